"""gs:// workdirs against a real Cloud Storage API on localhost (tests/gcs_server.py).

In-process: the workdir I/O layer, the metric writer (resume truncation included) and the
writability probe. The pod scenario (2 processes x 4 CPU devices, train.py with
--workdir=gs://..., SIGKILL, resume, evaluate.py --watch / --average_last on 2 processes)
is in test_multiprocess.py.
"""

import errno
import os
import time

import pytest

from t2t.infra import exits, metrics, uploads
from t2t.infra import workdir as wd
from t2t.run import cli, startup
from tests import fault_front, gcs_server


@pytest.fixture(scope='module')
def bucket():
    with gcs_server.serve() as url:
        yield gcs_server.make_bucket(url, 'unit')


def test_atomic_writes_reads_and_globs_in_a_bucket(bucket):
    run = wd.path(bucket, 'run')
    assert str(run) == f'{bucket}/run'  # a URL stays a URL (no local 'gs:' directory)
    wd.write_atomic(run / 'a.json', '{"x": 1}')
    wd.write_atomic(run / 'b.bin', b'\x00\x01')
    assert wd.read_text(run / 'a.json') == '{"x": 1}'
    assert wd.read_bytes(run / 'b.bin') == b'\x00\x01'
    assert wd.read_text(run / 'missing') is None
    assert [p.name for p in wd.glob(run, '*.json')] == ['a.json']
    assert wd.remove(run / 'a.json') and not wd.remove(run / 'a.json')
    wd.copy(run / 'b.bin', run / 'sub' / 'c.bin')
    assert wd.read_bytes(run / 'sub' / 'c.bin') == b'\x00\x01'
    assert not os.path.exists('gs:')


def test_appender_grows_a_bucket_object_line_by_line(bucket):
    target = wd.path(bucket, 'appender', 'lines.txt')
    first = wd.Appender(target)
    first.append('one\n')
    first.append('two\n')
    first.close()
    assert wd.read_text(target) == 'one\ntwo\n'
    second = wd.Appender(target)  # a resumed run keeps what is there
    second.append('three\n')
    assert wd.read_text(target) == 'one\ntwo\nthree\n'


def test_metric_writer_in_a_bucket_truncates_on_resume(bucket):
    logdir = wd.path(bucket, 'metrics-run')
    with metrics.MetricWriter(logdir, stream=open(os.devnull, 'w'), start_step=0) as writer:
        for step in range(1, 6):
            writer.write_scalars(step, {'loss': 10.0 - step})
    # Resumed from step 3: steps 4 and 5 go, in metrics.jsonl and in the event files.
    with metrics.MetricWriter(logdir, stream=open(os.devnull, 'w'), start_step=3) as writer:
        writer.write_scalars(4, {'loss': 0.5})
    records = metrics.read_jsonl(logdir)
    assert [(r['step'], r['loss']) for r in records] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]
    events = metrics.read_events(logdir)
    assert [(s, v) for tag, s, v in events if tag == 'loss'] == \
        [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]
    assert len(wd.glob(logdir, metrics.EVENTS_GLOB)) == 2  # one event file per writer


def test_check_writable_probes_the_bucket(bucket):
    startup.check_writable(f'{bucket}/probe-run')  # writes, reads and deletes a probe object
    assert wd.glob(wd.path(bucket, 'probe-run'), '*') == []
    with pytest.raises(startup.ConfigError, match=r'^workdir gs://no-such-bucket/run is not '
                                                  r'writable: .+'):
        startup.check_writable('gs://no-such-bucket/run')


