"""The launchers' --dry_run output: what would run on a TPU pod slice and on a SLURM cluster;
blocking launches that stop their job on SIGTERM (with fake sbatch, scancel and gcloud); the
restarts: the SLURM batch script's requeue, the TPU workers' loop, and launch_local.py's
supervision of fake train.py processes (exits, a self-stopped process, SIGTERM)."""

import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from t2t.goodput import ledger
from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'scripts'))
import launch_local  # noqa: E402
import launch_slurm  # noqa: E402
import launch_tpu  # noqa: E402

# Overrides a shell would mangle if they were not quoted: spaces, quotes, $, globs, commas.
TRICKY = ['--config.mesh_shape=1,-1,1', "--config.tsv_files.train=/data/it's here/*.tsv",
          '--config.tfds_name=wmt14_translate/de-en', '--config.dataset=$HOME;rm -rf x']


def _dry_run(script, argv):
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', script), *argv],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_tpu_launcher_runs_the_same_command_on_every_worker():
    stdout = _dry_run('launch_tpu.py', [
        '--tpu=pod-1', '--zone=us-central2-b', '--project=proj', '--setup',
        '--repo=https://github.com/org/t2t.git', '--ref=v1.0', '--python=python3.11',
        '--config=configs/wmt14_ende_big.py', '--workdir=gs://bucket/runs/big', '--dry_run',
        '--', *TRICKY])
    lines = stdout.strip().splitlines()
    assert len(lines) == 2  # setup, then the launch
    setup, launch = (shlex.split(line) for line in lines)  # as the local shell would split
    for cmd in (setup, launch):
        assert cmd[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'pod-1']
        assert {'--zone=us-central2-b', '--project=proj', '--worker=all'} <= set(cmd)
    remote_setup = next(a for a in setup if a.startswith('--command='))[len('--command='):]
    assert 'git clone --quiet https://github.com/org/t2t.git t2t' in remote_setup
    assert 'fetch --quiet origin v1.0' in remote_setup and 'python3.11 -m venv' in remote_setup
    assert "pip install --quiet -e '.[tpu]'" in remote_setup

    remote = next(a for a in launch if a.startswith('--command='))[len('--command='):]
    words = shlex.split(remote)  # as the worker's shell splits it
    start = words.index('train.py')
    assert words[start - 1] == '.venv/bin/python'
    assert words[start + 1:start + 4] == ['--config=configs/wmt14_ende_big.py',
                                          '--workdir=gs://bucket/runs/big', '--distributed']
    assert words[start + 4:start + 4 + len(TRICKY)] == TRICKY  # verbatim, one word each
    assert words[-3:] == ['tee', '-a', '~/t2t-logs/train-$(hostname).log']
    assert remote.startswith('set -o pipefail; cd t2t && mkdir -p ~/t2t-logs && ')
    # The launch's one attempt, in the goodput ledger's form (no restarts: number 0).
    assert re.search(r' && export T2T_ATTEMPT=tpu-[0-9a-f]{12}:0 && ', remote)


def test_tpu_launcher_detach_evaluate_and_errors():
    args, rest = launch_tpu.parse_args(['--tpu=t', '--zone=z', '--workdir=gs://b/r', '--detach',
                                        '--evaluate', '--', '--split=test'])
    (cmd,) = launch_tpu.commands(args, rest)
    remote = cmd[-1][len('--command='):]
    assert 'nohup .venv/bin/python evaluate.py' in remote
    assert '--distributed --split=test > ~/t2t-logs/evaluate-$(hostname).log 2>&1' in remote
    assert remote.endswith('< /dev/null &') and '--project' not in ' '.join(cmd)
    with pytest.raises(SystemExit):  # --setup without a repository to clone
        launch_tpu.parse_args(['--tpu=t', '--zone=z', '--workdir=gs://b/r', '--setup'])
    with pytest.raises(SystemExit):  # no workdir
        launch_tpu.parse_args(['--tpu=t', '--zone=z'])


