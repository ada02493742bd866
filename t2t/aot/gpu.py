"""What a compile for GPU nodes adds to the dry run: XLA's own counts, the attention kernel that
was compiled, the collectives split by NVLink domain, and a roofline of the node.

    counts, source = gpu.xla_cost_analysis(compiled)     # flops, bytes accessed (loop bodies once)
    gpu.attention_calls(text)                            # cuDNN fused-attention calls (fwd, bwd)
    gpu.network(text, nodes)                             # collectives by link, bytes sent
    gpu.largest_buffer(text, 'loss')                     # the loss's largest buffer
    GpuRoofline(...).seconds                             # an estimate, not a measurement

XLA's GPU compiler gives no cost_analysis() on a compile-only client (it returns None); its
HloCostAnalysis of the optimized module comes through a private jax binding, which may move
between jax releases: when it does, the report says there are no XLA counts, nothing fails.
Partition k of the compiled program runs on mesh.devices.flat[k]; a device's node is its
process_index (jax's compile-only CUDA topology gives each host of N x 1 x G its own).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from t2t.aot import hlo
from t2t.infra import metrics

CUDNN_ATTENTION = '__cudnn$fmha'  # the prefix of cuDNN's fused-attention custom-call targets


def xla_cost_analysis(compiled) -> tuple[dict, str]:
    """({'flops': ..., 'bytes accessed': ...}, what they are), or ({}, why there are none)."""
    try:
        import jax
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        costs = dict(_jax.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module))
    except Exception as e:  # a private binding: gone or changed in another jax release
        return {}, (f"none (compiled.cost_analysis() is None on this target and jax's "
                    f'HloCostAnalysis binding failed: {type(e).__name__})')
    return costs, 'HloCostAnalysis of the optimized module (compiled.cost_analysis() is None here)'


def _top_level(module: hlo.Module):
    """(computation, runs per run, instructions) of everything not inside a fusion."""
    fused = {c for body in module.computations.values() for i in body if i.opcode == 'fusion'
             for _, c in i.called}
    for name, times in hlo.executions(module).items():
        if name not in fused:
            yield name, times, module.computations.get(name, ())


def attention_calls(text) -> tuple[float, float]:
    """cuDNN fused-attention calls per run (forward, backward), loops by trip count."""
    module = hlo._module(text)
    forward = backward = 0.0
    for _, times, body in _top_level(module):
        for i in body:
            target = re.search(r'custom_call_target="([^"]*)"', i.attributes)
            if i.opcode == 'custom-call' and target and target.group(1).startswith(
                    CUDNN_ATTENTION):
                if target.group(1).endswith('Backward'):
                    backward += times
                else:
                    forward += times
    return forward, backward


def largest_buffer(text, scope: str) -> tuple[str, int]:
    """(type, bytes) of the largest array an op traced under jax.named_scope(scope) writes to
    memory (top-level ops: a fusion's insides stay on chip); ('', 0) if there is none."""
    module = hlo._module(text)
    best = ('', 0)
    # jit(train_step)/jvp(loss)/mul, transpose(jvp(loss))/...: the scope under transformations
    pattern = re.compile(rf'op_name="[^"]*[/(]{re.escape(scope)}\)*/')
    for _, _, body in _top_level(module):
        for i in body:
            if i.opcode in ('parameter', 'tuple', 'get-tuple-element', 'bitcast') or \
                    not pattern.search(i.attributes):
                continue
            for dtype, dims in hlo._ARRAY.findall(i.shape):
                array = f'{dtype}[{dims}]'
                size = hlo.shape_bytes(array)
                if size > best[1]:
                    best = (array, size)
    return best


# ----------------------------------------------------------------------------------------------
# Collectives by network

_IOTA = re.compile(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?')
_LISTS = re.compile(r'(replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}')
# replica_groups=mesh['axis_0'=2,'axis_1'=8], device_ids=([8,2]T(1,0)) {'axis_0'}: the devices
# (an iota [dims]T(perm) or a list; absent: 0..N-1) laid out on the named axes, grouped along the
# axes in braces.
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:\[([\d,]+)\]"
                   r"(?:T\(([\d,]+)\))?|([\d,]+))\))?\s*\{([^}]*)\}")


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list [dims]T(perm): 0..N-1 laid out as dims, then transposed."""
    shape = [int(d) for d in dims.split(',')]
    ids = np.arange(np.prod(shape)).reshape(shape)
    return ids.transpose([int(d) for d in perm.split(',')]) if perm else ids


def _mesh_groups(found: re.Match) -> list[list[int]]:
    axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    if found.group(4):
        ids = np.array([int(d) for d in found.group(4).split(',') if d])
    else:
        ids = _iota(found.group(2) or str(np.prod(sizes)), found.group(3))
    grouped = [names.index(a) for a in re.findall(r"'(\w+)'", found.group(5))]
    kept = [i for i in range(len(names)) if i not in grouped]
    ids = ids.reshape(sizes).transpose(kept + grouped)
    return ids.reshape(-1, int(np.prod([sizes[i] for i in grouped]))).tolist()


def groups(attributes: str, devices: int) -> list[list[int]]:
    """The device groups of a collective: its replica groups (a list, the iota form
    [G,S]<=[dims]T(perm) or the mesh form above), a collective-permute's source-target pairs;
    none given: all devices. Replica groups in another form: a ValueError, not a guess."""
    mesh = _MESH.search(attributes)
    if mesh:
        return _mesh_groups(mesh)
    iota = _IOTA.search(attributes)
    if iota:
        shape = [int(d) for d in iota.group(1).split(',')]
        return _iota(iota.group(2), iota.group(3)).reshape(shape).tolist()
    found = _LISTS.search(attributes)
    if found and found.group(2):
        return [[int(d) for d in g.split(',') if d] for g in re.findall(r'\{([\d,]*)\}',
                                                                         found.group(2))]
    if 'replica_groups=' in attributes and 'replica_groups={}' not in attributes:
        start = attributes.index('replica_groups=')
        raise ValueError(f'replica groups in a form t2t/aot/gpu.py does not read: '
                         f'{attributes[start:start + 120]}')
    return [list(range(devices))]


@dataclasses.dataclass(frozen=True)
class Network:
    """Collectives of one run per device, loops by trip count: those whose every group stays in
    one node (NVLink) and those with a group spanning nodes (the network), count and operand
    bytes; and the bytes a GPU sends over each link for all of them (`sent_bytes`)."""

    nvlink_count: float = 0.0
    nvlink_bytes: float = 0.0
    internode_count: float = 0.0
    internode_bytes: float = 0.0
    nvlink_sent: float = 0.0
    internode_sent: float = 0.0


# NCCL's ring algorithms: of a buffer B, each of n GPUs sends 2(n-1)/n for an all-reduce,
# (n-1)/n for a reduce-scatter (B its input), an all-gather (B its output) or an all-to-all.
# A group over N nodes of G GPUs goes hierarchically: the ring of G inside each node on NVLink,
# the same algorithm over the N nodes on the network, each GPU carrying B/G of it on its own NIC;
# an all-to-all sends its other nodes' share (N-1)/N of B whole over the network.
_RING_PASSES = {'all-reduce': 2, 'reduce-scatter': 1, 'all-gather': 1}


def sent_bytes(kind: str, operand_bytes: float, group_nodes: Sequence[int]) -> tuple[float,
                                                                                     float]:
    """(NVLink, network) bytes one GPU sends for one collective of `kind` whose operand on a
    device is `operand_bytes` (an all-gather's shard, the others' whole buffer), over a group
    whose member k sits on node group_nodes[k] (the model above: an estimate)."""
    n = len(group_nodes)
    if n < 2:
        return 0.0, 0.0
    counts = list(collections.Counter(group_nodes).values())
    nodes, per_node = len(counts), max(counts)
    buffer = operand_bytes * n if kind == 'all-gather' else operand_bytes
    if kind == 'collective-permute':  # a pair: the operand to the other GPU
        return (0.0, buffer) if nodes > 1 else (buffer, 0.0)
    if kind == 'all-to-all':
        return buffer * (per_node - 1) / n, buffer * (n - per_node) / n
    passes = _RING_PASSES[kind]
    return (passes * buffer * (per_node - 1) / per_node,
            passes * buffer * (nodes - 1) / nodes / per_node)


def network(text, nodes: Sequence[int]) -> Network:
    """Split the collectives of a program whose partition k runs on node nodes[k]."""
    module = hlo._module(text)
    attributes = {(c, i.name): i.attributes for c, body in module.computations.items()
                  for i in body}
    split = [0.0] * 6
    for op in hlo.collective_ops(module):
        members = [[nodes[d] for d in g] for g in
                   groups(attributes[op.computation, op.name], len(nodes))]
        spans = any(len(set(g)) > 1 for g in members)
        split[2 * spans] += op.times
        split[2 * spans + 1] += op.times * op.bytes
        # A device sits in one group (a permute: one pair): the groups' mean.
        sent = [sent_bytes(op.kind, op.bytes, g) for g in members]
        split[4] += op.times * sum(s[0] for s in sent) / len(sent)
        split[5] += op.times * sum(s[1] for s in sent) / len(sent)
    return Network(*split)


# ----------------------------------------------------------------------------------------------
# The roofline


@dataclasses.dataclass(frozen=True)
class GpuRoofline:
    """max(FLOPs / peak, HBM bytes / HBM bandwidth) + NVLink bytes / NVLink bandwidth + network
    bytes / network bandwidth, per GPU: an estimate from the datasheet, not a measurement (every
    matmul at the tensor cores' dense peak, memory at full HBM bandwidth overlapping the compute,
    the bytes a GPU sends under NCCL's ring model (`sent_bytes`) at the link's bandwidth in one
    direction, half the datasheet's both-way number, the collectives not overlapped).
    No autotuning on a compile-only client: the kernels are XLA's defaults."""

    chip: str  # key of metrics.CHIPS
    flops: float  # matmul FLOPs per device per run (hlo.matmul_flops, cuDNN and cuBLAS calls too)
    memory_bytes: float  # HBM bytes per device (t2t/aot/memory.py)
    network: Network
    internode_bytes_per_s: float  # the node's network per GPU, both directions
    fp32: bool = False  # float32 matmuls: TF32 tensor-core peak

    @property
    def spec(self) -> metrics.Chip:
        return metrics.CHIPS[self.chip]

    @property
    def peak_flops(self) -> float:
        return self.spec.peak_fp32_flops if self.fp32 else self.spec.peak_bf16_flops

    @property
    def compute_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_s(self) -> float:
        return self.memory_bytes / self.spec.hbm_bytes_per_s

    @property
    def nvlink_s(self) -> float:
        return self.network.nvlink_sent / (self.spec.ici_bytes_per_s / 2)

    @property
    def internode_s(self) -> float:
        return self.network.internode_sent / (self.internode_bytes_per_s / 2)

    @property
    def collective_s(self) -> float:
        return self.nvlink_s + self.internode_s

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.collective_s

    def mfu(self, model_flops_per_step: float, devices: int) -> float:
        """Model FLOPs / the estimated time / the peak of all devices (bf16, or TF32 for fp32)."""
        return metrics.mfu(model_flops_per_step, self.seconds, devices, self.peak_flops)


def _ms(seconds: float) -> str:
    return f'{seconds * 1e3:.3g} ms'


def _bytes(n: float) -> str:
    return f'{n / 1e9:.4g} GB'


def report_lines(compiled, devices: int, model_flops: float | None = None,
                 tokens: int = 0, run: str = 'step') -> list[str]:
    """The dry run's GPU lines: XLA's counts, attention kernel, loss buffer, network split and
    the roofline estimate with the MFU and tokens/s per GPU it implies."""
    lines = []
    if math.isfinite(compiled.flops_per_device):
        lines.append(f'  XLA counts per device per {run} ({compiled.xla_counts_source}; every '
                     f'op, each loop body counted once): {compiled.flops_per_device:.4g} FLOP, '
                     f'{compiled.xla_bytes_accessed:.4g} bytes accessed; HBM bytes with loops '
                     f'by trip count (compiled HLO): {compiled.memory_bytes_per_device:.4g}')
    else:
        lines.append(f'  XLA counts: {compiled.xla_counts_source}')
    forward, backward = compiled.attention_calls
    kernel = (f'cuDNN fused attention: {forward:.0f} forward + {backward:.0f} backward calls'
              if forward + backward else 'XLA softmax (no cuDNN fused-attention call)')
    lines.append(f'  attention kernel compiled: {kernel}')
    if compiled.loss_buffer[1]:
        lines.append(f"  the loss's largest buffer: {compiled.loss_buffer[0]} "
                     f'({compiled.loss_buffer[1] / (1 << 20):.1f} MiB)')
    r = compiled.roofline
    if not isinstance(r, GpuRoofline):
        return lines
    n, spec = r.network, r.spec
    lines.append(f'  collectives per device per {run}: in one node (NVLink) {n.nvlink_count:.0f} '
                 f'({_bytes(n.nvlink_bytes)}), across nodes {n.internode_count:.0f} '
                 f'({_bytes(n.internode_bytes)}); sent per GPU by NCCL\'s ring algorithms '
                 f'(hierarchical across nodes; an estimate): NVLink {_bytes(n.nvlink_sent)}, '
                 f'network {_bytes(n.internode_sent)}')
    peak = 'TF32' if r.fp32 else 'bf16'
    line = (f'  roofline ESTIMATE of the {run} time (not a measurement; {r.chip} datasheet: '
            f'{r.peak_flops / 1e12:.0f} TFLOP/s {peak}, HBM {spec.hbm_bytes_per_s / 1e9:.0f} '
            f'GB/s, NVLink {spec.ici_bytes_per_s / 2e9:.0f} GB/s and network '
            f'{r.internode_bytes_per_s / 2e9:.0f} GB/s per GPU each way): max(compute '
            f'{r.flops:.4g} FLOP = {_ms(r.compute_s)}, HBM {r.memory_bytes:.4g} B = '
            f'{_ms(r.memory_s)}) + NVLink {_ms(r.nvlink_s)} + network {_ms(r.internode_s)} = '
            f'{_ms(r.seconds)}')
    lines.append(line)
    if model_flops:
        lines.append(f'  implied by the estimate: MFU {100 * r.mfu(model_flops, devices):.3g}% '
                     f'(t2t/infra/flops.py {model_flops:.4g} FLOP / {devices} x '
                     f'{r.peak_flops / 1e12:.0f} TFLOP/s), {tokens / r.seconds / devices:.4g} '
                     'target tokens/s per GPU')
    return lines
