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

Under a mesh that splits the batch over S devices (data x fsdp), the dW carry is [S, V, D], one
slot per batch shard (a device holds its own slot: [V, D] per device, as before), each device
adding its own rows to its own slot; the slots are summed once after the loop. A plain [V, D]
carry is a sum over the sharded batch, which XLA completed with an all-reduce of dW inside the
loop, once per chunk (bench/RESULTS.md); summed after it, dW is reduced once per step like every
other gradient. Likewise the weights are cast and gathered whole along d_model once, before the
loop (under fsdp XLA gathered their shards in every chunk).

Gradients flow through the loss sum only: the NLL and accuracy sums are metrics (stop_gradient).
The smoothed target distribution is tensor2tensor's: 1 - smoothing on the gold token and
smoothing / (V - 1) on every other one (tests/plain_loss.py is the plain reference it equals).

Shape letters: B batch rows, T target length, C positions per chunk, N chunks, D d_model,
V vocabulary, S batch shards (devices the batch is split over; 1 without a mesh).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn


def cross_entropy_sums(y_BTD, w_VD, targets_BT, weights_BT, *, smoothing: float,
                       chunk_len: int = 0):
    """(smoothed loss sum, NLL sum, correct-argmax sum), each weighted by weights_BT; float32.

    y_BTD: decoder output in the compute dtype; w_VD: the output projection (float32
    parameters, cast to y's dtype for the matmuls); chunk_len: target positions per chunk
    (0 or >= T: one chunk). T is padded to a multiple of chunk_len with weight 0.
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
    loss_sum, nll_sum, correct_sum = _chunked_sums(float(smoothing), y_NBCD, w_VD, targets_NBC,
                                                   weights_NBC)
    return loss_sum, jax.lax.stop_gradient(nll_sum), jax.lax.stop_gradient(correct_sum)


def _whole_weights(w_VD, dtype):
    """The output projection in the compute dtype, whole along d_model on every device (vocab
    stays split over tensor), made once before the chunk loop: under fsdp XLA otherwise gathers
    the weights' shards inside the loop, once per chunk."""
    return nn.with_logical_constraint(w_VD.astype(dtype), ('vocab', None))


def _chunk_logits(y_BCD, w_VD):
    logits_BCV = jnp.einsum('bcd,vd->bcv', y_BCD, w_VD.astype(y_BCD.dtype),
                            preferred_element_type=jnp.float32)
    return nn.with_logical_constraint(logits_BCV, ('batch', 'length', 'vocab'))


def _batch_shards(rows: int) -> int:
    """Devices the 'batch' axis is split over under the active mesh and logical axis rules (1
    without them, or when they do not divide the rows)."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return 1
    axes = nn.logical_to_mesh_axes(('batch',), rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(mesh.shape[a] for a in axes)
    return shards if rows % shards == 0 else 1


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
def _chunked_sums(smoothing, y_NBCD, w_VD, targets_NBC, weights_NBC):
    w_c_VD = _whole_weights(w_VD, y_NBCD.dtype)

    def body(sums, chunk):
        y_BCD, targets_BC, weights_BC = chunk
        chunk_sums, _ = _chunk_terms(smoothing, _chunk_logits(y_BCD, w_c_VD), targets_BC,
                                     weights_BC)
        return sums + chunk_sums, None

    sums, _ = jax.lax.scan(body, jnp.zeros(3, jnp.float32), (y_NBCD, targets_NBC, weights_NBC))
    return sums[0], sums[1], sums[2]


def _chunked_sums_fwd(smoothing, y_NBCD, w_VD, targets_NBC, weights_NBC):
    w_c_VD = _whole_weights(w_VD, y_NBCD.dtype)
    _, b, c, d = y_NBCD.shape
    s = _batch_shards(b)

    def per_shard(x_BCX, last):  # [B, C, X] -> [S, B/S, C, X], S along the batch's devices
        return nn.with_logical_constraint(x_BCX.reshape(s, b // s, c, x_BCX.shape[-1]),
                                          ('batch', None, 'length', last))

    def body(carry, chunk):
        sums, dw_SVD = carry
        y_BCD, targets_BC, weights_BC = chunk
        logits_BCV = _chunk_logits(y_BCD, w_c_VD)
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
        dy_BCD = jnp.einsum('bcv,vd->bcd', dlogits_BCV, w_c_VD,
                            preferred_element_type=jnp.float32).astype(y_BCD.dtype)
        # Each batch shard's rows into its own slot: no sum across devices inside the loop.
        dw_SVD = dw_SVD + jnp.einsum('sbcv,sbcd->svd', per_shard(dlogits_BCV, 'vocab'),
                                     per_shard(y_BCD, 'embed'),
                                     preferred_element_type=jnp.float32)
        dw_SVD = nn.with_logical_constraint(dw_SVD, ('batch', 'vocab', 'embed'))
        return (sums + chunk_sums, dw_SVD), dy_BCD

    dw_SVD = nn.with_logical_constraint(jnp.zeros((s, *w_VD.shape), jnp.float32),
                                        ('batch', 'vocab', 'embed'))
    init = (jnp.zeros(3, jnp.float32), dw_SVD)
    (sums, dw_SVD), dy_NBCD = jax.lax.scan(body, init, (y_NBCD, targets_NBC, weights_NBC))
    dw_VD = dw_SVD[0] if s == 1 else dw_SVD.sum(axis=0)  # the one reduction across devices
    return (sums[0], sums[1], sums[2]), (dy_NBCD, dw_VD)


def _chunked_sums_bwd(smoothing, residuals, cotangents):
    dy_NBCD, dw_VD = residuals
    g_loss = cotangents[0]  # the NLL and accuracy sums are metrics: no gradient through them
    dy = (dy_NBCD * g_loss.astype(dy_NBCD.dtype)).astype(dy_NBCD.dtype)
    return dy, dw_VD * g_loss, None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)
