"""Pod scale from one machine: 2 processes x 4 CPU devices train and evaluate like 1 x 8, and a
checkpoint restores on any mesh, device count or process count with the data continuing in order.

One scenario (the `pod` fixture, computed once even when the tests run on several xdist workers),
with the workdir of A in a Cloud Storage bucket (gs://pod/A on a real Cloud Storage API on
localhost, tests/gcs_server.py), as on a TPU pod slice:
  A1  the training loop on 2 processes (tests/kill_driver.py), mesh (8, 1, 1) over both, steps
      0 -> 6, SIGKILLed on process 0 while checkpoint 6 is written (process 1 is killed then
      too); checkpoint 3 is in the bucket. Process 1 has its own data_dir, like a TPU VM's local
      disk: it gets the vocabulary from process 0
  A2  train.py on 2 processes resumes A1: steps 3 -> 6 on mesh (2, 1, 2) x dcn (1, 2, 1), i.e. a
      (2, 2, 2) mesh whose fsdp axis spans the processes (process 0 feeds rows 0,1,4,5 of 8)
  E2  evaluate.py on 2 processes: --watch (every checkpoint, as --all would, each through
      evaluation.evaluate_params) and --average_last=2, reading the bucket and writing their
      records there; then the bucket's A is copied to a local directory
  ref loop.train_and_evaluate in this process: 1 process x 8 devices, mesh (1, 8, 1), steps 0 -> 8
and in this process, from those checkpoints: A's step 6 -> 8 on 1 process, mesh (1, 8, 1);
ref's step 3 -> 6 on (8, 1, 1); ref's step 3 -> 6 on 1 device, then 6 -> 8 on 8 devices; and
evaluate.py's logic on 8 devices and on 1 device.

Compiled programs go to a persistent compilation cache for the session (jax's own, keyed by the
program), so a program compiled by an earlier run on the same mesh is read back, not recompiled.

The attention key biases are left out of parameter comparisons: their exact gradient is zero
(softmax ignores a constant added to every logit of a query), so each run's float noise, turned
into +-learning-rate steps by Adam, moves them differently without changing any output.
"""

import collections
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import traceback

import jax
import numpy as np
import pytest

from t2t import sharding
from t2t.data import identity, pipeline
from t2t.eval import evaluation
from t2t.infra import metrics
from t2t.infra import workdir as wd
from t2t.run import checkpoint, checkpoint_read, run_record
from t2t.train import loop
from tests import gcs_server, toy_corpus
from tests.helpers import start_script, tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# max_eval_len 16: evaluation buckets of 8 and 16 tokens only (9 of 21 test sentences are skipped
# as longer, and counted), so each decoder compiles twice, not three times.
SETTINGS = dict(log_every_steps=1, eval_every_steps=6, checkpoint_every_steps=3,
                keep_checkpoints=5, eval_bleu_sentences=0, num_eval_batches=1, max_eval_len=16)
BLEU = dict(eval_bleu_sentences=4)  # in-training BLEU where a run is compared on it
TIMEOUT_S = 420  # per 2-process command; a loaded 2-core machine takes a few times longer


def _config(corpus, **overrides):
    return tiny_config(corpus, **{**SETTINGS, **overrides})


