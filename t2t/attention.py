"""Attention (t2t/model.py's): masks, kernels and the multi-head attention layer.

A mask is built once at the top of the model's encode()/decode() in the form its kernel takes
(`AttentionMask`). Every kernel computes softmax(q k^T * scale + mask) v; `MultiHeadAttention`
projects q, k, v (rotary positions on q and k with position_embedding='rope'), runs the kernel,
projects the heads back, and in decode mode keeps earlier steps' keys/values in its caches.
It reads the model's TransformerConfig (passed in, never imported), each field declared once, there.

Shape letters: B batch, Q queries, K keys (or, last, the head dim), S key length, H heads,
D d_model, L any length.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from t2t.dropout import dropout

Array = jax.Array
# attention_impl's kernels (t2t/attention_choice.py resolves 'auto' to one of them)
KERNELS = ('xla', 'dot_product', 'cudnn', 'splash')


# ----------------------------------------------------------------------------------------------
# Masks, built once at the top of the model's encode()/decode()


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
    """Who may attend to whom, in the form the attention implementation takes."""

    dense_B1QK: Array | None = None  # bool ('xla', 'dot_product'; 'cudnn' on packed rows)
    # int32 numbers of leading valid tokens ('cudnn' on right-padded rows: cuDNN skips the
    # padding itself, no [Q, K] mask is materialized)
    q_lengths_B: Array | None = None
    k_lengths_B: Array | None = None
    # int32 segment ids, 0 on padding ('splash'; unpacked rows are segment 1)
    q_segment_BQ: Array | None = None
    k_segment_BK: Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)  # with lengths or segments


def make_attention_mask(impl: str, q_valid_BQ: Array, k_valid_BK: Array, q_segment_BQ=None,
                        k_segment_BK=None, causal: bool = False) -> AttentionMask:
    """The mask of `attention_mask` in the form that attention implementation `impl` takes.
    'cudnn' uses sequence lengths (right padding, as every t2t batch has); packed rows fall back
    to the dense mask, as jax.nn.dot_product_attention takes no segment ids."""
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


# ----------------------------------------------------------------------------------------------
# Kernels: softmax(q k^T * scale + mask) v


def cudnn_arguments(mask: AttentionMask) -> dict:
    """Keyword arguments of jax.nn.dot_product_attention that express `mask`."""
    if mask.dense_B1QK is not None:
        return dict(mask=mask.dense_B1QK)
    return dict(is_causal=mask.causal, query_seq_lengths=mask.q_lengths_B,
                key_value_seq_lengths=mask.k_lengths_B)


def attention_weights(q_BQHK: Array, k_BKHK: Array, mask_B1QK: Array, scale: float,
                      keys: str = 'bshk', dtype=None) -> Array:
    """softmax(q k^T * scale + mask) in float32: [B, H, Q, K] (mask: boolean [B, 1, Q, K]).
    keys: k's layout, 'bshk' (as projected) or 'bhsk' (head-major, the decode caches'). dtype:
    the weights returned and kept for the backward pass in it (softmax_kept_as); None: float32.
    """
    logits_BHQK = jnp.einsum(f'bqhk,{keys}->bhqs', q_BQHK, k_BKHK) * jnp.asarray(
        scale, q_BQHK.dtype)
    logits_BHQK = jnp.where(mask_B1QK, logits_BHQK.astype(jnp.float32), -1e10)
    if dtype is None or jnp.dtype(dtype) == jnp.float32:
        return jax.nn.softmax(logits_BHQK, axis=-1)
    return softmax_kept_as(logits_BHQK, jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax_kept_as(logits: Array, dtype) -> Array:
    """softmax over the last axis in float32, returned in dtype, its gradient computed in float32
    from that copy: autodiff would keep the float32 output [B, H, Q, K] a layer for the backward
    pass (bench/RESULTS.md, "The loss chunks and XLA's negative estimate")."""
    return jax.nn.softmax(logits, axis=-1).astype(dtype)


def _softmax_kept_as_fwd(logits, dtype):
    p = jax.nn.softmax(logits, axis=-1).astype(dtype)
    return p, p


def _softmax_kept_as_bwd(dtype, p, g):
    y, g = p.astype(jnp.float32), g.astype(jnp.float32)
    return (y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)


softmax_kept_as.defvjp(_softmax_kept_as_fwd, _softmax_kept_as_bwd)


def dot_product_attention(q_BQHK: Array, k_BKHK: Array, v_BKHK: Array, mask, *,
                          scale: float, dropout_rate: float = 0.0, dropout_rng=None,
                          impl: str = 'xla', softmax_residual: str = 'float32') -> Array:
    """softmax(q k^T * scale + mask) v with the softmax in float32; returns [B, Q, H, K].

    mask: an AttentionMask built for `impl`, or a boolean [B, 1, Q, K] array. impl: 'xla'
    (written out here), 'dot_product' (jax.nn.dot_product_attention: jax picks the kernel),
    'cudnn' (the same forced to cuDNN flash attention: GPU, bfloat16/float16) or 'splash' (the
    Pallas splash kernel: TPU). softmax_residual ('xla'): 'compute' keeps only the weights in
    v's dtype for the backward pass (softmax_kept_as).
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
    weights_BHQK = attention_weights(
        q_BQHK, k_BKHK, mask.dense_B1QK, scale,
        dtype=v_BKHK.dtype if softmax_residual == 'compute' else None)
    if dropout_rate > 0.0 and dropout_rng is not None:
        weights_BHQK = dropout(weights_BHQK, dropout_rate, dropout_rng)
    return jnp.einsum('bhqs,bshk->bqhk', weights_BHQK.astype(v_BKHK.dtype), v_BKHK)


