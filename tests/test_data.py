"""The data layer: sources, parser, split, tokenizer, packing, iterator state, eval, bad input.

No network: WMT is read through tfds.testing.mock_data, the embedded corpus from a fixture file.
"""

import collections
import os
import random

import numpy as np
import pytest

from configs import tiny
from t2t.data import cache, embedded, packing, pipeline, sources, tfds_wmt, tsv
from t2t.data.__main__ import report
from t2t.data.tokenizer import EOS_ID, PAD_ID, UNK_ID
from tests import toy_corpus
from tests.helpers import run_script, tiny_config

_translate = toy_corpus.translate
_config = tiny_config


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A TSV corpus: 400 training pairs, validation with 3 over-long pairs, test."""
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


@pytest.fixture(scope='module')
def tokenizer(corpus):
    return pipeline.get_tokenizer(_config(corpus))


# --- sources --------------------------------------------------------------------------------------

def test_mock_wmt14_gives_en_de_in_configured_direction(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=6):
        en_de = tfds_wmt.open_split('wmt14_translate/de-en', str(tmp_path), 'train', 'en', 'de')
        de_en = tfds_wmt.open_split('wmt14_translate/de-en', str(tmp_path), 'train', 'de', 'en')
        en_fr = tfds_wmt.open_split('wmt14_translate/fr-en', str(tmp_path), 'test', 'en', 'fr')
        assert len(en_de) == 6 and len(en_fr) == 6
        src, tgt = en_de[0]
        assert isinstance(src, str) and isinstance(tgt, str) and src and tgt
        assert de_en[0] == (tgt, src)  # the record's 'en' field is the source of EN->DE
        assert en_de.read(0, 3) == [en_de[i] for i in range(3)]
        config = tiny.get_config()
        config.dataset, config.data_dir = 'tfds', str(tmp_path)
        assert sources.open_split(config, 'validation')[0][0]  # the config path (en -> de)


@pytest.mark.parametrize('name,src,tgt', [('wmt14_translate/de-en', 'fr', 'de'),
                                          ('wmt14_translate/de-en', 'en', 'en'),
                                          ('wmt14_translate/fr-en', 'en', 'de'),
                                          ('wmt14_translate', 'en', 'de')])
def test_direction_check_rejects_bad_pairs(tmp_path, name, src, tgt):
    # raised before any tfds call, so no download can start
    with pytest.raises(ValueError, match='lang|expected'):
        tfds_wmt.open_split(name, str(tmp_path), 'train', src, tgt)


def test_unknown_dataset_is_an_error(corpus):
    with pytest.raises(ValueError, match='config.dataset'):
        sources.open_split(_config(corpus, dataset='wmt'), 'train')


DING = """\
# Version :: test fixture
Haus {n} [arch.] | Häuser {pl} | Das Haus ist sehr alt. :: house | houses | The house is very old.
Er kommt morgen zurück.; Morgen kommt er zurück. :: He will be back tomorrow.; He returns tomorrow.
Sie {f} lacht [ugs.] laut und lange. :: She {f} laughs [coll.] loud and long.
Zu kurz. :: Too short.
Ohne Punkt am Ende hier :: Without a full stop here
kaputte Zeile ohne Trenner.
Wo ist der Bahnhof, bitte? | Wo ist das Klo? :: Where is the station, please? | Where is the loo?
"""


def test_ding_parser_annotations_alternatives_alignment():
    pairs = embedded.parse_corpus(DING.splitlines() + DING.splitlines())  # duplicates drop
    assert pairs == [
        ('Das Haus ist sehr alt.', 'The house is very old.'),
        ('Er kommt morgen zurück.', 'He will be back tomorrow.'),
        ('Sie lacht laut und lange.', 'She laughs loud and long.'),
        ('Wo ist der Bahnhof, bitte?', 'Where is the station, please?'),
        ('Wo ist das Klo?', 'Where is the loo?'),
    ]
    line = 'A b c d. | Wo ist das Klo denn? :: A b c d. | Where is it now?'
    assert embedded.parse_line(line) == [('A b c d.', 'A b c d.'),
                                         ('Wo ist das Klo denn?', 'Where is it now?')]
    assert embedded.parse_line('a | b c d e. :: only one side entry here.') == []  # misaligned


def test_split_by_hash_is_stable_and_disjoint():
    rng = random.Random(1)
    pairs = [(f'Satz {i} ist hier.', f'Sentence {i} is here.') for i in range(3000)]
    pairs.append(('Satz 7 ist hier.', 'Another translation of seven.'))  # shares a sentence
    splits = embedded.split_pairs(pairs)
    shuffled = pairs[:]
    rng.shuffle(shuffled)
    again = embedded.split_pairs(shuffled)
    assert {k: set(v) for k, v in splits.items()} == {k: set(v) for k, v in again.items()}
    sentences = {k: {s for p in v for s in p} for k, v in splits.items()}
    assert not sentences['train'] & sentences['validation']
    assert not sentences['train'] & sentences['test']
    assert not sentences['validation'] & sentences['test']
    assert sum(map(len, splits.values())) == len(pairs)
    assert 0.85 < len(splits['train']) / len(pairs) < 0.95 and splits['test']


def test_embedded_source_from_supplied_file(tmp_path, monkeypatch):
    lines = [f'Satz {i} ist gut. :: Sentence {i} is good.' for i in range(300)]
    path = tmp_path / 'de-en'
    path.write_text(DING + '\n'.join(lines) + '\n', encoding='utf-8')
    monkeypatch.setenv(embedded.ENV_PATH, str(path))
    config = tiny.get_config()
    config.data_dir = str(tmp_path / 'data')
    en_de = {s: sources.open_split(config, s) for s in embedded.SPLITS}
    assert sum(map(len, en_de.values())) == 305
    train = en_de['train'].read(0, len(en_de['train']))
    src, tgt = next(p for p in train if p[1].startswith('Satz'))
    assert src == tgt.replace('Satz', 'Sentence').replace('ist gut', 'is good')
    config.source_lang = 'fr'
    with pytest.raises(ValueError, match='trans-de-en'):
        sources.open_split(config, 'train')


# --- tokenizer ------------------------------------------------------------------------------------

def test_tokenizer_ids_roundtrip_and_reuse(corpus, tokenizer):
    import t2t.data

    assert (PAD_ID, EOS_ID, UNK_ID) == (0, 1, 2) == (t2t.data.PAD_ID, t2t.data.EOS_ID, 2)
    assert 256 < tokenizer.vocab_size <= 400  # the corpus's pieces plus 256 UTF-8 byte pieces
    text = 'the red cat sees one bird .'
    ids = tokenizer.encode(text)
    assert EOS_ID not in ids and PAD_ID not in ids and UNK_ID not in ids
    assert tokenizer.decode(ids) == text
    unseen = 'Über 9 Öfen, ñ €'  # letters the corpus never had come back through byte pieces
    assert UNK_ID not in tokenizer.encode(unseen) and tokenizer.decode(tokenizer.encode(unseen)) \
        == unseen
    assert tokenizer.decode([PAD_ID, *ids, EOS_ID, *tokenizer.encode('dog'), PAD_ID]) == text
    with pytest.raises(ValueError, match='vocab_size=100 is too small'):
        pipeline.get_tokenizer(_config(corpus, vocab_size=100))
    mtime = os.path.getmtime(tokenizer.path)
    assert pipeline.get_tokenizer(_config(corpus)).path == tokenizer.path
    assert os.path.getmtime(tokenizer.path) == mtime  # reused, not retrained


# --- packing and the training iterator ------------------------------------------------------------

def _segments(tokens, segment_ids):
    """{segment id: tokens} of one row."""
    out = collections.defaultdict(list)
    for t, s in zip(tokens.tolist(), segment_ids.tolist(), strict=True):
        if s:
            out[s].append(t)
    return out


def test_packing_keeps_every_token_with_right_segments_and_positions():
    rng = np.random.default_rng(0)
    src = [list(rng.integers(3, 50, rng.integers(1, 16))) + [EOS_ID] for _ in range(300)]
    tgt = [list(rng.integers(3, 50, rng.integers(1, 16))) + [EOS_ID] for _ in range(300)]
    rows = packing.pack(src, tgt, max_len=32)
    assert rows['inputs'].shape[1] == 32 and len(rows['inputs']) < 300  # several pairs per row
    got = []
    for r in range(len(rows['inputs'])):
        ins = _segments(rows['inputs'][r], rows['inputs_segment_ids'][r])
        outs = _segments(rows['targets'][r], rows['targets_segment_ids'][r])
        assert sorted(ins) == sorted(outs) == list(range(1, len(ins) + 1))
        got += [(tuple(ins[k]), tuple(outs[k])) for k in ins]
        assert (rows['inputs'][r][rows['inputs_segment_ids'][r] == 0] == 0).all()
    assert sorted(got) == sorted((tuple(map(int, s)), tuple(map(int, t)))
                                 for s, t in zip(src, tgt, strict=True))
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert packing.positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    single = packing.pack(src[:5], tgt[:5], max_len=32, packed=False)
    assert single['inputs_segment_ids'].max() == 1 and len(single['inputs']) == 5


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_train_batches_fields_and_state_restore(corpus, tokenizer):
    config = _config(corpus)
    it = pipeline.train_iterator(config, tokenizer)
    first = _take(it, 3)
    state = it.get_state()
    expected = _take(it, 40)  # crosses epoch boundaries
    restored = pipeline.train_iterator(config, tokenizer)
    restored.set_state(state)
    for a, b in zip(expected, _take(restored, 40), strict=True):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    b = first[0]
    assert set(b) == {'inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids',
                      'inputs_positions', 'targets_positions'}
    assert all(v.dtype == np.int32 and v.shape == (8, 64) for v in b.values())
    for r in range(8):
        for side in ('inputs', 'targets'):
            segs = _segments(b[side][r], b[f'{side}_segment_ids'][r])
            assert all(toks[-1] == EOS_ID and EOS_ID not in toks[:-1] for toks in segs.values())
        expected_positions = packing.positions(b['targets_segment_ids'][r:r + 1])[0]
        assert (b['targets_positions'][r] == expected_positions).all()
    packed = cache.packed_split(config, tokenizer, 'train')
    assert packed.meta['examples'] == 400 and packed.num_rows < 400
    real = (np.asarray(packed.arrays['targets_segment_ids']) > 0).mean()
    assert packed.meta['fill'] == pytest.approx(real)


def test_train_epochs_reshuffle_and_unpacked_rows(corpus, tokenizer):
    config = _config(corpus, pack=False)
    packed = cache.packed_split(config, tokenizer, 'train')
    assert packed.num_rows == 400  # one pair per row
    epoch_rows = 400 // 8
    rows = [r.tobytes() for b in _take(pipeline.train_iterator(config, tokenizer), 2 * epoch_rows)
            for r in b['inputs']]
    assert len(set(rows[:400])) == len(set(rows[400:])) and rows[:400] != rows[400:]
    assert sorted(rows[:400]) == sorted(rows[400:])  # each epoch: every row once


def test_processes_feed_their_rows_of_the_same_global_batches(corpus, tokenizer):
    config = _config(corpus)  # batch_size 8
    whole = _take(pipeline.train_iterator(config, tokenizer), 5)
    rows = ([0, 1, 4, 5], [2, 3, 6, 7])  # two processes on an fsdp axis spanning both
    parts = [_take(pipeline.train_iterator(config, tokenizer, rows=r), 5) for r in rows]
    for step in range(5):
        for r, part in zip(rows, parts, strict=True):
            for key, value in whole[step].items():
                np.testing.assert_array_equal(part[step][key], value[r])
    # The position counts global batches: a state saved by one process of a 2-process job
    # continues the same global stream in a 1-process job (no restart, no repeat).
    it = pipeline.train_iterator(config, tokenizer, rows=rows[1])
    _take(it, 3)
    single = pipeline.train_iterator(config, tokenizer)
    single.set_state(it.get_state())
    for a, b in zip(_take(single, 2), whole[3:5], strict=True):
        assert all((a[k] == b[k]).all() for k in a)
    with pytest.raises(ValueError, match='rows must be positions in a batch of batch_size=8'):
        pipeline.train_iterator(config, tokenizer, rows=[8])


# --- evaluation -----------------------------------------------------------------------------------

def test_eval_every_example_once_original_order_and_skips(corpus, tokenizer):
    config = _config(corpus)
    srcs, refs = pipeline.split_texts(config, 'validation')
    assert srcs == corpus['validation_texts'] and refs == [_translate(s) for s in srcs]
    ev = pipeline.eval_split(config, tokenizer, 'validation')
    assert len(ev.skipped) == 3  # the three over-long sentences, counted, not lost silently
    assert all(len(srcs[i].split()) > 16 for i in ev.skipped)
    seen = []
    for batch in pipeline.eval_batches(config, tokenizer, 'validation'):
        length = batch['inputs'].shape[1]
        assert batch['inputs'].shape == batch['targets'].shape == (4, length)
        assert length in (8, 16, 32)
        for row, i in enumerate(batch['index'].tolist()):
            if i < 0:
                assert not batch['inputs'][row].any()
                continue
            seen.append(i)
            assert tokenizer.decode(batch['inputs'][row]) == srcs[i]
            assert tokenizer.decode(batch['targets'][row]) == refs[i]
    assert sorted(seen) == sorted(set(range(40)) - set(ev.skipped))
    # Padded to a multiple of the devices: the same examples per batch, more -1 rows.
    padded = list(ev.batches(4, global_rows=8))
    assert all(b['index'].shape == (8,) and (b['index'][4:] == -1).all() for b in padded)
    assert [i for b in padded for i in b['index'].tolist() if i >= 0] == seen


def test_cli_report_lines(corpus):
    config = _config(corpus)
    lines = report(config)
    assert [line.split(':')[0] for line in lines] == ['vocabulary', 'packed training rows',
                                                      'train', 'validation', 'test']
    # Where the prepared data lives, for a pod's hosts to share.
    assert lines[0].startswith(f'vocabulary: {pipeline.vocab_path(config)} (')
    packed_dir = lines[1].split(': ')[1].split(' (')[0]
    assert packed_dir.startswith(os.path.join(config.data_dir, 'packed', 'train-'))
    assert os.path.exists(os.path.join(packed_dir, 'meta.json'))
    lines = lines[2:]
    assert 'examples=400' in lines[0] and 'longer_than_max_eval_len_32=3' in lines[1]
    assert all('src_tokens mean=' in line and 'p95=' in line for line in lines)


# --- bad input ------------------------------------------------------------------------------------

def test_tsv_bad_lines_are_counted_skips(tmp_path):
    path = tmp_path / 'bad.tsv'
    path.write_bytes(b'a b c .\tA B C .\n'
                     b'\n'
                     b'   \t   \n'
                     b'only one column\n'
                     b'bad \xff\xfe utf8\tX Y\n'
                     + b'x' * (tsv.MAX_LINE_CHARS + 1) + b'\ty\n'
                     b'three\tcolumns\there\n'
                     b'd e .\tD E .\r\n')
    pairs, skipped = tsv.read_pairs(str(path))
    assert pairs == [('a b c .', 'A B C .'), ('d e .', 'D E .')]
    assert skipped == {'empty': 2, 'not_two_columns': 2, 'invalid_utf8': 1, 'line_too_long': 1}


def test_parallel_files_pairing_skips_and_length_mismatch(tmp_path):
    src, tgt = tmp_path / 'a.en', tmp_path / 'a.de'
    src.write_bytes(b'one .\n\ntwo \xff .\nthree .\n')
    tgt.write_bytes(b'eins .\nzwei .\nzwei .\ndrei .\n')
    pairs, skipped = tsv.read_pairs(f'{src},{tgt}')
    assert pairs == [('one .', 'eins .'), ('three .', 'drei .')]  # alignment kept past skips
    assert skipped == {'empty': 1, 'invalid_utf8': 1}
    tgt.write_bytes(b'eins .\nzwei .\n')
    with pytest.raises(ValueError, match=r'a\.de has 2 lines but .*a\.en has 4'):
        tsv.read_pairs(f'{src},{tgt}')


def test_empty_corpus_is_a_clear_error(tmp_path, corpus):
    empty = tmp_path / 'empty.tsv'
    empty.write_text('\n\n')
    with pytest.raises(ValueError, match=r'empty\.tsv: no usable sentence pairs \(empty=2\)'):
        tsv.read_pairs(str(empty))
    config = _config(corpus)
    config.tsv_files.test = ''
    with pytest.raises(ValueError, match='tsv_files.test'):
        pipeline.split_texts(config, 'test')


def test_too_long_training_pairs_are_counted(corpus, tokenizer):
    packed = cache.packed_split(_config(corpus, max_len=12), tokenizer, 'train')
    skipped = packed.meta['skipped']['longer_than_max_len_12']
    assert skipped > 0 and packed.meta['examples'] + skipped == 400
    assert packed.arrays['inputs'].shape[1] == 12


def test_import_is_light():
    code = ('import sys, t2t.data; t2t.data.PAD_ID; '
            'assert not {"grain", "tensorflow_datasets", "sentencepiece"} & set(sys.modules)')
    proc = run_script('-c', code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
