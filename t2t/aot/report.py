"""`train.py --dry_run --topology=TARGET`: the ahead-of-time report for a TPU slice or GPU nodes.

The compiles and the numbers come from t2t/aot/tpu.py (t2t/aot/gpu.py adds the GPU's); this module
prints them: the target and mesh, memory per device against the device's HBM with a verdict
(fits, fits only by rematerialization, does not fit), matmul FLOPs with loops counted, collectives,
the roofline and XLA's estimate or, on GPUs, the roofline estimate with the MFU and tokens/s per
GPU it implies, and the largest batch that fits (--find_max_batch).
"""

from __future__ import annotations

import math
import os

import jax

from t2t.aot import cost, gpu
from t2t.aot import tpu as aot
from t2t.infra import flops


def _size(num_bytes: float) -> str:
    if abs(num_bytes) >= 0.1 * (1 << 30):
        return f'{num_bytes / (1 << 30):.2f} GiB'
    return f'{num_bytes / (1 << 20):.1f} MiB'


def _compiler_line(platform: str) -> str:
    """Versions and non-default compiler settings: the memory numbers depend on them."""
    from importlib import metadata

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return 'unknown'

    line = (f'compiler: jax {jax.__version__}, libtpu {version("libtpu")}' if platform == 'tpu'
            else f'compiler: jax {jax.__version__}, jax-cuda12-plugin '
                 f'{version("jax-cuda12-plugin")} (no autotuning on a compile-only client: '
                 "XLA's default GEMM and fusion kernels, cuDNN workspace counted as 0)")
    changed = [f'{name}={getattr(jax.config, name)}' for name, default in (
        ('jax_optimization_level', 'UNKNOWN'), ('jax_exec_time_optimization_effort', 0.0),
        ('jax_memory_fitting_effort', 0.0)) if getattr(jax.config, name) != default]
    changed += [f'{k}={os.environ[k]!r}' for k in ('LIBTPU_INIT_ARGS', 'XLA_FLAGS')
                if os.environ.get(k)]
    if changed:
        return (f'{line}; NOT the default compile settings ({", ".join(changed)}): memory may '
                'differ from a default compile')
    return f'{line}, default compile settings'


def _total_line(total: int, hbm_bytes: int, margin: float, label: str = 'total',
                verdict: str = '') -> str:
    free = hbm_bytes - total
    verdict = verdict or (aot.FITS if total <= (1.0 - margin) * hbm_bytes else aot.DOES_NOT_FIT)
    return (f'  {label} {_size(total)} of {_size(hbm_bytes)} HBM: {verdict}, '
            f'{_size(free)} ({100 * free / hbm_bytes:.1f}%) free')


def _memory_lines(compiled, hbm_bytes: int, margin: float, verdict: str = '') -> list[str]:
    if compiled.memory is None:
        return [f'  {aot.DOES_NOT_FIT}: the compiler gave up: {compiled.out_of_memory}']
    m = compiled.memory
    return [f'  per device: arguments {_size(m.arguments)}, outputs {_size(m.outputs)}, '
            f'aliased {_size(m.aliased)}, temporaries {_size(m.temporaries)}, '
            f'code {_size(m.code)}',
            _total_line(m.total, hbm_bytes, margin, verdict=verdict)]


def recompute_line(ratio: float, remat: str) -> str:
    """XLA's matmul FLOPs against the model's dense count: the rematerialization check."""
    limit = 1.0 + aot.RECOMPUTE_MARGIN
    if ratio <= limit:
        said = f'at most {limit:.2f}: no recomputation'
    elif remat == 'none':
        said = (f'above {limit:.2f} with remat=none: XLA recomputes activations on its own to '
                'fit, the step is slower than the config\'s (ask for remat, or a smaller batch)')
    else:
        said = f'above {limit:.2f}: the recomputation remat={remat} asks for'
    return (f"  recomputation: XLA's matmul FLOPs / the model's as a dense kernel computes them "
            f'(t2t/infra/flops.py, causal self-attention whole) = {ratio:.3f}, {said}')


def flops_lines(compiled, devices: int, config_flops: float) -> list[str]:
    """The FLOPs of one step, three ways, each labeled with what it counts."""
    matmul = compiled.matmul_flops_per_device * devices
    lines = [f'  FLOPs per step: XLA matmul FLOPs (dots and convolutions of the compiled program, '
             f'loops counted by trip count) {compiled.matmul_flops_per_device:.4g} per device x '
             f'{devices} = {matmul:.4g}; t2t/infra/flops.py {config_flops:.4g} (matmuls and '
             f'attention, causal self-attention half): ratio {matmul / config_flops:.3f}']
    if compiled.unknown_loops:
        lines.append(f'  WARNING: {compiled.unknown_loops} loop(s) of unknown trip count counted '
                     'once: the matmul FLOPs are too low')
    if compiled.xla_counts_source == 'cost_analysis()':
        lines.append(f'  XLA cost_analysis: {compiled.flops_per_device * devices:.4g} (every op, '
                     'but each loop body counted once: not a step\'s total with scanned layers '
                     'or a chunked loss)')
    return lines


