"""Train state, loss, train_step and eval_step: pure functions, no I/O.

train_step(state, batch) -> (state, metrics), jitted once (`jit_train_step`) with the state's
shardings and the state donated. A step's dropout rng is folded from the state's rng (raw key
data of rng_impl) and the step, so a resumed run draws the masks of an uninterrupted one. The
loss: t2t/loss.py. Metrics are token sums left on device; `summarize_metrics` makes their means.

Shape letters: B batch rows, T target length, V vocabulary, M micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct

from t2t import loss, optim, sharding
from t2t.ids import PAD_ID
from t2t.model import Transformer, TransformerConfig, batch_forward_args, decoder_output_and_weights

BATCH_KEYS = ('inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids',
              'inputs_positions', 'targets_positions')


@struct.dataclass
class TrainState:
    """What a step updates. The optional parts are None when their option is off: a None field
    holds no array, so such a state flattens, shards and saves exactly as one without the field
    (t2t/run/checkpoint.py stores only the fields that are set)."""

    step: jax.Array  # int32 scalar: updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 raw key data (of StepConfig.rng_impl): the run's base dropout key
    ema: Any = None  # ema_decay > 0: the moving average of params, same tree and shardings
    guard: Any = None  # spike_skip or rollback_after > 0: recent losses, skip run (`init_guard`)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of a training step (hashable: safe to close over in jitted code)."""

    model: TransformerConfig
    label_smoothing: float = 0.1
    grad_accum_steps: int = 1
    skip_nonfinite: bool = False
    loss_chunk_len: int = 32  # target positions per chunk of the cross-entropy (0: one chunk)
    loss_chunk_tokens: int = 0  # > 0: chunks grown to this many target tokens per device
    loss_impl: str = 'plain'  # 'plain' (on the model's logits) or 'fused' (t2t/loss.py)
    z_loss: float = 0.0  # weight of log(Z)^2 in the loss (0: off)
    rng_impl: str = 'threefry'  # dropout key generator: 'threefry', 'rbg' or 'unsafe_rbg'
    ema_decay: float = 0.0  # > 0: the state's EMA of the params (TrainState.ema) at this decay
    ema_warmup: bool = False  # the decay of update t is min(ema_decay, (1 + t) / (10 + t))
    clip_grad_norm: float = 0.0  # > 0: the optimizer clips at it; metrics count clipped steps
    spike_skip: float = 0.0  # > 0: skip a step whose loss is over the recent mean + this x std
    guard_window: int = 0  # > 0: the state holds the last this many applied losses (a guard)

    def __post_init__(self):
        rules = (  # (holds, key, what the key needs), in the order a config is checked
            (self.loss_chunk_len >= 0, 'loss_chunk_len', 'must be >= 0 (0: one chunk)'),
            (self.loss_chunk_tokens >= 0, 'loss_chunk_tokens',
             'must be >= 0 (0: chunks not grown)'),
            (self.loss_impl in loss.IMPLS, 'loss_impl', f'must be one of {loss.IMPLS}'),
            (self.z_loss >= 0, 'z_loss', 'must be >= 0 (0: off)'),
            (self.rng_impl in RNG_IMPLS, 'rng_impl', f'must be one of {tuple(RNG_IMPLS)}'),
            (0 <= self.label_smoothing < 1, 'label_smoothing', 'must be in [0, 1)'),
            (0 <= self.ema_decay < 1, 'ema_decay', 'must be in [0, 1)'),
            (self.grad_accum_steps >= 1, 'grad_accum_steps', 'must be >= 1'),
            (self.spike_skip >= 0, 'spike_skip', 'must be >= 0 (standard deviations; 0: off)'),
        )
        for holds, key, needs in rules:
            if not holds:
                raise ValueError(f'{key}={getattr(self, key)!r} {needs}')

    @classmethod
    def from_config(cls, config) -> StepConfig:
        return cls(model=TransformerConfig.from_config(config),
                   label_smoothing=config.label_smoothing,
                   grad_accum_steps=config.grad_accum_steps,
                   skip_nonfinite=config.skip_nonfinite,
                   loss_chunk_len=config.loss_chunk_len,
                   loss_chunk_tokens=config.loss_chunk_tokens,
                   loss_impl=config.loss_impl, z_loss=config.z_loss,
                   rng_impl=config.rng_impl,
                   ema_decay=config.ema_decay,
                   ema_warmup=config.ema_warmup,
                   clip_grad_norm=config.clip_grad_norm,
                   spike_skip=config.spike_skip,
                   guard_window=guard_window(config))


