"""Run train.py as N processes on this machine, and restart them all when one fails.

    python scripts/launch_local.py --processes=2 --max_restarts=5 \\
        --config=configs/tiny.py --workdir=workdirs/tiny -- --config.num_train_steps=200

Each process gets --devices_per_process host CPU devices (XLA_FLAGS
--xla_force_host_platform_device_count, JAX_PLATFORMS=cpu) and `--coordinator_address=
127.0.0.1:<port> --num_processes=N --process_id=i`: a pod slice on one machine. Every attempt has
a fresh free coordinator port and a fresh job identity (the environment variable T2T_JOB_ID, which
the start-up handshake compares, so a straggler of an earlier attempt cannot join a later one),
and T2T_ATTEMPT=<launch>:<k> (the goodput ledger's count of attempts, t2t/goodput/ledger.py).

When a process exits abnormally (a non-zero status, or a signal), the others of its attempt are
SIGKILLed (which ends a SIGSTOPped one too) and all start again: train.py resumes from the last
checkpoint. One line per restart names the process and its status (t2t/infra/exits.py). Exit 1 (an
error: a config value, a path) is not restarted: restarting would repeat it. The launcher's own
hang guard: when process 0 (the one that prints the step lines) writes nothing to stdout for
--hang_timeout_s once the attempt has printed its first training step line, or for
--startup_hang_timeout_s before it (start-up: data, restore, compiles), the attempt is taken as
hung, killed and restarted; it catches what the watchdog inside train.py cannot (a process too
stuck to run it, or stopped by a signal). Set --hang_timeout_s above the longest silent stretch
of training (an evaluation, a save) and --startup_hang_timeout_s above the longest start-up; the
two are apart because a start-up that prepares data and compiles is silent far longer than a
step, so one limit for both would leave a hang in training undetected for as long as a start-up
may take.

It ends when WORKDIR/TRAINING_FINISHED is there (exit 0), or after --max_restarts restarts or an
error (one line, the failing status; 1 when that was a signal). SIGTERM or SIGINT to the launcher
sends SIGTERM to every process (train.py saves a checkpoint and exits 0), waits for them, and
exits with 0 when they all saved. Logs: <logs>/attempt-<k>-process-<i>.out and .err, every
attempt kept; <logs>/attempt-<k>.json names that attempt's process ids, port and job identity.
Process 0's stdout is also streamed here. Arguments after `--` go to train.py verbatim.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import sys
import time
import uuid

import launch_args  # scripts/: the directory of this script is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from t2t.infra import exits  # noqa: E402

DEVICE_FLAG = '--xla_force_host_platform_device_count'
POLL_S = 0.05
# A training step's line (t2t/infra/metrics.py: 'step 1 | loss 7.6 | ...'), its step; not an
# evaluation's ('step 12 | eval_loss ...'), which a resumed run may print before its first step.
STEP_LINE = re.compile(rb'^step (\d+) \| loss ', re.M)
LAUNCH_ID = f'launch-{uuid.uuid4().hex[:12]}'  # this launcher's, in T2T_ATTEMPT
TERM_WAIT_S = 120.0  # after a forwarded SIGTERM: processes that have not saved by then are killed


def free_port(used: set[int]) -> int:
    """A free port none of the earlier attempts had (the system may hand one back): a process of
    an earlier attempt still exiting never meets the new coordinator. Added to used."""
    while True:
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        if port not in used:
            used.add(port)
            return port


def process_env(base: dict, devices: int, job_id: str) -> dict:
    """The environment of each process: CPU devices, the attempt's job identity."""
    flags = [f for f in base.get('XLA_FLAGS', '').split() if not f.startswith(DEVICE_FLAG)]
    return {**base, 'JAX_PLATFORMS': 'cpu', 'T2T_JOB_ID': job_id,
            'XLA_FLAGS': ' '.join([*flags, f'{DEVICE_FLAG}={devices}'])}


def process_argv(args, passthrough: list[str], port: int, index: int) -> list[str]:
    return [args.python, os.path.join(ROOT, 'train.py'), f'--config={args.config}',
            f'--workdir={args.workdir}', *passthrough,
            f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={args.processes}',
            f'--process_id={index}']


@dataclasses.dataclass
class Outcome:
    """How an attempt ended: 'finished' (all exited 0), 'failed' (cause names the process),
    'hang' (no output for hang_timeout_s) or 'stopped' (the launcher got SIGTERM/SIGINT)."""
    kind: str
    statuses: list
    cause: str = ''
    status: int = 0  # the failing process's status (for the launcher's own exit status)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the launcher dies (a killed launcher leaves no orphans)."""
    try:
        import ctypes

        ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _state(pid: int) -> str:
    """The process's state letter from /proc ('T' when stopped), '' when unknown."""
    try:
        with open(f'/proc/{pid}/stat', encoding='ascii') as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except (OSError, IndexError):
        return ''


