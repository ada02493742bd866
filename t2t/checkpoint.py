"""Checkpoints: orbax CheckpointManager with the train state, the data iterator and metadata.

Layout: WORKDIR/checkpoints/<step>/{state, meta}. `state` is the train state pytree (any pytree of
arrays, typed PRNG keys included), `meta` a small JSON object: t2t version, step, time, the config,
a checksum per array, and the data iterator's position (`data_iterator`, written once: the grain
iterator of global batches is at the same position on every process, so it restores on any
number of processes).

Atomicity: orbax writes a step into a temporary directory and renames it when every item is
complete, so a crash mid-save leaves no half-written step (leftovers are removed at the next start).
Old steps beyond keep_checkpoints are first renamed into checkpoints/.deleted (emptied after each
save and at start), so a crash mid-deletion never leaves a half-deleted step that looks complete
(`finished_steps` and orbax skip names that are not step numbers).
A failed save (e.g. a full disk) raises CheckpointError naming the step at the next `save` or
`wait`; the steps saved before stay intact. `save` refuses a state that holds NaN or inf.

Integrity: orbax stores large arrays as raw chunks without a checksum, so a flipped byte on disk
restores silently wrong values (seen with orbax 0.12.8). `save` therefore records a bitwise
fingerprint of every array and `restore` / `restore_params` check it; any unreadable, incomplete or
corrupt checkpoint raises CorruptCheckpointError (a CheckpointError) with a one-line message that
names the step directory. A checkpoint that is readable but does not fit the requested state (a
different config) raises a plain CheckpointError. `restore_newest_good` falls back over corrupt
steps, moving each aside to WORKDIR/corrupt/<step>-<time> so a restarted job does not trip on it.

Multi-process: call `save` and `restore` on every process (orbax coordinates the writes);
`restore_params` and `average_checkpoints` may run on one process alone.
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from t2t.model import attention_bias_mismatch, has_attention_bias

STATE, META = 'state', 'meta'
ITERATOR_KEY = 'data_iterator'  # the grain iterator's get_state(), inside META
TRASH = '.deleted'  # old steps are renamed here (atomic), then removed
CORRUPT = 'corrupt'  # WORKDIR/corrupt/<step>-<time>: steps that failed to restore


def _not_read_only_notice(record: logging.LogRecord) -> bool:
    return record.msg != 'Given directory is read only=%s'


# orbax 0.12 warns 'Given directory is read only' at every read-only CheckpointManager, and no
# option turns it off; t2t's readers (evaluate.py, --watch beside a training) are read-only on
# purpose, so that one message is dropped from absl's logger (orbax logs through it).
logging.getLogger('absl').addFilter(_not_read_only_notice)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, does not fit, or could not be saved."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are unreadable, truncated or fail their checksums."""


@dataclasses.dataclass(frozen=True)
class Manager:
    """The orbax manager plus what every save records beside the state."""

    manager: ocp.CheckpointManager
    directory: epath.Path
    config: dict | None  # the experiment config as JSON-compatible data, stored in each step
    pending: list = dataclasses.field(default_factory=list)  # the step being saved, if any
    cleaners: list = dataclasses.field(default_factory=list)  # threads emptying the trash


def checkpoint_dir(workdir) -> epath.Path:
    # Absolute: orbax's array writer rejects relative paths, and only when the async save runs.
    path = epath.Path(workdir)
    if not path.is_absolute() and '://' not in str(workdir):  # gs:// and the like stay as given
        path = epath.Path(os.path.abspath(os.fspath(workdir)))
    return path / 'checkpoints'


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
    """A manager writing to WORKDIR/checkpoints, keeping the newest config.keep_checkpoints steps.

    With async_=True `save` returns once the arrays are copied to host memory (the caller may
    donate or overwrite the state right away) and the write continues in a background thread.
    """
    directory = checkpoint_dir(workdir)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.keep_checkpoints if config is not None else None,
        enable_async_checkpointing=async_,
        cleanup_tmp_directories=True,  # remove what a crash mid-save left behind
        todelete_subdir=TRASH,  # a step is renamed away in one step, then removed
        create=True,
    )
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    result = Manager(manager=manager, directory=directory, config=_config_data(config))
    _empty_trash(result)
    return result


