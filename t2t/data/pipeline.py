"""Tokenizer preparation, the grain training iterator and evaluation batches.

Training: packed rows from the on-disk cache (t2t/data/cache.py) -> grain MapDataset: shuffle by
seed (reshuffled each epoch), repeat forever, this process's rows of each global batch, batch,
gather. Every step is an index computation, so `get_state()/set_state()` restore exactly.

Evaluation: every example of a split once, unpacked, bucketed by length to a few static lengths
(powers of two up to max_eval_len) so that one compile serves a bucket; `index` says where each row
came from (-1 for the padding rows of a bucket's last batch). Examples longer than max_eval_len are
skipped, counted in `EvalSplit.skipped` and logged.

Batch shapes (np.int32): B rows of this process, L = max_len, Lb = a bucket length.
  train: inputs, targets, *_segment_ids, *_positions [B, L]
  eval:  inputs, targets [B, Lb], index [B]
"""

import collections
import dataclasses
import hashlib
import os
from collections.abc import Iterator

import numpy as np
from absl import logging

from t2t.data import cache, sources
from t2t.data.tokenizer import Tokenizer, train_tokenizer

MIN_BUCKET = 8
TOKENIZER_VERSION = 2  # bump when train_tokenizer's fixed settings change


def split_names(config) -> dict[str, str]:
    return {'train': config.train_split, 'eval': config.eval_split, 'test': config.test_split}


def vocab_path(config) -> str:
    if config.vocab_path:
        return config.vocab_path
    # The name carries every setting that changes the trained model, so none is reused stale.
    settings = (TOKENIZER_VERSION, config.tokenizer_character_coverage, config.tokenizer_sentences,
                config.shuffle_seed)
    tag = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]
    name = f'{sources.dataset_id(config)}-{config.vocab_size}-{tag}.model'
    return os.path.join(config.data_dir, 'vocab', name)


