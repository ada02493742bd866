"""A flaky or absent bucket is weather: train.py with its workdir on the local Cloud Storage server
(tests/gcs_server.py) behind the fault-injecting front (tests/fault_front.py).

Three runs at once (most of their time is waiting on the storage), against an uninterrupted run
begun before them (once it has prepared the data and compiled, so that they read both back):
- weather: 5% of requests answered 503, 2% dropped after they took effect: the same parameters
  bit for bit, each step in metrics.jsonl once;
- an outage of 60 s begun at step 5, when metrics, events and the checkpoint of step 6 are due
  (this run saves every 6 steps): no traceback; training goes on through it (the writes and
  checkpoint 6 wait in the background) until checkpoint 12 waits for checkpoint 6; every record
  arrives once and in order, the checkpoints after the outage hold the same parameters, and a
  resume from the last one trains on to the same parameters as the uninterrupted run;
- an outage longer than storage_outage_limit_s, begun at the save of step 6: one line naming the
  checkpoint, exit 5 with no further write tried, and checkpoint 3 (the last good one) intact.
The last two retry each read and write for RETRY_S instead of workdir.RETRY_BUDGET_S's minute
(T2T_STORAGE_RETRY_S), so an outage outlasts the storage clients' retries (gcsfs's six tries
take about 31-36 s) sooner: 60 s, not the 90 s the minute needs; the limit run's exit, whose
every write fails, is shorter too.

Then, one at a time: the outage run on 2 processes beside an uninterrupted 2-process run (every
move of the retried save agreed by both); a SIGTERM in an outage (one line of what is not in
storage, exit 0, the restart redoing the rest once); and the bad settings the issue names (one
line each, exit 1, before any request to the bucket). The issue's must-show list (49), item by
item: exit 0, every step's metrics once and in order, the checkpoints after the outage readable
and bitwise equal, a resume from the last one bitwise equal, steps trained during the outage > 0
(steps 6-11 while the front is still in its outage), and the bad settings, are asserted here;
goodput with and without the outage, and the queue's peak memory, are bench/bucket_outage.py's.
"""

import json
import os
import re
import signal
import time

import pytest

from t2t.goodput import report as goodput_report
from t2t.infra import exits, metrics
from t2t.infra import workdir as wd
from tests import chaos_run, fault_front, gcs_server
from tests.helpers import start_script

pytestmark = pytest.mark.xdist_group(__name__)

STEPS = 12  # checkpoints every 3 (chaos_run.train_flags)
OUTAGE_S = 60.0
RESUMED = STEPS + 3  # the outage run resumed from its last checkpoint to here
OUTAGE_EVERY = 6  # the outage run's checkpoints: one due in the outage, the next after steps
LIMIT_S = 10.0
RETRY_S = 5.0
GRACE_S = 10.0  # the SIGTERM run's grace (T2T_PREEMPTION_GRACE_S), waited out in full in the outage


def _train(logs, workdir, data_dir, env, *extra, steps=STEPS):
    """train.py on tiny, its stdout and stderr in logs.out and logs.err."""
    with open(f'{logs}.out', 'wb') as out, open(f'{logs}.err', 'wb') as err:
        return start_script('train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
                            *chaos_run.train_flags(steps, data_dir), *extra, env=env,
                            stdout=out, stderr=err)


def _finish(proc, logs):
    """(exit status, stdout, stderr)."""
    proc.wait(timeout=900)
    with open(f'{logs}.out', 'rb') as out, open(f'{logs}.err', 'rb') as err:
        return proc.returncode, out.read().decode(errors='replace'), \
            err.read().decode(errors='replace')


