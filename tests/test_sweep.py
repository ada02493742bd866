"""Sweeps (t2t/sweep.py, sweep.py): points and names, a real two-point sweep that is killed and
resumed, the summary from disk, and the Table 3 points."""

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
from t2t import sweep
from t2t.model import Transformer, TransformerConfig
from tests import toy_corpus
from tests.conftest import ROOT, one_device_env


def test_product_zip_and_names():
    assert sweep.product(a=[1, 2], b=[True, False]) == [
        {'a': 1, 'b': True}, {'a': 1, 'b': False}, {'a': 2, 'b': True}, {'a': 2, 'b': False}]
    assert sweep.zip(a=[1, 2], b=['x', 'y']) == [{'a': 1, 'b': 'x'}, {'a': 2, 'b': 'y'}]
    with pytest.raises(sweep.SweepError, match='equally long'):
        sweep.zip(a=[1, 2], b=[3])
    assert sweep.point_name({}) == 'default'
    # readable and stable: sorted keys, whatever the order they were given in
    name = sweep.point_name({'scale_attention': False, 'num_heads': 1})
    assert name == 'num_heads=1,scale_attention=False'
    assert name == sweep.point_name({'num_heads': 1, 'scale_attention': False})
    assert sweep.point_name({'learning_rate_scale': 1.6}) == 'learning_rate_scale=1.6'
    # unsafe characters and long names get a hash, so distinct points never share a directory
    a, b = sweep.point_name({'data_dir': 'a/b'}), sweep.point_name({'data_dir': 'a_b'})
    assert '/' not in a and a != b and a.startswith('data_dir=a_b-')
    long = sweep.point_name({f'key_{i}': i for i in range(30)})
    assert len(long) <= sweep.MAX_NAME + 9


def test_points_are_checked_and_identical_configs_run_once():
    config = table3_mini.get_config()
    points = sweep.make_points(config, [{}, {'num_heads': 4}, {'num_heads': 8}],
                               {'train_time_budget_s': 5.0})
    assert [p.name for p in points] == ['default', 'num_heads=8']
    assert points[0].same_as == ('num_heads=4',)  # 4 heads is the config's own value
    assert points[1].config.num_heads == 8 and points[1].config.train_time_budget_s == 5.0
    assert config.num_heads == 4  # the config itself is not changed
    with pytest.raises(sweep.SweepError, match=r"point 1 \(num_head=2\): unknown config key"):
        sweep.make_points(config, [{}, {'num_head': 2}])
    with pytest.raises(sweep.SweepError, match='point 0 .*pre_ln=.yes'):
        sweep.make_points(config, [{'pre_ln': 'yes'}])


def test_table3_points_and_dry_run():
    lines = []
    code = sweep.run('configs/table3_mini.py', table3_mini.get_config(), 'runs/t3',
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
    params = jax.jit(model.init)(jax.random.key(0), ids, ids)['params']
    encode = jax.jit(lambda x: model.apply({'params': params}, x, method=Transformer.encode))
    np.testing.assert_allclose(encode(ids[:, perm]), encode(ids)[:, perm], atol=1e-5)
    # with positions the order matters
    sinusoidal = Transformer(config.replace(position_embedding='sinusoidal'))
    out = jax.jit(lambda x: sinusoidal.apply({'params': params}, x, method=Transformer.encode))
    assert np.abs(out(ids[:, perm]) - out(ids)[:, perm]).max() > 1e-2


_SWEEP_CONFIG = '''
import pathlib

from tests import toy_corpus

CORPUS = {{'root': pathlib.Path({root!r}), 'train': {train!r}, 'validation': {validation!r},
          'test': {test!r}}}


def get_config():
    return toy_corpus.tiny_config(
        CORPUS, num_train_steps=6, log_every_steps=2, eval_every_steps=6,
        checkpoint_every_steps=3, keep_checkpoints=2, eval_bleu_sentences=0,
        num_eval_batches=2, max_len=32, eval_batch_size=8)


def get_sweep():
    return [{{'num_heads': 2}},
            {{'max_decode_len': 300}},  # fails at start-up: longer than max_position
            {{'num_train_steps': 16, 'checkpoint_every_steps': 1, 'eval_every_steps': 16}}]
'''
LONG = 'checkpoint_every_steps=1,eval_every_steps=16,num_train_steps=16'


def _sweep_command(config_path, workdir, *flags):
    return [sys.executable, 'sweep.py', f'--config={config_path}', f'--workdir={workdir}', *flags]


def _saved_steps(point_dir):
    directory = os.path.join(point_dir, 'checkpoints')
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())  # committed steps only


