"""The benchmarks work, at toy sizes on the CPU: the GPU ones bench/run_gpu.sh runs in one go on
a GPU machine, and the CPU ones (bulk translation against its exports).

A GPU run is costly and often done once: a benchmark that breaks on a code change (as bfloat16
training once did on the CPU's dot kernels) must fail here, not there.
"""

import json
import math
import subprocess
import sys

from tests.conftest import ROOT, one_device_env


def _results(*args):
    # One CPU device, as on the GPU box's one chip (the suite's processes have 8 host devices).
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=one_device_env())
    results = [json.loads(line[len('RESULT '):]) for line in out.stdout.splitlines()
               if line.startswith('RESULT ')]
    assert out.returncode == 0 and results, out.stdout[-3000:] + out.stderr[-3000:]
    return results


def test_train_speed_runs_the_gpu_levers_in_bfloat16():
    # run_gpu.sh's BASE levers: scanned layers, rbg dropout keys, the fused loss in one chunk.
    results = _results('bench/train_speed.py', '--tiny', '--model', 'base',
                       '--attention', 'xla,dot_product', '--steps', '1', '--warmup_steps', '1',
                       '--scan_layers', '--rng_impl', 'rbg')
    assert [r['attention'] for r in results] == ['xla', 'dot_product']
    for r in results:
        assert r['status'] == 'ok' and r['dtype'] == 'bfloat16', r
        assert r['step_ms'] > 0 and math.isfinite(r['loss']) and r['loss'] > 0


def test_decode_speed_runs_a_forced_beam_search():
    (r,) = _results('bench/decode_speed.py', '--tiny', '--attention', 'xla', '--reps', '1')
    assert r['status'] == 'ok', r
    assert r['batch_ms'] > 0 and r['sent_s'] > 0 and r['decoded_len'] == 8


def test_translate_speed_runs_every_runtime(tmp_path):
    # A random tiny model: t2t's streaming translator, both CTranslate2 weight types, generate().
    results = _results('bench/translate_speed.py', '--tiny', '--t2t_runs=1',
                       f'--out_dir={tmp_path}')
    assert [(r['runtime'], r['input']) for r in results] == [
        ('t2t', 'test'), ('t2t', 'repeated'), ('ct2-float32', 'test'), ('ct2-float32', 'repeated'),
        ('ct2-int8', 'test'), ('ct2-int8', 'repeated'), ('hf', 'test')]
    for r in results:
        assert r['lines'] == (24 if r['input'] == 'test' else 48) and r['sent_s'] > 0, r
        assert 0 <= r.get('same_as_t2t', 0) <= 1 and r['beam'] == 4
        assert r['t2t_beam_stop'] == 'bound' and r.get('warm') in (None, False)
    # The exported float32 model decodes a random model's test lines as t2t does (greedy
    # parity and beam ties on trained models: tests/test_export.py).
    assert results[2]['same_as_t2t'] >= 0.9, results[2]
