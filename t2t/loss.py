"""Label-smoothed cross-entropy straight from the decoder output, a chunk of positions at a time.

    loss_sum, nll_sum, correct_sum = cross_entropy_sums(y_BTD, w_VD, targets_BT, weights_BT,
                                                        smoothing=0.1, chunk_len=32)

The logits y W^T are never materialized for the whole batch: a lax.scan over chunks of
`chunk_len` target positions computes, per chunk, the float32 logits [B, C, V] (compute-dtype
matmul, float32 accumulation), their log-sum-exp, the smoothed loss, the NLL and the argmax, all
from the one chunk of logits. Under jax.grad the same pass also computes the gradient
(a custom_vjp): the softmax gradient of the chunk is cast to the compute dtype and both vocabulary
matmuls of the backward pass (dy = dlogits W, dW = dlogits^T y) run in it with float32
accumulation (dW summed over chunks in float32), so the backward pass neither recomputes nor
keeps any logits. Peak memory of the loss: one float32 [B, C, V] chunk (plus its gradient in the
compute dtype) instead of several float32 [B, T, V] arrays.

Under a mesh that splits the batch over S devices (data x fsdp), the dW carry is [S, V, D]: a
device holds its own slot ([V, D] per device) and adds its own rows to it, with no sum across
devices inside the loop (a plain [V, D] carry is a sum over the sharded batch, which XLA
completed with an all-reduce of dW once per chunk: bench/RESULTS.md). Weights w [V, D]: the
slots are summed once after the loop, dW's one reduction. Weights given as one copy per batch
shard, w [S, V, D] (sharding.per_batch_shard), each shard's rows times its own copy: the loss
returns the slots unsummed, as the copies' gradient, and the transpose of the broadcast that
made the copies sums them after JAX has added the gradients of the copies' other readers. With
the tied embedding under data parallelism (Transformer.features passes the copies its lookups
read) its whole gradient, both lookups and the output projection, is thus reduced across devices
once a step, like every other gradient; summed here instead, dW was reduced on its own and again
with the lookups' part (an extra float32 [V, D] a step). Likewise the weights are cast and
gathered whole along d_model once, before the loop (under fsdp XLA gathered their shards in
every chunk).

Gradients flow through the loss sum only: the NLL and accuracy sums are metrics (stop_gradient).
The smoothed target distribution is tensor2tensor's: 1 - smoothing on the gold token and
smoothing / (V - 1) on every other one (tests/plain_loss.py is the plain reference it equals).

Shape letters: B batch rows, T target length, C positions per chunk, N chunks, D d_model,
V vocabulary, S batch shards (devices the batch is split over; 1 without a mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from t2t import sharding


def cross_entropy_sums(y_BTD, w, targets_BT, weights_BT, *, smoothing: float,
                       chunk_len: int = 0):
    """(smoothed loss sum, NLL sum, correct-argmax sum), each weighted by weights_BT; float32.

    y_BTD: decoder output in the compute dtype; w: the output projection, float32 parameters
    (cast to y's dtype for the matmuls), [V, D] or one copy per batch shard [S, V, D]
    (sharding.per_batch_shard); chunk_len: target positions per chunk (0 or >= T: one
    chunk). T is padded to a multiple of chunk_len with weight 0.
    """
    b, t, d = y_BTD.shape
    c = t if chunk_len <= 0 else min(chunk_len, t)
    pad = -t % c
    if pad:
        y_BTD = jnp.pad(y_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
        weights_BT = jnp.pad(weights_BT, ((0, 0), (0, pad)))
    n = (t + pad) // c
    y_NBCD = y_BTD.reshape(b, n, c, d).swapaxes(0, 1)
    targets_NBC = targets_BT.reshape(b, n, c).swapaxes(0, 1)
    weights_NBC = weights_BT.astype(jnp.float32).reshape(b, n, c).swapaxes(0, 1)
    loss_sum, nll_sum, correct_sum = _chunked_sums(float(smoothing), y_NBCD, w, targets_NBC,
                                                   weights_NBC)
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


def _chunk_terms(smoothing, logits_BCV, targets_BC, weights_BC):
    """Weighted sums of one chunk, and what its gradient needs (the softmax, from the same
    exponentials as the log-sum-exp)."""
    vocab = logits_BCV.shape[-1]
    confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
    max_BC = jnp.max(logits_BCV, axis=-1)
    exp_BCV = jnp.exp(logits_BCV - max_BC[..., None])
    sum_exp_BC = jnp.sum(exp_BCV, axis=-1)
    lse_BC = max_BC + jnp.log(sum_exp_BC)
    gold_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    gold_logp_BC = gold_BC - lse_BC
    sum_logp_BC = jnp.sum(logits_BCV, axis=-1) - vocab * lse_BC
    smoothed_BC = -(confidence - low) * gold_logp_BC - low * sum_logp_BC
    # argmax as the first index holding the maximum (jnp.argmax's tie rule) by a select and a
    # min: argmax's (value, index) reduction over the vocabulary ran several times slower.
    first_max_BC = jnp.min(jnp.where(logits_BCV == max_BC[..., None],
                                     jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    correct_BC = (first_max_BC == targets_BC).astype(jnp.float32)
    sums = jnp.stack([(smoothed_BC * weights_BC).sum(), (-gold_logp_BC * weights_BC).sum(),
                      (correct_BC * weights_BC).sum()])
    return sums, exp_BCV / sum_exp_BC[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_sums(smoothing, y_NBCD, w, targets_NBC, weights_NBC):
    w_c = _whole_weights(w, y_NBCD.dtype)

    def body(sums, chunk):
        y_BCD, targets_BC, weights_BC = chunk
        chunk_sums, _ = _chunk_terms(smoothing, _chunk_logits(y_BCD, w_c), targets_BC,
                                     weights_BC)
        return sums + chunk_sums, None

    sums, _ = jax.lax.scan(body, jnp.zeros(3, jnp.float32), (y_NBCD, targets_NBC, weights_NBC))
    return sums[0], sums[1], sums[2]


def _chunked_sums_fwd(smoothing, y_NBCD, w, targets_NBC, weights_NBC):
    w_c = _whole_weights(w, y_NBCD.dtype)
    s = w.shape[0] if w.ndim == 3 else sharding.batch_shards(y_NBCD.shape[1])

    def body(carry, chunk):
        sums, dw_SVD = carry
        y_BCD, targets_BC, weights_BC = chunk
        logits_BCV = _chunk_logits(y_BCD, w_c)
        chunk_sums, p_BCV = _chunk_terms(smoothing, logits_BCV, targets_BC, weights_BC)
        # d(weighted smoothed loss)/d logits
        #   = w ((conf - low + low V) p - low - (conf - low) 1[gold])
        vocab = logits_BCV.shape[-1]
        confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
        gold_BCV = jnp.arange(vocab, dtype=targets_BC.dtype) == targets_BC[..., None]
        dlogits_BCV = weights_BC[..., None] * (
            (confidence - low + low * vocab) * p_BCV - low
            - jnp.where(gold_BCV, confidence - low, 0.0))
        dlogits_BCV = nn.with_logical_constraint(dlogits_BCV.astype(y_BCD.dtype),
                                                 ('batch', 'length', 'vocab'))
        dy_BCD = _times_weights(dlogits_BCV, w_c, 'embed').astype(y_BCD.dtype)
        # Each batch shard's rows into its own slot: no sum across devices inside the loop.
        dw_SVD = dw_SVD + jnp.einsum('sbcv,sbcd->svd', _per_shard(dlogits_BCV, s, 'vocab'),
                                     _per_shard(y_BCD, s, 'embed'),
                                     preferred_element_type=jnp.float32)
        dw_SVD = nn.with_logical_constraint(dw_SVD, ('batch', 'vocab', 'embed'))
        return (sums + chunk_sums, dw_SVD), dy_BCD

    dw_SVD = nn.with_logical_constraint(jnp.zeros((s, *w.shape[-2:]), jnp.float32),
                                        ('batch', 'vocab', 'embed'))
    init = (jnp.zeros(3, jnp.float32), dw_SVD)
    (sums, dw_SVD), dy_NBCD = jax.lax.scan(body, init, (y_NBCD, targets_NBC, weights_NBC))
    if w.ndim == 3:  # the copies' gradient, per shard: per_batch_shard's transpose sums it
        dw = dw_SVD
    else:  # the one reduction of this dW across devices
        dw = dw_SVD[0] if s == 1 else dw_SVD.sum(axis=0)
    return (sums[0], sums[1], sums[2]), (dy_NBCD, dw)


def _chunked_sums_bwd(smoothing, residuals, cotangents):
    dy_NBCD, dw = residuals
    g_loss = cotangents[0]  # the NLL and accuracy sums are metrics: no gradient through them
    dy = (dy_NBCD * g_loss.astype(dy_NBCD.dtype)).astype(dy_NBCD.dtype)
    return dy, dw * g_loss, None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
