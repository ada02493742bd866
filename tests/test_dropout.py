"""t2t/dropout.py: 16 random bits per element, exact keep probability, unbiased output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t import dropout as dr
from t2t.model import TransformerConfig


def test_keep_probability_is_the_16_bit_threshold():
    assert dr.keep_threshold(0.1) == 58982
    assert dr.keep_probability(0.1) == 58982 / 65536
    assert abs(dr.keep_probability(0.1) - 0.9) < 2 ** -17
    assert dr.keep_probability(0.0) == 1.0
    assert dr.keep_threshold(0.3) == round(0.7 * 65536)


@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_mask_frequency_and_independence_of_word_halves(rate):
    rows, n = 1000, 1001  # odd: the last word of a row gives only its low half
    keep = np.asarray(dr.keep_mask(jax.random.PRNGKey(3), (rows, n), rate))
    p = dr.keep_probability(rate)
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / keep.size)
    # Element j and element j + ceil(n/2) of a row come from the same 32-bit word.
    half = (n + 1) // 2
    both = np.mean(keep[:, : n - half] & keep[:, half:])
    assert abs(both - p * p) < 5 * np.sqrt(p * p * (1 - p * p) / (rows * (n - half)))
    assert np.mean(keep[0] != keep[1]) > 0.1  # rows differ


def test_dropout_values_and_mean():
    x = jnp.full((512, 1024), 2.0, jnp.float32)
    y = np.asarray(dr.dropout(x, 0.1, jax.random.PRNGKey(0)))
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.float32(2.0 / dr.keep_probability(0.1)))
    assert abs(y.mean() - 2.0) < 0.01  # unbiased: E[y] = x
    other = np.asarray(dr.dropout(x, 0.1, jax.random.PRNGKey(1)))
    assert np.mean((other != 0) != kept) > 0.1  # another key, another mask


def test_bfloat16_values_are_rounded_once_per_element():
    x = jnp.asarray(np.linspace(1, 2, 4096), jnp.bfloat16)
    y = dr.dropout(x, 0.1, jax.random.PRNGKey(0))
    expect = (np.asarray(x, np.float32) / dr.keep_probability(0.1)).astype(jnp.bfloat16)
    kept = np.asarray(y) != 0
    np.testing.assert_array_equal(np.asarray(y)[kept], expect[kept])


def test_any_rank():
    assert dr.keep_mask(jax.random.PRNGKey(0), (), 0.5).shape == ()
    assert dr.keep_mask(jax.random.PRNGKey(0), (2, 3, 5), 0.5).shape == (2, 3, 5)


def test_rate_zero_and_bad_rates():
    x = jnp.ones((3, 5))
    assert dr.dropout(x, 0.0, jax.random.PRNGKey(0)) is x
    with pytest.raises(ValueError, match='not in'):
        dr.keep_threshold(1.0)
    with pytest.raises(ValueError, match=r'dropout_rate=1.0 must be in \[0, 1\)'):
        TransformerConfig(vocab_size=8, dropout_rate=1.0)
    with pytest.raises(ValueError, match='attention_dropout_rate=-0.1'):
        TransformerConfig(vocab_size=8, attention_dropout_rate=-0.1)
