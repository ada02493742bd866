"""The goodput ledger and its report, profiles of chosen steps, the persistent compilation cache.

The kill test trains tiny in subprocesses that kill or preempt themselves at exact steps
(tests/kill_driver.py) and checks `python -m t2t.goodput` against what the kills imply: the
attempts, the steps trained twice, a wall time that the components add up to, and a restart's
compile served by the executables the first attempt stored.
"""

import collections
import errno
import glob
import io
import json
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from t2t import goodput
from t2t.goodput import report as goodput_report
from t2t.infra import metrics, watchdog
from t2t.run import compile_cache, profiling, run_record
from t2t.train import loop
from tests import toy_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A log and a checkpoint every 3 steps: a kill in the save of step s loses s - 3 .. s.
SETTINGS = dict(num_train_steps=12, log_every_steps=3, checkpoint_every_steps=3,
                eval_every_steps=6, keep_checkpoints=5, eval_bleu_sentences=0,
                num_eval_batches=2, max_len=32, eval_batch_size=8, store_executables=True)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


def _write_attempt(directory, name, records):
    (directory / name).write_text(''.join(json.dumps(r) + '\n' for r in records))


def test_report_splits_the_wall_time_and_finds_the_steps_trained_again(tmp_path):
    d = tmp_path / goodput.DIRNAME
    d.mkdir()
    # Attempt 1: trains 0 -> 8 and is killed (no end record) after a watchdog finding; attempt 2
    # resumes from checkpoint 6, so steps 7 and 8 were trained twice: half of the slice (4, 8].
    _write_attempt(d, 'attempt-A-p0.jsonl', [
        {'at': 'start', 't': 1000.0},
        {'at': 'ready', 't': 1010.0, 'step': 0,
         'seconds': {'startup': 5, 'setup': 3, 'data': 1, 'restore': 1}},
        {'at': 'log', 't': 1014.0, 'step': 4, 'seconds': {'compile': 2, 'train': 2},
         'step_times': {str(goodput.bucket(0.5)): 3}, 'max_step_s': 0.5},
        {'at': 'log', 't': 1018.0, 'step': 8, 'seconds': {'train': 4},
         'step_times': {str(goodput.bucket(1.0)): 4}, 'max_step_s': 1.0},
        {'at': 'finding', 't': 1018.5, 'kind': 'step', 'step': 9, 'elapsed_s': 9.0,
         'limit_s': 5.0}])
    _write_attempt(d, 'attempt-B-p0.jsonl', [
        {'at': 'start', 't': 1020.0},
        {'at': 'ready', 't': 1025.0, 'step': 6, 'seconds': {'startup': 3, 'setup': 1,
                                                            'restore': 1}},
        {'at': 'log', 't': 1029.0, 'step': 10, 'seconds': {'train': 3, 'data_wait': 1}},
        {'at': 'end', 't': 1030.0, 'step': 10, 'seconds': {'checkpoint': 1},
         'cause': 'finished'}])
    _write_attempt(d, 'attempt-C-p1.jsonl', [{'at': 'start', 't': 0.0}])  # another process

    r = goodput_report.report(tmp_path)
    assert (r['attempts'], r['restarts'], r['wall_s'], r['steps']) == (2, 1, 30.0, [0, 10])
    assert r['seconds'] == {'productive': 7.0, 'initialization': 13.0, 'compile': 2.0,
                            'restore': 2.0, 'checkpoint': 1.0, 'evaluation': 0.0,
                            'data_wait': 1.0, 'profiling': 0.0, 'logging': 0.0,
                            'storage_backpressure': 0.0, 'lost_progress': 2.0, 'idle': 2.0}
    assert r['unaccounted_s'] == 0.0 and r['goodput'] == 7.0 / 30.0 and r['lost_steps'] == 2
    first, second = r['per_attempt']
    assert first['cause'] == 'killed after a watchdog finding (step)'
    assert (first['steps'], first['lost_steps'], first['wall_s']) == ([0, 8], 2, 18.0)
    assert first['findings'][0]['step'] == 9
    times = first['step_times']
    assert times['steps'] == 7 and times['max_s'] == 1.0
    assert times['median_s'] == pytest.approx(1.0, rel=0.02)
    assert times['p90_s'] == pytest.approx(1.0, rel=0.02)
    assert (second['cause'], second['lost_steps'], second['goodput']) == ('finished', 0, 0.3)
    text = goodput_report.format_report(r)
    assert 'goodput of' in text and '23.3% of 30.0 s' in text
    assert '(2 steps trained again)' in text.splitlines()[12]
    assert goodput_report.report(tmp_path, process_index=1)['attempts'] == 1


