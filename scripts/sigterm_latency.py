"""Seconds from SIGTERM to exit of train.py: a preempted job must save and stop in time.

    python scripts/sigterm_latency.py --config=configs/default.py [--after_log=1] [--delay=0]
        [--eval_at_log] [--workdir=/tmp/t2t-sigterm]

train.py trains the config in a fresh workdir until its --after_log-th metric line (`step N |
loss ...`) plus --delay seconds, gets SIGTERM, and must save a checkpoint and exit 0. With
--eval_at_log, eval_every_steps is set to the config's log_every_steps, so the signal lands as an
evaluation starts, the slowest moment. Prints a JSON summary: the seconds, the exit status, the
last lines and the checkpoints left; exit 1 unless train.py exited 0 with a checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from launch_local import STEP_LINE  # scripts/ is on sys.path: train.py's training line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(config_path: str):
    """The config file's get_config(), loaded as train.py loads it (configs/ importable)."""
    sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_file_location('config', os.path.join(ROOT, config_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def measure(config_path: str, workdir: str, after_log: int, delay: float, eval_at_log: bool,
            env: dict) -> dict:
    """Seconds from SIGTERM to exit of train.py, and what it left behind."""
    sys.path.insert(0, ROOT)
    from t2t.run import checkpoint_read

    shutil.rmtree(workdir, ignore_errors=True)
    command = [sys.executable, 'train.py', f'--config={config_path}', f'--workdir={workdir}',
               '--config.train_time_budget_s=0', '--config.num_train_steps=1000000']
    if eval_at_log:
        command.append(f'--config.eval_every_steps={_config(config_path).log_every_steps}')
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    logs, lines = 0, []
    for line in proc.stdout:
        lines.append(line)
        if STEP_LINE.match(line.encode()):
            logs += 1
            if logs == after_log:
                break
    if logs < after_log:
        proc.wait()
        raise SystemExit(f'sigterm_latency.py: train.py exited with {proc.returncode} before '
                         f'metric line {after_log}:\n{"".join(lines[-20:])}')
    time.sleep(delay)
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    lines += proc.stdout.readlines()
    proc.wait()
    seconds = time.perf_counter() - signalled
    return {'config': config_path, 'seconds_from_sigterm_to_exit': round(seconds, 2),
            'returncode': proc.returncode, 'last_lines': [x.rstrip() for x in lines[-2:]],
            'checkpoints': checkpoint_read.finished_steps(workdir)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', required=True, help='a config file, e.g. configs/default.py')
    parser.add_argument('--after_log', type=int, default=1,
                        help='send SIGTERM after this many metric lines')
    parser.add_argument('--delay', type=float, default=0.0, help='seconds after that line')
    parser.add_argument('--eval_at_log', action='store_true',
                        help='evaluate at every log step: the signal lands as one starts')
    parser.add_argument('--workdir', default='/tmp/t2t-sigterm')
    args = parser.parse_args()
    env = {**os.environ, 'JAX_PLATFORMS': os.environ.get('JAX_PLATFORMS', 'cpu')}
    result = measure(args.config, args.workdir, args.after_log, args.delay, args.eval_at_log,
                     env)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result['returncode'] == 0 and result['checkpoints'] else 1)


if __name__ == '__main__':
    main()
