"""Lexically constrained beam search (t2t/eval/constraints.py) on tests/test_decode.py's toy model.

A wide beam keeps every prefix alive, so its constrained search must equal exhaustive search
restricted to the outputs the constraints allow; a narrow one must still put every phrase in
every output that has room for it; examples without constraints must decode exactly as the
unconstrained search does.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t import decode
from t2t.eval import constraints
from t2t.eval.constraints import Constraints
from tests.test_decode import EOS, V, _hash, _log_softmax, _pad, _pen, _table, _trim, init_cache
from tests.test_decode import run_beam as run_plain
from tests.test_decode import tokens_to_logits as toy_tokens_to_logits


def _phrases(per_example, C=2, P=3):
    """int32 [B, C, P] from lists of phrases (lists of tokens), 0-padded."""
    out = np.zeros((len(per_example), C, P), np.int32)
    for b, phrases in enumerate(per_example):
        for c, phrase in enumerate(phrases):
            out[b, c, :len(phrase)] = phrase
    return jnp.asarray(out)


@functools.partial(jax.jit, static_argnames=('beam_size', 'max_decode_len', 'unfinished',
                                             'shrink_to'))
def run_beam(table_RV, offset_B, max_lengths_B, phrases_BCP, *, beam_size, max_decode_len,
             unfinished='fallback', shrink_to=()):
    return decode.beam_search(
        functools.partial(toy_tokens_to_logits, table_RV), init_cache(offset_B, max_decode_len),
        batch_size=offset_B.shape[0], beam_size=beam_size, alpha=0.6, eos_id=EOS,
        max_decode_len=max_decode_len, max_lengths=max_lengths_B, unfinished=unfinished,
        constraints=Constraints(phrases_BCP), shrink_to=shrink_to)


def _contains(seq, phrase):
    return any(list(seq[i:i + len(phrase)]) == list(phrase) for i in range(len(seq)))


def exhaustive_constrained(table, offset, limit, alpha, phrases, unfinished):
    """Every hypothesis the constrained search may return, best first: [(score, tokens)]. EOS
    only after all phrases; of the finished ones only the first class the example has: EOS,
    then ('fallback') cut at the limit with all phrases, then cut without them; 'compete' puts
    the first two in one class."""
    table = np.asarray(table)
    found = []

    def expand(prefix, log_prob):
        log_probs_V = _log_softmax(table[_hash([0] + prefix, offset)])
        met = all(_contains(prefix, p) for p in phrases)
        for v in range(1, V):
            if v == EOS and not met:
                continue
            seq, lp = prefix + [v], log_prob + log_probs_V[v]
            if v == EOS:
                found.append((0, lp / _pen(len(seq), alpha), seq))
            elif len(seq) == limit:
                has_all = all(_contains(seq, p) for p in phrases)
                found.append(((1 if unfinished == 'fallback' else 0) if has_all else 2,
                              lp / _pen(len(seq), alpha), seq))
            else:
                expand(seq, lp)

    expand([], 0.0)
    first = min(c for c, _, _ in found)
    return sorted([(s, q) for c, s, q in found if c == first], key=lambda r: -r[0])


@pytest.mark.parametrize('unfinished', ['fallback', 'compete'])
def test_wide_beam_equals_exhaustive_search_over_the_allowed_outputs(unfinished):
    # K = 64 >= 3 ** 3 keeps every prefix alive to length 3, and 2K covers all their children:
    # beam search is exact. Example 2's phrase [4, 2, 3] cannot end in EOS within its limit 3,
    # so only cut hypotheses with it come back; example 4 has none and searches unconstrained.
    L, K = 4, 64
    table = _table(3)
    per_example = [[[2, 3]], [[3], [4]], [[4, 2, 3]], [[2, 2], [2]], []]
    limits = [4, 4, 3, 4, 4]
    offset_B = jnp.arange(5, dtype=jnp.int32)
    seqs_BKL, scores_BK = run_beam(table, offset_B, jnp.array(limits, jnp.int32),
                                   _phrases(per_example), beam_size=K, max_decode_len=L,
                                   unfinished=unfinished)
    seqs_BKL, scores_BK = np.asarray(seqs_BKL), np.asarray(scores_BK)
    for b, (phrases, limit) in enumerate(zip(per_example, limits, strict=True)):
        expected = exhaustive_constrained(table, b, limit, 0.6, phrases, unfinished)[:K]
        n = len(expected)
        assert n > 0
        np.testing.assert_allclose(scores_BK[b, :n], [s for s, _ in expected], rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(seqs_BKL[b, :n], [_pad(q, L) for _, q in expected])
        assert np.all(scores_BK[b, n:] == -np.inf)


def test_examples_without_constraints_decode_exactly_as_the_plain_search():
    # A narrow beam, where the constrained step's extra candidates exist but must change
    # nothing for an example without phrases: sequences and scores bit for bit, whether the
    # batch holds constrained examples or not.
    L, K = 6, 3
    offset_B = jnp.arange(4, dtype=jnp.int32)
    max_lengths_B = jnp.array([6, 3, 5, 6], jnp.int32)
    mixed = _phrases([[], [[3, 4]], [], [[2], [4, 4]]])
    for seed, rule in itertools.product(range(3), ('fallback', 'compete')):
        table = _table(50 + seed)
        plain = run_plain(table, offset_B, max_lengths_B, 0.6, beam_size=K, max_decode_len=L,
                          unfinished=rule)
        none = run_beam(table, offset_B, max_lengths_B, _phrases([[]] * 4), beam_size=K,
                        max_decode_len=L, unfinished=rule)
        some = run_beam(table, offset_B, max_lengths_B, mixed, beam_size=K, max_decode_len=L,
                        unfinished=rule)
        for got in (none, some):
            rows = [0, 2] if got is some else [0, 1, 2, 3]
            np.testing.assert_array_equal(np.asarray(got[0])[rows], np.asarray(plain[0])[rows])
            np.testing.assert_array_equal(np.asarray(got[1])[rows], np.asarray(plain[1])[rows])
        # The constrained rows did change: the test would notice a search that ignores them.
        assert not np.array_equal(np.asarray(some[0])[[1, 3]], np.asarray(plain[0])[[1, 3]])


def test_narrow_beam_puts_every_phrase_in_every_output_that_has_room():
    # 32 random models, beam 2, two phrases each (up to 5 tokens + EOS in limits of 8-10): every
    # best hypothesis ends in EOS and holds both; compaction to quarters changes nothing.
    L, K, B = 10, 2, 32
    rng = np.random.default_rng(0)
    per_example = [[list(rng.integers(2, V, rng.integers(1, 4))) for _ in range(2)]
                   for _ in range(B)]
    limits = rng.integers(8, L + 1, B)
    offset_B = jnp.arange(B, dtype=jnp.int32)
    args = (_table(60), offset_B, jnp.asarray(limits, jnp.int32), _phrases(per_example))
    seqs_BKL, scores_BK = run_beam(*args, beam_size=K, max_decode_len=L)
    for b in range(B):
        seq = _trim(seqs_BKL[b, 0], int(limits[b]))
        assert seq[-1] == EOS, (b, seq)
        for phrase in per_example[b]:
            assert _contains(seq, phrase), (b, phrase, seq)
    assert np.all(np.asarray(constraints.contains_all(seqs_BKL[:, 0], args[3])))
    staged = run_beam(*args, beam_size=K, max_decode_len=L, shrink_to=(8, 2))
    np.testing.assert_array_equal(staged[0], seqs_BKL)
    np.testing.assert_allclose(staged[1], scores_BK, rtol=1e-6)


@pytest.mark.parametrize('phrase', [[2, 2, 3], [2, 3, 2, 3, 4], [3, 3], [4]])
def test_the_matcher_finds_a_phrase_exactly_where_it_occurs(phrase):
    # Every sequence of up to 6 tokens over {2, 3, 4}, fed one token at a time: the phrase is
    # done exactly when it occurs in the prefix (a broken match falls back to its border, so
    # [2, 2, 3] is found in [2, 2, 2, 3]), and the bank never exceeds the phrase's length.
    seqs = [list(s) for n in range(1, 7) for s in itertools.product((2, 3, 4), repeat=n)]
    B, T = len(seqs), 6
    tokens_BT = np.zeros((B, T), np.int32)
    for b, s in enumerate(seqs):
        tokens_BT[b, :len(s)] = s
    state = Constraints(_phrases([[phrase]] * B, C=1, P=5)).start(beam_size=1)
    parent_B1 = jnp.zeros((B, 1), jnp.int32)
    done_BT = np.zeros((B, T), bool)
    advance = jax.jit(constraints.advance)
    for t in range(T):
        progress_B1C, done_B1C, met_B1 = advance(state, parent_B1, tokens_BT[:, t:t + 1])
        state = state.replace(progress_BKC=progress_B1C, done_BKC=done_B1C)
        done_BT[:, t] = np.asarray(done_B1C[:, 0, 0])
        assert np.all(np.asarray(met_B1) <= len(phrase))
    for b, s in enumerate(seqs):
        for t in range(len(s)):
            assert done_BT[b, t] == _contains(s[:t + 1], phrase), (s[:t + 1], phrase)
    found = constraints.contains_all(tokens_BT, _phrases([[phrase]] * B, C=1, P=5))
    np.testing.assert_array_equal(np.asarray(found), [_contains(s, phrase) for s in seqs])


def test_allocation_takes_the_banks_round_robin_furthest_first():
    # Candidates (score, bank): bank 2 has one, bank 1 three, bank 0 two; one has ended.
    log_probs = jnp.array([[-1.0, -2.0, -0.5, -3.0, -0.1, -4.0, -0.2]])
    met = jnp.array([[0, 1, 1, 2, 0, 1, 1]])
    eligible = jnp.array([[True, True, True, True, True, True, False]])
    pos_BK, log_probs_BK = constraints.allocate(log_probs, eligible, met, 5, banks=3)
    # Round 1: bank 2's best (3), bank 1's best (2), bank 0's best (4); round 2: bank 1's
    # second (1), bank 0's second (0).
    np.testing.assert_array_equal(pos_BK, [[3, 2, 4, 1, 0]])
    np.testing.assert_array_equal(log_probs_BK, log_probs[:, [3, 2, 4, 1, 0]])
    pos_BK, log_probs_BK = constraints.allocate(log_probs, eligible, met, 7, banks=3)
    assert list(np.asarray(log_probs_BK[0, -1:])) == [-np.inf]  # only 6 are eligible


def test_bad_constraint_shape_is_an_error():
    def search(phrases):
        decode.beam_search(lambda ids, c, _: (jnp.zeros((ids.shape[0], V)), c), {},
                           batch_size=3, beam_size=2, alpha=0.6, eos_id=EOS, max_decode_len=4,
                           constraints=Constraints(phrases))

    with pytest.raises(ValueError, match=r'constraints have shape \(3, 2\)'):
        search(jnp.zeros((3, 2), jnp.int32))
    with pytest.raises(ValueError, match=r'leading dim batch_size=3'):
        search(jnp.zeros((2, 2, 2), jnp.int32))
