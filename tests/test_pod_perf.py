"""What the compiled train step does on a pod, read from its HLO (t2t/aot/hlo.py, t2t/aot/tpu.py):
no
collective on the fused loss's dW (nor its weights) inside the loss's chunk loop, the
data-parallel gradient reduction as large as the parameters (the tied embedding, read by both
lookups and the loss, reduced once), and the roofline bound made of the numbers it names. On 8
CPU devices, and by TPU ahead-of-time compile at a tiny size (libtpu in a subprocess, under the
lock of tests/test_aot.py)."""

import json
import subprocess
import sys

import pytest

from t2t import model, sharding
from t2t.aot import hlo
from t2t.aot import tpu as aot
from t2t.infra import metrics
from t2t.model import TransformerConfig
from tests.conftest import ROOT
from tests.test_aot import _env, libtpu_lock

# One xdist worker runs every test that compiles with libtpu (--dist loadgroup), one at a time
# (libtpu_lock), while the other goes on with the rest; and its module fixtures are computed once.
pytestmark = pytest.mark.xdist_group('libtpu')

VOCAB = 512  # no other dimension of the model below is 512: dW's collectives are recognizable
CHUNKS = 4  # 32 target positions, 8 per chunk of the loss


def _config(mesh_shape):
    from configs import tiny

    c = tiny.get_config()
    c.vocab_size, c.d_model, c.d_ff, c.loss_chunk_len = VOCAB, 64, 128, 8
    c.loss_impl = 'fused'
    c.mesh_shape = mesh_shape
    return c


def _param_bytes(config) -> int:
    return 4 * model.count_params(model.abstract_params(TransformerConfig.from_config(config)))


def _vocab_sized(op) -> bool:
    return any(VOCAB in hlo.array_dims(s) for s in op.operand_shapes if not s.startswith('('))


def _check_no_dw_in_loops(ops, only_scalars: bool):
    """No vocabulary-sized collective in a loop: before the [S, V, D] carry, dW ([V, D] or its
    fsdp shard) was all-reduced in each of the chunks, and on the TPU the weights' fsdp shards
    were all-gathered in each. only_scalars (the CPU compiler): nothing in loops but the loss's
    three scalar sums (12 bytes a chunk). The TPU compiler also starts the all-gathers of the
    next layer's weights inside the loop, to overlap them with it (small, not the loss's)."""
    in_loops = [op for op in ops if op.in_loop]
    assert not [op for op in in_loops if _vocab_sized(op)], in_loops
    if only_scalars:
        assert sum(op.times * op.bytes for op in in_loops) <= 12 * CHUNKS, in_loops
    assert not [op for op in in_loops if op.kind != 'all-gather' and op.bytes > 12], in_loops


def _gradient_reduction_bytes(ops) -> float:
    """All-reduce and reduce-scatter operand bytes per step, but the metric scalars."""
    return sum(op.times * op.bytes for op in ops if op.kind in ('all-reduce', 'reduce-scatter')
               and op.bytes > 64)


@pytest.mark.parametrize('mesh_shape', [(4, 2, 1), (1, 8, 1), (8, 1, 1)])
def test_cpu_no_collective_on_the_loss_dw_inside_the_chunk_loop(mesh_shape):
    config = _config(mesh_shape)
    mesh = sharding.make_mesh(config.mesh_shape)
    compiled = aot.compile_train_step(config, mesh)
    trips = hlo.while_trip_counts(compiled.hlo_text).values()
    assert list(trips).count(CHUNKS) == 1  # the loss's chunk loop is there
    ops = hlo.collective_ops(compiled.hlo_text)
    _check_no_dw_in_loops(ops, only_scalars=True)
    # The shared embedding's gradient (both lookups and the loss's dW, added per batch shard) is
    # reduced in one [V, D] operand on meshes with a data axis; it was three on data-parallel
    # meshes. Under fsdp alone the lookups read the table gathered whole along D (t2t/tables.py)
    # and this CPU compiler reduces their two gradient parts beside the loss's dW: it has no
    # all-reduce reassociation, which the GPU and TPU compilers use to add the three and reduce
    # them once (bench/RESULTS.md, "The fsdp all-to-alls").
    parts = 3 if mesh_shape == (1, 8, 1) else 1
    embedding_reductions = [shape for op in ops if op.kind in ('all-reduce', 'reduce-scatter')
                            for shape in op.operand_shapes if VOCAB in hlo.array_dims(shape)]
    assert len(embedding_reductions) == parts, embedding_reductions
    if mesh_shape in ((1, 8, 1), (8, 1, 1)):
        # fsdp or data alone: every gradient is reduced once (under fsdp the CPU compiler
        # all-reduces, then slices), the metric scalars and the lookups' parts aside.
        table = 4 * VOCAB * config.d_model
        assert _gradient_reduction_bytes(ops) == pytest.approx(
            _param_bytes(config) + (parts - 1) * table, rel=1e-3)


