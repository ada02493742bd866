"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

The defaults are the paper's: post-LN residual blocks LayerNorm(x + Dropout(Sublayer(x))),
sinusoidal positions, embeddings multiplied by sqrt(d_model), one embedding shared by source and
target and tied to the output projection, ReLU feed-forward, scaled dot-product attention. Options
cover what ablations ask for: pre-LN, learned, rotary or no positions, head count, no 1/sqrt(d_k)
scaling, separate embeddings, bfloat16 compute (parameters stay float32) and the attention
kernel (attention_impl: 'xla', 'dot_product', 'cudnn' = cuDNN flash attention on GPU, 'splash' =
the Pallas splash attention kernel on TPU). Speed/memory options that never change the results:
rematerialization of each layer (remat) and one nn.scan over the identical layers of each stack
(scan_layers: parameters stacked with a leading 'layers' axis, see t2t/layers_convert.py).
Dropout draws 16 random bits per element (t2t/dropout.py: keep probability within 2^-17 of
1 - rate, kept values scaled by its exact inverse).

Shape letters: B batch, S source length, T target length, L any length, D d_model, H heads,
K head dim (d_k = d_v = D / H), F d_ff, V vocabulary.

Masks (padding, causality, packed segments) are built once at the top of encode()/decode(), in
the form the attention kernel wants (`AttentionMask`), and passed down. decode() is the
teacher-forced decoder (gold targets, shifted right here); features() stops before the output
projection (the loss applies it chunk by chunk, t2t/loss.py). In decode mode (config.decode)
decode_step() runs one token per call and the decoder keeps its self-attention keys/values
(head-major buffers [B, H, decode_len, K]) in the 'cache' collection and the cross-attention
keys/values, projected once from the encoder output, in 'cross_cache' ([B, H, S, K]). The first
apply without them (mutable=['cache', 'cross_cache']) creates both and decodes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from t2t.dropout import Dropout, dropout
from t2t.ids import EOS_ID, PAD_ID  # noqa: F401 (re-exported: t2t.model.EOS_ID)

