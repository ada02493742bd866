"""Kills, preemption, corrupt checkpoints and failed saves: the run resumes and ends exact.

The kill test trains in subprocesses that signal themselves at exact moments (tests/kill_driver.py:
a SIGKILL mid-save, a SIGTERM mid-evaluation) and compares the resumed workdir with one
uninterrupted run: the final state bitwise, every metrics.jsonl value and TensorBoard scalar at the
same steps, and no step written twice. scripts/torture.py does the same with kills at random
moments.
"""

import collections
import errno
import json
import os
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from t2t import optim, sharding, train_lib
from t2t.eval import evaluation
from t2t.infra import metrics
from t2t.run import checkpoint, checkpoint_read, run_record, startup
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import run_script, tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

# Checkpoints every 3 steps, logs every 2: a resume usually starts inside a log interval.
SETTINGS = dict(num_train_steps=8, log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=3,
                keep_checkpoints=5, eval_bleu_sentences=0, num_eval_batches=2, max_len=32,
                eval_batch_size=8)
TIMING = {'step_time_s', 'target_tokens_per_s', 'mfu_real_tokens', 'mfu_padded_slots'}


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


def _variant(config, **overrides):
    config = config.copy_and_resolve_references()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _final_state(config, workdir, step):
    mesh = sharding.make_mesh(config.mesh_shape)
    abstract = train_lib.abstract_state(config, mesh, optim.make_optimizer(config))
    manager = checkpoint.make_manager(str(workdir), config)
    try:
        return jax.device_get(checkpoint.restore(manager, step, abstract))
    finally:
        checkpoint.close(manager)


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory):
    """One uninterrupted run: checkpoints 3, 6, 8."""
    config = tiny_config(corpus, **SETTINGS)
    workdir = tmp_path_factory.mktemp('reference') / 'run'
    assert loop.train_and_evaluate(config, str(workdir)).step == 8
    return {'config': config, 'workdir': workdir, 'state': _final_state(config, workdir, 8)}


def _records(workdir):
    """{(step, key): value} of metrics.jsonl's lines; fails if a step holds a key twice."""
    values = {}
    with open(os.path.join(workdir, metrics.JSONL_NAME), encoding='utf-8') as f:
        for line in f:
            record = json.loads(line)
            for key, value in record.items():
                if key != 'step':
                    assert (record['step'], key) not in values, (record['step'], key)
                    values[record['step'], key] = value
    return values


def _scalars(workdir):
    """{(tag, step): value} of the event files; fails if a step holds a tag twice."""
    events = metrics.read_events(workdir)
    twice = [k for k, n in collections.Counter((t, s) for t, s, _ in events).items() if n > 1]
    assert not twice, twice
    return {(t, s): v for t, s, v in events}


def _assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(f'u{x.itemsize}'), y.view(f'u{y.itemsize}'))


def _assert_same_run(workdir, reference):
    _assert_bitwise_equal(_final_state(reference['config'], workdir, 8), reference['state'])
    got, want = _records(workdir), _records(reference['workdir'])
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[1] not in TIMING} == \
        {k: v for k, v in want.items() if k[1] not in TIMING}
    got, want = _scalars(workdir), _scalars(reference['workdir'])
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[0] not in TIMING} == \
        {k: v for k, v in want.items() if k[0] not in TIMING}


def _drive(corpus, workdir, action, at=0, overrides=SETTINGS):
    spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
            'overrides': overrides, 'workdir': str(workdir), 'action': action, 'at': at}
    return run_script('-m', 'tests.kill_driver', json.dumps(spec), devices=8, timeout=600)


def _leftovers(workdir):
    return [n for n in os.listdir(workdir / 'checkpoints') if not n.isdigit()]


