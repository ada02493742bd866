"""The model against the paper: attention, masks, positions, caching, parameter counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from t2t.attention import attention_mask, dot_product_attention
from t2t.eval.predict import next_logits
from t2t.ids import PAD_ID
from t2t.model import (
    Packing,
    Transformer,
    TransformerConfig,
    abstract_params,
    count_params,
    shift_right,
    sinusoidal_table,
)

SMALL = dict(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
             num_decoder_layers=2, deterministic=True)


def _init(cfg, src, tgt):
    return nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), src, tgt)['params'])


def _apply(model, variables, *args, **kwargs):
    """model.apply compiled whole: op-by-op dispatch of a Transformer costs seconds a call."""
    return jax.jit(functools.partial(model.apply, **kwargs))(variables, *args)


def _ids(rng, shape, low=2, high=40):
    return jnp.asarray(rng.integers(low, high, shape), jnp.int32)


def test_attention_equals_naive_numpy():
    rng = np.random.default_rng(0)
    b, q, s, h, k = 2, 3, 5, 2, 4
    q_, k_, v_ = (rng.normal(size=(b, n, h, k)).astype(np.float32) for n in (q, s, s))
    mask = rng.random((b, 1, q, s)) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    got = dot_product_attention(q_, k_, v_, jnp.asarray(mask), scale=k ** -0.5)
    want = np.zeros((b, q, h, k), np.float32)
    for bi in range(b):
        for hi in range(h):
            logits = q_[bi, :, hi] @ k_[bi, :, hi].T / np.sqrt(k)
            logits = np.where(mask[bi, 0], logits, -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            want[bi, :, hi] = w @ v_[bi, :, hi]
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    got_dp = dot_product_attention(q_, k_, v_, jnp.asarray(mask), scale=k ** -0.5,
                                   impl='dot_product')
    np.testing.assert_allclose(np.asarray(got_dp), want, atol=1e-5)


def test_bf16_attention_keeps_its_weights_in_bf16_for_the_gradient():
    """The written-out attention in bfloat16 returns the float32 softmax in bfloat16 and keeps
    only that copy for the backward pass: its gradient is the float32 softmax's to bfloat16
    precision, and the float32 softmax output is not among what the backward pass reads."""
    from jax._src.ad_checkpoint import saved_residuals

    from t2t import attention

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 4, 16)) * 3, jnp.float32)
    g = jnp.asarray(rng.normal(size=logits.shape), jnp.float32)
    kept = attention.softmax_kept_as(logits, jnp.dtype(jnp.bfloat16))
    assert kept.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kept, jax.nn.softmax(logits).astype(jnp.bfloat16))
    got = jax.grad(lambda x: jnp.sum(attention.softmax_kept_as(x, jnp.dtype(jnp.bfloat16))
                                     .astype(jnp.float32) * g))(logits)
    want = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * g))(logits)
    np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.abs(want).max()))
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.bfloat16) for _ in range(3))
    mask = jnp.ones((2, 1, 8, 8), bool)

    def kept(dtype):
        def out(q, k, v):
            w = attention.attention_weights(q, k, mask, 0.5, dtype=dtype).astype(v.dtype)
            return jnp.einsum('bhqs,bshk->bqhk', w, v).astype(jnp.float32).sum()
        return [str(r[0]) for r in saved_residuals(jax.jit(out), q, k, v)]

    # float32 weights: the softmax's output and sums kept; bfloat16: the weights alone (the
    # float32 array left is the mask's fill, a constant).
    assert kept(None).count('float32[2,2,8,8]') == 2 and 'float32[2,2,8,1]' in kept(None)
    bf16 = kept(jnp.bfloat16)
    assert bf16.count('float32[2,2,8,8]') == 1 and 'float32[2,2,8,1]' not in bf16, bf16
    assert 'bfloat16[2,2,8,8]' in bf16


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_softmax_residual_compute_changes_only_bfloat16_gradients_and_by_its_rounding(dtype):
    """The lever through the model: in float32 both settings are one program (bitwise equal
    gradients); in bfloat16 'compute' differs from the textbook 'float32' by the rounding of the
    kept weights, well within bfloat16's own error."""
    rng = np.random.default_rng(3)
    src, tgt = _ids(rng, (2, 6)), _ids(rng, (2, 5))
    params = _init(TransformerConfig(**SMALL), src, tgt)
    g = jnp.asarray(rng.normal(size=(2, 5, SMALL['vocab_size'])), jnp.float32)

    def grads(residual):
        model = Transformer(TransformerConfig(**SMALL, dtype=dtype, softmax_residual=residual))
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply({'params': p}, src, tgt) * g)))(
            params)

    textbook, kept = jax.tree.leaves(grads('float32')), jax.tree.leaves(grads('compute'))
    differ = [float(jnp.abs(a - b).max() / (jnp.abs(a).max() + 1e-30))
              for a, b in zip(textbook, kept, strict=True)]
    if dtype == jnp.float32:
        assert max(differ) == 0.0
    else:
        assert 0.0 < max(differ) < 0.05, differ
    with pytest.raises(ValueError, match="softmax_residual='bf16'"):
        TransformerConfig(**SMALL, softmax_residual='bf16')