@contextlib.contextmanager
def _reader(workdir) -> Iterator[ocp.CheckpointManager]:
    """A read-only manager whose state handler allows restoring a subtree without a target."""
    directory = checkpoint_dir(workdir)
    if not directory.exists():
        raise CheckpointError(f'no checkpoint directory {directory}')
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, enable_async_checkpointing=False
    )
    handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    try:
        yield manager
    finally:
        manager.close()


def latest_step(manager: Manager) -> int | None:
    return manager.manager.latest_step()


def all_steps(manager: Manager) -> list[int]:
    return sorted(manager.manager.all_steps())


def finished_steps(workdir) -> list[int]:
    """Steps of WORKDIR whose save completed (orbax's finalized directories), read from disk.

    A step still being written (a temporary directory, or on GCS one without its commit marker)
    is not listed; nothing is created or removed.
    """
    return _finished(checkpoint_dir(workdir))


def _finished(directory: epath.Path) -> list[int]:
    return sorted(ocp.path.step.checkpoint_steps(directory))


def _empty_trash(manager: Manager) -> None:
    """Removes the steps orbax renamed into the trash. Called while no save is in flight: the
    trash is renamed away first (orbax makes a new one), then removed in a thread, so training
    goes on meanwhile; `close` waits for it, a kill leaves it to the next call."""
    directory = manager.directory
    if jax.process_index() or '://' in str(directory) or not directory.exists():
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
    step_dir = _step_dir(mgr, step) if step is not None else manager.directory
    try:
        mgr.wait_until_finished()
    except Exception as e:  # orbax re-raises the background thread's error as it was
        raise _save_failed(step_dir, e) from e
    if step is not None and step not in _finished(manager.directory):
        raise CheckpointError(f'saving checkpoint {step_dir} failed: it is not on disk after the '
                              'save; the earlier checkpoints are intact')
    _empty_trash(manager)


def close(manager: Manager) -> None:
    manager.manager.close()
    for cleaner in manager.cleaners:
        cleaner.join()
    manager.cleaners.clear()


# --- fingerprints -------------------------------------------------------------------------------

_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_fingerprint(x):
    """sum(bits_i * (2i + 1)) mod 2^32 over the flat index i: any one flipped bit changes it.

    Integer sums do not depend on the reduction order, so the value is the same for every
    sharding; the index is built from iotas so that a sharded array is never reshaped.
    """
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = x.dtype.itemsize
    # 8-byte values become pairs of uint32 (a trailing axis of 2).
    x = jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH.get(width, jnp.uint32)).astype(jnp.uint32)
    position = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    return jnp.sum(x * (2 * position + 1), dtype=jnp.uint32)


def _leaf_finite(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.all(jnp.isfinite(x))
    return jnp.array(True)


# One pass over the arrays: fingerprints and whether each leaf is finite (one compile per tree
# structure serves both the save and the restore of a run).
_fingerprints_and_finite = jax.jit(
    lambda tree: (jax.tree.map(_leaf_fingerprint, tree), jax.tree.map(_leaf_finite, tree)))


def _key_name(key) -> str:
    for attr in ('key', 'name', 'idx'):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_name(path) -> str:
    # The same name for a dataclass field and a dict key, so {'params': p} matches state.params.
    return '/'.join(_key_name(k) for k in path)


def _local(scalar):
    # Scalars are replicated, so every process holds the value locally.
    return np.asarray(scalar.addressable_data(0)).item()


def _named(tree, values) -> dict:
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_name(p): v for (p, _), v in zip(named, values, strict=True)}


def checksums(tree) -> dict[str, list]:
    """{'params/.../kernel': [dtype, fingerprint]} for every array leaf of `tree`."""
    return checksums_and_nonfinite(tree)[0]


