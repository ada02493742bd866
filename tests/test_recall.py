"""The recall toy: generated splits, its fixed vocabulary, and a small model that learns it by
attending to source position 0."""

import pickle

import jax
import numpy as np
import pytest

from configs import recall_toy
from t2t.data import EOS_ID, UNK_ID, cache, recall, sources
from t2t.eval import attention_maps
from t2t.train import loop

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


def _config(tmp_path, **overrides):
    c = recall_toy.get_config()
    c.data_dir = str(tmp_path / 'data')
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


def test_splits_are_deterministic_disjoint_and_answer_the_first_symbol(tmp_path):
    config = _config(tmp_path, recall_length=7, recall_train_examples=3000,
                     recall_eval_examples=200)
    splits = {s: sources.open_split(config, s).read(0, 10**6)
              for s in ('train', 'validation', 'test')}
    assert [len(splits[s]) for s in splits] == [3000, 200, 200]
    assert splits == {s: sources.open_split(config, s).read(0, 10**6) for s in splits}
    seen = {s: {src for src, _ in pairs} for s, pairs in splits.items()}
    assert not seen['train'] & seen['validation'] and not seen['train'] & seen['test']
    assert not seen['validation'] & seen['test']
    assert len(seen['test']) == 200  # held-out sequences are distinct
    for src, tgt in splits['train'][:200] + splits['test']:
        symbols = src.split()
        assert len(symbols) == 7 and tgt == symbols[0] in recall.FIRST_SYMBOLS
        assert set(symbols[1:]) <= set(recall.OTHER_SYMBOLS)
    assert {t for _, t in splits['test']} == {'0', '1'}
    config.recall_length = 9  # another length gives other data and another cache key
    assert sources.dataset_id(config) != sources.dataset_id(_config(tmp_path, recall_length=7))
    assert config.max_len == 10 and config.max_eval_len == 10  # they follow recall_length
    with pytest.raises(ValueError, match='more than half the test sequences'):
        recall.generate(4, 'test', 10, 0, distinct=True)
    config.recall_distractors = True  # the answers occur later too: only position 0 tells
    later = [s.split()[1:] for s, _ in sources.open_split(config, 'test').read(0, 200)]
    assert {'0', '1'} <= {symbol for symbols in later for symbol in symbols}


def test_tokenizer_has_fixed_ids_and_the_sentencepiece_interface(tmp_path):
    config = _config(tmp_path)
    tok = recall.tokenizer(config)
    assert tok.vocab_size == 9 == config.vocab_size
    assert tok.encode('1 a d') == [4, 5, 8] and tok.encode('x') == [UNK_ID]
    assert tok.decode([3, 6, EOS_ID, 7]) == '0 b' and tok.piece(EOS_ID) == '</s>'
    assert cache.tokenize(tok, ['0 c']) == [[3, 7, EOS_ID]]
    assert pickle.loads(pickle.dumps(tok)).encode('0 c') == [3, 7]
    with pytest.raises(ValueError, match='recall_length=1'):
        recall.generate(1, 'train', 1, 0, distinct=False)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A small recall model trained to its end, on one device (nothing here is about sharding;
    8 virtual devices on 2 cores only add partitioning work to every step)."""
    root = tmp_path_factory.mktemp('recall')
    config = _config(root, recall_train_examples=4000, recall_eval_examples=256,
                     num_train_steps=150, log_every_steps=50, eval_every_steps=150,
                     checkpoint_every_steps=150)
    workdir = str(root / 'run')
    result = loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    return config, workdir, result


def test_recall_is_learned_and_the_answer_attends_to_position_0(trained):
    config, workdir, result = trained
    assert result.step == 150
    report = attention_maps.recall_report(config, workdir)
    assert report.examples == 256 and report.label == 'step-150'
    assert report.accuracy >= 0.99, report.format()
    layer, head, weight = report.best
    assert weight > 0.5, report.format()
    assert report.first_weights_LH.shape == report.encoder_weights_LH.shape == (2, 4)
    for weights in (report.first_weights_LH, report.encoder_weights_LH):
        assert np.all((weights >= 0) & (weights <= 1))
    assert f'layer {layer} head {head}: {weight:.3f}' in report.format()
    assert sorted(report.by_answer) == ['0', '1']  # the mean over both answers, per answer too
    share = np.mean([report.by_answer[a] for a in '01'], axis=0)  # both answers are ~half
    np.testing.assert_allclose(report.first_weights_LH, share, atol=0.1)