def _run_steps(ledger, dog, body, n: int = 8) -> None:
    """The loop's calls around n steps (body(i): step i + 1's work), then the attempt's end."""
    for i in range(n):
        ledger.next_step()
        dog.mark('step', i + 1)
        ledger.mark('train')
        body(i)
    ledger.next_step()
    dog.close()
    ledger.flush('log')
    ledger.end('num_train_steps')


def test_the_recorder_partitions_time_and_keeps_the_watchdogs_findings(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput.ledger, '_first_attempt_of_process', False)  # starts now
    ledger = goodput.Ledger(tmp_path)
    ledger.mark('restore')
    time.sleep(0.05)
    ledger.mark('setup')
    ledger.begin(0)
    dog = watchdog.Watchdog(straggler_factor=3, straggler_min_s=0.2, slow_save_s=0, poll_s=0.02,
                            stream=io.StringIO(), on_finding=ledger.finding)
    calls = []

    def train_step():  # its first call compiles
        time.sleep(0 if calls else 0.1)
        calls.append(1)

    step = ledger.compiling(train_step)

    def body(i):
        step()
        time.sleep(0.6 if i == 6 else 0.01)  # step 7 straggles

    _run_steps(ledger, dog, body)

    r = goodput_report.report(tmp_path)
    (a,) = r['per_attempt']
    assert a['cause'] == 'finished' and a['steps'] == [0, 9]
    assert abs(sum(r['seconds'].values()) - r['wall_s']) <= 0.01 * r['wall_s']
    assert r['seconds']['restore'] == pytest.approx(0.05, abs=0.03)
    assert r['seconds']['compile'] == pytest.approx(0.1, abs=0.05)  # the first call only
    assert [(f['kind'], f['step']) for f in a['findings']] == [('step', 7)]
    # Step 1 (compiled) is no step time; steps 2-8 are, 7 the slowest.
    assert a['step_times']['steps'] == 7
    assert a['step_times']['max_s'] == pytest.approx(0.61, abs=0.1)
    assert a['step_times']['median_s'] == pytest.approx(0.01, abs=0.01)


def test_an_attempts_last_records_wait_for_the_storage_as_long_as_its_run_did(tmp_path,
                                                                               monkeypatch):
    """A run that ended well waits for its ledger as long as for its other writes (the records
    of an outage it rode out may be held in the storage client's back-off); one that ended on its
    storage, or on a SIGTERM (whose grace went to its checkpoint and metrics), waits a moment; one
    that ended on another error, the storage layer's retries."""
    monkeypatch.setattr(goodput.ledger, '_first_attempt_of_process', False)
    monkeypatch.setattr(goodput.ledger.wd, 'RETRY_BUDGET_S', 5.0)
    ledger = goodput.Ledger(tmp_path, outage_limit_s=1800.0)
    for outcome in ('num_train_steps', 'rollback'):
        assert ledger.close_wait_s(outcome) == 1800.0
    assert ledger.close_wait_s('preemption') == goodput.ledger.WRITE_WAIT_S
    unavailable = OSError(errno.EIO, 'HTTP 503')
    wrapped = ValueError('orbax: the save failed')
    wrapped.__cause__ = TimeoutError('read timed out')
    assert ledger.close_wait_s(unavailable) == ledger.close_wait_s(wrapped) \
        == goodput.ledger.WRITE_WAIT_S
    assert ledger.close_wait_s(KeyError('step')) == 5.0
    assert goodput.Ledger(tmp_path).close_wait_s('num_train_steps') == 5.0  # no limit given


