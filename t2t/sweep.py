"""Sweeps: a config's `get_sweep()` points, each trained by train.py in its own directory.

    python sweep.py --config=configs/table3_mini.py --workdir=runs/table3 [--config.key=value ...]
    python sweep.py --config=... --workdir=... --dry_run        # the points and their commands
    python sweep.py --summarize=runs/table3                    # table and plot from disk alone

A config file may define `get_sweep()` returning a list of override dicts, {'num_heads': 1,
'scale_attention': False}, built by hand or with `product` / `zip` below. `--config.key=value`
flags of sweep.py apply to every point (a point's own value wins).

Each point runs `train.py` as a subprocess (a crash of one point cannot take the sweep down) in
WORKDIR/<name>, named from its overrides (`num_heads=1,scale_attention=False`, `default` for no
override; a short hash is added when a name needs characters unsafe in file names, or is long),
with its stdout/stderr in stdout.log / stderr.log there. Its state is a small JSON file written
atomically, `sweep_point.json`: status pending / running / done / failed, return code, error line,
the point's full config. Running the sweep again skips points done with the same config,
resumes unfinished ones (train.py resumes from the latest checkpoint; the time budget is total
because checkpoints store the training seconds spent), retries failed ones only with
--retry_failed, and trains further a done point whose config changed (e.g. a raised budget).
Points whose configs come out identical (an override equal to the config's value) run once.

Every trained point is evaluated with evaluate.py's logic (t2t.evaluation.run: sacreBLEU and chrF
on --split, optionally the average of the last N checkpoints); then WORKDIR/summary.md,
summary.csv (one row per point) and curves.png (validation perplexity against step and against
training seconds, every point, one legend) are rewritten, after each point and at the end.

SIGINT or SIGTERM stops the sweep cleanly: the running train.py gets SIGTERM (it saves a
checkpoint and exits), its point is left pending, the summary is written. If the sweep process
dies abruptly, its train.py gets SIGTERM too (on Linux, a parent-death signal).
"""

from __future__ import annotations

import builtins
import copy
import csv
import dataclasses
import datetime
import fcntl
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, 'train.py')
STATE_NAME = 'sweep_point.json'
SWEEP_NAME = 'sweep.json'
MAX_NAME = 100  # characters of a point directory name before it is shortened with a hash
_SAFE = re.compile(r'[^A-Za-z0-9._,=+-]')
_FINISHED = re.compile(r'^finished at step (\d+) \((\w+)\)', re.M)  # train.py's last line
STATUSES = ('pending', 'running', 'done', 'failed')


class SweepError(Exception):
    """A problem with the sweep's definition or directory, stated in one line."""


# ----------------------------------------------------------------------------------------------
# Building points


def product(**axes: Sequence) -> list[dict]:
    """Every combination: product(a=[1, 2], b=[True, False]) -> 4 points, the first key slowest."""
    keys = list(axes)
    return [dict(builtins.zip(keys, values, strict=True))
            for values in itertools.product(*axes.values())]


def zip(**axes: Sequence) -> list[dict]:  # shadows the builtin here, on purpose
    """Values side by side: zip(a=[1, 2], b=[3, 4]) -> [{'a': 1, 'b': 3}, {'a': 2, 'b': 4}]."""
    lengths = {k: len(v) for k, v in axes.items()}
    if len(set(lengths.values())) > 1:
        raise SweepError(f'zip needs equally long value lists, got lengths {lengths}')
    keys = list(axes)
    return [dict(builtins.zip(keys, values, strict=True))
            for values in builtins.zip(*axes.values(), strict=True)]


