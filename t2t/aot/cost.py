"""A TPU step's time from its compiled program, two ways, neither a measurement, and where its
bytes go.

    compiled = aot.compile_train_step(config, plan.mesh)     # t2t/aot/tpu.py
    compiled.roofline.seconds     # Roofline: a lower bound from FLOPs, HBM bytes, collective bytes
    compiled.estimate.seconds     # Estimate: XLA's cost model, loops counted by trip count
    compiled.estimate.mfu(flops.config_flops_per_step(config), plan.mesh.size)
    cost.breakdown(compiled.hlo_text)   # HBM and collective bytes per traced operation

The chips' numbers (bf16 peak, HBM bandwidth, bidirectional ICI bandwidth) are
t2t/infra/metrics.py's table, the one the training loop's MFU uses.

XLA's estimate: the TPU compiler's cost_analysis() holds `optimal_seconds`, its cost model's time
of the per-device program: a sum over the top-level ops, each costed on its own, with each while
loop's body counted once whatever its trip count (as its 'flops' and 'bytes accessed' are; seen
on v5e: optimal_seconds = bytes accessed / a fixed rate). Compile-only clients give no per-op or
per-computation cost, so the loops' other trips are added: each op of a loop body costed as the
model costs it, max(its FLOPs / peak, its bytes accessed in every memory space / the rate XLA's
own bytes accessed / optimal_seconds imply), times the runs past the first. Without loops the
estimate is XLA's number.

Where XLA's number is not a time: its cost analysis gives a custom-call it has no rule for -1 s
(and -1 byte, -1 FLOP: "unknown"), and the TPU compiler's ConcatBitcast, which joins the slices
of a sliced prefetch in place, is one (ZeroCrop and SliceId, in multi-slice programs, others).
Base and big on v5e hold hundreds, so optimal_seconds is about minus their count; adding the
count back does not give XLA's time either, as its float32 sum, running near that negative
total, rounds away most of the other ops' microseconds. Such a program gets no estimate, and the
report says why (uncosted_custom_calls); compiled with sliced prefetches off
(LIBTPU_INIT_ARGS=--xla_tpu_sliced_prefetch_max_slices=0) a single-slice program has none and
gets one; a multi-slice program keeps its ZeroCrops.
"""

from __future__ import annotations

import dataclasses
import math
import re

from t2t.aot import hlo
from t2t.aot import memory as hlo_memory
from t2t.infra import metrics


def _spec(chip: str) -> metrics.Chip:
    return metrics.CHIPS[chip]


@dataclasses.dataclass(frozen=True)
class Roofline:
    """max(FLOPs / peak, HBM bytes / HBM bandwidth) + collective bytes / ICI bandwidth, per device.

    A lower bound, not a measurement: it assumes every matmul at the chip's bf16 peak, the memory
    traffic at full HBM bandwidth overlapping the compute, and the collectives' operand bytes
    moved at the chip's whole bidirectional ICI bandwidth (a ring all-reduce moves about twice
    its operand; a device uses its links partly) without overlapping anything. Elementwise work
    is in the memory term only. Real steps are slower by the efficiencies this leaves out."""

    chip: str  # key of metrics.CHIPS
    flops: float  # matmul FLOPs per device per run, loops by trip count (hlo.matmul_flops)
    memory_bytes: float  # HBM bytes read and written per device (hlo_memory.memory_bytes)
    collective_bytes: float  # collectives' operand bytes per device (hlo.collectives)

    @property
    def compute_s(self) -> float:
        return self.flops / _spec(self.chip).peak_bf16_flops

    @property
    def memory_s(self) -> float:
        return self.memory_bytes / _spec(self.chip).hbm_bytes_per_s

    @property
    def collective_s(self) -> float:
        return self.collective_bytes / _spec(self.chip).ici_bytes_per_s

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.collective_s

    def mfu(self, model_flops_per_step: float, devices: int) -> float:
        """The MFU the bound allows: an upper bound (model FLOPs / bound / peak of all devices)."""
        return metrics.mfu(model_flops_per_step, self.seconds, devices,
                           _spec(self.chip).peak_bf16_flops)


# Custom-call targets XLA's TPU cost model leaves at the generic "unknown" (-1 s each), as seen
# in t2t's programs (a Pallas kernel's tpu_custom_call is costed): ConcatBitcast joins a sliced
# prefetch; ZeroCrop and SliceId come with a multi-slice (DCN) program, whatever the flags.
UNCOSTED_TARGETS = ('ConcatBitcast', 'ZeroCrop', 'SliceId')


