"""Sentence pairs behind one interface, chosen by `config.dataset`:

- 'embedded': Debian trans-de-en (t2t/data/embedded.py), prepared once as a local TFDS dataset;
- 'tfds': a TFDS translation dataset such as wmt14_translate/de-en (t2t/data/tfds_wmt.py);
- 'tsv': your own files (t2t/data/tsv.py);
- 'hf': Hugging Face datasets saved to disk, or parquet / JSON / CSV files, streamed or not
  (t2t/data/hf.py);
- 'recall': the generated recall toy, with its own fixed vocabulary (t2t/data/recall.py).

`open_split` gives a random-access `Pairs`: len(), [i] -> (source, target) in the configured
direction, `read(start, stop)`, a `name` for messages, and `skipped` (lines dropped while reading).
It holds a TSV split in memory: fine for evaluation splits. Training splits are streamed instead:
`chunks` cuts a split into chunks of lines (byte ranges of TSV files, index ranges of the others)
and `read_chunk` reads one, in whichever process asks.
"""

import collections
import functools
import hashlib
import os
from typing import Protocol

import numpy as np

from t2t.data import embedded, hf, recall, tfds_wmt, tsv
from t2t.data.tsv import Chunk

DATASETS = ('embedded', 'tfds', 'tsv', 'hf', 'recall')


class Pairs(Protocol):
    name: str
    skipped: collections.Counter

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> tuple[str, str]: ...
    def read(self, start: int, stop: int) -> list[tuple[str, str]]: ...


class ListPairs:
    """Pairs held in memory (the TSV and recall sources)."""

    def __init__(self, pairs: list[tuple[str, str]], name: str, skipped: collections.Counter):
        self._pairs, self.name, self.skipped = pairs, name, skipped

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self._pairs[i]

    def read(self, start: int, stop: int) -> list[tuple[str, str]]:
        return self._pairs[start:stop]


def _check_dataset(config) -> None:
    if config.dataset not in DATASETS:
        raise ValueError(f'config.dataset={config.dataset!r}: expected one of {DATASETS}')


def _tsv_spec(config, split: str) -> str:
    spec = config.tsv_files.get(split, '')
    if not spec:
        raise ValueError(f'dataset=tsv needs --config.tsv_files.{split}=FILE.tsv or "SRC,TGT" '
                         f'(split {split!r} has no file)')
    return spec


def open_split(config, split: str) -> Pairs:
    """The pairs of one split (preparing the embedded corpus on first use)."""
    _check_dataset(config)
    src, tgt = config.source_lang, config.target_lang
    if config.dataset == 'tsv':
        spec = _tsv_spec(config, split)
        pairs, skipped = tsv.read_pairs(spec)
        return ListPairs(pairs, f'tsv:{spec}', skipped)
    if config.dataset == 'recall':
        return ListPairs(recall.pairs(config, split), f'{recall.dataset_id(config)}/{split}',
                         collections.Counter())
    if config.dataset == 'hf':
        return hf.HFPairs(config, split)
    if config.dataset == 'tfds':
        pairs = tfds_wmt.open_split(config.tfds_name, config.data_dir, split, src, tgt)
    else:
        tfds_wmt.check_direction(embedded.LANGUAGES, src, tgt, 'the embedded trans-de-en corpus')
        if split not in embedded.SPLITS:
            raise ValueError(f'split {split!r}: the embedded corpus has {embedded.SPLITS}')
        ds = embedded.builder(config.data_dir).as_data_source(split=split)
        pairs = tfds_wmt.RecordPairs(ds, src, tgt, f'trans_de_en/{split}')
    pairs.skipped = collections.Counter()
    return pairs


def _files_digest(config, split: str) -> str:
    """The content digest of a TSV split's file(s): a copy elsewhere gives the same one."""
    from t2t.data import identity

    paths = [p.strip() for p in _tsv_spec(config, split).split(',')]
    digests = [identity.content_digest(p, config.data_dir) for p in paths]
    return hashlib.sha256('|'.join(digests).encode()).hexdigest()[:16]


