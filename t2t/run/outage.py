"""A checkpoint save that rides out a storage outage, up to config.storage_outage_limit_s.

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
import time

from t2t.infra import distributed
from t2t.infra import workdir as wd
from t2t.run import checkpoint

MAX_DELAY_S = 30.0


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