def test_sinusoidal_table_matches_paper_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            np.testing.assert_allclose(table[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 16)),
                                       atol=1e-6)
            np.testing.assert_allclose(table[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 16)),
                                       atol=1e-6)


def test_decoder_is_causal_through_gradients():
    # Separate, untied embeddings: the target table feeds only the decoder inputs, so the gradient
    # of output t w.r.t. the row of target token j is the dependence of output t on target j.
    cfg = TransformerConfig(**SMALL, share_embeddings=False, tie_output=False)
    src = jnp.asarray([[20, 21, 22, 23, 24, 25]], jnp.int32)
    tgt = jnp.asarray([[3, 4, 5, 6, 7, 8, 9]], jnp.int32)  # distinct: one table row per position
    params = _init(cfg, src, tgt)
    model = Transformer(cfg)
    encoded = _apply(model, {'params': params}, src, method=Transformer.encode)
    table_VD = params['target_embedder']['embedding']

    @jax.jit
    def grad_of_output_t(table, t):
        def output_t(table):
            p = {'params': dict(params, target_embedder={'embedding': table})}
            return model.apply(p, encoded, src, tgt, method=Transformer.decode)[0, t].sum()
        return jax.grad(output_t)(table)

    for t in range(tgt.shape[1]):
        grad_VD = grad_of_output_t(table_VD, t)
        per_target = np.asarray(jnp.abs(grad_VD[tgt[0]]).sum(-1))
        # Targets are shifted right: output t sees targets 0..t-1 and never t or later.
        assert np.all(per_target[t:] == 0), (t, per_target)
        assert np.all(per_target[:t] > 0), (t, per_target)


def test_padding_the_source_leaves_real_positions_unchanged():
    cfg = TransformerConfig(**SMALL)
    rng = np.random.default_rng(2)
    src, tgt = _ids(rng, (2, 5)), _ids(rng, (2, 6))
    params = _init(cfg, src, tgt)
    model = Transformer(cfg)
    logits = _apply(model, {'params': params}, src, tgt)
    src_padded = jnp.pad(src, ((0, 0), (0, 4)), constant_values=PAD_ID)
    tgt_padded = jnp.pad(tgt, ((0, 0), (0, 3)), constant_values=PAD_ID)
    logits_padded = _apply(model, {'params': params}, src_padded, tgt_padded)
    np.testing.assert_allclose(logits_padded[:, :6], logits, atol=1e-5)


def test_packed_batch_equals_sequences_one_by_one():
    for position_embedding in ('sinusoidal', 'rope'):
        cfg = TransformerConfig(**SMALL, position_embedding=position_embedding)
        rng = np.random.default_rng(3)
        pairs = [(_ids(rng, (1, 4)), _ids(rng, (1, 3))), (_ids(rng, (1, 3)), _ids(rng, (1, 5)))]
        params = _init(cfg, *pairs[0])
        model = Transformer(cfg)
        singles = [_apply(model, {'params': params}, s, t) for s, t in pairs]

        def pack(parts, length):
            ids = jnp.concatenate([p[0] for p in parts])
            seg = jnp.concatenate([jnp.full(p.shape[1], i + 1) for i, p in enumerate(parts)])
            pos = jnp.concatenate([jnp.arange(p.shape[1]) for p in parts])
            pad = length - ids.shape[0]
            return [jnp.pad(x, (0, pad))[None].astype(jnp.int32) for x in (ids, seg, pos)]

        src, src_seg, src_pos = pack([s for s, _ in pairs], 9)
        tgt, tgt_seg, tgt_pos = pack([t for _, t in pairs], 10)
        packed = _apply(model, {'params': params}, src, tgt,
                        Packing(src_seg, tgt_seg, src_pos, tgt_pos))
        np.testing.assert_allclose(packed[0, :3], singles[0][0], atol=1e-5)
        np.testing.assert_allclose(packed[0, 3:8], singles[1][0], atol=1e-5)


