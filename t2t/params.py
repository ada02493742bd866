"""A model config's parameters, abstractly: shapes without allocating them, and counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t2t.model import Transformer, TransformerConfig


def abstract_params(model_config: TransformerConfig, length: int = 8):
    """Parameter shapes (jax.ShapeDtypeStruct, logical boxes removed) without allocating them."""
    ids = jnp.ones((1, length), jnp.int32)
    variables = jax.eval_shape(
        lambda: Transformer(model_config).init(jax.random.key(0), ids, ids))
    return nn.unbox(variables['params'])


def count_params(params) -> int:
    """The number of scalars in a parameter tree (arrays or shapes)."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
