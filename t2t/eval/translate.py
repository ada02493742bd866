"""Bulk translation: batches decoded in original order, and a file of any size streamed through
them, in order, resumable after a kill.

    result = translate_batches(predict, params, eval_split.batches(64), tokenizer, n, mesh=mesh)

    stats = translate_stream(predict, params, tokenizer, 'in.txt', 'out.txt', max_len=256,
                             mesh=mesh)   # evaluate.py --translate --input=in.txt --output=out.txt

The input is read in windows of `window` lines (never whole). Each window is tokenized at once,
sorted by length and cut into batches of a few bucketed shapes: lengths round up to a power of
two (at least MIN_BUCKET) and each bucket's batch holds token_budget // length rows (a multiple
of the mesh's devices; a bucket's last batch of a window halves that up to 3 times to fit its
sentences), so each shape compiles once, whatever the file. Batches run on every
device of every host (`translate_batches`); the hypotheses go back to input order and
the window is appended to the output, then `<output>.progress` records how many lines and bytes
are done (written atomically after the output is flushed and synced). Run again with the same
files and it resumes after the last finished window (a finished run's file stays: a rerun adds
nothing); without the progress file an existing output is overwritten.

A line longer than max_len tokens (EOS included) is counted and its output left empty, or with
truncate_long=True cut to max_len tokens; blank lines translate to ''. Progress shows sentences/s
and the ETA (the lines are counted first, a fast byte scan; stdin has no ETA).

N-best (a predict built with nbest=N, nbest_alpha given): the output is TSV, a header line, then
per input line up to N rows `index rank score text` (index: the input line from 0, rank from 1,
best first), the score beam search's own: sum of the tokens' log-probs (EOS included) over the
length penalty ((5 + tokens) / 6) ** alpha, as the header says. A blank or too long (not
truncated) line has no rows.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from tqdm import tqdm

from t2t.eval import predict as predict_lib
from t2t.eval import terms
from t2t.eval.constraints import Constraints
from t2t.ids import EOS_ID, PAD_ID
from t2t.infra import workdir as wd

MIN_BUCKET = 8
DEFAULT_WINDOW = 50_000  # lines sorted together: big enough that batches are full and even
DEFAULT_TOKEN_BUDGET = 4096  # source tokens (padding included) per batch


@dataclasses.dataclass
class StreamStats:
    lines: int = 0  # lines of the input handled in this run and the runs it resumed
    translated: int = 0  # non-blank lines decoded in this run
    too_long: int = 0  # lines over max_len (left empty, or truncated)
    hit_limit: int = 0  # hypotheses that ended at their length limit without EOS
    capped: int = 0  # of those, cut by max_decode_len
    unmet_constraints: int = 0  # best hypotheses without all their line's phrases (terms.py)
    resumed_from: int = 0  # lines already done by an earlier run
    seconds: float = 0.0

    @property
    def sentences_per_s(self) -> float:
        return self.translated / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class Translations:
    """Detokenized hypotheses in original order, and what the length limits did to them."""

    hypotheses: list[str | None]  # None where no batch held the example (e.g. skipped as too long)
    hit_limit: list[int]  # indices whose best hypothesis ended at its limit without EOS
    capped: list[int]  # of those, the indices cut by max_decode_len
    seconds: float  # wall time of decoding, compiles included
    # predict(nbest > 1): per index [(beam score, hypothesis)], best first (empty slots left
    # out), None where hypotheses has None; else None
    nbest: list[list[tuple[float, str]] | None] | None = None
    # batches with constraints: the indices whose best hypothesis lacks one of its phrases
    unmet_constraints: list[int] | None = None

    @property
    def num_translated(self) -> int:
        return sum(h is not None for h in self.hypotheses)

    @property
    def sentences_per_s(self) -> float:
        return self.num_translated / max(self.seconds, 1e-9)


Choose = Callable[[list[list[str]]], list[int]]


def _chosen(got: predict_lib.Prediction, rows: list[int], tokenizer,
            choose: Choose) -> predict_lib.Prediction:
    """A fetched prediction whose output at each of `rows` is the candidate `choose` picks among
    the row's draws (samples_BNL), else its n-best, else its one output; the limit flags follow
    the chosen candidate, and score_B is dropped (a draw has none)."""
    if got.samples_BNL is not None:
        cands_BNL, valid_BN = got.samples_BNL, np.ones(got.samples_BNL.shape[:2], bool)
    elif got.nbest_ids_BNL is not None:
        cands_BNL, valid_BN = got.nbest_ids_BNL, got.nbest_scores_BN > -np.inf
    else:
        cands_BNL, valid_BN = got.ids_BL[:, None], np.ones((len(got.ids_BL), 1), bool)
    slots = [np.flatnonzero(valid_BN[row]) for row in rows]
    texts = [[tokenizer.decode(cands_BNL[row, k].tolist()) for k in ks]
             for row, ks in zip(rows, slots, strict=True)]
    ids_BL = np.array(got.ids_BL)
    for row, ks, pick in zip(rows, slots, choose(texts), strict=True):
        ids_BL[row] = cands_BNL[row, ks[pick]]
    chosen_B = np.isin(np.arange(len(ids_BL)), rows)  # real sentences: a source, a limit > 0
    hit_B = np.where(chosen_B, ~np.any(ids_BL == EOS_ID, axis=1), got.hit_limit_B)
    return got.replace(ids_BL=ids_BL, hit_limit_B=hit_B, capped_B=hit_B & got.limit_is_cap_B,
                       score_B=None)


def translate_batches(predict: predict_lib.Predict, params, batches: Iterable[dict], tokenizer,
                      num_examples: int, *, progress: bool = True, mesh=None,
                      choose: Choose | None = None) -> Translations:
    """Decodes every batch; the hypothesis of the row with `index` i lands at position i.

    Batches are dicts with `inputs` [B, S] and `index` [B] (-1 marks padding rows), as yielded by
    t2t.data EvalSplit.batches: global batches, the same on every process (which must all call
    this with a mesh that spans them); and optionally `constraints` [B, C, P], each row's phrases
    (t2t/eval/terms.py). The next batch is dispatched before the previous one is fetched, so
    detokenizing (and `choose`) overlaps with decoding.

    choose: each batch's sentences' candidates (texts: a predict with num_samples > 1 gives its
    draws, one with nbest > 1 its n-best) -> the index of the one to output per sentence (MBR,
    t2t/eval/mbr.py).
    """
    hypotheses: list[str | None] = [None] * num_examples
    nbest: list[list[tuple[float, str]] | None] = [None] * num_examples
    hit_limit, capped, unmet = [], [], []
    constrained = False
    bar = tqdm(total=num_examples, unit='sent', desc='decoding', disable=not progress,
               dynamic_ncols=True)

    def collect(index_B, prediction: predict_lib.Prediction):
        got = predict_lib.fetch(prediction, len(index_B))
        if choose is not None:
            got = _chosen(got, [r for r, i in enumerate(np.asarray(index_B).tolist()) if i >= 0],
                          tokenizer, choose)
        ids_BL, hit_B, capped_B = got.ids_BL, got.hit_limit_B, got.capped_B
        done = 0
        for row, i in enumerate(np.asarray(index_B).tolist()):
            if i < 0:
                continue
            if not 0 <= i < num_examples or hypotheses[i] is not None:
                raise ValueError(f'batch index {i} is out of range [0, {num_examples}) or repeated')
            hypotheses[i] = tokenizer.decode(ids_BL[row].tolist())
            if got.nbest_ids_BNL is not None:
                nbest[i] = [(float(score), tokenizer.decode(ids.tolist())) for ids, score in
                            zip(got.nbest_ids_BNL[row], got.nbest_scores_BN[row], strict=True)
                            if score > -np.inf]
            if hit_B[row]:
                hit_limit.append(i)
            if capped_B[row]:
                capped.append(i)
            if got.constraints_met_B is not None and not got.constraints_met_B[row]:
                unmet.append(i)
            done += 1
        bar.update(done)

    start = time.perf_counter()
    pending = None
    for batch in batches:
        if 'constraints' in batch:
            constrained = True
            prediction = predict(params, predict_lib.feed(batch['inputs'], mesh),
                                 Constraints(predict_lib.feed(batch['constraints'], mesh)))
        else:  # asynchronous dispatch
            prediction = predict(params, predict_lib.feed(batch['inputs'], mesh))
        if pending is not None:
            collect(*pending)
        pending = (batch['index'], prediction)
    if pending is not None:
        collect(*pending)
    seconds = time.perf_counter() - start
    bar.close()
    has_nbest = any(entry is not None for entry in nbest)
    return Translations(hypotheses, sorted(hit_limit), sorted(capped), seconds,
                        nbest if has_nbest else None, sorted(unmet) if constrained else None)


def bucket_length(n: int, max_len: int) -> int:
    """The padded length of a row of n tokens: the next power of two >= MIN_BUCKET, <= max_len."""
    length = MIN_BUCKET
    while length < n:
        length *= 2
    return min(length, max(max_len, n))


def batch_rows(length: int, token_budget: int, multiple: int) -> int:
    """Rows per batch of bucket `length`: the token budget, rounded down to `multiple` (>= it)."""
    rows = max(token_budget // length, 1)
    return max(rows - rows % multiple, multiple)


TAIL_HALVINGS = 3  # a bucket's last batch may shrink to rows / 2, / 4 or / 8: few more shapes


def tail_rows(needed: int, rows: int, multiple: int) -> int:
    """Rows of a bucket's last batch of `needed` sentences: the smallest of rows, rows / 2, ...
    (TAIL_HALVINGS times, each a multiple of `multiple`) that holds them."""
    best = rows
    for _ in range(TAIL_HALVINGS):
        half = best // 2
        if half < needed or half % multiple:
            break
        best = half
    return best


def window_batches(ids: list[list[int]], *, max_len: int, token_budget: int,
                   multiple: int = 1) -> Iterator[dict]:
    """Batches {'inputs' [B, L], 'index' [B]} of the non-empty rows of `ids`, sorted by length;
    padding rows have index -1. A bucket's batches have one shape, its last one up to
    TAIL_HALVINGS smaller ones (fewer rows of padding to decode).

    Padding rows are empty (all PAD): the search decodes nothing for them and drops them from
    the batch at its first compaction (DecodeConfig's beam_shrink_floor). Rows are
    independent, so the real rows' outputs do not change."""
    todo = sorted((i for i, row in enumerate(ids) if row), key=lambda i: len(ids[i]))
    for length, group in itertools.groupby(todo, key=lambda i: bucket_length(len(ids[i]),
                                                                             max_len)):
        group = list(group)
        full = batch_rows(length, token_budget, multiple)
        for start in range(0, len(group), full):
            chunk = group[start:start + full]
            rows = tail_rows(len(chunk), full, multiple)
            inputs = np.full((rows, length), PAD_ID, np.int32)
            index = np.full((rows,), -1, np.int64)
            for r, i in enumerate(chunk):
                inputs[r, :len(ids[i])] = ids[i]
                index[r] = i
            yield {'inputs': inputs, 'index': index}


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    encode_batch = getattr(tokenizer, 'encode_batch', None)
    ids = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
    return [row + [EOS_ID] if text.strip() else [] for row, text in zip(ids, texts, strict=True)]


def count_lines(path: str) -> int:
    """Lines of a file (a last line without newline counts), read in 16 MiB blocks."""
    n, last = 0, b'\n'
    with open(path, 'rb') as f:
        while block := f.read(1 << 24):
            n += block.count(b'\n')
            last = block[-1:]
    return n + (last != b'\n')


def _open_lines(input_path: str):
    """The input as text lines ending at '\\n' only, as count_lines counts them: Python's default
    (universal newlines) also ends a line at a lone '\\r', which would shift every later output
    line against its input. A '\\r\\n' ending is stripped with the line's '\\n'."""
    if input_path == '-':
        return io.TextIOWrapper(sys.stdin.buffer, encoding='utf-8', newline='\n')
    return open(input_path, encoding='utf-8', newline='\n')  # noqa: SIM115 (closed by the caller)


def one_line(hypothesis: str | None) -> str:
    """A hypothesis as one output line: a '\\n' or '\\r' inside would split it for a reader."""
    return (hypothesis or '').replace('\r', ' ').replace('\n', ' ')


def nbest_header(alpha: float) -> str:
    """The header line of an n-best output: it names what the score column is."""
    return f'index\trank\tscore=log_prob/((5+tokens)/6)^{alpha:g}\ttext\n'


def nbest_rows(first: int, nbest: list[list[tuple[float, str]] | None]) -> str:
    """The TSV rows of consecutive input lines from index `first` (see the module docstring)."""
    return ''.join(f'{first + i}\t{rank}\t{score:.6f}\t{one_line(text)}\n'
                   for i, entries in enumerate(nbest) for rank, (score, text)
                   in enumerate(entries or (), 1))


def _read_progress(path: str, input_path: str) -> tuple[int, int]:
    try:
        with open(path, encoding='utf-8') as f:
            done = json.load(f)
        lines, size, source = int(done['lines']), int(done['bytes']), done['input']
    except FileNotFoundError:
        return 0, 0
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f'{path} is not a progress file of t2t.eval.translate: {e}') from e
    if source != os.path.abspath(input_path):
        raise ValueError(f'{path} records the translation of {source}, not of {input_path}: '
                         'remove it to start over')
    return lines, size


