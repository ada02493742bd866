"""A bad --config.key=value is one line naming the key, before any data or compile (t2t/run/cli.py,
the rules in t2t/run/config_checks.py)."""

import importlib
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from configs import tiny
from t2t import model, optim, train_lib
from t2t.decode import DecodeConfig
from t2t.infra import exits
from t2t.run import cli, config_checks, startup

ROOT = Path(__file__).resolve().parents[1]
# The core's dataclasses of a config: each checks its own fields (the line of a bad one is theirs).
DATACLASSES = (model.TransformerConfig, train_lib.StepConfig, optim.OptimConfig,
               DecodeConfig)


def _exit_line(fn, *args) -> str:
    with pytest.raises(SystemExit) as excinfo:
        fn(*args)
    message = str(excinfo.value.code)
    assert '\n' not in message and 'Traceback' not in message
    return message


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin:/bin'})


# (key, value, the line): the values of issue 32 that gave a traceback (most after data
# preparation and compilation) or were accepted, then those that already gave one line, then more.
BAD_VALUES = [
    ('num_eval_batches', 0, 'num_eval_batches=0 must be >= 1, or -1 for all'),
    ('log_every_steps', 0, 'log_every_steps=0 must be >= 1'),
    ('eval_every_steps', 0, 'eval_every_steps=0 must be >= 1'),
    ('checkpoint_every_steps', 0, 'checkpoint_every_steps=0 must be >= 1'),
    ('grad_accum_steps', 0, 'grad_accum_steps=0 must be >= 1'),
    ('mesh_shape', (1, 1), 'mesh_shape=(1, 1) must be 3 sizes (data, fsdp, tensor), each >= 1 or '
                           'one -1 (the devices left), e.g. --config.mesh_shape=-1,1,1'),
    ('warmup_steps', 0, 'warmup_steps=0 must be >= 1 (the steps the learning rate rises over)'),
    ('warmup_steps', -5, 'warmup_steps=-5 must be >= 1 (the steps the learning rate rises over)'),
    ('batch_size', 0, 'batch_size=0 must be >= 1'),
    ('max_len', 0, 'max_len=0 must be >= 1'),
    ('vocab_size', 3, "vocab_size=3 must be >= 300 (256 UTF-8 byte pieces, PAD/EOS/UNK and the "
                      "corpus's characters)"),
    ('label_smoothing', 1.0, 'label_smoothing=1.0 must be in [0, 1)'),
    ('learning_rate_scale', -1.0, 'learning_rate_scale=-1.0 must be > 0'),
    ('num_train_steps', -1, 'num_train_steps=-1 must be >= 1'),
    ('dropout_rate', 1.5, 'dropout_rate=1.5 must be in [0, 1)'),
    ('d_model', 30, 'd_model=30 must be divisible by num_heads=4'),
    ('attention_impl', 'flash',
     "attention_impl='flash' must be one of ('auto', 'xla', 'dot_product', 'cudnn', 'splash')"),
    ('attention_impl', 'cudnn', "attention_impl='cudnn' cannot run: dtype=float32: cuDNN flash "
                                'attention takes bfloat16 or float16 (use auto or xla)'),
    ('attention_impl', 'cudnn', "attention_impl='cudnn' cannot run: head dim 12 (d_model=48 / "
                                'num_heads=4): cuDNN takes multiples of 8 up to 256 on compute '
                                'capability 9.0 (use auto or xla)',
     {'dtype': 'bfloat16', 'd_model': 48}),
    ('beam_size', 0, 'beam_size=0 must be >= 1'),
    ('beam_shrink_floor', -1, 'beam_shrink_floor=-1 must be >= 0 (0: no compaction)'),
    ('beam_stop', 'never', "beam_stop='never' must be one of ('bound', 'k_finished')"),
    ('beam_unfinished', 'x', "beam_unfinished='x' must be one of ('fallback', 'compete')"),
    ('max_len', 300, 'max_len=300 exceeds max_position=256 (--config.max_len or '
                     '--config.max_position)'),
    ('max_decode_len', 300, 'max_decode_len=300 exceeds max_position=256 '
                            '(--config.max_decode_len or --config.max_position)'),
    ('mesh_shape', ('1,x',), "mesh_shape=('1,x',) must be 3 sizes (data, fsdp, tensor), each >= 1 "
                             "or one -1 (the devices left), e.g. --config.mesh_shape=-1,1,1"),
    ('mesh_shape', (-1, -1, 1), 'mesh_shape=(-1, -1, 1) must be 3 sizes (data, fsdp, tensor), '
                                'each >= 1 or one -1 (the devices left), e.g. '
                                '--config.mesh_shape=-1,1,1'),
    ('dcn_mesh_shape', (0, 1, 1), 'dcn_mesh_shape=(0, 1, 1) must be 3 sizes >= 1 (data, fsdp, '
                                  'tensor), e.g. --config.dcn_mesh_shape=2,1,1'),
    ('num_heads', 0, 'num_heads=0 must be >= 1'),  # no ZeroDivisionError from d_model % 0
    ('batch_size', 15, 'batch_size=15 must be a multiple of grad_accum_steps=2',
     {'grad_accum_steps': 2}),
    ('attention_dropout_rate', 0.1, "attention_dropout_rate=0.1 needs attention_impl=xla "
                                    "(attention_impl='dot_product' has no dropout on "
                                    "attention weights)", {'attention_impl': 'dot_product'}),
    ('position_embedding', 'rope', "position_embedding='rope' needs an even head dimension: "
                                   "d_model=36 / num_heads=4", {'d_model': 36}),
    ('rng_impl', 'philox', "rng_impl='philox' must be one of ('threefry', 'rbg', 'unsafe_rbg')"),
    ('dtype', 'float16', "dtype='float16' must be one of ('float32', 'bfloat16')"),
    ('loss_impl', 'chunked', "loss_impl='chunked' must be one of ('plain', 'fused')"),
    ('z_loss', -1e-4, 'z_loss=-0.0001 must be >= 0 (0: off)'),
    ('average_fraction', 0.0, 'average_fraction=0.0 must be in (0, 1] (the final part of a run '
                              'whose checkpoints are averaged)'),
    # the model's, the step's and the optimizer's own checks (their dataclasses'), made at startup
    ('max_position', 0, 'max_position=0 must be >= 1'),  # before the lengths it bounds
    ('loss_chunk_len', -1, 'loss_chunk_len=-1 must be >= 0 (0: one chunk)'),
    ('spike_skip', -1.0, 'spike_skip=-1.0 must be >= 0 (standard deviations; 0: off)'),
    ('adam_eps', 0.0, 'adam_eps=0.0 must be > 0'),
    ('clip_grad_norm', -1.0, 'clip_grad_norm=-1.0 must be >= 0 (0: off)'),
    # decoding: DecodeConfig's own check, made once at startup
    ('decode_strategy', 'nucleus',
     "decode_strategy='nucleus' must be one of ('beam', 'greedy', 'sample')"),
    ('temperature', 0.0, "temperature=0.0 must be > 0 (1: the model's distribution)"),
    ('top_k', -1, 'top_k=-1 must be >= 0 (0: every token)'),
    ('top_p', 1.5, 'top_p=1.5 must be in (0, 1] (1: every token)'),
    ('decode_seed', -1, 'decode_seed=-1 must be >= 0'),
    ('length_penalty_alpha', -0.6, 'length_penalty_alpha=-0.6 must be >= 0'),
    ('max_decode_extra', -1, 'max_decode_extra=-1 must be >= 0'),
    ('max_decode_len', 0, 'max_decode_len=0 must be >= 1'),
    # storage (t2t/infra/uploads.py)
    ('storage_queue_mb', 0, 'storage_queue_mb=0.0 must be > 0: the MiB of writes kept for a '
                            'storage that does not answer'),
    ('storage_queue_mb', -1.0, 'storage_queue_mb=-1.0 must be > 0: the MiB of writes kept for a '
                               'storage that does not answer'),
    ('storage_outage_limit_s', 5.0, 'storage_outage_limit_s=5.0 must be 0 (not retried) or >= '
                                    '8 s, the longest wait between two tries of a failed write '
                                    '(a shorter limit ends the run before its second try)'),
    ('storage_outage_limit_s', -1.0, 'storage_outage_limit_s=-1.0 must be 0 (not retried) or >= '
                                     '8 s, the longest wait between two tries of a failed write '
                                     '(a shorter limit ends the run before its second try)'),
]


