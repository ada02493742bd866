"""Training: loss, accumulation, a few steps of learning, and bitwise-exact resume."""

import dataclasses
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sacrebleu

from t2t import optim, sharding, train_lib
from t2t.eval import evaluation
from t2t.infra import metrics
from t2t.loss import label_smoothed_cross_entropy
from t2t.run import checkpoint, checkpoint_read, startup
from t2t.train import loop
from t2t.train.interval import Interval
from tests import toy_corpus
from tests.helpers import tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


def test_label_smoothed_loss_equals_hand_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    targets = np.array([[1, 4, 0], [2, 2, 3]], np.int32)
    smoothed, nll = label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), 0.1)
    for b in range(2):
        for t in range(3):
            logp = logits[b, t] - np.log(np.exp(logits[b, t]).sum())
            q = np.full(5, 0.1 / 4)
            q[targets[b, t]] = 0.9
            np.testing.assert_allclose(smoothed[b, t], -(q * logp).sum(), rtol=1e-5)
            np.testing.assert_allclose(nll[b, t], -logp[targets[b, t]], rtol=1e-5)


def _synthetic_batch(rows, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, vocab, (rows, length)).astype(np.int32)
    targets = np.flip(inputs, axis=1).copy()  # learnable: the reversed source
    inputs[:, -2:] = 0  # some padding
    targets[:, -3:] = 0
    return {'inputs': inputs, 'targets': targets}


def _put(batch, mesh):
    return sharding.put_global(batch, sharding.batch_sharding(mesh))


def _setup(config, mesh_shape=(-1, 1, 1)):
    mesh = sharding.make_mesh(mesh_shape)
    tx = optim.make_optimizer(config)
    state, shardings = train_lib.create_sharded_state(config, mesh, tx)
    return mesh, tx, state, shardings


def test_a_few_steps_lower_the_loss():
    config = tiny_config(dropout_rate=0.0, warmup_steps=5, learning_rate_scale=3.0)
    mesh, tx, state, shardings = _setup(config)
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings, mesh)
    batch = _put(_synthetic_batch(8, 12, 50), mesh)
    losses = []
    for _ in range(12):
        state, m = step(state, batch)
        losses.append(float(m['loss_sum'] / m['tokens']))
    assert int(state.step) == 12
    assert losses[-1] < losses[0] - 0.5, losses


def test_accumulating_4_micro_batches_equals_one_4x_batch():
    # Plain SGD makes the parameter change the gradient itself: Adam's first step is about
    # lr * sign(g), which amplifies float noise in gradients that are nearly zero.
    # 4 micro-batches x 4 data devices x 1 row
    config = tiny_config(dropout_rate=0.0, batch_size=16)
    mesh = sharding.make_mesh((2, 2, 2))
    tx = optax.sgd(1.0)
    state, shardings = train_lib.create_sharded_state(config, mesh, tx)
    batch = _put(_synthetic_batch(16, 12, 50, seed=1), mesh)
    results = []
    for accum in (1, 4):
        step_config = dataclasses.replace(train_lib.StepConfig.from_config(config),
                                          grad_accum_steps=accum)
        step = train_lib.jit_train_step(step_config, tx, shardings, mesh)
        fresh = jax.tree_util.tree_map(jnp.copy, state)
        new_state, m = step(fresh, batch)
        results.append((jax.device_get(new_state.params), jax.device_get(m)))
    (p1, m1), (p4, m4) = results
    np.testing.assert_allclose(m1['loss_sum'], m4['loss_sum'], rtol=1e-5)
    assert m1['tokens'] == m4['tokens']
    np.testing.assert_allclose(m1['grad_norm'], m4['grad_norm'], rtol=1e-4)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), p1, p4)
    moved = jax.tree_util.tree_map(lambda a, b: np.abs(a - b).max(), p1,
                                   jax.device_get(state.params))
    assert max(jax.tree_util.tree_leaves(moved)) > 1e-3  # the step did change the parameters


