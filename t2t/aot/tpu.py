"""Ahead-of-time compiles on this machine's CPU for a TPU slice or GPU nodes: memory, FLOPs, the
verdict, the largest batch. (The name is the module's first target's; GPU nodes go the same way.)

    plan = aot.plan(config, 'v5e-16')                # or '8xh100', '2x8xh100' (t2t/aot/targets.py)
    train = aot.compile_train_step(config, plan.mesh)   # Compiled: memory, matmul FLOPs, s
    aot.verdict(train, plan.target.hbm_bytes, ratio=aot.recompute_ratio(train, config, n))
    predict = aot.compile_predict(config, plan.mesh)    # beam search on an eval batch
    train.roofline.seconds                           # TPU: lower bound; GPU: an estimate (gpu.py)
    train.estimate.seconds                           # XLA's cost model, loops by trip count (TPU)

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
backend (platforms.py). XLA's CUDA compiler (the gpu-aot extra) compiles for GPU nodes from
XLA's description of the card; it gives no cost_analysis() and never fails for memory, so the
verdict compares the total with the card and XLA's matmul FLOPs with the model's (t2t/aot/gpu.py
adds the rest).

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
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from t2t import attention_choice, optim, sharding, train_lib
from t2t.aot import cost, gpu, hlo, targets
from t2t.aot import memory as hlo_memory
from t2t.aot.cost import Estimate, Roofline, roofline_lines  # noqa: F401 (aot.roofline_lines)
from t2t.aot.targets import CHIPS, GIB, GpuNodes, Target, TpuSlice, parse_slice  # noqa: F401
from t2t.eval import predict as predict_lib
from t2t.infra import flops, metrics
from t2t.model import TransformerConfig

HBM_MARGIN = 0.05  # of HBM kept free for what memory_analysis does not count


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
    target: Target  # a TPU slice or GPU nodes (t2t/aot/targets.py)
    mesh: jax.sharding.Mesh
    batch_step: int  # batch sizes tried by the search are multiples of this
    attention: str = ''  # the attention kernel and why (check_kernel)

    @property
    def hosts(self) -> int:
        return len({d.process_index for d in self.mesh.devices.flat})

    @property
    def device_kind(self) -> str:
        return self.mesh.devices.flat[0].device_kind


def check_kernel(config, target: Target) -> str:
    """config.attention_impl resolved for the target's devices (t2t/attention_choice.py, no GPU to
    trace on: its compute capability unknown) and written back; returns the line saying which
    kernel and why. ValueError (one line) for a kernel the target does not have."""
    configured = config.get('attention_impl', 'xla')
    platform = 'gpu' if target.platform == 'cuda' else 'tpu'
    impl, reason = attention_choice.resolve_attention_impl(config, platform)
    config.attention_impl = impl
    return attention_choice.describe(configured, impl, reason)


def plan(config, target_name: str, batch_step: int = 0) -> Plan:
    """The target, its devices and the config's mesh over them; ValueError (one line) on bad
    input.

    The target's name and the mesh shape are checked before XLA's compiler is loaded, the batch
    sizes against the mesh (as in training) before anything compiles. batch_step: the search's
    granularity, a multiple of batch_unit (0: batch_unit itself).
    """
    target = targets.parse(target_name)
    attention = check_kernel(config, target)
    try:
        shape = sharding.resolve_mesh_shape(config.mesh_shape, target.chips)
    except ValueError as e:
        raise ValueError(f'{e} (--topology={target_name} has {target.chips} devices)') from None
    unit = batch_unit(config, dict(zip(sharding.MESH_AXES, shape, strict=True)))
    if batch_step % unit:
        raise ValueError(f'--batch_step={batch_step} is not a multiple of {unit} (data-parallel '
                         f'devices x grad_accum_steps of mesh {shape})')
    from t2t.run import startup  # the batch and length checks of a training run

    mesh = sharding.make_mesh(config.mesh_shape, devices=targets.devices(target))
    startup.check_training_config(config, mesh)
    return Plan(target, mesh, batch_step or unit, attention)


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
    # Where flops_per_device and xla_bytes_accessed come from (GPU: no cost_analysis())
    xla_counts_source: str = 'cost_analysis()'
    attention_calls: tuple[float, float] = (0.0, 0.0)  # cuDNN fused attention: forward, backward
    loss_buffer: tuple[str, int] = ('', 0)  # the loss's largest array: type, bytes

    @property
    def collective_bytes(self) -> int:
        """Operand bytes of every collective of one run, per device, loops by trip count."""
        return sum(c.bytes + c.in_loops_bytes for c in self.collectives.values())

    def fits(self, hbm_bytes: int, margin: float = HBM_MARGIN) -> bool:
        if self.memory is None:
            return False
        return self.memory.total <= (1.0 - margin) * hbm_bytes


# XLA's matmul FLOPs of a train step above the model's by more than this: XLA recomputes.
RECOMPUTE_MARGIN = 0.03
FITS, RECOMPUTES, DOES_NOT_FIT = 'fits', 'fits only by rematerialization', 'does NOT fit'


def recompute_ratio(compiled: Compiled, config, devices: int) -> float:
    """XLA's matmul FLOPs of the train step (all devices, loops by trip count) over the model's
    as a dense kernel computes them (t2t/infra/flops.py with the whole causal self-attention): above
    1 + RECOMPUTE_MARGIN, the compiled step recomputes activations (XLA's own rematerialization
    when buffers exceed the device, or the config's remat)."""
    return (compiled.matmul_flops_per_device * devices
            / flops.config_flops_per_step(config, causal_half=False))


def verdict(compiled: Compiled, hbm_bytes: int, margin: float = HBM_MARGIN,
            ratio: float = 1.0, remat: str = 'none') -> str:
    """FITS, RECOMPUTES (in HBM only because XLA recomputes what the config did not ask it to:
    remat 'none' and a ratio above 1 + RECOMPUTE_MARGIN) or DOES_NOT_FIT. A compile for a GPU
    never fails for memory, so the total is what decides; never FITS above HBM less margin."""
    if not compiled.fits(hbm_bytes, margin):
        return DOES_NOT_FIT
    if remat == 'none' and ratio > 1.0 + RECOMPUTE_MARGIN:
        return RECOMPUTES
    return FITS


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
    source = 'cost_analysis()'
    if costs is None:  # XLA's GPU compiler: HloCostAnalysis has no time ('optimal_seconds')
        costs, source = gpu.xla_cost_analysis(compiled)
        costs.pop('optimal_seconds', None)
    text = compiled.as_text()
    module = hlo.parse(text)
    unknown = sum(n is None for n in hlo.while_trip_counts(module).values())
    return Compiled(Memory.of(compiled), float(costs.get('flops', math.nan)), seconds,
                    matmul_flops_per_device=hlo.matmul_flops(module), unknown_loops=unknown,
                    hlo_text=text, collectives=hlo.collectives(module),
                    xla_bytes_accessed=float(costs.get('bytes accessed', math.nan)),
                    xla_optimal_seconds=float(costs.get('optimal_seconds', math.nan)),
                    xla_uncosted=cost.uncosted_custom_calls(module),
                    memory_bytes_per_device=hlo_memory.memory_bytes(module),
                    xla_counts_source=source, attention_calls=gpu.attention_calls(module),
                    loss_buffer=gpu.largest_buffer(module, 'loss'))


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
    return with_roofline(_compile(step, state, abstract_batch(config, mesh)), mesh,
                         fp32=config.dtype == 'float32')


def compile_predict(config, mesh) -> Compiled:
    """Beam search (config's beam, alpha, lengths) on eval_batch_size x max_eval_len sources.

    The longest evaluation bucket, decoded as the in-training BLEU does: every device of the mesh
    decodes its own rows (eval_batch_size padded to a multiple of the devices); the parameters
    come sharded like the training state's and are gathered inside (a temporary).
    """
    state = train_lib.abstract_state(config, mesh, optim.make_optimizer(config))
    predict = predict_lib.config_predict_fn(config, TransformerConfig.from_config(config),
                                            num_valid_ids=config.vocab_size, mesh=mesh)
    rows = config.eval_batch_size + (-config.eval_batch_size % mesh.size)
    inputs = jax.ShapeDtypeStruct((rows, config.max_eval_len), jnp.int32,
                                  sharding=sharding.decode_sharding(mesh))
    # shard_map'd: no logical constraints inside, so lowered outside the axis rules.
    return with_roofline(_compile(predict, state.params, inputs), mesh,
                         fp32=config.dtype == 'float32')


def with_roofline(compiled: Compiled, mesh, fp32: bool = False) -> Compiled:
    """compiled with its Roofline and XLA's Estimate for the mesh's TPU chip (t2t/aot/cost.py),
    or the GpuRoofline of its GPUs (t2t/aot/gpu.py; fp32: float32 matmuls); unchanged on other
    devices, or when the compiler ran out of memory."""
    chip = metrics.chip(mesh.devices.flat[0].device_kind)
    if chip is None or compiled.memory is None:
        return compiled
    card = next((g for g in targets.GPUS.values() if g.chip == chip.name), None)
    if card is not None:
        nodes = [d.process_index for d in mesh.devices.flat]
        roofline = gpu.GpuRoofline(chip.name, compiled.matmul_flops_per_device,
                                   compiled.memory_bytes_per_device,
                                   gpu.network(compiled.hlo_text, nodes),
                                   card.internode_bytes_per_s, fp32)
        return dataclasses.replace(compiled, roofline=roofline)
    if chip.name not in CHIPS:
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
