"""Every decoding, loss and dropout setting of a config reaches its code, measured against values
computed here (tests/reference_np.py, NumPy formulas): not only "a different setting gives a
different number".

- beam_size, length_penalty_alpha, max_decode_extra, beam_unfinished: predict_lib.config_predict_fn
  (what training's BLEU and evaluate.py decode with) against exhaustive search of the reference
  model;
- label_smoothing: StepConfig.from_config -> the loss value and its gradient;
- dropout_rate, relu_dropout_rate, attention_dropout_rate: the fraction of zeros and the scale of
  what each dropout site of the model does;
- the validation loss, perplexity and accuracy of loop.evaluate_loss over a whole split;
- a packed batch through the training loss equals its pairs one by one (loss and gradients);
- gradient accumulation with dropout and Adam equals the micro-batches' gradients added up by hand
  and Adam written out (two steps, so beta2 matters).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t import dropout as dr
from t2t import optim, sharding, train_lib
from t2t.attention import MultiHeadAttention
from t2t.eval import predict as predict_lib
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import (
    Transformer,
    TransformerConfig,
    batch_forward_args,
)
from t2t.train import loop
from tests import reference_np as ref_np
from tests import toy_corpus
from tests.conftest import tiny_config
from tests.test_reference import (
    BEAM,
    DECODE,
    EXTRA,
    MAX_LEN,
    NUM_VALID,
    _sources,
    pack,
    random_params,
    reference,
    spec_of,
)

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

# ----------------------------------------------------------------------------------------------
# Decoding settings through config_predict_fn


def _decode_config(**settings):
    c = tiny_config(**DECODE)
    c.beam_size, c.length_penalty_alpha = BEAM, 0.6
    c.max_decode_len, c.max_decode_extra = MAX_LEN, EXTRA
    for k, v in settings.items():
        setattr(c, k, v)
    return c


def _best(ref, spec, inputs, alpha, extra, unfinished='fallback'):
    """Exhaustive-search output of every row and its score."""
    out = []
    for row in inputs:
        source = [int(i) for i in row if i != PAD_ID]
        out.append(ref_np.exhaustive_search(
            ref, source, spec, limit=min(len(source) + extra, MAX_LEN), alpha=alpha,
            eos_id=EOS_ID, pad_id=PAD_ID, num_valid=NUM_VALID, unfinished=unfinished))
    return out


def _score(ref, spec, source, seq, alpha):
    logp = ref_np.log_softmax(ref_np.logits(ref, source, seq, spec)[:, :NUM_VALID])
    return sum(logp[t, tok] for t, tok in enumerate(seq)) / ref_np.length_penalty(len(seq), alpha)


def _ids(row):
    ids = [int(i) for i in row]
    return ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else [i for i in ids if i != PAD_ID]


@pytest.fixture(scope='module')
def decode_case():
    config = _decode_config()
    model_config = TransformerConfig.from_config(config)
    params = random_params(model_config, seed=29)  # alpha, extra, the rule change every row
    inputs = np.concatenate([_sources(seed) for seed in range(3)])  # 12 rows
    return model_config, params, inputs, reference(params, model_config), spec_of(model_config)


@pytest.mark.parametrize('setting', ['paper', 'length_penalty_alpha', 'max_decode_extra',
                                     'beam_unfinished'])
def test_decoding_settings_reach_the_search(decode_case, setting):
    model_config, params, inputs, ref, spec = decode_case
    alpha, extra, unfinished = 0.6, EXTRA, 'fallback'
    if setting == 'length_penalty_alpha':
        alpha = 0.0
    if setting == 'max_decode_extra':
        extra = 1
    if setting == 'beam_unfinished':
        unfinished = 'compete'
    config = _decode_config(length_penalty_alpha=alpha, max_decode_extra=extra,
                            beam_unfinished=unfinished)
    predict = predict_lib.config_predict_fn(config, model_config, num_valid_ids=NUM_VALID)
    got = np.asarray(predict(params, inputs).ids_BL)
    want = _best(ref, spec, inputs, alpha, extra, unfinished)
    for r, (seq, _) in enumerate(want):
        assert _ids(got[r]) == seq, (setting, r)
    if setting != 'paper':  # the setting changes the answer of at least one row here
        paper = _best(ref, spec, inputs, 0.6, EXTRA)
        assert any(a[0] != b[0] for a, b in zip(want, paper, strict=True)), setting


def test_beam_size_reaches_the_search(decode_case):
    # One beam misses the exhaustive optimum on some rows (scored by the reference); 27 never.
    model_config, _, inputs, _, spec = decode_case
    params = random_params(model_config, seed=23)  # one beam falls short on 8 of 12 rows
    ref = reference(params, model_config)
    predict = predict_lib.config_predict_fn(_decode_config(beam_size=1), model_config,
                                            num_valid_ids=NUM_VALID)
    got = np.asarray(predict(params, inputs).ids_BL)
    best = _best(ref, spec, inputs, 0.6, EXTRA)
    gaps = []
    for r, row in enumerate(inputs):
        source = [int(i) for i in row if i != PAD_ID]
        gaps.append(best[r][1] - _score(ref, spec, source, _ids(got[r]), 0.6))
    assert min(gaps) > -1e-9  # nothing beats exhaustive search
    assert max(gaps) > 1e-3, gaps  # and a single beam falls short somewhere


# ----------------------------------------------------------------------------------------------
# The loss: label_smoothing from the config


MODEL = dict(vocab_size=23, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
             num_decoder_layers=1, max_position=32)


def _padded_batch(seed, rows=4, s=7, t=6):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, MODEL['vocab_size'], (rows, s)).astype(np.int32)
    targets = rng.integers(2, MODEL['vocab_size'], (rows, t)).astype(np.int32)
    for r in range(rows):
        inputs[r, s - r:] = PAD_ID
        targets[r, t - 1 - r % 3:] = PAD_ID
    return {'inputs': inputs, 'targets': targets}


# One compiled loss-and-gradient of the training loss path for every test here (one per shape).
_loss_and_grad = jax.jit(jax.value_and_grad(train_lib.loss_sums, has_aux=True),
                         static_argnums=(3, 4))


def _assert_grads_close(got, want, what=''):
    """Gradients equal to float32 accumulation error: 1e-5 of the largest gradient (some, like
    the attention key biases', are exactly 0 in real arithmetic and float noise here)."""
    scale = max(float(np.abs(w).max()) for w in jax.tree_util.tree_leaves(want))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, rtol=0,
                                   err_msg=f'{what} {jax.tree_util.keystr(path)}')