@pytest.mark.parametrize('case', BAD_VALUES, ids=[f'{case[0]}={case[1]}' for case in BAD_VALUES])
def test_an_invalid_value_is_one_line_naming_the_key_and_what_it_needs(case):
    key, value, line, *also = case  # also: other keys the rule reads, set first
    config = tiny.get_config()
    config.update(*also)
    config[key] = value
    assert _exit_line(cli.check_values, config, 'train.py') == f'train.py: {line}'
    if key in config_checks.LENGTH_KEYS and 'max_position' in line:  # the library's callers
        with pytest.raises(startup.ConfigError) as error:
            startup.check_lengths(config)
        assert str(error.value) == line
    if config_checks.problem(config, keys=(key,)) is None:  # not the table's: a dataclass's
        refused = []
        for cls in DATACLASSES:
            try:
                cls.from_config(config)
            except ValueError as error:
                refused.append(str(error))
        assert refused[:1] == [line]


def test_every_config_file_passes_and_one_minus_one_in_the_mesh_is_valid():
    for path in sorted((ROOT / 'configs').glob('*.py')):
        module = importlib.import_module(f'configs.{path.stem}')
        if hasattr(module, 'get_config'):
            cli.check_values(module.get_config(), 'train.py')  # returns: nothing to say
    config = tiny.get_config()
    config.mesh_shape = (1, -1, 1)
    cli.check_values(config, 'train.py')


