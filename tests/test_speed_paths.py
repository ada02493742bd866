"""Speed and memory paths change no result: fused loss, attention kernels, remat, scan, rng."""

import contextlib
import dataclasses
import fcntl
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from t2t import loss, train_lib
from t2t.attention import (
    attention_mask,
    cudnn_arguments,
    dot_product_attention,
    make_attention_mask,
    splash_attention,
)
from t2t.eval.predict import next_logits
from t2t.ids import PAD_ID
from t2t.model import Transformer, TransformerConfig
from t2t.run import layers_convert

SMALL = dict(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
             num_decoder_layers=3, deterministic=True)
ONE_LAYER = dict(SMALL, num_encoder_layers=1, num_decoder_layers=1)  # where depth adds nothing


def _ids(rng, shape, low=2, high=40):
    return jnp.asarray(rng.integers(low, high, shape), jnp.int32)


def _batch(seed=0, rows=3, src=7, tgt=6):
    rng = np.random.default_rng(seed)
    inputs = _ids(rng, (rows, src)).at[1, 5:].set(PAD_ID)
    targets = _ids(rng, (rows, tgt)).at[2, 4:].set(PAD_ID)
    return {'inputs': inputs, 'targets': targets}


def _init(cfg, batch):
    init = jax.jit(lambda: Transformer(cfg).init(jax.random.key(0), batch['inputs'],
                                                 batch['targets']))
    return nn.unbox(init()['params'])


# ----------------------------------------------------------------------------------------------
# The fused, chunked loss


def _plain_sums(params, batch, cfg, smoothing=0.1):
    """Today's loss: full float32 logits, log-softmax, gold gather, argmax."""
    logits = Transformer(cfg).apply({'params': params}, batch['inputs'], batch['targets'])
    weights = (batch['targets'] != PAD_ID).astype(jnp.float32)
    smoothed, nll = loss.label_smoothed_cross_entropy(logits, batch['targets'], smoothing)
    correct = (jnp.argmax(logits, -1) == batch['targets']).astype(jnp.float32)
    return (smoothed * weights).sum(), {'nll_sum': (nll * weights).sum(),
                                        'correct_sum': (correct * weights).sum()}


def _grads(fn, params, batch, static):
    return jax.jit(jax.value_and_grad(fn, has_aux=True), static_argnums=2)(params, batch, static)


def _rel_error(got, want):
    num = sum(float(jnp.sum((jnp.asarray(a, jnp.float32) - b) ** 2))
              for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                              strict=True))
    den = sum(float(jnp.sum(b ** 2)) for b in jax.tree_util.tree_leaves(want))
    return (num / den) ** 0.5


def test_chunked_loss_equals_the_plain_loss_and_its_gradients():
    batch = _batch()
    cfg = TransformerConfig(**ONE_LAYER)
    params = _init(cfg, batch)
    (want, want_aux), want_grads = _grads(_plain_sums, params, batch, cfg)
    fused = lambda p, b, sc: train_lib.loss_sums(p, b, None, sc, True)
    for chunk_len in (0, 4):  # one chunk; two chunks, the last padded
        step_config = train_lib.StepConfig(model=cfg, loss_impl='fused', loss_chunk_len=chunk_len)
        (got, got_aux), got_grads = _grads(fused, params, batch, step_config)
        np.testing.assert_allclose(got, want, rtol=2e-6)
        np.testing.assert_allclose(got_aux['nll_sum'], want_aux['nll_sum'], rtol=2e-6)
        assert got_aux['correct_sum'] == want_aux['correct_sum']
        assert _rel_error(got_grads, want_grads) < 1e-5
    # bfloat16 compute: the fused loss is as close to the float32 truth as today's loss is.
    bf16 = cfg.replace(dtype=jnp.bfloat16)
    (plain16, _), plain16_grads = _grads(_plain_sums, params, batch, bf16)
    plain_err = _rel_error(plain16_grads, want_grads)
    for chunk_len in (0, 4):  # one chunk compiles to other kernels than a loop of chunks
        (got16, _), got16_grads = _grads(fused, params, batch, train_lib.StepConfig(
            model=bf16, loss_impl='fused', loss_chunk_len=chunk_len))
        assert abs(float(got16) - float(want)) <= (2 * abs(float(plain16) - float(want))
                                                   + 1e-3 * want)
        fused_err = _rel_error(got16_grads, want_grads)
        assert fused_err < 2 * plain_err + 1e-3, (chunk_len, fused_err, plain_err)


