"""Subword regularization (Kudo 2018): training pairs segmented again by sampling, on the fly.

`config.spm_alpha` > 0 (with `spm_nbest_size`: -1 samples from every segmentation, n >= 2 from
the n best) re-segments the pairs of every training row as the batch is built: each pair's
1-best pieces, as prepared in the packed cache, are decoded to text and encoded again with
sentencepiece's sampling. The draws of a row are seeded by (shuffle_seed, the row's position in
the training stream): the position counts epochs too, so the same row gets new segmentations
each epoch, the same ones in a resumed run and whatever the number of processes. Evaluation and
decoding never sample (they read the 1-best ids of t2t/data/pipeline.py's eval splits).

The packed row's room is fixed (max_len a side): a pair keeps its sampled segmentation where it
fits beside the 1-best lengths of the pairs after it in the row, else its 1-best one, so every
row stays valid. Tags (a mixture member's first source token) are kept as they are.
spm_alpha 0 leaves the rows exactly as prepared (this module is not used).
"""

import dataclasses
import hashlib

import numpy as np

from t2t.data import mixture, packing
from t2t.data.tokenizer import Tokenizer
from t2t.ids import EOS_ID, PAD_ID

_SIDES = ('inputs', 'targets')


def digest(rows_digest: str, config) -> str:
    """The training data's digest with the sampling settings folded in (the data identity)."""
    parts = [rows_digest, 'spm-sampling', float(config.spm_alpha), int(config.spm_nbest_size)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def row_seed(seed: int, position: int) -> int:
    """sentencepiece's generator seed (32 bits) for the row at stream `position`."""
    return int(np.random.SeedSequence([seed, position]).generate_state(1)[0])


def _segments(tokens: np.ndarray, segment_ids: np.ndarray) -> list[np.ndarray]:
    """The token runs of segments 1..k of one row side (each ends with EOS)."""
    count = int(segment_ids.max()) if len(segment_ids) else 0
    return [tokens[segment_ids == s] for s in range(1, count + 1)]


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Re-segments the pairs of training batches: `sampler(batch, positions)`."""

    tokenizer: Tokenizer
    alpha: float
    nbest_size: int
    seed: int
    keep: frozenset  # ids left in place at the start of a source: the mixture's tags

    @classmethod
    def from_config(cls, config, tokenizer: Tokenizer) -> 'Sampler':
        keep = frozenset(tokenizer.tag_id(t) for t in mixture.tags(config))
        return cls(tokenizer, float(config.spm_alpha), int(config.spm_nbest_size),
                   int(config.shuffle_seed), keep)

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
        rows = [{k: v[r] for k, v in batch.items()} for r in range(len(batch['inputs']))]
        parts = [self._split(row) for row in rows]
        texts = iter(self.tokenizer.decode_batch([b for _, _, bodies in parts for b in bodies]))
        out = []
        for row, (segs, heads, bodies), p in zip(rows, parts, np.asarray(positions).tolist(),
                                                 strict=True):
            mine = [next(texts) for _ in bodies]
            drawn = self.tokenizer.sample_batch(mine, self.alpha, self.nbest_size,
                                                row_seed(self.seed, int(p)))
            out.append(self._rebuild(row, segs, heads, drawn))
        stacked = {k: np.stack([r[k] for r in out]) for k in out[0]}
        stacked['inputs_positions'] = packing.positions(stacked['inputs_segment_ids'])
        stacked['targets_positions'] = packing.positions(stacked['targets_segment_ids'])
        return stacked
