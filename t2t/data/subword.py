"""Subword regularization (Kudo 2018): training pairs segmented again by sampling, on the fly.

`config.spm_alpha` > 0 (with `spm_nbest_size`: -1 samples among every segmentation, n >= 2 among
the n best) re-segments the pairs of every training row as the batch is built, from the 1-best
pieces the packed cache holds. The draws are t2t's own (numpy, seeded by (shuffle_seed, the row's
position in the training stream)): sentencepiece's sampler draws from a generator that no seed
makes the same in two processes. The position counts epochs, so the same row gets new
segmentations each epoch, the same ones in a resumed run and whatever the number of processes.
Evaluation and decoding never sample (they read the 1-best ids of pipeline.py's eval splits).

- spm_nbest_size -1: forward-filtering backward-sampling on the unigram lattice, as
  sentencepiece's `SampleEncode` (p(segmentation) ~ exp(alpha * sum of piece scores)), word by
  word: the model splits by whitespace, so no piece crosses a word's leading '▁' and the words are
  independent. A word holding a byte, unknown or user-defined piece keeps its 1-best pieces.
- spm_nbest_size n >= 2: one of sentencepiece's n best segmentations of the pair's text, drawn
  with probabilities ~ exp(alpha * score), as sentencepiece's own n-best sampling.

The packed row's room is fixed (max_len a side): a pair keeps its sampled segmentation where it
fits beside the 1-best lengths of the pairs after it in the row, else its 1-best one, so every
row stays valid. Tags (a mixture member's first source token) are kept as they are.
spm_alpha 0 leaves the rows exactly as prepared (this module is not used).
"""

import bisect
import dataclasses
import hashlib
import itertools
import math

import numpy as np

from t2t.data import mixture, packing
from t2t.data.tokenizer import Tokenizer
from t2t.ids import EOS_ID, PAD_ID

_SIDES = ('inputs', 'targets')
_NORMAL = 1  # sentencepiece's ModelProto.SentencePiece.Type.NORMAL
_WORD = '\u2581'  # sentencepiece's whitespace mark, first in a word's first piece
_CACHE_WORDS = 1 << 17  # words whose lattice is remembered (a pure function of the word)


