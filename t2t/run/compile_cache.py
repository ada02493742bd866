"""jax's persistent compilation cache for train.py and evaluate.py, and the train and eval steps'
executables stored beside it: a restart loads its programs.

config.compilation_cache_dir:
  ''        $JAX_COMPILATION_CACHE_DIR when set (jax reads it itself; the tests set it), else
            $XDG_CACHE_HOME/t2t/jax (~/.cache/t2t/jax): host-local
  'off'     no persistent cache
  a path or a bucket URL (gs://...: jax reads and writes it through etils.epath)
The cache key holds the program, the devices, the jax version and the XLA flags, so one directory
serves every config. Programs that compile in under MIN_COMPILE_S are not stored (one file each;
on a bucket one object each) unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.

jax's cache serves XLA's compile only: tracing the step and lowering it to StableHLO are paid
again by every process. So the loop's train and eval steps also go through `stored`: the whole
executable (jax.experimental.serialize_executable) in DIR/t2t-executables/, under a key of
everything that makes the program without tracing it (`program_key`: the whole config, t2t's
source, the library versions, jax's settings, XLA's flags, the devices, the arguments' types and
shardings). A restart of the same run loads it and traces nothing; any change makes a new key.
Single-process runs only (a multi-process program is stored by no process); only an executable
that XLA compiled in this process is stored (one that jax's cache loaded does not re-serialize
whole).

Whoever can write the directory can run code in the processes that read it: never share it with
users you do not trust.
"""

from __future__ import annotations

import logging
import os

MIN_COMPILE_S = 0.5


def default_dir() -> str:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 't2t', 'jax')


def setup(config) -> str | None:
    """Turns the cache on as config.compilation_cache_dir says; returns its directory (None:
    off). Call before anything compiles."""
    import jax

    choice = config.compilation_cache_dir
    if choice == 'off':
        jax.config.update('jax_enable_compilation_cache', False)
        return None
    directory = choice or os.environ.get('JAX_COMPILATION_CACHE_DIR') or default_dir()
    if '://' not in directory:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:  # e.g. a read-only home: compile every time, say so once
            logging.warning('compilation cache %s cannot be created (%s): compiling without it',
                            directory, e)
            return None
    jax.config.update('jax_enable_compilation_cache', True)
    jax.config.update('jax_compilation_cache_dir', directory)
    if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
        jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
    return directory


# ----------------------------------------------------------------------------------------------
# Stored executables: a restart skips tracing and lowering too

EXECUTABLES = 't2t-executables'  # a subdirectory of the cache directory
LOAD_EVENT = '/t2t/compile/executable_load_duration'  # jax.monitoring events (the goodput ledger)
STORE_EVENT = '/t2t/compile/executable_store_duration'
_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'chex', 'numpy', 'ml_dtypes')
_ENV = ('XLA_FLAGS', 'LIBTPU_INIT_ARGS')