def _wait_for_line(proc, logs, pattern: str, timeout_s: float) -> None:
    """Until `pattern` is a line of LOGS.out (LOGS.err is shown when proc ends first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if os.path.exists(f'{logs}.out'):
            with open(f'{logs}.out') as f:
                if re.search(pattern, f.read(), re.M):
                    return
        assert proc.poll() is None and time.monotonic() < deadline, _text(f'{logs}.err')[-3000:]
        time.sleep(0.01)


def _text(path) -> str:
    with open(path, 'rb') as f:
        return f.read().decode(errors='replace')


def _steps_once(workdir, steps=STEPS) -> None:
    """Each step's training record once, in order, in metrics.jsonl and the events."""
    assert chaos_run.step_counts(workdir) == dict.fromkeys(range(1, steps + 1), 1)
    text = wd.read_text(wd.path(workdir, metrics.JSONL_NAME))
    in_order = [r['step'] for r in map(json.loads, text.splitlines()) if 'loss' in r]
    assert in_order == list(range(1, steps + 1)), in_order
    losses = [s for tag, s, _ in metrics.read_events(workdir) if tag == 'loss']
    assert sorted(losses) == list(range(1, steps + 1)), losses


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """The prepared data every run of the module shares (the first run prepares it)."""
    return str(tmp_path_factory.mktemp('bucket-faults') / 'data')


