"""Data identity: artifacts keyed by content, the vocabulary pinned in the workdir, and checkpoints
that refuse other data (t2t/data/identity.py)."""

import json
import os
import shutil

import jax
import pytest

from t2t.data import cache, identity, pipeline
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import evaluation
from t2t.infra import workdir as wd
from t2t.run import checkpoint_read
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

# One device: the data checks are the point, and one device compiles fastest.
SETTINGS = dict(num_train_steps=2, log_every_steps=1, eval_every_steps=100,
                checkpoint_every_steps=2, eval_bleu_sentences=0, num_eval_batches=1,
                mesh_shape=(1, 1, 1))


def _train(config, workdir):
    return loop.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('identity'))


def _config(corpus, **overrides):
    return tiny_config(corpus, **{**SETTINGS, **overrides})


@pytest.fixture(scope='module')
def trained(corpus, tmp_path_factory):
    """A workdir trained 2 steps (one checkpoint), with its vocabulary pinned."""
    workdir = str(tmp_path_factory.mktemp('trained') / 'run')
    _train(_config(corpus), workdir)
    return workdir


def test_a_copied_corpus_and_another_shuffle_seed_reuse_vocabulary_and_cache(corpus, tmp_path,
                                                                             monkeypatch):
    config = _config(corpus)
    tokenizer = pipeline.get_tokenizer(config)
    key = cache.cache_key(config, tokenizer, 'train')
    # The same files elsewhere (new paths, new mtimes), and another training order.
    copy = {'root': corpus['root']}
    for split in ('train', 'validation', 'test'):
        copy[split] = str(tmp_path / f'{split}-copy.tsv')
        shutil.copyfile(corpus[split], copy[split])
    moved = _config(copy, shuffle_seed=7)
    trains = []
    monkeypatch.setattr(pipeline, 'train_tokenizer', lambda *a, **k: trains.append(a))
    assert pipeline.vocab_path(moved) == pipeline.vocab_path(config)
    assert pipeline.get_tokenizer(moved).path == tokenizer.path and trains == []
    assert cache.cache_key(moved, tokenizer, 'train') == key
    # Content changes what it keys: one more line is another corpus.
    with open(copy['train'], 'a', encoding='utf-8') as f:
        f.write('one more line .\tLINE MORE ONE\n')
    assert pipeline.vocab_path(_config(copy)) != pipeline.vocab_path(config)
    # The vocabulary's own seed is what picks its sample.
    assert pipeline.vocab_path(_config(corpus, vocab_seed=1)) != pipeline.vocab_path(config)


def test_packed_rows_carry_a_digest_of_their_bytes(corpus):
    config = _config(corpus)
    packed = cache.packed_split(config, pipeline.get_tokenizer(config), 'train')
    assert len(packed.meta['digest']) == 64
    again = cache._load(packed.directory)  # the digest is read back, not recomputed
    assert again.meta['digest'] == packed.meta['digest']


def test_the_workdir_keeps_the_vocabulary_and_checkpoints_record_the_data(corpus, trained):
    config = _config(corpus)
    tokenizer = pipeline.get_tokenizer(config)
    with open(tokenizer.path, 'rb') as f:
        assert wd.read_bytes(wd.path(trained, identity.VOCAB_NAME)) == f.read()
    saved = checkpoint_read.read_metadata(trained, 2)[identity.DATA_KEY]
    packed = cache.packed_split(config, tokenizer, 'train')
    assert saved == {'vocab_sha256': identity.sha256_file(tokenizer.path),
                     'train_rows': packed.num_rows, 'train_digest': packed.meta['digest'],
                     'batch_size': 8}
    # evaluate.py decodes with the workdir's copy, whatever the config's data_dir holds.
    elsewhere = _config(corpus, data_dir=str(corpus['root'] / 'empty-data-dir'))
    assert evaluation.workdir_tokenizer(elsewhere, trained).path == \
        str(wd.path(trained, identity.VOCAB_NAME))


def _other_vocabulary(corpus, tmp_path):
    """A vocabulary of the same corpus from another sample: other pieces, other ids."""
    config = _config(corpus, data_dir=str(tmp_path / 'other'), vocab_seed=1,
                     tokenizer_sentences=300)
    tokenizer = pipeline.get_tokenizer(config)
    with open(tokenizer.path, 'rb') as f:
        data = f.read()
    return config, tokenizer, data


