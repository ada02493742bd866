"""Ensembles (evaluate.py --ensemble, t2t/eval/ensemble.py): the mean of the members'
log-probabilities inside the jitted searches, on one device and on 8, and the members' checks."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t import data, optim, sharding, train_lib
from t2t.data import identity
from t2t.decode import DecodeConfig, length_penalty
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import ensemble, evaluation
from t2t.eval import predict as predict_lib
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import Transformer, TransformerConfig
from t2t.run import checkpoint, checkpoint_read
from tests.helpers import source_rows
from tests.test_evaluate import _config, _read_lines

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

# Two members of other sizes and depths, one vocabulary.
CFG_A = TransformerConfig(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, max_position=32, deterministic=True)
CFG_B = CFG_A.replace(d_model=16, d_ff=48, num_heads=2, num_encoder_layers=1,
                      num_decoder_layers=1)
DECODING = DecodeConfig(beam_size=3, length_penalty_alpha=0.6, max_decode_len=12,
                        max_decode_extra=5)
SRC_LENS = (7, 2, 5, 3, 8, 4, 6, 2)  # EOS included


def _init(cfg, seed):
    ids = jnp.ones((1, 8), jnp.int32)
    return nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(seed), ids, ids))['params']


@pytest.fixture(scope='module')
def members():
    return (_init(CFG_A, 0), _init(CFG_B, 1))


@pytest.fixture(scope='module')
def inputs_BS():
    return source_rows(SRC_LENS, 8, CFG_A.vocab_size, seed=2)


@functools.partial(jax.jit, static_argnums=0)
def _forced_log_probs(cfg, params, inputs_BS, ids_BL):
    """The plain model's log-probabilities of every position, teacher-forced on ids_BL."""
    return jax.nn.log_softmax(Transformer(cfg).apply({'params': params}, inputs_BS, ids_BL))


def _lengths(ids_BL):
    """Tokens of each hypothesis, EOS included."""
    return [ids.index(EOS_ID) + 1 if EOS_ID in ids else sum(i != PAD_ID for i in ids)
            for ids in ids_BL.tolist()]


def test_an_ensemble_of_a_model_with_itself_is_the_model(members, inputs_BS):
    params = members[0]
    alone = predict_lib.make_predict_fn(CFG_A, DECODING)(params, inputs_BS)
    twice = predict_lib.make_predict_fn((CFG_A, CFG_A), DECODING)((params, params), inputs_BS)
    np.testing.assert_array_equal(twice.ids_BL, alone.ids_BL)
    np.testing.assert_array_equal(twice.hit_limit_B, alone.hit_limit_B)
    np.testing.assert_allclose(twice.score_B, alone.score_B, rtol=0, atol=1e-5)
    # Real searches: rows of different lengths (random models run to each row's own limit) and
    # scores.
    assert len(set(_lengths(np.asarray(alone.ids_BL)))) >= 3
    assert len(np.unique(np.asarray(twice.score_B))) == len(SRC_LENS)