def test_slurm_launcher_one_process_per_gpu(tmp_path):
    stdout = _dry_run('launch_slurm.py', [
        '--nodes=4', '--gpus_per_node=8', '--partition=a100', '--time=2-00:00:00',
        '--account=nlp', '--setup=module load cuda/12.4', f'--chdir={tmp_path}',
        '--workdir=/shared/runs/big', '--job_name=big', '--dry_run', '--', *TRICKY])
    header, *body = stdout.splitlines()
    path = f'{tmp_path}/logs/big.sbatch'
    assert header == f'# {path}'
    assert body[-1] == f'sbatch {path}'
    script = '\n'.join(body[:-1])
    assert script.startswith('#!/bin/bash\n')
    for directive in ('--nodes=4', '--ntasks-per-node=8', '--gpus-per-node=8',
                      '--partition=a100', '--time=2-00:00:00', '--account=nlp',
                      f'--output={tmp_path}/logs/%x-%j.out', '--signal=TERM@300'):
        assert f'#SBATCH {directive}\n' in script, directive
    assert '32 processes, one per gpu' in script
    assert f'cd {tmp_path}\nmodule load cuda/12.4\n' in script
    assert 'JAX_LOCAL_DEVICE_IDS' not in script  # jax gives process SLURM_LOCALID its GPU
    step = script[script.index('srun '):].replace('\\\n', '')  # bash joins continued lines
    srun = shlex.split(step)
    assert srun[:5] == ['srun', '--kill-on-bad-exit=1', '--open-mode=append',
                        f'--output={tmp_path}/logs/%x-%j-%t.out', '--gpu-bind=none']
    assert srun[5:10] == ['.venv/bin/python', 'train.py', '--config=configs/wmt14_ende_big.py',
                          '--workdir=/shared/runs/big', '--distributed']
    assert srun[10:] == TRICKY
    assert 'scontrol requeue' not in script and '--requeue' not in script  # no --max_restarts


def test_slurm_launcher_one_process_per_node_submits_the_script(tmp_path, monkeypatch):
    submitted = []
    monkeypatch.setattr(launch_slurm.subprocess, 'run', lambda cmd, check: submitted.append(cmd)
                        or subprocess.CompletedProcess(cmd, 0))
    status = launch_slurm.main(['--nodes=2', '--gpus_per_node=4', '--per=node', '--signal_s=0',
                                f'--chdir={tmp_path}', '--workdir=runs/x', '--evaluate'])
    path = tmp_path / 'logs' / 't2t.sbatch'
    assert status == 0 and submitted == [['sbatch', str(path)]]
    script = path.read_text()
    assert '#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n' in script
    assert 'export JAX_LOCAL_DEVICE_IDS=0,1,2,3' in script and '--signal' not in script
    assert '--gpu-bind' not in script and '2 processes, one per node' in script
    # A relative workdir is resolved where the job is submitted, the same for every node.
    assert f'evaluate.py --config=configs/wmt14_ende_big.py --workdir={os.getcwd()}/runs/x' \
        in script
    with pytest.raises(SystemExit):
        launch_slurm.parse_args(['--nodes=0', '--gpus_per_node=8', '--workdir=/w'])


def _fake(path, body):
    """An executable Python script standing in for a cluster command (sbatch, scancel, gcloud)."""
    path.write_text(f'#!{sys.executable}\nimport os, sys, time\n{body}')
    path.chmod(0o755)


def _fake_env(bin_dir):
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}  # stdio as in C
    return {**env, 'PATH': f'{bin_dir}{os.pathsep}{env["PATH"]}', 'FAKE_DIR': str(bin_dir)}