def test_fused_loss_backward_matmuls_run_in_the_compute_dtype():
    y = jnp.ones((2, 4, 8), jnp.bfloat16)
    w = jnp.ones((16, 8), jnp.float32)
    t = jnp.ones((2, 4), jnp.int32)
    grad = jax.grad(lambda y, w: loss.cross_entropy_sums(y, w, t, jnp.ones((2, 4)),
                                                         smoothing=0.1, chunk_len=2)[0],
                    argnums=(0, 1))
    text = jax.jit(grad).lower(y, w).as_text()
    dots = [line for line in text.splitlines() if 'dot_general' in line]
    assert len(dots) == 3  # logits, dy, dW: nothing recomputed
    for line in dots:  # bf16 x bf16 -> f32 accumulation, never f32 x bf16
        assert line.count('bf16') >= 2 and '-> tensor<' in line and 'xf32>' in line, line


# ----------------------------------------------------------------------------------------------
# Attention implementations against the reference


def _attention_case(rng, q_len, k_len, packed, causal):
    b, h, k = 2, 2, 8
    q, kk, v = (jnp.asarray(rng.normal(size=(b, n, h, k)), jnp.float32)
                for n in (q_len, k_len, k_len))
    q_valid = jnp.arange(q_len)[None, :] < jnp.asarray([[q_len], [q_len - 3]])
    k_valid = jnp.arange(k_len)[None, :] < jnp.asarray([[k_len - 2], [k_len]])
    q_seg = k_seg = None
    if packed:  # two segments per row, then padding
        q_seg = jnp.where(q_valid, 1 + (jnp.arange(q_len) >= q_len // 2), 0)
        k_seg = jnp.where(k_valid, 1 + (jnp.arange(k_len) >= k_len // 2), 0)
    return (q, kk, v), (q_valid, k_valid, q_seg, k_seg)


@pytest.mark.parametrize('packed,causal', [(False, True), (False, False), (True, True),
                                           (True, False)])
def test_attention_implementations_equal_the_reference(packed, causal):
    rng = np.random.default_rng(1)
    q_len = k_len = 12 if causal else None
    q_len, k_len = (12, 12) if causal else (9, 13)
    (q, k, v), (q_valid, k_valid, q_seg, k_seg) = _attention_case(rng, q_len, k_len, packed,
                                                                  causal)
    dense = attention_mask(q_valid, k_valid, q_seg, k_seg, causal=causal)
    want = dot_product_attention(q, k, v, dense, scale=0.3)
    rows = np.asarray(q_valid)  # padded queries may differ; nothing reads them
    got = {'dot_product': dot_product_attention(
        q, k, v, make_attention_mask('dot_product', q_valid, k_valid, q_seg, k_seg, causal),
        scale=0.3, impl='dot_product')}
    # cuDNN cannot run here: the arguments the model gives it, run by jax's XLA implementation.
    cudnn_mask = make_attention_mask('cudnn', q_valid, k_valid, q_seg, k_seg, causal)
    assert (cudnn_mask.dense_B1QK is None) == (not packed)  # lengths unless rows are packed
    got['cudnn_arguments'] = jax.nn.dot_product_attention(
        q, k, v, scale=0.3, implementation='xla', **cudnn_arguments(cudnn_mask))
    splash_mask = make_attention_mask('splash', q_valid, k_valid, q_seg, k_seg, causal)
    got['splash_interpret'] = splash_attention(q, k, v, splash_mask, scale=0.3, interpret=True)
    if packed and causal:  # per shard under a mesh: batch over (data, fsdp), heads over tensor
        from t2t import sharding

        twice = lambda x: jnp.concatenate([x, x])  # 4 rows: 2 x 2 batch shards
        with jax.set_mesh(sharding.make_mesh((2, 2, 2))), \
                nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            sharded = jax.jit(functools.partial(splash_attention, scale=0.3, interpret=True))(
                twice(q), twice(k), twice(v), jax.tree_util.tree_map(twice, splash_mask))
        got['splash_sharded'] = sharded[2:]
    for name, out in got.items():
        np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(want)[rows], atol=2e-5,
                                   err_msg=name)


@contextlib.contextmanager
def _libtpu_lock():
    """One process at a time may use libtpu (two xdist workers would fail on its lockfile)."""
    with open('/tmp/t2t-libtpu.lock', 'w') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.xdist_group('libtpu')  # with the other libtpu tests, on one worker (test_aot.py)
def test_splash_attention_train_step_compiles_for_a_tpu_slice():
    import libtpu  # noqa: F401  (make test installs jax[tpu]: XLA's TPU compiler, no TPU needed)
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
    from jax.experimental import topologies

    from t2t import sharding

    cfg = TransformerConfig(vocab_size=256, d_model=128, d_ff=256, num_heads=2,
                            num_encoder_layers=1, num_decoder_layers=1, dtype=jnp.bfloat16,
                            attention_impl='splash', scan_layers=True, remat='full')
    step_config = train_lib.StepConfig(model=cfg)
    tx = optax.adam(1e-3)
    with _libtpu_lock():
        topo = topologies.get_topology_desc(platform='tpu', topology_name='v5e:2x2',
                                            chip_config_name='default',
                                            chips_per_host_bounds=(2, 2, 1), num_slices=1)
        mesh = sharding.make_mesh((1, 2, 2), devices=topo.devices)
        init = lambda key: train_lib.init_state(key, cfg, tx, (1, 128))
        boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
        shardings = sharding.tree_shardings(boxed, mesh)
        state = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed),
            shardings)
        batch = {k: jax.ShapeDtypeStruct((4, 128), jnp.int32,
                                         sharding=sharding.batch_sharding(mesh))
                 for k in train_lib.BATCH_KEYS}
        step = train_lib.jit_train_step(step_config, tx, shardings, mesh)
        lowered = step.lower(state, batch)
        assert 'tpu_custom_call' in lowered.as_text()  # the Pallas kernel, not XLA attention
        compiled = lowered.compile({'exec_time_optimization_effort': -1.0})
    assert compiled.memory_analysis().temp_size_in_bytes > 0


# ----------------------------------------------------------------------------------------------
# Scanned layers, checkpoint conversion, remat


def test_scanned_layers_equal_unrolled_ones_and_checkpoints_convert_both_ways():
    batch = _batch(2)
    unrolled_cfg = TransformerConfig(**SMALL)
    scanned_cfg = unrolled_cfg.replace(scan_layers=True)
    unrolled = _init(unrolled_cfg, batch)
    scanned = _init(scanned_cfg, batch)
    assert scanned['encoder_layers']['ffn']['wi']['kernel'].shape == (2, 32, 64)
    assert 'encoder_1' in unrolled and 'encoder_layers' not in unrolled
    # The logical names: a leading 'layers' axis, then the layer's own.
    boxed = jax.eval_shape(lambda: Transformer(scanned_cfg).init(
        jax.random.key(0), batch['inputs'], batch['targets']))
    names = boxed['params']['decoder_layers']['ffn']['wi']['kernel'].names
    assert names == ('layers', 'embed', 'mlp')

    apply = jax.jit(lambda p, b, cfg: Transformer(cfg).apply({'params': p}, b['inputs'],
                                                             b['targets']), static_argnums=2)
    for params, cfg in ((unrolled, unrolled_cfg), (scanned, scanned_cfg)):
        want = apply(params, batch, cfg)
        other_cfg = cfg.replace(scan_layers=not cfg.scan_layers)
        converted = layers_convert.to_layout(params, scan_layers=other_cfg.scan_layers)
        np.testing.assert_allclose(apply(converted, batch, other_cfg), want, atol=2e-5)
        back = layers_convert.to_layout(converted, scan_layers=cfg.scan_layers)
        jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    # A whole train state (Adam's moments too) converts, and to_layout is a no-op when done.
    state = jax.jit(lambda key: nn.unbox(train_lib.init_state(key, unrolled_cfg,
                                                              optax.adam(1e-3), (1, 6))))(
        jax.random.PRNGKey(1))
    state = jax.tree_util.tree_map(np.asarray, state)
    converted = layers_convert.to_scanned(state)
    assert converted.opt_state[0].mu['decoder_layers']['ffn']['wo']['kernel'].shape[0] == 3
    assert jax.tree_util.tree_structure(layers_convert.to_scanned(converted)) == \
        jax.tree_util.tree_structure(converted)


def test_checkpoint_parameters_convert_on_disk(tmp_path):
    from t2t.run import checkpoint, checkpoint_read

    params = {'embedder': {'embedding': np.ones((5, 2), np.float32)},
              **{f'encoder_{i}': {'w': np.full((2, 3), i, np.float32)} for i in range(2)},
              **{f'decoder_{i}': {'w': np.full((3,), i, np.float32)} for i in range(3)}}
    checkpoint.write_averaged(str(tmp_path / 'run'), params, 7)
    layers_convert.main(['--workdir', str(tmp_path / 'run'), '--out', str(tmp_path / 'scanned'),
                         '--to', 'scanned'])
    scanned = checkpoint_read.restore_params(str(tmp_path / 'scanned'), 7)
    np.testing.assert_array_equal(scanned['decoder_layers']['w'], [[0] * 3, [1] * 3, [2] * 3])
    assert checkpoint_read.read_metadata(str(tmp_path / 'scanned'))['layers'] == 'scanned'
    layers_convert.main(['--workdir', str(tmp_path / 'scanned'), '--out',
                         str(tmp_path / 'back'), '--to', 'unrolled'])
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           checkpoint_read.restore_params(str(tmp_path / 'back')), params)