def test_killed_mid_save_then_preempted_mid_eval_the_run_ends_exact(corpus, reference,
                                                                    tmp_path):
    workdir = tmp_path / 'run'
    # SIGKILL while step 6 is written: steps 4..6 were logged past checkpoint 3.
    killed = _drive(corpus, workdir, 'kill_in_save', at=6)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint_read.finished_steps(workdir) == [3]
    assert any('orbax-checkpoint-tmp' in name for name in _leftovers(workdir))
    assert max(r['step'] for r in metrics.read_jsonl(workdir)) == 6

    # Resumed from 3 (step 3's sums, logged by no one yet, travel in the checkpoint to the log
    # at 4); a SIGTERM as the evaluation of step 4 starts stops it, saves step 4 at once with
    # that evaluation pending, and exits 0.
    assert checkpoint_read.read_metadata(workdir, 3)['unlogged_metrics']['tokens'] > 0
    preempted = _drive(corpus, workdir, 'sigterm_in_eval', at=1)
    assert preempted.returncode == 0, preempted.stderr[-2000:]
    assert json.loads(preempted.stdout.splitlines()[-1]) == {'step': 4, 'stopped_by': 'preemption'}
    assert checkpoint_read.read_metadata(workdir, 4)['evaluation_pending'] is True
    assert 'eval_loss' not in metrics.read_jsonl(workdir)[-1]
    assert run_record.read_finished(workdir) is None

    # The last run evaluates step 4 first, then trains to the end. (A SIGKILL mid-evaluation:
    # scripts/torture.py, which kills at random moments.)
    finished = _drive(corpus, workdir, 'none')
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert run_record.read_finished(workdir) == {'step': 8, 'stopped_by': 'num_train_steps'}
    assert _leftovers(workdir) == []  # temporary and deleted steps are gone
    _assert_same_run(workdir, reference)


def test_sigterm_in_the_final_evaluation_of_a_time_budget_stop_leaves_it_pending(corpus,
                                                                                 tmp_path):
    workdir = tmp_path / 'budget'
    # The budget is spent at the first log step (2), which is no scheduled evaluation: the stop's
    # final evaluation starts there, and a SIGTERM arrives in it.
    budget = {**SETTINGS, 'train_time_budget_s': 0.3, 'eval_every_steps': 100}
    preempted = _drive(corpus, workdir, 'sigterm_in_eval', at=1, overrides=budget)
    assert preempted.returncode == 0, preempted.stderr[-2000:]
    assert json.loads(preempted.stdout.splitlines()[-1]) == {'step': 2, 'stopped_by': 'preemption'}
    assert (f'the time budget (train_time_budget_s=0.3) cut the run at step 2 of num_train_steps='
            f'{SETTINGS["num_train_steps"]}' in preempted.stdout.splitlines())
    assert checkpoint_read.read_metadata(workdir, 2)['evaluation_pending'] is True
    assert run_record.read_finished(workdir) is None
    # The resumed run evaluates step 2 first, then finds the budget spent.
    result = loop.train_and_evaluate(tiny_config(corpus, **budget), str(workdir))
    assert (result.step, result.stopped_by) == (2, 'time_budget')
    assert result.eval_metrics['eval_loss'] == metrics.read_jsonl(workdir)[-1]['eval_loss']
    assert run_record.read_finished(workdir) == {'step': 2, 'stopped_by': 'time_budget'}


