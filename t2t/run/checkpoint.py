"""Checkpoints of a training run: the orbax manager, save and resume (state, data iterator, rng).

Checkpoint code lives in three modules of t2t/run, split by what it does: this one writes (the
run's manager, its saves, the steps it keeps, deletes or moves aside, and the resume through the
same manager); checkpoint_read.py reads (the layout, the checksums, and the read-only side that
evaluation, --watch and export use); layers_convert.py converts (parameter trees and checkpoints
between unrolled and scanned layers). orbax is imported by the first two alone.

Atomicity: orbax writes a step into a temporary directory and renames it when every item is
complete, so a crash mid-save leaves no half-written step (leftovers are removed at the next start).
Old steps beyond keep_checkpoints (and not among keep_best's best steps, t2t/run/best.py) are first
renamed into checkpoints/.deleted (emptied after each save and at start), so a crash
mid-deletion never leaves a half-deleted step that looks complete (`finished_steps` and orbax
skip names that are not step numbers).
A failed save (e.g. a full disk) raises CheckpointError naming the step at the next `save` or
`wait`; the steps saved before stay intact. `save` refuses a state that holds NaN or inf, and
records a fingerprint of every array that `restore` checks: a corrupt checkpoint raises
CorruptCheckpointError naming the step directory. A checkpoint that is readable but does not fit
the requested state (a different config) raises a plain CheckpointError. `restore_newest_good`
falls back over corrupt steps, moving each aside to WORKDIR/corrupt/<step>-<time> so a restarted
job does not trip on it.

Multi-process: call `save` and `restore` on every process (orbax coordinates the writes).
"""

import dataclasses
import importlib.metadata
import json
import logging
import os
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

try:  # orbax's background-save threads, for `_release_stranded` (private: optional)
    from orbax.checkpoint._src.futures import future as _orbax_future
except ImportError:
    _orbax_future = None

from t2t.infra import distributed
from t2t.infra import workdir as wd
from t2t.run.checkpoint_read import (  # the errors and the layout every caller of save/restore uses
    ITERATOR_KEY,
    META,
    STATE,
    CheckpointError,
    CorruptCheckpointError,
    attention_bias_mismatch,
    checkpoint_dir,
    checksums,
    checksums_and_nonfinite,
    has_attention_bias,
    path_name,
    resolve_step,
    step_path,
    steps_on_disk,
    unreadable,
    verify,
)

TRASH = '.deleted'  # old steps are renamed here (atomic), then removed
CORRUPT = 'corrupt'  # WORKDIR/corrupt/<step>-<time>: steps that failed to restore


@dataclasses.dataclass
class KeepSteps:
    """An orbax preservation policy (ocp.checkpoint_managers.PreservationPolicy): preserves the
    checkpoints whose step is in `steps`, whatever their age. The loop sets `steps` to the best
    steps (t2t/run/best.py) before each save; orbax asks after each save which to delete."""

    steps: frozenset = frozenset()

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        del context
        steps = self.steps  # one read: the loop may replace it meanwhile
        return [info.step in steps for info in checkpoints]


@dataclasses.dataclass(frozen=True)
class Manager:
    """The orbax manager plus what every save records beside the state."""

    manager: ocp.CheckpointManager
    directory: epath.Path
    config: dict | None  # the experiment config as JSON-compatible data, stored in each step
    pending: list = dataclasses.field(default_factory=list)  # the step being saved, if any
    cleaners: list = dataclasses.field(default_factory=list)  # threads emptying the trash
    best: KeepSteps = dataclasses.field(default_factory=KeepSteps)  # steps kept beside the newest


def _version() -> str:
    try:
        return importlib.metadata.version('t2t')
    except importlib.metadata.PackageNotFoundError:
        return 'unknown'


def _config_data(config) -> dict | None:
    if config is None:
        return None
    if hasattr(config, 'to_json_best_effort'):
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=str))


