"""The training loss: label-smoothed cross-entropy, plus an optional z-loss.

Per token, with log p = z - log Z: -sum_v q_v log p_v + z_loss * (log Z)^2; q is tensor2tensor's
smoothed target (1 - smoothing on the gold token, smoothing / (V - 1) on each other one), the
second term t5x's z-loss. Sums weighted by weights_BT (1 on non-pad targets); the NLL and
accuracy sums are metrics (no gradient). loss_impl='plain': `plain_sums` on the model's logits.
loss_impl='fused' (a memory lever, equal by test): `cross_entropy_sums` from the decoder output,
float32 logits one chunk of target positions at a time, each chunk's gradient computed in the
same pass (a custom_vjp: no logits kept or recomputed; jax.checkpoint's recompute measured slower,
bench/RESULTS.md), dW summed per batch shard and reduced once.

Shape letters: B batch rows, T target length, C positions per chunk, N chunks, D d_model,
V vocabulary, S batch shards (devices the batch is split over; 1 without a mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from t2t import sharding

IMPLS = ('plain', 'fused')  # loss_impl: the loss on the model's logits, or the chunked one


def _smoothing_weights(smoothing: float, vocab: int) -> tuple[float, float]:
    """(q on the gold token, q on every other token) of the smoothed target distribution."""
    return 1.0 - smoothing, smoothing / (vocab - 1)


def label_smoothed_cross_entropy(logits_BTV, targets_BT, smoothing: float, z_loss: float = 0.0):
    """Per token: (-sum_v q_v log p_v + z_loss * (log Z)^2, the NLL -log p_gold), float32 [B, T]."""
    confidence, low = _smoothing_weights(smoothing, logits_BTV.shape[-1])
    logits_BTV = logits_BTV.astype(jnp.float32)
    log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    logp_BTV = logits_BTV - log_z_BT[..., None]
    gold_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    # sum_v q_v log p_v with q = low everywhere plus (confidence - low) on the gold token.
    smoothed_BT = -(confidence - low) * gold_BT - low * logp_BTV.sum(-1)
    if z_loss:
        smoothed_BT = smoothed_BT + z_loss * jnp.square(log_z_BT)
    return smoothed_BT, -gold_BT


def plain_sums(logits_BTV, targets_BT, weights_BT, *, smoothing: float, z_loss: float = 0.0):
    """(loss sum, NLL sum, correct-argmax sum) of the full logits, each weighted by weights_BT;
    float32. What cross_entropy_sums computes chunk by chunk."""
    weights_BT = weights_BT.astype(jnp.float32)
    smoothed_BT, nll_BT = label_smoothed_cross_entropy(logits_BTV, targets_BT, smoothing, z_loss)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
    return ((smoothed_BT * weights_BT).sum(), jax.lax.stop_gradient((nll_BT * weights_BT).sum()),
            jax.lax.stop_gradient((correct_BT * weights_BT).sum()))


def chunk_length(rows: int, length: int, chunk_len: int, chunk_tokens: int = 0) -> int:
    """Target positions per chunk: chunk_len (0: the whole length), doubled while a device's
    chunk (its rows x positions) stays within chunk_tokens and the length. Each chunk reads and
    writes the float32 dW accumulator [V, D] in HBM; a device holding few rows makes small
    chunks, and that traffic then outweighs the chunk's own (bench/RESULTS.md)."""
    c = length if chunk_len <= 0 else min(chunk_len, length)
    while chunk_tokens and 2 * c <= length and 2 * c * rows <= chunk_tokens:
        c *= 2
    return c


