"""t2t against flax examples/wmt on this CPU: train step, beam search and compile time, alternating.

    .venv/bin/python bench/cpu_vs_flax.py                      # all three comparisons
    .venv/bin/python bench/cpu_vs_flax.py --what train --rounds 7

The peer is google/flax examples/wmt (models.py, decode.py) kept verbatim in .peer/flax_wmt/, its
train step and beam search as bench/benchlib.py writes them for every benchmark (bench/peers_gpu.py
too): train.py's train_step (jit instead of pmap, label smoothing 0.1, Adam(0.9, 0.98, 1e-9),
dropout and attention dropout 0.1 as in its config) and predict_step (EOS disabled).

Same dims and batch for both (the CPU comparison shape): d_model 256, 4 heads, d_ff 1024, 3+3
layers, vocab 8000, float32, 64 sentence pairs x 64 tokens with padding (train_speed.make_batch,
the same arrays for both); beam 4 on 64 x 16 source tokens, 32 new tokens, no EOS. t2t runs its
real train step (train_lib.jit_train_step: also the NLL/accuracy sums and the gradient norm) and
t2t.eval.predict.make_predict_fn, with the levers given on the command line.

Timing: both functions are compiled first; then --rounds rounds, each timing --steps calls of t2t
and then --steps of the peer (the order flips every round), every call synced. Reported: the
median over all timed calls of each, the ratio t2t / peer of those medians, and the median of the
per-round ratios (robust to load that changes between rounds). Compile: the BASE dims
(512/2048/8 heads/6+6) train step, lower + compile, t2t with --compile_scan (default: scanned
layers) against the peer, alternating --compile_reps times. The machine's load average is printed
before and after: other processes slow both sides alike only on average, so rerun on a quiet
machine for the record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # a CPU comparison (and no TPU probing)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from benchlib import (  # noqa: E402
    emit,
    flax_peer_config,
    flax_peer_params,
    flax_peer_predict,
    flax_peer_state,
    flax_peer_train_step,
    load_flax_peer,
    time_calls,
)
from decode_speed import NO_EOS, build_predict, decode_src  # noqa: E402
from train_speed import MODELS, build_train_step, make_batch, versions  # noqa: E402

SHAPE = MODELS['CPU']


def peer_train_step(models, shape, vocab, batch):
    """(jitted step, state, key): flax examples/wmt's train.train_step (bench/benchlib.py)."""
    config = flax_peer_config(models, shape, vocab, 'float32', deterministic=False, decode=False)
    length = batch['inputs'].shape[1]
    state = flax_peer_state(models, config, flax_peer_params(models, config, length, length))
    return (jax.jit(flax_peer_train_step(models, config), donate_argnums=(0,)), state,
            jax.random.key(1))


def peer_predict(models, decode, args):
    """(jitted predict(inputs, params, cache), params, inputs, init_cache): train.predict_step."""
    config = flax_peer_config(models, SHAPE, args.vocab, 'float32', deterministic=True,
                              decode=True)
    max_decode_len = args.new_tokens + 1  # slot 0 holds the start token
    inputs = jnp.asarray(decode_src(args.batch, args.src_len, args.vocab), jnp.int32)
    params = flax_peer_params(models, config, inputs.shape[1], max_decode_len)
    predict, initialize_cache = flax_peer_predict(models, decode, config, args.beams,
                                                  max_decode_len, NO_EOS)
    return jax.jit(predict), params, inputs, jax.jit(initialize_cache)


def alternate(runs: dict, rounds: int, steps: int) -> dict:
    """Times the callables in `runs` alternately; {name: [seconds]} and per-round medians."""
    names = list(runs)
    times = {n: [] for n in names}
    per_round = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            ts = time_calls(runs[n], steps, cpu=True)
            times[n] += ts
            per_round[n].append(statistics.median(t for t, _ in ts))
    return times, per_round


def report(kind: str, times, per_round, extra: dict) -> dict:
    """Wall-time medians and ratios; also process CPU time (all threads), which other
    processes' load disturbs less than wall time."""
    wall = {k: [t for t, _ in v] for k, v in times.items()}
    cpu = {k: [c for _, c in v] for k, v in times.items()}
    t2t, peer = statistics.median(wall['t2t']), statistics.median(wall['peer'])
    cpu_t2t, cpu_peer = statistics.median(cpu['t2t']), statistics.median(cpu['peer'])
    round_ratios = [a / b for a, b in zip(per_round['t2t'], per_round['peer'], strict=True)]
    rec = dict(kind=kind, t2t_ms=round(t2t * 1e3, 2), peer_ms=round(peer * 1e3, 2),
               ratio=round(t2t / peer, 3), ratio_round_median=round(statistics.median(
                   round_ratios), 3), round_ratios=[round(r, 3) for r in round_ratios],
               t2t_cpu_s=round(cpu_t2t, 3), peer_cpu_s=round(cpu_peer, 3),
               cpu_time_ratio=round(cpu_t2t / cpu_peer, 3),
               n_each=len(times['t2t']), loadavg=[round(x, 2) for x in os.getloadavg()],
               **extra)
    return emit('cpu_vs_flax', kind, **rec)


