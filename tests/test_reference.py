"""t2t's Transformer against an independent float64 NumPy reference of the paper's equations
(tests/reference_np.py), fed t2t's own parameters: teacher-forced logits on padded and packed
rows for each architecture switch, and beam search against exhaustive search.

Every parameter is replaced by random values first (LayerNorm gains and every bias included:
their initial ones and zeros would hide a missing gain or bias). The t2t configs come from
ConfigDicts through TransformerConfig.from_config, the boundary train.py uses, so a setting that
never reaches the model fails here.

Tolerance: float32 rounds each operation to 2^-24 relative; the logits here are O(10) and come
out of about 40 dependent roundings (2 layers x (3 projections, softmax, LayerNorm, FFN) +
output), so t2t's float32 error is a few 1e-6 at most (measured: under 4e-6), while each of the
breaks in scripts/mutants.py moves some logit by far more than 1e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t.decode import DecodeConfig
from t2t.eval import predict as predict_lib
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import Transformer, TransformerConfig, batch_forward_args
from tests import reference_np as ref_np
from tests.helpers import tiny_config

ATOL = 1e-5
# With attention biases: the reference then checks every parameter the model can have.
MODEL = dict(vocab_size=23, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=2,
             num_decoder_layers=2, max_position=32, dropout_rate=0.0, attention_bias=True)
S, T = 8, 8


def model_config(**overrides) -> TransformerConfig:
    return TransformerConfig.from_config(tiny_config(**{**MODEL, **overrides}),
                                         deterministic=True)


def random_params(cfg: TransformerConfig, seed: int):
    """Every leaf of a fresh init replaced by random values of a sensible scale."""
    ids = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(lambda: nn.unbox(Transformer(cfg).init(jax.random.key(0), ids,
                                                                   ids)['params']))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):  # LayerNorm gain
            return 1.0 + 0.2 * rng.standard_normal(leaf.shape).astype(np.float32)
        std = 0.3 if leaf.ndim > 1 else 0.2  # kernels, embeddings / biases
        return (std * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def spec_of(cfg: TransformerConfig) -> ref_np.Spec:
    return ref_np.Spec(num_heads=cfg.num_heads, pre_ln=cfg.pre_ln,
                       positions=cfg.position_embedding, scale_embeddings=cfg.scale_embeddings,
                       scale_attention=cfg.scale_attention, epsilon=cfg.layer_norm_epsilon)


def reference(params, cfg):
    return ref_np.from_params(params, cfg.num_encoder_layers, cfg.num_decoder_layers)


# Rows of (source, target) pairs: one padded pair, two packed pairs, one full-length pair.
def _pairs(seed):
    rng = np.random.default_rng(seed)

    def seq(n):
        return [int(x) for x in rng.integers(2, MODEL['vocab_size'], n - 1)] + [EOS_ID]

    return [[(seq(5), seq(4))], [(seq(3), seq(4)), (seq(4), seq(3))], [(seq(S), seq(T))]]


def pack(rows):
    """The batch dict of rows of pairs: ids, 1-based segment ids, positions restarting."""
    out = {k: np.zeros((len(rows), n), np.int32) for k, n in (
        ('inputs', S), ('targets', T), ('inputs_segment_ids', S), ('targets_segment_ids', T),
        ('inputs_positions', S), ('targets_positions', T))}
    for r, pairs in enumerate(rows):
        at = {'inputs': 0, 'targets': 0}
        for seg, pair in enumerate(pairs, 1):
            for side, ids in zip(('inputs', 'targets'), pair, strict=True):
                a, n = at[side], len(ids)
                out[side][r, a:a + n] = ids
                out[f'{side}_segment_ids'][r, a:a + n] = seg
                out[f'{side}_positions'][r, a:a + n] = np.arange(n)
                at[side] += n
    return out


@functools.cache
def _forward_fn(cfg: TransformerConfig):
    model = Transformer(cfg)
    return jax.jit(lambda params, batch: model.apply({'params': params},
                                                     **batch_forward_args(batch)))


def forward(params, batch, cfg):
    return np.asarray(_forward_fn(cfg)(params, batch))


def compare(got_BTV, rows, params, cfg):
    """Each pair's logits in the batch against the reference run on that pair alone."""
    ref = reference(params, cfg)
    spec = spec_of(cfg)
    worst = 0.0
    for r, pairs in enumerate(rows):
        at = 0
        for source, target in pairs:
            want = ref_np.logits(ref, source, target, spec)
            got = got_BTV[r, at:at + len(target)]
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0,
                                       err_msg=f'row {r}, target positions {at}..')
            worst = max(worst, float(np.abs(got - want).max()))
            at += len(target)
    return worst


