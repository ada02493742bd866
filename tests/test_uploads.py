"""The background writer (t2t/infra/uploads.py) with the storage stood in for by a function that
fails while `down` says so: the caller never waits until the queue is full, then waits with one
line and its wait booked; a storage down past the limit is one error naming the limit and the last
durable checkpoint; files are written in the order first given, each byte once. Then the
checkpoint saver (t2t/run/outage.py) with orbax's save stood in for: a refused save is retried in
the background from its host copy while the loop goes on, is never reported saved while pending,
and ends the run past the limit; on several processes (the second stood in for by its rows) every
move is taken by all, from this process's host copy of its shards."""

import errno
import re
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath

from t2t.infra import uploads
from t2t.infra import workdir as wd
from t2t.run import checkpoint, outage


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


class _Checkpoints:
    """checkpoint.save / wait / remove_unfinished stood in for: an asynchronous save whose write
    fails while `down` (a transient error, as orbax re-raises it), the steps finished, the calls."""

    def __init__(self):
        self.down, self.finished, self.calls, self.saved_states = False, [], [], {}
        self.started = None

    def save(self, manager, step, state, force=False, extra_metadata=None, data_iter=None):
        self.calls.append(('save', step, force))
        self.started = (step, jax.device_get(state))
        return True

    def wait(self, manager):
        if self.started is None:
            return
        step, state = self.started
        self.started = None
        if self.down:
            time.sleep(0.05)
            error = checkpoint.CheckpointError(f'saving checkpoint {step} failed')
            error.__cause__ = OSError(errno.ECONNRESET, 'connection reset')
            raise error
        self.finished.append(step)
        self.saved_states[step] = state

    def remove_unfinished(self, directory, steps):
        self.calls.append(('remove_unfinished', tuple(steps)))


class _Writer:
    logdir = 'gs://b/run'

    def __init__(self):
        self.behind = {}

    def mark(self):
        return {}

    def written(self, seconds, mark=None):
        """The records before a save (a mark) are written; `behind` stands for later ones."""
        deadline = time.monotonic() + seconds
        while mark is None and self.behind and time.monotonic() < deadline:
            time.sleep(0.01)
        return mark is not None or not self.behind

    def unwritten(self):
        return self.behind

    def unwritten_records(self):
        return len(self.behind)


@pytest.fixture
def saver_parts(monkeypatch):
    fake = _Checkpoints()
    monkeypatch.setattr(uploads, 'QUEUE', uploads.Queue())  # the saver's say in it: this test's
    for name in ('save', 'wait', 'remove_unfinished'):
        monkeypatch.setattr(checkpoint, name, getattr(fake, name))
    monkeypatch.setattr(checkpoint, 'latest_step', lambda m: fake.finished[-1]
                        if fake.finished else None)
    orbax = types.SimpleNamespace(all_steps=lambda: list(fake.finished),
                                  should_save=lambda step: True, reload=lambda: None,
                                  wait_until_finished=lambda: None)
    manager = types.SimpleNamespace(manager=orbax, directory=epath.Path('gs://b/run/checkpoints'),
                                    pending=[])
    return fake, manager


def _state(step):
    return {'w': jnp.full((4,), float(step)), 'step': jnp.asarray(step)}


class _Iterator:
    def get_state(self):
        return {'position': 1}


def test_a_save_the_storage_refuses_is_retried_in_the_background_while_training_goes_on(
        saver_parts, monkeypatch):
    fake, manager = saver_parts
    lines = []
    monkeypatch.setattr(outage, 'PREEMPTION_GRACE_S', 0.3)
    monkeypatch.setattr(outage, 'MAX_DELAY_S', 0.2)  # the back-off between tries
    writer = _Writer()
    saver = outage.Saver(manager, 60.0, writer, lines.append)
    assert saver.background
    fake.down = True
    state = _state(3)
    began = time.monotonic()
    saver.save(3, state, _Iterator(), {})
    assert time.monotonic() - began < 1.0  # the loop goes on; the save is the thread's
    time.sleep(0.2)
    saver.check()  # failing, not past the limit: nothing to raise
    assert saver.durable is None and fake.finished == []
    # A preemption now: the pending save is not reported saved; one line says what is not.
    writer.behind = {'gs://b/run/metrics.jsonl': 12}
    assert saver.finish(_state(4), ended=True, preempted=True) is False
    assert lines[-1] == ('not yet in storage after 0 s: checkpoint 3, 1 metric record in 12 '
                         'bytes (metrics.jsonl), redone from the checkpoint; the last checkpoint '
                         'in storage is none'), lines
    # The storage answers again: checkpoint 3 is saved from the host copy of step 3's state;
    # the next due save waits for it, never two in flight.
    fake.down, writer.behind = False, {}
    saver.save(6, _state(6), _Iterator(), {})
    assert fake.finished[:1] == [3] and fake.saved_states[3]['w'].tolist() == [3.0] * 4
    assert ('remove_unfinished', (3,)) in fake.calls and ('save', 3, True) in fake.calls
    assert any(re.fullmatch(r'checkpoint 3 saved after \d+ s of storage failures', x)
               for x in lines), lines
    assert saver.finish(_state(6), ended=True, preempted=False)
    assert fake.finished == [3, 6] and saver.durable == 6