def test_cached_decoding_equals_teacher_forcing_with_scanned_layers():
    cfg = TransformerConfig(**SMALL, scan_layers=True, position_embedding='rope')
    batch = _batch(3, rows=2)
    src, tgt = batch['inputs'], batch['targets'].at[2:].set(0)
    params = _init(cfg, batch)
    model = Transformer(cfg)
    want = jax.jit(model.apply)({'params': params}, src, tgt)
    decoder = Transformer(cfg.replace(decode=True, decode_len=tgt.shape[1]))
    encoded = model.apply({'params': params}, src, method=Transformer.encode)
    prev = jnp.zeros((2, 1), jnp.int32)
    _, variables = decoder.apply({'params': params}, encoded, src, prev,
                                 method=next_logits, mutable=['cache', 'cross_cache'])
    cache, cross = variables['cache'], variables['cross_cache']
    # Batch stays the leading axis of every cache leaf (beam search tiles and gathers it).
    assert all(x.shape[0] == 2 for x in jax.tree_util.tree_leaves(cache) if x.ndim)
    step = jax.jit(lambda cache, prev: decoder.apply(
        {'params': params, 'cache': cache, 'cross_cache': cross}, encoded, src, prev,
        method=next_logits, mutable=['cache']))
    steps = []
    for t in range(tgt.shape[1]):
        logits, updated = step(cache, prev)
        cache = updated['cache']
        steps.append(logits[:, 0])
        prev = tgt[:, t:t + 1]
    np.testing.assert_allclose(jnp.stack(steps, 1), want, atol=1e-4)