def checksums_and_nonfinite(tree) -> tuple[dict[str, list], list[str]]:
    """(`checksums(tree)`, names of the leaves holding NaN or inf), in one pass over the arrays."""
    tree = jax.tree.map(jnp.asarray, tree)
    fingerprints, finite = map(jax.tree.leaves, _fingerprints_and_finite(tree))
    dtypes = [str(x.dtype) for x in jax.tree.leaves(tree)]
    sums = _named(tree, [[d, int(_local(s))] for d, s in zip(dtypes, fingerprints, strict=True)])
    ok = _named(tree, [bool(_local(f)) for f in finite])
    return sums, [name for name, good in ok.items() if not good]


def _verify(stored: dict | None, tree, step_dir) -> None:
    if not stored:
        return  # written without checksums: nothing to compare
    bad = [
        name
        for name, (dtype, value) in checksums(tree).items()
        if name in stored and stored[name][0] == dtype and stored[name][1] != value
    ]
    if bad:
        raise CorruptCheckpointError(
            f'checkpoint {step_dir} is corrupt: checksum mismatch in {", ".join(bad[:3])}'
            + (f' and {len(bad) - 3} more arrays' if len(bad) > 3 else '')
        )


# --- save / restore -----------------------------------------------------------------------------


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def _one_line(step_dir, error: Exception) -> CorruptCheckpointError:
    first = (str(error).strip().splitlines() or [''])[0][:300]
    return CorruptCheckpointError(
        f'checkpoint {step_dir} is unreadable (incomplete or corrupt): '
        f'{type(error).__name__}: {first}'
    )


def _resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f'no checkpoints in {manager.directory}')
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f'no checkpoint for step {step} in {manager.directory}; have {steps}')
    return step


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
    items = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
    try:
        saved = mgr.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # e.g. the disk filled while the step directory was created
        raise _save_failed(_step_dir(mgr, step), e) from e
    if saved:
        manager.pending.append(step)
    return saved


