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
source, the library versions, jax's settings, XLA's flags, the devices, the host's processor, the
arguments' types and shardings). A restart of the same run loads it and traces nothing; any change
makes a new key. Single-process runs only (a multi-process program is stored by no process); only
an executable that XLA compiled in this process, in this very compile, is stored (`compiled_here`:
one that jax's cache, or jax's in-memory caches, served does not re-serialize whole). A file is
written whole or not at all (tmp + rename; one object on a bucket) and names its key and its
payload's digest: a torn, foreign or stale file is compiled over, never loaded.

Whoever can write the directory can run code in the processes that read it: never share it with
users you do not trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading

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
FORMAT = b't2t-executable-2'  # the first line of a stored file (encode / decode)
LOAD_EVENT = '/t2t/compile/executable_load_duration'  # jax.monitoring events (the goodput ledger)
STORE_EVENT = '/t2t/compile/executable_store_duration'
_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'chex', 'numpy', 'ml_dtypes')
_ENV = ('XLA_FLAGS', 'LIBTPU_INIT_ARGS')


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # t2t/, not t2t/run/


def sources_digest(root: str = PACKAGE) -> str:
    """Every module under root (default: the whole t2t package, the code a step traces: the
    model and the train step are in t2t/, this module in t2t/run/), by name and content."""
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
    import jax

    backend = jax.devices()[0].client
    parts = [name, config.to_json_best_effort(sort_keys=True), sources_digest(), _versions(),
             sorted((k, repr(v)) for k, v in jax.config.values.items()),
             [(k, os.environ.get(k)) for k in _ENV],
             (backend.platform, backend.platform_version, jax.process_index(),
              jax.process_count()),
             [(d.id, d.process_index, d.device_kind, str(getattr(d, 'coords', None)))
              for d in jax.devices()],
             _host(), _arguments(args)]
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


# jax's compile events in the thread that is compiling for `_load_or_compile` (None elsewhere):
# whether THIS compile was XLA's, not what the process's event count says (other threads, and
# other programs of the same process, compile too).
_watch = threading.local()
_XLA_COMPILE = '/jax/core/compile/backend_compile_duration'  # jax._src.dispatch's: XLA ran, or
_CACHE_HIT = '/jax/compilation_cache/cache_hits'  # ... jax's cache served it instead


def _on_event(event: str, *_, **__) -> None:
    seen = getattr(_watch, 'events', None)
    if seen is not None:
        seen.append(event)


@contextlib.contextmanager
def _events_of_this_thread():
    import jax

    if not getattr(_events_of_this_thread, 'listening', False):
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _events_of_this_thread.listening = True
    _watch.events = seen = []
    try:
        yield seen
    finally:
        _watch.events = None


def compiled_here(events) -> bool:
    """Whether a compile whose jax events (this thread's, during it) were `events` ran XLA in
    this process: not served by jax's persistent cache, nor by jax's in-memory caches (no XLA
    event at all). Only such an executable serializes whole (XLA:CPU: one that jax's cache
    loaded lacks its machine code, and a run of it fails or crashes)."""
    return _XLA_COMPILE in events and _CACHE_HIT not in events


def _host() -> list:
    """The host's processor (XLA:CPU compiles for the host's instruction set)."""
    import platform

    out = [platform.machine()]
    try:
        with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
            for line in f:
                if line.startswith(('model name', 'flags', 'Features')):
                    out.append(line.strip())
                elif not line.strip() and len(out) > 1:
                    break  # the first processor's lines
    except OSError:
        out.append(platform.processor())
    return out


def encode(key: str, payload: bytes) -> bytes:
    """A stored file: the format, the program's key and the payload's digest, then the payload."""
    return b'\n'.join([FORMAT, key.encode(), hashlib.sha256(payload).hexdigest().encode(),
                       payload])


def decode(blob: bytes, key: str) -> bytes:
    """The payload of a stored file for `key`; ValueError (the reason) for a torn file, another
    key's, another format's."""
    parts = blob.split(b'\n', 3)
    if parts[0] != FORMAT:
        raise ValueError('not a stored executable of this format')
    if len(parts) != 4:
        raise ValueError(f'torn ({len(blob)} bytes, no payload)')
    if parts[1] != key.encode():
        raise ValueError(f'holds the program {parts[1][:80]!r}, not this one')
    if hashlib.sha256(parts[3]).hexdigest().encode() != parts[2]:
        raise ValueError(f'torn ({len(parts[3])} bytes of payload do not match its digest)')
    return parts[3]


def _matches(compiled, args) -> bool:
    """Whether a loaded executable takes exactly args' tree, shapes and dtypes."""
    import jax
    import numpy as np

    leaves, tree = jax.tree.flatten((args, {}))  # (positional, keyword), as args_info is
    infos, info_tree = jax.tree.flatten(compiled.args_info)
    return info_tree == tree and len(infos) == len(leaves) and all(
        tuple(i.shape) == tuple(np.shape(x)) and i.dtype == getattr(x, 'dtype', np.asarray(x).dtype)
        for i, x in zip(infos, leaves, strict=True))


def _load(path, key: str, args):
    """The executable stored at path for key, or None (absent, or unusable: said once)."""
    import pickle

    import jax
    from jax.experimental import serialize_executable

    from t2t.infra import workdir as wd

    try:
        blob = wd.read_bytes(path)
        if blob is None:
            return None
        payload, in_tree, out_tree, ids = pickle.loads(decode(blob, key))
        devices = {d.id: d for d in jax.devices()}
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=[devices[i] for i in ids])
        if not _matches(compiled, args):
            raise ValueError('takes other arguments')
        return compiled
    except Exception as e:  # noqa: BLE001 - a torn, foreign or stale file: compile over it
        logging.warning('stored executable %s unusable (%s: %s): compiling', path,
                        type(e).__name__, str(e)[:200])
        return None


def _load_or_compile(fn, args, directory: str, key: str):
    import pickle
    import time

    import jax
    from jax.experimental import serialize_executable

    from t2t.infra import workdir as wd

    path = wd.path(directory, EXECUTABLES, key)
    began = time.perf_counter()
    compiled = _load(path, key, args)
    if compiled is not None:
        jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - began)
        return compiled
    lowered = fn.lower(*args)
    began = time.perf_counter()
    with _events_of_this_thread() as events:
        compiled = lowered.compile()
    if compiled_here(events) and \
            time.perf_counter() - began >= jax.config.jax_persistent_cache_min_compile_time_secs:
        began = time.perf_counter()
        try:
            # The program's devices in its own order (what jax's serialize itself reads).
            ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
            payload = pickle.dumps((*serialize_executable.serialize(compiled), ids))
            wd.write_atomic(path, encode(key, payload))  # a reader sees all of it or nothing
        except Exception as e:  # noqa: BLE001 - the run goes on; the next one compiles again
            logging.warning('storing the executable %s failed (%s: %s)', path,
                            type(e).__name__, str(e)[:200])
        jax.monitoring.record_event_duration_secs(STORE_EVENT, time.perf_counter() - began)
    return compiled