def test_remat_policies_leave_loss_and_gradients_unchanged():
    batch = _batch(4)
    cfg = TransformerConfig(**{**ONE_LAYER, 'deterministic': False}, dropout_rate=0.3)
    params = _init(cfg, batch)
    key = jax.random.key(5)
    results = {}
    for remat in ('none', 'full', 'dots_saveable'):
        step_config = train_lib.StepConfig(model=cfg.replace(remat=remat))
        grad = jax.jit(jax.grad(train_lib.loss_sums, has_aux=True), static_argnums=(3, 4))
        results[remat] = grad(params, batch, key, step_config, False)
    for remat in ('full', 'dots_saveable'):  # same dropout masks, same numbers
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                                      atol=1e-6),
                               results[remat], results['none'])


# ----------------------------------------------------------------------------------------------
# Dropout generators


@pytest.mark.parametrize('rng_impl', ['rbg', 'unsafe_rbg'])
def test_rng_impls_train_and_resume_exactly(rng_impl):
    cfg = TransformerConfig(**{**ONE_LAYER, 'deterministic': False}, dropout_rate=0.3)
    tx = optax.adam(1e-2)
    step_config = train_lib.StepConfig(model=cfg, rng_impl=rng_impl)
    state = nn.unbox(train_lib.init_state(jax.random.PRNGKey(0), cfg, tx, (1, 6), rng_impl))
    assert state.rng.shape == (4,) and state.rng.dtype == jnp.uint32  # rbg key data
    step = jax.jit(lambda s, b: train_lib.train_step(s, b, step_config=step_config, tx=tx))
    batches = [_batch(10 + i) for i in range(3)]
    straight = state
    for b in batches:
        straight, metrics = step(straight, b)
    # Resume after one step from host copies (as a checkpoint holds them).
    resumed, _ = step(state, batches[0])
    resumed = jax.tree_util.tree_map(jnp.asarray, jax.device_get(resumed))
    for b in batches[1:]:
        resumed, _ = step(resumed, b)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(straight),
                           jax.device_get(resumed))
    # Dropout is on and uses this generator: threefry draws other masks, another loss.
    threefry = dataclasses.replace(step_config, rng_impl='threefry')
    plain = nn.unbox(train_lib.init_state(jax.random.PRNGKey(0), cfg, tx, (1, 6)))
    _, m_rbg = step(state, batches[0])
    _, m_threefry = jax.jit(lambda s, b: train_lib.train_step(s, b, step_config=threefry,
                                                              tx=tx))(plain, batches[0])
    assert float(m_rbg['loss_sum']) != float(m_threefry['loss_sum'])
    assert np.isfinite(float(metrics['loss_sum']))