def test_two_members_equal_the_hand_averaged_reference_on_8_devices(members, inputs_BS):
    """Greedy: each token is the argmax of the mean of the two plain models' teacher-forced
    log-probabilities. Beam: each score is the mean of the members' sums over the penalty."""
    mesh = sharding.make_mesh((-1, 1, 1))
    assert mesh.size == 8
    on_mesh = sharding.put_global(members, sharding.replicated(mesh))
    B = len(SRC_LENS)
    got = {}
    for strategy in ('greedy', 'beam'):
        predict = predict_lib.make_predict_fn(
            (CFG_A, CFG_B), DECODING.replace(decode_strategy=strategy), mesh=mesh)
        got[strategy] = predict_lib.fetch(predict(on_mesh, predict_lib.feed(inputs_BS, mesh)), B)

    ids_BL = got['greedy'].ids_BL
    mean_BLV = np.mean([np.asarray(_forced_log_probs(cfg, p, inputs_BS, ids_BL))
                        for cfg, p in zip((CFG_A, CFG_B), members, strict=True)], axis=0)
    mean_BLV[..., PAD_ID] = -np.inf
    steps = 0
    for row, n in enumerate(_lengths(ids_BL)):
        for t in range(n):
            chosen = mean_BLV[row, t, ids_BL[row, t]]
            assert chosen >= mean_BLV[row, t].max() - 1e-5, (row, t)
            steps += 1
    assert steps > 3 * B

    beam = got['beam']
    alone = predict_lib.make_predict_fn(CFG_A, DECODING)(members[0], inputs_BS)
    assert (np.asarray(alone.ids_BL) != beam.ids_BL).any(axis=1).sum() >= 2  # B changes A's
    sums = [np.take_along_axis(np.asarray(_forced_log_probs(cfg, p, inputs_BS, beam.ids_BL)),
                               beam.ids_BL[..., None], -1)[..., 0]
            for cfg, p in zip((CFG_A, CFG_B), members, strict=True)]
    want = [np.mean([s[row, :n].sum() for s in sums]) / float(length_penalty(n, 0.6))
            for row, n in enumerate(_lengths(beam.ids_BL))]
    np.testing.assert_allclose(beam.score_B, want, rtol=0, atol=1e-4)
    assert len(set(_lengths(beam.ids_BL))) >= 3


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Workdirs of random tiny models on one vocabulary: `a` (checkpoint 1) and `b` (other
    sizes, another seed, checkpoint 4), and `c`, a's params recording another vocabulary."""
    root = tmp_path_factory.mktemp('ensemble')
    config = _config(root)
    tokenizer = data.get_tokenizer(config)
    mesh = sharding.make_mesh(config.mesh_shape)
    b_config = _config(root, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                       num_decoder_layers=1, seed=1)
    states = {name: train_lib.create_sharded_state(c, mesh, optim.make_optimizer(c))[0]
              for name, c in (('a', config), ('b', b_config))}
    for name, run_config, step, vocab in (
            ('a', config, 1, identity.vocab_digest(tokenizer)),
            ('b', b_config, 4, identity.vocab_digest(tokenizer)), ('c', config, 1, 'f' * 64)):
        workdir = root / name
        identity.pin_vocabulary(workdir, tokenizer, write=True)
        manager = checkpoint.make_manager(workdir, run_config, async_=False)
        checkpoint.save(manager, step, states.get(name, states['a']),
                        extra_metadata={identity.DATA_KEY: {'vocab_sha256': vocab}})
        checkpoint.close(manager)
    return {'root': root, 'config': config, 'b_config': b_config,
            **{k: str(root / k) for k in 'abc'}}


def _run(runs, **kwargs):
    lines = []
    results = evaluation.run(runs['config'], runs['a'], progress=False, echo=lines.append,
                             **kwargs)
    return results, '\n'.join(lines)


def test_evaluate_ensemble_of_two_runs_of_other_sizes_and_translate(runs, tmp_path):
    """Through evaluate.py's logic on one device: the validation split scored and --translate,
    each member its own recorded model."""
    devices = jax.devices()[:1]
    results, report = _run(runs, ensemble=f'1, {runs["b"]}', split='validation',
                           devices=devices)
    assert list(results) == ['ens-step-1+b-step-4'] and 'ens-step-1+b-step-4' in report
    record = results['ens-step-1+b-step-4']
    assert record['ensemble_mean'] == 'log_prob' and record['steps'] == [1, 4]
    assert [(m['step'], m['d_model'], m['layers']) for m in record['ensemble']] == [
        (1, 32, [2, 2]), (4, 16, [1, 1])]
    hypotheses = _read_lines(record['hypotheses_file'])
    assert len(hypotheses) == record['sentences'] == 8 and len(set(hypotheses)) >= 3
    assert hypotheses != hypotheses[::-1]  # so the reversed --translate below shows the order
    sources = [line.split('\t')[0] for line in _read_lines(runs['root'] / 'validation.tsv')]
    source, target = tmp_path / 'in.txt', tmp_path / 'out.txt'
    source.write_text('\n'.join(sources[::-1]) + '\n', encoding='utf-8')
    _run(runs, ensemble=f'1,{runs["b"]}', translate=True, input_path=str(source),
         output_path=str(target), devices=devices)
    assert _read_lines(target) == hypotheses[::-1]


