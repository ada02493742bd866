"""Submit train.py (or evaluate.py) to a SLURM GPU cluster: an sbatch script with one srun step.

    python scripts/launch_slurm.py --nodes=2 --gpus_per_node=8 --partition=gpu \\
        --config=configs/wmt14_ende_big.py --workdir=/shared/runs/big --dry_run \\
        -- --config.batch_size=512

One process per GPU (default; --per=node: one per node driving all its GPUs), each started by
srun with the same flags and `--distributed`: jax.distributed.initialize() reads SLURM's variables
(SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) for the
coordinator, the process count and id, and gives process SLURM_LOCALID the GPU of that index;
with one process per node JAX_LOCAL_DEVICE_IDS hands it all the node's GPUs. The workdir must be
on a file system every node sees. Logs: <logs>/<job>-<jobid>.out (the batch script) and
<logs>/<job>-<jobid>-<task>.out (one per process). SIGTERM reaches the processes --signal_s
seconds before the time limit, so t2t saves a checkpoint; submitting again resumes from it.
Each run of the job gets T2T_ATTEMPT=slurm-<jobid>:<SLURM_RESTART_COUNT> (the goodput ledger's
count of attempts: a requeue, by --max_restarts or by SLURM itself, is the next one).
The script is written to <logs>/<job>.sbatch and submitted with sbatch; --dry_run prints both.
Arguments after `--` go to the script verbatim.

--wait (what sweep.py uses) blocks until the job ends (`sbatch --wait`), then prints process 0's
log and exits with the job's status. SIGTERM or SIGINT then cancels the job (scancel: SLURM sends
its processes SIGTERM, so t2t saves a checkpoint, and SIGKILL KillWait seconds later); a
killed sbatch --wait alone would leave the job running.
"""

from __future__ import annotations

import os
import pty
import shlex
import shutil
import signal
import subprocess
import sys

import launch_args  # scripts/: the directory of this script is on sys.path


def requeue_lines(max_restarts: int) -> list[str]:
    """After the srun step: a restartable failure requeues the job (up to max_restarts times).

    SLURM reruns a requeued job under the same id with SLURM_RESTART_COUNT one higher, and
    train.py resumes from the last checkpoint. Restartable: t2t's statuses for the pod's weather
    (t2t/infra/exits.py) and a task ended by a signal (srun: 128 + the signal). Exit 1 (an error a
    rerun repeats) and 0 end the job. `scontrol requeue` needs no cluster setting (RequeueExit in
    slurm.conf is the administrator's way to the same end).
    """
    return [
        'status=$?',
        'set -e',
        'case $status in',
        f'  {launch_args.restartable_pattern()}) restartable=1 ;;',
        '  *) restartable=0 ;;',
        'esac',
        f'if [ "$restartable" = 1 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_restarts} ]; then',
        f'  echo "t2t: srun ended with exit status $status; requeueing job $SLURM_JOB_ID '
        f'(restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of {max_restarts})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        'fi',
        'exit $status',
    ]