def _bytes(num_bytes: float) -> str:
    for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if num_bytes >= scale:
            return f'{num_bytes / scale:.1f} {unit}'
    return f'{num_bytes:.0f} B'


def collective_lines(compiled, run: str = 'step') -> list[str]:
    """Each kind of collective of the compiled per-device program (t2t/aot/hlo.py): how many run
    and the bytes of their operands, outside loops and inside them (times the trip counts)."""
    parts = []
    for kind, c in compiled.collectives.items():
        if c.count or c.in_loops_count:
            parts.append(f'{kind} {c.count} ({_bytes(c.bytes)}) + {c.in_loops_count} in loops '
                         f'({_bytes(c.in_loops_bytes)})')
    line = (f'  collectives per device per {run} (compiled HLO; bytes: their operands; in '
            f'loops: times the trip counts): {"; ".join(parts) or "none"}')
    if compiled.unknown_loops:
        line += f' ({compiled.unknown_loops} loop(s) of unknown trip count counted once)'
    return [line]


def _header_lines(plan, margin: float) -> list[str]:
    target, mesh = plan.target, plan.mesh
    hbm = target.hbm_bytes
    if target.platform == 'tpu':
        lines = [f'TPU ahead-of-time compile on this CPU; {_compiler_line("tpu")}',
                 f'slice: {target.name} (topology {target.topology}, accelerator type '
                 f'{target.accelerator_type}): {target.chips} chips on {plan.hosts} '
                 f'host{"s" if plan.hosts > 1 else ""}, {plan.device_kind}, {_size(hbm)} HBM '
                 'per chip']
    else:
        lines = [f'GPU ahead-of-time compile on this CPU; {_compiler_line("cuda")}',
                 f'nodes: {target.name} (jax topology {target.topology}): {target.chips} GPU'
                 f'{"s" if target.chips > 1 else ""} on '
                 f'{plan.hosts} node{"s" if plan.hosts > 1 else ""} of up to '
                 f'{target.card.nvlink_domain} joined by NVLink, {plan.device_kind}, {_size(hbm)} '
                 f'HBM per GPU (XLA\'s target description t2t/aot/gpu_specs/'
                 f'{target.card.spec_file})']
    lines.append(f'mesh: {" ".join(f"{k}={v}" for k, v in mesh.shape.items())} '
                 f'({mesh.size} devices)')
    if plan.attention:
        lines.append(f'attention: {plan.attention}')
    lines.append(f'memory: XLA memory_analysis per device; total = arguments + outputs - aliased '
                 f'+ temporaries + code; a fit leaves >= {100 * margin:.0f}% of HBM free for '
                 'what XLA does not count (runtime reservation, input buffers, fragmentation)')
    return lines


def _train_verdict(config, compiled, plan, margin: float) -> tuple[str, float]:
    """(verdict, recompute ratio) of a compiled train step (t2t/aot/tpu.py's one rule)."""
    if compiled.memory is None:
        return aot.DOES_NOT_FIT, math.nan
    ratio = aot.recompute_ratio(compiled, config, plan.mesh.size)
    return aot.verdict(compiled, plan.target.hbm_bytes, margin, ratio, config.remat), ratio


def _find_max_batch(config, plan, train_at, max_tries: int, margin: float, out) -> int:
    """The largest batch_size whose train step FITS: a fit by XLA's own recomputation counts as
    no fit unless the config asks for remat."""
    hbm, shape = plan.target.hbm_bytes, dict(plan.mesh.shape)
    compiled_at = {}

    def measure(batch_size: int):
        c, compiled = train_at(batch_size)
        verdict, ratio = _train_verdict(c, compiled, plan, margin)
        m = compiled.memory
        if m is None:
            sizes = 'the compiler ran out of HBM'
        else:
            # FLOPs per row above the first try's: recomputation the compiler chose to fit.
            first = next(((b, c) for b, c in compiled_at.items() if c.memory is not None),
                         (batch_size, compiled))
            per_row = (compiled.matmul_flops_per_device / batch_size
                       / (first[1].matmul_flops_per_device / first[0]))
            sizes = (f'arguments {_size(m.arguments)}, temporaries {_size(m.temporaries)}, '
                     f'total {_size(m.total)}, matmul FLOPs per row x{per_row:.2f} of the '
                     f'first, x{ratio:.3f} of the model\'s')
        compiled_at[batch_size] = compiled
        label = 'does not fit' if verdict == aot.DOES_NOT_FIT else verdict
        out(f'  try {len(compiled_at)}: batch_size={batch_size}: {sizes}: {label} '
            f'(compile {compiled.seconds:.0f} s)')
        # A recomputed fit gives no usable sizes (XLA shrank them by recomputing): bisect.
        return m if verdict != aot.RECOMPUTES else None

    out(f'find_max_batch: multiples of {plan.batch_step}, at most {max_tries} compiles'
        + ('' if config.remat != 'none' else '; a fit only by XLA\'s own recomputation '
           'counts as none (remat=none)'))
    result = aot.search_max_batch(measure, config.batch_size, plan.batch_step, max_tries,
                                  (1.0 - margin) * hbm)
    if result.largest is None:
        out(f'largest batch_size that fits: none (batch_size={result.smallest_failing} '
            'does not fit)')
        return 1
    above = (f'{result.smallest_failing} does not' if result.smallest_failing else
             'no larger batch tried')
    bound = 'exact' if result.exact else f'bounded by --max_batch_tries={max_tries}'
    out(f'largest batch_size that fits: {result.largest} ({above}; {bound}; '
        f'{result.largest // aot.data_parallel(shape)} rows per data-parallel device)')
    out(f'train step at batch_size={result.largest} x {config.max_len} tokens:')
    for line in _memory_lines(compiled_at[result.largest], hbm, margin):
        out(line)
    return 0


