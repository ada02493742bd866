"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

The defaults are the paper's: post-LN residual blocks LayerNorm(x + Dropout(Sublayer(x))),
sinusoidal positions, embeddings times sqrt(d_model), one embedding E shared by source and target
and tied to the output projection (logits = y E^T), ReLU feed-forward, attention without biases
(t2t/attention.py: masks, kernels, the layer). Options cover the ablations (pre-LN, learned,
rotary or no positions, untied tables, bias, scaling) and levers that never change a result
(remat, scan_layers, table_copies: t2t/tables.py; docs/performance.md); all are fields of
TransformerConfig (t2t/model_config.py).

`Transformer`: encode() -> decode() (teacher-forced, gold targets shifted right here) -> logits();
__call__ is the three. Masks are built once at the top of encode()/decode() and passed down. In
decode mode (config.decode) decode() runs one token per call, keeping self-attention keys/values
in the 'cache' collection and the cross-attention ones in 'cross_cache'; the first apply
(mutable=['cache', 'cross_cache']) creates both and decodes nothing.

Shape letters: B batch, S source length, T target length, L any length, D d_model, H heads,
K head dim (d_k = d_v = D / H), F d_ff, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from t2t.attention import MultiHeadAttention, make_attention_mask
from t2t.dropout import Dropout
from t2t.ids import PAD_ID
from t2t.model_config import REMAT_POLICIES, TransformerConfig
from t2t.tables import TokenTable

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Positions, packing and the decoder's inputs (rotary positions: t2t/attention.py)


