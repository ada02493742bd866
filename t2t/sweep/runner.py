"""Running a sweep: each point's train.py as a child process in WORKDIR/<name>, its state on
disk, its evaluation, and the signals that stop it all cleanly (docs/sweeps.md: the user's view).

A point's train.py runs as a subprocess (a crash of one point cannot take the sweep down), its
output in stdout.log / stderr.log of its directory, its state in sweep_point.json there (status
pending / running / done / failed, return code, error line, the point's full config; written
atomically). A point is done when its run's TRAINING_FINISHED marker (written by the training
loop after its last save, t2t/train/loop.py) says so: a preempted train.py exits 0 too. A new run of
the sweep skips points done with the same config, resumes unfinished ones from their checkpoints,
retries failed ones only with retry_failed, and trains on a done point whose config changed.
Each trained point is then evaluated (evaluate.py's logic, or evaluate.py through the cluster
launcher, which then writes the scores in the point's directory) and the summary rewritten.

SIGINT / SIGTERM: the running train.py gets SIGTERM (it saves and exits), its point stays
pending, the summary is written. If the sweep dies abruptly its train.py gets SIGTERM too (a
parent-death signal, on Linux). A cluster launcher (scripts/launch_tpu.py, launch_slurm.py) runs
a point as one job, blocks until it ends and exits with its status; a signal makes it stop the
job. Its sweep directory must be one path seen alike here and on the cluster (shared file system,
or a bucket mounted with gcsfuse): the state is written with local file APIs.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from t2t.infra import workdir as wd
from t2t.sweep import points, report
from t2t.sweep.points import Point, SweepError

TRAIN_PY = os.path.join(points.ROOT, 'train.py')


# ----------------------------------------------------------------------------------------------
# Launchers and commands


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

    def command(self, config_path: str, workdir: str, args: list[str],
                launcher_flags: Sequence[str] = (), evaluate: bool = False) -> list[str]:
        base = [f'--config={config_path}', f'--workdir={workdir}']
        if self.script is None:
            return [os.path.relpath(sys.executable), os.path.relpath(TRAIN_PY), *base, *args]
        return [os.path.relpath(sys.executable), os.path.relpath(self.script),
                *launcher_flags, *self.fixed_flags, *(['--evaluate'] if evaluate else []),
                *base, '--', *args]  # the script's own flags after `--`, verbatim


def _script(name: str) -> str:
    return os.path.join(points.ROOT, 'scripts', name)


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
                        [*points.script_args(overrides), *(eval_args or ())], launcher_flags,
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
# The sweep


def run(config_path: str, config, workdir: str, *, base_overrides: dict | None = None,
        split: str = '', average_last: int = 0, retry_failed: bool = False,
        dry_run: bool = False, launcher: str = 'local', launcher_flags: Sequence[str] = (),
        only: Sequence[str] = (), sweep: list[dict] | None = None,
        echo: Callable[[str], None] = print) -> int:
    """Runs (or, dry_run, prints) the sweep; returns an exit code (0: every point done).

    launcher: a name in LAUNCHERS; launcher_flags go to a cluster launcher's script.
    only: names of the points to run now (the summary still lists every point).
    sweep: the override dicts, instead of the config file's get_sweep().
    """
    base_overrides, launcher_flags = dict(base_overrides or {}), list(launcher_flags)
    if '://' in workdir:
        raise SweepError(f'--workdir={workdir}: a sweep directory must be a local or shared '
                         'file system path (it holds a lock and the points\' live logs, which a '
                         'bucket cannot); mount the bucket (gcsfuse) at one path here and on the '
                         'workers and give that path')
    cluster = check_launcher(launcher, launcher_flags).script is not None
    every = points.make_points(config, points.load_sweep(config_path) if sweep is None
                               else sweep, base_overrides)
    commands = {p.name: point_command(config_path, workdir, p, base_overrides, launcher,
                                      launcher_flags) for p in every}
    eval_commands = {p.name: eval_command(config_path, workdir, p, base_overrides, launcher,
                                          launcher_flags, split, average_last) if cluster
                     else None for p in every}
    unknown = set(only) - set(commands)
    if unknown:
        raise SweepError(f'no point named {", ".join(sorted(unknown))}; the points: '
                         f'{", ".join(commands)}')
    selected = [(i, p) for i, p in enumerate(every, 1) if not only or p.name in only]
    total = len(every)
    if dry_run:
        for i, p in selected:
            same = f'  (also stands for: {", ".join(p.same_as)})' if p.same_as else ''
            echo(f'[{i}/{total}] {p.name}: {points.count_params(p.config)} parameters{same}')
            echo('  ' + shlex.join(commands[p.name]))
            if eval_commands[p.name]:
                echo('  ' + shlex.join(eval_commands[p.name]))
        return 0

    os.makedirs(workdir, exist_ok=True)
    lock = _lock(workdir)
    try:
        wd.write_atomic(os.path.join(workdir, report.SWEEP_NAME), json.dumps({
            'config': config_path, 'base_overrides': base_overrides, 'split': split,
            'average_last': average_last, 'launcher': launcher,
            'launcher_flags': launcher_flags,
            'points': [p.name for p in every], 'argv': sys.argv,
            'updated_at': time.time()}, indent=1, default=str) + '\n')
        with _Stop(cluster) as stop:
            for i, p in selected:
                if stop.signum is not None:
                    break
                _run_point(p, f'[{i}/{total}] {p.name}', commands[p.name],
                           eval_commands[p.name], workdir, split, average_last, retry_failed,
                           stop, echo)
                report.write_summary(workdir)
            stopped = stop.signum
        rows = report.write_summary(workdir)
    finally:
        lock.close()
    echo(f'summary -> {os.path.join(workdir, "summary.md")}, summary.csv, curves.png')
    if stopped is not None:
        return 128 + stopped
    ran = {p.name for _, p in selected}
    return 0 if all(r['status'] == 'done' and not r['error'] for r in rows
                    if r['point'] in ran) else 1


def _run_point(p: Point, tag: str, command, eval_cmd, workdir, split, average_last,
               retry_failed, stop, echo) -> None:
    from t2t.run import run_record

    point_dir = os.path.join(workdir, p.name)
    os.makedirs(point_dir, exist_ok=True)
    state = report.read_state(point_dir)
    current = points.config_json(p.config)
    if 'params' not in state or state.get('config') != current:
        state['params'] = points.count_params(p.config)
    status = state.get('status', 'pending')
    same_config = state.get('config') == current
    state.update(name=p.name, overrides=p.overrides, same_as=list(p.same_as), config=current)

    if status == 'failed' and not retry_failed:
        echo(f'{tag}: failed earlier ({state.get("error")}); --retry_failed runs it again')
        write_state(point_dir, state)
        return
    if status == 'running':  # an earlier sweep died: its train.py may still be saving
        _wait_for_old_child(point_dir, state, echo)
    # Trained to its end with this config (also when an earlier sweep died before it could
    # record that): only the evaluation may be left to do.
    finished = run_record.read_finished(point_dir) if same_config and status != 'failed' else None
    if finished is not None:
        if status == 'done':
            echo(f'{tag}: done (step {state.get("step")}), skipped')
        else:
            echo(f'{tag}: finished earlier (step {finished.get("step")}), not trained again')
            state.update(finished_state(finished), pid=None)
            write_state(point_dir, state)
    else:
        what = {'pending': 'training', 'running': 'resuming (unfinished)', 'failed': 'retrying',
                'done': 'config changed: training on' if not same_config else
                'not finished (no TRAINING_FINISHED): training on'}[status]
        echo(f'{tag}: {what} -> {point_dir}/stdout.log')
        state = train_point(command, point_dir, state, stop)
        note = state['error'] or state['stopped_by']
        if state['status'] == 'done' and state['returncode']:
            note += f'; exit code {state["returncode"]} after TRAINING_FINISHED'
        echo(f'{tag}: {state["status"]} after {state["seconds"]:.0f} s ({note})')
        if state['status'] != 'done':
            return
    label = _eval_label(point_dir, average_last)
    previous = state.get('eval') or {}
    if previous.get('label') == label and previous.get('split') == (split or
                                                                   p.config.test_split):
        return
    echo(f'{tag}: evaluating {label} on {split or p.config.test_split}')
    state['eval'] = evaluate_point(p.config, point_dir, split, average_last, eval_cmd, stop)
    write_state(point_dir, state)
    result = state['eval']
    echo(f'{tag}: ' + (result['error'] if 'error' in result else
                       f'sacreBLEU {result["sacrebleu"]:.2f} chrF {result["chrf"]:.2f}'))


# ----------------------------------------------------------------------------------------------
# One point's training


def write_state(point_dir: str, state: dict) -> None:
    wd.write_atomic(os.path.join(point_dir, report.STATE_NAME), json.dumps(state, indent=1) + '\n')


def finished_state(finished: dict) -> dict:
    """A done point's state fields, from its TRAINING_FINISHED record."""
    return {'status': 'done', 'step': finished.get('step'),
            'stopped_by': finished.get('stopped_by', ''), 'error': ''}


