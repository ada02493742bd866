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

Cluster launchers (--launcher=tpu or slurm, with --launcher_flags for scripts/launch_tpu.py or
scripts/launch_slurm.py) run each point as `python scripts/launch_X.py FLAGS --config=CONFIG
--workdir=POINT_DIR -- --config.key=value ...`, blocking until the job ends (launch_tpu without
--detach; launch_slurm --wait) and exiting with its status; the point's evaluate.py runs through
the same launcher (--evaluate, then --split / --average_last after `--`) and the sweep reads its
scores from eval-<split>.json in the point's directory: nothing big runs on this machine. A
signal to the sweep reaches the launcher, which stops the job (launch_tpu: SIGTERM to the script
on every worker; launch_slurm: scancel). The sweep's directory must be one path seen alike here
and on the cluster: the sweep writes its state with local file APIs and reads checkpoints,
metrics and scores there. On SLURM that is the shared file system; for a TPU slice, mount the
bucket with gcsfuse at the same path on this machine and on every worker (a gs:// --workdir is
refused), and the config file must be a file of the workers' checkout.
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
import time
from collections.abc import Callable, Sequence

from t2t import workdir as wd

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


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How a point's train.py runs: here (`script` None) or through a cluster launcher script.

    A cluster launcher also runs the point's evaluate.py (`--evaluate`), so that a big model is
    never decoded on this machine. It must block until its job ends and exit with the job's
    status: the sweep runs one point after another.
    """

    script: str | None = None  # scripts/launch_*.py; None: train.py here, evaluation in-process
    fixed_flags: tuple[str, ...] = ()  # flags the sweep always passes (to block until the end)
    refused_flags: tuple[str, ...] = ()  # flags that would return before the job ends

    def command(self, config_path: str, workdir: str, script_args: list[str],
                launcher_flags: Sequence[str] = (), evaluate: bool = False) -> list[str]:
        base = [f'--config={config_path}', f'--workdir={workdir}']
        if self.script is None:
            return [os.path.relpath(sys.executable), os.path.relpath(TRAIN_PY), *base,
                    *script_args]
        return [os.path.relpath(sys.executable), os.path.relpath(self.script),
                *launcher_flags, *self.fixed_flags, *(['--evaluate'] if evaluate else []),
                *base, '--', *script_args]  # the script's own flags after `--`, verbatim


def _script(name: str) -> str:
    return os.path.join(ROOT, 'scripts', name)


# --launcher's names. A cluster launcher script takes its own flags, then --config, --workdir (and
# --evaluate), then the script's flags after `--`, and runs them on the cluster's hosts.
LAUNCHERS: dict[str, Launcher] = {
    'local': Launcher(),
    'tpu': Launcher(_script('launch_tpu.py'), refused_flags=('--detach', '--setup_only')),
    'slurm': Launcher(_script('launch_slurm.py'), fixed_flags=('--wait',)),
}
_SET_BY_SWEEP = ('--config', '--workdir', '--evaluate', '--dry_run', '--')


def check_launcher(launcher: str, launcher_flags: Sequence[str]) -> Launcher:
    """The launcher of --launcher, with --launcher_flags checked; one-line errors."""
    if launcher not in LAUNCHERS:
        raise SweepError(f'--launcher={launcher!r}: one of {sorted(LAUNCHERS)}')
    spec = LAUNCHERS[launcher]
    if launcher_flags and spec.script is None:
        raise SweepError(f'--launcher_flags is for a cluster launcher, not --launcher={launcher}')
    for flag in launcher_flags:
        name = flag.split('=', 1)[0]
        if name in spec.refused_flags:
            raise SweepError(f'--launcher_flags: {name} returns before the job ends; a sweep '
                             'waits for each point')
        if name in _SET_BY_SWEEP + spec.fixed_flags:
            raise SweepError(f'--launcher_flags: {name} is set by the sweep itself')
    return spec


def script_args(overrides: dict) -> list[str]:
    return [f'--config.{k}={format_value(v)}' for k, v in overrides.items()]


def point_dir_for(sweep_dir: str, point: Point, launcher: str) -> str:
    # A cluster's workers resolve a relative path elsewhere (the checkout on a TPU worker).
    local = LAUNCHERS[launcher].script is None
    return os.path.join(sweep_dir if local else os.path.abspath(sweep_dir), point.name)


def point_command(config_path: str, sweep_dir: str, point: Point, base_overrides: dict,
                  launcher: str = 'local', launcher_flags: Sequence[str] = (),
                  eval_args: Sequence[str] | None = None) -> list[str]:
    """The point's train.py command; with eval_args (evaluate.py's own flags) its evaluate.py,
    which only a cluster launcher runs as a command."""
    spec = check_launcher(launcher, launcher_flags)
    overrides = {**base_overrides, **point.overrides}  # the point's own value wins
    return spec.command(config_path, point_dir_for(sweep_dir, point, launcher),
                        [*script_args(overrides), *(eval_args or ())], launcher_flags,
                        evaluate=eval_args is not None)


def eval_command(config_path: str, sweep_dir: str, point: Point, base_overrides: dict,
                 launcher: str, launcher_flags: Sequence[str], split: str,
                 average_last: int) -> list[str]:
    """evaluate.py of the point through a cluster launcher (overrides, --split, --average_last)."""
    return point_command(config_path, sweep_dir, point, base_overrides, launcher, launcher_flags,
                         eval_args=[*([f'--split={split}'] if split else []),
                                    *([f'--average_last={average_last}'] if average_last
                                      else [])])


# ----------------------------------------------------------------------------------------------
# State on disk


def read_json(path) -> dict | None:
    text = wd.read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SweepError(f'{path} is not valid JSON ({e}); delete it to start the point over') \
            from e


def read_state(point_dir: str) -> dict:
    return read_json(os.path.join(point_dir, STATE_NAME)) or {'status': 'pending'}


def write_state(point_dir: str, state: dict) -> None:
    wd.write_atomic(os.path.join(point_dir, STATE_NAME), json.dumps(state, indent=1) + '\n')


def _process_alive(pid: int, command: list[str]) -> bool:
    """Whether `pid` still runs `command`: an earlier sweep's train.py finishing its save, or its
    cluster launcher waiting for the job to end."""
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            args = f.read().decode(errors='replace').split('\0')
    except OSError:
        return False
    workdir = next((a for a in command if a.startswith('--workdir=')), None)
    return workdir in args and any(os.path.basename(a) == _script_of(command) for a in args)


def _script_of(command: list[str]) -> str:
    """train.py, or the cluster launcher's script: the first .py of a point's command."""
    return next((os.path.basename(a) for a in command if a.endswith('.py')), 'train.py')


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
    """SIGINT / SIGTERM: remember, forward SIGTERM to the running train.py, stop after it.

    cluster: the child is a cluster launcher; a second signal is SIGTERM again, not SIGKILL, so
    that the launcher can still cancel its job (a killed launcher would leave it running).
    """

    def __init__(self, cluster: bool = False):
        self.signum = None
        self.child = None
        self.cluster = cluster
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
            # First signal: SIGTERM (train.py saves a checkpoint); a second one: SIGKILL
            # (to a cluster launcher SIGTERM again: it stops the job, then returns).
            self.child.send_signal(signal.SIGKILL if again and not self.cluster
                                   else signal.SIGTERM)
        what = ('asked the launcher to stop its job' if self.cluster else
                'killed' if again else 'asked train.py to save and exit')
        print(f'\nsweep: {signal.Signals(signum).name}: stopping after the running point '
              f'({what})', flush=True)


def _error_line(stderr_tail: str, returncode: int) -> str:
    if returncode < 0:
        return f'killed by signal {signal.Signals(-returncode).name}'
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    return lines[-1][:500] if lines else f'exit code {returncode}'


def _tail(path: str, offset: int) -> str:
    with open(path, 'rb') as f:
        f.seek(offset)
        return f.read().decode('utf-8', errors='replace')


def _run_child(command: list[str], out, err, stop: _Stop,
               started: Callable[[subprocess.Popen], None] = lambda child: None) -> int:
    """Runs `command` to its end with its output to the files `out`, `err`; its exit status."""
    # Its own session: a Ctrl-C in the terminal reaches the sweep, which forwards SIGTERM.
    child = subprocess.Popen(_spawn_command(command), stdout=out, stderr=err,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    started(child)
    stop.child = child
    if stop.signum is not None:  # the signal came while it was starting
        child.send_signal(signal.SIGTERM)
    try:
        return child.wait()
    finally:
        stop.child = None


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

        def started(child):
            state['pid'] = child.pid
            write_state(point_dir, state)

        returncode = _run_child(command, out, err, stop, started)
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


# What a point's state keeps of evaluate.py's record (eval-<split>.json holds all of it).
EVAL_KEEP = ('sacrebleu', 'chrf', 'tok_bleu_compound_split', 'sentences', 'skipped_too_long',
             'hit_length_limit', 'capped_at_max_decode_len', 'beam_size', 'sacrebleu_signature')


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
    return _eval_result(label, split or config.test_split, record)


def _eval_result(label: str, split: str, record: dict) -> dict:
    """What a point's state keeps of evaluate.py's record of `label`."""
    return {'label': label, 'split': split, **{k: record[k] for k in EVAL_KEEP if k in record}}


def evaluate_with_launcher(command: list[str], config, point_dir: str, split: str,
                           average_last: int, stop: _Stop) -> dict:
    """The point's evaluate.py run by its cluster launcher (`command`); the scores are read back
    from the eval-<split>.json that evaluate.py writes in the point's directory. The same dict
    as evaluate_point; the launcher's output goes to evaluate.log."""
    from t2t import evaluation

    split = split or config.test_split
    try:
        label = evaluation.select(point_dir, average_last=average_last)[0][0]
    except evaluation.EvalError as e:
        return {'error': f'evaluation: {str(e).splitlines()[0][:400]}', 'split': split}
    log_path = os.path.join(point_dir, 'evaluate.log')
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, 'ab') as log:
        log.write(f'=== sweep evaluation {datetime.datetime.now().isoformat()}: '
                  f'{shlex.join(command)}\n'.encode())
        log.flush()
        returncode = _run_child(command, log, subprocess.STDOUT, stop)
    if stop.signum is not None:
        return {'error': 'evaluation interrupted: runs again at the next run', 'split': split}
    if returncode != 0:
        line = _error_line(_tail(log_path, offset), returncode)
        return {'error': f'evaluation: {line}', 'split': split}
    path = evaluation.scores_path(point_dir, split)
    try:
        record = (read_json(path) or {}).get(label)
    except SweepError as e:
        return {'error': f'evaluation: {e}', 'split': split}
    if not record or 'sacrebleu' not in record:
        return {'error': f'evaluation: {path} holds no scores of {label}', 'split': split}
    return _eval_result(label, split, record)


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
    command = state.get('command') or []
    script = _script_of(command)
    while _process_alive(pid, command):
        if time.monotonic() > deadline:
            raise SweepError(f'{point_dir}: {script} (pid {pid}) of an earlier sweep is still '
                             'running; stop it first')
        if not said:
            echo(f'  waiting for pid {pid} ({script} of an earlier sweep) to finish')
            said = True
        time.sleep(0.5)


