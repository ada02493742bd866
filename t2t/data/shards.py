"""The work on one chunk of a training split, run in a worker process (or inline).

A chunk's lines are read (t2t/data/sources.py `read_chunk`), tokenized into a *token shard*, and
packed into a *packed shard*; each shard is one .npz file written under a temporary name and
renamed into place, so a killed preparation leaves only whole shards and resumes from them.

- Token shard (DATA_DIR/tokens/<split>-<key>/chunk-NNNNN.npz): the chunk's usable pairs in file
  order as flat token arrays with EOS appended (`src`, `tgt`) and their lengths, plus what was
  skipped while reading. Independent of max_len, packing and seeds: a new max_len only re-packs.
- Packed shard (DATA_DIR/packed/.shards-<split>-<key>/chunk-NNNNN.npz): the chunk's rows [R, L]
  (pairs of at most max_len tokens a side, mixed by a fixed seed per chunk, then first-fit
  packed), the sha256 of their bytes, length histograms and counts.

A chunk's rows depend only on the chunk, so the rows of the split (the shards in chunk order) are
the same whatever the number of workers.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
import zipfile
from typing import Any

import numpy as np

from t2t.data import durable, packing, sources
from t2t.data.tokenizer import EOS_ID, Tokenizer
from t2t.data.tsv import Chunk

ARRAYS = ('inputs', 'targets', 'inputs_segment_ids', 'targets_segment_ids')
MIX_SEED = 0  # the fixed mix of each chunk before packing (the cache is shuffle_seed independent)
ENCODE_BATCH = 20_000  # texts per sentencepiece call: bounds a worker's Python lists


@dataclasses.dataclass(frozen=True)
class Task:
    """Everything a worker needs for one chunk (pickled to it)."""

    config: Any  # the ConfigDict: which source, which files
    split: str
    chunk: Chunk
    tokenizer: Any  # a Tokenizer (or the recall toy's); None: the worker's (`init_worker`)
    tokens_path: str
    packed_path: str
    max_len: int
    pack: bool
    threads: int  # sentencepiece threads for this chunk
    tag_id: int = -1  # >= 0: this id (a mixture member's tag) starts every source


_TMP = f'.tmp-{socket.gethostname()}-'  # + pid: a partial shard, renamed when whole


def save(path: str, arrays: dict[str, np.ndarray], info: dict) -> None:
    """One shard, written atomically and durably (a reader never sees a partial file)."""
    tmp = f'{path}{_TMP}{os.getpid()}'
    with open(tmp, 'wb') as f:
        np.savez(f, info=np.array(json.dumps(info, sort_keys=True)), **arrays)
        f.flush()
        os.fsync(f.fileno())  # whole on disk before the rename makes it count (durable.py)
    durable.replace(tmp, path)


def remove_stale(directory: str) -> None:
    """Removes partial shards of killed writers on this host (their process is gone)."""
    for name in os.listdir(directory):
        head, sep, pid = name.rpartition(_TMP)
        if not sep or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
        except OSError:
            pass  # alive (another user's): not ours to remove


def load(path: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """(arrays, info) of a shard, or None when it is missing or unreadable (built again)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k != 'info'}
            return arrays, json.loads(str(z['info']))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
        return None


def load_info(path: str) -> dict | None:
    """The info of a shard (its arrays are not read), or None when missing or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(str(z['info']))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError):
        return None


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.int32


def encode(tokenizer: Tokenizer, texts: list[str], threads: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of all texts end to end, each followed by EOS [T], lengths with EOS [N])."""
    dtype = token_dtype(tokenizer.vocab_size)
    flats, lens = [np.zeros(0, dtype)], [np.zeros(0, np.int32)]
    for i in range(0, len(texts), ENCODE_BATCH):
        flat, n = packing.flatten(tokenizer.encode_batch(texts[i:i + ENCODE_BATCH], threads),
                                  dtype)
        out = np.full(len(flat) + len(n), EOS_ID, dtype)
        out[np.arange(len(flat)) + np.repeat(np.arange(len(n)), n)] = flat  # EOS after each
        flats.append(out)
        lens.append((n + 1).astype(np.int32))
    return np.concatenate(flats), np.concatenate(lens)


