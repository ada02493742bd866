"""Per-device memory of t2t's train step on a TPU slice, by ahead-of-time compile on this CPU.

    flock /tmp/t2t-libtpu.lock timeout 900 .venv/bin/python bench/tpu_aot_memory.py \
        --model big --per_chip 128 --len 256 --topology v5e:2x2 --model_kw remat=full

The train step (t2t.train_lib.train_step: label smoothing 0.1, Adam, bf16 compute, dropout) is
lowered and compiled for the topology with XLA's TPU compiler from libtpu (no TPU needed, see
docs/aot.md) on a (data=1, fsdp=chips, tensor=1) mesh, the state sharded as t2t derives
it and donated. Prints one `RESULT {json}` line with the compiled memory analysis (per device:
arguments, outputs, aliased, temporaries), XLA's cost_analysis FLOPs per device (each loop body
once), the HLO's matmul FLOPs per device with loops counted (t2t/aot/hlo.py) and the compile time.

--code DIR imports t2t from another checkout (e.g. an older commit unpacked with `git archive`),
so that the same script measures before and after a change. --model_kw / --step_kw pass extra
TransformerConfig / StepConfig fields (key=value, Python literals) where the checkout has them.
Compiling big takes minutes on 2 cores; run one at a time: libtpu allows one process.

--config FILE --slice NAME measures instead the dry run's own train step (t2t/aot/tpu.py, as
`train.py --dry_run --topology` compiles it: the config's mesh, batch_size and every other key)
for a slice name such as v5e-16 or v4-8; --set key=value changes config keys. Besides the memory,
the RESULT line then carries XLA's cost_analysis FLOPs, the HLO's matmul FLOPs with loops counted
by trip count (t2t/aot/hlo.py) and t2t/flops.py's count, all per step, and per device: each kind of
collective (outside and inside loops, times the trip counts), the HBM traffic, the roofline
bound's terms (t2t/aot/tpu.py), XLA's bytes accessed and the rng-bit-generator ops' result types and
bytes; --hlo_dir DIR keeps the compiled HLO text (gzip) for a later look at where the
temporaries go. --hlo FILE --slice NAME prints the HLO numbers of a kept file without compiling
(read by this checkout's t2t/aot/hlo.py: a before/after pair is read the same way).

    flock /tmp/t2t-libtpu.lock timeout 900 .venv/bin/python bench/tpu_aot_memory.py \
        --config configs/wmt14_ende_big.py --slice v5e-16 --set batch_size=128 scan_layers=False
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys
import time

MODELS = {'base': (512, 8, 2048, 6), 'big': (1024, 16, 4096, 6)}


def parse_kw(items):
    out = {}
    for item in items:
        key, _, value = item.partition('=')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='big', choices=tuple(MODELS))
    ap.add_argument('--per_chip', type=int, default=128, help='sentence pairs per chip')
    ap.add_argument('--len', type=int, default=256, help='tokens per side')
    ap.add_argument('--vocab', type=int, default=37000)
    ap.add_argument('--topology', default='v5e:2x2')
    ap.add_argument('--chips_per_host', default='2,2,1')
    ap.add_argument('--chip_config', default='default')
    ap.add_argument('--dtype', default='bfloat16')
    ap.add_argument('--model_kw', nargs='*', default=[], help='TransformerConfig fields k=v')
    ap.add_argument('--step_kw', nargs='*', default=[], help='StepConfig fields k=v')
    ap.add_argument('--code', default=None, help='import t2t from this directory')
    ap.add_argument('--label', default='')
    ap.add_argument('--fast', action='store_true',
                    help='lower optimization effort (compiles faster, reports ~2x temporaries)')
    ap.add_argument('--config', default=None, help='measure this config file\'s dry-run step')
    ap.add_argument('--slice', default='v5e-16', help='with --config: the TPU slice name')
    ap.add_argument('--set', nargs='*', default=[], help='with --config: config keys k=v')
    ap.add_argument('--hlo_dir', default=None, help='with --config: keep the HLO text here')
    ap.add_argument('--hlo', default=None,
                    help='no compile: the HLO numbers of a kept HLO file (.hlo.gz) for --slice')
    args = ap.parse_args(argv)
    if args.hlo:
        return hlo_main(args)
    if args.config:
        return config_main(args)

    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
    root = args.code or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.abspath(root))

    import functools
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp
    from flax import linen as nn
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from t2t import optim, sharding, train_lib
    from t2t.aot import hlo
    from t2t.model import TransformerConfig

    topo = topologies.get_topology_desc(
        platform='tpu', topology_name=args.topology, chip_config_name=args.chip_config,
        chips_per_host_bounds=tuple(int(x) for x in args.chips_per_host.split(',')),
        num_slices=1)
    devices = topo.devices
    chips = len(devices)
    mesh = sharding.make_mesh((1, chips, 1), devices=devices)

    d, h, ff, layers = MODELS[args.model]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_kw = parse_kw(args.model_kw)
    unknown = sorted(set(model_kw) - fields)
    if unknown:
        raise SystemExit(f'TransformerConfig of {root} has no field(s) {unknown}')
    mc = TransformerConfig(
        vocab_size=args.vocab, d_model=d, d_ff=ff, num_heads=h, num_encoder_layers=layers,
        num_decoder_layers=layers, dropout_rate=0.1,
        dtype={'bfloat16': jnp.bfloat16, 'float32': jnp.float32}[args.dtype], **model_kw)
    step_kw = {'loss_impl': 'fused', **parse_kw(args.step_kw)}  # the recorded numbers' loss
    step_config = train_lib.StepConfig(model=mc, label_smoothing=0.1, **step_kw)
    tx = optim.make_optimizer(SimpleNamespace(
        d_model=d, warmup_steps=4000, learning_rate_scale=1.0, adam_b1=0.9, adam_b2=0.98,
        adam_eps=1e-9, clip_grad_norm=0.0, weight_decay=0.0))

    init = functools.partial(train_lib.init_state, model_config=mc, tx=tx,
                             batch_shape=(1, args.len))
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
    state_shardings = sharding.tree_shardings(boxed, mesh)
    abstract_state = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed),
        state_shardings)
    batch_size = args.per_chip * chips
    batch_sharding = sharding.batch_sharding(mesh)
    abstract_batch = {k: jax.ShapeDtypeStruct((batch_size, args.len), jnp.int32,
                                              sharding=batch_sharding)
                      for k in train_lib.BATCH_KEYS}
    step = functools.partial(train_lib.train_step, step_config=step_config, tx=tx)
    jitted = jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=(0,))
    options = {'exec_time_optimization_effort': -1.0} if args.fast else None
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES):
        lowered = jitted.lower(abstract_state, abstract_batch)
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    gib = 2 ** 30
    result = dict(
        label=args.label, code=os.path.abspath(root), model=args.model, topology=args.topology,
        chips=chips, device_kind=devices[0].device_kind, per_chip=args.per_chip, len=args.len,
        vocab=args.vocab, dtype=args.dtype, model_kw=model_kw, step_kw=step_kw, fast=args.fast,
        jax=jax.__version__, compile_s=round(compile_s, 1),
        argument_gib=round(mem.argument_size_in_bytes / gib, 3),
        output_gib=round(mem.output_size_in_bytes / gib, 3),
        alias_gib=round(mem.alias_size_in_bytes / gib, 3),
        temp_gib=round(mem.temp_size_in_bytes / gib, 3),
        total_gib=round((mem.argument_size_in_bytes + mem.output_size_in_bytes
                         - mem.alias_size_in_bytes + mem.temp_size_in_bytes) / gib, 3),
        # cost_analysis counts each loop body once (scanned layers, the loss's chunks): too low
        xla_tflop_per_device=round(float(cost.get('flops', 0.0)) / 1e12, 3) if cost else None,
        hlo_matmul_tflop_per_device=round(hlo.matmul_flops(compiled.as_text()) / 1e12, 3))
    print('RESULT ' + json.dumps(result), flush=True)
    return 0


def config_main(args) -> int:
    """The dry run's train step of a config file on a slice (t2t.aot.tpu), one RESULT line."""
    import gzip
    import importlib.util

    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
    root = args.code or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.abspath(root))
    from t2t import flops
    from t2t.aot import tpu as aot

    spec = importlib.util.spec_from_file_location('bench_config', args.config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    overrides = parse_kw(args.set)
    for key, value in overrides.items():
        config[key] = value
    plan = aot.plan(config, args.slice)
    train = aot.compile_train_step(config, plan.mesh)
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        name = args.label or f'{os.path.basename(args.config)[:-3]}-{args.slice}'
        with gzip.open(os.path.join(args.hlo_dir, name + '.hlo.gz'), 'wt') as f:
            f.write(train.hlo_text)
    import jax

    gib = 2 ** 30
    m = train.memory
    devices = plan.mesh.size
    result = dict(
        label=args.label, code=os.path.abspath(root), config=args.config, set=overrides,
        slice=plan.tpu.name, topology=plan.tpu.topology, devices=devices,
        mesh=dict(plan.mesh.shape), batch_size=config.batch_size, max_len=config.max_len,
        scan_layers=config.scan_layers, remat=config.remat, jax=jax.__version__,
        compile_s=round(train.seconds, 1),
        out_of_memory=train.out_of_memory or None,
        argument_gib=m and round(m.arguments / gib, 3), output_gib=m and round(m.outputs / gib, 3),
        alias_gib=m and round(m.aliased / gib, 3), temp_gib=m and round(m.temporaries / gib, 3),
        total_gib=m and round(m.total / gib, 3),
        xla_cost_analysis_flops=train.flops_per_device * devices,
        hlo_matmul_flops=train.matmul_flops_per_device * devices if m else None,
        t2t_flops=flops.config_flops_per_step(config))
    if m:
        result.update(hlo_numbers(train.hlo_text, plan.tpu.generation),
                      xla_bytes_accessed=getattr(train, 'xla_bytes_accessed', None))
    print('RESULT ' + json.dumps(result), flush=True)
    return 0


def _this_checkout(module: str):
    """A module of this script's own checkout (not --code's): the numbers are read the same way
    before and after a change."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(f'bench_{module}',
                                                  os.path.join(root, 't2t', f'{module}.py'))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def hlo_numbers(text: str, generation: str) -> dict:
    """Per device per step, from the compiled HLO (this checkout's t2t/aot/hlo.py and
    hlo_memory.py): the collectives (outside / inside loops, x trip counts), the memory traffic and
    the roofline lower bound on the chip (the t2t/aot/tpu.py datasheet table)."""
    hlo = _this_checkout('hlo')
    module = hlo.parse(text)
    collectives = hlo.collectives(module)
    flops = hlo.matmul_flops(module)
    memory = _this_checkout('hlo_memory').memory_bytes(text)
    coll = sum(c.bytes + c.in_loops_bytes for c in collectives.values())
    from t2t.aot import tpu as aot  # the chip table is the same in every checkout that has it

    chip = getattr(aot, 'CHIPS', {}).get(generation)
    roofline = {}
    if chip is not None and hasattr(chip, 'peak_bf16_flops'):
        compute_s, memory_s = flops / chip.peak_bf16_flops, memory / chip.hbm_bytes_per_s
        collective_s = coll / chip.ici_bytes_per_s
        roofline = dict(compute_ms=compute_s * 1e3, memory_ms=memory_s * 1e3,
                        collective_ms=collective_s * 1e3,
                        bound_ms=(max(compute_s, memory_s) + collective_s) * 1e3)
    # Random bits of the rng-bit-generator ops (rbg, unsafe_rbg: result bytes x runs, per
    # device, by result type); threefry's bits are computed inside fusions and do not appear.
    runs = hlo.executions(module)
    rng_ops, rng_bytes = {}, 0.0
    for name, times in runs.items():
        for i in module.computations.get(name, ()):
            if i.opcode == 'rng-bit-generator':
                rng_bytes += times * hlo.shape_bytes(i.shape)
                rng_ops[i.shape] = rng_ops.get(i.shape, 0) + times
    return dict(collectives={k: dataclasses.asdict(c) for k, c in collectives.items()
                             if c.count or c.in_loops_count},
                collective_bytes=coll,
                collective_bytes_in_loops=sum(c.in_loops_bytes for c in collectives.values()),
                memory_bytes=memory, roofline=roofline, rng_bit_generator_bytes=rng_bytes,
                rng_bit_generator_shapes=rng_ops)


def hlo_main(args) -> int:
    """The HLO numbers of a kept HLO file, without compiling (e.g. one kept by an older checkout
    with --code and --hlo_dir)."""
    import gzip

    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from t2t.aot import tpu as aot

    with gzip.open(args.hlo, 'rt') as f:
        text = f.read()
    tpu = aot.parse_slice(args.slice)
    result = dict(label=args.label, hlo=args.hlo, slice=tpu.name,
                  **hlo_numbers(text, tpu.generation))
    print('RESULT ' + json.dumps(result), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
