"""Sweeps (t2t/sweep/, sweep.py): points and names, a real sweep that is killed and resumed, a
point done by its TRAINING_FINISHED marker, the summary from disk, and the Table 3 points."""

import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from configs import table3_mini
from t2t.eval import evaluation
from t2t.model import Transformer, TransformerConfig
from t2t.sweep import points, report, runner
from tests import toy_corpus
from tests.helpers import ROOT, run_script, start_script


def test_product_zipped_and_names():
    assert points.product(a=[1, 2], b=[True, False]) == [
        {'a': 1, 'b': True}, {'a': 1, 'b': False}, {'a': 2, 'b': True}, {'a': 2, 'b': False}]
    assert points.zipped(a=[1, 2], b=['x', 'y']) == [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
    with pytest.raises(points.SweepError, match='zipped needs equally long'):
        points.zipped(a=[1, 2], b=[3])
    assert points.point_name({}) == 'default'
    # readable and stable: sorted keys, whatever the order they were given in
    name = points.point_name({'scale_attention': False, 'num_heads': 1})
    assert name == 'num_heads=1,scale_attention=False'
    assert name == points.point_name({'num_heads': 1, 'scale_attention': False})
    assert points.point_name({'learning_rate_scale': 1.6}) == 'learning_rate_scale=1.6'
    # unsafe characters and long names get a hash, so distinct points never share a directory
    a, b = points.point_name({'data_dir': 'a/b'}), points.point_name({'data_dir': 'a_b'})
    assert '/' not in a and a != b and a.startswith('data_dir=a_b-')
    long = points.point_name({f'key_{i}': i for i in range(30)})
    assert len(long) <= points.MAX_NAME + 9


def test_points_are_checked_and_identical_configs_run_once():
    config = table3_mini.get_config()
    made = points.make_points(config, [{}, {'num_heads': 4}, {'num_heads': 8}],
                              {'train_time_budget_s': 5.0})
    assert [p.name for p in made] == ['default', 'num_heads=8']
    assert made[0].same_as == ('num_heads=4',)  # 4 heads is the config's own value
    assert made[1].config.num_heads == 8 and made[1].config.train_time_budget_s == 5.0
    assert config.num_heads == 4  # the config itself is not changed
    with pytest.raises(points.SweepError, match=r"point 1 \(num_head=2\): unknown config key"):
        points.make_points(config, [{}, {'num_head': 2}])
    with pytest.raises(points.SweepError, match='point 0 .*pre_ln=.yes'):
        points.make_points(config, [{'pre_ln': 'yes'}])


def test_table3_points_and_dry_run():
    lines = []
    code = runner.run('configs/table3_mini.py', table3_mini.get_config(), 'runs/t3',
                     base_overrides={'train_time_budget_s': 20.0}, dry_run=True,
                     echo=lines.append)
    assert code == 0 and not os.path.exists('runs/t3')
    names = [line.split(': ')[0].split('] ')[1] for line in lines if line.startswith('[')]
    assert len(names) == len(set(names)) == 13 and names[0] == 'default'
    for name in ('num_heads=1', 'num_heads=16', 'scale_attention=False',
                 'position_embedding=none', 'position_embedding=learned', 'pre_ln=True',
                 'learning_rate_scale=1.6,pre_ln=True', 'label_smoothing=0.0',
                 'dropout_rate=0.0', 'dropout_rate=0.3'):
        assert name in names
    commands = [line.strip() for line in lines if 'train.py' in line]
    assert len(commands) == 13
    assert commands[1].endswith('train.py --config=configs/table3_mini.py '
                                '--workdir=runs/t3/num_heads=1 '
                                '--config.train_time_budget_s=20.0 --config.num_heads=1')


def test_position_none_makes_the_encoder_permutation_equivariant():
    config = TransformerConfig(vocab_size=30, d_model=16, d_ff=32, num_heads=2,
                               num_encoder_layers=2, num_decoder_layers=1,
                               position_embedding='none', deterministic=True)
    ids = jnp.array([[3, 9, 4, 17, 5, 1]], jnp.int32)
    perm = np.array([4, 0, 5, 2, 1, 3])
    model = Transformer(config)
    init = jax.jit(lambda key, x: model.init(key, x, method=Transformer.encode))  # no decoder
    params = init(jax.random.key(0), ids)['params']
    encode = jax.jit(lambda x: model.apply({'params': params}, x, method=Transformer.encode))
    np.testing.assert_allclose(encode(ids[:, perm]), encode(ids)[:, perm], atol=1e-5)
    # with positions the order matters
    sinusoidal = Transformer(config.replace(position_embedding='sinusoidal'))
    out = jax.jit(lambda x: sinusoidal.apply({'params': params}, x, method=Transformer.encode))
    assert np.abs(out(ids[:, perm]) - out(ids)[:, perm]).max() > 1e-2


_SWEEP_CONFIG = '''
import pathlib

from tests.helpers import tiny_config

CORPUS = {{'root': pathlib.Path({root!r}), 'train': {train!r}, 'validation': {validation!r},
          'test': {test!r}}}


def get_config():  # one layer a side, one evaluation batch: fewer and smaller compiles
    return tiny_config(
        CORPUS, num_train_steps=6, log_every_steps=2, eval_every_steps=6,
        checkpoint_every_steps=3, keep_checkpoints=2, eval_bleu_sentences=0,
        num_eval_batches=1, max_len=32, eval_batch_size=32, num_encoder_layers=1,
        num_decoder_layers=1)


def get_sweep():
    return [{{'max_decode_len': 300}},  # fails at start-up: longer than max_position
            {{'num_train_steps': 16, 'checkpoint_every_steps': 1, 'eval_every_steps': 16}}]
'''
LONG = 'checkpoint_every_steps=1,eval_every_steps=16,num_train_steps=16'


def _sweep_command(config_path, workdir, *flags):
    return ['sweep.py', f'--config={config_path}', f'--workdir={workdir}', *flags]


def _saved_steps(point_dir):
    directory = os.path.join(point_dir, 'checkpoints')
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())  # committed steps only


