"""Lexically constrained beam search: dynamic beam allocation (Post & Vilar 2018) in jitted JAX.

`Constraints(phrases_BCP)` is what decode.beam_search (and t2t/eval/predict.py) take as
`constraints`: started for K beams it is the search's carry, and its `step` replaces the plain
step after the model; without constraints the search is the plain one, operation for operation.

An example's constraints are phrases, token sequences its output must contain, each somewhere,
in any order (fairseq's `--constraints`, unordered). They come padded: phrases_BCP int32, 0
(PAD, never generated) after a phrase's last token and in unused slots.

Each hypothesis carries, per phrase, how much of it the output has matched so far: the longest
prefix of the phrase that ends the output (Knuth-Morris-Pratt: a broken match falls back to the
longest border, so 'a a b' is found in 'a a a b'), and whether the phrase has appeared whole. Its
bank is the constraint tokens it has met: those of the phrases done plus the matched prefixes.

`candidates` is the constrained form of the candidates of one step of decode.beam_search:
- EOS is blocked (log-prob -inf, not renormalized, as PAD) for a hypothesis with a phrase to go;
- the candidates are the 2K best over all beams (the unconstrained step's), every beam's next
  token of each phrase it has not done and its own best token (fairseq's
  LexicallyConstrainedBeamSearch), and its EOS once its phrases are met; the same (beam, token)
  twice counts once;
- the K that stay alive are taken round-robin across banks, the bank furthest along first: the
  best of each bank, then the second best of each, ... (`allocate`); those that end go to the
  finished pool as in the unconstrained search, by score.
An example without constraints gets exactly the unconstrained step's candidates and choice.

Shape letters (with decode.py's): C phrases per example, P tokens per phrase, X candidates per
example (2K + K * (C + 2)), J a border's length (0 .. P - 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from t2t import decode
from t2t.ids import PAD_ID

NEG_INF = float('-inf')


@struct.dataclass
class Constraints:
    """Each example's phrases; once started (`start`), what beam search carries for them. Every
    leaf's leading dim is the batch."""

    phrases_BCP: jax.Array  # int32: the phrases, 0-padded
    lengths_BC: jax.Array | None = None  # int32: tokens per phrase (0: an unused slot)
    border_BCPJ: jax.Array | None = None  # bool: phrase[:j] is a suffix of phrase[:s] (s: 3rd)
    progress_BKC: jax.Array | None = None  # int32: the matched prefix of each phrase, per beam
    done_BKC: jax.Array | None = None  # bool: the phrase has appeared whole (unused slots: True)

    def start(self, beam_size: int) -> Constraints:
        """The carry before the first token: nothing matched, unused slots done."""
        if jnp.ndim(self.phrases_BCP) != 3:
            raise ValueError(f'constraints have shape {jnp.shape(self.phrases_BCP)}, expected '
                             '(batch, phrases, tokens)')
        phrases_BCP = jnp.asarray(self.phrases_BCP, jnp.int32)
        B, C, _ = phrases_BCP.shape
        lengths_BC = jnp.sum(phrases_BCP != PAD_ID, axis=-1).astype(jnp.int32)
        return Constraints(
            phrases_BCP=phrases_BCP, lengths_BC=lengths_BC, border_BCPJ=_borders(phrases_BCP),
            progress_BKC=jnp.zeros((B, beam_size, C), jnp.int32),
            done_BKC=jnp.broadcast_to((lengths_BC == 0)[:, None, :], (B, beam_size, C)))

    def step(self, state: decode.BeamState, cand_log_probs_BKV, cache, searching_B, *, alpha,
             eos_id: int, unfinished: str) -> decode.BeamState:
        """beam_search's step after the model: the alive beams by dynamic beam allocation;
        finished, in classes each admitted only when the example has none of an earlier class:
        EOS (its phrases all met), then (under 'fallback'; with EOS under 'compete') cut at the
        limit with all phrases, then cut without them."""
        i, K = state.step, state.alive_log_probs_BK.shape[1]
        cand_log_probs_BKV = block_eos(cand_log_probs_BKV, self, eos_id)
        log_probs_BX, parent_BX, token_BX = candidates(cand_log_probs_BKV, self, eos_id)
        progress_BXC, done_BXC, met_BX = advance(self, parent_BX, token_BX)
        seqs_BXT = decode.gather_beams(state.alive_seqs_BKT, parent_BX)
        seqs_BXT = seqs_BXT.at[:, :, i + 1].set(token_BX)
        length = i + 1
        ended_BX = (token_BX == eos_id) | (length >= state.limit_B[:, None])
        live_BX = log_probs_BX > NEG_INF
        alive_pos_BK, alive_log_probs_BK = allocate(
            log_probs_BX, live_BX & ~ended_BX, met_BX, K, num_banks(self.phrases_BCP))

        new_BX = ended_BX & live_BX & searching_B[:, None]
        met_all_BX = jnp.all(done_BXC, axis=-1)
        first_BX = new_BX & ((token_BX == eos_id) if unfinished == 'fallback' else met_all_BX)
        second_BX = new_BX & met_all_BX & ~first_BX
        has_first_B = jnp.any(state.finished_flags_BK, axis=1) | jnp.any(first_BX, axis=1)
        has_second_B = has_first_B | jnp.any(second_BX, axis=1)
        new_BX = (first_BX | (second_BX & ~has_first_B[:, None])
                  | (new_BX & ~met_all_BX & ~has_second_B[:, None]))
        new_scores_BX = jnp.where(new_BX, log_probs_BX / decode.length_penalty(length, alpha),
                                  NEG_INF)
        alive_parent_BK = jnp.take_along_axis(parent_BX, alive_pos_BK, axis=1)
        return state.replace(
            step=i + 1,
            alive_seqs_BKT=decode.gather_beams(seqs_BXT, alive_pos_BK),
            alive_log_probs_BK=alive_log_probs_BK,
            alive_cache=decode.gather_cache(cache, alive_parent_BK),
            **decode.best_finished(state, new_scores_BX, new_BX, seqs_BXT),
            constraints=self.replace(progress_BKC=decode.gather_beams(progress_BXC, alive_pos_BK),
                                     done_BKC=decode.gather_beams(done_BXC, alive_pos_BK)),
        )

    def met(self, ids_BL):
        """bool[B]: every phrase of the example is in its row of ids."""
        return contains_all(ids_BL, self.phrases_BCP)


