"""A CPU run reuses its freed host memory (platforms.reuse_freed_memory): XLA's temporaries of the
second and later executions take the pages of the first, with no page fault."""

import json
import os
import statistics
import subprocess
import sys

from t2t.infra import platforms
from tests.helpers import script_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A jitted function whose temporaries are one 96 MB block: a sort takes its operand from memory
# (XLA fuses anything else into the sum). The faults of each of its calls after the first are
# counted, and the median is compared: the heap settles first (now and then a small allocation
# lands in the freed block and a call or two grow the heap once more).
_PROBE = '''
import json, resource, sys
from t2t.infra import platforms
applied = platforms.reuse_freed_memory() if sys.argv[1] == 'reuse' else None
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sort(jnp.sin(x[:, None] * x[None, :]).reshape(-1, 2), axis=1)[:, 0].sum())
x = jnp.arange(4096, dtype=jnp.float32)
f(x).block_until_ready()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({'applied': applied, 'faults': faults}))
'''


def _probe(mode: str) -> dict:
    env = script_env(PYTHONPATH=ROOT)  # one CPU device, as a run on this host has
    env.pop('GLIBC_TUNABLES', None)  # 4 KiB pages: a fault per page, the count unambiguous
    proc = subprocess.run([sys.executable, '-c', _PROBE, mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cpu_run_reuses_the_last_executions_temporaries():
    plain, reused = _probe('plain'), _probe('reuse')
    assert reused['applied'] is True  # glibc (this project's hosts)
    # 96 MB of 4 KiB pages is 24,576 faults a call without reuse; with it, none of that block
    assert statistics.median(plain['faults']) > 20_000, plain
    assert statistics.median(reused['faults']) < 500, reused


def test_only_a_cpu_only_run_changes_the_host_allocator(monkeypatch):
    monkeypatch.setenv('JAX_PLATFORMS', 'cuda,cpu')
    assert not platforms.cpu_only()
    monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
    assert platforms.cpu_only()
