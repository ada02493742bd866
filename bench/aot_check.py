"""The GPU dry run's estimates against the card: one config, compiled deviceless and run.

    python bench/aot_check.py                 # on a GPU machine (bench/run_gpu.sh runs it)
    python bench/aot_check.py --tiny          # CPU smoke test: the same path at tiny sizes

1. In a child process on the CPU backend (as on a laptop: t2t/aot/, the gpu-aot extra), the
   train step is compiled for one GPU of this machine's kind from XLA's target description
   (t2t/aot/gpu_specs/), and the dry run's numbers are taken: memory_analysis per device, the
   verdict, the roofline estimate of the step time, the tokens/s and MFU it implies, the
   attention kernel compiled.
2. In this process, on the GPU: the same step (train_lib.jit_train_step on a sharded state) is
   compiled for the card, with autotuning, and its memory_analysis read; then run on random
   batches: the median step time, tokens/s and MFU (t2t/infra/flops.py's FLOPs over the datasheet
   peak, as the estimate's).
One RESULT line per part (`deviceless`, `device`) and one comparing them (`aot_check`: device /
deviceless ratios), appended to $OUT/t2t_results.jsonl when OUT is set.

--tiny: configs/tiny.py; both parts on the CPU (the deviceless part still compiles for an H100;
the 'device' part is the CPU's own compile and run, so the ratios mean nothing: a path check).
Default: configs/wmt14_ende_base.py, 64 rows x 256 tokens, bf16 (attention as the config says;
--set attention_impl=cudnn for cuDNN's kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))


def load_config(args):
    import importlib

    config = importlib.import_module(f'configs.{args.config}').get_config()
    with config.unlocked():
        config.batch_size, config.max_len = args.rows, args.len
        config.dtype = args.dtype
        config.mesh_shape = (1, 1, 1)
        for k, v in (s.split('=', 1) for s in args.set):
            setattr(config, k, type(getattr(config, k))(v))
    return config


def deviceless(args) -> dict:
    """Part 1, run in a child on the CPU backend: the dry run's numbers for one GPU."""
    from t2t.aot import tpu as aot
    from t2t.infra import flops

    config = load_config(args)
    plan = aot.plan(config, args.target)
    c = aot.compile_train_step(config, plan.mesh)
    m, r = c.memory, c.roofline
    ratio = aot.recompute_ratio(c, config, 1)
    model = flops.config_flops_per_step(config)
    forward, backward = c.attention_calls
    return dict(target=args.target, device=plan.device_kind, total_gib=m.total / 2**30,
                temp_gib=m.temporaries / 2**30, argument_gib=m.arguments / 2**30,
                verdict=aot.verdict(c, plan.target.hbm_bytes, ratio=ratio, remat=config.remat),
                recompute_ratio=ratio, step_ms=r.seconds * 1e3,
                tgt_tok_s=config.batch_size * config.max_len / r.seconds,
                mfu=r.mfu(model, 1), attention_kernel=f'cuDNN {forward:.0f}+{backward:.0f}'
                if forward + backward else 'XLA softmax', compile_s=c.seconds)


def on_device(args) -> dict:
    """Part 2, this process: the same step compiled for and run on jax.devices()[0]."""
    import jax
    import numpy as np

    from t2t import optim, sharding, train_lib
    from t2t.infra import flops, metrics

    config = load_config(args)
    mesh = sharding.make_mesh(config.mesh_shape, devices=jax.devices()[:1])
    tx = optim.make_optimizer(config)
    state, shardings = train_lib.create_sharded_state(config, mesh, tx)
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings,
                                    mesh)
    rng = np.random.default_rng(0)
    batch = {k: jax.device_put(rng.integers(3, config.vocab_size,
                                            (config.batch_size, config.max_len), np.int32),
                               sharding.batch_sharding(mesh))
             for k in train_lib.BATCH_KEYS}
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    times = []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        state, sums = compiled(state, batch)
        jax.block_until_ready((state, sums))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    peak = metrics.peak_flops_per_device()
    model = flops.config_flops_per_step(config)
    return dict(device=jax.devices()[0].device_kind, total_gib=total / 2**30,
                temp_gib=mem.temp_size_in_bytes / 2**30,
                argument_gib=mem.argument_size_in_bytes / 2**30, step_ms=step_s * 1e3,
                tgt_tok_s=config.batch_size * config.max_len / step_s,
                mfu=metrics.mfu(model, step_s, 1, peak), steps=len(times), compile_s=compile_s)


def local_target() -> str:
    """The dry run's name of this machine's GPU: '1xh100' for an H100 (the CPU: an H100)."""
    import jax

    from t2t.aot import targets
    from t2t.infra import metrics

    chip = metrics.chip(jax.devices()[0].device_kind) if jax.default_backend() == 'gpu' else None
    card = next((g.name for g in targets.GPUS.values() if chip and g.chip == chip.name), 'h100')
    return f'1x{card}'


def emit(name: str, **fields) -> dict:
    import benchlib

    out = os.environ.get('OUT')
    return benchlib.emit('t2t', name, files=(out and os.path.join(out, 't2t_results.jsonl'),),
                         **fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--tiny', action='store_true')
    ap.add_argument('--config', default=None)
    ap.add_argument('--rows', type=int, default=None)
    ap.add_argument('--len', type=int, default=None)
    ap.add_argument('--dtype', default='bfloat16')
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE')
    ap.add_argument('--warmup', type=int, default=2)
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--target', default='', help='deviceless target (default: this GPU, 1x)')
    ap.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tiny = dict(config='tiny', rows=16, len=32)
    full = dict(config='wmt14_ende_base', rows=64, len=256)
    for k, v in (tiny if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.child:
        print('RESULT ' + json.dumps(deviceless(args)), flush=True)
        return 0
    args.target = args.target or local_target()
    cmd = [sys.executable, os.path.abspath(__file__), '--child', f'--target={args.target}',
           f'--config={args.config}', f'--rows={args.rows}', f'--len={args.len}',
           f'--dtype={args.dtype}'] + [f'--set={s}' for s in args.set]
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT ')]
    shape = dict(config=args.config, rows=args.rows, len=args.len, dtype=args.dtype,
                 settings=' '.join(args.set))
    if proc.returncode or not lines:
        emit('aot_check', status='error', error=(proc.stderr.strip().splitlines()
                                                 or ['no output'])[-1][:400], **shape)
        return 1
    before = json.loads(lines[-1][len('RESULT '):])
    emit('aot_check_deviceless', status='ok', **shape, **before)
    after = on_device(args)
    emit('aot_check_device', status='ok', **shape, **after)
    ratios = {f'{k}_device_over_deviceless': after[k] / before[k]
              for k in ('total_gib', 'temp_gib', 'step_ms', 'tgt_tok_s', 'mfu')
              if before.get(k) and after.get(k) == after.get(k)}
    emit('aot_check', status='ok', **shape, deviceless_verdict=before['verdict'],
         attention_kernel=before['attention_kernel'], **ratios)
    return 0


if __name__ == '__main__':
    sys.exit(main())
