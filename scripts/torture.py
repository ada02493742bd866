"""Kill training at random moments, restart it each time, and check that it ends exact.

    python scripts/torture.py --kills=20 [--seed=0] [--workdir=/tmp/t2t-torture]

Trains configs/tiny.py on the embedded corpus (prepared first with `python -m t2t.data`) once
without interruption: the reference. Then trains it again in another workdir, SIGKILLs train.py
at a random moment, restarts it on the same workdir, and so on until --kills kills have landed;
a run that completes before then starts a new round in a fresh workdir. Every completed round is
compared with the reference: the final checkpoint's state bitwise (params, optimizer state, rng,
step), every metrics.jsonl value except timings at every step, every TensorBoard scalar, and no
step written twice in either.

With --aim_at_saves=P, a kill is, with probability P, aimed at a save instead: the script polls
the checkpoint directory and SIGKILLs as soon as a new orbax temporary directory appears (or at
the random moment if none does); if that directory outlives the kill, the kill landed mid-save.

Where a kill landed: just before it, the script sends SIGUSR1, on which train.py prints every
thread's stack (faulthandler). Before train.py has printed its last set-up line (`eval loss on
...`, printed once the data, the restored state and the step functions are ready, right before the
first step) the kill landed in startup (imports, data, restore); after it, the main thread's
innermost t2t frame gives mid-step (the first step's compile included), mid-eval or mid-save; an
orbax temporary directory left on disk also counts as mid-save (the asynchronous write was in
flight). Prints a JSON summary; exit 1 if any round differs.

The seconds from SIGTERM to exit are measured by scripts/sigterm_latency.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Checkpoints every 7 steps and logs every 5: most kills fall inside a log interval; evaluation
# (loss and 8 sentences of beam-search BLEU) every 20 steps.
OVERRIDES = dict(num_train_steps=120, log_every_steps=5, eval_every_steps=20,
                 checkpoint_every_steps=7, keep_checkpoints=3, num_eval_batches=4,
                 eval_bleu_sentences=8, train_time_budget_s=0.0)
TIMING = {'step_time_s', 'target_tokens_per_s', 'mfu_real_tokens', 'mfu_padded_slots'}
# The line train.py prints when its set-up is done, right before the training loop's first step.
SETUP_DONE = re.compile(r'^eval loss on ', re.M)


def _config():
    sys.path.insert(0, ROOT)
    from configs import tiny

    config = tiny.get_config()
    for key, value in OVERRIDES.items():
        setattr(config, key, value)
    return config


def _command(workdir):
    flags = [f'--config.{k}={v}' for k, v in OVERRIDES.items()]
    return [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}', *flags]


def _main_thread_frames(stderr: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the faulthandler dump's main thread, innermost first."""
    for block in re.split(r'\n(?=(?:Current thread|Thread) 0x)', stderr):
        if 'train.py", line' in block and '<module>' in block:
            return [(f, int(n), fn) for f, n, fn in
                    re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)]
    return []


def _phase(stderr: str, save_in_flight: bool, set_up: bool) -> str:
    """Where the main thread was: startup, mid-step, mid-eval or mid-save."""
    frames = _main_thread_frames(stderr)
    if not set_up:
        phase = 'startup (imports, data, restore)'
    elif not frames:
        return 'unknown (no stack dump read)'
    else:
        file, _, function = next(((f, n, fn) for f, n, fn in frames if '/t2t/' in f),
                                 ('', 0, ''))
        if file.endswith('checkpoint.py'):
            phase = 'mid-save'
        elif function in ('evaluate', 'evaluate_loss', 'run') or \
                file.endswith(('predict.py', 'translate.py', 'bleu.py', 'decode.py')):
            phase = 'mid-eval'
        else:
            phase = 'mid-step'
    if save_in_flight and phase != 'mid-save':
        phase += ' + async save in flight'
    return phase


def _records(workdir):
    values = {}
    with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
        for line in f:
            record = json.loads(line)
            for key, value in record.items():
                if key != 'step':
                    if (record['step'], key) in values:
                        raise AssertionError(f'{workdir}: step {record["step"]} {key} twice')
                    values[record['step'], key] = value
    return values


def _scalars(workdir):
    from t2t.infra import metrics

    events = metrics.read_events(workdir)
    twice = [k for k, n in collections.Counter((t, s) for t, s, _ in events).items() if n > 1]
    if twice:
        raise AssertionError(f'{workdir}: TensorBoard scalars written twice: {twice[:5]}')
    return {(t, s): v for t, s, v in events}


def _state(workdir, step):
    import jax

    from t2t import optim, sharding, train_lib
    from t2t.run import checkpoint

    config = _config()
    mesh = sharding.make_mesh(config.mesh_shape)
    abstract = train_lib.abstract_state(config, mesh, optim.make_optimizer(config))
    manager = checkpoint.make_manager(workdir, config)
    try:
        return jax.device_get(checkpoint.restore(manager, step, abstract))
    finally:
        checkpoint.close(manager)


