"""Hangs and stragglers name themselves: a process that never starts, a barrier a process never
reaches, processes that disagree, a step or a save that runs too long; and every run records
what ran (WORKDIR/run-<start>.json)."""

import glob
import io
import json
import os
import signal
import subprocess
import sys
import time

from t2t import train_lib
from t2t.infra import exits, watchdog
from t2t.run import checkpoint, run_record
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import ROOT, start_script
from tests.test_multiprocess import _flags as _pod_flags
from tests.test_multiprocess import _free_port
from tests.test_train import _run_config

DRIVER = os.path.join(ROOT, 'tests', 'hang_driver.py')
STARTUP_S = 3


def _start(port, count, index, *extra, startup_s=STARTUP_S):
    return start_script(DRIVER, f'--coordinator_address=localhost:{port}',
                        f'--num_processes={count}', f'--process_id={index}',
                        f'--startup_timeout_s={startup_s}', *extra, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=60):
    """(exit status, stdout, last line of stderr, seconds from now); the whole stderr is kept as
    proc.stderr_text."""
    start = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    proc.stderr_text = err
    lines = err.strip().splitlines()
    return proc.returncode, out, lines[-1] if lines else '', time.monotonic() - start


def test_processes_that_never_start_are_named():
    ports = [_free_port() for _ in range(4)]
    started = time.monotonic()
    jobs = {
        # the 2-process job whose process 1 never starts
        'alone0': _start(ports[0], 2, 0),
        # a 3-process job whose process 2 never starts: process 1 hears it from process 0
        'three0': _start(ports[1], 3, 0), 'three1': _start(ports[1], 3, 1),
        # process 1 of a job whose process 0 never starts
        'alone1': _start(ports[2], 2, 1),
        # the processes do not agree on the job's size
        'size0': _start(ports[3], 2, 0), 'size1': _start(ports[3], 3, 1),
    }
    results = {name: _finish(proc) for name, proc in jobs.items()}
    took = time.monotonic() - started
    assert {name: r[0] for name, r in results.items()} == dict.fromkeys(jobs, 1), results
    assert results['alone0'][2] == (f'hang_driver.py: process 1 of 2 did not join within '
                                    f'{STARTUP_S} s (coordinator localhost:{ports[0]})')
    missing_2 = f'process 2 of 3 did not join within {STARTUP_S} s (coordinator localhost:'
    assert results['three0'][2] == f'hang_driver.py: {missing_2}{ports[1]})'
    assert results['three1'][2] == (f'hang_driver.py: process 1: process 0 gave up: {missing_2}'
                                    f'{ports[1]})')
    assert results['alone1'][2] == (f'hang_driver.py: process 1: the coordinator localhost:'
                                    f'{ports[2]} (process 0) did not answer within {STARTUP_S} s')
    size = 'process 1 has --num_processes=3, process 0 has 2'
    assert results['size0'][2] == f'hang_driver.py: {size}'
    assert results['size1'][2] == f'hang_driver.py: process 1: process 0 gave up: {size}'
    # Each gave up at its timeout (process 1 of 'three' when process 0 told it), not after
    # jax's 5 minutes; 'size' at once.
    waited = {name: float(r[1].split()[3]) for name, r in results.items()}
    for name in ('alone0', 'three0', 'alone1'):
        assert STARTUP_S <= waited[name] < STARTUP_S + 2, (name, waited)
    assert STARTUP_S - 1 < waited['three1'] < STARTUP_S + 2, waited  # started after process 0
    assert max(waited['size0'], waited['size1']) < STARTUP_S, waited
    assert took < 60