def test_shift_right_restarts_each_segment():
    tgt = jnp.asarray([[5, 6, 7, 8, 9, 0]])
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(tgt, seg), [[0, 5, 0, 7, 8, 0]])
    np.testing.assert_array_equal(shift_right(tgt), [[0, 5, 6, 7, 8, 9]])


def test_attention_mask_segments_and_causality():
    valid = jnp.asarray([[True, True, True, False]])
    seg = jnp.asarray([[1, 1, 2, 0]])
    m = np.asarray(attention_mask(valid, valid, seg, seg, causal=True))[0, 0]
    np.testing.assert_array_equal(m, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize('variant', [
    dict(), dict(position_embedding='rope', pre_ln=True), dict(position_embedding='learned'),
    dict(share_embeddings=False, tie_output=False),
])
def test_cached_decoding_equals_teacher_forcing(variant):
    cfg = TransformerConfig(**SMALL, **variant)
    rng = np.random.default_rng(4)
    src = _ids(rng, (2, 7)).at[1, 5:].set(PAD_ID)
    tgt = _ids(rng, (2, 6))
    params = _init(cfg, src, tgt)
    model = Transformer(cfg)
    want = _apply(model, {'params': params}, src, tgt)

    decoder = Transformer(cfg.replace(decode=True, decode_len=tgt.shape[1]))
    encoded = _apply(model, {'params': params}, src, method=Transformer.encode)
    prev = jnp.zeros((2, 1), jnp.int32)
    _, variables = _apply(decoder, {'params': params}, encoded, src, prev,
                          method=next_logits, mutable=['cache', 'cross_cache'])
    cache, cross_cache = variables['cache'], variables['cross_cache']
    step = jax.jit(functools.partial(decoder.apply, method=next_logits, mutable=['cache']))
    steps = []
    for t in range(tgt.shape[1]):
        logits, updated = step(
            {'params': params, 'cache': cache, 'cross_cache': cross_cache}, encoded, src, prev)
        cache = updated['cache']
        steps.append(logits[:, 0])
        prev = tgt[:, t:t + 1]
    np.testing.assert_allclose(jnp.stack(steps, 1), want, atol=1e-4)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = TransformerConfig(**SMALL, dtype=jnp.bfloat16)
    rng = np.random.default_rng(5)
    src, tgt = _ids(rng, (2, 5)), _ids(rng, (2, 4))
    params = _init(cfg, src, tgt)
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype('float32')}
    logits = _apply(Transformer(cfg), {'params': params}, src, tgt)
    assert logits.dtype == jnp.float32
    ref = _apply(Transformer(TransformerConfig(**SMALL)), {'params': params}, src, tgt)
    # bfloat16 keeps 8 significant bits: each rounding is within 2^-9 (0.2%) relative, and the
    # logits come out of about 20 roundings in sequence (2 + 2 layers of projections, softmax
    # inputs, FFN, the final matmul's inputs); independent errors add up to about
    # sqrt(20) * 0.2% = 0.9% (measured: 0.7-1.2% of the largest logit over 5 seeds, RMS 0.7-1.2%).
    # 3% leaves room for unlucky seeds; a float32 step done in bfloat16 twice would not pass 10%.
    err = jnp.abs(logits - ref)
    assert float(err.max()) < 0.03 * float(jnp.abs(ref).max())
    assert float(jnp.sqrt(jnp.mean(err ** 2))) < 0.02 * float(jnp.sqrt(jnp.mean(ref ** 2)))


@pytest.mark.parametrize('name,d,ff,heads,want,with_bias', [
    ('base', 512, 2048, 8, 63_045_632, 63_082_496),
    ('big', 1024, 4096, 16, 214_171_648, 214_245_376)])
