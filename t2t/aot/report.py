"""`train.py --dry_run --topology=SLICE`: the TPU ahead-of-time report.

The compiles and the numbers come from t2t/aot/tpu.py; this module prints them: the slice and mesh,
memory per device against the chip's HBM, matmul FLOPs with loops counted, collectives, the
roofline lower bound, XLA's estimated time and the MFU it implies, and the largest batch that
fits (--find_max_batch).
"""

from __future__ import annotations

import os

import jax

from t2t import flops
from t2t.aot import cost
from t2t.aot import tpu as aot


def _size(num_bytes: float) -> str:
    if abs(num_bytes) >= 0.1 * (1 << 30):
        return f'{num_bytes / (1 << 30):.2f} GiB'
    return f'{num_bytes / (1 << 20):.1f} MiB'


def _compiler_line() -> str:
    """Versions and non-default compiler settings: the memory numbers depend on them."""
    from importlib import metadata

    try:
        libtpu = metadata.version('libtpu')
    except metadata.PackageNotFoundError:
        libtpu = 'unknown'
    line = f'compiler: jax {jax.__version__}, libtpu {libtpu}'
    changed = [f'{name}={getattr(jax.config, name)}' for name, default in (
        ('jax_optimization_level', 'UNKNOWN'), ('jax_exec_time_optimization_effort', 0.0),
        ('jax_memory_fitting_effort', 0.0)) if getattr(jax.config, name) != default]
    changed += [f'{k}={os.environ[k]!r}' for k in ('LIBTPU_INIT_ARGS', 'XLA_FLAGS')
                if os.environ.get(k)]
    if changed:
        return (f'{line}; NOT the default compile settings ({", ".join(changed)}): memory may '
                'differ from a default compile')
    return f'{line}, default compile settings'


def _total_line(total: int, hbm_bytes: int, margin: float, label: str = 'total') -> str:
    free = hbm_bytes - total
    verdict = 'fits' if total <= (1.0 - margin) * hbm_bytes else 'does NOT fit'
    return (f'  {label} {_size(total)} of {_size(hbm_bytes)} HBM: {verdict}, '
            f'{_size(free)} ({100 * free / hbm_bytes:.1f}%) free')


def _memory_lines(compiled, hbm_bytes: int, margin: float) -> list[str]:
    if compiled.memory is None:
        return [f'  does NOT fit: the TPU compiler gave up: {compiled.out_of_memory}']
    m = compiled.memory
    return [f'  per device: arguments {_size(m.arguments)}, outputs {_size(m.outputs)}, '
            f'aliased {_size(m.aliased)}, temporaries {_size(m.temporaries)}, '
            f'code {_size(m.code)}',
            _total_line(m.total, hbm_bytes, margin)]


def flops_lines(compiled, devices: int, config_flops: float) -> list[str]:
    """The FLOPs of one step, three ways, each labeled with what it counts."""
    matmul = compiled.matmul_flops_per_device * devices
    lines = [f'  FLOPs per step: XLA matmul FLOPs (dots and convolutions of the compiled program, '
             f'loops counted by trip count) {compiled.matmul_flops_per_device:.4g} per device x '
             f'{devices} = {matmul:.4g}; t2t/flops.py {config_flops:.4g} (matmuls and attention, '
             f'causal self-attention half): ratio {matmul / config_flops:.3f}']
    if compiled.unknown_loops:
        lines.append(f'  WARNING: {compiled.unknown_loops} loop(s) of unknown trip count counted '
                     'once: the matmul FLOPs are too low')
    lines.append(f'  XLA cost_analysis: {compiled.flops_per_device * devices:.4g} (every op, but '
                 'each loop body counted once: not a step\'s total with scanned layers or a '
                 'chunked loss)')
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