def classify(statuses: list) -> tuple[int, int] | None:
    """(process, status) of the failure that explains an attempt's end, None if none failed.

    A peer's death makes the others fail a moment later (exit 1 from a collective's error, or
    SIGABRT from jax's coordination service), and one poll can see both: among the processes
    that have ended, a signal from outside (SIGKILL, SIGTERM, ...) is the cause before a
    restartable exit status (t2t/infra/exits.py), before SIGABRT, before any other status.
    """
    def rank(status):
        if status < 0:
            return 2 if status == -signal.SIGABRT else 0
        return 1 if status in exits.RESTARTABLE else 3

    failed = [(rank(s), i, s) for i, s in enumerate(statuses) if s not in (None, exits.OK)]
    return min(failed)[1:] if failed else None


class Attempt:
    """The N processes of one attempt, their logs, and process 0's stdout streamed."""

    def __init__(self, args, passthrough, number: int, stream, used_ports: set[int]):
        import subprocess

        self.port, self.job_id = free_port(used_ports), f'local-{uuid.uuid4().hex[:12]}'
        env = process_env(dict(os.environ), args.devices_per_process, self.job_id)
        env['T2T_ATTEMPT'] = f'{LAUNCH_ID}:{number}'  # the goodput ledger counts attempts by it
        self.procs, self.files = [], []
        for i in range(args.processes):
            base = os.path.join(args.logs, f'attempt-{number}-process-{i}')
            out, err = open(base + '.out', 'wb'), open(base + '.err', 'wb')
            self.files += [out, err]
            self.procs.append(subprocess.Popen(
                process_argv(args, passthrough, self.port, i), stdin=subprocess.DEVNULL,
                stdout=out, stderr=err, env=env, start_new_session=True,
                preexec_fn=_die_with_parent))
        self.tail = open(os.path.join(args.logs, f'attempt-{number}-process-0.out'), 'rb')
        self.stream, self.last_output = stream, time.monotonic()
        self.stepping, self._head = False, b''  # process 0 has printed a training step line
        with open(os.path.join(args.logs, f'attempt-{number}.json'), 'w') as f:
            json.dump({'pids': [p.pid for p in self.procs], 'port': self.port,
                       'job_id': self.job_id}, f)

    def pump(self) -> None:
        """Process 0's new output to the stream; its arrival is the attempt's progress."""
        data = self.tail.read()
        if data:
            self.last_output = time.monotonic()
            self.stream.write(data)
            self.stream.flush()
            if not self.stepping:  # a line may arrive in pieces: keep the unfinished one
                *lines, self._head = (self._head + data).split(b'\n')
                self.stepping = any(STEP_LINE.match(line) for line in lines)

    def statuses(self) -> list:
        return [p.poll() for p in self.procs]

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self) -> list:
        self.signal_all(signal.SIGKILL)
        return [p.wait() for p in self.procs]

    def close(self) -> None:
        self.pump()
        for f in [*self.files, self.tail]:
            f.close()


def run_attempt(attempt: Attempt, hang_timeout_s: float, startup_hang_timeout_s: float,
                stop: list) -> Outcome:
    """Waits for the attempt to end; kills what is left when one process fails or it hangs
    (silent for startup_hang_timeout_s before its first training step line, hang_timeout_s
    after; 0: not watched)."""
    forwarded = None
    while True:
        attempt.pump()
        statuses = attempt.statuses()
        limit = hang_timeout_s if attempt.stepping else startup_hang_timeout_s
        if stop and forwarded is None:
            attempt.signal_all(signal.SIGTERM)
            forwarded = time.monotonic()
        if forwarded is not None:
            if all(s is not None for s in statuses):
                return Outcome('stopped', statuses)
            if time.monotonic() - forwarded > TERM_WAIT_S:
                return Outcome('stopped', attempt.kill(), 'not saved within '
                               f'{TERM_WAIT_S:.0f} s of SIGTERM: killed', 1)
        elif (failure := classify(statuses)) is not None:
            attempt.kill()
            i, status = failure
            return Outcome('failed', statuses, f'process {i} {exits.describe(status)}', status)
        elif all(s is not None for s in statuses):
            return Outcome('finished', statuses)
        elif limit and time.monotonic() - attempt.last_output > limit:
            stopped = [i for i, p in enumerate(attempt.procs) if _state(p.pid) == 'T']
            which = f' (process {", ".join(map(str, stopped))} stopped)' if stopped else ''
            phase = 'in training' if attempt.stepping else 'in start-up'
            attempt.kill()
            return Outcome('hang', statuses, f'no output from process 0 for {limit:g} s {phase}'
                           f'{which}: taken as a hang', exits.HANG)
        time.sleep(POLL_S)


