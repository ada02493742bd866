"""The training loop: data -> train_step -> metrics, with evaluation, checkpoints and preemption.

Everything here is orchestration with I/O; the maths lives in t2t/train_lib.py. A workdir that
holds checkpoints is resumed from the newest good one (state, data iterator position and rng; a
corrupt step is moved aside), so a stopped, killed or preempted and resumed run computes exactly
what an uninterrupted one would: the same states, and the same metrics at every logged step (the
sums of steps not yet logged travel in the checkpoint, t2t/train/interval.py; records after the
restored step, written before the interruption, are removed from metrics.jsonl and the event
files).

A SIGTERM (preemption) is seen at the next step: the loop skips evaluation, saves and returns. The
host runs at most one step ahead of the device, so that moment is near. A run that completed
(num_train_steps, the time budget or early stopping: t2t/run/best.py) leaves
WORKDIR/TRAINING_FINISHED for evaluate.py --watch. Rollbacks: t2t/train/guards.py.

`_train_and_evaluate` reads as the run goes: set up, restore, prepare, then train step by step
(each step logged, evaluated and saved when due), close. `_Run` holds what the steps make and
what the loop changes.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Any

import jax
import numpy as np

from t2t import goodput, optim, sharding, train_lib
from t2t.data import identity
from t2t.eval.validation import evaluate_loss  # the loop's validation loss (a name tests replace)
from t2t.infra import distributed, flops, metrics, trackers, uploads, watchdog
from t2t.infra import workdir as wd
from t2t.infra.preemption import Interrupted, PreemptionFlag
from t2t.run import best, checkpoint, compile_cache, outage, profiling, run_record, startup
from t2t.train import guards
from t2t.train.interval import Interval, NonFiniteLossError, log_train


@dataclasses.dataclass
class TrainResult:
    step: int
    stopped_by: str  # 'num_train_steps', 'time_budget', 'early_stopping' or 'preemption'
    train_metrics: dict
    eval_metrics: dict


@dataclasses.dataclass
class _Run:
    """One attempt at training a workdir: what the steps of `_train_and_evaluate` make (each
    group of fields filled by the step named above it) and what the loop changes."""

    # _setup
    config: Any
    workdir: str
    ledger: goodput.Ledger
    profile: profiling.Profiler
    mesh: jax.sharding.Mesh
    record: dict  # what ran (WORKDIR/run-*.json)
    batch_sharding: jax.sharding.NamedSharding
    eval_rows: int  # eval_batch_size padded to a multiple of the data-parallel devices
    tokenizer: Any
    train_iter: Any  # the global batches' iterator (its position is checkpointed)
    data_identity: dict  # what a checkpoint records of the data (t2t/data/identity.py)
    # _restore
    tx: Any = None
    manager: checkpoint.Manager | None = None
    state_shardings: Any = None
    state: train_lib.TrainState | None = None
    meta: dict = dataclasses.field(default_factory=dict)  # the restored checkpoint's metadata
    trained_s: float = 0.0  # training seconds of earlier runs of this workdir (the budget is total)
    tracker: best.Tracker | None = None
    # _prepare
    train_fn: Any = None  # the compiled train step
    eval_fn: Any = None  # the compiled eval step
    eval_data: Any = None
    writer: metrics.MetricWriter | None = None
    flops_per_step: float = 0.0
    flops_per_token: tuple = (0.0, 0.0)  # (source token, target token)
    peak: float | None = None  # the device's peak FLOP/s (None: unknown)
    bleu_eval: Any = None  # params -> BLEU and chrF, or None (t2t/eval/evaluation.py)
    train_start: float = 0.0
    interval: Interval | None = None
    outage_limit_s: float = 0.0
    saver: outage.Saver | None = None
    preemption: PreemptionFlag | None = None
    dog: watchdog.Watchdog | None = None
    # the loop's
    step: int = 0
    stopped_by: str = 'num_train_steps'
    train_summary: dict = dataclasses.field(default_factory=dict)
    eval_summary: dict = dataclasses.field(default_factory=dict)

    def train_seconds(self) -> float:
        return self.trained_s + time.perf_counter() - self.train_start

    def over_budget(self) -> bool:
        budget = self.config.train_time_budget_s
        return budget > 0 and self.train_seconds() >= budget


def _say(message: str) -> None:
    """A progress line on stdout, from the first process only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
    """One attempt: set up, restore, prepare, then train step by step until a stop; the loop's
    resources are closed whatever ends it (a Rollback or an error goes to train_and_evaluate)."""
    run = _setup(config, workdir, devices, ledger)
    _restore(run)
    _prepare(run)
    ended = False
    try:
        _before_training(run)
        while run.step < config.num_train_steps and run.stopped_by == 'num_train_steps':
            _train_step(run)
            if _after_step(run):
                break
        ended = True
    finally:
        _close(run, ended)
    if run.stopped_by != 'preemption':
        run_record.mark_finished(workdir, run.step, run.stopped_by)
    return TrainResult(step=run.step, stopped_by=run.stopped_by, train_metrics=run.train_summary,
                       eval_metrics=run.eval_summary)


