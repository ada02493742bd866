"""Checkpoint saves that ride out a storage outage, up to config.storage_outage_limit_s.

`Saver` is the loop's. With the workdir in a bucket (one process or several) a save whose storage
fails is retried in the background while training goes on (`Saver` below: each move of it agreed
by every process, since an orbax save is collective). Otherwise (a local workdir) `save` retries
it synchronously, training waiting, as follows.

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

import os
import sys
import threading
import time
from typing import NamedTuple

import jax

from t2t.infra import distributed, uploads
from t2t.infra import workdir as wd
from t2t.run import checkpoint

MAX_DELAY_S = uploads.BACKOFF_MAX_S
FLUSH_WAIT_S = 2.0  # a due save waits this long for the metrics before it takes the slow road
# What a SIGTERM leaves for durable writes before the process goes; T2T_PREEMPTION_GRACE_S sets
# another (tests/test_bucket_faults.py: its SIGTERM in an outage waits it out in full).
PREEMPTION_GRACE_S = float(os.environ.get('T2T_PREEMPTION_GRACE_S', '20'))
ERROR_WAIT_S = 5.0  # what a run ending on an error leaves its pending save


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



# A process's part of the try under way, as each process gives it in a round (Saver._decide).
IDLE, RUNNING, DONE, FAILED, FATAL = range(5)
ROUND_S = 0.1  # between two rounds while the loop waits for a pending save


class _Shards(NamedTuple):
    shape: tuple
    sharding: object
    placement: list  # (device, index into the copy's data) of each addressable shard


def _index_key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def host_copy(state):
    """This process's shards of `state` in host memory, each distinct shard once (the devices of
    a replicated array share one): a retry's source while the device state moves on. Several
    processes: each copies only what it holds."""
    leaves, treedef = jax.tree.flatten(state)
    plans, fetch = [], []
    for x in leaves:
        if not isinstance(x, jax.Array):
            plans.append(x)
            continue
        first = {}
        for shard in x.addressable_shards:
            if _index_key(shard.index) not in first:
                first[_index_key(shard.index)] = len(fetch)
                fetch.append(shard.data)
        plans.append(_Shards(x.shape, x.sharding, [(s.device, first[_index_key(s.index)])
                                                   for s in x.addressable_shards]))
    return treedef, plans, jax.device_get(fetch)  # one transfer for all


def from_host_copy(copy):
    """The state `host_copy` copied, on its devices and shardings again."""
    treedef, plans, data = copy
    leaves = [jax.make_array_from_single_device_arrays(
        p.shape, p.sharding, [jax.device_put(data[i], device) for device, i in p.placement])
        if isinstance(p, _Shards) else p for p in plans]
    return jax.tree.unflatten(treedef, leaves)


class _Try:
    """This process's part of one try of the pending save, on a thread of its own: the wait for
    orbax's asynchronous save ('save'), or the removal of a failed try's unfinished directory
    (process 0) and the reload of the finished steps before the next ('clean'). Storage calls
    only: no device collective, which the loop's thread alone runs."""

    def __init__(self, kind: str, work=None, error: BaseException | None = None):
        self.kind, self.error = kind, error
        self.finalized = False  # 'clean': the step was found finished after all
        self._thread = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                            name=f't2t-save-{kind}')
            self._thread.start()

    def _run(self, work) -> None:
        try:
            work(self)
        except BaseException as e:  # noqa: BLE001 - read by the loop's next round
            self.error = e

    def join(self, seconds: float) -> None:
        if self._thread is not None:
            self._thread.join(seconds)

    def state(self) -> int:
        if self._thread is not None and self._thread.is_alive():
            return RUNNING
        if self.error is None:
            return DONE
        return FAILED if wd.transient_cause(self.error) is not None else FATAL


