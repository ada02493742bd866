"""A training mixture of corpora (t2t/data/mixture.py): weights, tags, exact resume, identity,
and bad specs refused in one line before any data is read."""

import numpy as np
import pytest

from t2t.data import cache, identity, pipeline
from t2t.run import cli, config_checks
from tests import toy_corpus
from tests.helpers import tiny_config

TAG = '<BT>'


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
    """The toy corpus, and a second training corpus (the "back-translations") beside it."""
    corpus = toy_corpus.make_corpus(tmp_path_factory.mktemp('mix'))
    rng = __import__('random').Random(7)
    bt = toy_corpus.write_tsv(corpus['root'] / 'bt.tsv',
                              [toy_corpus.sentence(rng, 2, 6) for _ in range(150)])
    return corpus, bt


def _config(corpora, spec, **overrides):
    corpus, _ = corpora
    return tiny_config(corpus, train_mixture=spec, **overrides)


def _spec(corpora, base=3, bt=1, tag=TAG):
    corpus, bt_path = corpora
    return f'tsv:{corpus["train"]}={base}; tsv:{bt_path}={bt}' + (f':{tag}' if tag else '')


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_weights_tags_resume_and_identity(corpora):
    config = _config(corpora, _spec(corpora))
    tokenizer = pipeline.get_tokenizer(config)
    tag = tokenizer.tag_id(TAG)  # a user-defined piece of the vocabulary the run trains with
    rows = pipeline.train_rows(config, tokenizer)
    base, bt = rows.parts
    assert rows.num_rows == base.num_rows + bt.num_rows
    assert [m['share'] for m in rows.meta['members']] == [0.75, 0.25]
    assert 'tag <BT> (25.0% of rows' in rows.meta['source']

    it = pipeline.train_iterator(config, tokenizer)
    batches = _take(it, 25)  # 200 rows: several epochs of the small member
    inputs = np.concatenate([b['inputs'] for b in batches])
    starts = np.concatenate([b['inputs_positions'] for b in batches]) == 0
    starts &= np.concatenate([b['inputs_segment_ids'] for b in batches]) > 0
    tagged = inputs[:, 0] == tag
    assert abs(tagged.mean() - 0.25) <= 0.02, tagged.mean()
    # a tagged row's every pair starts with the tag, an untagged row's none
    assert (inputs[tagged][starts[tagged]] == tag).all()
    assert not (inputs[~tagged] == tag).any()
    # the tagged rows are the second corpus's: their first pairs' sources after the tag
    seg = np.concatenate([b['inputs_segment_ids'] for b in batches])
    texts = {tokenizer.decode(row[(s == 1)][1:]) for row, s in zip(inputs[tagged], seg[tagged],
                                                                    strict=True)}
    corpus_bt = {line.split('\t')[0] for line in open(corpora[1], encoding='utf-8')}
    assert texts <= corpus_bt and len(texts) > 10

    # resume: a fresh iterator from the state continues bit for bit
    state = it.get_state()
    expected = _take(it, 6)
    again = pipeline.train_iterator(config, tokenizer)
    again.set_state(state)
    for a, b in zip(expected, _take(again, 6), strict=True):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    # subword sampling re-segments the pairs but keeps each tag whole, first in its source
    sampled = next(pipeline.train_iterator(_config(corpora, _spec(corpora), spm_alpha=0.1),
                                           tokenizer))
    first = sampled['inputs_positions'] == 0
    first &= sampled['inputs_segment_ids'] > 0
    rows_tagged = sampled['inputs'][:, 0] == tag
    np.testing.assert_array_equal(rows_tagged, batches[0]['inputs'][:, 0] == tag)
    assert (sampled['inputs'][rows_tagged][first[rows_tagged]] == tag).all()
    assert (sampled['inputs'] == tag).sum() == (batches[0]['inputs'] == tag).sum()

    # the identity covers weights, members and tags; members' caches are reused as they are
    run = identity.run_identity(tokenizer, rows, config.batch_size)
    for other in (_spec(corpora, base=2), _spec(corpora, tag=''), _spec(corpora, tag='<XX>')):
        if '<XX>' in other:  # a tag outside the vocabulary: one line before any preparation
            with pytest.raises(ValueError, match="has no piece '<XX>' of its own"):
                pipeline.train_rows(_config(corpora, other), tokenizer)
            continue
        changed = pipeline.train_rows(_config(corpora, other), tokenizer)
        assert changed.parts[0].directory == base.directory
        assert identity.run_identity(tokenizer, changed, 8)['train_digest'] != run['train_digest']
    with pytest.raises(identity.DataMismatchError, match='train_digest'):
        identity.check_resume(run, identity.run_identity(tokenizer, changed, 8), None,
                              allow_change=False, where='ckpt')
    # without a mixture, today's vocabulary and rows (no tag in either)
    plain = tiny_config(corpora[0])
    assert pipeline.vocab_path(plain) != pipeline.vocab_path(config)
    assert pipeline.train_rows(plain, tokenizer).directory == base.directory
    assert cache.packed_split(plain, tokenizer, 'train').meta['digest'] == base.meta['digest']


@pytest.mark.parametrize('spec, says', [
    ('embedded=0', "member 'embedded': weight 0 must be > 0"),
    ('embedded=x', "member 'embedded': weight 'x' is not a number"),
    ('embedded', "'embedded' is not MEMBER=WEIGHT[:TAG]"),
    ('wmt=1', "member 'wmt' is not embedded, tfds:NAME or tsv:SPEC"),
    ('embedded=1:<B T>', "tag '<B T>' must be one word"),
    ('embedded=1; embedded=2', 'a member is named twice'),
    ('tsv:/no/such.tsv=1', 'names TSV files that do not exist (or are not FILE.tsv / SRC,TGT): '
                           '/no/such.tsv'),
])
def test_bad_specs_are_one_line_before_any_data(tmp_path, spec, says):
    config = tiny_config({'root': tmp_path, 'train': 't', 'validation': 'v',
                         'test': 't'}, train_mixture=spec)
    line = config_checks.problem(config)
    assert line.startswith(f'train_mixture={spec!r} ') and says in line, line
    with pytest.raises(SystemExit) as e:
        cli.check_values(config, 'train.py')
    assert str(e.value) == f'train.py: {line}' and '\n' not in line
    assert not (tmp_path / 'data').exists()  # nothing read or prepared
