"""The machines t2t compiles for ahead of time: TPU slices and GPU nodes, one table each.

    target = targets.parse('v5e-16')      # TpuSlice: 16 v5e chips (or 'v5e:4x4', 'v5litepod-16')
    target = targets.parse('2x8xh100')    # GpuNodes: 2 nodes of 8 H100 SXM joined by NVLink
    target.chips, target.hbm_bytes, target.spec     # devices, capacity, datasheet (metrics.CHIPS)
    devices = targets.devices(target)    # compile-only jax devices described on this CPU

A TPU slice is described by libtpu (its accelerator types and topologies: Cloud TPU's names). A
GPU node is described by XLA's own target description of the card (a GpuTargetConfig text proto,
kept in t2t/aot/gpu_specs/ as XLA's repository has it, less the fields the XLA of the jax in use
cannot parse), and jax's compile-only CUDA topology: `<slices>x<hosts per slice>x<devices per
host>` (jax's mock GPU topology flag spells the same fields; its aot_test compiles for '1x1x1').
One NVLink domain is one slice, so N nodes of G GPUs are 'Nx1xG': collectives between slices go
over the network.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from pathlib import Path

from t2t.infra import metrics, platforms

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class _Chip:
    generation: str  # key of metrics.CHIPS: the datasheet numbers
    topology_prefix: str  # libtpu's topology names: 'v5e:4x4', 'v5:2x2x1' (v5p)
    cloud_prefix: str  # Cloud TPU accelerator types: 'v5litepod-16', 'v5p-8'
    cores_per_chip: int  # accelerator types count TensorCores: 2 per v4 / v5p chip
    chip_config: str  # 'megacore': one jax device per chip, its two TensorCores fused
    hbm_gib: int  # capacity, binary units (a v6e reports 33550237696 usable bytes, > 32e9)
    dims: int  # 2D or 3D torus

    @property
    def spec(self) -> metrics.Chip:
        """Peak FLOP/s, HBM and ICI bandwidth: t2t/infra/metrics.py's table (MFU's too)."""
        return metrics.CHIPS[self.generation]


# The slices' shapes and names (Google Cloud's TPU pages, MaxText's accelerator table).
CHIPS = {c.generation: c for c in (
    _Chip('v4', 'v4', 'v4', 2, 'megacore', 32, 3),
    _Chip('v5e', 'v5e', 'v5litepod', 1, 'default', 16, 2),
    _Chip('v5p', 'v5', 'v5p', 2, 'megacore', 95, 3),
    _Chip('v6e', 'v6e', 'v6e', 1, 'default', 32, 2),
)}
_ALIASES = {'v5litepod': 'v5e', 'v5': 'v5p', 'v6': 'v6e'}
# Slice shapes by chip count (MaxText's accelerator table, Cloud TPU docs).
_SHAPES = {
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
        256: (16, 16)},
    3: {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
        256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
        4096: (16, 16, 16)},
}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    generation: str  # key of CHIPS
    shape: tuple[int, ...]  # chips along each torus axis

    platform = 'tpu'

    @property
    def spec(self) -> metrics.Chip:
        return self.chip.spec

    @property
    def chip(self) -> _Chip:
        return CHIPS[self.generation]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """The accelerator type users write: 'v5e-16', 'v4-8' (TensorCores for v4 / v5p)."""
        return f'{self.generation}-{self.chips * self.chip.cores_per_chip}'

    @property
    def accelerator_type(self) -> str:
        return f'{self.chip.cloud_prefix}-{self.chips * self.chip.cores_per_chip}'

    @property
    def topology(self) -> str:
        return f'{self.chip.topology_prefix}:' + 'x'.join(map(str, self.shape))

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_gib * GIB

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        # 4 chips per host (2x2), as on multi-host slices; 2x4 slices are one 8-chip host.
        if self.shape == (2, 4):
            return (2, 4, 1)
        bounds = [min(2, s) for s in self.shape[:2]]
        return (bounds[0], bounds[1], 1)


def parse_slice(name: str) -> TpuSlice:
    """'v5e-16', 'v5litepod-16', 'v4-8', 'v5p-8', 'v6e-256' or a topology 'v5e:4x4', 'v5p:2x2x1'."""
    known = ', '.join(sorted(CHIPS))
    m = re.fullmatch(r'([a-z0-9]+?)(?:-(\d+)|:(\d+(?:x\d+)+))', name.strip().lower())
    generation = m and _ALIASES.get(m.group(1), m.group(1))
    if not m or generation not in CHIPS:
        raise ValueError(f'--topology={name!r}: not a TPU slice of {known} (e.g. v5e-16, v4-8, '
                         'v5p-8, v6e-256, or a topology such as v5e:4x4, v5p:2x2x1) nor GPU '
                         'nodes (e.g. 8xh100, 2x8xh100)')
    chip = CHIPS[generation]
    if m.group(3):
        shape = tuple(int(s) for s in m.group(3).split('x'))
        if len(shape) != chip.dims or min(shape) < 1:
            raise ValueError(f'--topology={name!r}: {generation} slices have {chip.dims} '
                             'positive sizes, e.g. ' + 'x'.join(['2'] * chip.dims))
        return TpuSlice(generation, shape)
    count = int(m.group(2))
    chips, rest = divmod(count, chip.cores_per_chip)
    shape = _SHAPES[chip.dims].get(chips) if not rest else None
    if shape is None:
        sizes = ', '.join(f'{generation}-{c * chip.cores_per_chip}' for c in _SHAPES[chip.dims])
        raise ValueError(f'--topology={name!r}: unknown {generation} slice size; one of {sizes} '
                         f'or a topology such as {chip.topology_prefix}:'
                         + 'x'.join(['4'] * chip.dims))
    return TpuSlice(generation, shape)


def _tpu_devices(tpu: TpuSlice) -> list:
    """The slice's jax devices (for compiling only), described by libtpu on this machine."""
    platforms.compile_only_tpu(tpu.accelerator_type)
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform='tpu', topology_name=tpu.topology, chip_config_name=tpu.chip.chip_config,
        chips_per_host_bounds=tpu.chips_per_host_bounds, num_slices=1)
    return list(topology.devices)