def test_a_metrics_write_held_by_the_storage_is_logging_not_training_nor_a_straggler(
        tmp_path, monkeypatch):
    # The loop's metrics writes, as train_and_evaluate wraps them: one held 0.8 s (a bucket
    # outage) inside step 7 of steps of 0.01 s.
    monkeypatch.setattr(goodput.ledger, '_first_attempt_of_process', False)
    ledger = goodput.Ledger(tmp_path)
    ledger.begin(0)
    out = io.StringIO()
    dog = watchdog.Watchdog(straggler_factor=3, straggler_min_s=0.2, slow_save_s=0, poll_s=0.02,
                            stream=out, on_finding=ledger.finding)
    write = dog.paused(ledger.timed('logging', slice_after=False)(lambda: time.sleep(0.8)))

    def body(i):
        time.sleep(0.01)
        if i == 6:
            write()

    _run_steps(ledger, dog, body)

    r = goodput_report.report(tmp_path)
    (a,) = r['per_attempt']
    assert r['seconds']['logging'] == pytest.approx(0.8, abs=0.1)
    assert r['seconds']['productive'] < 0.3
    assert a['findings'] == [] and out.getvalue() == ''  # no straggler, no stacks
    assert a['step_times']['steps'] == 7 and a['step_times']['max_s'] < 0.2  # step 7 not one


def test_the_start_record_before_jax_counts_every_attempt_the_launcher_started(tmp_path,
                                                                              monkeypatch):
    # train.py writes the start record first (launch attempt 2 of launch L); the process's
    # Ledger continues that file. Attempt 1 of L was killed before it could write anything.
    monkeypatch.setattr(goodput.ledger, '_first_attempt_of_process', True)
    monkeypatch.setenv(goodput.ledger.LAUNCH_ENV, 'L:2')
    goodput.open_attempt(tmp_path, 0, 2)
    (early,) = glob.glob(str(tmp_path / goodput.DIRNAME / '*-p0.jsonl'))
    start = json.loads(open(early).read())
    assert start['at'] == 'start' and start['attempt'] == {'launch': 'L', 'number': 2}
    goodput.note_startup('distributed_init', time.perf_counter() - 0.25)
    ledger = goodput.Ledger(tmp_path, 0, 2)
    ledger.begin(0)
    ledger.end('num_train_steps')
    assert glob.glob(str(tmp_path / goodput.DIRNAME / '*.jsonl')) == [early]
    records = [json.loads(x) for x in open(early).read().splitlines()]
    assert [x['at'] for x in records] == ['start', 'ledger', 'ready', 'end']
    assert ledger.start == pytest.approx(start['t'], abs=1e-3)
    assert records[1]['seconds']['startup'] > 0
    _write_attempt(tmp_path / goodput.DIRNAME, 'attempt-0-p0.jsonl', [  # launch attempt 0
        {'at': 'start', 't': start['t'] - 60, 'attempt': {'launch': 'L', 'number': 0}},
        {'at': 'ledger', 't': start['t'] - 50, 'seconds': {'startup': 10}}])
    r = goodput_report.report(tmp_path)
    assert (r['attempts'], r['restarts'], r['unrecorded_attempts']) == (3, 2, ['L:1'])
    assert r['per_attempt'][1]['startup']['distributed_init'] == pytest.approx(0.25, abs=0.05)
    assert abs(sum(r['seconds'].values()) - r['wall_s']) <= 1e-3
    assert '(1 attempt ended before writing a record' in goodput_report.format_report(r)
    monkeypatch.setattr(goodput.ledger, '_first_attempt_of_process', True)
    goodput.open_attempt(tmp_path / 'other', 1, 2)  # another process writes only when asked
    assert not (tmp_path / 'other').exists()


def test_profile_windows():
    assert profiling.next_window(0, 3, 0, 1) is None
    assert profiling.next_window(5, 3, 0, 1) == (5, 8)
    assert profiling.next_window(5, 3, 0, 6) == (5, 8)  # a resume inside the window
    assert profiling.next_window(5, 3, 0, 8) is None
    assert profiling.next_window(5, 3, 10, 8) == (15, 18)
    assert profiling.next_window(5, 3, 10, 17) == (15, 18)
    assert profiling.next_window(5, 3, 3, 8) == (8, 11)  # back to back


def test_compilation_cache_default_keeps_the_environments_and_a_key_overrides_it(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    config = toy_corpus.tiny_config({'root': tmp_path, 'train': '', 'validation': '',
                                     'test': ''})
    try:
        assert os.environ.get('JAX_COMPILATION_CACHE_DIR')  # tests/conftest.py's
        assert compile_cache.setup(config) == os.environ['JAX_COMPILATION_CACHE_DIR']
        config.compilation_cache_dir = str(tmp_path / 'cache')
        assert compile_cache.setup(config) == str(tmp_path / 'cache')
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'cache')
        assert os.path.isdir(tmp_path / 'cache')
    finally:
        jax.config.update('jax_compilation_cache_dir', before)


