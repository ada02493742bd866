"""Tokenizer preparation, the grain training iterator and evaluation batches.

Training: packed rows from the on-disk cache (t2t/data/cache.py) -> grain MapDataset: shuffle by
seed (reshuffled each epoch), repeat forever, batch into GLOBAL batches of packed-row ids, gather
the rows this process feeds. Global batch k is the same whatever the number of processes, and the
iterator position (a global batch counter) is too, so a run may resume on another process count.
Every step is an index computation, so `get_state()/set_state()` restore exactly.

Evaluation: every example of a split once, unpacked, bucketed by length to a few static lengths
(powers of two up to max_eval_len) so that one compile serves a bucket; `index` says where each row
came from (-1 for padding rows). Batches are global: every process builds the same ones and puts
the rows its devices hold. Examples longer than max_eval_len are skipped, counted in
`EvalSplit.skipped` and logged.

Several processes: process 0 trains the vocabulary and builds the caches while the others wait;
they then use process 0's vocabulary bytes (t2t/data/multihost.py). With config.shared_data_dir
they copy the vocabulary, the packed rows and the tokenized evaluation splits from the share and
never read the corpus (t2t/data/shared.py).

Batch shapes (np.int32): B rows (this process's rows of a training batch), L = max_len,
G rows of a global evaluation batch, Lb = a bucket length.
  train: inputs, targets, *_segment_ids, *_positions [B, L]
  eval:  inputs, targets [G, Lb], index [G]
"""

import collections
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator

import numpy as np
from absl import logging

from t2t.data import (
    cache,
    durable,
    identity,
    mixture,
    multihost,
    prepare,
    progress,
    shared,
    sources,
    subword,
)
from t2t.data.tokenizer import Tokenizer, train_tokenizer
from t2t.ids import PAD_ID
from t2t.infra import distributed

MIN_BUCKET = 8
TOKENIZER_VERSION = 3  # bump when train_tokenizer's fixed settings or the sample change
EVAL_CACHE_VERSION = 1  # bump when reading or tokenizing an evaluation split changes


def vocab_path(config) -> str:
    if config.vocab_path:
        return config.vocab_path
    # The name carries every setting that changes the trained model, so none is reused stale.
    # Not shuffle_seed: a seed sweep trains on one vocabulary.
    settings = (TOKENIZER_VERSION, config.tokenizer_character_coverage, config.tokenizer_sentences,
                config.vocab_seed)
    if tags := mixture.tags(config):  # a mixture's tags are pieces of the vocabulary
        settings += (tags,)
    tag = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]
    name = f'{sources.dataset_id(config)}-{config.vocab_size}-{tag}.model'
    return os.path.join(config.data_dir, 'vocab', name)


def get_tokenizer(config) -> Tokenizer:
    """The shared vocabulary at vocab_path(config), trained on the training split if missing.

    With several processes every process must call it: process 0 loads or trains the vocabulary,
    the others then get its bytes (written where their file is missing or differs), and all check
    that they hold the same vocabulary.
    """
    if config.dataset == 'recall':  # fixed symbols, no sentencepiece
        from t2t.data import recall

        return recall.tokenizer(config)
    if distributed.process_count() == 1:
        return _load_or_train(config, vocab_path(config))
    wait = config.data_wait_timeout_s
    first = distributed.process_index() == 0
    path = multihost.process_0_path(config, vocab_path(config) if first else None, 'vocabulary',
                                    wait)
    if first:
        _load_or_train(config, path)
    multihost.share_file(path, f'process 0 loads or trains the vocabulary {path}', wait)
    distributed.agree(f'the vocabulary {os.path.basename(path)} (sha256)',
                      multihost.file_digest(path), wait)
    return Tokenizer(path)


def _load_or_train(config, path: str) -> Tokenizer:
    """The vocabulary at `path`: the shared data_dir's copy where it has one, else the local file,
    else trained; uploaded to the shared data_dir where it lacks it."""
    share = shared.enabled(config) and shared.relative(config, path) is not None
    if share and shared.fetch(config, path) != shared.ABSENT:
        return Tokenizer(path)
    tokenizer = Tokenizer(path) if os.path.exists(path) else _train(config, path)
    if share:
        shared.publish(config, path)
    return tokenizer


def _train(config, path: str) -> Tokenizer:
    # A seeded uniform sample of the whole split, not a prefix (WMT's training split is a
    # concatenation of corpora), streamed: the corpus is never held.
    texts = prepare.sample_sentences(config, config.train_split, config.tokenizer_sentences,
                                     config.vocab_seed)
    name = sources.split_name(config, config.train_split)
    if not texts:
        raise ValueError(f'{name}: no usable sentence pairs for the vocabulary')
    logging.info('training a %d-piece vocabulary on %d sentences of %s -> %s',
                 config.vocab_size, len(texts), name, path)
    with progress.Stage(f'{config.train_split}: vocabulary training ({len(texts):,} sentences, '
                        f'{prepare.cores()} cores)') as stage:
        tokenizer = train_tokenizer(texts, path, config.vocab_size, config.tokenizer_sentences,
                                    config.tokenizer_character_coverage,
                                    user_defined_symbols=mixture.tags(config))
    progress.echo(stage.summary())
    return tokenizer