def compare_train(models, args):
    levers = SimpleNamespace(batch=64, len=64, vocab=args.vocab, dtype='float32', pad=True,
                             remat=args.remat, scan_layers=args.scan_layers,
                             loss_impl=args.loss_impl, loss_chunk_len=args.loss_chunk_len,
                             rng_impl=args.rng_impl)
    step, state, batch = build_train_step(SHAPE, args.attention, levers)
    compiled = step.lower(state, batch).compile()
    host_batch = make_batch(64, 64, args.vocab, True)
    peer_step, peer_state, key = peer_train_step(models, SHAPE, args.vocab, host_batch)
    peer_batch = {k: jnp.asarray(v) for k, v in host_batch.items()}
    peer_compiled = peer_step.lower(peer_state, peer_batch, key).compile()
    box = {'t2t': state, 'peer': peer_state}

    def run_t2t():
        box['t2t'], m = compiled(box['t2t'], batch)
        jax.block_until_ready((box['t2t'], m))

    def run_peer():
        box['peer'], loss = peer_compiled(box['peer'], peer_batch, key)
        jax.block_until_ready((box['peer'], loss))

    for _ in range(2):
        run_t2t()
        run_peer()
    times, per_round = alternate({'t2t': run_t2t, 'peer': run_peer}, args.rounds, args.steps)
    return report('train_step', times, per_round, dict(
        attention=args.attention, remat=args.remat, scan_layers=args.scan_layers,
        loss_impl=args.loss_impl, loss_chunk_len=args.loss_chunk_len, rng_impl=args.rng_impl))


def compare_beam(models, decode, args):
    dec_args = SimpleNamespace(batch=args.batch, src_len=args.src_len,
                               new_tokens=args.new_tokens, vocab=args.vocab, dtype='float32',
                               beams=args.beams)
    predict, params, inputs_BS = build_predict(args.attention, SHAPE, dec_args, args.scan_layers)
    compiled = predict.lower(params, inputs_BS).compile()
    peer, peer_params, peer_inputs, init_cache = peer_predict(models, decode, dec_args)
    peer_compiled = peer.lower(peer_inputs, peer_params, init_cache(peer_inputs)).compile()
    out = {}

    def run_t2t():
        out['t2t'] = jax.block_until_ready(compiled(params, inputs_BS))

    def run_peer():  # per batch as in the example: a fresh cache, then the beam search
        out['peer'] = jax.block_until_ready(peer_compiled(peer_inputs, peer_params,
                                                          init_cache(peer_inputs)))

    run_t2t()
    run_peer()
    if out['t2t'].ids_BL.shape[1] != args.new_tokens or \
            out['peer'].shape[1] != args.new_tokens:
        raise RuntimeError(f'decode lengths differ: t2t {out["t2t"].ids_BL.shape}, '
                           f'peer {out["peer"].shape}')
    times, per_round = alternate({'t2t': run_t2t, 'peer': run_peer}, args.rounds,
                                 max(2, args.steps // 2))
    return report('beam_search', times, per_round, dict(
        attention=args.attention, scan_layers=args.scan_layers, beams=args.beams,
        batch=args.batch, src_len=args.src_len, new_tokens=args.new_tokens))


def compare_compile(models, args):
    """Lower + compile of the BASE-dims train step (vocab and batch of the CPU shape)."""
    base = MODELS['BASE']
    levers = SimpleNamespace(batch=64, len=64, vocab=args.vocab, dtype='float32', pad=True,
                             remat=args.remat, scan_layers=args.compile_scan,
                             loss_impl=args.loss_impl, loss_chunk_len=args.loss_chunk_len,
                             rng_impl=args.rng_impl)
    host_batch = make_batch(64, 64, args.vocab, True)

    def t2t_compile():
        jax.clear_caches()
        step, state, batch = build_train_step(base, args.attention, levers)
        t0 = time.perf_counter()
        step.lower(state, batch).compile()
        return time.perf_counter() - t0

    def peer_compile():
        jax.clear_caches()
        step, state, key = peer_train_step(models, base, args.vocab, host_batch)
        batch = {k: jnp.asarray(v) for k, v in host_batch.items()}
        t0 = time.perf_counter()
        step.lower(state, batch, key).compile()
        return time.perf_counter() - t0

    times = {'t2t': [], 'peer': []}
    for r in range(args.compile_reps):
        for name in (('t2t', 'peer') if r % 2 == 0 else ('peer', 't2t')):
            c0 = time.process_time()
            wall = t2t_compile() if name == 't2t' else peer_compile()
            times[name].append((wall, time.process_time() - c0))
    per_round = {k: [t for t, _ in v] for k, v in times.items()}
    return report('base_train_compile_s', times, per_round, dict(
        scan_layers=args.compile_scan, remat=args.remat, note='values in ms are seconds x 1000'))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--what', default='train,beam,compile')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=6, help='timed calls per side and round')
    ap.add_argument('--compile_reps', type=int, default=2)
    ap.add_argument('--vocab', type=int, default=8000)
    ap.add_argument('--batch', type=int, default=64, help='beam search: sentences')
    ap.add_argument('--src_len', type=int, default=16)
    ap.add_argument('--new_tokens', type=int, default=32)
    ap.add_argument('--beams', type=int, default=4)
    ap.add_argument('--attention', default='xla')
    ap.add_argument('--remat', default='none')
    ap.add_argument('--scan_layers', action='store_true', help='t2t train/beam with scan')
    ap.add_argument('--compile_scan', action=argparse.BooleanOptionalAction, default=True,
                    help='t2t compile comparison with scanned layers (default on)')
    ap.add_argument('--loss_impl', default='fused', choices=('plain', 'fused'))
    ap.add_argument('--loss_chunk_len', type=int, default=32)
    ap.add_argument('--rng_impl', default='threefry')
    args = ap.parse_args(argv)
    models, decode = load_flax_peer()
    print(f'# cpu_vs_flax: {versions()}, {jax.devices()}, loadavg {os.getloadavg()}',
          flush=True)
    what = args.what.split(',')
    if 'train' in what:
        compare_train(models, args)
    if 'beam' in what:
        compare_beam(models, decode, args)
    if 'compile' in what:
        compare_compile(models, args)
    print(f'# done, loadavg {os.getloadavg()}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
