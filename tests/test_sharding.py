"""Shardings derived from logical names; a sharded forward pass equals the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from t2t import sharding
from t2t.model import Transformer, TransformerConfig


def test_resolve_mesh_shape():
    assert sharding.resolve_mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert sharding.resolve_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(ValueError, match='does not divide'):
        sharding.resolve_mesh_shape((3, -1, 1), 8)
    with pytest.raises(ValueError, match='needs 4 devices'):
        sharding.resolve_mesh_shape((2, 2, 1), 8)


def test_sharded_forward_equals_unsharded():
    cfg = TransformerConfig(vocab_size=64, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                            num_decoder_layers=1, deterministic=True)
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(2, 64, (8, 6)), jnp.int32)
    tgt = jnp.asarray(rng.integers(2, 64, (8, 5)), jnp.int32)
    init = lambda key: model.init(key, src, tgt)['params']
    want = model.apply({'params': nn.unbox(init(jax.random.key(0)))}, src, tgt)

    mesh = sharding.make_mesh((2, 2, 2))
    params, shardings = sharding.init_sharded(init, mesh, jax.random.key(0))
    kernel = params['decoder_0']['ffn']['wi']['kernel']  # [embed, mlp]
    assert kernel.sharding.spec == P('fsdp', 'tensor')
    assert shardings['embedder']['embedding'].spec == P('tensor', 'fsdp')
    batch = jax.device_put((src, tgt), sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        got = jax.jit(lambda p, s, t: model.apply({'params': p}, s, t))(params, *batch)
    assert got.sharding.spec[0] == ('data', 'fsdp')
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
