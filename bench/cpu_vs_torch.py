"""t2t's CPU train step against a PyTorch 2 implementation of the same model and batch, per core.

    .venv/bin/python bench/cpu_vs_torch.py                         # 1 and 2 cores, packed rows
    .venv/bin/python bench/cpu_vs_torch.py --cores 1 --rounds 7 --layout padded
    .venv/bin/python bench/cpu_vs_torch.py --cores 1 --cpus 1      # one core: CPU 1
    .venv/bin/python bench/cpu_vs_torch.py --cores 1 --hosts reuse,plain  # with and without
    .venv/bin/python bench/cpu_vs_torch.py --set loss_impl=fused   # a t2t config key changed
    .venv/bin/python bench/cpu_vs_torch.py --variant rng_impl=unsafe_rbg  # and without, alternating

The model and batch are `make demo`'s (configs/default.py, its keys changeable with --set): post-LN
Transformer, d_model 128, d_ff 512, 4 heads, 3+3 layers, 4000-piece vocabulary shared by source,
target and the tied output projection, dropout 0.1 on the sub-layer outputs and embeddings (none on
attention weights or ReLU outputs), label smoothing 0.1, Adam(0.9, 0.98, 1e-9), float32; a batch of
64 rows x 64 tokens a side. The PyTorch side exists to be compared with, not to be used:
torch.nn.Transformer (norm_first=False, its final LayerNorms removed: the paper's post-LN has none),
the same dropout places, F.cross_entropy(label_smoothing=0.1, ignore_index=PAD), torch.optim.Adam
(fused), eager (PyTorch NMT toolkits train eagerly on the CPU; --torch_compile tries Inductor).

Layouts (the same arrays for both): `packed` (default, the demo's): pairs of 6-28 tokens packed
first-fit into the rows, with segment ids and positions; t2t takes them as it trains, PyTorch as
block-diagonal masks (each token sees its own pair, causally on the target side). `padded`: one pair
a row, each side's length uniform in [32, 64], then padding (key padding masks in PyTorch).

Cores: each core count N runs in its own process pinned to the first N CPUs of --cpus (default:
the CPUs this process may use) before jax or torch is imported (XLA's CPU thread pool follows the
affinity; torch.set_num_threads(N)). The process first prepares the host as --hosts says: `reuse`
(the default) as t2t's entry points do on a CPU-only host (platforms.prepare_cpu_host: glibc's
malloc keeps freed memory for the next allocation), `plain` leaves glibc's malloc as it is; one
process, so PyTorch's allocations get the same. In it, both steps are run first (compiles,
warm-up), then --rounds rounds, each timing --steps synced steps of one side then of the other
(the order rotates every round; --variant adds t2t steps with other config keys to the rotation).
With two or more hosts, a process each on the same CPUs, their rounds alternate too (one process
computes while the others wait; the order flips every round).
Reported: target tokens/s (non-pad target tokens / the median step time) per core of each, and
the ratio t2t / PyTorch (>= 1: t2t processes at least as many target tokens a second), with the
median of the per-round ratios, robust to load changing between rounds; with several hosts, also
each host's t2t against each host's PyTorch (`cross`), round by round. The machine's load average
is printed: on a shared machine both sides slow alike only on average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD = 0
HOSTS = ('reuse', 'plain')  # the host settings a child can start with (--hosts)


def make_batch(layout: str, rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """numpy int32 [rows, length] arrays: inputs, targets and their segment ids and positions."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batch = {f'{side}{key}': np.zeros((rows, length), np.int32) for side in ('inputs', 'targets')
             for key in ('', '_segment_ids', '_positions')}
    for r in range(rows):
        used = {'inputs': 0, 'targets': 0}
        segment, misses = 0, 0
        while misses < 20 and not (layout == 'padded' and segment):
            if layout == 'padded':
                lengths = {s: int(rng.integers(length // 2, length + 1)) for s in used}
            else:
                lengths = {s: int(rng.integers(6, 29)) for s in used}
            if any(used[s] + lengths[s] > length for s in used):
                misses += 1  # a shorter pair may still fit: the rows fill as a packer's do
                continue
            segment += 1
            for side, n in lengths.items():
                span = slice(used[side], used[side] + n)
                batch[side][r, span] = rng.integers(3, vocab, n)
                batch[f'{side}_segment_ids'][r, span] = segment
                batch[f'{side}_positions'][r, span] = np.arange(n)
                used[side] += n
    return batch


def t2t_step(overrides: dict, batch: dict):
    """(run(): one synced train step of t2t's real train step, the config)."""
    import jax

    sys.path.insert(0, ROOT)
    from configs import default
    from t2t import optim, sharding, train_lib

    config = default.get_config()
    for key, value in overrides.items():
        config[key] = type(config[key])(value) if not isinstance(config[key], bool) \
            else value in ('1', 'true', 'True')
    mesh = sharding.make_mesh((-1, 1, 1), jax.devices()[:1])
    tx = optim.make_optimizer(config)
    state, _ = train_lib.create_sharded_state(config, mesh, tx)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding,
                                       train_lib.abstract_state(config, mesh, tx))
    step = train_lib.jit_train_step(train_lib.StepConfig.from_config(config), tx, shardings, mesh)
    device_batch = sharding.put_rows(batch, sharding.batch_sharding(mesh), config.batch_size)
    compiled = step.lower(state, device_batch).compile()
    box = {'state': state}

    def run():
        box['state'], metrics = compiled(box['state'], device_batch)
        jax.block_until_ready(metrics)
        return float(metrics['loss_sum']) / max(float(metrics['tokens']), 1.0)

    return run, config


def torch_step(config, batch: dict, compile_: bool):
    """(run(): one train step of the PyTorch implementation, its description)."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, h, vocab = config.d_model, config.num_heads, config.vocab_size

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tf = nn.Transformer(d, h, config.num_encoder_layers, config.num_decoder_layers,
                                     config.d_ff, dropout=config.dropout_rate,
                                     activation='relu', batch_first=True, norm_first=False)
            self.tf.encoder.norm = self.tf.decoder.norm = None  # post-LN: no final LayerNorm
            for layer in [*self.tf.encoder.layers, *self.tf.decoder.layers]:
                layer.dropout.p = config.relu_dropout_rate  # the ReLU outputs' dropout
                for attention in ('self_attn', 'multihead_attn'):
                    if hasattr(layer, attention):
                        getattr(layer, attention).dropout = config.attention_dropout_rate
            self.embedding = nn.Embedding(vocab, d)
            nn.init.normal_(self.embedding.weight, std=d ** -0.5)
            position = torch.arange(config.max_position, dtype=torch.float32)[:, None]
            rate = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(1e4) / d))
            table = torch.zeros(config.max_position, d)
            table[:, 0::2], table[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
            self.register_buffer('table', table, persistent=False)
            self.drop = nn.Dropout(config.dropout_rate)

        def embed(self, ids, positions):
            return self.drop(self.embedding(ids) * math.sqrt(d) + self.table[positions])

        def forward(self, src, src_pos, tgt_in, tgt_pos, masks):
            out = self.tf(self.embed(src, src_pos), self.embed(tgt_in, tgt_pos), **masks)
            return F.linear(out, self.embedding.weight)  # the tied output projection

    t = {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in batch.items()}
    src_seg, tgt_seg = t['inputs_segment_ids'], t['targets_segment_ids']
    targets = t['targets']
    same_segment = tgt_seg[:, 1:] == tgt_seg[:, :-1]  # shifted right within each pair
    tgt_in = torch.cat([torch.zeros_like(targets[:, :1]),
                        torch.where(same_segment, targets[:, :-1], 0)], 1)
    length = targets.shape[1]
    if (src_seg <= 1).all() and (tgt_seg <= 1).all():  # padded: key padding masks
        masks = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(length),
                     tgt_is_causal=True, src_key_padding_mask=src_seg == 0,
                     tgt_key_padding_mask=tgt_seg == 0, memory_key_padding_mask=src_seg == 0)
    else:  # packed: a token sees its own pair (padding sees all: never an empty softmax row)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        def blocked(q, k):  # noqa: E306  [B*H, Q, K], True = not attended
            allowed = (q[:, :, None] == k[:, None, :]) | (q[:, :, None] == 0)
            return (~allowed).repeat_interleave(h, dim=0)
        masks = dict(src_mask=blocked(src_seg, src_seg),
                     tgt_mask=blocked(tgt_seg, tgt_seg) | ~causal,
                     memory_mask=blocked(tgt_seg, src_seg))
    torch.manual_seed(0)
    model = Transformer().train()
    try:
        adam = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                fused=True)
        fused = True
    except (RuntimeError, TypeError):
        adam = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        fused = False

    def loss_fn():
        logits = model(t['inputs'], t['inputs_positions'], tgt_in, t['targets_positions'], masks)
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1),
                               ignore_index=PAD, label_smoothing=config.label_smoothing)

    forward = torch.compile(loss_fn) if compile_ else loss_fn

    def run():
        adam.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        adam.step()
        return float(loss.detach())

    return run, dict(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                     adam_fused=fused, torch_compile=compile_)


class _Turns:
    """A served child's rounds wait for the parent's `go` on stdin and answer DONE: the processes
    of several hosts take turns on the same CPUs (a lone --child runs its rounds straight on)."""

    def __init__(self, serve: bool):
        self.serve = serve
        if serve:
            print('READY', flush=True)

    def begin(self):
        if self.serve and sys.stdin.readline().strip() != 'go':
            raise SystemExit('cpu_vs_torch --child: the parent stopped before the last round')

    def end(self):
        if self.serve:
            print('DONE', flush=True)


def _pairs(items) -> dict:
    return dict(item.split('=', 1) for item in items)


def _timed_rounds(runs: dict, args) -> tuple[dict, dict]:
    """--rounds rounds of --steps synced steps of each run, the order rotating every round:
    (every step's seconds, each round's median) by run."""
    times = {name: [] for name in runs}
    per_round = {name: [] for name in runs}
    names = list(runs)
    turn = _Turns(args.serve)
    for r in range(args.rounds):
        turn.begin()
        for name in names[r % len(names):] + names[:r % len(names)]:
            round_times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                runs[name]()
                round_times.append(time.perf_counter() - t0)
            times[name] += round_times
            per_round[name].append(statistics.median(round_times))
        turn.end()
    return times, per_round


def child(args) -> dict:
    """One core count, in this process (pinned by the parent's command): both steps, alternating."""
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # main's command sets it; --child alone too
    sys.path.insert(0, ROOT)
    from t2t.infra import platforms

    if args.host == 'reuse':
        platforms.prepare_cpu_host()  # before jax or torch allocates
    import torch

    torch.set_num_threads(args.cores)
    import jax

    batch = make_batch(args.layout, 64, 64, 4000)
    overrides = _pairs(args.set)
    run_t2t, config = t2t_step(overrides, batch)
    if (config.batch_size, config.max_len, config.vocab_size) != (64, 64, 4000):
        raise SystemExit('--set changed the batch or vocabulary: the batch here is 64 x 64, '
                         'vocabulary 4000')
    run_torch, torch_info = torch_step(config, batch, args.torch_compile)
    runs = {'t2t': run_t2t, 'torch': run_torch}
    for variant in args.variant:
        runs[f't2t[{variant}]'] = t2t_step({**overrides, **_pairs(variant.split(','))}, batch)[0]
    losses = {name: [run() for _ in range(3)] for name, run in runs.items()}  # warm-up
    times, per_round = _timed_rounds(runs, args)
    tokens = int((batch['targets'] != PAD).sum())
    step_s = {name: statistics.median(v) for name, v in times.items()}
    per_core = {name: tokens / s / args.cores for name, s in step_s.items()}

    def round_ratios(name):  # t2t / PyTorch of each round
        return [b / a for a, b in zip(per_round[name], per_round['torch'], strict=True)]

    variants = {name: dict(step_ms=round(step_s[name] * 1e3, 1),
                           tokens_per_s_per_core=round(per_core[name]),
                           ratio=round(per_core[name] / per_core['torch'], 3),
                           ratio_round_median=round(statistics.median(round_ratios(name)), 3),
                           over_t2t_round_median=round(statistics.median([  # > 1: faster
                               a / b for a, b in zip(per_round['t2t'], per_round[name],
                                                     strict=True)]), 3))
                for name in runs if name.startswith('t2t[')}
    return dict(cores=args.cores, host=args.host, layout=args.layout, target_tokens=tokens,
                t2t_step_ms=round(step_s['t2t'] * 1e3, 1),
                torch_step_ms=round(step_s['torch'] * 1e3, 1),
                t2t_tokens_per_s_per_core=round(per_core['t2t']),
                torch_tokens_per_s_per_core=round(per_core['torch']),
                ratio=round(per_core['t2t'] / per_core['torch'], 3),
                ratio_round_median=round(statistics.median(round_ratios('t2t')), 3),
                round_ratios=[round(x, 3) for x in round_ratios('t2t')],
                steps_each=len(times['t2t']), variants=variants,
                round_step_ms={k: [round(x * 1e3, 1) for x in v] for k, v in per_round.items()},
                warmup_losses={k: [round(x, 3) for x in v] for k, v in losses.items()},
                t2t_overrides=overrides, jax=jax.__version__,
                xla_flags=os.environ.get('XLA_FLAGS', ''), **torch_info,
                loadavg=[round(x, 2) for x in os.getloadavg()])


def _start(args, host: str, cpus: list[int], n: int) -> subprocess.Popen:
    """A served child for one host and core count, pinned to cpus[:n], once it is READY."""
    command = ['taskset', '-c', ','.join(map(str, cpus[:n])), sys.executable,
               os.path.abspath(__file__), '--child', '--serve', f'--cores={n}', f'--host={host}',
               f'--rounds={args.rounds}', f'--steps={args.steps}', f'--layout={args.layout}',
               *(f'--set={s}' for s in args.set), *(f'--variant={v}' for v in args.variant),
               *(['--torch_compile'] if args.torch_compile else [])]
    # glibc's huge pages for large blocks, as the Makefile sets for t2t (both sides get them)
    env = {'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1', **os.environ, 'JAX_PLATFORMS': 'cpu'}
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    _read_until(proc, 'READY')
    return proc


def _read_until(proc: subprocess.Popen, mark: str) -> list[str]:
    """The child's stdout lines up to `mark` (echoed, the marks excepted)."""
    lines = []
    for line in proc.stdout:
        if line.strip() == mark:
            return lines
        print(line, end='', flush=True)
        lines.append(line)
    raise SystemExit(f'cpu_vs_torch: a child ended (exit {proc.wait()}) before {mark}')


def _cross(results: dict) -> dict:
    """Each host's t2t against each host's PyTorch: step times of neighbouring rounds."""
    out = {}
    for a, ra in results.items():
        for b, rb in results.items():
            pairs = zip(ra['round_step_ms']['t2t'], rb['round_step_ms']['torch'], strict=True)
            rounds = [torch_ms / t2t_ms for t2t_ms, torch_ms in pairs]
            out[f't2t_{a}/torch_{b}'] = dict(
                ratio=round(rb['torch_step_ms'] / ra['t2t_step_ms'], 3),
                ratio_round_median=round(statistics.median(rounds), 3),
                round_ratios=[round(x, 3) for x in rounds])
    return out


def _one_core_count(args, cpus: list[int], n: int) -> None:
    hosts = args.hosts.split(',')
    procs = {host: _start(args, host, cpus, n) for host in hosts}
    for r in range(args.rounds):
        for host in (hosts if r % 2 == 0 else hosts[::-1]):
            procs[host].stdin.write('go\n')
            procs[host].stdin.flush()
            _read_until(procs[host], 'DONE')
    results = {}
    for host, proc in procs.items():
        proc.stdin.close()
        lines = proc.stdout.readlines()
        print(''.join(lines), end='', flush=True)
        if proc.wait():
            raise SystemExit(f'cpu_vs_torch: the {host} child failed')
        result = [x for x in lines if x.startswith('RESULT ')][-1]
        results[host] = json.loads(result[len('RESULT '):])
    if len(hosts) > 1:
        print('RESULT ' + json.dumps({'section': 'cpu_vs_torch_hosts', 'cores': n,
                                      'cross': _cross(results),
                                      'loadavg': [round(x, 2) for x in os.getloadavg()]}),
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--cores', default='1,2', help='comma list: a process pinned to each count')
    ap.add_argument('--cpus', default='', help='comma list of the CPUs to pin to, first ones '
                    'first (default: those this process may use)')
    ap.add_argument('--hosts', default='reuse', help='comma list of host settings (reuse: '
                    'platforms.prepare_cpu_host, as t2t runs; plain: glibc as it is): a process '
                    'each, their rounds alternating')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=5, help='timed steps per side and round')
    ap.add_argument('--layout', default='packed', choices=('packed', 'padded'))
    ap.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                    help='a configs/default.py key for t2t (a speed lever), repeatable')
    ap.add_argument('--variant', action='append', default=[], metavar='KEY=VALUE[,...]',
                    help='a second t2t step with these keys on top of --set, timed in the same '
                    'rounds (its ratios under "variants"), repeatable')
    ap.add_argument('--torch_compile', action='store_true', help='torch.compile the loss')
    ap.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--serve', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--host', default='reuse', choices=HOSTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.cores = int(args.cores)
        print('RESULT ' + json.dumps({'section': 'cpu_vs_torch', **child(args)}), flush=True)
        return 0
    if not set(args.hosts.split(',')) <= set(HOSTS) or len(set(args.hosts.split(','))) < \
            len(args.hosts.split(',')):
        raise SystemExit(f'--hosts {args.hosts}: distinct ones of {", ".join(HOSTS)}')
    allowed = sorted(os.sched_getaffinity(0))
    available = [int(c) for c in args.cpus.split(',')] if args.cpus else allowed
    if not set(available) <= set(allowed):
        raise SystemExit(f'--cpus {args.cpus}: this process may use only CPUs {allowed}')
    print(f'# cpu_vs_torch: cpus {available}, loadavg {os.getloadavg()}', flush=True)
    counts = [int(c) for c in args.cores.split(',')]
    if max(counts) > len(available):
        raise SystemExit(f'--cores {max(counts)}: only {len(available)} CPUs to pin to '
                         f'({available})')
    for n in counts:
        _one_core_count(args, available, n)
    print(f'# done, loadavg {os.getloadavg()}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
