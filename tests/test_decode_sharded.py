"""Beam search under the prediction function's shard_map: every attention kernel, CPU and TPU.

On the 8 CPU devices the sharded predict (each device decoding its own rows, padded batches)
equals the unsharded one for the kernels that run here: xla, dot_product, and splash through its
Python interpretation. The splash kernel, called inside a shard_map, runs on the local block, or
splits it over the mesh axes the shard_map left automatic. For a TPU slice (v5e:2x2, libtpu's
compiler, no TPU needed) the predict compiles with xla, dot_product and splash; cudnn is not a
TPU kernel (cuDNN is NVIDIA's GPU library) and is refused in one line before any compile.
"""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec

from t2t import attention, model, sharding
from t2t.aot import tpu as aot
from t2t.decode import DecodeConfig
from t2t.eval import predict as predict_lib
from t2t.ids import EOS_ID
from t2t.model import Transformer, TransformerConfig
from tests.helpers import ROOT, source_rows
from tests.test_aot import _env, libtpu_lock

# One xdist worker runs every test that compiles with libtpu (--dist loadgroup), one at a time
# (libtpu_lock), while the other goes on with the rest; and its module fixtures are computed once.
pytestmark = pytest.mark.xdist_group('libtpu')

CFG = TransformerConfig(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                        num_decoder_layers=1, max_position=32, deterministic=True)
DECODING = DecodeConfig(beam_size=3, max_decode_len=12, max_decode_extra=4)
SRC_LENS = (9, 2, 6, 4, 10, 3, 7, 1, 5, 8, 2)  # EOS included; 11 rows, padded to 16 by `feed`


def _init_boxed(rng):
    ids = jnp.ones((1, 10), jnp.int32)
    return Transformer(CFG).init(rng, ids, ids)['params']


@pytest.fixture(scope='module')
def inputs_BS():
    return source_rows(SRC_LENS, 10, CFG.vocab_size, seed=3)


@pytest.fixture(scope='module')
def unsharded(inputs_BS):
    """The reference: xla attention, one device, host parameters."""
    params = nn.unbox(jax.jit(_init_boxed)(jax.random.key(0)))
    predict = predict_lib.make_predict_fn(CFG, DECODING)
    return params, jax.device_get(predict(params, inputs_BS))


@pytest.mark.parametrize('impl', ['xla', 'dot_product', 'splash'])
def test_sharded_predict_equals_unsharded(impl, inputs_BS, unsharded, monkeypatch):
    params, want = unsharded
    if impl == 'splash':  # the Pallas kernel's Python interpretation: the TPU kernel on a CPU
        monkeypatch.setattr(attention, 'splash_attention',
                            functools.partial(attention.splash_attention, interpret=True))
    mesh = sharding.make_mesh((2, 2, 2))  # rows over all 8 devices: 2 each
    sharded_params, _ = sharding.init_sharded(_init_boxed, mesh, jax.random.key(0))
    predict = predict_lib.make_predict_fn.__wrapped__(  # uncached: traced with this kernel
        CFG.replace(attention_impl=impl), DECODING, mesh=mesh)
    B = len(SRC_LENS)
    # Traced as the training loop may call it, with the training step's mesh and axis rules
    # active: inside the shard_map they must not reach the model.
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        got = predict_lib.fetch(predict(sharded_params, predict_lib.feed(inputs_BS, mesh)), B)
    assert got.ids_BL.shape == want.ids_BL.shape == (B, DECODING.max_decode_len)
    np.testing.assert_array_equal(got.ids_BL, want.ids_BL)
    np.testing.assert_array_equal(got.hit_limit_B, want.hit_limit_B)
    np.testing.assert_array_equal(got.capped_B, want.capped_B)
    np.testing.assert_allclose(got.score_B, want.score_B, rtol=1e-5, atol=1e-5)
    # Real searches: finite scores that differ by row, some hypotheses ending in EOS.
    assert np.all(np.isfinite(want.score_B)) and len(np.unique(want.score_B)) == B
    assert (want.ids_BL == EOS_ID).any(1).sum() >= 2