def uncosted_custom_calls(module) -> int:
    """Custom-calls of UNCOSTED_TARGETS as XLA's sum counts them: outside fusions (a fusion's time
    is recomputed from its bytes and FLOPs), each loop body once."""
    module = hlo._module(module)
    fused = {c for body in module.computations.values() for i in body if i.opcode == 'fusion'
             for _, c in i.called}
    targets = '|'.join(UNCOSTED_TARGETS)
    return round(sum(
        times for name, times in hlo.executions(module, loops=False).items() if name not in fused
        for i in module.computations.get(name, ())
        if i.opcode == 'custom-call' and re.search(f'custom_call_target="({targets})"',
                                                   i.attributes)))


def _fused_flops(module: hlo.Module, computation: str) -> float:
    """Matmul FLOPs inside a fused computation (and the fusions nested in it)."""
    body = module.computations.get(computation, ())
    shapes = {i.name: i.shape for i in body}
    return sum(hlo.instruction_flops(i, shapes) + sum(
        _fused_flops(module, c) for _, c in i.called if i.opcode == 'fusion') for i in body)


def op_seconds(module, chip: str, loops: bool = True, bytes_per_s: float = 0.0) -> float:
    """The cost model's shape summed over the top-level ops: each op max(FLOPs / peak, bytes
    accessed (every memory space) / bytes_per_s (default: the chip's HBM bandwidth)), times its
    runs (loops=False: each loop body once, as XLA counts)."""
    module = hlo._module(module)
    spec = _spec(chip)
    bytes_per_s = bytes_per_s or spec.hbm_bytes_per_s
    instructions = {c: {i.name: i for i in body} for c, body in module.computations.items()}
    shapes = {c: {n: i.shape for n, i in here.items()} for c, here in instructions.items()}
    total = 0.0
    for op in hlo_memory.op_traffic(module, all_spaces=True, loops=loops):
        i = instructions[op.computation][op.name]
        flops = (sum(_fused_flops(module, c) for _, c in i.called) if i.opcode == 'fusion'
                 else hlo.instruction_flops(i, shapes[op.computation]))
        total += op.times * max(flops / spec.peak_bf16_flops, op.bytes / bytes_per_s)
    return total


def loop_extra_seconds(module, chip: str, bytes_per_s: float = 0.0) -> float:
    """What a once-counted loop body leaves out: op_seconds with loops by trip count less
    op_seconds with each body once (0.0 without loops)."""
    module = hlo._module(module)
    return (op_seconds(module, chip, True, bytes_per_s)
            - op_seconds(module, chip, False, bytes_per_s))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """XLA's cost model's time of one run per device: its optimal_seconds (each loop body once)
    plus the loop bodies' other trips (loop_extra_seconds, costed at the bytes per second XLA's
    own bytes accessed / optimal_seconds imply). An estimate of a model, not a measurement; not a
    bound either way."""

    chip: str  # key of metrics.CHIPS
    optimal_seconds: float  # XLA cost_analysis()'s, each loop body counted once
    loop_extra_seconds: float  # the loops' trips past the first (t2t/aot/cost.py)

    @property
    def seconds(self) -> float:
        return self.optimal_seconds + self.loop_extra_seconds

    @property
    def scale(self) -> float:
        """seconds / optimal_seconds: 1.0 for a program without loops."""
        return self.seconds / self.optimal_seconds

    def mfu(self, model_flops_per_step: float, devices: int) -> float:
        """Model FLOPs / the estimated time / the peak of all devices."""
        return metrics.mfu(model_flops_per_step, self.seconds, devices,
                           _spec(self.chip).peak_bf16_flops)


def estimate(text, chip: str, optimal_seconds: float, xla_bytes_accessed: float) -> Estimate:
    """XLA's estimate of a compiled program with its loops counted by trip count."""
    rate = (xla_bytes_accessed / optimal_seconds
            if xla_bytes_accessed > 0 and optimal_seconds > 0 else 0.0)
    return Estimate(chip, optimal_seconds, loop_extra_seconds(text, chip, rate))


def _ms(seconds: float) -> str:
    return f'{seconds * 1e3:.3g} ms'


def roofline_lines(compiled, run: str = 'step') -> list[str]:
    """The dry run's lines on memory traffic and the roofline bound of `compiled` (a
    t2t.aot.tpu.Compiled; none without a roofline)."""
    r = compiled.roofline
    if r is None:
        return []
    chip = _spec(r.chip)
    return [
        f'  memory traffic per device per {run}: {r.memory_bytes / 1e9:.4g} GB (compiled HLO, '
        f'operands and results of each top-level op, loops counted by trip count); XLA '
        f'cost_analysis bytes accessed {compiled.xla_bytes_accessed / 1e9:.4g} GB (each loop '
        'body counted once)',
        f'  roofline LOWER BOUND of the {run} time (not a measurement; {r.chip} datasheet: '
        f'{chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, HBM {chip.hbm_bytes_per_s / 1e9:.0f} '
        f'GB/s, ICI {chip.ici_bytes_per_s / 1e9:.0f} GB/s per chip): max(compute '
        f'{r.flops:.4g} FLOP / peak = {_ms(r.compute_s)}, memory {r.memory_bytes:.4g} B / HBM = '
        f'{_ms(r.memory_s)}) + collectives {r.collective_bytes:.4g} B / ICI = '
        f'{_ms(r.collective_s)}; bound {_ms(r.seconds)}',
    ]