def test_writer_drops_records_after_the_resumed_step_in_jsonl_and_events(tmp_path):
    with metrics.MetricWriter(tmp_path, stream=open(os.devnull, 'w')) as writer:
        for step in range(1, 7):
            writer.write_scalars(step, {'loss': float(step)})
            writer.write_scalars(step, {'eval_loss': float(step)})
    with open(tmp_path / metrics.JSONL_NAME, 'a') as f:
        f.write('{"step": 7, "lo')  # torn by a kill
    events = [p for p in os.listdir(tmp_path) if p.startswith('events')]
    with open(tmp_path / events[0], 'ab') as f:
        f.write(b'\x20\x00\x00')  # a torn event record
    # Resumed from 3 with its evaluation pending: that evaluation is written again too.
    with metrics.MetricWriter(tmp_path, stream=open(os.devnull, 'w'), start_step=3,
                              redo_at_start=('eval_',)) as writer:
        writer.write_scalars(3, {'eval_loss': 30.0})
        writer.write_scalars(4, {'loss': 40.0})
    kept = {(1, 'loss'): 1.0, (1, 'eval_loss'): 1.0, (2, 'loss'): 2.0, (2, 'eval_loss'): 2.0,
            (3, 'loss'): 3.0, (3, 'eval_loss'): 30.0, (4, 'loss'): 40.0}
    assert _records(tmp_path) == kept
    assert _scalars(tmp_path) == {(key, step): value for (step, key), value in kept.items()}
    # The new event file also tells a running TensorBoard to purge what it read after step 3.
    from tensorboardX.proto.event_pb2 import SessionLog

    starts = [metrics._event(r) for p in sorted(os.listdir(tmp_path)) if p.startswith('events')
              for r in metrics._records((tmp_path / p).read_bytes())]
    assert [e.step for e in starts if e.session_log.status == SessionLog.START] == [4]


def _truncate_data_files(step_dir):
    """Every array data file of the step cut in half (a disk that lost the files' ends)."""
    for root, _, files in os.walk(step_dir / 'state'):
        for name in files if os.path.basename(root) == 'd' else ():
            path = os.path.join(root, name)
            os.truncate(path, os.path.getsize(path) // 2)


def _change_a_params_checksum(step_dir):
    """As a flipped bit in an embedding looks to `restore`: its fingerprint no longer matches."""
    path = step_dir / 'meta' / 'metadata'
    meta = json.loads(path.read_text())
    meta['checksums']['params/embedder/embedding'][1] ^= 1 << 7
    path.write_text(json.dumps(meta))


# After a failed read, orbax's tensorstore callback may hit its already closed event loop.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_corrupt_checkpoints_are_reported_moved_aside_and_training_falls_back(
        reference, tmp_path, caplog):
    workdir = tmp_path / 'run'
    shutil.copytree(reference['workdir'], workdir)
    _truncate_data_files(workdir / 'checkpoints' / '8')
    _change_a_params_checksum(workdir / 'checkpoints' / '6')
    config = reference['config']

    # evaluate.py names a bad checkpoint it is asked for, and --all reports both and goes on.
    with pytest.raises(checkpoint.CheckpointError) as error:
        evaluation.run(config, str(workdir), step=8, progress=False, echo=lambda _: None)
    assert f'{workdir}/checkpoints/8' in str(error.value) and '\n' not in str(error.value)
    quick = _variant(config, beam_size=1, max_decode_extra=2)  # decode settings only
    lines = []
    results = evaluation.run(quick, str(workdir), all_steps=True, progress=False,
                             echo=lines.append)
    assert 'sacrebleu' in results['step-3']
    assert {'step-6', 'step-8'} <= {label for label, r in results.items() if 'corrupt' in r}
    table = lines[-2].splitlines()
    assert any(row.split()[:2] == ['step-8', 'corrupt:'] for row in table), table

    # Training falls back to step 3, naming each bad step, and moves them out of orbax's sight.
    with caplog.at_level('WARNING'):
        result = loop.train_and_evaluate(config, str(workdir))
    assert result.step == 8
    warned = [r.getMessage() for r in caplog.records if 'falling back' in r.getMessage()]
    assert len(warned) == 2 and 'checkpoints/8 is unreadable' in warned[0] \
        and 'checkpoints/6 is corrupt: checksum mismatch in params/embedder' in warned[1]
    assert sorted(n.split('-')[0] for n in os.listdir(workdir / 'corrupt')) == ['6', '8']
    _assert_same_run(workdir, reference)


