"""Subword regularization (t2t/data/subword.py): spm_alpha 0 keeps the prepared rows exactly;
alpha > 0 samples valid segmentations, reproducible per seed, resumed bit for bit, training only."""

import hashlib

import grain
import numpy as np
import pytest

from t2t.data import cache, packing, pipeline, subword
from t2t.ids import EOS_ID
from t2t.run import config_checks
from tests import toy_corpus
from tests.helpers import run_script, tiny_config

_config = tiny_config


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('subword'))


@pytest.fixture(scope='module')
def tokenizer(corpus):
    return pipeline.get_tokenizer(_config(corpus))


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _segments(row_tokens, row_segment_ids):
    return [row_tokens[row_segment_ids == s] for s in range(1, int(row_segment_ids.max()) + 1)]


def test_alpha_zero_is_the_prepared_rows_exactly(corpus, tokenizer):
    config = _config(corpus)
    assert config.spm_alpha == 0
    packed = cache.packed_split(config, tokenizer, 'train')
    assert pipeline.train_rows(config, tokenizer).meta == packed.meta  # the same identity
    order = grain.MapDataset.range(packed.num_rows).shuffle(seed=config.shuffle_seed).repeat()
    it = pipeline.train_iterator(config, tokenizer)
    for k in range(2 * packed.num_rows // 8 + 1):  # two epochs and more
        expected = packed.gather(np.array([order[8 * k + j] for j in range(8)]))
        assert _equal(next(it), expected)


def test_sampled_segmentations_are_valid_reproducible_and_resume(corpus, tokenizer):
    config = _config(corpus, spm_alpha=0.1)
    best_it = pipeline.train_iterator(_config(corpus), tokenizer)
    it = pipeline.train_iterator(config, tokenizer)
    n = 12  # past the first epoch
    best, sampled = _take(best_it, n), _take(it, n)
    segments = changed = 0
    for b, s in zip(best, sampled, strict=True):
        assert s.keys() == b.keys() and all(v.shape == b[k].shape for k, v in s.items())
        for side in ('inputs', 'targets'):
            np.testing.assert_array_equal(s[f'{side}_positions'],
                                          packing.positions(s[f'{side}_segment_ids']))
            for r in range(len(b[side])):
                one = _segments(b[side][r], b[f'{side}_segment_ids'][r])
                two = _segments(s[side][r], s[f'{side}_segment_ids'][r])
                assert len(one) == len(two)  # the same pairs, in the same row
                for x, y in zip(one, two, strict=True):
                    assert y[-1] == EOS_ID and EOS_ID not in y[:-1]
                    assert tokenizer.decode(y) == tokenizer.decode(x)  # the same text
                    segments += 1
                    changed += len(x) != len(y) or (x != y).any()
    assert changed > 0.3 * segments, (changed, segments)
    # the same seed gives the same draws; a resumed iterator continues bit for bit
    state = it.get_state()
    expected = _take(it, 4)
    again = pipeline.train_iterator(config, tokenizer)
    assert all(_equal(a, b) for a, b in zip(_take(again, n), sampled, strict=True))
    again.set_state(state)
    assert all(_equal(a, b) for a, b in zip(_take(again, 4), expected, strict=True))
    # a process feeding rows [2, 3, 6, 7] gets those rows of the same global batches
    part = pipeline.train_iterator(config, tokenizer, rows=[2, 3, 6, 7])
    for a, b in zip(_take(part, 3), sampled[:3], strict=True):
        assert all((a[k] == b[k][[2, 3, 6, 7]]).all() for k in a)
    # another seed or another epoch (stream position) draws other segmentations
    sampler = subword.Sampler.from_config(config, tokenizer)
    positions = np.arange(8)
    batch = best[0]
    other = subword.Sampler.from_config(_config(corpus, spm_alpha=0.1, shuffle_seed=1), tokenizer)
    assert _equal(sampler(batch, positions), sampler(batch, positions))
    assert not _equal(sampler(batch, positions), other(batch, positions))
    assert not _equal(sampler(batch, positions), sampler(batch, positions + 1000))
    # among the n best: valid, and not always the best
    nbest = subword.Sampler.from_config(_config(corpus, spm_alpha=0.1, spm_nbest_size=4),
                                        tokenizer)(batch, positions)
    for r in range(len(batch['inputs'])):
        one = _segments(batch['inputs'][r], batch['inputs_segment_ids'][r])
        two = _segments(nbest['inputs'][r], nbest['inputs_segment_ids'][r])
        assert [tokenizer.decode(x) for x in one] == [tokenizer.decode(y) for y in two]
    assert not (nbest['inputs'] == batch['inputs']).all()


_OTHER_PROCESS = """
import hashlib, sys
import numpy as np
from t2t.data import subword
from t2t.data.tokenizer import Tokenizer
batch = dict(np.load(sys.argv[2]))
tokenizer = Tokenizer(sys.argv[1])
sampler = subword.Sampler(tokenizer, -1, 0, frozenset(), subword.Lattice(tokenizer.path, 0.1))
out = sampler(batch, np.arange(8) + 100)
print(hashlib.sha256(b''.join(out[k].tobytes() for k in sorted(out))).hexdigest())
"""


def test_the_draws_are_the_same_in_another_process(corpus, tokenizer, tmp_path):
    # (sentencepiece's own sampler is not: its generator differs per process whatever the seed)
    batch = next(pipeline.train_iterator(_config(corpus), tokenizer))
    np.savez(tmp_path / 'batch.npz', **batch)
    out = subword.Sampler.from_config(_config(corpus, spm_alpha=0.1), tokenizer)(
        batch, np.arange(8) + 100)
    here = hashlib.sha256(b''.join(out[k].tobytes() for k in sorted(out))).hexdigest()
    there = run_script('-c', _OTHER_PROCESS, tokenizer.path, tmp_path / 'batch.npz', timeout=120)
    assert there.returncode == 0, there.stderr[-2000:]
    assert there.stdout.strip() == here


def test_identity_covers_the_sampling_and_evaluation_stays_one_best(corpus, tokenizer):
    plain = pipeline.train_rows(_config(corpus), tokenizer)
    rows = pipeline.train_rows(_config(corpus, spm_alpha=0.1), tokenizer)
    nbest = pipeline.train_rows(_config(corpus, spm_alpha=0.1, spm_nbest_size=8), tokenizer)
    assert rows.meta['rows_digest'] == plain.meta['digest']
    assert len({plain.meta['digest'], rows.meta['digest'], nbest.meta['digest']}) == 3
    one_best = pipeline.eval_split(_config(corpus), tokenizer, 'validation')
    ev = pipeline.eval_split(_config(corpus, spm_alpha=0.1), tokenizer, 'validation')
    assert ev.inputs == one_best.inputs and ev.targets == one_best.targets
    assert ev.inputs[0] == tokenizer.encode(ev.sources[0]) + [EOS_ID]


@pytest.mark.parametrize('overrides, line', [
    ({'spm_alpha': -0.1}, 'spm_alpha=-0.1 must be >= 0 (0: the 1-best segmentation)'),
    ({'spm_nbest_size': 1}, 'spm_nbest_size=1 must be -1 (sample among every segmentation) or '
                            '>= 2 (among the n best)'),
])
def test_bad_sampling_settings_are_one_line(corpus, overrides, line):
    assert config_checks.problem(_config(corpus, **overrides)) == line
