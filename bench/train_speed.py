"""Training-step speed of t2t's real train step, in the shape the peer benchmarks use.

    python bench/train_speed.py --model both --attention dot_product,xla     # GPU
    python bench/train_speed.py --model cpu --attention xla                  # the CPU shape
    python bench/train_speed.py --tiny                                       # CPU smoke test

Shape (as bench/peers_gpu.py): 128 sentence pairs x 256 tokens each side, random ids in
[3, vocab) (no padding), vocab 32768, label smoothing 0.1, Adam(0.9, 0.98, 1e-9) with the paper's
schedule, bf16 compute (float32 parameters), dropout 0.1. BASE 512/2048/8 heads/6+6, BIG
1024/4096/16 heads/6+6. The step is t2t.train_lib.jit_train_step, unchanged: it also computes the
NLL and accuracy sums and the gradient norm, which the peers' steps do not.

Reports per model and attention implementation: compile s (lower + compile), step ms (median over
--steps timed steps after --warmup_steps, each synced with block_until_ready), target tokens/s,
model TFLOP/s and MFU, with FLOPs counted by t2t/infra/flops.py (the peers' formula) against
t2t.infra.metrics.peak_flops_per_device() (989 TFLOP/s on H100/H200; none on CPU -> MFU null). With
MEAS_TFLOPS set (the measured matmul peak), also MFU against it. One `RESULT {json}` line per
measurement, also appended to $OUT/t2t_results.jsonl when OUT is set.

--model cpu is the CPU comparison shape (bench/cpu_vs_flax.py): d_model 256, 4 heads, d_ff 1024,
3+3 layers, vocab 8000, 64 pairs x 64 tokens with padding (each side's length uniform in
[32, 64], `make_batch`), float32. The levers --remat, --scan_layers, --loss_impl (default fused,
as the recorded numbers ran), --loss_chunk_len and --rng_impl set the config keys of the same
names (configs/common.py).

Needs jax, flax, optax and numpy only (no ml_collections, grain or TFDS): it builds the configs
directly, so it runs on a bare GPU machine from the repository root.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from t2t import optim, sharding, train_lib  # noqa: E402
from t2t.infra import flops, metrics  # noqa: E402
from t2t.model import TransformerConfig  # noqa: E402

# name -> (d_model, heads, d_ff, layers in each of encoder and decoder): the peers' shapes.
MODELS = {'BASE': (512, 8, 2048, 6), 'BIG': (1024, 16, 4096, 6), 'CPU': (256, 4, 1024, 3)}
TINY_MODELS = {'BASE': (64, 4, 256, 2), 'BIG': (128, 8, 512, 2)}
FULL = dict(batch=128, len=256, vocab=32768, warmup_steps=3, steps=20)
TINY = dict(batch=4, len=16, vocab=512, warmup_steps=1, steps=3)  # peers_gpu.py --tiny sizes
CPU = dict(batch=64, len=64, vocab=8000, warmup_steps=2, steps=10, dtype='float32', pad=True)


def make_batch(rows: int, length: int, vocab: int, padded: bool, seed: int = 0) -> dict:
    """Random ids in [3, vocab) [rows, length] per side; padded: each row's length (per side)
    uniform in [length / 2, length], then PAD (0)."""
    rng = np.random.default_rng(seed)
    batch = {}
    for k in ('inputs', 'targets'):
        ids = rng.integers(3, vocab, (rows, length), dtype=np.int32)
        if padded:
            lengths = rng.integers(length // 2, length + 1, rows)
            ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
        batch[k] = ids
    return batch


def emit(section: str, name: str, **fields) -> dict:
    """benchlib.emit, the line appended to $OUT/t2t_results.jsonl when OUT is set."""
    out = os.environ.get('OUT')
    return benchlib.emit(section, name, files=(out and os.path.join(out, 't2t_results.jsonl'),),
                         **fields)


def versions() -> str:
    import flax
    import optax
    return f'jax {jax.__version__} flax {flax.__version__} optax {optax.__version__}'


def device_fields() -> dict:
    dev = jax.devices()[0]
    return dict(backend=jax.default_backend(), device=dev.device_kind,
                num_devices=jax.device_count())


def model_config(shape, vocab: int, dtype: str, attention: str, **kw) -> TransformerConfig:
    d, h, ff, layers = shape
    return TransformerConfig(
        vocab_size=vocab, d_model=d, d_ff=ff, num_heads=h, num_encoder_layers=layers,
        num_decoder_layers=layers, dropout_rate=0.1, attention_dropout_rate=0.0,
        dtype={'bfloat16': jnp.bfloat16, 'float32': jnp.float32}[dtype],
        attention_impl=attention, **kw)


def levers(args) -> dict:
    """The speed/memory config keys of this run (model and step config fields)."""
    return dict(remat=args.remat, scan_layers=args.scan_layers, loss_impl=args.loss_impl,
                loss_chunk_len=args.loss_chunk_len, rng_impl=args.rng_impl)


def build_train_step(shape, attention: str, args):
    """(compiled-to-be step, state, batch) of t2t's real train step for one shape."""
    d = shape[0]
    B, S, V = args.batch, args.len, args.vocab
    mc = model_config(shape, V, args.dtype, attention, remat=args.remat,
                      scan_layers=args.scan_layers)
    step_config = train_lib.StepConfig(model=mc, label_smoothing=0.1, loss_impl=args.loss_impl,
                                       loss_chunk_len=args.loss_chunk_len, rng_impl=args.rng_impl)
    tx = optim.make_optimizer(optim.OptimConfig(d_model=d))  # the paper's Adam and schedule
    mesh = sharding.make_mesh((-1, 1, 1))
    init = functools.partial(train_lib.init_state, model_config=mc, tx=tx, batch_shape=(1, S),
                             rng_impl=args.rng_impl)
    state, state_shardings = sharding.init_sharded(init, mesh, jax.random.PRNGKey(0))
    batch = {k: jax.device_put(v, sharding.batch_sharding(mesh))
             for k, v in make_batch(B, S, V, args.pad).items()}
    step = train_lib.jit_train_step(step_config, tx, state_shardings, mesh)
    return step, state, batch


