"""predict agrees with full-forward rollouts, respects per-example limits, and keeps order."""

import dataclasses
import importlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from configs import tiny
from t2t import decode, sharding
from t2t.data.pipeline import EvalSplit
from t2t.decode import DecodeConfig
from t2t.eval import predict as predict_lib
from t2t.eval import translate
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import Transformer, TransformerConfig
from tests.helpers import source_rows

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

CFG = TransformerConfig(vocab_size=48, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                        num_decoder_layers=2, max_position=64, deterministic=True)
# One decode setting for every compiled test, so the cached predict functions are shared.
BEAM = DecodeConfig(beam_size=1, length_penalty_alpha=0.6, max_decode_len=10,
                    max_decode_extra=3)
GREEDY = BEAM.replace(decode_strategy='greedy')
SRC_LENS = (8, 2, 5, 3)  # EOS included; bucket 8; the first one's limit 8 + 3 is capped at 10


def _init_boxed(rng):
    ids = jnp.ones((1, 8), jnp.int32)
    return Transformer(CFG).init(rng, ids, ids)['params']


@jax.jit
def _forward(params, inputs_BS, targets_BT):
    return Transformer(CFG).apply({'params': params}, inputs_BS, targets_BT)


def _suppress(params, tokens):
    """A model that never predicts `tokens`: their logits are -d_model, the others near 0.

    The final post-LN output y has sum(y) = 0 plus D * bias; with bias 1 and a row of -1s the
    token's logit is -D whatever y is.
    """
    last = f'decoder_{CFG.num_decoder_layers - 1}'
    params = jax.tree.map(lambda x: x, params)
    norm = params[last]['ffn_block']['norm']
    norm['bias'] = jnp.ones_like(norm['bias'])
    params['embedder']['embedding'] = params['embedder']['embedding'].at[np.array(tokens)].set(-1.0)
    return params


@pytest.fixture(scope='module')
def params():
    return nn.unbox(jax.jit(_init_boxed)(jax.random.key(0)))


@pytest.fixture(scope='module')
def inputs_BS():
    return source_rows(SRC_LENS, 8, CFG.vocab_size, seed=1)


def _scores(params, inputs_BS, ids_BL, alpha):
    """sum log p(token) up to and including EOS (or the end) / length penalty, per row."""
    log_probs_BLV = jax.nn.log_softmax(_forward(params, inputs_BS, ids_BL))
    token_lp_BL = np.take_along_axis(np.asarray(log_probs_BLV), ids_BL[..., None], -1)[..., 0]
    scores = []
    for row, ids in enumerate(ids_BL.tolist()):
        n = ids.index(EOS_ID) + 1 if EOS_ID in ids else len([i for i in ids if i != PAD_ID])
        scores.append(token_lp_BL[row, :n].sum() / float(decode.length_penalty(n, alpha)))
    return np.array(scores)


def _limits():
    return [min(n + BEAM.max_decode_extra, BEAM.max_decode_len) for n in SRC_LENS]


def test_greedy_equals_argmax_rollout_of_full_forward_passes(params, inputs_BS):
    params = _suppress(params, [PAD_ID])  # a PAD mid-sentence would be masked by teacher forcing
    predict = predict_lib.make_predict_fn(CFG, GREEDY)
    got = jax.device_get(predict(params, inputs_BS))

    B, L = inputs_BS.shape[0], GREEDY.max_decode_len
    want_BL = np.zeros((B, L), np.int32)
    done_B = np.zeros(B, bool)
    for t in range(L):
        # Position t of a causal full forward pass predicts token t from tokens < t; the 2s after
        # them are non-pad fillers, so every shape (and compile) is the same.
        targets_BT = np.concatenate([want_BL[:, :t], np.full((B, L - t), 2, np.int32)], axis=1)
        next_B = np.asarray(jnp.argmax(_forward(params, inputs_BS, targets_BT)[:, t], -1))
        live_B = ~done_B & (t < np.array(_limits()))
        want_BL[live_B, t] = next_B[live_B]
        done_B |= live_B & (next_B == EOS_ID)
    np.testing.assert_array_equal(got.ids_BL, want_BL)
    np.testing.assert_array_equal(got.hit_limit_B, ~(want_BL == EOS_ID).any(1))