def cross_entropy_sums(y_BTD, w, targets_BT, weights_BT, *, smoothing: float,
                       z_loss: float = 0.0, chunk_len: int = 0, chunk_tokens: int = 0):
    """(smoothed loss sum, NLL sum, correct-argmax sum), each weighted by weights_BT; float32.

    y_BTD: decoder output in the compute dtype; w: the output projection, float32 parameters
    (cast to y's dtype for the matmuls), [V, D] or one copy per batch shard [S, V, D]
    (t2t/tables.py); z_loss: the weight of (log Z)^2; chunk_len: target positions per chunk
    (0 or >= T: one chunk), grown to chunk_tokens target tokens per device (chunk_length; 0:
    not grown). T is padded to a multiple of the chunk length with weight 0.
    """
    b, t, d = y_BTD.shape
    c = chunk_length(b // sharding.batch_shards(b), t, chunk_len, chunk_tokens)
    pad = -t % c
    if pad:
        y_BTD = jnp.pad(y_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
        weights_BT = jnp.pad(weights_BT, ((0, 0), (0, pad)))
    n = (t + pad) // c
    y_NBCD = y_BTD.reshape(b, n, c, d).swapaxes(0, 1)
    targets_NBC = targets_BT.reshape(b, n, c).swapaxes(0, 1)
    weights_NBC = weights_BT.astype(jnp.float32).reshape(b, n, c).swapaxes(0, 1)
    loss_sum, nll_sum, correct_sum = _chunked_sums(float(smoothing), float(z_loss), y_NBCD, w,
                                                   targets_NBC, weights_NBC)
    return loss_sum, jax.lax.stop_gradient(nll_sum), jax.lax.stop_gradient(correct_sum)


def _whole_weights(w, dtype):
    """The output projection ([V, D] or the shards' copies [S, V, D]) in the compute dtype, whole
    along d_model (vocab stays split over tensor), made once before the chunk loop: under fsdp
    XLA otherwise gathers the weights' shards inside the loop, once per chunk."""
    names = ('vocab', None) if w.ndim == 2 else ('batch', 'vocab', None)
    return nn.with_logical_constraint(w.astype(dtype), names)


def _per_shard(x_BCX, shards, last):
    """[B, C, X] -> [S, B/S, C, X], S along the batch's devices (each device a block of rows)."""
    b, c, x = x_BCX.shape
    return nn.with_logical_constraint(x_BCX.reshape(shards, b // shards, c, x),
                                      ('batch', None, 'length', last))


def _times_weights(x_BCX, w_c, into: str):
    """y [B, C, D] -> logits [B, C, V] (into='vocab'), or dlogits [B, C, V] -> dy [B, C, D]
    (into='embed'), float32: all rows times the weights [V, D], or each batch shard's rows times
    its own copy [S, V, D]."""
    if w_c.ndim == 2:
        spec = 'bcd,vd->bcv' if into == 'vocab' else 'bcv,vd->bcd'
        return jnp.einsum(spec, x_BCX, w_c, preferred_element_type=jnp.float32)
    spec = 'sbcd,svd->sbcv' if into == 'vocab' else 'sbcv,svd->sbcd'
    x_SBCX = _per_shard(x_BCX, w_c.shape[0], 'embed' if into == 'vocab' else 'vocab')
    out_SBCX = jnp.einsum(spec, x_SBCX, w_c, preferred_element_type=jnp.float32)
    return out_SBCX.reshape(*x_BCX.shape[:2], -1)


def _chunk_logits(y_BCD, w_c):
    return nn.with_logical_constraint(_times_weights(y_BCD, w_c, 'vocab'),
                                      ('batch', 'length', 'vocab'))


def _chunk_terms(smoothing, z_loss, logits_BCV, targets_BC, weights_BC):
    """Weighted sums of one chunk, and what its gradient needs (the softmax, from the same
    exponentials as the log-sum-exp, and the log-sum-exp)."""
    vocab = logits_BCV.shape[-1]
    confidence, low = _smoothing_weights(smoothing, vocab)
    max_BC = jnp.max(logits_BCV, axis=-1)
    exp_BCV = jnp.exp(logits_BCV - max_BC[..., None])
    sum_exp_BC = jnp.sum(exp_BCV, axis=-1)
    lse_BC = max_BC + jnp.log(sum_exp_BC)
    gold_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    gold_logp_BC = gold_BC - lse_BC
    sum_logp_BC = jnp.sum(logits_BCV, axis=-1) - vocab * lse_BC
    smoothed_BC = -(confidence - low) * gold_logp_BC - low * sum_logp_BC
    if z_loss:
        smoothed_BC = smoothed_BC + z_loss * jnp.square(lse_BC)
    # argmax as the first index holding the maximum (jnp.argmax's tie rule) by a select and a
    # min: argmax's (value, index) reduction over the vocabulary ran several times slower.
    first_max_BC = jnp.min(jnp.where(logits_BCV == max_BC[..., None],
                                     jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    correct_BC = (first_max_BC == targets_BC).astype(jnp.float32)
    sums = jnp.stack([(smoothed_BC * weights_BC).sum(), (-gold_logp_BC * weights_BC).sum(),
                      (correct_BC * weights_BC).sum()])
    return sums, exp_BCV / sum_exp_BC[..., None], lse_BC


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_sums(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC):
    """The weighted sums over the chunks. Under jax.grad the forward pass computes the gradient
    too (_chunked_sums_fwd): per chunk dlogits in the compute dtype, dy = dlogits W and
    dW += dlogits^T y, both matmuls accumulating in float32."""
    w_c = _whole_weights(w, y_NBCD.dtype)

    def body(sums, chunk):
        y_BCD, targets_BC, weights_BC = chunk
        chunk_sums, _, _ = _chunk_terms(smoothing, z_loss, _chunk_logits(y_BCD, w_c),
                                        targets_BC, weights_BC)
        return sums + chunk_sums, None

    sums, _ = jax.lax.scan(body, jnp.zeros(3, jnp.float32), (y_NBCD, targets_NBC, weights_NBC))
    return sums[0], sums[1], sums[2]


def _chunked_sums_fwd(smoothing, z_loss, y_NBCD, w, targets_NBC, weights_NBC):
    w_c = _whole_weights(w, y_NBCD.dtype)
    s = w.shape[0] if w.ndim == 3 else sharding.batch_shards(y_NBCD.shape[1])

    def body(carry, chunk):
        sums, dw_SVD = carry
        y_BCD, targets_BC, weights_BC = chunk
        logits_BCV = _chunk_logits(y_BCD, w_c)
        chunk_sums, p_BCV, lse_BC = _chunk_terms(smoothing, z_loss, logits_BCV, targets_BC,
                                                 weights_BC)
        # d(weighted loss)/d logits
        #   = w ((conf - low + low V + 2 z_loss log Z) p - low - (conf - low) 1[gold])
        vocab = logits_BCV.shape[-1]
        confidence, low = _smoothing_weights(smoothing, vocab)
        gold_BCV = jnp.arange(vocab, dtype=targets_BC.dtype) == targets_BC[..., None]
        p_scale_BC1 = confidence - low + low * vocab
        if z_loss:
            p_scale_BC1 = p_scale_BC1 + 2.0 * z_loss * lse_BC[..., None]
        dlogits_BCV = weights_BC[..., None] * (
            p_scale_BC1 * p_BCV - low - jnp.where(gold_BCV, confidence - low, 0.0))
        dlogits_BCV = nn.with_logical_constraint(dlogits_BCV.astype(y_BCD.dtype),
                                                 ('batch', 'length', 'vocab'))
        dy_BCD = _times_weights(dlogits_BCV, w_c, 'embed').astype(y_BCD.dtype)
        # Each batch shard's rows into its own slot: no sum across devices inside the loop.
        dw_SVD = dw_SVD + jnp.einsum('sbcv,sbcd->svd', _per_shard(dlogits_BCV, s, 'vocab'),
                                     _per_shard(y_BCD, s, 'embed'),
                                     preferred_element_type=jnp.float32)
        dw_SVD = nn.with_logical_constraint(dw_SVD, ('batch', 'vocab', 'embed'))
        return (sums + chunk_sums, dw_SVD), dy_BCD

    # dW [S, V, D], a slot per batch shard: each device adds its own rows to its own slot, no
    # sum across devices inside the loop (a [V, D] carry made XLA all-reduce dW once per chunk:
    # bench/RESULTS.md); the slots are summed once after it.
    dw_SVD = nn.with_logical_constraint(jnp.zeros((s, *w.shape[-2:]), jnp.float32),
                                        ('batch', 'vocab', 'embed'))
    init = (jnp.zeros(3, jnp.float32), dw_SVD)
    (sums, dw_SVD), dy_NBCD = jax.lax.scan(body, init, (y_NBCD, targets_NBC, weights_NBC))
    # Weights given as one copy per batch shard (t2t/tables.py): the slots are the copies'
    # gradient, summed by the transpose of the broadcast that made them, with the embedding's.
    if w.ndim == 3:
        dw = dw_SVD
    else:  # the one reduction of this dW across devices
        dw = dw_SVD[0] if s == 1 else dw_SVD.sum(axis=0)
    return (sums[0], sums[1], sums[2]), (dy_NBCD, dw)


def _chunked_sums_bwd(smoothing, z_loss, residuals, cotangents):
    dy_NBCD, dw = residuals
    g_loss = cotangents[0]  # the NLL and accuracy sums are metrics: no gradient through them
    dy = (dy_NBCD * g_loss.astype(dy_NBCD.dtype)).astype(dy_NBCD.dtype)
    return dy, dw * g_loss, None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