def test_faults_an_outage_and_one_past_the_limit(tmp_path, data_dir):
    with gcs_server.serve() as url:
        # Prepares the data and compiles first; keeps every checkpoint to compare with, and trains
        # on to where the outage run is resumed to.
        reference = _train(tmp_path / 'reference', tmp_path / 'reference', data_dir,
                           gcs_server.environment(url), '--config.keep_checkpoints=10',
                           steps=RESUMED)
        _wait_for_line(reference, tmp_path / 'reference', r'^step 1 \|', 300)
        fronts = {'weather': fault_front.start(url, seed=1, p_503=0.05, p_drop=0.02),
                  'outage': fault_front.start(url, seed=2, p_503=0.0, p_drop=0.0),
                  'limit': fault_front.start(url, seed=3, p_503=0.0, p_drop=0.0)}
        workdirs = {name: gcs_server.make_bucket(url, name) + '/run' for name in fronts}
        fronts['limit'].outage(600, when=r'/checkpoints/6')
        try:
            retry = {'T2T_STORAGE_RETRY_S': f'{RETRY_S:g}'}
            runs = {name: _train(tmp_path / name, workdirs[name], data_dir,
                                 {**gcs_server.environment(front.url),
                                  **(retry if name != 'weather' else {})},
                                 *([f'--config.storage_outage_limit_s={LIMIT_S}']
                                   if name == 'limit' else []),
                                 *([f'--config.checkpoint_every_steps={OUTAGE_EVERY}']
                                   if name == 'outage' else []))
                    for name, front in fronts.items()}
            _wait_for_line(runs['outage'], tmp_path / 'outage', r'^step 5 \|', 300)
            fronts['outage'].outage(OUTAGE_S)
            began = time.monotonic()
            # The loop does not wait for the bucket: steps 6-11 are trained during the outage
            # (checkpoint 12 then waits for checkpoint 6, which waits for the bucket).
            _wait_for_line(runs['outage'], tmp_path / 'outage', r'^step 11 \|', OUTAGE_S)
            trained_within = time.monotonic() - began
            assert fronts['outage'].in_outage(), trained_within
            status, _, err = _finish(reference, tmp_path / 'reference')
            assert status == 0, err[-3000:]
            results = {}
            for name, proc in runs.items():
                results[name] = (*_finish(proc, tmp_path / name), time.monotonic() - began)
            limit_end = fronts['limit'].outages
            fronts['limit'].end_outage()
            print('bucket faults: ' + '; '.join(  # pytest -rP shows it
                f'{name}: exit {r[0]} {r[3]:.0f} s after the outage began, front '
                f'{fronts[name].counts}' for name, r in results.items()))

            # Weather: requests refused and lost on the way, and nothing else changes.
            status, out, err, _ = results['weather']
            assert status == 0 and 'Traceback' not in err, err[-3000:]
            counts = fronts['weather'].counts
            assert counts['503'] > 10 and counts['dropped'] > 3, counts
            assert chaos_run.params_differ(str(tmp_path / 'reference'),
                                           workdirs['weather'], STEPS) == []
            _steps_once(workdirs['weather'])

            # The outage: said in a line when it begins and when it ends, ridden out.
            status, out, err, took = results['outage']
            assert status == 0 and 'Traceback' not in err, err[-3000:]
            assert took > OUTAGE_S and fronts['outage'].counts['outage_503'] > 5
            # A save the outage failed leaves no orbax thread waiting out its five-minute
            # coordination timeout (t2t/run/checkpoint.py): the process ends with its run.
            assert took < OUTAGE_S + 150, took
            failed = re.search(r'^metrics: writing \S+ failed \((\w+): .*training goes on$',
                               err, re.M)
            assert failed and failed.group(1) == 'HttpError', err[-3000:]
            assert re.search(r'^metrics: writing works again after \d+ s; every record kept is '
                             r'written$', err, re.M), err[-3000:]
            assert re.search(r'^saving checkpoint 6 .*; it is saved in the background for up to '
                             r'\d+ s \(storage_outage_limit_s\), training goes on$', out, re.M), out
            assert re.search(r'^checkpoint 6 saved after \d+ s of storage failures$', out, re.M)
            assert re.search(r'^checkpoint 12 is due while checkpoint 6 is still being saved',
                             out, re.M), out
            _steps_once(workdirs['outage'])
            # The checkpoints written after the outage hold the uninterrupted run's parameters.
            for step in (OUTAGE_EVERY, STEPS):
                assert chaos_run.params_differ(str(tmp_path / 'reference'), workdirs['outage'],
                                               step) == [], step
            # The metrics writes the outage held are no training and no straggling step.
            assert 'watchdog:' not in err, err[-3000:]
            # Its account is whole (the last records are waited for, t2t/goodput/ledger.py), the
            # loop hardly waited for the metrics, and their writes are booked as background.
            ledger = goodput_report.report(workdirs['outage'])
            assert [a['cause'] for a in ledger['per_attempt']] == ['finished'], ledger
            assert ledger['seconds']['logging'] < 2.0, ledger['seconds']
            assert ledger['seconds']['storage_backpressure'] == 0.0, ledger['seconds']
            assert ledger['background_writes']['written_bytes'] > 10_000, ledger
            assert ledger['per_attempt'][0]['findings'] == []
            # Resumed from its last checkpoint, it trains on as the uninterrupted run did.
            resumed = _train(tmp_path / 'resumed', workdirs['outage'], data_dir,
                             gcs_server.environment(url), steps=RESUMED)
            status, out, err = _finish(resumed, tmp_path / 'resumed')
            assert status == 0, err[-3000:]
            assert re.search(rf'^resuming from checkpoint {STEPS} in ', out, re.M), out
            assert chaos_run.params_differ(str(tmp_path / 'reference'), workdirs['outage'],
                                           RESUMED) == []
            _steps_once(workdirs['outage'], RESUMED)

            # Past the limit: one line, exit 5, the last good checkpoint restores.
            status, out, err, _ = results['limit']
            assert status == exits.STORAGE and 'Traceback' not in err, err[-3000:]
            last = err.strip().splitlines()[-1]
            # Checkpoint 6's save retried in the background, or the metrics written beside it.
            assert re.fullmatch(
                rf'train\.py: storage: (saving checkpoint {workdirs["limit"]}/checkpoints/6|'
                rf'writing {workdirs["limit"]}/\S+) failed for \d+ s \(storage_outage_limit_s='
                rf'{LIMIT_S:g}\): HttpError: .+; the last checkpoint saved is step 3', last), last
            # Begun by the first request about checkpoint 6: its write, or orbax's listing first.
            assert len(limit_end) == 1 and re.search(r'\brun/checkpoints/6\b',
                                                     limit_end[0][2]), limit_end
            assert chaos_run.params_differ(str(tmp_path / 'reference'),
                                           workdirs['limit'], 3) == []
        finally:
            for front in fronts.values():
                front.stop()


