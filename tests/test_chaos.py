"""The chaos run, short form: scripts/launch_local.py trains tiny on 2 processes x 4 CPU devices,
its workdir in a bucket on the local Cloud Storage server behind a fault-injecting front
(tests/fault_front.py), while 5 SIGKILLs and one SIGSTOP (a hang) hit random processes at random
moments (seeded, tests/chaos_run.py). The launcher restarts every time, training finishes, the
final parameters equal an uninterrupted run's bit for bit and metrics.jsonl holds each step once.
bench/chaos.py is the long form (20 faults).
"""

import contextlib
import os
import re

import pytest

from t2t import loop
from tests import chaos_run, fault_front, gcs_server

pytestmark = pytest.mark.xdist_group(__name__)

STEPS = 24
HANG_TIMEOUT_S = 45.0  # the launcher's guard; above a loaded 2-core machine's start-up silence
SEED = 3


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp('chaos-reference')
    data_dir = str(root / 'data')
    result = chaos_run.run(str(root / 'run'), str(root / 'logs'), STEPS, data_dir, [],
                           hang_timeout_s=HANG_TIMEOUT_S)
    assert result['status'] == 0 and result['attempts'] == 1, result['launcher_err'][-3000:]
    return {'workdir': str(root / 'run'), 'data_dir': data_dir}


@contextlib.contextmanager
def _storage(kind: str, tmp_path):
    """A workdir: local, or in a bucket on the local Cloud Storage server behind a front that
    answers 2% of requests 503 and drops 1% after they took effect (the environment of this
    process, which the launcher and its processes inherit, points at the front)."""
    if kind == 'local':
        yield str(tmp_path / 'run'), None
        return
    with gcs_server.serve() as url:
        front = fault_front.start(url, seed=SEED, p_503=0.02, p_drop=0.01)
        before = dict(os.environ)
        os.environ.update(gcs_server.environment(front.url))
        try:
            yield gcs_server.make_bucket(url, 'chaos') + '/run', front
        finally:
            os.environ.clear()
            os.environ.update(before)
            front.stop()


@pytest.mark.parametrize('storage', ['local', 'bucket'])
def test_chaos_run_restarts_and_ends_exact(reference, tmp_path, storage, capsys):
    faults = chaos_run.plan(SEED, kills=5, stops=1)
    with _storage(storage, tmp_path) as (workdir, front):
        result = chaos_run.run(workdir, str(tmp_path / 'logs'), STEPS, reference['data_dir'],
                               faults, hang_timeout_s=HANG_TIMEOUT_S)
        finished = loop.read_finished(workdir)
        counts = chaos_run.step_counts(workdir)
        differ = chaos_run.params_differ(workdir, reference['workdir'], STEPS)
        faults_injected = dict(front.counts) if front else {}
    err = result['launcher_err']
    with capsys.disabled():
        print(f"\nchaos ({storage}): {len(result['applied'])} faults, {result['attempts']} "
              f"attempts, {result['steps_redone']} steps redone, {result['wall_s']:.0f} s; "
              f"bucket front {faults_injected}")
    assert result['status'] == 0, err[-3000:]
    assert len(result['applied']) == 6, (result['applied'], err[-3000:])
    restarts = re.findall(r'^launch_local: restart (\d+) of \d+ at (\d+) s: (.*)$', err, re.M)
    assert [int(n) for n, _, _ in restarts] == list(range(1, 7)) and result['attempts'] == 7
    for fault, (_, at_s, cause) in zip(result['applied'], restarts, strict=True):
        if fault['signal'] == 'SIGKILL':
            assert cause == f'process {fault["process"]} killed by SIGKILL', (fault, cause)
        else:  # the hang ended the attempt within the guard's limit
            assert 'taken as a hang' in cause and f'process {fault["process"]} stopped' in cause
            assert int(at_s) - fault['at_s'] <= HANG_TIMEOUT_S + 10, (fault, at_s)
    assert 'training finished at step 24 (num_train_steps) after 6 restarts' in err
    assert finished == {'step': STEPS, 'stopped_by': 'num_train_steps'}
    assert counts == {s: 1 for s in range(1, STEPS + 1)}
    assert differ == []
    if front:  # the front did inject faults
        assert faults_injected['503'] > 0 and faults_injected['dropped'] > 0, faults_injected