class Saver:
    """The loop's checkpoint saves (the module doc). In the background mode (a bucket workdir,
    storage_outage_limit_s > 0; one process or several), at a due save:

    - the previous save, if still pending, is waited for first (never two in flight);
    - the state is copied to host memory (the retry's source: the device state moves on) and,
      when process 0's metrics up to the step are in storage within FLUSH_WAIT_S (a checkpoint
      is never ahead of its records), orbax's asynchronous save starts as usual;
    - from then on, at every step (`check`) while it is pending, the processes agree in one
      round (a small device collective of the loop's thread, none on one process) on its next
      move: each gives the state of its part of the try under way (_Try), process 0 its clock's
      verdicts (the records written, a retry due after its back-off, the limit passed, a
      preemption's grace spent). Every process takes the same move from the same rows: it is
      saved (all done), it failed (a transient failure anywhere: back-off; another error: the
      run ends), the unfinished directory is removed and the finished steps reloaded ('clean',
      in the background), then saved again from the host copy in the loop's thread (orbax's
      save is collective; its write goes on in the background), or the limit has passed
      (StorageError naming it and the last durable checkpoint).
    Orbax finalizes a step only when all of it is written, so a pending save is never visible;
    `durable` is the newest checkpoint known to be in storage, and a pending one is never
    reported saved.
    """

    def __init__(self, manager: checkpoint.Manager, limit_s: float, writer, say):
        self.manager, self.limit_s, self.writer, self._say = manager, limit_s, writer, say
        self.background = limit_s > 0 and wd.is_url(manager.directory)
        self.durable = checkpoint.latest_step(manager)
        self.pending = None  # the step whose save every process agrees is not yet in storage
        self.skipped = None  # a preempted run's last save, not begun: the previous one pending
        self._try = None  # this process's part of the try under way
        self._save_args = None  # the last synchronous save's, for `finish`
        self._step = None
        self._deadline = self._grace_began = None  # a preempted run's grace (one for all)

    def _grace(self) -> float:
        return min(PREEMPTION_GRACE_S, self.limit_s)

    def check(self) -> None:
        """One round while a save is pending (every process calls it at every step): raises the
        error that ended it (a StorageError past the limit)."""
        if self.pending is not None:
            self._decide()

    def save(self, step: int, state, data_iter, extra_metadata: dict,
             preempted: bool = False) -> None:
        """Saves `state` as checkpoint `step` (see the class doc). preempted: the previous save
        is waited for PREEMPTION_GRACE_S at most; still pending, this one is not begun."""
        if not self.background:
            self._save_now(step, state, data_iter, extra_metadata)
            return
        if self.pending is not None:
            if self._failing and not preempted:
                self._say(f'checkpoint {step} is due while checkpoint {self.pending} is still '
                          'being saved through a storage outage: training waits for it')
            if not self._wait(self._grace() if preempted else None):
                self.skipped = step
                return
        mgr = self.manager.manager
        if step in mgr.all_steps() or not mgr.should_save(step):
            return  # saved already, or not newer than the latest
        self.pending, self._tries, self._failing = step, 0, False
        self._copy, self._mark = host_copy(state), self.writer.mark()
        self._meta = {**extra_metadata, checkpoint.ITERATOR_KEY: data_iter.get_state()}
        self._since, self._error, self._next_try = None, None, 0.0
        self._delay = min(1.0, MAX_DELAY_S)
        # A bucket known to fail: the background waits for the metrics, not the loop.
        wait_s = 0.0 if uploads.QUEUE.failing() else FLUSH_WAIT_S
        if distributed.process_0_decides(self.writer.written(wait_s, self._mark)):
            self._start_save(state)
        else:
            self._slow_road('waits for the metrics written before it')

    def _save_now(self, step, state, data_iter, extra_metadata) -> None:
        """The synchronous save: the records first, then `save`'s retry of a failure."""
        wait_s = max(self.limit_s, wd.RETRY_BUDGET_S)  # limit 0: the storage layer's retries
        if not self.writer.written(wait_s):
            raise wd.StorageError(f'writing the metrics to {self.writer.logdir} failed for '
                                  f'{wait_s:g} s (storage_outage_limit_s={self.limit_s:g})')
        distributed.wait_for('metrics-flushed', 'process 0 writes the metrics',
                             self.limit_s + 600, processes=[0])
        self._save_args = dict(data_iter=data_iter, extra_metadata=extra_metadata)
        self._step = step
        save(self.manager, step, state, self.limit_s, self._say, **self._save_args)

    def _start_save(self, state) -> None:
        """A try (every process, the loop's thread): orbax's save begins; its wait is a _Try."""
        if self._tries:  # orbax raises a failed save's error once in every thread that waits:
            try:  # here too, though its _Try has said it (the save's thread has ended)
                self.manager.manager.wait_until_finished()
            except Exception:  # noqa: BLE001 - known: the try failed
                pass
        self._tries += 1
        try:
            started = checkpoint.save(self.manager, self.pending, state, force=True,
                                      extra_metadata=self._meta)
        except checkpoint.CheckpointError as e:
            if wd.transient_cause(e) is None:
                raise
            self._try = _Try('save', error=e)
            return
        self._try = _Try('save', (lambda t: checkpoint.wait(self.manager)) if started else None)

    def _start_clean(self) -> None:
        step, manager = self.pending, self.manager

        def clean(t: _Try) -> None:
            if distributed.process_index() == 0:
                checkpoint.remove_unfinished(manager.directory, [step])
            manager.manager.reload()  # a failed save may be listed; finished steps are kept
            t.finalized = step in manager.manager.all_steps()

        self._try = _Try('clean', clean)

    def _verdicts(self) -> list[int]:
        """Process 0's clock: [records before the save written, a try due, limit passed, a
        preemption's grace spent]."""
        now = time.monotonic()
        return [int(self.writer.written(0.0, self._mark)), int(now >= self._next_try),
                int(self._since is not None and now - self._since >= self.limit_s),
                int(self._deadline is not None and now >= self._deadline)]

    def _decide(self) -> None:
        """One round: every process gives its part of the try under way, process 0 its verdicts;
        all take the same move from the same rows (the class doc)."""
        mine = self._try.state() if self._try is not None else IDLE
        rows = distributed.every_process_ints(
            [mine, int(self._try is not None and self._try.finalized),
             *(self._verdicts() if distributed.process_index() == 0 else [0, 0, 0, 0])])
        states, finalized = [r[0] for r in rows], {r[1] for r in rows}
        records, due, past_limit, self._grace_spent = rows[0][2:]
        if FATAL in states:
            raise self._try.error if mine == FATAL else checkpoint.CheckpointError(
                f'saving checkpoint {self.manager.directory / str(self.pending)} failed on '
                f'process {states.index(FATAL)}')
        if RUNNING in states:
            return
        done, self._try = self._try, None
        if done is not None:
            if FAILED in states or (done.kind == 'clean' and len(finalized) > 1):
                self._failed(done.error)  # the next move after the back-off, from the next round
                return
            if done.kind == 'save' or finalized == {1}:
                self._saved()
            else:  # cleaned up: the try itself, at once (the storage answered just now)
                self._start_save(from_host_copy(self._copy))
            return
        if past_limit:
            raise self._limit_error()
        if due and records:
            if self._tries:
                self._start_clean()
            else:
                self._start_save(from_host_copy(self._copy))

    def _slow_road(self, what: str) -> None:
        self._failing, self._since = True, time.monotonic()
        self._say(f'saving checkpoint {self.pending} {what}; it is saved in the background for '
                  f'up to {self.limit_s:.0f} s (storage_outage_limit_s), training goes on')

    def _failed(self, error: BaseException | None) -> None:
        """A try failed (error: this process's, None: another's): the next after a back-off.
        The write queue knows the storage is down meanwhile (uploads.Queue.down)."""
        self._error = error or self._error
        if not self._failing:
            self._slow_road(f'failed ({_why(error)})')
        uploads.QUEUE.set_down(self, (self._since, wd.transient_cause(self._error) or
                                      RuntimeError('on another process'),
                                      str(self.manager.directory / str(self.pending))))
        self._next_try = time.monotonic() + self._delay
        self._delay = min(2 * self._delay, MAX_DELAY_S)

    def _saved(self) -> None:
        step, self.pending, self._copy = self.pending, None, None
        self.durable = step
        uploads.QUEUE.set_down(self, None)
        if self._failing:
            self._say(f'checkpoint {step} saved after {time.monotonic() - self._since:.0f} s of '
                      'storage failures')

    def _limit_error(self) -> wd.StorageError:
        failing = uploads.QUEUE.failing()
        error = wd.transient_cause(self._error) or self._error if self._error is not None else \
            failing[1] if failing else TimeoutError(
                'it failed on another process' if self._tries else
                'the metrics before it were not written')
        return uploads.limit_error(
            f'saving checkpoint {self.manager.directory / str(self.pending)}', self._since,
            error, self.limit_s, self.durable)

    def _wait(self, grace_s: float | None = None) -> bool:
        """Rounds until the pending save is in storage: True. grace_s: False once process 0's
        grace is spent first (it begins at the first wait given one: a preempted run has one
        grace for its last saves and records)."""
        if grace_s is not None and self._deadline is None:
            self._grace_began = time.monotonic()
            self._deadline = self._grace_began + grace_s
        self._grace_spent = False
        while self.pending is not None:
            if grace_s is not None and self._grace_spent:
                return False
            time.sleep(ROUND_S)
            self._decide()
        return True

    def finish(self, state, ended: bool, preempted: bool) -> bool:
        """At the end of the run: waits for the last save (when the run ended well, until it is
        saved or the limit ends it; when preempted, what is left of PREEMPTION_GRACE_S for it
        and the metrics; on an error, ERROR_WAIT_S, and on several processes with no round, as
        they may be apart). What is then still not in storage is said in one line (an error
        when the run ended well). False when a save is still under way (the manager is not to
        be closed: the process ends)."""
        if not self.background:
            if ended and self._save_args is not None:
                wait(self.manager, self._step, state, self.limit_s, self._say,
                     **self._save_args)
            else:
                checkpoint.wait(self.manager)
            return True
        began = time.monotonic()
        try:
            if ended or preempted:
                saved = self._wait(self._grace() if preempted else None)
            elif distributed.process_count() == 1:
                saved = self._wait(ERROR_WAIT_S)
            else:
                if self._try is not None:
                    self._try.join(ERROR_WAIT_S)
                saved = self.pending is None
        except BaseException:
            if ended:
                raise
            saved = False
        if preempted:
            self.writer.written(max(0.0, self._deadline - time.monotonic()))
        unwritten = self.writer.unwritten() if preempted or not saved else {}
        if saved and not unwritten:
            return True
        line = self._not_durable(
            time.monotonic() - (self._grace_began if preempted else began), unwritten, saved)
        if preempted or not ended:
            self._say(line)
            return saved
        raise wd.StorageError(line)

    def _not_durable(self, seconds: float, unwritten: dict, saved: bool) -> str:
        """The one line of what is not yet in storage at the end of a run (a preempted one:
        seconds since its grace began): the checkpoints, the metric records, and the rest of the
        write queue (the goodput ledger's records, which its `end` does not name again)."""
        steps = [s for s in (self.pending, self.skipped) if s is not None and not saved]
        records = self.writer.unwritten_records() if unwritten else 0
        files = ', '.join(sorted(p.rsplit('/', 1)[-1] for p in unwritten))
        ledger = uploads.QUEUE.pending - sum(unwritten.values())
        return (f'not yet in storage after {seconds:.0f} s: '
                + ', '.join([f'checkpoint {s}' for s in steps]
                            + ([f'{records} metric record{"s" if records != 1 else ""} in '
                                f'{sum(unwritten.values())} bytes ({files}), redone from the '
                                'checkpoint'] if unwritten else [])
                            + ([f'{ledger} bytes of the goodput ledger'] if ledger > 0 else []))
                + '; the last checkpoint in storage is '
                + (f'step {self.durable}' if self.durable is not None else 'none'))