PROCESSES, DEVICES = 2, 2  # as the chaos run: collectives within a process and across the two


def test_two_processes_agree_on_a_save_retried_through_an_outage(tmp_path, data_dir):
    """The outage run on 2 processes (scripts/launch_local.py, 2 CPU devices each): checkpoint 6
    is due in the outage and retried in the background, every move agreed by both processes,
    while both train on (steps 6-11 in the outage); checkpoint 12 waits for it; exit 0, each
    step's record once and in order, checkpoints 6 and 12 bitwise equal to an uninterrupted
    2-process run's (begun first, beside it)."""
    every = [f'--config.checkpoint_every_steps={OUTAGE_EVERY}']
    with gcs_server.serve() as url, \
            chaos_run.launch(str(tmp_path / 'reference'), str(tmp_path / 'reference-logs'), STEPS,
                             data_dir, *every, processes=PROCESSES,
                             devices=DEVICES) as reference:
        front = fault_front.start(url, seed=4)
        workdir = gcs_server.make_bucket(url, 'two') + '/run'
        logs, process_0 = tmp_path / 'logs', tmp_path / 'logs' / 'attempt-0-process-0'
        try:
            _wait_for_line(reference, tmp_path / 'reference-logs' / 'attempt-0-process-0',
                           r'^step 1 \|', 300)
            # Past the launcher's hang guard: checkpoint 12 waits silently for the outage's end.
            with chaos_run.launch(workdir, str(logs), STEPS, data_dir, *every,
                                  processes=PROCESSES, devices=DEVICES, hang_timeout_s=300,
                                  env={**os.environ, **gcs_server.environment(front.url),
                                       'T2T_STORAGE_RETRY_S': f'{RETRY_S:g}'}) as run:
                _wait_for_line(run, process_0, r'^step 5 \|', 300)
                front.outage(OUTAGE_S)
                _wait_for_line(run, process_0, r'^step 11 \|', OUTAGE_S)
                assert front.in_outage()  # trained through the outage: the loop did not wait
                assert run.wait(timeout=600) == 0, _text(logs / 'launcher.err')[-3000:]
            assert reference.wait(timeout=600) == 0
        finally:
            front.stop()
        print(f'two processes: front {front.counts}')  # pytest -rP shows it
        out = _text(f'{process_0}.out')
        for i in range(PROCESSES):
            err = _text(logs / f'attempt-0-process-{i}.err')
            assert 'Traceback' not in err and 'watchdog:' not in err, err[-3000:]
        assert front.counts['outage_503'] > 5, front.counts
        assert re.search(r'^saving checkpoint 6 .*; it is saved in the background for up to '
                         r'\d+ s \(storage_outage_limit_s\), training goes on$', out, re.M), out
        assert re.search(r'^checkpoint 12 is due while checkpoint 6 is still being saved', out,
                         re.M), out
        assert re.search(r'^checkpoint 6 saved after \d+ s of storage failures$', out, re.M), out
        _steps_once(workdir)
        for step in (OUTAGE_EVERY, STEPS):
            assert chaos_run.params_differ(str(tmp_path / 'reference'), workdir, step) == [], step


