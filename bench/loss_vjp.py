"""The fused loss's hand-written gradient against the same chunks differentiated by jax.checkpoint.

    .venv/bin/python bench/loss_vjp.py --rounds 5 --steps 3

t2t's fused loss (t2t/loss.py, loss_impl='fused') computes each chunk's gradient in the forward
pass (a custom_vjp), so that the backward pass neither keeps nor recomputes logits. The textbook
alternative writes only the forward, chunk by chunk in a lax.scan, and wraps each chunk in
jax.checkpoint: JAX's autodiff then recomputes the chunk's logits in the backward pass (one more
[B, C, D] x [D, V] matmul per chunk) and accumulates dW in the scan's carry. This times t2t's
real train step with each (the CPU comparison shape of bench/cpu_vs_flax.py: d_model 256, 4
heads, d_ff 1024, 3+3 layers, vocab 8000, float32, 64 x 64 tokens with padding), alternating
--steps calls of each per round, every call synced; reported: wall and process-CPU medians and
their ratios (checkpoint / hand), and the median of the per-round wall ratios.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from types import SimpleNamespace

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from train_speed import MODELS, build_train_step  # noqa: E402

from t2t import loss  # noqa: E402


def checkpointed_sums(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC, dw_dtype=None):
    """loss._chunked_sums written as the forward only: each chunk's plain loss under
    jax.checkpoint in a lax.scan, its gradient left to autodiff. The weights are cast to the
    compute dtype before the loop, so autodiff sums dW over the chunks in that dtype; dw_dtype
    float32: cast inside each chunk, dW summed in float32 (as the hand VJP does)."""
    w_c = loss._whole_weights(w, dw_dtype or y_NBCD.dtype)

    @jax.checkpoint
    def chunk_sums(y_BCD, targets_BC, weights_BC):
        logits_BCV = loss._chunk_logits(y_BCD, w_c.astype(y_BCD.dtype))
        smoothed_BC, nll_BC = loss.label_smoothed_cross_entropy(logits_BCV, targets_BC,
                                                                smoothing, z_loss)
        vocab = logits_BCV.shape[-1]  # the accuracy as the hand path counts it (no gradient)
        max_BC = jnp.max(logits_BCV, axis=-1)
        first_max_BC = jnp.min(jnp.where(logits_BCV == max_BC[..., None],
                                         jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
        correct_BC = (first_max_BC == targets_BC).astype(jnp.float32)
        return jnp.stack([(smoothed_BC * weights_BC).sum(),
                          jax.lax.stop_gradient((nll_BC * weights_BC).sum()),
                          jax.lax.stop_gradient((correct_BC * weights_BC).sum())])

    def body(sums, chunk):
        return sums + chunk_sums(*chunk), None

    sums, _ = jax.lax.scan(body, jnp.zeros(3, jnp.float32), (y_NBCD, targets_NBC, weights_NBC))
    return sums[0], sums[1], sums[2]


def checkpointed_f32_sums(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC):
    return checkpointed_sums(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC,
                             dw_dtype=jnp.float32)


def _derived_chunk(smoothing, z_loss, logits_BCV, targets_BC, weights_BC):
    """(sums, d loss_sum / d logits) of one chunk: the plain loss and its autodiff gradient."""
    def loss_sum(logits_BCV):
        smoothed_BC, nll_BC = loss.label_smoothed_cross_entropy(logits_BCV, targets_BC,
                                                                smoothing, z_loss)
        return (smoothed_BC * weights_BC).sum(), nll_BC

    (loss_s, nll_BC), dlogits_BCV = jax.value_and_grad(loss_sum, has_aux=True)(logits_BCV)
    vocab = logits_BCV.shape[-1]
    max_BC = jnp.max(logits_BCV, axis=-1)
    first_max_BC = jnp.min(jnp.where(logits_BCV == max_BC[..., None],
                                     jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    correct_BC = (first_max_BC == targets_BC).astype(jnp.float32)
    sums = jnp.stack([loss_s, (nll_BC * weights_BC).sum(), (correct_BC * weights_BC).sum()])
    return sums, dlogits_BCV


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def derived_sums(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC):
    """loss._chunked_sums with each chunk's dlogits from autodiff of the plain loss instead of
    the hand-written formula (the rest of the custom_vjp as it is)."""
    return _derived_fwd(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC)[0]


def _derived_fwd(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC):
    w_c = loss._whole_weights(w, y_NBCD.dtype)
    s = w.shape[0] if w.ndim == 3 else loss.sharding.batch_shards(y_NBCD.shape[1])
    nn = loss.nn

    def body(carry, chunk):
        sums, dw_SVD = carry
        y_BCD, targets_BC, weights_BC = chunk
        chunk_sums, dlogits_BCV = _derived_chunk(smoothing, z_loss, loss._chunk_logits(y_BCD, w_c),
                                                 targets_BC, weights_BC)
        dlogits_BCV = nn.with_logical_constraint(dlogits_BCV.astype(y_BCD.dtype),
                                                 ('batch', 'length', 'vocab'))
        dy_BCD = loss._times_weights(dlogits_BCV, w_c, 'embed').astype(y_BCD.dtype)
        dw_SVD = dw_SVD + jnp.einsum('sbcv,sbcd->svd', loss._per_shard(dlogits_BCV, s, 'vocab'),
                                     loss._per_shard(y_BCD, s, 'embed'),
                                     preferred_element_type=jnp.float32)
        dw_SVD = nn.with_logical_constraint(dw_SVD, ('batch', 'vocab', 'embed'))
        return (sums + chunk_sums, dw_SVD), dy_BCD

    dw_SVD = nn.with_logical_constraint(jnp.zeros((s, *w.shape[-2:]), jnp.float32),
                                        ('batch', 'vocab', 'embed'))
    init = (jnp.zeros(3, jnp.float32), dw_SVD)
    (sums, dw_SVD), dy_NBCD = jax.lax.scan(body, init, (y_NBCD, targets_NBC, weights_NBC))
    dw = dw_SVD if w.ndim == 3 else (dw_SVD[0] if s == 1 else dw_SVD.sum(axis=0))
    return (sums[0], sums[1], sums[2]), (dy_NBCD, dw)


derived_sums.defvjp(_derived_fwd, loss._chunked_sums_bwd)


def build(name, impl, args):
    """(compiled step, state, batch) with the fused loss's chunks as `impl` computes them."""
    levers = SimpleNamespace(batch=64, len=64, vocab=args.vocab, dtype='float32', pad=True,
                             remat='none', scan_layers=False, loss_impl='fused',
                             loss_chunk_len=args.loss_chunk_len, rng_impl='threefry')
    hand = loss._chunked_sums
    loss._chunked_sums = impl
    try:
        step, state, batch = build_train_step(MODELS['CPU'], 'xla', levers)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        costs = compiled.cost_analysis()
        costs = costs[0] if isinstance(costs, (list, tuple)) else costs
        print(f'{name}: compiled in {time.perf_counter() - t0:.1f} s; XLA:CPU cost analysis '
              f'{costs.get("flops", float("nan")):.4g} FLOPs, '
              f'{costs.get("bytes accessed", float("nan")):.4g} bytes accessed', flush=True)
    finally:
        loss._chunked_sums = hand
    return compiled, state, batch


