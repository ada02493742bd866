"""Checkpoint saves that ride out a storage outage, up to config.storage_outage_limit_s.

`Saver` is the loop's: with the workdir in a bucket (one process) a save whose storage fails is
retried in the background while training goes on (`Saver` below); otherwise, and on several
processes (each attempt is a collective save that every process must retry in step, agreed by a
device collective the loop thread alone may run), `save` retries it synchronously, training
waiting, as follows.

A regional storage incident routinely lasts longer than the storage clients' own retries (gcsfs
and tensorstore give up after about half a minute; t2t/infra/workdir.py adds a minute). A save whose
failure is transient (workdir.is_transient: a 5xx, 429, reset or timeout, anywhere in the error's
chain) is therefore tried again, synchronously, with backoff: the current state at the current
step, after the failed step's unfinished directory is removed. Training waits meanwhile. The save
that failed may be this step's or the previous asynchronous one (its error arrives here): either
way the step saved is this one, so nothing trained is lost. When the storage is still failing
after the limit, workdir.StorageError names the step directory and the error; train.py exits with
exits.STORAGE, the last finalized checkpoint intact. Each attempt is a collective save: every
process takes the same branch (distributed.any_process), so a failure seen by one process is
retried by all. The start and the end of an outage are said in one line each.
"""

from __future__ import annotations

import sys
import threading
import time

import jax

from t2t.infra import distributed, uploads
from t2t.infra import workdir as wd
from t2t.run import checkpoint

MAX_DELAY_S = uploads.BACKOFF_MAX_S
FLUSH_WAIT_S = 2.0  # a due save waits this long for the metrics before it takes the slow road
PREEMPTION_GRACE_S = 20.0  # what a SIGTERM leaves for durable writes before the process goes


def _discard_unfinished(manager: checkpoint.Manager, steps) -> None:
    """Process 0 removes the directories of `steps` that were begun but never finalized (a save
    of the same step would find them in its way); then every process goes on together."""
    problem = None
    if distributed.process_index() == 0:
        try:  # one try: the loop retries
            checkpoint.remove_unfinished(manager.directory, steps)
        except Exception as e:  # still failing: the others must not wait at the barrier for it
            if wd.transient_cause(e) is None:
                raise
            problem = e
    distributed.wait_for('outage-discard', 'an unfinished checkpoint is removed', 600)
    if problem is not None:
        raise problem
    manager.manager.reload()


def save(manager: checkpoint.Manager, step: int, state, limit_s: float, say=None,
         **save_kwargs) -> bool:
    """checkpoint.save(manager, step, state, **save_kwargs), retried through a storage outage of
    up to limit_s (0: not retried; the error is raised as before). Returns what save returns."""
    error, failed, saved = None, set(), False
    try:
        failed = set(manager.pending)  # the previous asynchronous save first
        checkpoint.wait(manager)
        failed = {step}
        saved = checkpoint.save(manager, step, state, **save_kwargs)
    except checkpoint.CheckpointError as e:
        if limit_s <= 0 or wd.transient_cause(e) is None:
            raise
        error = e
    if not distributed.any_process(error is not None):
        return saved
    return _retry(manager, step, state, failed | {step}, error, limit_s, say, save_kwargs)


def wait(manager: checkpoint.Manager, step: int, state, limit_s: float, say=None,
         **save_kwargs) -> None:
    """checkpoint.wait(manager) for the last save (of `step`, whose state is `state`), its
    storage failure retried as in `save`."""
    error = None
    try:
        checkpoint.wait(manager)
    except checkpoint.CheckpointError as e:
        if limit_s <= 0 or wd.transient_cause(e) is None:
            raise
        error = e
    if distributed.any_process(error is not None):
        _retry(manager, step, state, {step}, error, limit_s, say, save_kwargs)


