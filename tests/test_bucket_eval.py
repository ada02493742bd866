"""evaluate.py with its workdir in a bucket (a real Cloud Storage API on localhost,
tests/gcs_server.py): --watch sees every checkpoint a training beside it writes, concurrent merges
of eval-<split>.json keep every record, and a storage failure is one line."""

import http.server
import json
import subprocess
import threading
import time

import pytest

from t2t.eval import evaluation
from t2t.infra import workdir as wd
from tests import gcs_server
from tests.helpers import tiny_config

# One server for the module: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope='module')
def bucket():
    with gcs_server.serve() as url:
        yield gcs_server.make_bucket(url, 'evals')


@pytest.mark.parametrize('where', ['local', 'bucket'])
def test_concurrent_merges_keep_every_label(where, bucket, tmp_path):
    path = wd.path(tmp_path if where == 'local' else f'{bucket}/merge', 'eval-test.json')
    start = threading.Barrier(2)
    errors = []

    def writer(name: str) -> None:
        try:
            start.wait()
            for i in range(30):
                evaluation.merge_json(path, f'{name}-{i}', {'sacrebleu': float(i)})
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ('a', 'b')]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    merged = json.loads(wd.read_text(path))
    assert sorted(merged) == sorted(f'{n}-{i}' for n in 'ab' for i in range(30))
    assert merged['b-29'] == {'sacrebleu': 29.0}


# Training beside the watcher: a checkpoint every 2 steps, all kept, so each is there to evaluate.
TRAIN = dict(num_train_steps=12, checkpoint_every_steps=2, keep_checkpoints=20, log_every_steps=6,
             eval_every_steps=12, eval_bleu_sentences=0, num_eval_batches=1, max_eval_len=16,
             eval_batch_size=4, beam_size=1, max_decode_extra=2, num_encoder_layers=1,
             num_decoder_layers=1)


def _config_flags(config) -> list[str]:
    """--config flags giving evaluate.py `config` (configs/tiny.py and the keys that differ)."""
    from configs import tiny

    base = tiny.get_config()
    flags = ['--config=configs/tiny.py']
    flags += [f'--config.{k}={config[k]}' for k in config
              if k != 'tsv_files' and config[k] != base[k]]
    return flags + [f'--config.tsv_files.{s}={config.tsv_files[s]}'
                    for s in ('train', 'validation', 'test')]


def _started(command, env, lines: list) -> tuple[subprocess.Popen, threading.Thread]:
    """The script command (stdout and stderr together), each line kept as (arrival time, text)."""
    from tests.helpers import start_script

    proc = start_script(*command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip('\n')))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, reader


def test_watch_on_a_bucket_evaluates_every_checkpoint_once(bucket, tmp_path):
    """The watcher lists checkpoints/ afresh at each poll (gcsfs's listing cache is off): with
    the cache it saw only the first listing, here step 2 of 2..12, and stopped with exit 0."""
    from t2t import data
    from t2t.infra import metrics
    from t2t.run import checkpoint_read
    from tests import toy_corpus

    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus', train=200, validation=4, test=4,
                                    long_validation=0)
    config = tiny_config(corpus, **TRAIN)
    data.get_tokenizer(config)  # trained once here, not by both processes at the same time
    workdir = f'{bucket}/watched'
    env = {'PYTHONUNBUFFERED': '1'}
    spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
            'overrides': TRAIN, 'workdir': workdir, 'action': 'none'}
    watched, trained = [], []
    watcher, watch_reader = _started(
        ['evaluate.py', *_config_flags(config), f'--workdir={workdir}', '--watch', '--poll=0.2',
         '--timeout=300'], env, watched)
    training, train_reader = _started(['-m', 'tests.kill_driver', json.dumps(spec)], env, trained)
    try:
        training.wait(timeout=300)
        watcher.wait(timeout=300)
    finally:
        for proc in (training, watcher):
            proc.kill()
            proc.wait()
    train_reader.join(10)
    watch_reader.join(10)
    out = [line for _, line in watched]
    assert training.returncode == 0, '\n'.join(line for _, line in trained)[-3000:]
    assert watcher.returncode == 0, '\n'.join(out)[-3000:]
    # The watcher polled from before the checkpoint of step 6 (logged after it) to the end.
    polling = next(t for t, line in watched if line.startswith(f'watching {workdir}'))
    assert polling < next(t for t, line in trained if line.startswith('step 6 |'))
    steps = list(range(2, 13, 2))
    assert checkpoint_read.finished_steps(workdir) == steps
    # Each step once: in the watcher's records, in eval-test.json, in what it printed.
    assert [r['step'] for r in metrics.read_jsonl(wd.path(workdir, 'watch-test'))] == steps
    assert sorted(json.loads(wd.read_text(wd.path(workdir, 'eval-test.json')))) == sorted(
        f'step-{s}' for s in steps)
    assert [line.split()[1] for line in out if line.startswith('== step-')] == [
        f'step-{s}' for s in steps]
    assert f'training finished at step 12 (num_train_steps); evaluated {len(steps)} new ' \
           'checkpoints' in out[-1]


class _Refusing(http.server.BaseHTTPRequestHandler):
    """A Cloud Storage endpoint that refuses every request (403), as a bucket the caller has no
    access to: the real server has no access control."""

    def _refuse(self):
        body = json.dumps({'error': {'code': 403, 'message': 'the caller does not have '
                                     'storage.objects.get access'}}).encode()
        self.send_response(403)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _refuse

    def log_message(self, *args):
        pass


def test_a_refused_bucket_is_one_line_and_exit_1(tmp_path):
    from t2t.infra import exits
    from tests.helpers import run_script

    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = run_script('evaluate.py', '--config=configs/tiny.py', '--workdir=gs://refused/run',
                         '--watch', timeout=120,
                         env=gcs_server.environment(f'http://127.0.0.1:{server.server_port}'))
    finally:
        server.shutdown()
    # Not transient (a restart is refused again): ERROR, not STORAGE.
    assert run.returncode == exits.ERROR
    assert run.stderr.splitlines() == ['evaluate.py: storage: OSError: Forbidden: b/refused/o']


def test_attention_picture_lands_in_a_bucket_workdir(bucket):
    import numpy as np

    from t2t.eval import attention_maps

    rng = np.random.default_rng(0)
    source, output = ['▁a', '▁cat', '</s>'], ['▁CAT', '▁A', '</s>']

    def weights(queries, keys):  # rows of softmax weights
        w = rng.random((2, len(queries), len(keys)))
        return w / w.sum(-1, keepdims=True)

    maps = attention_maps.SentenceMaps(
        label='step-1', translation='CAT A', source_pieces=source, output_pieces=output,
        decoder_input_pieces=[attention_maps.START_PIECE, *output[:-1]],
        weights={attention_maps.KINDS[0]: [weights(source, source)],
                 attention_maps.KINDS[1]: [weights(output, output)],
                 attention_maps.KINDS[2]: [weights(output, source)]})
    workdir = f'{bucket}/pictures'
    path = attention_maps.default_output(workdir)
    assert str(path) == f'{workdir}/attention.png'
    figure = attention_maps.plot(maps, path)
    assert len(figure.axes) == 3 * 2  # 1 layer x 2 heads per kind
    assert wd.read_bytes(path)[:8] == b'\x89PNG\r\n\x1a\n'
    assert [p.name for p in wd.glob(workdir, '*')] == ['attention.png']  # nothing else left