def guard_window(config) -> int:
    """The recent losses a state keeps: spike_window with a divergence guard on, else 0 (none)."""
    on = config.spike_skip > 0 or config.rollback_after > 0
    return config.spike_window if on else 0


# config name -> jax PRNG implementation of the dropout keys
RNG_IMPLS = {'threefry': 'threefry2x32', 'rbg': 'rbg', 'unsafe_rbg': 'unsafe_rbg'}


def dropout_key(raw_key, rng_impl: str):
    """The typed dropout key of a state's raw key data."""
    return jax.random.wrap_key_data(raw_key, impl=RNG_IMPLS[rng_impl])


# ----------------------------------------------------------------------------------------------
# Loss


def loss_sums(params, batch, rng, step_config: StepConfig, deterministic: bool):
    """Token sums over the batch's non-pad targets: (smoothed loss sum, metrics dict).

    loss_impl 'plain': the model's logits (Transformer.__call__), then the loss; 'fused': the
    decoder output, whose logits the loss computes chunk by chunk, never all at once.
    """
    model = Transformer(step_config.model.replace(deterministic=deterministic))
    apply = functools.partial(model.apply, {'params': params}, **batch_forward_args(batch),
                              rngs=None if deterministic else {'dropout': rng})
    targets_BT = batch['targets']
    weights_BT = (targets_BT != PAD_ID).astype(jnp.float32)
    terms = dict(smoothing=step_config.label_smoothing, z_loss=step_config.z_loss)
    # The scope names the loss's ops in the compiled program (the dry run reports its buffers).
    if step_config.loss_impl == 'plain':
        logits_BTV = apply()
        with jax.named_scope('loss'):
            loss_sum, nll_sum, correct_sum = loss.plain_sums(logits_BTV, targets_BT, weights_BT,
                                                             **terms)
    else:
        y_BTD, w_VD = apply(method=decoder_output_and_weights)
        with jax.named_scope('loss'):
            loss_sum, nll_sum, correct_sum = loss.cross_entropy_sums(
                y_BTD, w_VD, targets_BT, weights_BT, chunk_len=step_config.loss_chunk_len,
                chunk_tokens=step_config.loss_chunk_tokens, **terms)
    sums = {'loss_sum': loss_sum, 'nll_sum': nll_sum, 'correct_sum': correct_sum,
            'tokens': weights_BT.sum()}
    return sums['loss_sum'], sums


# ----------------------------------------------------------------------------------------------
# State


def init_state(rng, model_config: TransformerConfig, tx: optax.GradientTransformation,
               batch_shape: tuple[int, int], rng_impl: str = 'threefry',
               ema: bool = False, guard_window: int = 0) -> TrainState:
    """A fresh state; parameters are boxed with logical axis names (see sharding.init_sharded).

    ema: the state's average starts at the initial parameters (boxed alike, so it is sharded
    like them). guard_window > 0: a guard (`init_guard`) beside them."""
    init_rng, dropout_rng = jax.random.split(rng)
    if rng_impl != 'threefry':  # the same draw seeds the other generator
        seed = jax.random.bits(dropout_rng, (), jnp.uint32)
        dropout_rng = jax.random.key_data(jax.random.key(seed, impl=RNG_IMPLS[rng_impl]))
    ids = jnp.ones(batch_shape, jnp.int32)
    model = Transformer(model_config.replace(deterministic=True))
    params = model.init(init_rng, ids, ids)['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=dropout_rng, ema=params if ema else None,
                      guard=init_guard(guard_window) if guard_window else None)


def _config_init(config, tx):
    """(init function of the rng, the config's rng): what both state builders below start from."""
    init = functools.partial(init_state, model_config=TransformerConfig.from_config(config),
                             tx=tx, batch_shape=(1, config.max_len), rng_impl=config.rng_impl,
                             ema=config.ema_decay > 0, guard_window=guard_window(config))
    return init, jax.random.PRNGKey(config.seed)


def create_sharded_state(config, mesh, tx):
    """(state, state_shardings): initialized under jit, each device creating only its shard."""
    init, rng = _config_init(config, tx)
    return sharding.init_sharded(init, mesh, rng)


