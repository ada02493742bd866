"""The training loop: data -> train_step -> metrics, with evaluation, checkpoints and preemption.

Everything here is orchestration with I/O; the maths lives in t2t/train_lib.py. A workdir that
holds checkpoints is resumed from the newest good one (state, data iterator position and rng; a
corrupt step is moved aside), so a stopped, killed or preempted and resumed run computes exactly
what an uninterrupted one would: the same states, and the same metrics at every logged step (the
sums of steps not yet logged travel in the checkpoint; records after the restored step, written
before the interruption, are removed from metrics.jsonl and the event files).

A SIGTERM (preemption) is seen at the next step: the loop skips evaluation, saves and returns. The
host runs at most one step ahead of the device, so that moment is near. A run that completed
(num_train_steps, the time budget or early stopping: t2t/run/best.py) leaves
WORKDIR/TRAINING_FINISHED for evaluate.py --watch. Rollbacks: t2t/train/guards.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from t2t import flops, goodput, optim, sharding, train_lib
from t2t.data import identity
from t2t.infra import distributed, metrics, trackers, uploads
from t2t.infra import workdir as wd
from t2t.infra.preemption import Interrupted, PreemptionFlag
from t2t.run import best, checkpoint, compile_cache, outage, profiling, run_record, startup
from t2t.train import guards
from t2t.train_lib import evaluate_loss  # the loop's validation loss (a name tests replace)

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


@dataclasses.dataclass
class TrainResult:
    step: int
    stopped_by: str  # 'num_train_steps', 'time_budget', 'early_stopping' or 'preemption'
    train_metrics: dict
    eval_metrics: dict


def _say(message: str) -> None:
    """A progress line on stdout, from the first process only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


class _Interval:
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


