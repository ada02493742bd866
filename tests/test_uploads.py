"""The background writer (t2t/infra/uploads.py) with the storage stood in for by a function that
fails while `down` says so: the caller never waits until the queue is full, then waits with one
line and its wait booked; a storage down past the limit is one error naming the limit and the last
durable checkpoint; files are written in the order first given, each byte once."""

import errno
import threading
import time

import pytest

from t2t.infra import uploads
from t2t.infra import workdir as wd


@pytest.fixture
def storage(monkeypatch):
    """{'down': bool, 'objects': {path: bytes}, 'writes': [path, ...]} behind wd.write_atomic."""
    state = {'down': False, 'objects': {}, 'writes': []}

    def write_atomic(path, content, budget_s):
        if state['down']:
            time.sleep(0.01)
            raise OSError(errno.ECONNRESET, 'connection reset')
        state['objects'][str(path)] = bytes(content)
        state['writes'].append(str(path))

    monkeypatch.setattr(wd, 'write_atomic', write_atomic)
    return state


def test_writes_leave_the_caller_and_the_queue_blocks_only_when_full(storage, capsys):
    queue = uploads.Queue(max_bytes=100)
    waits = []
    queue.configure(100, limit_s=0.0, on_wait=waits.append)
    up = uploads.Uploader('metrics', queue, say=lambda line: None)
    storage['down'] = True
    began = time.monotonic()
    for i in range(5):  # 100 bytes kept: at the bound, no wait
        up.add('gs://b/events', b'e' * 8)
        up.add('gs://b/metrics.jsonl', f'{{"step": {i}}}\n'.encode())  # 12 bytes
        queue.make_room()
    assert time.monotonic() - began < 0.5 and waits == []
    assert queue.pending == 100 and capsys.readouterr().err == ''
    up.add('gs://b/metrics.jsonl', b'x' * 30)  # 130 > 100: the next make_room waits

    def storage_back():
        time.sleep(0.5)
        storage['down'] = False

    threading.Thread(target=storage_back).start()
    began = time.monotonic()
    queue.make_room()
    waited = time.monotonic() - began
    assert 0.4 < waited < 10.0 and len(waits) == 1 and abs(waits[0] - waited) < 0.1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith('storage: 0.0 MiB of writes wait for the storage (storage_queue_mb=')
    assert err[0].endswith(' is full); training waits for room') and len(err) == 2
    assert err[1].startswith('storage: the write queue has room again; training waited ')
    assert up.close(10.0)
    # Each file whole and once; the events were written before the records after them.
    assert storage['objects']['gs://b/events'] == b'e' * 40
    assert storage['objects']['gs://b/metrics.jsonl'].endswith(b'x' * 30)
    assert storage['writes'][:2] == ['gs://b/events', 'gs://b/metrics.jsonl']
    stats = queue.stats()
    assert stats['peak_queue_bytes'] == 130 and stats['written_bytes'] == 130
    assert queue.pending == 0 and stats['waited_s'] == pytest.approx(waited, abs=0.1)


def test_a_storage_down_past_the_limit_names_it_and_the_last_durable_step(storage):
    queue = uploads.Queue(max_bytes=10)
    queue.configure(10, limit_s=0.3, last_durable=lambda: 6)
    up = uploads.Uploader('metrics', queue, say=lambda line: None)
    storage['down'] = True
    up.add('gs://b/metrics.jsonl', b'{"step": 7}\n')
    queue.check()  # not failing yet long enough
    with pytest.raises(wd.StorageError) as error:
        queue.make_room()  # full, and the storage stays down: the limit ends the wait
    assert str(error.value).startswith('writing gs://b/metrics.jsonl failed for ')
    assert str(error.value).endswith(' s (storage_outage_limit_s=0.3): ConnectionResetError: '
                                     '[Errno 104] connection reset; the last checkpoint saved is '
                                     'step 6')
    with pytest.raises(wd.StorageError):
        queue.check()
    assert not up.close(0.1) and queue.pending == 0  # what was not written leaves the queue
    assert storage['objects'] == {}


def test_a_mark_waits_for_the_bytes_before_it_not_those_after(storage):
    queue = uploads.Queue()
    up = uploads.Uploader('metrics', queue, say=lambda line: None)
    up.add('gs://b/metrics.jsonl', b'one\n')
    mark = up.mark()
    assert up.wait(5.0, mark)
    storage['down'] = True
    up.add('gs://b/metrics.jsonl', b'two\n')
    assert up.wait(0.0, mark)  # what the mark covers is written
    assert not up.wait(0.2)  # what came after is not
    assert up.unwritten() == {'gs://b/metrics.jsonl': 4}
    storage['down'] = False
    assert up.close(10.0)
    assert storage['objects']['gs://b/metrics.jsonl'] == b'one\ntwo\n'
