"""Device mesh, the one table that maps the model's logical axis names onto it, and batch feeding.

Mesh axes: 'data' (data parallel), 'fsdp' (data parallel, parameters and optimizer state sharded
along 'embed'), 'tensor' (heads / d_ff / vocabulary split, Megatron style). Shardings are derived
from the logical names on the parameters (eval_shape of init) and activations, never written by
hand. Several slices: `mesh_shape` inside a slice, `dcn_mesh_shape` the mesh of slices (jax's
hybrid mesh). A process is fed the rows its devices hold (`process_rows`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
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


def resolve_mesh_shape(mesh_shape: Sequence[int], num_devices: int,
                       where: str = 'devices') -> tuple[int, ...]:
    """Replaces one -1 by the devices left over; checks the product equals num_devices."""
    shape = [int(s) for s in mesh_shape]
    if len(shape) != len(MESH_AXES):
        raise ValueError(f'mesh_shape={tuple(shape)} must have {len(MESH_AXES)} sizes {MESH_AXES}')
    if shape.count(-1) > 1:
        raise ValueError(f'mesh_shape={tuple(shape)} has more than one -1')
    if any(s < 1 and s != -1 for s in shape):
        raise ValueError(f'mesh_shape={tuple(shape)}: sizes must be positive (or one -1)')
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f'mesh_shape={tuple(shape)} does not divide {num_devices} {where}')
        shape[shape.index(-1)] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ValueError(f'mesh_shape={tuple(shape)} needs {math.prod(shape)} {where}, the run has '
                         f'{num_devices} (-1 in it takes what is left)')
    return tuple(shape)


def _slice_attribute(devices) -> str:
    """What groups devices into slices: TPU devices' slice_index; elsewhere each process."""
    if len({getattr(d, 'slice_index', None) for d in devices} - {None}) > 1:
        return 'slice_index'
    return 'process_index'


def make_mesh(mesh_shape: Sequence[int], devices=None,
              dcn_mesh_shape: Sequence[int] = (1, 1, 1)) -> Mesh:
    """A (data, fsdp, tensor) mesh over all (global) devices, in an ICI/DCN-aware order. With
    several slices mesh_shape is one slice's (its -1 resolved per slice) and each axis is
    mesh_shape * dcn_mesh_shape long, slices varying slowest."""
    devices = jax.devices() if devices is None else list(devices)
    dcn = tuple(int(s) for s in dcn_mesh_shape)
    if len(dcn) != len(MESH_AXES) or min(dcn) < 1:
        raise ValueError(f'dcn_mesh_shape={dcn} must have {len(MESH_AXES)} positive sizes '
                         f'{MESH_AXES}')
    axis_types = (AxisType.Auto,) * len(MESH_AXES)  # shardings propagate from our constraints
    num_slices = math.prod(dcn)
    if num_slices == 1:
        shape = resolve_mesh_shape(mesh_shape, len(devices))
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    attribute = _slice_attribute(devices)
    sizes = collections.Counter(getattr(d, attribute) for d in devices)
    if len(sizes) != num_slices or len(set(sizes.values())) != 1:
        groups = 'slices' if attribute == 'slice_index' else 'processes (one per slice)'
        raise ValueError(f'dcn_mesh_shape={dcn} needs {num_slices} slices of equal size; the '
                         f'{len(devices)} devices are in {len(sizes)} {groups}, of sizes '
                         f'{sorted(sizes.values())}')
    ici = resolve_mesh_shape(mesh_shape, len(devices) // num_slices, 'devices per slice')
    array = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=attribute == 'process_index')
    return Mesh(array, MESH_AXES, axis_types=axis_types)


