"""Ahead-of-time compiles for a TPU slice on this machine's CPU: memory, FLOPs, the largest batch.

    tpu = aot.parse_slice('v5e-16')                  # or 'v5e:4x4', 'v5litepod-16'
    plan = aot.plan(config, 'v5e-16')                # devices of the slice, the config's mesh
    train = aot.compile_train_step(config, plan.mesh)   # Compiled: memory, matmul FLOPs, s
    train.memory.total <= plan.tpu.hbm_bytes         # what the step keeps resident per device
    predict = aot.compile_predict(config, plan.mesh)    # beam search on an eval batch
    train.roofline.seconds                           # lower bound of the step on the chips
    train.estimate.seconds                           # XLA's cost model, loops by trip count

XLA's TPU compiler ships in libtpu and runs without TPU hardware: jax.experimental.topologies
describes the devices of a slice, the real train step (train_lib.jit_train_step on
train_lib.abstract_state) lowers for a mesh over them and compiles, compiled.memory_analysis()
gives the buffers XLA assigned per device (MaxText's train_compile.py does the same). FLOPs come
from the compiled HLO (t2t/aot/hlo.py: dots and convolutions, each loop body times its trip count);
XLA's own cost_analysis() counts a loop body once, so it undercounts scanned layers and the
loss's chunk loop, and is kept only as what it is. The roofline (Roofline) bounds the step time
from below with those FLOPs, the HBM traffic and the collectives of the compiled HLO and the
chip's datasheet numbers (t2t/infra/metrics.py's CHIPS); the estimate (Estimate) is XLA's cost
model's time with the loops put back (t2t/aot/cost.py). The process itself runs on the CPU
backend (platforms.py).

What memory_analysis counts, per device: arguments (state and batch shards), outputs, aliased
(outputs written into donated arguments, counted once), temporaries (XLA's scratch at its peak:
activations, gradients, Adam's updates) and the generated code. It does not count the TPU
runtime's own reservation, other executables alive at the same time (the predict function's
buffers are reported separately), the input pipeline's device buffers, nor fragmentation: hence
the HBM_MARGIN kept free before calling a size a fit.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from t2t import attention_choice, inference, optim, sharding, train_lib
from t2t.aot import cost, hlo
from t2t.aot import memory as hlo_memory
from t2t.aot.cost import Estimate, Roofline, roofline_lines  # noqa: F401 (aot.roofline_lines)
from t2t.infra import metrics, platforms
from t2t.model import TransformerConfig

GIB = 1 << 30
HBM_MARGIN = 0.05  # of HBM kept free for what memory_analysis does not count


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
                         'v5p-8, v6e-256, or a topology such as v5e:4x4, v5p:2x2x1)')
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


def topology_devices(tpu: TpuSlice) -> list:
    """The slice's jax devices (for compiling only), described by libtpu on this machine."""
    platforms.compile_only_tpu(tpu.accelerator_type)
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform='tpu', topology_name=tpu.topology, chip_config_name=tpu.chip.chip_config,
        chips_per_host_bounds=tpu.chips_per_host_bounds, num_slices=1)
    return list(topology.devices)


# ----------------------------------------------------------------------------------------------
# The plan: slice, mesh and batch checks, all before any compile


def data_parallel(mesh_shape: dict) -> int:
    """Devices a batch is split over (the batch axis shards over data and fsdp)."""
    return mesh_shape['data'] * mesh_shape['fsdp']


