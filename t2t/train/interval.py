"""The training metrics of a log interval: summed on the device step by step, fetched once at
the log step, written as the interval's means (`log_train`); the sums of steps no log covered
yet travel in the checkpoint, so a resumed run logs what an uninterrupted one would.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from t2t import optim, train_lib
from t2t.infra import metrics

# Sums over the steps of a log interval (carried across a resume): float32 loss sums, exact counts.
_FLOAT_SUMS = ('loss_sum', 'nll_sum', 'correct_sum')
_COUNT_SUMS = ('tokens', 'nonfinite')
# Guards' counts, summed only with their option on (clip_grad_norm: also the interval's steps,
# the window of the fraction; spike_skip), so that without them the sums are as before.
_GUARD_SUMS = ('clipped', 'window_steps', 'spikes')
_SUM_KEYS = _FLOAT_SUMS + _COUNT_SUMS + _GUARD_SUMS
_RAN_KEYS = ('tokens', 'source_tokens')  # this run's steps alone: throughput and MFU


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient became NaN or inf."""


def _accumulate(acc, step, m):
    """acc + one step's metrics, on the device: the interval's sums, this run's token counts and
    the first step whose loss or gradient was not finite (-1: none yet)."""
    def count(x):  # token counts as integers: a float32 sum is exact only up to 2**24
        return jnp.round(x).astype(jnp.int32)

    if 'clipped' in m:
        m = dict(m, window_steps=1.0)
    out = {k: acc[k] + m[k] for k in _FLOAT_SUMS}
    out.update({k: acc[k] + count(m[k]) for k in _COUNT_SUMS})
    out.update({k: acc.get(k, 0) + count(m[k]) for k in _GUARD_SUMS if k in m})
    out.update({f'ran_{k}': acc[f'ran_{k}'] + count(m[k]) for k in _RAN_KEYS})
    first = (m['nonfinite'] > 0) & (acc['bad_step'] < 0)
    out['bad_step'] = jnp.where(first, step, acc['bad_step'])
    for k in ('loss_sum', 'grad_norm'):
        out[f'bad_{k}'] = jnp.where(first, m[k], acc[f'bad_{k}'])
    return out


_accumulate_jit = jax.jit(_accumulate)


def _start_sums(carried: dict | None) -> dict:
    """The accumulator of a new interval: the carried sums (a resume), else zeros (host values:
    the first `_accumulate` puts them beside the step's metrics, on the same devices)."""
    carried = carried or {}
    acc = {k: np.float32(carried.get(k, 0.0)) for k in _FLOAT_SUMS}
    acc.update({k: np.int32(round(carried.get(k, 0))) for k in _COUNT_SUMS})
    acc.update({k: np.int32(round(carried[k])) for k in _GUARD_SUMS if k in carried})
    acc.update({f'ran_{k}': np.int32(0) for k in _RAN_KEYS})
    acc.update(bad_step=np.int32(-1), bad_loss_sum=np.float32(0), bad_grad_norm=np.float32(0))
    return acc