def sbatch_script(args, passthrough: list[str]) -> str:
    """The batch script: #SBATCH resources, environment, one srun step running t2t."""
    per_gpu = args.per == 'gpu' and args.gpus_per_node > 0
    tasks_per_node = args.tasks_per_node or (args.gpus_per_node if per_gpu else 1)
    logs = args.logs
    directives = [
        f'--job-name={args.job_name}',
        f'--nodes={args.nodes}',
        f'--ntasks-per-node={tasks_per_node}',
        *([f'--gpus-per-node={args.gpus_per_node}'] if args.gpus_per_node else []),
        f'--output={logs}/%x-%j.out',
        '--open-mode=append',  # a requeued job appends to its logs
    ]
    if args.cpus_per_task:
        directives.append(f'--cpus-per-task={args.cpus_per_task}')
    for name in ('time', 'partition', 'account', 'qos'):
        if getattr(args, name):
            directives.append(f'--{name}={getattr(args, name)}')
    if args.signal_s:
        directives.append(f'--signal=TERM@{args.signal_s}')  # to the job steps: t2t checkpoints
    if args.requeue or args.max_restarts:
        directives.append('--requeue')
    script = launch_args.script(args)
    argv = [args.python, script, f'--config={args.config}', f'--workdir={args.workdir}',
            '--distributed', *passthrough]
    # append: a requeued job's tasks write on after the earlier run's lines (srun truncates)
    srun = ['srun', '--kill-on-bad-exit=1', '--open-mode=append',
            f'--output={logs}/%x-%j-%t.out']
    if per_gpu:
        srun.append('--gpu-bind=none')  # every task sees the node's GPUs; jax picks SLURM_LOCALID
    processes = args.nodes * tasks_per_node
    each = (f'one per {args.per}' if not args.tasks_per_node else
            f'{tasks_per_node} per node')
    lines = ['#!/bin/bash'] + [f'#SBATCH {d}' for d in directives] + [
        f'# t2t {script}: {processes} processes, {each} '
        f'({args.nodes} nodes x {args.gpus_per_node} GPUs)',
        'set -eo pipefail',
        f'cd {shlex.quote(args.chdir)}',
        *args.setup,
        # One identity per run of the job (the start-up handshake refuses another's processes).
        'export T2T_JOB_ID="slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
        # The goodput ledger's count of attempts: a requeue is the same job, one restart later.
        'export T2T_ATTEMPT="slurm-$SLURM_JOB_ID:${SLURM_RESTART_COUNT:-0}"',
    ]
    if not per_gpu and args.gpus_per_node:
        ids = ','.join(str(i) for i in range(args.gpus_per_node))
        lines.append(f'export JAX_LOCAL_DEVICE_IDS={ids}  # all GPUs of the node to its process')
    step = f'{shlex.join(srun)} \\\n    {shlex.join(argv)}'
    if args.max_restarts:
        lines += ['set +e  # the step\'s status decides the requeue', step,
                  *requeue_lines(args.max_restarts)]
    else:
        lines.append(step)
    return '\n'.join(lines) + '\n'


def parse_args(argv: list[str]):
    argv, passthrough = launch_args.split_at_dashes(argv)
    p = launch_args.parser(__doc__)
    p.add_argument('--nodes', type=int, required=True)
    p.add_argument('--gpus_per_node', type=int, required=True)
    p.add_argument('--per', choices=('gpu', 'node'), default='gpu',
                   help='one process per GPU (default) or per node')
    p.add_argument('--config', default='configs/wmt14_ende_big.py')
    p.add_argument('--workdir', required=True, help='on a file system shared by all nodes')
    p.add_argument('--job_name', default='t2t')
    p.add_argument('--time', default='', help='time limit, e.g. 2-00:00:00')
    p.add_argument('--partition', default='')
    p.add_argument('--account', default='')
    p.add_argument('--qos', default='')
    p.add_argument('--cpus_per_task', type=int, default=0)
    p.add_argument('--signal_s', type=int, default=300,
                   help='SIGTERM this many seconds before the time limit (0: none)')
    p.add_argument('--requeue', action='store_true', help='#SBATCH --requeue')
    p.add_argument('--max_restarts', type=int, default=0,
                   help='requeue the job after a restartable failure (a signal, exit 3/4/5) up '
                   'to this many times; it resumes from the last checkpoint')
    p.add_argument('--tasks_per_node', type=int, default=0,
                   help='processes per node (default: --gpus_per_node, 1 with --per=node); with '
                   '--gpus_per_node=0 for CPU nodes')
    p.add_argument('--setup', action='append', default=[],
                   help='a shell line run before srun (repeatable), e.g. "module load cuda/12"')
    p.add_argument('--python', default='.venv/bin/python', help='relative to --chdir or absolute')
    p.add_argument('--chdir', default=os.getcwd(), help='the t2t checkout (default: here)')
    p.add_argument('--logs', default='', help='log directory (default: <chdir>/logs)')
    p.add_argument('--evaluate', action='store_true', help='run evaluate.py instead of train.py')
    p.add_argument('--wait', action='store_true',
                   help='block until the job ends, exit with its status; SIGTERM/SIGINT cancel it')
    p.add_argument('--dry_run', action='store_true', help='print the script and sbatch command')
    args = p.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 0 or args.tasks_per_node < 0 \
            or args.max_restarts < 0:
        p.error(f'--nodes={args.nodes} must be >= 1, --gpus_per_node={args.gpus_per_node}, '
                f'--tasks_per_node={args.tasks_per_node} and --max_restarts={args.max_restarts} '
                '>= 0')
    if args.gpus_per_node == 0 and not args.tasks_per_node:
        p.error('--gpus_per_node=0 (CPU nodes) needs --tasks_per_node')
    args.chdir = os.path.abspath(args.chdir)
    args.logs = os.path.abspath(args.logs or os.path.join(args.chdir, 'logs'))
    if '://' not in args.workdir:  # every node resolves it the same way
        args.workdir = os.path.abspath(args.workdir)
    if any(c.isspace() for c in args.logs):  # #SBATCH lines are not shell-quoted
        p.error(f'--logs={args.logs!r}: the log directory may not contain spaces')
    return args, passthrough