def test_sweep_records_failures_resumes_after_a_kill_skips_done_points_and_summarizes(tmp_path):
    corpus = toy_corpus.make_corpus(tmp_path)
    config_path = tmp_path / 'sweep_config.py'
    config_path.write_text(_SWEEP_CONFIG.format(root=str(tmp_path), train=corpus['train'],
                                                validation=corpus['validation'],
                                                test=corpus['test']))
    workdir = tmp_path / 'sweep'
    long_dir = workdir / LONG

    # First run: the first point fails, the sweep goes on; it is killed (SIGKILL) once the
    # second point has saved its first checkpoint.
    first = start_script(*_sweep_command(config_path, workdir), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not _saved_steps(long_dir):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, 'the second point saved no checkpoint in 300 s'
        time.sleep(0.02)
    first.kill()
    output = first.communicate(timeout=60)[0]
    assert '[1/2] max_decode_len=300: failed after' in output
    state = json.loads((long_dir / 'sweep_point.json').read_text())
    assert state['status'] == 'running' and state['pid'] > 0
    failed = json.loads((workdir / 'max_decode_len=300' / 'sweep_point.json').read_text())
    assert failed['status'] == 'failed' and failed['returncode'] == 1
    assert failed['error'] == ('train.py: max_decode_len=300 exceeds max_position=256 '
                               '(--config.max_decode_len or --config.max_position)')

    # Second run: the failed point is left alone (no --retry_failed), the killed one resumes
    # from its checkpoint (its train.py got SIGTERM when the sweep died), finishes (its
    # TRAINING_FINISHED) and is evaluated.
    second = run_script(*_sweep_command(config_path, workdir))
    assert second.returncode == 1, second.stdout + second.stderr  # one point failed
    assert '[1/2] max_decode_len=300: failed earlier' in second.stdout
    assert f'[2/2] {LONG}: resuming (unfinished)' in second.stdout
    assert f'[2/2] {LONG}: sacreBLEU' in second.stdout
    assert 'resuming from checkpoint' in (long_dir / 'stdout.log').read_text()
    done = json.loads((long_dir / 'sweep_point.json').read_text())
    assert (done['status'], done['step'], done['attempts']) == ('done', 16, 2)
    assert done['eval']['label'] == 'step-16'

    # Third run: the done point is skipped, training and evaluation alike.
    third = run_script(*_sweep_command(config_path, workdir))
    assert third.returncode == 1, third.stdout + third.stderr
    assert f'[2/2] {LONG}: done (step 16), skipped' in third.stdout
    assert 'evaluating' not in third.stdout and 'failed earlier' in third.stdout
    assert json.loads((long_dir / 'sweep_point.json').read_text()) == done

    with open(workdir / 'summary.csv', newline='') as f:
        rows = {r['point']: r for r in csv.DictReader(f)}
    assert set(rows) == {'max_decode_len=300', LONG}
    assert (rows[LONG]['status'], rows[LONG]['steps']) == ('done', '16')
    assert rows[LONG]['eval_label'] == 'step-16' and rows[LONG]['num_train_steps'] == '16'
    assert float(rows[LONG]['best_val_perplexity']) <= float(rows[LONG]['final_val_perplexity'])
    # The point's scores are sacrebleu's on the hypotheses its evaluation wrote.
    hypotheses = (long_dir / 'hypotheses-test-step-16.txt').read_text(
        encoding='utf-8').splitlines()
    references = [line.split('\t')[1] for line in
                  Path(corpus['test']).read_text(encoding='utf-8').splitlines()]
    assert float(rows[LONG]['chrf']) == pytest.approx(
        sacrebleu.CHRF().corpus_score(hypotheses, [references]).score, abs=1e-9)
    assert float(rows[LONG]['sacrebleu']) == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9)
    assert rows['max_decode_len=300']['status'] == 'failed'

    # The summary is rebuilt from the directory alone (what `sweep.py --summarize=DIR` calls).
    for name in ('summary.md', 'summary.csv', 'curves.png'):
        os.remove(workdir / name)
    rebuilt = report.write_summary(str(workdir))
    assert [r['status'] for r in rebuilt] == ['failed', 'done']
    assert [len(r['curve']) for r in rebuilt] == [0, 1]  # validation evaluations
    assert (workdir / 'curves.png').read_bytes()[:4] == b'\x89PNG'
    markdown = (workdir / 'summary.md').read_text()
    assert '2 points: 1 done, 1 failed' in markdown and f'| `{LONG}` | done |' in markdown
    assert 'max_decode_len=300 exceeds max_position=256' in markdown