def abstract_state(config, mesh, tx):
    """Shapes, dtypes and shardings of the state without allocating it (for restoring)."""
    init, rng = _config_init(config, tx)
    boxed = jax.eval_shape(init, rng)
    shardings = sharding.tree_shardings(boxed, mesh)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed),
        shardings)


# ----------------------------------------------------------------------------------------------
# Divergence guards (MaxText's skip_step_on_spikes): the losses of the last applied steps


def init_guard(window: int) -> dict:
    """losses: the last `window` applied steps' mean token losses (a ring, by count); count:
    applied steps seen; skip_run: the steps in a row, up to now, that were not applied."""
    return {'losses': jnp.zeros((window,), jnp.float32), 'count': jnp.zeros((), jnp.int32),
            'skip_run': jnp.zeros((), jnp.int32)}


def is_spike(guard: dict, loss, k: float):
    """Whether `loss` exceeds the mean of the window by more than k standard deviations (only
    once the window is full: too few losses give no standard deviation to trust)."""
    losses = guard['losses']
    full = guard['count'] >= losses.shape[0]
    return full & (loss > losses.mean() + k * losses.std())


def update_guard(guard: dict, loss, applied) -> dict:
    """The guard after a step: an applied step's loss enters the window; a skipped one (spike
    or not finite) lengthens the run of skips instead, so spikes never raise the mean."""
    at = guard['count'] % guard['losses'].shape[0]
    return {'losses': jnp.where(applied, guard['losses'].at[at].set(loss), guard['losses']),
            'count': guard['count'] + applied.astype(jnp.int32),
            'skip_run': jnp.where(applied, 0, guard['skip_run'] + 1)}


# ----------------------------------------------------------------------------------------------
# Steps


