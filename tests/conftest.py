"""Tests run on the CPU with 8 host devices, so sharding is exercised without an accelerator."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# XLA's CPU compiler at its quickest (TEST_XLA_FLAGS): the tests run tiny models, a few steps each,
# so compiling is most of their time. LLVM without optimization, and the legacy fusion emitters in
# one codegen module instead of the MLIR emitters split in parallel modules, compile a tiny run's
# programs in under half the time (bench/RESULTS.md, "The test suite"); the programs run slower,
# which tiny models do not notice. Every CPU process of the tests uses them (tests compare runs bit
# for bit): the scripts they start get them from tests/helpers.py. The TPU and GPU ahead-of-time
# tests compile in processes without XLA_FLAGS.
from tests import gcs_server  # noqa: E402
from tests.helpers import DEVICE_FLAG, TEST_XLA_FLAGS, script_env, tiny_config  # noqa: E402, F401

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + f' {TEST_XLA_FLAGS} {DEVICE_FLAG}=8'
).strip()
os.environ['JAX_PLATFORMS'] = 'cpu'
os.environ.update(gcs_server.GCSFS_HTTP_ONLY)  # before any test imports gcsfs
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# One persistent compilation cache for the whole run, shared by the xdist workers and the train.py /
# evaluate.py subprocesses they start (they inherit the environment): the same tiny train step is
# compiled once, not once per process. Created by the first process to load this file; removed
# when that process exits, so every run starts cold like CI.
_OWN_CACHE = None  # the cache this process created: its entries are the run's distinct programs
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    _OWN_CACHE = _cache = tempfile.mkdtemp(prefix='t2t-test-jax-cache-')
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
    os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '-1'


# Counts of XLA compiles, one line at the end of the run (tests/compile_count.py).
from tests import compile_count  # noqa: E402
from tests.compile_count import pytest_sessionfinish, pytest_testnodedown  # noqa: E402, F401


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(compile_count.summary_line(_OWN_CACHE))


@pytest.fixture(scope='session')
def trained_tiny(tmp_path_factory) -> dict:
    """configs/tiny.py trained on the toy corpus, once per process (tests/trained_tiny.py)."""
    from tests import trained_tiny

    return trained_tiny.train(tmp_path_factory.mktemp('trained'))


def one_device_env() -> dict:
    """The environment for a script the tests start on one CPU device (tests/helpers.py)."""
    return script_env(1)


# --dist loadgroup (make test) hands each worker a whole group at a time, in the order of the
# collection here (pytest_configure turns xdist's own reordering by test count off: it put the
# groups of one or two long tests last, where two of them met on one worker). The four longest
# groups go first, one to each of make test's four workers (xdist's first assignment); every
# other test follows, the larger groups first, and fills in wherever a worker is free. Their
# times: bench/RESULTS.md, "The test suite".
LONGEST_FIRST = ('tests.test_chaos', 'tests.test_bucket_faults', 'libtpu',
                 'tests.test_multiprocess')


def pytest_configure(config):
    if getattr(config.option, 'loadscopereorder', None) is not None:
        config.option.loadscopereorder = False


def _group(item) -> str:
    """The work unit xdist makes of the item: its xdist_group names joined, as xdist joins them."""
    names = {str(m.args[0] if m.args else m.kwargs.get('name', 'default'))
             for m in item.iter_markers('xdist_group')}
    return '_'.join(sorted(names)) if names else item.nodeid


def pytest_collection_modifyitems(config, items):
    if config.getoption('dist', 'no') != 'loadgroup':
        return  # a plain run keeps each module's tests together (its module fixtures once)
    sizes = {}
    for item in items:
        sizes[_group(item)] = sizes.get(_group(item), 0) + 1

    def rank(item):
        group = _group(item)
        if group in LONGEST_FIRST:
            return (LONGEST_FIRST.index(group), 0)
        return (len(LONGEST_FIRST), -sizes[group])

    items.sort(key=rank)  # stable: each group's tests stay in their order