def tpu_estimates(impls, args):
    """XLA's estimate and the roofline bound of the train step with each impl, compiled for a TPU
    slice on this CPU (t2t/aot/tpu.py): the CPU shape in bfloat16, data-parallel over the slice."""
    import configs.tiny
    from t2t.aot import tpu as aot

    config = configs.tiny.get_config()
    config.d_model, config.num_heads, config.d_ff = MODELS['CPU'][:3]
    config.num_encoder_layers = config.num_decoder_layers = MODELS['CPU'][3]
    config.vocab_size, config.max_len, config.batch_size = args.vocab, 64, args.tpu_rows
    config.dtype, config.loss_impl, config.loss_chunk_len = 'bfloat16', 'fused', 32
    plan = aot.plan(config, args.tpu)
    hand = loss._chunked_sums
    for name, impl in impls.items():
        loss._chunked_sums = impl
        try:
            c = aot.compile_train_step(config, plan.mesh)
        finally:
            loss._chunked_sums = hand
        est = c.estimate
        r = c.roofline
        print(f'{name} on {args.tpu} ({args.tpu_rows} x 64 tokens): compiled in '
              f'{c.seconds:.0f} s; XLA estimate '
              f'{"none" if est is None else f"{est.seconds * 1e3:.3f} ms"} (optimal_seconds '
              f'{c.xla_optimal_seconds:.4g}); roofline compute / HBM / collectives '
              f'{r.compute_s * 1e3:.3f} / {r.memory_s * 1e3:.3f} / {r.collective_s * 1e3:.3f} ms; '
              f'temporaries {c.memory.temporaries / 2**20:.1f} MiB; matmul FLOPs a device '
              f'{c.matmul_flops_per_device:.4g}', flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=3)
    ap.add_argument('--vocab', type=int, default=8000)
    ap.add_argument('--loss_chunk_len', type=int, default=32)
    ap.add_argument('--impls', default='hand,checkpoint,derived')
    ap.add_argument('--tpu', default='', help='a TPU slice (v5e-4): XLA\'s estimates instead '
                    '(libtpu; LIBTPU_INIT_ARGS=--xla_tpu_sliced_prefetch_max_slices=0 for a time)')
    ap.add_argument('--tpu_rows', type=int, default=64)
    args = ap.parse_args()
    print(f'jax {jax.__version__}, load average {os.getloadavg()}', flush=True)
    impls = {'hand': loss._chunked_sums, 'checkpoint': checkpointed_sums,
             'checkpoint_f32': checkpointed_f32_sums, 'derived': derived_sums}
    impls = {k: impls[k] for k in args.impls.split(',')}
    if args.tpu:
        tpu_estimates(impls, args)
        return 0
    built = {name: build(name, impl, args) for name, impl in impls.items()}
    box = {name: b[1] for name, b in built.items()}
    wall = {name: [] for name in impls}
    cpu = {name: [] for name in impls}
    per_round = {name: [] for name in impls}

    def run(name):
        compiled, _, batch = built[name]
        box[name], m = compiled(box[name], batch)
        jax.block_until_ready((box[name], m))
        return float(m['loss_sum'])

    first = {name: run(name) for name in impls}  # warm; the same first step's loss
    print('first loss sums:', {k: f'{v:.7g}' for k, v in first.items()}, flush=True)
    for r in range(args.rounds):
        medians = {}
        for name in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
            walls = []
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                run(name)
                walls.append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            wall[name] += walls
            medians[name] = statistics.median(walls)
        for name in impls:
            per_round[name].append(medians[name] / medians['hand'])
        print(f'round {r}: median wall s {medians}', flush=True)
    hand_wall, hand_cpu = statistics.median(wall['hand']), statistics.median(cpu['hand'])
    for name in impls:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f'{name}: train step median of {len(wall[name])} calls {w * 1e3:.0f} ms wall, '
              f'{c:.3f} s CPU; / hand: wall {w / hand_wall:.3f}, CPU {c / hand_cpu:.3f}, '
              f'per-round wall {[round(x, 3) for x in per_round[name]]} '
              f'(median {statistics.median(per_round[name]):.3f})')
    print(f'load average {os.getloadavg()}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
