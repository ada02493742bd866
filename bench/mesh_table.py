"""Which mesh on which TPU slice: the train step of base and big compiled ahead of time per mesh.

    nice -n 19 .venv/bin/python bench/mesh_table.py --out bench/mesh_table   # hours on 2 cores
    .venv/bin/python bench/mesh_table.py --tiny --out /tmp/tiny_mesh          # seconds

For each row (config, slice, mesh, batch) the dry run's train step (t2t/aot/tpu.py: the config's
step, state sharded and donated as in training) is compiled for the slice with libtpu's TPU
compiler on this CPU, in a child process under the libtpu file lock (/tmp/t2t-libtpu.lock, the
test suite's) and `nice -n 19`. Each row is appended to OUT.csv and OUT.md as soon as its
compile ends, so a partial table is usable; rows already in OUT.csv are skipped (resumable).

Meshes (data, fsdp, tensor): data-parallel (chips, 1, 1), fsdp (1, chips, 1), fsdp x tensor
(1, chips/4, 4) and data x fsdp (8, chips/8, 1) (16 x 16 on 256 chips; 4 x 16 on v5p-128,
whose 4x4x4 torus cannot hold an axis of 8); and two v5e-64 slices
over the data-center network (DCN), the batch split over the slices (dcn_mesh_shape (2, 1, 1))
with data or fsdp inside each. The roofline has only the ICI bandwidth: for the DCN rows its
collective term has only the collectives inside a slice: what crosses DCN (the multi-slice
runtime's send ops, `dcn-send` in the collective_kinds column, not in collective_gb) has no term,
so the bound stays a lower bound but leaves that transfer time out. Batch: the paper's
~25k target tokens a step, rows = 25000 / max_len rounded to the nearest multiple of the
mesh's data-parallel devices (data x fsdp), at least one; and 4x that (100k tokens). Every
row is max_len target positions (the token count assumes full rows, as packed batches nearly
are).

Columns, per chip (one jax device) and per step: memory_analysis arguments / temporaries /
total (t2t.aot.tpu.Memory.total) in GiB and whether the total fits the chip's HBM less
t2t.aot.tpu.HBM_MARGIN; the collectives' operand bytes (t2t/aot/hlo.py, loops by trip count; of them
in loops); the roofline LOWER BOUND's terms (t2t.aot.tpu.Roofline: matmul FLOPs / bf16 peak, HBM
bytes / HBM bandwidth, collective bytes / ICI bandwidth) and the bound; and the resulting
upper bound of throughput, target tokens per step / bound / chips, with the MFU the bound
allows (t2t/infra/flops.py's FLOPs / bound / peak of the chips: an upper bound). Then XLA's ESTIMATE
(t2t/aot/cost.py: the TPU compiler's cost model, cost_analysis' optimal_seconds with each loop
body once, plus the loops' other trips; loop_scale = the estimate / XLA's number), the MFU it
implies and the tokens/s per chip it implies. Bounds and estimates, not measurements. On the
DCN rows the estimate is XLA's model of the per-device program as compiled, whatever it makes
of the DCN sends.

XLA's estimate on v5e: with the default compile settings libtpu joins each sliced prefetch with a
ConcatBitcast custom-call that XLA's cost analysis counts at -1 s, so base's and big's
optimal_seconds is negative and the estimate column stays empty (t2t/aot/cost.py). --noslice
compiles the children with LIBTPU_INIT_ARGS=--xla_tpu_sliced_prefetch_max_slices=0 (no sliced
prefetches: the estimate is a time, on a program whose bytes and memory differ a little from the
default one's); the column libtpu_init_args holds what each child compiled with, and a row is
done per (config, slice, mesh, tokens, libtpu_init_args), so both kinds can share one OUT.
--config, --slice and --mesh_name (comma-separated) keep only those rows of the plan, in its
order; --only N the first N not done.

--breakdown FILE.hlo.gz (a row's HLO kept with --hlo_dir): where that step's bytes go, HBM and
collective bytes per traced operation (t2t.aot.cost.breakdown), the largest groups as a table.

--tiny: configs/tiny.py on v5e:2x2 with two meshes, for the test that keeps this script working;
--tiny_dcn: the same on two v5e:2x2 slices over DCN.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU_LOCK = '/tmp/t2t-libtpu.lock'
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import benchlib  # noqa: E402

PAPER_TOKENS = 25_000  # target tokens per step in the paper (section 5.1)
GIB = 1 << 30

COLUMNS = ('config', 'slice', 'chips', 'mesh_name', 'mesh', 'rows', 'target_tokens',
           'status', 'argument_gib', 'temp_gib', 'total_gib', 'hbm_gib', 'fits',
           'collective_gb', 'collective_gb_in_loops', 'collective_kinds',
           'compute_ms', 'memory_ms', 'collective_ms', 'bound_ms',
           'tokens_per_s_per_chip_bound', 'xla_estimate_ms', 'loop_scale', 'mfu_estimate_pct',
           'mfu_bound_pct', 'tokens_per_s_per_chip_estimate', 'compile_s', 'libtpu_init_args')
NOSLICE = '--xla_tpu_sliced_prefetch_max_slices=0'  # libtpu: no sliced prefetches (see --noslice)


@dataclasses.dataclass(frozen=True)
class Row:
    config: str  # file under configs/, without .py
    slice: str  # aot.parse_slice name
    mesh_name: str
    mesh: tuple[int, int, int]  # (data, fsdp, tensor)
    tokens: int  # target tokens a step asked for
    dcn: tuple[int, int, int] = (1, 1, 1)  # slices along each mesh axis (data-center network)

    @property
    def mesh_label(self) -> str:
        """The mesh column: the mesh of one slice, times the slices over DCN if more than one."""
        return str(self.mesh) if self.dcn == (1, 1, 1) else f'{self.mesh} x dcn {self.dcn}'


def meshes(chips: int, torus_3d: bool = False) -> list[tuple[str, tuple[int, int, int]]]:
    """The four meshes of a slice. On a 3-D torus (v4, v5p: 4x4x4 for 64 chips) each mesh axis
    must be a product of whole torus axes, so data x fsdp is (4, chips/4, 1), not (8, 8, 1)."""
    outer = 4 if torus_3d else 16 if chips >= 256 else 8
    return [('data', (chips, 1, 1)), ('fsdp', (1, chips, 1)),
            ('fsdp x tensor', (1, chips // 4, 4)), ('data x fsdp', (outer, chips // outer, 1))]


rows_for = benchlib.rows_for


def full_plan() -> list[Row]:
    """Most useful first: base on v5e-64, big on v5e-64, v5p-128, v5e-256, then 4x the batch."""
    out = []
    for tokens in (PAPER_TOKENS, 4 * PAPER_TOKENS):
        for slice_name, chips in (('v5e-64', 64), ('v5p-128', 64), ('v5e-256', 256)):
            for config in ('wmt14_ende_base', 'wmt14_ende_big'):
                out += [Row(config, slice_name, n, m, tokens)
                        for n, m in meshes(chips, torus_3d=slice_name.startswith('v5p'))]
        if tokens == PAPER_TOKENS:  # two v5e-64 slices, the batch split over the slices
            out += [Row(config, 'v5e-64', f'dcn data x {n}', m, tokens, (2, 1, 1))
                    for config in ('wmt14_ende_base', 'wmt14_ende_big')
                    for n, m in meshes(64)[:2]]
    return out


FLAX_PEER = 'flax_wmt'  # a config name prefix: flax examples/wmt's model at that config's dims


def peer_plan(slice_name: str = 'v5e-16') -> list[Row]:
    """t2t and flax examples/wmt (its data-parallel train step: parameters replicated, the batch
    split, as its pmap does) at the paper's ~25k target tokens, base and big, on one slice: t2t
    on the same data-parallel mesh and on fsdp x tensor."""
    chips = aot_chips(slice_name)
    out = []
    for config in ('wmt14_ende_base', 'wmt14_ende_big'):
        out += [Row(f'{FLAX_PEER}:{config}', slice_name, 'data (flax example)', (chips, 1, 1),
                    PAPER_TOKENS),
                Row(config, slice_name, 'data', (chips, 1, 1), PAPER_TOKENS),
                Row(config, slice_name, 'fsdp x tensor', (1, chips // 4, 4), PAPER_TOKENS)]
    return out


def aot_chips(slice_name: str) -> int:
    sys.path.insert(0, ROOT)
    from t2t.aot import tpu as aot

    return aot.parse_slice(slice_name).chips


def compile_flax_peer(config, mesh):
    """flax examples/wmt's train step (bench/benchlib.py) at config's dims, vocabulary and batch,
    bf16 as its TPU runs: parameters and Adam state replicated, the batch split over the mesh's
    data axis, the state donated; compiled and read as t2t's step is (t2t.aot.tpu.Compiled)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from t2t.aot import tpu as aot

    models, _ = benchlib.load_flax_peer()
    shape = (config.d_model, config.num_heads, config.d_ff, config.num_encoder_layers)
    peer = benchlib.flax_peer_config(models, shape, config.vocab_size, 'bfloat16',
                                     deterministic=False, decode=False)
    state = jax.eval_shape(lambda: benchlib.flax_peer_state(
        models, peer, benchlib.flax_peer_params(models, peer, config.max_len, config.max_len)))
    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec('data'))
    state = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    batch = {k: jax.ShapeDtypeStruct((config.batch_size, config.max_len), 'int32', sharding=split)
             for k in ('inputs', 'targets')}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    step = jax.jit(benchlib.flax_peer_train_step(models, peer), donate_argnums=(0,),
                   out_shardings=(jax.tree_util.tree_map(lambda x: x.sharding, state),
                                  replicated))
    return aot.with_roofline(aot.compile_jitted(step, state, batch, key), mesh)