def _setup(config, workdir, devices, ledger: goodput.Ledger) -> _Run:
    """The mesh (the config checked against it), the run record and the training data."""
    profile = profiling.Profiler.from_config(config, workdir, ledger)
    mesh = startup.make_mesh(config, devices)  # one that cannot be: a ConfigError, here
    _say(f'mesh {dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].platform} devices '
         f'({jax.process_count()} processes)')
    startup.check_training_config(config, mesh)
    trackers.check_dir(config, workdir)  # a bucket workdir needs a local tracker_dir
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
    return _Run(config=config, workdir=workdir, ledger=ledger, profile=profile, mesh=mesh,
                record=record, batch_sharding=batch_sharding, eval_rows=eval_rows,
                tokenizer=tokenizer, train_iter=train_iter, data_identity=data_identity)


def _restore(run: _Run) -> None:
    """The state of the newest good checkpoint (its data position and metadata too), else a
    fresh one; the best checkpoints' tracker the checkpoint carries."""
    config, workdir, ledger = run.config, run.workdir, run.ledger
    run.tx = optim.make_optimizer(optim.OptimConfig.from_config(config))
    run.manager = manager = checkpoint.make_manager(workdir, config)
    abstract = train_lib.abstract_state(config, run.mesh, run.tx)
    run.state_shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
    ledger.mark('restore')
    restored = checkpoint.restore_newest_good(  # the state and its metadata, in one read
        manager, lambda s: checkpoint.restore(manager, s, abstract, run.train_iter,
                                              with_metadata=True))
    ledger.mark('setup')
    if restored is None:
        run.state, _ = train_lib.create_sharded_state(config, run.mesh, run.tx)
    else:
        latest, (run.state, run.meta) = restored
        _say(f'resuming from checkpoint {latest} in {workdir}')
        run.trained_s = float(run.meta.get('train_seconds', 0.0))
        mapped = identity.check_resume(
            run.meta.get(identity.DATA_KEY), run.data_identity,
            run.meta.get(checkpoint.ITERATOR_KEY), allow_change=config.allow_data_change,
            where=f'checkpoint {latest} of {workdir}')
        if mapped is not None:
            run.train_iter.set_state(mapped)
        guards.skip_rolled_back_batches(workdir, latest, run.train_iter, _say)
    run_record.clear_finished(workdir)
    run.tracker = best.Tracker.from_config(config, run.meta.get(best.META_KEY))
    checkpoint.keep_best_steps(manager, run.tracker.kept_steps())


def _prepare(run: _Run) -> None:
    """The compiled steps, the evaluation data, the metric writer, the checkpoint saver and the
    watchers (SIGTERM, slow or stuck steps) of the loop."""
    from t2t import data  # grain / tfds / sentencepiece stay out of the model path
    from t2t.eval import evaluation

    config, ledger, mesh = run.config, run.ledger, run.mesh
    step_config = train_lib.StepConfig.from_config(config)
    # A restart loads the programs a run of the same config and code stored (compile_cache.py).
    run.train_fn = ledger.compiling(compile_cache.stored(
        train_lib.jit_train_step(step_config, run.tx, run.state_shardings, mesh), config,
        'train_step'))
    run.eval_fn = ledger.compiling(compile_cache.stored(
        train_lib.jit_eval_step(step_config, run.state_shardings.params, mesh), config,
        'eval_step'))
    run.eval_data = data.eval_split(config, run.tokenizer, config.eval_split)
    num_eval = len(run.eval_data.plan(config.eval_batch_size))
    _say(f'eval loss on {run.eval_data.name}: ' + (
        f'all {num_eval} batches' if not 0 <= config.num_eval_batches < num_eval else
        f'{config.num_eval_batches} of {num_eval} batches, a fixed seeded sample across the '
        'length buckets (num_eval_batches=-1: all)'))

    run.step = int(jax.device_get(run.state.step))
    ledger.begin(run.step)
    run.writer = _metric_writer(run)
    run.flops_per_step = flops.config_flops_per_step(config)
    run.flops_per_token = flops.config_flops_per_token(config)
    run.peak = metrics.peak_flops_per_device()
    run.bleu_eval = evaluation.make_bleu_eval(config, step_config.model, run.tokenizer,
                                              run.eval_data, mesh)
    run.train_start = time.perf_counter()
    run.interval = Interval(run.meta.get('unlogged_metrics'))
    run.outage_limit_s = config.get('storage_outage_limit_s', 0.0)
    run.saver = _storage_writes(config, run.manager, run.writer, ledger, run.outage_limit_s)
    run.preemption = PreemptionFlag().install()
    run.dog = watchdog.Watchdog.from_config(config, jax.process_index(), ledger.finding)
    # A metrics write waits for the workdir's storage (long in a bucket outage): the ledger books
    # it as 'logging', not training, and the watchdog does not take it for a slow step.
    run.writer.write_scalars = run.dog.paused(
        ledger.timed('logging', slice_after=False)(run.writer.write_scalars))


