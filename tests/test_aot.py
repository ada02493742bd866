"""TPU ahead-of-time compiles on this CPU (t2t/aot/tpu.py, `train.py --dry_run --topology`).

The compiles run libtpu (the `tpu` extra) in subprocesses, one at a time under a file lock: two
libtpu users at once fail, and each compile takes most of a CPU core.
"""

import contextlib
import fcntl
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from t2t import sharding
from t2t.aot import report as aot_report
from t2t.aot import tpu as aot
from t2t.infra import flops
from t2t.model import TransformerConfig, abstract_params, count_params
from tests.conftest import ROOT

# One xdist worker runs every test that compiles with libtpu (--dist loadgroup), one at a time
# (libtpu_lock: bench/mesh_table.py takes it too), while the other goes on with the rest.
pytestmark = pytest.mark.xdist_group('libtpu')
LIBTPU_LOCK = '/tmp/t2t-libtpu.lock'
# What libtpu prints on a host without TPU chips when jax tries the TPU backend.
LIBTPU_NOISE = ('TPU_WORKER_HOSTNAMES', 'INVALID_ARGUMENT', 'TPU accelerator type', 'libtpu')
# What the CUDA plugin (the gpu-aot extra) prints on a host without a GPU when jax tries it.
GPU_NOISE = ('xla_cuda12', 'cuInit', 'Jax plugin configuration error')


@contextlib.contextmanager
def libtpu_lock():
    with open(LIBTPU_LOCK, 'a') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _env(**changes):
    env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
    env.update(changes)
    return env


def _train_py(*flags, timeout=300):
    cmd = [sys.executable, 'train.py', '--config=configs/tiny.py', '--dry_run', *flags]
    with libtpu_lock():
        return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                              timeout=timeout)


# ----------------------------------------------------------------------------------------------
# Slice names and the search, without libtpu


def test_slice_names_map_to_topologies_and_hbm():
    cases = {  # name: (topology, chips, HBM GiB, accelerator type)
        'v4-8': ('v4:2x2x1', 4, 32, 'v4-8'),
        'v4-16': ('v4:2x2x2', 8, 32, 'v4-16'),
        'v5e-16': ('v5e:4x4', 16, 16, 'v5litepod-16'),
        'v5litepod-256': ('v5e:16x16', 256, 16, 'v5litepod-256'),
        'v5p-8': ('v5:2x2x1', 4, 95, 'v5p-8'),
        'v5p-256': ('v5:4x4x8', 128, 95, 'v5p-256'),
        'v6e-256': ('v6e:16x16', 256, 32, 'v6e-256'),
        'v5e:2x2': ('v5e:2x2', 4, 16, 'v5litepod-4'),
        'v5p:4x4x12': ('v5:4x4x12', 192, 95, 'v5p-384'),
        'V6E:8x16': ('v6e:8x16', 128, 32, 'v6e-128'),
    }
    for name, (topology, chips, hbm_gib, accelerator) in cases.items():
        tpu = aot.parse_slice(name)
        assert (tpu.topology, tpu.chips, tpu.hbm_bytes, tpu.accelerator_type) == (
            topology, chips, hbm_gib << 30, accelerator), name
    assert aot.parse_slice('v4-8').chip.chip_config == 'megacore'
    assert aot.parse_slice('v5e-16').chips_per_host_bounds == (2, 2, 1)
    assert aot.parse_slice('v5e-8').chips_per_host_bounds == (2, 4, 1)  # one 8-chip host
    for bad in ('v9-8', 'v5e-3', 'v4-6', 'v5e:2x2x2', 'v4:2x2', 'tpu', 'v5e-16x', ''):
        with pytest.raises(ValueError, match=re.escape(f'--topology={bad!r}')):
            aot.parse_slice(bad)


def _memory_model(fixed, per_row, oom_above=None, power=1.0):
    """A stand-in compile: bytes per device for a batch (None: the compiler ran out of HBM)."""
    def measure(batch):
        if oom_above is not None and batch > oom_above:
            return None
        temporaries = int(per_row * batch**power)
        return aot.Memory(arguments=fixed, outputs=fixed, aliased=fixed, temporaries=temporaries,
                          code=0)
    return measure