def tiny_plan(dcn: bool = False) -> list[Row]:
    if dcn:
        return [Row('tiny', 'v5e-4', 'dcn data x fsdp', (1, 4, 1), 512, (2, 1, 1))]
    return [Row('tiny', 'v5e-4', 'data', (4, 1, 1), 512),
            Row('tiny', 'v5e-4', 'fsdp', (1, 4, 1), 512)]


# ----------------------------------------------------------------------------------------------
# One row, in a child process


def measure(row: Row, hlo_dir: str = '') -> dict:
    """Compiles the row's train step for its slice; the table's numbers (see the docstring)."""
    import importlib

    sys.path.insert(0, ROOT)
    from t2t import sharding
    from t2t.aot import tpu as aot
    from t2t.infra import flops, platforms
    from t2t.run import startup

    peer = row.config.startswith(FLAX_PEER + ':')
    config = importlib.import_module(
        f'configs.{row.config.split(":")[-1]}').get_config()
    slices = math.prod(row.dcn)
    dp = tuple(a * b for a, b in zip(row.mesh, row.dcn, strict=True))
    rows = rows_for(row.tokens, config.max_len, dp)
    with config.unlocked():
        config.mesh_shape = row.mesh
        config.dcn_mesh_shape = row.dcn
        config.batch_size = rows
    if slices == 1:
        plan = aot.plan(config, row.slice)
        tpu, mesh = plan.target, plan.mesh
    else:  # aot.plan describes one slice; the same slice num_slices times, over DCN
        tpu = aot.parse_slice(row.slice)
        platforms.compile_only_tpu(tpu.accelerator_type)
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(
            platform='tpu', topology_name=tpu.topology, chip_config_name=tpu.chip.chip_config,
            chips_per_host_bounds=tpu.chips_per_host_bounds, num_slices=slices).devices
        mesh = sharding.make_mesh(row.mesh, devices=devices, dcn_mesh_shape=row.dcn)
        startup.check_training_config(config, mesh)
    train = compile_flax_peer(config, mesh) if peer else aot.compile_train_step(config, mesh)
    if hlo_dir:
        import gzip

        os.makedirs(hlo_dir, exist_ok=True)
        name = f'{row.config}-{row.slice}-{row.mesh_label}-{row.tokens}'
        with gzip.open(os.path.join(hlo_dir, ''.join(
                c if c.isalnum() or c in '-.' else '_' for c in name) + '.hlo.gz'), 'wt') as f:
            f.write(train.hlo_text)
    hbm = tpu.hbm_bytes
    chips = tpu.chips * slices
    out = dict(config=row.config, slice=tpu.name if slices == 1 else f'{slices} x {tpu.name}',
               chips=chips, mesh_name=row.mesh_name, mesh=row.mesh_label, rows=rows,
               target_tokens=rows * config.max_len, hbm_gib=round(hbm / GIB, 1),
               compile_s=round(train.seconds, 1), requested_tokens=row.tokens,
               libtpu_init_args=os.environ.get('LIBTPU_INIT_ARGS', ''))
    if train.memory is None:
        out.update(status='compiler out of memory', fits='no')
        return out
    m, r, e = train.memory, train.roofline, train.estimate
    bound = r.seconds
    model_flops = flops.config_flops_per_step(config)
    kinds = {k: _sig((c.bytes + c.in_loops_bytes) / 1e9)
             for k, c in train.collectives.items() if c.count or c.in_loops_count}
    if slices > 1:
        kinds['dcn-send'] = _sig(dcn_send_bytes(train.hlo_text) / 1e9)
    out.update(
        status='ok', argument_gib=_sig(m.arguments / GIB),
        temp_gib=_sig(m.temporaries / GIB), total_gib=_sig(m.total / GIB),
        fits='yes' if train.fits(hbm) else 'no',
        collective_gb=_sig(train.collective_bytes / 1e9),
        collective_gb_in_loops=_sig(
            sum(c.in_loops_bytes for c in train.collectives.values()) / 1e9),
        collective_kinds=' '.join(f'{k}={v}' for k, v in sorted(kinds.items())),
        compute_ms=_sig(r.compute_s * 1e3), memory_ms=_sig(r.memory_s * 1e3),
        collective_ms=_sig(r.collective_s * 1e3), bound_ms=_sig(bound * 1e3),
        tokens_per_s_per_chip_bound=round(rows * config.max_len / bound / chips),
        mfu_bound_pct=_sig(100 * r.mfu(model_flops, chips)))
    if e is not None:
        out.update(xla_estimate_ms=_sig(e.seconds * 1e3), loop_scale=_sig(e.scale),
                   mfu_estimate_pct=_sig(100 * e.mfu(model_flops, chips)),
                   tokens_per_s_per_chip_estimate=round(rows * config.max_len / e.seconds / chips))
    return out