def _flags(corpus, **overrides) -> list[str]:
    """--config flags giving train.py / evaluate.py the config of `_config` (but data_dir)."""
    from configs import tiny

    config, base = _config(corpus, **overrides), tiny.get_config()
    flags = ['--config=configs/tiny.py']
    flags += [f'--config.{k}={config[k]}' for k in config
              if k not in ('tsv_files', 'data_dir') and config[k] != base[k]]
    flags += [f'--config.tsv_files.{s}={config.tsv_files[s]}'
              for s in ('train', 'validation', 'test')]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def _cache_env(log_dir) -> dict:
    """The scenario's own compilation cache (see the module doc), for its processes."""
    return {'JAX_COMPILATION_CACHE_DIR': str(log_dir / 'jax-cache'),
            'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
            'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '-1'}


def _two_processes(script: str, args: list[str], data_dirs: list[str], log_dir) -> list[str]:
    """Runs `script` on 2 processes x 4 CPU devices; returns their stdouts; raises with both
    processes' stderr tails when one fails or the time runs out."""
    port = _free_port()
    procs, logs = [], []
    for i in range(2):
        out = open(log_dir / f'{script}-{port}-{i}.out', 'w+')
        err = open(log_dir / f'{script}-{port}-{i}.err', 'w+')
        logs.append((out, err))
        procs.append(start_script(
            script, *args, f'--config.data_dir={data_dirs[i]}',
            f'--coordinator_address=localhost:{port}', '--num_processes=2', f'--process_id={i}',
            devices=4, env=_cache_env(log_dir), stdout=out, stderr=err))
    # A process that fails leaves the other waiting in a collective: stop it soon after.
    deadline, failed = time.monotonic() + TIMEOUT_S, []
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() for p in procs):
            deadline = min(deadline, time.monotonic() + 20)
        time.sleep(0.2)
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            failed.append(f'process {i} was stopped after waiting (limit {TIMEOUT_S} s)')
        elif proc.returncode:
            failed.append(f'process {i} exited with {proc.returncode}')
    texts = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    if failed:
        tails = '\n'.join(f'--- process {i} stderr:\n{e[-3000:]}' for i, (_, e) in enumerate(texts))
        raise AssertionError(f'{script}: {"; ".join(failed)}\n{tails}')
    return [o for o, _ in texts]


@contextlib.contextmanager
def _exclusive(path):
    with open(path, 'w') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _copy_checkpoint(src_workdir, step: int, dst_workdir) -> str:
    dst = os.path.join(dst_workdir, 'checkpoints')
    os.makedirs(dst)
    shutil.copytree(os.path.join(src_workdir, 'checkpoints', str(step)),
                    os.path.join(dst, str(step)))
    return str(dst_workdir)


class _Recorder:
    """Records the (process-local) batches the loop feeds, by wrapping sharding.put_rows."""

    def __init__(self, monkeypatch):
        self.batches = []
        put_rows = sharding.put_rows

        def recording(batch, *args):
            self.batches.append({k: np.array(v) for k, v in batch.items()})
            return put_rows(batch, *args)

        monkeypatch.setattr(sharding, 'put_rows', recording)


def _killed_in_save(corpus, args_overrides, workdir, data_dirs, log_dir, at: int) -> list[int]:
    """tests/kill_driver on 2 processes x 4 CPU devices: process 0 SIGKILLs itself while the
    checkpoint of step `at` is written; process 1 is killed then too, as a pod's scheduler does.
    Returns both return codes."""
    port, procs = _free_port(), []
    for i in range(2):
        spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
                'overrides': {**SETTINGS, **args_overrides}, 'workdir': workdir,
                'data_dir': data_dirs[i], 'action': 'kill_in_save' if i == 0 else 'none',
                'at': at, 'distributed': {'coordinator': f'localhost:{port}',
                                          'num_processes': 2, 'process_id': i}}
        with open(log_dir / f'killed-{port}-{i}.err', 'w') as err:
            procs.append(start_script('-m', 'tests.kill_driver', json.dumps(spec), devices=4,
                                      env=_cache_env(log_dir), stdout=subprocess.DEVNULL,
                                      stderr=err))
    deadline = time.monotonic() + TIMEOUT_S
    while procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return [p.returncode for p in procs]


def _bucket_facts(a: str) -> dict:
    """What the runs left in the bucket, read while its server runs."""
    text = wd.read_text
    return {
        'metrics_text': text(wd.path(a, metrics.JSONL_NAME)),
        'watch_text': text(wd.path(a, 'watch-test', metrics.JSONL_NAME)),
        'scores': json.loads(text(wd.path(a, 'eval-test.json'))),
        'hypotheses': {p.name: text(p) for p in wd.glob(wd.path(a), 'hypotheses-*.txt')},
        'events': metrics.read_events(a),
        'finished': run_record.read_finished(a),
        'vocab': wd.exists(wd.path(a, identity.VOCAB_NAME)),
        'run_records': [p.name for p in wd.glob(wd.path(a), 'run-*.json')],
    }