def bench_train(name: str, shape, attention: str, args) -> dict:
    gc.collect()
    d, h, ff, layers = shape
    B, S, V = args.batch, args.len, args.vocab
    step, state, batch = build_train_step(shape, attention, args)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    # Lower + compile apart from running, so that compile time is measured by itself.
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    extra = {}
    try:  # XLA's own count, a cross-check of the analytic FLOPs (absent on some backends)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        if cost and cost.get('flops'):
            extra['xla_tflop_per_step'] = float(cost['flops']) / 1e12
    except Exception:  # optional diagnostics only
        pass
    try:
        mem = compiled.memory_analysis()
        extra['temp_gib'] = mem.temp_size_in_bytes / 2**30
    except Exception:
        pass

    box = {'state': state}
    del state

    def run():
        box['state'], box['metrics'] = compiled(box['state'], batch)
        jax.block_until_ready((box['state'], box['metrics']))

    for _ in range(args.warmup_steps):
        run()
    ts = benchlib.time_calls(run, args.steps)
    sums = jax.device_get(box['metrics'])
    loss = float(sums['loss_sum']) / max(float(sums['tokens']), 1.0)

    med = statistics.median(ts)
    total, attn = flops.train_flops_per_step(B, S, S, d, ff, layers, layers, V)
    peak = metrics.peak_flops_per_device()
    r = dict(framework='t2t', version=versions(), model=name, attention=attention,
             dtype=args.dtype, **levers(args), padded=args.pad, **device_fields(),
             compile_s=compile_s, n_params=n_params,
             loss=loss, batch=B, seq=S, vocab=V, n_steps=len(ts), step_ms=med * 1e3,
             step_ms_mean=statistics.fmean(ts) * 1e3, step_ms_min=min(ts) * 1e3,
             tgt_tok_s=B * S / med, src_tgt_tok_s=2 * B * S / med,
             model_tflop_per_step=total / 1e12, attn_flop_share=attn / total,
             achieved_tflops=total / med / 1e12,
             peak_tflops=peak / 1e12 if peak else None,
             mfu=metrics.mfu(total, med, jax.device_count(), peak), **extra)
    if os.environ.get('MEAS_TFLOPS'):
        r['mfu_measured_peak'] = total / med / (float(os.environ['MEAS_TFLOPS']) * 1e12)
    return r


