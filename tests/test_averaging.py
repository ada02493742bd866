"""Checkpoint averaging that never hurts (t2t/eval/averaging.py, evaluate.py --average_final): the
window from the run's final fraction of steps, the average kept only when its validation NLL beats
the last checkpoint's, and the one-line warning for an --average_last window reaching back early."""

import jax
import numpy as np
import pytest

from t2t import data, optim, sharding, train_lib
from t2t.eval import averaging, evaluation, scoring
from t2t.eval import checkpoints as eval_checkpoints
from t2t.run import checkpoint, checkpoint_read
from t2t.train import loop
from tests import toy_corpus

pytestmark = pytest.mark.xdist_group(__name__)

# A toy run of 40 steps whose checkpoints are step 2 (near the initialization: the learning rate
# still warms up) and step 40 (the run is resumed after step 2 with a checkpoint only at its end).
SETTINGS = dict(log_every_steps=20, eval_every_steps=40, keep_checkpoints=10,
                eval_bleu_sentences=0, num_eval_batches=-1, d_model=16, d_ff=32, num_heads=2,
                num_encoder_layers=1, num_decoder_layers=1, learning_rate_scale=2.0,
                warmup_steps=10, beam_size=2, max_decode_len=12, max_decode_extra=4)


def test_the_final_window_and_the_warning():
    steps = [150, 300, 450, 600, 675]  # the 675-step run whose last-5 average halved its BLEU
    assert averaging.final_window(steps, 0.25) == [600, 675]  # steps >= 506.25
    assert averaging.final_window(steps, 1.0) == steps
    assert averaging.final_window([1200], 0.25) == [1200]
    line = averaging.wide_window(steps, 0.25)
    assert line == ("WARNING: averaging steps 150-675 spans 78% of the run's 675 steps, back "
                    'before its final average_fraction=0.25 (steps >= 506): early checkpoints '
                    'can make the average worse than the last checkpoint alone (--average_final '
                    'compares them on validation)')
    assert averaging.wide_window([600, 675], 0.25) is None
    assert averaging.wide_window([96_000, 97_000, 98_000, 99_000, 100_000], 0.25) is None


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    corpus = toy_corpus.make_corpus(tmp_path_factory.mktemp('corpus'))
    workdir = str(tmp_path_factory.mktemp('averaging') / 'run')
    early = toy_corpus.tiny_config(corpus, num_train_steps=2, checkpoint_every_steps=2, **SETTINGS)
    loop.train_and_evaluate(early, workdir)
    config = toy_corpus.tiny_config(corpus, num_train_steps=40, checkpoint_every_steps=40,
                                    **SETTINGS)
    loop.train_and_evaluate(config, workdir)
    assert eval_checkpoints.list_steps(workdir) == [2, 40]
    return {'config': config, 'workdir': workdir}


def _evaluate(config, workdir, **kwargs):
    lines = []
    results = evaluation.run(config, workdir, progress=False, echo=lines.append, **kwargs)
    return results, lines


def _direct_nll(config, params) -> float:
    """The validation NLL of host params, by the training loop's own evaluation."""
    mesh = sharding.make_mesh((-1, 1, 1))
    tokenizer = data.get_tokenizer(config)
    split = data.eval_split(config, tokenizer, config.eval_split)
    step = train_lib.jit_eval_step(train_lib.StepConfig.from_config(config),
                                   sharding.replicated(mesh), mesh)
    params = sharding.put_global(params, sharding.replicated(mesh))
    rows = max(config.eval_batch_size, mesh.size)  # 8 devices, 4 rows: padded to 8, as evaluate
    return loop.evaluate_loss(step, params, split.batches(config.eval_batch_size, rows), mesh,
                              -1)['nll']