def dcn_send_bytes(text: str) -> float:
    """Bytes a device sends over DCN per run: the multi-slice runtime's host-transfer sends
    (each a (data, u32[] context, token[]) tuple; the data counted), loops by trip count. The
    collectives inside a slice stay all-reduces etc.; t2t/aot/hlo.py counts only those."""
    from t2t.aot import hlo

    module = hlo.parse(text)
    total = 0.0
    for name, times in hlo.executions(module).items():
        for i in module.computations.get(name, ()):
            if i.opcode == 'send' and 'megascale' in i.attributes:
                total += times * (hlo.shape_bytes(i.shape) - 4)
    return total


def breakdown_table(path: str, top: int) -> str:
    """A markdown table of the largest byte groups of a kept HLO (t2t.aot.cost.breakdown), with
    the totals (which the groups sum to) and the share of each."""
    import gzip

    sys.path.insert(0, ROOT)
    from t2t.aot import cost

    with gzip.open(path, 'rt') if path.endswith('.gz') else open(path) as f:
        shares = cost.breakdown(f.read())
    memory = sum(s.memory_bytes for s in shares)
    collective = sum(s.collective_bytes for s in shares)
    lines = [f'{os.path.basename(path)}: per device per step, HBM {memory / 1e9:.4g} GB, '
             f'collectives {collective / 1e9:.4g} GB (loops by trip count)', '',
             '| ops | HBM GB | % of HBM | collective GB | % of collectives | of it in loops GB | '
             'opcode and traced operation |', '|---|---|---|---|---|---|---|']
    for s in shares[:top]:
        lines.append(f'| {s.ops} | {s.memory_bytes / 1e9:.4g} | '
                     f'{100 * s.memory_bytes / max(memory, 1):.1f} | '
                     f'{s.collective_bytes / 1e9:.4g} | '
                     f'{100 * s.collective_bytes / max(collective, 1):.1f} | '
                     f'{s.in_loops_bytes / 1e9:.4g} | `{s.key[:160]}` |')
    return '\n'.join(lines)