def _direct_sums(ref, spec, pairs, smoothing, vocab):
    """(smoothed loss sum, NLL sum, correct, tokens) of pairs by the formulas, float64."""
    loss = nll = correct = tokens = 0.0
    for source, target in pairs:
        logp = ref_np.log_softmax(ref_np.logits(ref, source, target, spec))
        q = np.full(logp.shape, smoothing / (vocab - 1))
        q[np.arange(len(target)), target] = 1.0 - smoothing
        loss += -(q * logp).sum()
        nll += -logp[np.arange(len(target)), target].sum()
        correct += (logp.argmax(-1) == np.asarray(target)).sum()
        tokens += len(target)
    return loss, nll, correct, tokens


def _rows_as_pairs(batch):
    return [([int(i) for i in s if i != PAD_ID], [int(i) for i in t if i != PAD_ID])
            for s, t in zip(batch['inputs'], batch['targets'], strict=True)]


@functools.partial(jax.jit, static_argnums=(2,))
@functools.partial(jax.grad)
def _smoothed_plain_grad(params, batch, model_config, smoothing):
    """The smoothed loss sum written here from t2t's logits (for its gradient)."""
    logits = Transformer(model_config.replace(deterministic=True)).apply(
        {'params': params}, **batch_forward_args(batch))
    logp = jax.nn.log_softmax(logits)
    vocab = logits.shape[-1]
    q = jax.nn.one_hot(batch['targets'], vocab) * (1 - smoothing - smoothing / (vocab - 1)) \
        + smoothing / (vocab - 1)
    return -((q * logp).sum(-1) * (batch['targets'] != PAD_ID)).sum()