def _metric_writer(run: _Run) -> metrics.MetricWriter:
    """metrics.jsonl, TensorBoard and the trackers, from this run's first step on (process 0)."""
    config, workdir, step = run.config, run.workdir, run.step
    # A pending evaluation (see `_after_step`) may have been written by a run killed after it.
    return metrics.MetricWriter(
        workdir, enabled=jax.process_index() == 0, start_step=step,
        redo_at_start=('eval_',) if run.meta.get('evaluation_pending') else (),
        tensorboard='tensorboard' in trackers.names(config.trackers),
        sinks=trackers.open_sinks(config, workdir, start_step=step, record=run.record,
                                  enabled=jax.process_index() == 0))


def _before_training(run: _Run) -> None:
    """What comes before the first step: the evaluation a preemption left pending, and the stops
    that leave nothing to train (early stopping reached, the time budget spent)."""
    config = run.config
    if run.meta.get('evaluation_pending'):  # preempted at an evaluation step: evaluate it now
        summary = _evaluate(run)
        if summary is None:  # preempted again: the checkpoint still says pending
            run.stopped_by = 'preemption'
        else:
            run.eval_summary = summary
    if run.stopped_by == 'num_train_steps' and run.tracker.exhausted() \
            and run.step < config.num_train_steps:
        run.stopped_by = 'early_stopping'
        _say(run.tracker.stop_line(run.step) + ': nothing to train')
    if run.stopped_by == 'num_train_steps' and distributed.process_0_decides(run.over_budget()):
        run.stopped_by = 'time_budget'
        _say(f'the time budget of {config.train_time_budget_s:.0f} s is spent in {run.workdir}: '
             'nothing to train')


def _train_step(run: _Run) -> None:
    """One update on the next global batch (this process's rows of it); its metrics summed."""
    run.profile.step(run.step + 1, run.state)
    run.ledger.next_step()
    run.dog.mark('step', run.step + 1)
    batch = sharding.put_rows(next(run.train_iter), run.batch_sharding, run.config.batch_size)
    run.ledger.mark('train')
    run.state, step_metrics = run.train_fn(run.state, batch)
    run.step += 1
    run.interval.add(run.step, step_metrics)
    guards.check_run(run.config, run.step, step_metrics, run.train_iter)  # may raise Rollback
    run.saver.check()  # a save retried in the background failed past the limit


def _after_step(run: _Run) -> bool:
    """The step's log, evaluation and checkpoint, each when due; whether the run stops here."""
    config, step = run.config, run.step
    is_last = step == config.num_train_steps
    logged = step % config.log_every_steps == 0 or is_last
    if logged:
        _log(run, is_last)
    if run.preemption.reached(step, at_log_step=logged):
        run.stopped_by = 'preemption'
    stopping = run.stopped_by != 'num_train_steps' or is_last
    preempted = run.stopped_by == 'preemption'
    scheduled_eval = step % config.eval_every_steps == 0 or is_last
    # Preempted: save at once; a scheduled evaluation is left to the resumed run, and so is an
    # interrupted one (also the final evaluation of a time-budget stop).
    evaluation_pending = scheduled_eval and preempted
    if (scheduled_eval or stopping) and not preempted:
        run.dog.mark('other', step)
        summary = _evaluate(run)
        if summary is None:  # SIGTERM during the evaluation: save this step now
            run.stopped_by, evaluation_pending = 'preemption', True
        else:
            run.eval_summary = summary
            if run.tracker.exhausted() and not stopping:
                run.stopped_by = 'early_stopping'
                _say(run.tracker.stop_line(step))
                if not logged:  # the last steps' train metrics, not left unwritten
                    run.train_summary = _log_train(run)
        stopping = run.stopped_by != 'num_train_steps' or is_last
        preempted = run.stopped_by == 'preemption'
    # A step among the best is saved whatever checkpoint_every_steps says.
    if step % config.checkpoint_every_steps == 0 or stopping or step in run.tracker.kept_steps():
        _save(run, preempted, evaluation_pending)
    if logged and not stopping:  # after evaluation and saving: step times measure training alone
        run.interval = Interval()
    return stopping