def dataset_id(config) -> str:
    """A file-name-safe name of the training data, for vocabulary paths: the corpus's name, or
    for TSV the digest of the training files' contents (not their path or mtime)."""
    _check_dataset(config)
    if config.dataset == 'embedded':
        return f'trans_de_en-{embedded.DATASET_VERSION}'
    if config.dataset == 'tfds':
        return config.tfds_name.replace('/', '-')
    if config.dataset == 'recall':
        return recall.dataset_id(config)
    if config.dataset == 'hf':
        return 'hf-' + hf.fingerprint(config, config.train_split)
    return 'tsv-' + _files_digest(config, config.train_split)


def split_fingerprint(config, split: str) -> str:
    """Changes whenever the texts of `split` change (the packed cache key): file contents."""
    if config.dataset == 'tsv':
        return 'tsv-' + _files_digest(config, split)
    if config.dataset == 'hf':
        return 'hf-' + hf.fingerprint(config, split)
    return f'{dataset_id(config)}|{split}'


def split_name(config, split: str) -> str:
    """The split's name in messages (as `open_split(...).name`), without reading it."""
    if config.dataset == 'tsv':
        return f'tsv:{_tsv_spec(config, split)}'
    if config.dataset == 'recall':
        return f'{recall.dataset_id(config)}/{split}'
    if config.dataset == 'hf':
        return hf.split_name(config, split)
    if config.dataset == 'tfds':
        return f'{config.tfds_name}/{split}'
    return f'trans_de_en/{split}'


@functools.lru_cache(maxsize=8)
def _tsv_index(spec: str, stamps: tuple, chunk_lines: int) -> tuple[tuple[Chunk, ...], int]:
    del stamps  # part of the memo key only: a changed file is indexed again
    chunks, total = tsv.index(spec, chunk_lines)
    return tuple(chunks), total


def chunks(config, split: str, chunk_lines: int) -> tuple[tuple[Chunk, ...], int]:
    """The split cut into chunks of `chunk_lines` lines (pairs), and its number of lines."""
    _check_dataset(config)
    if config.dataset == 'tsv':
        spec = _tsv_spec(config, split)
        stamps = tuple((os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns)
                       for p in tsv.paths_of(spec))
        return _tsv_index(spec, stamps, chunk_lines)
    total = len(_opened(config, split))
    return tuple(Chunk(k, first, min(chunk_lines, total - first))
                 for k, first in enumerate(range(0, total, chunk_lines))), total


_OPEN: dict = {}  # this process's opened (non-TSV) splits, for the chunks it reads


def _opened(config, split: str) -> Pairs:
    key = (split_fingerprint(config, split), config.data_dir, config.source_lang,
           config.target_lang)
    if key not in _OPEN:
        _OPEN[key] = open_split(config, split)
    return _OPEN[key]


def read_chunk(config, split: str, chunk: Chunk, select: np.ndarray | None = None
               ) -> tuple[list[tuple[str, str]], collections.Counter, list[tuple[int, str]]]:
    """(usable pairs, skip counts by reason, the first few (line, reason) skipped) of one chunk,
    or of its lines at the chunk-relative positions `select` only."""
    if config.dataset == 'tsv':
        return tsv.read_chunk(_tsv_spec(config, split), chunk, select)
    pairs = _opened(config, split)
    if select is None:
        raw = pairs.read(chunk.first, chunk.first + chunk.lines)
    elif getattr(pairs, 'sequential', False):  # a streamed split: one pass over the chunk
        lines = pairs.read(chunk.first, chunk.first + chunk.lines)
        raw = [lines[int(j)] for j in select]
    else:
        raw = [pairs[chunk.first + int(j)] for j in select]
    kept = [(s, t) for s, t in raw if s and t]
    skipped = collections.Counter({'empty': len(raw) - len(kept)} if len(raw) > len(kept) else {})
    return kept, skipped, []
