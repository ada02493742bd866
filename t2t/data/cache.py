"""Pre-tokenized, pre-packed training rows on disk, built once per data, tokenizer and packing.

Tokenizing and packing on the fly gives ~4k pairs/s per core; the pipeline instead reads packed rows
from memory-mapped files here, so a batch is one fancy-index per array. The packing is epoch
independent: the rows are shuffled per epoch by the grain pipeline, not re-packed. The rows are
built by t2t/data/prepare.py: streamed in chunks, tokenized and packed by worker processes into
shards (resumable), then concatenated here in chunk order.

Layout of `<data_dir>/packed/<split>-<key>/`: `<name>.bin` raw row-major [R, L] arrays for inputs,
targets and their segment ids, and `meta.json` (dtypes, shape, counts, length statistics, the
sha256 `digest` of the rows). The key hashes everything that changes the rows, so a stale cache is
never read. While it is built, the shards live in `<data_dir>/packed/.shards-<split>-<key>/`.
Every file is fsynced and meta.json written last (t2t/data/durable.py); a directory whose
meta.json does not parse or whose arrays are shorter than it says is built again.
"""

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from t2t.data import durable, multihost, packing, prepare, progress, shards, shared, sources
from t2t.data.tokenizer import EOS_ID, Tokenizer
from t2t.infra import distributed

CACHE_VERSION = 3
ARRAYS = shards.ARRAYS


def length_stats(src_lens: np.ndarray, tgt_lens: np.ndarray) -> dict[str, float]:
    """mean / p95 / max tokens (EOS included) of each side."""
    out = {}
    for side, lens in (('src', src_lens), ('tgt', tgt_lens)):
        lens = lens if len(lens) else np.zeros(1)
        out[f'{side}_mean'] = float(np.mean(lens))
        out[f'{side}_p95'] = float(np.percentile(lens, 95))
        out[f'{side}_max'] = int(np.max(lens))
    return out