def outcome(returncode: int, finished: dict | None, interrupted: bool, stderr: str) -> dict:
    """The state fields an attempt leaves: done only when its TRAINING_FINISHED says so."""
    if finished is not None:  # every checkpoint is on disk, whatever the exit status says
        return finished_state(finished)
    if interrupted:
        return {'status': 'pending', 'step': None, 'stopped_by': 'signal',
                'error': 'interrupted: resumes at the next run'}
    if returncode == 0:  # e.g. preempted: train.py saved and exited without finishing
        return {'status': 'pending', 'step': None, 'stopped_by': '',
                'error': 'exited 0 without TRAINING_FINISHED (stopped early, e.g. preempted): '
                         'resumes at the next run'}
    return {'status': 'failed', 'step': None, 'stopped_by': '',
            'error': _error_line(stderr, returncode)}


def train_point(command: list[str], point_dir: str, state: dict, stop: _Stop) -> dict:
    """Runs train.py for one point; returns its new state (already written)."""
    from t2t.run import run_record

    # A marker of an earlier attempt says nothing about this one (train.py clears it too, but
    # only once it has started).
    wd.remove(os.path.join(point_dir, run_record.FINISHED_NAME))
    out_path, err_path = (os.path.join(point_dir, n) for n in ('stdout.log', 'stderr.log'))
    err_offset = os.path.getsize(err_path) if os.path.exists(err_path) else 0
    state = {**state, 'status': 'running', 'command': command, 'error': '', 'returncode': None,
             'attempts': state.get('attempts', 0) + 1, 'started_at': time.time()}
    start = time.perf_counter()
    with open(out_path, 'ab') as out, open(err_path, 'ab') as err:
        header = (f'=== sweep attempt {state["attempts"]} {datetime.datetime.now().isoformat()}:'
                  f' {shlex.join(command)}\n').encode()
        for f in (out, err):
            f.write(header)
            f.flush()

        def started(child):
            state['pid'] = child.pid
            write_state(point_dir, state)

        returncode = _run_child(command, out, err, stop, started)
    state.update(returncode=returncode, pid=None, seconds=round(time.perf_counter() - start, 1),
                 finished_at=time.time())
    state.update(outcome(returncode, run_record.read_finished(point_dir), stop.signum is not None,
                         _tail(err_path, err_offset)))
    write_state(point_dir, state)
    return state