_SPLASH_BLOCK = 128  # the kernel's tile; lengths are padded up to a multiple of it


def splash_attention(q_BQHK: Array, k_BKHK: Array, v_BKHK: Array, mask: AttentionMask, *,
                     scale: float, interpret: bool = False) -> Array:
    """Attention through jax's Pallas splash attention kernel for TPU (segment ids + causal).

    Lengths are padded to a multiple of 128 (with segment ids no real token has, cut off again).
    Under a mesh the kernel runs per shard (shard_map over the mesh axes not already manual):
    batch split as 'batch', heads as 'heads', lengths whole. interpret=True: the kernel's Python
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
    # Inside a shard_map (the prediction function's) the arrays are already this device's block.
    free = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if math.prod(mesh.shape[a] for a in free) == 1:
        return per_shard(*args)
    qkv = _splash_spec(('batch', 'length', 'heads', 'kv'), free)
    seg = _splash_spec(('batch', 'length'), free)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg),
                         out_specs=qkv, axis_names=set(free), check_vma=False)(*args)


def _splash_spec(names: tuple[str, ...], free: tuple[str, ...]) -> jax.sharding.PartitionSpec:
    """The logical axes' mesh axes (the active rules), keeping only the axes in `free`."""
    def keep(axes):
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in free)
        return axes[0] if len(axes) == 1 else (axes or None)

    return jax.sharding.PartitionSpec(*map(keep, nn.logical_to_mesh_axes(names)))


# ----------------------------------------------------------------------------------------------
# The layer


