"""A model config's parameters, abstractly: shapes without allocating them, and counts."""

from __future__ import annotations

import re

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
