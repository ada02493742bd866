"""Beam search, greedy decoding and sampling, model-agnostic and fully jitted.

The model is seen only through a closure

    tokens_to_logits(ids_N1: int32[N, 1], cache, constants) -> (logits_NV: float[N, V], new_cache)

that feeds one token per row, advances its decode cache by one position and returns the logits
of the next token. `constants` (the encoder's keys/values, the source mask) are the same for
every beam of an example: tiled once, never reordered by beam. Rows are beams flattened
batch-major, row n = b * K + k. The first token fed is 0 (PAD acts as BOS, as the model shifts
targets right with 0). PAD is never generated (log-probability -inf, not renormalized), so a
hypothesis is tokens, EOS, then 0s. The cache handed in is for B sequences: leaves of ndim >= 1
lead with B (beam_search tiles them K times and re-gathers them by parent beam every step),
scalar leaves (a shared cache index) are shared by all rows.

The searches are `lax.while_loop`s with static shapes, called inside `jax.jit` with
tokens_to_logits closed over: one compile per (batch_size, beam_size, max_decode_len,
shrink_to); `max_lengths` and `alpha` may be traced.

Compaction (beam_search's `shrink_to`; CTranslate2 and fairseq drop finished examples too):
static shapes cannot shrink, so the search runs in stages of fewer and fewer examples, each its
own while loop. A stage ends once no more of its examples are still searching than the next
holds; those are gathered (state, cache, constants) into the smaller batch. Rows are
independent, so the hypotheses are the one-stage search's (up to a matmul's rounding at another
batch size).

Shape letters: B batch size; K beam size; N rows fed to the model (B * K, or B for greedy and
sampling); C 2 * K candidates per example and step; M 3 * K, the pool the finished set is chosen
from; L max_decode_len, the generated positions returned; T L + 1, the token buffer (position 0
holds BOS); V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from t2t.ids import EOS_ID, PAD_ID

NEG_INF = float('-inf')

# What a hypothesis cut at its length limit without EOS counts for (see `beam_search`).
UNFINISHED_RULES = ('fallback', 'compete')
# When an example stops searching (see `beam_search`).
STOP_RULES = ('bound', 'k_finished')
# How a hypothesis is found: beam_search, greedy_search (argmax) or sample_search.
STRATEGIES = ('beam', 'greedy', 'sample')

TokensToLogits = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]


def length_penalty(length, alpha):
    """GNMT length penalty ((5 + |Y|) / 6) ** alpha (Wu et al. 2016), as float32.

    |Y| counts the generated tokens including the final EOS and excluding the BOS, as in
    tensor2tensor and flax examples/wmt. A hypothesis cut at its length limit without EOS has
    |Y| = the limit. Its score is sum(log p) / length_penalty(|Y|, alpha).
    """
    length = jnp.asarray(length, jnp.float32)
    return jnp.power((5.0 + length) / 6.0, jnp.asarray(alpha, jnp.float32))


def _length_limits(batch_size, max_decode_len, max_lengths):
    """int32[B] number of tokens each example may generate, within the static buffer. A limit
    of 0 (nothing to decode: a padding row) ends the example before the first step."""
    if max_lengths is None:
        return jnp.full((batch_size,), max_decode_len, jnp.int32)
    max_lengths = jnp.asarray(max_lengths, jnp.int32)
    if max_lengths.shape != (batch_size,):
        raise ValueError(f'max_lengths has shape {max_lengths.shape}, expected ({batch_size},)')
    return jnp.clip(max_lengths, 0, max_decode_len)


def _check_leaves(tree, batch_size, what):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.ndim(x) and jnp.shape(x)[0] != batch_size:
            raise ValueError(
                f'{what} leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(x)}; leaves must '
                f'be scalars or have leading dim batch_size={batch_size}'
            )


def _per_row(tree, batch_size, beam_size):
    """Repeats each example's rows beam_size times: leaves [B, ...] -> [B * K, ...]."""
    return jax.tree.map(
        lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(jnp.asarray(x), beam_size, axis=0), tree)


def gather_beams(x_BK, beam_idx_BJ):
    """x[b, beam_idx[b, j]] for an array whose dims 0, 1 are (batch, beam): -> [B, J, ...]."""
    batch_idx_B1 = jnp.arange(x_BK.shape[0])[:, None]
    return x_BK[batch_idx_B1, beam_idx_BJ]


