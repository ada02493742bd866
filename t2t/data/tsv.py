"""Your own parallel text: `config.tsv_files.<split>` names either

- one `.tsv` (any name without a comma): `source<TAB>target` per line, UTF-8; or
- a pair of parallel files `'src_path,tgt_path'`: line i of one translates line i of the other.

The direction is the file's: column 1 / the first file is the source. Lines that cannot be used are
skipped and counted, never repaired: an empty side, invalid UTF-8, a line over MAX_LINE_CHARS, a TSV
line without exactly one tab. Parallel files of different lengths and a corpus with no usable pair
are errors naming the file, since a shifted pairing would train on nonsense.

Two readers of the same format: `read_pairs` holds a whole split in memory (evaluation splits);
`index` + `read_chunk` stream a training split in chunks of lines addressed by byte offsets, so a
worker process reads its chunk alone and no step holds the corpus.
"""

import collections
import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np
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


def _parse_tsv(text: str) -> tuple[tuple[str, str] | None, str | None]:
    fields = text.split('\t')
    if len(fields) != 2:
        return None, 'not_two_columns'
    src, tgt = fields[0].strip(), fields[1].strip()
    if not src or not tgt:
        return None, 'empty'
    return (src, tgt), None


def _tsv_pairs(path: str) -> Iterator[tuple[int, tuple[str, str] | None, str | None]]:
    with open(path, 'rb') as f:
        for n, raw in enumerate(f, 1):
            text, why = _decode(raw)
            if why:
                yield n, None, why
                continue
            pair, why = _parse_tsv(text)
            yield n, pair, why


def _length_error(short: str, short_lines: int, long_: str, long_lines: int) -> ValueError:
    return ValueError(f'{short} has {short_lines} lines but {long_} has {long_lines}: '
                      'parallel files must have the same number of lines')


def _parallel_pairs(src_path: str, tgt_path: str):
    with open(src_path, 'rb') as fs, open(tgt_path, 'rb') as ft:
        for n, (a, b) in enumerate(itertools.zip_longest(fs, ft), 1):
            if a is None or b is None:
                short, long_ = (src_path, tgt_path) if a is None else (tgt_path, src_path)
                rest = sum(1 for _ in (ft if a is None else fs))
                raise _length_error(short, n - 1, long_, n + rest)
            (s, why_s), (t, why_t) = _decode(a), _decode(b)
            why = why_s or why_t
            yield n, (None if why else (s.strip(), t.strip())), why


def paths_of(spec: str) -> list[str]:
    """The one .tsv or the two parallel files of a tsv_files entry."""
    paths = [p.strip() for p in spec.split(',')]
    if not spec.strip() or len(paths) > 2 or not all(paths):
        raise ValueError(f'tsv_files entry {spec!r}: expected "file.tsv" or "src_path,tgt_path"')
    return paths


def read_pairs(spec: str) -> tuple[list[tuple[str, str]], collections.Counter]:
    """(pairs, skip counts by reason) of one split named by `spec` (see the module docstring)."""
    paths = paths_of(spec)
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


# --- streaming: chunks of lines by byte offsets -----------------------------------------------