def apply_rope(x_BLHK: Array, positions_BL: Array) -> Array:
    """Rotary position embedding (Su et al. 2021) on the last axis, pairs (i, i + K/2)."""
    k = x_BLHK.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    angle_BLK2 = positions_BL[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BLK2)[:, :, None, :], jnp.cos(angle_BLK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


def _head_projection(cfg, direction: str, name: str) -> nn.DenseGeneral:
    """x W (+ b) between [.., D] and [.., H, K] ('in': q/k/v; 'out': the output projection).

    Glorot uniform over the flattened [fan_in, fan_out] matrix, as a plain Dense layer's; kernel
    and bias stored in their true shapes, a logical name per dimension (the inits reshape first:
    flax would apply the names to its flat draw). Biases only with cfg.attention_bias.
    """
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    if direction == 'in':
        features, axis = (h, k), -1
        kernel = (d, h, k), ('embed', 'heads', 'kv')
        bias = (h, k), ('heads', 'kv')
    else:
        features, axis = d, (-2, -1)
        kernel = (h, k, d), ('heads', 'kv', 'embed')
        bias = (d,), ('embed',)

    def shaped(init, shape_names):
        shape, names = shape_names
        return nn.with_logical_partitioning(
            lambda key, flat, dtype=jnp.float32: init(key, flat, dtype).reshape(shape), names)

    return nn.DenseGeneral(
        features, axis=axis, use_bias=cfg.attention_bias, dtype=cfg.dtype, name=name,
        kernel_init=shaped(nn.initializers.xavier_uniform(), kernel),
        bias_init=shaped(nn.initializers.zeros_init(), bias))


class MultiHeadAttention(nn.Module):
    """Multi-head attention with q, k, v, o projections (biases only with config.attention_bias).

    kind: 'self' (keys from x itself, a growing cache in decode mode; causality is in the mask)
    or 'cross' (keys from the encoder output, projected once and cached in decode mode).
    """

    config: Any  # the model's TransformerConfig (the fields the module docstring lists)
    kind: str = 'self'

    @nn.compact
    def __call__(self, x_BQD, kv_BSD, mask_B1QS, q_positions_BQ=None, kv_positions_BS=None,
                 cache_index=None):
        cfg = self.config
        rope = cfg.position_embedding == 'rope' and self.kind == 'self'
        q_BQHK = _head_projection(cfg, 'in', 'query')(x_BQD)
        if rope:
            q_BQHK = apply_rope(q_BQHK, q_positions_BQ)

        scale = cfg.head_dim ** -0.5 if cfg.scale_attention else 1.0
        if cfg.decode:
            out_BQHK = self._decode_attention(q_BQHK, kv_BSD, mask_B1QS, kv_positions_BS,
                                              cache_index, scale)
            return _head_projection(cfg, 'out', 'out')(out_BQHK)

        k_BSHK = _head_projection(cfg, 'in', 'key')(kv_BSD)
        v_BSHK = _head_projection(cfg, 'in', 'value')(kv_BSD)
        if rope:
            k_BSHK = apply_rope(k_BSHK, kv_positions_BS)
        q_BQHK = nn.with_logical_constraint(q_BQHK, ('batch', 'length', 'heads', 'kv'))
        if cfg.sow_attention:  # the weights this layer uses (before attention dropout)
            dense_B1QS = mask_B1QS.dense_B1QK if isinstance(mask_B1QS, AttentionMask) \
                else mask_B1QS
            self.sow('intermediates', 'attention_weights',
                     attention_weights(q_BQHK, k_BSHK, dense_B1QS, scale))
        dropout_rng = None
        if not cfg.deterministic and cfg.attention_dropout_rate > 0:
            dropout_rng = self.make_rng('dropout')
        out_BQHK = dot_product_attention(
            q_BQHK, k_BSHK, v_BSHK, mask_B1QS, scale=scale,
            dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,
            impl=cfg.attention_impl, softmax_residual=cfg.softmax_residual,
        )
        out_BQD = _head_projection(cfg, 'out', 'out')(out_BQHK)
        return nn.with_logical_constraint(out_BQD, ('batch', 'length', 'embed'))

    def _decode_attention(self, q_B1HK, kv_BSD, mask, kv_positions_BS, cache_index, scale):
        """Decode mode: one query per row over the cached keys/values, kept head-major
        [B, H, L, K] (the layout a matmul over (B, H) reads as it is; any attention_impl: one
        query gains nothing from a fused kernel)."""
        cfg = self.config
        if self.kind == 'cross':
            k_BHSK, v_BHSK = self._cross_cache(kv_BSD)
        else:
            k_B1HK = _head_projection(cfg, 'in', 'key')(kv_BSD)
            if cfg.position_embedding == 'rope':
                k_B1HK = apply_rope(k_B1HK, kv_positions_BS)
            k_BHSK, v_BHSK, mask = self._self_cache(
                k_B1HK, _head_projection(cfg, 'in', 'value')(kv_BSD), cache_index)
        mask_B11S = mask.dense_B1QK if isinstance(mask, AttentionMask) else mask
        weights_BH1S = attention_weights(q_B1HK, k_BHSK, mask_B11S, scale, keys='bhsk')
        if cfg.sow_attention:
            self.sow('intermediates', 'attention_weights', weights_BH1S)
        return jnp.einsum('bhqs,bhsk->bqhk', weights_BH1S.astype(v_BHSK.dtype), v_BHSK)

    def _self_cache(self, k_B1HK, v_B1HK, cache_index):
        """Writes this step's key/value at cache_index: (the buffers [B, H, decode_len, K], the
        mask [B, 1, 1, decode_len] of the positions <= cache_index)."""
        cfg = self.config
        b, _, h, k = k_B1HK.shape
        initialized = self.has_variable('cache', 'cached_key')
        shape = (b, h, cfg.decode_len, k)
        ck = self.variable('cache', 'cached_key', jnp.zeros, shape, k_B1HK.dtype)
        cv = self.variable('cache', 'cached_value', jnp.zeros, shape, v_B1HK.dtype)
        if not initialized:  # the call that creates the cache does not decode a token
            return (k_B1HK.swapaxes(1, 2), v_B1HK.swapaxes(1, 2),
                    jnp.ones((b, 1, 1, 1), bool))
        at = (0, 0, cache_index, 0)
        ck.value = jax.lax.dynamic_update_slice(ck.value, k_B1HK.swapaxes(1, 2), at)
        cv.value = jax.lax.dynamic_update_slice(cv.value, v_B1HK.swapaxes(1, 2), at)
        mask_B11L = (jnp.arange(cfg.decode_len) <= cache_index)[None, None, None, :]
        return ck.value, cv.value, jnp.broadcast_to(mask_B11L, (b, 1, 1, cfg.decode_len))

    def _cross_cache(self, encoded_BSD):
        """Keys/values [B, H, S, K] of the encoder output, projected once, in 'cross_cache':
        they never change, so a beam search never reorders them (decode.py's constants)."""
        def project(name):
            return lambda: _head_projection(self.config, 'in', name)(encoded_BSD).swapaxes(1, 2)

        ck = self.variable('cross_cache', 'cross_key', project('key'))
        cv = self.variable('cross_cache', 'cross_value', project('value'))
        return ck.value, cv.value