def logical_to_sharding(logical_specs, mesh: Mesh):
    """A tree of logical PartitionSpecs -> the same tree of NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def tree_shardings(abstract_boxed_tree, mesh: Mesh):
    """NamedShardings of an (abstract) tree's leaves, in the unboxed tree's structure: boxed
    parameters (nn.Partitioned) by their logical names, other leaves (step, rng) replicated."""
    return logical_to_sharding(nn.get_partition_spec(abstract_boxed_tree), mesh)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Data batches are split along their leading (batch) dimension over data and fsdp."""
    return NamedSharding(mesh, PartitionSpec(('data', 'fsdp')))


def decode_sharding(mesh: Mesh) -> NamedSharding:
    """Decoding splits its batch over every device of the mesh (parameters replicated)."""
    return NamedSharding(mesh, PartitionSpec(MESH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    """Devices a training batch is split over (its rows; tensor-parallel devices share rows)."""
    return mesh.shape['data'] * mesh.shape['fsdp']


def _devices_along(logical_name: str) -> int:
    """Devices a logical axis is split over under the active mesh and rules (1 without)."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return 1
    axes = nn.logical_to_mesh_axes((logical_name,), rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes)


def batch_shards(rows: int) -> int:
    """Devices the 'batch' axis is split over under the active mesh and logical axis rules (1
    without them, or when they do not divide the rows)."""
    shards = _devices_along('batch')
    return shards if rows % shards == 0 else 1


def embedding_copies() -> int:
    """S for per_batch_shard of the embeddings (t2t/tables.py): the devices the batch is split
    over when they do not all split the embedding's 'embed' axis (data parallelism), else 1.
    Under fsdp alone XLA already reduces the tied embedding's gradient parts together, and the
    copies only added HBM traffic (bench/RESULTS.md, "The shared embedding's gradient, reduced
    once")."""
    shards = _devices_along('batch')
    return shards if shards > _devices_along('embed') else 1


def per_batch_shard(w_VD, shards: int):
    """[V, D] -> [S, V, D]: a copy of the weights for each batch shard, on that shard's devices
    (t2t/tables.py: the transpose of this broadcast, a sum over S, is the one gradient reduction
    of every read). S == 1: a leading axis of 1, no constraint."""
    w_SVD = jnp.broadcast_to(w_VD, (shards, *w_VD.shape))
    if shards == 1:
        return w_SVD
    return nn.with_logical_constraint(w_SVD, ('batch', 'vocab', 'embed'))


def process_rows(batch_sharding: NamedSharding, num_rows: int, devices=None) -> np.ndarray:
    """Sorted global row ids of a [num_rows, ...] batch held by this process's devices (or by
    `devices`: a test asks for another process), the order `put_rows` maps local rows to."""
    if devices is None:
        index_map = batch_sharding.addressable_devices_indices_map((num_rows,))
    else:
        index_map = {d: i for d, i in batch_sharding.devices_indices_map((num_rows,)).items()
                     if d in set(devices)}
    rows = set()
    for (rows_slice,) in index_map.values():
        rows.update(range(*rows_slice.indices(num_rows)))
    return np.array(sorted(rows), np.int64)


def put_rows(local_batch, batch_sharding: NamedSharding, num_rows: int):
    """This process's rows (`process_rows` order) of a tree of [num_rows, ...] host arrays ->
    global jax arrays split as batch_sharding says."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            batch_sharding, np.asarray(x), (num_rows,) + np.shape(x)[1:]), local_batch)


def put_global(tree, target_sharding):
    """A tree of host arrays that every process holds in full -> global jax arrays; each process
    copies only the slices its own devices hold. `target_sharding`: one sharding or a tree."""
    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

    if isinstance(target_sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: put(x, target_sharding), tree)
    return jax.tree.map(put, tree, target_sharding)


def init_sharded(init_fn, mesh: Mesh, *args):
    """(tree, shardings): init_fn(*args) (parameters boxed with logical names) under jit, each
    device creating only its shard; the tree unboxed."""
    abstract = jax.eval_shape(init_fn, *args)
    shardings = tree_shardings(abstract, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        tree = jax.jit(lambda *a: nn.unbox(init_fn(*a)), out_shardings=shardings)(*args)
    return tree, shardings
