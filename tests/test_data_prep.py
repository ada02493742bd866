"""Streaming, parallel, resumable data preparation (t2t/data/prepare.py, shards.py, tsv.py's
chunk reader): the same pairs as the in-memory reader, a vocabulary sample over the whole corpus,
rows independent of the worker count, a killed preparation resumed to identical bytes, max_len
changes without re-tokenizing, and evaluation pairs dropped at read time as an error."""

import collections
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from t2t.data import cache, pipeline, prepare, progress, shards, sources, tsv
from t2t.data.tokenizer import Tokenizer
from tests import toy_corpus
from tests.helpers import run_script, start_script, tiny_config

SMALL_CHUNKS = 50  # lines per chunk: the 400-pair toy corpus becomes 8 chunks


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('prep'))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(prepare, 'CHUNK_PAIRS', SMALL_CHUNKS)


def _config(corpus, data_dir, **overrides):
    return tiny_config(corpus, data_dir=str(data_dir), **overrides)


def _streamed(spec: str, chunk_lines: int):
    chunks, total = tsv.index(spec, chunk_lines)
    pairs, skipped = [], collections.Counter()
    for chunk in chunks:
        p, s, _ = tsv.read_chunk(spec, chunk)
        pairs += p
        skipped += s
    return pairs, skipped, total


BAD_TSV = (b'a b c .\tA B C .\n\n   \t   \nonly one column\nbad \xff\xfe utf8\tX Y\n'
           + b'x' * (tsv.MAX_LINE_CHARS + 1)
           + b'\ty\nthree\tcolumns\there\nd e .\tD E .\r\nlast\tno newline')


def test_streamed_reader_equals_the_in_memory_reader(corpus, tmp_path):
    bad = tmp_path / 'bad.tsv'
    bad.write_bytes(BAD_TSV)
    src, tgt = tmp_path / 'a.en', tmp_path / 'a.de'
    src.write_bytes(b'one .\n\ntwo \xff .\nthree .\nfour .')
    tgt.write_bytes(b'eins .\nzwei .\nzwei .\ndrei .\nvier .\n')
    for spec, lines in ((corpus['train'], 400), (str(bad), 9), (f'{src},{tgt}', 5)):
        expected = tsv.read_pairs(spec)
        for chunk_lines in (1, 2, 3, 7, 1000):
            pairs, skipped, total = _streamed(spec, chunk_lines)
            assert (pairs, skipped, total) == (*expected, lines), (spec, chunk_lines)
    assert _streamed(str(bad), 4)[1] == {'empty': 2, 'not_two_columns': 2, 'invalid_utf8': 1,
                                         'line_too_long': 1}
    tgt.write_bytes(b'eins .\nzwei .\n')
    with pytest.raises(ValueError, match=r'a\.de has 2 lines but .*a\.en has 5'):
        tsv.index(f'{src},{tgt}', 2)


HALF_A = 'apple banana cherry grape lemon mango melon peach pear plum'.split()
HALF_B = 'oak pine birch cedar maple willow spruce alder aspen larch'.split()


def test_vocabulary_sample_covers_the_whole_corpus(tmp_path, small_chunks):
    # The corpus's second half uses other words: a prefix sample would miss them.
    import random

    rng = random.Random(0)
    lines = [' '.join(rng.choice(words) for _ in range(6)) + ' .'
             for words in [HALF_A] * 500 + [HALF_B] * 500]
    train = toy_corpus.write_tsv(tmp_path / 'halves.tsv', lines)
    halves = {'root': tmp_path, 'train': train, 'validation': train, 'test': train}
    config = _config(halves, tmp_path / 'data', tokenizer_sentences=200)  # 100 of 1000 pairs
    sample = prepare.sample_sentences(config, 'train', 200, seed=0, echo=lambda _: None)
    first = sum(any(w in s for w in HALF_A + [w.upper() for w in HALF_A]) for s in sample)
    assert len(sample) == 200 and 70 <= first <= 130  # ~ half from each half
    assert sample == prepare.sample_sentences(config, 'train', 200, 0, echo=lambda _: None)
    assert sample != prepare.sample_sentences(config, 'train', 200, 1, echo=lambda _: None)
    tokenizer = pipeline.get_tokenizer(config)
    # Whole words of both halves are pieces (the target side's upper-case words are frequent).
    whole = {w for w in HALF_A + HALF_B if len(tokenizer.encode(w.upper())) == 1}
    assert len(whole & set(HALF_A)) >= 5 and len(whole & set(HALF_B)) >= 5, whole
    # The same sample and settings give the same vocabulary bytes (a fresh data_dir).
    again = pipeline.get_tokenizer(_config(halves, tmp_path / 'again', tokenizer_sentences=200))
    with open(tokenizer.path, 'rb') as a, open(again.path, 'rb') as b:
        assert a.read() == b.read()