def test_search_max_batch_aims_with_the_numbers_then_bisects():
    limit = 1000.0
    # Linear memory: the second try lands on the answer, the third confirms the next one fails.
    linear = aot.search_max_batch(_memory_model(100, 1.0), start=96, unit=8, max_tries=10,
                                  limit_bytes=limit)
    assert (linear.largest, linear.smallest_failing, linear.exact) == (896, 904, True)
    assert [b for b, _ in linear.tries] == [96, 896, 904]
    # Memory growing faster than the batch: the aim overshoots, then the search closes in.
    steep = aot.search_max_batch(_memory_model(100, 0.05, power=1.5), start=96, unit=8,
                                 max_tries=12, limit_bytes=limit)
    want = max(b for b in range(8, 4000, 8) if 100 + int(0.05 * b**1.5) <= limit)
    assert (steep.largest, steep.smallest_failing) == (want, want + 8) and steep.exact
    assert steep.tries[1][1] is False and len(steep.tries) <= 12
    # Starting above the limit: aims down from the failing try's numbers.
    down = aot.search_max_batch(_memory_model(100, 1.0), start=4000, unit=8, max_tries=10,
                                limit_bytes=limit)
    assert (down.largest, down.smallest_failing) == (896, 904) and down.tries[1] == (896, True)
    # The compiler out of memory (no numbers): halves until a batch fits, then aims and bisects.
    oom = aot.search_max_batch(_memory_model(100, 1.0, oom_above=2000), start=64000, unit=8,
                               max_tries=12, limit_bytes=limit)
    assert [b for b, _ in oom.tries[:4]] == [64000, 32000, 16000, 8000]
    assert (oom.largest, oom.smallest_failing) == (896, 904)
    bounded = aot.search_max_batch(_memory_model(100, 0.05, power=1.5), start=8, unit=8,
                                   max_tries=2, limit_bytes=limit)
    assert len(bounded.tries) == 2 and not bounded.exact
    nothing = aot.search_max_batch(_memory_model(2000, 1.0), start=64, unit=8, max_tries=20,
                                   limit_bytes=limit)
    assert nothing.largest is None and nothing.smallest_failing == 8
    for result in (linear, steep, down, oom, bounded):
        assert all(b % 8 == 0 and b >= 8 for b, _ in result.tries)
        assert len({b for b, _ in result.tries}) == len(result.tries)  # no compile repeated