def parse_with_defaults(ap: argparse.ArgumentParser, argv, tiny: dict, full: dict,
                        cpu: dict | None = None):
    """Parses argv; options left unset take the --tiny, the CPU-shape or the full-size default."""
    args = ap.parse_args(argv)
    preset = tiny if args.tiny else cpu if cpu and getattr(args, 'model', '') == 'cpu' else full
    for key, value in {'dtype': 'bfloat16', 'pad': False, **preset}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def add_lever_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument('--remat', default='none', choices=('none', 'dots_saveable', 'full'))
    ap.add_argument('--scan_layers', action='store_true')
    ap.add_argument('--loss_impl', default='fused', choices=('plain', 'fused'))
    ap.add_argument('--loss_chunk_len', type=int, default=32)
    ap.add_argument('--rng_impl', default='threefry', choices=('threefry', 'rbg', 'unsafe_rbg'))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='both', choices=('base', 'big', 'both', 'cpu'),
                    help='cpu: the CPU comparison shape (float32, padded, vocab 8000)')
    ap.add_argument('--attention', default='dot_product',
                    help="comma list of 'xla', 'dot_product', 'cudnn' (GPU only)")
    ap.add_argument('--batch', type=int, help='sentence pairs per step (default 128; tiny 4)')
    ap.add_argument('--len', type=int, help='tokens per side (default 256; tiny 16)')
    ap.add_argument('--vocab', type=int, help='vocabulary (default 32768; tiny 512)')
    ap.add_argument('--dtype', choices=('bfloat16', 'float32'),
                    help='compute dtype (default bfloat16; cpu float32)')
    ap.add_argument('--pad', action=argparse.BooleanOptionalAction,
                    help='padded rows (default: only for --model cpu)')
    ap.add_argument('--steps', type=int, help='timed steps (default 20; tiny 3)')
    ap.add_argument('--warmup_steps', type=int, help='untimed steps after compiling (default 3)')
    ap.add_argument('--tiny', action='store_true', help='toy sizes for a CPU smoke test')
    add_lever_args(ap)
    return parse_with_defaults(ap, argv, TINY, FULL, CPU)


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = TINY_MODELS if args.tiny else MODELS
    names = ['BASE', 'BIG'] if args.model == 'both' else [args.model.upper()]
    if args.tiny and args.model == 'cpu':
        raise SystemExit('--tiny has no cpu shape: use --model base or big with --tiny')
    impls = [a.strip() for a in args.attention.split(',') if a.strip()]
    print(f'# t2t train_speed: {versions()}, {device_fields()}, batch {args.batch} x {args.len}, '
          f'vocab {args.vocab}, {args.dtype}, padded={args.pad}, {levers(args)}, '
          f'tiny={args.tiny}', flush=True)
    failed = 0
    # Model-major order: each model's first implementation is the headline, run before the rest.
    for name in names:
        for impl in impls:
            label = f'train_{name}_{impl}'
            t0 = time.time()
            try:
                res = bench_train(name, shapes[name], impl, args)
                emit('t2t', label, status='ok', wall_s=time.time() - t0, **res)
            except Exception as e:  # one failure (e.g. out of memory) must not lose the others
                traceback.print_exc()
                failed += 1
                emit('t2t', label, status='error', error=f'{type(e).__name__}: {e}'[:400],
                     wall_s=time.time() - t0)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
