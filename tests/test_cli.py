"""A bad --config.key=value is one line naming the key, before any data or compile (t2t/cli.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from configs import tiny
from t2t import cli

ROOT = Path(__file__).resolve().parents[1]


def _exit_line(fn, *args) -> str:
    with pytest.raises(SystemExit) as excinfo:
        fn(*args)
    message = str(excinfo.value.code)
    assert '\n' not in message and 'Traceback' not in message
    return message


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin'})


@pytest.mark.parametrize('key, value, says', [
    ('dropout_rate', 1.5, 'train.py: --config.dropout_rate=1.5: dropout_rate=1.5 is not in [0, 1)'),
    ('d_model', 30, 'd_model=30 is not divisible by num_heads=4'),
    ('attention_impl', 'flash', "attention_impl='flash'; one of"),
    ('mesh_shape', ('1,x',), "mesh_shape=('1,x',) is not a tuple of positive integers"),
    ('beam_shrink_floor', -1, 'train.py: --config.beam_shrink_floor=-1: beam_shrink_floor=-1 '
                              'must be >= 0'),
    ('beam_stop', 'never', "--config.beam_stop=never: beam_stop='never'; one of ('bound', "
                           "'k_finished')"),
])
def test_an_invalid_value_is_one_line_naming_the_key(key, value, says):
    config = tiny.get_config()
    config[key] = value
    argv = ['train.py', '--config=configs/tiny.py', f'--config.{key}={value}']
    assert says in _exit_line(cli.check_values, config, 'train.py', argv)


def test_valid_configs_pass_including_one_minus_one_in_the_mesh():
    config = tiny.get_config()
    config.mesh_shape = (1, -1, 1)
    cli.check_values(config, 'train.py', ['train.py'])  # returns: nothing to say


@pytest.mark.parametrize('impl, platform, ok', [
    ('splash', 'cpu', False), ('splash', 'tpu', True), ('cudnn', 'cpu', False),
    ('cudnn', 'gpu', True), ('cudnn', 'tpu', False), ('dot_product', 'cpu', True)])
def test_attention_kernels_need_their_platform(impl, platform, ok):
    config = tiny.get_config()
    config.attention_impl = impl
    if ok:
        cli.check_platform(config, platform, 'evaluate.py', [])
    else:
        line = _exit_line(cli.check_platform, config, platform, 'evaluate.py', [])
        assert line.startswith(f'evaluate.py: --config.attention_impl={impl}: ')
        assert f'this process has {platform} devices (use xla or dot_product)' in line


def test_unknown_key_and_missing_config_file_from_the_command_line(tmp_path):
    typo = _run('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                '--config.num_layer=3')
    assert typo.returncode == 1
    assert typo.stderr.strip().splitlines()[-1] == (
        'train.py: --config.num_layer: no such config key in configs/tiny.py')
    assert 'Traceback' not in typo.stderr and not list(tmp_path.iterdir())  # nothing started
    missing = _run('evaluate.py', '--config=configs/nope.py', f'--workdir={tmp_path}')
    assert missing.returncode == 1 and 'Traceback' not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1] == (
        "evaluate.py: --config=configs/nope.py: [Errno 2] No such file or directory: "
        "'configs/nope.py'")


def test_a_did_you_mean_hint_is_kept():
    error = KeyError('\'num_layers\'\nDid you mean "scan_layers" instead of "num_layers"?')
    assert cli._missing_key(error, ['x', '--config=configs/tiny.py', '--config.num_layers=2']) \
        == '--config.num_layers: no such config key in configs/tiny.py (did you mean scan_layers?)'