_TPU_SCRIPT = f"""
import dataclasses, json
from configs import tiny
from t2t.aot import tpu as aot, hlo, memory as hlo_memory
out = {{}}
for mesh_shape in ((2, 2, 1), (4, 1, 1)):
    config = tiny.get_config()
    config.vocab_size, config.d_model, config.d_ff, config.loss_chunk_len = {VOCAB}, 64, 128, 8
    config.loss_impl = 'fused'
    config.mesh_shape = mesh_shape
    plan = aot.plan(config, 'v5e:2x2')
    c = aot.compile_train_step(config, plan.mesh)
    out[str(mesh_shape)] = dict(
        ops=[dataclasses.asdict(op) for op in hlo.collective_ops(c.hlo_text)],
        trips=list(hlo.while_trip_counts(c.hlo_text).values()),
        roofline=dataclasses.asdict(c.roofline),
        terms=[c.roofline.compute_s, c.roofline.memory_s, c.roofline.collective_s,
               c.roofline.seconds],
        matmul=c.matmul_flops_per_device, memory=c.memory_bytes_per_device,
        collective_bytes=c.collective_bytes, xla_bytes=c.xla_bytes_accessed,
        hlo_matmul=hlo.matmul_flops(c.hlo_text), hlo_memory=hlo_memory.memory_bytes(c.hlo_text),
        lines=aot.roofline_lines(c))
print('POD ' + json.dumps(out))
"""
POD_JSON = '/tmp/t2t-test-pod-perf.json'  # the compiled numbers, kept for a look on failure


