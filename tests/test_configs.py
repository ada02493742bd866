"""Every experiment config builds, is locked, and its model is the one it claims to be."""

import glob
import importlib.util
import os

import pytest

from t2t.model import TransformerConfig, abstract_params, count_params
from tests.helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(
    p for p in glob.glob(os.path.join(ROOT, 'configs', '*.py'))
    if os.path.basename(p) not in ('__init__.py', 'common.py'))


def load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_the_expected_configs_exist():
    names = {os.path.basename(p)[:-3] for p in CONFIG_FILES}
    assert {'default', 'tiny', 'wmt14_ende_base', 'wmt14_ende_big', 'wmt14_enfr_big'} <= names


@pytest.mark.parametrize('path', CONFIG_FILES, ids=os.path.basename)
def test_config_builds_and_is_locked(path):
    config = load(path)
    assert config.is_locked
    with pytest.raises(AttributeError, match='learning_rte'):
        config.learning_rte = 1.0
    config.learning_rate_scale = 0.5  # known keys stay writable
    model_config = TransformerConfig.from_config(config)
    assert count_params(abstract_params(model_config)) > 0


def test_paper_configs_have_the_papers_sizes():
    base = load(os.path.join(ROOT, 'configs', 'wmt14_ende_base.py'))
    big = load(os.path.join(ROOT, 'configs', 'wmt14_ende_big.py'))

    def count(c):
        return count_params(abstract_params(TransformerConfig.from_config(c)))

    assert count(base) == 63_045_632  # no attention biases (the default)
    assert count(big) == 214_171_648
    assert (base.adam_b1, base.adam_b2, base.adam_eps) == (0.9, 0.98, 1e-9)
    assert base.warmup_steps == 4000 and base.label_smoothing == 0.1
    assert big.dropout_rate == 0.3 and base.dropout_rate == 0.1
    assert (base.beam_size, base.length_penalty_alpha, base.max_decode_extra) == (4, 0.6, 50)


def test_dry_run_prints_params_and_flops_and_rejects_unknown_keys():
    cmd = ['train.py', '--config=configs/wmt14_ende_base.py', '--dry_run']
    out = run_script(*cmd, devices=8, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'params: 63045632' in out.stdout.splitlines()
    flops_line = next(line for line in out.stdout.splitlines() if line.startswith('train_flops'))
    assert float(flops_line.split(':')[1]) > 1e12
    bad = run_script(*cmd, '--config.dmodel=3', devices=8, timeout=120)
    assert bad.returncode != 0 and 'dmodel' in bad.stderr