def _split_micro_batches(batch, num: int, batch_sharding=None):
    """[B, ...] -> [M, B / M, ...] for gradient accumulation: micro-batch m holds rows m, m + M,
    m + 2M, ... Each device holds a contiguous block of rows, so every micro-batch keeps rows on
    every data-parallel device and the split moves no data (a micro-batch [m*B/M, (m+1)*B/M)
    would sit on a few devices while the others idle)."""
    def split(x):
        if x.shape[0] % num:
            raise ValueError(f'batch of {x.shape[0]} rows does not split into {num} micro-batches')
        x = jnp.swapaxes(x.reshape((x.shape[0] // num, num) + x.shape[1:]), 0, 1)
        if batch_sharding is not None:
            spec = jax.sharding.PartitionSpec(None, *batch_sharding.spec)
            x = jax.lax.with_sharding_constraint(x, batch_sharding.update(spec=spec))
        return x
    return jax.tree_util.tree_map(split, batch)


def train_step(state: TrainState, batch, *, step_config: StepConfig,
               tx: optax.GradientTransformation, batch_sharding=None, param_shardings=None):
    """One update on the batch (accumulated over step_config.grad_accum_steps micro-batches).

    The loss is the mean over all non-pad target tokens of the whole batch, so accumulating M
    micro-batches gives the same gradient as one batch M times larger. batch_sharding /
    param_shardings (optional) pin each micro-batch to the data-parallel devices and the
    accumulated gradients to the parameters' shardings.
    """
    step_rng = jax.random.fold_in(dropout_key(state.rng, step_config.rng_impl), state.step)
    grad_fn = jax.grad(loss_sums, has_aux=True)
    num_micro = step_config.grad_accum_steps

    if num_micro == 1:
        grads, sums = grad_fn(state.params, batch, step_rng, step_config, False)
    else:
        micro = _split_micro_batches(batch, num_micro, batch_sharding)

        def like_params(grads):
            if param_shardings is None:
                return grads
            return jax.lax.with_sharding_constraint(grads, param_shardings)

        def accumulate(carry, inputs):
            grads_acc, sums_acc = carry
            index, micro_batch = inputs
            if batch_sharding is not None:
                micro_batch = jax.lax.with_sharding_constraint(micro_batch, batch_sharding)
            g, s = grad_fn(state.params, micro_batch, jax.random.fold_in(step_rng, index),
                           step_config, False)
            return (like_params(jax.tree_util.tree_map(jnp.add, grads_acc, g)),
                    jax.tree_util.tree_map(jnp.add, sums_acc, s)), None

        zeros_grads = like_params(jax.tree_util.tree_map(jnp.zeros_like, state.params))
        zeros_sums = {k: jnp.zeros((), jnp.float32)
                      for k in ('loss_sum', 'nll_sum', 'correct_sum', 'tokens')}
        (grads, sums), _ = jax.lax.scan(accumulate, (zeros_grads, zeros_sums),
                                        (jnp.arange(num_micro), micro))

    denom = jnp.maximum(sums['tokens'], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums['loss_sum']) & jnp.isfinite(grad_norm)
    applied, extra, guard_metrics = finite, {}, {}
    if step_config.guard_window:
        loss_mean = sums['loss_sum'] / denom
        spike = jnp.zeros((), bool)
        if step_config.spike_skip > 0:
            spike = finite & is_spike(state.guard, loss_mean, step_config.spike_skip)
        applied = finite & ~spike
        extra['guard'] = update_guard(state.guard, loss_mean, applied)
        guard_metrics = dict(spikes=spike.astype(jnp.float32),
                             skip_run=extra['guard']['skip_run'].astype(jnp.float32))
    skipping = step_config.skip_nonfinite or step_config.spike_skip > 0
    if skipping:
        if not step_config.skip_nonfinite:  # a non-finite step is applied (and stops the run)
            applied = applied | ~finite
        # Keep the old parameters and optimizer state; the step counter still advances.
        keep = lambda new, old: jax.tree_util.tree_map(
            lambda n, o: jnp.where(applied, n, o), new, old)
        new_params = keep(new_params, state.params)
        new_opt_state = keep(new_opt_state, state.opt_state)
    if step_config.ema_decay > 0:  # after the optimizer step; a skipped step leaves it too
        decay = optim.ema_decay_at(step_config.ema_decay, state.step + 1, step_config.ema_warmup)
        extra['ema'] = optim.update_ema(state.ema, new_params, decay)
        if skipping:
            extra['ema'] = keep(extra['ema'], state.ema)

    metrics = dict(sums, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32),
                   source_tokens=(batch['inputs'] != PAD_ID).sum().astype(jnp.float32),
                   **guard_metrics)
    if step_config.clip_grad_norm > 0:  # optax's clip_by_global_norm scales such gradients
        metrics['clipped'] = (grad_norm > step_config.clip_grad_norm).astype(jnp.float32)
    applied_lr = optim.applied_learning_rate(new_opt_state)
    if applied_lr is not None:  # what Adam used; after a skipped step, the last rate applied
        metrics['learning_rate'] = applied_lr
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state,
                              **extra)
    return new_state, metrics


def eval_step(params, batch, *, step_config: StepConfig):
    """Token sums of the loss, NLL and accuracy on a batch, without dropout."""
    _, sums = loss_sums(params, batch, None, step_config, True)
    return sums


def jit_train_step(step_config: StepConfig, tx, state_shardings, mesh):
    """train_step compiled once for the mesh: state sharded as derived, batch split over data."""
    batch_sharding = sharding.batch_sharding(mesh)
    step = functools.partial(train_step, step_config=step_config, tx=tx,
                             batch_sharding=batch_sharding,
                             param_shardings=state_shardings.params)
    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, sharding.replicated(mesh)),
                     donate_argnums=(0,))
    return _under_mesh(jitted, mesh)


def jit_eval_step(step_config: StepConfig, params_shardings, mesh):
    step = functools.partial(eval_step, step_config=step_config)
    jitted = jax.jit(step, in_shardings=(params_shardings, sharding.batch_sharding(mesh)),
                     out_shardings=sharding.replicated(mesh))
    return _under_mesh(jitted, mesh)


def _under_mesh(fn, mesh):
    """Calls fn with the mesh and the logical axis rules active (for the model's constraints).

    `.lower(*args)` lowers the jitted fn in the same context (to compile ahead of time, or to
    time the compile apart from the first run).
    """
    def in_context(call):
        def run(*args):
            with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
                return call(*args)
        return run

    wrapped = functools.wraps(fn)(in_context(fn))
    wrapped.lower = in_context(fn.lower)
    return wrapped


# ----------------------------------------------------------------------------------------------
# Metrics


def summarize_metrics(sums: dict) -> dict:
    """Host token sums (possibly added over several steps) -> loss, nll, perplexity, accuracy:
    host floats, computed on the host."""
    tokens = max(float(sums['tokens']), 1.0)
    nll = float(sums['nll_sum']) / tokens
    return {
        'loss': float(sums['loss_sum']) / tokens,
        'nll': nll,
        'perplexity': math.exp(min(nll, 50.0)),
        'accuracy': float(sums['correct_sum']) / tokens,
    }
