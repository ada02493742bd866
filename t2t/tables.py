"""The token tables as one pass of the model reads them (t2t/model.py: Transformer.token_tables).

A pass looks tokens up in the source and target tables and projects the decoder output onto the
output table (the target table when tied). Under data parallelism it reads each table in one
copy per batch shard, so that the table's gradient is reduced across devices once a step; the
model itself has one lookup path and one projection, these objects' `lookup` and `logits`.

Shape letters: B batch rows, L any length, T target length, D d_model, V vocabulary,
S batch shards (devices the batch is split over).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from t2t import sharding

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TokenTable:
    """A float32 [V, D] table as one pass reads it: the table itself, or, when the batch is split
    over data-parallel devices, one copy per batch shard ([S, V, D], sharding.per_batch_shard),
    each shard's rows reading their own copy. The reads of a copy leave their gradients in its
    shard's slot, and the transpose of the broadcast that made the copies, a sum over S, reduces
    the table's gradient across devices once a step, however many reads there are (the two
    lookups and the tied output projection), like every other gradient."""

    w: Array  # [V, D] or [S, V, D]

    @classmethod
    def copies(cls, w_VD: Array, shards: int) -> TokenTable:
        """The table read in `shards` copies (sharding.per_batch_shard); 1: the table itself."""
        return cls(w_VD if shards == 1 else sharding.per_batch_shard(w_VD, shards))

    def lookup(self, ids_BL: Array) -> Array:
        """The rows of `ids_BL`: [B, L, D] float32.

        The lookup reads the table whole along D: under fsdp, where D is split over the devices
        that split the batch, from the all-gather of the table that the tied output projection
        makes too, then a gather of each device's own rows. Left to itself XLA gathered every
        device's D-slice of the rows of the whole batch and redistributed them by all-to-all, in
        both lookups and their gradients. Only the lookup's read is constrained: constraining
        the projection's as well made its dW an all-reduce of the whole table on top of the
        reduce-scatter (bench/RESULTS.md, "The fsdp all-to-alls").
        """
        if self.w.ndim == 2:
            w_VD = nn.with_logical_constraint(self.w, ('vocab', None))
            return jnp.take(w_VD, ids_BL, axis=0)
        s, b, length = self.w.shape[0], *ids_BL.shape
        ids_SBL = nn.with_logical_constraint(ids_BL.reshape(s, b // s, length),
                                             ('batch', None, 'length'))
        x_SBLD = jax.vmap(lambda t_VD, i_BL: jnp.take(t_VD, i_BL, axis=0))(self.w, ids_SBL)
        return x_SBLD.reshape(b, length, -1)

    def logits(self, y_BTD: Array) -> Array:
        """y W^T [B, T, V]: y in the compute dtype, W cast to it, float32 accumulation, output."""
        w = self.w.astype(y_BTD.dtype)
        if w.ndim == 2:
            return jnp.einsum('btd,vd->btv', y_BTD, w, preferred_element_type=jnp.float32)
        s, b, t, d = w.shape[0], *y_BTD.shape
        y_SBTD = nn.with_logical_constraint(y_BTD.reshape(s, b // s, t, d),
                                            ('batch', None, 'length', 'embed'))
        logits_SBTV = jnp.einsum('sbtd,svd->sbtv', y_SBTD, w, preferred_element_type=jnp.float32)
        return logits_SBTV.reshape(b, t, -1)


@dataclasses.dataclass(frozen=True)
class TokenTables:
    """The tables one pass reads (Transformer.token_tables): the same object where shared/tied."""

    source: TokenTable  # the encoder's lookups
    target: TokenTable  # the decoder's lookups
    output: TokenTable  # the output projection (the target table when tied)
