"""The checkpoint layout and its read-only side: what evaluation, --watch and export read.

Layout: WORKDIR/checkpoints/<step>/{state, meta}. `state` is the train state pytree (any pytree of
arrays, typed PRNG keys included), `meta` a small JSON object: t2t version, step, time, the config,
a checksum per array, and the data iterator's position (`data_iterator`). Training writes it
(t2t/run/checkpoint.py: the manager, save, resume); nothing here writes or moves a file.

Integrity: orbax stores large arrays as raw chunks without a checksum, so a flipped byte on disk
restores silently wrong values (seen with orbax 0.12.8). Every save records a bitwise fingerprint
of every array (`checksums`) and every restore checks it (`verify`); an unreadable, incomplete or
corrupt checkpoint raises CorruptCheckpointError (a CheckpointError) with a one-line message that
names the step directory.

`restore_params`, `average_checkpoints` and `read_metadata` may run on one process alone, beside a
training run that is still saving (read-only managers).

Weights: a run with ema_decay > 0 stores the moving average of its params beside them (state.ema,
the same tree). The readers take `weights`: 'raw' (state.params, as trained) or 'ema';
`choose_weights` turns 'auto' into 'ema' when the checkpoint holds one, else 'raw'.
"""

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

STATE, META = 'state', 'meta'
ITERATOR_KEY = 'data_iterator'  # the grain iterator's get_state(), inside META
WEIGHTS = {'raw': 'params', 'ema': 'ema'}  # weights -> the state's subtree that holds them


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


_ATTENTION_BIAS = re.compile(r"(self|cross)_attention\W+(query|key|value|out)\W+bias\b")


