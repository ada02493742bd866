"""Numbers mean what they say: eval samples, applied learning rate, MFU, positions, PAD, dropout.

Each test fails on the silent misreport it guards against: a first-N eval subset, a logged rate
that Adam did not apply, padded slots counted as work, positions read beyond the table, PAD inside
a hypothesis, PAD targets in the loss, dropout on in evaluation or off in training.
"""

import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t import decode, optim, sharding, train_lib
from t2t.data.pipeline import EvalSplit, sample_batches
from t2t.decode import DecodeConfig
from t2t.eval import predict as predict_lib
from t2t.ids import EOS_ID, PAD_ID
from t2t.infra import flops, metrics
from t2t.model import Transformer, TransformerConfig
from t2t.run import startup
from t2t.train.interval import Interval, log_train
from tests.helpers import run_script, tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


def _batch(rows=8, length=12, vocab=50, seed=0, pad_to=None):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, vocab, (rows, length)).astype(np.int32)
    targets = np.flip(inputs, axis=1).copy()
    inputs[:, -2:] = PAD_ID
    targets[:, -3:] = PAD_ID
    if pad_to:
        extra = ((0, 0), (0, pad_to - length))
        inputs, targets = np.pad(inputs, extra), np.pad(targets, extra)
    return {'inputs': inputs, 'targets': targets}


# --- evaluation on a fixed sample across the length buckets ----------------------------------


def test_eval_sample_is_fixed_and_spans_the_length_buckets():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.choice([5, 12, 30, 60], 400, p=[0.5, 0.3, 0.15, 0.05])]
    split = EvalSplit('toy', [''] * 400, [''] * 400, [[3] * n for n in lengths],
                      [[3] * n for n in lengths], (), {}, 64)
    everything = split.plan(8)
    sample = split.plan(8, num_batches=10, seed=0)
    assert len(sample) == 10 and len(everything) > 10
    # The same every evaluation, in plan order, and each bucket in proportion to its batches.
    again, other = split.plan(8, num_batches=10, seed=0), split.plan(8, num_batches=10, seed=1)
    assert [i.tolist() for _, i in sample] == [i.tolist() for _, i in again]
    assert [i.tolist() for _, i in sample] != [i.tolist() for _, i in other]
    buckets = [b for b, _ in everything]
    for bucket in set(buckets):
        share = buckets.count(bucket) / len(buckets) * 10
        assert abs([b for b, _ in sample].count(bucket) - share) < 1, bucket
    assert sample_batches(everything, 100, 0) == everything
    got = list(split.batches(8, num_batches=10, seed=0))
    assert [b['index'].tolist() for b in got] == [i.tolist() for _, i in sample]


# --- the learning rate Adam applied, and skipped steps ----------------------------------------