# ----------------------------------------------------------------------------------------------
# One point's evaluation


# What a point's state keeps of evaluate.py's record (eval-<split>.json holds all of it).
EVAL_KEEP = ('sacrebleu', 'chrf', 'tok_bleu_compound_split', 'sentences', 'skipped_too_long',
             'hit_length_limit', 'capped_at_max_decode_len', 'beam_size', 'sacrebleu_signature')


def _eval_label(point_dir: str, average_last: int) -> str | None:
    from t2t.eval import checkpoints as eval_checkpoints

    try:
        return eval_checkpoints.select(point_dir, average_last=average_last)[0][0]
    except eval_checkpoints.EvalError:
        return None


def evaluate_point(config, point_dir: str, split: str, average_last: int,
                   command: list[str] | None = None, stop: _Stop | None = None) -> dict:
    """{'label', 'split', 'sacrebleu', 'chrf', ...} or {'error': ...}.

    Without `command`: evaluate.py's logic in this process. With it: the point's evaluate.py run
    by its cluster launcher, the scores read back from the eval-<split>.json that evaluate.py
    writes in the point's directory. Either way its output is appended to evaluate.log.
    """
    from t2t.eval import checkpoints as eval_checkpoints
    from t2t.eval import evaluation
    from t2t.run import checkpoint

    resolved = split or config.test_split
    log_path = os.path.join(point_dir, 'evaluate.log')
    try:
        label = eval_checkpoints.select(point_dir, average_last=average_last)[0][0]
        if command is None:
            lines = []
            record = evaluation.run(config, point_dir, average_last=average_last, split=split,
                                    progress=False, echo=lines.append)[label]
            with open(log_path, 'a', encoding='utf-8') as f:
                f.write('\n'.join(lines) + '\n')
        else:
            record = _evaluate_with_launcher(command, point_dir, resolved, label, stop)
    except (eval_checkpoints.EvalError, checkpoint.CheckpointError, SweepError) as e:
        return {'error': f'evaluation: {str(e).splitlines()[0][:400]}', 'split': resolved}
    except Exception as e:  # e.g. out of memory: recorded, and the sweep goes on
        first = (str(e).splitlines() or [''])[0][:400]
        return {'error': f'evaluation: {type(e).__name__}: {first}', 'split': resolved}
    return {'label': label, 'split': resolved,
            **{k: record[k] for k in EVAL_KEEP if k in record}}