def test_a_sigterm_in_an_outage_says_what_is_not_in_storage_and_a_restart_redoes_it_once(
        tmp_path, data_dir):
    """A run's bucket goes down at checkpoint 6's first request; at step 8 or later, with that
    save pending and the records since held, a SIGTERM: the run waits its preemption grace for
    them (GRACE_S through T2T_PREEMPTION_GRACE_S: a shorter wait, the same path), says in one
    line what is not in storage (both checkpoints, the metric records and their bytes) and the
    last checkpoint that is (3), and exits 0 without a traceback.
    Restarted once the bucket is back, it resumes from checkpoint 3 and ends with each step's
    record once and in order: the records after checkpoint 3 that reached the bucket before the
    outage are removed and written again by the resumed run, the held ones were never written."""
    with gcs_server.serve() as url:
        front = fault_front.start(url, seed=5)
        workdir = gcs_server.make_bucket(url, 'sigterm') + '/run'
        front.outage(600, when=r'/checkpoints/6')
        try:
            run = _train(tmp_path / 'run', workdir, data_dir,
                         {**gcs_server.environment(front.url),
                          'T2T_STORAGE_RETRY_S': f'{RETRY_S:g}',
                          'T2T_PREEMPTION_GRACE_S': f'{GRACE_S:g}'})
            _wait_for_line(run, tmp_path / 'run', r'^step 8 \|', 300)
            assert front.in_outage()
            run.send_signal(signal.SIGTERM)
            began = time.monotonic()
            status, out, err = _finish(run, tmp_path / 'run')
            took = time.monotonic() - began
        finally:
            front.stop()
        print(f'sigterm: exit {status} {took:.0f} s after the signal; front {front.counts}')
        assert status == 0 and 'Traceback' not in err, err[-3000:]
        said = [line for line in (out + err).splitlines() if 'not yet in storage' in line]
        assert len(said) == 1, (said, err[-3000:])
        match = re.fullmatch(r'not yet in storage after (\d+) s: checkpoint 6, checkpoint (\d+), '
                             r'(\d+) metric records in \d+ bytes \(events\.out\.tfevents\.\S+, '
                             r'metrics\.jsonl\), redone from the checkpoint(, \d+ bytes of the '
                             r'goodput ledger)?; the last checkpoint in storage is step 3', said[0])
        assert match, said
        waited, stopped, held = map(int, match.group(1, 2, 3))
        assert abs(waited - GRACE_S) <= 2, said  # the grace, spent waiting
        assert stopped >= 8 and held >= stopped - 6, said  # steps 7.. at least
        assert re.search(rf'^finished at step {stopped} \(preemption\)', out, re.M), out
        assert re.search(r'^goodput: no report \(HttpError: .*: the workdir\'s storage is failing',
                         out, re.M), out  # not read: its retries would outlast a preemption
        # The grace, the ledger's WRITE_WAIT_S and the exit: no storage retries waited out.
        assert took < GRACE_S + 20, took
        resumed = _train(tmp_path / 'resumed', workdir, data_dir, gcs_server.environment(url))
        status, out, err = _finish(resumed, tmp_path / 'resumed')
        assert status == 0, err[-3000:]
        assert re.search(r'^resuming from checkpoint 3 in ', out, re.M), out
        _steps_once(workdir)


BAD_SETTINGS = {  # the must-show: each a one-line error (t2t/run/config_checks.py)
    'storage_queue_mb=0': 'storage_queue_mb=0.0 must be > 0',
    'storage_queue_mb=-1': 'storage_queue_mb=-1.0 must be > 0',
    f'storage_outage_limit_s={RETRY_S:g}': f'storage_outage_limit_s={RETRY_S} must be 0 (not '
                                          'retried) or >= 8 s, the longest wait between two tries',
}


def test_bad_storage_settings_are_one_line_before_the_bucket_is_touched(tmp_path, data_dir):
    """A write queue of no bytes, or an outage limit below the longest wait between two tries:
    train.py says so in one line and exits 1, no request sent to the bucket."""
    with gcs_server.serve() as url:
        front = fault_front.start(url, seed=6)
        workdir = gcs_server.make_bucket(url, 'bad') + '/run'
        try:
            runs = {setting: _train(tmp_path / str(k), workdir, data_dir,
                                    gcs_server.environment(front.url), f'--config.{setting}')
                    for k, setting in enumerate(BAD_SETTINGS)}
            results = {setting: _finish(proc, tmp_path / str(k))
                       for k, (setting, proc) in enumerate(runs.items())}
        finally:
            front.stop()
        for setting, (status, _, err) in results.items():
            assert status == 1, (setting, err[-3000:])
            assert len(err.strip().splitlines()) == 1, (setting, err)
            assert err.startswith(f'train.py: {BAD_SETTINGS[setting]}'), (setting, err)
        assert front.counts['requests'] == 0, front.counts