def test_logged_learning_rate_is_the_one_applied_and_skips_do_not_advance_it():
    # Separate source/target embeddings: a NaN row of the source table poisons only the batches
    # that contain that token, so step 1 is skipped and step 2 is applied.
    config = tiny_config(dropout_rate=0.0, share_embeddings=False, tie_output=False,
                         warmup_steps=10, skip_nonfinite=True)
    mesh = sharding.make_mesh((-1, 1, 1))
    tx = optim.make_optimizer(config)
    state, shardings = train_lib.create_sharded_state(config, mesh, tx)
    params = jax.tree.map(np.array, jax.device_get(state.params))
    params['source_embedder']['embedding'][3] = np.nan
    state = state.replace(params=jax.device_put(params, shardings.params))
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings, mesh)
    bad, good = _batch(seed=1), _batch(seed=2)
    bad['inputs'][0, 0] = 3
    good['inputs'][good['inputs'] == 3] = 4

    state, m1 = step(state, sharding.put_global(bad, sharding.batch_sharding(mesh)))
    assert float(m1['nonfinite']) == 1.0
    before = jax.device_get(state.params)
    state, m2 = step(state, sharding.put_global(good, sharding.batch_sharding(mesh)))
    assert float(m2['nonfinite']) == 0.0
    schedule = optim.learning_rate_schedule(config.d_model, config.warmup_steps,
                                            config.learning_rate_scale)
    # The skipped step advanced the train step but not the optimizer: the rate applied by the
    # first real update is the schedule's first one, and that is what is logged.
    assert int(state.step) == 2 and int(optim.applied_updates(state.opt_state)) == 1
    assert float(m2['learning_rate']) == pytest.approx(float(schedule(0)), rel=1e-6)
    assert float(schedule(0)) != pytest.approx(float(schedule(1)), rel=1e-3)
    # Adam's first update moves a parameter by lr * g / (|g| + eps), i.e. by lr where |g| >> eps.
    after = jax.device_get(state.params)
    moved = np.abs(after['decoder_0']['ffn']['wi']['kernel']
                   - before['decoder_0']['ffn']['wi']['kernel'])
    assert moved.max() == pytest.approx(float(m2['learning_rate']), rel=1e-3)
    # The loop logs the last step's rate, the interval's skips and the total.
    interval = Interval()
    interval.add(1, m1)
    interval.add(2, m2)
    writer = metrics.MetricWriter('unused', enabled=False)
    logged = log_train(writer, interval, config, 2, state, 1.0, (1.0, 1.0), None, 8)
    assert logged['learning_rate'] == float(m2['learning_rate'])
    assert logged['skipped_steps'] == 1 and logged['skipped_steps_total'] == 1


def _step_metrics(loss_sum, tokens):
    return {'loss_sum': loss_sum, 'nll_sum': loss_sum / 2, 'correct_sum': tokens / 2,
            'tokens': tokens, 'source_tokens': tokens + 1, 'nonfinite': 0.0, 'grad_norm': 1.5,
            'learning_rate': 1e-3}


def _log(interval, config, step):
    tx = optim.make_optimizer(config)
    state = types.SimpleNamespace(opt_state=tx.init({'w': jnp.zeros(2)}))
    return log_train(metrics.MetricWriter('unused', enabled=False), interval, config, step,
                           state, 1.0, (1.0, 1.0), None, 1)


def test_logged_loss_is_the_intervals_token_mean_and_a_resume_logs_the_same_floats():
    config = tiny_config()
    steps = [_step_metrics(0.3 * 10, 10.0), _step_metrics(0.7 * 30, 30.0),
             _step_metrics(0.11 * 11, 11.0)]
    full = Interval()
    for i, m in enumerate(steps, start=1):
        full.add(i, m)
    assert isinstance(full.sums['loss_sum'], jax.Array)  # summed on the device, not fetched
    logged = _log(full, config, 3)
    # over the interval's target tokens, not the mean of the three steps' means
    total = sum(m['loss_sum'] for m in steps)
    assert logged['loss'] == pytest.approx(total / 51, rel=1e-6)
    assert logged['loss'] != pytest.approx((0.3 + 0.7 + 0.11) / 3, rel=1e-3)
    assert logged['perplexity'] == pytest.approx(np.exp(logged['nll']), rel=1e-12)
    assert logged['target_tokens_per_s'] > 0 and logged['grad_norm'] == 1.5
    # A checkpoint after step 1 carries its sums (as JSON); the resumed interval adds the rest.
    first = Interval()
    first.add(1, steps[0])
    carried = json.loads(json.dumps(first.unlogged()))
    assert carried['tokens'] == 10 and isinstance(carried['tokens'], int)
    resumed = Interval(carried)
    resumed.add(2, steps[1])
    resumed.add(3, steps[2])
    again = _log(resumed, config, 3)
    for key in ('loss', 'nll', 'accuracy', 'perplexity', 'skipped_steps'):
        assert again[key] == logged[key], key
    # throughput counts the tokens of the steps this run ran: 41 of the 51 (elapsed = step time
    # x steps, so tokens/s x step time x steps gives the tokens back)
    assert again['target_tokens_per_s'] * again['step_time_s'] * 2 == pytest.approx(41)
    assert logged['target_tokens_per_s'] * logged['step_time_s'] * 3 == pytest.approx(51)
    assert resumed.unlogged() == {'loss_sum': 0.0, 'nll_sum': 0.0, 'correct_sum': 0.0,
                                  'tokens': 0, 'nonfinite': 0}  # the log emptied it