def test_barriers_wait_for_late_processes_and_name_absent_and_disagreeing_ones():
    port = _free_port()
    procs = [_start(port, 2, i, '--scenario=barriers') for i in range(2)]
    results = [_finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0], results
    out0, out1 = results[0][1].splitlines(), results[1][1].splitlines()
    outcomes = [line for line in out0 if ': ok' in line or 'Error' in line or 'PeerLost' in line]
    # Process 1 reaches the first barrier 1.5 s late: process 0 waits, with progress lines.
    assert outcomes[0].startswith('late: ok after') and float(outcomes[0].split()[3]) >= 1.0
    assert any(line.startswith('hang_driver.py: process 0: waiting for process 1: everyone, ')
               and line.endswith(' s so far') for line in out0)
    assert outcomes[1].startswith('same: ok')
    differ = ("the processes disagree on digest: process 0 has 'value-0', process 1 has "
              "'value-1'")
    assert outcomes[2].endswith(differ) and any(line.endswith(differ) for line in out1)
    # Process 1 never reaches 'absent': process 0 gives up after 2 s, naming it.
    assert outcomes[3].endswith(": process 0: gave up at 'absent' after 2 s waiting for process 1: "
                                'process 1 does something')
    assert outcomes[3].startswith('absent: PeerLost after')  # train.py: exit 4, a restart helps
    assert 2.0 <= float(outcomes[3].split()[3]) < 3.0
    # ... and both go on to the next barrier, process 1 having waited there for process 0.
    assert outcomes[4].startswith('after: ok') and out1[-1].startswith('after: ok')
    assert 'hang_driver.py: process 1: waiting for process 0: everyone, 1 s so far' in out1, out1


HEARTBEAT_S = 3


def _started(proc):
    """Reads the 'started' line byte by byte: nothing after it is buffered away from
    communicate()."""
    line = b''
    while not line.endswith(b'\n') and (byte := os.read(proc.stdout.fileno(), 1)):
        line += byte
    assert line == b'started\n', (line, proc.stderr.read() if proc.poll() is not None else '')


def test_a_lost_process_ends_the_job_in_one_line_with_status_4():
    """Three 2-process jobs with --heartbeat_timeout_s=3: process 1 SIGKILLed (process 0 names it),
    process 0 SIGSTOPped (process 1 names the coordination service), and a normal end where
    process 1 ends 2 x 3 s after process 0 (both exit 0: waiting at the end is not lost)."""
    ports = [_free_port() for _ in range(3)]
    beat = f'--heartbeat_timeout_s={HEARTBEAT_S}'
    # Six processes start at once: a start-up limit that a loaded machine cannot hit (start-up is
    # the test above's subject, not this one's).
    jobs = {name: [_start(port, 2, i, f'--scenario={scenario}', beat, '--end_after_s=6',
                          startup_s=60) for i in range(2)]
            for name, port, scenario in (('kill', ports[0], 'idle'), ('stop', ports[1], 'idle'),
                                         ('end', ports[2], 'end'))}
    for procs in jobs.values():
        for proc in procs:
            _started(proc)
    os.kill(jobs['kill'][1].pid, signal.SIGKILL)
    os.kill(jobs['stop'][0].pid, signal.SIGSTOP)
    try:
        killed = _finish(jobs['kill'][0])
        stopped = _finish(jobs['stop'][1])
        ended = [_finish(proc) for proc in jobs['end']]
    finally:
        for proc in (jobs['kill'][1], jobs['stop'][0]):
            proc.kill()
            proc.wait()
    assert killed[0] == exits.PEER_LOST, killed
    head = 'hang_driver.py: process 0: lost process 1: no heartbeat for '
    assert killed[2].startswith(head) and killed[2].endswith(
        f' s (--heartbeat_timeout_s={HEARTBEAT_S}); exiting with status 4 (peer lost)'), killed
    silent = float(killed[2][len(head):].split()[0])
    assert HEARTBEAT_S <= silent < HEARTBEAT_S + 1.5 and killed[3] < HEARTBEAT_S + 2.5, killed
    assert stopped[0] == exits.PEER_LOST, stopped
    assert stopped[2].startswith('hang_driver.py: process 1: the coordination service (process '
                                 '0) has not answered for '), stopped
    assert stopped[3] < HEARTBEAT_S + 2.5, stopped
    assert [r[0] for r in ended] == [0, 0], ended
    end_times = [float(r[1].split('ending at ')[1].split()[0]) for r in ended]
    assert end_times[1] - end_times[0] > 2 * HEARTBEAT_S - 0.5, end_times