def _retry(manager, step, state, failed_steps, error, limit_s, say, save_kwargs) -> bool:
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    start, delay = time.monotonic(), 1.0
    # orbax's cached list (no storage call), without the steps whose saves failed
    intact = [s for s in checkpoint.all_steps(manager) if s not in failed_steps]
    why = _why(error)
    say(f'saving checkpoint {step} failed ({why}); saving it again for up to {limit_s:.0f} s '
        '(storage_outage_limit_s), training waits')
    while True:
        waited = time.monotonic() - start
        if distributed.process_0_decides(waited >= limit_s):
            raise wd.StorageError(
                f'saving checkpoint {manager.directory / str(step)} failed for {waited:.0f} s '
                f'(storage_outage_limit_s={limit_s:g}): {why}; '
                + (f'the last checkpoint saved is step {intact[-1]}' if intact else
                   'no checkpoint was saved before'))
        time.sleep(min(delay, max(0.0, limit_s - waited)))
        delay = min(2 * delay, MAX_DELAY_S)
        error = None
        try:
            _discard_unfinished(manager, failed_steps)
            checkpoint.save(manager, step, state, force=True, **save_kwargs)
            checkpoint.wait(manager)
        except Exception as e:  # the save's CheckpointError, or the discard's own storage calls
            if wd.transient_cause(e) is None:
                raise
            error = e
        if not distributed.any_process(error is not None):
            say(f'checkpoint {step} saved after {time.monotonic() - start:.0f} s of storage '
                'failures')
            return True
        why = _why(error)


def _why(error: BaseException | None) -> str:
    """This process's transient failure in one line (None: another process failed)."""
    return wd.describe(wd.transient_cause(error)) if error else 'on another process'