# ----------------------------------------------------------------------------------------------
# GPU nodes

SPEC_DIR = Path(__file__).with_name('gpu_specs')


@dataclasses.dataclass(frozen=True)
class _Gpu:
    name: str  # what --topology calls it: 8xh100
    spec_file: str  # XLA's target description in SPEC_DIR
    chip: str  # key of metrics.CHIPS: peak FLOP/s, HBM and NVLink bandwidth
    # The network between nodes per GPU, both directions together (as NVLink's and TPU ICI's
    # numbers are): one InfiniBand NIC per GPU in NVIDIA's DGX / HGX reference nodes.
    internode_bytes_per_s: float
    nvlink_domain: int = 8  # GPUs one NVSwitch joins (an HGX board)

    @property
    def spec(self) -> metrics.Chip:
        return metrics.CHIPS[self.chip]


# DGX H100 / H200 / B200: ConnectX-7, 400 Gb/s per GPU; DGX A100: ConnectX-6, 200 Gb/s per GPU.
GPUS = {g.name: g for g in (
    _Gpu('h100', 'h100_sxm.txtpb', 'h100', 2 * 400e9 / 8),
    _Gpu('h200', 'h200.txtpb', 'h200', 2 * 400e9 / 8),
    _Gpu('a100-80g', 'a100_sxm_80.txtpb', 'a100', 2 * 200e9 / 8),
    _Gpu('b200', 'b200.txtpb', 'b200', 2 * 400e9 / 8),
)}


def spec_text(gpu: str) -> str:
    return (SPEC_DIR / GPUS[gpu].spec_file).read_text()


def spec_memory_bytes(text: str) -> int:
    """The card's memory in its target description (device_memory_size): what XLA plans for."""
    found = re.search(r'^\s*device_memory_size:\s*(\d+)\s*$', text, re.M)
    if not found:
        raise ValueError('no device_memory_size in the GPU target description')
    return int(found.group(1))