def test_an_average_reaching_back_to_an_early_checkpoint_is_not_chosen(run):
    # The default final quarter of the run holds step 40 alone: nothing to average.
    results, lines = _evaluate(run['config'], run['workdir'], average_final=True)
    assert list(results) == ['step-40'] and 'chosen_by_validation_nll' not in results['step-40']
    assert any(line.startswith('--average_final: the run\'s final average_fraction=0.25') and
               'holds one checkpoint' in line for line in lines)

    config = run['config'].copy_and_resolve_references()
    config.average_fraction = 1.0  # the window: the whole run, back to step 2
    results, lines = _evaluate(config, run['workdir'], average_final=True)
    assert list(results) == ['step-40']  # the last checkpoint, not avg2-2-40
    nll = results['step-40']['chosen_by_validation_nll']
    assert set(nll) == {'avg2-2-40', 'step-40'}
    assert nll['avg2-2-40'] > nll['step-40']  # the average is worse on validation
    average = checkpoint_read.average_checkpoints(run['workdir'], [2, 40])
    last = checkpoint_read.restore_params(run['workdir'], 40)
    assert nll['avg2-2-40'] == pytest.approx(_direct_nll(config, average), rel=1e-5)
    assert nll['step-40'] == pytest.approx(_direct_nll(config, last), rel=1e-5)
    said = [line for line in lines if line.startswith('validation NLL')]
    assert len(said) == 1 and said[0].endswith('using step-40')
    assert f'{nll["avg2-2-40"]:.4f} for avg2-2-40' in said[0]

    # The same window by --average_last: evaluated as asked, with the one warning line.
    results, lines = _evaluate(run['config'], run['workdir'], average_last=2)
    assert list(results) == ['avg2-2-40']
    warnings = [line for line in lines if line.startswith('WARNING: averaging')]
    assert warnings == [averaging.wide_window([2, 40], 0.25)]
    # evaluate.py --score with the same window says the same line.
    source, reference = (run['workdir'] + '/../source.txt', run['workdir'] + '/../reference.txt')
    for path, text in ((source, 'red cat .\n'), (reference, '. CAT RED\n')):
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
    lines = []
    scoring.run(run['config'], run['workdir'], input_path=source, references_path=reference,
                output_path=run['workdir'] + '/../scores.tsv', average_last=2,
                echo=lines.append)
    assert lines[0] == averaging.wide_window([2, 40], 0.25) and len(lines) == 2


def test_an_average_better_on_validation_is_chosen(run, tmp_path):
    # Two checkpoints either side of the trained params: their mean is the trained params, so
    # better on validation than the last alone (params minus the noise).
    config = run['config']
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    trained = checkpoint_read.restore_params(run['workdir'], 40)
    leaves, treedef = jax.tree.flatten(trained)
    rng = np.random.default_rng(0)
    noise = [rng.normal(0, 0.3 * (np.std(x) + 1e-3), x.shape).astype(x.dtype) for x in leaves]
    workdir = tmp_path / 'run'
    manager = checkpoint.make_manager(workdir, config, async_=False)
    for step, sign in ((39, 1), (40, -1)):
        shifted = [x + sign * n for x, n in zip(leaves, noise, strict=True)]
        params = jax.tree.unflatten(treedef, shifted)
        params = jax.tree.map(lambda p, s: jax.device_put(p, s.sharding), params, state.params)
        checkpoint.save(manager, step, state.replace(step=state.step + step, params=params))
    checkpoint.close(manager)
    data.get_tokenizer(config)  # the run's vocabulary, where evaluate.py looks for it
    results, lines = _evaluate(config, str(workdir), average_final=True)
    assert list(results) == ['avg2-39-40'] and results['avg2-39-40']['steps'] == [39, 40]
    nll = results['avg2-39-40']['chosen_by_validation_nll']
    assert nll['avg2-39-40'] < nll['step-40']
    assert nll['avg2-39-40'] == pytest.approx(_direct_nll(config, trained), rel=1e-4)
    assert any(line.endswith('using avg2-39-40') for line in lines)