def _check_fits(mgr: ocp.CheckpointManager, step: int, abstract_state, step_dir) -> None:
    """The checkpoint holds the arrays of `abstract_state`, in its shapes (from the metadata).

    A mismatch is a CheckpointError (a different config, not damage); unreadable metadata is a
    CorruptCheckpointError. PRNG keys are compared by name only (stored as their raw data).
    """
    try:
        stored = mgr.item_metadata(step)[STATE]
        stored = getattr(stored, 'tree', stored)
        have = {_path_name(p): tuple(m.shape)
                for p, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    except Exception as e:
        raise _one_line(step_dir, e) from e
    if not have:
        raise CorruptCheckpointError(f'checkpoint {step_dir} is unreadable (incomplete or '
                                     'corrupt): no state metadata')
    bias = attention_bias_mismatch(f'checkpoint {step_dir}', stored,
                                   has_attention_bias(abstract_state))
    if bias:
        raise CheckpointError(bias)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        name = _path_name(path)
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


def restore(manager: Manager, step: int | None, abstract_state, data_iter=None):
    """Restores checkpoint `step` (None: the latest) into the shapes, dtypes and shardings of
    `abstract_state` (a pytree of jax.ShapeDtypeStruct with sharding, e.g. from jax.eval_shape).

    When `data_iter` is given, its position is set to the saved one. The checkpoint may come from
    any mesh, device count or process count.
    """
    mgr = manager.manager
    step = _resolve_step(mgr, step)
    step_dir = _step_dir(mgr, step)
    _check_fits(mgr, step, abstract_state, step_dir)
    items = {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
    try:
        restored = mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax / tensorstore raise many types; name the step either way
        raise _one_line(step_dir, e) from e
    meta = restored[META] or {}
    _verify(meta.get('checksums'), restored[STATE], step_dir)
    if data_iter is not None:
        if ITERATOR_KEY not in meta:
            raise CheckpointError(f'checkpoint {step_dir} holds no data iterator state')
        data_iter.set_state(meta[ITERATOR_KEY])
    return restored[STATE]


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def quarantine(manager: Manager, step: int) -> epath.Path:
    """Moves step's directory to WORKDIR/corrupt/<step>-<time>, out of orbax's sight.

    Only process 0 moves; every process then waits for it and rescans the steps.
    """
    mgr = manager.manager
    target = manager.directory.parent / CORRUPT / f'{step}-{time.strftime("%Y%m%d-%H%M%S")}'
    if jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        _step_dir(mgr, step).rename(target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f't2t_quarantine_{step}')
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
        if _all_processes_ok(error is None):
            return step, result
        moved = quarantine(manager, step)
        logging.warning('%s; moved it to %s and falling back to an older checkpoint',
                        error or f'checkpoint {step} failed to restore on another process', moved)
    return None


def read_metadata(workdir, step: int | None = None) -> dict:
    """The JSON metadata of checkpoint `step` (None: the latest): version, step, config, ..."""
    with _reader(workdir) as mgr:
        step = _resolve_step(mgr, step)
        try:
            args = ocp.args.Composite(**{META: ocp.args.JsonRestore()})
            return mgr.restore(step, args=args)[META]
        except Exception as e:
            raise _one_line(_step_dir(mgr, step), e) from e


def _restore_params(mgr: ocp.CheckpointManager, step: int, abstract_params=None):
    step_dir = _step_dir(mgr, step)
    try:
        if abstract_params is None:
            # The structure comes from the checkpoint's own metadata; numpy arrays on the host
            # work whatever devices the checkpoint was written from.
            tree = mgr.item_metadata(step)[STATE]
            tree = getattr(tree, 'tree', tree)['params']
            item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
            restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        else:
            item = abstract_params
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
        state_args = ocp.args.PyTreeRestore(
            item={'params': item}, restore_args={'params': restore_args}, partial_restore=True
        )
        restored = mgr.restore(
            step, args=ocp.args.Composite(**{STATE: state_args, META: ocp.args.JsonRestore()})
        )
    except Exception as e:
        raise _one_line(step_dir, e) from e
    params = restored[STATE]['params']
    _verify((restored[META] or {}).get('checksums'), {'params': params}, step_dir)
    return params


def restore_params(workdir, step: int | None = None, abstract_params=None):
    """The model parameters of checkpoint `step` (None: the latest), for evaluation.

    Without `abstract_params` the parameter tree is read from the checkpoint's metadata and comes
    back as numpy arrays on the host (nothing about the optimizer or the model needs to be known);
    with it, as jax arrays in its shardings. Only the params are read from disk.
    """
    with _reader(workdir) as mgr:
        return _restore_params(mgr, _resolve_step(mgr, step), abstract_params)


def average_checkpoints(workdir, steps: Sequence[int]):
    """The element-wise mean of the params of `steps`, summed in float32, cast back per leaf."""
    if not steps:
        raise ValueError('average_checkpoints needs at least one step')
    total = reference = None
    with _reader(workdir) as mgr:
        for step in steps:
            params = _restore_params(mgr, _resolve_step(mgr, step))
            as_f32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
            if total is None:
                total, reference = as_f32, params
                continue
            try:
                total = jax.tree.map(np.add, total, as_f32)
            except (ValueError, TypeError) as e:
                raise CheckpointError(
                    f'checkpoint {_step_dir(mgr, step)} has different params than '
                    f'step {steps[0]}: {e}'
                ) from e
    return jax.tree.map(lambda t, r: (t / len(steps)).astype(r.dtype), total, reference)


def write_averaged(
    workdir_out, params, step: int, config=None, extra_metadata: dict | None = None
) -> epath.Path:
    """Writes `params` as checkpoint `step` of WORKDIR_OUT (state {'params': params} + metadata),
    readable with `restore_params(workdir_out)`. Returns the step directory."""
    manager = make_manager(workdir_out, None, async_=False)
    mgr = manager.manager
    if step in mgr.all_steps():
        raise CheckpointError(f'checkpoint {_step_dir(mgr, step)} already exists')
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
    return _step_dir(mgr, step)
