"""Sequence packing: many (source, target) pairs per fixed-length row, as pure numpy functions.

Shapes: N pairs, R rows, L = max_len slots per side. A row holds pairs 1..k as segments: segment
ids 1..k on their tokens and 0 on padding, positions restarting at 0 in each segment.
"""

import itertools

import numpy as np

from t2t.ids import PAD_ID

MIN_PAIR_LEN = 2  # a non-empty text is >= 1 piece, + EOS: a row with less room is full


def first_fit(src_lens: np.ndarray, tgt_lens: np.ndarray, max_len: int,
              max_open: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Places each pair in the first open row where both sides fit (pairs are <= max_len).

    At most `max_open` rows are open; opening one more closes the oldest, which keeps the cost
    O(N * max_open) and the placement deterministic. Returns per pair (row, source offset,
    target offset, segment id) and the number of rows.
    """
    n = len(src_lens)
    row, src_off, tgt_off, seg = [0] * n, [0] * n, [0] * n, [0] * n
    bins = []  # open rows: [source used, target used, segments, row]
    num_rows = 0
    full = max_len - MIN_PAIR_LEN  # a row with more used on a side is closed
    for i, (ls, lt) in enumerate(zip(src_lens.tolist(), tgt_lens.tolist(), strict=True)):
        room_s, room_t = max_len - ls, max_len - lt  # the most a fitting row may have used
        for b in bins:
            if b[0] <= room_s and b[1] <= room_t:
                break
        else:
            if len(bins) == max_open:
                del bins[0]
            b = [0, 0, 0, num_rows]
            bins.append(b)
            num_rows += 1
        row[i], src_off[i], tgt_off[i] = b[3], b[0], b[1]
        b[0] += ls
        b[1] += lt
        b[2] += 1
        seg[i] = b[2]
        if b[0] > full or b[1] > full:
            bins.remove(b)
    return (np.array(row, np.int64), np.array(src_off, np.int64), np.array(tgt_off, np.int64),
            np.array(seg, np.int64), num_rows)


def one_per_row(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """The placement without packing: pair i alone in row i."""
    zeros = np.zeros(n, np.int64)
    return np.arange(n), zeros, zeros.copy(), np.ones(n, np.int64), n


def segment_dtype(max_len: int):
    """The smallest dtype for segment ids: a row holds at most max_len / MIN_PAIR_LEN pairs."""
    return np.uint8 if max_len // MIN_PAIR_LEN <= np.iinfo(np.uint8).max else np.uint16


def flatten(seqs: list[list[int]], dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """(all tokens end to end [T], lengths [N]) of a list of token lists."""
    lens = np.fromiter(map(len, seqs), np.int64, len(seqs))
    return np.fromiter(itertools.chain.from_iterable(seqs), dtype, int(lens.sum())), lens


def _scatter(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, row, offset, seg,
             num_rows: int, max_len: int, seg_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [R, L] and segment ids [R, L]: sequence i (flat[starts[i]:][:lens[i]]) at
    (row[i], offset[i]:)."""
    total = int(lens.sum())
    within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)  # position in its sequence
    tokens = np.full((num_rows, max_len), PAD_ID, flat.dtype)
    segments = np.zeros((num_rows, max_len), seg_dtype)
    dest = np.repeat(row * max_len + offset, lens) + within
    tokens.reshape(-1)[dest] = flat[np.repeat(starts, lens) + within]
    segments.reshape(-1)[dest] = np.repeat(seg, lens)
    return tokens, segments


def pack_flat(src: np.ndarray, src_lens: np.ndarray, tgt: np.ndarray, tgt_lens: np.ndarray,
              order: np.ndarray, max_len: int, packed: bool = True) -> dict[str, np.ndarray]:
    """Rows [R, L] of the pairs `order` (in that order) of flat token arrays (see `flatten`;
    EOS already appended, every pair <= max_len per side). Tokens keep the arrays' dtype."""
    src_starts = (np.cumsum(src_lens) - src_lens)[order]
    tgt_starts = (np.cumsum(tgt_lens) - tgt_lens)[order]
    ls, lt = src_lens[order], tgt_lens[order]
    if packed:
        row, off_s, off_t, seg, num_rows = first_fit(ls, lt, max_len)
    else:
        row, off_s, off_t, seg, num_rows = one_per_row(len(order))
    seg_dtype = segment_dtype(max_len)
    inputs, inputs_seg = _scatter(src, src_starts, ls, row, off_s, seg, num_rows, max_len,
                                  seg_dtype)
    targets, targets_seg = _scatter(tgt, tgt_starts, lt, row, off_t, seg, num_rows, max_len,
                                    seg_dtype)
    return {'inputs': inputs, 'targets': targets,
            'inputs_segment_ids': inputs_seg, 'targets_segment_ids': targets_seg}


def pack(src: list[list[int]], tgt: list[list[int]], max_len: int, packed: bool = True,
         dtype=np.int32) -> dict[str, np.ndarray]:
    """Rows [R, L] of `inputs`, `targets` and their `_segment_ids` (EOS already appended)."""
    (src_flat, src_lens), (tgt_flat, tgt_lens) = flatten(src, dtype), flatten(tgt, dtype)
    return pack_flat(src_flat, src_lens, tgt_flat, tgt_lens, np.arange(len(src)), max_len,
                     packed)


def positions(segment_ids: np.ndarray) -> np.ndarray:
    """Positions [R, L] restarting at 0 where a segment starts; 0 on padding."""
    length = segment_ids.shape[-1]
    idx = np.broadcast_to(np.arange(length), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return np.where(segment_ids > 0, idx - first, 0).astype(np.int32)
