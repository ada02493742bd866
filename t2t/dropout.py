"""Dropout whose keep mask costs 16 random bits per element instead of 32.

Every random 32-bit word gives the masks of two elements (its low and high halves): the
generator, most of dropout's cost on a CPU, runs half as long. An element is kept when its 16
bits are below round((1 - rate) * 2^16), so the keep probability is that threshold / 2^16
(within 2^-17 of 1 - rate: 0.899994 for rate 0.1), and kept values are divided by exactly that
probability, so the expected output is the input, as with inverted dropout at any rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

_LEVELS = 1 << 16


def keep_threshold(rate: float) -> int:
    """Elements whose 16 random bits are below this are kept."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f'dropout rate {rate} is not in [0, 1)')
    return round((1.0 - rate) * _LEVELS)


def keep_probability(rate: float) -> float:
    """The exact probability that an element is kept (the inverse of the scale of kept ones)."""
    return keep_threshold(rate) / _LEVELS


def keep_mask(key, shape, rate: float):
    """Boolean mask of `shape`, True with probability keep_probability(rate).

    Along the last axis of length n, elements j and j + ceil(n/2) share a word: rows stay apart,
    so a mask sharded over its leading axes (batch, heads) is drawn where it is used. Only a
    sharded last axis (d_ff under tensor parallelism, for relu dropout) makes each device draw
    the words of the whole row.
    """
    shape = tuple(shape)
    n = shape[-1] if shape else 1
    words = jax.random.bits(key, shape[:-1] + ((n + 1) // 2,), jnp.uint32)
    halves = jnp.concatenate([words & 0xFFFF, words >> 16], axis=-1)[..., :n]
    return (halves < keep_threshold(rate)).reshape(shape)


def dropout(x, rate: float, key):
    """Inverted dropout: zero with probability ~rate, else x / keep_probability(rate)."""
    if rate == 0.0:
        return x
    keep = keep_mask(key, x.shape, rate)
    # Scaled in float32 and rounded once per element: a bfloat16 scale would bias every value.
    kept = (x.astype(jnp.float32) * (1.0 / keep_probability(rate))).astype(x.dtype)
    return jnp.where(keep, kept, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`dropout` with a key from the 'dropout' rng stream; the identity when deterministic."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng('dropout'))