class Saver:
    """The loop's checkpoint saves (the module doc). In the background mode, at a due save:

    - the previous save, if still pending, is waited for first (never two in flight; its
      storage failure past the limit is raised here, or by `check` at any step);
    - the state is copied to host memory (the retry's source: the device state moves on) and,
      when the metrics up to the step are in storage within FLUSH_WAIT_S (so that a checkpoint
      is never ahead of its records), orbax's asynchronous save starts as usual;
    - a thread waits for it; if it fails transiently (or was not started: the metrics were
      behind), the thread waits for the metrics, removes the unfinished step directory and
      saves again from the host copy with back-off, until it succeeds or limit_s has passed.
    Orbax finalizes a step only when all of it is written, so a pending save is never visible;
    `durable` is the newest checkpoint known to be in storage.
    """

    def __init__(self, manager: checkpoint.Manager, limit_s: float, writer, say):
        self.manager, self.limit_s, self.writer, self._say = manager, limit_s, writer, say
        self.background = (limit_s > 0 and wd.is_url(manager.directory)
                           and distributed.process_count() == 1)
        self.durable = checkpoint.latest_step(manager)
        self.pending = None  # the step whose save is in the background
        self._thread, self._error = None, None
        self._save_args = None  # the last synchronous save's, for `finish`
        self._step = None
        self.skipped = None  # a preempted run's last save, not begun: the previous one pending

    def check(self) -> None:
        """Raises the error that ended the pending save (a StorageError past the limit)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join(0.0)

    def save(self, step: int, state, data_iter, extra_metadata: dict,
             preempted: bool = False) -> None:
        """Saves `state` as checkpoint `step` (see the class doc). preempted: the previous save
        is waited for PREEMPTION_GRACE_S at most; still pending, this one is not begun."""
        if not self.background:  # the records first, then the synchronous retry of a failure
            wait_s = max(self.limit_s, wd.RETRY_BUDGET_S)  # limit 0: the storage layer's retries
            if not self.writer.written(wait_s):
                raise wd.StorageError(f'writing the metrics to {self.writer.logdir} failed for '
                                      f'{wait_s:g} s (storage_outage_limit_s='
                                      f'{self.limit_s:g})')
            distributed.wait_for('metrics-flushed', 'process 0 writes the metrics',
                                 self.limit_s + 600, processes=[0])
            self._save_args = dict(data_iter=data_iter, extra_metadata=extra_metadata)
            self._step = step
            save(self.manager, step, state, self.limit_s, self._say, **self._save_args)
            return
        if self._thread is not None:
            if self._thread.is_alive() and self._thread.slow and not preempted:
                self._say(f'checkpoint {step} is due while checkpoint {self.pending} is still '
                          'being saved through a storage outage: training waits for it')
            if not self._join(min(PREEMPTION_GRACE_S, self.limit_s) if preempted else None):
                self.skipped = step
                return
        mgr = self.manager.manager
        if step in mgr.all_steps() or not mgr.should_save(step):
            return  # saved already, or not newer than the latest
        meta = {**extra_metadata, checkpoint.ITERATOR_KEY: data_iter.get_state()}
        shardings = jax.tree.map(lambda x: x.sharding, state)
        host = jax.device_get(state)
        mark = self.writer.mark()
        started = False
        # A bucket known to fail: the background waits for the metrics, not the loop.
        if self.writer.written(0.0 if uploads.QUEUE.failing() else FLUSH_WAIT_S, mark):
            try:
                started = checkpoint.save(self.manager, step, state, extra_metadata=meta,
                                          force=True)
            except checkpoint.CheckpointError as e:
                if wd.transient_cause(e) is None:
                    raise
        self.pending = step
        self._thread = threading.Thread(
            target=self._run, args=(step, host, shardings, meta, mark, started), daemon=True,
            name=f't2t-save-{step}')
        self._thread.slow = False  # set once the save takes the slow road (an outage)
        self._thread.start()

    def _join(self, timeout_s: float | None) -> bool:
        """Waits for the pending save; raises its error. False when still pending."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self._thread, self.pending = None, None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def _run(self, step, host, shardings, meta, mark, started) -> None:
        start, delay, error = time.monotonic(), min(1.0, MAX_DELAY_S), None
        try:
            if started:
                try:
                    checkpoint.wait(self.manager)
                    self.durable = step
                    return
                except checkpoint.CheckpointError as e:
                    if wd.transient_cause(e) is None:
                        raise
                    error = e
            threading.current_thread().slow = True
            what = f'saving checkpoint {step}' + (f' failed ({_why(error)})' if error else
                                                   ' waits for the metrics written before it')
            self._say(f'{what}; it is saved in the background for up to {self.limit_s:.0f} s '
                      '(storage_outage_limit_s), training goes on')
            while True:
                if not self.writer.written(max(0.0, self.limit_s - (time.monotonic() - start)),
                                           mark) or time.monotonic() - start >= self.limit_s:
                    failing = uploads.QUEUE.failing()
                    raise uploads.limit_error(
                        f'saving checkpoint {self.manager.directory / str(step)}', start,
                        wd.transient_cause(error) or error if error is not None else
                        failing[1] if failing else
                        TimeoutError('the metrics before it were not written'),
                        self.limit_s, self.durable)
                if error is not None:
                    time.sleep(min(delay, max(0.0, self.limit_s - (time.monotonic() - start))))
                    delay = min(2 * delay, MAX_DELAY_S)
                try:
                    checkpoint.remove_unfinished(self.manager.directory, [step])
                    self.manager.manager.reload()
                    checkpoint.save(self.manager, step, jax.device_put(host, shardings),
                                    force=True, extra_metadata=meta)
                    checkpoint.wait(self.manager)
                except Exception as e:  # the save's CheckpointError, or the removal's own calls
                    if wd.transient_cause(e) is None:
                        raise
                    error = e
                    continue
                self.durable = step
                self._say(f'checkpoint {step} saved after {time.monotonic() - start:.0f} s of '
                          'storage failures')
                return
        except BaseException as e:  # noqa: BLE001 - raised in the loop's thread by _join
            self._error = e

    def finish(self, state, ended: bool, preempted: bool) -> bool:
        """At the end of the run: waits for the last save (past limit_s it fails by itself when
        the run ended well; PREEMPTION_GRACE_S for it and the metrics when preempted; a moment on
        an error). What is then still not in storage is said in one line (an error when the run
        ended well). False when a save is still under way (the manager is not to be closed: the
        process ends)."""
        if not self.background:
            if ended and self._save_args is not None:
                wait(self.manager, self._step, state, self.limit_s, self._say,
                     **self._save_args)
            else:
                checkpoint.wait(self.manager)
            return True
        began = time.monotonic()
        grace = min(PREEMPTION_GRACE_S, self.limit_s) if preempted else \
            self.limit_s + 120 if ended else 5.0  # the thread ends itself past limit_s
        saved = True
        try:
            saved = self._thread is None or self._join(grace)
        except BaseException:
            if ended:
                raise
        if preempted:
            self.writer.written(max(0.0, began + grace - time.monotonic()))
        unwritten = self.writer.unwritten() if preempted or not saved else {}
        if saved and not unwritten:
            return True
        steps = [s for s in (self.pending, self.skipped) if s is not None and not saved]
        line = ('not yet in storage after '
                f'{time.monotonic() - began:.0f} s: '
                + ', '.join([f'checkpoint {s}' for s in steps]
                            + ([f'{sum(unwritten.values())} bytes of metrics ('
                                + ', '.join(sorted(p.rsplit('/', 1)[-1] for p in unwritten))
                                + '), redone from the checkpoint' ] if unwritten else []))
                + '; the last checkpoint in storage is '
                + (f'step {self.durable}' if self.durable is not None else 'none'))
        if preempted or not ended:
            self._say(line)
            return saved
        raise wd.StorageError(line)
