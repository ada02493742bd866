"""Step time of the whole training loop (t2t/train/loop.py) at a config, as its own log reports it.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python bench/loop_speed.py --config=configs/default.py

Trains --steps steps of the config in a fresh temporary workdir (logging every --log_every steps,
no evaluation or checkpoint before the last step, no time budget) and prints one `RESULT {json}`
line: the median and each of the `step_time_s` values the loop logged, the first interval left
out (it holds the compile), the t2t package that ran, and the load average before and after.
`step_time_s` is the loop's own measure: seconds from the start of an interval to its log line,
over its steps (data, dispatch, the device and the metrics bookkeeping). To compare two versions
of t2t, point PYTHONPATH at each in turn and alternate the runs.

--profile_start=N traces steps N .. N + --profile_steps - 1 with jax.profiler
(config.profile_start_step) and reports, beside the median of every interval, the median of the
intervals that neither hold a traced step nor follow one (`outside_window_median_s`): the
profiler's cost to the steps it does not trace. Compare against runs without it, alternating.

--bookkeeping measures the loop's metrics bookkeeping alone instead: --steps iterations of a
stand-in step (a jitted function of a device counter returning a train step's metric scalars)
fed to the loop's interval (`Interval.add` every step, `log_train` every --log_every steps),
against the stand-in step alone; the RESULT line gives microseconds per step of both.
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


_METRIC_KEYS = ('loss_sum', 'nll_sum', 'correct_sum', 'tokens', 'source_tokens', 'nonfinite',
                'grad_norm', 'learning_rate')


def _bookkeeping(config, steps: int, log_every: int) -> dict:
    """Microseconds per step: the stand-in step alone, and with the loop's metrics bookkeeping."""
    import types

    import jax
    import jax.numpy as jnp

    from t2t import optim
    from t2t.infra import metrics
    from t2t.train.interval import Interval, log_train

    @jax.jit
    def step_fn(counter):
        values = {k: (counter * 0.25 + i).astype(jnp.float32) for i, k in enumerate(_METRIC_KEYS)}
        values['nonfinite'] = jnp.zeros((), jnp.float32)
        return counter + 1, values

    state = types.SimpleNamespace(opt_state=optim.make_optimizer(config).init({'w': jnp.zeros(2)}))
    writer = metrics.MetricWriter('unused', enabled=False)
    counter = jnp.zeros((), jnp.int32)
    counter, m = step_fn(counter)
    interval = Interval()
    interval.add(1, m)
    log_train(writer, interval, config, 1, state, 1.0, (1.0, 1.0), None, 1)  # compiles

    start = time.perf_counter()
    for _ in range(steps):
        counter, m = step_fn(counter)
    jax.block_until_ready(counter)
    alone = time.perf_counter() - start

    interval = Interval()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        counter, m = step_fn(counter)
        interval.add(i, m)
        if i % log_every == 0:
            log_train(writer, interval, config, i, state, 1.0, (1.0, 1.0), None, 1)
            interval = Interval()
    jax.block_until_ready(counter)
    booked = time.perf_counter() - start
    return {'step_alone_us': alone / steps * 1e6, 'step_with_bookkeeping_us': booked / steps * 1e6}


def _outside_window(logged: list[dict], args) -> dict:
    """The intervals (ending at each record's step) clear of the traced steps and of the interval
    after them (the trace's writing lands there)."""
    first, last = args.profile_start, args.profile_start + args.profile_steps - 1
    clear = [r['step_time_s'] for r in logged
             if r['step'] < first or r['step'] - args.log_every + 1 > last + args.log_every]
    if not clear:
        sys.exit('loop_speed.py: no interval lies clear of the profile window; add --steps')
    return {'profile_window': [first, last], 'outside_window_median_s': statistics.median(clear),
            'outside_window_intervals': len(clear)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/default.py')
    parser.add_argument('--steps', type=int, default=125)
    parser.add_argument('--log_every', type=int, default=25)
    parser.add_argument('--profile_start', type=int, default=0,
                        help='trace steps from this one (0: no profile)')
    parser.add_argument('--profile_steps', type=int, default=3)
    parser.add_argument('--bookkeeping', action='store_true',
                        help='time the metrics bookkeeping with a stand-in step (see above)')
    args = parser.parse_args()
    if args.steps < 2 * args.log_every:
        sys.exit('loop_speed.py: --steps must cover at least two --log_every intervals')

    import t2t
    from t2t.infra import metrics, platforms
    from t2t.train import loop

    platforms.skip_absent_tpu()
    config = _load_config(args.config)
    if args.bookkeeping:
        load_before = _loadavg()
        result = _bookkeeping(config, args.steps, args.log_every)
        print('RESULT ' + json.dumps({
            'bookkeeping': True, 'steps': args.steps, 'log_every': args.log_every, **result,
            't2t': os.path.dirname(t2t.__file__), 'loadavg_before': load_before,
            'loadavg_after': _loadavg()}), flush=True)
        return
    config.num_train_steps = args.steps
    config.log_every_steps = args.log_every
    config.eval_every_steps = config.checkpoint_every_steps = args.steps
    config.train_time_budget_s = 0.0
    config.num_eval_batches = 1
    config.profile_start_step = args.profile_start
    config.profile_num_steps = args.profile_steps
    load_before = _loadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='t2t-loop-speed-') as workdir:
        loop.train_and_evaluate(config, workdir)
        records = metrics.read_jsonl(workdir)
    wall = time.perf_counter() - start
    logged = [r for r in records if 'step_time_s' in r][1:]
    times = [r['step_time_s'] for r in logged]
    window = _outside_window(logged, args) if args.profile_start else {}
    print('RESULT ' + json.dumps({
        'config': args.config, 'steps': args.steps, 'log_every': args.log_every,
        'median_step_time_s': statistics.median(times), 'step_time_s': times, **window,
        'wall_s': round(wall, 1), 't2t': os.path.dirname(t2t.__file__),
        'loadavg_before': load_before, 'loadavg_after': _loadavg()}), flush=True)


if __name__ == '__main__':
    main()
