"""The peers t2t is measured against, on one GPU, in the same run as t2t's own benchmarks.

    python bench/peers_gpu.py [--sections hw,hf,torch] [--tiny]

bench/run_gpu.sh runs it first, so that every t2t speed claim is a ratio to a peer of the same run
on the same device. Sections (bench/peer_sections.py), each in its own process under a hard cap:
  hw     device info, bf16 matmul TFLOP/s (8192^3), device-to-device copy GB/s (read+write bytes)
  hf     HF transformers MarianMTModel (BASE shape, random init, bf16): beam-search generate
  torch  reference torch.nn.Transformer (post-LN, one 32k embedding for source, target and tied
         output), label-smoothed CE, fused Adam, bf16 autocast, torch.compile: BASE, BIG
  jax    flax examples/wmt models.py + decode.py, verbatim in .peer/flax_wmt/ (not committed; see
         bench/README.md): BASE, BIG training steps (bf16) and decode.beam_search; not by default
Needs torch and transformers (the jax section: jax, flax, optax). Budget: ANCHOR_BUDGET_S seconds
in all (default 420, 1500 with --tiny), shared out among the sections left to run; a measurement
is skipped when too little time is left and interrupted at its section's deadline. Output:
`RESULT {json}` lines (also appended to $OUT/anchors.jsonl when OUT is set; each section's stderr
then goes to $OUT/<section>.stderr.log) and a markdown table at the end. --tiny runs everything
at toy sizes on the CPU (minutes).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from peer_sections import section_hf, section_hw, section_jax, section_torch
from peers_common import FULL, TINY, emit

# name -> (function, share of the remaining budget, floor in seconds)
SECTIONS = {
    'hw': (section_hw, 0.5, 40),
    'hf': (section_hf, 1.0, 45),
    'torch': (section_torch, 4.0, 120),
    'jax': (section_jax, 4.0, 120),
}
COLS = [
    ('step_ms', 'step ms'),
    ('batch_ms', 'batch ms'),
    ('tgt_tok_s', 'tgt tok/s'),
    ('src_tgt_tok_s', 'src+tgt tok/s'),
    ('achieved_tflops', 'TFLOP/s'),
    ('mfu_989', 'MFU@989T'),
    ('mfu_measured_peak', 'MFU@meas'),
    ('sent_s', 'sent/s'),
    ('compile_s', 'compile s'),
]


def print_table(recs, wall):
    info = [r for r in recs if r['name'] in ('device_info', 'jax_info') and r['status'] == 'ok']
    for r in info:
        print(
            '# '
            + ', '.join(
                f'{k}={v}' for k, v in r.items() if k not in ('section', 'name', 'status', 'wall_s')
            )
        )
    print(f'\n| measurement | status | {" | ".join(h for _, h in COLS)} | other |')
    print('|' + '---|' * (len(COLS) + 3))
    for r in (r for r in recs if r not in info):
        other = (
            r.get('reason')
            or r.get('error')
            or (f'{r["gbs_median"]} GB/s' if 'gbs_median' in r else '')
        )
        if r.get('compiled') is False:
            other = 'EAGER (compile failed) ' + other
        cells = ' | '.join(str(r.get(k, '')) for k, _ in COLS)
        print(f'| {r["section"]}/{r["name"]} | {r["status"]} | {cells} | {str(other)[:90]} |')
    print(f'\ntotal wall {wall:.0f}s', flush=True)


def run_section(sec, cap, env, tiny, out):
    """Run one section in a child process (own session) under a hard cap; return its exit status."""
    env = dict(env, ANCHOR_DEADLINE=str(time.time() + cap))
    cmd = [sys.executable, os.path.abspath(__file__), '--section', sec] + (
        ['--tiny'] if tiny else []
    )
    err = open(os.path.join(out, f'{sec}.stderr.log'), 'w') if out else None
    p = subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True)
    try:
        return p.wait(timeout=cap + 10)
    except subprocess.TimeoutExpired:
        return 'killed after cap'
    finally:
        if p.poll() is None:  # kill the child's own process group (it and e.g. its compile workers)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if err:
            err.close()


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument('--tiny', action='store_true', help='tiny shapes on CPU (smoke test)')
    ap.add_argument('--sections', default='hw,hf,torch', help='comma list, run in this order')
    ap.add_argument(
        '--section', choices=SECTIONS, help=argparse.SUPPRESS
    )  # internal: one section, this process
    args = ap.parse_args()
    cfg = TINY if args.tiny else FULL
    if args.section:
        return SECTIONS[args.section][0](cfg, args.tiny)

    t_start, budget = time.time(), float(os.environ.get('ANCHOR_BUDGET_S', cfg['budget']))
    fd, results = tempfile.mkstemp(prefix='anchors-', suffix='.jsonl')
    os.close(fd)
    out = os.environ.get('OUT')
    if out:
        os.makedirs(out, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONUNBUFFERED='1',
        ANCHOR_RESULTS=results,
        HF_HUB_OFFLINE='1',
        TOKENIZERS_PARALLELISM='false',
    )
    if args.tiny:
        env['JAX_PLATFORMS'] = 'cpu'
    todo = [s for s in args.sections.split(',') if s in SECTIONS]
    print(f'# peers_gpu.py: budget {budget:.0f}s, sections {todo}, tiny={args.tiny}', flush=True)
    for i, sec in enumerate(todo):
        remaining = t_start + budget - time.time()
        share = SECTIONS[sec][1] / sum(SECTIONS[s][1] for s in todo[i:])
        cap = min(remaining, max(remaining * share, SECTIONS[sec][2]))
        if cap < 10:
            emit(sec, 'section', status='skipped', reason=f'budget: {cap:.0f}s left')
            continue
        print(f'# section {sec}: cap {cap:.0f}s', flush=True)
        t0 = time.time()
        rc = run_section(sec, cap, env, args.tiny, out)
        print(f'# section {sec}: rc={rc} after {time.time() - t0:.0f}s', flush=True)
        if rc != 0:
            emit(sec, 'section', status='crashed', error=f'rc={rc}', wall_s=time.time() - t0)
            if out:
                with open(os.path.join(out, f'{sec}.stderr.log')) as f:
                    print(''.join(f.readlines()[-8:]), flush=True)
        if sec == 'hw':  # the measured matmul peak becomes the second MFU denominator
            for r in map(json.loads, open(results)):
                if r['name'] == 'matmul_bf16' and r['status'] == 'ok':
                    env['ANCHOR_MEAS_TFLOPS'] = str(r['achieved_tflops'])
    with open(results) as f:
        recs = [json.loads(line) for line in f]
    os.unlink(results)
    print_table(recs, time.time() - t_start)


if __name__ == '__main__':
    main()