def _files(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), 'rb') as f:
            out[name] = f.read()
    return out


def _vocab(corpus, data_dir):
    """The toy vocabulary, trained once and copied into data_dir (training is not the point)."""
    config = _config(corpus, data_dir)
    tokenizer = pipeline.get_tokenizer(_config(corpus, corpus['root'] / 'data'))
    os.makedirs(os.path.dirname(pipeline.vocab_path(config)), exist_ok=True)
    with open(tokenizer.path, 'rb') as f, open(pipeline.vocab_path(config), 'wb') as g:
        g.write(f.read())
    return config, Tokenizer(pipeline.vocab_path(config))


def test_one_and_two_workers_give_the_same_rows(corpus, tmp_path, monkeypatch, small_chunks):
    built = []
    for workers in ('1', '2'):
        monkeypatch.setenv(prepare.WORKERS_ENV, workers)
        config, tokenizer = _vocab(corpus, tmp_path / f'w{workers}')
        packed = cache.packed_split(config, tokenizer, 'train')
        built.append(_files(packed.directory))
        assert not os.path.exists(os.path.join(os.path.dirname(packed.directory),
                                               '.shards-' + os.path.basename(packed.directory)))
    assert built[0] == built[1]
    meta = json.loads(built[0]['meta.json'])
    assert meta['chunks'] == 8 and meta['pairs_read'] == meta['examples'] == 400
    for key in ('digest', 'rows', 'examples', 'skipped', 'fill', 'stats', 'dtypes', 'max_len',
                'source', 'split'):
        assert key in meta
    rows = b''.join(built[0][f'{a}.bin'] for a in shards.ARRAYS)
    assert len(rows) == meta['rows'] * 64 * (2 + 2 + 1 + 1)  # uint16 tokens, uint8 segments


def _count_encodes(monkeypatch):
    calls = []
    real = Tokenizer.encode_batch
    monkeypatch.setattr(Tokenizer, 'encode_batch',
                        lambda self, texts, *a: calls.append(len(texts)) or real(self, texts, *a))
    return calls


def test_a_new_max_len_repacks_without_tokenizing(corpus, tmp_path, monkeypatch, small_chunks):
    monkeypatch.setenv(prepare.WORKERS_ENV, '1')  # inline: the counter sees every call
    calls = _count_encodes(monkeypatch)
    config, tokenizer = _vocab(corpus, tmp_path)
    first = cache.packed_split(config, tokenizer, 'train')
    assert sum(calls) == 800  # both sides of 400 pairs, once
    calls.clear()
    short = cache.packed_split(_config(corpus, tmp_path, max_len=12), tokenizer, 'train')
    unpacked = cache.packed_split(_config(corpus, tmp_path, pack=False), tokenizer, 'train')
    assert calls == []
    assert short.meta['max_len'] == 12 and short.meta['skipped']['longer_than_max_len_12'] > 0
    assert unpacked.num_rows == 400 and first.num_rows < 400
    assert first.meta['stats'] == short.meta['stats']  # from the same token ids


def test_length_stats_from_histograms_equal_the_direct_ones():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 1000):
        src, tgt = rng.integers(2, 300, n), rng.integers(2, 40, n)
        hists = {'src': np.bincount(src), 'tgt': np.bincount(tgt)}
        got, want = prepare._hist_stats(hists), cache.length_stats(src, tgt)
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got), (got, want)


