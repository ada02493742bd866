"""Tests run on the CPU with 8 host devices, so sharding is exercised without an accelerator."""

import atexit
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# LLVM without optimization for XLA's CPU code (TEST_XLA_FLAGS): the tests run tiny models, a few
# steps each, so compiling is most of their time; at level 0 it takes about a third less and the
# programs run slower, which tiny models do not notice. Every CPU process of the tests uses it
# (tests compare runs bit for bit): the scripts they start get it from tests/helpers.py. The TPU
# ahead-of-time tests compile in processes without XLA_FLAGS.
from tests.helpers import TEST_XLA_FLAGS, script_env, tiny_config  # noqa: E402, F401

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + f' {TEST_XLA_FLAGS} --xla_force_host_platform_device_count=8'
).strip()
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# One persistent compilation cache for the whole run, shared by the xdist workers and the train.py /
# evaluate.py subprocesses they start (they inherit the environment): the same tiny train step is
# compiled once, not once per process. Created by the first process to load this file; removed
# when that process exits, so every run starts cold like CI.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    _cache = tempfile.mkdtemp(prefix='t2t-test-jax-cache-')
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
    os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'


def one_device_env() -> dict:
    """The environment for a script the tests start on one CPU device (tests/helpers.py)."""
    return script_env(1)