def estimate_lines(compiled, devices: int, model_flops: float | None = None,
                   run: str = 'step') -> list[str]:
    """The dry run's line on XLA's estimate of `compiled` and, given the model FLOPs of a run,
    the MFU it implies and the MFU the roofline bound allows (none without an estimate)."""
    e = compiled.estimate
    if e is None:
        opt = getattr(compiled, 'xla_optimal_seconds', math.nan)
        if compiled.roofline is None or not math.isfinite(opt):
            return []
        uncosted = getattr(compiled, 'xla_uncosted', 0)
        if uncosted:
            return [f'  XLA ESTIMATE of the {run} time: none (its cost_analysis gave '
                    f'optimal_seconds {opt:.4g}: -1 s for each of {uncosted} custom-calls it '
                    'cannot cost, the rest lost to float32 rounding; ConcatBitcast, of sliced '
                    'prefetches: a time with LIBTPU_INIT_ARGS='
                    '--xla_tpu_sliced_prefetch_max_slices=0; ZeroCrop and SliceId, of a '
                    'multi-slice program: none found)']
        return [f'  XLA ESTIMATE of the {run} time: none (its cost_analysis gave '
                f'optimal_seconds {opt:.4g}, not a time)']
    line = (f'  XLA ESTIMATE of the {run} time (its cost model, not a measurement): '
            f'optimal_seconds {_ms(e.optimal_seconds)} (each loop body once) + loops\' other '
            f'trips {_ms(e.loop_extra_seconds)} = {_ms(e.seconds)}')
    if model_flops:
        line += (f'; MFU it implies {100 * e.mfu(model_flops, devices):.3g}% (t2t/infra/flops.py '
                 f'{model_flops:.4g} FLOP / {devices} x {_spec(e.chip).peak_bf16_flops / 1e12:.0f}'
                 ' TFLOP/s)')
        if compiled.roofline is not None:
            line += (f'; the roofline bound allows at most '
                     f'{100 * compiled.roofline.mfu(model_flops, devices):.3g}%')
    return [line]


# ----------------------------------------------------------------------------------------------
# Where the bytes go


def source(op_name: str) -> str:
    """A traced operation's name without the jit prefix, layer numbers folded ('layers_3' ->
    'layers_*'): the ops of every layer of a stack fall together."""
    name = re.sub(r'^jit\([^)]*\)/', '', op_name)
    return re.sub(r'(layers?|block|encoderblock|decoderblock)_\d+', r'\1_*', name) or '(none)'


@dataclasses.dataclass(frozen=True)
class Share:
    """What one group of ops moves per device per run, loops by trip count."""

    key: str
    memory_bytes: float  # HBM bytes read and written (hlo_memory.op_traffic)
    collective_bytes: float  # collectives' operand bytes (hlo.collective_ops)
    ops: int  # instructions in the group (each counted once, however often it runs)
    in_loops_bytes: float = 0.0  # of memory_bytes + collective_bytes, from inside while loops


def breakdown(text, key=None) -> list[Share]:
    """HBM bytes and collective bytes of one run grouped by key(op) (default: the op's opcode and
    source(op_name)), largest first. Sums to hlo_memory.memory_bytes and to the collectives'
    bytes (hlo.collectives) of the same program."""
    module = hlo._module(text)
    key = key or (lambda opcode, op_name: f'{opcode} {source(op_name)}')
    in_loop = {name for (name, looped) in hlo._runs_by_loop(module) if looped}
    groups: dict[str, list[float]] = {}
    for op in hlo_memory.op_traffic(module):
        g = groups.setdefault(key(op.opcode, op.op_name), [0.0, 0.0, 0, 0.0])
        g[0] += op.total
        g[2] += 1
        g[3] += op.total if op.computation in in_loop else 0.0
    for op in hlo.collective_ops(module):
        g = groups.setdefault(key(op.kind, op.op_name), [0.0, 0.0, 0, 0.0])
        g[1] += op.times * op.bytes
        g[2] += 1
        g[3] += op.times * op.bytes if op.in_loop else 0.0
    shares = [Share(k, m, c, n, looped) for k, (m, c, n, looped) in groups.items()]
    return sorted(shares, key=lambda s: -(s.memory_bytes + s.collective_bytes))