def _sig(x: float) -> float:
    return float(f'{x:.4g}')


def child_main(spec: str) -> int:
    d = json.loads(spec)
    row = Row(d['config'], d['slice'], d['mesh_name'], tuple(d['mesh']), d['tokens'],
              tuple(d.get('dcn', (1, 1, 1))))
    print('RESULT ' + json.dumps(measure(row, d.get('hlo_dir', ''))), flush=True)
    return 0


def run_row(row: Row, timeout: int, nice: int, hlo_dir: str = '', libtpu_args: str = '') -> dict:
    spec = json.dumps(dict(dataclasses.asdict(row), hlo_dir=hlo_dir))
    start = time.time()
    result, status = benchlib.run_child(
        __file__, spec, timeout=timeout, nice=nice, root=ROOT, prefix=('flock', LIBTPU_LOCK),
        env_extra={'LIBTPU_INIT_ARGS': libtpu_args} if libtpu_args else None)
    if result is not None:
        return result
    return dict(config=row.config, slice=row.slice, mesh_name=row.mesh_name, mesh=row.mesh_label,
                requested_tokens=row.tokens, status=status,
                compile_s=round(time.time() - start, 1),
                libtpu_init_args=libtpu_args or os.environ.get('LIBTPU_INIT_ARGS', ''))