def _write_progress(path: str, input_path: str, lines: int, size: int) -> None:
    wd.write_atomic(path, json.dumps({'input': os.path.abspath(input_path), 'lines': lines,
                                      'bytes': size}))


def translate_stream(predict: predict_lib.Predict, params, tokenizer, input_path: str,
                     output_path: str, *, max_len: int, token_budget: int = DEFAULT_TOKEN_BUDGET,
                     window: int = DEFAULT_WINDOW, truncate_long: bool = False,
                     progress: bool = True, write: bool = True, nbest_alpha: float | None = None,
                     mesh=None, constraints=None,
                     choose: Choose | None = None) -> StreamStats:
    """Translates `input_path` ('-': stdin) line by line into `output_path` ('-': stdout).

    nbest_alpha: the output is n-best TSV (predict built with nbest > 1 and this alpha).
    constraints: t2t/eval/terms.py Constraints, the phrases each line's translation must hold
    (each window's are checked against their lines' limits before it is decoded).
    choose: each line's output is its candidate this picks (translate_batches; MBR).

    write=False: decode (every process of a multi-host run must) but write nothing (processes
    other than 0). Raises ValueError for a bad progress file or a too small token budget.
    """
    if token_budget < max_len:
        raise ValueError(f'token_budget={token_budget} is below max_len={max_len}: a longest '
                         'sentence would not fit in a batch')
    multiple = mesh.size if mesh is not None else 1
    resumable = input_path != '-' and output_path != '-'
    progress_path = output_path + '.progress'
    skip, size = _read_progress(progress_path, input_path) if resumable else (0, 0)
    stats = StreamStats(lines=skip, resumed_from=skip)
    total = count_lines(input_path) if input_path != '-' else None

    source = _open_lines(input_path)
    if not write:
        sink = None
    elif output_path == '-':
        sink = sys.stdout
    else:
        sink = open(output_path, 'r+b' if skip else 'wb')
        sink.truncate(size)  # drops a window that was half written when the run stopped
        sink.seek(size)
    if sink is not None and nbest_alpha is not None and not skip:
        header = nbest_header(nbest_alpha)
        sink.write(header if sink is sys.stdout else header.encode('utf-8'))
    bar = tqdm(total=total, initial=skip, unit='sent', disable=not progress, dynamic_ncols=True,
               desc='translating')
    start = time.perf_counter()
    try:
        lines = (line.rstrip('\r\n') for line in source)
        for _ in itertools.islice(lines, skip):
            pass
        while texts := list(itertools.islice(lines, window)):
            ids = _encode(tokenizer, texts)
            for row_ids in ids:
                if len(row_ids) > max_len:
                    stats.too_long += 1
                    row_ids[:] = row_ids[:max_len - 1] + [EOS_ID] if truncate_long else []
            batches = window_batches(ids, max_len=max_len, token_budget=token_budget,
                                     multiple=multiple)
            if constraints is not None:
                batches = terms.lines(constraints, stats.lines, texts, ids).batches(batches)
            result = translate_batches(predict, params, batches, tokenizer, len(ids),
                                                 progress=False, mesh=mesh, choose=choose)
            stats.translated += result.num_translated
            stats.hit_limit += len(result.hit_limit)
            stats.capped += len(result.capped)
            stats.unmet_constraints += len(result.unmet_constraints or ())
            stats.lines += len(texts)
            if sink is not None:
                if nbest_alpha is not None:
                    text = nbest_rows(stats.lines - len(texts),
                                      result.nbest or [None] * len(texts))
                else:
                    text = ''.join(one_line(h) + '\n' for h in result.hypotheses)
                if sink is sys.stdout:
                    sink.write(text)
                    sink.flush()
                else:
                    sink.write(text.encode('utf-8'))
                    sink.flush()
                    os.fsync(sink.fileno())
                    if resumable:
                        _write_progress(progress_path, input_path, stats.lines, sink.tell())
            stats.seconds = time.perf_counter() - start
            bar.update(len(texts))
            bar.set_postfix_str(f'{stats.sentences_per_s:.1f} sent/s')
    finally:
        bar.close()
        if input_path == '-':
            source.detach()  # sys.stdin stays open
        else:
            source.close()
        if sink is not None and sink is not sys.stdout:
            sink.close()
    stats.seconds = time.perf_counter() - start
    return stats
