"""One process of a jax.distributed job that gets its data exactly as train.py does before its
first step (loop._training_data, then the evaluation split), counting what it reads and tokenizes.

    python -m tests.data_driver '{"corpus": {...}, "data_dir": "...", "shared_data_dir": "...",
                                  "workdir": "...", "distributed": {...}}'

Counted (by wrapping the functions every path goes through): `tokenize`, calls of the tokenizer's
encode / encode_batch and of sentencepiece training; `corpus`, reads of the corpus (opening a
split, indexing or reading its chunks, hashing its files for a cache key; the TFDS download sits
behind opening a split). Prints one JSON line: the counts, the sha256 of every prepared file under
data_dir, the data identity a checkpoint would record, and digests of the first training batches
and of the tokenized evaluation split.
"""

import collections
import hashlib
import json
import os
import pathlib
import sys

COUNTS = collections.Counter()


def _counting(owner, name: str, kind: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        COUNTS[kind] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _install() -> None:
    from t2t.data import pipeline, sources, tokenizer

    _counting(tokenizer.Tokenizer, 'encode', 'tokenize')
    _counting(tokenizer.Tokenizer, 'encode_batch', 'tokenize')
    _counting(pipeline, 'train_tokenizer', 'tokenize')
    for name in ('open_split', 'read_chunk', 'chunks', 'split_fingerprint'):
        _counting(sources, name, 'corpus')


def _file_digests(data_dir: str) -> dict[str, str]:
    out = {}
    for top in ('vocab', 'packed', 'eval'):
        for path in sorted(pathlib.Path(data_dir, top).rglob('*')):
            hidden = any(part.startswith('.') for part in path.relative_to(data_dir).parts)
            if path.is_file() and not hidden and path.suffix != '.vocab':
                out[str(path.relative_to(data_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def main(spec: dict) -> None:
    import jax

    d = spec['distributed']
    jax.distributed.initialize(d['coordinator'], d['num_processes'], d['process_id'])
    _install()
    from t2t import data
    from t2t.train import loop
    from tests.helpers import tiny_config

    corpus = dict(spec['corpus'], root=pathlib.Path(spec['corpus']['root']))
    config = tiny_config(corpus, data_dir=spec['data_dir'],
                         shared_data_dir=spec['shared_data_dir'])
    os.environ['T2T_DATA_WORKERS'] = '1'  # tokenized in this process, where it is counted
    tokenizer, train_iter, identity = loop._training_data(config, spec['workdir'], None)
    batches = hashlib.sha256()
    for _ in range(3):
        for key, value in sorted(next(train_iter).items()):
            batches.update(key.encode() + value.tobytes())
    ev = data.eval_split(config, tokenizer, config.eval_split)
    print(json.dumps({'counts': dict(COUNTS), 'files': _file_digests(config.data_dir),
                      'identity': identity, 'batches': batches.hexdigest(),
                      'eval': hashlib.sha256(json.dumps([ev.sources, ev.references, ev.inputs,
                                                         ev.targets]).encode()).hexdigest()}),
          flush=True)


if __name__ == '__main__':
    main(json.loads(sys.argv[1]))