def _take_rows(tree, rows_N):
    """Leaves [N, ...] with row n taken from row rows_N[n] (scalar leaves as they are)."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, rows_N, axis=0), tree)


def gather_cache(cache, beam_idx_BK):
    """Re-orders the flat cache rows [B * K, ...] so row b * K + k holds beam beam_idx[b, k]."""
    batch_size, beam_size = beam_idx_BK.shape
    return _take_rows(cache, (jnp.arange(batch_size)[:, None] * beam_size + beam_idx_BK).ravel())


@struct.dataclass
class BeamState:
    """Loop carry of `beam_search`, for the examples of the current stage (B of them)."""

    step: jax.Array  # int32[]: tokens generated so far; alive_seqs[:, :, step] is fed next
    alive_seqs_BKT: jax.Array  # int32: BOS, then the tokens of the unfinished beams
    alive_log_probs_BK: jax.Array  # float32: sum of log-probs; -inf marks an empty beam
    alive_cache: Any  # model cache, leaves [N, ...] (or scalars), rows aligned with alive beams
    finished_seqs_BKT: jax.Array  # int32: ended hypotheses, EOS then 0 padding
    finished_scores_BK: jax.Array  # float32: log-prob / length penalty, sorted best first
    finished_flags_BK: jax.Array  # bool: slot holds a real hypothesis
    limit_B: jax.Array  # int32: the tokens this example may generate
    origin_B: jax.Array  # int32: the example's row in the batch beam_search was given
    constants: Any  # the model's per-row constants, leaves [N, ...] (or scalars)
    constraints: Any = None  # beam_search's constraints, started (leaves [B, ...]), or None

    def keep_examples(self, keep_E, beam_size: int) -> BeamState:
        """The state of examples keep_E only, in that order (rows [N, ...] move K at a time)."""
        rows_N = (keep_E[:, None] * beam_size + jnp.arange(beam_size)).ravel()
        per_example = {f.name: getattr(self, f.name)[keep_E] for f in dataclasses.fields(self)
                       if f.name not in ('step', 'alive_cache', 'constants', 'constraints')}
        return self.replace(alive_cache=_take_rows(self.alive_cache, rows_N),
                            constants=_take_rows(self.constants, rows_N),
                            constraints=jax.tree.map(lambda x: x[keep_E], self.constraints),
                            **per_example)


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache,
    *,
    batch_size: int,
    beam_size: int,
    alpha,
    eos_id: int,
    max_decode_len: int,
    max_lengths=None,
    unfinished: str = 'fallback',
    stop: str = 'bound',
    constants=None,
    shrink_to: tuple[int, ...] = (),
    cache_lengths: tuple[int, ...] = (),
    grow_cache: Callable[[Any, int], Any] | None = None,
    log_probs: bool = False,
    constraints=None,
):
    """Beam search with the GNMT length penalty (alive / finished, 2K top-k per step).

    tokens_to_logits and cache: as in the module docstring (N = B * K). batch_size, beam_size,
    max_decode_len (the buffer: the most tokens of a hypothesis, EOS included), eos_id: static.
    alpha: the length penalty's exponent (0.6 in the paper), may be traced. max_lengths: int32[B],
    each example's token limit (the paper: source length + 50) in [0, max_decode_len]; 0 decodes
    nothing. constants: what the model reads per row and never changes (leaves lead with B).
    A hypothesis cut at its limit is scored as if it emitted EOS there (|Y| = limit).

    Static rules: unfinished, what a hypothesis cut at its limit counts for: 'fallback'
    (tensor2tensor's) finished only if none of its example ended in EOS, 'compete' finished like
    one with EOS. stop: 'bound' (tensor2tensor's) stops an example once no alive beam can beat
    its worst of K finished (log-probs only fall), which never changes the result; 'k_finished'
    (fairseq, CTranslate2) once K have finished, where a later winner is lost.

    Levers: shrink_to, decreasing batch sizes to compact to (module docstring). cache_lengths and
    grow_cache(cache, length): the cache handed in holds cache_lengths[0] positions, grown to the
    next length (last max_decode_len) when the steps reach it. log_probs: tokens_to_logits gives
    log-probabilities already (an ensemble's mean, not renormalized). constraints: phrases each
    hypothesis must contain (t2t/eval/constraints.py), leaves [B, ...]: start(beam_size) is the
    carry kept in BeamState, whose step(state, cand_log_probs_BKV, cache, searching_B, alpha=,
    eos_id=, unfinished=) replaces `_beam_step`.

    Returns (sequences int32[B, K, max_decode_len]: tokens (BOS excluded), EOS, then 0s; scores
    float32[B, K]: sum log-prob / length_penalty(|Y|, alpha), best first). A slot is -inf only
    when fewer than K hypotheses exist (a tiny vocabulary) or, under 'fallback', fewer than K
    ended in EOS (its sequence is 0s).
    """
    _check_beam_arguments(batch_size, unfinished, stop, shrink_to, cache_lengths)
    _check_leaves(cache, batch_size, 'cache')
    _check_leaves(constants, batch_size, 'constants')
    _check_leaves(constraints, batch_size, 'constraints')
    K, L = beam_size, max_decode_len
    state = _first_state(cache, constants, batch_size, K, L,
                         _length_limits(batch_size, L, max_lengths))
    if constraints is not None:
        state = state.replace(constraints=constraints.start(K))

    def body_fn(state: BeamState):
        B = state.limit_B.shape[0]
        ids_N1 = state.alive_seqs_BKT[:, :, state.step].reshape(B * K, 1)
        logits_NV, cache = tokens_to_logits(ids_N1, state.alive_cache, state.constants)
        log_probs_NV = logits_NV.astype(jnp.float32)
        if not log_probs:
            log_probs_NV = jax.nn.log_softmax(log_probs_NV)
        log_probs_BKV = log_probs_NV.reshape(B, K, -1).at[:, :, PAD_ID].set(NEG_INF)  # never made
        cand_log_probs_BKV = state.alive_log_probs_BK[:, :, None] + log_probs_BKV
        step = _beam_step if state.constraints is None else state.constraints.step
        return step(state, cand_log_probs_BKV, cache, _searching(state, alpha, stop),
                    alpha=alpha, eos_id=eos_id, unfinished=unfinished)

    def search(state: BeamState, steps: int, next_rows: int) -> BeamState:
        """Steps until `steps` or until the searching examples fit in next_rows (0: none left)."""
        return lax.while_loop(
            lambda state: (state.step < steps)
            & (jnp.sum(_searching(state, alpha, stop)) > next_rows), body_fn, state)

    # The whole batch's first steps with a short cache, then grown (once per length).
    lengths = [n for n in cache_lengths if n < L] if grow_cache is not None else []
    for length, grown in itertools.pairwise([*lengths, L]):
        state = search(state, length, (*shrink_to, 0)[0])
        state = state.replace(alive_cache=grow_cache(state.alive_cache, grown))
    return _search_in_stages(state, search, shrink_to, L,
                             lambda state: _searching(state, alpha, stop))


def _check_beam_arguments(batch_size, unfinished, stop, shrink_to, cache_lengths):
    if unfinished not in UNFINISHED_RULES:
        raise ValueError(f'unfinished={unfinished!r}, expected one of {UNFINISHED_RULES}')
    if stop not in STOP_RULES:
        raise ValueError(f'stop={stop!r}, expected one of {STOP_RULES}')
    ladder = (batch_size, *shrink_to)
    if any(not 0 < small < big for big, small in itertools.pairwise(ladder)):
        raise ValueError(f'shrink_to={shrink_to} must decrease from batch_size={batch_size} '
                         'and stay >= 1')
    if any(long <= short for short, long in itertools.pairwise((0, *cache_lengths))):
        raise ValueError(f'cache_lengths={cache_lengths} must increase from 1')


def _first_state(cache, constants, B: int, K: int, L: int, limit_B) -> BeamState:
    """Before the first token: beam 0 of each example alive (the others would repeat it), none
    where there is nothing to decode; the cache and constants tiled to B * K rows."""
    T = L + 1
    first_BK = jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), jnp.float32), (B, 1))
    return BeamState(
        step=jnp.array(0, jnp.int32),
        alive_seqs_BKT=jnp.full((B, K, T), PAD_ID, jnp.int32),
        alive_log_probs_BK=jnp.where(limit_B[:, None] > 0, first_BK, NEG_INF),
        alive_cache=_per_row(cache, B, K),
        finished_seqs_BKT=jnp.full((B, K, T), PAD_ID, jnp.int32),
        finished_scores_BK=jnp.full((B, K), NEG_INF, jnp.float32),
        finished_flags_BK=jnp.zeros((B, K), jnp.bool_),
        limit_B=limit_B,
        origin_B=jnp.arange(B, dtype=jnp.int32),
        constants=_per_row(constants, B, K),
    )


def _searching(state: BeamState, alpha, stop: str):
    """bool[B]: an alive beam of the example can still beat its worst finished one (and, under
    stop='k_finished', fewer than K hypotheses have finished)."""
    # Largest penalty over the lengths still reachable (monotone in length, either sign of
    # alpha); dividing a non-positive log-prob by it gives the best reachable score.
    max_penalty_B = jnp.maximum(
        length_penalty(state.step + 1, alpha), length_penalty(state.limit_B, alpha))
    best_alive_B = jnp.max(state.alive_log_probs_BK, axis=1) / max_penalty_B
    all_finished_B = jnp.all(state.finished_flags_BK, axis=1)
    worst_finished_B = jnp.where(all_finished_B, jnp.min(state.finished_scores_BK, axis=1),
                                 NEG_INF)
    can_improve_B = best_alive_B > worst_finished_B
    if stop == 'k_finished':
        return can_improve_B & ~all_finished_B
    return can_improve_B


def _beam_step(state: BeamState, cand_log_probs_BKV, cache, searching_B, *, alpha, eos_id: int,
               unfinished: str) -> BeamState:
    """The step after the model: of the 2K best candidates (at most K of them end in EOS, so K
    can always stay alive) the best K unended stay alive, the ended join the finished."""
    i = state.step
    B, K, V = cand_log_probs_BKV.shape
    top_log_probs_BC, top_flat_BC = lax.top_k(cand_log_probs_BKV.reshape(B, K * V), 2 * K)
    parent_BC = top_flat_BC // V
    token_BC = (top_flat_BC % V).astype(jnp.int32)
    seqs_BCT = gather_beams(state.alive_seqs_BKT, parent_BC).at[:, :, i + 1].set(token_BC)
    length = i + 1
    ended_BC = (token_BC == eos_id) | (length >= state.limit_B[:, None])
    alive_log_probs_BK, alive_pos_BK = lax.top_k(
        jnp.where(ended_BC, NEG_INF, top_log_probs_BC), K)
    alive_parent_BK = jnp.take_along_axis(parent_BC, alive_pos_BK, axis=1)

    # An example that has stopped keeps its hypotheses: under 'k_finished' a later step could
    # still improve them, which would make its answer depend on how long its batch runs.
    new_flags_BC = ended_BC & (top_log_probs_BC > NEG_INF) & searching_B[:, None]
    if unfinished == 'fallback':
        # Cut hypotheses arrive only at the example's last step, when the finished pool holds
        # EOS ones only: they join only if neither the pool nor this step has one.
        eos_BC = new_flags_BC & (token_BC == eos_id)
        has_eos_B = jnp.any(state.finished_flags_BK, axis=1) | jnp.any(eos_BC, axis=1)
        new_flags_BC = eos_BC | (new_flags_BC & ~has_eos_B[:, None])
    new_scores_BC = jnp.where(new_flags_BC, top_log_probs_BC / length_penalty(length, alpha),
                              NEG_INF)
    return state.replace(
        step=i + 1,
        alive_seqs_BKT=gather_beams(seqs_BCT, alive_pos_BK),
        alive_log_probs_BK=alive_log_probs_BK,
        alive_cache=gather_cache(cache, alive_parent_BK),
        **best_finished(state, new_scores_BC, new_flags_BC, seqs_BCT),
    )


def best_finished(state: BeamState, new_scores_BC, new_flags_BC, seqs_BCT) -> dict:
    """The K best of an example's finished hypotheses and this step's new ones (state fields).
    The old ones come first, so ties keep them (top_k prefers the lower index)."""
    K = state.finished_scores_BK.shape[1]
    pool_scores_BM = jnp.concatenate([state.finished_scores_BK, new_scores_BC], axis=1)
    pool_flags_BM = jnp.concatenate([state.finished_flags_BK, new_flags_BC], axis=1)
    pool_seqs_BMT = jnp.concatenate([state.finished_seqs_BKT, seqs_BCT], axis=1)
    finished_scores_BK, finished_pos_BK = lax.top_k(pool_scores_BM, K)
    return dict(finished_seqs_BKT=gather_beams(pool_seqs_BMT, finished_pos_BK),
                finished_scores_BK=finished_scores_BK,
                finished_flags_BK=gather_beams(pool_flags_BM, finished_pos_BK))


def _search_in_stages(state: BeamState, search, shrink_to, L: int, searching):
    """The search to its end, compacted into the smaller batches of shrink_to as examples stop
    (module docstring): (sequences [B, K, L], scores [B, K]) of every example in its row."""
    B, K, T = state.alive_seqs_BKT.shape
    out_seqs_BKT = jnp.full((B, K, T), PAD_ID, jnp.int32)
    out_scores_BK = jnp.full((B, K), NEG_INF, jnp.float32)
    for next_rows in (*shrink_to, 0):
        state = search(state, L, next_rows)
        # Every example's hypotheses as they stand; those kept are overwritten by a later stage.
        out_seqs_BKT = out_seqs_BKT.at[state.origin_B].set(state.finished_seqs_BKT)
        out_scores_BK = out_scores_BK.at[state.origin_B].set(state.finished_scores_BK)
        if next_rows:
            # The searching examples first (in order), then finished ones to fill the rows:
            # those stay finished, their hypotheses are written again unchanged.
            state = state.keep_examples(
                jnp.argsort(~searching(state), stable=True)[:next_rows], K)
    return out_seqs_BKT[:, :, 1:], out_scores_BK


@struct.dataclass
class GreedyState:
    """Loop carry of `greedy_search`."""

    step: jax.Array  # int32[]: tokens generated so far; seqs[:, step] is fed next
    seqs_BT: jax.Array  # int32: BOS, generated tokens, EOS, then 0s
    cache: Any  # model cache, leaves [B, ...] (or scalars)
    finished_B: jax.Array  # bool: emitted EOS or reached its limit


def greedy_search(tokens_to_logits: TokensToLogits, cache, *, batch_size: int, eos_id: int,
                  max_decode_len: int, max_lengths=None, constants=None,
                  pick: Callable[[jax.Array, jax.Array], jax.Array] | None = None):
    """Greedy (argmax) decoding with beam_search's conventions, one row per example (N = B, the
    cache and constants as given): sequences int32[B, max_decode_len], tokens, EOS, then 0s.
    pick: (logits_BV with PAD at -inf, step) -> int32[B], each row's token instead of the argmax.
    """
    B, L = batch_size, max_decode_len
    limit_B = _length_limits(B, L, max_lengths)
    state = GreedyState(step=jnp.array(0, jnp.int32), cache=cache, finished_B=limit_B == 0,
                        seqs_BT=jnp.full((B, L + 1), PAD_ID, jnp.int32))

    def cond_fn(state: GreedyState):
        return (state.step < L) & ~jnp.all(state.finished_B)

    def body_fn(state: GreedyState):
        i = state.step
        logits_BV, cache = tokens_to_logits(state.seqs_BT[:, i][:, None], state.cache,
                                           constants)
        logits_BV = logits_BV.astype(jnp.float32).at[:, PAD_ID].set(NEG_INF)  # never generated
        if pick is None:
            token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        else:
            token_B = pick(logits_BV, i)
        token_B = jnp.where(state.finished_B, 0, token_B)
        finished_B = state.finished_B | (token_B == eos_id) | (i + 1 >= limit_B)
        return GreedyState(step=i + 1, seqs_BT=state.seqs_BT.at[:, i + 1].set(token_B),
                           cache=cache, finished_B=finished_B)

    state = lax.while_loop(cond_fn, body_fn, state)
    return state.seqs_BT[:, 1:]


def sampling_logits(logits_BV, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """float32 logits_BV / temperature, the tokens outside the top_k (0: none) and then outside
    the fewest most likely whose mass reaches top_p (1: none) at -inf (ties at either threshold
    stay in): what `sample_search` draws from."""
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    V = logits_BV.shape[-1]
    if 0 < top_k < V:
        kth_B1 = lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, NEG_INF, logits_BV)
    if top_p < 1:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # most likely first
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # A token stays when the tokens more likely than it hold less than top_p: the first
        # always does.
        kept_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p
        least_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < least_B1, NEG_INF, logits_BV)
    return logits_BV


def sample_search(tokens_to_logits: TokensToLogits, cache, *, keys_B, batch_size: int,
                  eos_id: int, max_decode_len: int, max_lengths=None, constants=None,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Ancestral sampling: `greedy_search` with each token drawn from `sampling_logits`, step t
    of row b with fold_in(keys_B[b], t) (a row's sample depends on its key and logits alone)."""
    def pick(logits_BV, step):
        keys_B_step = jax.vmap(jax.random.fold_in, (0, None))(keys_B, step)
        logits_BV = sampling_logits(logits_BV, temperature, top_k, top_p)
        return jax.vmap(jax.random.categorical)(keys_B_step, logits_BV).astype(jnp.int32)

    return greedy_search(tokens_to_logits, cache, batch_size=batch_size, eos_id=eos_id,
                         max_decode_len=max_decode_len, max_lengths=max_lengths,
                         constants=constants, pick=pick)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Which search decodes and how: the decoding keys of configs/common.py under their names,
    checked when made (one line naming the key and what it needs). Hashable: the cache key of
    t2t/eval/predict.py's make_predict_fn. The defaults are the paper's beam search, without
    compaction."""

    decode_strategy: str = 'beam'  # one of STRATEGIES: beam search, argmax, sampling
    beam_size: int = 4  # 1 is still beam search (alive / finished, the length penalty)
    length_penalty_alpha: float = 0.6
    beam_unfinished: str = 'fallback'  # beam_search's `unfinished` rule
    beam_stop: str = 'bound'  # beam_search's `stop` rule
    # Compaction: beam search drops ended examples, to quarters down to this many
    # (t2t/eval/predict.py: shrink_ladder)
    beam_shrink_floor: int = 0
    max_decode_len: int = 256  # the decode buffers' length: the most tokens of any hypothesis
    max_decode_extra: int = 50  # an example's limit: its source length + this
    temperature: float = 1.0  # decode_strategy='sample': logits / temperature (sampling_logits)
    top_k: int = 0
    top_p: float = 1.0
    decode_seed: int = 0  # decode_strategy='sample': with its source, a sentence's key
    num_samples: int = 1  # decode_strategy='sample': draws per sentence (predict.draw_keys; MBR)
    nbest: int = 1  # beam search's best nbest too (evaluate.py --nbest; no config key)
    eos_id: int = EOS_ID  # -1: no EOS, every hypothesis runs to its limit (benchmarks)

    def __post_init__(self):
        rules = (  # (holds, key, what the key needs), in the order a config is checked
            (self.decode_strategy in STRATEGIES, 'decode_strategy', f'must be one of {STRATEGIES}'),
            (self.temperature > 0, 'temperature', "must be > 0 (1: the model's distribution)"),
            (self.top_k >= 0, 'top_k', 'must be >= 0 (0: every token)'),
            (0 < self.top_p <= 1, 'top_p', 'must be in (0, 1] (1: every token)'),
            (self.decode_seed >= 0, 'decode_seed', 'must be >= 0'),
            (self.beam_size >= 1, 'beam_size', 'must be >= 1'),
            (self.length_penalty_alpha >= 0, 'length_penalty_alpha', 'must be >= 0'),
            (self.beam_unfinished in UNFINISHED_RULES, 'beam_unfinished',
             f'must be one of {UNFINISHED_RULES}'),
            (self.beam_stop in STOP_RULES, 'beam_stop', f'must be one of {STOP_RULES}'),
            (self.max_decode_extra >= 0, 'max_decode_extra', 'must be >= 0'),
            (self.beam_shrink_floor >= 0, 'beam_shrink_floor', 'must be >= 0 (0: no compaction)'),
            (self.max_decode_len >= 1, 'max_decode_len', 'must be >= 1'),
            (1 <= self.nbest <= self.beam_size, 'nbest',
             f'must be in [1, beam_size={self.beam_size}]'),
            (self.nbest == 1 or self.decode_strategy == 'beam', 'nbest',
             f'needs decode_strategy=beam (decode_strategy={self.decode_strategy!r} keeps one '
             'hypothesis)'),
            (self.num_samples >= 1, 'num_samples', 'must be >= 1'),
            (self.num_samples == 1 or self.decode_strategy == 'sample', 'num_samples',
             f'needs decode_strategy=sample (not {self.decode_strategy!r})'),
        )
        for holds, key, needs in rules:
            if not holds:
                raise ValueError(f'{key}={getattr(self, key)!r} {needs}')

    @classmethod
    def from_config(cls, config, nbest: int = 1) -> DecodeConfig:
        return cls(decode_strategy=config.decode_strategy,
                   beam_size=config.beam_size,
                   length_penalty_alpha=config.length_penalty_alpha,
                   beam_unfinished=config.beam_unfinished,
                   beam_stop=config.beam_stop,
                   beam_shrink_floor=config.beam_shrink_floor,
                   max_decode_len=config.max_decode_len,
                   max_decode_extra=config.max_decode_extra,
                   temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                   decode_seed=config.decode_seed,
                   nbest=nbest)

    def replace(self, **changes) -> DecodeConfig:
        return dataclasses.replace(self, **changes)
