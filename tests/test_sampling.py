"""Sampling (decode_strategy='sample'), n-best output and forced-decoding scores on a tiny model."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from configs import tiny
from t2t import decode, sharding
from t2t.decode import DecodeConfig
from t2t.eval import evaluation, scoring
from t2t.eval import predict as predict_lib
from t2t.eval.checkpoints import EvalError
from t2t.ids import EOS_ID
from t2t.model import Transformer
from t2t.run import cli
from tests.helpers import run_script
from tests.test_predict import CFG  # a random tiny model's config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

EOS_LIFT = 0.06  # the tied EOS row's value in recall_run (0 leaves hypotheses cut at the limit)
DECODING = DecodeConfig(beam_size=3, length_penalty_alpha=0.6, max_decode_len=24,
                        max_decode_extra=16)
GREEDY = DECODING.replace(decode_strategy='greedy')


@pytest.fixture(scope='module')
def params():
    """A random tiny model: greedy and sampled sentences run to their limits at varied lengths."""
    ids = jnp.ones((1, 8), jnp.int32)
    return nn.unbox(jax.jit(Transformer(CFG).init)(jax.random.key(0), ids, ids))['params']


def _sources(n, seed):
    rng = np.random.default_rng(seed)
    inputs = np.zeros((n, 8), np.int32)
    for row, length in enumerate(rng.integers(2, 8, n)):
        inputs[row, :length - 1] = rng.integers(3, CFG.vocab_size, length - 1)
        inputs[row, length - 1] = EOS_ID
    return inputs


def _sample(params, inputs, sampling: dict, seed=0, mesh=None):
    sample = DECODING.replace(decode_strategy='sample', decode_seed=seed, **sampling)
    predict = predict_lib.make_predict_fn(CFG, sample, mesh=mesh)
    return np.asarray(predict(params, predict_lib.feed(inputs, mesh)).ids_BL)


def test_top_k_one_is_greedy(params):
    inputs = _sources(8, seed=1)
    greedy = predict_lib.make_predict_fn(CFG, GREEDY)
    want = np.asarray(greedy(params, inputs).ids_BL)
    got = _sample(params, inputs, dict(temperature=0.7, top_k=1), seed=5)
    np.testing.assert_array_equal(got, want)
    assert len({tuple(row) for row in want}) > 4  # the rows differ: a real comparison


def test_a_seed_reproduces_a_sentence_whatever_its_batch_and_devices(params):
    sampling = dict(temperature=1.5, top_p=0.95)
    inputs = _sources(8, seed=2)
    first = _sample(params, inputs, sampling)
    np.testing.assert_array_equal(_sample(params, inputs, sampling), first)
    # Other batch mates, rows in another order: rows 0..3 sample what they sampled before.
    others = np.concatenate([_sources(4, seed=3), inputs[:4]])[::-1]
    np.testing.assert_array_equal(_sample(params, others, sampling)[::-1][4:], first[:4])
    # On 8 devices, one row each: the same samples.
    mesh = sharding.make_mesh((-1, 1, 1))
    assert mesh.size == 8
    np.testing.assert_array_equal(_sample(params, inputs, sampling, mesh=mesh), first)
    other_seed = _sample(params, inputs, sampling, seed=1)
    assert (other_seed != first).any(axis=1).sum() >= 4  # most sentences change
    greedy = np.asarray(predict_lib.make_predict_fn(CFG, GREEDY)(params, inputs).ids_BL)
    assert (first != greedy).any()  # sampling at temperature 1.5 is not the argmax


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda **kw: np.isfinite(np.asarray(decode.sampling_logits(logits, **kw)))[0].tolist()
    assert kept() == [True] * 4
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_p=0.7) == [False, True, False, True]  # 0.5 < 0.7, 0.5 + 0.3 is not
    assert kept(top_p=0.81) == [False, True, True, True]
    assert kept(top_p=0.4) == [False, True, False, False]  # the most likely always stays
    assert kept(top_k=3, top_p=0.1) == [False, True, False, False]
    np.testing.assert_allclose(decode.sampling_logits(logits, temperature=2.0),
                               logits / 2.0, rtol=1e-6)


def _tsv(path):
    header, *rows = path.read_text(encoding='utf-8').splitlines()
    return header, [row.split('\t') for row in rows]


@pytest.fixture(scope='module')
def recall_run(tmp_path_factory):
    """A workdir with one checkpoint of a random tiny model of the recall toy, whose fixed
    symbols re-encode exactly what the model generates (the segmentation is the text's)."""
    from configs import recall_toy
    from t2t import data, optim, train_lib
    from t2t.run import checkpoint

    root = tmp_path_factory.mktemp('recall')
    config = recall_toy.get_config()
    config.update(data_dir=str(root / 'data'), d_model=32, d_ff=64, max_position=64,
                  max_decode_len=12, max_decode_extra=4, beam_size=3)
    data.get_tokenizer(config)
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    # EOS lifted (the last LayerNorm's bias 1, the tied EOS row constant): hypotheses end in EOS
    # at varied lengths, so each one's text + EOS is the sequence beam search scored.
    params = jax.tree.map(lambda x: x, state.params)
    norm = params[f'decoder_{config.num_decoder_layers - 1}']['ffn_block']['norm']
    norm['bias'] = jnp.ones_like(norm['bias'])
    params['embedder']['embedding'] = params['embedder']['embedding'].at[EOS_ID].set(EOS_LIFT)
    manager = checkpoint.make_manager(root / 'run', config, async_=False)
    checkpoint.save(manager, 1, state.replace(params=params))
    checkpoint.close(manager)
    return config, str(root / 'run'), root


def test_nbest_scores_are_forced_decoding_scores_over_the_length_penalty(recall_run):
    config, workdir, root = recall_run
    rng = np.random.default_rng(4)
    texts = [' '.join(rng.choice(list('01abcd'), n)) for n in rng.integers(1, 9, 10)]
    texts.insert(2, '')  # a blank line: no rows
    source, out = root / 'in.txt', root / 'nbest.tsv'
    source.write_text(''.join(t + '\n' for t in texts), encoding='utf-8')
    evaluation.run(config, workdir, translate=True, input_path=str(source),
                   output_path=str(out), nbest=3, progress=False, echo=lambda _: None)
    header, rows = _tsv(out)
    assert header == 'index\trank\tscore=log_prob/((5+tokens)/6)^0.6\ttext'
    assert sorted({int(r[0]) for r in rows}) == [i for i in range(11) if i != 2]
    for i in {int(r[0]) for r in rows}:
        mine = [r for r in rows if int(r[0]) == i]
        assert [int(r[1]) for r in mine] == list(range(1, len(mine) + 1))
        scores = [float(r[2]) for r in mine]
        assert scores == sorted(scores, reverse=True)
    assert sum(len({r[3] for r in rows if r[0] == i}) == 3 for i in {r[0] for r in rows}) >= 6

    # evaluate.py --score of the same pairs, and one pair too long to score (counted, not cut).
    sources, targets = root / 'src.txt', root / 'tgt.txt'
    sources.write_text(''.join(texts[int(r[0])] + '\n' for r in rows) + 'a\n', encoding='utf-8')
    targets.write_text(''.join(r[3] + '\n' for r in rows) + 'b ' * 70 + '\n', encoding='utf-8')
    lines = []
    result = scoring.run(config, workdir, input_path=str(sources), references_path=str(targets),
                         output_path=str(root / 'scores.tsv'), echo=lines.append)
    assert result.too_long == [len(rows)] and result.scored == len(rows)
    assert '1 pairs over max_position=64 tokens on a side not scored' in lines[-1]
    header, table = _tsv(root / 'scores.tsv')
    assert header == 'index\ttokens\tlog_prob\tlog_prob_per_token'
    assert table[-1] == [str(len(rows)), '71', '', '']
    for r, (index, tokens, log_prob, per_token) in zip(rows, table[:-1], strict=True):
        n = int(tokens)
        assert n == len(r[3].split()) + 1  # EOS counted
        assert float(per_token) == pytest.approx(float(log_prob) / n, abs=1e-5)
        want = float(log_prob) / float(decode.length_penalty(n, 0.6))
        assert abs(float(r[2]) - want) < 1e-4, (index, r, log_prob)


BAD = [('top_p', 0.0, 'top_p=0.0 must be in (0, 1] (1: every token)'),
       ('top_k', -1, 'top_k=-1 must be >= 0 (0: every token)'),
       ('temperature', 0.0, "temperature=0.0 must be > 0 (1: the model's distribution)"),
       ('temperature', -1.0, "temperature=-1.0 must be > 0 (1: the model's distribution)"),
       ('decode_strategy', 'topk',
        "decode_strategy='topk' must be one of ('beam', 'greedy', 'sample')")]


def test_bad_values_are_one_line_before_any_compile():
    for key, value, line in BAD:
        config = tiny.get_config()
        config[key] = value
        with pytest.raises(SystemExit) as info:
            cli.check_values(config, 'evaluate.py')
        assert str(info.value.code) == f'evaluate.py: {line}'
    with pytest.raises(ValueError, match=r'^nbest=4 must be in \[1, beam_size=3\]$'):
        DECODING.replace(nbest=4)
    with pytest.raises(ValueError, match="^nbest=2 needs decode_strategy=beam"):
        GREEDY.replace(nbest=2)
    with pytest.raises(EvalError, match='^--nbest=2 needs --translate$'):
        evaluation.run(tiny.get_config(), '/nonexistent', nbest=2)
    # The command line: one line, exit 1, from a run that reads no checkpoint and compiles nothing.
    for flags, line in [(['--config.top_p=0'], BAD[0][2]),
                        (['--translate', '--nbest=3'], 'nbest=3 must be in [1, beam_size=2]')]:
        proc = run_script('evaluate.py', '--config=configs/tiny.py', '--workdir=/nonexistent',
                          *flags, timeout=120)
        assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [f'evaluate.py: {line}']


def test_config_keys_reach_the_predict_function(monkeypatch):
    config = tiny.get_config()
    config.update(decode_strategy='sample', temperature=0.5, top_k=7, top_p=0.9, decode_seed=3)
    seen = []
    monkeypatch.setattr(predict_lib, 'make_predict_fn',
                        lambda cfg, decoding, **kwargs: seen.append(decoding))
    predict_lib.config_predict_fn(config, CFG, num_valid_ids=48)
    got = seen[-1]
    assert (got.decode_strategy, got.temperature, got.top_k, got.top_p) == ('sample', 0.5, 7, 0.9)
    assert seen[-1].decode_seed == 3 and seen[-1].nbest == 1
    config.decode_strategy = 'greedy'
    predict_lib.config_predict_fn(config, CFG, num_valid_ids=48, nbest=1)
    assert seen[-1].decode_strategy == 'greedy'
    config.decode_strategy = 'beam'
    predict_lib.config_predict_fn(config, CFG, num_valid_ids=48, nbest=2)
    assert seen[-1].decode_strategy == 'beam' and seen[-1].nbest == 2