def main(argv: list[str]) -> int:
    args, passthrough = parse_args(argv)
    script = sbatch_script(args, passthrough)
    path = os.path.join(args.logs, f'{args.job_name}.sbatch')
    # --parsable: the first line sbatch prints is the job id (JOBID or JOBID;CLUSTER).
    command = ['sbatch', '--wait', '--parsable', path] if args.wait else ['sbatch', path]
    if args.dry_run:
        print(f'# {path}\n{script}\n{shlex.join(command)}')
        return 0
    os.makedirs(args.logs, exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        f.write(script)
    if not args.wait:
        return subprocess.run(command, check=False).returncode
    job, status = submit_and_wait(command)
    if job:
        show_log(os.path.join(args.logs, f'{args.job_name}-{job[-1]}-0.out'), job[-1], status)
    return status


def submit_and_wait(command: list[str]) -> tuple[list[str], int]:
    """Runs `sbatch --wait --parsable ...`; returns (scancel's job arguments, exit status).

    SIGTERM / SIGINT cancel the job once its id is known (at once if it already is). sbatch
    prints the id when the job is queued, but C's stdout into a pipe is flushed only at exit:
    on a pseudo-terminal it is line-buffered, so the id arrives while sbatch waits.
    """
    job, signals = [], []

    def cancel(signum, frame):
        signals.append(signum)
        if job:
            subprocess.run(['scancel', *job], check=False)

    old = {s: signal.signal(s, cancel) for s in (signal.SIGTERM, signal.SIGINT)}
    leader, follower = pty.openpty()
    try:
        # Its own session: a Ctrl-C in the terminal reaches this process (which cancels the
        # job), not sbatch.
        sbatch = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower,
                                  start_new_session=True)
    finally:
        os.close(follower)
    output = b''
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: sbatch has closed the terminal
                break
            if not chunk:
                break
            first_line = b'\n' not in output and b'\n' in output + chunk
            output += chunk
            if first_line:
                first = output.split(b'\n')[0].decode(errors='replace').strip()
                jobid, _, cluster = first.partition(';')
                if not jobid.isdigit():
                    print(f'launch_slurm: no job id in sbatch\'s output {first!r}: a signal '
                          'cannot cancel the job', file=sys.stderr, flush=True)
                    continue
                job[:] = [*([f'--clusters={cluster}'] if cluster else []), jobid]
                print(f'submitted batch job {jobid}; waiting for it to end', flush=True)
                if signals:  # the signal came while sbatch was submitting
                    subprocess.run(['scancel', *job], check=False)
        status = sbatch.wait()
    finally:
        os.close(leader)
        for s, handler in old.items():
            signal.signal(s, handler)
    return job, status


def show_log(path: str, jobid: str, status: int) -> None:
    """Process 0's log on stdout (the caller sees t2t's output); if the job failed, its last
    line on stderr."""
    tail = b''
    try:
        with open(path, 'rb') as f:
            sys.stdout.flush()
            shutil.copyfileobj(f, sys.stdout.buffer)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read()
    except OSError:  # the job never started: no log
        pass
    sys.stdout.flush()
    if status:
        text = tail.decode('utf-8', errors='replace')
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        last = f'; process 0\'s last line: {lines[-1]}' if lines else ''
        print(f'job {jobid} ended with exit status {status}{last}', file=sys.stderr)


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