def digest(rows_digest: str, config) -> str:
    """The training data's digest with the sampling settings folded in (the data identity)."""
    parts = [rows_digest, 'spm-sampling', float(config.spm_alpha), int(config.spm_nbest_size)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def row_rng(seed: int, position: int) -> np.random.Generator:
    """The generator of the row at stream `position`."""
    return np.random.default_rng([seed, position])


class Lattice:
    """Sampling on a unigram model's lattice, one word at a time (module docstring)."""

    def __init__(self, path: str, alpha: float):
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        with open(path, 'rb') as f:
            model.ParseFromString(f.read())
        self.alpha = alpha
        self.pieces = [p.piece for p in model.pieces]
        self.normal = [p.type == _NORMAL for p in model.pieces]
        self.chars = [len(p.piece) for p in model.pieces]
        self._ids = {p.piece: (i, p.score) for i, p in enumerate(model.pieces)
                     if p.type == _NORMAL}
        self._longest = max(map(len, self._ids), default=1)
        self._forward = {}

    def _table(self, word: str) -> list[tuple[list[int], list[int], list[float]]]:
        """Per end position j: the edges ending there as (starts, ids, cumulative probabilities
        of taking each, given the path reaches j)."""
        table = self._forward.get(word)
        if table is not None:
            return table
        log_z = [0.0] + [-math.inf] * len(word)
        table = [([], [], [])]
        for j in range(1, len(word) + 1):
            edges = []
            for i in range(max(0, j - self._longest), j):
                hit = self._ids.get(word[i:j])
                if hit is not None and log_z[i] > -math.inf:
                    edges.append((i, hit[0], log_z[i] + self.alpha * hit[1]))
            cumulative = []
            if edges:
                top = max(w for _, _, w in edges)
                log_z[j] = top + math.log(sum(math.exp(w - top) for _, _, w in edges))
                cumulative = list(itertools.accumulate(math.exp(w - log_z[j])
                                                       for _, _, w in edges))
            table.append(([e[0] for e in edges], [e[1] for e in edges], cumulative))
        if len(self._forward) >= _CACHE_WORDS:
            self._forward.clear()
        self._forward[word] = table
        return table

    def sample_word(self, word: str, uniforms) -> list[int] | None:
        """Ids of one sampled segmentation of `word` (drawing from the iterator `uniforms`, at
        most one a character), or None if it has none."""
        table = self._table(word)
        out, j = [], len(word)
        while j > 0:
            starts, ids, cumulative = table[j]
            if not ids:
                return None
            pick = min(bisect.bisect_right(cumulative, next(uniforms)), len(ids) - 1)
            out.append(ids[pick])
            j = starts[pick]
        return out[::-1]

    def sample(self, ids, uniforms) -> list[int]:
        """A sampled segmentation of the text of 1-best `ids`, word by word (`sample_word`)."""
        out, word = [], []
        for k in [*map(int, ids), None]:
            if word and (k is None or self.pieces[k].startswith(_WORD)):
                drawn = (self.sample_word(''.join(self.pieces[x] for x in word), uniforms)
                         if all(self.normal[x] for x in word) else None)
                out += word if drawn is None else drawn
                word = []
            if k is not None:
                word.append(k)
        return out


def _segments(tokens: np.ndarray, segment_ids: np.ndarray) -> list[np.ndarray]:
    """The token runs of segments 1..k of one row side (each ends with EOS)."""
    count = int(segment_ids.max()) if len(segment_ids) else 0
    return [tokens[segment_ids == s] for s in range(1, count + 1)]


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Re-segments the pairs of training batches: `sampler(batch, positions)`."""

    tokenizer: Tokenizer
    nbest_size: int
    seed: int
    keep: frozenset  # ids left in place at the start of a source: the mixture's tags
    lattice: Lattice

    @classmethod
    def from_config(cls, config, tokenizer: Tokenizer) -> 'Sampler':
        keep = frozenset(tokenizer.tag_id(t) for t in mixture.tags(config))
        return cls(tokenizer, int(config.spm_nbest_size), int(config.shuffle_seed), keep,
                   Lattice(tokenizer.path, float(config.spm_alpha)))

    def _draw(self, bodies: list[np.ndarray], rng: np.random.Generator) -> list[list[int]]:
        """One sampled segmentation of each body (1-best ids), in order, from `rng`."""
        if self.nbest_size == -1:
            chars = sum(self.lattice.chars[k] for b in bodies for k in b.tolist())
            uniforms = iter(rng.random(chars).tolist())  # one draw a character at most
            return [self.lattice.sample(b, uniforms) for b in bodies]
        out = []
        for text in self.tokenizer.decode_batch(bodies):
            ids, scores = self.tokenizer.nbest(text, self.nbest_size)
            weights = np.exp(self.lattice.alpha * (np.asarray(scores) - max(scores)))
            out.append(ids[int(rng.choice(len(ids), p=weights / weights.sum()))])
        return out

    def _split(self, row: dict[str, np.ndarray]):
        """(segments, kept heads, bodies to re-segment) of one row's two sides."""
        segs = {side: _segments(row[side], row[f'{side}_segment_ids']) for side in _SIDES}
        heads, bodies = {}, []
        for side in _SIDES:
            heads[side] = []
            for seg in segs[side]:
                lead = 0
                while side == 'inputs' and lead < len(seg) - 1 and int(seg[lead]) in self.keep:
                    lead += 1
                heads[side].append(seg[:lead])
                bodies.append(seg[lead:-1])
        return segs, heads, bodies

    def _rebuild(self, row: dict[str, np.ndarray], segs: dict, heads: dict,
                 drawn: list[list[int]]) -> dict[str, np.ndarray]:
        """The row with each pair's sampled pieces where they fit (see the module docstring)."""
        drawn = iter(drawn)
        out = {}
        length = row['inputs'].shape[-1]
        for side in _SIDES:
            best = [len(s) for s in segs[side]]
            tokens = np.full(length, PAD_ID, row[side].dtype)
            seg_ids = np.zeros(length, row[f'{side}_segment_ids'].dtype)
            used = 0
            for j, (seg, head) in enumerate(zip(segs[side], heads[side], strict=True)):
                sampled = np.concatenate([head, np.asarray(next(drawn), seg.dtype),
                                          np.array([EOS_ID], seg.dtype)])
                # sampled if it leaves the room the later pairs' 1-best pieces need
                piece = sampled if used + len(sampled) + sum(best[j + 1:]) <= length else seg
                tokens[used:used + len(piece)] = piece
                seg_ids[used:used + len(piece)] = j + 1
                used += len(piece)
            out[side], out[f'{side}_segment_ids'] = tokens, seg_ids
        return out

    def __call__(self, batch: dict[str, np.ndarray], positions: np.ndarray
                 ) -> dict[str, np.ndarray]:
        out = []
        for r, p in enumerate(np.asarray(positions).tolist()):
            row = {k: v[r] for k, v in batch.items()}
            segs, heads, bodies = self._split(row)
            out.append(self._rebuild(row, segs, heads,
                                     self._draw(bodies, row_rng(self.seed, int(p)))))
        stacked = {k: np.stack([r[k] for r in out]) for k in out[0]}
        stacked['inputs_positions'] = packing.positions(stacked['inputs_segment_ids'])
        stacked['targets_positions'] = packing.positions(stacked['targets_segment_ids'])
        return stacked