def test_find_max_batch_report_prints_every_try(monkeypatch):
    """The --find_max_batch branch of the report, on a CPU mesh with a stand-in compile."""
    from configs import tiny

    config = tiny.get_config()
    per_row = 300 << 20

    def fake_compile(c, mesh):
        memory = aot.Memory(arguments=1 << 20, outputs=1 << 20, aliased=1 << 20,
                            temporaries=c.batch_size * per_row // mesh.size, code=0)
        return aot.Compiled(memory, flops_per_device=1e5 * c.batch_size, seconds=0.5,
                            matmul_flops_per_device=1e6 * c.batch_size)

    monkeypatch.setattr(aot, 'compile_train_step', fake_compile)
    plan = aot.Plan(aot.parse_slice('v5e-8'), sharding.make_mesh((-1, 1, 1)), batch_step=8)
    lines = []
    status = aot_report.dry_run(config, plan, find_max_batch=True, max_tries=12,
                             out=lines.append)
    text = '\n'.join(lines)
    # 0.95 x 16 GiB per device, 1 MiB of state, 300 MiB per row, 8 devices: 408 rows fit.
    want = max(b for b in range(8, 2000, 8) if (1 << 20) + b * per_row // 8 <= 0.95 * (16 << 30))
    assert status == 0
    assert f'largest batch_size that fits: {want} (' in text and '; exact;' in text
    tries = [line for line in lines if line.startswith('  try ')]
    assert tries[0].startswith('  try 1: batch_size=16: ')
    assert re.search(r"matmul FLOPs per row x1\.00 of the first, x[\d.]+ of the model's: "
                     r'fits \(compile 0 s\)$', tries[0]), tries[0]
    assert any('does not fit' in t for t in tries) and len(tries) <= 12


# ----------------------------------------------------------------------------------------------
# Through train.py: errors before compiling, the report, and no libtpu noise


def test_bad_slice_mesh_or_batch_is_one_line_before_compiling():
    for flag, words in (
            ('--topology=v5e-3', ["--topology='v5e-3'", 'unknown v5e slice size']),
            ('--config.mesh_shape=3,1,1', ['mesh_shape=(3, 1, 1)', '4 devices']),
            ('--config.batch_size=18', ['batch_size=18', 'not divisible by the 4'])):
        topology = [] if flag.startswith('--topology') else ['--topology=v5e:2x2']
        out = _train_py(*topology, flag, timeout=120)
        assert out.returncode == 2, out.stderr
        error = out.stderr.strip().splitlines()
        assert len(error) == 1 and error[0].startswith('train.py: ')
        assert all(w in error[0] for w in words), error[0]
        assert 'train step' not in out.stdout


def _report(stdout: str) -> dict:
    """{'train': {...}, 'predict': {...}}: each section's sizes (bytes) and verdicts."""
    unit = {'MiB': 1 << 20, 'GiB': 1 << 30}
    size = r'([\d.]+) (MiB|GiB)'
    sections, current = {}, None
    for line in stdout.splitlines():
        if line.startswith(('train step ', 'predict ')):
            current = sections.setdefault(line.split()[0], {'head': line})
        elif line.startswith('  per device: '):
            for name, value, u in re.findall(r'([a-z]+) ' + size, line):
                current[name] = float(value) * unit[u]
        elif line.startswith('  total '):
            key = 'with_state' if line.startswith('  total with the training state') else 'total'
            value, u = re.search(size, line).groups()
            current[key] = float(value) * unit[u]
            current[f'{key}_fits'] = ': fits, ' in line
        elif line.startswith('  FLOPs per step: '):
            current['flops_line'] = line
        elif line.startswith('  XLA cost_analysis: '):
            current['cost_line'] = line
        elif line.startswith('  collectives per device per '):
            current['collectives_line'] = line
    return sections


def test_tiny_fits_a_v5e_2x2_and_a_huge_batch_does_not():
    out = _train_py('--topology=v5e:2x2')
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'slice: v5e-4 (topology v5e:2x2, accelerator type v5litepod-4): 4 chips on 1 host, ' \
           'TPU v5 lite, 16.00 GiB HBM per chip' in out.stdout
    assert 'mesh: data=4 fsdp=1 tensor=1 (4 devices)' in out.stdout
    assert 'default compile settings' in out.stdout
    report = _report(out.stdout)
    for name in ('train', 'predict'):
        r = report[name]
        assert r['arguments'] > 0 and r['temporaries'] > 0 and r['total_fits'], (name, r)
        resident = r['arguments'] + r['outputs'] - r['aliased'] + r['temporaries'] + r['code']
        assert r['total'] == pytest.approx(resident, abs=3e5)  # printed rounded to 0.1 MiB
        assert r['total'] < 0.95 * (16 << 30)
    train, predict = report['train'], report['predict']
    # In-training BLEU: the training state stays resident next to the decoder's buffers.
    during = train['arguments'] + predict['temporaries'] + predict['outputs'] + predict['code']
    assert predict['with_state'] == pytest.approx(during, abs=3e5) and predict['with_state_fits']
    assert predict['arguments'] < train['arguments']  # parameters only, no Adam moments
    assert train['aliased'] > 0.9 * train['arguments']  # the donated state (the batch is tiny)
    line = train['flops_line']
    per_device, devices, total = re.search(
        r'loops counted by trip count\) ([\d.e+]+) per device x (\d+) = ([\d.e+]+); ',
        line).groups()
    assert float(per_device) * int(devices) == pytest.approx(float(total), rel=1e-3)
    ours = flops.config_flops_per_step(_tiny())
    assert f't2t/infra/flops.py {ours:.4g} (matmuls and attention' in line
    assert float(total) == pytest.approx(ours, rel=0.10)  # tiny_tpu_flops has the exact checks
    assert 'each loop body counted once' in train['cost_line']
    # Data-parallel over 4 chips: the gradients are summed across them (all-reduce, or a
    # reduce-scatter the compiler made of it), at least the f32 parameters' bytes.
    summed = [(int(n), float(b) * {'B': 1, 'KiB': 1 << 10, 'MiB': 1 << 20}[u])
              for n, b, u in re.findall(r'(?:all-reduce|reduce-scatter) (\d+) \(([\d.]+) '
                                        r'(B|KiB|MiB)\)', train['collectives_line'])]
    params = count_params(abstract_params(
        TransformerConfig.from_config(_tiny())))
    assert summed and sum(n for n, _ in summed) > 0, train['collectives_line']
    assert sum(b for _, b in summed) >= 0.95 * 4 * params, (train['collectives_line'], params)
    assert 'collectives_line' in predict
    # The roofline bound of each (its arithmetic: tests/test_pod_perf.py).
    assert out.stdout.count('  roofline LOWER BOUND of the step time (not a measurement; v5e') == 1
    assert out.stdout.count('  roofline LOWER BOUND of the batch time (not a measurement;') == 1
    # XLA's estimate with loops counted, and the MFU it implies (scaling: test_hlo, below).
    assert out.stdout.count('  XLA ESTIMATE of the batch time (its cost model, not a') == 1
    number = r'([\d.]+(?:e[+-]\d+)?)'
    estimate = re.search(
        r'  XLA ESTIMATE of the step time \(its cost model, not a measurement\): optimal_seconds '
        + number + r' ms \(each loop body once\) \+ loops\' other trips ' + number + r' ms = '
        + number + r' ms; MFU it implies ' + number + r'% \(t2t/infra/flops.py ' + number
        + r' FLOP / 4 x 197 TFLOP/s\); the roofline bound allows at most ' + number + '%',
        out.stdout)
    assert estimate, out.stdout
    optimal_ms, extra_ms, estimate_ms, mfu, model_flops, bound_mfu = map(float, estimate.groups())
    assert extra_ms >= 0  # tiny's default loss: one chunk, no loop
    assert estimate_ms == pytest.approx(optimal_ms + extra_ms, rel=0.01)
    assert model_flops == pytest.approx(ours, rel=1e-3)
    assert mfu == pytest.approx(100 * ours / (estimate_ms / 1e3) / (4 * 197e12), rel=0.02)
    assert 0 < mfu < 100 and 0 < bound_mfu

    # 65536 rows per device: the TPU compiler itself finds no room for the temporaries.
    huge = _train_py('--topology=v5e:2x2', '--config.batch_size=262144')
    assert huge.returncode == 1, huge.stdout + huge.stderr
    verdict = re.search(r'does NOT fit: .*RESOURCE_EXHAUSTED.* temporaries \(([\d.]+)G\) exceeds '
                        r'available HBM \(([\d.]+)G\)', huge.stdout)
    assert verdict, huge.stdout
    required, available = map(float, verdict.groups())
    assert required > available and 15 < available <= 16  # v5e: 16 GiB less the runtime's share
    assert 'predict: not compiled (the train step does not fit)' in huge.stdout


def _tiny():
    from configs import tiny

    return tiny.get_config()


def test_no_libtpu_noise_without_a_tpu():
    """libtpu is installed (the `tpu` extra) but this host has no TPU chip, the CUDA plugin (the
    `gpu-aot` extra) but no GPU: no start-up noise from either."""
    assert importlib.util.find_spec('libtpu') is not None, 'make test installs jax[tpu]'
    from jax._src import hardware_utils

    out = subprocess.run([sys.executable, 'train.py', '--config=configs/tiny.py', '--dry_run'],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'params: ' in out.stdout
    assert not [w for w in LIBTPU_NOISE + GPU_NOISE if w in out.stdout + out.stderr], out.stderr
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        # The same environment without t2t: jax tries libtpu and it complains.
        with libtpu_lock():
            plain = subprocess.run(
                [sys.executable, '-c', 'import jax; print(jax.devices()[0].platform)'],
                env=_env(ALLOW_MULTIPLE_LIBTPU_LOAD='1'), capture_output=True, text=True,
                timeout=120)
        assert plain.stdout.strip() == 'cpu'
        assert [w for w in LIBTPU_NOISE if w in plain.stderr], plain.stderr


_FLOPS_SCRIPT = """
import json, sys
from configs import tiny
from t2t.infra import flops
from t2t.aot import tpu as aot
out = {}
for scan in (False, True):
    config = tiny.get_config()
    config.scan_layers, config.loss_chunk_len = scan, 8  # 4 chunks of the 32 target positions
    config.loss_impl = 'fused'
    plan = aot.plan(config, 'v5e:2x2')
    compiled = aot.compile_train_step(config, plan.mesh)
    out[scan] = dict(matmul=compiled.matmul_flops_per_device * plan.mesh.size,
                     xla=compiled.flops_per_device * plan.mesh.size,
                     unknown=compiled.unknown_loops, analytic=flops.config_flops_per_step(config),
                     optimal=compiled.xla_optimal_seconds, scale=compiled.estimate.scale,
                     estimate=compiled.estimate.seconds)
print('FLOPS ' + json.dumps(out))
"""


def test_tiny_tpu_flops_and_estimate_count_loops_scanned_or_not():
    """The TPU compiler's train step, scanned and unrolled (the loss's 4 chunks a loop in both):
    the matmul FLOPs, loops counted by trip count, agree with each other and t2t/infra/flops.py;
    XLA's cost_analysis (one body per loop) is far below with scanned layers. So is its
    optimal_seconds; scaled by the loops' trip counts (t2t/aot/cost.py) the two estimates agree."""
    with libtpu_lock():
        out = subprocess.run([sys.executable, '-c', _FLOPS_SCRIPT], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    counts = json.loads(out.stdout.split('FLOPS ', 1)[1])
    unrolled, scanned = counts['false'], counts['true']
    analytic = unrolled['analytic']
    # The full (not causal-half) decoder self-attention: 12 d L (L - (L+1)/2) per target token and
    # layer, what the compiled step computes above flops.py's count.
    config = _tiny()
    causal_rest = (12 * config.d_model * config.num_decoder_layers * config.max_len
                   * (config.max_len - (config.max_len + 1) / 2) * config.batch_size)
    for c in (unrolled, scanned):
        assert c['unknown'] == 0
        assert c['matmul'] == pytest.approx(analytic + causal_rest, rel=0.02), c
    assert scanned['matmul'] == pytest.approx(unrolled['matmul'], rel=1e-3)
    assert scanned['xla'] < 0.7 * analytic  # the old count: each layer stack's body once
    # XLA's estimate: its raw number counts the scanned stacks' bodies once; the layers' other
    # trips added (more than the loss loop's alone, which both have), the two programs agree.
    extra = {k: c['estimate'] - c['optimal'] for k, c in counts.items()}
    assert extra['true'] > 2 * extra['false'] > 0, counts
    assert scanned['estimate'] == pytest.approx(unrolled['estimate'], rel=0.10), counts


def test_mesh_table_tiny_rows_are_consistent_and_resumable(tmp_path):
    """bench/mesh_table.py --tiny (two v5e:2x2 meshes): each compiled row's numbers agree with
    one another, and a second run compiles nothing (the rows are already there)."""
    import csv

    out = str(tmp_path / 'mesh')
    cmd = [sys.executable, 'bench/mesh_table.py', '--tiny', '--out', out, '--nice', '0']
    first = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    with open(out + '.csv', newline='') as f:
        rows = {r['mesh_name']: r for r in csv.DictReader(f)}
    assert sorted(rows) == ['data', 'fsdp']
    params = count_params(abstract_params(TransformerConfig.from_config(_tiny())))
    for r in rows.values():
        assert r['status'] == 'ok' and r['fits'] == 'yes' and r['chips'] == '4', r
        assert int(r['rows']) == 16 and int(r['target_tokens']) == 16 * 32  # 512 / 32, 4 | 16
        compute, memory, coll, bound = (float(r[k]) for k in
                                        ('compute_ms', 'memory_ms', 'collective_ms', 'bound_ms'))
        assert bound == pytest.approx(max(compute, memory) + coll, rel=2e-3), r
        assert float(r['collective_ms']) == pytest.approx(
            float(r['collective_gb']) * 1e9 / aot.CHIPS['v5e'].spec.ici_bytes_per_s * 1e3, rel=2e-3)
        assert float(r['tokens_per_s_per_chip_bound']) == pytest.approx(
            512 / (bound / 1e3) / 4, rel=2e-3), r
        assert float(r['total_gib']) >= float(r['argument_gib']) + float(r['temp_gib']) - 1e-3
    data, fsdp = rows['data'], rows['fsdp']
    # Data-parallel: the gradients are summed once a step, the float32 parameters' bytes (the
    # shared embedding's three reads reduced together: sharding.per_batch_shard, test_pod_perf.py).
    summed = sum(float(v) for k, v in (kv.split('=') for kv in data['collective_kinds'].split())
                 if k in ('all-reduce', 'reduce-scatter'))
    assert summed * 1e9 == pytest.approx(4 * params, rel=2e-3), (data, params)
    assert 'all-gather' not in data['collective_kinds']
    # fsdp gathers the sharded parameters and holds less of the state per chip (at this size
    # the replicated biases and layer norms are a good part of it).
    assert 'all-gather' in fsdp['collective_kinds']
    assert float(fsdp['argument_gib']) < 0.8 * float(data['argument_gib'])
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and '2 rows already in' in again.stdout and \
        '0 to compile' in again.stdout, again.stdout + again.stderr
    with open(out + '.md') as f:
        assert len(f.read().splitlines()) == 4  # header, rule, two rows
