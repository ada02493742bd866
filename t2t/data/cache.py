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
"""

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from t2t import distributed
from t2t.data import packing, prepare, shards, sources
from t2t.data.tokenizer import EOS_ID, Tokenizer

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


def cache_key(config, tokenizer: Tokenizer, split: str) -> str:
    with open(tokenizer.path, 'rb') as f:
        vocab_hash = hashlib.sha256(f.read()).hexdigest()
    # Not shuffle_seed: the rows are mixed by a fixed seed; the pipeline shuffles them per epoch.
    parts = [CACHE_VERSION, sources.split_fingerprint(config, split), config.source_lang,
             config.target_lang, config.max_len, bool(config.pack), vocab_hash,
             prepare.CHUNK_PAIRS]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _load(directory: str) -> PackedSplit:
    with open(os.path.join(directory, 'meta.json')) as f:
        meta = json.load(f)
    shape = (meta['rows'], meta['max_len'])
    arrays = {name: np.memmap(os.path.join(directory, name + '.bin'), dtype=meta['dtypes'][name],
                              mode='r', shape=shape) for name in ARRAYS}
    return PackedSplit(directory, arrays, meta)


def packed_split(config, tokenizer: Tokenizer, split: str) -> PackedSplit:
    """The packed rows of `split`, built on first use.

    With several processes every process must call it: process 0 builds first while the others
    wait; a process whose data_dir does not hold process 0's cache (a host-local disk) then builds
    the same rows itself (they depend only on the data, the vocabulary and the settings).
    """
    key = cache_key(config, tokenizer, split)
    directory = os.path.join(config.data_dir, 'packed', f'{split}-{key}')
    wait = config.data_wait_timeout_s
    if distributed.process_index() == 0:
        _build_once(config, tokenizer, split, directory)
    distributed.wait_for(f'packed-{split}', f'process 0 builds the packed rows of {split} in '
                         f'{directory}', wait, processes=[0])
    if distributed.process_index() != 0:
        _build_once(config, tokenizer, split, directory)
    packed = _load(directory)
    # Hosts that hold other rows (another library version, a stale or foreign cache) would mix
    # different data into one global batch: stop before the first step instead.
    distributed.agree(f'the packed rows of {split} (rows:digest)',
                      f'{packed.num_rows}:{packed.meta["digest"]}', wait)
    return packed


def _build_once(config, tokenizer: Tokenizer, split: str, directory: str) -> None:
    """Builds into a unique temporary directory renamed into place: concurrent builders (or a
    crash) never leave a half-written cache. The shards stay until the rename, so a killed build
    resumes from them."""
    root = os.path.dirname(directory)
    if os.path.exists(os.path.join(directory, 'meta.json')):
        return
    os.makedirs(root, exist_ok=True)
    shard_dir = os.path.join(root, '.shards-' + os.path.basename(directory))
    tmp = tempfile.mkdtemp(dir=root, prefix='.building-')
    try:
        prepare.build_packed(config, tokenizer, split, tmp, shard_dir)
        os.replace(tmp, directory)
        shutil.rmtree(shard_dir, ignore_errors=True)
    except OSError:
        if not os.path.exists(os.path.join(directory, 'meta.json')):
            raise  # not a concurrent build by another process that won the rename
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
