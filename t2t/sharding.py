"""Device mesh and the one table that maps the model's logical axis names onto it.

Mesh axes: 'data' (pure data parallelism), 'fsdp' (data parallelism with parameters and optimizer
state sharded along 'embed'), 'tensor' (heads / d_ff / vocabulary split across devices, Megatron
style). Shardings are never written by hand: they are derived from the logical names that the model
puts on its parameters (via jax.eval_shape of the init function) and on its activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# Order matters: a mesh axis is given to the first logical axis of an array that asks for it, so
# activations [batch, length, embed] shard batch over (data, fsdp) and leave embed whole, while
# parameters [vocab, embed] shard embed over fsdp.
LOGICAL_AXIS_RULES = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('heads', 'tensor'),
    ('mlp', 'tensor'),
    ('embed', 'fsdp'),
    ('length', None),
    ('kv', None),
    ('layers', None),  # the stacked axis of scanned layers: every device holds all layers
)


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces one -1 by the devices left over; checks the product equals num_devices."""
    shape = [int(s) for s in mesh_shape]
    if len(shape) != len(MESH_AXES):
        raise ValueError(f'mesh_shape={tuple(shape)} must have {len(MESH_AXES)} sizes {MESH_AXES}')
    if shape.count(-1) > 1:
        raise ValueError(f'mesh_shape={tuple(shape)} has more than one -1')
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f'mesh_shape={tuple(shape)} does not divide {num_devices} devices')
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(f'mesh_shape={tuple(shape)} needs {math.prod(shape)} devices, '
                         f'{num_devices} are present')
    return tuple(shape)


def make_mesh(mesh_shape: Sequence[int], devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh over all (global) devices, in an ICI/DCN-aware order."""
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_mesh_shape(mesh_shape, len(devices))
    # Auto axes: shardings propagate through jit from the constraints we place (GSPMD style).
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def logical_to_sharding(logical_specs, mesh: Mesh):
    """A tree of logical PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def tree_shardings(abstract_boxed_tree, mesh: Mesh):
    """NamedShardings for every leaf of an (abstract) tree whose parameters carry logical names.

    The result has the structure of the unboxed tree: boxed parameters (nn.Partitioned) become their
    sharding, every other leaf (step counters, rng keys) is replicated.
    """
    return logical_to_sharding(nn.get_partition_spec(abstract_boxed_tree), mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Data batches are split along their leading (batch) dimension over data and fsdp."""
    return NamedSharding(mesh, PartitionSpec(('data', 'fsdp')))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def init_sharded(init_fn, mesh: Mesh, *args):
    """Runs init_fn(*args) under jit so that each device creates only its shard of the result.

    init_fn may return parameters boxed with logical names; the returned tree is unboxed.
    Returns (tree, shardings).
    """
    abstract = jax.eval_shape(init_fn, *args)
    shardings = tree_shardings(abstract, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        tree = jax.jit(lambda *a: nn.unbox(init_fn(*a)), out_shardings=shardings)(*args)
    return tree, shardings