def test_beam_of_one_scores_at_least_greedy(params, inputs_BS):
    params = _suppress(params, [PAD_ID])
    greedy = predict_lib.make_predict_fn(CFG, GREEDY)
    beam = predict_lib.make_predict_fn(CFG, BEAM)
    greedy_ids = np.asarray(greedy(params, inputs_BS).ids_BL)
    beam_ids = np.asarray(beam(params, inputs_BS).ids_BL)
    alpha = BEAM.length_penalty_alpha
    beam_scores = _scores(params, inputs_BS, beam_ids, alpha)
    greedy_scores = _scores(params, inputs_BS, greedy_ids, alpha)
    assert np.all(beam_scores >= greedy_scores - 1e-4), (beam_scores, greedy_scores)


@pytest.mark.parametrize('greedy', [True, False])
def test_each_example_stops_at_source_length_plus_extra(params, inputs_BS, greedy):
    params = _suppress(params, [PAD_ID, EOS_ID])  # never ends by itself: every limit is reached
    predict = predict_lib.make_predict_fn(CFG, GREEDY if greedy else BEAM)
    got = jax.device_get(predict(params, inputs_BS))
    lengths = (got.ids_BL != PAD_ID).sum(1)
    np.testing.assert_array_equal(lengths, _limits())
    assert got.hit_limit_B.all()
    # Only the first example wanted more than max_decode_len (8 + 3 > 10).
    np.testing.assert_array_equal(got.capped_B, [True, False, False, False])


def test_compaction_short_cache_and_padding_rows_decode_like_one_plain_search(
        params, inputs_BS, monkeypatch):
    # Real rows interleaved with empty (padding) ones, EOS never emitted, limits of source + 32
    # tokens (at most 40): the search decodes nothing for padding, drops the others from the
    # batch as they reach their limits (compacting it to 2 rows), and every search outgrows its
    # first cache (the bucket's 8 + 8 positions) and runs on after it grew to 40. Hypotheses,
    # scores and flags are those of one stage with the whole buffer from the start.
    params = _suppress(params, [PAD_ID, EOS_ID])
    padded_BS = np.zeros((8, inputs_BS.shape[1]), np.int32)
    padded_BS[::2] = inputs_BS
    plain_search = BEAM.replace(max_decode_len=40, max_decode_extra=32, beam_size=2)
    staged = jax.device_get(predict_lib.make_predict_fn(
        CFG, plain_search.replace(beam_shrink_floor=1))(params, padded_BS))
    monkeypatch.setattr(predict_lib, 'SHORT_CACHE_OVER_SOURCE', 100)  # no short cache
    plain = jax.device_get(predict_lib.make_predict_fn(CFG, plain_search)(params, padded_BS))
    np.testing.assert_array_equal(staged.ids_BL, plain.ids_BL)
    np.testing.assert_allclose(staged.score_B, plain.score_B, rtol=1e-5)
    np.testing.assert_array_equal(staged.hit_limit_B, plain.hit_limit_B)
    lengths = (plain.ids_BL != PAD_ID).sum(1)
    np.testing.assert_array_equal(lengths[::2], [min(n + 32, 40) for n in SRC_LENS])
    np.testing.assert_array_equal(lengths[1::2], 0)  # padding: nothing decoded, not flagged
    assert plain.hit_limit_B[::2].all() and not plain.hit_limit_B[1::2].any()
    assert np.all(np.isfinite(plain.score_B[::2])) and np.all(plain.score_B[1::2] == -np.inf)
    ladder = predict_lib.shrink_ladder
    assert ladder(512, 8) == (128, 32, 8) and ladder(8, 1) == (2,)
    assert ladder(8, 0) == () and ladder(6, 1) == ()


def test_config_decoding_keys_reach_the_predict_function(monkeypatch):
    config = tiny.get_config()
    config.update(beam_stop='k_finished', beam_shrink_floor=2, beam_unfinished='compete')
    seen = []
    monkeypatch.setattr(predict_lib, 'make_predict_fn',
                        lambda cfg, decoding, **kwargs: seen.append((decoding, kwargs)))
    predict_lib.config_predict_fn(config, CFG, num_valid_ids=48)
    (decoding, kwargs), = seen
    assert decoding == DecodeConfig.from_config(config)
    assert decoding.beam_stop == 'k_finished' and decoding.beam_shrink_floor == 2
    assert decoding.beam_unfinished == 'compete' and decoding.beam_size == config.beam_size
    assert kwargs == {'num_valid_ids': 48, 'mesh': None}