_WORKER_TOKENIZER = None  # a worker process's tokenizer, loaded once (not once per chunk)


def init_worker(tokenizer) -> None:
    """A worker process's start: keeps the tokenizer, and exits when the parent is gone (a
    killed preparation must not leave its workers waiting for work forever)."""
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name='t2t-parent-watch').start()


def tokenize(task: Task) -> tuple[dict[str, np.ndarray], dict]:
    """The token shard of a chunk: read, tokenized, saved."""
    pairs, skipped, examples = sources.read_chunk(task.config, task.split, task.chunk)
    tokenizer = _WORKER_TOKENIZER if task.tokenizer is None else task.tokenizer
    src, src_lens = encode(tokenizer, [s for s, _ in pairs], task.threads)
    if task.tag_id >= 0:  # an id, not text: the tag is one token whatever the segmentation
        src = np.insert(src, np.cumsum(src_lens) - src_lens, task.tag_id).astype(src.dtype)
        src_lens = src_lens + 1
    tgt, tgt_lens = encode(tokenizer, [t for _, t in pairs], task.threads)
    del pairs
    arrays = {'src': src, 'src_lens': src_lens, 'tgt': tgt, 'tgt_lens': tgt_lens}
    info = {'chunk': task.chunk.number, 'lines': task.chunk.lines,
            'read_skipped': dict(skipped), 'skipped_lines': examples}
    save(task.tokens_path, arrays, info)
    return arrays, info


def pack(task: Task, tokens: dict[str, np.ndarray], info: dict) -> dict:
    """The packed shard of a chunk from its token shard: saved; returns its counts."""
    ls, lt = tokens['src_lens'], tokens['tgt_lens']
    order = np.random.default_rng([MIX_SEED, task.chunk.number]).permutation(len(ls))
    keep = order[(ls[order] <= task.max_len) & (lt[order] <= task.max_len)]
    rows = packing.pack_flat(tokens['src'], ls, tokens['tgt'], lt, keep, task.max_len,
                             task.pack)
    digest = hashlib.sha256()
    for name in ARRAYS:
        digest.update(np.ascontiguousarray(rows[name]).data)
    counts = {'chunk': task.chunk.number, 'lines': info['lines'],
              'read_skipped': info['read_skipped'], 'skipped_lines': info['skipped_lines'],
              'over_max_len': int(len(ls) - len(keep)), 'examples': int(len(keep)),
              'target_tokens': int(lt[keep].sum()), 'rows': int(len(rows['inputs'])),
              'digest': digest.hexdigest()}
    hists = {'src_hist': np.bincount(ls).astype(np.int64),
             'tgt_hist': np.bincount(lt).astype(np.int64)}
    save(task.packed_path, {**rows, **hists}, counts)
    return counts


def run(task: Task) -> dict:
    """Builds what the chunk lacks (token shard, packed shard). Returns the packed shard's counts
    and this call's work: {'counts', 'tokenized', 'packed', '<phase>_s', '<phase>_cpu_s'} with
    phases tokenize (read, tokenize, save), load (the cached token ids) and pack (pack, save);
    _s in seconds of wall time, _cpu_s in CPU seconds of this process (all its threads)."""
    out = {'tokenized': False, 'packed': False}
    counts = load_info(task.packed_path)
    if counts is not None:
        return {**out, 'counts': counts}
    clock = (time.perf_counter(), time.process_time())
    token_shard = load(task.tokens_path) if os.path.exists(task.tokens_path) else None
    phase = 'load'
    if token_shard is None:
        token_shard, phase = tokenize(task), 'tokenize'
    middle = (time.perf_counter(), time.process_time())
    counts = pack(task, *token_shard)
    end = (time.perf_counter(), time.process_time())
    out.update({'counts': counts, 'tokenized': phase == 'tokenize', 'packed': True,
                f'{phase}_s': middle[0] - clock[0], f'{phase}_cpu_s': middle[1] - clock[1],
                'pack_s': end[0] - middle[0], 'pack_cpu_s': end[1] - middle[1]})
    return out
