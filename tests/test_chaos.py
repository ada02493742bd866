"""The chaos run, short form: scripts/launch_local.py trains tiny on 2 processes x 2 CPU devices,
locally and with its workdir in a bucket on the local Cloud Storage server behind a
fault-injecting front (tests/fault_front.py), while 2 SIGKILLs and one SIGSTOP (a hang) hit random
processes at random moments (seeded, tests/chaos_run.py). The launcher restarts every time,
training finishes, the final parameters equal an uninterrupted run's bit for bit and metrics.jsonl
holds each step once; the goodput report counts every attempt, adds up to the wall time and finds
the steps trained twice. Each fault costs a restart (two processes start jax again, a hang the
guard's timeout on top), so the two runs' seeds are chosen to cover the kinds of fault between
them rather than by count: local, a kill of process 1 during start-up, a hang of process 0 (the
one that prints the step lines) and a kill of process 1 in training; bucket, kills of process 0
in training and in start-up and a hang of process 1 (the one that prints nothing) in training.
The hangs come in training, where the launcher's guard waits HANG_TIMEOUT_S; its start-up
guard (STARTUP_HANG_TIMEOUT_S, above a loaded machine's start-up silence) is tested on stand-in
processes in tests/test_launchers.py. bench/chaos.py is the long form (20 faults).
"""

import contextlib
import json
import os
import re

import pytest

from t2t.run import run_record
from tests import chaos_run, fault_front, gcs_server
from tests.helpers import run_script

pytestmark = pytest.mark.xdist_group(__name__)

# The faults land by step 5 (FAULTS' plans: at most 4 step lines into an attempt that resumed from
# checkpoint 0 or 3); the last attempt then trains on from its checkpoint to here.
STEPS = 12
# The launcher's guards: silence before an attempt's first step line, and after it (above the
# longest pause between step lines in training on a loaded 2-core machine: a save, the evaluation).
STARTUP_HANG_TIMEOUT_S, HANG_TIMEOUT_S = 45.0, 20.0
SEED = 3  # the bucket front's
# Its faults: a run makes about 2,000 requests, and each 503 costs the clients' first backoff
# (about a second), so a few in a thousand give a dozen of each.
P_503, P_DROP = 0.005, 0.005
DEVICES = 2  # per process: collectives within a process and across the two, at cheaper steps than 4
# (seed, SIGKILLs, SIGSTOPs) of chaos_run.plan: what each draws is in the module doc.
FAULTS = {'local': (0, 2, 1), 'bucket': (5, 2, 1)}


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp('chaos-reference')
    data_dir = str(root / 'data')
    result = chaos_run.run(str(root / 'run'), str(root / 'logs'), STEPS, data_dir, [],
                           devices=DEVICES, hang_timeout_s=HANG_TIMEOUT_S,
                           startup_hang_timeout_s=STARTUP_HANG_TIMEOUT_S)
    assert result['status'] == 0 and result['attempts'] == 1, result['launcher_err'][-3000:]
    return {'workdir': str(root / 'run'), 'data_dir': data_dir}


@contextlib.contextmanager
def _storage(kind: str, tmp_path):
    """A workdir: local, or in a bucket on the local Cloud Storage server behind a front that
    answers 0.5% of requests 503 and drops 0.5% after they took effect (the environment of this
    process, which the launcher and its processes inherit, points at the front)."""
    if kind == 'local':
        yield str(tmp_path / 'run'), None
        return
    with gcs_server.serve() as url:
        front = fault_front.start(url, seed=SEED, p_503=P_503, p_drop=P_DROP)
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
    seed, kills, stops = FAULTS[storage]
    faults = chaos_run.plan(seed, kills=kills, stops=stops)
    restarts_due = kills + stops
    with _storage(storage, tmp_path) as (workdir, front):
        result = chaos_run.run(workdir, str(tmp_path / 'logs'), STEPS, reference['data_dir'],
                               faults, devices=DEVICES, hang_timeout_s=HANG_TIMEOUT_S,
                               startup_hang_timeout_s=STARTUP_HANG_TIMEOUT_S)
        finished = run_record.read_finished(workdir)
        counts = chaos_run.step_counts(workdir)
        differ = chaos_run.params_differ(workdir, reference['workdir'], STEPS)
        faults_injected = dict(front.counts) if front else {}
        ledger = run_script('-m', 't2t.goodput', workdir, '--json', '--no_tensorboard')
    err = result['launcher_err']
    with capsys.disabled():
        print(f"\nchaos ({storage}): {len(result['applied'])} faults, {result['attempts']} "
              f"attempts, {result['steps_redone']} steps redone, {result['wall_s']:.0f} s; "
              f"bucket front {faults_injected}")
    assert result['status'] == 0, err[-3000:]
    assert len(result['applied']) == restarts_due, (result['applied'], err[-3000:])
    restarts = re.findall(r'^launch_local: restart (\d+) of \d+ at (\d+) s: (.*)$', err, re.M)
    assert [int(n) for n, _, _ in restarts] == list(range(1, restarts_due + 1))
    assert result['attempts'] == restarts_due + 1
    for fault, (_, at_s, cause) in zip(result['applied'], restarts, strict=True):
        if fault['signal'] == 'SIGKILL':
            assert cause == f'process {fault["process"]} killed by SIGKILL', (fault, cause)
        else:  # the hang in training ended the attempt within the guard's limit
            assert cause == f'no output from process 0 for {HANG_TIMEOUT_S:g} s in training ' \
                f'(process {fault["process"]} stopped): taken as a hang', (fault, cause)
            assert int(at_s) - fault['at_s'] <= HANG_TIMEOUT_S + 10, (fault, at_s)
    assert f'training finished at step {STEPS} (num_train_steps) after {restarts_due} restarts' \
        in err
    assert finished == {'step': STEPS, 'stopped_by': 'num_train_steps'}
    assert counts == {s: 1 for s in range(1, STEPS + 1)}
    assert differ == []
    if front:  # the front did inject faults
        assert faults_injected['503'] > 0 and faults_injected['dropped'] > 0, faults_injected
    _check_goodput(ledger, result, tmp_path / 'logs')


def _check_goodput(proc, result, logs):
    """`python -m t2t.goodput` on the chaos run: every attempt the launcher started, the wall time
    split without remainder, and lost progress = the steps trained twice by the step lines."""
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert (r['attempts'], r['restarts']) == (result['attempts'], result['attempts'] - 1)
    total = sum(r['seconds'].values())
    assert abs(total - r['wall_s']) <= 0.01 * r['wall_s'], (total, r['wall_s'])
    # Each recorded attempt's steps against process 0's stdout: it began at the checkpoint it
    # resumed from; its last slice is its last step line, or the one before when the kill landed
    # between that line and the slice written after it (the step then counts as not recorded).
    printed = chaos_run.attempt_steps(str(logs), result['attempts'])
    ranges = {}
    for a in r['per_attempt']:
        k = a['launch_attempt']['number']
        (first, last), (resumed, logged) = a['steps'], printed[k]
        if first is None:  # killed before training began
            continue
        assert first == (resumed or 0), (k, a['steps'], printed[k])
        assert last in ({logged, logged - 1} if logged is not None else {first}), (k, a, printed)
        ranges[k] = (first, last)
    assert r['lost_steps'] == chaos_run.trained_twice([ranges[k] for k in sorted(ranges)]), r
    assert r['lost_steps'] > 0 and r['seconds']['lost_progress'] > 0
