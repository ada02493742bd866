"""Which mesh on which GPU nodes: the train step of base and big compiled ahead of time per mesh.

    nice -n 19 .venv/bin/python bench/gpu_mesh_table.py --out bench/gpu_mesh_table  # hours
    .venv/bin/python bench/gpu_mesh_table.py --target 8xh100 --peer   # t2t vs flax wmt, 8 x H100
    .venv/bin/python bench/gpu_mesh_table.py --tiny --out /tmp/gpu_tiny           # minutes

For each row (config, GPU nodes, mesh, batch) the dry run's train step (t2t/aot/tpu.py's
compile_train_step, state sharded and donated as in training) is compiled with XLA's CUDA
compiler on this CPU (the gpu-aot extra; t2t/aot/targets.py describes the nodes), in a child
process under `nice`, and appended to OUT.csv / OUT.md as soon as it ends, with the commit it
was compiled at; rows already in OUT.csv are skipped (resumable; a row is its config, target,
mesh, batch and attention kernel). The configs' attention_impl='auto' is cuDNN's on GPUs in bf16:
`--set attention_impl=xla` for XLA's softmax. Targets: 1xh100, 8xh100, 8xh200, 2x8xh100 (two
nodes over the network). Meshes: every (data, fsdp, tensor) whose product is the GPU count and
whose tensor divides the heads, data-parallel first (--mesh data,fsdp: only those two). Batch:
the paper's ~25k target tokens a step (rows = 25000 / max_len, rounded to a multiple of data x
fsdp) and 4x that.

--peer: flax examples/wmt's train step (bench/mesh_table.py's compile_flax_peer: parameters and
Adam state replicated, the batch split, as its pmap does; bf16, XLA's attention) beside t2t's on
the same data-parallel mesh, base and big, on --target (default 8xh100), at equal work (the same
dims, vocabulary, rows and length).

Columns, per GPU and per step: memory_analysis arguments / temporaries / total in GiB against
the card's HBM and the verdict (t2t.aot.tpu.verdict: fits / fits only by rematerialization /
does not fit) with the recompute ratio (XLA's matmul FLOPs over t2t/infra/flops.py's dense count;
the peer's counted against the same formula); XLA's counts (HloCostAnalysis of the optimized module:
flops and bytes accessed, each loop body once) and the matmul FLOPs and HBM bytes with loops by
trip count; collectives in one node (NVLink) and across nodes, GB of operands, and the GB a GPU
sends on each link (t2t.aot.gpu.sent_bytes: NCCL's ring model); the attention kernel compiled;
the roofline ESTIMATE's terms (t2t.aot.gpu.GpuRoofline: compute, HBM, NVLink, network) and its
step time, with the MFU and target tokens/s per GPU it implies. Estimates from datasheet
numbers and a compile without autotuning, not measurements.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import benchlib  # noqa: E402

PAPER_TOKENS = 25_000  # target tokens per step in the paper (section 5.1)
GIB = 1 << 30
FLAX_PEER = 'flax_wmt'  # a config name prefix: flax examples/wmt's model at that config's dims

COLUMNS = ('config', 'target', 'gpus', 'mesh', 'rows', 'target_tokens', 'attention', 'status',
           'verdict', 'recompute_ratio', 'argument_gib', 'temp_gib', 'total_gib', 'hbm_gib',
           'xla_flops', 'xla_bytes', 'matmul_flops', 'hbm_bytes', 'nvlink_gb', 'network_gb',
           'nvlink_sent_gb', 'network_sent_gb', 'collective_kinds', 'attention_kernel',
           'compute_ms', 'memory_ms', 'nvlink_ms', 'network_ms', 'estimate_ms', 'mfu_pct',
           'tokens_per_s_per_gpu', 'compile_s')


@dataclasses.dataclass(frozen=True)
class Row:
    config: str  # file under configs/ without .py; 'flax_wmt:<config>' for the peer
    target: str  # t2t.aot.targets name: 8xh100
    mesh: tuple[int, int, int]  # (data, fsdp, tensor)
    tokens: int  # target tokens a step asked for
    attention: str = ''  # the kernel the config resolves to on the target (attention_of)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.config, self.target, str(self.mesh), str(self.tokens), self.attention)


def meshes(gpus: int, heads: int = 8) -> list[tuple[int, int, int]]:
    """Every (data, fsdp, tensor) with data x fsdp x tensor = gpus and tensor | heads; data
    first, then fsdp, then the mixed ones."""
    out = [(d, f, gpus // (d * f)) for d in range(gpus, 0, -1) if gpus % d == 0
           for f in range(gpus // d, 0, -1) if (gpus // d) % f == 0
           if heads % (gpus // (d * f)) == 0]
    return sorted(out, key=lambda m: (m != (gpus, 1, 1), m != (1, gpus, 1), m[2], -m[0]))


rows_for = benchlib.rows_for


_GPUS = {'1xh100': 1, '8xh100': 8, '8xh200': 8, '2x8xh100': 16}


def _mesh_name(row: Row) -> str:
    gpus = row.mesh[0] * row.mesh[1] * row.mesh[2]
    if row.mesh == (gpus, 1, 1):  # one GPU's mesh is 'data'
        return 'data'
    return 'fsdp' if row.mesh == (1, gpus, 1) else '.'.join(map(str, row.mesh))


def full_plan() -> list[Row]:
    """Most useful first: 8 x H100 at the paper's batch, then 1 x H100, 8 x H200, two nodes, then
    4x the batch."""
    out = []
    for tokens in (PAPER_TOKENS, 4 * PAPER_TOKENS):
        for target in ('8xh100', '1xh100', '8xh200', '2x8xh100'):
            for config in ('wmt14_ende_base', 'wmt14_ende_big'):
                out += [Row(config, target, m, tokens) for m in meshes(_GPUS[target])]
    return out


def peer_plan(target: str = '8xh100') -> list[Row]:
    gpus = _GPUS.get(target) or int(target.split('x')[0])
    return [Row(c, target, (gpus, 1, 1), PAPER_TOKENS)
            for config in ('wmt14_ende_base', 'wmt14_ende_big')
            for c in (config, f'{FLAX_PEER}:{config}')]


def tiny_plan() -> list[Row]:
    return [Row('tiny', '2xh100', (2, 1, 1), 512), Row(f'{FLAX_PEER}:tiny', '2xh100', (2, 1, 1),
                                                       512)]


# ----------------------------------------------------------------------------------------------
# One row, in a child process


def _sig(x: float) -> float:
    return float(f'{x:.4g}')


def load_config(row: Row, settings: dict):
    """The row's config: its file's, the row's mesh and batch, bf16, then `settings`."""
    import importlib

    sys.path.insert(0, ROOT)
    config = importlib.import_module(f'configs.{row.config.split(":")[-1]}').get_config()
    with config.unlocked():
        config.mesh_shape = row.mesh
        config.batch_size = rows_for(row.tokens, config.max_len, row.mesh)
        config.dtype = 'bfloat16'
        for k, v in settings.items():
            setattr(config, k, type(getattr(config, k))(v))
    return config


