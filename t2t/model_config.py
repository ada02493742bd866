"""The Transformer's hyperparameters (t2t/model.py reads them): a frozen, hashable dataclass made
from an experiment's ConfigDict once, at the boundary (`TransformerConfig.from_config`), and
checked when made."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from t2t import attention_choice
from t2t.attention import KERNELS

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_POSITIONS = ('sinusoidal', 'learned', 'rope', 'none')
_ATTENTION_IMPLS = KERNELS
SOFTMAX_RESIDUALS = ('float32', 'compute')
REMAT_POLICIES = {'none': None, 'full': None,
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
    # The token table read through t2t/tables.py (copies per data-parallel batch shard, fsdp's
    # whole-D lookups); False: jnp.take(E, ids) and y @ E.T as written. One device: the same.
    table_copies: bool = True

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
            (self.remat in REMAT_POLICIES, 'remat', f'must be one of {tuple(REMAT_POLICIES)}'),
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
