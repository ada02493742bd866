"""Attention maps sown by the model itself, and their picture (t2t/eval/attention_maps.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t import optim, sharding, train_lib
from t2t.eval import attention_maps
from t2t.eval import checkpoints as eval_checkpoints
from t2t.model import Transformer, TransformerConfig
from t2t.run import checkpoint
from tests import toy_corpus
from tests.helpers import tiny_config

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


def test_sowing_is_off_by_default_and_changes_nothing():
    config = TransformerConfig(vocab_size=20, d_model=16, d_ff=32, num_heads=2,
                               num_encoder_layers=1, num_decoder_layers=2, deterministic=True)
    inputs = jnp.array([[5, 6, 7, 1, 0]], jnp.int32)  # one padding key
    targets = jnp.array([[8, 9, 1]], jnp.int32)
    params = jax.jit(Transformer(config).init)(jax.random.key(0), inputs, targets)['params']

    @jax.jit
    def forward(params):  # the training forward pass, asked to keep intermediates
        return Transformer(config).apply({'params': params}, inputs, targets,
                                         mutable=['intermediates'])

    plain, state = forward(params)
    assert not state  # training pays nothing: no weights are kept
    maps = attention_maps.attention_weights(config, params, inputs, targets)
    assert [len(maps[k]) for k in attention_maps.KINDS] == [1, 2, 2]
    enc, dec, cross = (maps[k][0][0] for k in attention_maps.KINDS)  # layer 1, example 0: [H, Q, K]
    assert enc.shape == (2, 5, 5) and dec.shape == (2, 3, 3) and cross.shape == (2, 3, 5)
    for w in (enc[:, :4], dec, cross):
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert np.all(enc[:, :4, 4] < 1e-6) and np.all(cross[:, :, 4] < 1e-6)  # the padding key
    assert np.all(np.triu(dec, k=1) < 1e-6)  # causal: no weight on later target positions
    # Sowing changes nothing else: the sown pass gives the same logits.
    sown = config.replace(sow_attention=True)
    logits = jax.jit(Transformer(sown).apply)({'params': params}, inputs, targets)
    np.testing.assert_allclose(logits, plain, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope='module')
def tiny_checkpoint(tmp_path_factory):
    """configs/tiny.py (2+2 layers, 4 heads) on the toy corpus, random weights, one checkpoint."""
    root = tmp_path_factory.mktemp('attention')
    corpus = toy_corpus.make_corpus(root)
    config = tiny_config(corpus, max_decode_len=8, max_decode_extra=4)
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    workdir = root / 'run'
    manager = checkpoint.make_manager(workdir, config, async_=False)
    checkpoint.save(manager, 1, state)
    checkpoint.close(manager)
    return config, str(workdir)


def test_png_has_one_panel_per_layer_head_and_kind(tiny_checkpoint, tmp_path):
    config, workdir = tiny_checkpoint
    maps = attention_maps.sentence_maps(config, workdir, 'the red cat sees a dog .')
    assert maps.label == 'step-1' and maps.source_pieces[-1] == '</s>'
    assert maps.decoder_input_pieces[0] == attention_maps.START_PIECE
    assert maps.decoder_input_pieces[1:] == maps.output_pieces[:-1]
    s, t = len(maps.source_pieces), len(maps.output_pieces)
    assert 1 <= t <= 8 and ''.join(maps.source_pieces).replace('▁', ' ').strip().startswith('the')
    assert maps.weights[attention_maps.KINDS[2]][0].shape == (4, t, s)
    path = tmp_path / 'attention.png'
    figure = attention_maps.plot(maps, str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    layers, heads = 2, 4
    assert len(figure.axes) == layers * heads * 3  # encoder self, decoder self, cross
    titles = [ax.get_title() for ax in figure.axes]
    assert titles.count('layer 2 head 4') == 3
    bottom_left = figure.axes[layers * heads - heads]  # encoder block, last layer, head 1
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == maps.source_pieces
    with pytest.raises(eval_checkpoints.EvalError, match='at most max_eval_len'):
        attention_maps.sentence_maps(config, workdir, 'a ' * 100)