def _pairs(seed):
    """Two rows of two pairs each (packed) and the same four pairs one a row."""
    rng = np.random.default_rng(seed)

    def seq(n):
        return [int(x) for x in rng.integers(2, MODEL['vocab_size'], n - 1)] + [EOS_ID]

    return [[(seq(3), seq(4)), (seq(4), seq(3))], [(seq(2), seq(2)), (seq(3), seq(5))]]


def test_label_smoothing_reaches_the_loss_and_its_gradient():
    # The Table 3 point label_smoothing=0.0 (the default 0.1 is checked by the validation test
    # below); loss and gradient, through StepConfig.from_config as train.py builds it.
    config = tiny_config(**MODEL, label_smoothing=0.0, dropout_rate=0.0)
    step_config = train_lib.StepConfig.from_config(config)
    params = random_params(step_config.model, seed=5)
    rows = _pairs(seed=5)
    batch = pack(rows)
    (loss, sums), grads = _loss_and_grad(params, batch, None, step_config, True)
    want = _direct_sums(reference(params, step_config.model), spec_of(step_config.model),
                        [p for pairs in rows for p in pairs], 0.0, MODEL['vocab_size'])
    np.testing.assert_allclose([float(loss), float(sums['nll_sum']), float(sums['correct_sum']),
                                float(sums['tokens'])], want, rtol=2e-6)
    assert float(loss) == float(sums['nll_sum'])  # no smoothing: the loss is the NLL
    _assert_grads_close(grads, _smoothed_plain_grad(params, batch, step_config.model, 0.0))


# ----------------------------------------------------------------------------------------------
# Dropout rates, measured at each site


RATES = dict(dropout_rate=0.1, relu_dropout_rate=0.3, attention_dropout_rate=0.2)


def _measure(inputs, outputs, rate):
    """(fraction of the nonzero inputs zeroed, sigma of that fraction at `rate`, kept scales)."""
    x = np.concatenate([np.ravel(a) for a in inputs])
    y = np.concatenate([np.ravel(a) for a in outputs])
    live = x != 0  # ReLU outputs are often 0 before any dropout
    x, y = x[live], y[live]
    zeroed = float(np.mean(y == 0))
    p = 1 - rate
    return zeroed, np.sqrt(p * (1 - p) / len(x)), y[y != 0] / x[y != 0]


@functools.partial(jax.jit, static_argnums=(0,))
def _dropout_io(cfg, params, src, tgt, key):
    """{module path: [(input, output), ...]} of every Dropout module of a training forward."""
    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, dr.Dropout) and context.method_name == '__call__':
            context.module.sow('intermediates', 'io', (args[0], out))
        return out

    with nn.intercept_methods(record):
        _, state = Transformer(cfg).apply({'params': params}, src, tgt, rngs={'dropout': key},
                                          mutable=['intermediates'])
    return state['intermediates']


def _walk(tree, path=()):
    for k, v in tree.items():
        if k == 'io':
            for x, y in v:
                yield path, np.asarray(x), np.asarray(y)
        else:
            yield from _walk(v, path + (k,))


def test_dropout_rates_reach_every_site_at_their_values():
    config = tiny_config(**MODEL, **RATES)
    cfg = TransformerConfig.from_config(config)  # deterministic=False: training
    params = random_params(cfg, seed=9)
    rng = np.random.default_rng(9)
    src, tgt = (rng.integers(2, MODEL['vocab_size'], (16, 12)).astype(np.int32) for _ in '12')
    seen = {'embedding': ([], []), 'residual': ([], []), 'relu': ([], [])}
    for path, x, y in _walk(_dropout_io(cfg, params, src, tgt, jax.random.key(1, impl='rbg'))):
        kind = 'embedding' if path[0] == 'embedder' else 'relu' if path[-2] == 'ffn' else \
            'residual'
        seen[kind][0].append(x)
        seen[kind][1].append(y)
    # the shared embedder twice, 2 + 3 sublayers, 2 FFNs
    assert [len(seen[k][0]) for k in seen] == [2, 5, 2]
    for kind, rate in (('embedding', 0.1), ('residual', 0.1), ('relu', 0.3)):
        zeroed, sigma, scales = _measure(*seen[kind], rate)
        keep = dr.keep_probability(rate)
        assert abs(zeroed - (1 - keep)) < 5 * sigma, (kind, zeroed, rate)
        np.testing.assert_allclose(scales, 1 / keep, rtol=1e-6, err_msg=kind)


