"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Flax Linen modules.

The defaults are the paper's: post-LN residual blocks LayerNorm(x + Dropout(Sublayer(x))),
sinusoidal positions, embeddings multiplied by sqrt(d_model), one embedding shared by source and
target and tied to the output projection, ReLU feed-forward, scaled dot-product attention with
no biases in its projections (attention_bias=True adds them, as older checkpoints have). Options
cover what ablations ask for: pre-LN, learned, rotary or no positions, head count, no 1/sqrt(d_k)
scaling, separate embeddings, bfloat16 compute (parameters stay float32) and the attention
kernel (attention_impl: 'xla', 'dot_product', 'cudnn' = cuDNN flash attention on GPU, 'splash' =
the Pallas splash attention kernel on TPU; a config's 'auto' is cuDNN where it runs, else 'xla',
t2t/attention_choice.py). Speed/memory options that never change the results: rematerialization
of each layer (remat) and one nn.scan over the identical layers of each stack (scan_layers:
parameters stacked with a leading 'layers' axis, see t2t/run/layers_convert.py).
Dropout draws 16 random bits per element (t2t/dropout.py: keep probability within 2^-17 of
1 - rate, kept values scaled by its exact inverse).

Shape letters: B batch, S source length, T target length, L any length, D d_model, H heads,
K head dim (d_k = d_v = D / H), F d_ff, V vocabulary.

Masks (padding, causality, packed segments) are built once at the top of encode()/decode(), in
the form the attention kernel wants (`AttentionMask`), and passed down (t2t/attention.py holds
masks, kernels and the attention layer). The token tables are read through one object made once
per pass (`TokenTables`: both lookups and the output projection, in copies per batch shard under
data parallelism). decode() is the teacher-forced decoder (gold targets, shifted right here) and
logits() the output projection; features() stops before it (loss_impl='fused' applies it chunk
by chunk, t2t/loss.py). In decode mode (config.decode)
decode_step() runs one token per call and the decoder keeps its self-attention keys/values
(head-major buffers [B, H, decode_len, K]) in the 'cache' collection and the cross-attention
keys/values, projected once from the encoder output, in 'cross_cache' ([B, H, S, K]). The first
apply without them (mutable=['cache', 'cross_cache']) creates both and decodes nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t2t import attention_choice, sharding
from t2t.attention import KERNELS, MultiHeadAttention, make_attention_mask
from t2t.dropout import Dropout
from t2t.ids import PAD_ID
from t2t.tables import TokenTable, TokenTables

Array = jax.Array
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_POSITIONS = ('sinusoidal', 'learned', 'rope', 'none')
_ATTENTION_IMPLS = KERNELS
SOFTMAX_RESIDUALS = ('float32', 'compute')
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
    attention_bias: bool = False  # biases in the q/k/v/o projections (the paper has none)
    scale_embeddings: bool = True
    share_embeddings: bool = True
    tie_output: bool = True
    dtype: Any = jnp.float32
    attention_impl: str = 'xla'
    softmax_residual: str = 'float32'  # 'compute': only the weights in dtype kept for backward
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
        heads = self.num_heads >= 1  # the checks that divide by it wait for its own
        rules = (  # (holds, key, what the key needs), in the order a config is checked
            (self.max_position >= 1, 'max_position', 'must be >= 1'),
            (self.d_model >= 1, 'd_model', 'must be >= 1'),
            (self.d_ff >= 1, 'd_ff', 'must be >= 1'),
            (heads, 'num_heads', 'must be >= 1'),
            (not heads or self.d_model % self.num_heads == 0, 'd_model',
             f'must be divisible by num_heads={self.num_heads}'),
            (self.num_encoder_layers >= 1, 'num_encoder_layers', 'must be >= 1'),
            (self.num_decoder_layers >= 1, 'num_decoder_layers', 'must be >= 1'),
            *((0 <= getattr(self, key) < 1, key, 'must be in [0, 1)')
              for key in ('dropout_rate', 'attention_dropout_rate', 'relu_dropout_rate')),
            (self.position_embedding in _POSITIONS, 'position_embedding',
             f'must be one of {_POSITIONS}'),
            (self.position_embedding != 'rope' or not heads or self.head_dim % 2 == 0,
             'position_embedding', f'needs an even head dimension: d_model={self.d_model} / '
             f'num_heads={self.num_heads}'),
            (self.attention_impl != 'auto', 'attention_impl',
             'names no kernel: resolve it for the devices (TransformerConfig.from_config, '
             't2t/attention_choice.py)'),
            (self.attention_impl in _ATTENTION_IMPLS, 'attention_impl',
             f'must be one of {_ATTENTION_IMPLS}'),
            (self.softmax_residual in SOFTMAX_RESIDUALS, 'softmax_residual',
             f'must be one of {SOFTMAX_RESIDUALS}'),
            (self.attention_dropout_rate == 0 or self.attention_impl == 'xla',
             'attention_dropout_rate', f'needs attention_impl=xla (attention_impl='
             f'{self.attention_impl!r} has no dropout on attention weights)'),
            (self.remat in _REMAT_POLICIES, 'remat', f'must be one of {tuple(_REMAT_POLICIES)}'),
            (not self.sow_attention or self.attention_impl in ('xla', 'dot_product'),
             'sow_attention', 'needs the dense-mask attention (attention_impl xla or '
             f'dot_product, not {self.attention_impl!r})'),
        )
        for holds, key, needs in rules:
            if not holds:
                raise ValueError(f'{key}={getattr(self, key)!r} {needs}')

    @classmethod
    def from_config(cls, config, **overrides) -> TransformerConfig:
        """The boundary from a ConfigDict (never passed to jitted code) to this frozen dataclass.

        attention_impl='auto' becomes the kernel for this process's devices; the entry points
        and the dry runs resolve it first, for the devices the step runs on, and print why
        (t2t/attention_choice.py).
        """
        if config.dtype not in _DTYPES:
            raise ValueError(f'dtype={config.dtype!r} must be one of {tuple(_DTYPES)}')
        kwargs = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
        kwargs['dtype'] = _DTYPES[config.dtype]
        if kwargs.get('attention_impl') == 'auto' and 'attention_impl' not in overrides:
            kwargs['attention_impl'] = attention_choice.resolve_for_this_process(config)[0]
        kwargs.update(overrides)
        return cls(**kwargs)

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# ----------------------------------------------------------------------------------------------
# Positions and the decoder's inputs (rotary positions: t2t/attention.py)