def test_check_writable_names_a_local_directory_it_cannot_create(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('x')
    with pytest.raises(startup.ConfigError, match='is not writable'):
        startup.check_writable(blocker / 'run')


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise error from cause
    except BaseException as e:
        return e


@pytest.mark.parametrize('error, found, status', [
    (ConnectionResetError('reset'), 'itself', exits.STORAGE),
    (PermissionError('403 denied'), 'itself', exits.ERROR),
    (wd.StorageError('gs://b/run/x still failing'), 'itself', exits.STORAGE),
    # a storage library's transient failure inside another library's error (orbax, asyncio)
    (_raised(RuntimeError('save failed'), TimeoutError('read timed out')), 'cause', exits.STORAGE),
    (_raised(RuntimeError('save failed'), KeyError('params')), None, None),
    (ValueError('a bug'), None, None),
])
def test_a_storage_failure_is_found_in_the_error_or_its_causes_and_gets_its_exit_status(
        error, found, status, capsys):
    failure = wd.storage_failure(error)
    assert failure is {'itself': error, 'cause': error.__cause__, None: None}[found]
    if failure is None:
        return
    with pytest.raises(SystemExit) as exited:
        cli.exit_storage_error('train.py', failure)
    assert exited.value.code == status
    line = capsys.readouterr().err
    assert line.startswith('train.py: ') and line.count('\n') == 1, line


def test_bounded_appender_never_holds_its_caller_through_an_outage(bucket, monkeypatch):
    """The goodput ledger's appender: writes go through a front that answers 503 for a while;
    `append` returns within its wait (then at once while behind), the lines arrive in order."""
    import gcsfs

    front = fault_front.start(os.environ['STORAGE_EMULATOR_HOST'])
    direct = wd._fs
    through_front = gcsfs.GCSFileSystem(endpoint_url=front.url, token='anon',
                                        skip_instance_cache=True)
    monkeypatch.setattr(wd, '_fs', lambda p: through_front)
    target = wd.path(bucket, 'bounded', 'attempt.jsonl')
    try:
        appender = uploads.BoundedAppender(target, wait_s=0.5)
        assert appender.append('one\n')  # a bucket that answers: written on return
        assert direct(target).cat_file(os.fspath(target)) == b'one\n'
        front.outage(4.0)
        began = time.monotonic()
        assert not appender.append('two\n')
        held = time.monotonic() - began
        assert 0.45 <= held < 1.5, held
        began = time.monotonic()
        assert not appender.append('three\n')  # behind: no wait at all
        assert time.monotonic() - began < 0.1
        assert direct(target).cat_file(os.fspath(target)) == b'one\n'
        assert appender.close(wait_s=60)  # the outage passes; gcsfs's next try writes all
        assert direct(target).cat_file(os.fspath(target)) == b'one\ntwo\nthree\n'
        assert front.counts['outage_503'] >= 1
    finally:
        front.stop()


def test_closing_a_bounded_appender_ends_its_back_off_and_writes_at_once(monkeypatch):
    """The ledger's last records: close() during the uploader's back-off (2 s after its second
    failed try) tries again at once, so a bucket back by then has every line within the wait."""
    down, written, tries = [True], [], []

    def write_atomic(path, content, budget_s):
        tries.append(time.monotonic())
        if down[0]:
            raise OSError(errno.ECONNRESET, 'connection reset')
        written.append(content)

    monkeypatch.setattr(wd, 'read_text', lambda p: '')
    monkeypatch.setattr(wd, 'write_atomic', write_atomic)
    appender = uploads.BoundedAppender('gs://bucket/goodput/attempt.jsonl', wait_s=0.1)
    assert not appender.append('one\n')
    while len(tries) < 2:  # the first try, then one more after the 1 s back-off
        time.sleep(0.01)
    time.sleep(0.2)  # in the 2 s back-off now
    down[0] = False
    began = time.monotonic()
    assert appender.close(wait_s=1.0)
    assert time.monotonic() - began < 0.5 and written == [b'one\n'] and len(tries) == 3
    assert tries[2] - tries[1] < 1.0  # not after the 2 s back-off


def test_a_restart_finds_a_killed_first_save_removed_and_the_finished_steps_kept(bucket,
                                                                              monkeypatch):
    """A save killed before it finished leaves objects under checkpoints/STEP without orbax's
    commit file. Orbax removes such steps in a thread of its own while its constructor lists the
    directory: where they were the only objects, the listing found the prefix gone
    (FileNotFoundError) and the restart failed. make_manager removes them before orbax starts,
    so orbax's clean-up finds nothing to race with."""
    from etils import epath
    from orbax.checkpoint._src.path import temporary_paths

    from t2t.run import checkpoint as ckpt
    from tests.test_checkpoint import config, make_state

    found_by_orbax = []
    orbax_cleanup = temporary_paths.cleanup_temporary_paths

    def cleanup(directory, **kwargs):  # what orbax's clean-up thread would start removing
        directory = epath.Path(directory)
        found_by_orbax.append(sorted(p.name for p in directory.iterdir() if p.name.isdigit())
                              if directory.exists() else [])
        return orbax_cleanup(directory, **kwargs)

    monkeypatch.setattr(temporary_paths, 'cleanup_temporary_paths', cleanup)

    def leave_unfinished(run, step):
        epath.Path(f'{run}/checkpoints/{step}/state/array_0').write_bytes(b'partial')

    alone = wd.path(bucket, 'killed-first-save')
    leave_unfinished(alone, 3)
    manager = ckpt.make_manager(alone, config())
    assert found_by_orbax == [[]]
    assert ckpt.all_steps(manager) == [] and ckpt.latest_step(manager) is None
    ckpt.close(manager)

    beside = wd.path(bucket, 'killed-second-save')
    manager = ckpt.make_manager(beside, config())
    assert ckpt.save(manager, 3, make_state(step=3))
    ckpt.wait(manager)
    ckpt.close(manager)
    leave_unfinished(beside, 6)
    manager = ckpt.make_manager(beside, config())
    assert found_by_orbax[-1] == ['3']  # the finished step kept, the unfinished one gone
    assert ckpt.all_steps(manager) == [3]
    ckpt.close(manager)
