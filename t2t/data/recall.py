"""The recall toy: remember the first symbol of a sequence (`config.dataset = 'recall'`).

A source is `recall_length` symbols: the first is '0' or '1', the others are drawn from 'a' 'b'
'c' 'd'; the target is the first symbol (then EOS). Nothing in the rest of the sequence tells the
answer, so the decoder must look back at source position 0: attention does it in one step at any
length, where a recurrent model must carry the symbol through every later position.

With `recall_distractors` the later symbols are drawn from all six, so '0' and '1' also occur
after position 0 and only the position tells the answer. Without it (the default), the answer is
also the only reserved symbol present, which a model can detect by averaging over the whole
sequence instead of attending to position 0.

Pairs are generated (no files), deterministically from (recall_length, recall_distractors,
shuffle_seed). A sequence
belongs to the split its content hashes to (80% train, 10% validation, 10% test), so the held-out
splits never share a sequence with training; each held-out split holds `recall_eval_examples`
distinct sequences, the training split `recall_train_examples` draws (repeats allowed).

Texts are the symbols separated by spaces ('1 c a d b b a c' -> '1'); `RecallTokenizer` maps them to
fixed ids (PAD 0, EOS 1, UNK 2, then '0' '1' 'a' 'b' 'c' 'd' = 3 .. 8) behind the interface of
t2t.data.tokenizer.Tokenizer, so training, evaluation and decoding run unchanged.
"""

import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np

from t2t import ids as ids_lib
from t2t.ids import UNK_ID
from t2t.infra import workdir as wd

VERSION = 1  # bump when the generated pairs change
FIRST_SYMBOLS = ('0', '1')  # the two reserved answers, only ever at position 0
OTHER_SYMBOLS = ('a', 'b', 'c', 'd')
PIECES = ('<pad>', '</s>', '<unk>', *FIRST_SYMBOLS, *OTHER_SYMBOLS)
SPLITS = {'train': (0, 80), 'validation': (80, 90), 'test': (90, 100)}  # hash buckets of 100
_CHUNK = 4096  # candidate sequences drawn at a time


class RecallTokenizer:
    """A fixed vocabulary of whitespace-separated symbols, read from a file of one piece a line.

    Same interface as t2t.data.tokenizer.Tokenizer (encode / encode_batch / decode / vocab_size /
    piece / path); pickles by path.
    """

    def __init__(self, path: str):
        self.path = str(path)
        with open(self.path, encoding='utf-8') as f:
            self._pieces = tuple(f.read().split())
        if self._pieces[:3] != PIECES[:3]:
            raise ValueError(f'{self.path}: expected <pad> </s> <unk> as ids 0/1/2, got '
                             f'{self._pieces[:3]}')
        self._ids = {p: i for i, p in enumerate(self._pieces)}

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(symbol, UNK_ID) for symbol in text.split()]

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        del num_threads  # a dictionary lookup needs no threads
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Symbols of `ids` up to the first EOS, space-separated; PAD is ignored."""
        return ' '.join(self.piece(i) for i in ids_lib.content(ids))

    def piece(self, i: int) -> str:
        i = int(i)
        return self._pieces[i] if 0 <= i < len(self._pieces) else PIECES[UNK_ID]

    def __getstate__(self):
        return {'path': self.path}

    def __setstate__(self, state):
        self.__init__(state['path'])


def tokenizer(config) -> RecallTokenizer:
    """The recall vocabulary, written once to data_dir/vocab (atomically) and read from there."""
    path = os.path.join(config.data_dir, 'vocab', f'recall-v{VERSION}.vocab')
    if not os.path.exists(path):
        wd.write_atomic(path, ''.join(p + '\n' for p in PIECES))
    return RecallTokenizer(path)


def _bucket(codes: np.ndarray) -> int:
    """0 .. 99 from the sequence's content: the same sequence always lands in the same split."""
    return int.from_bytes(hashlib.blake2b(codes.tobytes(), digest_size=8).digest(), 'little') % 100


def generate(length: int, split: str, num: int, seed: int, distinct: bool,
             distractors: bool = False) -> list[np.ndarray]:
    """`num` sequences of symbol indices into FIRST_SYMBOLS + OTHER_SYMBOLS for `split`."""
    if length < 2:
        raise ValueError(f'recall_length={length}: at least 2 (the first symbol and one other)')
    if split not in SPLITS:
        raise ValueError(f'split {split!r}: the recall toy has {tuple(SPLITS)}')
    lo, hi = SPLITS[split]
    later = len(FIRST_SYMBOLS + OTHER_SYMBOLS) if distractors else len(OTHER_SYMBOLS)
    if distinct and num > 2 * later ** (length - 1) * (hi - lo) // 200:
        raise ValueError(f'recall_eval_examples={num} is more than half the {split} sequences of '
                         f'length {length}: lower it or raise recall_length')
    rng = np.random.default_rng([seed, length, list(SPLITS).index(split), int(distractors)])
    out, seen = [], set()
    while len(out) < num:
        codes = np.empty((_CHUNK, length), np.uint8)
        codes[:, 0] = rng.integers(0, len(FIRST_SYMBOLS), _CHUNK)
        codes[:, 1:] = len(FIRST_SYMBOLS) - (later - len(OTHER_SYMBOLS)) + rng.integers(
            0, later, (_CHUNK, length - 1))
        for row in codes:
            if not lo <= _bucket(row) < hi:
                continue
            if distinct:
                key = row.tobytes()
                if key in seen:
                    continue
                seen.add(key)
            out.append(row)
            if len(out) == num:
                break
    return out


def pairs(config, split: str) -> list[tuple[str, str]]:
    """(source text, target text) of a split."""
    symbols = np.array(FIRST_SYMBOLS + OTHER_SYMBOLS)
    held_out = split != 'train'
    num = config.recall_eval_examples if held_out else config.recall_train_examples
    rows = generate(config.recall_length, split, num, config.shuffle_seed, distinct=held_out,
                    distractors=config.recall_distractors)
    return [(' '.join(symbols[row]), str(symbols[row[0]])) for row in rows]


def dataset_id(config) -> str:
    return (f'recall-v{VERSION}-len{config.recall_length}'
            + ('-distractors' if config.recall_distractors else '')
            + f'-n{config.recall_train_examples}-{config.recall_eval_examples}'
            f'-seed{config.shuffle_seed}')