def sources_digest(root: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """Every module under root (default: t2t, the code a step traces), by name and content."""
    import hashlib

    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(f for f in filenames if f.endswith('.py')):
            path = os.path.join(dirpath, name)
            with open(path, 'rb') as f:
                h.update(os.path.relpath(path, root).encode() + b'\0' + f.read() + b'\0')
    return h.hexdigest()


def _versions() -> list:
    import importlib.metadata
    import sys

    out = [sys.version]
    for name in _PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append((name, None))
    return out


def _devices(sharding) -> tuple:
    mesh = getattr(sharding, 'mesh', None)
    devices = mesh.devices.flat if mesh is not None and hasattr(mesh, 'devices') else \
        sorted(sharding.device_set, key=lambda d: d.id)
    return tuple(d.id for d in devices)


def _arguments(args) -> list:
    """The arguments' tree, and each leaf's type and sharding (its devices in mesh order)."""
    import jax
    import numpy as np

    leaves, tree = jax.tree.flatten(args)
    out = [str(tree)]
    for x in leaves:
        sharding = getattr(x, 'sharding', None)
        out.append((np.shape(x), str(np.asarray(x).dtype) if sharding is None else str(x.dtype),
                    bool(getattr(x, 'weak_type', False)), repr(sharding),
                    _devices(sharding) if sharding is not None else None))
    return out


def program_key(config, name: str, args) -> str:
    """A digest of everything that makes the program of `name` called with `args`: the whole
    config, t2t's source, the library versions, jax's settings, XLA's flags, the devices and the
    arguments' types and shardings."""
    import hashlib

    import jax

    backend = jax.devices()[0].client
    parts = [name, config.to_json_best_effort(sort_keys=True), sources_digest(), _versions(),
             sorted((k, repr(v)) for k, v in jax.config.values.items()),
             [(k, os.environ.get(k)) for k in _ENV],
             (backend.platform, backend.platform_version, jax.process_index(),
              jax.process_count()),
             [(d.id, d.process_index, d.device_kind, str(getattr(d, 'coords', None)))
              for d in jax.devices()],
             _arguments(args)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def stored(fn, config, name: str):
    """fn (jitted, with `.lower`, as train_lib's) whose first call loads the executable stored
    for the same program (program_key) from the cache directory, or compiles it (jax's cache
    serves XLA's part) and stores it there; a restart then skips tracing and lowering as well.
    Calls with other argument types (evaluation batches of other lengths) go through fn. As fn
    itself unless config.store_executables, and when the cache is off, fn cannot be lowered (a
    test's wrapper), or there are several processes (each holds its part of the program)."""
    import jax

    if not config.get('store_executables', False) or not hasattr(fn, 'lower') or \
            not jax.config.jax_enable_compilation_cache or \
            not jax.config.jax_compilation_cache_dir or jax.process_count() > 1:
        return fn
    directory = jax.config.jax_compilation_cache_dir
    compiled = None

    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = _load_or_compile(fn, args, directory,
                                        f'{name}-{program_key(config, name, args)}')
            return compiled(*args)
        try:
            return compiled(*args)
        except (TypeError, ValueError) as e:  # raised before anything runs: types differ
            if 'compiled' not in str(e):
                raise
            return fn(*args)

    return call


_cache_hits = []  # one entry per hit of jax's persistent cache in this process


def _count_cache_hits() -> int:
    import jax

    if not hasattr(_count_cache_hits, 'listening'):
        jax.monitoring.register_event_listener(
            lambda event, **_: _cache_hits.append(1)
            if event == '/jax/compilation_cache/cache_hits' else None)
        _count_cache_hits.listening = True
    return len(_cache_hits)


def _load_or_compile(fn, args, directory: str, key: str):
    import pickle
    import time

    import jax
    from jax.experimental import serialize_executable

    from t2t.infra import workdir as wd

    path = wd.path(directory, EXECUTABLES, key)
    began = time.perf_counter()
    try:
        blob = wd.read_bytes(path)
        if blob is not None:
            payload, in_tree, out_tree, ids = pickle.loads(blob)
            devices = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[devices[i] for i in ids])
            jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - began)
            return compiled
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: compile instead
        logging.warning('stored executable %s unusable (%s: %s): compiling', path,
                        type(e).__name__, str(e)[:200])
    began, hits = time.perf_counter(), _count_cache_hits()
    compiled = fn.lower(*args).compile()
    # An executable that jax's cache loaded serializes incompletely (XLA:CPU: its run fails with
    # "Function ... not found"): only one that XLA compiled here is stored.
    if _count_cache_hits() == hits and \
            time.perf_counter() - began >= jax.config.jax_persistent_cache_min_compile_time_secs:
        began = time.perf_counter()
        try:
            # The program's devices in its own order (what jax's serialize itself reads).
            ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
            wd.write_atomic(path, pickle.dumps((*serialize_executable.serialize(compiled), ids)))
        except Exception as e:  # noqa: BLE001 - the run goes on; the next one compiles again
            logging.warning('storing the executable %s failed (%s: %s)', path,
                            type(e).__name__, str(e)[:200])
        jax.monitoring.record_event_duration_secs(STORE_EVENT, time.perf_counter() - began)
    return compiled