def get_tokenizer(config) -> Tokenizer:
    """The shared vocabulary at vocab_path(config), trained on the training split if missing."""
    path = vocab_path(config)
    if os.path.exists(path):
        return Tokenizer(path)
    pairs = sources.open_split(config, config.train_split)
    n = min(len(pairs), max(1, config.tokenizer_sentences // 2))
    # a seeded sample, not a prefix: WMT's training split is a concatenation of corpora
    rows = np.sort(np.random.default_rng(config.shuffle_seed).choice(len(pairs), n, replace=False))
    texts = [t for i in rows.tolist() for t in pairs[i] if t]
    logging.info('training a %d-piece vocabulary on %d sentences of %s -> %s',
                 config.vocab_size, len(texts), pairs.name, path)
    return train_tokenizer(texts, path, config.vocab_size, config.tokenizer_sentences,
                           config.tokenizer_character_coverage)


def _rows_per_process(batch_size: int, process_count: int, what: str) -> int:
    if batch_size % process_count:
        raise ValueError(f'{what}={batch_size} is not divisible by process_count={process_count}')
    return batch_size // process_count


def train_iterator(config, tokenizer: Tokenizer, *, process_index: int = 0,
                   process_count: int = 1, num_threads: int = 2):
    """An endless grain DatasetIterator of packed training batches of this process."""
    import grain

    rows = _rows_per_process(config.batch_size, process_count, 'batch_size')
    packed = cache.packed_split(config, tokenizer, config.train_split)
    logging.info('%s: %d packed rows of %d pairs (fill %.3f); skipped %s', config.train_split,
                 packed.num_rows, packed.meta['examples'], packed.meta['fill'],
                 packed.meta['skipped'] or 'none')
    ds = grain.MapDataset.range(packed.num_rows).shuffle(seed=config.shuffle_seed).repeat()
    # global batch k is stream items [k*B, (k+1)*B); process p takes every P-th of them
    ds = ds.slice(slice(process_index, None, process_count))
    ds = ds.batch(rows, drop_remainder=True).map(packed.gather)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
    return iter(ds.to_iter_dataset(options))


def split_texts(config, split: str) -> tuple[list[str], list[str]]:
    """(sources, references) of a split in its original order: what eval `index` points into."""
    pairs = sources.open_split(config, split)
    kept = cache.usable(pairs.read(0, len(pairs)), collections.Counter())
    return [s for s, _ in kept], [t for _, t in kept]


def bucket_length(n: int, max_len: int) -> int:
    """The static padded length for a sequence of n tokens: a power of two, at most max_len."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), max_len)


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """A tokenized evaluation split: texts, token ids (+EOS) and what was skipped."""

    name: str
    sources: list[str]
    references: list[str]
    inputs: list[list[int]]
    targets: list[list[int]]
    skipped: tuple[int, ...]  # indices of examples longer than max_eval_len
    read_skipped: dict[str, int]  # lines dropped before indexing (empty, invalid UTF-8, ...)
    max_len: int

    def plan(self, batch_size: int, num_batches: int = -1,
             seed: int = 0) -> list[tuple[int, np.ndarray]]:
        """(bucket length, indices [batch_size] with -1 padding) of every batch, or of a fixed
        sample of num_batches of them (>= 0: see `sample_batches`)."""
        skipped = set(self.skipped)
        buckets = collections.defaultdict(list)
        for i, (s, t) in enumerate(zip(self.inputs, self.targets, strict=True)):
            if i not in skipped:
                buckets[bucket_length(max(len(s), len(t)), self.max_len)].append(i)
        batches = []
        for length in sorted(buckets):
            idx = np.array(buckets[length], np.int32)
            for start in range(0, len(idx), batch_size):
                chunk = idx[start:start + batch_size]
                pad = np.full(batch_size - len(chunk), -1, np.int32)
                batches.append((length, np.concatenate([chunk, pad])))
        return batches if num_batches < 0 else sample_batches(batches, num_batches, seed)

    def batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                num_batches: int = -1, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of every global batch of `batch_size` rows (or of the sample)."""
        rows = _rows_per_process(batch_size, process_count, 'eval_batch_size')
        for length, idx in self.plan(batch_size, num_batches, seed):
            idx = idx[process_index * rows:(process_index + 1) * rows]
            batch = {'inputs': np.zeros((rows, length), np.int32),
                     'targets': np.zeros((rows, length), np.int32), 'index': idx}
            for r, i in enumerate(idx.tolist()):
                if i >= 0:
                    batch['inputs'][r, :len(self.inputs[i])] = self.inputs[i]
                    batch['targets'][r, :len(self.targets[i])] = self.targets[i]
            yield batch


def sample_batches(batches: list, num: int, seed: int) -> list:
    """A fixed sample of `num` of the (bucket length, indices) batches, stratified by bucket.

    Each bucket gets its share of `num` in proportion to its batches (largest remainders round),
    drawn with `seed`; the result keeps the plan's order. The same arguments give the same
    sample, so every evaluation of a run sees the same sentences. num >= len(batches): all.
    """
    if num >= len(batches):
        return batches
    by_bucket = collections.defaultdict(list)
    for position, (length, _) in enumerate(batches):
        by_bucket[length].append(position)
    buckets = sorted(by_bucket)
    exact = np.array([num * len(by_bucket[b]) / len(batches) for b in buckets])
    quota = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - quota), kind='stable')[:num - quota.sum()]:
        quota[i] += 1
    rng = np.random.default_rng(seed)
    chosen = [p for b, q in zip(buckets, quota, strict=True)
              for p in rng.choice(by_bucket[b], q, replace=False).tolist()]
    return [batches[p] for p in sorted(chosen)]


def eval_split(config, tokenizer: Tokenizer, split: str) -> EvalSplit:
    pairs = sources.open_split(config, split)
    read_skipped = collections.Counter(pairs.skipped)
    kept = cache.usable(pairs.read(0, len(pairs)), read_skipped)
    if not kept:
        raise ValueError(f'{pairs.name}: no usable sentence pairs')
    srcs, refs = [s for s, _ in kept], [t for _, t in kept]
    inputs, targets = cache.tokenize(tokenizer, srcs), cache.tokenize(tokenizer, refs)
    limit = config.max_eval_len
    skipped = tuple(i for i, (s, t) in enumerate(zip(inputs, targets, strict=True))
                    if len(s) > limit or len(t) > limit)
    if skipped:
        logging.warning('%s: %d of %d examples are longer than max_eval_len=%d and are skipped',
                        pairs.name, len(skipped), len(kept), limit)
    return EvalSplit(pairs.name, srcs, refs, inputs, targets, skipped,
                     {k: v for k, v in read_skipped.items() if v}, limit)


def eval_batches(config, tokenizer: Tokenizer, split: str, *, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Every example of `split` (except those counted in eval_split(...).skipped) exactly once."""
    return eval_split(config, tokenizer, split).batches(config.eval_batch_size, process_index,
                                                        process_count)
