"""Beam-search decoding speed of t2t's jitted predict function, in the peers' decode shape.

    python bench/decode_speed.py --attention dot_product,xla     # GPU
    python bench/decode_speed.py --tiny                          # CPU smoke test
    python bench/decode_speed.py --model cpu --attention xla     # the CPU comparison shape

Shape (as bench/peers_gpu.py): BASE model (512/2048/8 heads/6+6, vocab 32768, bf16,
random init), beam 4, alpha 0.6, 64 sentences x 32 source tokens (random ids in [3, vocab), the
peers' own batch), exactly 64 new tokens per sentence. The predict function is
t2t.eval.predict.make_predict_fn, unchanged: per batch it runs the encoder, builds the decode caches
and runs the beam search, all inside one jit.

"64 new tokens forced": the peers pass eos_id=-1 to the flax beam search, so no token ends a
hypothesis and every search runs to its length limit; DecodeConfig(eos_id=-1) does the same
here. The limit is max_decode_len = max_decode_extra = 64 (so min(64, source length + 64) = 64).
The script checks that every best hypothesis ran to the limit.

--model cpu: the CPU comparison shape (bench/cpu_vs_flax.py): d_model 256, 4 heads, d_ff 1024,
3+3 layers, vocab 8000, float32, beam 4 on 64 sentences x 16 source tokens, 32 new tokens, no EOS.

Reports per attention implementation: compile s (lower + compile of predict), first run s, ms per
batch (median of --reps runs, each synced), sentences/s and new tokens/s. One `RESULT {json}` line
per measurement, also appended to $OUT/t2t_results.jsonl when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from train_speed import (  # noqa: E402
    MODELS,
    TINY_MODELS,
    device_fields,
    emit,
    model_config,
    parse_with_defaults,
    versions,
)

from t2t.decode import DecodeConfig  # noqa: E402
from t2t.eval import predict as predict_lib  # noqa: E402
from t2t.model import Transformer  # noqa: E402

NO_EOS = -1  # a token id no model can emit, as peers_gpu.py: every search runs to its limit
FULL = dict(batch=64, src_len=32, new_tokens=64, vocab=32768, reps=10)
TINY = dict(batch=4, src_len=8, new_tokens=8, vocab=512, reps=2)  # peers_gpu.py --tiny sizes
CPU = dict(batch=64, src_len=16, new_tokens=32, vocab=8000, reps=10, dtype='float32')


def decode_src(batch: int, src_len: int, vocab: int) -> np.ndarray:
    """The peers' decode batch: random ids in [3, vocab), no padding, seed 1."""
    return np.random.default_rng(1).integers(3, vocab, (batch, src_len), dtype=np.int64)


def build_predict(attention: str, shape, args, scan_layers: bool = False):
    """(jitted predict, params, inputs_BS): t2t's beam search in this shape, random init."""
    config = model_config(shape, args.vocab, args.dtype, attention, deterministic=True,
                          scan_layers=scan_layers)
    inputs_BS = jnp.asarray(decode_src(args.batch, args.src_len, args.vocab), jnp.int32)
    params = jax.jit(lambda key: nn.unbox(Transformer(config).init(key, inputs_BS, inputs_BS)))(
        jax.random.PRNGKey(0))['params']
    decoding = DecodeConfig(beam_size=args.beams, length_penalty_alpha=0.6,
                            max_decode_len=args.new_tokens,
                            max_decode_extra=args.new_tokens, eos_id=NO_EOS)
    predict = predict_lib.make_predict_fn(config, decoding)
    return predict, params, inputs_BS


def bench_decode(attention: str, shape, args) -> dict:
    gc.collect()
    predict, params, inputs_BS = build_predict(attention, shape, args, args.scan_layers)
    t0 = time.perf_counter()
    compiled = predict.lower(params, inputs_BS).compile()
    compile_s = time.perf_counter() - t0

    box = {}

    def run():
        box['out'] = jax.block_until_ready(compiled(params, inputs_BS))

    t0 = time.perf_counter()
    run()
    first_s = time.perf_counter() - t0
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)

    out = jax.device_get(box['out'])
    decoded_len = int(out.ids_BL.shape[1])
    if decoded_len != args.new_tokens or not np.all(out.hit_limit_B):
        raise RuntimeError(f'decoding was not forced: length {decoded_len}, '
                           f'{int(np.sum(~out.hit_limit_B))} hypotheses ended early')
    nb, med = args.batch, statistics.median(ts)
    return dict(framework='t2t', version=versions(), model=args.model.upper(),
                attention=attention, dtype=args.dtype, scan_layers=args.scan_layers,
                **device_fields(), alpha=0.6, compile_s=compile_s,
                batch=nb, src_len=args.src_len, new_tokens=args.new_tokens, beams=args.beams,
                decoded_len=decoded_len, first_run_s=first_s, n_runs=len(ts),
                batch_ms=med * 1e3, batch_ms_min=min(ts) * 1e3, sent_s=nb / med,
                tok_s=nb * args.new_tokens / med, note='eos disabled: fixed decode length')


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--attention', default='dot_product',
                    help="comma list of 'xla', 'dot_product', 'cudnn' (GPU only)")
    ap.add_argument('--model', default='base', choices=('base', 'cpu'),
                    help='cpu: the CPU comparison shape (float32, vocab 8000, 64 x 16 -> 32)')
    ap.add_argument('--scan_layers', action='store_true')
    ap.add_argument('--batch', type=int, help='sentences per batch (default 64; tiny 4)')
    ap.add_argument('--src_len', type=int, help='source tokens (default 32; tiny 8)')
    ap.add_argument('--new_tokens', type=int, help='tokens generated (default 64; tiny 8)')
    ap.add_argument('--vocab', type=int, help='vocabulary (default 32768; tiny 512)')
    ap.add_argument('--beams', type=int, default=4)
    ap.add_argument('--dtype', choices=('bfloat16', 'float32'),
                    help='compute dtype (default bfloat16; cpu float32)')
    ap.add_argument('--reps', type=int, help='timed batches (default 10; tiny 2)')
    ap.add_argument('--tiny', action='store_true', help='toy sizes for a CPU smoke test')
    return parse_with_defaults(ap, argv, TINY, FULL, CPU)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = (TINY_MODELS if args.tiny else MODELS)[args.model.upper()]
    impls = [a.strip() for a in args.attention.split(',') if a.strip()]
    print(f'# t2t decode_speed: {versions()}, {device_fields()}, {args.batch} x {args.src_len} '
          f'source tokens, {args.new_tokens} new, beam {args.beams}, tiny={args.tiny}',
          flush=True)
    failed = 0
    for impl in impls:
        label = f'beam_search_{args.model.upper()}_{impl}'
        t0 = time.time()
        try:
            res = bench_decode(impl, shape, args)
            emit('t2t', label, status='ok', wall_s=time.time() - t0, **res)
        except Exception as e:  # one failure must not lose the other measurements
            traceback.print_exc()
            failed += 1
            emit('t2t', label, status='error', error=f'{type(e).__name__}: {e}'[:400],
                 wall_s=time.time() - t0)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
