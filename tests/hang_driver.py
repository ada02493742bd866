"""Several processes meet through t2t/infra/distributed.py and nothing else (no model, no compile),
for tests/test_hangs.py:

    python tests/hang_driver.py --coordinator_address=localhost:PORT --num_processes=2 \
        --process_id=I --startup_timeout_s=3 [--scenario=barriers|idle|end] \
        [--heartbeat_timeout_s=S] [--job_id=J]

Prints 'started' once jax.distributed is up, or how long it took to give up. --scenario=barriers
then runs, with progress lines every 0.5 s: a barrier that process 1 reaches 1.5 s late, an
agreement, a disagreement and a barrier that process 1 never reaches, printing one line per
outcome. --scenario=idle waits 120 s (a peer to be stopped or killed meanwhile); --scenario=end
exits normally, process 1 --end_after_s later than process 0.
"""

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from t2t.infra import distributed  # noqa: E402

_SCENARIO = flags.DEFINE_string('scenario', '', "'' (start only), 'barriers', 'idle' or 'end'.")
_END_AFTER = flags.DEFINE_float('end_after_s', 0.0, "--scenario=end: process 1's extra time.")


def _outcome(label, fn):
    start = time.monotonic()
    try:
        fn()
        print(f'{label}: ok after {time.monotonic() - start:.1f} s', flush=True)
    except distributed.SyncError as e:
        print(f'{label}: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}',
              flush=True)


def main(argv):
    del argv
    start = time.monotonic()
    try:
        distributed.initialize()
    except distributed.StartupError as e:
        print(f'gave up after {time.monotonic() - start:.2f} s', flush=True)
        sys.exit(f'hang_driver.py: {e}')
    import jax

    me = jax.process_index()
    print('started', flush=True)
    if _SCENARIO.value == 'idle':
        time.sleep(120)
    if _SCENARIO.value == 'end':
        time.sleep(_END_AFTER.value if me == 1 else 0.0)
        print(f'ending at {time.time():.2f}', flush=True)
    if _SCENARIO.value != 'barriers':
        return
    distributed.PROGRESS_EVERY_S = 0.5
    if me == 1:
        time.sleep(1.5)
    _outcome('late', lambda: distributed.wait_for('late', 'everyone', 20))
    _outcome('same', lambda: distributed.agree('digest', 'abc', 20))
    _outcome('differ', lambda: distributed.agree('digest', f'value-{me}', 20))
    if me == 0:
        _outcome('absent', lambda: distributed.wait_for(
            'absent', 'process 1 does something', 2, processes=[1]))
    _outcome('after', lambda: distributed.wait_for('after', 'everyone', 20))


if __name__ == '__main__':
    app.run(main)