def test_attention_dropout_rate_on_the_attention_weights():
    # One head, keys = values = the rows of the identity, queries that see every key alike: the
    # attention output of query q is its row of weights, 1/16 each before dropout.
    config = tiny_config(**{**MODEL, 'num_heads': 1}, **RATES)
    cfg = TransformerConfig.from_config(config)
    d = cfg.d_model
    eye = np.eye(d, dtype=np.float32)
    zero_in = {'kernel': np.zeros((d, 1, d), np.float32), 'bias': np.zeros((1, d), np.float32)}
    params = {'query': zero_in, 'key': zero_in,
              'value': {'kernel': eye[:, None, :], 'bias': np.zeros((1, d), np.float32)},
              'out': {'kernel': eye[None], 'bias': np.zeros(d, np.float32)}}
    x = np.broadcast_to(eye, (32, d, d))  # 32 rows of 16 tokens
    mask = jnp.ones((32, 1, d, d), bool)
    out = jax.jit(lambda p, x, m, k: MultiHeadAttention(cfg, 'self').apply(
        {'params': p}, x, x, m, rngs={'dropout': k}))(params, x, mask,
                                                      jax.random.key(2, impl='rbg'))
    zeroed, sigma, scales = _measure([np.full(out.shape, 1 / d)], [np.asarray(out)], 0.2)
    keep = dr.keep_probability(0.2)
    assert abs(zeroed - (1 - keep)) < 5 * sigma, zeroed
    np.testing.assert_allclose(scales, 1 / keep, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Validation loss, perplexity and accuracy over a whole split


def test_validation_metrics_equal_a_direct_computation_over_the_whole_split(tmp_path):
    from t2t import data

    corpus = toy_corpus.make_corpus(tmp_path, train=100, validation=21, long_validation=2)
    config = toy_corpus.tiny_config(corpus, d_model=16, d_ff=32, num_heads=2,
                                    num_encoder_layers=1, num_decoder_layers=1,
                                    eval_batch_size=8, num_eval_batches=-1, max_eval_len=32)
    tokenizer = data.get_tokenizer(config)
    split = data.eval_split(config, tokenizer, 'validation')
    assert len(split.plan(8)) > 2  # several batches: dropping one would show
    step_config = train_lib.StepConfig.from_config(config)
    params = random_params(step_config.model, seed=4)
    mesh = sharding.make_mesh((-1, 1, 1))
    eval_step = train_lib.jit_eval_step(step_config, sharding.replicated(mesh), mesh)
    got = loop.evaluate_loss(eval_step, params, split.batches(8), mesh, config.num_eval_batches)

    too_long = [i for i, (s, t) in enumerate(zip(split.inputs, split.targets, strict=True))
                if max(len(s), len(t)) > config.max_eval_len]
    assert sorted(split.skipped) == too_long and len(too_long) == 2
    pairs = [(s, t) for i, (s, t) in enumerate(zip(split.inputs, split.targets, strict=True))
             if i not in too_long]
    assert len(pairs) == 21
    loss, nll, correct, tokens = _direct_sums(
        reference(params, step_config.model), spec_of(step_config.model), pairs,
        config.label_smoothing, config.vocab_size)
    np.testing.assert_allclose(got['loss'], loss / tokens, rtol=1e-5)
    np.testing.assert_allclose(got['nll'], nll / tokens, rtol=1e-5)
    np.testing.assert_allclose(got['perplexity'], np.exp(nll / tokens), rtol=1e-5)
    assert got['accuracy'] == correct / tokens


# ----------------------------------------------------------------------------------------------
# Packed training equals pairs one by one


def test_packed_batch_loss_and_gradients_equal_its_pairs_one_by_one():
    # Each pair alone in a row of the same shape (segment 1, then padding): one compile.
    config = tiny_config(**MODEL, label_smoothing=0.0, dropout_rate=0.0)
    step_config = train_lib.StepConfig.from_config(config)
    params = random_params(step_config.model, seed=6)
    rows = _pairs(seed=6)
    (_, packed), packed_grads = _loss_and_grad(params, pack(rows), None, step_config, True)
    singles = [[p] for pairs in rows for p in pairs]
    total_grads, total = None, None
    for at in range(0, len(singles), 2):
        (_, s), g = _loss_and_grad(params, pack(singles[at:at + 2]), None, step_config, True)
        total = s if total is None else jax.tree.map(jnp.add, total, s)
        total_grads = g if total_grads is None else jax.tree.map(jnp.add, total_grads, g)
    for key in ('loss_sum', 'nll_sum', 'correct_sum', 'tokens'):
        np.testing.assert_allclose(packed[key], total[key], rtol=2e-6, err_msg=key)
    _assert_grads_close(packed_grads, total_grads, 'packed')


# ----------------------------------------------------------------------------------------------
# Gradient accumulation with dropout and Adam


def _adam_update(p, mu, nu, *, rate, t, b1, b2, eps):
    """Adam (Kingma & Ba, algorithm 1): bias-corrected moments, then the step."""
    return p - rate * (mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t)) + eps)