def attention_of(row: Row, settings: dict) -> str:
    """The attention kernel of the row's compile, known before it (t2t/attention_choice.py, as
    the dry run's plan resolves it for a GPU target): part of the row's key."""
    if row.config.startswith(FLAX_PEER + ':'):
        return 'xla (flax example)'
    from t2t import attention_choice

    return attention_choice.resolve_attention_impl(load_config(row, settings), 'gpu')[0]


def measure(row: Row, settings: dict) -> dict:
    """Compiles the row's train step for its GPUs; the table's numbers (see the docstring)."""
    from t2t.aot import tpu as aot
    from t2t.infra import flops

    peer = row.config.startswith(FLAX_PEER + ':')
    config = load_config(row, settings)
    rows = config.batch_size
    plan = aot.plan(config, row.target)
    if peer:
        import mesh_table

        train = mesh_table.compile_flax_peer(config, plan.mesh)
    else:
        train = aot.compile_train_step(config, plan.mesh)
    gpus = plan.mesh.size
    out = dict(config=row.config, target=row.target, gpus=gpus, mesh=str(row.mesh), rows=rows,
               target_tokens=rows * config.max_len, hbm_gib=_sig(plan.target.hbm_bytes / GIB),
               attention='xla (flax example)' if peer else config.attention_impl,
               compile_s=round(train.seconds, 1), requested_tokens=row.tokens)
    m, r = train.memory, train.roofline
    ratio = aot.recompute_ratio(train, config, gpus)
    remat = 'none' if peer else config.remat
    forward, backward = train.attention_calls
    kinds = {k: _sig((c.bytes + c.in_loops_bytes) / 1e9)
             for k, c in train.collectives.items() if c.count or c.in_loops_count}
    model_flops = flops.config_flops_per_step(config)
    out.update(
        status='ok', verdict=aot.verdict(train, plan.target.hbm_bytes, ratio=ratio, remat=remat),
        recompute_ratio=_sig(ratio), argument_gib=_sig(m.arguments / GIB),
        temp_gib=_sig(m.temporaries / GIB), total_gib=_sig(m.total / GIB),
        xla_flops=_sig(train.flops_per_device), xla_bytes=_sig(train.xla_bytes_accessed),
        matmul_flops=_sig(train.matmul_flops_per_device),
        hbm_bytes=_sig(train.memory_bytes_per_device),
        nvlink_gb=_sig(r.network.nvlink_bytes / 1e9),
        network_gb=_sig(r.network.internode_bytes / 1e9),
        nvlink_sent_gb=_sig(r.network.nvlink_sent / 1e9),
        network_sent_gb=_sig(r.network.internode_sent / 1e9),
        collective_kinds=' '.join(f'{k}={v}' for k, v in sorted(kinds.items())),
        attention_kernel=(f'cuDNN {forward:.0f}+{backward:.0f}' if forward + backward
                          else 'XLA softmax'),
        compute_ms=_sig(r.compute_s * 1e3), memory_ms=_sig(r.memory_s * 1e3),
        nvlink_ms=_sig(r.nvlink_s * 1e3), network_ms=_sig(r.internode_s * 1e3),
        estimate_ms=_sig(r.seconds * 1e3), mfu_pct=_sig(100 * r.mfu(model_flops, gpus)),
        tokens_per_s_per_gpu=round(rows * config.max_len / r.seconds / gpus))
    return out


