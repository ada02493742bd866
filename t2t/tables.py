"""The token table as the model reads it with table_copies on (t2t/model.py: Embedder).

Off, the model reads the embedding E [V, D] as the paper writes it: jnp.take(E, ids) and y @ E.T.
On, it reads it through a `TokenTable`, made once per pass, which computes the same values:
- under data parallelism, in one copy per batch shard ([S, V, D], sharding.per_batch_shard), each
  shard's rows reading their own copy: the transpose of the broadcast that made the copies, a sum
  over S, reduces the table's gradient across devices once a step however many reads there are
  (both lookups and the tied output projection);
- under fsdp, the lookups read the table whole along D, from the all-gather the tied projection
  makes anyway: left to itself XLA moved the rows' D-slices by all-to-alls (bench/RESULTS.md,
  "The fsdp all-to-alls"). Only the lookup's read is constrained: constraining the projection's
  too made its dW an all-reduce on top of the reduce-scatter.

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
    """A float32 table [V, D], and its copies per batch shard [S, V, D] when the batch is split
    over data-parallel devices (else None). A batch whose rows the shards do not divide (init's
    one row) reads the table itself."""

    w_VD: Array
    copies_SVD: Array | None = None

    @classmethod
    def of(cls, w_VD: Array) -> TokenTable:
        shards = sharding.embedding_copies()
        return cls(w_VD, sharding.per_batch_shard(w_VD, shards) if shards > 1 else None)

    def weights(self, rows: int) -> Array:
        """What a pass over `rows` batch rows reads: the copies [S, V, D] or the table [V, D]."""
        if self.copies_SVD is not None and rows % self.copies_SVD.shape[0] == 0:
            return self.copies_SVD
        return self.w_VD

    def lookup(self, ids_BL: Array) -> Array:
        """The rows of `ids_BL`: [B, L, D] float32."""
        w = self.weights(ids_BL.shape[0])
        if w.ndim == 2:
            return jnp.take(nn.with_logical_constraint(w, ('vocab', None)), ids_BL, axis=0)
        s, b, length = w.shape[0], *ids_BL.shape
        ids_SBL = nn.with_logical_constraint(ids_BL.reshape(s, b // s, length),
                                             ('batch', None, 'length'))
        x_SBLD = jax.vmap(lambda t_VD, i_BL: jnp.take(t_VD, i_BL, axis=0))(w, ids_SBL)
        return x_SBLD.reshape(b, length, -1)

    def logits(self, y_BTD: Array) -> Array:
        """y W^T [B, T, V]: y in the compute dtype, W cast to it, float32 accumulation, output."""
        w = self.weights(y_BTD.shape[0]).astype(y_BTD.dtype)
        if w.ndim == 2:
            return jnp.einsum('btd,vd->btv', y_BTD, w, preferred_element_type=jnp.float32)
        s, b, t, d = w.shape[0], *y_BTD.shape
        y_SBTD = nn.with_logical_constraint(y_BTD.reshape(s, b // s, t, d),
                                            ('batch', None, 'length', 'embed'))
        logits_SBTV = jnp.einsum('sbtd,svd->sbtv', y_SBTD, w, preferred_element_type=jnp.float32)
        return logits_SBTV.reshape(b, t, -1)