@dataclasses.dataclass(frozen=True)
class GpuNodes:
    gpu: str  # key of GPUS
    nodes: int
    per_node: int  # GPUs of each node, all in its NVLink domain

    platform = 'cuda'

    @property
    def card(self) -> _Gpu:
        return GPUS[self.gpu]

    @property
    def spec(self) -> metrics.Chip:
        return self.card.spec

    @property
    def chips(self) -> int:
        return self.nodes * self.per_node

    @property
    def name(self) -> str:
        return (f'{self.nodes}x' if self.nodes > 1 else '') + f'{self.per_node}x{self.gpu}'

    @property
    def topology(self) -> str:
        """jax's compile-only CUDA topology: one slice (NVLink domain) of one host per node."""
        return f'{self.nodes}x1x{self.per_node}'

    @property
    def hbm_bytes(self) -> int:
        return spec_memory_bytes(spec_text(self.gpu))


def parse_gpus(name: str) -> GpuNodes:
    """'8xh100', '1xh200', 'a100-80g' (one GPU), '2x8xh100' (nodes x GPUs per node x card)."""
    known = ', '.join(GPUS)
    m = re.fullmatch(r'(?:(?:(\d+)x)?(\d+)x)?([a-z][a-z0-9-]*)', name.strip().lower())
    if not m or m.group(3) not in GPUS:
        raise ValueError(f'--topology={name!r}: not GPU nodes of {known} (e.g. 8xh100, 1xh200, '
                         '2x8xh100: nodes x GPUs per node x card) nor a TPU slice (e.g. v5e-16)')
    nodes, per_node = int(m.group(1) or 1), int(m.group(2) or 1)
    domain = GPUS[m.group(3)].nvlink_domain
    if not 1 <= per_node <= domain or nodes < 1:
        raise ValueError(f'--topology={name!r}: a node holds 1 to {domain} {m.group(3)} GPUs '
                         'and there is at least one node (e.g. 8xh100, 2x8xh100)')
    return GpuNodes(m.group(3), nodes, per_node)


def _gpu_devices(target: GpuNodes, text: str | None = None) -> list:
    """The nodes' jax devices (for compiling only), from XLA's description of the card; a
    description the compiler cannot read is a one-line ValueError."""
    platforms.compile_only_gpu()
    from jax.experimental import topologies

    text = spec_text(target.gpu) if text is None else text
    # The plugin says which field it could not parse on stderr (C++ logging), the exception only
    # that it failed: stderr is read back for the one-line error.
    with tempfile.TemporaryFile(mode='w+b') as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            topology = topologies.get_topology_desc(platform='cuda', topology=target.topology,
                                                    target_config=text)
            error = None
        except Exception as e:  # the plugin's errors come as several exception types
            error = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        logged = captured.read().decode(errors='replace')
    if error is not None:
        why = re.search(r'Error parsing text-format [\w.]+: (.*)', logged)
        first = why.group(1) if why else ' '.join(
            (str(error).strip().splitlines() or [''])[:1]
            + ["(XLA's log names the field; TF_CPP_MIN_LOG_LEVEL=3 hides it)"])
        raise ValueError(f'--topology={target.name}: XLA cannot read the target description '
                         f'{target.card.spec_file}: {first.strip()}') from None
    return list(topology.devices)


# ----------------------------------------------------------------------------------------------
# Either


Target = TpuSlice | GpuNodes


def parse(name: str) -> Target:
    """A TPU slice ('v5e-16', 'v5e:4x4') or GPU nodes ('8xh100', '2x8xh100'); ValueError (one
    line) for anything else."""
    return parse_gpus(name) if re.match(r'\s*\d|\s*[a-uw-z]', name.lower()) else parse_slice(name)


def devices(target: Target, spec: str | None = None) -> list:
    """The target's compile-only jax devices, described on this CPU (libtpu, or XLA's CUDA
    compiler from the card's description: t2t/aot/gpu_specs/'s, or the text `spec`)."""
    if isinstance(target, GpuNodes):
        return _gpu_devices(target, spec)
    return _tpu_devices(target)