def make_manager(workdir, config, async_: bool = True) -> Manager:
    """A manager writing to WORKDIR/checkpoints, keeping the newest config.keep_checkpoints steps
    and, beside them, the steps of `keep_best_steps` (the best ones: t2t/run/best.py).

    With async_=True `save` returns once the arrays are copied to host memory (the caller may
    donate or overwrite the state right away) and the write continues in a background thread.
    """
    directory = checkpoint_dir(workdir)
    best = KeepSteps()
    newest = ocp.checkpoint_managers.LatestN(config.keep_checkpoints if config is not None
                                             else None)
    options = ocp.CheckpointManagerOptions(
        # A step is deleted only when neither policy keeps it.
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy([newest, best]),
        enable_async_checkpointing=async_,
        cleanup_tmp_directories=True,  # remove what a crash mid-save left behind
        todelete_subdir=TRASH,  # a step is renamed away in one step, then removed
        create=True,
    )
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    if wd.is_url(directory):
        # Orbax removes a killed save's unfinished steps in a thread of its own while its
        # constructor lists the directory; in a bucket, where they were the only objects under
        # the prefix, that listing found it gone (gcsfs: FileNotFoundError). So they go first.
        if jax.process_index() == 0:
            remove_unfinished(directory)
        distributed.wait_for('checkpoints-unfinished', 'process 0 removes unfinished checkpoints',
                             600)
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    result = Manager(manager=manager, directory=directory, config=_config_data(config), best=best)
    _empty_trash(result)
    return result


def remove_unfinished(directory: epath.Path, steps=None) -> None:
    """Removes the step directories (of `steps`; default: all) that a save began and never
    finalized. One process calls it while the others wait."""
    finished = set(steps_on_disk(directory))
    if steps is None:
        try:
            steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] \
                if directory.exists() else []
        except FileNotFoundError:  # a bucket prefix whose last object went meanwhile
            steps = []
    for step in steps:
        step_dir = directory / str(step)
        if step not in finished and step_dir.exists():
            step_dir.rmtree()


def keep_best_steps(manager: Manager, steps) -> None:
    """From the next save on, these steps are never deleted by keep_checkpoints."""
    manager.best.steps = frozenset(steps)


def latest_step(manager: Manager) -> int | None:
    return manager.manager.latest_step()


def all_steps(manager: Manager) -> list[int]:
    return sorted(manager.manager.all_steps())


def _empty_trash(manager: Manager) -> None:
    """Removes the steps orbax renamed into the trash. Called while no save is in flight: the
    trash is renamed away first (orbax makes a new one), then removed in a thread, so training
    goes on meanwhile; `close` waits for it, a kill leaves it to the next call."""
    directory = manager.directory
    if jax.process_index() or wd.is_url(directory) or not directory.exists():
        return  # on GCS orbax deletes at once
    if (directory / TRASH).exists():
        (directory / TRASH).rename(directory / f'{TRASH}-{time.time_ns()}')
    for doomed in directory.glob(f'{TRASH}-*'):
        cleaner = threading.Thread(target=shutil.rmtree, args=(os.fspath(doomed),),
                                   kwargs={'ignore_errors': True}, name='t2t_empty_trash')
        cleaner.start()
        manager.cleaners.append(cleaner)


def _save_failed(step_dir, error: Exception) -> CheckpointError:
    first = (str(error).strip().splitlines() or [''])[0][:300]
    if 'No space left on device' in str(error):
        first = f'the disk is full ({first})'
    return CheckpointError(f'saving checkpoint {step_dir} failed: {type(error).__name__}: {first}'
                           '; the earlier checkpoints are intact')


def wait(manager: Manager) -> None:
    """Blocks until the pending asynchronous save (if any) is on disk.

    Raises CheckpointError naming the step when that save failed (orbax's error, or a step that is
    not on disk afterwards); earlier steps are untouched.
    """
    mgr = manager.manager
    step = manager.pending.pop() if manager.pending else None
    step_dir = step_path(mgr, step) if step is not None else manager.directory
    try:
        mgr.wait_until_finished()
    except Exception as e:  # orbax re-raises the background thread's error as it was
        _release_stranded()
        raise _save_failed(step_dir, e) from e
    if step is not None and step not in steps_on_disk(manager.directory):
        raise CheckpointError(f'saving checkpoint {step_dir} failed: it is not on disk after the '
                              'save; the earlier checkpoints are intact')
    _empty_trash(manager)


