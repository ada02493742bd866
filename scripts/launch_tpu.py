"""Run train.py (or evaluate.py) on every host of a Cloud TPU VM slice, with one gcloud command.

    python scripts/launch_tpu.py --tpu=my-v5e --zone=us-west4-a --setup \\
        --repo=https://github.com/ORG/t2t.git --ref=main --dry_run
    python scripts/launch_tpu.py --tpu=my-v5e --zone=us-west4-a \\
        --config=configs/wmt14_ende_big.py --workdir=gs://BUCKET/runs/big \\
        -- --config.batch_size=512 --config.mesh_shape=1,-1,1

Every worker runs the same command (`gcloud compute tpus tpu-vm ssh --worker=all`): the same
config and overrides, `--distributed` so that jax.distributed.initialize() finds the other hosts
itself (Cloud TPU metadata), and the same workdir, which must be shared by all hosts (a gs://
bucket). Each worker's output goes to ~/t2t-logs/<script>-<hostname>.log on that worker (also
streamed back here unless --detach). Arguments after `--` go to the script verbatim.
--dry_run prints the gcloud command lines instead of running them.

--max_restarts=R: each worker runs the script in a loop that reruns it after a restartable failure
(t2t/infra/exits.py: a hang, a lost peer, a storage outage, or a signal), up to R times; when one
host fails, the others' processes end too (jax's heartbeats, the watchdog), every loop reruns, and
the processes meet again and resume from the last checkpoint. 0 (finished, or saved after SIGTERM)
and 1 (an error) end the loop. Every run gets T2T_ATTEMPT=<job id>:<restarts so far> (the goodput
ledger counts the attempts by it, also those killed before their first record). For restarts
that survive the VM itself (a host replaced, a slice preempted), run under GKE JobSet or a queued
resource: see docs/clusters.md.

Without --detach the command blocks until every worker's script ends and exits with its status
(what sweep.py uses). SIGTERM or SIGINT then sends SIGTERM to the script on every worker (one more
gcloud ssh running pkill): t2t saves a checkpoint and exits, and the command returns.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import uuid

import launch_args  # scripts/: the directory of this script is on sys.path

LOG_DIR = '~/t2t-logs'  # on each worker; '~' expands there
RESTART_PAUSE_S = 5  # between a failure and the rerun: the other hosts' processes end meanwhile
ATTEMPT_ENV = 'T2T_ATTEMPT'  # '<launch>:<n>', the goodput ledger's count (t2t/goodput/ledger.py)


def gcloud_ssh(args, remote: str) -> list[str]:
    """The gcloud command that runs the shell command `remote` on every worker of the slice."""
    cmd = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', args.tpu, f'--zone={args.zone}',
           '--worker=all', f'--command={remote}']
    if args.project:
        cmd.insert(6, f'--project={args.project}')
    return cmd


def setup_command(args) -> str:
    """Clones (or updates) the repository at --ref into --dir and installs t2t with the tpu extra.

    gcsfs lets orbax / etils read and write gs:// paths.
    """
    d, ref, repo = shlex.quote(args.dir), shlex.quote(args.ref), shlex.quote(args.repo)
    py = shlex.quote(args.python)
    return (f'set -e; if [ ! -d {d}/.git ]; then git clone --quiet {repo} {d}; fi; '
            f'git -C {d} fetch --quiet origin {ref}; '
            f'git -C {d} checkout --quiet --detach FETCH_HEAD; cd {d}; {py} -m venv .venv; '
            '.venv/bin/pip install --quiet --upgrade pip; '
            ".venv/bin/pip install --quiet -e '.[tpu]' gcsfs")


def run_command(args, passthrough: list[str]) -> str:
    """The shell command each worker runs: the script with the same flags on every host (with
    --max_restarts, in a loop that reruns it after a restartable failure)."""
    argv = [*_script_start(args), *passthrough]
    # $(hostname) expands on the worker
    log = f'{LOG_DIR}/{launch_args.script(args)[:-3]}-$(hostname).log'
    cd = f'cd {shlex.quote(args.dir)} && mkdir -p {LOG_DIR}'
    launch = shlex.quote(args.job_id)
    if args.max_restarts:
        cd += f' && export T2T_JOB_ID={launch}'
        if args.detach:
            loop = restart_loop(shlex.join(argv), args.max_restarts, launch=launch)
            return f'{cd} && nohup bash -c {shlex.quote(loop)} >> {log} 2>&1 < /dev/null &'
        return f'{cd} || exit 1; ' + restart_loop(f'{shlex.join(argv)} 2>&1 | tee -a {log}',
                                          args.max_restarts, '${PIPESTATUS[0]}', launch)
    cd += f' && export {ATTEMPT_ENV}={launch}:0'  # the launch's only attempt
    if args.detach:  # keeps running after the ssh session ends
        return f'{cd} && nohup {shlex.join(argv)} > {log} 2>&1 < /dev/null &'
    return f'set -o pipefail; {cd} && {shlex.join(argv)} 2>&1 | tee -a {log}'


def restart_loop(command: str, max_restarts: int, status: str = '$?', launch: str = '') -> str:
    """A worker's loop: run `command`; rerun it after a restartable failure, up to max_restarts.

    When one host's process fails, the others' end too (jax's heartbeats, the watchdog's
    hang_timeout_s), so every worker's loop reruns at about the same time and the processes meet
    again in the start-up handshake; train.py resumes from the last checkpoint. 0 (finished, or
    saved after SIGTERM) and 1 (an error a rerun repeats) end the loop. The job identity
    (T2T_JOB_ID) is the launch's: a worker runs one process at a time, so no earlier attempt's
    process can stand in for a later one's. Each run is attempt <launch>:<restarts> of the
    goodput ledger ($T2T_ATTEMPT): every worker's loop counts the same restarts.
    """
    attempt = f'export {ATTEMPT_ENV}={launch}:$restarts; ' if launch else ''
    return (f'restarts=0; while true; do {attempt}{command}; status={status}; '
            f'case $status in {launch_args.restartable_pattern()}) ;; *) exit $status ;; esac; '
            f'if [ $restarts -ge {max_restarts} ]; then echo "t2t: $(hostname): exit status '
            f'$status; all {max_restarts} restarts spent"; exit $status; fi; '
            'restarts=$((restarts + 1)); echo "t2t: $(hostname): exit status $status; restart '
            f'$restarts of {max_restarts}"; sleep {RESTART_PAUSE_S}; done')


def _script_start(args) -> list[str]:
    return ['.venv/bin/python', launch_args.script(args), f'--config={args.config}',
            f'--workdir={args.workdir}', '--distributed']


def stop_command(args) -> str:
    """SIGTERM to the script that run_command started on a worker (it saves and exits)."""
    start = ' '.join(_script_start(args))  # as /proc/PID/cmdline reads, which pkill -f matches
    pattern = '^' + re.sub(r'([][.()*+?{}|^$\\])', r'\\\1', start) + '( |$)'
    return f'pkill -TERM -f -- {shlex.quote(pattern)} || true'  # pkill: 1 when none matched


def parse_args(argv: list[str]):
    argv, passthrough = launch_args.split_at_dashes(argv)
    p = launch_args.parser(__doc__)
    p.add_argument('--tpu', required=True, help='TPU VM name (gcloud compute tpus tpu-vm create)')
    p.add_argument('--zone', required=True)
    p.add_argument('--project', default='', help='default: gcloud\'s configured project')
    p.add_argument('--config', default='configs/wmt14_ende_big.py')
    p.add_argument('--workdir', default='',
                   help='shared by all hosts: gs://BUCKET/PATH (checkpoints, metrics)')
    p.add_argument('--dir', default='t2t', help='the checkout on each worker, relative to ~')
    p.add_argument('--setup', action='store_true',
                   help='first clone/update --repo at --ref into --dir and pip install on all')
    p.add_argument('--setup_only', action='store_true', help='--setup, then do not launch')
    p.add_argument('--repo', default='', help='git URL of t2t (with --setup)')
    p.add_argument('--ref', default='main', help='branch, tag or commit (with --setup)')
    p.add_argument('--python', default='python3', help='interpreter for the venv (>= 3.11)')
    p.add_argument('--evaluate', action='store_true',
                   help='run evaluate.py instead of train.py (on every worker)')
    p.add_argument('--detach', action='store_true',
                   help='start in the background (nohup) and return; logs stay on the workers')
    p.add_argument('--max_restarts', type=int, default=0,
                   help='on every worker, rerun the script after a restartable failure (a signal, '
                   'exit 3/4/5) up to this many times; it resumes from the last checkpoint')
    p.add_argument('--job_id', default='',
                   help='T2T_JOB_ID of this launch, the same on every worker, and the launch in '
                   'T2T_ATTEMPT (default: random)')
    p.add_argument('--dry_run', action='store_true', help='print the gcloud commands only')
    args = p.parse_args(argv)
    if args.max_restarts < 0:
        p.error(f'--max_restarts={args.max_restarts} must be >= 0')
    args.job_id = args.job_id or f'tpu-{uuid.uuid4().hex[:12]}'
    args.setup = args.setup or args.setup_only
    if args.setup and not args.repo:
        p.error('--setup needs --repo (the git URL to clone on every worker)')
    if not args.setup_only and not args.workdir:
        p.error('--workdir is required (gs://BUCKET/PATH, shared by all hosts)')
    if args.workdir and not args.workdir.startswith('gs://'):
        print(f'warning: --workdir={args.workdir} is not a gs:// path: every host must see the '
              'same directory (a shared file system)', file=sys.stderr)
    return args, passthrough


def commands(args, passthrough: list[str]) -> list[list[str]]:
    """The gcloud command lines, in order: the setup (optional), then the launch."""
    cmds = [gcloud_ssh(args, setup_command(args))] if args.setup else []
    if not args.setup_only:
        cmds.append(gcloud_ssh(args, run_command(args, passthrough)))
    return cmds


def main(argv: list[str]) -> int:
    args, passthrough = parse_args(argv)
    cmds = commands(args, passthrough)
    launch = None if args.setup_only else cmds[-1]
    for cmd in cmds:
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        status = run_blocking(cmd, args) if cmd is launch and not args.detach else \
            subprocess.run(cmd, check=False).returncode
        if status:
            return status
    return 0


def run_blocking(cmd: list[str], args) -> int:
    """Runs the launch; SIGTERM / SIGINT stop the script on every worker, then it returns."""
    def stop(signum, frame):
        print(f'launch_tpu: {signal.Signals(signum).name}: sending SIGTERM to the workers',
              file=sys.stderr, flush=True)
        subprocess.run(gcloud_ssh(args, stop_command(args)), check=False)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Its own session: a Ctrl-C reaches this process only, and the stream from the workers
        # stays open while their script saves.
        return subprocess.Popen(cmd, start_new_session=True).wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