Array = jax.Array
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_POSITIONS = ('sinusoidal', 'learned', 'rope', 'none')
_ATTENTION_IMPLS = ('xla', 'dot_product', 'cudnn', 'splash')
_REMAT_POLICIES = {'none': None, 'full': None,
                   'dots_saveable': jax.checkpoint_policies.dots_saveable}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Static model hyperparameters; hashable, so it may be closed over by jitted code."""

    vocab_size: int
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    relu_dropout_rate: float = 0.0
    pre_ln: bool = False
    position_embedding: str = 'sinusoidal'
    max_position: int = 1024
    scale_attention: bool = True
    scale_embeddings: bool = True
    share_embeddings: bool = True
    tie_output: bool = True
    dtype: Any = jnp.float32
    attention_impl: str = 'xla'
    remat: str = 'none'  # 'none', 'dots_saveable' (keep matmul outputs) or 'full' (keep inputs)
    scan_layers: bool = False  # one nn.scan over each stack's layers (stacked parameters)
    layer_norm_epsilon: float = 1e-6
    deterministic: bool = False
    decode: bool = False
    decode_len: int = 0  # length of the self-attention cache in decode mode
    # Store every attention's weights [B, H, Q, K] in the 'intermediates' collection (apply with
    # mutable=['intermediates']); off in training, which then pays nothing for it.
    sow_attention: bool = False

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f'd_model={self.d_model} is not divisible by num_heads={self.num_heads}')
        if self.position_embedding not in _POSITIONS:
            raise ValueError(f'position_embedding={self.position_embedding!r}; one of {_POSITIONS}')
        if self.attention_impl not in _ATTENTION_IMPLS:
            raise ValueError(f'attention_impl={self.attention_impl!r}; one of {_ATTENTION_IMPLS}')
        if self.remat not in _REMAT_POLICIES:
            raise ValueError(f'remat={self.remat!r}; one of {tuple(_REMAT_POLICIES)}')
        if self.position_embedding == 'rope' and (self.d_model // self.num_heads) % 2:
            raise ValueError('rope needs an even head dimension d_model / num_heads')
        for name in ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate'):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f'{name}={getattr(self, name)} is not in [0, 1)')
        if self.attention_impl != 'xla' and self.attention_dropout_rate > 0:
            raise ValueError(
                f'attention_impl={self.attention_impl!r} has no dropout on attention weights: '
                'set attention_dropout_rate=0 or attention_impl=xla'
            )
        if self.sow_attention and self.attention_impl not in ('xla', 'dot_product'):
            raise ValueError(f'sow_attention needs the dense-mask attention (xla or dot_product), '
                             f'not attention_impl={self.attention_impl!r}')

    @classmethod
    def from_config(cls, config, **overrides) -> TransformerConfig:
        """The boundary from a ConfigDict (never passed to jitted code) to this frozen dataclass."""
        if config.dtype not in _DTYPES:
            raise ValueError(f'dtype={config.dtype!r}; one of {tuple(_DTYPES)}')
        kwargs = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
        kwargs['dtype'] = _DTYPES[config.dtype]
        kwargs.update(overrides)
        return cls(**kwargs)

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# ----------------------------------------------------------------------------------------------
# Positions


def sinusoidal_table(num_positions: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); [L, D]."""
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angle = pos / np.power(10000.0, two_i / d_model)
    table = np.zeros((num_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table.astype(np.float32)


def apply_rope(x_BLHK: Array, positions_BL: Array) -> Array:
    """Rotary position embedding (Su et al. 2021) on the last axis, pairs (i, i + K/2)."""
    k = x_BLHK.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    angle_BLK2 = positions_BL[..., None].astype(jnp.float32) * inv_freq
    sin, cos = jnp.sin(angle_BLK2)[:, :, None, :], jnp.cos(angle_BLK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


# ----------------------------------------------------------------------------------------------
# Masks, built once at the top of encode()/decode()


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


def shift_right(targets_BT: Array, segment_ids_BT=None) -> Array:
    """Decoder inputs: targets moved right by one, PAD_ID as start token, per packed segment."""
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]
    if segment_ids_BT is not None:
        # The first token of each packed segment must see the start token, not the previous pair.
        prev_segment = jnp.pad(segment_ids_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        shifted = jnp.where(segment_ids_BT == prev_segment, shifted, PAD_ID)
    return shifted


# ----------------------------------------------------------------------------------------------
# Attention


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
    'batch', heads as 'heads', lengths whole. Inside a shard_map over every mesh axis (the
    prediction function's) it runs on the local block as it is; over some axes only, it splits
    that block over the others. interpret=True runs the kernel's Python interpretation on any
    backend (tests).
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
    # Inside a shard_map (the prediction function's) the axes it maps are manual: the arrays are
    # already this device's block, so only the remaining axes may split it further.
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


def _dense_init(names):
    return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class HeadProjection(nn.Module):
    """x W + b between [.., D] and [.., H, K] ('in': q/k/v projections; 'out': the output one).

    Written out rather than nn.DenseGeneral so the kernel is created in its true 3-D shape and
    carries one logical name per dimension.
    """

    config: TransformerConfig
    direction: str = 'in'

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
        if self.direction == 'in':
            names, shape, bias_names, bias_shape = ('embed', 'heads', 'kv'), (d, h, k), \
                ('heads', 'kv'), (h, k)
            fan_in, fan_out, spec = d, h * k, 'bld,dhk->blhk'
        else:
            names, shape, bias_names, bias_shape = ('heads', 'kv', 'embed'), (h, k, d), \
                ('embed',), (d,)
            fan_in, fan_out, spec = h * k, d, 'blhk,hkd->bld'
        # Glorot uniform over the flattened (fan_in, fan_out) matrix, as for a plain Dense layer.
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        kernel_init = nn.with_logical_partitioning(
            lambda key, shp, dtype: jax.random.uniform(key, shp, dtype, -limit, limit), names)
        kernel = self.param('kernel', kernel_init, shape, jnp.float32)
        bias = self.param('bias', _zeros(bias_names), bias_shape, jnp.float32)
        y = jnp.einsum(spec, x.astype(cfg.dtype), kernel.astype(cfg.dtype))
        return y + bias.astype(cfg.dtype)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with q, k, v, o projections (with biases, as the paper counts them).

    kind: 'self' (keys from x itself, causal if `causal`, a growing cache in decode mode) or
    'cross' (keys from the encoder output, projected once and cached in decode mode).
    """

    config: TransformerConfig
    kind: str = 'self'
    causal: bool = False

    def _project(self, name, x_BLD):
        cfg = self.config
        return HeadProjection(cfg, 'in', name=name)(x_BLD)

    @nn.compact
    def __call__(self, x_BQD, kv_BSD, mask_B1QS, q_positions_BQ=None, kv_positions_BS=None,
                 cache_index=None):
        cfg = self.config
        rope = cfg.position_embedding == 'rope' and self.kind == 'self'
        q_BQHK = self._project('query', x_BQD)
        if rope:
            q_BQHK = apply_rope(q_BQHK, q_positions_BQ)

        scale = cfg.head_dim ** -0.5 if cfg.scale_attention else 1.0
        if cfg.decode:
            out_BQHK = self._decode_attention(q_BQHK, kv_BSD, mask_B1QS, kv_positions_BS,
                                              cache_index, scale)
            return HeadProjection(cfg, 'out', name='out')(out_BQHK)

        k_BSHK = self._project('key', kv_BSD)
        v_BSHK = self._project('value', kv_BSD)
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
            impl=cfg.attention_impl,
        )
        out_BQD = HeadProjection(cfg, 'out', name='out')(out_BQHK)
        return nn.with_logical_constraint(out_BQD, ('batch', 'length', 'embed'))

    def _decode_attention(self, q_B1HK, kv_BSD, mask, kv_positions_BS, cache_index, scale):
        """Decode mode: one query per row over the cached keys/values.

        The caches are kept head-major, [B, H, L, K], the layout a batched matmul over (B, H)
        reads as it is: stored as [B, L, H, K] they were transposed in full at every step.
        One query gains nothing from a fused kernel, so every attention_impl takes this path.
        """
        cfg = self.config
        if self.kind == 'cross':
            k_BHSK, v_BHSK = self._cross_cache(kv_BSD)
        else:
            k_B1HK = self._project('key', kv_BSD)
            if cfg.position_embedding == 'rope':
                k_B1HK = apply_rope(k_B1HK, kv_positions_BS)
            k_BHSK, v_BHSK, mask = self._self_cache(
                k_B1HK, self._project('value', kv_BSD), cache_index)
        mask_B11S = mask.dense_B1QK if isinstance(mask, AttentionMask) else mask
        weights_BH1S = attention_weights(q_B1HK, k_BHSK, mask_B11S, scale, keys='bhsk')
        if cfg.sow_attention:
            self.sow('intermediates', 'attention_weights', weights_BH1S)
        return jnp.einsum('bhqs,bhsk->bqhk', weights_BH1S.astype(v_BHSK.dtype), v_BHSK)

    def _self_cache(self, k_B1HK, v_B1HK, cache_index):
        """Writes this step's key/value at cache_index; attends to positions <= cache_index.

        Returns the head-major buffers [B, H, decode_len, K] and the mask [B, 1, 1, decode_len].
        """
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
        """Head-major keys/values [B, H, S, K] of the encoder output, projected once when the
        cache is created.

        They live in their own collection, 'cross_cache': they never change while decoding, so a
        beam search need not reorder them with the growing self-attention 'cache'.
        """
        def project(name):
            return lambda: self._project(name, encoded_BSD).swapaxes(1, 2)

        ck = self.variable('cross_cache', 'cross_key', project('key'))
        cv = self.variable('cross_cache', 'cross_value', project('value'))
        return ck.value, cv.value


# ----------------------------------------------------------------------------------------------
# Blocks


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, with optional dropout on the ReLU activations."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLD):
        cfg = self.config
        h_BLF = nn.Dense(cfg.d_ff, dtype=cfg.dtype, name='wi', kernel_init=_dense_init(
            ('embed', 'mlp')), bias_init=_zeros(('mlp',)))(x_BLD)
        h_BLF = nn.relu(h_BLF)
        h_BLF = nn.with_logical_constraint(h_BLF, ('batch', 'length', 'mlp'))
        h_BLF = Dropout(cfg.relu_dropout_rate)(h_BLF, deterministic=cfg.deterministic)
        return nn.Dense(cfg.d_model, dtype=cfg.dtype, name='wo', kernel_init=_dense_init(
            ('mlp', 'embed')), bias_init=_zeros(('embed',)))(h_BLF)


def _layer_norm(cfg: TransformerConfig, name: str):
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name=name,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ('embed',)),
        bias_init=_zeros(('embed',)),
    )


class Residual(nn.Module):
    """Post-LN: LayerNorm(x + Dropout(f(x))) (the paper). Pre-LN: x + Dropout(f(LayerNorm(x)))."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLD, sublayer):
        cfg = self.config
        norm = _layer_norm(cfg, 'norm')
        y_BLD = sublayer(norm(x_BLD) if cfg.pre_ln else x_BLD)
        y_BLD = Dropout(cfg.dropout_rate)(y_BLD, deterministic=cfg.deterministic)
        out_BLD = x_BLD + y_BLD
        return out_BLD if cfg.pre_ln else norm(out_BLD)


class EncoderLayer(nn.Module):
    config: TransformerConfig
    scanned: bool = False  # under nn.scan: returns (carry, None)

    @nn.compact
    def __call__(self, x_BSD, mask_B1SS, positions_BS):
        cfg = self.config
        attn = MultiHeadAttention(cfg, 'self', name='self_attention')
        x_BSD = Residual(cfg, name='attention_block')(
            x_BSD, lambda h: attn(h, h, mask_B1SS, positions_BS, positions_BS))
        x_BSD = Residual(cfg, name='ffn_block')(x_BSD, FeedForward(cfg, name='ffn'))
        return (x_BSD, None) if self.scanned else x_BSD


class DecoderLayer(nn.Module):
    config: TransformerConfig
    scanned: bool = False  # under nn.scan: returns (carry, None)

    @nn.compact
    def __call__(self, y_BTD, encoded_BSD, self_mask_B1TT, cross_mask_B1TS, positions_BT,
                 cache_index=None):
        cfg = self.config
        self_attn = MultiHeadAttention(cfg, 'self', causal=True, name='self_attention')
        cross_attn = MultiHeadAttention(cfg, 'cross', name='cross_attention')
        y_BTD = Residual(cfg, name='self_attention_block')(
            y_BTD, lambda h: self_attn(h, h, self_mask_B1TT, positions_BT, positions_BT,
                                       cache_index=cache_index))
        y_BTD = Residual(cfg, name='cross_attention_block')(
            y_BTD, lambda h: cross_attn(h, encoded_BSD, cross_mask_B1TS))
        y_BTD = Residual(cfg, name='ffn_block')(y_BTD, FeedForward(cfg, name='ffn'))
        return (y_BTD, None) if self.scanned else y_BTD


def layer_stack(cfg: TransformerConfig, layer_cls, num_layers: int, prefix: str):
    """The layers of one stack: a list `<prefix>_<i>`, or one scanned module `<prefix>_layers`.

    Rematerialization (cfg.remat) wraps each layer; it is off in decode mode. Scanned, every
    parameter gets a leading axis of num_layers with the logical name 'layers', and the decode
    caches a second axis (batch stays first, as beam search expects).
    """
    cls = layer_cls
    if cfg.remat != 'none' and not cfg.decode:
        cls = nn.remat(cls, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if not cfg.scan_layers:
        return [cls(cfg, name=f'{prefix}_{i}') for i in range(num_layers)]
    scanned = nn.scan(
        cls, length=num_layers, variable_axes={'params': 0, 'cache': 1, 'cross_cache': 1,
                                               'intermediates': 0},
        split_rngs={'params': True, 'dropout': True},
        in_axes=(nn.broadcast,) * (5 if layer_cls is DecoderLayer else 2),
        metadata_params={nn.PARTITION_NAME: 'layers'})
    return scanned(cfg, scanned=True, name=f'{prefix}_layers')


def _run_stack(layers, x, *args):
    if isinstance(layers, list | tuple):  # setup turns lists into tuples
        for layer in layers:
            x = layer(x, *args)
        return x
    return layers(x, *args)[0]


class Embedder(nn.Module):
    """Token embedding (x sqrt(D)) plus positions, with dropout; also the tied output projection."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = self.param(
            'embedding',
            nn.with_logical_partitioning(
                nn.initializers.normal(stddev=cfg.d_model ** -0.5), ('vocab', 'embed')),
            (cfg.vocab_size, cfg.d_model), jnp.float32,
        )
        if cfg.position_embedding == 'learned':
            self.position_table = self.param(
                'position_embedding',
                nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, 'embed')),
                (cfg.max_position, cfg.d_model), jnp.float32,
            )
        self.dropout = Dropout(cfg.dropout_rate)

    def __call__(self, ids_BL, positions_BL):
        cfg = self.config
        x_BLD = jnp.take(self.embedding, ids_BL, axis=0)
        if cfg.scale_embeddings:
            x_BLD = x_BLD * math.sqrt(cfg.d_model)
        if cfg.position_embedding in ('sinusoidal', 'learned'):
            # Positions are < the row length (packed ones restart per segment; in decode mode the
            # cache index is < decode_len): a length within the table keeps every read in range.
            # Checked while tracing, so it is an error before any compile; mode='clip' replaces
            # jnp.take's NaN fill, which the check leaves unreachable.
            length = cfg.decode_len if cfg.decode else ids_BL.shape[1]
            if length > cfg.max_position:
                raise ValueError(f'sequence length {length} exceeds max_position='
                                 f'{cfg.max_position} (the position table)')
            table = (jnp.asarray(sinusoidal_table(cfg.max_position, cfg.d_model))
                     if cfg.position_embedding == 'sinusoidal' else self.position_table)
            x_BLD = x_BLD + jnp.take(table, positions_BL, axis=0, mode='clip')
        x_BLD = self.dropout(x_BLD.astype(cfg.dtype), deterministic=cfg.deterministic)
        return nn.with_logical_constraint(x_BLD, ('batch', 'length', 'embed'))

    def attend(self, y_BTD):
        """Output logits y E^T in float32 (compute-dtype inputs, float32 accumulation)."""
        return output_logits(y_BTD, self.embedding)


def output_logits(y_BTD: Array, w_VD: Array) -> Array:
    """Logits y W^T: y in the compute dtype, W cast to it, float32 accumulation and output."""
    return jnp.einsum('btd,vd->btv', y_BTD, w_VD.astype(y_BTD.dtype),
                      preferred_element_type=jnp.float32)


class OutputProjection(nn.Module):
    """The untied output projection: a [D, V] kernel, no bias."""

    config: TransformerConfig

    def setup(self):
        self.kernel = self.param('kernel', _dense_init(('embed', 'vocab')),
                                 (self.config.d_model, self.config.vocab_size), jnp.float32)

    def __call__(self, y_BTD):
        return output_logits(y_BTD, self.kernel.T)


class DecodePosition(nn.Module):
    """The position of the token being decoded: a cache counter advanced by one per call."""

    @nn.compact
    def __call__(self):
        existed = self.has_variable('cache', 'index')
        index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
        position = index.value
        if existed:  # the call that creates the cache decodes nothing and does not advance it
            index.value = position + 1
        return position


# ----------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    """Encoder-decoder; __call__ is the teacher-forced training/eval pass: logits [B, T, V]."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.source_embedder = Embedder(cfg, name='embedder' if cfg.share_embeddings
                                        else 'source_embedder')
        self.target_embedder = (self.source_embedder if cfg.share_embeddings
                                else Embedder(cfg, name='target_embedder'))
        self.encoder_layers = layer_stack(cfg, EncoderLayer, cfg.num_encoder_layers, 'encoder')
        self.decoder_layers = layer_stack(cfg, DecoderLayer, cfg.num_decoder_layers, 'decoder')
        if cfg.pre_ln:  # pre-LN stacks end with a LayerNorm; post-LN outputs are normed already
            self.encoder_norm = _layer_norm(cfg, 'encoder_norm')
            self.decoder_norm = _layer_norm(cfg, 'decoder_norm')
        if cfg.decode:
            self.decode_position = DecodePosition(name='decode_position')
        if not cfg.tie_output:
            self.output_projection = OutputProjection(cfg, name='output_projection')

    def encode(self, inputs_BS, inputs_positions_BS=None, inputs_segment_ids_BS=None):
        """Encoder output [B, S, D]."""
        valid_BS = inputs_BS != PAD_ID
        mask_B1SS = make_attention_mask(self.config.attention_impl, valid_BS, valid_BS,
                                        inputs_segment_ids_BS, inputs_segment_ids_BS)
        if inputs_positions_BS is None:
            inputs_positions_BS = _arange_like(inputs_BS)
        x_BSD = self.source_embedder(inputs_BS, inputs_positions_BS)
        x_BSD = _run_stack(self.encoder_layers, x_BSD, mask_B1SS, inputs_positions_BS)
        if self.config.pre_ln:
            x_BSD = self.encoder_norm(x_BSD)
        return x_BSD

    def decoder_output(self, encoded_BSD, inputs_BS, targets_BT, targets_positions_BT=None,
                       inputs_segment_ids_BS=None, targets_segment_ids_BT=None):
        """The teacher-forced decoder's last hidden states [B, T, D] (compute dtype).

        `targets_BT` are the gold targets; they are shifted right here.
        """
        cfg = self.config
        if cfg.decode:
            raise ValueError('a decode-mode Transformer runs decode_step(), one token per call')
        src_valid_BS = inputs_BS != PAD_ID
        y_in_BT = shift_right(targets_BT, targets_segment_ids_BT)
        if targets_positions_BT is None:
            targets_positions_BT = _arange_like(targets_BT)
        tgt_valid_BT = targets_BT != PAD_ID
        self_mask_B1TT = make_attention_mask(cfg.attention_impl, tgt_valid_BT, tgt_valid_BT,
                                             targets_segment_ids_BT, targets_segment_ids_BT,
                                             causal=True)
        cross_mask_B1TS = make_attention_mask(cfg.attention_impl, tgt_valid_BT, src_valid_BS,
                                              targets_segment_ids_BT, inputs_segment_ids_BS)
        return self._decoder_stack(y_in_BT, encoded_BSD, self_mask_B1TT, cross_mask_B1TS,
                                   targets_positions_BT, None)

    def decode(self, encoded_BSD, inputs_BS, targets_BT, targets_positions_BT=None,
               inputs_segment_ids_BS=None, targets_segment_ids_BT=None):
        """Teacher-forced logits [B, T, V] (float32) of the gold `targets_BT`."""
        y_BTD = self.decoder_output(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                                    inputs_segment_ids_BS, targets_segment_ids_BT)
        return self.logits(y_BTD)

    def decode_step(self, encoded_BSD, inputs_BS, prev_ids_B1):
        """Decode mode: logits [B, 1, V] (float32) of the token after `prev_ids_B1`.

        `prev_ids_B1` is the previous output token (PAD_ID at the first step); the step's
        position is the cache index, advanced by one per call. `encoded_BSD` is read only by the
        call that creates the caches; `inputs_BS` gives the source padding mask.
        """
        cfg = self.config
        if not cfg.decode:
            raise ValueError('decode_step() needs config.decode=True (and decode_len)')
        cache_index = self.decode_position()
        positions_B1 = jnp.full(prev_ids_B1.shape, cache_index, jnp.int32)
        # One query per step: plain masks (the self-attention cache builds its own).
        cross_mask_B11S = make_attention_mask('xla', jnp.ones(prev_ids_B1.shape, bool),
                                              inputs_BS != PAD_ID)
        y_B1D = self._decoder_stack(prev_ids_B1, encoded_BSD, None, cross_mask_B11S,
                                    positions_B1, cache_index)
        return self.logits(y_B1D)

    def _decoder_stack(self, y_in_BT, encoded_BSD, self_mask, cross_mask, positions_BT,
                       cache_index):
        y_BTD = self.target_embedder(y_in_BT, positions_BT)
        y_BTD = _run_stack(self.decoder_layers, y_BTD, encoded_BSD, self_mask, cross_mask,
                           positions_BT, cache_index)
        if self.config.pre_ln:
            y_BTD = self.decoder_norm(y_BTD)
        return y_BTD

    def output_weights(self) -> Array:
        """The output projection as a float32 [V, D] matrix (the embedding when tied)."""
        if self.config.tie_output:
            return self.target_embedder.embedding
        return self.output_projection.kernel.T

    def logits(self, y_BTD):
        """Output logits [B, T, V] in float32 (compute-dtype matmul, float32 accumulation)."""
        logits_BTV = output_logits(y_BTD, self.output_weights())
        return nn.with_logical_constraint(logits_BTV, ('batch', 'length', 'vocab'))

    def features(self, inputs_BS, targets_BT, inputs_positions_BS=None,
                 targets_positions_BT=None, inputs_segment_ids_BS=None,
                 targets_segment_ids_BT=None):
        """(decoder output [B, T, D], output projection [V, D]): the training pass without the
        logits, which the loss computes chunk by chunk (t2t/loss.py)."""
        encoded_BSD = self.encode(inputs_BS, inputs_positions_BS, inputs_segment_ids_BS)
        y_BTD = self.decoder_output(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                                    inputs_segment_ids_BS, targets_segment_ids_BT)
        return y_BTD, self.output_weights()

    def __call__(self, inputs_BS, targets_BT, inputs_positions_BS=None, targets_positions_BT=None,
                 inputs_segment_ids_BS=None, targets_segment_ids_BT=None):
        encoded_BSD = self.encode(inputs_BS, inputs_positions_BS, inputs_segment_ids_BS)
        return self.decode(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                           inputs_segment_ids_BS, targets_segment_ids_BT)


def _arange_like(ids_BL: Array) -> Array:
    return jnp.broadcast_to(jnp.arange(ids_BL.shape[1], dtype=jnp.int32), ids_BL.shape)


def batch_forward_args(batch: dict) -> dict:
    """Keyword arguments of Transformer.__call__ from a (possibly packed) data batch."""
    return dict(
        inputs_BS=batch['inputs'], targets_BT=batch['targets'],
        inputs_positions_BS=batch.get('inputs_positions'),
        targets_positions_BT=batch.get('targets_positions'),
        inputs_segment_ids_BS=batch.get('inputs_segment_ids'),
        targets_segment_ids_BT=batch.get('targets_segment_ids'),
    )