def _release_stranded() -> None:
    """After a failed save: orbax (0.12) leaves the threads of that save that wait for a signal
    of a failed one (the step directory's creation) waiting for its coordination timeout, five
    minutes, and as they are not daemon threads the process cannot exit meanwhile. Each of this
    process's is cancelled (it then returns without writing), then the signals it waits for are
    set. Other processes' threads of the same save wake too and finish their writes into the
    failed step's temporary directory, which the retry (t2t/run/outage.py) or the next start
    removes; without this they would hold their processes' `wait` for those five minutes."""
    try:
        stranded = [t for t in threading.enumerate()
                    if isinstance(t, _orbax_future._SignalingThread) and t.is_alive()]
        for thread in stranded:
            thread.cancel()
        for thread in stranded:
            _orbax_future.set_signals(thread._receive_signals,
                                      operation_id=thread._operation_id)
    except AttributeError as e:  # another orbax: its own timeout applies
        logging.debug('releasing the failed save\'s threads: %s', e)


def close(manager: Manager) -> None:
    manager.manager.close()
    for cleaner in manager.cleaners:
        cleaner.join()
    manager.cleaners.clear()


# --- save / restore -----------------------------------------------------------------------------


def save(manager: Manager, step: int, state, data_iter=None, force: bool = False,
         extra_metadata: dict | None = None) -> bool:
    """Starts saving `state` (and the iterator position) as checkpoint `step`.

    `data_iter`: a grain iterator whose get_state() is the same on every process (t2t's iterator
    of global batches); its state is stored in the metadata.

    Returns False without saving when `step` is already saved (e.g. the final save right after a
    periodic one) or, unless force=True, when it is not newer than the latest checkpoint. Waits
    for the previous asynchronous save first; call `wait` before exiting.
    """
    mgr = manager.manager
    wait(manager)  # the previous save must have succeeded (its error names its step)
    if step in mgr.all_steps() or not (force or mgr.should_save(step)):
        return False  # checked first: the checksums below cost a pass over the state
    sums, nonfinite = checksums_and_nonfinite(state)
    if nonfinite:
        raise CheckpointError(
            f'step {step}: refusing to save a state with NaN or inf in {", ".join(nonfinite[:3])}'
            + (f' and {len(nonfinite) - 3} more arrays' if len(nonfinite) > 3 else ''))
    meta = {
        't2t_version': _version(),
        'step': int(step),
        'saved_at': time.time(),
        'config': manager.config,
        'checksums': sums,
        **(extra_metadata or {}),
    }
    if data_iter is not None:
        meta[ITERATOR_KEY] = data_iter.get_state()
    items = {STATE: ocp.args.StandardSave(_stored(state)), META: ocp.args.JsonSave(meta)}
    try:
        saved = mgr.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # e.g. the disk filled while the step directory was created
        raise _save_failed(step_path(mgr, step), e) from e
    if saved:
        manager.pending.append(step)
    return saved


def _stored(state):
    """The tree a checkpoint holds of `state`: a train state's fields that are set. A None field
    (an option that is off: train_lib.TrainState) is not written: the checkpoint of a run
    without EMA or guards has the layout it had before the state had such fields."""
    if not dataclasses.is_dataclass(state):
        return state
    fields = (f.name for f in dataclasses.fields(state))
    return {name: getattr(state, name) for name in fields if getattr(state, name) is not None}


def _check_fits(mgr: ocp.CheckpointManager, step: int, abstract_state, step_dir) -> None:
    """The checkpoint holds the arrays of `abstract_state`, in its shapes (from the metadata).

    A mismatch is a CheckpointError (a different config, not damage); unreadable metadata is a
    CorruptCheckpointError. PRNG keys are compared by name only (stored as their raw data).
    """
    try:
        stored = mgr.item_metadata(step)[STATE]
        stored = getattr(stored, 'tree', stored)
        have = {path_name(p): tuple(m.shape)
                for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    except Exception as e:
        raise unreadable(step_dir, e) from e
    if not have:
        raise CorruptCheckpointError(f'checkpoint {step_dir} is unreadable (incomplete or '
                                     'corrupt): no state metadata')
    bias = attention_bias_mismatch(f'checkpoint {step_dir}', stored,
                                   has_attention_bias(abstract_state))
    if bias:
        raise CheckpointError(bias)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        name = path_name(path)
        if name not in have:
            raise CheckpointError(f'checkpoint {step_dir} does not fit the state of this config: '
                                  f'it has no {name}')
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) \
                and have[name] != tuple(leaf.shape):
            raise CheckpointError(f'checkpoint {step_dir} does not fit the state of this config: '
                                  f'{name} is {have[name]}, the config wants {tuple(leaf.shape)}')
    extra = len(have) - len(jax.tree.leaves(abstract_state))
    if extra:
        raise CheckpointError(f'checkpoint {step_dir} does not fit the state of this config: '
                              f'it has {extra} more arrays')