# --- MFU on real tokens -----------------------------------------------------------------------


def test_flops_per_token_add_up_to_the_padded_step():
    config = tiny_config(max_len=64, batch_size=32, d_model=128, d_ff=512, vocab_size=4000)
    per_source, per_target = flops.config_flops_per_token(config)
    slots = config.batch_size * config.max_len
    assert slots * (per_source + per_target) == pytest.approx(flops.config_flops_per_step(config))


def test_mfu_counts_real_tokens_and_labels_the_padded_figure():
    config = tiny_config()
    per_token = (3.0e6, 5.0e6)
    per_step = 4 * 12 * sum(per_token)  # 4 rows x 12 slots per side, as if all were real
    m = {'loss_sum': 1.0, 'nll_sum': 1.0, 'correct_sum': 1.0, 'nonfinite': 0.0,
         'grad_norm': 1.0, 'learning_rate': 1e-3}
    interval = Interval()
    for step, (src, tgt) in enumerate([(30.0, 20.0), (10.0, 36.0)], start=1):
        interval.add(step, dict(m, source_tokens=src, tokens=tgt))
    tx = optim.make_optimizer(config)
    state = types.SimpleNamespace(opt_state=tx.init({'w': jnp.zeros(2)}))
    logged = log_train(metrics.MetricWriter('unused', enabled=False), interval, config, 2,
                             state, per_step, per_token, 1e12, 2)
    real = (40.0 * per_token[0] + 56.0 * per_token[1]) / 2
    assert logged['mfu_real_tokens'] / logged['mfu_padded_slots'] == pytest.approx(
        real / per_step)
    assert logged['mfu_real_tokens'] == pytest.approx(
        real / logged['step_time_s'] / (2 * 1e12))
    assert 'mfu' not in logged


# --- positions beyond the table ---------------------------------------------------------------


def test_a_sequence_longer_than_the_position_table_is_an_error_while_tracing():
    for positions in ('sinusoidal', 'learned'):
        cfg = TransformerConfig(vocab_size=20, d_model=16, d_ff=32, num_heads=2,
                                num_encoder_layers=1, num_decoder_layers=1, max_position=8,
                                position_embedding=positions, deterministic=True)
        ids = jnp.ones((1, 9), jnp.int32)
        with pytest.raises(ValueError, match='sequence length 9 exceeds max_position=8'):
            jax.eval_shape(lambda ids=ids, cfg=cfg: Transformer(cfg).init(jax.random.key(0),
                                                                         ids, ids))
    with pytest.raises(startup.ConfigError, match=r'max_len=300 exceeds max_position=256 '
                                                  r'\(--config.max_len'):
        startup.check_lengths(tiny_config(max_len=300))


def test_evaluate_refuses_a_long_max_eval_len_in_one_line_before_compiling(tmp_path):
    for extra in ([], ['--translate']):
        proc = run_script('evaluate.py', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                          '--config.max_eval_len=300', *extra, timeout=120,
                          env={'JAX_LOG_COMPILES': '1'})
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1] == (
            'evaluate.py: max_eval_len=300 exceeds max_position=256 (--config.max_eval_len or '
            '--config.max_position)')
        assert 'Traceback' not in proc.stderr and 'Compiling' not in proc.stderr


# --- PAD is never generated -------------------------------------------------------------------