def test_splash_in_a_shard_map_runs_on_the_local_block_or_splits_it_over_the_rest():
    """Under the training rules (batch over data and fsdp, heads over tensor): a shard_map over
    every axis leaves the kernel the local block; one over 'data' only leaves it fsdp and tensor
    to split the block over itself. Both equal dense attention."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 12, 2, 8)), jnp.float32) for _ in range(3))
    valid_BQ = jnp.arange(12)[None] < jnp.asarray([[12], [9], [5], [12]])
    want = attention.dot_product_attention(
        q, k, v, attention.attention_mask(valid_BQ, valid_BQ, causal=True), scale=0.3)
    mask = attention.make_attention_mask('splash', valid_BQ, valid_BQ, None, None, True)
    mesh = sharding.make_mesh((2, 2, 2))
    seen = []

    def attend(q, k, v, mask):
        seen.append(set(jax.sharding.get_abstract_mesh().manual_axes))
        return attention.splash_attention(q, k, v, mask, scale=0.3, interpret=True)

    rows = PartitionSpec('data')
    for manual in ({'data'}, set(sharding.MESH_AXES)):
        with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
            got = jax.jit(jax.shard_map(
                attend, mesh=mesh, in_specs=(rows, rows, rows, jax.tree.map(lambda _: rows, mask)),
                out_specs=rows, axis_names=manual, check_vma=False))(q, k, v, mask)
        valid = np.asarray(valid_BQ)  # padded queries may differ; nothing reads them
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5,
                                   err_msg=str(manual))
    assert seen == [{'data'}, set(sharding.MESH_AXES)]


_TPU_SCRIPT = """
import json, sys
from configs import tiny
from t2t.aot import tpu as aot
out = {}
for impl, mesh_shape in (('xla', (4, 1, 1)), ('dot_product', (4, 1, 1)), ('splash', (4, 1, 1)),
                         ('splash', (1, 2, 2))):
    config = tiny.get_config()
    config.attention_impl, config.mesh_shape = impl, mesh_shape
    plan = aot.plan(config, 'v5e:2x2')
    c = aot.compile_predict(config, plan.mesh)
    out[f'{impl} {mesh_shape}'] = dict(
        kernels=c.hlo_text.count('tpu_custom_call'), temporaries=c.memory.temporaries,
        collectives={k: [v.count, v.bytes, v.in_loops_count] for k, v in c.collectives.items()
                     if v.count or v.in_loops_count}, seconds=c.seconds)
print('PREDICT ' + json.dumps(out))
"""


def test_predict_compiles_for_a_tpu_slice_with_every_tpu_kernel():
    """Beam search for v5e:2x2, each device its own rows (data=4, and fsdp x tensor 2 x 2 where
    the parameters arrive sharded): splash's Pallas kernel is in the program, the others have
    none; the rows never meet, so the only collectives are the parameters' gathers, before the
    search loop."""
    with libtpu_lock():
        out = subprocess.run([sys.executable, '-c', _TPU_SCRIPT], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split('PREDICT ', 1)[1])
    for name in ('xla (4, 1, 1)', 'dot_product (4, 1, 1)'):
        assert got[name]['kernels'] == 0 and got[name]['temporaries'] > 0, (name, got[name])
    for name in ('splash (4, 1, 1)', 'splash (1, 2, 2)'):
        # One kernel per encoder self-attention layer (decode steps attend with one query).
        assert got[name]['kernels'] == _tiny().num_encoder_layers, (name, got[name])
    for name in ('xla (4, 1, 1)', 'dot_product (4, 1, 1)', 'splash (4, 1, 1)'):
        assert got[name]['collectives'] == {}, (name, got[name])  # replicated parameters
    # Gathers (XLA writes those of small vectors as all-reduces of zero-padded copies), none
    # inside a loop, at most the float32 parameters' bytes.
    gathers = got['splash (1, 2, 2)']['collectives']
    assert set(gathers) <= {'all-gather', 'all-reduce'} and 'all-gather' in gathers, gathers
    assert all(in_loops == 0 for _, _, in_loops in gathers.values()), gathers
    params = model.count_params(model.abstract_params(TransformerConfig.from_config(_tiny())))
    assert 0 < sum(b for _, b, _ in gathers.values()) <= 4 * params, (gathers, params)


def test_cudnn_for_a_tpu_slice_is_one_line_before_libtpu():
    config = _tiny()
    config.attention_impl = 'cudnn'
    with pytest.raises(ValueError) as e:
        aot.plan(config, 'v5e:2x2')  # raises before the slice's devices are asked for
    assert str(e.value) == ('--config.attention_impl=cudnn: cuDNN flash attention runs on '
                            'NVIDIA GPUs only, the target is tpu (use auto, xla, dot_product, '
                            'splash)')


def _tiny():
    from configs import tiny

    return tiny.get_config()