def run(config_path: str, config, workdir: str, *, base_overrides: dict | None = None,
        split: str = '', average_last: int = 0, retry_failed: bool = False,
        dry_run: bool = False, launcher: str = 'local', launcher_flags: Sequence[str] = (),
        only: Sequence[str] = (), sweep: list[dict] | None = None,
        echo: Callable[[str], None] = print) -> int:
    """Runs (or, dry_run, prints) the sweep; returns an exit code (0: every point done).

    launcher: a name in LAUNCHERS; launcher_flags go to a cluster launcher's script.
    only: names of the points to run now (the summary still lists every point).
    """
    base_overrides, launcher_flags = dict(base_overrides or {}), list(launcher_flags)
    if '://' in workdir:
        raise SweepError(f'--workdir={workdir}: a sweep directory must be a local or shared '
                         'file system path (it holds a lock and the points\' live logs, which a '
                         'bucket cannot); mount the bucket (gcsfuse) at one path here and on the '
                         'workers and give that path')
    cluster = check_launcher(launcher, launcher_flags).script is not None
    points = make_points(config, load_sweep(config_path) if sweep is None else sweep,
                         base_overrides)
    commands = {p.name: point_command(config_path, workdir, p, base_overrides, launcher,
                                      launcher_flags) for p in points}
    eval_commands = {p.name: eval_command(config_path, workdir, p, base_overrides, launcher,
                                          launcher_flags, split, average_last) if cluster
                     else None for p in points}
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
            if eval_commands[p.name]:
                echo('  ' + shlex.join(eval_commands[p.name]))
        return 0

    os.makedirs(workdir, exist_ok=True)
    lock = _lock(workdir)
    try:
        wd.write_atomic(os.path.join(workdir, SWEEP_NAME), json.dumps({
            'config': config_path, 'base_overrides': base_overrides, 'split': split,
            'average_last': average_last, 'launcher': launcher,
            'launcher_flags': launcher_flags,
            'points': [p.name for p in points], 'argv': sys.argv,
            'updated_at': time.time()}, indent=1, default=str) + '\n')
        with _Stop(cluster) as stop:
            for i, p in selected:
                if stop.signum is not None:
                    break
                _run_point(p, i, total, commands[p.name], eval_commands[p.name], workdir, split,
                           average_last, retry_failed, stop, echo)
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