def train_rows(config, tokenizer: Tokenizer) -> cache.PackedSplit | mixture.MixedRows:
    """The training rows: the training split's packed rows, or config.train_mixture's members'.
    With spm_alpha > 0 their meta's `digest` (the run's data identity) also covers the subword
    sampling settings: a run resumed with others would not continue its data."""
    if config.train_mixture.strip():
        packed = mixture.mixed_rows(config, tokenizer)
    else:
        packed = cache.packed_split(config, tokenizer, config.train_split)
    if config.spm_alpha > 0:
        meta = dict(packed.meta, rows_digest=packed.meta['digest'],
                    digest=subword.digest(packed.meta['digest'], config))
        packed = dataclasses.replace(packed, meta=meta)
    return packed


def train_iterator(config, tokenizer: Tokenizer, *, rows=None, num_threads: int = 2,
                   packed: cache.PackedSplit | mixture.MixedRows | None = None):
    """An endless grain DatasetIterator of packed training batches.

    Global batch k holds the packed rows at stream positions [k*B, (k+1)*B) of the shuffled,
    repeated row stream (B = config.batch_size), or of the mixed stream of config.train_mixture
    (t2t/data/mixture.py). `rows`: the sorted row positions within a global batch that this
    process feeds (t2t.sharding.process_rows); None: all of them. Every process must call it (the
    packed cache is built by process 0 first). `packed`: `train_rows(config, tokenizer)` when the
    caller has them already. With spm_alpha > 0 every row's pairs are segmented again by
    sampling, seeded by shuffle_seed and the row's stream position (t2t/data/subword.py).
    """
    import grain

    batch_size = config.batch_size
    take = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
    if take.ndim != 1 or not len(take) or take.min() < 0 or take.max() >= batch_size:
        raise ValueError(f'rows must be positions in a batch of batch_size={batch_size}, got '
                         f'{take.tolist()[:8]}')
    if packed is None:
        packed = train_rows(config, tokenizer)
    if isinstance(packed, mixture.MixedRows):
        ds = packed.stream(config.shuffle_seed)
    else:
        ds = grain.MapDataset.range(packed.num_rows).shuffle(seed=config.shuffle_seed).repeat()
    ds = ds.batch(batch_size, drop_remainder=True)
    if config.spm_alpha > 0:
        sampler = subword.Sampler.from_config(config, tokenizer)
        ds = ds.map_with_index(lambda k, ids: sampler(packed.gather(ids[take]),
                                                      k * batch_size + take))
    else:
        ds = ds.map(lambda ids: packed.gather(ids[take]))
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * num_threads)
    return iter(ds.to_iter_dataset(options))


def _check_drops(config, name: str, split: str, skipped: collections.Counter) -> None:
    """A pair dropped while reading (empty side, invalid UTF-8, ...) is an error unless
    config.allow_eval_drops: a score over fewer references must never be silent."""
    if skipped and not config.allow_eval_drops:
        detail = ', '.join(f'{k}={v}' for k, v in sorted(skipped.items()))
        raise ValueError(f'{name}: {skipped.total()} pairs of evaluation split {split!r} '
                         f'were dropped while reading ({detail}): scores would cover fewer '
                         'references; fix the data or set --config.allow_eval_drops=True')


def _read_all(config, split: str) -> tuple[str, list[tuple[str, str]], collections.Counter]:
    """(name, usable pairs, read-time skips) of an evaluation split, held in memory."""
    pairs = sources.open_split(config, split)
    skipped = collections.Counter(pairs.skipped)
    kept = cache.usable(pairs.read(0, len(pairs)), skipped)
    return pairs.name, kept, +skipped


def _read_eval(config, split: str) -> tuple[str, list[tuple[str, str]], collections.Counter]:
    name, kept, skipped = _read_all(config, split)
    _check_drops(config, name, split, skipped)
    return name, kept, skipped


