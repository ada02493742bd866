"""Best checkpoints and early stopping (keep_best, best_metric, early_stopping_patience): the
ranking, the checkpoints kept beside keep_checkpoints' newest, the stop, and kill + resume."""

import json
import signal
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from t2t.infra import metrics
from t2t.run import best, checkpoint, checkpoint_read, config_checks, run_record
from t2t.run.checkpoint_read import CheckpointError
from t2t.train import loop
from tests import toy_corpus
from tests.conftest import ROOT, one_device_env
from tests.test_bucket_eval import _config_flags
from tests.test_resume import _drive

pytestmark = pytest.mark.xdist_group(__name__)

# An evaluation at every step; a learning rate so high that the validation loss jumps about:
# measured, 13.92 at step 1, then 17.26, 15.38, 18.46, so patience 3 stops the run at step 4
# and the two best steps are 1 and 3. keep_checkpoints=1 would keep step 4 alone.
SETTINGS = dict(num_train_steps=10, log_every_steps=5, eval_every_steps=1,
                checkpoint_every_steps=5, keep_checkpoints=1, eval_bleu_sentences=0,
                num_eval_batches=1, max_len=32, eval_batch_size=8, keep_best=2,
                early_stopping_patience=3, learning_rate_scale=5.0, warmup_steps=1)


def _tracker(metric='bleu', keep=2, patience=2, record=None):
    config = ml_collections.ConfigDict(dict(best_metric=metric, keep_best=keep,
                                            early_stopping_patience=patience))
    return best.Tracker.from_config(config, record)


def test_the_ranking_of_evaluations():
    tracker = _tracker('bleu', keep=2, patience=2)
    for step, value in ((10, 5.0), (20, 7.0), (30, 7.0)):
        tracker.update({'eval_bleu': value}, step)
    assert tracker.since_best == 1 and not tracker.exhausted()  # a tie is no improvement
    tracker.update({'eval_bleu': float('nan')}, 40)  # nor is NaN: 2 of 2
    assert tracker.exhausted()
    # Higher BLEU first; the tie ranks the older step first; NaN never ranks.
    assert tracker.kept_steps() == [20, 30]
    assert (tracker.best_value, tracker.best_step, tracker.since_best) == (7.0, 20, 2)
    # The record survives JSON (the checkpoint's metadata) and continues exactly.
    again = _tracker('bleu', keep=2, patience=2, record=json.loads(json.dumps(tracker.record())))
    assert again == tracker
    again.update({'eval_bleu': 6.5}, 50)  # displaces nothing: 6.5 is below both kept
    assert again.kept_steps() == [20, 30] and again.since_best == 3

    loss = _tracker('loss_ema', keep=1, patience=0)  # lower is better; no patience: never stops
    for step, value in ((1, 3.0), (2, 2.5), (3, 2.7)):
        line = loss.update({'eval_loss_ema': value}, step)
    assert loss.kept_steps() == [2] and not loss.exhausted()
    assert line == 'step 3: eval_loss_ema 2.7; best 2.5 at step 2; kept 2'
    # A record of another metric starts afresh; a smaller keep_best drops the worst kept.
    assert _tracker('chrf', record=tracker.record()).best_step is None
    assert _tracker('bleu', keep=1, record=tracker.record()).kept_steps() == [20]


def test_bad_values_are_one_line(tmp_path):
    config = toy_corpus.tiny_config({'root': tmp_path, 'train': '', 'validation': '',
                                     'test': ''}, keep_best=2, eval_bleu_sentences=0)
    assert config_checks.problem(config) is None  # best_metric='loss' needs no BLEU
    config.best_metric = 'bleu'
    assert config_checks.problem(config) == ("best_metric='bleu' needs eval_bleu_sentences > 0 "
                                             '(BLEU and chrF are scored during training only then)')
    config.best_metric, config.eval_bleu_sentences = 'chrf_ema', 8
    assert config_checks.problem(config) == \
        "best_metric='chrf_ema' needs ema_decay > 0 (the EMA weights it ranks)"
    config.best_metric = 'accuracy'
    assert config_checks.problem(config).startswith("best_metric='accuracy' must be one of (")
    config.best_metric, config.early_stopping_patience = 'loss', -1
    assert config_checks.problem(config) == 'early_stopping_patience=-1 must be >= 0 (0: off)'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


