"""The pod workflow with a gs:// workdir, against a real Cloud Storage API on localhost
(tests/gcs_server.py), on 2 processes x 4 CPU devices, as a TPU pod slice runs it:

  local   train.py on 2 processes, workdir on the local disk: steps 0 -> 6 (the reference)
  killed  the same run with --workdir=gs://pod/run, SIGKILLed on process 0 while checkpoint 4 is
          written (process 1 is then killed too, as a pod's scheduler does)
  resumed train.py on 2 processes resumes it from checkpoint 2 to step 6
  evaluate.py on 2 processes: --watch, --all, --average_last=2, reading and writing the bucket

Checked: the parameters equal the local run's bit for bit; everything the runs write lands in the
bucket (metrics.jsonl with each step once, TensorBoard events, TRAINING_FINISHED, the
vocabulary, scores, hypotheses, the watcher's records written once), and nothing in a local
directory named 'gs:'.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import jax
import numpy as np
import pytest

from t2t import checkpoint, loop, metrics
from t2t import workdir as wd
from t2t.data import identity
from tests import gcs_server
from tests.test_multiprocess import SETTINGS, _flags, _free_port, _two_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = dict(num_train_steps=6, checkpoint_every_steps=2, eval_every_steps=6)
BUCKET = 'pod'
TIMEOUT_S = 420


def _killed_run(corpus, data_dirs, workdir, log_dir) -> list[int]:
    """tests/kill_driver on 2 processes; process 0 SIGKILLs itself while checkpoint 4 is written.
    Returns both return codes (process 1 is killed once process 0 has died)."""
    port, procs = _free_port(), []
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
           'XLA_FLAGS': '--xla_force_host_platform_device_count=4',
           'JAX_COMPILATION_CACHE_DIR': str(log_dir / 'jax-cache')}
    overrides = {**SETTINGS, **RUN}
    for i in range(2):
        spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
                'overrides': overrides, 'workdir': workdir, 'data_dir': data_dirs[i],
                'action': 'kill_in_save' if i == 0 else 'none', 'at': 4,
                'distributed': {'coordinator': f'localhost:{port}', 'num_processes': 2,
                                'process_id': i}}
        with open(log_dir / f'killed-{i}.err', 'w') as err:
            procs.append(subprocess.Popen([sys.executable, '-m', 'tests.kill_driver',
                                           json.dumps(spec)], cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=err))
    deadline = time.monotonic() + TIMEOUT_S
    while procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    return [p.returncode for p in procs]


def _scenario(root, url) -> dict:
    from tests import toy_corpus

    (root / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(root / 'corpus')
    dirs = [str(root / 'corpus' / 'data'), str(root / 'local1')]
    bucket = gcs_server.make_bucket(url, BUCKET)
    run = f'{bucket}/run'
    out = {'run': run, 'local': str(root / 'local')}
    _two_processes('train.py', [*_flags(corpus, **RUN), f'--workdir={out["local"]}'], dirs, root)

    out['killed_returncodes'] = _killed_run(corpus, dirs, run, root)
    out['steps_after_kill'] = checkpoint.finished_steps(run)
    out['finished_after_kill'] = loop.read_finished(run)
    out['resumed_stdout'] = _two_processes('train.py', [*_flags(corpus, **RUN), f'--workdir={run}'],
                                           dirs, root)[0]
    flags = [*_flags(corpus), f'--workdir={run}']
    out['watch_stdout'] = _two_processes('evaluate.py', [*flags, '--watch', '--timeout=60'],
                                         dirs, root)[0]
    out['all_stdout'] = _two_processes('evaluate.py', [*flags, '--all'], dirs, root)[0]
    out['average_stdout'] = _two_processes('evaluate.py', [*flags, '--average_last=2'],
                                           dirs, root)[0]
    return out


# One worker runs every test of this module (make test: pytest -n 2 --dist loadgroup): the
# scenario and its bucket live in this module's fixture.
pytestmark = pytest.mark.xdist_group('gcs_pod')


@pytest.fixture(scope='module')
def pod(tmp_path_factory):
    with gcs_server.serve() as url:
        yield _scenario(tmp_path_factory.mktemp('gcs-pod'), url)


def test_gs_workdir_killed_and_resumed_on_two_processes_equals_the_local_run(pod):
    assert pod['killed_returncodes'][0] == -signal.SIGKILL
    assert pod['steps_after_kill'] == [2] and pod['finished_after_kill'] is None
    assert f'resuming from checkpoint 2 in {pod["run"]}' in pod['resumed_stdout']
    assert checkpoint.finished_steps(pod['run']) == checkpoint.finished_steps(pod['local'])
    for step in (2, 4, 6):  # bit for bit: the same program on the same data, resumed exactly
        ours = jax.tree.leaves(checkpoint.restore_params(pod['run'], step))
        theirs = jax.tree.leaves(checkpoint.restore_params(pod['local'], step))
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f'step {step}')
    assert loop.read_finished(pod['run']) == {'step': 6, 'stopped_by': 'num_train_steps'}
    assert not os.path.exists(os.path.join(ROOT, 'gs:'))


def test_metrics_land_in_the_bucket_each_step_once(pod):
    lines = wd.read_text(wd.path(pod['run'], metrics.JSONL_NAME)).splitlines()
    train_steps = Counter(json.loads(line)['step'] for line in lines if '"loss"' in line)
    assert train_steps == Counter(range(1, 7))  # the killed run's steps 3-4 were truncated
    ours = {r['step']: r['loss'] for r in metrics.read_jsonl(pod['run'])}
    theirs = {r['step']: r['loss'] for r in metrics.read_jsonl(pod['local'])}
    assert ours == theirs
    events = [(s, v) for tag, s, v in metrics.read_events(pod['run']) if tag == 'loss']
    assert sorted(s for s, _ in events) == list(range(1, 7))
    assert wd.exists(wd.path(pod['run'], identity.VOCAB_NAME))


def test_evaluate_reads_and_writes_the_bucket_once(pod):
    scores = json.loads(wd.read_text(wd.path(pod['run'], 'eval-test.json')))
    assert sorted(scores) == ['avg2-4-6', 'step-2', 'step-4', 'step-6']
    for label, record in scores.items():
        hypotheses = wd.read_text(record['hypotheses_file'])
        assert record['hypotheses_file'] == f'{pod["run"]}/hypotheses-test-{label}.txt'
        assert hypotheses.count('\n') == record['sentences'] == 21
    watched = wd.read_text(wd.path(pod['run'], 'watch-test', metrics.JSONL_NAME)).splitlines()
    assert [json.loads(line)['step'] for line in watched] == [2, 4, 6]  # process 0 alone wrote
    assert 'training finished at step 6 (num_train_steps); evaluated 3 new checkpoints' in \
        pod['watch_stdout']
    assert '== avg2-4-6 on' in pod['average_stdout'] and '== step-4 on' in pod['all_stdout']
