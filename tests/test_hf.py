"""dataset='hf' (t2t/data/hf.py): a DatasetDict saved to disk by the test, parquet files read as
Arrow or streamed, JSON with other field names; each gives the TSV source's pairs and packed rows,
and its digest follows the data, not the path."""

import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # nothing here may reach the network
os.environ.setdefault('HF_HUB_OFFLINE', '1')

from t2t import data  # noqa: E402
from t2t.data import cache, prepare, sources, tsv  # noqa: E402
from t2t.run import config_checks  # noqa: E402
from tests import toy_corpus  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402

datasets = pytest.importorskip('datasets', reason='the hf extra (make test installs it)')

pytestmark = pytest.mark.xdist_group(__name__)

SPLITS = ('train', 'validation', 'test')


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """The toy corpus as TSV, as a saved DatasetDict (a `translation` column), as parquet files
    (train in 3 files) and as JSON lines with their own field names."""
    root = tmp_path_factory.mktemp('hf')
    corpus = toy_corpus.make_corpus(root)
    pairs = {split: tsv.read_pairs(corpus[split])[0] for split in SPLITS}
    rows = {split: [{'translation': {'en': s, 'de': t}} for s, t in pairs[split]]
            for split in SPLITS}
    saved = datasets.DatasetDict({split: datasets.Dataset.from_list(rows[split])
                                  for split in SPLITS})
    saved.save_to_disk(str(root / 'saved'))
    files = {}
    for split in SPLITS:
        parts = np.array_split(np.arange(len(rows[split])), 3 if split == 'train' else 1)
        names = []
        for k, part in enumerate(parts):
            name = str(root / f'{split}-{k}.parquet')
            datasets.Dataset.from_list([rows[split][i] for i in part]).to_parquet(name)
            names.append(name)
        files[split] = ','.join(names)
        with open(root / f'{split}.jsonl', 'w', encoding='utf-8') as f:
            for s, t in pairs[split]:
                f.write(json.dumps({'meta': {'src': s}, 'tgt': t}) + '\n')
    return {**corpus, 'pairs': pairs, 'parquet': files}


def _config(corpus, data_dir, **hf):
    config = tiny_config(corpus, data_dir=str(data_dir))
    config.dataset = 'hf'
    for key, value in hf.items():
        setattr(config, key, value)
    return config


def _parquet(corpus, data_dir, streaming):
    config = _config(corpus, data_dir, hf_path='parquet', hf_streaming=streaming)
    for split in SPLITS:
        config.hf_data_files[split] = corpus['parquet'][split]
    return config


def test_saved_parquet_streamed_and_json_give_the_tsv_pairs_and_rows(corpus, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setattr(prepare, 'CHUNK_PAIRS', 60)  # 400 pairs: 7 chunks, read apart
    monkeypatch.setenv(prepare.WORKERS_ENV, '1')
    reference = tiny_config(corpus, data_dir=str(tmp_path / 'tsv'))
    tokenizer = data.get_tokenizer(reference)
    want = cache.packed_split(reference, tokenizer, 'train')
    jsonl = _config(corpus, tmp_path / 'json', hf_path='json', hf_source_field='meta.src',
                    hf_target_field='tgt')
    for split in SPLITS:
        jsonl.hf_data_files[split] = str(corpus['root'] / f'{split}.jsonl')
    configs = {'saved': _config(corpus, tmp_path / 'saved', hf_path=str(corpus['root'] / 'saved')),
               'parquet': _parquet(corpus, tmp_path / 'parquet', streaming=False),
               'streamed': _parquet(corpus, tmp_path / 'streamed', streaming=True),
               'json': jsonl}
    for name, config in configs.items():
        assert config_checks.problem(config, keys=('dataset', 'hf_path')) is None
        for split in SPLITS:
            pairs = sources.open_split(config, split)
            assert len(pairs) == len(corpus['pairs'][split]), (name, split)
            assert pairs.read(0, len(pairs)) == corpus['pairs'][split], (name, split)
            assert pairs[5] == corpus['pairs'][split][5]
        assert data.split_texts(config, 'validation') == data.split_texts(reference, 'validation')
        config.vocab_path = tokenizer.path  # the same vocabulary: the rows must match
        got = cache.packed_split(config, tokenizer, 'train')
        assert got.meta['rows'] == want.meta['rows'] and got.meta['skipped'] == want.meta['skipped']
        for key, array in want.arrays.items():
            np.testing.assert_array_equal(np.asarray(got.arrays[key]), np.asarray(array),
                                          err_msg=f'{name} {key}')
        assert got.directory != want.directory  # its own cache, keyed by its own digest
    # the streamed split was never converted to Arrow files; the non-streamed one was
    assert not list((tmp_path / 'streamed' / 'hf_cache').rglob('*.arrow'))
    assert len(list((tmp_path / 'parquet' / 'hf_cache').rglob('*.arrow'))) == 3


def test_the_digest_follows_the_data_not_the_path(corpus, tmp_path):
    saved = _config(corpus, tmp_path / 'a', hf_path=str(corpus['root'] / 'saved'))
    copy = tmp_path / 'copy'
    shutil.copytree(corpus['root'] / 'saved', copy)
    moved = _config(corpus, tmp_path / 'a', hf_path=str(copy))
    assert sources.split_fingerprint(saved, 'train') == sources.split_fingerprint(moved, 'train')
    assert sources.dataset_id(saved) == sources.dataset_id(moved)
    assert sources.split_fingerprint(saved, 'train') != sources.split_fingerprint(saved, 'test')
    other_field = _config(corpus, tmp_path / 'a', hf_path=str(copy), hf_source_field='x')
    assert sources.split_fingerprint(other_field, 'train') != sources.split_fingerprint(
        moved, 'train')
    changed = datasets.DatasetDict({s: datasets.Dataset.from_list(
        [{'translation': {'en': 'new .', 'de': 'neu .'}}]) for s in SPLITS})
    shutil.rmtree(copy)
    changed.save_to_disk(str(copy))
    assert sources.split_fingerprint(moved, 'train') != sources.split_fingerprint(saved, 'train')


def test_bad_settings_are_one_line(corpus, tmp_path):
    def problem(**hf):
        return config_checks.problem(_config(corpus, tmp_path, **hf), keys=('hf_path',))

    assert problem(hf_path='').startswith("hf_path='' is required with dataset=hf")
    assert 'neither a directory saved by save_to_disk' in problem(hf_path='/nonexistent')
    assert 'hf_streaming=True streams data files' in problem(
        hf_path=str(corpus['root'] / 'saved'), hf_streaming=True)
    saved = str(corpus['root'] / 'saved')
    with pytest.raises(ValueError, match=r"field 'x.y': the dataset has columns \['translation'\]"):
        sources.open_split(_config(corpus, tmp_path, hf_path=saved, hf_source_field='x.y'),
                           'test').read(0, 2)
    with pytest.raises(ValueError, match="field 'translation.fr': 'fr' is not among the keys"):
        sources.open_split(_config(corpus, tmp_path, hf_path=saved,
                                   hf_target_field='translation.fr'), 'test').read(0, 2)
    with pytest.raises(ValueError, match=r'hf_data_files\.test: .* matches no file'):
        config = _config(corpus, tmp_path, hf_path='parquet')
        config.hf_data_files.test = str(tmp_path / 'none-*.parquet')
        sources.open_split(config, 'test')
