"""The chaos run: scripts/launch_local.py trains tiny on N processes while seeded faults hit them.

A fault is a SIGKILL or a SIGSTOP (a hang) of a random process of the attempt that is running, at
a random moment: during start-up (a random delay after the attempt began) or during training (after
a random number of new step lines, plus a random fraction of a second, so it lands in a step, a
save or the start of one). After each fault the next fault waits for the launcher's next attempt.
`run` returns what happened; tests/test_chaos.py (short) and bench/chaos.py (long) compare the
result with an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, 'scripts', 'launch_local.py')
sys.path.insert(0, os.path.dirname(LAUNCHER))
from launch_local import STEP_LINE  # noqa: E402  the training line the launcher's guard reads

RESUME_LINE = re.compile(rb'^resuming from checkpoint (\d+) ', re.M)


def train_flags(steps: int, data_dir: str) -> list[str]:
    """configs/tiny.py shortened: a line and a metrics record every step, frequent checkpoints,
    one small evaluation at the end."""
    return [f'--config.num_train_steps={steps}', '--config.log_every_steps=1',
            '--config.checkpoint_every_steps=3', '--config.keep_checkpoints=2',
            f'--config.eval_every_steps={steps}', '--config.eval_bleu_sentences=0',
            '--config.num_eval_batches=1', f'--config.data_dir={data_dir}']


def _read(path: str) -> bytes:
    try:
        with open(path, 'rb') as f:
            return f.read()
    except OSError:
        return b''


def _attempt_pids(logs: str, k: int) -> list[int] | None:
    try:
        with open(os.path.join(logs, f'attempt-{k}.json')) as f:
            return json.load(f)['pids']
    except (OSError, ValueError):
        return None


def plan(seed: int, kills: int, stops: int) -> list[dict]:
    """The faults in order: which signal, at which moment, to which process."""
    rng = random.Random(seed)
    kinds = ['SIGKILL'] * kills + ['SIGSTOP'] * stops
    rng.shuffle(kinds)
    faults = []
    for kind in kinds:
        during_startup = rng.random() < 0.25
        faults.append({'signal': kind, 'process': rng.randrange(2),
                       'startup_delay_s': rng.uniform(0.5, 6.0) if during_startup else None,
                       'after_steps': rng.randint(1, 4), 'extra_s': rng.uniform(0.0, 0.5)})
    return faults


def _wait(predicate, launcher, deadline) -> bool:
    """Polls until predicate() is true; False when the launcher ended or time ran out."""
    while not predicate():
        if launcher.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _apply(fault: dict, k: int, logs: str, processes: int, launcher, deadline) -> dict | None:
    """Waits for attempt k and the fault's moment, sends its signal; None when there is none."""
    if not _wait(lambda: _attempt_pids(logs, k), launcher, deadline):
        return None
    begun = time.monotonic()
    log0 = os.path.join(logs, f'attempt-{k}-process-0.out')
    if fault['startup_delay_s'] is not None:
        waited = _wait(lambda: time.monotonic() - begun > fault['startup_delay_s'], launcher,
                       deadline)
    else:
        waited = _wait(lambda: len(STEP_LINE.findall(_read(log0))) >= fault['after_steps'],
                       launcher, deadline)
        time.sleep(fault['extra_s'])
    if not waited or _attempt_pids(logs, k + 1) is not None:
        return None
    steps_seen = STEP_LINE.findall(_read(log0))
    try:
        os.kill(_attempt_pids(logs, k)[fault['process'] % processes],
                getattr(signal, fault['signal']))
    except ProcessLookupError:
        return None
    return {**fault, 'attempt': k, 'last_step': int(steps_seen[-1]) if steps_seen else None}


@contextlib.contextmanager
def launch(workdir: str, logs: str, steps: int, data_dir: str, *extra: str, processes: int = 2,
           devices: int = 4, max_restarts: int = 0, hang_timeout_s: float = 45.0,
           startup_hang_timeout_s: float | None = None, env: dict | None = None):
    """The launcher training tiny (train_flags, then `extra` flags for train.py) on `processes`
    processes, started: its Popen, its stdout and stderr in LOGS/launcher.out and .err (the
    processes' in LOGS/attempt-K-process-I.*). Left running when the block ends: killed."""
    os.makedirs(logs, exist_ok=True)
    argv = [sys.executable, LAUNCHER, f'--processes={processes}',
            f'--devices_per_process={devices}', f'--max_restarts={max_restarts}',
            f'--hang_timeout_s={hang_timeout_s}',
            *([f'--startup_hang_timeout_s={startup_hang_timeout_s}']
              if startup_hang_timeout_s is not None else []), '--config=configs/tiny.py',
            f'--workdir={workdir}', f'--logs={logs}', '--', *train_flags(steps, data_dir),
            *extra]
    with open(os.path.join(logs, 'launcher.out'), 'wb') as out, \
            open(os.path.join(logs, 'launcher.err'), 'wb') as err:
        launcher = subprocess.Popen(argv, cwd=ROOT, env=env or os.environ, stdout=out,
                                    stderr=err)
        try:
            yield launcher
        finally:
            if launcher.poll() is None:
                launcher.kill()  # its processes die with it (the launcher sets PDEATHSIG)
                launcher.wait()


