"""Per-device memory of t2t's train step on a TPU slice, by ahead-of-time compile on this CPU.

    flock /tmp/t2t-libtpu.lock timeout 3600 .venv/bin/python bench/tpu_aot_memory.py \
        --model big --per_chip 128 --len 256 --topology v5e:2x2 --set remat=full

The train step is the dry run's (t2t/aot/tpu.py: `aot.plan` and `aot.compile_train_step`, as
`train.py --dry_run --topology` compiles it: the config's step, state sharded and donated),
compiled with XLA's TPU compiler from libtpu (no TPU needed, see docs/aot.md). By default the
config is configs/wmt14_ende_<model>.py with vocab 37000, --per_chip sentence pairs x --len
tokens per chip on a (data=1, fsdp=chips, tensor=1) mesh; --config FILE takes a config file as
it is (its mesh and batch) instead, and --set key=value (Python literals) changes config keys
in either case (the levers: remat, scan_layers, loss_chunk_len, ...).

Prints one `RESULT {json}` line: the compiled memory analysis per device (arguments, outputs,
aliased, temporaries, total), the compile time, and from the compiled HLO (read by this
checkout's t2t/aot: the same reading before and after a change) XLA's cost_analysis FLOPs (each
loop body once), the matmul FLOPs with loops counted, t2t/infra/flops.py's count, each kind of
collective, the HBM traffic, the roofline bound's terms and XLA's estimated step time with loops
counted (t2t/aot/cost.py).

--code DIR compiles with another checkout's t2t and configs (e.g. an older commit unpacked with
`git archive`), in a child process, so that the same script measures before and after a change.
--hlo_dir DIR keeps the compiled HLO text (gzip); --hlo FILE --topology NAME prints the HLO
numbers of a kept file without compiling. Compiling big takes minutes on 2 cores; run one at a
time: libtpu allows one process.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30

# The child: compiles with the checkout on its sys.path, writes the HLO text, prints its numbers.
_CHILD = r'''
import importlib.util, json, os, sys
spec = json.loads(sys.argv[1])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
sys.path.insert(0, spec['code'])
import jax
try:
    from t2t.aot import tpu as aot
except ImportError:  # a checkout from before t2t/aot/
    from t2t import aot
from t2t.infra import flops
if spec['fast']:
    jax.config.update('jax_exec_time_optimization_effort', -1.0)
loader = importlib.util.spec_from_file_location('bench_config', spec['config'])
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
config = module.get_config()
with config.unlocked():
    for key, value in spec['set'].items():
        config[key] = value
    if spec['per_chip']:
        config.batch_size = spec['per_chip'] * aot.parse_slice(spec['topology']).chips
plan = aot.plan(config, spec['topology'])
train = aot.compile_train_step(config, plan.mesh)
m = train.memory
with open(spec['hlo'], 'w') as f:
    f.write(getattr(train, 'hlo_text', '') if m else '')
print('CHILD ' + json.dumps(dict(
    jax=jax.__version__, slice=plan.target.name, topology=plan.target.topology,
    devices=plan.mesh.size, mesh=dict(plan.mesh.shape), batch_size=config.batch_size,
    max_len=config.max_len, scan_layers=config.get('scan_layers'), remat=config.get('remat'),
    compile_s=round(train.seconds, 1), out_of_memory=train.out_of_memory or None,
    memory=m and dict(arguments=m.arguments, outputs=m.outputs, aliased=m.aliased,
                      temporaries=m.temporaries, total=m.total),
    xla_flops_per_device=train.flops_per_device,
    xla_bytes_accessed=getattr(train, 'xla_bytes_accessed', None),
    xla_optimal_seconds=getattr(train, 'xla_optimal_seconds', None),
    t2t_flops=flops.config_flops_per_step(config))), flush=True)
'''


def parse_kw(items) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition('=')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def hlo_numbers(text: str, generation: str, optimal_seconds: float | None = None,
                xla_bytes: float | None = None) -> dict:
    """Per device per step, from the compiled HLO by this checkout's t2t/aot: the matmul FLOPs
    with loops counted, the collectives (outside / inside loops, x trip counts), the HBM traffic,
    the roofline bound's terms and, given XLA's optimal_seconds, its estimate with the loops
    counted."""
    import dataclasses

    sys.path.insert(0, ROOT)
    from t2t.aot import cost, hlo
    from t2t.aot import memory as hlo_memory
    from t2t.aot import tpu as aot

    module = hlo.parse(text)
    collectives = hlo.collectives(module)
    coll = sum(c.bytes + c.in_loops_bytes for c in collectives.values())
    chip = aot.CHIPS[generation].spec.name
    r = cost.Roofline(chip, hlo.matmul_flops(module), hlo_memory.memory_bytes(module), coll)
    out = dict(hlo_matmul_flops_per_device=r.flops,
               collectives={k: dataclasses.asdict(c) for k, c in collectives.items()
                            if c.count or c.in_loops_count},
               collective_bytes=coll,
               collective_bytes_in_loops=sum(c.in_loops_bytes for c in collectives.values()),
               memory_bytes=r.memory_bytes,
               roofline=dict(compute_ms=r.compute_s * 1e3, memory_ms=r.memory_s * 1e3,
                             collective_ms=r.collective_s * 1e3, bound_ms=r.seconds * 1e3),
               unknown_loops=sum(n is None for n in hlo.while_trip_counts(module).values()),
               xla_uncosted=cost.uncosted_custom_calls(module))
    # Sliced prefetches' joins make XLA's sum no time (t2t/aot/cost.py): no estimate then.
    if optimal_seconds and optimal_seconds > 0 and not out['xla_uncosted']:
        e = cost.estimate(module, chip, optimal_seconds, xla_bytes or 0.0)
        out.update(xla_optimal_ms=optimal_seconds * 1e3, loop_scale=e.scale,
                   xla_estimate_ms=e.seconds * 1e3)
    return out


def _with_mfu(result: dict) -> dict:
    """result with the MFU the roofline bound allows and the one XLA's estimate implies
    (t2t/infra/flops.py's FLOPs / time / peak of the devices)."""
    flops, devices = result.get('t2t_flops'), result.get('devices')
    if not (flops and devices):
        return result
    peak = {'bound_ms': result.get('roofline', {}).get('bound_ms'),
            'xla_estimate_ms': result.get('xla_estimate_ms')}
    sys.path.insert(0, ROOT)
    from t2t.aot import tpu as aot

    chip = aot.parse_slice(result['topology']).chip.spec
    for key, ms in peak.items():
        if ms:
            result[f'mfu_{key[:-3]}_pct'] = 100 * flops / (ms / 1e3) / (
                devices * chip.peak_bf16_flops)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='big', choices=('base', 'big'))
    ap.add_argument('--per_chip', type=int, default=128, help='sentence pairs per chip')
    ap.add_argument('--len', type=int, default=256, help='tokens per side')
    ap.add_argument('--vocab', type=int, default=37000)
    ap.add_argument('--topology', default='v5e:2x2', help='a slice name or topology')
    ap.add_argument('--config', default=None,
                    help='a config file taken as it is (mesh, batch) instead of --model')
    ap.add_argument('--set', nargs='*', default=[], help='config keys k=v')
    ap.add_argument('--code', default=ROOT, help='compile with this checkout\'s t2t')
    ap.add_argument('--label', default='')
    ap.add_argument('--fast', action='store_true',
                    help='lower optimization effort (compiles faster, reports ~2x temporaries)')
    ap.add_argument('--hlo_dir', default=None, help='keep the HLO text here (gzip)')
    ap.add_argument('--hlo', default=None,
                    help='no compile: the HLO numbers of a kept HLO file (.hlo.gz) for --topology')
    args = ap.parse_args(argv)
    if args.hlo:
        sys.path.insert(0, ROOT)
        from t2t.aot import tpu as aot

        with gzip.open(args.hlo, 'rt') as f:
            text = f.read()
        tpu = aot.parse_slice(args.topology)
        print('RESULT ' + json.dumps(dict(label=args.label, hlo=args.hlo, slice=tpu.name,
                                          **hlo_numbers(text, tpu.generation))), flush=True)
        return 0

    code = os.path.abspath(args.code)
    overrides = parse_kw(args.set)
    if args.config:
        config_path, per_chip = os.path.abspath(args.config), 0
    else:
        config_path = os.path.join(code, 'configs', f'wmt14_ende_{args.model}.py')
        per_chip = args.per_chip
        overrides = {'vocab_size': args.vocab, 'max_len': args.len, 'mesh_shape': (1, -1, 1),
                     **overrides}
    with tempfile.TemporaryDirectory() as tmp:
        hlo_path = os.path.join(tmp, 'step.hlo')
        spec = dict(code=code, config=config_path, set=overrides, topology=args.topology,
                    per_chip=per_chip, fast=args.fast, hlo=hlo_path)
        env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'PYTHONPATH')}
        proc = subprocess.run([sys.executable, '-c', _CHILD, json.dumps(spec)], cwd=code, env=env,
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('CHILD ')]
        if proc.returncode or not lines:
            sys.stderr.write(proc.stderr[-3000:])
            return proc.returncode or 1
        child = json.loads(lines[-1][len('CHILD '):])
        with open(hlo_path) as f:
            text = f.read()
    result = dict(label=args.label, code=code, config=os.path.relpath(config_path, code),
                  set=overrides, **{k: v for k, v in child.items() if k != 'memory'})
    memory = child['memory']
    if memory:
        result.update({f'{k}_gib': round(v / GIB, 3) for k, v in memory.items()})
    if memory and text:
        sys.path.insert(0, ROOT)
        from t2t.aot import tpu as aot

        result.update(hlo_numbers(text, aot.parse_slice(args.topology).generation,
                                  child.get('xla_optimal_seconds'),
                                  child.get('xla_bytes_accessed')))
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            name = args.label or f'{os.path.basename(config_path)[:-3]}-{child["slice"]}'
            with gzip.open(os.path.join(args.hlo_dir, name + '.hlo.gz'), 'wt') as f:
                f.write(text)
    print('RESULT ' + json.dumps(_with_mfu(result)), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
