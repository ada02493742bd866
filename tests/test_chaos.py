"""The chaos run, short form: scripts/launch_local.py trains tiny on 2 processes x 4 CPU devices
while 5 SIGKILLs and one SIGSTOP (a hang) hit random processes at random moments (seeded,
tests/chaos_run.py). The launcher restarts every time, training finishes, the final parameters
equal an uninterrupted run's bit for bit and metrics.jsonl holds each step once.
bench/chaos.py is the long form (20 faults).
"""

import re

import pytest

from t2t import loop
from tests import chaos_run

pytestmark = pytest.mark.xdist_group(__name__)

STEPS = 24
HANG_TIMEOUT_S = 30.0  # the launcher's guard; above a loaded 2-core machine's start-up silence
SEED = 3


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp('chaos-reference')
    data_dir = str(root / 'data')
    result = chaos_run.run(str(root / 'run'), str(root / 'logs'), STEPS, data_dir, [],
                           hang_timeout_s=HANG_TIMEOUT_S)
    assert result['status'] == 0 and result['attempts'] == 1, result['launcher_err'][-3000:]
    return {'workdir': str(root / 'run'), 'data_dir': data_dir}


@pytest.mark.parametrize('storage', ['local'])
def test_chaos_run_restarts_and_ends_exact(reference, tmp_path, storage, capsys):
    faults = chaos_run.plan(SEED, kills=5, stops=1)
    workdir = str(tmp_path / 'run')
    result = chaos_run.run(workdir, str(tmp_path / 'logs'), STEPS, reference['data_dir'], faults,
                           hang_timeout_s=HANG_TIMEOUT_S)
    err = result['launcher_err']
    with capsys.disabled():
        print(f"\nchaos ({storage}): {len(result['applied'])} faults, {result['attempts']} "
              f"attempts, {result['steps_redone']} steps redone, {result['wall_s']:.0f} s")
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
    assert loop.read_finished(workdir) == {'step': STEPS, 'stopped_by': 'num_train_steps'}
    assert chaos_run.step_counts(workdir) == {s: 1 for s in range(1, STEPS + 1)}
    assert chaos_run.params_differ(workdir, reference['workdir'], STEPS) == []