def test_parameter_counts_equal_the_papers_architecture(name, d, ff, heads, want, with_bias):
    cfg = TransformerConfig(vocab_size=37000, d_model=d, d_ff=ff, num_heads=heads)
    assert count_params(abstract_params(cfg)) == want, name
    # attention_bias=True: the counts of checkpoints written with biases; exactly q/k/v/o biases
    # (4 x d_model) in each of the 6 + 2 x 6 attentions more.
    biased = count_params(abstract_params(cfg.replace(attention_bias=True)))
    assert biased == with_bias == want + 18 * 4 * d, name


def test_variants_change_parameter_counts_as_expected():
    base = TransformerConfig(vocab_size=1000, d_model=64, d_ff=128, num_heads=4)
    n = count_params(abstract_params(base))
    pre = count_params(abstract_params(base.replace(pre_ln=True)))
    assert pre == n + 2 * 2 * 64  # one final LayerNorm (scale + bias) per stack
    untied = count_params(abstract_params(
        base.replace(share_embeddings=False, tie_output=False)))
    assert untied == n + 2 * 1000 * 64
    learned = count_params(abstract_params(
        base.replace(position_embedding='learned')))
    assert learned == n + base.max_position * 64


def test_bad_model_configs_are_rejected():
    with pytest.raises(ValueError, match='num_heads'):
        TransformerConfig(vocab_size=10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match='position_embedding'):
        TransformerConfig(vocab_size=10, position_embedding='alibi')


@pytest.mark.parametrize('attention_bias', [True, False])
def test_attention_parameters_keep_the_names_shapes_and_axes_of_earlier_checkpoints(
        attention_bias):
    # Checkpoints written before attention_bias have q/k/v kernels [D, H, K] with biases [H, K]
    # and an output kernel [H, K, D] with a bias [D]: attention_bias=True restores them as they are.
    cfg = TransformerConfig(**SMALL, attention_bias=attention_bias)
    ids = jnp.ones((1, 4), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), ids, ids))['params']
    for layer, kind in (('encoder_0', 'self_attention'), ('decoder_1', 'cross_attention')):
        got = {f'{proj}/{name}': (tuple(p.value.shape), p.names)
               for proj, leaves in boxed[layer][kind].items() for name, p in leaves.items()}
        want = {f'{proj}/kernel': ((32, 4, 8), ('embed', 'heads', 'kv'))
                for proj in ('query', 'key', 'value')}
        want['out/kernel'] = ((4, 8, 32), ('heads', 'kv', 'embed'))
        if attention_bias:
            want.update({f'{proj}/bias': ((4, 8), ('heads', 'kv'))
                         for proj in ('query', 'key', 'value')})
            want['out/bias'] = ((32,), ('embed',))
        assert got == want, (layer, kind)


def test_an_edit_to_the_written_out_attention_reaches_the_paper_configs_training(monkeypatch):
    """Under the wmt14 configs' attention_impl (and loss_impl, dtype), changing
    attention.attention_weights changes the train step's loss: the kernel that runs is the
    formula on the page."""
    from configs import wmt14_ende_base, wmt14_ende_big, wmt14_enfr_big
    from t2t import attention, train_lib

    configs = [m.get_config() for m in (wmt14_ende_base, wmt14_ende_big, wmt14_enfr_big)]
    assert len({c.attention_impl for c in configs}) == 1
    config = configs[0].unlock()
    config.update(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                  num_decoder_layers=1)
    step_config = train_lib.StepConfig.from_config(config)
    rng = np.random.default_rng(0)
    batch = {'inputs': _ids(rng, (2, 5)), 'targets': _ids(rng, (2, 4))}
    params = _init(step_config.model.replace(deterministic=True), batch['inputs'],
                   batch['targets'])

    def loss():  # traced afresh each time: the edit below is seen
        fn = jax.jit(lambda p, b: train_lib.loss_sums(p, b, None, step_config, True)[0])
        return float(fn(params, batch))

    before = loss()
    written_out = attention.attention_weights
    monkeypatch.setattr(attention, 'attention_weights',
                        lambda q, k, mask, scale, **kw: written_out(q, k, mask, 3 * scale, **kw))
    assert abs(loss() - before) > 1e-4 * abs(before)