def sinusoidal_table(num_positions: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); [L, D]."""
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angle = pos / np.power(10000.0, two_i / d_model)
    table = np.zeros((num_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table.astype(np.float32)


@struct.dataclass
class Packing:
    """Rows holding several pairs (t2t/data/packing.py): each token's pair (1, 2, ...; 0 on
    padding) and its position in it. Without it a row holds one pair at positions 0, 1, ..."""

    inputs_segment_ids_BS: Array
    targets_segment_ids_BT: Array
    inputs_positions_BS: Array
    targets_positions_BT: Array


def shift_right(targets_BT: Array, segment_ids_BT=None) -> Array:
    """Decoder inputs: targets moved right by one, PAD_ID as start token, per packed segment."""
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]
    if segment_ids_BT is not None:
        # The first token of each packed segment must see the start token, not the previous pair.
        prev_segment = jnp.pad(segment_ids_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        shifted = jnp.where(segment_ids_BT == prev_segment, shifted, PAD_ID)
    return shifted


def _arange_like(ids_BL: Array) -> Array:
    return jnp.broadcast_to(jnp.arange(ids_BL.shape[1], dtype=jnp.int32), ids_BL.shape)


# ----------------------------------------------------------------------------------------------
# Blocks


def _dense_init(names):
    return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


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
    BROADCAST = 2  # the arguments after x: the same for every layer of a stack

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
    BROADCAST = 5

    @nn.compact
    def __call__(self, y_BTD, encoded_BSD, self_mask_B1TT, cross_mask_B1TS, positions_BT,
                 cache_index=None):
        cfg = self.config
        self_attn = MultiHeadAttention(cfg, 'self', name='self_attention')
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
    parameter gets a leading axis of num_layers with the logical name 'layers' (converted by
    t2t/run/layers_convert.py), and the decode caches a second axis (batch stays first).
    """
    cls = layer_cls
    if cfg.remat != 'none' and not cfg.decode:
        cls = nn.remat(cls, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if not cfg.scan_layers:
        return [cls(cfg, name=f'{prefix}_{i}') for i in range(num_layers)]
    scanned = nn.scan(
        cls, length=num_layers, variable_axes={'params': 0, 'cache': 1, 'cross_cache': 1,
                                               'intermediates': 0},
        split_rngs={'params': True, 'dropout': True},
        in_axes=(nn.broadcast,) * layer_cls.BROADCAST,
        metadata_params={nn.PARTITION_NAME: 'layers'})
    return scanned(cfg, scanned=True, name=f'{prefix}_layers')


def _run_stack(layers, x, *args):
    if isinstance(layers, list | tuple):  # setup turns lists into tuples
        for layer in layers:
            x = layer(x, *args)
        return x
    return layers(x, *args)[0]


class Embedder(nn.Module):
    """Token embedding E [V, D] (x sqrt(D)) plus positions, with dropout; attend() is the tied
    output projection y E^T. With table_copies E is read through a TokenTable made once per
    pass (t2t/tables.py), which both lookups and the projection share."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = self.param(
            'embedding',
            nn.with_logical_partitioning(
                nn.initializers.normal(stddev=cfg.d_model ** -0.5), ('vocab', 'embed')),
            (cfg.vocab_size, cfg.d_model), jnp.float32,
        )
        self.table = TokenTable.of(self.embedding) if cfg.table_copies else None
        if cfg.position_embedding == 'learned':
            self.position_table = self.param(
                'position_embedding',
                nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, 'embed')),
                (cfg.max_position, cfg.d_model), jnp.float32,
            )
        self.dropout = Dropout(cfg.dropout_rate)

    def __call__(self, ids_BL, positions_BL):
        cfg = self.config
        if self.table is None:
            x_BLD = jnp.take(self.embedding, ids_BL, axis=0)
        else:
            x_BLD = self.table.lookup(ids_BL)
        if cfg.scale_embeddings:
            x_BLD = x_BLD * math.sqrt(cfg.d_model)
        if cfg.position_embedding in ('sinusoidal', 'learned'):
            # Checked while tracing, an error before any compile: positions stay in the table
            # (they are < the row length, or < decode_len), so mode='clip' never clips.
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
        """y E^T [B, T, V]: E cast to y's (compute) dtype, float32 accumulation and output."""
        if self.table is not None:
            return self.table.logits(y_BTD)
        E_VD = self.embedding.astype(y_BTD.dtype)
        return jnp.matmul(y_BTD, E_VD.T, preferred_element_type=jnp.float32)

    def weights(self, rows: int):
        """E as a pass over `rows` rows reads it: [V, D], or the copies [S, V, D]."""
        return self.embedding if self.table is None else self.table.weights(rows)


class OutputProjection(nn.Module):
    """The untied output projection y W: a [D, V] kernel, no bias."""

    config: TransformerConfig

    def setup(self):
        self.kernel = self.param('kernel', _dense_init(('embed', 'vocab')),
                                 (self.config.d_model, self.config.vocab_size), jnp.float32)

    def __call__(self, y_BTD):
        W_DV = self.kernel.astype(y_BTD.dtype)
        return jnp.matmul(y_BTD, W_DV, preferred_element_type=jnp.float32)


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

    def encode(self, inputs_BS, packing: Packing | None = None):
        """Encoder output [B, S, D]."""
        cfg = self.config
        positions_BS, segments_BS = _arange_like(inputs_BS), None
        if packing is not None:
            positions_BS, segments_BS = packing.inputs_positions_BS, packing.inputs_segment_ids_BS
        valid_BS = inputs_BS != PAD_ID
        mask_B1SS = make_attention_mask(cfg.attention_impl, valid_BS, valid_BS, segments_BS,
                                        segments_BS)
        x_BSD = self.source_embedder(inputs_BS, positions_BS)
        x_BSD = _run_stack(self.encoder_layers, x_BSD, mask_B1SS, positions_BS)
        return self.encoder_norm(x_BSD) if cfg.pre_ln else x_BSD

    def decode(self, encoded_BSD, inputs_BS, targets_BT, packing: Packing | None = None):
        """Decoder output [B, T, D] (compute dtype) of the gold targets, shifted right here.

        Decode mode: one step; targets_BT [B, 1] is the previous output token (PAD_ID first), its
        position the cache index, and encoded_BSD is read only by the call creating the caches.
        """
        cfg = self.config
        src_valid_BS = inputs_BS != PAD_ID
        if cfg.decode:
            cache_index = self.decode_position()
            y_in_BT, positions_BT = targets_BT, jnp.full(targets_BT.shape, cache_index, jnp.int32)
            self_mask_B1TT = None  # the self-attention cache masks what it has not written
            cross_mask_B1TS = make_attention_mask('xla', jnp.ones(targets_BT.shape, bool),
                                                  src_valid_BS)
        else:
            cache_index, positions_BT = None, _arange_like(targets_BT)
            src_seg_BS = tgt_seg_BT = None
            if packing is not None:
                src_seg_BS, tgt_seg_BT = (packing.inputs_segment_ids_BS,
                                          packing.targets_segment_ids_BT)
                positions_BT = packing.targets_positions_BT
            y_in_BT = shift_right(targets_BT, tgt_seg_BT)
            tgt_valid_BT = targets_BT != PAD_ID
            self_mask_B1TT = make_attention_mask(cfg.attention_impl, tgt_valid_BT, tgt_valid_BT,
                                                 tgt_seg_BT, tgt_seg_BT, causal=True)
            cross_mask_B1TS = make_attention_mask(cfg.attention_impl, tgt_valid_BT, src_valid_BS,
                                                  tgt_seg_BT, src_seg_BS)
        y_BTD = self.target_embedder(y_in_BT, positions_BT)
        y_BTD = _run_stack(self.decoder_layers, y_BTD, encoded_BSD, self_mask_B1TT,
                           cross_mask_B1TS, positions_BT, cache_index)
        return self.decoder_norm(y_BTD) if cfg.pre_ln else y_BTD

    def logits(self, y_BTD):
        """The output projection [B, T, V], float32: y E^T tied, y W untied."""
        if self.config.tie_output:
            logits_BTV = self.target_embedder.attend(y_BTD)
        else:
            logits_BTV = self.output_projection(y_BTD)
        return nn.with_logical_constraint(logits_BTV, ('batch', 'length', 'vocab'))

    def output_weights(self, rows: int):
        """The output projection's weights as logits() reads them, [V, D] (or copies [S, V, D]),
        for the loss that projects chunk by chunk (loss_impl='fused', t2t/loss.py)."""
        if self.config.tie_output:
            return self.target_embedder.weights(rows)
        return self.output_projection.kernel.T

    def __call__(self, inputs_BS, targets_BT, packing: Packing | None = None):
        encoded_BSD = self.encode(inputs_BS, packing)
        return self.logits(self.decode(encoded_BSD, inputs_BS, targets_BT, packing))


def decoder_output_and_weights(model: Transformer, inputs_BS, targets_BT, packing=None):
    """__call__ up to the logits (an apply method): (decoder output [B, T, D], output_weights)."""
    y_BTD = model.decode(model.encode(inputs_BS, packing), inputs_BS, targets_BT, packing)
    return y_BTD, model.output_weights(inputs_BS.shape[0])


def batch_forward_args(batch: dict) -> dict:
    """Keyword arguments of Transformer.__call__ from a data batch, packed or not."""
    packing = None
    if 'inputs_segment_ids' in batch:
        packing = Packing(*(batch[f'{side}_{key}'] for key in ('segment_ids', 'positions')
                            for side in ('inputs', 'targets')))
    return dict(inputs_BS=batch['inputs'], targets_BT=batch['targets'], packing=packing)


# ----------------------------------------------------------------------------------------------
# Parameters, abstractly


def abstract_params(model_config: TransformerConfig, length: int = 8):
    """Parameter shapes (jax.ShapeDtypeStruct, logical boxes removed) without allocating them."""
    ids = jnp.ones((1, length), jnp.int32)
    variables = jax.eval_shape(
        lambda: Transformer(model_config).init(jax.random.key(0), ids, ids))
    return nn.unbox(variables['params'])


def count_params(params) -> int:
    """The number of scalars in a parameter tree (arrays or shapes)."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