def test_cluster_launcher_commands_and_refused_flags(tmp_path):
    config = table3_mini.get_config()
    workdir = str(tmp_path / 'sw')
    for launcher, flags, fixed in (
            ('tpu', ['--tpu=pod-1', '--zone=us-west4-a', '--project=p'], []),
            ('slurm', ['--nodes=2', '--gpus_per_node=8', '--setup=module load cuda'],
             ['--wait'])):
        lines = []
        code = runner.run('configs/table3_mini.py', config, workdir, dry_run=True,
                         base_overrides={'train_time_budget_s': 60.0}, split='validation',
                         average_last=2, launcher=launcher, launcher_flags=flags,
                         sweep=[{'num_heads': 1}], echo=lines.append)
        assert code == 0 and not os.path.exists(workdir)
        train, evaluate = (shlex.split(line) for line in lines[1:])
        script = os.path.relpath(os.path.join(ROOT, 'scripts', f'launch_{launcher}.py'))
        head = [os.path.relpath(sys.executable), script, *flags, *fixed]
        base = ['--config=configs/table3_mini.py', f'--workdir={workdir}/num_heads=1', '--']
        overrides = ['--config.train_time_budget_s=60.0', '--config.num_heads=1']
        assert train == [*head, *base, *overrides]
        assert evaluate == [*head, '--evaluate', *base, *overrides, '--split=validation',
                            '--average_last=2']

    def error(**kwargs):
        with pytest.raises(points.SweepError) as e:
            runner.run('configs/table3_mini.py', config, workdir, dry_run=True,
                      sweep=[{}], echo=lambda _: None, **kwargs)
        return str(e.value)

    assert error(launcher='tpu', launcher_flags=['--tpu=t', '--zone=z', '--detach']) == (
        '--launcher_flags: --detach returns before the job ends; a sweep waits for each point')
    assert 'set by the sweep' in error(launcher='slurm', launcher_flags=['--workdir=/x'])
    assert 'not --launcher=local' in error(launcher_flags=['--nodes=1'])
    with pytest.raises(points.SweepError,
                       match='gs://b/sw: a sweep directory must be a local or shared file system'):
        runner.run('configs/table3_mini.py', config, 'gs://b/sw', launcher='tpu', sweep=[{}])