def test_beam_and_greedy_never_generate_pad():
    V, B, L = 9, 3, 7
    table_V = jax.random.normal(jax.random.key(1), (V,))

    def prefers_pad(ids_N1, cache, constants):
        n = ids_N1.shape[0]
        noise_NV = jax.random.normal(jax.random.fold_in(jax.random.key(2), cache['i']), (n, V))
        logits_NV = table_V + noise_NV
        logits_NV = logits_NV.at[:, PAD_ID].set(10.0)  # PAD is by far the likeliest token
        logits_NV = logits_NV.at[:, EOS_ID].set(-3.0)
        return logits_NV, {'i': cache['i'] + 1}

    beam_BKL, scores_BK = jax.jit(lambda: decode.beam_search(
        prefers_pad, {'i': jnp.array(0)}, batch_size=B, beam_size=3, alpha=0.6, eos_id=EOS_ID,
        max_decode_len=L))()
    greedy_BL = jax.jit(lambda: decode.greedy_search(
        prefers_pad, {'i': jnp.array(0)}, batch_size=B, eos_id=EOS_ID, max_decode_len=L))()
    for row in [*np.asarray(beam_BKL).reshape(-1, L), *np.asarray(greedy_BL)]:
        body = row[:list(row).index(EOS_ID)] if EOS_ID in row else row
        assert len(body) and PAD_ID not in body, row
    assert np.all(np.isfinite(np.asarray(scores_BK)))


# --- the loss counts real target tokens only ---------------------------------------------------


@pytest.fixture(scope='module')
def small_model():
    """(config with dropout 0.3, host params, a fresh train state)."""
    config = tiny_config(dropout_rate=0.3)
    mesh = sharding.make_mesh((-1, 1, 1))
    tx = optim.make_optimizer(config)
    state, shardings = train_lib.create_sharded_state(config, mesh, tx)
    return config, jax.device_get(state.params), (mesh, tx, state, shardings)


def _eval_sums(params, batch, config):
    step = jax.jit(functools.partial(train_lib.eval_step,
                                     step_config=train_lib.StepConfig.from_config(config)))
    return jax.device_get(step(params, batch))


def test_pad_targets_are_not_counted_in_the_loss(small_model):
    config, params, _ = small_model
    sums = [_eval_sums(params, _batch(pad_to=n), config) for n in (12, 20)]
    real = int((_batch()['targets'] != PAD_ID).sum())
    assert sums[0]['tokens'] == sums[1]['tokens'] == real  # 9 real targets per row, not 12 or 20
    for key in ('loss_sum', 'nll_sum', 'correct_sum'):
        np.testing.assert_allclose(sums[0][key], sums[1][key], rtol=1e-5)


def test_dropout_is_on_in_training_and_off_in_evaluation_and_decoding(small_model):
    config, params, (mesh, tx, state, shardings) = small_model
    step_config = train_lib.StepConfig.from_config(config)
    batch = _batch()
    # Training: the step draws dropout masks from the state's rng, so another rng, another loss.
    jitted = train_lib.jit_train_step(step_config, tx, shardings, mesh)
    losses = []
    for seed in (0, 1):
        fresh = state.replace(rng=jax.random.PRNGKey(seed).astype(state.rng.dtype))
        fresh = jax.tree.map(jnp.copy, fresh)
        batch_on_mesh = sharding.put_global(batch, sharding.batch_sharding(mesh))
        losses.append(float(jitted(fresh, batch_on_mesh)[1]['loss_sum']))
    assert losses[0] != losses[1]
    # Evaluation: the same sums as the model without dropout, whatever the rate.
    no_dropout = tiny_config(dropout_rate=0.0)
    assert _eval_sums(params, batch, config) == _eval_sums(params, batch, no_dropout)
    # Decoding: the same output as the model without dropout.
    inputs = batch['inputs'][:4]
    greedy = DecodeConfig(decode_strategy='greedy', max_decode_len=6, max_decode_extra=2)
    outputs = [jax.device_get(predict_lib.make_predict_fn(
        TransformerConfig.from_config(tiny_config(dropout_rate=rate)), greedy)(
            nn.unbox(params), inputs).ids_BL) for rate in (0.9, 0.0)]
    np.testing.assert_array_equal(outputs[0], outputs[1])
