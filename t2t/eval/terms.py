"""Constraints for evaluate.py: phrases each translation must contain (t2t/eval/constraints.py).

    --constraints FILE       one JSON list of phrases per source line, e.g. ["Haus", "grünes Auto"]
                             ([] for none); fairseq-interactive's --constraints takes them
                             tab-separated after the source instead
    --terminology FILE.tsv   `source term<TAB>target term` per line: the target term is a
                             constraint of every source line that holds the source term as whole
                             words (case-sensitive)

Phrases are text, tokenized with the model's sentencepiece as they stand (so a word-initial
phrase matches a word-initial piece). Before anything is decoded each line's phrases are checked
against its decode limit (source tokens + max_decode_extra, at most max_decode_len): their tokens
plus EOS must fit, else a one-line error names the line. Every batch then carries its rows'
phrases as int32 [B, C, P], C and P rounded up to powers of two so that few shapes compile.
Term accuracy: the share of (line, phrase) pairs whose phrase appears in the line's hypothesis
as text (a substring, case-sensitive).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator

import numpy as np

from t2t.eval.checkpoints import EvalError
from t2t.ids import PAD_ID, UNK_ID


def read_constraints(path: str, num_lines: int) -> list[list[str]]:
    """--constraints FILE: the phrases of each of num_lines source lines."""
    with open(path, encoding='utf-8', newline='\n') as f:
        lines = [line.rstrip('\r\n') for line in f]
    if len(lines) != num_lines:
        raise EvalError(f'--constraints {path} has {len(lines)} lines, the source has {num_lines}: '
                        'one JSON list of phrases per source line ([] for none)')
    phrases = []
    for n, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise EvalError(f'--constraints {path} line {n}: not JSON ({e})') from e
        if not isinstance(entry, list) or not all(isinstance(p, str) for p in entry):
            raise EvalError(f'--constraints {path} line {n}: expected a JSON list of strings, got '
                            f'{line[:80]}')
        phrases.append(list(dict.fromkeys(entry)))  # a phrase asked twice is one constraint
    return phrases


def read_terminology(path: str) -> list[tuple[str, str]]:
    """--terminology FILE.tsv: (source term, target term) pairs; blank lines are skipped."""
    terms = []
    with open(path, encoding='utf-8', newline='\n') as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip('\r\n')
            if not line.strip():
                continue
            fields = line.split('\t')
            if len(fields) != 2 or not all(x.strip() for x in fields):
                raise EvalError(f'--terminology {path} line {n}: expected "source term<TAB>target '
                                f'term", got {line[:80]!r}')
            terms.append((fields[0].strip(), fields[1].strip()))
    return terms


def match_terms(terms: list[tuple[str, str]], sources: list[str]) -> list[list[str]]:
    """The target terms of each source: those whose source term occurs in it as whole words."""
    patterns = [(re.compile(r'(?<!\w)' + re.escape(src) + r'(?!\w)'), tgt) for src, tgt in terms]
    return [list(dict.fromkeys(tgt for pattern, tgt in patterns if pattern.search(source)))
            for source in sources]


def tokenize(tokenizer, phrases: list[list[str]], what: str,
             source_ids: list[list[int]], *, max_decode_len: int,
             max_decode_extra: int, first: int = 0) -> list[list[list[int]]]:
    """Each line's phrases as token ids, checked to fit the line's decode limit (`what` names the
    flag and file in an error, `first` the index of the first line). source_ids: each line's
    source tokens (EOS included; [] for a line that is not decoded: blank, or skipped as too
    long)."""
    out = []
    for n, (line_phrases, src) in enumerate(zip(phrases, source_ids, strict=True), first + 1):
        ids = [tokenizer.encode(p) for p in line_phrases]
        for p, tokens in zip(line_phrases, ids, strict=True):
            if problem := _unwritable(tokens):
                raise EvalError(f'{what} line {n}: phrase {p!r} {problem}')
        need = sum(map(len, ids)) + 1
        limit = min(len(src) + max_decode_extra, max_decode_len)
        if ids and src and need > limit:
            raise EvalError(
                f'{what} line {n}: its {need - 1} constraint tokens and EOS need {need} '
                f'positions but the line may generate {limit} (source {len(src)} tokens + '
                f'max_decode_extra={max_decode_extra}, at most max_decode_len={max_decode_len})')
        out.append(ids)
    return out


def _unwritable(tokens: list[int]) -> str:
    """Why a phrase's tokens cannot appear in a translation as its text, or ''."""
    if not tokens:
        return 'has no tokens'
    if UNK_ID in tokens:
        return ('has characters the vocabulary cannot write (sentencepiece\'s unknown piece): no '
                'output would show it')
    return ''