def format_value(value) -> str:
    """A value as `--config.key=VALUE` takes it (and as point names show it)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return '(' + ', '.join(format_value(v) for v in value) + (',)' if len(value) == 1 else ')')
    return str(value)


def point_name(overrides: dict) -> str:
    """Readable, stable (sorted keys), unique and safe as a directory name."""
    if not overrides:
        return 'default'
    name = ','.join(f'{k}={format_value(overrides[k])}' for k in sorted(overrides))
    safe = _SAFE.sub('_', name)
    if safe != name or len(safe) > MAX_NAME or safe.startswith('.'):
        digest = hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str)
                                .encode()).hexdigest()[:8]
        safe = safe[:MAX_NAME].lstrip('.') + '-' + digest
    return safe


def apply_overrides(config, overrides: dict, what: str):
    """A copy of `config` with `overrides` (dotted keys) set; unknown keys and bad types raise."""
    config = copy.deepcopy(config)  # keeps FieldReferences: derived fields follow their source
    for key, value in overrides.items():
        *parents, leaf = key.split('.')
        node = config
        for part in parents:
            node = node.get(part) if hasattr(node, 'get') else None
        if node is None or not hasattr(node, 'keys') or leaf not in node:
            raise SweepError(f'{what}: unknown config key {key!r}')
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise SweepError(f'{what}: {key}={value!r}: {str(e).splitlines()[0]}') from e
    return config


def config_json(config) -> str:
    return config.to_json_best_effort(sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    overrides: dict  # the point's own overrides, as get_sweep gave them
    config: object  # the effective ConfigDict: the file's config + base overrides + the point's
    same_as: tuple[str, ...] = ()  # names of later points with an identical config (run once)


def make_points(config, sweep: list[dict], base_overrides: dict | None = None) -> list[Point]:
    """The sweep's points with their configs; checked before anything runs."""
    if not isinstance(sweep, list) or not sweep:
        raise SweepError('get_sweep() must return a non-empty list of override dicts')
    base = apply_overrides(config, base_overrides or {}, 'sweep flags')
    points, by_config = [], {}
    for i, overrides in enumerate(sweep):
        if not isinstance(overrides, dict):
            raise SweepError(f'get_sweep() point {i} is {type(overrides).__name__}, not a dict')
        name = point_name(overrides)
        point_config = apply_overrides(base, overrides, f'point {i} ({name})')
        key = config_json(point_config)
        if key in by_config:  # identical run: keep the first name, remember the others
            first = by_config[key]
            points[first] = dataclasses.replace(points[first],
                                                same_as=points[first].same_as + (name,))
            continue
        by_config[key] = len(points)
        points.append(Point(name, dict(overrides), point_config))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f'two different points share a name: {sorted(names)}')
    return points