def test_a_save_refused_past_the_limit_ends_the_run_naming_it_and_the_last_durable_step(
        saver_parts):
    fake, manager = saver_parts
    saver = outage.Saver(manager, 1.5, _Writer(), lambda line: None)
    saver.save(3, _state(3), _Iterator(), {})
    assert saver.finish(_state(3), ended=True, preempted=False) and saver.durable == 3
    fake.down = True
    saver.save(6, _state(6), _Iterator(), {})
    deadline = time.monotonic() + 30
    with pytest.raises(wd.StorageError) as error:
        while time.monotonic() < deadline:
            saver.check()  # the loop's call at every step
            time.sleep(0.05)
    assert re.fullmatch(r'saving checkpoint gs://b/run/checkpoints/6 failed for \d+ s '
                        r'\(storage_outage_limit_s=1\.5\): ConnectionResetError: \[Errno 104\] '
                        r'connection reset; the last checkpoint saved is step 3',
                        str(error.value)), error.value
    assert fake.finished == [3]


def test_without_an_outage_limit_a_save_waits_for_the_metrics_as_long_as_the_storage_retries(
        saver_parts, monkeypatch):
    """storage_outage_limit_s=0 (not retried): no background saves; a due save waits for the
    records before it as long as one write's retries (before, a limit of 0 waited no time)."""
    fake, manager = saver_parts
    asked = []

    class Writer(_Writer):
        def written(self, seconds, mark=None):
            asked.append(seconds)
            return True

    monkeypatch.setattr(wd, 'RETRY_BUDGET_S', 7.0)
    saver = outage.Saver(manager, 0.0, Writer(), lambda line: None)
    assert not saver.background
    saver.save(3, _state(3), _Iterator(), {})
    assert asked == [7.0] and fake.calls == [('save', 3, False)]
    assert saver.finish(_state(3), ended=True, preempted=False) and fake.finished == [3]


def test_a_host_copy_holds_each_distinct_shard_once_and_restores_bitwise():
    """The retry's source on several processes: this process's shards, not the global array
    (which jax.device_get cannot fetch there); a replicated shard is copied once."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ('data', 'model'))
    rows = jax.device_put(jnp.arange(32, dtype=jnp.bfloat16).reshape(8, 4) / 3,
                          NamedSharding(mesh, PartitionSpec('data')))  # 4 shards, each on 2
    scalar = jax.device_put(jnp.asarray(7, jnp.int32), NamedSharding(mesh, PartitionSpec()))
    state = {'rows': rows, 'step': scalar, 'name': 'kept as it is'}
    copy = outage.host_copy(state)
    assert len(copy[2]) == 4 + 1  # distinct shards: 4 of rows, 1 of the replicated scalar
    back = outage.from_host_copy(copy)
    assert back['name'] == 'kept as it is'
    for key in ('rows', 'step'):
        assert back[key].sharding == state[key].sharding
        assert back[key].dtype == state[key].dtype
        assert jax.device_get(back[key]).tobytes() == jax.device_get(state[key]).tobytes()


def test_several_processes_take_each_move_of_a_retried_save_together(saver_parts, monkeypatch):
    """Process 1 stood in for by the row it gives in each round: a save finished on process 0
    is not reported saved while process 1's part runs; a failure on process 0 alone is retried
    by both (the unfinished directory removed, then saved again from the host copy); a
    non-transient failure on process 1 ends the run on process 0 too, naming it."""
    fake, manager = saver_parts
    monkeypatch.setattr(outage, 'MAX_DELAY_S', 0.2)
    other = {'row': [outage.RUNNING, 0]}
    monkeypatch.setattr(outage.distributed, 'every_process_ints',
                        lambda mine: [mine, [*other['row'], 0, 0, 0, 0]])
    lines = []
    saver = outage.Saver(manager, 60.0, _Writer(), lines.append)
    fake.down = True  # process 0's write fails; process 1's goes on
    saver.save(3, _state(3), _Iterator(), {})
    deadline = time.monotonic() + 10
    while saver._try.state() == outage.RUNNING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert saver._try.state() == outage.FAILED
    for _ in range(3):
        saver.check()
    assert lines == [] and fake.calls == [('save', 3, True)]  # process 1's part runs: no move
    other['row'] = [outage.DONE, 0]
    fake.down = False
    while not lines and time.monotonic() < deadline:
        saver.check()
        time.sleep(0.02)
    assert lines == ['saving checkpoint 3 failed (ConnectionResetError: [Errno 104] connection '
                     'reset); it is saved in the background for up to 60 s '
                     '(storage_outage_limit_s), training goes on'], lines
    while ('save', 3, True) not in fake.calls[1:] and time.monotonic() < deadline:
        saver.check()  # the back-off, then both clean up (found unfinished), then save again
        time.sleep(0.02)
    assert fake.calls[1:] == [('remove_unfinished', (3,)), ('save', 3, True)], fake.calls
    other['row'] = [outage.RUNNING, 0]  # process 1 still writing: not saved, though 0 is done
    for _ in range(5):
        saver.check()
        time.sleep(0.05)
    assert fake.finished == [3] and saver.pending == 3 and saver.durable is None
    other['row'] = [outage.DONE, 0]
    saver.check()
    assert saver.pending is None and saver.durable == 3
    assert fake.saved_states[3]['w'].tolist() == [3.0] * 4  # from the host copy of step 3
    assert re.fullmatch(r'checkpoint 3 saved after \d+ s of storage failures', lines[-1])
    saver.save(6, _state(6), _Iterator(), {})
    other['row'] = [outage.FATAL, 0]
    with pytest.raises(checkpoint.CheckpointError, match=r'^saving checkpoint '
                       r'gs://b/run/checkpoints/6 failed on process 1$'):
        saver.check()