def test_a_stopped_host_ends_training_within_the_heartbeat_timeout(tmp_path):
    """train.py on 2 processes (1 CPU device each), process 1 SIGSTOPped while it trains: process 0
    exits with status 4 (peer lost) within --heartbeat_timeout_s and a little, naming process 1,
    instead of waiting in the next collective until jax aborts it; hang_timeout_s=30 is the
    later backstop (exit 3)."""
    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus')
    workdir = tmp_path / 'run'
    port, procs = _free_port(), []
    flags = _pod_flags(corpus, num_train_steps=100000, log_every_steps=1, eval_every_steps=100000,
                       checkpoint_every_steps=100000, hang_timeout_s=30.0)
    for i in range(2):
        procs.append(start_script(
            'train.py', *flags, f'--workdir={workdir}',
            f'--config.data_dir={tmp_path / f"data{i}"}',
            f'--coordinator_address=localhost:{port}', '--num_processes=2', f'--process_id={i}',
            f'--heartbeat_timeout_s={HEARTBEAT_S}', stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
    try:
        metrics_file, deadline = workdir / 'metrics.jsonl', time.monotonic() + 400
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                p.poll() for p in procs]
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGSTOP)
        status, _, last, took = _finish(procs[0], timeout=60)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert status == exits.PEER_LOST, (status, procs[0].stderr_text[-3000:])
    assert last.startswith('train.py: process 0: lost process 1: no heartbeat for '), last
    assert took < HEARTBEAT_S + 3, took


def _sleep_in(seconds):
    time.sleep(seconds)


def test_watchdog_dumps_stacks_while_a_step_or_a_save_hangs():
    stream = io.StringIO()
    dog = watchdog.Watchdog(straggler_factor=3, straggler_min_s=0.2, slow_save_s=0.3,
                            process_index=5, poll_s=0.02, stream=stream)
    for step in range(1, 7):  # steps of ~0.01 s: the limit is max(3 x median, 0.2 s) = 0.2 s
        dog.mark('step', step)
        time.sleep(0.01)
    dog.mark('step', 7)
    _sleep_in(0.5)
    # Dumped while step 7 still ran (the next mark has not come), once.
    text = stream.getvalue()
    assert text.count('watchdog:') == 1
    assert 'watchdog: process 5: step 7 has run 0.2' in text
    assert 'straggler_min_s=0.2' in text and 'in _sleep_in' in text
    dog.mark('other', 7)  # an evaluation: not timed
    time.sleep(0.4)
    dog.mark('save', 7)
    time.sleep(0.45)
    dog.mark('step', 8)
    dog.close()
    text = stream.getvalue()
    assert text.count('watchdog:') == 2, text
    assert ('watchdog: process 5: the checkpoint save of step 7 has run 0.3' in text
            and '(slow_save_s=0.3)' in text)


_HUNG = """
import sys, time
from t2t.infra import watchdog
dog = watchdog.Watchdog(0, 0, 0, process_index=3, poll_s=0.02, hang_timeout_s=0.5,
                        save_grace_s=float(sys.argv[1]))
for step in range(1, 4):
    dog.mark('step', step)
    time.sleep(0.05)
dog.mark(sys.argv[2], 4)
def stuck_in_a_collective():
    time.sleep(30)
stuck_in_a_collective()
"""