def tokenize(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids with EOS appended."""
    return [ids + [EOS_ID] for ids in tokenizer.encode_batch(texts)]


def usable(pairs: list[tuple[str, str]], skipped: collections.Counter) -> list[tuple[str, str]]:
    kept = [(s, t) for s, t in pairs if s and t]
    skipped['empty'] += len(pairs) - len(kept)
    return kept


@dataclasses.dataclass(frozen=True)
class PackedSplit:
    """Memory-mapped packed rows of one split, with the counts of how they were made."""

    directory: str
    arrays: dict[str, np.ndarray]  # name -> [R, L] memmap
    meta: dict

    @property
    def num_rows(self) -> int:
        return self.meta['rows']

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """A batch: int32 [B, L] arrays for `rows`, positions derived from the segment ids."""
        rows = np.asarray(rows)
        batch = {k: v[rows].astype(np.int32) for k, v in self.arrays.items()}
        batch['inputs_positions'] = packing.positions(batch['inputs_segment_ids'])
        batch['targets_positions'] = packing.positions(batch['targets_segment_ids'])
        return batch


def cache_key(config, tokenizer: Tokenizer, split: str, tag: str = '') -> str:
    with open(tokenizer.path, 'rb') as f:
        vocab_hash = hashlib.sha256(f.read()).hexdigest()
    # Not shuffle_seed: the rows are mixed by a fixed seed; the pipeline shuffles them per epoch.
    parts = [CACHE_VERSION, sources.split_fingerprint(config, split), config.source_lang,
             config.target_lang, config.max_len, bool(config.pack), vocab_hash,
             prepare.CHUNK_PAIRS] + ([tag] if tag else [])
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def read_meta(directory: str) -> dict | None:
    """meta.json of a packed directory whose arrays are whole (each as long as meta.json says),
    or None: missing, torn (a host crash after the rename, before the bytes reached the disk) or
    not this version's. Such a directory is prepared again, never read."""
    try:
        with open(os.path.join(directory, prepare.META_NAME), encoding='utf-8') as f:
            meta = json.load(f)
        row = meta['rows'] * meta['max_len']
        whole = all(os.path.getsize(os.path.join(directory, name + '.bin'))
                    == row * np.dtype(meta['dtypes'][name]).itemsize for name in ARRAYS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if whole else None


def _load(directory: str) -> PackedSplit:
    meta = read_meta(directory)
    if meta is None:
        raise RuntimeError(f'{directory} is incomplete (meta.json unreadable or the arrays '
                           'short): remove it and prepare again')
    shape = (meta['rows'], meta['max_len'])
    arrays = {name: np.memmap(os.path.join(directory, name + '.bin'), dtype=meta['dtypes'][name],
                              mode='r', shape=shape) for name in ARRAYS}
    return PackedSplit(directory, arrays, meta)


def packed_dir(config, tokenizer: Tokenizer, split: str, tag: str = '') -> str:
    return os.path.join(config.data_dir, 'packed',
                        f'{split}-{cache_key(config, tokenizer, split, tag)}')


def packed_split(config, tokenizer: Tokenizer, split: str, *, tag: str = '',
                 label: str = '') -> PackedSplit:
    """The packed rows of `split`, built on first use.

    With several processes every process must call it: process 0 builds first (or, with
    config.shared_data_dir, takes the share's copy, else builds and uploads) while the others
    wait; then a process whose data_dir does not hold process 0's cache copies it from the share,
    or without one builds the same rows itself (they depend only on the data, the vocabulary and
    the settings).

    `tag`: a piece put first in every source (a mixture member's); `label`: the name of these
    rows among several of one split (a mixture member's) in the processes' barriers.
    """
    wait = config.data_wait_timeout_s
    first = distributed.process_index() == 0
    label = label or split
    directory = multihost.process_0_path(
        config, packed_dir(config, tokenizer, split, tag) if first else None, f'packed-{label}',
        wait)
    if first:
        _obtain(config, tokenizer, split, directory, tag)
    distributed.wait_for(f'packed-{label}', f'process 0 builds the packed rows of {label} in '
                         f'{directory}', wait, processes=[0])
    if not first:
        if shared.enabled(config):
            shared.require(config, directory, f'the packed rows of {label}')
        else:
            _build_once(config, tokenizer, split, directory, tag)
    packed = _load(directory)
    # Hosts that hold other rows (another library version, a stale or foreign cache) would mix
    # different data into one global batch: stop before the first step instead.
    distributed.agree(f'the packed rows of {label} (rows:digest)',
                      f'{packed.num_rows}:{packed.meta["digest"]}', wait)
    return packed


def _obtain(config, tokenizer: Tokenizer, split: str, directory: str, tag: str) -> None:
    """The packed rows in `directory`: the share's copy where it has one, else built here (from
    the share's token shards where it has those) and uploaded with the token shards."""
    if not shared.enabled(config):
        _build_once(config, tokenizer, split, directory, tag)
        return
    if shared.fetch(config, directory) != shared.ABSENT:
        return
    tokens = prepare.token_dir(config, tokenizer, split, tag)
    if read_meta(directory) is None:
        shared.fetch(config, tokens)  # another max_len or packing: re-packed, not re-tokenized
        _build_once(config, tokenizer, split, directory, tag)
    shared.publish(config, tokens)
    shared.publish(config, directory)


def _build_once(config, tokenizer: Tokenizer, split: str, directory: str, tag: str = '') -> None:
    """Builds into a unique temporary directory renamed into place: concurrent builders (or a
    crash) never leave a half-written cache. The shards stay until the rename, so a killed build
    resumes from them. A directory left torn by a host crash is built again."""
    root = os.path.dirname(directory)
    if read_meta(directory) is not None:
        return
    if os.path.exists(directory):
        progress.echo(f'{directory} is incomplete (meta.json unreadable or the arrays short, '
                      'e.g. after a host crash): preparing it again')
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    shard_dir = os.path.join(root, '.shards-' + os.path.basename(directory))
    tmp = tempfile.mkdtemp(dir=root, prefix='.building-')
    try:
        prepare.build_packed(config, tokenizer, split, tmp, shard_dir, tag=tag)
        durable.fsync_dir(tmp)
        durable.replace(tmp, directory)
        shutil.rmtree(shard_dir, ignore_errors=True)
    except OSError:
        if read_meta(directory) is None:
            raise  # not a concurrent build by another process that won the rename
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