def test_sweep_trains_records_failures_resumes_after_a_kill_and_summarizes(tmp_path):
    corpus = toy_corpus.make_corpus(tmp_path)
    config_path = tmp_path / 'sweep_config.py'
    config_path.write_text(_SWEEP_CONFIG.format(root=str(tmp_path), train=corpus['train'],
                                                validation=corpus['validation'],
                                                test=corpus['test']))
    workdir = tmp_path / 'sweep'
    long_dir = workdir / LONG

    # First run: the first point trains and is evaluated, the second fails; the sweep process is
    # killed (SIGKILL) once the third point has saved its first checkpoint.
    first = subprocess.Popen(_sweep_command(config_path, workdir), cwd=ROOT,
                             env=one_device_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not _saved_steps(long_dir):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, 'the third point saved no checkpoint in 300 s'
        time.sleep(0.02)
    first.kill()
    output = first.communicate(timeout=60)[0]
    assert '[1/3] num_heads=2: sacreBLEU' in output
    assert 'max_decode_len=300: failed after' in output
    state = json.loads((long_dir / 'sweep_point.json').read_text())
    assert state['status'] == 'running' and state['pid'] > 0
    failed = json.loads((workdir / 'max_decode_len=300' / 'sweep_point.json').read_text())
    assert failed['status'] == 'failed' and failed['returncode'] == 1
    assert failed['error'] == ('train.py: max_decode_len=300 exceeds max_position=256 '
                               '(--config.max_decode_len or --config.max_position)')

    # Second run: the done point is skipped, the failed one is left alone (no --retry_failed),
    # the killed one resumes from its checkpoint (its train.py got SIGTERM when the sweep died).
    second = subprocess.run(_sweep_command(config_path, workdir), cwd=ROOT,
                            env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stdout + second.stderr  # one point failed
    assert '[1/3] num_heads=2: done (step 6), skipped' in second.stdout
    assert '[2/3] max_decode_len=300: failed earlier' in second.stdout
    assert f'[3/3] {LONG}: resuming (unfinished)' in second.stdout
    assert 'resuming from checkpoint' in (long_dir / 'stdout.log').read_text()
    done = json.loads((long_dir / 'sweep_point.json').read_text())
    assert (done['status'], done['step'], done['attempts']) == ('done', 16, 2)
    first_point = json.loads((workdir / 'num_heads=2' / 'sweep_point.json').read_text())
    assert first_point['attempts'] == 1 and first_point['eval']['label'] == 'step-6'

    with open(workdir / 'summary.csv', newline='') as f:
        rows = {r['point']: r for r in csv.DictReader(f)}
    assert set(rows) == {'num_heads=2', 'max_decode_len=300', LONG}
    assert rows['num_heads=2']['status'] == rows[LONG]['status'] == 'done'
    assert (rows['num_heads=2']['steps'], rows[LONG]['steps']) == ('6', '16')
    assert rows[LONG]['eval_label'] == 'step-16' and rows[LONG]['num_train_steps'] == '16'
    assert float(rows[LONG]['best_val_perplexity']) <= float(rows[LONG]['final_val_perplexity'])
    # The point's scores are sacrebleu's on the hypotheses its evaluation wrote.
    point = workdir / 'num_heads=2'
    hypotheses = (point / 'hypotheses-test-step-6.txt').read_text(encoding='utf-8').splitlines()
    references = [line.split('\t')[1] for line in
                  Path(corpus['test']).read_text(encoding='utf-8').splitlines()]
    assert float(rows['num_heads=2']['chrf']) == pytest.approx(
        sacrebleu.CHRF().corpus_score(hypotheses, [references]).score, abs=1e-9)
    assert float(rows['num_heads=2']['sacrebleu']) == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9)
    assert rows['max_decode_len=300']['status'] == 'failed'

    # The summary is rebuilt from the directory alone (what `sweep.py --summarize=DIR` calls).
    for name in ('summary.md', 'summary.csv', 'curves.png'):
        os.remove(workdir / name)
    rebuilt = sweep.write_summary(str(workdir))
    assert [r['status'] for r in rebuilt] == ['done', 'failed', 'done']
    assert [len(r['curve']) for r in rebuilt] == [1, 0, 1]  # validation evaluations
    assert (workdir / 'curves.png').read_bytes()[:4] == b'\x89PNG'
    markdown = (workdir / 'summary.md').read_text()
    assert '3 points: 2 done, 1 failed' in markdown and f'| `{LONG}` | done |' in markdown
    assert 'max_decode_len=300 exceeds max_position=256' in markdown


def test_cluster_launcher_commands_and_refused_flags(tmp_path):
    config = table3_mini.get_config()
    workdir = str(tmp_path / 'sw')
    for launcher, flags, fixed in (
            ('tpu', ['--tpu=pod-1', '--zone=us-west4-a', '--project=p'], []),
            ('slurm', ['--nodes=2', '--gpus_per_node=8', '--setup=module load cuda'],
             ['--wait'])):
        lines = []
        code = sweep.run('configs/table3_mini.py', config, workdir, dry_run=True,
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
        with pytest.raises(sweep.SweepError) as e:
            sweep.run('configs/table3_mini.py', config, workdir, dry_run=True,
                      sweep=[{}], echo=lambda _: None, **kwargs)
        return str(e.value)

    assert error(launcher='tpu', launcher_flags=['--tpu=t', '--zone=z', '--detach']) == (
        '--launcher_flags: --detach returns before the job ends; a sweep waits for each point')
    assert 'set by the sweep' in error(launcher='slurm', launcher_flags=['--workdir=/x'])
    assert 'not --launcher=local' in error(launcher_flags=['--nodes=1'])
    with pytest.raises(sweep.SweepError,
                       match='gs://b/sw: a sweep directory must be a local or shared file system'):
        sweep.run('configs/table3_mini.py', config, 'gs://b/sw', launcher='tpu', sweep=[{}])


# Stands for scripts/launch_slurm.py --wait: records its arguments; "trains" (a checkpoint's
# metadata, train.py's last line) or "evaluates" (the scores file evaluate.py writes).
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
    os.makedirs(os.path.join(workdir, 'checkpoints', '6', 'meta'))
    with open(os.path.join(workdir, 'checkpoints', '6', 'meta', 'metadata'), 'w') as f:
        json.dump({'step': 6, 'train_seconds': 3.5}, f)
    print('finished at step 6 (num_train_steps); 0.1 s')
'''


def test_cluster_point_is_evaluated_through_its_launcher(tmp_path, monkeypatch):
    fake = tmp_path / 'fake_launch.py'
    fake.write_text(_FAKE_LAUNCHER)
    monkeypatch.setitem(sweep.LAUNCHERS, 'slurm', sweep.Launcher(str(fake), ('--wait',)))
    monkeypatch.setattr(sweep, 'evaluate_point', lambda *a: pytest.fail('evaluated locally'))
    workdir = tmp_path / 'sw'
    lines = []
    code = sweep.run('configs/table3_mini.py', table3_mini.get_config(), str(workdir),
                     split='validation', launcher='slurm', launcher_flags=['--nodes=1'],
                     sweep=[{'num_heads': 1}], echo=lines.append)
    assert code == 0, lines
    calls = [json.loads(line) for line in (workdir / 'calls.jsonl').read_text().splitlines()]
    point = f'--workdir={workdir}/num_heads=1'
    assert calls == [
        ['--nodes=1', '--wait', '--config=configs/table3_mini.py', point, '--',
         '--config.num_heads=1'],
        ['--nodes=1', '--wait', '--evaluate', '--config=configs/table3_mini.py', point, '--',
         '--config.num_heads=1', '--split=validation']]
    assert '[1/1] num_heads=1: sacreBLEU 12.50 chrF 40.25' in lines
    state = json.loads((workdir / 'num_heads=1' / 'sweep_point.json').read_text())
    assert state['status'] == 'done' and state['step'] == 6
    assert state['eval'] == {'label': 'step-6', 'split': 'validation', 'sacrebleu': 12.5,
                             'chrf': 40.25, 'sentences': 64}
    with open(workdir / 'summary.csv', newline='') as f:
        (row,) = csv.DictReader(f)
    assert (row['status'], row['steps'], row['train_seconds']) == ('done', '6', '3.5')
    assert (row['eval_label'], row['sacrebleu'], row['chrf']) == ('step-6', '12.5', '40.25')

    # A run again skips the point and its evaluation; the launcher is not called again.
    assert sweep.run('configs/table3_mini.py', table3_mini.get_config(), str(workdir),
                     split='validation', launcher='slurm', launcher_flags=['--nodes=1'],
                     sweep=[{'num_heads': 1}], echo=lines.append) == 0
    assert len((workdir / 'calls.jsonl').read_text().splitlines()) == 2


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
        assert sweep._process_alive(child.pid, launcher)
        assert not sweep._process_alive(child.pid, ['python', 'train.py', '--workdir=/s/p'])
        assert not sweep._process_alive(child.pid, [*launcher[:3], '--workdir=/s/q', '--'])
    finally:
        child.kill()
        child.wait()
