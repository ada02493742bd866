"""Minimum Bayes risk decoding: of a sentence's candidates, the one the others agree with most.

    mbr = MBR(samples=16, candidates='sample', utility='chrf')   # evaluate.py --mbr_samples=16
    decoding = mbr.decoding(DecodeConfig.from_config(config))
    predict = predict_lib.make_predict_fn(model_config, decoding, ...)
    result = translate.translate_batches(predict, ..., choose=mbr.choose)

Candidates: `samples` draws per sentence (decode_strategy='sample' with the config's temperature,
top_k, top_p and decode_seed; draw 0 is the sentence's plain sample), or beam search's best
`samples` hypotheses (candidates='nbest', samples <= beam_size). Each candidate's expected
utility is the mean of its utility against every other candidate, as pseudo-references (repeated
draws count as often as drawn: a Monte Carlo estimate of the model's distribution); the highest
wins, a tie going to the earlier candidate (the better beam, or draw 0). One candidate is
chosen as is.

Utility: sacrebleu's sentence-level chrF (default parameters) or BLEU (effective order, its
default exp smoothing) of the candidate as hypothesis against the other as reference. chrF's
character n-grams are counted once per distinct candidate and every pair's matches come from
one numpy minimum over the count matrix, then sacrebleu's own chrF formula; the scores equal
sacrebleu's `sentence_score`. Runs on the host while the next batch decodes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from t2t.decode import DecodeConfig
from t2t.eval import predict as predict_lib

UTILITIES = ('chrf', 'bleu')
CANDIDATES = ('sample', 'nbest')


@dataclasses.dataclass(frozen=True)
class MBR:
    """MBR decoding's settings (evaluate.py --mbr_samples, --mbr_candidates, --mbr_utility)."""

    samples: int  # candidates per sentence
    candidates: str = 'sample'  # 'sample': draws; 'nbest': beam search's best `samples`
    utility: str = 'chrf'

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f'--mbr_samples={self.samples} must be >= 1')
        if self.candidates not in CANDIDATES:
            raise ValueError(f'--mbr_candidates={self.candidates!r}: expected one of '
                             f'{CANDIDATES}')
        if self.utility not in UTILITIES:
            raise ValueError(f'--mbr_utility={self.utility!r}: expected one of {UTILITIES}')

    def decoding(self, base: DecodeConfig) -> DecodeConfig:
        """The decoding that yields the candidates (checked: n-best within the beam)."""
        if self.candidates == 'nbest':
            if self.samples > base.beam_size:
                raise ValueError(f'--mbr_samples={self.samples} n-best candidates need '
                                 f'beam_size >= {self.samples} (it is {base.beam_size})')
            return base.replace(decode_strategy='beam', nbest=self.samples)
        return base.replace(decode_strategy='sample', num_samples=self.samples)

    @property
    def tag(self) -> str:
        """The suffix of an evaluation label: mbr-sample16-chrf."""
        return f'mbr-{self.candidates}{self.samples}-{self.utility}'

    def describe(self, decoding: DecodeConfig) -> str:
        return (f'MBR ({self.utility}) over {self.samples} candidates from '
                f'{predict_lib.describe(decoding)}')

    def record(self) -> dict:
        return {'mbr_samples': self.samples, 'mbr_candidates': self.candidates,
                'mbr_utility': self.utility}

    def choose(self, candidates: list[list[str]]) -> list[int]:
        """Per sentence, the index of its candidate of highest expected utility."""
        return [int(np.argmax(expected_utility(c, self.utility))) for c in candidates]


def expected_utility(candidates: list[str], utility: str) -> np.ndarray:
    """float64 [N]: candidate i's mean utility against candidates j != i (0 when N == 1)."""
    n = len(candidates)
    if n == 1:
        return np.zeros(1)
    distinct, where = np.unique(np.array(candidates, dtype=object), return_inverse=True)
    matrix_UU = utility_matrix(list(distinct), utility)
    matrix_NN = matrix_UU[np.ix_(where, where)]
    return (matrix_NN.sum(axis=1) - np.diag(matrix_NN)) / (n - 1)


def utility_matrix(texts: list[str], utility: str) -> np.ndarray:
    """float64 [U, U]: [i, j] the sentence-level score of texts[i] against the reference
    texts[j]."""
    if utility == 'chrf':
        return _chrf_matrix(texts)
    metric = _metric('bleu')
    return np.array([[metric.sentence_score(h, [r]).score for r in texts] for h in texts])


_METRICS: dict = {}


def _metric(utility: str):
    if utility not in _METRICS:
        _METRICS[utility] = CHRF() if utility == 'chrf' else BLEU(effective_order=True)
    return _METRICS[utility]


def _chrf_matrix(texts: list[str]) -> np.ndarray:
    """sacrebleu's sentence chrF of every ordered pair, each text's n-grams counted once."""
    metric = _metric('chrf')
    ngrams = metric._extract_reference_info([metric._preprocess_segment(t) for t in texts])
    per_text = ngrams['ref_ngrams']  # per text: one Counter per order
    stats = []  # per order: (totals [U], matches [U, U])
    for order in range(metric.order):
        counters = [grams[order] for grams in per_text]
        vocab = {g: k for k, g in enumerate({g for c in counters for g in c})}
        counts_UG = np.zeros((len(texts), max(len(vocab), 1)), np.int64)
        for u, counter in enumerate(counters):
            for gram, count in counter.items():
                counts_UG[u, vocab[gram]] = count
        matches_UU = np.minimum(counts_UG[:, None], counts_UG[None]).sum(-1)
        stats.append((counts_UG.sum(1), matches_UU))
    u = len(texts)
    scores = np.empty((u, u))
    for i in range(u):
        for j in range(u):
            flat = [int(x) for totals, matches in stats
                    for x in (totals[i], totals[j], matches[i, j])]
            scores[i, j] = metric._compute_f_score(flat)
    return scores
