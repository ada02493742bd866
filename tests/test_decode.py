"""Beam search and greedy against exhaustive search on a tiny hand-built model.

The model: logits = table[h] where h hashes the whole token history (BOS 0, then the generated
tokens) kept in the decode cache, plus a per-example offset. A wrong cache tile or gather changes
the history and so the logits, and the result no longer matches exhaustive search over the true
prefixes. The cache also holds a scalar position, which must be left alone.

Shape letters: B batch, K beam, N = B * K rows, L max_decode_len, T = L + 1, V vocab, R table rows.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t import decode

V = 5
EOS = 1
R = 101  # hash buckets; collisions are harmless since the reference uses the same hash


def _hash(history, offset):
    """Bucket of a token history (BOS first); numpy ints or jax arrays."""
    return (sum((int(t) + 1) * 7**j for j, t in enumerate(history)) + 13 * int(offset)) % R


def init_cache(offset_B, max_decode_len):
    B = offset_B.shape[0]
    return {
        'index': jnp.array(0, jnp.int32),  # scalar, shared by all rows
        'history_BT': jnp.zeros((B, max_decode_len + 1), jnp.int32),
        'offset_B': offset_B,
    }


def tokens_to_logits(table_RV, ids_N1, cache, constants):
    del constants  # the toy model reads none
    index = cache['index']
    history_NT = cache['history_BT'].at[:, index].set(ids_N1[:, 0])
    pos_T = jnp.arange(history_NT.shape[1])
    weights_T = jnp.where(pos_T <= index, 7**pos_T, 0)
    h_N = (jnp.sum((history_NT + 1) * weights_T, axis=1) + 13 * cache['offset_B']) % R
    new_cache = {'index': index + 1, 'history_BT': history_NT, 'offset_B': cache['offset_B']}
    return table_RV[h_N], new_cache


@functools.partial(jax.jit, static_argnames=('beam_size', 'max_decode_len', 'unfinished', 'stop'))
def run_beam(table_RV, offset_B, max_lengths_B, alpha, *, beam_size, max_decode_len,
             unfinished='fallback', stop='bound'):
    return decode.beam_search(
        functools.partial(tokens_to_logits, table_RV),
        init_cache(offset_B, max_decode_len),
        batch_size=offset_B.shape[0],
        beam_size=beam_size,
        alpha=alpha,
        eos_id=EOS,
        max_decode_len=max_decode_len,
        max_lengths=max_lengths_B,
        unfinished=unfinished,
        stop=stop,
    )


@functools.partial(jax.jit, static_argnames=('max_decode_len',))
def run_greedy(table_RV, offset_B, max_lengths_B, *, max_decode_len):
    return decode.greedy_search(
        functools.partial(tokens_to_logits, table_RV),
        init_cache(offset_B, max_decode_len),
        batch_size=offset_B.shape[0],
        eos_id=EOS,
        max_decode_len=max_decode_len,
        max_lengths=max_lengths_B,
    )


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _pen(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def exhaustive(table, offset, limit, alpha, unfinished='compete'):
    """All finished hypotheses (PAD is never generated), best first: [(score, tokens)].

    'compete': those ended by EOS and those cut at `limit`. 'fallback' (tensor2tensor): those
    ended by EOS, or the cut ones only when none ended by EOS."""
    table = np.asarray(table)
    results = []

    def expand(prefix, log_prob):
        log_probs_V = _log_softmax(table[_hash([0] + prefix, offset)])
        for v in range(1, V):
            seq, lp = prefix + [v], log_prob + log_probs_V[v]
            if v == EOS or len(seq) == limit:
                results.append((lp / _pen(len(seq), alpha), seq))
            else:
                expand(seq, lp)

    expand([], 0.0)
    if unfinished == 'fallback' and any(seq[-1] == EOS for _, seq in results):
        results = [(score, seq) for score, seq in results if seq[-1] == EOS]
    return sorted(results, key=lambda r: -r[0])


def reference_greedy(table, offset, limit):
    table, seq = np.asarray(table), []
    while len(seq) < limit and (not seq or seq[-1] != EOS):
        seq.append(1 + int(np.argmax(table[_hash([0] + seq, offset)][1:])))  # never PAD
    return seq


def score_of(table, offset, seq, alpha):
    table = np.asarray(table)
    lp = sum(_log_softmax(table[_hash([0] + seq[:j], offset)])[t] for j, t in enumerate(seq))
    return lp / _pen(len(seq), alpha)


def _pad(seq, length):
    return seq + [0] * (length - len(seq))


def _trim(row, limit):
    """Generated tokens of one returned row: up to EOS, else the first `limit` positions."""
    row = [int(t) for t in row[:limit]]
    return row[: row.index(EOS) + 1] if EOS in row else row


def _table(seed):
    return jax.random.normal(jax.random.PRNGKey(seed), (R, V), jnp.float32) * 2.0


@pytest.mark.parametrize('length', [1, 2, 5, 50])
@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.0])
def test_length_penalty_is_gnmt_formula(length, alpha):
    expected = ((5.0 + length) / 6.0) ** alpha
    np.testing.assert_allclose(decode.length_penalty(length, alpha), expected, rtol=1e-6)


@pytest.mark.parametrize('unfinished', ['fallback', 'compete'])
def test_wide_beam_equals_exhaustive_search_per_example_limits(unfinished):
    # K = 64 > (V - 2) ** 3 keeps every unfinished prefix (no EOS, no PAD) alive up to length 4,
    # so beam search is exact. Example 1 (limit 2) has only 1 + 3 * 4 = 13 hypotheses ('compete';
    # 4 ending in EOS, 'fallback'): the rest stay -inf.
    L, K = 4, 64
    table = _table(0)
    offset_B = jnp.array([0, 1, 2], jnp.int32)
    limits = [4, 2, 3]
    for alpha in [0.0, 0.6, -0.5]:
        seqs_BKL, scores_BK = run_beam(
            table, offset_B, jnp.array(limits, jnp.int32), alpha, beam_size=K, max_decode_len=L,
            unfinished=unfinished,
        )
        seqs_BKL, scores_BK = np.asarray(seqs_BKL), np.asarray(scores_BK)
        assert seqs_BKL.shape == (3, K, L) and scores_BK.shape == (3, K)
        for b, limit in enumerate(limits):
            expected = exhaustive(table, int(offset_B[b]), limit, alpha, unfinished)[:K]
            n = len(expected)
            np.testing.assert_allclose(
                scores_BK[b, :n], [s for s, _ in expected], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_array_equal(seqs_BKL[b, :n], [_pad(q, L) for _, q in expected])
            assert np.all(scores_BK[b, n:] == -np.inf)
            assert np.all(seqs_BKL[b, :, limit:] == 0)  # nothing past the example's limit


def test_the_two_rules_each_match_their_exhaustive_search_and_differ():
    # Eight random models (the offset changes every logit) with limits 2..4, a beam wide enough
    # to be exact: each rule's best hypothesis is its own exhaustive search's, and on some
    # models a hypothesis cut at the limit beats every EOS one, so the rules disagree.
    L, K, alpha = 4, 64, 0.6
    table = _table(7)
    offset_B = jnp.arange(8, dtype=jnp.int32)
    limits = [2, 3, 4, 2, 3, 4, 3, 4]
    best = {}
    for rule in ('fallback', 'compete'):
        seqs_BKL, scores_BK = run_beam(table, offset_B, jnp.array(limits, jnp.int32), alpha,
                                       beam_size=K, max_decode_len=L, unfinished=rule)
        best[rule] = []
        for b, limit in enumerate(limits):
            score, seq = exhaustive(table, b, limit, alpha, rule)[0]
            np.testing.assert_array_equal(seqs_BKL[b, 0], _pad(seq, L))
            np.testing.assert_allclose(scores_BK[b, 0], score, rtol=1e-5, atol=1e-5)
            best[rule].append(seq)
    differ = [b for b in range(8) if best['fallback'][b] != best['compete'][b]]
    assert differ, 'no model where the rules disagree: the test checks nothing'
    for b in differ:  # where they disagree, 'compete' chose a cut hypothesis
        assert best['fallback'][b][-1] == EOS and best['compete'][b][-1] != EOS


def test_cache_history_matches_returned_sequences():
    # Logits depend only on the cached history, so each returned hypothesis' score must equal
    # the score recomputed from its own tokens; a mis-gathered cache would break this.
    L, K = 5, 3
    table = _table(1)
    offset_B = jnp.array([3, 4], jnp.int32)
    seqs_BKL, scores_BK = run_beam(
        table, offset_B, jnp.array([L, L], jnp.int32), 0.6, beam_size=K, max_decode_len=L
    )
    for b, k in itertools.product(range(2), range(K)):
        seq = _trim(seqs_BKL[b, k], L)
        expected = score_of(table, int(offset_B[b]), seq, 0.6)
        np.testing.assert_allclose(scores_BK[b, k], expected, rtol=1e-5)
    assert np.all(np.diff(np.asarray(scores_BK), axis=1) <= 0)  # best first


def test_greedy_matches_reference_per_example_limits():
    L = 6
    offset_B = jnp.array([0, 5, 7, 9], jnp.int32)
    limits = [6, 1, 3, 6]
    for seed in range(3):
        table = _table(10 + seed)
        seqs_BL = np.asarray(
            run_greedy(table, offset_B, jnp.array(limits, jnp.int32), max_decode_len=L)
        )
        for b, limit in enumerate(limits):
            expected = reference_greedy(table, int(offset_B[b]), limit)
            np.testing.assert_array_equal(seqs_BL[b], _pad(expected, L))


def test_beam_one_equals_greedy():
    # Beam 1 keeps the greedy path alive, but also keeps an EOS hypothesis that ranked second
    # at some step, which may outscore greedy's own. With EOS never second (always the best or
    # the worst token), the two coincide exactly.
    L = 6
    offset_B = jnp.array([0, 2, 4], jnp.int32)
    max_lengths_B = jnp.array([6, 3, 5], jnp.int32)
    for seed in range(3):
        table = np.array(_table(20 + seed))
        top = np.random.default_rng(seed).random(R) < 0.25
        table[:, EOS] = np.where(top, table.max(1) + 1.0, table.min(1) - 1.0)
        table = jnp.asarray(table)
        greedy_BL = run_greedy(table, offset_B, max_lengths_B, max_decode_len=L)
        beam_BKL, scores_BK = run_beam(
            table, offset_B, max_lengths_B, 0.6, beam_size=1, max_decode_len=L
        )
        np.testing.assert_array_equal(beam_BKL[:, 0], greedy_BL)
        for b in range(3):
            seq = _trim(greedy_BL[b], int(max_lengths_B[b]))
            expected = score_of(table, int(offset_B[b]), seq, 0.6)
            np.testing.assert_allclose(scores_BK[b, 0], expected, rtol=1e-5)

    # In general beam 1 is at least as good as greedy when cut hypotheses compete ('fallback'
    # prefers any EOS hypothesis to greedy's cut one).
    table = _table(30)
    greedy_BL = run_greedy(table, offset_B, max_lengths_B, max_decode_len=L)
    _, scores_BK = run_beam(table, offset_B, max_lengths_B, 0.6, beam_size=1, max_decode_len=L,
                            unfinished='compete')
    for b in range(3):
        seq = _trim(greedy_BL[b], int(max_lengths_B[b]))
        greedy_score = score_of(table, int(offset_B[b]), seq, 0.6)
        assert scores_BK[b, 0] >= greedy_score - 1e-5


def test_no_eos_ever_returns_best_sequences_cut_at_each_limit():
    L, K = 6, 3
    table = np.array(_table(40))
    table[:, 0] = -1e9  # never PAD
    table[:, EOS] = -np.inf  # never EOS, not even improbably: so 'fallback' takes the cut ones
    table = jnp.asarray(table)
    offset_B = jnp.array([0, 1, 2], jnp.int32)
    limits = [6, 2, 4]
    max_lengths_B = jnp.array(limits, jnp.int32)
    seqs_BKL, scores_BK = run_beam(
        table, offset_B, max_lengths_B, 0.6, beam_size=K, max_decode_len=L
    )
    greedy_BL = run_greedy(table, offset_B, max_lengths_B, max_decode_len=L)
    assert np.all(np.isfinite(scores_BK))
    for b, limit in enumerate(limits):
        assert np.all(seqs_BKL[b, :, :limit] >= 2) and np.all(seqs_BKL[b, :, limit:] == 0)
        assert np.all(greedy_BL[b, :limit] >= 2) and np.all(greedy_BL[b, limit:] == 0)
        # Beam 0 is the best cut sequence: exhaustive over the non-EOS sequences of that length.
        best = max(
            itertools.product(range(2, V), repeat=limit),
            key=lambda s: score_of(table, int(offset_B[b]), list(s), 0.6),
        )
        np.testing.assert_array_equal(seqs_BKL[b, 0, :limit], best)


def _scripted_model(target_B, steps):
    """Emits token 2 + step % 3 before step target_B[b] - 1, EOS from then on (logit +50).

    The cache counts steps per row; `steps` records how often the model is called.
    """

    def tokens_to_logits(ids_N1, cache, constants):
        del ids_N1, constants
        jax.debug.callback(lambda: steps.append(1))
        count_N, target_N = cache['count'], cache['target']
        want_N = jnp.where(count_N >= target_N - 1, EOS, 2 + count_N % 3)
        logits_NV = 50.0 * jax.nn.one_hot(want_N, V)
        return logits_NV, {'count': count_N + 1, 'target': target_N}

    cache = {'count': jnp.zeros_like(target_B), 'target': target_B}
    return tokens_to_logits, cache


def test_eos_per_example_and_early_stop():
    # 'compete': example 2's scripted path, cut at its limit, beats the EOS hypotheses its
    # deviations (log-prob ~ -50) found. 'fallback' is checked below.
    L, K = 16, 2
    target_B = jnp.array([3, 1, 7, 6], jnp.int32)
    max_lengths_B = jnp.array([16, 16, 4, 16], jnp.int32)  # example 2 is cut before its EOS
    expected = [[2, 3, EOS], [EOS], [2, 3, 4, 2], [2, 3, 4, 2, 3, EOS]]

    steps = []
    tokens_to_logits, cache = _scripted_model(target_B, steps)
    beam = jax.jit(
        lambda cache, max_lengths, unfinished='compete': decode.beam_search(
            tokens_to_logits, cache, batch_size=4, beam_size=K, alpha=0.6, eos_id=EOS,
            max_decode_len=L, max_lengths=max_lengths, unfinished=unfinished,
        ),
        static_argnames='unfinished',
    )
    seqs_BKL, scores_BK = jax.block_until_ready(beam(cache, max_lengths_B))
    jax.effects_barrier()
    for b in range(4):
        np.testing.assert_array_equal(seqs_BKL[b, 0], _pad(expected[b], L))
    assert np.all(np.asarray(scores_BK[:, 0]) > -1e-3)  # the scripted path has log-prob ~0
    # Once each example has K finished hypotheses that no alive beam (log-prob ~ -50 per
    # deviation) can beat, the loop stops: example 3 needs 6 steps plus one to fill K = 2.
    assert len(steps) == 7, len(steps)

    # 'fallback': example 2 returns an EOS hypothesis, however bad; the others are unchanged.
    steps.clear()
    seqs_BKL, scores_BK = jax.block_until_ready(
        beam(cache, max_lengths_B, unfinished='fallback'))
    jax.effects_barrier()
    for b in (0, 1, 3):
        np.testing.assert_array_equal(seqs_BKL[b, 0], _pad(expected[b], L))
    np.testing.assert_array_equal(seqs_BKL[2, 0], _pad([2, 3, 4, EOS], L))  # EOS at -50
    np.testing.assert_allclose(scores_BK[2, 0], -50 / _pen(4, 0.6), rtol=1e-4)
    assert len(steps) == 7, len(steps)

    steps.clear()
    greedy = jax.jit(
        lambda cache, max_lengths: decode.greedy_search(
            tokens_to_logits, cache, batch_size=4, eos_id=EOS, max_decode_len=L,
            max_lengths=max_lengths,
        )
    )
    seqs_BL = jax.block_until_ready(greedy(cache, max_lengths_B))
    jax.effects_barrier()
    for b in range(4):
        np.testing.assert_array_equal(seqs_BL[b], _pad(expected[b], L))
    assert len(steps) == 6  # all examples have stopped after example 3's EOS


@pytest.mark.parametrize('bad, says', [
    (dict(unfinished='first'), "unfinished='first'"),
    (dict(stop='never'), "stop='never'"),
    (dict(shrink_to=(4, 4)), r'shrink_to=\(4, 4\)'),
])
def test_unknown_rule_or_bad_stages_is_an_error(bad, says):
    with pytest.raises(ValueError, match=says):
        decode.beam_search(
            lambda ids, c, _: (jnp.zeros((ids.shape[0], V)), c), {}, batch_size=8,
            beam_size=2, alpha=0.6, eos_id=EOS, max_decode_len=4, **bad,
        )


def test_cache_leaf_with_wrong_leading_dim_is_an_error():
    cache = {'keys': jnp.zeros((5, 2))}
    with pytest.raises(ValueError, match='batch_size=3'):
        decode.beam_search(
            lambda ids, c, _: (jnp.zeros((ids.shape[0], V)), c), cache, batch_size=3,
            beam_size=2, alpha=0.6, eos_id=EOS, max_decode_len=4,
        )


def test_early_stop_bound_uses_the_largest_penalty_ahead():
    # Step 0: EOS with p = 0.6, else token 2; then token 2 surely until EOS at step 4. With
    # alpha = 2 the long hypothesis wins (log 0.4 / pen(5) > log 0.6 / pen(1)), though after
    # step 0 its log-prob is below the finished one's: only a bound using the penalty at the
    # longest reachable length keeps it alive.
    logits_SV = np.full((6, V), -1e9, np.float32)
    logits_SV[0, [EOS, 2]] = np.log([0.6, 0.4])
    logits_SV[1:4, 2] = 0.0
    logits_SV[4:, EOS] = 0.0

    def tokens_to_logits(ids_N1, cache, constants):
        del ids_N1, constants
        return jnp.asarray(logits_SV)[cache['count']], {'count': cache['count'] + 1}

    beam = jax.jit(
        lambda alpha, stop='bound': decode.beam_search(
            tokens_to_logits, {'count': jnp.zeros((1,), jnp.int32)}, batch_size=1, beam_size=1,
            alpha=alpha, eos_id=EOS, max_decode_len=6, stop=stop,
        ), static_argnames='stop',
    )
    seqs_BKL, scores_BK = beam(2.0)
    np.testing.assert_array_equal(seqs_BKL[0, 0], [2, 2, 2, 2, EOS, 0])
    np.testing.assert_allclose(scores_BK[0, 0], np.log(0.4) / _pen(5, 2.0), rtol=1e-5)
    seqs_BKL, scores_BK = beam(0.0)
    np.testing.assert_array_equal(seqs_BKL[0, 0], [EOS, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(scores_BK[0, 0], np.log(0.6), rtol=1e-5)
    # 'k_finished' stops once K = 1 hypothesis has finished: at step 0, with EOS, the long
    # hypothesis that 'bound' finds (and that wins) is never seen.
    seqs_BKL, scores_BK = beam(2.0, 'k_finished')
    np.testing.assert_array_equal(seqs_BKL[0, 0], [EOS, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(scores_BK[0, 0], np.log(0.6) / _pen(1, 2.0), rtol=1e-5)


def test_k_finished_stops_once_k_hypotheses_ended():
    # The scripted model: per example, a path of log-prob ~0 ending in EOS at its target step;
    # every deviation costs ~-50. With K = 2 a deviation's EOS finishes at steps 0 and 1, so
    # 'k_finished' stops after 2 steps and returns the better deviation, [2, EOS] (-50 over the
    # penalty of 2), where the scripted path ends later; example 1's path is [EOS] itself.
    # 'bound' searches on (8 steps) and finds every scripted path.
    L, K = 16, 2
    target_B = jnp.array([3, 1, 7, 6], jnp.int32)
    results = {}
    for stop in decode.STOP_RULES:
        steps = []
        tokens_to_logits, cache = _scripted_model(target_B, steps)
        seqs_BKL, scores_BK = jax.block_until_ready(jax.jit(functools.partial(
            decode.beam_search, tokens_to_logits, cache, batch_size=4, beam_size=K, alpha=0.6,
            eos_id=EOS, max_decode_len=L, stop=stop))())
        jax.effects_barrier()
        results[stop] = (np.asarray(seqs_BKL[:, 0]), np.asarray(scores_BK[:, 0]), len(steps))
    seqs_BL, scores_B, steps = results['k_finished']
    assert steps == 2 and results['bound'][2] == 8
    for b, want in enumerate([[2, EOS], [EOS], [2, EOS], [2, EOS]]):
        np.testing.assert_array_equal(seqs_BL[b], _pad(want, L))
    np.testing.assert_allclose(scores_B[[0, 2, 3]], -50 / _pen(2, 0.6), rtol=1e-3)
    np.testing.assert_array_equal(results['bound'][0][2], _pad([2, 3, 4, 2, 3, 4, EOS], L))


def test_a_stopped_example_keeps_its_hypotheses_whatever_its_batch():
    # An example that has stopped stays in the batch while others search on; under
    # 'k_finished' later steps could still find better hypotheses for it, which would make its
    # answer depend on its batch. Each example of a batch returns what it returns alone.
    L, K = 8, 2
    table = _table(3)
    offset_B = jnp.arange(8, dtype=jnp.int32) * 7
    limits = jnp.array([8, 3, 8, 2, 8, 5, 8, 4], jnp.int32)
    for stop in decode.STOP_RULES:
        batch = run_beam(table, offset_B, limits, 0.6, beam_size=K, max_decode_len=L, stop=stop)
        for b in range(8):
            alone = run_beam(table, offset_B[b:b + 1], limits[b:b + 1], 0.6, beam_size=K,
                             max_decode_len=L, stop=stop)
            np.testing.assert_array_equal(batch[0][b], alone[0][0], err_msg=f'{stop} {b}')
            np.testing.assert_array_equal(batch[1][b], alone[1][0], err_msg=f'{stop} {b}')


def test_compaction_returns_the_one_stage_search_and_feeds_fewer_rows():
    # Twelve examples whose limits (0 to 9) end their searches at different steps; the offset
    # is a constant (never reordered by beam, only compacted with its example). Compacting to
    # 6, 3, 1 examples returns exactly the one-stage hypotheses and scores, which are those of
    # exhaustive search where the beam is wide enough; the model is fed far fewer rows.
    L, K = 9, 3
    table = _table(11)
    offset_B = jnp.arange(12, dtype=jnp.int32) * 5
    limits = jnp.array([3, 9, 1, 0, 5, 2, 9, 4, 1, 7, 2, 6], jnp.int32)
    rows_fed = []

    def with_constant_offset(ids_N1, cache, constants):
        jax.debug.callback(lambda n: rows_fed.append(int(n)), ids_N1.shape[0])
        logits_NV, new_cache = tokens_to_logits(
            table, ids_N1, {**cache, 'offset_B': constants['offset_B']}, None)
        return logits_NV, {k: v for k, v in new_cache.items() if k != 'offset_B'}

    cache = {k: v for k, v in init_cache(offset_B, L).items() if k != 'offset_B'}
    results, fed = {}, {}
    for shrink_to in [(), (6, 3, 1)]:
        rows_fed.clear()
        search = functools.partial(
            decode.beam_search, with_constant_offset, cache, batch_size=12, beam_size=K,
            alpha=0.6, eos_id=EOS, max_decode_len=L, max_lengths=limits,
            constants={'offset_B': offset_B}, shrink_to=shrink_to)
        results[shrink_to] = jax.block_until_ready(jax.jit(search)())
        jax.effects_barrier()
        fed[shrink_to] = sum(rows_fed)
    (seqs_BKL, scores_BK), (small_seqs, small_scores) = results[()], results[(6, 3, 1)]
    np.testing.assert_array_equal(small_seqs, seqs_BKL)
    np.testing.assert_array_equal(small_scores, scores_BK)
    assert fed[(6, 3, 1)] < 0.6 * fed[()], fed
    np.testing.assert_array_equal(seqs_BKL[3], 0)  # limit 0: nothing decoded
    assert np.all(np.asarray(scores_BK[3]) == -np.inf)
    for b in [2, 5, 8, 10]:  # limits 1, 2: K = 3 keeps all 3 unfinished prefixes, exact
        score, seq = exhaustive(table, int(offset_B[b]), int(limits[b]), 0.6, 'fallback')[0]
        np.testing.assert_array_equal(seqs_BKL[b, 0], _pad(seq, L))
        np.testing.assert_allclose(scores_BK[b, 0], score, rtol=1e-5, atol=1e-5)


def test_a_growing_cache_returns_the_one_stage_search():
    # The toy model's history buffer starts 3 positions long: the whole batch runs 3 steps with
    # it, then it is padded to L (and the batch compacted as examples end). Same hypotheses and
    # scores as with the whole buffer from the start; the short buffer was really used.
    L, K = 9, 3
    table = _table(5)
    offset_B = jnp.arange(6, dtype=jnp.int32) * 3
    limits = jnp.array([9, 2, 7, 4, 9, 1], jnp.int32)
    lengths_seen = set()

    def model(ids_N1, cache, constants):
        lengths_seen.add(cache['history_BT'].shape[1])
        return tokens_to_logits(table, ids_N1, cache, constants)

    def grow(cache, length):
        history = cache['history_BT']
        return {**cache, 'history_BT': jnp.pad(history, ((0, 0), (0, length - history.shape[1])))}

    full = init_cache(offset_B, L)
    short = {**full, 'history_BT': full['history_BT'][:, :3]}
    runs, seen = {}, {}
    for name, cache, kwargs in [('one', full, {}),
                                ('grown', short, dict(cache_lengths=(3,), grow_cache=grow,
                                                      shrink_to=(3,)))]:
        runs[name] = jax.jit(functools.partial(
            decode.beam_search, model, cache, batch_size=6, beam_size=K, alpha=0.6, eos_id=EOS,
            max_decode_len=L, max_lengths=limits, **kwargs))()
        seen[name] = set(lengths_seen)
        lengths_seen.clear()
    np.testing.assert_array_equal(runs['grown'][0], runs['one'][0])
    np.testing.assert_array_equal(runs['grown'][1], runs['one'][1])
    assert seen == {'one': {L + 1}, 'grown': {3, L}}, seen  # grown to max_decode_len
    with pytest.raises(ValueError, match=r'cache_lengths=\(4, 2\)'):
        decode.beam_search(model, short, batch_size=6, beam_size=K, alpha=0.6, eos_id=EOS,
                           max_decode_len=L, cache_lengths=(4, 2), grow_cache=grow)