def _run_point(p: Point, i: int, total: int, command, eval_cmd, workdir, split, average_last,
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
    if eval_cmd:  # on the cluster, through the launcher
        state['eval'] = evaluate_with_launcher(eval_cmd, p.config, point_dir, split,
                                               average_last, stop)
    else:
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
    from t2t import checkpoint, checkpoint_read, metrics

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
            meta = checkpoint_read.read_metadata(point_dir)
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
    if any(r['curve'] for r in rows):  # no legend without a curve
        fig.legend(loc='center right', fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=110)
    plt.close(fig)
    wd.write_atomic(path, buffer.getvalue())
    return fig


def write_summary(workdir: str) -> list[dict]:
    """summary.md, summary.csv and curves.png from what is on disk; returns the rows."""
    meta = read_json(os.path.join(workdir, SWEEP_NAME))
    if meta is None:
        raise SweepError(f'{workdir} holds no {SWEEP_NAME}: not a sweep directory')
    rows = [point_row(workdir, name) for name in meta['points']]
    keys = sorted({k for r in rows for k in r['overrides']})
    wd.write_atomic(os.path.join(workdir, 'summary.md'), _markdown(rows, meta))
    wd.write_atomic(os.path.join(workdir, 'summary.csv'), _csv(rows, keys))
    plot_curves(rows, os.path.join(workdir, 'curves.png'),
                f'{meta.get("config", "")}: {os.path.basename(os.path.abspath(workdir))}')
    return rows
