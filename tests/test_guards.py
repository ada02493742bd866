"""Divergence guards: the fraction of clipped steps, spike_skip and rollback_after, through the
training loop with poisoned batches."""

import json
import os

import numpy as np
import pytest

from t2t import data
from t2t.infra import metrics
from t2t.run import checkpoint_read, config_checks
from t2t.train import guards, loop
from t2t.train.interval import Interval
from tests import toy_corpus
from tests.helpers import tiny_config
from tests.test_numbers import _log, _step_metrics
from tests.test_resume import _final_state

pytestmark = pytest.mark.xdist_group(__name__)

CLIP = 2.5
# Batches 3, 5 and 6 (0-based global batches: steps 4, 6 and 7) are poisoned. Measured on this
# toy run, a poisoned batch's loss is about 6.8 while the three steps before it are 6.5, 6.0,
# 5.3 (mean + 1 std about 6.4), and the clipped steps are 1 and 4 (grad norms 2.8, 6.7).
POISONED = (3, 5, 6)
SETTINGS = dict(num_train_steps=7, log_every_steps=1, eval_every_steps=100,
                checkpoint_every_steps=2, keep_checkpoints=10, eval_bleu_sentences=0,
                num_eval_batches=1, max_len=32, eval_batch_size=8, spike_skip=1.0,
                spike_window=3, rollback_after=2, clip_grad_norm=CLIP)


class _Poisoned:
    """The training iterator, with every target token of the POISONED global batches replaced
    by one id: a loss far above the recent ones."""

    def __init__(self, inner):
        self.inner = inner

    def __next__(self):
        at = self.inner.get_state()['next_index']
        batch = next(self.inner)
        if at in POISONED:
            batch = dict(batch, targets=np.where(batch['targets'] > 0, 7, 0).astype(
                batch['targets'].dtype))
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)


def test_the_clipped_fraction_is_over_the_log_interval_also_across_a_resume():
    config = tiny_config(clip_grad_norm=1.0, spike_skip=2.0)
    steps = [dict(_step_metrics(3.0, 10.0), clipped=c, spikes=s)
             for c, s in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.0))]
    first = Interval()
    first.add(1, steps[0])
    carried = json.loads(json.dumps(first.unlogged()))  # a checkpoint after step 1
    assert (carried['clipped'], carried['window_steps'], carried['spikes']) == (1, 1, 0)
    resumed = Interval(carried)
    resumed.add(2, steps[1])
    resumed.add(3, steps[2])
    logged = _log(resumed, config, 3)
    assert logged['clipped_steps_fraction'] == pytest.approx(2 / 3, rel=1e-12)
    assert logged['spike_skipped_steps'] == 1 and logged['skipped_steps'] == 1
    # Without the options nothing new is summed or logged.
    plain = Interval()
    plain.add(1, _step_metrics(3.0, 10.0))
    assert set(plain.unlogged()) == {'loss_sum', 'nll_sum', 'correct_sum', 'tokens', 'nonfinite'}
    assert 'clipped_steps_fraction' not in _log(plain, tiny_config(), 1)


def test_rollback_needs_a_skipping_option():
    config = tiny_config(rollback_after=3)
    keys = ('rollback_after', 'spike_window')
    assert config_checks.problem(config, keys) == ('rollback_after=3 needs spike_skip > 0 or '
                                                   'skip_nonfinite=True (the steps it counts '
                                                   'are skipped ones)')
    config.spike_skip, config.spike_window = 2.0, 1
    assert config_checks.problem(config, keys) == ('spike_window=1 must be >= 2 (steps whose '
                                                   'loss spread spike_skip measures)')


def test_a_poisoned_batch_is_skipped_and_a_run_of_them_rolls_back(tmp_path, monkeypatch):
    (tmp_path / 'corpus').mkdir()
    corpus = toy_corpus.make_corpus(tmp_path / 'corpus')
    original = data.train_iterator
    monkeypatch.setattr(data, 'train_iterator', lambda *a, **k: _Poisoned(original(*a, **k)))
    config = tiny_config(corpus, **SETTINGS)
    workdir = tmp_path / 'run'
    result = loop.train_and_evaluate(config, str(workdir))
    assert (result.step, result.stopped_by) == (7, 'num_train_steps')

    # Steps 6 and 7 were skipped in a row: back to checkpoint 4 (the newest before them), the
    # data past batch 6; checkpoint 6 moved aside (its step is trained again on other data).
    assert guards.read(workdir) == [{'at_step': 7, 'run': 2, 'to_step': 4, 'from_batch': 4,
                                     'next_batch': 7}]
    assert [n.split('-')[0] for n in os.listdir(workdir / guards.ROLLED_BACK)] == ['6']
    assert checkpoint_read.finished_steps(workdir) == [2, 4, 6, 7]
    assert checkpoint_read.read_metadata(workdir)['data_iterator']['next_index'] == 10

    logged = [r for r in metrics.read_jsonl(workdir) if 'loss' in r]
    assert [r['step'] for r in logged] == list(range(1, 8))  # the rolled-back ones replaced
    # The recent losses came through the checkpoint: 3 applied steps before it, 3 after.
    guard = _final_state(config, workdir, 7).guard
    assert (int(guard['count']), int(guard['skip_run'])) == (6, 0)
    records = {r['step']: r for r in logged}
    np.testing.assert_array_equal(guard['losses'][[0, 1, 2]], np.float32(
        [records[s]['loss'] for s in (5, 6, 7)]))  # the ring's slots 3 % 3, 4 % 3, 5 % 3
    # Step 4's poisoned batch was skipped, and counted; no other step of this lineage was.
    assert [records[s]['spike_skipped_steps'] for s in range(1, 8)] == [0, 0, 0, 1, 0, 0, 0]
    assert records[7]['skipped_steps_total'] == 1
    # With one step per log the fraction of clipped steps is each step's own clipping.
    for r in records.values():
        assert r['clipped_steps_fraction'] == float(r['grad_norm'] > CLIP)
    assert {records[1]['clipped_steps_fraction'], records[2]['clipped_steps_fraction']} == {0, 1}