def _mirror(url: str, local: str) -> str:
    """A local copy of a bucket directory (checkpoints included), for the tests that follow."""
    import gcsfs

    gcsfs.GCSFileSystem().get(url.removeprefix('gs://'), local, recursive=True)
    return local


def _run_scenario(root) -> dict:
    (root / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(root / 'corpus')
    data0, data1 = str(root / 'corpus' / 'data'), str(root / 'local1')
    runs = {'corpus_root': str(corpus['root']), 'data_dirs': [data0, data1]}
    dirs = [data0, data1]
    with gcs_server.serve() as url:
        a = gcs_server.make_bucket(url, 'pod') + '/A'
        runs['bucket_workdir'] = a
        runs['killed'] = _killed_in_save(corpus, {'num_train_steps': 6}, a, dirs, root, at=6)
        runs['after_kill'] = {'steps': checkpoint_read.finished_steps(a),
                              'logged': max(r['step'] for r in metrics.read_jsonl(a))}
        resume = _flags(corpus, num_train_steps=6, mesh_shape=(2, 1, 2), dcn_mesh_shape=(1, 2, 1),
                        **BLEU)
        runs['a2_stdout'] = _two_processes('train.py', [*resume, f'--workdir={a}'], dirs, root)[0]
        evaluate = [*_flags(corpus), f'--workdir={a}']
        runs['watch_stdout'] = _two_processes('evaluate.py', [*evaluate, '--watch'], dirs, root)[0]
        runs['average_stdout'] = _two_processes('evaluate.py', [*evaluate, '--average_last=2'],
                                                dirs, root)[0]
        runs['bucket'] = _bucket_facts(a)
        runs['A'] = _mirror(a, str(root / 'A'))
    runs['hypotheses_2_processes'] = runs['bucket']['hypotheses']['hypotheses-test-step-6.txt']
    runs['scores_2_processes'] = runs['bucket']['scores']['step-6']
    runs['local_gs_dir'] = os.path.exists(os.path.join(ROOT, 'gs:'))

    # The reference: 1 process x 8 devices, FSDP mesh (1, 8, 1): steps 0 -> 8, checkpoints 3, 6, 8.
    runs['reference'] = str(root / 'reference')
    result = loop.train_and_evaluate(
        _config(corpus, num_train_steps=8, mesh_shape=(1, 8, 1), **BLEU), runs['reference'])
    assert result.step == 8
    return runs


@pytest.fixture(scope='module')
def pod_root(tmp_path_factory, worker_id):
    """A directory of this test session, shared by its xdist workers, with jax's compilation
    cache in it (for this module's tests and processes only)."""
    from jax.experimental.compilation_cache import compilation_cache

    root = tmp_path_factory.getbasetemp()
    if worker_id != 'master':
        root = root.parent
    root = root / 'pod'
    root.mkdir(exist_ok=True)
    settings = {'jax_compilation_cache_dir': str(root / 'jax-cache'),
                'jax_persistent_cache_min_compile_time_secs': 0,
                'jax_persistent_cache_min_entry_size_bytes': -1}
    before = {k: getattr(jax.config, k) for k in settings}
    for key, value in settings.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()
    yield root
    for key, value in before.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope='module')
def pod(pod_root):
    """The 2-process runs, once per test session (a lock shares them between xdist workers)."""
    root = pod_root
    with _exclusive(root / '.lock'):
        done = root / 'runs.json'
        if not done.exists():
            try:
                runs = _run_scenario(root)
            except Exception:  # the other workers report it instead of running it again
                runs = {'error': traceback.format_exc()[-8000:]}
            done.write_text(json.dumps(runs))
        runs = json.loads(done.read_text())
    if 'error' in runs:
        pytest.fail(runs['error'], pytrace=False)
    corpus = {'root': root / 'corpus'}
    corpus.update({s: str(root / 'corpus' / f'{s}.tsv') for s in ('train', 'validation', 'test')})
    runs['corpus'] = corpus
    return runs


@pytest.fixture(scope='module')
def reference(pod):
    return pod['reference']


def _params(workdir, step):
    return checkpoint_read.restore_params(workdir, step)