def sinusoidal_table(num_positions: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); [L, D]."""
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angle = pos / np.power(10000.0, two_i / d_model)
    table = np.zeros((num_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return table.astype(np.float32)


def shift_right(targets_BT: Array, segment_ids_BT=None) -> Array:
    """Decoder inputs: targets moved right by one, PAD_ID as start token, per packed segment."""
    shifted = jnp.pad(targets_BT, ((0, 0), (1, 0)), constant_values=PAD_ID)[:, :-1]
    if segment_ids_BT is not None:
        # The first token of each packed segment must see the start token, not the previous pair.
        prev_segment = jnp.pad(segment_ids_BT, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        shifted = jnp.where(segment_ids_BT == prev_segment, shifted, PAD_ID)
    return shifted


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
    """Token embedding (x sqrt(D)) plus positions, with dropout. It holds the table; a pass reads
    it through its TokenTable (the tied output projection reads the same one)."""

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

    def __call__(self, ids_BL, positions_BL, table: TokenTable):
        """table: this embedding's table as the pass reads it (Transformer.token_tables)."""
        cfg = self.config
        x_BLD = table.lookup(ids_BL)
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


class OutputProjection(nn.Module):
    """The untied output projection: a [D, V] kernel, no bias (read as TokenTables.output)."""

    config: TransformerConfig

    def setup(self):
        self.kernel = self.param('kernel', _dense_init(('embed', 'vocab')),
                                 (self.config.d_model, self.config.vocab_size), jnp.float32)


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

    def token_tables(self, rows: int) -> TokenTables:
        """The token tables as a pass over `rows` batch rows reads them: in one copy per batch
        shard when the batch is split over data-parallel devices (sharding.embedding_copies),
        else the tables themselves. Made once per pass, at its top, and handed down."""
        cfg, s = self.config, sharding.embedding_copies(rows)
        target = TokenTable.copies(self.target_embedder.embedding, s)
        source = target if cfg.share_embeddings else TokenTable.copies(
            self.source_embedder.embedding, s)
        output = target if cfg.tie_output else TokenTable(self.output_projection.kernel.T)
        return TokenTables(source=source, target=target, output=output)

    def encode(self, inputs_BS, inputs_positions_BS=None, inputs_segment_ids_BS=None,
               tables: TokenTables | None = None):
        """Encoder output [B, S, D]; tables: the pass's token_tables (default: made here)."""
        if tables is None:
            tables = self.token_tables(inputs_BS.shape[0])
        valid_BS = inputs_BS != PAD_ID
        mask_B1SS = make_attention_mask(self.config.attention_impl, valid_BS, valid_BS,
                                        inputs_segment_ids_BS, inputs_segment_ids_BS)
        if inputs_positions_BS is None:
            inputs_positions_BS = _arange_like(inputs_BS)
        x_BSD = self.source_embedder(inputs_BS, inputs_positions_BS, tables.source)
        x_BSD = _run_stack(self.encoder_layers, x_BSD, mask_B1SS, inputs_positions_BS)
        if self.config.pre_ln:
            x_BSD = self.encoder_norm(x_BSD)
        return x_BSD

    def decoder_output(self, encoded_BSD, inputs_BS, targets_BT, targets_positions_BT=None,
                       inputs_segment_ids_BS=None, targets_segment_ids_BT=None,
                       tables: TokenTables | None = None):
        """The teacher-forced decoder's last hidden states [B, T, D] (compute dtype).

        `targets_BT` are the gold targets; they are shifted right here. tables: see encode().
        """
        cfg = self.config
        if cfg.decode:
            raise ValueError('a decode-mode Transformer runs decode_step(), one token per call')
        if tables is None:
            tables = self.token_tables(targets_BT.shape[0])
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
                                   targets_positions_BT, None, tables.target)

    def decode(self, encoded_BSD, inputs_BS, targets_BT, targets_positions_BT=None,
               inputs_segment_ids_BS=None, targets_segment_ids_BT=None,
               tables: TokenTables | None = None):
        """Teacher-forced logits [B, T, V] (float32) of the gold `targets_BT`."""
        if tables is None:
            tables = self.token_tables(targets_BT.shape[0])
        y_BTD = self.decoder_output(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                                    inputs_segment_ids_BS, targets_segment_ids_BT, tables)
        return self.logits(y_BTD, tables)

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
        tables = self.token_tables(prev_ids_B1.shape[0])
        y_B1D = self._decoder_stack(prev_ids_B1, encoded_BSD, None, cross_mask_B11S,
                                    positions_B1, cache_index, tables.target)
        return self.logits(y_B1D, tables)

    def _decoder_stack(self, y_in_BT, encoded_BSD, self_mask, cross_mask, positions_BT,
                       cache_index, table: TokenTable):
        y_BTD = self.target_embedder(y_in_BT, positions_BT, table)
        y_BTD = _run_stack(self.decoder_layers, y_BTD, encoded_BSD, self_mask, cross_mask,
                           positions_BT, cache_index)
        if self.config.pre_ln:
            y_BTD = self.decoder_norm(y_BTD)
        return y_BTD

    def logits(self, y_BTD, tables: TokenTables | None = None):
        """Output logits [B, T, V] in float32 (compute-dtype matmul, float32 accumulation)."""
        if tables is None:
            tables = self.token_tables(y_BTD.shape[0])
        logits_BTV = tables.output.logits(y_BTD)
        return nn.with_logical_constraint(logits_BTV, ('batch', 'length', 'vocab'))

    def features(self, inputs_BS, targets_BT, inputs_positions_BS=None,
                 targets_positions_BT=None, inputs_segment_ids_BS=None,
                 targets_segment_ids_BT=None):
        """(decoder output [B, T, D], the output projection's TokenTable weights [V, D] or
        [S, V, D]): the training pass without the logits, which loss_impl='fused' computes chunk
        by chunk (t2t/loss.py) from the same table the lookups read."""
        tables = self.token_tables(inputs_BS.shape[0])
        encoded_BSD = self.encode(inputs_BS, inputs_positions_BS, inputs_segment_ids_BS, tables)
        y_BTD = self.decoder_output(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                                    inputs_segment_ids_BS, targets_segment_ids_BT, tables)
        return y_BTD, tables.output.w

    def __call__(self, inputs_BS, targets_BT, inputs_positions_BS=None, targets_positions_BT=None,
                 inputs_segment_ids_BS=None, targets_segment_ids_BT=None):
        tables = self.token_tables(inputs_BS.shape[0])
        encoded_BSD = self.encode(inputs_BS, inputs_positions_BS, inputs_segment_ids_BS, tables)
        return self.decode(encoded_BSD, inputs_BS, targets_BT, targets_positions_BT,
                           inputs_segment_ids_BS, targets_segment_ids_BT, tables)


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


_ATTENTION_BIAS = re.compile(r"(self|cross)_attention\W+(query|key|value|out)\W+bias\b")


def has_attention_bias(tree) -> bool:
    """Whether `tree` (parameters, a train state or a checkpoint's metadata of either) has
    q/k/v/o projection biases: checkpoints written before attention_bias existed have them."""
    return any(_ATTENTION_BIAS.search(jax.tree_util.keystr(path))
               for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def attention_bias_mismatch(what: str, tree, attention_bias: bool) -> str | None:
    """One line naming the --config.attention_bias that restores `tree`, or None if it fits."""
    stored = has_attention_bias(tree)
    if stored == attention_bias:
        return None
    return (f'{what} has {"" if stored else "no "}attention biases but the config has '
            f'attention_bias={attention_bias}: run with --config.attention_bias={stored}')
