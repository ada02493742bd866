"""The chaos run, long form: scripts/launch_local.py trains tiny on 2 processes x 4 CPU devices
while seeded faults (SIGKILLs and SIGSTOPs of random processes at random moments) hit it; the
result is compared with an uninterrupted run of the same launcher.

    python bench/chaos.py [--kills=18] [--stops=2] [--steps=60] [--seed=0] [--hang_timeout_s=30]
        [--startup_hang_timeout_s=S] [--bucket [--p_503=0.02] [--p_drop=0.01]]   # else local

--bucket puts the chaos run's workdir in a bucket on the local Cloud Storage server
(tests/gcs_server.py) behind the fault-injecting front (tests/fault_front.py): storage faults
on top of the process faults. The RESULT line then also holds the front's counts, and the goodput
summary of the run (python -m t2t.goodput) is printed.

Prints one RESULT line (JSON): faults applied, restarts, wall time of both runs, steps trained
again, and whether the final parameters (bitwise) and metrics.jsonl (each step once) are exact.
tests/test_chaos.py is the short form (tests/chaos_run.py holds the machinery).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the checkpoints are compared here, on the CPU

from tests import chaos_run  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--kills', type=int, default=18)
    p.add_argument('--stops', type=int, default=2)
    p.add_argument('--steps', type=int, default=60)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--hang_timeout_s', type=float, default=30.0)
    p.add_argument('--startup_hang_timeout_s', type=float, default=None,
                   help='the launcher\'s guard before an attempt\'s first step line (default: '
                   '--hang_timeout_s)')
    p.add_argument('--bucket', action='store_true', help='the chaos run\'s workdir in a bucket')
    p.add_argument('--p_503', type=float, default=0.02)
    p.add_argument('--p_drop', type=float, default=0.01)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix='t2t-chaos-')
    data_dir = os.path.join(root, 'data')
    reference = os.path.join(root, 'reference')
    guards = dict(hang_timeout_s=args.hang_timeout_s,
                  startup_hang_timeout_s=args.startup_hang_timeout_s)
    ref = chaos_run.run(reference, os.path.join(root, 'logs-ref'), args.steps, data_dir, [],
                        **guards)
    if ref['status'] != 0:
        print(f'chaos: the uninterrupted run failed: {ref["launcher_err"][-2000:]}',
              file=sys.stderr)
        return 1
    faults = chaos_run.plan(args.seed, args.kills, args.stops)
    with contextlib.ExitStack() as stack:
        workdir, front = os.path.join(root, 'run'), None
        if args.bucket:
            from tests import fault_front, gcs_server

            url = stack.enter_context(gcs_server.serve())
            front = fault_front.start(url, seed=args.seed, p_503=args.p_503, p_drop=args.p_drop)
            stack.callback(front.stop)
            os.environ.update(gcs_server.environment(front.url))  # the launcher inherits it
            workdir = gcs_server.make_bucket(url, 'chaos') + '/run'
        got = chaos_run.run(workdir, os.path.join(root, 'logs-run'), args.steps, data_dir,
                            faults, **guards, timeout_s=3600)
        counts = chaos_run.step_counts(workdir)
        exact = got['status'] == 0 and \
            chaos_run.params_differ(workdir, reference, args.steps) == []
        if args.bucket:
            from t2t.goodput import report

            report.print_summary(workdir)
    result = {
        'faults': len(got['applied']),
        'sigkills': sum(f['signal'] == 'SIGKILL' for f in got['applied']),
        'sigstops': sum(f['signal'] == 'SIGSTOP' for f in got['applied']),
        'during_startup': sum(f['startup_delay_s'] is not None for f in got['applied']),
        'restarts': got['attempts'] - 1, 'status': got['status'],
        'wall_s': round(got['wall_s'], 1), 'uninterrupted_wall_s': round(ref['wall_s'], 1),
        'steps': args.steps, 'steps_redone': got['steps_redone'],
        'each_step_once': counts == {s: 1 for s in range(1, args.steps + 1)},
        'params_bitwise_equal': exact, 'seed': args.seed, 'hang_timeout_s': args.hang_timeout_s,
        'storage': dict(front.counts) if front else 'local',
        'restart_causes': re.findall(r'^launch_local: restart \d+ of \d+ at \d+ s: (.*)$',
                                     got['launcher_err'], re.M),
    }
    print('RESULT ' + json.dumps(result), flush=True)
    ok = exact and result['each_step_once']
    if ok:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f'chaos: not exact; files kept in {root}\n{got["launcher_err"][-3000:]}',
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
