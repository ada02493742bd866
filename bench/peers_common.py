"""Shapes, FLOP count, budget, timing and RESULT lines shared by the peer benchmarks.

bench/peers_gpu.py runs the sections of bench/peer_sections.py with these helpers; the FLOPs formula
(`train_flops_per_step`) is the one t2t/flops.py counts, so t2t's MFU compares with the peers'.
"""

import json
import math
import os
import signal
import statistics
import time
import traceback

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


def train_flops_per_step(batch, src_len, tgt_len, d, ff, n_enc, n_dec, vocab, causal_half=True):
    """Analytic model FLOPs of ONE training step (forward + backward) of an encoder-decoder
    Transformer.

    Matmuls: a weight with P entries applied to N tokens costs 2PN FLOPs forward, 4PN backward
    (gradients w.r.t. input and weight): 6PN per step.
      encoder layer : self q,k,v,o (4 d^2) + FFN (2 d ff)                     x source tokens
      decoder layer : self q,k,v,o (4 d^2) + cross q,o (2 d^2) + FFN (2 d ff) x target tokens
                      cross k,v (2 d^2), projected from the encoder output     x source tokens
      output proj.  : d x vocab (tied with the embedding)                     x target tokens
    Not counted: embedding lookups, biases, LayerNorm, softmax, dropout, loss, optimizer.
    Attention: per query token and layer, QK^T and AV cost 2Ld + 2Ld = 4Ld FLOPs forward for L
    attended keys, x3 for forward+backward = 12Ld (the usual 12 * layers * seq * d_model per token):
      encoder self-attn L = src_len;  decoder cross-attn L = src_len
      decoder self-attn L = (tgt_len+1)/2 on average: causal, only the unmasked half is counted
                        (causal_half=False gives the PaLM-style L = tgt_len)
    Returns (total FLOPs, attention-only FLOPs).
    """
    src_tok, tgt_tok = batch * src_len, batch * tgt_len
    params_x_tokens = (
        n_enc * (4 * d * d + 2 * d * ff) * src_tok
        + n_dec * (6 * d * d + 2 * d * ff) * tgt_tok
        + n_dec * 2 * d * d * src_tok
        + d * vocab * tgt_tok
    )
    dec_self_len = (tgt_len + 1) / 2 if causal_half else tgt_len
    attn = 12 * d * (n_enc * src_len * src_tok + n_dec * (dec_self_len + src_len) * tgt_tok)
    return 6 * params_x_tokens + attn, attn


# reporting, budget, timing
def emit(section, name, **fields):
    rec = {
        'section': section,
        'name': name,
        **{
            k: float(f'{v:.4g}') if isinstance(v, float) and math.isfinite(v) else v
            for k, v in fields.items()
        },
    }
    line = json.dumps(rec, default=str)
    print('RESULT ' + line, flush=True)
    out = os.environ.get('OUT')
    for path in (os.environ.get('ANCHOR_RESULTS'), out and os.path.join(out, 'anchors.jsonl')):
        if path:
            with open(path, 'a') as f:
                f.write(line + '\n')
    return rec


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
    deadline."""
    ts = []
    for i in range(n):
        if i >= min_n and left() < 10:
            break
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return ts


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