def test_a_full_disk_mid_save_is_one_line_and_keeps_the_earlier_checkpoints(reference, tmp_path,
                                                                             monkeypatch):
    workdir = tmp_path / 'run'
    shutil.copytree(reference['workdir'], workdir)
    config = _variant(reference['config'], num_train_steps=10, keep_checkpoints=3)
    original = ocp.JsonCheckpointHandler._save_fn

    async def disk_full_at_9(self, item, directory):
        if item.get('step') == 9:
            raise OSError(errno.ENOSPC, 'No space left on device')
        return await original(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn', disk_full_at_9)
    with pytest.raises(checkpoint.CheckpointError) as error:
        loop.train_and_evaluate(config, str(workdir))
    message = str(error.value)
    assert '\n' not in message and f'{workdir}/checkpoints/9 failed' in message
    assert 'the disk is full' in message
    # Step 3 would have been deleted (keep 3) had 9 succeeded: everything before stays.
    assert checkpoint_read.finished_steps(workdir) == [3, 6, 8]
    for step in (3, 6, 8):
        assert checkpoint_read.restore_params(workdir, step)


def test_a_nan_state_is_never_saved_between_log_steps(reference, tmp_path, monkeypatch):
    workdir = tmp_path / 'run'
    shutil.copytree(reference['workdir'], workdir)
    # Resumed from 8: logs at 12 only, checkpoints at 11 and 12; a NaN appears at step 10.
    config = _variant(reference['config'], num_train_steps=12, log_every_steps=4,
                      checkpoint_every_steps=11)
    real_jit = train_lib.jit_train_step

    def nan_at_step_10(*args, **kwargs):
        step = real_jit(*args, **kwargs)

        def poisoned(state, batch):
            state, m = step(state, batch)
            if int(state.step) == 10:
                state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
                m = dict(m, nonfinite=np.float32(1.0))
            return state, m

        return poisoned

    monkeypatch.setattr(train_lib, 'jit_train_step', nan_at_step_10)
    with pytest.raises(loop.NonFiniteLossError, match='step 10: the loss or the gradient'):
        loop.train_and_evaluate(config, str(workdir))
    assert checkpoint_read.finished_steps(workdir) == [3, 6, 8]  # 11 was refused

    # The checkpoint writer refuses a non-finite state by itself too, naming the array.
    state = _final_state(reference['config'], workdir, 8)
    bad = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    manager = checkpoint.make_manager(str(workdir), config)
    with pytest.raises(checkpoint.CheckpointError, match='step 11: refusing to save a state '
                                                         'with NaN or inf in params/'):
        checkpoint.save(manager, 11, bad)
    checkpoint.close(manager)
    assert checkpoint_read.finished_steps(workdir) == [3, 6, 8]


def test_an_unwritable_workdir_is_one_line_before_anything_is_built(reference, tmp_path,
                                                                   monkeypatch):
    blocker = tmp_path / 'a-file'
    blocker.write_text('')
    monkeypatch.setattr(loop.sharding, 'make_mesh', lambda *_: pytest.fail('went past the check'))
    with pytest.raises(startup.ConfigError) as error:
        loop.train_and_evaluate(reference['config'], str(blocker / 'run'))
    assert str(error.value) == f'workdir {blocker}/run is not writable: Not a directory'


def test_with_jax_distributed_sigterm_reaches_jaxs_preemption_sync_point():
    code = '''if True:
        import os, signal, socket, time
        import jax
        from t2t.infra.preemption import PreemptionFlag
        s = socket.socket(); s.bind(('localhost', 0)); port = s.getsockname()[1]; s.close()
        jax.distributed.initialize(f'localhost:{port}', 1, 0)
        flag = PreemptionFlag().install()
        assert signal.getsignal(signal.SIGTERM) != flag._handle  # jax's notifier owns SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        for step in range(1, 3000):
            if flag.reached(step, at_log_step=False):
                print('reached', step, flag.is_set())
                break
            time.sleep(0.01)
    '''
    proc = run_script('-c', code, devices=8, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == 'reached' and proc.stdout.split()[2] == 'False'
