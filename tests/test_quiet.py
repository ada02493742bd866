"""What a user runs prints t2t's lines, not its libraries' warnings: evaluate.py end to end."""

import os
import random
import re
import subprocess
import sys

from t2t import data, optim, sharding, train_lib
from t2t.infra import platforms
from t2t.run import checkpoint
from tests import toy_corpus
from tests.helpers import ROOT, run_script, script_env, tiny_config

# absl's line prefix: W1201 05:05:48.246602 139859538611072 checkpoint_manager.py:849]
ABSL_LINE = re.compile(r'^[WEF]\d{4} [\d:.]+ +\d+ (\S+\.py):\d+\]', re.M)
T2T_FILES = {f for _, _, files in os.walk(os.path.join(ROOT, 't2t')) for f in files}


def test_evaluate_prints_no_library_warnings(tmp_path):
    rng = random.Random(0)
    overrides = {'dataset': 'tsv', 'data_dir': str(tmp_path / 'data'), 'vocab_size': 400,
                 'tokenizer_sentences': 1000, 'max_eval_len': 32, 'eval_batch_size': 8,
                 'beam_size': 2, 'max_decode_len': 8, 'max_decode_extra': 4}
    config = tiny_config(**overrides)
    for split, n in (('train', 100), ('validation', 4), ('test', 6)):
        path = toy_corpus.write_tsv(tmp_path / f'{split}.tsv',
                                    [toy_corpus.sentence(rng, 2, 6) for _ in range(n)])
        config.tsv_files[split] = overrides[f'tsv_files.{split}'] = path
    data.get_tokenizer(config)  # prepared, as python -m t2t.data does
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    workdir = tmp_path / 'run'
    manager = checkpoint.make_manager(workdir, config, async_=False)
    checkpoint.save(manager, 1, state)
    checkpoint.close(manager)

    # tiny_config's shrunk keys too, so that the checkpoint fits evaluate.py's model
    flags = [f'--config.{k}={v}' for k, v in {'max_len': config.max_len, **overrides}.items()]
    proc = run_script('evaluate.py', '--config=configs/tiny.py', f'--workdir={workdir}', *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'sacreBLEU' in proc.stdout and 'read only' not in proc.stderr
    # orbax printed 'Given directory is read only' twice before the scores; the only warnings
    # left are t2t's own (e.g. pipeline.py counting test sentences over max_eval_len)
    assert set(ABSL_LINE.findall(proc.stderr)) <= T2T_FILES, proc.stderr[-2000:]
    assert 'Warning:' not in proc.stderr, proc.stderr[-2000:]


# What jax and its plugins print on a host without the accelerator they look for: the TPU
# backend's failure (absl's "Unable to initialize backend 'tpu': ... libtpu.so", or libtpu's own
# start-up errors) and the CUDA plugin's checks against a driver that is not there.
ACCELERATOR_NOISE = re.compile(r'Unable to initialize backend|plugin configuration error|libtpu|'
                               r'TPU|CUDA|cuda|cudnn|GPU', re.I)


def _startup_stderr(script, args, *, hide_libtpu):
    """stderr of `python SCRIPT ARGS` as a user starts it: no JAX_PLATFORMS; hide_libtpu: as
    where the `tpu` extra is not installed (a fresh clone's make demo)."""
    hide = "sys.modules['libtpu'] = None; " if hide_libtpu else ''
    code = (f'import runpy, sys; {hide}sys.argv = {[script, *args]!r}; '
            f'runpy.run_path({script!r}, run_name="__main__")')
    env = {k: v for k, v in script_env().items() if k != 'JAX_PLATFORMS'}
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc


def test_train_and_evaluate_start_quietly_on_a_cpu_host(tmp_path):
    """No accelerator line when jax chooses its platforms (t2t/infra/platforms.py): train.py
    without libtpu (jax then probed its TPU backend), evaluate.py with whatever the venv holds."""
    train = _startup_stderr('train.py', ['--config=configs/tiny.py', '--dry_run'],
                            hide_libtpu=True)
    assert train.returncode == 0 and 'params: ' in train.stdout, train.stderr[-2000:]
    assert not ACCELERATOR_NOISE.search(train.stderr), train.stderr[-2000:]
    evaluate = _startup_stderr('evaluate.py', ['--config=configs/tiny.py',
                                               f'--workdir={tmp_path}'], hide_libtpu=False)
    # it starts jax (jax.default_backend()) before it looks for checkpoints
    assert evaluate.returncode == 1 and 'no checkpoint in' in evaluate.stderr, evaluate.stderr
    assert not ACCELERATOR_NOISE.search(evaluate.stderr), evaluate.stderr[-2000:]


def test_platforms_are_those_whose_chips_the_host_has():
    assert platforms.choose(0, False, False) == platforms.choose(0, False, True) == 'cpu'
    assert platforms.choose(0, True, True) == 'cuda,cpu'  # a CUDA failure then fails loudly
    assert platforms.choose(0, True, False) is None  # jax warns that the CUDA plugin is missing
    assert platforms.choose(4, False, False) is None  # jax's own TPU start, its errors real
