"""The cost of T^2: one attention layer, forward + backward, as the sequence length T grows.

    python bench/attention_scaling.py          # CPU: T = 128 .. 8192, xla and dot_product
    python bench/attention_scaling.py --heads=8 --d_model=512 --batch=4 --out=docs/x.png
                                               # GPU: also cudnn (fused flash attention), bf16

The layer is t2t's own MultiHeadAttention (q/k/v/o projections with biases, as when the
published numbers were measured; the padding mask the encoder builds, softmax in float32) as
self-attention over [batch, T, d_model]; the step is jax.value_and_grad of sum(output^2) with
respect to the parameters and the input, jitted. Per
implementation ('xla': t2t's einsum + softmax; 'dot_product': jax.nn.dot_product_attention, which
jax 0.10 lowers to the same XLA ops; 'cudnn': the same function forced to cuDNN's fused kernel,
GPU + bfloat16 only) and T it reports the median step time (--repeats synced runs after one
warm-up) and the compiled program's memory from XLA's memory_analysis: temporaries + arguments
(+ outputs), i.e. the peak the program needs, not the process's RSS.

The fitted exponent is the least-squares slope of log(time) against log(T) over T >= --fit_from:
2 where the T x T score matrix dominates, 1 where the projections (linear in T) do. Writes a
log-log PNG (time and memory against T, with slope-1 and slope-2 guides) and one `RESULT {json}`
line per measurement (appended to $OUT/t2t_results.jsonl when OUT is set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from train_speed import device_fields, emit, versions  # noqa: E402  (bench/ is on sys.path)

from t2t.attention import MultiHeadAttention, attention_mask  # noqa: E402
from t2t.model import TransformerConfig  # noqa: E402

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def make_step(impl: str, length: int, args):
    """(jitted step, params, x_BTD) for one implementation and sequence length."""
    config = TransformerConfig(vocab_size=8, d_model=args.d_model, d_ff=4 * args.d_model,
                               num_heads=args.heads, dropout_rate=0.0, attention_impl=impl,
                               dtype=DTYPES[args.dtype], max_position=length, deterministic=True,
                               attention_bias=True)
    layer = MultiHeadAttention(config.attention, 'self')
    x_BTD = jax.random.normal(jax.random.key(1), (args.batch, length, args.d_model), jnp.float32)

    def mask():  # the encoder's padding mask over a batch without padding
        valid_BT = jnp.ones((args.batch, length), bool)
        return attention_mask(valid_BT, valid_BT)

    params = nn.unbox(jax.jit(lambda x: layer.init(jax.random.key(0), x, x, mask()))(x_BTD))

    def loss(params, x_BTD):
        out_BTD = layer.apply(params, x_BTD, x_BTD, mask())
        return jnp.sum(jnp.square(out_BTD.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x_BTD


def measure(impl: str, length: int, args) -> dict:
    step, params, x_BTD = make_step(impl, length, args)
    start = time.perf_counter()
    compiled = step.lower(params, x_BTD).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
                + memory.output_size_in_bytes - memory.alias_size_in_bytes)
    jax.block_until_ready(compiled(params, x_BTD))  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x_BTD))
        times.append(time.perf_counter() - start)
    return dict(impl=impl, T=length, step_ms=1e3 * statistics.median(times),
                compile_s=compile_s, memory_bytes=peak,
                temp_bytes=None if memory is None else memory.temp_size_in_bytes)


def exponent(rows: list[dict], key: str, fit_from: int) -> float:
    """Least-squares slope of log(rows[key]) against log(T) over T >= fit_from."""
    points = [(r['T'], r[key]) for r in rows if r['T'] >= fit_from and r.get(key)]
    if len(points) < 2:
        return float('nan')
    t, y = np.log(np.array(points, np.float64)).T
    return float(np.polyfit(t, y, 1)[0])


def plot(rows: list[dict], fits: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_time, by_memory) = plt.subplots(1, 2, figsize=(12, 4.6))
    for impl in dict.fromkeys(r['impl'] for r in rows):
        mine = [r for r in rows if r['impl'] == impl]
        lengths = [r['T'] for r in mine]
        by_time.plot(lengths, [r['step_ms'] for r in mine], 'o-',
                     label=f'{impl} (fitted exponent {fits[impl]["time"]:.2f})')
        by_memory.plot(lengths, [r['memory_bytes'] / 2**20 for r in mine], 'o-',
                       label=f'{impl} (fitted exponent {fits[impl]["memory"]:.2f})')
    for ax, key, scale in ((by_time, 'step_ms', 1.0), (by_memory, 'memory_bytes', 2.0**-20)):
        top = max(r[key] * scale for r in rows if r[key])
        lengths = np.array(sorted({r['T'] for r in rows}), np.float64)
        for power, style in ((1, ':'), (2, '--')):  # guides through the largest measurement
            ax.plot(lengths, top * (lengths / lengths[-1]) ** power, 'k' + style, alpha=0.4,
                    label=f'~ T^{power}')
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel('sequence length T')
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=8)
    by_time.set_ylabel('forward + backward, ms (median)')
    by_memory.set_ylabel('compiled memory, MiB (temp + args + outputs)')
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--impls', default='', help='default: xla,dot_product (+cudnn on GPU)')
    parser.add_argument('--min_len', type=int, default=128)
    parser.add_argument('--max_len', type=int, default=8192)
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--d_model', type=int, default=256)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--dtype', default='', help='default: bfloat16 on GPU, float32 elsewhere')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--fit_from', type=int, default=1024, help='fit over T >= this')
    parser.add_argument('--out', default='docs/attention_scaling.png')
    args = parser.parse_args()
    gpu = jax.default_backend() == 'gpu'
    args.dtype = args.dtype or ('bfloat16' if gpu else 'float32')
    impls = args.impls.split(',') if args.impls else ['xla', 'dot_product'] + (['cudnn'] * gpu)
    lengths = [t for t in (2 ** k for k in range(4, 20)) if args.min_len <= t <= args.max_len]

    print(f'{versions()}; {device_fields()}; batch {args.batch}, d_model {args.d_model}, '
          f'{args.heads} heads, {args.dtype}', flush=True)
    rows = []
    for impl in impls:
        for length in lengths:
            try:
                row = measure(impl, length, args)
            except Exception as e:  # e.g. out of memory at the largest T: report, go on
                print(f'{impl} T={length}: {type(e).__name__}: {str(e).splitlines()[0][:200]}',
                      flush=True)
                break
            rows.append(row)
            emit('attention_scaling', impl, batch=args.batch, d_model=args.d_model,
                 heads=args.heads, dtype=args.dtype, **device_fields(), **row)
    fits = {impl: {'time': exponent([r for r in rows if r['impl'] == impl], 'step_ms',
                                    args.fit_from),
                   'memory': exponent([r for r in rows if r['impl'] == impl], 'memory_bytes',
                                      args.fit_from)} for impl in impls}
    print('\n| T | ' + ' | '.join(f'{i} ms | {i} MiB' for i in impls) + ' |')
    print('|---|' + '---|---|' * len(impls))
    for length in lengths:
        cells = []
        for impl in impls:
            r = next((r for r in rows if r['impl'] == impl and r['T'] == length), None)
            cells += ['', ''] if r is None else [f'{r["step_ms"]:.1f}',
                                                 f'{(r["memory_bytes"] or 0) / 2**20:.0f}']
        print(f'| {length} | ' + ' | '.join(cells) + ' |')
    for impl, fit in fits.items():
        print(f'{impl}: time ~ T^{fit["time"]:.2f}, memory ~ T^{fit["memory"]:.2f} '
              f'(least squares over T >= {args.fit_from})')
        emit('attention_scaling_fit', impl, time_exponent=fit['time'],
             memory_exponent=fit['memory'], fit_from=args.fit_from)
    if rows and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        device = jax.devices()[0].device_kind
        plot(rows, fits, args.out, f'one attention layer, forward + backward, on {device}: '
             f'batch {args.batch}, d_model {args.d_model}, {args.heads} heads, {args.dtype}')
        print(f'plot -> {args.out}')


if __name__ == '__main__':
    main()