@pytest.fixture(scope='module')
def reference(corpus, tmp_path_factory):
    """One uninterrupted run: it stops early at step 4."""
    config = toy_corpus.tiny_config(corpus, **SETTINGS)
    workdir = tmp_path_factory.mktemp('best') / 'run'
    result = loop.train_and_evaluate(config, str(workdir))
    return {'config': config, 'workdir': workdir, 'result': result,
            'record': checkpoint_read.read_metadata(workdir)[best.META_KEY]}


def test_the_best_stay_beside_the_newest_and_patience_stops_the_run(reference):
    workdir, record = reference['workdir'], reference['record']
    assert (reference['result'].step, reference['result'].stopped_by) == (4, 'early_stopping')
    assert run_record.read_finished(workdir) == {'step': 4, 'stopped_by': 'early_stopping'}
    # The train metrics of the steps since the last log (none: log_every_steps=5) are written.
    assert [r['step'] for r in metrics.read_jsonl(workdir) if 'loss' in r] == [4]
    assert record['since_best'] == 3 and record['best_step'] == 1
    assert [step for _, step in record['top']] == [1, 3]
    # Step 2 was saved as second best, then displaced by 3 and deleted; 1 and 3 outlive
    # keep_checkpoints=1 (4, the newest, is its one).
    assert checkpoint_read.finished_steps(workdir) == [1, 3, 4]
    step, what = best.best_step(workdir)
    assert step == 1 and what == f'eval_loss {record["top"][0][0]:.4g}'


def test_killed_and_resumed_the_ranking_and_the_stop_are_those_of_one_run(corpus, reference,
                                                                         tmp_path):
    workdir = tmp_path / 'run'
    # SIGKILL while step 3 (then second best) is written: the resume starts from step 2, with 1
    # evaluation without improvement and the best at 1; forgetting either would stop later.
    killed = _drive(corpus, workdir, 'kill_in_save', at=3, overrides=SETTINGS)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint_read.finished_steps(workdir) == [1, 2]
    assert checkpoint_read.read_metadata(workdir)[best.META_KEY]['since_best'] == 1
    result = loop.train_and_evaluate(reference['config'], str(workdir))
    assert (result.step, result.stopped_by) == (4, 'early_stopping')
    assert checkpoint_read.read_metadata(workdir)[best.META_KEY] == reference['record']
    assert checkpoint_read.finished_steps(workdir) == [1, 3, 4]
    # Started again, a stopped run has nothing to train.
    again = loop.train_and_evaluate(reference['config'], str(workdir))
    assert (again.step, again.stopped_by) == (4, 'early_stopping')
    assert checkpoint_read.finished_steps(workdir) == [1, 3, 4]


def test_evaluate_best_without_a_best_is_one_line(corpus, tmp_path):
    config = toy_corpus.tiny_config(corpus)  # keep_best=0
    workdir = tmp_path / 'plain'
    checkpoint.write_averaged(str(workdir), {'w': np.zeros(2, np.float32)}, 7, config)
    with pytest.raises(CheckpointError) as error:
        best.best_step(workdir)
    assert str(error.value) == (f'no best checkpoint in {workdir}/checkpoints (newest checkpoint '
                                '7): the run kept none (keep_best=0)')


def test_evaluate_py_best_scores_the_best_checkpoint_not_the_newest(reference):
    """The public entry point: evaluate.py --best reads the ranking the run saved (best step 1,
    newest 4) and decodes the test split with step 1."""
    workdir = reference['workdir']
    proc = subprocess.run(
        [sys.executable, 'evaluate.py', *_config_flags(reference['config']), f'--workdir={workdir}',
         '--best', '--config.beam_size=1', '--config.max_decode_extra=2'],
        cwd=ROOT, env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    best_loss = reference['record']['top'][0][0]
    assert f'the best checkpoint: step 1 (eval_loss {best_loss:.4g})' in proc.stderr
    assert '== step-1 on ' in proc.stdout and 'step-4' not in proc.stdout
    scores = json.loads((workdir / 'eval-test.json').read_text(encoding='utf-8'))
    assert list(scores) == ['step-1'] and scores['step-1']['steps'] == [1]
    hypotheses = (workdir / 'hypotheses-test-step-1.txt').read_text(encoding='utf-8')
    assert len(hypotheses.splitlines()) == scores['step-1']['sentences'] == 21