def _spans(rows, shown: int = 4) -> str:
    """Sorted row ids as ranges: [0, 1, 4, 5] -> '0-1, 4-5'."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    spans = [f'{r[0]}-{r[-1]}' if len(r) > 1 else f'{r[0]}' for r in np.split(rows, breaks)]
    return ', '.join(spans[:shown]) + (f', ... ({len(spans)} spans)' if len(spans) > shown else '')


def _batch_line(config, mesh, rows) -> str:
    """How a training batch splits over the mesh and what this process feeds, in one line."""
    parallel = sharding.data_parallel_size(mesh)
    accum = config.grad_accum_steps
    split = (f'{accum} micro-batches x ' if accum > 1 else '') + \
        f'{parallel} data-parallel devices x {config.batch_size // accum // parallel} rows'
    return (f'batch_size {config.batch_size} = {split}; process {jax.process_index()} feeds '
            f'{len(rows)} rows of each global batch ({_spans(rows)})')


def train_and_evaluate(config, workdir: str, devices=None) -> TrainResult:
    """Trains config in workdir (resuming from its latest checkpoint) and returns final metrics.

    devices: the devices of the mesh (default: all). A checkpoint of any mesh, device count or
    process count resumes here, with the data continuing at the same global batch. Where the
    time went: WORKDIR/goodput/ (t2t/goodput/ledger.py), one ledger per call.
    """
    startup.check_writable(workdir)
    while True:
        ledger = goodput.Ledger.from_config(config, workdir)
        try:
            result = _train_and_evaluate(config, workdir, devices, ledger)
        except guards.Rollback as rollback:  # rollback_after: resume from an older checkpoint
            ledger.end('rollback')
            try:
                guards.roll_back(workdir, rollback, _say)
            except guards.RollbackError as e:
                raise NonFiniteLossError(str(e)) from None
            continue
        except BaseException as e:
            ledger.end(e)
            raise
        ledger.end(result.stopped_by)
        return result


def _train_and_evaluate(config, workdir, devices, ledger: goodput.Ledger) -> TrainResult:
    from t2t import data  # grain / tfds / sentencepiece stay out of the model path

    profile = profiling.Profiler.from_config(config, workdir, ledger)
    mesh = startup.make_mesh(config, devices)  # one that cannot be: a ConfigError, here
    _say(f'mesh {dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} devices '
         f'({jax.process_count()} processes)')
    startup.check_training_config(config, mesh)
    trackers.check_dir(config, workdir)  # a bucket workdir needs a local tracker_dir
    from t2t.infra import watchdog  # stacks of slow steps and saves

    record = run_record.record(config, mesh)
    run_record.write(workdir, record)  # what ran: WORKDIR/run-*.json
    batch_sharding = sharding.batch_sharding(mesh)
    rows = sharding.process_rows(batch_sharding, config.batch_size)
    _say(_batch_line(config, mesh, rows))
    eval_rows = _round_up(config.eval_batch_size, sharding.data_parallel_size(mesh))
    if eval_rows != config.eval_batch_size:
        _say(f'eval_batch_size {config.eval_batch_size} is padded to {eval_rows} rows (a multiple '
             f'of the {sharding.data_parallel_size(mesh)} data-parallel devices)')
    ledger.mark('data')
    tokenizer, train_iter, data_identity = _training_data(config, workdir, rows)
    ledger.mark('setup', flush='data_ready')

    tx = optim.make_optimizer(config)
    manager = checkpoint.make_manager(workdir, config)
    abstract = train_lib.abstract_state(config, mesh, tx)
    state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
    trained_s = 0.0  # training seconds of earlier runs of this workdir (the budget is total)
    meta = {}
    ledger.mark('restore')
    restored = checkpoint.restore_newest_good(  # the state and its metadata, in one read
        manager, lambda s: checkpoint.restore(manager, s, abstract, train_iter, with_metadata=True))
    ledger.mark('setup')
    if restored is None:
        state, _ = train_lib.create_sharded_state(config, mesh, tx)
    else:
        latest, (state, meta) = restored
        _say(f'resuming from checkpoint {latest} in {workdir}')
        trained_s = float(meta.get('train_seconds', 0.0))
        mapped = identity.check_resume(
            meta.get(identity.DATA_KEY), data_identity, meta.get(checkpoint.ITERATOR_KEY),
            allow_change=config.allow_data_change, where=f'checkpoint {latest} of {workdir}')
        if mapped is not None:
            train_iter.set_state(mapped)
        guards.skip_rolled_back_batches(workdir, latest, train_iter, _say)
    run_record.clear_finished(workdir)
    tracker = best.Tracker.from_config(config, meta.get(best.META_KEY))
    checkpoint.keep_best_steps(manager, tracker.kept_steps())

    step_config = train_lib.StepConfig.from_config(config)
    # A restart loads the programs a run of the same config and code stored (compile_cache.py).
    train_step = ledger.compiling(compile_cache.stored(
        train_lib.jit_train_step(step_config, tx, state_shardings, mesh), config, 'train_step'))
    eval_step = ledger.compiling(compile_cache.stored(
        train_lib.jit_eval_step(step_config, state_shardings.params, mesh), config, 'eval_step'))
    eval_data = data.eval_split(config, tokenizer, config.eval_split)
    num_eval = len(eval_data.plan(config.eval_batch_size))
    _say(f'eval loss on {eval_data.name}: ' + (
        f'all {num_eval} batches' if not 0 <= config.num_eval_batches < num_eval else
        f'{config.num_eval_batches} of {num_eval} batches, a fixed seeded sample across the '
        'length buckets (num_eval_batches=-1: all)'))

    step = int(jax.device_get(state.step))
    ledger.begin(step)
    # A pending evaluation (see below) may have been written by a run killed after it.
    writer = metrics.MetricWriter(
        workdir, enabled=jax.process_index() == 0, start_step=step,
        redo_at_start=('eval_',) if meta.get('evaluation_pending') else (),
        tensorboard='tensorboard' in trackers.names(config.trackers),
        sinks=trackers.open_sinks(config, workdir, start_step=step, record=record,
                                  enabled=jax.process_index() == 0))
    flops_per_step = flops.config_flops_per_step(config)
    flops_per_token = flops.config_flops_per_token(config)
    peak = metrics.peak_flops_per_device()
    bleu_eval = _make_bleu_eval(config, step_config.model, tokenizer, eval_data, mesh)

    train_start = time.perf_counter()

    def train_seconds():
        return trained_s + time.perf_counter() - train_start

    def over_budget():
        return config.train_time_budget_s > 0 and train_seconds() >= config.train_time_budget_s

    @ledger.timed('eval')
    def evaluate():
        """The eval scalars (also written), or None when a SIGTERM arrived meanwhile. With
        ema_decay > 0 the EMA weights are evaluated too, the same way: eval_*_ema."""
        weights = {'': state.params}
        if state.ema is not None:
            weights['_ema'] = state.ema
        summary = {}
        for suffix, params in weights.items():
            batches = eval_data.batches(config.eval_batch_size, eval_rows,
                                        num_batches=config.num_eval_batches, seed=config.seed)
            try:
                losses = evaluate_loss(eval_step, params, preemption.interruptible(batches),
                                       mesh, -1)
            except Interrupted:
                return None
            summary.update({f'eval_{k}{suffix}': v for k, v in losses.items()})
        if bleu_eval is not None:
            for suffix, params in weights.items():
                summary.update({f'{k}{suffix}': v for k, v in bleu_eval(params).items()})
        writer.write_scalars(step, summary)
        if best.enabled(config):
            _say(tracker.update(summary, step))
            checkpoint.keep_best_steps(manager, tracker.kept_steps())
        return summary

    interval = _Interval(meta.get('unlogged_metrics'))
    outage_limit_s = config.get('storage_outage_limit_s', 0.0)
    saver = _storage_writes(config, manager, writer, ledger, outage_limit_s)
    ended = False
    stopped_by = 'num_train_steps'
    train_summary, eval_summary = {}, {}
    preemption = PreemptionFlag().install()
    dog = watchdog.Watchdog.from_config(config, jax.process_index(), ledger.finding)
    # A metrics write waits for the workdir's storage (long in a bucket outage): the ledger books
    # it as 'logging', not training, and the watchdog does not take it for a slow step.
    writer.write_scalars = dog.paused(
        ledger.timed('logging', slice_after=False)(writer.write_scalars))
    try:
        if meta.get('evaluation_pending'):  # preempted at an evaluation step: evaluate it now
            eval_summary = evaluate()
            if eval_summary is None:  # preempted again: the checkpoint still says pending
                stopped_by, eval_summary = 'preemption', {}
        if stopped_by == 'num_train_steps' and tracker.exhausted() \
                and step < config.num_train_steps:
            stopped_by = 'early_stopping'
            _say(tracker.stop_line(step) + ': nothing to train')
        if stopped_by == 'num_train_steps' and distributed.process_0_decides(over_budget()):
            stopped_by = 'time_budget'
            _say(f'the time budget of {config.train_time_budget_s:.0f} s is spent in {workdir}: '
                 'nothing to train')
        while step < config.num_train_steps and stopped_by == 'num_train_steps':
            profile.step(step + 1, state)
            ledger.next_step()
            dog.mark('step', step + 1)
            batch = sharding.put_rows(next(train_iter), batch_sharding, config.batch_size)
            ledger.mark('train')
            state, step_metrics = train_step(state, batch)
            step += 1
            interval.add(step, step_metrics)
            guards.check_run(config, step, step_metrics, train_iter)  # may raise Rollback
            saver.check()  # a save retried in the background failed past the limit

            is_last = step == config.num_train_steps
            logged = step % config.log_every_steps == 0 or is_last
            if logged:
                train_summary = _log_train(writer, interval, config, step, state,
                                           flops_per_step, flops_per_token, peak, mesh.size)
                ledger.flush('log')
                if distributed.process_0_decides(over_budget()) and not is_last:
                    stopped_by = 'time_budget'
                    _say(f'the time budget (train_time_budget_s={config.train_time_budget_s:g}) '
                         f'cut the run at step {step} of num_train_steps={config.num_train_steps}')
            if preemption.reached(step, at_log_step=logged):
                stopped_by = 'preemption'

            stopping = stopped_by != 'num_train_steps' or is_last
            preempted = stopped_by == 'preemption'
            scheduled_eval = step % config.eval_every_steps == 0 or is_last
            # Preempted: save at once; a scheduled evaluation is left to the resumed run, and so
            # is an interrupted one (also the final evaluation of a time-budget stop).
            evaluation_pending = scheduled_eval and preempted
            if (scheduled_eval or stopping) and not preempted:
                dog.mark('other', step)
                summary = evaluate()
                if summary is None:  # SIGTERM during the evaluation: save this step now
                    stopped_by, stopping, preempted = 'preemption', True, True
                    evaluation_pending = True
                else:
                    eval_summary = summary
                    if tracker.exhausted() and not stopping:
                        stopped_by, stopping = 'early_stopping', True
                        _say(tracker.stop_line(step))
                        if not logged:  # the last steps' train metrics, not left unwritten
                            train_summary = _log_train(writer, interval, config, step, state,
                                                       flops_per_step, flops_per_token, peak,
                                                       mesh.size)
            # A step among the best is saved whatever checkpoint_every_steps says.
            if step % config.checkpoint_every_steps == 0 or stopping \
                    or step in tracker.kept_steps():
                interval.check_finite(config.skip_nonfinite)  # never save a non-finite state
                ledger.mark('checkpoint')
                dog.mark('save', step)
                saver.save(step, state, train_iter, preempted=preempted, extra_metadata={
                    'train_seconds': train_seconds(),
                    'unlogged_metrics': interval.unlogged(),
                    'evaluation_pending': evaluation_pending,
                    best.META_KEY: tracker.record(),
                    identity.DATA_KEY: data_identity})
                ledger.mark('train', flush='checkpoint')
            if stopping:
                break
            if logged:  # after evaluation and saving, so step times measure training alone
                interval = _Interval()
        ended = True
    finally:
        profile.close(state, step)
        ledger.mark('checkpoint')  # the wait for the last save
        dog.mark('save', step)  # the last asynchronous save is watched too
        try:
            preemption.uninstall()
            if saver.finish(state, ended, preempted=stopped_by == 'preemption'):
                checkpoint.close(manager)  # else a save still under way: the process ends
        finally:
            dog.close()
            error = sys.exc_info()[1]  # what ends the run, if not its last step
            writer.close(outage_limit_s, quiet=not ended or stopped_by == 'preemption',
                         upload=wd.storage_failure(error) is None)
    if stopped_by != 'preemption':
        run_record.mark_finished(workdir, step, stopped_by)
    return TrainResult(step=step, stopped_by=stopped_by, train_metrics=train_summary,
                       eval_metrics=eval_summary)


def _storage_writes(config, manager, writer, ledger, outage_limit_s) -> outage.Saver:
    """The run's settings of the write queue (storage_queue_mb; its waits are the ledger's
    storage backpressure) and its checkpoint saver (t2t/run/outage.py)."""
    saver = outage.Saver(manager, outage_limit_s, writer, _say)
    uploads.QUEUE.configure(int(config.get('storage_queue_mb', uploads.DEFAULT_QUEUE_MB) * 2**20),
                            outage_limit_s, on_wait=ledger.waited,
                            last_durable=lambda: saver.durable)
    return saver


def _training_data(config, workdir, rows):
    """(tokenizer, training iterator, data identity): the vocabulary pinned in WORKDIR, the
    packed training rows and what a checkpoint records about them (t2t/data/identity.py)."""
    from t2t import data

    tokenizer = data.get_tokenizer(config)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f'tokenizer {tokenizer.path} has {tokenizer.vocab_size} pieces but '
                         f'config.vocab_size={config.vocab_size}')
    if tokenizer.vocab_size < config.vocab_size:  # a small corpus can't fill the vocabulary
        logging.warning('tokenizer %s has %d pieces < config.vocab_size=%d: rows unused',
                        tokenizer.path, tokenizer.vocab_size, config.vocab_size)
    if config.dataset != 'recall':  # the recall toy's symbols are fixed, not trained
        identity.pin_vocabulary(workdir, tokenizer, write=jax.process_index() == 0)
    packed = data.train_rows(config, tokenizer)  # one corpus's or a mixture's
    meta = packed.meta
    _say(f'training data {meta["source"]}: {meta["examples"]} pairs in {packed.num_rows} packed '
         f'rows of {meta["max_len"]} tokens (fill {meta["fill"]:.3f}); skipped '
         + (', '.join(f'{k}={v}' for k, v in sorted(meta['skipped'].items())) or 'none')
         + f'; vocabulary {tokenizer.path} ({tokenizer.vocab_size} pieces)')
    train_iter = data.train_iterator(config, tokenizer, rows=rows, packed=packed)
    return tokenizer, train_iter, identity.run_identity(tokenizer, packed, config.batch_size)


def _log_train(writer, interval: _Interval, config, step, state, flops_per_step,
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


def _make_bleu_eval(config, model_config, tokenizer, eval_data, mesh):
    """A function params -> {'eval_bleu', 'eval_chrf'} on the first eval_bleu_sentences, or None.

    The sentences are decoded on every device of the mesh (each its own rows) and gathered back
    in order on every process.
    """
    if config.eval_bleu_sentences <= 0:
        return None
    from t2t import inference
    from t2t.eval import bleu

    predict = inference.config_predict_fn(config, model_config, num_valid_ids=tokenizer.vocab_size,
                                          mesh=mesh)
    n = min(config.eval_bleu_sentences, len(eval_data.references))
    head = dataclasses.replace(
        eval_data, sources=eval_data.sources[:n], references=eval_data.references[:n],
        inputs=eval_data.inputs[:n], targets=eval_data.targets[:n],
        skipped=tuple(i for i in eval_data.skipped if i < n))

    def run(params):
        result = inference.translate_batches(
            predict, params, head.batches(config.eval_batch_size), tokenizer, n, progress=False,
            mesh=mesh)
        # Examples skipped as too long count as empty output, as evaluate.py scores them.
        hypotheses = [h or '' for h in result.hypotheses]
        scores = bleu.score_all(hypotheses, head.references, lang=config.target_lang)
        return {'eval_bleu': scores['sacrebleu'], 'eval_chrf': scores['chrf']}

    return run