_BLOCK = 1 << 24  # bytes scanned at a time by `index`


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Lines [first, first + lines) of a split (0-based), at byte ranges [start, stop) of each
    file (one range per file; empty for sources read by index)."""

    number: int
    first: int
    lines: int
    ranges: tuple[tuple[int, int], ...] = ()


def _line_starts(path: str, every: int) -> tuple[list[int], int]:
    """(byte offsets of lines 0, every, 2*every, ... and of the end of the file), lines."""
    offsets, lines, pos, last = [0], 0, 0, b'\n'
    with open(path, 'rb') as f:
        while block := f.read(_BLOCK):
            newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # the line count after each newline: a boundary where it reaches a multiple of every
            at = np.flatnonzero((lines + np.arange(1, len(newlines) + 1)) % every == 0)
            offsets += (pos + newlines[at] + 1).tolist()
            lines += len(newlines)
            pos += len(block)
            last = block[-1:]
    lines += last != b'\n'  # a last line without its newline
    if offsets[-1] != pos:
        offsets.append(pos)
    return offsets, lines


def index(spec: str, chunk_lines: int) -> tuple[list[Chunk], int]:
    """The chunks of `chunk_lines` lines of one split, and its number of lines.

    Parallel files must have the same number of lines (an error naming them otherwise).
    """
    paths = paths_of(spec)
    scans = [_line_starts(p, chunk_lines) for p in paths]
    if len(paths) == 2 and scans[0][1] != scans[1][1]:
        (a, na), (b, nb) = sorted(zip(paths, (s[1] for s in scans), strict=True),
                                  key=lambda x: x[1])
        raise _length_error(a, na, b, nb)
    total = scans[0][1]
    chunks = []
    for number, first in enumerate(range(0, total, chunk_lines)):
        ranges = tuple((offsets[number], offsets[number + 1]) for offsets, _ in scans)
        chunks.append(Chunk(number, first, min(chunk_lines, total - first), ranges))
    return chunks, total


def _read(path: str, start: int, stop: int) -> bytes:
    with open(path, 'rb') as f:
        f.seek(start)
        return f.read(stop - start)


def _split(data: bytes | str, path: str, expected: int) -> list:
    """The lines of a chunk's bytes (or text), without their newlines."""
    lines = data.split(b'\n' if isinstance(data, bytes) else '\n')
    if lines and not lines[-1]:
        lines.pop()  # after the last newline
    if len(lines) != expected:
        raise ValueError(f'{path} changed while it was read: a chunk of {expected} lines holds '
                         f'{len(lines)}')
    return lines


def _fast(texts: list[list[str]]) -> list[tuple[str, str]] | None:
    """The pairs of decoded lines when every line is usable, else None (then they are read one
    by one, counting why): the common case, without a function call per line."""
    pairs = []
    if len(texts) == 1:
        for line in texts[0]:
            fields = line.rstrip('\r').split('\t')
            if len(fields) != 2 or len(line) > MAX_LINE_CHARS:
                return None
            src, tgt = fields[0].strip(), fields[1].strip()
            if not src or not tgt:
                return None
            pairs.append((src, tgt))
        return pairs
    for a, b in zip(*texts, strict=True):
        src, tgt = a.strip(), b.strip()
        if not src or not tgt or len(a) > MAX_LINE_CHARS or len(b) > MAX_LINE_CHARS:
            return None
        pairs.append((src, tgt))
    return pairs


def read_chunk(spec: str, chunk: Chunk, select: np.ndarray | None = None
               ) -> tuple[list[tuple[str, str]], collections.Counter, list[tuple[int, str]]]:
    """(usable pairs, skip counts, the first few (line number, reason) skipped) of one chunk,
    or of its lines at the chunk-relative positions `select` (sorted) only."""
    paths = paths_of(spec)
    data = [_read(p, a, b) for p, (a, b) in zip(paths, chunk.ranges, strict=True)]
    if select is None:
        try:
            pairs = _fast([_split(d.decode('utf-8'), p, chunk.lines)
                           for d, p in zip(data, paths, strict=True)])
        except UnicodeDecodeError:
            pairs = None
        if pairs is not None:
            return pairs, collections.Counter(), []
    per_file = [_split(d, p, chunk.lines) for d, p in zip(data, paths, strict=True)]
    positions = range(chunk.lines) if select is None else select.tolist()
    pairs, skipped, examples = [], collections.Counter(), []
    for i in positions:
        if len(paths) == 1:
            text, why = _decode(per_file[0][i])
            pair, why = (None, why) if why else _parse_tsv(text)
        else:
            (s, why_s), (t, why_t) = _decode(per_file[0][i]), _decode(per_file[1][i])
            why = why_s or why_t
            pair = None if why else (s.strip(), t.strip())
        if why:
            skipped[why] += 1
            if len(examples) < _WARN_LINES:
                examples.append((chunk.first + i + 1, why))
        else:
            pairs.append(pair)
    return pairs, skipped, examples


def warn_skipped(spec: str, examples: list[tuple[int, str]]) -> None:
    """Logs the first few skipped lines of a streamed split, as `read_pairs` does."""
    for n, why in examples[:_WARN_LINES]:
        logging.warning('%s: line %d skipped: %s', spec, n, why)