def test_a_stored_executable_serves_the_same_program_only(tmp_path, monkeypatch, caplog):
    jax.config.update('jax_compilation_cache_dir', str(tmp_path / 'cache'))
    config = toy_corpus.tiny_config({'root': tmp_path, 'train': '', 'validation': '',
                                     'test': ''})
    config.store_executables = True
    events = []

    def listen(event, seconds, **_):
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    x = jax.numpy.arange(6.0)
    try:
        fn = jax.jit(lambda v: v * 2 + 1)
        assert compile_cache.stored(fn, config, 'f')(x).tolist() == [1, 3, 5, 7, 9, 11]
        (path,) = (tmp_path / 'cache' / compile_cache.EXECUTABLES).iterdir()
        assert compile_cache.STORE_EVENT in events
        events.clear()
        again = compile_cache.stored(jax.jit(lambda v: v * 2 + 1), config, 'f')  # a restart
        assert again(x).tolist() == [1, 3, 5, 7, 9, 11] and again(x[:2]).tolist() == [1, 3]
        first = events.index(compile_cache.LOAD_EVENT)
        assert '/jax/core/compile/jaxpr_trace_duration' not in events[:first + 1]  # not traced
        # Anything that makes another program makes another key.
        key = compile_cache.program_key(config, 'f', (x,))
        assert key == path.name.removeprefix('f-')
        assert compile_cache.program_key(config, 'f', (x[:2],)) != key
        assert compile_cache.program_key(config, 'g', (x,)) != key
        other = toy_corpus.tiny_config({'root': tmp_path, 'train': '', 'validation': '',
                                        'test': ''}, label_smoothing=0.2)
        assert compile_cache.program_key(other, 'f', (x,)) != key
        monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_foo')
        assert compile_cache.program_key(config, 'f', (x,)) != key
        monkeypatch.undo()
        with jax.default_matmul_precision('highest'):
            assert compile_cache.program_key(config, 'f', (x,)) != key
        (tmp_path / 'src').mkdir()
        (tmp_path / 'src' / 'm.py').write_text('A = 1\n')
        digest = compile_cache.sources_digest(str(tmp_path / 'src'))
        (tmp_path / 'src' / 'm.py').write_text('A = 2\n')
        assert compile_cache.sources_digest(str(tmp_path / 'src')) != digest
        # A torn file is compiled over, with a warning (and not stored again from fn's
        # executable, which jax's in-memory cache now serves: tests/test_compile_cache.py).
        path.write_bytes(path.read_bytes()[:100])
        assert compile_cache.stored(fn, config, 'f')(x).tolist() == [1, 3, 5, 7, 9, 11]
        assert 'unusable (ValueError: torn' in caplog.text
        # An executable that jax's own cache served is not stored (it would not run).
        path.unlink()
        jax.clear_caches()
        assert compile_cache.stored(jax.jit(lambda v: v * 2 + 1), config, 'f')(x)[1] == 3
        assert not path.exists()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])


