"""The paper's schedule and Adam, checked against the formula and a hand-computed update."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.common import base_config
from t2t import optim


def paper_lr(step, d_model=512, warmup=4000, scale=1.0):
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


@pytest.mark.parametrize('step', [1, 100, 3999, 4000, 4001, 100_000])
def test_schedule_matches_formula(step):
    schedule = optim.learning_rate_schedule(512, 4000)
    # optax passes count = step - 1 for the paper's step `step`.
    np.testing.assert_allclose(float(schedule(step - 1)), paper_lr(step), rtol=1e-6)


def test_schedule_first_update_nonzero_and_peak_at_warmup():
    schedule = optim.learning_rate_schedule(512, 4000, scale=2.0)
    assert float(schedule(0)) > 0
    lrs = np.asarray(schedule(jnp.arange(10_000)))
    assert int(np.argmax(lrs)) + 1 == 4000
    np.testing.assert_allclose(lrs.max(), 2.0 * (512 * 4000) ** -0.5, rtol=1e-6)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError):
        optim.learning_rate_schedule(512, 0)


def _adam_reference(grads, lr_fn, b1, b2, eps):
    """Two Adam steps in float64 from the paper's equations; returns the summed update."""
    m = v = 0.0
    total = 0.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        total = total - lr_fn(t) * m_hat / (np.sqrt(v_hat) + eps)
    return total


def _two_updates(tx, params, grads):
    state = tx.init(params)
    total = jnp.zeros_like(params)
    for g in grads:
        upd, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        total = total + upd
    return np.asarray(total, np.float64)


def test_optimizer_is_adam_with_paper_hyperparameters():
    config = base_config()
    config.adam_eps = 1e-3  # large enough that eps visibly enters the update
    tx = optim.make_optimizer(config)
    params = jnp.ones((2, 3), jnp.float32)
    grads = [np.linspace(-1.0, 2.0, 6).reshape(2, 3), np.linspace(0.5, -0.3, 6).reshape(2, 3)]
    got = _two_updates(tx, params, grads)
    want = _adam_reference([np.asarray(g) for g in grads], paper_lr, 0.9, 0.98, 1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_clipping_and_weight_decay():
    config = base_config()
    config.clip_grad_norm = 1.0
    config.weight_decay = 0.1
    tx = optim.make_optimizer(config)
    params = {'w': jnp.full((2, 2), 3.0), 'b': jnp.full((2,), 3.0)}
    grads = {'w': jnp.full((2, 2), 100.0), 'b': jnp.full((2,), 100.0)}
    upd, _ = tx.update(grads, tx.init(params), params)
    lr = paper_lr(1)
    # First Adam step is lr * sign(g) whatever the clipping; decay applies to the matrix only.
    np.testing.assert_allclose(upd['b'], -lr * np.ones(2), rtol=1e-5)
    np.testing.assert_allclose(upd['w'], -lr * (1 + 0.1 * 3.0) * np.ones((2, 2)), rtol=1e-5)
    # Clipping acts before Adam: the second moment sees the clipped gradient.
    nu = optax.tree_utils.tree_get(tx.update(grads, tx.init(params), params)[1], 'nu')
    clipped = 100.0 / np.sqrt(6 * 100.0**2)
    np.testing.assert_allclose(nu['b'], (1 - 0.98) * clipped**2, rtol=1e-5)