@pytest.fixture(scope='module')
def tpu_tiny():
    """The tiny train step compiled for v5e:2x2 with data=2 x fsdp=2 and with data=4."""
    with libtpu_lock():
        out = subprocess.run([sys.executable, '-c', _TPU_SCRIPT], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = out.stdout.split('POD ', 1)[1]
    with open(POD_JSON, 'w') as f:
        f.write(result)
    return json.loads(result)


def _ops(result):
    return [hlo.CollectiveOp(**{**op, 'operand_shapes': tuple(op['operand_shapes'])})
            for op in result['ops']]


def test_tpu_no_collective_on_the_loss_dw_inside_the_chunk_loop(tpu_tiny):
    for mesh_shape, result in tpu_tiny.items():
        assert result['trips'].count(CHUNKS) >= 1, (mesh_shape, result['trips'])
        _check_no_dw_in_loops(_ops(result), only_scalars=False)
    # Data-parallel over 4 chips: every gradient reduced once a step, the shared embedding's
    # too (its lookups' and the loss's parts are added in each shard's slot first).
    config = _config((4, 1, 1))
    assert _gradient_reduction_bytes(_ops(tpu_tiny['(4, 1, 1)'])) == pytest.approx(
        _param_bytes(config), rel=1e-3)


def test_tpu_roofline_is_made_of_the_numbers_it_names(tpu_tiny):
    chip = aot.CHIPS['v5e'].spec
    for result in tpu_tiny.values():
        r = result['roofline']
        assert r['chip'] == 'v5e'
        assert r['flops'] == result['matmul'] == result['hlo_matmul'] > 0
        assert r['memory_bytes'] == result['memory'] == result['hlo_memory'] > 0
        # A chained collective's pieces run 1/N times each: equal up to float rounding.
        assert r['collective_bytes'] == result['collective_bytes'] > 0
        assert result['collective_bytes'] == pytest.approx(
            sum(op.times * op.bytes for op in _ops(result)), rel=1e-12)
        compute, memory, collective, bound = result['terms']
        assert compute == r['flops'] / 197e12 and memory == r['memory_bytes'] / 819e9
        assert collective == r['collective_bytes'] / 400e9
        assert bound == max(compute, memory) + collective
        assert result['xla_bytes'] > 0  # printed next to it, as what it is
        traffic, line = result['lines']
        assert 'LOWER BOUND' in line and 'not a measurement' in line
        assert line.endswith(f'bound {bound * 1e3:.3g} ms')
        assert f'= {compute * 1e3:.3g} ms' in line and f'= {collective * 1e3:.3g} ms' in line
    assert (chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.ici_bytes_per_s) == (
        197e12, 819e9, 400e9)


def test_one_chip_table_for_the_roofline_the_estimate_and_mfu():
    """The slices' generations read their peak and bandwidths from metrics.CHIPS (the table the
    training loop's MFU reads), and each TPU device kind jax reports finds its generation."""
    kinds = {'TPU v4': 'v4', 'TPU v5 lite': 'v5e', 'TPU v5e': 'v5e', 'TPU v5': 'v5p',
             'TPU v5p': 'v5p', 'TPU v6 lite': 'v6e', 'TPU v6e': 'v6e'}
    for kind, generation in kinds.items():
        assert metrics.chip(kind) is metrics.CHIPS[generation] is aot.CHIPS[generation].spec
        assert metrics.peak_flops_per_device(kind) == aot.CHIPS[generation].spec.peak_bf16_flops
    assert set(kinds.values()) == set(aot.CHIPS)
    for chip in aot.CHIPS.values():
        assert chip.spec.hbm_bytes_per_s > 0 and chip.spec.ici_bytes_per_s > 0


@pytest.mark.parametrize('copies', [False, True])
def test_sharded_fused_loss_and_gradients_equal_unsharded(copies):
    """The [S, V, D] dW carry (S = 8 batch shards on a data=4 x fsdp=2 mesh) gives the loss and
    the gradients of the plain [V, D] carry without a mesh, with the weights given as [V, D] or
    as one copy per batch shard (sharding.per_batch_shard; without a mesh one copy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    from t2t import loss

    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.normal(size=(16, 32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(VOCAB, 64)) * 0.1, jnp.float32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (16, 32)), jnp.int32)
    weights = jnp.asarray(rng.random((16, 32)) > 0.2, jnp.float32)

    def value_and_grads(y, w):
        def fn(y, w):
            if copies:
                w = sharding.per_batch_shard(w, sharding.batch_shards(y.shape[0]))
            return loss.cross_entropy_sums(y, w, targets, weights, smoothing=0.1, chunk_len=8)[0]

        return jax.value_and_grad(fn, argnums=(0, 1))(y, w)

    want_loss, (want_dy, want_dw) = jax.jit(value_and_grads)(y, w)
    mesh = sharding.make_mesh((4, 2, 1))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        assert sharding.batch_shards(16) == 8 and sharding.batch_shards(12) == 1
        y_sharded = jax.device_put(y, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(('data', 'fsdp'))))
        got_loss, (got_dy, got_dw) = jax.jit(value_and_grads)(y_sharded, w)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_dy), np.asarray(want_dy), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_dw), np.asarray(want_dw), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('mesh_shape,tied', [((8, 1, 1), True), ((4, 2, 1), True),
                                             ((4, 2, 1), False)])
def test_sharded_train_gradients_equal_one_device(mesh_shape, tied):
    """The per-batch-shard copies of the embeddings (lookups and loss; untied: two tables and the
    output kernel, each copied) give the gradients of the plain model on one device."""
    import jax
    import numpy as np
    from flax import linen as nn

    from t2t import train_lib
    from tests.conftest import tiny_config

    config = tiny_config(vocab_size=VOCAB, batch_size=16, share_embeddings=tied, tie_output=tied)
    step_config = train_lib.StepConfig.from_config(config)
    rng = np.random.default_rng(0)
    batch = {k: jax.numpy.asarray(rng.integers(1, VOCAB, (16, config.max_len)), np.int32)
             for k in ('inputs', 'targets')}
    batch['targets'] = batch['targets'].at[:, -3:].set(0)  # some padding
    params = nn.unbox(model.Transformer(TransformerConfig.from_config(config)).init(
        jax.random.key(0), batch['inputs'], batch['targets'])['params'])
    grad = jax.jit(jax.grad(lambda p, b: train_lib.loss_sums(p, b, None, step_config, True)[0]))
    want = grad(params, batch)
    mesh = sharding.make_mesh(mesh_shape)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        got = grad(params, jax.device_put(batch, sharding.batch_sharding(mesh)))
    # Sums of the loss over 16 x 12 tokens (entries up to ~10): float32 reduction order apart
    # (seen: 6e-6 at most, as before the copies), the same.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got, want)