def test_another_vocabulary_is_a_one_line_error_for_evaluate_and_resume(corpus, trained,
                                                                        tmp_path):
    other_config, other, other_bytes = _other_vocabulary(corpus, tmp_path)
    pinned = wd.path(trained, identity.VOCAB_NAME)
    assert other_bytes != wd.read_bytes(pinned)
    # Resuming on a config whose vocabulary is another: stopped before anything is restored.
    with pytest.raises(identity.DataMismatchError, match='differs from') as info:
        _train(_config(corpus, data_dir=other_config.data_dir, vocab_seed=1,
                       tokenizer_sentences=300), trained)
    assert '\n' not in str(info.value)
    # A workdir whose vocabulary copy was swapped: the checkpoint's record catches it.
    swapped = tmp_path / 'swapped'
    shutil.copytree(trained, swapped)
    wd.write_atomic(wd.path(swapped, identity.VOCAB_NAME), other_bytes)
    with pytest.raises(eval_checkpoints.EvalError, match=r'^checkpoint step-2 was trained with '
                                                          r'vocabulary \w{12} but .* is \w{12}'):
        evaluation.run(_config(corpus), str(swapped), progress=False, echo=lambda _: None)
    # A workdir without its copy (from before t2t kept one) falls back to the config's vocabulary,
    # which is checked against the checkpoint too.
    os.remove(wd.path(swapped, identity.VOCAB_NAME))
    with pytest.raises(eval_checkpoints.EvalError, match='was trained with vocabulary'):
        evaluation.run(other_config, str(swapped), progress=False, echo=lambda _: None)


def test_another_batch_size_needs_allow_data_change_and_maps_the_position(corpus, trained,
                                                                          tmp_path, capsys):
    workdir = tmp_path / 'resized'
    shutil.copytree(trained, workdir)
    with pytest.raises(identity.DataMismatchError,
                       match=r'other training data: batch_size 8 -> 4; .*allow_data_change'):
        _train(_config(corpus, batch_size=4), workdir)
    # Allowed: 2 batches of 8 rows were consumed, so the stream continues at batch 4 of 4 rows.
    # (num_train_steps=2: nothing left to train, so nothing compiles.)
    _train(_config(corpus, batch_size=4, allow_data_change=True), workdir)
    assert 'continuing at global batch 4 of 4 rows (16 rows consumed)' in capsys.readouterr().out


def test_check_resume_maps_by_rows_consumed():
    saved = {'vocab_sha256': 'a' * 64, 'train_rows': 100, 'train_digest': 'd', 'batch_size': 8}
    now = dict(saved, batch_size=3)
    state = {'next_index': 7}  # 56 rows consumed -> 18 batches of 3
    assert identity.check_resume(saved, now, state, allow_change=True, where='x') == \
        {'next_index': 18}
    assert identity.check_resume(saved, dict(saved), state, allow_change=False, where='x') is None
    assert identity.check_resume(None, now, state, allow_change=False, where='x') is None
    with pytest.raises(identity.DataMismatchError, match='train_digest d -> e'):
        identity.check_resume(saved, dict(saved, train_digest='e'), state, allow_change=False,
                              where='x')


def test_two_processes_with_other_packed_rows_stop_with_one_line(corpus, tmp_path):
    from tests.test_multiprocess import _flags, _two_processes

    # Process 0's data_dir prepared here; process 1's is a copy whose cache holds other rows
    # (what another library version or a stale cache gives a host).
    config = tiny_config(corpus, data_dir=str(tmp_path / 'data0'))
    packed = cache.packed_split(config, pipeline.get_tokenizer(config), 'train')
    shutil.copytree(config.data_dir, tmp_path / 'data1')
    other = os.path.join(str(tmp_path / 'data1'), os.path.relpath(packed.directory,
                                                                  config.data_dir))
    meta = json.loads(open(os.path.join(other, 'meta.json')).read())
    meta['digest'] = 'f' * 64
    wd.write_atomic(os.path.join(other, 'meta.json'), json.dumps(meta))
    with pytest.raises(AssertionError) as info:
        _two_processes('train.py', [*_flags(corpus), f'--workdir={tmp_path / "run"}'],
                       [config.data_dir, str(tmp_path / 'data1')], tmp_path)
    for process in (0, 1):  # each stops with the same one line, before anything compiles
        assert f'process {process} exited with 1' in str(info.value)
    want = (f"train.py: the processes disagree on the packed rows of train (rows:digest): "
            f"process 0 has '{packed.num_rows}:{packed.meta['digest'][:10]}")
    assert str(info.value).count(want) == 2, str(info.value)[-3000:]