def assert_same_params(workdir_a, workdir_b, step, atol=1e-5):
    a, b = _params(workdir_a, step), _params(workdir_b, step)
    worst = 0.0
    for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(a)[0],
                                 jax.tree_util.tree_flatten_with_path(b)[0], strict=True):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" in name:
            continue  # zero true gradient: see the module docstring
        diff = float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())
        assert diff <= atol, f'step {step}: {name} differs by {diff}'
        worst = max(worst, diff)
    return worst


def _iterator_position(workdir, step) -> dict:
    return checkpoint_read.read_metadata(workdir, step)[checkpoint.ITERATOR_KEY]


def _global_stream(corpus, start, count):
    config = _config(corpus)
    it = pipeline.train_iterator(config, pipeline.get_tokenizer(config))
    batches = [next(it) for _ in range(start + count)]
    return batches[start:]


# --- 2 processes ----------------------------------------------------------------------------------

def test_two_processes_train_and_resume_like_one(pod, reference, capsys):
    worst = {step: assert_same_params(pod['A'], reference, step) for step in (3, 6)}
    with capsys.disabled():
        print(f'\n2 processes vs 1 (key biases aside): max |param diff| {worst}')
    # The training and validation metrics, BLEU included, are those of the 1-process run.
    ours = {(r['step'], k): v for r in metrics.read_jsonl(pod['A']) for k, v in r.items()}
    theirs = {(r['step'], k): v for r in metrics.read_jsonl(reference) for k, v in r.items()}
    for key in [(s, 'loss') for s in range(1, 7)] + [(6, 'eval_loss'), (6, 'eval_bleu'),
                                                       (6, 'eval_chrf')]:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert 'resuming from checkpoint 3' in pod['a2_stdout']
    assert "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in pod['a2_stdout']
    # fsdp spans the processes: each feeds two separate blocks of rows, as the sharding says.
    assert 'process 0 feeds 4 rows of each global batch (0-1, 4-5)' in pod['a2_stdout']
    # The iterator position is a global batch counter, saved once for all processes.
    for step in (3, 6):
        assert _iterator_position(pod['A'], step) == _iterator_position(reference, step) \
            == {'next_index': step}


def test_the_bucket_workdir_survives_a_kill_and_holds_every_record_once(pod):
    assert pod['killed'][0] == -signal.SIGKILL
    # Killed while writing checkpoint 6: only 3 is in the bucket, steps past it were logged.
    assert pod['after_kill']['steps'] == [3] and pod['after_kill']['logged'] == 6
    bucket = pod['bucket']
    records = [json.loads(line) for line in bucket['metrics_text'].splitlines()]
    # The resumed run removed the killed run's records of steps 4-6 and wrote its own, once.
    assert collections.Counter(r['step'] for r in records if 'loss' in r) == \
        collections.Counter(range(1, 7))
    assert [r['step'] for r in records if 'eval_loss' in r] == [6]
    assert sorted(s for tag, s, _ in bucket['events'] if tag == 'loss') == list(range(1, 7))
    assert bucket['finished'] == {'step': 6, 'stopped_by': 'num_train_steps'}
    assert bucket['vocab']  # the run's vocabulary, beside its checkpoints
    # evaluate.py --watch and --average_last=2 on 2 processes wrote to the bucket, once.
    assert sorted(bucket['scores']) == ['avg2-3-6', 'step-3', 'step-6']
    assert sorted(bucket['hypotheses']) == [f'hypotheses-test-{label}.txt'
                                            for label in ('avg2-3-6', 'step-3', 'step-6')]
    assert all(text.count('\n') == 21 for text in bucket['hypotheses'].values())
    assert [json.loads(line)['step'] for line in bucket['watch_text'].splitlines()] == [3, 6]
    assert 'training finished at step 6 (num_train_steps); evaluated 2 new checkpoints' in \
        pod['watch_stdout']
    assert '== avg2-3-6 on' in pod['average_stdout'] and '== step-3 on' in pod['watch_stdout']
    assert not pod['local_gs_dir']  # nothing went to a local directory named 'gs:'