class Interval:
    """The training metrics since the last log, summed on the device step by step (one jitted
    add) and fetched once, at the log step (or a checkpoint's).

    The host never runs more than one step ahead of the device: `add` waits for the previous
    step while the device has the new one queued (it never runs dry), so a SIGTERM or a time
    budget is acted on within about a step, and the watchdog times device steps. Nothing is
    fetched per step. `carried`: the sums (_SUM_KEYS) of the steps before a resume that no log
    covered yet; they start the accumulator, so a resumed run adds the same floats in the same
    order as an uninterrupted one. The loss sums are float32 sums of float32 step sums (rounding
    of about 1e-7 relative per step); token and skip counts are exact integers.
    """

    def __init__(self, carried: dict | None = None):
        self.sums = _start_sums(carried)
        self.steps = 0  # steps added since the start
        self.last = None  # the newest step's device metrics (its learning rate and grad norm)
        self.start_time = time.perf_counter()

    def add(self, step, device_metrics):
        previous = self.last
        self.sums = _accumulate_jit(self.sums, step, device_metrics)
        self.steps += 1
        self.last = device_metrics
        if previous is not None:
            jax.block_until_ready(previous['tokens'])  # pace the host (see the class docstring)

    def fetch(self) -> dict:
        """Host copies of the sums, and of the newest step's learning rate and grad norm."""
        last = {k: self.last[k] for k in ('learning_rate', 'grad_norm') if k in self.last}
        sums, last = jax.device_get((self.sums, last))
        return {**{k: v.item() for k, v in sums.items()}, **{k: float(v) for k, v in last.items()}}

    def check_finite(self, skip_nonfinite: bool, fetched: dict | None = None):
        """Raises NonFiniteLossError naming the interval's first step whose loss or gradient is
        not finite. With skip_nonfinite such steps were not applied, so the state stayed finite."""
        if skip_nonfinite or self.steps == 0:
            return
        fetched = self.fetch() if fetched is None else fetched
        if fetched['bad_step'] >= 0:
            raise NonFiniteLossError(
                f'step {fetched["bad_step"]}: the loss or the gradient is not finite (loss sum '
                f'{fetched["bad_loss_sum"]}, grad norm {fetched["bad_grad_norm"]}); set '
                'skip_nonfinite=True to skip such steps')

    def drain(self, skip_nonfinite: bool) -> dict:
        """The interval's host sums (checked for a non-finite step); the interval is then empty."""
        fetched = self.fetch()
        self.check_finite(skip_nonfinite, fetched)
        fetched['steps'] = self.steps
        self.sums, self.steps, self.last = _start_sums(None), 0, None
        return fetched

    def unlogged(self) -> dict:
        """Host sums of the steps no log covered yet (carried ones too), for the checkpoint."""
        if self.steps == 0:
            return {k: v.item() for k, v in self.sums.items() if k in _SUM_KEYS}
        return {k: v for k, v in self.fetch().items() if k in _SUM_KEYS}


def log_train(writer, interval: Interval, config, step, state, flops_per_step,
              flops_per_token, peak, num_devices):
    """Writes the interval's train scalars. Means cover every step since the last log (carried
    ones too); throughput and MFU cover the steps this process ran."""
    fetched = interval.drain(config.skip_nonfinite)  # the interval's one fetch
    elapsed = time.perf_counter() - interval.start_time
    steps = fetched['steps']
    step_time = elapsed / max(steps, 1)
    scalars = dict(train_lib.summarize_metrics(fetched))
    scalars.update(
        learning_rate=fetched.get('learning_rate'),
        grad_norm=fetched['grad_norm'],
        step_time_s=step_time,
        target_tokens_per_s=fetched['ran_tokens'] / max(elapsed, 1e-9),
        skipped_steps=fetched['nonfinite'] + fetched.get('spikes', 0),
    )
    if config.clip_grad_norm > 0:  # the steps of the interval whose gradient optax scaled down
        scalars['clipped_steps_fraction'] = fetched['clipped'] / fetched['window_steps']
    if config.spike_skip > 0:
        scalars['spike_skipped_steps'] = fetched['spikes']
    applied = optim.applied_updates(state.opt_state)
    if applied is not None:  # skipped steps advance the step but not the optimizer's count
        scalars['skipped_steps_total'] = step - int(jax.device_get(applied))
    # MFU on the real (non-pad) tokens, and on every slot of the batch as if all were real.
    real_flops = (fetched['ran_source_tokens'] * flops_per_token[0]
                  + fetched['ran_tokens'] * flops_per_token[1])
    for name, per_step in (('mfu_real_tokens', real_flops / max(steps, 1)),
                           ('mfu_padded_slots', flops_per_step)):
        utilization = metrics.mfu(per_step, step_time, num_devices, peak)
        if not math.isnan(utilization):
            scalars[name] = utilization
    writer.write_scalars(step, scalars)
    return scalars
