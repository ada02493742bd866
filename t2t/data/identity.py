"""What identifies the data a run trains on, and the checks that keep a run on the same data.

- Content digests of corpus files (TSV / parallel text), memoized in DATA_DIR/digests by path,
  size and mtime: a copied corpus (new path and mtime) is hashed once and then keys the same
  vocabulary and caches as the original.
- The vocabulary's content digest (sha256 of the sentencepiece model's bytes).
- The run's data identity, stored in every checkpoint's metadata (`DATA_KEY`): the vocabulary
  digest, the packed training cache's row count and digest, and the batch size. A resumed run
  must match it (`check_resume`); a changed batch size or cache is accepted only with
  config.allow_data_change, and then the data position is mapped by rows consumed.
- The workdir's own copy of the vocabulary, WORKDIR/vocab.model, written by the first run (process
  0): evaluate.py decodes with it and never trains a vocabulary; a run resumed or evaluated with
  another vocabulary stops with one line.
"""

from __future__ import annotations

import hashlib
import json
import os

from t2t.infra import workdir as wd
from t2t.infra.exits import ConfigError

DATA_KEY = 'data_identity'  # in the checkpoint metadata
VOCAB_NAME = 'vocab.model'  # WORKDIR/vocab.model: the vocabulary the run was trained with
_BLOCK = 1 << 22  # bytes hashed at a time


class DataMismatchError(ConfigError):
    """A run resumed or evaluated with other data than it was trained with (one line)."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _memo(path: str, data_dir: str) -> tuple[str, str]:
    """(stamp, memo file) of a local file: its path, size and mtime name its remembered digest."""
    stat = os.stat(path)
    stamp = f'{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}'
    return stamp, os.path.join(data_dir, 'digests',
                               hashlib.sha256(stamp.encode()).hexdigest()[:24] + '.json')


def content_digest(path: str, data_dir: str) -> str:
    """sha256 of a local file's bytes, remembered in DATA_DIR/digests by (path, size, mtime)."""
    stamp, memo = _memo(path, data_dir)
    try:
        with open(memo, encoding='utf-8') as f:
            record = json.load(f)
        if record.get('stamp') == stamp:
            return record['sha256']
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    remember_digest(path, data_dir, digest, _stamped=(stamp, memo))
    return digest


def remember_digest(path: str, data_dir: str, digest: str, _stamped=None) -> None:
    """Records `digest` as the content digest of `path` as it is now (its bytes were just checked
    while written, e.g. a copy from the shared data_dir: not hashed again at the next start)."""
    stamp, memo = _stamped or _memo(path, data_dir)
    try:
        wd.write_atomic(memo, json.dumps({'stamp': stamp, 'sha256': digest}))
    except OSError:  # a read-only shared data_dir: hash again next time
        pass


def vocab_digest(tokenizer) -> str:
    return sha256_file(tokenizer.path)


def run_identity(tokenizer, packed, batch_size: int) -> dict:
    """What a checkpoint records about its data (see the module docstring)."""
    return {'vocab_sha256': vocab_digest(tokenizer), 'train_rows': int(packed.num_rows),
            'train_digest': packed.meta['digest'], 'batch_size': int(batch_size)}


def _short(digest: str | None) -> str:
    return (digest or 'none')[:12]


def check_resume(saved: dict | None, current: dict, iterator_state: dict | None, *,
                 allow_change: bool, where: str) -> dict | None:
    """Compares a checkpoint's data identity with this run's.

    Returns the iterator state to continue from (mapped when an allowed change moved it), or
    None to keep the restored one. Raises DataMismatchError in one line otherwise. A checkpoint
    written before identities were recorded (`saved` None) is accepted as it is.
    """
    if not saved:
        return None
    if saved['vocab_sha256'] != current['vocab_sha256']:
        raise DataMismatchError(
            f'{where} was trained with vocabulary {_short(saved["vocab_sha256"])} but this run '
            f'uses {_short(current["vocab_sha256"])}: another vocabulary turns every token into '
            'another word (use the vocabulary of the run: its WORKDIR/vocab.model)')
    changes = [f'{k} {saved[k]} -> {current[k]}'
               for k in ('batch_size', 'train_rows', 'train_digest') if saved[k] != current[k]]
    if not changes:
        return None
    if not allow_change:
        raise DataMismatchError(
            f'{where} was trained on other training data: {", ".join(changes)}; resuming '
            'would not continue its data order (set --config.allow_data_change=True if the '
            'change is meant)')
    if not iterator_state or 'next_index' not in iterator_state:
        return None
    # Continue after the same number of rows consumed (a batch size change keeps the epoch
    # position; a new cache can only be continued approximately).
    rows = int(iterator_state['next_index']) * saved['batch_size']
    mapped = dict(iterator_state, next_index=rows // current['batch_size'])
    print(f'{where}: data changed ({", ".join(changes)}), allow_data_change: continuing at '
          f'global batch {mapped["next_index"]} of {current["batch_size"]} rows ({rows} rows '
          f'consumed) instead of {iterator_state["next_index"]}', flush=True)
    return mapped


def pin_vocabulary(workdir, tokenizer, *, write: bool) -> None:
    """WORKDIR/vocab.model holds the run's vocabulary: copied there by the first run (`write`:
    process 0), compared on every later start. Raises DataMismatchError when they differ."""
    target = wd.path(workdir, VOCAB_NAME)
    pinned = wd.read_bytes(target)
    with open(tokenizer.path, 'rb') as f:
        ours = f.read()
    if pinned is None:
        if write:
            wd.write_atomic(target, ours)
        return
    if pinned != ours:
        raise DataMismatchError(
            f'{target} (the vocabulary this workdir was trained with, '
            f'{_short(hashlib.sha256(pinned).hexdigest())}) differs from {tokenizer.path} '
            f'({_short(hashlib.sha256(ours).hexdigest())}): the config would train on other '
            'token ids (check data_dir, vocab_path, vocab_size and the corpus)')


def local_vocabulary(workdir, data_dir: str) -> str | None:
    """A local file holding WORKDIR/vocab.model (the file itself for a local workdir, a copy
    under DATA_DIR/vocab/workdir-<digest>.model for a bucket), or None when the workdir has none.
    """
    source = wd.path(workdir, VOCAB_NAME)
    if not wd.is_url(source):
        return os.fspath(source) if source.exists() else None
    data = wd.read_bytes(source)
    if data is None:
        return None
    local = os.path.join(data_dir, 'vocab', f'workdir-{hashlib.sha256(data).hexdigest()[:16]}'
                         '.model')
    if not os.path.exists(local):
        wd.write_atomic(local, data)
    return local