def compare(workdir, reference) -> list[str]:
    """Differences between a finished workdir and the reference (empty: equal)."""
    import jax
    import numpy as np

    problems = []
    try:
        got, want = _state(workdir, OVERRIDES['num_train_steps']), \
            _state(reference, OVERRIDES['num_train_steps'])
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or x.tobytes() != y.tobytes():
                problems.append('final state differs')
                break
        for name, read, timing_index in (('metrics.jsonl', _records, 1),
                                         ('TensorBoard', _scalars, 0)):
            a, b = read(workdir), read(reference)
            if a.keys() != b.keys():
                problems.append(f'{name}: different steps/keys: {sorted(a.keys() ^ b.keys())[:5]}')
            diff = [k for k in a.keys() & b.keys() if k[timing_index] not in TIMING
                    and a[k] != b[k]]
            if diff:
                problems.append(f'{name}: {len(diff)} values differ, e.g. {sorted(diff)[:3]}')
    except AssertionError as e:
        problems.append(str(e))
    return problems


def _saves_in_flight(directory: str) -> set[str]:
    """Names of orbax temporary step directories (a save being written, or one a kill left)."""
    if not os.path.isdir(directory):
        return set()
    return {n for n in os.listdir(directory) if 'orbax-checkpoint-tmp' in n}


def _wait_for_a_save(proc, directory: str, deadline_s: float, stale: set[str]) -> None:
    """Returns when proc exits; raises TimeoutExpired once a new temporary step directory shows
    up in `directory` after the first deadline_s / 2 seconds, or at deadline_s."""
    start = time.perf_counter()
    while proc.poll() is None:
        elapsed = time.perf_counter() - start
        if elapsed > deadline_s or (elapsed > deadline_s / 2
                                    and _saves_in_flight(directory) - stale):
            raise subprocess.TimeoutExpired(proc.args, elapsed)
        time.sleep(0.005)


def _run_to_end(workdir, env) -> float:
    start = time.perf_counter()
    proc = subprocess.run(_command(workdir), cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f'torture.py: training failed in {workdir}:\n{proc.stderr[-3000:]}')
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--kills', type=int, default=20)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--workdir', default='/tmp/t2t-torture')
    parser.add_argument('--aim_at_saves', type=float, default=0.0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
    started = time.perf_counter()
    subprocess.run([sys.executable, '-m', 't2t.data', '--config=configs/tiny.py'], cwd=ROOT,
                   env=env, check=True, capture_output=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    reference = os.path.join(args.workdir, 'reference')
    duration = _run_to_end(reference, env)
    print(f'reference run: {duration:.1f} s', flush=True)

    landed, rounds, restarts, kills = collections.Counter(), [], 0, 0
    while kills < args.kills:
        workdir = os.path.join(args.workdir, f'round-{len(rounds)}')
        round_kills = 0
        while kills < args.kills:
            checkpoints = os.path.join(workdir, 'checkpoints')
            stale = _saves_in_flight(checkpoints)  # left by the last kill, removed at start
            stdout = tempfile.TemporaryFile('w+', encoding='utf-8')  # read at a kill
            proc = subprocess.Popen(_command(workdir), cwd=ROOT, env=env, text=True,
                                    stdout=stdout, stderr=subprocess.PIPE)
            restarts += 1
            delay = rng.uniform(0.0, duration * 0.6)
            aimed = rng.random() < args.aim_at_saves
            try:
                if aimed:
                    _wait_for_a_save(proc, checkpoints, delay, stale)
                else:
                    proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                if aimed:  # at once: a small save is written in milliseconds
                    proc.kill()
                    proc.communicate()
                    # orbax renames the temporary directory when the save completes
                    phase = ('mid-save (aimed)' if _saves_in_flight(checkpoints) - stale else
                             'aimed at a save, landed after it')
                else:
                    proc.send_signal(signal.SIGUSR1)  # the stack dump says where the kill lands
                    time.sleep(0.3)
                    tmp = _saves_in_flight(checkpoints) - stale
                    proc.kill()
                    _, stderr = proc.communicate()
                    stdout.seek(0)
                    phase = ('startup (imports, before the stack dump handler)'
                             if proc.returncode == -signal.SIGUSR1 else
                             _phase(stderr, bool(tmp), bool(SETUP_DONE.search(stdout.read()))))
                stdout.close()
                landed[phase] += 1
                kills += 1
                round_kills += 1
                print(f'kill {kills}{" aimed at a save" if aimed else f" after {delay:.1f} s"}: '
                      f'{phase}', flush=True)
                continue
            stdout.close()
            stderr = proc.stderr.read()
            if proc.returncode:
                raise SystemExit(f'torture.py: training failed in {workdir}:\n{stderr[-3000:]}')
            break  # finished before the next kill: this round is complete
        else:
            _run_to_end(workdir, env)
        problems = compare(workdir, reference)
        rounds.append({'workdir': workdir, 'kills': round_kills, 'equal': not problems,
                       'problems': problems})
        print(f'round {len(rounds)}: {round_kills} kills, '
              f'{"equal" if not problems else problems}', flush=True)

    summary = {'kills': kills, 'restarts': restarts, 'landed': dict(landed), 'rounds': rounds,
               'all_equal': all(r['equal'] for r in rounds),
               'seconds': round(time.perf_counter() - started, 1)}
    print(json.dumps(summary, indent=2))
    sys.exit(0 if summary['all_equal'] else 1)


if __name__ == '__main__':
    main()