def _power_of_two(n: int, least: int) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def shape(phrase_ids: list[list[list[int]]]) -> tuple[int, int]:
    """(C, P) of the padded arrays: phrases per line and tokens per phrase, powers of two."""
    C = max((len(line) for line in phrase_ids), default=0)
    P = max((len(p) for line in phrase_ids for p in line), default=0)
    return _power_of_two(C, 1), _power_of_two(P, 2)


def with_constraints(batches: Iterable[dict], phrase_ids: list[list[list[int]]],
                     shape_CP: tuple[int, int]) -> Iterator[dict]:
    """The batches with `constraints` int32 [B, C, P]: the phrases of each row's index (padding
    rows and lines without phrases: all 0)."""
    C, P = shape_CP
    for batch in batches:
        out = np.full((len(batch['index']), C, P), PAD_ID, np.int32)
        for row, i in enumerate(np.asarray(batch['index']).tolist()):
            for c, tokens in enumerate(phrase_ids[i] if i >= 0 else ()):
                out[row, c, :len(tokens)] = tokens
        yield {**batch, 'constraints': out}


def term_accuracy(hypotheses: list[str], phrases: list[list[str]]) -> tuple[int, int]:
    """(pairs whose phrase is in its line's hypothesis, all (line, phrase) pairs)."""
    pairs = [(h, p) for h, line in zip(hypotheses, phrases, strict=True) for p in line]
    return sum(p in h for h, p in pairs), len(pairs)


@dataclasses.dataclass(frozen=True)
class Constraints:
    """The phrases of a run's source lines, from --constraints or --terminology."""

    what: str  # the flag and its file, for messages and the record
    tokenizer: object
    max_decode_len: int
    max_decode_extra: int
    per_line: list[list[str]] | None = None  # --constraints: every line's phrases
    terms: list[tuple[str, str]] | None = None  # --terminology: matched per line

    def phrases(self, first: int, sources: list[str]) -> list[list[str]]:
        """The phrases of the lines first, first + 1, ... (their texts `sources`)."""
        if self.terms is not None:
            return match_terms(self.terms, sources)
        return self.per_line[first:first + len(sources)]

    def ids(self, first: int, phrases: list[list[str]], source_ids: list[list[int]]):
        """Their token ids, checked against the lines' decode limits (tokenize)."""
        return tokenize(self.tokenizer, phrases, self.what, source_ids, first=first,
                        max_decode_len=self.max_decode_len,
                        max_decode_extra=self.max_decode_extra)


@dataclasses.dataclass(frozen=True)
class Lines:
    """The phrases of consecutive source lines, as text and as token ids."""

    what: str
    phrases: list[list[str]]
    ids: list[list[list[int]]]

    def batches(self, batches: Iterable[dict]) -> Iterator[dict]:
        return with_constraints(batches, self.ids, shape(self.ids))

    def record(self, hypotheses: list[str], unmet: list[int]) -> dict:
        """What the hypotheses did with the phrases: evaluate.py's report."""
        present, total = term_accuracy(hypotheses, self.phrases)
        return {'source': self.what, 'lines_with_phrases': sum(map(bool, self.phrases)),
                'phrases': total, 'phrases_in_hypotheses': present,
                'term_accuracy': round(100 * present / max(total, 1), 2),
                'hypotheses_lacking_a_phrase_token_level': len(unmet)}


def lines(constraints: Constraints, first: int, sources: list[str],
          source_ids: list[list[int]]) -> Lines:
    """The phrases of the lines first, first + 1, ... (texts and source token ids)."""
    phrases = constraints.phrases(first, sources)
    return Lines(constraints.what, phrases, constraints.ids(first, phrases, source_ids))


def load(config, tokenizer, *, constraints_path: str = '', terminology_path: str = '',
         num_lines: int) -> Constraints | None:
    """evaluate.py's --constraints / --terminology, read and checked (None when neither)."""
    if constraints_path and terminology_path:
        raise EvalError('give --constraints or --terminology, not both')
    if not constraints_path and not terminology_path:
        return None
    if config.decode_strategy != 'beam':
        raise EvalError(f'--constraints and --terminology need decode_strategy=beam, not '
                        f'{config.decode_strategy!r}')
    what = (f'--constraints {constraints_path}' if constraints_path
            else f'--terminology {terminology_path}')
    try:
        if constraints_path:
            loaded = {'per_line': read_constraints(constraints_path, num_lines)}
        else:
            loaded = {'terms': read_terminology(terminology_path)}
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f'{what}: {e}') from e
    for source_term, target_term in loaded.get('terms', ()):
        if problem := _unwritable(tokenizer.encode(target_term)):
            raise EvalError(f'{what}: the target term {target_term!r} (of {source_term!r}) '
                            f'{problem}')
    return Constraints(what, tokenizer, config.max_decode_len, config.max_decode_extra, **loaded)