def _outermost(events):
    """Events not inside another of the same name (jax's dispatch nests one in another)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: e.start_ns):
        if e.start_ns >= end:
            out.append(e)
            end = e.end_ns
    return out


def test_a_profile_of_three_steps_holds_their_xla_ops_and_no_other_step(corpus, tmp_path):
    config = toy_corpus.tiny_config(corpus, **{**SETTINGS, 'num_train_steps': 8,
                                               'profile_start_step': 3})
    workdir = tmp_path / 'run'
    assert loop.train_and_evaluate(config, str(workdir)).step == 8
    (trace,) = glob.glob(str(workdir / 'profiles/plugins/profile/*/*.xplane.pb'))
    events = collections.defaultdict(list)
    for plane in jax.profiler.ProfileData.from_file(trace).planes:
        for line in plane.lines:
            for e in line.events:
                events[e.name].append(e)
    # The train step's executable ran in steps 3, 4, 5 only (jitted or stored: the same name).
    assert len(_outermost(events['CommonPjRtLoadedExecutable::Execute (jit_train_step)'])) == 3
    ops = [n for n in events if 'fusion' in n]  # XLA's fused ops, run by the CPU's thunks
    assert len(ops) > 10 and events['ThunkExecutor::Execute']
    r = goodput_report.report(workdir)
    assert r['seconds']['profiling'] > 0 and r['per_attempt'][-1]['cause'] == 'finished'


def _drive(corpus, workdir, action, at, overrides):
    spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
            'overrides': overrides, 'workdir': str(workdir), 'action': action, 'at': at}
    # XLA's default optimization (not the tests' level 0): the compile a cache saves, as users
    # compile; one CPU device.
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    return subprocess.run([sys.executable, '-m', 'tests.kill_driver', json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, 'JAX_PLATFORMS': 'cpu'})


def test_kills_and_resumes_report_lost_steps_restarts_and_cached_compiles(corpus, tmp_path):
    workdir = tmp_path / 'run'
    overrides = {**SETTINGS, 'compilation_cache_dir': str(tmp_path / 'jax-cache')}  # cold
    began = time.time()
    # Killed while saving 6 (checkpoint 3 stands) and 9 (6 stands); preempted as the final
    # evaluation of step 12 starts (12 saved, its evaluation pending); the last one evaluates.
    for action, at, status in (('kill_in_save', 6, -signal.SIGKILL),
                               ('kill_in_save', 9, -signal.SIGKILL),
                               ('sigterm_in_eval', 1, 0), ('none', 0, 0)):
        proc = _drive(corpus, workdir, action, at, overrides)
        assert proc.returncode == status, proc.stderr[-2000:]
    ended = time.time()
    assert run_record.read_finished(workdir)['step'] == 12

    proc = subprocess.run([sys.executable, '-m', 't2t.goodput', str(workdir), '--json'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    attempts = r['per_attempt']
    assert (r['attempts'], r['restarts']) == (4, 3)
    assert [a['cause'] for a in attempts] == ['killed', 'killed', 'preempted', 'finished']
    assert [a['steps'] for a in attempts] == [[0, 6], [3, 9], [6, 12], [12, 12]]
    # Trained twice: 4-6 (killed at 6, resumed from 3) and 7-9 (killed at 9, resumed from 6).
    assert r['lost_steps'] == (6 - 3) + (9 - 6)
    assert [a['lost_steps'] for a in attempts] == [3, 3, 0, 0]
    # Their time: each killed attempt's log slice of exactly those steps.
    for a, (lost_from, lost_to) in zip(attempts, ((3, 6), (6, 9)), strict=False):
        records = [json.loads(x) for x in
                   (workdir / goodput.DIRNAME / a['file']).read_text().splitlines()]
        logged = [x for x in records if x['at'] == 'log']
        assert [x['step'] for x in logged][-2:] == [lost_from, lost_to]
        assert a['seconds']['lost_progress'] == pytest.approx(logged[-1]['seconds']['train'])
    assert r['seconds']['lost_progress'] > 0
    total = sum(r['seconds'].values())
    assert abs(total - r['wall_s']) <= 0.01 * r['wall_s'], (total, r['wall_s'])
    # From the first process's start to the last record: within what the test saw (less the
    # last process's exit) and the clock's rounding.
    assert ended - began - 10 <= r['wall_s'] <= ended - began + 0.5
    # A restart loads the executables the first attempt stored: nothing traced, lowered or
    # compiled, the whole phase well under the first attempt's (about a tenth on a quiet machine,
    # near a quarter beside the suite's multi-process tests; the ratio is bench/RESULTS.md's).
    first, restart = (a['compile_stages'] for a in attempts[:2])
    assert first['xla'] > 0 and first['store'] > 0 and first['load'] == 0, first
    assert restart['load'] > 0 and restart['trace'] == restart['xla'] == 0, restart
    for a in attempts[:3]:
        assert sum(a['compile_stages'].values()) <= a['seconds']['compile']
    assert attempts[1]['seconds']['compile'] <= 0.5 * attempts[0]['seconds']['compile'], \
        [a['seconds']['compile'] for a in attempts]
    # The same totals as TensorBoard scalars, at the last step.
    scalars = {(tag, step): v for tag, step, v in
               metrics.read_events(workdir / goodput.DIRNAME)}
    assert scalars[('goodput', 12)] == pytest.approx(r['goodput'], rel=1e-6)
    assert scalars[('goodput/lost_steps', 12)] == 6
    text = goodput_report.format_report(goodput_report.report(workdir))
    assert '4 attempts (3 restarts), steps 0 -> 12' in text
    assert '(6 steps trained again)' in text