def test_member_errors_are_one_line_before_anything_is_restored(runs, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError('restored or compiled before the members were checked')

    monkeypatch.setattr(eval_checkpoints, 'load_params', refuse)
    monkeypatch.setattr(predict_lib, 'make_predict_fn', refuse)
    problems = {f'1,{runs["c"]}': 'trained with vocabulary ffffffffffff but --workdir',
                '1': 'give two or more members', '1,7': 'no checkpoint for step 7',
                f'1,{runs["root"]}/none': 'does not exist'}
    for spec, message in problems.items():
        with pytest.raises(eval_checkpoints.EvalError) as info:
            _run(runs, ensemble=spec)
        assert message in str(info.value) and '\n' not in str(info.value), spec
    with pytest.raises(eval_checkpoints.EvalError, match='takes no --step'):
        _run(runs, ensemble='1,1', step=1)
    # A member's own architecture comes from its checkpoint, how to run it from --config.
    config = _config(runs['root'], dtype='bfloat16')
    meta_config = checkpoint_read.read_metadata(runs['b'])['config']
    got = ensemble.member_model_config(config, meta_config)
    assert (got.d_model, got.num_encoder_layers, got.dtype) == (16, 1, jnp.bfloat16)
    assert os.path.exists(os.path.join(runs['b'], identity.VOCAB_NAME))


def test_score_with_an_ensemble_is_the_mean_of_its_members_and_takes_an_average(runs, tmp_path):
    """evaluate.py --score --ensemble: each pair's log_prob is the mean of the members' (a sum
    over tokens of per-token means); an average written by --write_averaged is a member (its
    recorded vocabulary is checked)."""
    from t2t.eval import scoring

    config, devices = runs['config'], jax.devices()[:1]
    pairs = [line.split('\t') for line in _read_lines(runs['root'] / 'validation.tsv')]
    source, reference = tmp_path / 'src.txt', tmp_path / 'ref.txt'
    source.write_text(''.join(s + '\n' for s, _ in pairs), encoding='utf-8')
    reference.write_text(''.join(t + '\n' for _, t in pairs), encoding='utf-8')
    # Two checkpoints of b's params in workdir d, their average (b's params) written to avg.
    params = eval_checkpoints.load_params(runs['b'], [4])
    digest = identity.vocab_digest(data.get_tokenizer(config))
    for step in (1, 2):
        checkpoint.write_averaged(str(tmp_path / 'd'), params, step, runs['b_config'],
                                  {identity.DATA_KEY: {'vocab_sha256': digest}})
    evaluation._params_for(runs['b_config'], str(tmp_path / 'd'), 'avg2-1-2', [1, 2],
                           str(tmp_path / 'avg'), sharding.make_mesh((-1, 1, 1), devices), 'raw')
    assert not os.path.exists(tmp_path / 'avg' / identity.VOCAB_NAME)  # the digest is recorded

    def score(**kwargs):
        lines = []
        got = scoring.run(config, runs['a'], input_path=str(source),
                          references_path=str(reference), output_path=str(tmp_path / 'out.tsv'),
                          echo=lines.append, devices=devices, **kwargs)
        assert got.scored == len(pairs) == 8
        return np.array(got.log_probs), lines[-1]

    alone, line = score()
    assert line.startswith('== step-1: scored 8 of 8 pairs')
    b_twice, line = score(ensemble=f'{tmp_path / "avg"},{tmp_path / "avg"}')
    assert line.startswith('== ens-avg-step-2+avg-step-2: scored 8 of 8 pairs')
    both, _ = score(ensemble=f'1,{runs["b"]}')
    assert np.abs(alone - b_twice).min() > 0.1  # two different models
    np.testing.assert_allclose(both, (alone + b_twice) / 2, rtol=0, atol=1e-4)
    with pytest.raises(eval_checkpoints.EvalError, match='takes no --step'):
        score(ensemble=f'1,{runs["b"]}', step=1)
