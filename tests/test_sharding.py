"""Shardings derived from logical names; a sharded forward pass equals the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from t2t import sharding
from t2t.aot import hlo
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


# --- feeding: which rows a process holds ---------------------------------------------------------

def _mesh_with_process_axis(axis: int):
    """A (2, 2, 2) mesh whose `axis` splits the devices into [:4] and [4:], as if they were two
    processes of 4 devices each."""
    devices = np.array(jax.devices()).reshape(2, 4)  # "process" p holds devices[p]
    order = np.moveaxis(devices.reshape(2, 2, 2), 0, axis)
    return jax.sharding.Mesh(order, sharding.MESH_AXES)


@pytest.mark.parametrize('axis,rows', [(0, [[0, 1, 2, 3], [4, 5, 6, 7]]),
                                       (1, [[0, 1, 4, 5], [2, 3, 6, 7]]),
                                       (2, [list(range(8))] * 2)],
                         ids=['data', 'fsdp', 'tensor'])
def test_process_rows_follow_the_sharding_not_the_process_index(axis, rows):
    batch_sharding = sharding.batch_sharding(_mesh_with_process_axis(axis))
    process_devices = np.array(jax.devices()).reshape(2, 4)
    got = [sharding.process_rows(batch_sharding, 8, devices=d).tolist() for d in process_devices]
    assert got == rows
    assert sharding.process_rows(batch_sharding, 8).tolist() == list(range(8))  # all local here
    # put_rows places row i of the local batch where the sharding wants global row rows[i].
    batch = np.arange(8 * 3).reshape(8, 3)
    placed = sharding.put_rows(batch[sharding.process_rows(batch_sharding, 8)], batch_sharding, 8)
    np.testing.assert_array_equal(np.asarray(placed), batch)


def test_multi_slice_mesh_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r'dcn_mesh_shape=\(1, 2, 1\) needs 2 slices of equal '
                                         r'size; the 8 devices are in 1 processes'):
        sharding.make_mesh((-1, 1, 1), dcn_mesh_shape=(1, 2, 1))
    with pytest.raises(ValueError, match='dcn_mesh_shape=.* positive'):
        sharding.make_mesh((-1, 1, 1), dcn_mesh_shape=(0, 1, 1))
    with pytest.raises(ValueError, match='does not divide 8 devices per slice'):
        sharding.resolve_mesh_shape((3, -1, 1), 8, 'devices per slice')
    assert sharding.make_mesh((2, 2, 2), dcn_mesh_shape=(1, 1, 1)).shape == {
        'data': 2, 'fsdp': 2, 'tensor': 2}


# --- sharding that really happens ----------------------------------------------------------------

def _config(**overrides):
    from configs import tiny

    c = tiny.get_config()
    c.num_heads, c.max_len, c.batch_size = 8, 16, 8  # 8 heads: one per tensor-parallel device
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


@pytest.mark.parametrize('mesh_shape', [(1, 8, 1), (1, 1, 8)], ids=['fsdp', 'tensor'])
def test_every_large_matrix_and_its_adam_moments_take_an_eighth_per_device(mesh_shape):
    from t2t import optim, train_lib

    config = _config()
    mesh = sharding.make_mesh(mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    leaves = jax.tree_util.tree_flatten_with_path({'params': state.params,
                                                   'adam': state.opt_state})[0]
    large = [(jax.tree_util.keystr(p), x) for p, x in leaves if x.size >= 1024]
    names = ' '.join(name for name, _ in large)
    assert 'mu' in names and 'nu' in names and 'embedding' in names and 'wi' in names
    for name, x in large:
        shards = [s.data.nbytes for s in x.addressable_shards]
        assert len(shards) == 8 and set(shards) == {x.nbytes // 8}, (name, shards, x.nbytes)


def test_train_step_temporaries_per_device_fall_as_fsdp_grows():

    from t2t import optim, train_lib

    # Parameters large next to the activations of one row per device, so that what FSDP shards
    # (gradients, Adam's update) dominates the step's temporaries.
    config = _config(d_model=64, d_ff=512, num_encoder_layers=1, num_decoder_layers=1,
                     loss_impl='fused')
    tx = optim.make_optimizer(config)
    step_config = train_lib.StepConfig.from_config(config)
    temp, all_to_all = {}, {}
    for fsdp in (1, 2, 4, 8):
        mesh = sharding.make_mesh((8 // fsdp, fsdp, 1))
        abstract = train_lib.abstract_state(config, mesh, tx)
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
        batch = {k: jax.ShapeDtypeStruct((config.batch_size, config.max_len), np.int32,
                                         sharding=sharding.batch_sharding(mesh))
                 for k in ('inputs', 'targets')}
        step = train_lib.jit_train_step(step_config, tx, shardings, mesh)
        compiled = step.lower(abstract, batch).compile()  # lowers under the mesh and axis rules
        temp[fsdp] = compiled.memory_analysis().temp_size_in_bytes
        all_to_all[fsdp] = hlo.collectives(compiled.as_text())['all-to-all']
    print(f'train-step temporaries per device by fsdp size: {temp}')
    # The token lookups read the table whole along D (t2t/tables.py): no all-to-all moves their
    # rows between D-slices and batch shards (before: 4 a step, the lookups and their gradients).
    assert all(c == hlo.Collectives() for c in all_to_all.values()), all_to_all
    # What FSDP cannot shard stays: the weights it gathers for each use, the activations, and the
    # fused loss's dW: one float32 [V, D] slot per batch shard on its device (t2t/loss.py; with
    # data parallelism the lookups' gradients add into it too), summed once a step. Data
    # parallelism alone no longer keeps the embedding's three gradient parts apart for their
    # reductions (seen: 1.97 MB, 2.99 MB before), so fsdp 2 and 4 save against it. At fsdp 8
    # (no data axis: no copies) the lookups read the table gathered whole along D, and this CPU
    # compiler reduces the three gradient parts one by one, each a full [V, D] slot (it has no
    # all-reduce reassociation; the GPU and TPU compilers add them and reduce once: bench/
    # RESULTS.md, "The fsdp all-to-alls"): the gathered table, the lookups' two parts and their
    # reduced copies outweigh what sharding saves on this tiny model (seen: +1.15 MB).
    dw_slot = 4 * config.vocab_size * config.d_model
    assert temp[1] > temp[2] >= temp[4], temp
    assert temp[4] < temp[8] < temp[4] + 5 * dw_slot, temp
