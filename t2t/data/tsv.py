"""Your own parallel text: `config.tsv_files.<split>` names either

- one `.tsv` (any name without a comma): `source<TAB>target` per line, UTF-8; or
- a pair of parallel files `'src_path,tgt_path'`: line i of one translates line i of the other.

The direction is the file's: column 1 / the first file is the source. Lines that cannot be used are
skipped and counted, never repaired: an empty side, invalid UTF-8, a line over MAX_LINE_CHARS, a TSV
line without exactly one tab. Parallel files of different lengths and a corpus with no usable pair
are errors naming the file, since a shifted pairing would train on nonsense.
"""

import collections
import itertools
from collections.abc import Iterator

from absl import logging

MAX_LINE_CHARS = 100_000  # no sentence is this long: a runaway line (e.g. a binary file)
_WARN_LINES = 5  # per file: name the first few skipped lines, count the rest


def _decode(raw: bytes | None) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason to skip)."""
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError:
        return None, 'invalid_utf8'
    text = text.rstrip('\r\n')
    if len(text) > MAX_LINE_CHARS:
        return None, 'line_too_long'
    if not text.strip():
        return None, 'empty'
    return text, None


def _tsv_pairs(path: str) -> Iterator[tuple[int, tuple[str, str] | None, str | None]]:
    with open(path, 'rb') as f:
        for n, raw in enumerate(f, 1):
            text, why = _decode(raw)
            if why:
                yield n, None, why
                continue
            fields = text.split('\t')
            if len(fields) != 2:
                yield n, None, 'not_two_columns'
            elif not fields[0].strip() or not fields[1].strip():
                yield n, None, 'empty'
            else:
                yield n, (fields[0].strip(), fields[1].strip()), None


def _parallel_pairs(src_path: str, tgt_path: str):
    with open(src_path, 'rb') as fs, open(tgt_path, 'rb') as ft:
        for n, (a, b) in enumerate(itertools.zip_longest(fs, ft), 1):
            if a is None or b is None:
                short, long_ = (src_path, tgt_path) if a is None else (tgt_path, src_path)
                rest = sum(1 for _ in (ft if a is None else fs))
                raise ValueError(f'{short} has {n - 1} lines but {long_} has {n + rest}: '
                                 'parallel files must have the same number of lines')
            (s, why_s), (t, why_t) = _decode(a), _decode(b)
            why = why_s or why_t
            yield n, (None if why else (s.strip(), t.strip())), why


def read_pairs(spec: str) -> tuple[list[tuple[str, str]], collections.Counter]:
    """(pairs, skip counts by reason) of one split named by `spec` (see the module docstring)."""
    paths = [p.strip() for p in spec.split(',')]
    if not spec.strip() or len(paths) > 2 or not all(paths):
        raise ValueError(f'tsv_files entry {spec!r}: expected "file.tsv" or "src_path,tgt_path"')
    rows = _tsv_pairs(paths[0]) if len(paths) == 1 else _parallel_pairs(*paths)
    pairs, skipped = [], collections.Counter()
    for n, pair, why in rows:
        if why:
            skipped[why] += 1
            if skipped.total() <= _WARN_LINES:
                logging.warning('%s: line %d skipped: %s', spec, n, why)
        else:
            pairs.append(pair)
    if not pairs:
        detail = ', '.join(f'{k}={v}' for k, v in sorted(skipped.items())) or 'no lines'
        raise ValueError(f'{spec}: no usable sentence pairs ({detail})')
    return pairs, skipped