# A preparation that tokenizes slowly (a sleep per sentencepiece call), one chunk at a time.
_SLOW = """
import json, sys, time
from t2t.data import cache, prepare
from t2t.data.tokenizer import Tokenizer
from tests.helpers import tiny_config
corpus, data_dir = json.loads(sys.argv[1]), sys.argv[2]
corpus['root'] = __import__('pathlib').Path(corpus['root'])
prepare.CHUNK_PAIRS = 50
real = Tokenizer.encode_batch
Tokenizer.encode_batch = lambda self, *a: time.sleep(0.3) or real(self, *a)
config = tiny_config(corpus, data_dir=data_dir)
cache.packed_split(config, Tokenizer(sys.argv[3]), 'train')
"""


def test_a_killed_preparation_resumes_to_identical_bytes(corpus, tmp_path, monkeypatch,
                                                         small_chunks):
    monkeypatch.setenv(prepare.WORKERS_ENV, '1')
    clean_config, clean_tok = _vocab(corpus, tmp_path / 'clean')
    clean = cache.packed_split(clean_config, clean_tok, 'train')
    config, tokenizer = _vocab(corpus, tmp_path / 'killed')
    tokens = prepare.token_dir(config, tokenizer, 'train')
    args = {k: str(v) for k, v in corpus.items() if k != 'validation_texts'}
    proc = start_script('-c', _SLOW, json.dumps(args), config.data_dir, tokenizer.path,
                        devices=8, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    def finished_chunks():  # chunks are written to a temporary name first, then renamed
        return sum(f.endswith('.npz') for f in os.listdir(tokens)) if os.path.isdir(tokens) else 0

    while finished_chunks() < 3 and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # mid-chunk: its sentencepiece calls sleep
    proc.wait()
    done = sorted(f for f in os.listdir(tokens) if f.endswith('.npz'))
    final = os.path.join(config.data_dir, 'packed',
                         'train-' + cache.cache_key(config, tokenizer, 'train'))
    assert 3 <= len(done) < 8 and not os.path.exists(final)  # killed mid-preparation
    calls = _count_encodes(monkeypatch)
    resumed = cache.packed_split(config, tokenizer, 'train')
    # Only the chunks without a token shard are tokenized again (2 calls each: both sides).
    assert len(calls) == 2 * (8 - len(done))
    assert os.path.basename(resumed.directory) == os.path.basename(clean.directory)
    assert resumed.directory == final
    assert _files(resumed.directory) == _files(clean.directory)
    assert not [f for f in os.listdir(tokens) if '.tmp-' in f]  # a killed writer's file removed


def test_an_evaluation_pair_dropped_at_read_time_is_an_error(corpus, tmp_path):
    test = tmp_path / 'test.tsv'
    test.write_text('one two .\tTWO ONE\n\t\nthree four .\tFOUR THREE\n', encoding='utf-8')
    config = _config(dict(corpus, test=str(test)), corpus['root'] / 'data')
    tokenizer = pipeline.get_tokenizer(config)
    with pytest.raises(ValueError, match=r"1 pairs of evaluation split 'test' were dropped while "
                                         r'reading \(empty=1\).*allow_eval_drops'):
        pipeline.eval_split(config, tokenizer, 'test')
    with pytest.raises(ValueError, match='dropped while reading'):
        pipeline.split_texts(config, 'test')
    config.allow_eval_drops = True
    ev = pipeline.eval_split(config, tokenizer, 'test')
    assert ev.read_skipped == {'empty': 1} and len(ev.sources) == 2


def test_a_torn_meta_json_or_evaluation_cache_is_prepared_again(corpus, tmp_path, monkeypatch,
                                                                capsys):
    # After a host crash a renamed file can come back torn: it must count as not done.
    monkeypatch.setenv(prepare.WORKERS_ENV, '1')
    config, tokenizer = _vocab(corpus, tmp_path)
    first = cache.packed_split(config, tokenizer, 'train')
    meta_path = os.path.join(first.directory, prepare.META_NAME)
    whole = open(meta_path, 'rb').read()
    for torn in (whole[:len(whole) // 2], b''):
        with open(meta_path, 'wb') as f:
            f.write(torn)
        calls = _count_encodes(monkeypatch)
        again = cache.packed_split(config, tokenizer, 'train')  # no traceback: built again
        assert calls == []  # re-packed from the kept token shards
        assert open(meta_path, 'rb').read() == whole and again.meta == first.meta
        assert 'is incomplete' in capsys.readouterr().out
    # An array shorter than meta.json says (its bytes lost, the rename kept): built again too.
    inputs = os.path.join(first.directory, 'inputs.bin')
    os.truncate(inputs, os.path.getsize(inputs) // 2)
    assert cache.read_meta(first.directory) is None
    assert cache.packed_split(config, tokenizer, 'train').meta['digest'] == first.meta['digest']
    # A torn tokenized evaluation split: read and tokenized again, the same examples.
    ev = pipeline.eval_split(config, tokenizer, 'validation')
    path = pipeline.eval_path(config, tokenizer, 'validation')
    with open(path, 'r+b') as f:
        f.truncate(10)
    again = pipeline.eval_split(config, tokenizer, 'validation')
    assert again.inputs == ev.inputs and again.references == ev.references


def test_progress_lines_name_pairs_rate_eta_and_memory():
    lines = []
    with progress.Stage('train: x', total=1000, done=100, echo=lines.append,
                        interval=0.05) as stage:
        stage.advance(300)
        time.sleep(0.6)
    assert lines and all(
        __import__('re').fullmatch(r'train: x: 400/1,000 pairs \(40\.0%\), [\d,]+ pairs/s, '
                                   r'ETA \S+, RSS \d+\.\d\d GB', line) for line in lines), lines
    assert stage.summary().startswith('train: x: 300 pairs in ')
    assert 'peak RSS' in stage.summary() and '(100 pairs done before, resumed)' in stage.summary()
    assert progress.tree_rss() > 10e6


def test_sources_chunks_of_an_index_source(tmp_path):
    config = tiny_config({'root': tmp_path, 'train': '', 'validation': '',
                          'test': ''}, dataset='recall', data_dir=str(tmp_path))
    chunks, total = sources.chunks(config, 'test', 300)
    whole = sources.open_split(config, 'test').read(0, total)
    got = [p for c in chunks for p in sources.read_chunk(config, 'test', c)[0]]
    assert got == whole and len(chunks) == -(-total // 300)


def test_bench_data_prep_runs_at_toy_size(tmp_path):
    ding = tmp_path / 'de-en'  # a stand-in for the trans-de-en file: 300 sentence pairs
    ding.write_text(''.join(f'Satz {i} ist hier gut. :: Sentence {i} is good here.\n'
                            for i in range(300)), encoding='utf-8')
    out = run_script('bench/data_prep.py', '--pairs=500', '--vocab_size=400',
                     '--tokenizer_sentences=400', f'--dir={tmp_path / "bench"}',
                     '--limit_pairs=500', devices=8, env={'T2T_TRANS_DE_EN': str(ding)})
    results = [json.loads(line[len('RESULT '):]) for line in out.stdout.splitlines()
               if line.startswith('RESULT ')]
    assert out.returncode == 0 and len(results) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    r = results[0]
    assert r['pairs'] == 500 and r['peak_gb'] > 0 and r['limit_pairs'] == 500
    assert r['tokpack_pairs_s'] > 0 and r['pack_pairs_s'] > 0 and r['limit_pairs_s'] > 0
    # The repack reads cached ids: no tokenizing time at all (500 pairs may tokenize in under
    # the CPU clock's resolution, so the first pass's time is not asserted; the tokenizer-call
    # count is: test_a_new_max_len_repacks_without_tokenizing).
    assert r['tokenize_cpu_s'] >= 0 and r['repack_tokenize_cpu_s'] == 0
    assert '| 500 |' in out.stdout
    assert not os.path.exists(tmp_path / 'bench' / 'corpus-500.tsv')  # deleted without --keep


_POOL = """
import concurrent.futures, multiprocessing, os, time
from t2t.data import shards
if __name__ == '__main__':
    pool = concurrent.futures.ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context('spawn'), initializer=shards.init_worker,
        initargs=(None,))
    pids = {pool.submit(os.getpid).result() for _ in range(8)}
    print(' '.join(map(str, sorted(pids))), flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'  # a zombie has exited
    except OSError:
        return False


def test_workers_exit_when_their_preparation_is_killed():
    proc = start_script('-c', _POOL, devices=8, text=True, stdout=subprocess.PIPE)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids and all(map(_alive, pids))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20
    while any(map(_alive, pids)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))
