"""Streaming, parallel, resumable preparation of a training split.

Nothing holds the corpus: a split is cut into chunks of CHUNK_PAIRS lines (byte ranges of TSV
files, index ranges of TFDS sources) and every step reads one chunk at a time.

- `sample_sentences`: the vocabulary's sample, a seeded uniform choice of line numbers over the
  whole split (both sides of each chosen pair), read chunk by chunk.
- `build_packed`: worker processes (spawned: the parent may run jax threads) tokenize and pack
  the chunks into shard files (t2t/data/shards.py), then the packed shards are concatenated in
  chunk order into the memory-mapped arrays of t2t/data/cache.py, with meta.json. A killed
  preparation resumes from the shards on disk; the token shards are kept, so another max_len (or
  packing) re-packs without tokenizing again.

Workers: `T2T_DATA_WORKERS` or all available cores. Progress lines (t2t/data/progress.py) go
through `echo` (print by default).
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os

import numpy as np
from absl import logging

from t2t.data import durable, progress, shards, sources, tsv
from t2t.data.tokenizer import Tokenizer

CHUNK_PAIRS = 100_000  # lines per chunk: a worker's unit of work, memory and of loss on a kill
TOKENS_VERSION = 1  # bump when the token shards' content changes
WORKERS_ENV = 'T2T_DATA_WORKERS'
META_NAME = 'meta.json'  # written last (durably): a packed directory is whole when it parses


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    value = os.environ.get(WORKERS_ENV, '')
    if value and (not value.isdigit() or int(value) < 1):
        raise ValueError(f'{WORKERS_ENV}={value!r}: expected a number of worker processes >= 1')
    return int(value) if value else cores()


def sample_sentences(config, split: str, sentences: int, seed: int,
                     echo=progress.echo) -> list[str]:
    """Both sides of a uniform seeded sample of sentences // 2 pairs of the whole split."""
    chunks, total = sources.chunks(config, split, CHUNK_PAIRS)
    n = min(total, max(1, sentences // 2))
    picks = np.sort(np.random.default_rng(seed).choice(total, n, replace=False))
    bounds = np.searchsorted(picks, [c.first for c in chunks] + [total])
    texts = []
    with progress.Stage(f'{split}: vocabulary sample', total=total, echo=echo) as stage:
        for chunk, lo, hi in zip(chunks, bounds[:-1], bounds[1:], strict=True):
            if hi > lo:
                pairs, _, _ = sources.read_chunk(config, split, chunk, picks[lo:hi] - chunk.first)
                texts += [text for pair in pairs for text in pair]
            stage.advance(chunk.lines)
    echo(stage.summary() + f': {len(texts):,} sentences of {n:,} pairs')
    return texts


def token_dir(config, tokenizer: Tokenizer, split: str, tag: str = '') -> str:
    """Where the split's token shards live: keyed by its content, the vocabulary and the tag
    prepended to its sources (a mixture member's) only."""
    with open(tokenizer.path, 'rb') as f:
        vocab = hashlib.sha256(f.read()).hexdigest()
    parts = [TOKENS_VERSION, sources.split_fingerprint(config, split), config.source_lang,
             config.target_lang, vocab, CHUNK_PAIRS] + ([tag] if tag else [])
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return os.path.join(config.data_dir, 'tokens', f'{split}-{key}')


def _results(tasks: list[shards.Task], workers: int):
    """shards.run over `tasks`, inline (one worker) or in spawned processes, as they finish."""
    if workers == 1:
        for task in tasks:
            yield shards.run(task)
        return
    context = multiprocessing.get_context('spawn')
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=shards.init_worker,
            initargs=(tasks[0].tokenizer,)) as pool:
        futures = [pool.submit(shards.run, dataclasses.replace(task, tokenizer=None))
                   for task in tasks]
        try:
            for future in concurrent.futures.as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def _hist_stats(hists: dict[str, np.ndarray]) -> dict[str, float]:
    """cache.length_stats from length histograms: the same numbers, without per-pair arrays."""
    out = {}
    for side in ('src', 'tgt'):
        h = hists[side] if hists[side].sum() else np.ones(1, np.int64)  # as stats of [0]
        n, values = int(h.sum()), np.arange(len(h))
        rank = 0.95 * (n - 1)  # numpy's linear percentile: between sorted[floor] and [ceil]
        cum = np.cumsum(h)
        lo, hi = (int(np.searchsorted(cum, k, side='right')) for k in (int(rank),
                                                                       int(np.ceil(rank))))
        out[f'{side}_mean'] = float((h * values).sum() / n)
        out[f'{side}_p95'] = float(lo + (hi - lo) * (rank - int(rank)))
        out[f'{side}_max'] = int(np.flatnonzero(h)[-1])
    return out


def _add(total: np.ndarray, h: np.ndarray) -> np.ndarray:
    if len(h) > len(total):
        total = np.pad(total, (0, len(h) - len(total)))
    total[:len(h)] += h
    return total


def assemble(tasks: list[shards.Task], out_dir: str, *, split: str, name: str, max_len: int,
             vocab_size: int) -> dict:
    """The packed shards concatenated in chunk order into `<out_dir>/<array>.bin` + meta.json,
    each fsynced (meta.json last)."""
    files = {a: open(os.path.join(out_dir, a + '.bin'), 'wb') for a in shards.ARRAYS}
    skipped, skipped_lines = collections.Counter(), []
    hists = {'src': np.zeros(1, np.int64), 'tgt': np.zeros(1, np.int64)}
    rows = examples = target_tokens = lines = 0
    digests, dtypes = [], {}
    try:
        for task in tasks:
            shard = shards.load(task.packed_path)
            if shard is None:
                raise RuntimeError(f'{task.packed_path} is missing or unreadable: prepare again')
            arrays, counts = shard
            for a in shards.ARRAYS:
                files[a].write(np.ascontiguousarray(arrays[a]).data)
                dtypes[a] = arrays[a].dtype.name
            for side in hists:
                hists[side] = _add(hists[side], arrays[f'{side}_hist'])
            skipped.update(counts['read_skipped'])
            skipped[f'longer_than_max_len_{max_len}'] += counts['over_max_len']
            skipped_lines += counts['skipped_lines']
            rows += counts['rows']
            examples += counts['examples']
            target_tokens += counts['target_tokens']
            lines += counts['lines']
            digests.append(counts['digest'])
        for f in files.values():  # on disk before meta.json says they are whole
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    if name.startswith('tsv:'):
        tsv.warn_skipped(name[len('tsv:'):], skipped_lines)
    if not examples:
        raise ValueError(f'{name}: no pair fits max_len={max_len} (skipped: '
                         f'{dict(+skipped)}); raise --config.max_len')
    # A hash tree over the rows' bytes (chunk by chunk): the same whatever the worker count.
    meta = {'split': split, 'source': name, 'rows': rows, 'max_len': max_len,
            'pairs_read': lines, 'examples': examples, 'skipped': dict(sorted((+skipped).items())),
            'target_tokens': target_tokens, 'fill': target_tokens / max(1, rows * max_len),
            'stats': _hist_stats(hists), 'dtypes': dtypes or None,
            'digest': hashlib.sha256(''.join(digests).encode()).hexdigest(),
            'chunks': len(tasks), 'chunk_pairs': CHUNK_PAIRS, 'vocab_size': vocab_size}
    durable.write_bytes(os.path.join(out_dir, META_NAME), json.dumps(meta, indent=1).encode())
    return meta


def build_packed(config, tokenizer: Tokenizer, split: str, out_dir: str, shard_dir: str, *,
                 workers: int | None = None, echo=progress.echo, tag: str = '') -> dict:
    """Tokenizes (where not cached) and packs the split's chunks into `shard_dir`, resuming from
    the shards there, then assembles them into `out_dir`. Returns the meta. `tag`: a piece of
    the vocabulary put first in every source (a mixture member's, t2t/data/mixture.py)."""
    workers = default_workers() if workers is None else workers
    chunks, total = sources.chunks(config, split, CHUNK_PAIRS)
    name = sources.split_name(config, split)
    if not total:
        raise ValueError(f'{name}: no usable sentence pairs (no lines)')
    tokens = token_dir(config, tokenizer, split, tag)
    tag_id = tokenizer.tag_id(tag) if tag else -1
    os.makedirs(tokens, exist_ok=True)
    os.makedirs(shard_dir, exist_ok=True)
    for directory in (tokens, shard_dir):
        shards.remove_stale(directory)
    todo = [c for c in chunks
            if shards.load_info(os.path.join(shard_dir, f'chunk-{c.number:05d}.npz')) is None]
    workers = max(1, min(workers, len(todo)))
    threads = cores() if workers == 1 else 1  # one worker: sentencepiece's own threads
    tasks = [shards.Task(config, split, c, tokenizer,
                         os.path.join(tokens, f'chunk-{c.number:05d}.npz'),
                         os.path.join(shard_dir, f'chunk-{c.number:05d}.npz'),
                         config.max_len, bool(config.pack), threads, tag_id) for c in chunks]
    todo_set = {c.number for c in todo}
    done = sum(c.lines for c in chunks if c.number not in todo_set)
    work = collections.Counter()
    with progress.Stage(f'{split}: tokenize+pack', total=total, done=done, echo=echo) as stage:
        for result in _results([t for t in tasks if t.chunk.number in todo_set], workers):
            stage.advance(result['counts']['lines'])
            work.update({k: v for k, v in result.items() if k.endswith('_s')},
                        tokenized=int(result['tokenized']))
    phases = '; '.join(f'{label} {work[f"{p}_s"]:.2f} s, {work[f"{p}_cpu_s"]:.2f} CPU s'
                       for p, label in (('tokenize', 'read+tokenize'),
                                        ('load', 'cached ids loaded'), ('pack', 'packing')))
    echo(f'{stage.summary()}; {workers} worker(s), {len(todo)} of {len(chunks)} chunks built '
         f'({work["tokenized"]} tokenized, {len(todo) - work["tokenized"]} from cached token '
         f'ids); worker time: {phases}')
    logging.info('%s: token ids cached in %s', name, tokens)
    with progress.Stage(f'{split}: assemble', echo=echo) as stage:
        meta = assemble(tasks, out_dir, split=split, name=name, max_len=config.max_len,
                        vocab_size=tokenizer.vocab_size)
    echo(stage.summary())
    return meta