def _step_lines(compiled, config, plan, run: str, model_flops: float | None,
                tokens: int = 0) -> list[str]:
    """Collectives and time: TPU the roofline bound and XLA's estimate, GPU XLA's counts, the
    attention kernel, the network split and the roofline estimate."""
    devices = plan.mesh.size
    lines = collective_lines(compiled, run=run)
    if plan.target.platform == 'tpu':
        return (lines + aot.roofline_lines(compiled, run=run)
                + cost.estimate_lines(compiled, devices, model_flops, run=run))
    return lines + gpu.report_lines(compiled, devices, model_flops, tokens, run=run)


def dry_run(config, plan, *, find_max_batch: bool = False, max_tries: int = 8,
            margin: float | None = None, out=print) -> int:
    """Prints the report of `plan` (t2t.aot.tpu.plan: a TPU slice or GPU nodes); returns the exit
    status: 0 fits, 1 does not fit or fits only by XLA's own rematerialization.

    Without find_max_batch: the train step at config.batch_size, then (if it fits) the predict
    function. With it: the largest batch_size that fits, searched over multiples of
    plan.batch_step in at most max_tries compiles.
    """
    margin = aot.HBM_MARGIN if margin is None else margin
    mesh, hbm = plan.mesh, plan.target.hbm_bytes
    for line in _header_lines(plan, margin):
        out(line)

    def train_at(batch_size: int):
        c = config.copy_and_resolve_references()
        c.batch_size = batch_size
        return c, aot.compile_train_step(c, mesh)

    if find_max_batch:
        return _find_max_batch(config, plan, train_at, max_tries, margin, out)

    config_flops = flops.config_flops_per_step(config)
    train_config, train = train_at(config.batch_size)
    out(f'train step (batch_size={config.batch_size} x {config.max_len} tokens, '
        f'{config.batch_size // aot.data_parallel(dict(mesh.shape))} rows per data-parallel '
        f'device): compile {train.seconds:.1f} s')
    verdict, ratio = _train_verdict(config, train, plan, margin)
    for line in _memory_lines(train, hbm, margin, verdict):
        out(line)
    if train.memory is not None:
        for line in ([*flops_lines(train, mesh.size, config_flops), recompute_line(ratio,
                      config.remat)] + _step_lines(train, config, plan, 'step', config_flops,
                                                   config.batch_size * config.max_len)):
            out(line)
    if verdict != aot.FITS:
        why = 'does not fit' if verdict == aot.DOES_NOT_FIT else verdict
        out(f'predict: not compiled (the train step {why})')
        return 1

    predict = aot.compile_predict(train_config, mesh)
    out(f'predict (beam {config.beam_size}, eval_batch_size={config.eval_batch_size} x '
        f'{config.max_eval_len} source tokens, up to {config.max_decode_len} new): '
        f'compile {predict.seconds:.1f} s')
    for line in _memory_lines(predict, hbm, margin):
        out(line)
    if predict.memory is None:
        return 1
    for line in _step_lines(predict, config, plan, 'batch', None):
        out(line)
    # In-training BLEU decodes while the training state (the train step's arguments) is resident.
    p = predict.memory
    during_training = train.memory.arguments + p.temporaries + p.outputs + p.code
    out(f'  in-training BLEU: train-step arguments {_size(train.memory.arguments)} + predict '
        f'temporaries, outputs and code {_size(p.temporaries + p.outputs + p.code)}')
    out(_total_line(during_training, hbm, margin, label='total with the training state'))
    return 0 if during_training <= (1.0 - margin) * hbm else 1