def read_finished(workdir: str) -> dict | None:
    from t2t.run import run_record  # imports jax: only once an attempt has ended

    return run_record.read_finished(workdir)


def supervise(args, passthrough, stream=None, say=None) -> int:
    """The launcher's loop: attempts until TRAINING_FINISHED, an error or the restarts spent."""
    stream = stream or sys.stdout.buffer
    say = say or (lambda line: print(f'launch_local: {line}', file=sys.stderr, flush=True))
    stop = []

    def on_signal(signum, frame):
        if not stop:
            say(f'{signal.Signals(signum).name}: sending SIGTERM to every process')
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    start, restarts, used_ports = time.monotonic(), 0, set()
    try:
        while True:
            if stop:  # between two attempts: nothing is running
                say('stopped between attempts; run again to resume')
                return exits.OK
            attempt = Attempt(args, passthrough, restarts, stream, used_ports)
            try:
                outcome = run_attempt(attempt, args.hang_timeout_s,
                                      args.startup_hang_timeout_s, stop)
            finally:
                attempt.close()
            if outcome.kind == 'stopped':
                ok = all(s == exits.OK for s in outcome.statuses)
                say('stopped: ' + ('every process saved and exited' if ok else
                                   outcome.cause or 'statuses ' + ', '.join(
                                       exits.describe(s) for s in outcome.statuses)))
                return exits.OK if ok else exits.ERROR
            finished = read_finished(args.workdir)
            elapsed = time.monotonic() - start
            if finished:
                say(f'training finished at step {finished.get("step")} '
                    f'({finished.get("stopped_by")}) after {restarts} restarts in {elapsed:.0f} s')
                return exits.OK
            if outcome.kind == 'finished':
                cause = 'every process exited 0 before TRAINING_FINISHED'
            else:
                cause = outcome.cause
            if outcome.kind == 'failed' and outcome.status == exits.ERROR:
                say(f'{cause}: a restart cannot fix it (see '
                    f'{args.logs}/attempt-{restarts}-process-*.err)')
                return exits.ERROR
            if restarts >= args.max_restarts:
                say(f'{cause}; all {args.max_restarts} restarts spent, giving up after '
                    f'{elapsed:.0f} s')
                return outcome.status if outcome.status > 0 else exits.ERROR
            restarts += 1
            say(f'restart {restarts} of {args.max_restarts} at {elapsed:.0f} s: {cause}')
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def parse_args(argv: list[str]):
    argv, passthrough = launch_args.split_at_dashes(argv)
    p = launch_args.parser(__doc__)
    p.add_argument('--processes', type=int, required=True)
    p.add_argument('--devices_per_process', type=int, default=4)
    p.add_argument('--max_restarts', type=int, default=3)
    p.add_argument('--hang_timeout_s', type=float, default=1800.0,
                   help='no stdout from process 0 for this long once it has printed a '
                   'training step line: a hang, restart (0: off)')
    p.add_argument('--startup_hang_timeout_s', type=float, default=None,
                   help='the same before an attempt\'s first training step line (default: '
                   '--hang_timeout_s; 0: off)')
    p.add_argument('--config', default='configs/default.py')
    p.add_argument('--workdir', required=True)
    p.add_argument('--logs', default='', help='per-process logs (default: logs/launch_local)')
    p.add_argument('--python', default=sys.executable)
    args = p.parse_args(argv)
    if args.processes < 1 or args.devices_per_process < 1 or args.max_restarts < 0:
        p.error(f'--processes={args.processes} and --devices_per_process='
                f'{args.devices_per_process} must be >= 1, --max_restarts={args.max_restarts} '
                '>= 0')
    if args.startup_hang_timeout_s is None:
        args.startup_hang_timeout_s = args.hang_timeout_s
    for flag in ('hang_timeout_s', 'startup_hang_timeout_s'):
        if getattr(args, flag) < 0:
            p.error(f'--{flag}={getattr(args, flag)} must be >= 0 (0: off)')
    owned = [a for a in passthrough if a.split('=')[0] in (
        '--workdir', '--config', '--coordinator_address', '--num_processes', '--process_id')]
    if owned:
        p.error(f'{owned[0]} after --: the launcher sets it (give --config/--workdir before --)')
    args.logs = os.path.abspath(args.logs or 'logs/launch_local')
    if '://' not in args.workdir:
        args.workdir = os.path.abspath(args.workdir)
    return args, passthrough


def main(argv: list[str]) -> int:
    args, passthrough = parse_args(argv)
    os.makedirs(args.logs, exist_ok=True)
    return supervise(args, passthrough)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