# Stands for scripts/launch_slurm.py --wait: records its arguments; "trains" (a checkpoint's
# metadata; train.py's last line; TRAINING_FINISHED unless FAKE_UNFINISHED is set, as a preempted
# run leaves it) or "evaluates" (the scores file evaluate.py writes).
_FAKE_LAUNCHER = '''import json, os, sys
i = sys.argv.index('--')
mine, passed = sys.argv[1:i], sys.argv[i + 1:]
workdir = next(a for a in mine if a.startswith('--workdir='))[len('--workdir='):]
with open(os.path.join(os.path.dirname(workdir), 'calls.jsonl'), 'a') as f:
    f.write(json.dumps(sys.argv[1:]) + '\\n')
if '--evaluate' in mine:
    split = next(a for a in passed if a.startswith('--split='))[len('--split='):]
    with open(os.path.join(workdir, f'eval-{split}.json'), 'w') as f:
        json.dump({'step-5': {'sacrebleu': 1.0}, 'step-6': {'sacrebleu': 12.5, 'chrf': 40.25,
                   'sentences': 64, 'steps': [6], 'hypotheses_file': 'h.txt'}}, f)
else:
    os.makedirs(os.path.join(workdir, 'checkpoints', '6', 'meta'), exist_ok=True)
    with open(os.path.join(workdir, 'checkpoints', '6', 'meta', 'metadata'), 'w') as f:
        json.dump({'step': 6, 'train_seconds': 3.5}, f)
    if not os.environ.get('FAKE_UNFINISHED'):
        with open(os.path.join(workdir, 'TRAINING_FINISHED'), 'w') as f:
            json.dump({'step': 6, 'stopped_by': 'num_train_steps'}, f)
    print('finished at step 6 (num_train_steps); 0.1 s')
'''


def _fake_slurm(tmp_path, monkeypatch):
    fake = tmp_path / 'fake_launch.py'
    fake.write_text(_FAKE_LAUNCHER)
    monkeypatch.setitem(runner.LAUNCHERS, 'slurm', runner.Launcher(str(fake), ('--wait',)))
    monkeypatch.setattr(evaluation, 'run', lambda *a, **k: pytest.fail('evaluated locally'))
    workdir = tmp_path / 'sw'

    def run_sweep(lines, **base_overrides):
        return runner.run('configs/table3_mini.py', table3_mini.get_config(), str(workdir),
                          base_overrides=base_overrides, split='validation', launcher='slurm',
                          launcher_flags=['--nodes=1'], sweep=[{'num_heads': 1}],
                          echo=lines.append)

    def calls():
        return [json.loads(line) for line in (workdir / 'calls.jsonl').read_text().splitlines()]

    return workdir, run_sweep, calls


