"""What a bucket outage costs a run: the same train.py run with and without one, goodput and all.

    python bench/bucket_outage.py [--steps=1500] [--outage_s=90] [--outage_at_s=20]
        [--log_every=10] [--checkpoint_every=500] [--small_queue_mb=0.05] [--data_dir=DIR]

Each run trains configs/tiny.py with its workdir in a bucket on the local Cloud Storage server
(tests/gcs_server.py) behind the fault-injecting front (tests/fault_front.py); in the second and
the third, every request is answered 503 for --outage_s seconds from --outage_at_s seconds after
the first step line. The third keeps only --small_queue_mb of writes (storage_queue_mb; 0: not
run): its queue fills during the outage and the loop waits for room (storage backpressure).
Per run: exit status, wall time, the goodput report's goodput and its largest badputs, storage
backpressure (the loop's waits for room in the write queue) and the run's own lines about it,
the background writes and the write queue's peak (the memory the queue held), and the steps
trained while the outage lasted (step lines timed as they arrive); the goodput table after each
run, one RESULT line of JSON per run at the end. A run shorter than --outage_at_s + --outage_s of
training ends inside the outage and waits for it at its last save (a checkpoint is not reported
saved before it is in storage).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t2t.goodput import report as goodput_report  # noqa: E402
from tests import fault_front, gcs_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--steps', type=int, default=1500)
    p.add_argument('--outage_s', type=float, default=90.0)
    p.add_argument('--outage_at_s', type=float, default=20.0)
    p.add_argument('--log_every', type=int, default=10)
    p.add_argument('--checkpoint_every', type=int, default=500)
    p.add_argument('--small_queue_mb', type=float, default=0.05,
                   help='the third run\'s storage_queue_mb (0: no third run)')
    p.add_argument('--data_dir', default=None, help='prepared data (default: a new temp dir)')
    return p.parse_args(argv)


def _run(args, url: str, bucket: str, data_dir: str, outage: bool,
         queue_mb: float | None = None) -> dict:
    front = fault_front.start(url, seed=0)
    workdir = gcs_server.make_bucket(url, bucket) + '/run'
    command = [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}',
               f'--config.num_train_steps={args.steps}', f'--config.data_dir={data_dir}',
               f'--config.log_every_steps={args.log_every}',
               f'--config.checkpoint_every_steps={args.checkpoint_every}',
               f'--config.eval_every_steps={args.steps}', '--config.eval_bleu_sentences=0',
               '--config.num_eval_batches=1',
               *([f'--config.storage_queue_mb={queue_mb:g}'] if queue_mb else [])]
    env = {**os.environ, **gcs_server.environment(front.url), 'PYTHONPATH': ROOT}
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    step_times, window, err = [], [None, None], []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    for line in proc.stdout:
        match = re.match(r'step (\d+) \|', line)
        if match:
            now = time.monotonic()
            step_times.append((now, int(match.group(1))))
            if outage and window[0] is None:
                threading.Timer(args.outage_at_s, _begin, (front, args.outage_s, window)).start()
                window[0] = 'scheduled'
        elif not line.startswith('step '):
            print(f'  {line.rstrip()}', flush=True)
    proc.wait()
    reader.join()
    wall = time.monotonic() - began
    front.stop()
    during = None
    if outage and isinstance(window[0], float):
        lo, hi = window[0], window[0] + args.outage_s
        at = [s for t, s in step_times if t <= lo]
        within = [s for t, s in step_times if lo < t <= hi]
        during = (max(within) - max(at or [0])) if within else 0
    r = goodput_report.report(workdir)
    if r is not None:
        print(goodput_report.format_report(r), flush=True)
    result = {'outage_s': args.outage_s if outage else 0, 'storage_queue_mb': queue_mb,
              'exit': proc.returncode,
              'wall_s': round(wall, 1), 'steps': args.steps,
              'steps_trained_during_outage': during,
              'goodput': r and round(r['goodput'], 4),
              'summary': r and goodput_report.summary_line(r),
              'backpressure_s': r and round(r['seconds']['storage_backpressure'], 3),
              'checkpoint_s': r and round(r['seconds']['checkpoint'], 2),
              'logging_s': r and round(r['seconds']['logging'], 3),
              'background_writes': r and r['background_writes'],
              'backpressure_lines': [line.strip() for line in err
                                     if line.startswith('storage: ')],
              'front': front.counts,
              'stderr_tail': ''.join(err[-6:]).strip()[-1500:]}
    return result


def _begin(front, seconds: float, window: list) -> None:
    front.outage(seconds)
    window[0] = time.monotonic()


def main(argv=None) -> None:
    args = _args(argv)
    data_dir = args.data_dir or tempfile.mkdtemp(prefix='t2t-bench-data-')
    results = []
    with gcs_server.serve() as url:
        runs = [(False, None), (True, None)] + ([(True, args.small_queue_mb)]
                                                 if args.small_queue_mb > 0 else [])
        for k, (outage, queue_mb) in enumerate(runs):
            print(f'run {"with a " + str(args.outage_s) + " s outage" if outage else "without"}'
                  + (f', storage_queue_mb={queue_mb:g}' if queue_mb else ''), flush=True)
            results.append(_run(args, url, f'bench-{k}', data_dir, outage, queue_mb))
    for r in results:
        print('RESULT ' + json.dumps(r), flush=True)


if __name__ == '__main__':
    main()