def _log(run: _Run, is_last: bool) -> None:
    """The interval's training metrics written; then the time budget (process 0 decides)."""
    config = run.config
    run.train_summary = _log_train(run)
    run.ledger.flush('log')
    if distributed.process_0_decides(run.over_budget()) and not is_last:
        run.stopped_by = 'time_budget'
        _say(f'the time budget (train_time_budget_s={config.train_time_budget_s:g}) '
             f'cut the run at step {run.step} of num_train_steps={config.num_train_steps}')


def _log_train(run: _Run) -> dict:
    return log_train(run.writer, run.interval, run.config, run.step, run.state,
                     run.flops_per_step, run.flops_per_token, run.peak, run.mesh.size)


def _evaluate(run: _Run) -> dict | None:
    """The eval scalars (also written), or None when a SIGTERM arrived meanwhile. With
    ema_decay > 0 the EMA weights are evaluated too, the same way: eval_*_ema."""
    return run.ledger.timed('eval')(_evaluate_weights)(run)


def _evaluate_weights(run: _Run) -> dict | None:
    config = run.config
    weights = {'': run.state.params}
    if run.state.ema is not None:
        weights['_ema'] = run.state.ema
    summary = {}
    for suffix, params in weights.items():
        batches = run.eval_data.batches(config.eval_batch_size, run.eval_rows,
                                        num_batches=config.num_eval_batches, seed=config.seed)
        try:
            losses = evaluate_loss(run.eval_fn, params, run.preemption.interruptible(batches),
                                   run.mesh, -1)
        except Interrupted:
            return None
        summary.update({f'eval_{k}{suffix}': v for k, v in losses.items()})
    if run.bleu_eval is not None:
        for suffix, params in weights.items():
            summary.update({f'{k}{suffix}': v for k, v in run.bleu_eval(params).items()})
    run.writer.write_scalars(run.step, summary)
    if best.enabled(config):
        _say(run.tracker.update(summary, run.step))
        checkpoint.keep_best_steps(run.manager, run.tracker.kept_steps())
    return summary


def _save(run: _Run, preempted: bool, evaluation_pending: bool) -> None:
    """Checkpoints this step: the state, the data position and what a resume needs to go on
    exactly (the unlogged sums, a pending evaluation, the best steps, the data's identity)."""
    run.interval.check_finite(run.config.skip_nonfinite)  # never save a non-finite state
    run.ledger.mark('checkpoint')
    run.dog.mark('save', run.step)
    run.saver.save(run.step, run.state, run.train_iter, preempted=preempted, extra_metadata={
        'train_seconds': run.train_seconds(),
        'unlogged_metrics': run.interval.unlogged(),
        'evaluation_pending': evaluation_pending,
        best.META_KEY: run.tracker.record(),
        identity.DATA_KEY: run.data_identity})
    run.ledger.mark('train', flush='checkpoint')


def _close(run: _Run, ended: bool) -> None:
    """After the loop, however it ended: the profile, the last save (waited for), the watchers,
    the metric writer (its queued writes flushed)."""
    run.profile.close(run.state, run.step)
    run.ledger.mark('checkpoint')  # the wait for the last save
    run.dog.mark('save', run.step)  # the last asynchronous save is watched too
    try:
        run.preemption.uninstall()
        if run.saver.finish(run.state, ended, preempted=run.stopped_by == 'preemption'):
            checkpoint.close(run.manager)  # else a save still under way: the process ends
    finally:
        run.dog.close()
        error = sys.exc_info()[1]  # what ends the run, if not its last step
        run.writer.close(run.outage_limit_s, quiet=not ended or run.stopped_by == 'preemption',
                         upload=wd.storage_failure(error) is None)


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
