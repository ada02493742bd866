"""Pre-tokenized, pre-packed training rows on disk, built once per data, tokenizer and packing.

Tokenizing and packing on the fly gives ~4k pairs/s per core; the pipeline instead reads packed rows
from memory-mapped files here, so a batch is one fancy-index per array. The packing is epoch
independent: the rows are shuffled per epoch by the grain pipeline, not re-packed.

Layout of `<data_dir>/packed/<split>-<key>/`: `<name>.bin` raw row-major [R, L] arrays for inputs,
targets and their segment ids, and `meta.json` (dtypes, shape, counts, length statistics). The key
hashes everything that changes the rows, so a stale cache is never read.
"""

import collections
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from t2t.data import multihost, packing, sources
from t2t.data.tokenizer import EOS_ID, Tokenizer

CACHE_VERSION = 2
MIX_SEED = 0  # the fixed mix of each chunk before packing (the cache is seed independent)
CHUNK_PAIRS = 200_000  # pairs tokenized and packed at a time: bounds memory for WMT-sized splits
ARRAYS = ('inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids')


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
             config.target_lang, config.max_len, bool(config.pack), vocab_hash]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _load(directory: str) -> PackedSplit:
    with open(os.path.join(directory, 'meta.json')) as f:
        meta = json.load(f)
    shape = (meta['rows'], meta['max_len'])
    arrays = {name: np.memmap(os.path.join(directory, name + '.bin'), dtype=meta['dtypes'][name],
                              mode='r', shape=shape) for name in ARRAYS}
    return PackedSplit(directory, arrays, meta)


def _build(config, tokenizer: Tokenizer, split: str, out_dir: str) -> None:
    pairs = sources.open_split(config, split)
    max_len = config.max_len
    token_dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    dtypes = {'inputs': token_dtype, 'targets': token_dtype,
              'inputs_segment_ids': np.uint16, 'targets_segment_ids': np.uint16}
    files = {name: open(os.path.join(out_dir, name + '.bin'), 'wb') for name in ARRAYS}
    digests = {name: hashlib.sha256() for name in ARRAYS}  # the rows' identity across hosts
    skipped = collections.Counter(pairs.skipped)
    src_lens, tgt_lens = [], []
    rows = examples = real_tokens = 0
    try:
        for chunk, start in enumerate(range(0, len(pairs), CHUNK_PAIRS)):
            texts = usable(pairs.read(start, min(start + CHUNK_PAIRS, len(pairs))), skipped)
            # the corpus may be sorted (trans-de-en is, by headword): mix it before packing
            order = np.random.default_rng([MIX_SEED, chunk]).permutation(len(texts))
            texts = [texts[i] for i in order]
            src = tokenize(tokenizer, [s for s, _ in texts])
            tgt = tokenize(tokenizer, [t for _, t in texts])
            ls = np.fromiter(map(len, src), np.int32, len(src))
            lt = np.fromiter(map(len, tgt), np.int32, len(tgt))
            src_lens.append(ls)
            tgt_lens.append(lt)
            fits = (ls <= max_len) & (lt <= max_len)
            skipped[f'longer_than_max_len_{max_len}'] += int((~fits).sum())
            keep = np.flatnonzero(fits)
            if not len(keep):
                continue
            examples += len(keep)
            real_tokens += int(lt[keep].sum())
            rows_chunk = packing.pack([src[i] for i in keep], [tgt[i] for i in keep], max_len,
                                      packed=config.pack, dtype=token_dtype)
            rows += len(rows_chunk['inputs'])
            for name in ARRAYS:
                data = rows_chunk[name].astype(dtypes[name]).tobytes()
                files[name].write(data)
                digests[name].update(data)
    finally:
        for f in files.values():
            f.close()
    if not examples:
        raise ValueError(f'{pairs.name}: no pair fits max_len={max_len} '
                         f'(skipped: {dict(skipped)}); raise --config.max_len')
    stats = length_stats(np.concatenate(src_lens), np.concatenate(tgt_lens))
    meta = {'split': split, 'source': pairs.name, 'rows': rows, 'max_len': max_len,
            'examples': examples, 'skipped': {k: v for k, v in skipped.items() if v},
            'target_tokens': real_tokens, 'fill': real_tokens / (rows * max_len),
            'stats': stats, 'dtypes': {k: np.dtype(v).name for k, v in dtypes.items()},
            'digest': hashlib.sha256(''.join(digests[n].hexdigest() for n in ARRAYS)
                                     .encode()).hexdigest()}
    with open(os.path.join(out_dir, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1)


def packed_split(config, tokenizer: Tokenizer, split: str) -> PackedSplit:
    """The packed rows of `split`, built on first use.

    With several processes every process must call it: process 0 builds first while the others
    wait; a process whose data_dir does not hold process 0's cache (a host-local disk) then builds
    the same rows itself (they depend only on the data, the vocabulary and the settings).
    """
    key = cache_key(config, tokenizer, split)
    directory = os.path.join(config.data_dir, 'packed', f'{split}-{key}')
    wait = config.data_wait_timeout_s
    if multihost.process_index() == 0:
        _build_once(config, tokenizer, split, directory)
    multihost.wait_for_process_0(f'packed-{split}', f'process 0 builds the packed rows of '
                                 f'{split} in {directory}', wait)
    if multihost.process_index() != 0:
        _build_once(config, tokenizer, split, directory)
    packed = _load(directory)
    # Hosts that hold other rows (another library version, a stale or foreign cache) would mix
    # different data into one global batch: stop before the first step instead.
    multihost.check_same(f'the packed rows of {split} (rows:digest)',
                         f'{packed.num_rows}:{packed.meta["digest"]}', wait)
    return packed


def _build_once(config, tokenizer: Tokenizer, split: str, directory: str) -> None:
    """Builds into a unique temporary directory renamed into place: concurrent builders (or a
    crash) never leave a half-written cache."""
    root = os.path.dirname(directory)
    if not os.path.exists(os.path.join(directory, 'meta.json')):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root, prefix='.building-')
        try:
            _build(config, tokenizer, split, tmp)
            os.replace(tmp, directory)
        except OSError:
            if not os.path.exists(os.path.join(directory, 'meta.json')):
                raise  # not a concurrent build by another process that won the rename
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