def split_texts(config, split: str) -> tuple[list[str], list[str]]:
    """(sources, references) of a split in its original order: what eval `index` points into."""
    _, kept, _ = _read_eval(config, split)
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

    def plan(self, batch_size: int, global_rows: int | None = None, num_batches: int = -1,
             seed: int = 0) -> list[tuple[int, np.ndarray]]:
        """(bucket length, indices [G] with -1 padding) of every batch of batch_size examples, or
        of a fixed sample of num_batches of them (>= 0: see `sample_batches`).

        G = global_rows (>= batch_size, default batch_size): batches are padded to G rows, e.g. a
        multiple of the devices they are split over, without changing which examples they hold.
        """
        global_rows = batch_size if global_rows is None else global_rows
        if global_rows < batch_size:
            raise ValueError(f'global_rows={global_rows} < batch_size={batch_size}')
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
                pad = np.full(global_rows - len(chunk), -1, np.int32)
                batches.append((length, np.concatenate([chunk, pad])))
        return batches if num_batches < 0 else sample_batches(batches, num_batches, seed)

    def batches(self, batch_size: int, global_rows: int | None = None, num_batches: int = -1,
                seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Every global batch of `plan` (or of its sample): the same on every process (each puts
        its own rows)."""
        for length, idx in self.plan(batch_size, global_rows, num_batches, seed):
            rows = len(idx)
            batch = {'inputs': np.full((rows, length), PAD_ID, np.int32),
                     'targets': np.full((rows, length), PAD_ID, np.int32), 'index': idx}
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


def eval_path(config, tokenizer: Tokenizer, split: str) -> str:
    """Where the tokenized evaluation split lives: keyed by its texts and the vocabulary."""
    parts = [EVAL_CACHE_VERSION, sources.split_fingerprint(config, split), config.source_lang,
             config.target_lang, identity.vocab_digest(tokenizer)]
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return os.path.join(config.data_dir, 'eval', f'{split}-{key}.json')


_RECORD_KEYS = ('name', 'sources', 'references', 'inputs', 'targets', 'read_skipped')


def _tokenized(config, tokenizer: Tokenizer, split: str) -> dict:
    """An evaluation split read and tokenized: what eval/<split>-<key>.json holds."""
    name, kept, skipped = _read_all(config, split)
    srcs, refs = [s for s, _ in kept], [t for _, t in kept]
    return {'name': name, 'sources': srcs, 'references': refs,
            'inputs': cache.tokenize(tokenizer, srcs), 'targets': cache.tokenize(tokenizer, refs),
            'read_skipped': dict(sorted(skipped.items()))}


def _read_record(path: str) -> dict | None:
    """A tokenized evaluation split from disk, or None when missing or torn (made again)."""
    try:
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        n = len(record['sources'])
        if any(len(record[k]) != n for k in ('references', 'inputs', 'targets')):
            return None
        return {k: record[k] for k in _RECORD_KEYS}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _obtain_eval(config, tokenizer: Tokenizer, split: str, path: str) -> dict:
    """The tokenized split at `path`: the shared data_dir's copy where it has one, else the local
    file, else read and tokenized here (then written, and uploaded to the share)."""
    share = shared.enabled(config)
    if share and shared.fetch(config, path) != shared.ABSENT:
        record = _read_record(path)
        if record is not None:
            return record
    record = _read_record(path)
    if record is None:
        record = _tokenized(config, tokenizer, split)
        try:
            durable.write_bytes(path, json.dumps(record).encode())
        except OSError:  # a read-only data_dir: tokenized again next time
            return record
    if share:
        shared.publish(config, path)
    return record


def eval_split(config, tokenizer: Tokenizer, split: str) -> EvalSplit:
    """The tokenized evaluation split, cached in DATA_DIR/eval/. With config.shared_data_dir and
    several processes every process must call it: process 0 reads and tokenizes it (or takes the
    share's copy) while the others wait, then they copy it from the share."""
    wait = config.data_wait_timeout_s
    if shared.enabled(config) and distributed.process_count() > 1:
        first = distributed.process_index() == 0
        path = multihost.process_0_path(
            config, eval_path(config, tokenizer, split) if first else None, f'eval-{split}', wait)
        record = _obtain_eval(config, tokenizer, split, path) if first else None
        distributed.wait_for(f'eval-{split}', f'process 0 tokenizes the evaluation split {split} '
                             f'into {path}', wait, processes=[0])
        if not first:
            shared.require(config, path, f'the evaluation split {split}')
            record = _read_record(path)
        digest = hashlib.sha256(json.dumps(record).encode()).hexdigest()
        distributed.agree(f'the evaluation split {split} (sha256)', digest, wait)
    else:
        record = _obtain_eval(config, tokenizer, split, eval_path(config, tokenizer, split))
    return _from_record(config, split, record)


def _from_record(config, split: str, record: dict) -> EvalSplit:
    name = sources.split_name(config, split)  # this config's (a copied corpus: its own path)
    _check_drops(config, name, split, collections.Counter(record['read_skipped']))
    if not record['sources']:
        raise ValueError(f'{name}: no usable sentence pairs')
    inputs, targets = record['inputs'], record['targets']
    limit = config.max_eval_len
    skipped = tuple(i for i, (s, t) in enumerate(zip(inputs, targets, strict=True))
                    if len(s) > limit or len(t) > limit)
    if skipped:
        logging.warning('%s: %d of %d examples are longer than max_eval_len=%d and are skipped',
                        name, len(skipped), len(inputs), limit)
    return EvalSplit(name, record['sources'], record['references'], inputs, targets, skipped,
                     {k: v for k, v in record['read_skipped'].items() if v}, limit)


def eval_batches(config, tokenizer: Tokenizer, split: str) -> Iterator[dict[str, np.ndarray]]:
    """Every example of `split` (except those counted in eval_split(...).skipped) exactly once."""
    return eval_split(config, tokenizer, split).batches(config.eval_batch_size)
