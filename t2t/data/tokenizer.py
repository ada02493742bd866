"""One SentencePiece (unigram) vocabulary shared by source and target.

Ids: PAD=0, EOS=1, UNK=2 and no BOS (t2t/ids.py). `encode` adds no EOS; the
pipelines append it, so the tokenizer stays a plain text <-> pieces map.
"""

import os
import tempfile
from collections.abc import Iterable, Sequence

from t2t import ids as ids_lib
from t2t.data import durable
from t2t.ids import EOS_ID, PAD_ID, UNK_ID


class Tokenizer:
    """A trained SentencePiece model; pickles by path so worker processes can rebuild it."""

    def __init__(self, path: str):
        import sentencepiece as spm  # here, so that `import t2t.data` stays light

        self.path = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        if (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id()) != (PAD_ID, EOS_ID, UNK_ID):
            raise ValueError(f'{self.path}: expected pad/eos/unk ids 0/1/2, got '
                             f'{self._sp.pad_id()}/{self._sp.eos_id()}/{self._sp.unk_id()}')

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        """Many texts at once in C++ threads (0 = all cores): the fast path for whole splits."""
        return self._sp.encode(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def nbest(self, text: str, n: int) -> tuple[list[list[int]], list[float]]:
        """The n best segmentations of `text` (ids) and their scores (sum of log-probs)."""
        nbests = self._sp.nbest_encode_as_proto(text, n).nbests
        return [[p.id for p in x.pieces] for x in nbests], [x.score for x in nbests]

    def decode_batch(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Texts of many id lists (no EOS or PAD in them), in sentencepiece's threads."""
        return self._sp.decode([x.tolist() if hasattr(x, 'tolist') else list(x) for x in ids],
                               num_threads=os.cpu_count() or 1)

    def tag_id(self, tag: str) -> int:
        """The id of a user-defined piece (a mixture's tag, e.g. '<BT>'); ValueError if the
        vocabulary does not hold it as one (a plain piece would also be made of text)."""
        i = self._sp.piece_to_id(tag)
        if i == UNK_ID or self._sp.id_to_piece(i) != tag or self._sp.encode(tag)[-1:] != [i]:
            raise ValueError(f'{self.path} has no piece {tag!r} of its own: a tag must be a '
                             'user-defined symbol of the vocabulary (leave vocab_path empty to '
                             'train one with the mixture\'s tags)')
        return i

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS; PAD is ignored."""
        return self._sp.decode(ids_lib.content(ids))

    def piece(self, i: int) -> str:
        """The piece of one id as sentencepiece writes it (e.g. '▁Haus'), for labels."""
        return self._sp.id_to_piece(int(i))

    def __getstate__(self):
        return {'path': self.path}

    def __setstate__(self, state):
        self.__init__(state['path'])


MIN_VOCAB_SIZE = 300  # 256 byte pieces + PAD/EOS/UNK + room for the corpus's own characters
# sentencepiece splits the sentences among its training threads and sums their float counts, so
# the vocabulary depends on the thread count: fixed here (not the machine's cores) so that the
# same sentences give the same vocabulary bytes everywhere; 16 threads use every core of machines
# up to 16 cores (more threads than cores cost nothing measurable: bench/RESULTS.md).
TRAIN_THREADS = 16


def _drop_prefix(model_path: str) -> None:
    """Clears the training's model_prefix (a temporary directory) recorded in the model."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    with open(model_path, 'rb') as f:
        model.ParseFromString(f.read())
    model.trainer_spec.model_prefix = ''
    with open(model_path, 'wb') as f:
        f.write(model.SerializeToString())
        f.flush()
        os.fsync(f.fileno())  # whole on disk before the rename into place (durable.py)


def train_tokenizer(sentences: Iterable[str], path: str, vocab_size: int,
                    max_sentences: int, character_coverage: float = 0.9999,
                    num_threads: int = TRAIN_THREADS,
                    user_defined_symbols: Sequence[str] = ()) -> Tokenizer:
    """Trains a unigram model on `sentences` and writes it to `path` atomically (.model + .vocab).

    `hard_vocab_limit=False` lets a small corpus give a smaller vocabulary instead of failing;
    callers size embeddings by `Tokenizer.vocab_size`, which is then <= `vocab_size`.
    Characters outside `character_coverage` and unseen ones fall back to UTF-8 byte pieces, so no
    input becomes UNK (sentencepiece's default coverage drops rare letters such as a capital Ü).
    The same sentences and settings (`num_threads` included) give the same bytes.
    `user_defined_symbols` (e.g. a mixture's tags) become pieces of their own, never split.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f'vocab_size={vocab_size} is too small: at least {MIN_VOCAB_SIZE} (256 '
                         'UTF-8 byte pieces, PAD/EOS/UNK and the corpus\'s characters)')
    import sentencepiece as spm

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        prefix = os.path.join(tmp, 'spm')
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_prefix=prefix,
            model_type='unigram',
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            character_coverage=character_coverage,
            byte_fallback=True,
            pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=num_threads,
            minloglevel=2,
            **({'user_defined_symbols': list(user_defined_symbols)}
               if user_defined_symbols else {}),
        )
        base = path[:-len('.model')] if path.endswith('.model') else path
        os.replace(prefix + '.vocab', base + '.vocab')
        _drop_prefix(prefix + '.model')  # the temporary path would make every model differ
        durable.replace(prefix + '.model', path)
    return Tokenizer(path)
