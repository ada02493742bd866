"""Rollbacks (rollback_after): a run of skipped steps sends training back to a checkpoint.

The train step skips a step whose loss spikes (spike_skip) or is not finite (skip_nonfinite) and
counts the run of such steps in the state (t2t/train_lib.py, `init_guard`). After rollback_after
of them in a row the model itself is taken to be in a bad region (PaLM, section 5.1): the loop
stops (`Rollback`), the run goes back to the newest checkpoint before the run of skips, the
checkpoints after it are moved aside to WORKDIR/rolled_back/<step>-<time>, and training resumes
there with the data position past every batch drawn since that checkpoint, so the batches met on
the way into the bad region are not met again. One line says each rollback.

WORKDIR/rollbacks.json lists them ({at_step, run, to_step, from_batch, next_batch}); a run that
resumes from checkpoint `to_step` (a kill before its next save, or later a fallback) continues at
`next_batch` again, so the batches skipped stay skipped and a resume stays exact.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax

from t2t.infra import distributed
from t2t.infra import workdir as wd
from t2t.run import checkpoint_read

ROLLBACKS_NAME = 'rollbacks.json'
ROLLED_BACK = 'rolled_back'
MAX_ROLLBACKS_TO_ONE_STEP = 3  # more: the divergence is not the data's, stop with an error


@dataclasses.dataclass
class Rollback(Exception):
    """Raised by the loop: `run` steps up to `at_step` were skipped; the data iterator stands at
    global batch `next_batch` (the one after at_step's)."""

    at_step: int
    run: int
    next_batch: int


class RollbackError(FloatingPointError):
    """No checkpoint to go back to, or the same one too often."""


def read(workdir) -> list[dict]:
    text = wd.read_text(wd.path(workdir, ROLLBACKS_NAME))
    return json.loads(text) if text else []


def check_run(config, step: int, step_metrics: dict, train_iter) -> None:
    """Raises Rollback when step ends rollback_after skipped steps in a row. It reads the step's
    count at once: a device sync per step, for this option alone."""
    if config.rollback_after <= 0:
        return
    run = int(jax.device_get(step_metrics['skip_run']))
    if run >= config.rollback_after:
        raise Rollback(at_step=step, run=run, next_batch=int(train_iter.get_state()['next_index']))


def resume_batch(workdir, restored_step: int) -> int | None:
    """The global batch a run resumed from checkpoint `restored_step` continues at, when a
    rollback went back to that step (the latest such rollback); else None."""
    batches = [r['next_batch'] for r in read(workdir) if r['to_step'] == restored_step]
    return max(batches) if batches else None


def skip_rolled_back_batches(workdir, restored_step: int, train_iter, say) -> None:
    """Moves the data iterator resumed at checkpoint restored_step past the batches a rollback
    to that checkpoint skipped (none if there was no such rollback)."""
    skip_to = resume_batch(workdir, restored_step)
    if skip_to is not None:
        train_iter.set_state(dict(train_iter.get_state(), next_index=skip_to))
        say(f'continuing at global batch {skip_to}, after the batches a rollback to checkpoint '
            f'{restored_step} skipped ({wd.path(workdir, ROLLBACKS_NAME)})')


def roll_back(workdir, rollback: Rollback, say) -> dict:
    """Goes back to the newest checkpoint before the run of skips; returns the record written.

    Every process calls it (after the loop has closed its manager); process 0 moves and writes.
    """
    steps = checkpoint_read.finished_steps(workdir)
    first_skipped = rollback.at_step - rollback.run + 1
    good = [s for s in steps if s < first_skipped]
    done = read(workdir)
    where = (f'step {rollback.at_step}: {rollback.run} steps in a row skipped (loss spike or '
             'not finite)')
    if not good:
        raise RollbackError(f'{where} and no checkpoint before step {first_skipped} to go back '
                            'to in ' + str(checkpoint_read.checkpoint_dir(workdir)))
    to_step = good[-1]
    if sum(r['to_step'] == to_step for r in done) >= MAX_ROLLBACKS_TO_ONE_STEP:
        raise RollbackError(f'{where}, after {MAX_ROLLBACKS_TO_ONE_STEP} rollbacks to checkpoint '
                            f'{to_step} already: the divergence is not in the data skipped')
    from_batch = int(checkpoint_read.read_metadata(workdir, to_step)
                     [checkpoint_read.ITERATOR_KEY]['next_index'])
    record = {'at_step': rollback.at_step, 'run': rollback.run, 'to_step': to_step,
              'from_batch': from_batch, 'next_batch': rollback.next_batch}
    # Every process has read the listing and rollbacks.json before process 0 changes them.
    distributed.sync_devices(f't2t_rollback_read_{rollback.at_step}')
    if jax.process_index() == 0:
        stamp = time.strftime('%Y%m%d-%H%M%S')
        aside = wd.path(workdir, ROLLED_BACK)
        for step in steps:
            if step > to_step:  # its step number will be trained again, on other batches
                aside.mkdir(parents=True, exist_ok=True)
                (checkpoint_read.checkpoint_dir(workdir) / str(step)).rename(
                    aside / f'{step}-{stamp}')
        wd.write_atomic(wd.path(workdir, ROLLBACKS_NAME), json.dumps(done + [record], indent=1))
    distributed.sync_devices(f't2t_rollback_done_{rollback.at_step}')
    say(f'rollback at {where}: back to checkpoint {to_step}, skipping global batches '
        f'{from_batch}-{rollback.next_batch - 1} ({rollback.next_batch - from_batch} batches, '
        f'those since it); checkpoints after {to_step} moved to {wd.path(workdir, ROLLED_BACK)}')
    return record