def _evaluate_with_launcher(command: list[str], point_dir: str, split: str, label: str,
                            stop: _Stop) -> dict:
    """evaluate.py's record of `label`, from a run through the cluster launcher."""
    from t2t.eval import evaluation

    log_path = os.path.join(point_dir, 'evaluate.log')
    offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, 'ab') as log:
        log.write(f'=== sweep evaluation {datetime.datetime.now().isoformat()}: '
                  f'{shlex.join(command)}\n'.encode())
        log.flush()
        returncode = _run_child(command, log, subprocess.STDOUT, stop)
    if stop.signum is not None:
        raise SweepError('interrupted: runs again at the next run')
    if returncode != 0:
        raise SweepError(_error_line(_tail(log_path, offset), returncode))
    path = evaluation.scores_path(point_dir, split)
    record = (report.read_json(path) or {}).get(label)
    if not record or 'sacrebleu' not in record:
        raise SweepError(f'{path} holds no scores of {label}')
    return record


# ----------------------------------------------------------------------------------------------
# Child processes, signals, the sweep's lock


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


def _error_line(stderr_tail: str, returncode: int) -> str:
    if returncode < 0:
        return f'killed by signal {signal.Signals(-returncode).name}'
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    return lines[-1][:500] if lines else f'exit code {returncode}'


def _tail(path: str, offset: int) -> str:
    with open(path, 'rb') as f:
        f.seek(offset)
        return f.read().decode('utf-8', errors='replace')


def _script_of(command: list[str]) -> str:
    """train.py, or the cluster launcher's script: the first .py of a point's command."""
    return next((os.path.basename(a) for a in command if a.endswith('.py')), 'train.py')


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


def _wait_for_old_child(point_dir: str, state: dict, echo) -> None:
    pid = state.get('pid')
    if not pid:
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


def _lock(workdir: str):
    handle = open(os.path.join(workdir, '.sweep.lock'), 'w')
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        handle.close()
        raise SweepError(f'another sweep is running in {workdir}') from e
    return handle
