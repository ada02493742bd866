"""The stored whole executables (t2t/run/compile_cache.py): which are stored, which files load.

Only an executable that XLA compiled in that very compile is stored: one that jax's persistent
cache served re-serializes without its machine code (XLA:CPU: a later process's run of it fails,
"Function ... not found"), and jax's in-memory caches hand out such an executable again without
any cache event. A file names its format, key and payload digest: anything else is compiled over.
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from t2t.run import compile_cache
from tests.conftest import ROOT


@pytest.fixture
def cache(tmp_path):
    """A private cache directory (cold), jax's and the stored executables'."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update('jax_compilation_cache_dir', str(tmp_path / 'cache'))
    try:
        yield tmp_path / 'cache' / compile_cache.EXECUTABLES
    finally:
        jax.config.update('jax_compilation_cache_dir', before)


CONFIG = ml_collections.ConfigDict({'store_executables': True, 'name': 'test'})


def _program():  # a new function each call: a fresh trace of the same program
    return jax.jit(lambda v: jnp.sin(v) * 2 + jnp.cumsum(v))


def test_only_an_executable_xla_compiled_in_that_compile_is_stored(cache):
    x = jnp.arange(6.0)
    want = _program()(x).tolist()  # XLA compiles it; jax's cache now holds it
    served = _program()
    assert served(x).tolist() == want  # jax's persistent cache served this one
    # Its next compile comes from jax's in-memory cache: no cache event at all. Counting the
    # process's cache hits around it took it for XLA's own and stored it.
    with compile_cache._events_of_this_thread() as events:
        served.lower(x).compile()
    assert not compile_cache.compiled_here(events)
    assert compile_cache.stored(served, CONFIG, 'p')(x).tolist() == want
    assert compile_cache.stored(_program(), CONFIG, 'p')(x).tolist() == want  # a cache hit
    assert not cache.exists()
    # A program XLA compiles in the call is stored, and a restart loads it.
    fresh = jax.jit(lambda v: v * 3 - 1)
    assert compile_cache.stored(fresh, CONFIG, 'q')(x).tolist() == [-1, 2, 5, 8, 11, 14]
    (path,) = cache.iterdir()
    events = []

    def listen(event, seconds, **_):
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        loaded = compile_cache.stored(jax.jit(lambda v: v * 3 - 1), CONFIG, 'q')
        assert loaded(x).tolist() == [-1, 2, 5, 8, 11, 14]
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compile_cache.LOAD_EVENT in events and path.exists()


def test_a_torn_foreign_or_stale_file_is_compiled_over(cache, caplog):
    key, payload = 'q-' + 'a' * 64, b'\x00pickled\nexecutable\n'
    blob = compile_cache.encode(key, payload)
    assert compile_cache.decode(blob, key) == payload
    for bad, reason in ((blob[:-1], 'torn'), (blob[:40], 'torn'), (b'\x80\x04junk', 'format'),
                        (compile_cache.encode('q-' + 'b' * 64, payload), 'holds the program')):
        with pytest.raises(ValueError, match=reason):
            compile_cache.decode(bad, key)
    # Another program's file under this program's name: refused, this one compiled.
    x = jnp.arange(4.0)
    assert compile_cache.stored(jax.jit(lambda v: v + 7), CONFIG, 'r')(x).tolist() == [7, 8, 9, 10]
    (other,) = cache.iterdir()
    mine = cache / f'r-{compile_cache.program_key(CONFIG, "r", (x[:2],))}'
    mine.write_bytes(other.read_bytes())
    assert compile_cache.stored(jax.jit(lambda v: v - 7), CONFIG, 'r')(x[:2]).tolist() == [-7, -6]
    assert 'unusable (ValueError: holds the program' in caplog.text


def test_the_key_covers_the_whole_package():
    package = os.path.join(ROOT, 't2t')
    assert compile_cache.sources_digest() == compile_cache.sources_digest(package)
    assert compile_cache.sources_digest() != compile_cache.sources_digest(
        os.path.join(package, 'run'))  # the model and the train step are outside t2t/run/
    assert any('model name' in x or 'flags' in x for x in compile_cache._host()) or \
        not os.path.exists('/proc/cpuinfo')
