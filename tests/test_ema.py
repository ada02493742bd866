"""The EMA of the weights (ema_decay > 0): its formula, kill + resume, evaluation's weights, and
ema_decay=0 leaving the state and the checkpoint as they were."""

import os
import shutil
import signal

import jax
import numpy as np
import pytest

from t2t import optim, sharding, train_lib
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import evaluation
from t2t.infra import metrics
from t2t.run import checkpoint, checkpoint_read, cli, config_checks
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import tiny_config
from tests.test_resume import _assert_bitwise_equal, _drive, _final_state

pytestmark = pytest.mark.xdist_group(__name__)

DECAY = 0.9
# A checkpoint after every step: the EMA's recurrence can be checked step by step from disk.
SETTINGS = dict(num_train_steps=3, log_every_steps=2, eval_every_steps=3, checkpoint_every_steps=1,
                keep_checkpoints=3, eval_bleu_sentences=0, num_eval_batches=1, max_len=32,
                eval_batch_size=8, ema_decay=DECAY)
LAST = SETTINGS['num_train_steps']


def _fake_bleu(params):
    """Stands in for the BLEU evaluation: a number of the weights it was given."""
    embedding = np.asarray(jax.device_get(params['embedder']['embedding']), np.float64)
    return {'eval_bleu': float(embedding.sum()), 'eval_chrf': float(np.abs(embedding).sum())}


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))


@pytest.fixture(scope='module')
def ema_run(corpus, tmp_path_factory):
    """One uninterrupted run with ema_decay=0.9: checkpoints 1, 2, 3, evaluated at 3."""
    config = tiny_config(corpus, **SETTINGS)
    workdir = tmp_path_factory.mktemp('ema') / 'run'
    with pytest.MonkeyPatch.context() as patch:  # the routing of BLEU, without a beam compile
        patch.setattr(evaluation, 'make_bleu_eval', lambda *args: _fake_bleu)
        result = loop.train_and_evaluate(config, str(workdir))
    assert result.step == LAST
    return {'config': config, 'workdir': workdir, 'result': result,
            'state': _final_state(config, workdir, LAST)}


def test_ema_follows_its_formula_step_by_step_and_is_evaluated_beside_the_params(ema_run):
    config, workdir = ema_run['config'], ema_run['workdir']
    assert checkpoint_read.finished_steps(workdir) == [1, 2, 3]
    ema = checkpoint_read.restore_params(workdir, 1, weights='ema')
    for step in range(2, LAST + 1):
        params = checkpoint_read.restore_params(workdir, step, weights='raw')
        stored = checkpoint_read.restore_params(workdir, step, weights='ema')
        ema = jax.tree.map(lambda e, p: np.float32(DECAY) * e + np.float32(1 - DECAY) * p,
                           ema, params)
        jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=0, atol=2e-6),
                     stored, ema)
    # The average lags the parameters (else the check above would hold for any copy of them).
    gap = max(float(np.abs(e - p).max()) for e, p in zip(jax.tree.leaves(stored),
                                                         jax.tree.leaves(params), strict=True))
    assert gap > 1e-3
    # Sharded like the params: every EMA leaf has its param's sharding.
    mesh = sharding.make_mesh(config.mesh_shape)
    state = train_lib.abstract_state(config, mesh, optim.make_optimizer(config))
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.ema)) == \
        jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.params))

    # The evaluation at the last step reports both weights under distinct names, each of its own.
    evaluated = ema_run['result'].eval_metrics
    assert evaluated['eval_loss'] != evaluated['eval_loss_ema']
    assert {'eval_nll_ema', 'eval_accuracy_ema', 'eval_perplexity_ema'} <= evaluated.keys()
    assert evaluated['eval_bleu'] == _fake_bleu(params)['eval_bleu']
    assert evaluated['eval_bleu_ema'] == _fake_bleu(stored)['eval_bleu']
    logged = metrics.read_jsonl(workdir)[-1]
    assert logged['step'] == LAST and logged['eval_loss_ema'] == evaluated['eval_loss_ema']

    # evaluate.py's readers: auto picks the EMA; an average of EMAs is their mean.
    assert checkpoint_read.choose_weights(workdir, None, 'auto') == 'ema'
    averaged = eval_checkpoints.load_params(workdir, [LAST - 1, LAST], weights='ema')
    before = checkpoint_read.restore_params(workdir, LAST - 1, weights='ema')
    jax.tree.map(lambda a, x, y: np.testing.assert_allclose(a, (x + y) / 2, rtol=1e-6),
                 averaged, before, stored)