def restore(manager: Manager, step: int | None, abstract_state, data_iter=None,
            with_metadata: bool = False):
    """Restores checkpoint `step` (None: the latest) into the shapes, dtypes and shardings of
    `abstract_state` (a pytree of jax.ShapeDtypeStruct with sharding, e.g. from jax.eval_shape).

    When `data_iter` is given, its position is set to the saved one. The checkpoint may come from
    any mesh, device count or process count. with_metadata: (state, the step's JSON metadata),
    read in the same restore.
    """
    mgr = manager.manager
    step = resolve_step(mgr, step)
    step_dir = step_path(mgr, step)
    _check_fits(mgr, step, abstract_state, step_dir)
    items = {STATE: ocp.args.StandardRestore(_stored(abstract_state)),
             META: ocp.args.JsonRestore()}
    try:
        restored = mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax / tensorstore raise many types; name the step either way
        raise unreadable(step_dir, e) from e
    meta = restored[META] or {}
    state = restored[STATE]
    if dataclasses.is_dataclass(abstract_state):
        state = dataclasses.replace(abstract_state, **state)
    verify(meta.get('checksums'), state, step_dir)
    if data_iter is not None:
        if ITERATOR_KEY not in meta:
            raise CheckpointError(f'checkpoint {step_dir} holds no data iterator state')
        data_iter.set_state(meta[ITERATOR_KEY])
    return (state, meta) if with_metadata else state


def quarantine(manager: Manager, step: int) -> epath.Path:
    """Moves step's directory to WORKDIR/corrupt/<step>-<time>, out of orbax's sight.

    Only process 0 moves; every process then waits for it and rescans the steps.
    """
    mgr = manager.manager
    target = manager.directory.parent / CORRUPT / f'{step}-{time.strftime("%Y%m%d-%H%M%S")}'
    if jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        step_path(mgr, step).rename(target)
    distributed.sync_devices(f't2t_quarantine_{step}')
    mgr.reload()
    return target


def restore_newest_good(manager: Manager, restore_fn):
    """(step, restore_fn(step)) for the newest step that restores, or None when there is none.

    restore_fn(step) restores one step (e.g. `restore` with the abstract state and the data
    iterator). A step that raises CorruptCheckpointError on any process is moved aside
    (`quarantine`) with a warning naming it, and the next older one is tried, so a restarted job
    resumes instead of failing on the same step again. Any other error (e.g. a checkpoint of a
    different config) propagates: good checkpoints are never moved.

    Limitation: a read error on one process only, raised while the others are inside a
    collective of the restore, is not caught here (the others would wait for it).
    """
    for step in reversed(all_steps(manager)):
        error = None
        try:
            result = restore_fn(step)
        except CorruptCheckpointError as e:
            error, result = e, None
        if distributed.all_processes(error is None):
            return step, result
        moved = quarantine(manager, step)
        logging.warning('%s; moved it to %s and falling back to an older checkpoint',
                        error or f'checkpoint {step} failed to restore on another process', moved)
    return None


def write_averaged(
    workdir_out, params, step: int, config=None, extra_metadata: dict | None = None
) -> epath.Path:
    """Writes `params` as checkpoint `step` of WORKDIR_OUT (state {'params': params} + metadata),
    readable with `restore_params(workdir_out)`. Returns the step directory."""
    manager = make_manager(workdir_out, None, async_=False)
    mgr = manager.manager
    if step in mgr.all_steps():
        raise CheckpointError(f'checkpoint {step_path(mgr, step)} already exists')
    meta = {
        't2t_version': _version(),
        'step': int(step),
        'saved_at': time.time(),
        'config': _config_data(config),
        'checksums': checksums({'params': params}),
        **(extra_metadata or {}),
    }
    items = {STATE: ocp.args.StandardSave({'params': params}), META: ocp.args.JsonSave(meta)}
    mgr.save(step, args=ocp.args.Composite(**items), force=True)
    mgr.wait_until_finished()
    mgr.close()
    return step_path(mgr, step)