def test_cluster_point_is_evaluated_through_its_launcher(tmp_path, monkeypatch):
    workdir, run_sweep, calls = _fake_slurm(tmp_path, monkeypatch)
    lines = []
    assert run_sweep(lines) == 0, lines
    point = f'--workdir={workdir}/num_heads=1'
    assert calls() == [
        ['--nodes=1', '--wait', '--config=configs/table3_mini.py', point, '--',
         '--config.num_heads=1'],
        ['--nodes=1', '--wait', '--evaluate', '--config=configs/table3_mini.py', point, '--',
         '--config.num_heads=1', '--split=validation']]
    assert '[1/1] num_heads=1: sacreBLEU 12.50 chrF 40.25' in lines
    state = json.loads((workdir / 'num_heads=1' / 'sweep_point.json').read_text())
    assert (state['status'], state['step'], state['stopped_by']) == ('done', 6, 'num_train_steps')
    assert state['eval'] == {'label': 'step-6', 'split': 'validation', 'sacrebleu': 12.5,
                             'chrf': 40.25, 'sentences': 64}
    with open(workdir / 'summary.csv', newline='') as f:
        (row,) = csv.DictReader(f)
    assert (row['status'], row['steps'], row['train_seconds']) == ('done', '6', '3.5')
    assert (row['eval_label'], row['sacrebleu'], row['chrf']) == ('step-6', '12.5', '40.25')

    # A run again skips the point and its evaluation; the launcher is not called again.
    assert run_sweep(lines) == 0
    assert len(calls()) == 2


def test_a_point_is_done_by_its_training_finished_marker_not_its_exit_status(tmp_path,
                                                                              monkeypatch):
    workdir, run_sweep, calls = _fake_slurm(tmp_path, monkeypatch)
    point_dir = workdir / 'num_heads=1'

    def state():
        return json.loads((point_dir / 'sweep_point.json').read_text())

    # Exits 0 and prints train.py's last line, but leaves no marker (as a preempted run does):
    # not done, not evaluated; the next run trains it again.
    monkeypatch.setenv('FAKE_UNFINISHED', '1')
    lines = []
    assert run_sweep(lines) == 1
    assert (state()['status'], state()['returncode'], state()['step']) == ('pending', 0, None)
    assert 'exited 0 without TRAINING_FINISHED' in state()['error'] and 'eval' not in state()
    assert len(calls()) == 1  # no evaluation

    # Its marker says it finished: done, then evaluated.
    monkeypatch.delenv('FAKE_UNFINISHED')
    lines = []
    assert run_sweep(lines) == 0, lines
    assert (state()['status'], state()['step'], state()['attempts']) == ('done', 6, 2)
    assert [c[2] for c in calls()] == ['--config=configs/table3_mini.py'] * 2 + ['--evaluate']

    # A sweep that died while its point was finishing left "running" and a dead pid; the
    # point's marker says it finished: the next run does not train it again, only evaluates it.
    (point_dir / 'sweep_point.json').write_text(json.dumps(
        {**state(), 'status': 'running', 'pid': 2**22 + 1, 'eval': {}}))
    lines = []
    assert run_sweep(lines) == 0, lines
    assert '[1/1] num_heads=1: finished earlier (step 6), not trained again' in lines
    assert [c[2] for c in calls()][3:] == ['--evaluate']
    assert (state()['status'], state()['attempts'], state()['eval']['sacrebleu']) == (
        'done', 2, 12.5)

    # The config changed: the marker of the old config's run is not this run's (the sweep
    # removes it before the new attempt, which here ends unfinished).
    monkeypatch.setenv('FAKE_UNFINISHED', '1')
    lines = []
    assert run_sweep(lines, train_time_budget_s=99.0) == 1
    assert '[1/1] num_heads=1: config changed: training on' in lines[0]
    assert state()['status'] == 'pending' and not (point_dir / 'TRAINING_FINISHED').exists()


def test_a_running_cluster_launcher_of_an_earlier_sweep_is_recognised():
    # A re-run waits for it (it is stopping its job) rather than starting a second job.
    launcher = ['.venv/bin/python', 'scripts/launch_slurm.py', '--wait', '--workdir=/s/p', '--']
    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)',
                              *launcher[1:]])
    try:
        deadline = time.monotonic() + 10
        while not (Path(f'/proc/{child.pid}/cmdline').read_bytes()  # empty while it starts
                   or time.monotonic() > deadline):
            time.sleep(0.01)
        assert runner._process_alive(child.pid, launcher)
        assert not runner._process_alive(child.pid, ['python', 'train.py', '--workdir=/s/p'])
        assert not runner._process_alive(child.pid, [*launcher[:3], '--workdir=/s/q', '--'])
    finally:
        child.kill()
        child.wait()
