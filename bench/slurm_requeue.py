"""SLURM for real: a 2-task job of scripts/launch_slurm.py trains tiny on a one-node cluster on
localhost, one task is SIGKILLed, the job requeues itself and resumes to the parameters of an
uninterrupted job, bit for bit.

    apt-get install -y slurm-wlm munge      # Debian's packages, once (as root)
    python bench/slurm_requeue.py [--steps=24] [--kill_after=8]

The cluster (munged, slurmctld, slurmd in the foreground, everything under a temporary directory)
is started here and stopped at the end. Each task is one train.py process with 4 CPU devices;
jax.distributed.initialize() finds the others from SLURM's variables (--distributed). Prints one
RESULT line (JSON): the job's restarts, the wall times, the steps redone and whether the final
parameters and metrics.jsonl equal the uninterrupted job's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the checkpoints are compared here, on the CPU

from tests import chaos_run  # noqa: E402  (the tiny run's flags and comparisons)

HOST = socket.gethostname()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def slurm_conf(d: str) -> str:
    cpus = os.cpu_count() or 2
    return '\n'.join([
        'ClusterName=local', f'SlurmctldHost={HOST}(127.0.0.1)', 'SlurmUser=root',
        f'SlurmctldPort={_free_port()}', f'SlurmdPort={_free_port()}',
        'AuthType=auth/munge', 'CredType=cred/munge',
        # cred_expire: a requeued job waits this long before it runs again (default 120 s)
        f'AuthInfo=socket={d}/munge/munge.socket,cred_expire=5',
        'ProctrackType=proctrack/linuxproc', 'TaskPlugin=task/none',
        'SelectType=select/cons_tres', 'SelectTypeParameters=CR_Core',
        'SchedulerParameters=sched_interval=1,bf_interval=1',
        'AccountingStorageType=accounting_storage/none', 'JobCompType=jobcomp/none',
        'MailProg=/bin/true', 'ReturnToService=2', 'KillWait=5', 'MpiDefault=none',
        f'StateSaveLocation={d}/state', f'SlurmdSpoolDir={d}/spool',
        f'SlurmctldPidFile={d}/slurmctld.pid', f'SlurmdPidFile={d}/slurmd.pid',
        f'SlurmctldLogFile={d}/slurmctld.log', f'SlurmdLogFile={d}/slurmd.log',
        f'NodeName={HOST} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN',
        'PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP', ''])


@contextlib.contextmanager
def local_cluster():
    """munged, slurmctld and slurmd on localhost; yields the environment for sbatch & co."""
    d = tempfile.mkdtemp(prefix='t2t-slurm-')
    os.chmod(d, 0o755)  # every directory above munge's socket must be o+x
    for sub in ('munge', 'state', 'spool'):
        os.makedirs(os.path.join(d, sub), mode=0o755)
    key = os.path.join(d, 'munge', 'munge.key')
    subprocess.run(['mungekey', '-c', '-k', key], check=True)
    os.chmod(key, 0o400)
    conf = os.path.join(d, 'slurm.conf')
    with open(conf, 'w') as f:
        f.write(slurm_conf(d))
    env = {**os.environ, 'SLURM_CONF': conf}
    daemons = [subprocess.Popen(
        ['munged', '-F', f'--socket={d}/munge/munge.socket', f'--key-file={key}',
         f'--log-file={d}/munge/munged.log', f'--pid-file={d}/munge/munged.pid',
         f'--seed-file={d}/munge/munged.seed'], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)]
    try:
        time.sleep(0.5)
        for daemon in ('slurmctld', 'slurmd'):
            daemons.append(subprocess.Popen([daemon, '-D', '-f', conf], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(['sinfo', '-h', '-N', '-o', '%T'], env=env,
                                   capture_output=True, text=True).stdout.strip()
            if state == 'idle':
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f'the SLURM node is {state!r} after 60 s (logs in {d})')
            time.sleep(0.3)
        yield env
    finally:
        for p in reversed(daemons):
            p.send_signal(signal.SIGTERM)
        for p in reversed(daemons):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(d, ignore_errors=True)


def submit(env, workdir: str, logs: str, steps: int, data_dir: str, max_restarts: int) -> str:
    """launch_slurm.py: 2 tasks on the node, 4 CPU devices each; returns the job id."""
    flags = f'--xla_force_host_platform_device_count=4 {os.environ.get("XLA_FLAGS", "")}'
    cmd = [sys.executable, os.path.join(ROOT, 'scripts', 'launch_slurm.py'), '--nodes=1',
           '--gpus_per_node=0', '--tasks_per_node=2', f'--max_restarts={max_restarts}',
           '--config=configs/tiny.py', f'--workdir={workdir}', f'--logs={logs}',
           f'--python={sys.executable}', f'--chdir={ROOT}', '--job_name=tiny',
           '--setup=export JAX_PLATFORMS=cpu', f'--setup=export XLA_FLAGS="{flags.strip()}"',
           '--', *chaos_run.train_flags(steps, data_dir)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return re.search(r'Submitted batch job (\d+)', out).group(1)


def job_state(env, job: str) -> tuple[str, int]:
    """(JobState, Restarts) from scontrol."""
    text = subprocess.run(['scontrol', 'show', 'job', job], env=env, capture_output=True,
                          text=True).stdout
    state = re.search(r'JobState=(\S+)', text)
    restarts = re.search(r'Restarts=(\d+)', text)
    return (state.group(1) if state else 'GONE'), int(restarts.group(1)) if restarts else 0


def wait_done(env, job: str, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        state, restarts = job_state(env, job)
        if state in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'GONE'):
            return state, restarts
        if time.monotonic() > deadline:
            subprocess.run(['scancel', job], env=env)
            return f'{state} (cancelled after {timeout_s:.0f} s)', restarts
        time.sleep(0.5)


def task_pid(workdir: str, procid: str) -> int | None:
    """The train.py process of this workdir with SLURM_PROCID=procid."""
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                cmdline = f.read().split(b'\0')
            if b'train.py' not in b' '.join(cmdline) or \
                    f'--workdir={workdir}'.encode() not in cmdline:
                continue
            with open(f'/proc/{pid}/environ', 'rb') as f:
                if f'SLURM_PROCID={procid}'.encode() in f.read().split(b'\0'):
                    return int(pid)
        except OSError:
            continue
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--steps', type=int, default=24)
    p.add_argument('--kill_after', type=int, default=8, help='SIGKILL task 1 after this step')
    p.add_argument('--timeout_s', type=float, default=900)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix='t2t-slurm-run-')
    data_dir = os.path.join(root, 'data')
    result = {}
    with local_cluster() as env:
        t0 = time.monotonic()
        ref = os.path.join(root, 'reference')
        job = submit(env, ref, os.path.join(root, 'logs-ref'), args.steps, data_dir, 0)
        result['reference_state'] = wait_done(env, job, args.timeout_s)[0]
        result['reference_wall_s'] = round(time.monotonic() - t0, 1)

        t0 = time.monotonic()
        run, logs = os.path.join(root, 'run'), os.path.join(root, 'logs-run')
        job = submit(env, run, logs, args.steps, data_dir, 2)
        log0 = os.path.join(logs, f'tiny-{job}-0.out')
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            steps = [int(s) for s in chaos_run.STEP_LINE.findall(chaos_run._read(log0))]
            if steps and steps[-1] >= args.kill_after:
                pid = task_pid(run, '1')
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    result['killed'] = {'task': 1, 'after_step': steps[-1],
                                        'at_s': round(time.monotonic() - t0, 1)}
                    break
            time.sleep(0.1)
        state, restarts = wait_done(env, job, args.timeout_s)
        result.update(state=state, restarts=restarts, wall_s=round(time.monotonic() - t0, 1))
        batch_log = chaos_run._read(os.path.join(logs, f'tiny-{job}.out')).decode()
        result['requeue_lines'] = [line for line in batch_log.splitlines()
                                   if 'requeueing' in line]
        text = chaos_run._read(log0)
        result['resumed_from'] = [int(s) for s in chaos_run.RESUME_LINE.findall(text)]
    counts = chaos_run.step_counts(run)
    result['each_step_once'] = counts == {s: 1 for s in range(1, args.steps + 1)}
    result['params_bitwise_equal'] = chaos_run.params_differ(run, ref, args.steps) == []
    if result.get('killed') and result['resumed_from']:
        result['steps_redone'] = result['killed']['after_step'] - result['resumed_from'][-1]
    print('RESULT ' + json.dumps(result), flush=True)
    ok = (state == 'COMPLETED' and restarts >= 1 and result['each_step_once']
          and result['params_bitwise_equal'])
    if ok:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f'slurm_requeue: not exact or not requeued; files kept in {root}', file=sys.stderr)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