VARIANTS = {  # together: post-/pre-LN, sinusoidal/learned/no positions, scaled or not, (un)tied,
    # the token table read through t2t/tables.py or as jnp.take(E, ids) and y @ E.T
    'paper': dict(),
    'pre_ln_learned_untied': dict(pre_ln=True, position_embedding='learned',
                                  share_embeddings=False, tie_output=False),
    'unscaled_no_positions_textbook_table': dict(scale_embeddings=False, scale_attention=False,
                                                 position_embedding='none', table_copies=False),
}


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_logits_equal_the_papers_equations_on_padded_and_packed_rows(variant):
    cfg = model_config(**VARIANTS[variant])
    params = random_params(cfg, seed=len(variant))
    rows = _pairs(seed=1)
    batch = pack(rows)
    compare(forward(params, batch, cfg), rows, params, cfg)
    if variant == 'paper':
        # Unpacked rows without segment ids (the evaluation path): one pair a row, padded.
        single = [[p] for pairs in rows for p in pairs]
        plain = {k: v for k, v in pack(single).items() if k in ('inputs', 'targets')}
        compare(forward(params, plain, cfg), single, params, cfg)


def test_logits_without_attention_biases():
    # The default (attention_bias=False): no bias parameters, the reference with none at all.
    cfg = model_config(attention_bias=False)
    params = random_params(cfg, seed=7)
    projections = [params[name][att][proj] for name in params
                   for att in ('self_attention', 'cross_attention') if att in params[name]
                   for proj in ('query', 'key', 'value', 'out')]
    assert len(projections) == 4 * (2 + 2 * 2) and all(set(p) == {'kernel'} for p in projections)
    rows = _pairs(seed=2)
    compare(forward(params, pack(rows), cfg), rows, params, cfg)


# ----------------------------------------------------------------------------------------------
# Beam search against exhaustive search, both through the model

DECODE = dict(vocab_size=8, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
              num_decoder_layers=2, max_position=16, dropout_rate=0.0, attention_bias=True)
NUM_VALID = 5  # tokens 1..4 can be generated (EOS = 1): 3 ways to continue a prefix
EXTRA, MAX_LEN = 2, 4  # limits: source length + 2, at most 4
BEAM = 3 ** (MAX_LEN - 1)  # every unfinished prefix stays alive: the search is exhaustive


def _sources(seed, rows=4):
    rng = np.random.default_rng(seed)
    inputs = np.zeros((rows, 3), np.int32)
    for r in range(rows):
        n = 1 + r % 2  # 1 or 2 tokens, EOS included: limits 3 and 4
        inputs[r, :n - 1] = rng.integers(2, DECODE['vocab_size'], n - 1)
        inputs[r, n - 1] = EOS_ID
    return inputs


def test_wide_beam_search_equals_exhaustive_search_of_the_reference():
    alpha = 0.6  # other alphas: tests/test_settings.py
    cfg = TransformerConfig.from_config(tiny_config(**DECODE))
    decoding = DecodeConfig(beam_size=BEAM, length_penalty_alpha=alpha,
                            max_decode_len=MAX_LEN, max_decode_extra=EXTRA)
    predict = predict_lib.make_predict_fn(cfg, decoding, num_valid_ids=NUM_VALID)
    spec = spec_of(cfg)
    for seed in (0, 1, 2):
        params = random_params(cfg, seed=10 + seed)
        inputs = _sources(seed)
        got = np.asarray(predict(params, inputs).ids_BL)
        ref = reference(params, cfg)
        for r, row in enumerate(inputs):
            source = [int(i) for i in row if i != PAD_ID]
            want, _ = ref_np.exhaustive_search(
                ref, source, spec, limit=min(len(source) + EXTRA, MAX_LEN), alpha=alpha,
                eos_id=EOS_ID, pad_id=PAD_ID, num_valid=NUM_VALID)
            np.testing.assert_array_equal(got[r, :len(want)], want, err_msg=f'seed {seed} row {r}')
            assert np.all(got[r, len(want):] == PAD_ID)
