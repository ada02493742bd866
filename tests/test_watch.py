"""evaluate.py --watch beside a training run: each finished checkpoint once, then it stops."""

import collections
import json
import os
import subprocess
import sys

import pytest

from t2t import data
from t2t.eval import watch
from t2t.infra import metrics
from t2t.run import checkpoint_read
from tests import toy_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = dict(num_train_steps=12, log_every_steps=4, eval_every_steps=12, checkpoint_every_steps=4,
             keep_checkpoints=5, eval_bleu_sentences=0, num_eval_batches=1, max_len=32,
             eval_batch_size=8)


def test_watch_evaluates_each_checkpoint_once_while_training_runs(tmp_path, monkeypatch):
    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus')
    config = toy_corpus.tiny_config(corpus, **TRAIN, beam_size=2, max_decode_extra=2)
    data.get_tokenizer(config)  # trained once here, not by both processes at the same time
    workdir = tmp_path / 'run'
    spec = {'corpus': {k: str(v) for k, v in corpus.items() if k != 'validation_texts'},
            'overrides': TRAIN, 'workdir': str(workdir), 'action': 'none'}
    training = subprocess.Popen([sys.executable, '-m', 'tests.kill_driver', json.dumps(spec)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    reads = []
    real_restore = checkpoint_read.restore_params

    def restore_finished_only(workdir_, step=None, abstract_params=None, weights='raw'):
        # Never a step orbax has not finalized (its temporary directory is still being written).
        assert step in checkpoint_read.finished_steps(workdir_)
        reads.append(step)
        return real_restore(workdir_, step, abstract_params, weights)

    monkeypatch.setattr(checkpoint_read, 'restore_params', restore_finished_only)
    try:
        lines = []
        results = watch.run(config, str(workdir), poll_s=0.2, timeout_s=600, echo=lines.append)
        _, stderr = training.communicate(timeout=600)
    finally:
        training.kill()
    assert training.returncode == 0, stderr[-2000:]
    assert sorted(results) == reads == [4, 8, 12]
    assert 'training finished at step 12 (num_train_steps)' in lines[-1]
    logdir = workdir / 'watch-test'
    records = metrics.read_jsonl(logdir)
    assert [r['step'] for r in records] == [4, 8, 12]
    assert records[-1]['eval/sacrebleu'] == results[12]['sacrebleu']
    with open(workdir / 'eval-test.json', encoding='utf-8') as f:
        assert set(json.load(f)) == {'step-4', 'step-8', 'step-12'}

    # Restartable: as if killed after step 12's events but before its record, a restarted watcher
    # evaluates step 12 alone and leaves one value per step in the scores and the events.
    jsonl = logdir / metrics.JSONL_NAME
    jsonl.write_text(''.join(jsonl.read_text().splitlines(keepends=True)[:2]))
    reads.clear()
    again = watch.run(config, str(workdir), poll_s=0.2, timeout_s=60, echo=lambda _: None)
    assert sorted(again) == reads == [12]
    assert [r['step'] for r in metrics.read_jsonl(logdir)] == [4, 8, 12]
    events = collections.Counter((tag, step) for tag, step, _ in metrics.read_events(logdir))
    assert set(events.values()) == {1}
    assert {step for _, step in events} == {4, 8, 12}
    assert {tag for tag, _ in events} == {'eval/sacrebleu', 'eval/chrf', 'eval/tok_bleu',
                                         'eval/hit_length_limit'}
    assert watch.run(config, str(workdir), poll_s=0.2, timeout_s=60, echo=lambda _: None) == {}


def test_watch_gives_up_after_the_timeout_without_checkpoints(tmp_path):
    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus', train=60, validation=4, test=4)
    config = toy_corpus.tiny_config(corpus)
    now = [0.0]
    lines = []
    result = watch.run(config, str(tmp_path / 'not-yet'), timeout_s=30, poll_s=10,
                       echo=lines.append, clock=lambda: now[0],
                       sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert result == {} and now[0] == pytest.approx(40)
    assert 'no new checkpoint for 30 s' in lines[-1]


def test_watch_with_an_ensemble_is_one_line_before_any_compile():
    proc = subprocess.run(
        [sys.executable, 'evaluate.py', '--config=configs/tiny.py', '--workdir=/nonexistent',
         '--watch', '--ensemble=1,2'], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'evaluate.py: --watch with --ensemble is not supported: --watch evaluates the '
        'checkpoints of one run (--workdir) as they come']
