"""Attention masks and kernels: who may attend to whom, and softmax(q k^T * scale + mask) v.

A mask is built once at the top of the model's encode()/decode() (`make_attention_mask`) in the
form its kernel takes (`AttentionMask`): a dense boolean [B, 1, Q, K] for the einsum ('xla') and
jax.nn.dot_product_attention ('dot_product'), sequence lengths for cuDNN flash attention
('cudnn', GPU), segment ids for the Pallas splash attention kernel ('splash', TPU).

Shape letters: B batch, Q queries, K keys (or, last, the head dim), S key length, H heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from t2t.dropout import dropout

Array = jax.Array

def attention_mask(q_valid_BQ: Array, k_valid_BK: Array, q_segment_BQ=None, k_segment_BK=None,
                   causal: bool = False) -> Array:
    """Boolean [B, 1, Q, K]: True where query q may attend to key k."""
    mask = q_valid_BQ[:, :, None] & k_valid_BK[:, None, :]
    if q_segment_BQ is not None:
        mask &= q_segment_BQ[:, :, None] == k_segment_BK[:, None, :]
    if causal:
        q, k = mask.shape[1], mask.shape[2]
        mask &= jnp.arange(q)[:, None] >= jnp.arange(k)[None, :]
    return mask[:, None, :, :]



@struct.dataclass
class AttentionMask:
    """Who may attend to whom, in the form the attention implementation takes.

    dense_B1QK: boolean [B, 1, Q, K] ('xla', 'dot_product'; 'cudnn' on packed rows).
    q_lengths_B / k_lengths_B: int32 numbers of leading valid tokens ('cudnn' on right-padded
      rows: cuDNN skips the padding itself, no [Q, K] mask is ever materialized).
    q_segment_BQ / k_segment_BK: int32 segment ids, 0 on padding ('splash'; unpacked rows are
      segment 1).
    causal: key k is visible to query q only if k <= q (with the lengths or segments).
    """

    dense_B1QK: Array | None = None
    q_lengths_B: Array | None = None
    k_lengths_B: Array | None = None
    q_segment_BQ: Array | None = None
    k_segment_BK: Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)


def make_attention_mask(impl: str, q_valid_BQ: Array, k_valid_BK: Array, q_segment_BQ=None,
                        k_segment_BK=None, causal: bool = False) -> AttentionMask:
    """The mask of `attention_mask` in the form that attention implementation `impl` takes.

    'cudnn' uses sequence lengths, so it assumes right padding (valid tokens first), as every
    t2t batch has. Packed rows (segment ids given) fall back to the dense mask with cuDNN:
    jax.nn.dot_product_attention takes no segment ids; jax turns the mask into a bias.
    """
    if impl == 'cudnn' and q_segment_BQ is None:
        return AttentionMask(q_lengths_B=q_valid_BQ.sum(-1, dtype=jnp.int32),
                             k_lengths_B=k_valid_BK.sum(-1, dtype=jnp.int32), causal=causal)
    if impl == 'splash':
        def segments(valid, segment):
            ids = valid.astype(jnp.int32) if segment is None else segment.astype(jnp.int32)
            return jnp.where(valid, ids, 0)
        return AttentionMask(q_segment_BQ=segments(q_valid_BQ, q_segment_BQ),
                             k_segment_BK=segments(k_valid_BK, k_segment_BK), causal=causal)
    return AttentionMask(dense_B1QK=attention_mask(q_valid_BQ, k_valid_BK, q_segment_BQ,
                                                   k_segment_BK, causal=causal))


def cudnn_arguments(mask: AttentionMask) -> dict:
    """Keyword arguments of jax.nn.dot_product_attention that express `mask`."""
    if mask.dense_B1QK is not None:
        return dict(mask=mask.dense_B1QK)
    return dict(is_causal=mask.causal, query_seq_lengths=mask.q_lengths_B,
                key_value_seq_lengths=mask.k_lengths_B)


def attention_weights(q_BQHK: Array, k_BKHK: Array, mask_B1QK: Array, scale: float,
                      keys: str = 'bshk') -> Array:
    """softmax(q k^T * scale + mask) in float32: [B, H, Q, K] (mask: boolean [B, 1, Q, K]).

    keys: the layout of k, 'bshk' ([B, K, H, head dim], as projected) or 'bhsk' (head-major,
    as the decode caches keep them).
    """
    logits_BHQK = jnp.einsum(f'bqhk,{keys}->bhqs', q_BQHK, k_BKHK) * jnp.asarray(
        scale, q_BQHK.dtype)
    logits_BHQK = jnp.where(mask_B1QK, logits_BHQK.astype(jnp.float32), -1e10)
    return jax.nn.softmax(logits_BHQK, axis=-1)


def dot_product_attention(q_BQHK: Array, k_BKHK: Array, v_BKHK: Array, mask, *,
                          scale: float, dropout_rate: float = 0.0, dropout_rng=None,
                          impl: str = 'xla') -> Array:
    """softmax(q k^T * scale + mask) v with the softmax in float32; returns [B, Q, H, K].

    mask: an AttentionMask built for `impl`, or a boolean [B, 1, Q, K] array.
    impl: 'xla' (written out here), 'dot_product' (jax.nn.dot_product_attention, which lets jax
    pick the kernel: XLA's today), 'cudnn' (the same function forced to cuDNN's fused flash
    attention, with sequence lengths and the causal flag: GPU only, bfloat16/float16 inputs) or
    'splash' (the Pallas splash attention kernel with segment ids: TPU only).
    """
    if not isinstance(mask, AttentionMask):
        mask = AttentionMask(dense_B1QK=mask)
    if impl == 'dot_product':
        return jax.nn.dot_product_attention(q_BQHK, k_BKHK, v_BKHK, mask=mask.dense_B1QK,
                                            scale=scale)
    if impl == 'cudnn':
        return jax.nn.dot_product_attention(q_BQHK, k_BKHK, v_BKHK, scale=scale,
                                            implementation='cudnn', **cudnn_arguments(mask))
    if impl == 'splash':
        return splash_attention(q_BQHK, k_BKHK, v_BKHK, mask, scale=scale)
    weights_BHQK = attention_weights(q_BQHK, k_BKHK, mask.dense_B1QK, scale)
    if dropout_rate > 0.0 and dropout_rng is not None:
        weights_BHQK = dropout(weights_BHQK, dropout_rate, dropout_rng)
    return jnp.einsum('bhqs,bshk->bqhk', weights_BHQK.astype(v_BKHK.dtype), v_BKHK)


_SPLASH_BLOCK = 128  # the kernel's tile; lengths are padded up to a multiple of it


def splash_attention(q_BQHK: Array, k_BKHK: Array, v_BKHK: Array, mask: AttentionMask, *,
                     scale: float, interpret: bool = False) -> Array:
    """Attention through jax's Pallas splash attention kernel for TPU (segment ids + causal).

    Lengths are padded to a multiple of 128 (the padding gets segment ids no real token has,
    and is cut off again). Under a mesh the kernel runs per shard (shard_map): batch split as
    'batch', heads as 'heads', lengths whole. interpret=True runs the kernel's Python
    interpretation on any backend (tests).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q_len, k_len = q_BQHK.shape[1], k_BKHK.shape[1]
    pad_q, pad_k = -q_len % _SPLASH_BLOCK, -k_len % _SPLASH_BLOCK

    def per_shard(q_BQHK, k_BKHK, v_BKHK, q_seg_BQ, k_seg_BK):
        heads = q_BQHK.shape[2]
        q_BQHK = q_BQHK * jnp.asarray(scale, q_BQHK.dtype)
        q_BHQK, k_BHKK, v_BHKK = (
            jnp.pad(x, ((0, 0), (0, p), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
            for x, p in ((q_BQHK, pad_q), (k_BKHK, pad_k), (v_BKHK, pad_k)))
        # Padded queries (-1) and keys (-2) match nothing; a fully masked row stays finite.
        q_seg_BQ = jnp.pad(q_seg_BQ, ((0, 0), (0, pad_q)), constant_values=-1)
        k_seg_BK = jnp.pad(k_seg_BK, ((0, 0), (0, pad_k)), constant_values=-2)
        shape = (q_len + pad_q, k_len + pad_k)
        head_mask = splash.CausalMask(shape) if mask.causal else splash.FullMask(shape)
        kernel = splash.make_splash_mha(
            splash.MultiHeadMask([head_mask] * heads), head_shards=1, q_seq_shards=1,
            interpret=interpret)
        out_BHQK = jax.vmap(kernel)(q_BHQK, k_BHKK, v_BHKK,
                                    segment_ids=splash.SegmentIds(q_seg_BQ, k_seg_BK))
        return out_BHQK.transpose(0, 2, 1, 3)[:, :q_len]

    args = (q_BQHK, k_BKHK, v_BKHK, mask.q_segment_BQ, mask.k_segment_BK)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return per_shard(*args)
    qkv = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'kv'))
    seg = nn.logical_to_mesh_axes(('batch', 'length'))
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg),
                         out_specs=qkv, check_vma=False)(*args)
