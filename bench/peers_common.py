"""Shapes, FLOP count, budget, timing and RESULT lines shared by the peer benchmarks.

bench/peers_gpu.py runs the sections of bench/peer_sections.py with these helpers; the FLOPs
formula is t2t/infra/flops.py's `train_flops_per_step`, so t2t's MFU compares with the peers'.
RESULT lines and the timing loop are bench/benchlib.py's.
"""

import math
import os
import signal
import statistics
import sys
import time
import traceback

import benchlib

sys.path.insert(0, benchlib.ROOT)
from t2t.infra.flops import train_flops_per_step  # noqa: E402  (the one FLOPs formula)

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 tensor-core peak, FLOP/s
NO_EOS = -1  # a token id no model can emit: every beam search runs to its maximum length

# models: name -> (d_model, heads, d_ff, layers in each of encoder and decoder)
FULL = dict(
    vocab=32768,
    batch=128,
    seq=256,
    warmup=3,
    steps=20,
    reps=5,
    budget=420,
    models={'BASE': (512, 8, 2048, 6), 'BIG': (1024, 16, 4096, 6)},
    dec_batch=64,
    dec_src=32,
    dec_new=64,
    beams=4,
    mm_n=8192,
    copy_mib=1024,
)
TINY = dict(
    vocab=512,
    batch=4,
    seq=16,
    warmup=1,
    steps=3,
    reps=2,
    budget=1500,
    models={'BASE': (64, 4, 256, 2), 'BIG': (128, 8, 512, 2)},
    dec_batch=4,
    dec_src=8,
    dec_new=8,
    beams=4,
    mm_n=256,
    copy_mib=8,
)


# reporting, budget, timing
def emit(section, name, **fields):
    """benchlib.emit, the line appended to $ANCHOR_RESULTS and $OUT/anchors.jsonl when set."""
    out = os.environ.get('OUT')
    return benchlib.emit(section, name, files=(os.environ.get('ANCHOR_RESULTS'),
                                               out and os.path.join(out, 'anchors.jsonl')),
                         **fields)


def left():
    """Seconds until this section's deadline (inf when a section is run by hand)."""
    return float(os.environ.get('ANCHOR_DEADLINE', 'inf')) - time.time()


class CapReached(
    BaseException
):  # BaseException: library code that catches Exception must not swallow it
    pass


def _on_alarm(signum, frame):
    raise CapReached('wall-clock cap of the section reached')


def measure(section, name, need_s, fn):
    """One measurement: skipped when fewer than need_s seconds are left, interrupted (SIGALRM) at
    the
    section deadline, never raises. fn() returns the dict that becomes its RESULT line."""
    if left() < need_s:
        return emit(
            section, name, status='skipped', reason=f'budget: {left():.0f}s left < {need_s}s needed'
        )
    t0 = time.time()
    if math.isfinite(left()):
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(max(1, int(left()) - 3))
    try:
        res = fn()
        return emit(section, name, status='ok', wall_s=time.time() - t0, **res)
    except (Exception, CapReached) as e:
        traceback.print_exc()
        return emit(
            section,
            name,
            status='timeout' if isinstance(e, CapReached) else 'error',
            error=f'{type(e).__name__}: {e}'[:400],
            wall_s=time.time() - t0,
        )
    finally:
        signal.alarm(0)


def time_runs(run, n, min_n=3):
    """Wall time of up to n calls of run() (which must end with a device sync); fewer near the
    deadline (after min_n)."""
    return benchlib.time_calls(run, n, stop=lambda i: i >= min_n and left() < 10)


def train_metrics(ts, cfg, d, ff, layers):
    B, S, V = cfg['batch'], cfg['seq'], cfg['vocab']
    med = statistics.median(ts)
    flops, attn = train_flops_per_step(B, S, S, d, ff, layers, layers, V)
    r = dict(
        batch=B,
        seq=S,
        n_steps=len(ts),
        step_ms=med * 1e3,
        step_ms_mean=statistics.fmean(ts) * 1e3,
        tgt_tok_s=B * S / med,
        src_tgt_tok_s=2 * B * S / med,
        model_tflop_per_step=flops / 1e12,
        attn_flop_share=attn / flops,
        achieved_tflops=flops / med / 1e12,
        mfu_989=flops / med / PEAK_BF16,
    )
    if os.environ.get('ANCHOR_MEAS_TFLOPS'):
        r['mfu_measured_peak'] = flops / med / (float(os.environ['ANCHOR_MEAS_TFLOPS']) * 1e12)
    return r


def decode_metrics(first_s, ts, cfg):
    nb, med = cfg['dec_batch'], statistics.median(ts)
    return dict(
        batch=nb,
        src_len=cfg['dec_src'],
        new_tokens=cfg['dec_new'],
        beams=cfg['beams'],
        first_run_s=first_s,
        n_runs=len(ts),
        batch_ms=med * 1e3,
        sent_s=nb / med,
        tok_s=nb * cfg['dec_new'] / med,
    )


def decode_src(cfg):
    """The decode batch shared by the flax and HF peers: random ids in [3, vocab), no padding."""
    import numpy as np

    return np.random.default_rng(1).integers(
        3, cfg['vocab'], (cfg['dec_batch'], cfg['dec_src']), dtype=np.int64
    )