MESH_LINE = 'mesh_shape=(3, 1, 1) needs 3 devices, the run has 1 (-1 in it takes what is left)'


def test_a_mesh_the_devices_cannot_form_is_a_config_error_naming_it():
    one = jax.devices()[:1]
    config = tiny.get_config()
    config.mesh_shape = (3, 1, 1)
    with pytest.raises(startup.ConfigError) as error:
        startup.make_mesh(config, one)
    assert str(error.value) == MESH_LINE
    config.mesh_shape, config.dcn_mesh_shape = (-1, 1, 1), (2, 1, 1)
    with pytest.raises(startup.ConfigError, match=r'^dcn_mesh_shape=\(2, 1, 1\) needs 2 slices'):
        startup.make_mesh(config, one)
    config.dcn_mesh_shape = (1, 1, 1)
    assert startup.make_mesh(config, one).shape == {'data': 1, 'fsdp': 1, 'tensor': 1}


@pytest.mark.parametrize('flag, line', [
    ('--config.num_eval_batches=0', 'train.py: num_eval_batches=0 must be >= 1, or -1 for all'),
    ('--config.mesh_shape=3,1,1',  # one CPU device: the mesh is made before any data
     f'train.py: {MESH_LINE}'),
    ('--config.beam_size=0', 'train.py: beam_size=0 must be >= 1'),  # DecodeConfig's check
])
def test_train_py_says_it_in_one_line_before_data_or_compile(tmp_path, flag, line):
    data_dir = tmp_path / 'data'
    run = _run('train.py', '--config=configs/tiny.py', f'--workdir={tmp_path / "run"}',
               f'--config.data_dir={data_dir}', flag)
    assert run.returncode == exits.ERROR
    assert run.stderr.strip() == line  # the only line: no traceback, no progress
    assert not data_dir.exists()  # nothing prepared


@pytest.mark.parametrize('impl, platform, ok', [
    ('splash', 'cpu', False), ('splash', 'tpu', True), ('cudnn', 'cpu', False),
    ('cudnn', 'gpu', True), ('cudnn', 'tpu', False), ('dot_product', 'cpu', True)])
def test_attention_kernels_need_their_platform(impl, platform, ok, capsys):
    config = tiny.get_config()
    config.attention_impl, config.dtype = impl, 'bfloat16'
    if ok:
        cli.check_platform(config, platform, 'evaluate.py')
        assert config.attention_impl == impl
        assert capsys.readouterr().out.startswith(f'evaluate.py: attention_impl={impl} -> {impl} (')
    else:
        line = _exit_line(cli.check_platform, config, platform, 'evaluate.py')
        assert line.startswith(f'evaluate.py: --config.attention_impl={impl}: ')
        assert line.endswith(f'the target is {platform} (use auto, xla, dot_product'
                             + (', splash)' if platform == 'tpu' else ')'))


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


def test_a_missing_key_is_found_in_the_config_file_with_a_hint():
    argv = ['x', '--config=configs/tiny.py', '--config.beam_size=2', '--config.num_layers=2']
    assert cli._missing_key(argv) == (
        '--config.num_layers: no such config key in configs/tiny.py (did you mean scan_layers?)')
    assert cli._missing_key(['x', '--config=configs/tiny.py', '--config.tsv_files.dev=a']) == (
        '--config.tsv_files.dev: no such config key in configs/tiny.py')
    assert cli._missing_key(['x', '--config=configs/tiny.py', '--config.beam_size=2']) is None
