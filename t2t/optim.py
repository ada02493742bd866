"""The paper's learning-rate schedule and optimizer (section 5.3), and the moving average of the
weights (not in the paper: fairseq --ema-decay, Marian --exponential-smoothing).

lr(step) = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), Adam(0.9, 0.98, 1e-9).

Step numbering: optax calls a schedule with `count`, the number of updates already applied, so the
first update sees count 0. The paper's step number is count + 1; using count directly would give
the first update a learning rate of exactly 0 (a wasted step) and shift the peak off `warmup`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer's settings, configs/common.py's keys of the same names; checked when made
    (one line naming the key), hashable. The defaults are the paper's."""

    d_model: int
    warmup_steps: int = 4000
    learning_rate_scale: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # > 0: AdamW's decoupled decay on parameters with ndim > 1
    clip_grad_norm: float = 0.0  # > 0: the gradients' global norm is clipped to it before Adam

    def __post_init__(self):
        rules = (  # (holds, key, what the key needs), in the order a config is checked
            (self.learning_rate_scale > 0, 'learning_rate_scale', 'must be > 0'),
            (self.warmup_steps >= 1, 'warmup_steps',
             'must be >= 1 (the steps the learning rate rises over)'),
            (0 <= self.adam_b1 < 1, 'adam_b1', 'must be in [0, 1)'),
            (0 <= self.adam_b2 < 1, 'adam_b2', 'must be in [0, 1)'),
            (self.adam_eps > 0, 'adam_eps', 'must be > 0'),
            (self.weight_decay >= 0, 'weight_decay', 'must be >= 0'),
            (self.clip_grad_norm >= 0, 'clip_grad_norm', 'must be >= 0 (0: off)'),
        )
        for holds, key, needs in rules:
            if not holds:
                raise ValueError(f'{key}={getattr(self, key)!r} {needs}')

    @classmethod
    def from_config(cls, config) -> OptimConfig:
        return cls(**{f.name: config[f.name] for f in dataclasses.fields(cls)})


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

    config: an OptimConfig, or an experiment's ConfigDict, made into one here: what the update
    closes over (and runs inside jit) is the frozen dataclass, never the ConfigDict.

    The schedule goes in through `optax.inject_hyperparams`, so the state holds the rate each
    update applied (`applied_learning_rate`): the logs report what Adam used, also when a skipped
    step leaves the state unchanged. State: InjectStatefulHyperparamsState(count, hyperparams,
    hyperparams_states, inner_state=(clip state,) adam state).
    """
    if not isinstance(config, OptimConfig):
        config = OptimConfig.from_config(config)
    schedule = learning_rate_schedule(config.d_model, config.warmup_steps,
                                      config.learning_rate_scale)
    adam_kwargs = dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)

    def adam(learning_rate):
        # Only the rate is a hyperparameter in the state: Adam's constants stay Python floats.
        if config.weight_decay > 0:
            tx = optax.adamw(learning_rate, weight_decay=config.weight_decay, mask=_decay_mask,
                             **adam_kwargs)
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
