"""loss_impl: the plain loss on the model's logits() and the fused, chunked one are one loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t import loss, train_lib
from t2t.ids import PAD_ID
from t2t.model import Transformer, TransformerConfig

CFG = TransformerConfig(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                        num_decoder_layers=1, dropout_rate=0.1)


def _batch(rows=3, src=7, tgt=6):
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(2, 40, (rows, src)), jnp.int32).at[1, 5:].set(PAD_ID)
    targets = jnp.asarray(rng.integers(2, 40, (rows, tgt)), jnp.int32).at[2, 4:].set(PAD_ID)
    return {'inputs': inputs, 'targets': targets}


BATCH = _batch()
PARAMS = nn.unbox(Transformer(CFG.replace(deterministic=True)).init(
    jax.random.key(0), BATCH['inputs'], BATCH['targets'])['params'])


def _loss_and_grads(step_config, deterministic=True):
    fn = jax.value_and_grad(train_lib.loss_sums, has_aux=True)
    rng = jax.random.key(7)
    return jax.jit(fn, static_argnums=(3, 4))(PARAMS, BATCH, rng, step_config, deterministic)


def _loss(step_config):
    """The loss sum, traced afresh (a new function each call: no jit cache across edits)."""
    fn = jax.jit(lambda p, b: train_lib.loss_sums(p, b, None, step_config, True)[0])
    return fn(PARAMS, BATCH)


def _rel_error(got, want):
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in
              zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True))
    return (num / sum(float(jnp.sum(b ** 2)) for b in jax.tree_util.tree_leaves(want))) ** 0.5


@pytest.mark.parametrize('z_loss, deterministic, chunk_lens', [(0.0, True, (0, 4, (1, 64))),
                                                             (0.1, False, (4,))])
def test_plain_and_fused_losses_and_gradients_are_equal(z_loss, deterministic, chunk_lens):
    """Loss sums equal to rtol 2e-6, NLL sums too, the same argmax count, gradients to a
    relative 1e-5 (float32): without dropout in one chunk and in two (the last padded); with
    dropout (both paths draw the same masks) and the z-loss; (length, tokens): chunks grown."""
    plain = train_lib.StepConfig(model=CFG, loss_impl='plain', z_loss=z_loss)
    (want, want_aux), want_grads = _loss_and_grads(plain, deterministic)
    for chunk in chunk_lens:
        chunk_len, tokens = chunk if isinstance(chunk, tuple) else (chunk, 0)
        fused = train_lib.StepConfig(model=CFG, loss_impl='fused', z_loss=z_loss,
                                     loss_chunk_len=chunk_len, loss_chunk_tokens=tokens)
        (got, got_aux), got_grads = _loss_and_grads(fused, deterministic)
        np.testing.assert_allclose(got, want, rtol=2e-6)
        np.testing.assert_allclose(got_aux['nll_sum'], want_aux['nll_sum'], rtol=2e-6)
        assert got_aux['correct_sum'] == want_aux['correct_sum']
        assert got_aux['tokens'] == want_aux['tokens'] == 16
        assert _rel_error(got_grads, want_grads) < 1e-5, chunk


def test_z_loss_adds_its_weight_times_log_z_squared():
    logits = Transformer(CFG.replace(deterministic=True)).apply(
        {'params': PARAMS}, BATCH['inputs'], BATCH['targets'])
    weights = np.asarray(BATCH['targets'] != PAD_ID, np.float32)
    log_z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    want = 0.1 * (weights * log_z ** 2).sum()
    off = train_lib.StepConfig(model=CFG, z_loss=0.0)
    on = train_lib.StepConfig(model=CFG, z_loss=0.1)
    assert want > 1e-3
    np.testing.assert_allclose(float(_loss(on)) - float(_loss(off)), want, rtol=1e-4)


def test_an_edit_to_logits_reaches_the_default_train_loss(monkeypatch):
    step_config = train_lib.StepConfig(model=CFG)
    assert step_config.loss_impl == 'plain'
    before = _loss(step_config)
    logits = Transformer.logits
    monkeypatch.setattr(Transformer, 'logits', lambda self, *a: 0.5 * logits(self, *a))
    after = _loss(step_config)
    assert abs(float(after) - float(before)) > 1e-3 * float(before)



def test_chunks_grow_to_the_tokens_a_device_holds():
    """loss_chunk_tokens doubles the chunk while a device's rows x positions fit it: few rows a
    device, fewer chunks (each a pass of the float32 dW through memory); many rows, unchanged."""
    assert loss.chunk_length(6, 256, 32, 768) == 128
    assert loss.chunk_length(104, 256, 32, 768) == 32
    assert loss.chunk_length(1, 256, 32, 768) == 256  # never past the length
    assert loss.chunk_length(6, 256, 32) == 32 and loss.chunk_length(6, 256, 0, 768) == 256
    assert loss.chunk_length(6, 20, 32, 768) == 20