# ----------------------------------------------------------------------------------------------
# The table files


def done_keys(csv_path: str) -> set:
    """(config, slice asked, mesh, tokens asked, LIBTPU_INIT_ARGS) of the rows in the file."""
    if not os.path.exists(csv_path):
        return set()
    with open(csv_path, newline='') as f:
        return {(r['config'], r['slice_asked'], r['mesh'], r['requested_tokens'],
                 r.get('libtpu_init_args') or '') for r in csv.DictReader(f)}


def append(out: str, row: Row, result: dict) -> None:
    """Appends the row to OUT.csv (a file of an older header is rewritten with today's columns,
    the new ones empty) and writes OUT.md from the whole of it."""
    values = {k: result.get(k, '') for k in COLUMNS}
    values.update(slice_asked=row.slice, requested_tokens=row.tokens)
    benchlib.append_table(out, ('slice_asked', 'requested_tokens') + COLUMNS, COLUMNS, values)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=os.path.join(ROOT, 'bench', 'mesh_table'),
                    help='writes OUT.csv and OUT.md')
    ap.add_argument('--tiny', action='store_true', help='configs/tiny.py on v5e:2x2, two meshes')
    ap.add_argument('--tiny_dcn', action='store_true', help='configs/tiny.py on 2 x v5e:2x2')
    ap.add_argument('--only', type=int, default=0, help='at most this many new rows (0: all)')
    ap.add_argument('--timeout', type=int, default=3600, help='seconds per compile')
    ap.add_argument('--nice', type=int, default=19)
    ap.add_argument('--hlo_dir', default='', help='keep each compiled HLO text here (gzip)')
    ap.add_argument('--peer', action='store_true',
                    help='t2t against flax examples/wmt on v5e-16 (needs .peer/flax_wmt/)')
    ap.add_argument('--paper_only', action='store_true',
                    help='only the rows at the paper\'s ~25k target tokens a step')
    ap.add_argument('--mesh_name', default='',
                    help='only the rows of these meshes, comma-separated (e.g. fsdp)')
    ap.add_argument('--config', default='', help='only the rows of these configs, comma-separated '
                    '(e.g. wmt14_ende_base)')
    ap.add_argument('--slice', default='', help='only the rows of these slices as asked, '
                    'comma-separated (e.g. v5e-64: its DCN rows too)')
    ap.add_argument('--noslice', action='store_true',
                    help=f'compile with LIBTPU_INIT_ARGS={NOSLICE} (libtpu makes no sliced '
                    'prefetches, so XLA\'s estimate on v5e is a time; the program differs a '
                    'little from the default one); the column libtpu_init_args says so')
    ap.add_argument('--breakdown', default='', help='no compile: where the bytes of a kept HLO '
                    'go (see above)')
    ap.add_argument('--top', type=int, default=15, help='with --breakdown: groups shown')
    ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.breakdown:
        print(breakdown_table(args.breakdown, args.top))
        return 0
    plan = (tiny_plan(args.tiny_dcn) if args.tiny or args.tiny_dcn else
            peer_plan() if args.peer else full_plan())
    if args.paper_only:
        plan = [r for r in plan if r.tokens == PAPER_TOKENS]
    for flag, key in ((args.mesh_name, 'mesh_name'), (args.config, 'config'),
                      (args.slice, 'slice')):
        if flag:
            plan = [r for r in plan if getattr(r, key) in flag.split(',')]
    libtpu_args = os.environ.get('LIBTPU_INIT_ARGS', '')
    if args.noslice and NOSLICE not in libtpu_args:
        libtpu_args = f'{libtpu_args} {NOSLICE}'.strip()
    done = done_keys(args.out + '.csv')
    todo = [r for r in plan
            if (r.config, r.slice, r.mesh_label, str(r.tokens), libtpu_args) not in done]
    if args.only:
        todo = todo[:args.only]
    print(f'{len(plan) - len(todo)} rows already in {args.out}.csv or past --only, '
          f'{len(todo)} to compile', flush=True)
    for row in todo:
        result = run_row(row, args.timeout, args.nice, args.hlo_dir, libtpu_args)
        append(args.out, row, result)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