def test_micro_batches_stay_spread_over_every_data_device_without_moving_data():
    mesh = sharding.make_mesh((2, 2, 2))  # 4 data-parallel devices, each 4 of 16 rows
    batch_sharding = sharding.batch_sharding(mesh)
    rows = sharding.put_global(np.arange(16 * 3).reshape(16, 3) // 3, batch_sharding)
    split = jax.jit(lambda x: train_lib._split_micro_batches(x, 4, batch_sharding))
    compiled = split.lower(rows).compile()
    assert not any(op in compiled.as_text() for op in ('all-to-all', 'all-gather',
                                                        'collective-permute'))
    micro = compiled(rows)  # [4 micro-batches, 4 rows, 3]
    held = {s.device: set(np.asarray(s.data)[:, 0].tolist()) for s in rows.addressable_shards}
    for shard in micro.addressable_shards:  # every micro-batch has one row on every device
        got = np.asarray(shard.data)[:, :, 0]
        assert got.shape == (4, 1) and set(got.ravel().tolist()) == held[shard.device]
    np.testing.assert_array_equal(np.asarray(micro)[:, :, 0], np.arange(16).reshape(4, 4).T)


def test_config_errors_name_the_key():
    mesh = sharding.make_mesh((-1, 1, 1))  # 8 data-parallel devices
    with pytest.raises(ValueError, match='batch_size=12 is not divisible by the 8'):
        startup.check_training_config(tiny_config(batch_size=12), mesh)
    with pytest.raises(ValueError, match='max_decode_len=300 exceeds max_position=256'):
        startup.check_training_config(tiny_config(max_decode_len=300), mesh)
    startup.check_training_config(tiny_config(), mesh)


def test_nonfinite_loss_stops_with_the_step_or_is_skipped():
    config = tiny_config(dropout_rate=0.0)
    mesh, tx, state, shardings = _setup(config)
    params = jax.tree_util.tree_map(np.array, jax.device_get(state.params))  # writable copies
    params['embedder']['embedding'][3] = np.nan  # a token the batch uses
    bad = state.replace(params=jax.device_put(params, shardings.params))
    batch = _synthetic_batch(8, 12, 50)
    batch['inputs'][0, 0] = 3
    skip = train_lib.jit_train_step(
        dataclasses.replace(train_lib.StepConfig.from_config(config), skip_nonfinite=True),
        tx, shardings, mesh)
    before = jax.device_get(bad.params)
    after_state, m = skip(bad, _put(batch, mesh))
    assert float(m['nonfinite']) == 1.0 and int(after_state.step) == 1
    np.testing.assert_array_equal(jax.device_get(after_state.params)['encoder_0']['ffn']['wi']
                                  ['kernel'], before['encoder_0']['ffn']['wi']['kernel'])
    interval = Interval()
    interval.add(7, m)
    with pytest.raises(loop.NonFiniteLossError, match='step 7'):
        interval.drain(skip_nonfinite=False)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


def _run_config(corpus, **overrides):
    settings = dict(num_train_steps=6, log_every_steps=2, eval_every_steps=6,
                    checkpoint_every_steps=3, keep_checkpoints=5, eval_bleu_sentences=0,
                    num_eval_batches=2, max_len=32, eval_batch_size=8)
    settings.update(overrides)
    return tiny_config(corpus, **settings)


def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(corpus, tmp_path):
    config = _run_config(corpus)
    full = loop.train_and_evaluate(config, str(tmp_path / 'full'))
    assert full.step == 6

    first = _run_config(corpus, num_train_steps=3)
    assert loop.train_and_evaluate(first, str(tmp_path / 'resumed')).step == 3
    resumed = loop.train_and_evaluate(config, str(tmp_path / 'resumed'))
    assert resumed.step == 6

    from t2t import data

    tokenizer = data.get_tokenizer(config)
    mesh = sharding.make_mesh(config.mesh_shape)
    tx = optim.make_optimizer(config)
    abstract = train_lib.abstract_state(config, mesh, tx)
    states, next_batches = [], []
    for name in ('full', 'resumed'):
        manager = checkpoint.make_manager(str(tmp_path / name), config)
        it = data.train_iterator(config, tokenizer)
        states.append(jax.device_get(checkpoint.restore(manager, 6, abstract, it)))
        next_batches.append(next(it))
        checkpoint.close(manager)
    jax.tree_util.tree_map(np.testing.assert_array_equal, states[0], states[1])
    jax.tree_util.tree_map(np.testing.assert_array_equal, next_batches[0], next_batches[1])
    # The metrics of the steps both runs logged agree too (to print precision).
    full_log = {r['step']: r for r in metrics.read_jsonl(tmp_path / 'full')}
    resumed_log = {r['step']: r for r in metrics.read_jsonl(tmp_path / 'resumed')}
    assert full_log[6]['loss'] == resumed_log[6]['loss']


def test_train_leaves_checkpoints_events_and_metrics(corpus, tmp_path):
    config = _run_config(corpus, num_train_steps=4, checkpoint_every_steps=2, keep_checkpoints=1,
                         eval_every_steps=4, eval_bleu_sentences=10)
    workdir = tmp_path / 'run'
    result = loop.train_and_evaluate(config, str(workdir))
    assert result.stopped_by == 'num_train_steps'
    assert sorted(os.listdir(workdir / 'checkpoints')) == ['4']
    assert any(name.startswith('events.out.tfevents') for name in os.listdir(workdir))
    records = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
    train_records = [r for r in records if 'loss' in r]
    assert [r['step'] for r in train_records] == [2, 4]
    for key in ('loss', 'nll', 'accuracy', 'learning_rate', 'grad_norm', 'step_time_s',
                'target_tokens_per_s', 'perplexity'):
        assert np.isfinite(train_records[-1][key]), key
    eval_record = next(r for r in records if 'eval_loss' in r)
    assert eval_record['step'] == 4 and eval_record['eval_loss'] > 0
    # BLEU and chrF of the first 10 validation sentences, decoded again from the checkpoint and
    # scored by sacrebleu itself (sentences skipped as too long count as empty output).
    from t2t import data
    from t2t.eval import predict as predict_lib
    from t2t.eval import translate as eval_translate
    from t2t.model import TransformerConfig

    tokenizer = data.get_tokenizer(config)
    split = data.eval_split(config, tokenizer, config.eval_split)
    mesh = sharding.make_mesh(config.mesh_shape)
    predict = predict_lib.config_predict_fn(config, TransformerConfig.from_config(config),
                                            num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    params = checkpoint_read.restore_params(str(workdir), 4)
    head = dataclasses.replace(split, sources=split.sources[:10], inputs=split.inputs[:10],
                               references=split.references[:10], targets=split.targets[:10],
                               skipped=tuple(i for i in split.skipped if i < 10))

    def translate(params):  # skipped as too long: None, scored as empty output
        return [h or '' for h in eval_translate.translate_batches(
            predict, params, head.batches(config.eval_batch_size), tokenizer, 10,
            progress=False, mesh=mesh).hypotheses]

    hypotheses = translate(params)
    references = split.references[:10]
    assert eval_record['eval_bleu'] == sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert eval_record['eval_chrf'] == sacrebleu.CHRF().corpus_score(hypotheses,
                                                                     [references]).score
    # After 4 steps the model says EOS at once (every score 0): the same BLEU function again on
    # a random model's (non-empty) output, against references made of that output every other
    # sentence, where the numbers are far from 0 and hypotheses / references not symmetric.
    model_config = TransformerConfig.from_config(config)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    hypotheses = translate(state.params)
    mixed = [h if i % 2 and h else r for i, (h, r) in enumerate(zip(hypotheses, references,
                                                                    strict=True))]
    scores = evaluation.make_bleu_eval(config, model_config, tokenizer, dataclasses.replace(
        split, references=mixed + split.references[10:]), mesh)(state.params)
    assert scores['eval_chrf'] == sacrebleu.CHRF().corpus_score(hypotheses, [mixed]).score > 10
    assert scores['eval_bleu'] == sacrebleu.corpus_bleu(hypotheses, [mixed]).score
    # Resuming a finished run trains nothing and keeps the checkpoint.
    again = loop.train_and_evaluate(config, str(workdir))
    assert again.step == 4
    # The time budget counts the seconds of earlier runs too: one already spent trains nothing.
    config.num_train_steps, config.train_time_budget_s = 100, 0.001
    spent = loop.train_and_evaluate(config, str(workdir))
    assert (spent.step, spent.stopped_by) == (4, 'time_budget')
    assert checkpoint_read.read_metadata(str(workdir))['train_seconds'] > 0


def test_preemption_saves_a_checkpoint_and_stops(corpus, tmp_path, monkeypatch):
    real_jit = train_lib.jit_train_step

    def sigterm_in_the_first_step(*args, **kwargs):
        step = real_jit(*args, **kwargs)

        def signalled(state, batch):
            if int(state.step) == 0:  # the real signal, caught by the loop's handler
                os.kill(os.getpid(), signal.SIGTERM)
            return step(state, batch)

        return signalled

    monkeypatch.setattr(train_lib, 'jit_train_step', sigterm_in_the_first_step)
    config = _run_config(corpus, num_train_steps=50, checkpoint_every_steps=40)
    result = loop.train_and_evaluate(config, str(tmp_path / 'run'))
    # Seen at the very next step, not at a log step: saved at once, not evaluated.
    assert (result.step, result.stopped_by) == (1, 'preemption')
    assert os.listdir(tmp_path / 'run' / 'checkpoints') == ['1']
    assert checkpoint_read.read_metadata(str(tmp_path / 'run'))['evaluation_pending'] is False