def has_attention_bias(tree) -> bool:
    """Whether `tree` (parameters, a train state or a checkpoint's metadata of either) has
    q/k/v/o projection biases: checkpoints written before attention_bias existed have them."""
    return any(_ATTENTION_BIAS.search(jax.tree_util.keystr(path))
               for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def attention_bias_mismatch(what: str, tree, attention_bias: bool) -> str | None:
    """One line naming the --config.attention_bias that restores `tree`, or None if it fits."""
    stored = has_attention_bias(tree)
    if stored == attention_bias:
        return None
    return (f'{what} has {"" if stored else "no "}attention biases but the config has '
            f'attention_bias={attention_bias}: run with --config.attention_bias={stored}')


def checkpoint_dir(workdir) -> epath.Path:
    # Absolute: orbax's array writer rejects relative paths, and only when the async save runs.
    path = epath.Path(workdir)
    if not path.is_absolute() and '://' not in str(workdir):  # gs:// and the like stay as given
        path = epath.Path(os.path.abspath(os.fspath(workdir)))
    return path / 'checkpoints'


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


def finished_steps(workdir) -> list[int]:
    """Steps of WORKDIR whose save completed (orbax's finalized directories), read from disk.

    A step still being written (a temporary directory, or on GCS one without its commit marker)
    is not listed; nothing is created or removed.
    """
    return steps_on_disk(checkpoint_dir(workdir))


def listed_steps(workdir) -> list[int]:
    """Steps of WORKDIR as a read-only orbax manager lists them (what evaluate.py chooses from);
    never touches a training run's saves."""
    with _reader(workdir) as manager:
        return sorted(manager.all_steps())


def steps_on_disk(directory: epath.Path) -> list[int]:
    """The finalized steps in a checkpoints directory."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


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


def path_name(path) -> str:
    # The same name for a dataclass field and a dict key, so {'params': p} matches state.params.
    return '/'.join(_key_name(k) for k in path)


def _local(scalar):
    # Scalars are replicated, so every process holds the value locally.
    return np.asarray(scalar.addressable_data(0)).item()


def _named(tree, values) -> dict:
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(p): v for (p, _), v in zip(named, values, strict=True)}


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


def verify(stored: dict | None, tree, step_dir) -> None:
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


def step_path(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(manager.directory) / str(step)


def unreadable(step_dir, error: Exception) -> CorruptCheckpointError:
    first = (str(error).strip().splitlines() or [''])[0][:300]
    return CorruptCheckpointError(
        f'checkpoint {step_dir} is unreadable (incomplete or corrupt): '
        f'{type(error).__name__}: {first}'
    )


def resolve_step(manager: ocp.CheckpointManager, step: int | None) -> int:
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f'no checkpoints in {manager.directory}')
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f'no checkpoint for step {step} in {manager.directory}; have {steps}')
    return step


def read_metadata(workdir, step: int | None = None) -> dict:
    """The JSON metadata of checkpoint `step` (None: the latest): version, step, config, ..."""
    with _reader(workdir) as mgr:
        step = resolve_step(mgr, step)
        try:
            args = ocp.args.Composite(**{META: ocp.args.JsonRestore()})
            return mgr.restore(step, args=args)[META]
        except Exception as e:
            raise unreadable(step_path(mgr, step), e) from e


def _stored_tree(mgr: ocp.CheckpointManager, step: int) -> dict:
    tree = mgr.item_metadata(step)[STATE]
    return getattr(tree, 'tree', tree)


def _has_ema(mgr: ocp.CheckpointManager, step: int) -> bool:
    try:
        return WEIGHTS['ema'] in _stored_tree(mgr, step)
    except Exception as e:
        raise unreadable(step_path(mgr, step), e) from e


def _no_ema(mgr: ocp.CheckpointManager, step: int) -> CheckpointError:
    return CheckpointError(f'checkpoint {step_path(mgr, step)} holds no EMA weights (trained with '
                           'ema_decay=0): evaluate its raw weights (--weights=raw)')


def choose_weights(workdir, step: int | None, weights: str) -> str:
    """'raw' or 'ema' for `weights` ('auto': 'ema' when checkpoint `step` holds an EMA)."""
    if weights not in ('auto', *WEIGHTS):
        raise ValueError(f'weights={weights!r}; one of auto, {", ".join(WEIGHTS)}')
    if weights == 'raw':
        return weights
    with _reader(workdir) as mgr:
        step = resolve_step(mgr, step)
        if _has_ema(mgr, step):
            return 'ema'
        if weights == 'ema':
            raise _no_ema(mgr, step)
        return 'raw'


def _restore_params(mgr: ocp.CheckpointManager, step: int, abstract_params=None,
                    weights: str = 'raw'):
    step_dir = step_path(mgr, step)
    key = WEIGHTS[weights]
    stored = None  # the checkpoint's tree (its metadata): read once, when needed
    if weights == 'ema':
        try:
            stored = _stored_tree(mgr, step)
        except Exception as e:
            raise unreadable(step_dir, e) from e
        if key not in stored:
            raise _no_ema(mgr, step)
    try:
        if abstract_params is None:
            # The structure comes from the checkpoint's own metadata; numpy arrays on the host
            # work whatever devices the checkpoint was written from.
            tree = (stored or _stored_tree(mgr, step))[key]
            item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
            restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        else:
            item = abstract_params
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
        state_args = ocp.args.PyTreeRestore(
            item={key: item}, restore_args={key: restore_args}, partial_restore=True
        )
        restored = mgr.restore(
            step, args=ocp.args.Composite(**{STATE: state_args, META: ocp.args.JsonRestore()})
        )
    except Exception as e:
        raise unreadable(step_dir, e) from e
    params = restored[STATE][key]
    verify((restored[META] or {}).get('checksums'), {key: params}, step_dir)
    return params


def restore_params(workdir, step: int | None = None, abstract_params=None,
                   weights: str = 'raw'):
    """The model parameters of checkpoint `step` (None: the latest), for evaluation; with
    weights='ema' their moving average (a CheckpointError when the checkpoint has none).

    Without `abstract_params` the parameter tree is read from the checkpoint's metadata and comes
    back as numpy arrays on the host (nothing about the optimizer or the model needs to be known);
    with it, as jax arrays in its shardings. Only those params are read from disk.
    """
    with _reader(workdir) as mgr:
        return _restore_params(mgr, resolve_step(mgr, step), abstract_params, weights)


def average_checkpoints(workdir, steps: Sequence[int], weights: str = 'raw'):
    """The element-wise mean of the params (or EMAs) of `steps`, summed in float32, cast back
    per leaf."""
    if not steps:
        raise ValueError('average_checkpoints needs at least one step')
    total = reference = None
    with _reader(workdir) as mgr:
        for step in steps:
            params = _restore_params(mgr, resolve_step(mgr, step), weights=weights)
            as_f32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
            if total is None:
                total, reference = as_f32, params
                continue
            try:
                total = jax.tree.map(np.add, total, as_f32)
            except (ValueError, TypeError) as e:
                raise CheckpointError(
                    f'checkpoint {step_path(mgr, step)} has different params than '
                    f'step {steps[0]}: {e}'
                ) from e
    return jax.tree.map(lambda t, r: (t / len(steps)).astype(r.dtype), total, reference)