def load_sweep(config_path: str) -> list[dict]:
    """`get_sweep()` of a config file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location('_t2t_sweep_config', config_path)
    module = importlib.util.module_from_spec(spec)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # config files import `configs.common`
    spec.loader.exec_module(module)
    if not hasattr(module, 'get_sweep'):
        raise SweepError(f'{config_path} defines no get_sweep()')
    return module.get_sweep()


# ----------------------------------------------------------------------------------------------
# Commands


def _local(train_args: list[str]) -> list[str]:
    return [os.path.relpath(sys.executable), os.path.relpath(TRAIN_PY), *train_args]


# A launcher turns train.py's arguments into the command that runs them. Cluster launchers (a TPU
# pod slice, SLURM) register here: they run the same train.py arguments on their machines.
LAUNCHERS: dict[str, Callable[[list[str]], list[str]]] = {'local': _local}


def train_args(config_path: str, workdir: str, overrides: dict) -> list[str]:
    return [f'--config={config_path}', f'--workdir={workdir}',
            *(f'--config.{k}={format_value(v)}' for k, v in overrides.items())]


def point_command(config_path: str, sweep_dir: str, point: Point, base_overrides: dict,
                  launcher: str = 'local') -> list[str]:
    if launcher not in LAUNCHERS:
        raise SweepError(f'--launcher={launcher!r}: one of {sorted(LAUNCHERS)}')
    overrides = {**base_overrides, **point.overrides}  # the point's own value wins
    return LAUNCHERS[launcher](train_args(config_path, os.path.join(sweep_dir, point.name),
                                          overrides))


# ----------------------------------------------------------------------------------------------
# State on disk


def write_atomic(path: str, data: bytes | str) -> None:
    """A reader never sees half a file: write a temporary file beside it, then rename."""
    directory = os.path.dirname(os.path.abspath(path))
    mode = 'wb' if isinstance(data, bytes) else 'w'
    with tempfile.NamedTemporaryFile(mode, dir=directory, delete=False, suffix='.tmp') as f:
        f.write(data)
    os.replace(f.name, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise SweepError(f'{path} is not valid JSON ({e}); delete it to start the point over') \
            from e


def read_state(point_dir: str) -> dict:
    return read_json(os.path.join(point_dir, STATE_NAME)) or {'status': 'pending'}


def write_state(point_dir: str, state: dict) -> None:
    write_atomic(os.path.join(point_dir, STATE_NAME), json.dumps(state, indent=1) + '\n')


def _process_alive(pid: int, command: list[str]) -> bool:
    """Whether `pid` still runs `command` (an earlier sweep's train.py finishing its save)."""
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            args = f.read().decode(errors='replace').split('\0')
    except OSError:
        return False
    workdir = next((a for a in command if a.startswith('--workdir=')), None)
    return workdir in args and any(a.endswith('train.py') for a in args)


# ----------------------------------------------------------------------------------------------
# Running


# Runs as `python -c _ORPHAN_GUARD SWEEP_PID COMMAND...`: asks Linux to send the command SIGTERM
# when the sweep process dies (PR_SET_PDEATHSIG survives exec), then becomes the command. Done in
# the child rather than with Popen(preexec_fn=...), which is unsafe in a process running threads.
_ORPHAN_GUARD = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit('sweep: the sweep process is gone')
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _spawn_command(command: list[str]) -> list[str]:
    if not sys.platform.startswith('linux'):
        return command  # elsewhere an orphaned train.py runs on to its own end
    return [sys.executable, '-c', _ORPHAN_GUARD, str(os.getpid()), *command]


class _Stop:
    """SIGINT / SIGTERM: remember, forward SIGTERM to the running train.py, stop after it."""

    def __init__(self):
        self.signum = None
        self.child = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        again = self.signum is not None
        self.signum = signum
        if self.child is not None and self.child.poll() is None:
            # First signal: SIGTERM (train.py saves a checkpoint); a second one: SIGKILL.
            self.child.send_signal(signal.SIGKILL if again else signal.SIGTERM)
        print(f'\nsweep: {signal.Signals(signum).name}: stopping after the running point'
              + (' (killed)' if again else ' (asked train.py to save and exit)'), flush=True)


def _error_line(stderr_tail: str, returncode: int) -> str:
    if returncode < 0:
        return f'killed by signal {signal.Signals(-returncode).name}'
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    return lines[-1][:500] if lines else f'exit code {returncode}'


def _tail(path: str, offset: int) -> str:
    with open(path, 'rb') as f:
        f.seek(offset)
        return f.read().decode('utf-8', errors='replace')


def train_point(command: list[str], point_dir: str, state: dict, stop: _Stop) -> dict:
    """Runs train.py for one point; returns its new state (already written)."""
    out_path, err_path = (os.path.join(point_dir, n) for n in ('stdout.log', 'stderr.log'))
    offsets = [os.path.getsize(p) if os.path.exists(p) else 0 for p in (out_path, err_path)]
    state = {**state, 'status': 'running', 'command': command, 'error': '', 'returncode': None,
             'attempts': state.get('attempts', 0) + 1, 'started_at': time.time()}
    start = time.perf_counter()
    with open(out_path, 'ab') as out, open(err_path, 'ab') as err:
        header = (f'=== sweep attempt {state["attempts"]} {datetime.datetime.now().isoformat()}:'
                  f' {shlex.join(command)}\n').encode()
        out.write(header)
        err.write(header)
        out.flush()
        err.flush()
        # Its own session: a Ctrl-C in the terminal reaches the sweep, which forwards SIGTERM.
        child = subprocess.Popen(_spawn_command(command), stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        state['pid'] = child.pid
        write_state(point_dir, state)
        stop.child = child
        if stop.signum is not None:  # the signal came while it was starting
            child.send_signal(signal.SIGTERM)
        try:
            returncode = child.wait()
        finally:
            stop.child = None
    stdout, stderr = _tail(out_path, offsets[0]), _tail(err_path, offsets[1])
    finished = _FINISHED.findall(stdout)
    step, stopped_by = (int(finished[-1][0]), finished[-1][1]) if finished else (None, '')
    state.update(returncode=returncode, pid=None, seconds=round(time.perf_counter() - start, 1),
                 finished_at=time.time(), step=step, stopped_by=stopped_by)
    if returncode == 0 and stopped_by != 'preemption' and stop.signum is None:
        state['status'] = 'done'
    elif returncode == 0 or stop.signum is not None:
        state.update(status='pending', error='interrupted: resumes at the next run')
    else:
        state.update(status='failed', error=_error_line(stderr, returncode))
    write_state(point_dir, state)
    return state


def evaluate_point(config, point_dir: str, split: str, average_last: int) -> dict:
    """{'label', 'split', 'sacrebleu', 'chrf', ...} or {'error': ...}: evaluate.py's logic."""
    from t2t import checkpoint, evaluation

    lines = []
    try:
        label = evaluation.select(point_dir, average_last=average_last)[0][0]
        results = evaluation.run(config, point_dir, average_last=average_last, split=split,
                                 progress=False, echo=lines.append)
    except (evaluation.EvalError, checkpoint.CheckpointError) as e:
        return {'error': f'evaluation: {str(e).splitlines()[0][:400]}', 'split': split}
    except Exception as e:  # e.g. out of memory: recorded, and the sweep goes on
        first = (str(e).splitlines() or [''])[0][:400]
        return {'error': f'evaluation: {type(e).__name__}: {first}', 'split': split}
    record = results[label]
    with open(os.path.join(point_dir, 'evaluate.log'), 'a', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')
    keep = ('sacrebleu', 'chrf', 'tok_bleu_compound_split', 'sentences', 'skipped_too_long',
            'hit_length_limit', 'capped_at_max_decode_len', 'beam_size', 'sacrebleu_signature')
    return {'label': label, 'split': split or config.test_split,
            **{k: record[k] for k in keep if k in record}}


def count_params(config) -> int:
    from t2t import summary
    from t2t.model import TransformerConfig

    return summary.count_params(summary.abstract_params(TransformerConfig.from_config(config)))


def _lock(workdir: str):
    handle = open(os.path.join(workdir, '.sweep.lock'), 'w')
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        handle.close()
        raise SweepError(f'another sweep is running in {workdir}') from e
    return handle


def _wait_for_old_child(point_dir: str, state: dict, echo) -> None:
    pid = state.get('pid')
    if state.get('status') != 'running' or not pid:
        return
    deadline, said = time.monotonic() + 300, False
    while _process_alive(pid, state.get('command') or []):
        if time.monotonic() > deadline:
            raise SweepError(f'{point_dir}: train.py (pid {pid}) of an earlier sweep is still '
                             'running; stop it first')
        if not said:
            echo(f'  waiting for pid {pid} (train.py of an earlier sweep) to finish its save')
            said = True
        time.sleep(0.5)


def run(config_path: str, config, workdir: str, *, base_overrides: dict | None = None,
        split: str = '', average_last: int = 0, retry_failed: bool = False,
        dry_run: bool = False, launcher: str = 'local', only: Sequence[str] = (),
        sweep: list[dict] | None = None, echo: Callable[[str], None] = print) -> int:
    """Runs (or, dry_run, prints) the sweep; returns an exit code (0: every point done).

    only: names of the points to run now (the summary still lists every point).
    """
    base_overrides = dict(base_overrides or {})
    points = make_points(config, load_sweep(config_path) if sweep is None else sweep,
                         base_overrides)
    commands = {p.name: point_command(config_path, workdir, p, base_overrides, launcher)
                for p in points}
    unknown = set(only) - set(commands)
    if unknown:
        raise SweepError(f'no point named {", ".join(sorted(unknown))}; the points: '
                         f'{", ".join(commands)}')
    selected = [(i, p) for i, p in enumerate(points, 1) if not only or p.name in only]
    total = len(points)
    if dry_run:
        for i, p in selected:
            same = f'  (also stands for: {", ".join(p.same_as)})' if p.same_as else ''
            echo(f'[{i}/{total}] {p.name}: {count_params(p.config)} parameters{same}')
            echo('  ' + shlex.join(commands[p.name]))
        return 0

    os.makedirs(workdir, exist_ok=True)
    lock = _lock(workdir)
    try:
        write_atomic(os.path.join(workdir, SWEEP_NAME), json.dumps({
            'config': config_path, 'base_overrides': base_overrides, 'split': split,
            'average_last': average_last, 'launcher': launcher,
            'points': [p.name for p in points], 'argv': sys.argv,
            'updated_at': time.time()}, indent=1, default=str) + '\n')
        with _Stop() as stop:
            for i, p in selected:
                if stop.signum is not None:
                    break
                _run_point(p, i, total, commands[p.name], workdir, split, average_last,
                           retry_failed, stop, echo)
                write_summary(workdir)
            stopped = stop.signum
        rows = write_summary(workdir)
    finally:
        lock.close()
    echo(f'summary -> {os.path.join(workdir, "summary.md")}, summary.csv, curves.png')
    if stopped is not None:
        return 128 + stopped
    ran = {p.name for _, p in selected}
    return 0 if all(r['status'] == 'done' and not r['error'] for r in rows
                    if r['point'] in ran) else 1


def _run_point(p: Point, i: int, total: int, command, workdir, split, average_last,
               retry_failed, stop, echo) -> None:
    point_dir = os.path.join(workdir, p.name)
    os.makedirs(point_dir, exist_ok=True)
    state = read_state(point_dir)
    current = config_json(p.config)
    tag = f'[{i}/{total}] {p.name}'
    if 'params' not in state or state.get('config') != current:
        state['params'] = count_params(p.config)
    status = state.get('status', 'pending')
    changed = state.get('config') not in (None, current)
    state.update(name=p.name, overrides=p.overrides, same_as=list(p.same_as), config=current)

    if status == 'failed' and not retry_failed:
        echo(f'{tag}: failed earlier ({state.get("error")}); --retry_failed runs it again')
        write_state(point_dir, state)
        return
    if status == 'done' and not changed:
        echo(f'{tag}: done (step {state.get("step")}), skipped')
    else:
        if status == 'running':
            _wait_for_old_child(point_dir, state, echo)
        what = {'pending': 'training', 'running': 'resuming (unfinished)',
                'failed': 'retrying', 'done': 'config changed: training on'}[status]
        echo(f'{tag}: {what} -> {point_dir}/stdout.log')
        state = train_point(command, point_dir, state, stop)
        echo(f'{tag}: {state["status"]} after {state["seconds"]:.0f} s'
             + (f' ({state["error"]})' if state['error'] else f' ({state["stopped_by"]})'))
        if state['status'] != 'done':
            return
    label = _eval_label(point_dir, average_last)
    previous = state.get('eval') or {}
    if previous.get('label') == label and previous.get('split') == (split or
                                                                   p.config.test_split):
        return
    echo(f'{tag}: evaluating {label} on {split or p.config.test_split}')
    state['eval'] = evaluate_point(p.config, point_dir, split, average_last)
    write_state(point_dir, state)
    result = state['eval']
    echo(f'{tag}: ' + (result['error'] if 'error' in result else
                       f'sacreBLEU {result["sacrebleu"]:.2f} chrF {result["chrf"]:.2f}'))


def _eval_label(point_dir: str, average_last: int) -> str | None:
    from t2t import evaluation

    try:
        return evaluation.select(point_dir, average_last=average_last)[0][0]
    except evaluation.EvalError:
        return None


# ----------------------------------------------------------------------------------------------
# Summary


def _curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds, validation perplexity) of each evaluation.

    Training seconds: the sum of logged step times up to that step (compiles included,
    evaluation and checkpointing excluded), so points compare by the time spent training.
    """
    points, seconds, last_step = [], 0.0, 0
    for r in records:
        if r.get('step_time_s') is not None:
            seconds += r['step_time_s'] * (r['step'] - last_step)
            last_step = r['step']
        if r.get('eval_perplexity') is not None:
            points.append((r['step'], seconds, r['eval_perplexity']))
    return points


def point_row(workdir: str, name: str) -> dict:
    """One summary row, from the point directory alone."""
    from t2t import checkpoint, metrics

    point_dir = os.path.join(workdir, name)
    state = read_state(point_dir)
    row = {'point': name, 'status': state.get('status', 'pending'),
           'overrides': state.get('overrides', {}), 'params': state.get('params'),
           'steps': None, 'train_seconds': None, 'best_val_perplexity': None,
           'best_val_step': None, 'final_val_perplexity': None, 'eval_label': '', 'split': '',
           'sacrebleu': None, 'chrf': None, 'error': state.get('error', ''), 'curve': []}
    jsonl = os.path.join(point_dir, metrics.JSONL_NAME)
    if os.path.exists(jsonl):
        row['curve'] = _curve(metrics.read_jsonl(jsonl))
    if row['curve']:
        best = min(row['curve'], key=lambda c: c[2])
        row.update(best_val_perplexity=best[2], best_val_step=best[0],
                   final_val_perplexity=row['curve'][-1][2])
    if os.path.isdir(os.path.join(point_dir, 'checkpoints')):
        try:
            meta = checkpoint.read_metadata(point_dir)
            row.update(steps=meta.get('step'), train_seconds=meta.get('train_seconds'))
        except checkpoint.CheckpointError as e:
            row['error'] = row['error'] or str(e)
    result = state.get('eval') or {}
    if 'error' in result:
        row['error'] = '; '.join(x for x in (row['error'], result['error']) if x)
    else:
        row.update(eval_label=result.get('label', ''), split=result.get('split', ''),
                   sacrebleu=result.get('sacrebleu'), chrf=result.get('chrf'))
    return row


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ''
    return f'{value:.{digits}f}' if isinstance(value, float) else str(value)


CSV_COLUMNS = ('point', 'status', 'params', 'steps', 'train_seconds', 'best_val_perplexity',
               'best_val_step', 'final_val_perplexity', 'split', 'eval_label', 'sacrebleu',
               'chrf', 'overrides', 'error')


def _csv(rows: list[dict], keys: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator='\n')
    writer.writerow([*CSV_COLUMNS, *keys])
    for r in rows:
        writer.writerow([json.dumps(r[c], sort_keys=True) if c == 'overrides' else
                         ('' if r[c] is None else r[c]) for c in CSV_COLUMNS]
                        + [format_value(r['overrides'][k]) if k in r['overrides'] else ''
                           for k in keys])
    return buffer.getvalue()


def _markdown(rows: list[dict], meta: dict) -> str:
    counts = {s: sum(r['status'] == s for r in rows) for s in STATUSES}
    split = next((r['split'] for r in rows if r['split']), meta.get('split') or 'test split')
    base = ' '.join(f'--config.{k}={format_value(v)}'
                    for k, v in (meta.get('base_overrides') or {}).items())
    averaged = (f'the average of the last {meta["average_last"]} checkpoints'
                if meta.get('average_last') else 'the latest checkpoint')
    lines = [f'# Sweep of `{meta.get("config", "?")}`' + (f' with `{base}`' if base else ''),
             '',
             f'{len(rows)} points: ' + ', '.join(f'{n} {s}' for s, n in counts.items() if n)
             + f'. Written {datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}.',
             '',
             'Validation perplexity from metrics.jsonl (best and last evaluation); train s: the '
             'seconds the time budget counted (checkpoint metadata); sacreBLEU and chrF of '
             f'evaluate.py on {split} ({averaged}).',
             '',
             '| point | status | params | steps | train s | best val ppl (step) '
             '| final val ppl | sacreBLEU | chrF | note |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        best = (f'{_fmt(r["best_val_perplexity"], 2)} ({r["best_val_step"]})'
                if r['best_val_perplexity'] is not None else '')
        note = r['error'].replace('|', '/')
        lines.append(f'| `{r["point"]}` | {r["status"]} | {_fmt(r["params"], 0)} | '
                     f'{_fmt(r["steps"], 0)} | {_fmt(r["train_seconds"], 0)} | {best} | '
                     f'{_fmt(r["final_val_perplexity"], 2)} | {_fmt(r["sacrebleu"], 2)} | '
                     f'{_fmt(r["chrf"], 2)} | {note} |')
    return '\n'.join(lines) + '\n'


def plot_curves(rows: list[dict], path: str, title: str = ''):
    """Validation perplexity against step and against training seconds; returns the figure."""
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = plt.get_cmap('tab20' if len(rows) > 10 else 'tab10')
    for i, r in enumerate(rows):
        if not r['curve']:
            continue
        steps, seconds, ppl = builtins.zip(*r['curve'], strict=True)
        style = dict(color=colors(i % colors.N), marker='o', markersize=3,
                     linestyle='-' if i < colors.N else '--')
        by_step.plot(steps, ppl, label=r['point'], **style)
        by_time.plot(seconds, ppl, **style)
    by_step.set_xlabel('step')
    by_time.set_xlabel('training seconds (sum of step times; evaluation excluded)')
    by_step.set_ylabel('validation perplexity')
    for ax in (by_step, by_time):
        ax.set_yscale('log')
        ax.grid(alpha=0.3, which='both')
    fig.legend(loc='center right', fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return fig


def write_summary(workdir: str) -> list[dict]:
    """summary.md, summary.csv and curves.png from what is on disk; returns the rows."""
    meta = read_json(os.path.join(workdir, SWEEP_NAME))
    if meta is None:
        raise SweepError(f'{workdir} holds no {SWEEP_NAME}: not a sweep directory')
    rows = [point_row(workdir, name) for name in meta['points']]
    keys = sorted({k for r in rows for k in r['overrides']})
    write_atomic(os.path.join(workdir, 'summary.md'), _markdown(rows, meta))
    write_atomic(os.path.join(workdir, 'summary.csv'), _csv(rows, keys))
    plot_curves(rows, os.path.join(workdir, 'curves.png'),
                f'{meta.get("config", "")}: {os.path.basename(os.path.abspath(workdir))}')
    return rows