def test_a_host_local_data_dir_gets_process_0s_vocabulary(pod):
    config0, config1 = (_config(pod['corpus'], data_dir=d) for d in pod['data_dirs'])
    vocab0, vocab1 = pipeline.vocab_path(config0), pipeline.vocab_path(config1)
    with open(vocab0, 'rb') as f0, open(vocab1, 'rb') as f1:
        assert f0.read() == f1.read()
    # Process 0 trained it (sentencepiece also writes a .vocab file); process 1 only received it.
    assert os.path.exists(vocab0.replace('.model', '.vocab'))
    assert not os.path.exists(vocab1.replace('.model', '.vocab'))
    # Each built the same packed cache in its own data_dir.
    names = [sorted(os.listdir(os.path.join(d, 'packed'))) for d in pod['data_dirs']]
    assert names[0] == names[1] and len(names[0]) == 1


def _evaluate(config, src_workdir, step, workdir, devices=None):
    """evaluate.py's logic on a copy of checkpoint `step`: (hypotheses text, record)."""
    workdir = _copy_checkpoint(src_workdir, step, workdir)
    results = evaluation.run(config, workdir, progress=False, echo=lambda _: None,
                             devices=devices)
    with open(os.path.join(workdir, f'hypotheses-test-step-{step}.txt'), encoding='utf-8') as f:
        return f.read(), results[f'step-{step}']


def test_evaluate_on_two_processes_one_process_and_one_device_agree(pod, tmp_path):
    config = _config(pod['corpus'])
    assert pod['scores_2_processes']['sentences'] == 21
    assert pod['scores_2_processes']['skipped_too_long'] == 9
    for devices, name in ((None, '8 devices'), (jax.devices()[:1], '1 device')):
        text, record = _evaluate(config, pod['A'], 6, tmp_path / name, devices)
        assert text == pod['hypotheses_2_processes'], name
        for key in ('sacrebleu', 'chrf', 'sentences', 'hit_length_limit'):
            assert record[key] == pod['scores_2_processes'][key], (name, key)


# --- restore anywhere -----------------------------------------------------------------------------

def test_two_processes_continue_on_one_with_the_next_global_batches(pod, reference, tmp_path,
                                                                    monkeypatch):
    workdir = _copy_checkpoint(pod['A'], 6, tmp_path / 'one')
    recorder = _Recorder(monkeypatch)
    config = _config(pod['corpus'], num_train_steps=8, mesh_shape=(1, 8, 1))
    assert loop.train_and_evaluate(config, workdir).step == 8
    # Global batches 6 and 7 of the stream: not a restart, not a repeat.
    for got, want in zip(recorder.batches, _global_stream(pod['corpus'], 6, 2), strict=True):
        assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)
    assert_same_params(workdir, reference, 8)
    assert _iterator_position(workdir, 8) == {'next_index': 8}


def test_fsdp_checkpoint_continues_on_a_data_parallel_mesh(pod, reference, tmp_path):
    workdir = _copy_checkpoint(reference, 3, tmp_path / 'run')
    config = _config(pod['corpus'], num_train_steps=6, mesh_shape=(8, 1, 1))
    assert loop.train_and_evaluate(config, workdir).step == 6
    assert_same_params(workdir, reference, 6)


def test_eight_devices_to_one_and_back(pod, reference, tmp_path):
    workdir = _copy_checkpoint(reference, 3, tmp_path / 'run')
    config = _config(pod['corpus'], num_train_steps=6, mesh_shape=(1, 1, 1))
    assert loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1]).step == 6
    assert_same_params(workdir, reference, 6)
    # evaluate.py: a checkpoint of 1 device gives the same hypotheses on 8 devices as on 1.
    texts = [_evaluate(config, workdir, 6, tmp_path / name, devices)[0]
             for name, devices in (('eval-8', None), ('eval-1', jax.devices()[:1]))]
    assert texts[0] == texts[1] and texts[0].count('\n') == 21
    config.mesh_shape, config.num_train_steps = (1, 8, 1), 8
    assert loop.train_and_evaluate(config, workdir).step == 8
    assert_same_params(workdir, reference, 8)