def tpu_dry_run(config, plan, *, find_max_batch: bool = False, max_tries: int = 8,
                margin: float | None = None, out=print) -> int:
    """Prints the TPU report of `plan` (t2t.aot.tpu.plan); returns the exit status: 0 fits, 1 not.

    Without find_max_batch: the train step at config.batch_size, then (if it fits) the predict
    function. With it: the largest batch_size that fits, searched over multiples of
    plan.batch_step in at most max_tries compiles.
    """
    margin = aot.HBM_MARGIN if margin is None else margin
    tpu, mesh = plan.tpu, plan.mesh
    hbm = tpu.hbm_bytes
    shape = dict(mesh.shape)
    out(f'TPU ahead-of-time compile on this CPU; {_compiler_line()}')
    out(f'slice: {tpu.name} (topology {tpu.topology}, accelerator type {tpu.accelerator_type}): '
        f'{tpu.chips} chips on {plan.hosts} host{"s" if plan.hosts > 1 else ""}, '
        f'{plan.device_kind}, {_size(hbm)} HBM per chip')
    out(f'mesh: {" ".join(f"{k}={v}" for k, v in shape.items())} ({mesh.size} devices)')
    if plan.attention:
        out(f'attention: {plan.attention}')
    out(f'memory: XLA memory_analysis per device; total = arguments + outputs - aliased + '
        f'temporaries + code; a fit leaves >= {100 * margin:.0f}% of HBM free for what XLA '
        'does not count (runtime reservation, input buffers, fragmentation)')

    def train_at(batch_size: int):
        c = config.copy_and_resolve_references()
        c.batch_size = batch_size
        return c, aot.compile_train_step(c, mesh)

    if find_max_batch:
        step = plan.batch_step
        compiled_at = {}

        def measure(batch_size: int):
            _, compiled = train_at(batch_size)
            m = compiled.memory
            verdict = 'fits' if compiled.fits(hbm, margin) else 'does not fit'
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
                         'first')
            compiled_at[batch_size] = compiled
            out(f'  try {len(compiled_at)}: batch_size={batch_size}: {sizes}: {verdict} '
                f'(compile {compiled.seconds:.0f} s)')
            return m

        out(f'find_max_batch: multiples of {step}, at most {max_tries} compiles')
        result = aot.search_max_batch(measure, config.batch_size, step, max_tries,
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
        best = compiled_at[result.largest]
        out(f'train step at batch_size={result.largest} x {config.max_len} tokens:')
        for line in _memory_lines(best, hbm, margin):
            out(line)
        return 0

    config_flops = flops.config_flops_per_step(config)
    train_config, train = train_at(config.batch_size)
    out(f'train step (batch_size={config.batch_size} x {config.max_len} tokens, '
        f'{config.batch_size // aot.data_parallel(shape)} rows per data-parallel device): '
        f'compile {train.seconds:.1f} s')
    for line in _memory_lines(train, hbm, margin):
        out(line)
    if train.memory is not None:
        for line in (flops_lines(train, mesh.size, config_flops) + collective_lines(train)
                     + aot.roofline_lines(train)
                     + cost.estimate_lines(train, mesh.size, config_flops)):
            out(line)
    if not train.fits(hbm, margin):
        out('predict: not compiled (the train step does not fit)')
        return 1

    predict = aot.compile_predict(train_config, mesh)
    out(f'predict (beam {config.beam_size}, eval_batch_size={config.eval_batch_size} x '
        f'{config.max_eval_len} source tokens, up to {config.max_decode_len} new): '
        f'compile {predict.seconds:.1f} s')
    for line in _memory_lines(predict, hbm, margin):
        out(line)
    if predict.memory is None:
        return 1
    for line in (collective_lines(predict, run='batch') + aot.roofline_lines(predict, run='batch')
                 + cost.estimate_lines(predict, mesh.size, run='batch')):
        out(line)
    # In-training BLEU decodes while the training state (the train step's arguments) is resident.
    p = predict.memory
    during_training = train.memory.arguments + p.temporaries + p.outputs + p.code
    out(f'  in-training BLEU: train-step arguments {_size(train.memory.arguments)} + predict '
        f'temporaries, outputs and code {_size(p.temporaries + p.outputs + p.code)}')
    out(_total_line(during_training, hbm, margin, label='total with the training state'))
    return 0 if during_training <= (1.0 - margin) * hbm else 1