def run(workdir: str, logs: str, steps: int, data_dir: str, faults: list[dict], *,
        processes: int = 2, devices: int = 4, hang_timeout_s: float = 45.0,
        startup_hang_timeout_s: float | None = None, max_restarts: int | None = None,
        env: dict | None = None, timeout_s: float = 900.0):
    """Runs the launcher with `faults` applied; returns a dict of what happened."""
    start = time.monotonic()
    deadline = start + timeout_s
    with launch(workdir, logs, steps, data_dir, processes=processes, devices=devices,
                max_restarts=len(faults) + 2 if max_restarts is None else max_restarts,
                hang_timeout_s=hang_timeout_s, startup_hang_timeout_s=startup_hang_timeout_s,
                env=env) as launcher:
        applied = []
        for k, fault in enumerate(faults):
            done = _apply(fault, k, logs, processes, launcher, deadline)
            if done is None:
                break  # the launcher ended, or the attempt ended by itself
            applied.append({**done, 'at_s': round(time.monotonic() - start, 1)})
        status = launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    wall_s = time.monotonic() - start
    attempts = 0
    while _attempt_pids(logs, attempts) is not None:
        attempts += 1
    return {'status': status, 'wall_s': wall_s, 'applied': applied, 'attempts': attempts,
            'steps_redone': steps_redone(logs, attempts),
            'launcher_err': _read(os.path.join(logs, 'launcher.err')).decode(errors='replace'),
            'launcher_out': _read(os.path.join(logs, 'launcher.out')).decode(errors='replace')}


def attempt_steps(logs: str, attempts: int) -> list[tuple[int | None, int | None]]:
    """(the checkpoint attempt k resumed from (0: none), its last step line) for each attempt,
    from process 0's stdout; None where the attempt printed neither."""
    out = []
    for k in range(attempts):
        text = _read(os.path.join(logs, f'attempt-{k}-process-0.out'))
        resumed, logged = RESUME_LINE.findall(text), STEP_LINE.findall(text)
        began = int(resumed[0]) if resumed else (0 if logged else None)
        out.append((began, int(logged[-1]) if logged else None))
    return out


def steps_redone(logs: str, attempts: int) -> int:
    """Steps trained again after a restart: an attempt's last logged step minus the checkpoint the
    next one resumed from."""
    redone, last = 0, 0
    for k, (resumed, logged) in enumerate(attempt_steps(logs, attempts)):
        if k:
            redone += max(0, last - (resumed or 0))
        last = logged if logged is not None else (resumed if resumed is not None else last)
    return redone


def trained_twice(ranges: list[tuple[int, int]]) -> int:
    """Steps trained by an attempt and again by a later one; ranges: each attempt's (resumed
    from, last step trained], in order."""
    twice = 0
    for k, (lo, hi) in enumerate(ranges):
        later = set().union(*(range(a + 1, b + 1) for a, b in ranges[k + 1:]))
        twice += len(set(range(lo + 1, hi + 1)) & later)
    return twice


def step_counts(workdir: str) -> dict[int, int]:
    """{step: how many training records metrics.jsonl holds for it} (raw lines, not merged)."""
    from t2t.infra import metrics
    from t2t.infra import workdir as wd

    counts = {}
    for line in (wd.read_text(wd.path(workdir, metrics.JSONL_NAME)) or '').splitlines():
        record = json.loads(line)
        if 'loss' in record:
            counts[record['step']] = counts.get(record['step'], 0) + 1
    return counts


def params_differ(workdir_a: str, workdir_b: str, step: int) -> list[str]:
    """The parameter leaves of checkpoint `step` that are not bitwise equal in the two workdirs."""
    import jax
    import numpy as np

    from t2t.run import checkpoint_read

    a, b = (checkpoint_read.restore_params(w, step) for w in (workdir_a, workdir_b))
    differ = []
    for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(a)[0],
                                 jax.tree_util.tree_flatten_with_path(b)[0], strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or \
                x.view(f'u{x.itemsize}').tobytes() != y.view(f'u{y.itemsize}').tobytes():
            differ.append(jax.tree_util.keystr(path))
    return differ