def _borders(phrases_BCP):
    """bool [B, C, P, P]: [.., s, j] says phrase[:j] is a suffix of phrase[:s] (j <= s; j = 0
    always): the states a match of length s may fall back to."""
    P = phrases_BCP.shape[-1]
    s, j, k = jnp.meshgrid(jnp.arange(P), jnp.arange(P), jnp.arange(P), indexing='ij')
    shifted_BCSJK = phrases_BCP[..., jnp.clip(s - j + k, 0, P - 1)]
    same_BCSJK = (shifted_BCSJK == phrases_BCP[..., None, None, :]) | (k >= j)
    return jnp.all(same_BCSJK, axis=-1) & (j <= s)[..., 0]


def num_banks(phrases_BCP) -> int:
    """Static: the banks a search may fill, 0 .. every slot's tokens."""
    return phrases_BCP.shape[1] * phrases_BCP.shape[2] + 1


def advance(state: Constraints, parent_BX, token_BX):
    """The state after beam parent_BX emits token_BX: (progress_BXC, done_BXC, met_BX)."""
    progress_BXC = jnp.take_along_axis(state.progress_BKC, parent_BX[:, :, None], axis=1)
    done_BXC = jnp.take_along_axis(state.done_BKC, parent_BX[:, :, None], axis=1)
    B, _, C = progress_BXC.shape
    batch_B11 = jnp.arange(B)[:, None, None]
    slot_11C = jnp.arange(C)[None, None, :]
    falls_back_BXCJ = state.border_BCPJ[batch_B11, slot_11C, progress_BXC]
    P = state.phrases_BCP.shape[-1]
    # phrase[j] for each border j <= s: the token that extends a fallback to length j + 1.
    extends_BXCJ = state.phrases_BCP[:, None, :, :] == token_BX[:, :, None, None]
    matched_BXCJ = jnp.where(falls_back_BXCJ & extends_BXCJ, jnp.arange(1, P + 1), 0)
    progress_BXC = jnp.max(matched_BXCJ, axis=-1).astype(jnp.int32)
    lengths_B1C = state.lengths_BC[:, None, :]
    done_BXC = done_BXC | (progress_BXC >= lengths_B1C)
    progress_BXC = jnp.where(done_BXC, 0, progress_BXC)  # a done phrase is matched no further
    met_BX = jnp.sum(jnp.where(done_BXC, lengths_B1C, progress_BXC), axis=-1)
    return progress_BXC, done_BXC, met_BX


def next_tokens(state: Constraints):
    """(token_BKC, wanted_BKC): each beam's next token of every phrase it has not done."""
    token_BKC = jnp.take_along_axis(state.phrases_BCP[:, None], state.progress_BKC[..., None],
                                    axis=-1)[..., 0]
    return token_BKC, ~state.done_BKC


