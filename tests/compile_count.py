"""How many XLA programs a test run compiles: one line at the end of every pytest run.

    XLA: N distinct programs compiled (the session's compilation cache, scripts included);
    pytest processes: R compile requests (S s), C compiled, H read back from the cache

Distinct programs: the entries of the session's persistent compilation cache (tests/conftest.py
creates it empty and caches every program, so each distinct program any process of the run
compiled is one entry: train.py and the other scripts the tests start included). The pytest
processes (each xdist worker) count their own compile requests from jax.monitoring's events: each
jit compile requested (its time includes reading a cached program back), and those the cache
answered.
"""

from __future__ import annotations

import os

import pytest
from jax import monitoring

_REQUEST = '/jax/core/compile/backend_compile_duration'  # every compile, cached or not
_HIT = '/jax/compilation_cache/cache_hits'
_counts = {'requests': 0, 'hits': 0, 'seconds': 0.0}
_from_workers: list[dict] = []


def _on_duration(event: str, duration: float, **_):
    if event == _REQUEST:
        _counts['requests'] += 1
        _counts['seconds'] += duration


def _on_event(event: str, **_):
    if event == _HIT:
        _counts['hits'] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


def cache_entries(cache_dir: str) -> int:
    """Programs in a jax persistent compilation cache (one '<key>-cache' file each)."""
    return sum(name.endswith('-cache') for name in os.listdir(cache_dir))


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, 'workeroutput', None)
    if workeroutput is not None:  # an xdist worker: its counts go to the controller
        workeroutput['t2t_compiles'] = dict(_counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _from_workers.append(getattr(node, 'workeroutput', {}).get('t2t_compiles', {}))


def summary_line(own_cache_dir: str | None) -> str:
    counts = [_counts, *_from_workers]
    requests = sum(c.get('requests', 0) for c in counts)
    hits = sum(c.get('hits', 0) for c in counts)
    seconds = sum(c.get('seconds', 0.0) for c in counts)
    distinct = (f'{cache_entries(own_cache_dir)} distinct programs compiled (the session\'s '
                'compilation cache, scripts included)' if own_cache_dir and
                os.path.isdir(own_cache_dir) else
                'distinct programs not counted (JAX_COMPILATION_CACHE_DIR set outside the run)')
    return (f'XLA: {distinct}; pytest processes: {requests} compile requests ({seconds:.1f} s), '
            f'{requests - hits} compiled, {hits} read back from the cache')