def run_row(row: Row, timeout: int, nice: int, settings: dict) -> dict:
    spec = json.dumps(dict(dataclasses.asdict(row), settings=settings))
    start = time.time()
    result, status = benchlib.run_child(__file__, spec, timeout=timeout, nice=nice, root=ROOT)
    if result is None:
        result = dict(config=row.config, target=row.target, mesh=str(row.mesh), status=status,
                      requested_tokens=row.tokens, attention=row.attention,
                      compile_s=round(time.time() - start, 1))
    return dict(result, commit=_commit(), settings=' '.join(f'{k}={v}' for k, v in
                                                            sorted(settings.items())))


def _commit() -> str:
    """The code a row was compiled with: HEAD, '+dirty' with uncommitted changes under t2t/."""
    import subprocess

    def git(*a):
        return subprocess.run(['git', *a], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = git('status', '--porcelain', '--', 't2t', 'configs').strip()
    return git('rev-parse', '--short', 'HEAD').strip() + ('+dirty' if dirty else '')


# ----------------------------------------------------------------------------------------------
# The table files


def done_keys(csv_path: str) -> set:
    if not os.path.exists(csv_path):
        return set()
    with open(csv_path, newline='') as f:
        return {(r['config'], r['target'], r['mesh'], r['requested_tokens'], r['attention'])
                for r in csv.DictReader(f)}


def append(out: str, result: dict) -> None:
    """Appends the row to OUT.csv and writes OUT.md from the whole of it."""
    fields = ('requested_tokens',) + COLUMNS + ('commit', 'settings')
    benchlib.append_table(out, fields, COLUMNS, {k: result.get(k, '') for k in fields})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', default=os.path.join(ROOT, 'bench', 'gpu_mesh_table'),
                    help='writes OUT.csv and OUT.md')
    ap.add_argument('--tiny', action='store_true', help='configs/tiny.py on 2xh100, t2t and flax')
    ap.add_argument('--peer', action='store_true', help='t2t against flax examples/wmt '
                    '(needs .peer/flax_wmt/, see bench/benchlib.py)')
    ap.add_argument('--target', default='', help='only these targets, comma-separated')
    ap.add_argument('--config', default='', help='only these configs, comma-separated')
    ap.add_argument('--paper_only', action='store_true', help="only the paper's ~25k tokens")
    ap.add_argument('--four_x_only', action='store_true', help="only 4x the paper's tokens")
    ap.add_argument('--mesh', default='', help='only these meshes, comma-separated: data (all '
                    'GPUs data-parallel), fsdp (all fsdp) or D.F.T (e.g. 4.2.1)')
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                    help='a config value of every t2t row (e.g. attention_impl=cudnn)')
    ap.add_argument('--only', type=int, default=0, help='at most this many new rows (0: all)')
    ap.add_argument('--timeout', type=int, default=3600, help='seconds per compile')
    ap.add_argument('--nice', type=int, default=19)
    ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        d = json.loads(args.child)
        row = Row(d['config'], d['target'], tuple(d['mesh']), d['tokens'], d['attention'])
        print('RESULT ' + json.dumps(measure(row, d['settings'])), flush=True)
        return 0
    settings = dict(s.split('=', 1) for s in args.set)
    plan = (tiny_plan() if args.tiny else
            peer_plan(args.target.split(',')[0] or '8xh100') if args.peer else full_plan())
    if args.paper_only or args.four_x_only:
        plan = [r for r in plan if r.tokens == (PAPER_TOKENS if args.paper_only else
                                                4 * PAPER_TOKENS)]
    for flag, pick in ((args.target, lambda r: r.target),
                       (args.config, lambda r: r.config.split(':')[-1]),
                       (args.mesh, _mesh_name)):
        if flag:
            plan = [r for r in plan if pick(r) in flag.split(',')]
    plan = [dataclasses.replace(r, attention=attention_of(r, settings)) for r in plan]
    done = done_keys(args.out + '.csv')
    todo = [r for r in plan if r.key not in done]
    if args.only:
        todo = todo[:args.only]
    print(f'{len(plan) - len(todo)} rows already in {args.out}.csv or past --only, '
          f'{len(todo)} to compile', flush=True)
    for row in todo:
        result = run_row(row, args.timeout, args.nice, settings)
        append(args.out, result)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