def test_warmup_of_the_decay():
    got = [float(optim.ema_decay_at(0.5, t, warmup=True)) for t in (1, 2, 10)]
    np.testing.assert_allclose(got, [2 / 11, 3 / 12, 0.5], rtol=1e-6)  # 11/20 is over 0.5
    assert optim.ema_decay_at(0.5, 1) == 0.5


def test_killed_mid_save_and_resumed_the_ema_and_params_are_bitwise_those_of_one_run(
        corpus, ema_run, tmp_path):
    workdir = tmp_path / 'run'
    killed = _drive(corpus, workdir, 'kill_in_save', at=2, overrides=SETTINGS)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert checkpoint_read.finished_steps(workdir) == [1]
    config = ema_run['config']
    assert loop.train_and_evaluate(config, str(workdir)).step == LAST
    resumed = _final_state(config, workdir, LAST)
    assert resumed.ema is not None and resumed.guard is None
    _assert_bitwise_equal(resumed, ema_run['state'])  # step, params, opt_state, rng and ema


def test_ema_decay_0_is_the_state_and_checkpoint_of_before(corpus, ema_run, tmp_path):
    from t2t import data

    plain = tiny_config(corpus, **{**SETTINGS, 'ema_decay': 0.0})
    mesh = sharding.make_mesh(plain.mesh_shape)
    # A batch of the run's own data: the EMA run's step is compiled already (the cache).
    batch = next(data.train_iterator(plain, data.get_tokenizer(plain)))
    batch = sharding.put_rows(batch, sharding.batch_sharding(mesh), plain.batch_size)
    states = {}
    for decay in (0.0, DECAY):
        config = tiny_config(corpus, **{**SETTINGS, 'ema_decay': decay})
        tx = optim.make_optimizer(config)
        state, shardings = train_lib.create_sharded_state(config, mesh, tx)
        if decay:  # the average starts at the initial parameters
            _assert_bitwise_equal(jax.device_get(state.ema), jax.device_get(state.params))
        step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings,
                                        mesh)
        for _ in range(2):
            state, _ = step(state, batch)
        states[decay] = state
    state = states[0.0]
    assert state.ema is None and state.guard is None  # fields that hold no array
    tops = {checkpoint_read.path_name(p).split('/')[0]
            for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert tops == {'step', 'params', 'opt_state', 'rng'}
    # Keeping an EMA changes nothing of the training itself.
    with_ema = states[DECAY]
    _assert_bitwise_equal(jax.device_get(state), jax.device_get(train_lib.TrainState(
        step=with_ema.step, params=with_ema.params, opt_state=with_ema.opt_state,
        rng=with_ema.rng)))

    # The checkpoint holds the same arrays as before; an EMA one adds ema/<param> for each.
    workdir = tmp_path / 'plain'
    manager = checkpoint.make_manager(str(workdir), plain)
    checkpoint.save(manager, 2, state, force=True)
    checkpoint.wait(manager)
    checkpoint.close(manager)
    names = set(checkpoint_read.read_metadata(workdir)['checksums'])
    assert {n.split('/')[0] for n in names} == {'step', 'params', 'opt_state', 'rng'}
    params = {n for n in names if n.startswith('params/')}
    ema_names = set(checkpoint_read.read_metadata(ema_run['workdir'])['checksums'])
    assert ema_names == names | {'ema/' + n.removeprefix('params/') for n in params}

    # Asked for EMA weights it has not: one line, before any decoding.
    assert checkpoint_read.choose_weights(workdir, None, 'auto') == 'raw'
    shutil.copy(os.path.join(ema_run['workdir'], 'vocab.model'), workdir / 'vocab.model')
    with pytest.raises(checkpoint.CheckpointError, match='holds no EMA weights') as error:
        evaluation.run(plain, str(workdir), weights='ema', progress=False, echo=lambda _: None)
    assert '\n' not in str(error.value) and str(workdir) in str(error.value)


def test_ema_decay_outside_0_1_is_one_line_and_exit_1(corpus):
    config = tiny_config(corpus, ema_decay=1.0)
    with pytest.raises(SystemExit) as exited:  # a message as the code: printed, exit status 1
        cli.check_values(config, 'train.py')
    assert exited.value.code == 'train.py: ema_decay=1.0 must be in [0, 1)'
    config.ema_decay = -0.1
    assert config_checks.problem(config) == 'ema_decay=-0.1 must be in [0, 1)'