def test_slurm_launcher_wait_returns_the_job_status_and_cancels_on_sigterm(tmp_path):
    stdout = _dry_run('launch_slurm.py', ['--nodes=1', '--gpus_per_node=1', f'--chdir={tmp_path}',
                                          '--workdir=/w', '--wait', '--dry_run'])
    assert stdout.splitlines()[-1] == f'sbatch --wait --parsable {tmp_path}/logs/t2t.sbatch'

    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    # Like sbatch: the job id printed through stdio (flushed at exit when stdout is a pipe), then
    # it waits for the job. Job 7 has ended with status 3; job 8 runs until it is cancelled.
    _fake(bin_dir / 'sbatch', '''d = os.environ['FAKE_DIR']
job = '7' if os.path.exists(os.path.join(d, 'job7')) else '8'
print(job)
deadline = time.monotonic() + 60  # bounded, should the test fail
while job == '8' and not os.path.exists(os.path.join(d, 'cancelled')):
    time.sleep(0.02)
    if time.monotonic() > deadline:
        sys.exit('never cancelled')
sys.exit(3 if job == '7' else 1)
''')
    _fake(bin_dir / 'scancel', '''d = os.environ['FAKE_DIR']
with open(os.path.join(d, 'cancelled'), 'w') as f:
    f.write(' '.join(sys.argv[1:]))
''')
    argv = [sys.executable, os.path.join(ROOT, 'scripts', 'launch_slurm.py'), '--nodes=1',
            '--gpus_per_node=1', f'--chdir={tmp_path}', '--workdir=/w', '--wait']

    (bin_dir / 'job7').touch()
    (tmp_path / 'logs').mkdir()
    (tmp_path / 'logs' / 't2t-7-0.out').write_text('step 1 | loss 9.1\ntrain.py: out of memory\n')
    done = subprocess.run(argv, env=_fake_env(bin_dir), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3  # the job's status
    assert done.stdout == ('submitted batch job 7; waiting for it to end\n'
                           'step 1 | loss 9.1\ntrain.py: out of memory\n')  # task 0's log
    assert done.stderr.strip().splitlines()[-1] == (
        "job 7 ended with exit status 3; process 0's last line: train.py: out of memory")

    (bin_dir / 'job7').unlink()
    waiting = subprocess.Popen(argv, env=_fake_env(bin_dir), stdout=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout.readline() == 'submitted batch job 8; waiting for it to end\n'
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=30) == 1  # sbatch --wait returned once the job was cancelled
    finally:
        waiting.kill()
    assert (bin_dir / 'cancelled').read_text() == '8'


def test_tpu_launcher_sigterm_stops_the_script_on_every_worker(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    # Like gcloud ssh --worker=all: the launch streams until the workers' train.py ends, which it
    # does once the stop command (pkill) has reached them.
    _fake(bin_dir / 'gcloud', '''d = os.environ['FAKE_DIR']
with open(os.path.join(d, 'calls'), 'a') as f:
    f.write(repr(sys.argv[1:]) + '\\n')
if 'pkill' in sys.argv[-1]:
    open(os.path.join(d, 'stopped'), 'w').close()
    sys.exit(0)
open(os.path.join(d, 'started'), 'w').close()
deadline = time.monotonic() + 60  # bounded, should the test fail
while not os.path.exists(os.path.join(d, 'stopped')):
    time.sleep(0.02)
    if time.monotonic() > deadline:
        sys.exit('never stopped')
print('finished at step 40 (preemption)')
''')
    workdir = '/mnt/gcs/sweep/num_heads=1'
    launch = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'scripts', 'launch_tpu.py'), '--tpu=pod',
         '--zone=z', f'--workdir={workdir}', '--', '--config.num_heads=1'],
        env=_fake_env(bin_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (bin_dir / 'started').exists():
            assert launch.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        launch.send_signal(signal.SIGTERM)
        out, err = launch.communicate(timeout=30)
    finally:
        launch.kill()
    assert launch.returncode == 0 and out == 'finished at step 40 (preemption)\n'
    assert 'SIGTERM: sending SIGTERM to the workers' in err
    calls = [ast.literal_eval(line) for line in (bin_dir / 'calls').read_text().splitlines()]
    assert len(calls) == 2 and calls[1][:7] == ['compute', 'tpus', 'tpu-vm', 'ssh', 'pod',
                                                '--zone=z', '--worker=all']
    stop = shlex.split(calls[1][-1][len('--command='):])
    assert stop[:4] == ['pkill', '-TERM', '-f', '--'] and stop[5:] == ['||', 'true']
    pattern = stop[4]  # the workers' train.py of this workdir, and nothing else
    assert re.search(pattern, f'.venv/bin/python train.py --config=configs/wmt14_ende_big.py '
                     f'--workdir={workdir} --distributed --config.num_heads=1')
    for other in (f'bash -c .venv/bin/python train.py --config=configs/wmt14_ende_big.py '
                  f'--workdir={workdir} --distributed',
                  '.venv/bin/python train.py --config=configs/wmt14_ende_big.py '
                  f'--workdir={workdir}0 --distributed'):
        assert not re.search(pattern, other)


@pytest.mark.parametrize('srun_status, restart_count, requeued', [
    (137, None, True),  # a task SIGKILLed (srun: 128 + 9): requeued
    (4, '1', True),  # t2t's peer-lost status, one restart already made
    (3, '2', False),  # a hang, but both restarts are spent
    (1, None, False),  # an error a rerun would repeat
    (0, None, False),  # finished
])
def test_slurm_batch_script_requeues_restartable_failures(tmp_path, monkeypatch, srun_status,
                                                          restart_count, requeued):
    args, rest = launch_slurm.parse_args([
        '--nodes=1', '--gpus_per_node=0', '--tasks_per_node=2', '--max_restarts=2',
        f'--chdir={tmp_path}', '--workdir=/w', '--signal_s=0'])
    script = launch_slurm.sbatch_script(args, rest)
    assert '#SBATCH --ntasks-per-node=2\n' in script and '#SBATCH --requeue\n' in script
    assert '--gpus-per-node' not in script and '--gpu-bind' not in script
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    # srun records the job identity its tasks get and ends with the status under test.
    _fake(bin_dir / 'srun', f'''d = os.environ['FAKE_DIR']
with open(os.path.join(d, 'job_id'), 'w') as f:
    f.write(os.environ['T2T_JOB_ID'] + ' ' + os.environ['T2T_ATTEMPT'])
sys.exit({srun_status})
''')
    _fake(bin_dir / 'scontrol', '''d = os.environ['FAKE_DIR']
with open(os.path.join(d, 'scontrol_calls'), 'w') as f:
    f.write(' '.join(sys.argv[1:]))
''')
    env = {**_fake_env(bin_dir), 'SLURM_JOB_ID': '41'}
    if restart_count is not None:
        env['SLURM_RESTART_COUNT'] = restart_count
    (tmp_path / 'job.sh').write_text(script)
    done = subprocess.run(['bash', str(tmp_path / 'job.sh')], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == srun_status, done.stderr
    # The goodput ledger's attempt: the job's launch, numbered by its requeues.
    assert (bin_dir / 'job_id').read_text() == \
        f'slurm-41-{restart_count or 0} slurm-41:{restart_count or 0}'
    monkeypatch.setenv(ledger.LAUNCH_ENV, (bin_dir / 'job_id').read_text().split()[1])
    assert ledger.launch_attempt() == {'launch': 'slurm-41', 'number': int(restart_count or 0)}
    if requeued:
        assert (bin_dir / 'scontrol_calls').read_text() == 'requeue 41'
        n = int(restart_count or 0) + 1
        assert done.stdout == (f't2t: srun ended with exit status {srun_status}; requeueing job '
                               f'41 (restart {n} of 2)\n')
    else:
        assert not (bin_dir / 'scontrol_calls').exists() and done.stdout == ''


@pytest.mark.parametrize('statuses, max_restarts, runs, final', [
    ([137, 4, 0], 3, 3, 0),  # SIGKILLed, then a lost peer: rerun twice, then finished
    ([137, 137], 1, 2, 137),  # the restarts spent: the last status
    ([1, 0], 3, 1, 1),  # an error ends the loop at once
])
def test_tpu_worker_loop_reruns_after_restartable_failures(tmp_path, monkeypatch, statuses,
                                                           max_restarts, runs, final):
    monkeypatch.setattr(launch_tpu, 'RESTART_PAUSE_S', 0)
    checkout = tmp_path / 't2t'
    (checkout / '.venv' / 'bin').mkdir(parents=True)
    # The worker's python: ends with the next status of the list, records its job identity.
    _fake(checkout / '.venv' / 'bin' / 'python', f'''d = os.environ['FAKE_DIR']
with open(os.path.join(d, 'runs'), 'a') as f:
    f.write(os.environ['T2T_JOB_ID'] + ' ' + ' '.join(sys.argv[1:]) + '\\n')
with open(os.path.join(d, 'attempts'), 'a') as f:
    f.write(os.environ['T2T_ATTEMPT'] + '\\n')
n = len(open(os.path.join(d, 'runs')).readlines())
print('run', n)
sys.exit({statuses}[n - 1])
''')
    args, rest = launch_tpu.parse_args(['--tpu=t', '--zone=z', '--workdir=gs://b/r',
                                        f'--dir={checkout}', f'--max_restarts={max_restarts}',
                                        '--job_id=launch-7', '--', '--config.num_heads=2'])
    (cmd,) = launch_tpu.commands(args, rest)
    remote = cmd[-1][len('--command='):]
    env = {**_fake_env(tmp_path), 'HOME': str(tmp_path)}
    done = subprocess.run(['bash', '-c', remote], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == final, done.stderr
    calls = (tmp_path / 'runs').read_text().splitlines()
    assert len(calls) == runs
    # Each run is the next attempt of the launch (the goodput ledger counts them).
    assert (tmp_path / 'attempts').read_text().splitlines() == \
        [f'launch-7:{i}' for i in range(runs)]
    # The same command and job identity every time (the processes of one launch meet again).
    assert set(calls) == {'launch-7 train.py --config=configs/wmt14_ende_big.py '
                          '--workdir=gs://b/r --distributed --config.num_heads=2'}
    lines = done.stdout.splitlines()
    restarts = [line.split(': ', 2)[2] for line in lines if line.startswith('t2t: ')]
    expected = [f'exit status {statuses[i]}; restart {i + 1} of {max_restarts}'
                for i in range(min(runs - 1, max_restarts))]
    if final == statuses[runs - 1] and final and runs == max_restarts + 1:
        expected.append(f'exit status {final}; all {max_restarts} restarts spent')
    assert restarts == expected
    # Every run's output is in the worker's log too.
    log = (tmp_path / 't2t-logs').glob('train-*.log')
    assert [line for line in next(log).read_text().splitlines() if line.startswith('run')] == \
        [f'run {i + 1}' for i in range(runs)]
    # Detached, the loop runs under nohup with its output in the same log.
    args.detach = True
    remote = launch_tpu.run_command(args, rest)
    assert remote.startswith(f'cd {checkout} && mkdir -p ~/t2t-logs && export T2T_JOB_ID='
                             'launch-7 && nohup bash -c ')
    assert remote.endswith('>> ~/t2t-logs/train-$(hostname).log 2>&1 < /dev/null &')


# --- launch_local.py ------------------------------------------------------------------------------

# A stand-in for `python train.py ...`: what process i does in attempt k is FAKE_PLAN[k][i]
# ('ok', 'finish': exit 0 after writing TRAINING_FINISHED, 'exit N', 'stop': SIGSTOP itself,
# 'eval stop': print an evaluation's step line, then SIGSTOP itself, 'step stop': print a training
# step line in two pieces, then SIGSTOP itself, 'term': print a line, wait for SIGTERM, exit 0);
# it records its job id, port and argv.
FAKE_TRAIN = '''import json, signal
argv = sys.argv[2:]
flag = lambda name: next(a.split('=', 1)[1] for a in argv if a.startswith(f'--{name}='))
workdir, i = flag('workdir'), int(flag('process_id'))
d = os.environ['FAKE_DIR']
k = len([n for n in os.listdir(d) if n.startswith('run-') and n.endswith(f'-{i}')])
with open(os.path.join(d, f'run-{k}-{i}'), 'w') as f:
    json.dump({'job': os.environ['T2T_JOB_ID'], 'port': flag('coordinator_address'),
               'devices': os.environ['XLA_FLAGS'], 'argv': argv}, f)
action = json.loads(os.environ['FAKE_PLAN'])[k][i]
if i == 0:
    print(f'attempt {k}', flush=True)
if action == 'finish':
    with open(os.path.join(workdir, 'TRAINING_FINISHED'), 'w') as f:
        json.dump({'step': 9, 'stopped_by': 'num_train_steps'}, f)
elif action.startswith('exit'):
    time.sleep(0.3)
    sys.exit(int(action.split()[1]))
elif action == 'stop':
    os.kill(os.getpid(), signal.SIGSTOP)
elif action == 'eval stop':
    print('step 6 | eval_loss 7.9', flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
elif action == 'step stop':
    print('step 1 ', end='', flush=True)
    time.sleep(0.3)
    print('| loss 7.5', flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
elif action == 'term':
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print('waiting for SIGTERM', flush=True)
    time.sleep(60)
    sys.exit(7)
'''


def _local(tmp_path, plan, *flags):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    _fake(bin_dir / 'python', FAKE_TRAIN)
    (tmp_path / 'w').mkdir()
    env = {**_fake_env(bin_dir), 'FAKE_PLAN': json.dumps(plan), 'XLA_FLAGS': '--xla_x=1 '
           '--xla_force_host_platform_device_count=8'}
    argv = [sys.executable, os.path.join(ROOT, 'scripts', 'launch_local.py'), '--processes=2',
            f'--python={bin_dir / "python"}', f'--workdir={tmp_path / "w"}',
            f'--logs={tmp_path / "logs"}', '--config=configs/tiny.py', *flags, '--',
            '--config.num_train_steps=9']
    return bin_dir, env, argv


def _runs(bin_dir):
    return {n: json.loads((bin_dir / n).read_text()) for n in os.listdir(bin_dir)
            if n.startswith('run-')}


def test_local_launcher_restarts_until_training_finished(tmp_path):
    plan = [['ok', 'exit 4'], ['eval stop', 'ok'], ['step stop', 'ok'], ['exit 3', 'ok'],
            ['finish', 'ok']]
    bin_dir, env, argv = _local(tmp_path, plan, '--max_restarts=4', '--hang_timeout_s=1',
                                '--startup_hang_timeout_s=3', '--devices_per_process=3')
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith('launch_local: ')]
    restarts = [re.match(r'launch_local: restart (\d) of 4 at (\d+) s: (.*)$', line).groups()
                for line in lines[:4]]
    assert [(int(n), cause) for n, _, cause in restarts] == [
        (1, 'process 1 exit 4 (peer lost)'),
        (2, 'no output from process 0 for 3 s in start-up (process 0 stopped): taken as a hang'),
        (3, 'no output from process 0 for 1 s in training (process 0 stopped): taken as a hang'),
        (4, 'process 0 exit 3 (hang)')]
    # Each guard waited its own limit: the start-up one 3 s (an evaluation's line is not training),
    # the one in training 1 s (+ a start).
    took = [int(at) for _, at, _ in restarts]
    assert took[1] - took[0] >= 3 and took[2] - took[1] < took[1] - took[0], took
    assert lines[4].startswith('launch_local: training finished at step 9 (num_train_steps) '
                               'after 4 restarts in ')
    printed = {1: 'step 6 | eval_loss 7.9\n', 2: 'step 1 | loss 7.5\n'}
    assert done.stdout == ''.join(f'attempt {k}\n' + printed.get(k, '')
                                  for k in range(5))  # process 0's, streamed
    runs = _runs(bin_dir)
    assert len(runs) == 10
    # Per attempt one job id and port for both processes, new ones each attempt.
    jobs = {k: {runs[f'run-{k}-{i}']['job'] for i in range(2)} for k in range(5)}
    ports = {k: {runs[f'run-{k}-{i}']['port'] for i in range(2)} for k in range(5)}
    assert all(len(j) == 1 for j in jobs.values()) and len(set.union(*jobs.values())) == 5
    assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 5
    assert all(p.startswith('127.0.0.1:') for p in set.union(*ports.values()))
    one = runs['run-0-1']
    assert one['devices'] == '--xla_x=1 --xla_force_host_platform_device_count=3'
    assert one['argv'] == ['--config=configs/tiny.py', f'--workdir={tmp_path / "w"}',
                           '--config.num_train_steps=9',
                           f'--coordinator_address={one["port"]}', '--num_processes=2',
                           '--process_id=1']
    logs = sorted(os.listdir(tmp_path / 'logs'))
    assert len(logs) == 5 * 5 and 'attempt-4-process-1.err' in logs  # every attempt's logs kept


@pytest.mark.parametrize('plan, flags, status, last', [
    ([['ok', 'exit 1']], [], 1, 'process 1 exit 1 (error): a restart cannot fix it'),
    ([['exit 5', 'ok'], ['ok', 'exit 5']], ['--max_restarts=1'], 5,
     'process 1 exit 5 (storage outage); all 1 restarts spent'),
    ([['ok', 'ok']], [], 1, 'every process exited 0 before TRAINING_FINISHED; all 0 restarts'),
])
def test_local_launcher_gives_up(tmp_path, plan, flags, status, last):
    bin_dir, env, argv = _local(tmp_path, plan, '--max_restarts=0', *flags)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == status
    assert last in done.stderr.strip().splitlines()[-1]
    assert len(_runs(bin_dir)) == 2 * len(plan)


def test_local_launcher_sigterm_reaches_every_process(tmp_path):
    bin_dir, env, argv = _local(tmp_path, [['term', 'term']])
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout.readline() == 'attempt 0\n'
        assert launcher.stdout.readline() == 'waiting for SIGTERM\n'
        deadline = time.monotonic() + 30
        while len(_runs(bin_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # process 1 has set its handler by now
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err  # both exited 0 (not 7: the sleep was cut short)
    assert err.strip().splitlines()[-1] == 'launch_local: stopped: every process saved and exited'


def test_local_launcher_arguments_and_failure_order():
    with pytest.raises(SystemExit):
        launch_local.parse_args(['--processes=2', '--workdir=w', '--', '--workdir=x'])
    with pytest.raises(SystemExit):
        launch_local.parse_args(['--processes=0', '--workdir=w'])
    kill, abort = -signal.SIGKILL, -signal.SIGABRT
    # A SIGKILL from outside explains the attempt before the peer's consequent failures.
    assert launch_local.classify([1, kill]) == (1, kill)
    assert launch_local.classify([abort, 4]) == (1, 4)
    assert launch_local.classify([1, abort]) == (1, abort)
    assert launch_local.classify([None, 1]) == (1, 1)
    assert launch_local.classify([0, None]) is None
