"""Step time of the whole training loop (t2t/loop.py) at a config, as its own log reports it.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python bench/loop_speed.py --config=configs/default.py

Trains --steps steps of the config in a fresh temporary workdir (logging every --log_every steps,
no evaluation or checkpoint before the last step, no time budget) and prints one `RESULT {json}`
line: the median and each of the `step_time_s` values the loop logged, the first interval left
out (it holds the compile), the t2t package that ran, and the load average before and after.
`step_time_s` is the loop's own measure: seconds from the start of an interval to its log line,
over its steps (data, dispatch, the device and the metrics bookkeeping). To compare two versions
of t2t, point PYTHONPATH at each in turn and alternate the runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time


def _load_config(path: str):
    spec = importlib.util.spec_from_file_location('bench_config', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _loadavg() -> list[float]:
    with open('/proc/loadavg') as f:
        return [float(x) for x in f.read().split()[:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/default.py')
    parser.add_argument('--steps', type=int, default=125)
    parser.add_argument('--log_every', type=int, default=25)
    args = parser.parse_args()
    if args.steps < 2 * args.log_every:
        sys.exit('loop_speed.py: --steps must cover at least two --log_every intervals')

    import t2t
    from t2t import loop, metrics, platforms

    platforms.skip_absent_tpu()
    config = _load_config(args.config)
    config.num_train_steps = args.steps
    config.log_every_steps = args.log_every
    config.eval_every_steps = config.checkpoint_every_steps = args.steps
    config.train_time_budget_s = 0.0
    config.num_eval_batches = 1
    load_before = _loadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='t2t-loop-speed-') as workdir:
        loop.train_and_evaluate(config, workdir)
        records = metrics.read_jsonl(workdir)
    wall = time.perf_counter() - start
    times = [r['step_time_s'] for r in records if 'step_time_s' in r][1:]
    print('RESULT ' + json.dumps({
        'config': args.config, 'steps': args.steps, 'log_every': args.log_every,
        'median_step_time_s': statistics.median(times), 'step_time_s': times,
        'wall_s': round(wall, 1), 't2t': os.path.dirname(t2t.__file__),
        'loadavg_before': load_before, 'loadavg_after': _loadavg()}), flush=True)


if __name__ == '__main__':
    main()