def allocate(log_probs_BX, eligible_BX, met_BX, beam_size: int, banks: int):
    """Dynamic beam allocation: the positions of K eligible candidates taken round-robin across
    banks (most constraint tokens met first), each bank's best first; (pos_BK, log_probs_BK),
    -inf where fewer than K are eligible. With one bank: the K best, ties to the lower index."""
    X = log_probs_BX.shape[1]
    index_X = jnp.arange(X)
    ahead_BXY = ((log_probs_BX[:, None, :] > log_probs_BX[:, :, None])
                 | ((log_probs_BX[:, None, :] == log_probs_BX[:, :, None])
                    & (index_X[None, :] < index_X[:, None])))
    same_bank_BXY = met_BX[:, None, :] == met_BX[:, :, None]
    rank_BX = jnp.sum(ahead_BXY & same_bank_BXY & eligible_BX[:, None, :], axis=-1)
    stripe_BX = rank_BX * banks + (banks - 1 - met_BX)
    last = jnp.iinfo(jnp.int32).max
    _, pos_BK = lax.top_k(-jnp.where(eligible_BX, stripe_BX, last), beam_size)
    chosen_BK = jnp.take_along_axis(eligible_BX, pos_BK, axis=1)
    picked_BK = jnp.take_along_axis(log_probs_BX, pos_BK, axis=1)
    return pos_BK, jnp.where(chosen_BK, picked_BK, NEG_INF)


def block_eos(cand_log_probs_BKV, state: Constraints, eos_id: int):
    """EOS at -inf for the beams with a phrase still to go."""
    if eos_id < 0:
        return cand_log_probs_BKV
    all_done_BK = jnp.all(state.done_BKC, axis=-1)
    return cand_log_probs_BKV.at[:, :, eos_id].set(
        jnp.where(all_done_BK, cand_log_probs_BKV[:, :, eos_id], NEG_INF))


def candidates(cand_log_probs_BKV, state: Constraints, eos_id: int):
    """The step's candidates (EOS already blocked): (log_probs_BX, parent_BX, token_BX), the 2K
    best first (as the unconstrained step's top_k), then each beam's constraint tokens, its best
    token and its EOS (-inf until its phrases are met: else a beam with them all would wait for
    its EOS to rank among the 2K best); repeats and the extras of examples without constraints
    at -inf."""
    B, K, V = cand_log_probs_BKV.shape
    top_BC, flat_BC = lax.top_k(cand_log_probs_BKV.reshape(B, K * V), 2 * K)
    want_token_BKC, wanted_BKC = next_tokens(state)
    want_BKC = jnp.where(wanted_BKC, jnp.take_along_axis(cand_log_probs_BKV, want_token_BKC,
                                                         axis=-1), NEG_INF)
    extra_tokens = [want_token_BKC, jnp.argmax(cand_log_probs_BKV, axis=-1)[..., None]]
    extras = [want_BKC, jnp.max(cand_log_probs_BKV, axis=-1)[..., None]]
    if eos_id >= 0:
        extra_tokens.append(jnp.full((B, K, 1), eos_id))
        extras.append(cand_log_probs_BKV[:, :, eos_id:eos_id + 1])
    constrained_B11 = jnp.any(state.lengths_BC > 0, axis=1)[:, None, None]
    extra_BKE = jnp.where(constrained_B11, jnp.concatenate(extras, axis=-1), NEG_INF)
    E = extra_BKE.shape[-1]
    log_probs_BX = jnp.concatenate([top_BC, extra_BKE.reshape(B, K * E)], axis=1)
    parent_BX = jnp.concatenate(
        [flat_BC // V, jnp.broadcast_to(jnp.arange(K)[:, None], (B, K, E)).reshape(B, K * E)],
        axis=1)
    token_BX = jnp.concatenate(
        [flat_BC % V, jnp.concatenate(extra_tokens, axis=-1).reshape(B, K * E)],
        axis=1).astype(jnp.int32)
    # The same (beam, token) from two sources: the first one stays.
    key_BX = parent_BX * V + token_BX
    X = key_BX.shape[1]
    earlier_XY = jnp.arange(X)[None, :] < jnp.arange(X)[:, None]
    repeat_BX = jnp.any((key_BX[:, :, None] == key_BX[:, None, :]) & earlier_XY, axis=-1)
    return jnp.where(repeat_BX, NEG_INF, log_probs_BX), parent_BX.astype(jnp.int32), token_BX


def contains_all(ids_BL, phrases_BCP):
    """bool[B]: every phrase of the example appears in its row of ids (contiguously)."""
    ids_BL = jnp.asarray(ids_BL, jnp.int32)
    phrases_BCP = jnp.asarray(phrases_BCP, jnp.int32)
    L, P = ids_BL.shape[1], phrases_BCP.shape[-1]
    padded_BL = jnp.pad(ids_BL, ((0, 0), (0, P)), constant_values=-1)
    windows_BLP = padded_BL[:, jnp.arange(L)[:, None] + jnp.arange(P)[None, :]]
    used_BCP = phrases_BCP != PAD_ID
    hit_BCL = jnp.all((windows_BLP[:, None] == phrases_BCP[:, :, None]) | ~used_BCP[:, :, None],
                      axis=-1)
    present_BC = jnp.any(hit_BCL, axis=-1) | ~jnp.any(used_BCP, axis=-1)
    return jnp.all(present_BC, axis=-1)