def test_watchdog_ends_a_stuck_step_save_or_evaluation_with_status_3():
    """Past hang_timeout_s the process ends by itself (exits.HANG), one line naming the process,
    the step and how long, then every stack; a save gets storage_outage_limit_s on top."""
    procs = {kind: start_script(
        '-c', _HUNG, grace, kind, devices=8, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for kind, grace in (
            ('step', '0'), ('save', '0.7'), ('other', '0'))}
    results = {kind: _finish(proc, timeout=30) for kind, proc in procs.items()}
    assert {kind: r[0] for kind, r in results.items()} == dict.fromkeys(procs, exits.HANG)
    heads = {}
    for kind, proc in procs.items():
        err = proc.stderr_text
        heads[kind] = err.splitlines()[0]
        assert 'in stuck_in_a_collective' in err and 'Thread 0x' in err, err
        assert err.count('watchdog:') == 1, err
    elapsed = {kind: float(h.split(' has run ')[1].split()[0]) for kind, h in heads.items()}
    assert heads['step'].startswith('watchdog: process 3: step 4 has run ')
    assert heads['step'].endswith(' s, over hang_timeout_s=0.5: stuck, exiting with status 3 '
                                  "(every thread's stack follows)")
    assert heads['save'].startswith('watchdog: process 3: the checkpoint save of step 4 has run ')
    assert 'over hang_timeout_s=0.5 + storage_outage_limit_s=0.7: stuck' in heads['save']
    assert heads['other'].startswith('watchdog: process 3: the evaluation at step 4 has run ')
    assert 0.5 <= elapsed['step'] < 1.5 and 0.5 <= elapsed['other'] < 1.5, elapsed
    assert 1.2 <= elapsed['save'] < 2.2, elapsed


def test_training_records_what_ran_and_survives_a_slow_step_and_save(tmp_path, capfd,
                                                                     monkeypatch):
    """A step and a save that sleep past their limits: both dump every stack to stderr, naming
    the step, and training finishes normally. The run's record is in WORKDIR/run-*.json."""
    real_jit, real_save, calls = train_lib.jit_train_step, checkpoint.save, []

    def slow_jit(*args, **kwargs):
        step_fn = real_jit(*args, **kwargs)

        def step(state, batch):
            calls.append(None)
            if len(calls) == 7:  # after 5 timed steps (the first compiles): the median is known
                _sleep_in(2.5)
            return step_fn(state, batch)

        return step

    def slow_save(manager, step, *args, **kwargs):
        if step == 6:
            _sleep_in(2.5)
        return real_save(manager, step, *args, **kwargs)

    monkeypatch.setattr(train_lib, 'jit_train_step', slow_jit)
    monkeypatch.setattr(checkpoint, 'save', slow_save)
    monkeypatch.setattr(watchdog, 'POLL_S', 0.05)
    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus')
    # test_train's settings: its programs are in the session's compilation cache when it ran.
    config = _run_config(corpus, num_train_steps=8, straggler_factor=2.0, straggler_min_s=0.5,
                         slow_save_s=1.0)
    workdir = tmp_path / 'run'
    result = loop.train_and_evaluate(config, str(workdir))
    assert (result.step, result.stopped_by) == (8, 'num_train_steps')
    out, err = capfd.readouterr()
    assert 'watchdog: process 0: step 7 has run' in err, err
    assert 'watchdog: process 0: the checkpoint save of step 6 has run' in err, err
    assert err.count('in _sleep_in') >= 2 and 'Thread 0x' in err

    paths = glob.glob(str(workdir / 'run-*.json'))
    assert len(paths) == 1
    record = json.loads(open(paths[0]).read())
    assert os.path.basename(paths[0]) == f'run-{record["start"]}.json'
    assert len(record['start']) == 16 and record['start'].endswith('Z')
    git = run_record.git_state(ROOT)
    if git is not None:  # the tests run from a git checkout (a source tarball has none)
        assert record['git'] == git and len(git['commit']) == 40
    for package in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 't2t'):
        assert record['versions'][package], package
    assert 'libtpu' in record['versions']
    assert record['python'] == '.'.join(map(str, sys.version_info[:3]))
    assert (record['platform'], record['device_kind']) == ('cpu', 'cpu')
    assert (record['device_count'], record['process_count']) == (8, 1)
    assert record['mesh_shape'] == {'data': 8, 'fsdp': 1, 'tensor': 1}
    assert record['config']['num_train_steps'] == 8 and record['config']['slow_save_s'] == 1.0
    assert record['config']['tsv_files']['train'] == corpus['train']
    summary = next(line for line in out.splitlines() if line.startswith('run record '))
    assert summary == run_record.summary(record, paths[0])
    assert '8 cpu devices, 1 process; mesh data 8 x fsdp 1 x tensor 1' in summary