def batch_unit(config, mesh_shape: dict) -> int:
    """The batch sizes that divide: multiples of this (data-parallel devices x micro-batches)."""
    return data_parallel(mesh_shape) * max(config.grad_accum_steps, 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    tpu: TpuSlice
    mesh: jax.sharding.Mesh
    batch_step: int  # batch sizes tried by the search are multiples of this
    attention: str = ''  # the attention kernel and why (check_tpu_kernel)

    @property
    def hosts(self) -> int:
        return len({d.process_index for d in self.mesh.devices.flat})

    @property
    def device_kind(self) -> str:
        return self.mesh.devices.flat[0].device_kind


def check_tpu_kernel(config) -> str:
    """config.attention_impl resolved for a TPU slice and written back (t2t/attention_choice.py);
    returns the line saying which kernel and why. ValueError (one line) for a kernel a TPU does
    not have."""
    configured = config.get('attention_impl', 'xla')
    impl, reason = attention_choice.resolve_attention_impl(config, 'tpu')
    config.attention_impl = impl
    return attention_choice.describe(configured, impl, reason)


def plan(config, slice_name: str, batch_step: int = 0) -> Plan:
    """The slice, its devices and the config's mesh over them; ValueError (one line) on bad input.

    The slice name and the mesh shape are checked before libtpu is loaded, the batch sizes against
    the mesh (as in training) before anything compiles. batch_step: the search's granularity,
    a multiple of batch_unit (0: batch_unit itself).
    """
    tpu = parse_slice(slice_name)
    attention = check_tpu_kernel(config)
    try:
        shape = sharding.resolve_mesh_shape(config.mesh_shape, tpu.chips)
    except ValueError as e:
        raise ValueError(f'{e} (--topology={slice_name} has {tpu.chips} devices)') from None
    unit = batch_unit(config, dict(zip(sharding.MESH_AXES, shape, strict=True)))
    if batch_step % unit:
        raise ValueError(f'--batch_step={batch_step} is not a multiple of {unit} (data-parallel '
                         f'devices x grad_accum_steps of mesh {shape})')
    from t2t.run import startup  # the batch and length checks of a training run

    mesh = sharding.make_mesh(config.mesh_shape, devices=topology_devices(tpu))
    startup.check_training_config(config, mesh)
    return Plan(tpu, mesh, batch_step or unit, attention)


# ----------------------------------------------------------------------------------------------
# Compiling


@dataclasses.dataclass(frozen=True)
class Memory:
    """compiled.memory_analysis(), bytes per device."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int

    @property
    def total(self) -> int:
        """What is resident while the executable runs: aliased outputs reuse argument buffers."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @classmethod
    def of(cls, compiled) -> Memory:
        m = compiled.memory_analysis()
        return cls(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                   aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                   code=m.generated_code_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What one compile gave: memory and FLOPs, or the TPU compiler's out-of-memory error."""

    memory: Memory | None  # None when the compiler ran out of HBM
    # XLA's cost_analysis of the per-device program: every op, but each loop body counted once
    # (scanned layers, the loss's chunks), so not what a step executes.
    flops_per_device: float
    seconds: float  # lower + compile
    out_of_memory: str = ''  # the compiler's RESOURCE_EXHAUSTED message
    # Dot and convolution FLOPs of the per-device program, loops counted by trip count (hlo.py)
    matmul_flops_per_device: float = math.nan
    unknown_loops: int = 0  # while loops whose trip count hlo.py could not find (counted once)
    hlo_text: str = dataclasses.field(default='', repr=False)  # compiled.as_text()
    # {kind: hlo.Collectives}: count and operand bytes per device per run, outside / in loops
    collectives: dict = dataclasses.field(default_factory=dict)
    # XLA's cost_analysis 'bytes accessed' per device (each loop body counted once)
    xla_bytes_accessed: float = math.nan
    # The same memory traffic from the HLO, loops counted by trip count (hlo_memory.memory_bytes)
    memory_bytes_per_device: float = math.nan
    roofline: Roofline | None = None  # the step-time lower bound on the slice's chips
    # XLA cost_analysis 'optimal_seconds': its cost model's time, each loop body counted once
    xla_optimal_seconds: float = math.nan
    estimate: Estimate | None = None  # that time with loops by trip count (t2t/aot/cost.py)
    # Custom-calls XLA's cost model holds at -1 s each: optimal_seconds is then no time
    xla_uncosted: int = 0

    @property
    def collective_bytes(self) -> int:
        """Operand bytes of every collective of one run, per device, loops by trip count."""
        return sum(c.bytes + c.in_loops_bytes for c in self.collectives.values())

    def fits(self, hbm_bytes: int, margin: float = HBM_MARGIN) -> bool:
        if self.memory is None:
            return False
        return self.memory.total <= (1.0 - margin) * hbm_bytes


def _compile(jitted, *abstract_args) -> Compiled:
    """jitted.lower(...).compile(); a jit_train_step lowers with its mesh and axis rules active."""
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*abstract_args).compile()
    except jax.errors.JaxRuntimeError as e:
        # Buffers that cannot fit make the compiler itself give up (it knows the usable HBM).
        message = str(e).strip().splitlines()[0]
        if 'RESOURCE_EXHAUSTED' not in message:
            raise
        return Compiled(None, math.nan, time.perf_counter() - start, out_of_memory=message)
    seconds = time.perf_counter() - start
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    text = compiled.as_text()
    module = hlo.parse(text)
    unknown = sum(n is None for n in hlo.while_trip_counts(module).values())
    return Compiled(Memory.of(compiled), float(costs.get('flops', math.nan)), seconds,
                    matmul_flops_per_device=hlo.matmul_flops(module), unknown_loops=unknown,
                    hlo_text=text, collectives=hlo.collectives(module),
                    xla_bytes_accessed=float(costs.get('bytes accessed', math.nan)),
                    xla_optimal_seconds=float(costs.get('optimal_seconds', math.nan)),
                    xla_uncosted=cost.uncosted_custom_calls(module),
                    memory_bytes_per_device=hlo_memory.memory_bytes(module))


def compile_jitted(jitted, *abstract_args) -> Compiled:
    """Any jitted function (another model's train step, to compare) compiled for abstract
    arguments sharded over a TPU mesh and read as the train step is; with_roofline(result, mesh)
    adds the bound and XLA's estimate."""
    return _compile(jitted, *abstract_args)


def abstract_batch(config, mesh, rows: int | None = None) -> dict:
    """A training batch as ShapeDtypeStructs: rows x max_len int32 per key, split over data."""
    shape = (config.batch_size if rows is None else rows, config.max_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(mesh))
            for k in train_lib.BATCH_KEYS}


