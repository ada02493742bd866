"""Hugging Face `datasets` as a source (`config.dataset = 'hf'`; pip install 't2t[hf]').

    --config.hf_path=DIR                       # a DatasetDict saved by save_to_disk: its splits
    --config.hf_path=parquet --config.hf_data_files.train='data/train-*.parquet' ...   # or json,
                                               # csv: data files per split (paths or globs)
    --config.hf_streaming=True                 # data files read as they stream, never copied
    --config.hf_source_field=translation.de --config.hf_target_field=translation.en

The fields default to a translation dataset's `translation.<source_lang>` and
`translation.<target_lang>`; a dotted name reads into a dict column. A row with an empty or
missing side is skipped and counted ('empty'), as for the other sources.

Data files are loaded with `datasets.load_dataset(BUILDER, data_files=..., split=...)`. Without
streaming, datasets converts them once into Arrow files under DATA_DIR/hf_cache (memory-mapped,
random access); with hf_streaming=True nothing is converted: each read streams the files from
the start of the split (the split's length is counted by one pass, a chunk is read by skipping
to it), so preparing a training split of C chunks streams it about C / 2 times over. Streaming
suits a corpus too large to copy once more; the packed training cache (t2t/data/cache.py) is
built from it once, and training reads that cache: packing, resume-exactness and multi-host
sharding are the other sources' own.

What keys the vocabulary and the caches (`fingerprint`): the content digests of the saved
directory's files or of the data files (t2t/data/identity.py, memoized by path, size and mtime),
with the builder, the split and the field names: new data, a copy elsewhere the same one.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import itertools
import os

BUILDERS = ('parquet', 'json', 'csv')


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise ValueError("dataset='hf' needs the datasets package (pip install 't2t[hf]')") from e
    return datasets


def fields(config) -> tuple[str, str]:
    """(source field, target field), dotted names allowed."""
    return (config.hf_source_field or f'translation.{config.source_lang}',
            config.hf_target_field or f'translation.{config.target_lang}')


def _is_saved(config) -> bool:
    return config.hf_path not in BUILDERS


def _files(config, split: str) -> list[str]:
    """The data files of a split: its hf_data_files entry, comma-separated paths or globs."""
    spec = config.hf_data_files.get(split, '')
    if not spec:
        raise ValueError(f'dataset=hf with hf_path={config.hf_path} needs '
                         f'--config.hf_data_files.{split}=FILES (split {split!r} has none)')
    paths = []
    for pattern in (p.strip() for p in spec.split(',')):
        found = sorted(glob.glob(pattern))
        if not found:
            raise ValueError(f'hf_data_files.{split}: {pattern!r} matches no file')
        paths += found
    return paths


def check(config) -> str | None:
    """What is wrong with config.hf_path (it follows 'hf_path=VALUE '), else None; reads no
    data."""
    if not config.hf_path:
        return (f'is required with dataset=hf: a directory saved by save_to_disk, or one of '
                f'{BUILDERS} with --config.hf_data_files.<split>=FILES')
    if _is_saved(config):
        if not os.path.isdir(config.hf_path):
            return f'is neither a directory saved by save_to_disk nor one of {BUILDERS}'
        if config.hf_streaming:
            return (f'is a saved directory (memory-mapped already): hf_streaming=True streams '
                    f'data files, with hf_path one of {BUILDERS}')
    return None


def _load(config, split: str):
    """The split as a datasets.Dataset (or IterableDataset when streaming)."""
    problem = check(config)
    if problem:
        raise ValueError(f'hf_path={config.hf_path!r} {problem}')
    datasets = _datasets()
    if _is_saved(config):
        saved = datasets.load_from_disk(config.hf_path)
        if isinstance(saved, datasets.Dataset):
            raise ValueError(f'{config.hf_path} holds one Dataset without splits: save a '
                             'DatasetDict with the splits train, validation, test')
        if split not in saved:
            raise ValueError(f'{config.hf_path} has splits {sorted(saved)}, not {split!r}')
        return saved[split]
    return datasets.load_dataset(
        config.hf_path, data_files={split: _files(config, split)}, split=split,
        streaming=bool(config.hf_streaming),
        cache_dir=os.path.join(config.data_dir, 'hf_cache'))


def _texts(rows: dict, field: str, n: int) -> list[str]:
    """The strings at a dotted field of a batch of rows (a dict of columns); '' where missing."""
    top, *rest = field.split('.')
    if top not in rows:
        raise ValueError(f'field {field!r}: the dataset has columns {sorted(rows)}')
    values = rows[top]
    for key in rest:
        for v in values:  # a misspelt key would skip every row as empty: an error instead
            if isinstance(v, dict) and key not in v:
                raise ValueError(f'field {field!r}: {key!r} is not among the keys {sorted(v)}')
        values = [v.get(key) if isinstance(v, dict) else None for v in values]
    out = [v.strip() if isinstance(v, str) else '' for v in values]
    if len(out) != n:
        raise ValueError(f'field {field!r}: {len(out)} values for {n} rows')
    return out


class HFPairs:
    """A split's (source, target) pairs: random access into Arrow files, or streamed."""

    def __init__(self, config, split: str):
        self._data = _load(config, split)
        self._fields = fields(config)
        self._streaming = bool(config.hf_streaming)
        self._len = None if self._streaming else len(self._data)
        self.name = split_name(config, split)
        self.skipped = collections.Counter()
        self.sequential = self._streaming  # a read costs a pass from the split's start

    def __len__(self) -> int:
        if self._len is None:  # one pass over the stream
            self._len = sum(1 for _ in self._data.select_columns(
                sorted({f.split('.')[0] for f in self._fields})))
        return self._len

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self.read(i, i + 1)[0]

    def read(self, start: int, stop: int) -> list[tuple[str, str]]:
        stop = min(stop, len(self))
        if start >= stop:
            return []
        if self._streaming:
            rows = list(itertools.islice(iter(self._data.skip(start)), stop - start))
            batch = {key: [row[key] for row in rows] for key in (rows[0] if rows else {})}
        else:
            batch = self._data[start:stop]
        n = stop - start
        src, tgt = (_texts(batch, f, n) for f in self._fields)
        return list(zip(src, tgt, strict=True))


def split_name(config, split: str) -> str:
    where = config.hf_path if _is_saved(config) else f'{config.hf_path}:{split}'
    return f'hf:{where}/{split}'


def fingerprint(config, split: str) -> str:
    """The digest of a split's data and how it is read (see the module docstring)."""
    from t2t.data import identity

    if _is_saved(config):
        root = os.path.join(config.hf_path, split)
        if not os.path.isdir(root):
            raise ValueError(f'{config.hf_path} has no split {split!r}')
        paths = sorted(glob.glob(os.path.join(root, '*')))
    else:
        paths = _files(config, split)
    parts = ['saved' if _is_saved(config) else config.hf_path, split, *fields(config)]
    parts += [identity.content_digest(p, config.data_dir) for p in paths if os.path.isfile(p)]
    return hashlib.sha256('|'.join(parts).encode()).hexdigest()[:16]