def _decoding_block_keys() -> list[str]:
    """The keys configs/common.py's base_config sets under its '# --- decoding' heading."""
    text = (Path(__file__).resolve().parents[1] / 'configs' / 'common.py').read_text()
    block = text.split('# --- decoding\n', 1)[1].split('# ---', 1)[0]
    return re.findall(r'^    c\.(\w+) =', block, re.M)


@pytest.mark.parametrize('name', ['wmt14_ende_base', 'wmt14_ende_big', 'wmt14_enfr_big'])
def test_decode_config_holds_every_decoding_key_of_the_paper_configs(name):
    config = importlib.import_module(f'configs.{name}').get_config()
    decoding = DecodeConfig.from_config(config)
    keys = _decoding_block_keys()
    assert {'decode_strategy', 'beam_size', 'top_p', 'max_decode_len'} <= set(keys)  # parsed
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    # a new decoding key is a field, and back; nbest and num_samples are set by evaluate.py's
    # flags (--nbest, --mbr_samples), not by the config
    assert fields == {*keys, 'nbest', 'eos_id', 'num_samples'}
    assert {key: getattr(decoding, key) for key in keys} == {key: config[key] for key in keys}
    assert decoding.nbest == 1 and decoding.num_samples == 1 and decoding.eos_id == EOS_ID
    assert (decoding.beam_size, decoding.length_penalty_alpha, decoding.max_decode_extra) == (
        4, 0.6, 50)  # the paper's decoding
    assert predict_lib.describe(decoding) == 'beam 4, alpha 0.6'
    hash(decoding)  # make_predict_fn's cache key


def test_sharded_params_decode_like_unsharded(inputs_BS):
    mesh = sharding.make_mesh((2, 2, 2))
    sharded, _ = sharding.init_sharded(_init_boxed, mesh, jax.random.key(0))
    assert len(sharded['embedder']['embedding'].sharding.device_set) == 8
    host = jax.device_get(sharded)
    predict = predict_lib.make_predict_fn(CFG, GREEDY)
    np.testing.assert_array_equal(predict(sharded, inputs_BS).ids_BL,
                                  predict(host, inputs_BS).ids_BL)


class _EchoTokenizer:
    """Text '3 4 5' <-> ids [3, 4, 5]; decode stops at EOS like the real tokenizer."""

    def encode(self, text):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        ids = list(ids)
        ids = ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids
        return ' '.join(str(i) for i in ids if i != PAD_ID)


def _echo_predict(params, inputs_BS):
    """Copies the source: hypothesis i is the source of example i, so order is checkable."""
    ids_BL = np.asarray(inputs_BS)
    return predict_lib.Prediction(ids_BL=ids_BL, hit_limit_B=ids_BL[:, 0] == 7,
                                  capped_B=np.zeros(len(ids_BL), bool))


def test_translate_batches_keeps_the_original_order():
    rng = np.random.default_rng(2)
    texts = [' '.join(str(w) for w in rng.integers(8, 40, n)) for n in rng.integers(1, 30, 37)]
    texts[5] = '7 8 9'
    tok = _EchoTokenizer()
    ids = [tok.encode(t) + [EOS_ID] for t in texts]
    split = EvalSplit(name='echo', sources=texts, references=texts, inputs=ids, targets=ids,
                      skipped=(), read_skipped={}, max_len=64)
    batches = list(split.batches(4))
    assert len({b['inputs'].shape[1] for b in batches}) > 1  # bucketing did reorder
    order = np.concatenate([b['index'] for b in batches])
    assert sorted(order[order >= 0].tolist()) == list(range(len(texts)))
    assert order[order >= 0].tolist() != list(range(len(texts)))

    result = translate.translate_batches(_echo_predict, None, iter(batches), tok, len(texts),
                                         progress=False)
    assert result.hypotheses == texts
    assert result.hit_limit == [5] and result.capped == []