def compile_train_step(config, mesh) -> Compiled:
    """The training run's step for config.batch_size rows, state sharded and donated as there."""
    tx = optim.make_optimizer(config)
    state = train_lib.abstract_state(config, mesh, tx)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings, mesh)
    return with_roofline(_compile(step, state, abstract_batch(config, mesh)), mesh)


def compile_predict(config, mesh) -> Compiled:
    """Beam search (config's beam, alpha, lengths) on eval_batch_size x max_eval_len sources.

    The longest evaluation bucket, decoded as the in-training BLEU does: every device of the mesh
    decodes its own rows (eval_batch_size padded to a multiple of the devices); the parameters
    come sharded like the training state's and are gathered inside (a temporary).
    """
    state = train_lib.abstract_state(config, mesh, optim.make_optimizer(config))
    predict = inference.config_predict_fn(config, TransformerConfig.from_config(config),
                                          num_valid_ids=config.vocab_size, mesh=mesh)
    rows = config.eval_batch_size + (-config.eval_batch_size % mesh.size)
    inputs = jax.ShapeDtypeStruct((rows, config.max_eval_len), jnp.int32,
                                  sharding=sharding.decode_sharding(mesh))
    # shard_map'd: no logical constraints inside, so lowered outside the axis rules.
    return with_roofline(_compile(predict, state.params, inputs), mesh)


def with_roofline(compiled: Compiled, mesh) -> Compiled:
    """compiled with its Roofline and XLA's Estimate for the mesh's TPU chip (t2t/aot/cost.py;
    unchanged on other devices, or when the compiler ran out of memory)."""
    chip = metrics.chip(mesh.devices.flat[0].device_kind)
    if chip is None or chip.name not in CHIPS or compiled.memory is None:
        return compiled
    roofline = Roofline(chip.name, compiled.matmul_flops_per_device,
                        compiled.memory_bytes_per_device, compiled.collective_bytes)
    estimate = None
    opt = compiled.xla_optimal_seconds
    if math.isfinite(opt) and opt > 0 and not compiled.xla_uncosted:
        estimate = cost.estimate(compiled.hlo_text, chip.name, compiled.xla_optimal_seconds,
                                 compiled.xla_bytes_accessed)
    return dataclasses.replace(compiled, roofline=roofline, estimate=estimate)


# ----------------------------------------------------------------------------------------------
# The largest batch


@dataclasses.dataclass(frozen=True)
class MaxBatch:
    largest: int | None  # the largest batch seen to fit (None: not even the smallest tried)
    smallest_failing: int | None  # the smallest seen not to fit (None: all tries fit)
    tries: tuple[tuple[int, bool], ...]  # (batch, fits) in the order compiled
    unit: int

    @property
    def exact(self) -> bool:
        """The answer is exact: the next multiple of `unit` above `largest` failed."""
        if self.smallest_failing is None:
            return False
        return (self.largest or 0) + self.unit >= self.smallest_failing


def _round(batch: float, unit: int) -> int:
    return max(unit, int(batch) // unit * unit)


def search_max_batch(measure: Callable[[int], Memory | None], start: int, unit: int,
                     max_tries: int, limit_bytes: float) -> MaxBatch:
    """Largest multiple of `unit` whose measure(batch).total <= limit_bytes, in max_tries measures.

    measure(batch) -> Memory (bytes per device), or None when the compiler ran out of memory; the
    total must grow with the batch. Compiles are the cost, so each try is placed with the numbers
    of the last one: where they put the limit (temporaries grow with the batch, the rest does
    not), kept at least one unit inside what is known (above the largest fit, below the smallest
    failure). Without numbers (the compiler ran out of memory) the batch halves, or the interval
    is bisected. The first try is `start` rounded down to a multiple of unit.
    """
    if unit < 1 or max_tries < 1:
        raise ValueError(f'unit={unit} and max_tries={max_tries} must be >= 1')
    tries: list[tuple[int, bool]] = []
    lo, hi = None, None  # largest fitting, smallest failing
    batch = _round(start, unit)
    while len(tries) < max_tries:
        memory = measure(batch)
        fits = memory is not None and memory.total <= limit_bytes
        tries.append((batch, fits))
        lo, hi = (batch, hi) if fits else (lo, batch)
        if hi is not None and hi - (lo or 0) <= unit:
            break  # exact, or not even the smallest batch fits
        if memory is not None and memory.temporaries > 0:
            fixed = memory.total - memory.temporaries
            batch = _round(batch * (limit_bytes - fixed) / memory.temporaries, unit)
            if lo is not None:
                batch = max(batch, lo + unit)
            if hi is not None:
                batch = min(batch, hi - unit)
        elif hi is None:
            batch = 2 * lo
        elif lo is None:
            batch = _round(hi // 2, unit)
        else:
            batch = (lo + hi) // 2 // unit * unit
    return MaxBatch(lo, hi, tuple(tries), unit)
