"""The paper's learning-rate schedule and optimizer (section 5.3), and the moving average of the
weights (not in the paper: fairseq --ema-decay, Marian --exponential-smoothing).

lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), Adam(0.9, 0.98, 1e-9).

Step numbering: optax calls a schedule with `count`, the number of updates already applied, so the
first update sees count 0. The paper's step number is count + 1; using count directly would give
the first update a learning rate of exactly 0 (a wasted step) and shift the peak off `warmup`.
"""

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """Linear warmup for `warmup_steps` updates, then decay with the inverse square root of step.

    The returned function takes optax's `count` (0 for the first update) and peaks at count
    warmup_steps - 1, i.e. at the paper's step `warmup_steps`, at scale * (d_model*warmup)^-0.5.
    """
    if d_model <= 0 or warmup_steps <= 0:
        raise ValueError(f'd_model and warmup_steps must be > 0, got {d_model}, {warmup_steps}')
    # Python floats so the constants do not depend on x64 mode.
    lr_0 = scale * d_model**-0.5
    warmup_factor = warmup_steps**-1.5

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # the paper counts from 1
        return lr_0 * jnp.minimum(jax.lax.rsqrt(step), step * warmup_factor)

    return schedule


def _decay_mask(params):
    # Decay weight matrices and embeddings only; biases and LayerNorm scales (ndim <= 1) are exempt.
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def make_optimizer(config) -> optax.GradientTransformation:
    """Adam with the warmup-rsqrt schedule; optional global-norm clipping and AdamW decay.

    clip_grad_norm > 0 clips before Adam; weight_decay > 0 subtracts lr * weight_decay * param
    (optax's decoupled decay) on parameters with ndim > 1. The schedule goes in through
    `optax.inject_hyperparams`, so the state holds the rate each update applied
    (`applied_learning_rate`): the logs report what Adam used, also when a skipped step leaves
    the state unchanged. State: InjectStatefulHyperparamsState(count, hyperparams,
    hyperparams_states, inner_state=(clip state,) adam state).
    """
    schedule = learning_rate_schedule(
        config.d_model, config.warmup_steps, config.learning_rate_scale
    )
    adam_kwargs = dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)

    def adam(learning_rate):
        # Only the rate is a hyperparameter in the state: Adam's constants stay Python floats.
        if config.weight_decay > 0:
            tx = optax.adamw(
                learning_rate, weight_decay=config.weight_decay, mask=_decay_mask, **adam_kwargs
            )
        else:
            tx = optax.adam(learning_rate, **adam_kwargs)
        if config.clip_grad_norm > 0:
            tx = optax.chain(optax.clip_by_global_norm(config.clip_grad_norm), tx)
        return tx

    return optax.inject_hyperparams(adam)(learning_rate=schedule)


def applied_learning_rate(opt_state):
    """The learning rate of the last update applied (before any update: the first one's rate).

    None for an optimizer built without `make_optimizer`'s injected schedule.
    """
    hyperparams = getattr(opt_state, 'hyperparams', None)
    return None if hyperparams is None else hyperparams.get('learning_rate')


def applied_updates(opt_state):
    """How many updates the optimizer applied (skipped steps do not count); None if unknown."""
    if applied_learning_rate(opt_state) is None:
        return None
    return opt_state.count


def ema_decay_at(decay: float, step, warmup: bool = False):
    """The EMA decay of update `step` (1 for the first update): `decay`, or with warmup
    min(decay, (1 + step) / (10 + step)) (tf.train.ExponentialMovingAverage's num_updates), so
    that early on the average follows the parameters instead of staying near their init."""
    if not warmup:
        return decay
    step = jnp.asarray(step, jnp.float32)
    return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


def update_ema(ema, params, decay):
    """ema = decay * ema + (1 - decay) * params, leaf by leaf (optax's Polyak update)."""
    return optax.incremental_update(params, ema, 1.0 - decay)
