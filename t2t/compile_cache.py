"""jax's persistent compilation cache for train.py and evaluate.py: a restart loads its programs.

config.compilation_cache_dir:
  ''        $JAX_COMPILATION_CACHE_DIR when set (jax reads it itself; the tests set it), else
            $XDG_CACHE_HOME/t2t/jax (~/.cache/t2t/jax): host-local
  'off'     no persistent cache
  a path or a bucket URL (gs://...: jax reads and writes it through etils.epath)
The cache key holds the program, the devices, the jax version and the XLA flags, so one directory
serves every config. Programs that compile in under MIN_COMPILE_S are not stored (one file each;
on a bucket one object each) unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
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