def test_accumulation_with_dropout_and_adam_equals_the_micro_batches_added_by_hand():
    # adam_eps 1e-3: Adam's update is then linear in gradients far below 1e-3, so float noise in
    # near-zero gradients stays noise (with 1e-9 their sign alone would move parameters by lr).
    # rng_impl rbg: the same fold_in logic as threefry, and several times faster to compile.
    config = tiny_config(**MODEL, dropout_rate=0.1, relu_dropout_rate=0.2, batch_size=8,
                         grad_accum_steps=2, adam_eps=1e-3, adam_b2=0.9, rng_impl='rbg')
    step_config = train_lib.StepConfig.from_config(config)
    tx = optim.make_optimizer(config)
    params = random_params(step_config.model, seed=8)
    state = train_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params),
                                 rng=jax.random.key_data(jax.random.key(3, impl='rbg')))
    batch = _padded_batch(seed=8, rows=8)
    step = jax.jit(functools.partial(train_lib.train_step, step_config=step_config, tx=tx))

    lr = optim.learning_rate_schedule(config.d_model, config.warmup_steps,
                                      config.learning_rate_scale)
    b1, b2, eps = config.adam_b1, config.adam_b2, config.adam_eps
    mine = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    mu = jax.tree.map(np.zeros_like, mine)
    nu = jax.tree.map(np.zeros_like, mine)
    for t in range(2):
        # train_step's documented rngs: the step's key folded with the step, then with m
        step_key = jax.random.fold_in(jax.random.key(3, impl='rbg'), t)
        grads, tokens = None, 0.0
        for m in range(2):
            micro = {k: v[m::2] for k, v in batch.items()}  # rows m, m + 2, ...
            (_, s), g = _loss_and_grad(state.params, micro, jax.random.fold_in(step_key, m),
                                       step_config, False)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            tokens += float(s['tokens'])
        g = jax.tree.map(functools.partial(np.multiply, 1.0 / tokens), grads)
        mu = jax.tree.map(lambda m_, g_: b1 * m_ + (1 - b1) * g_, mu, g)
        nu = jax.tree.map(lambda n_, g_: b2 * n_ + (1 - b2) * g_ ** 2, nu, g)
        mine = jax.tree.map(functools.partial(_adam_update, rate=float(lr(t)), t=t + 1, b1=b1,
                                              b2=b2, eps=eps), mine, mu, nu)
        state, metrics = step(state, batch)
        assert float(metrics['tokens']) == tokens
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params),
                                jax.tree_util.tree_leaves(mine), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=0,
                                       err_msg=f'step {t + 1} {jax.tree_util.keystr(path)}')
    moved = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(params), strict=True))
    assert moved > 1e-3  # the steps did move the parameters
