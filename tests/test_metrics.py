"""Metric writers leave parseable JSON lines and TensorBoard events; MFU arithmetic."""

import io
import json
import math
import os

import jax.numpy as jnp
import pytest

from t2t import metrics


def test_writer_jsonl_stdout_and_events(tmp_path):
    out = io.StringIO()
    with metrics.MetricWriter(tmp_path, stream=out) as writer:
        writer.write_scalars(10, {'loss': jnp.float32(2.5), 'lr': 1e-3, 'mfu': None})
        writer.write_scalars(20, {'loss': float('nan'), 'lr': 2e-3})
    lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {'step': 10, 'loss': 2.5, 'lr': 1e-3},
        {'step': 20, 'loss': None, 'lr': 2e-3},
    ]
    assert out.getvalue().splitlines()[0] == 'step 10 | loss 2.5 | lr 0.001'
    assert any(f.startswith('events.out.tfevents') for f in os.listdir(tmp_path))

    # A resumed run appends; lines of one step merge, the rewritten keys win when reading back.
    with metrics.MetricWriter(tmp_path, stream=out, tensorboard=False) as writer:
        writer.write_scalars(20, {'loss': 1.0})
        writer.write_scalars(30, {'loss': 0.5})
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        f.write('{"step": 40, "lo')  # torn by a crash
    assert len((tmp_path / 'metrics.jsonl').read_text().splitlines()) == 5
    assert metrics.read_jsonl(tmp_path) == [
        {'step': 10, 'loss': 2.5, 'lr': 1e-3},
        {'step': 20, 'loss': 1.0, 'lr': 2e-3},
        {'step': 30, 'loss': 0.5},
    ]


def test_disabled_writer_writes_nothing(tmp_path):
    out = io.StringIO()
    writer = metrics.MetricWriter(tmp_path / 'w', enabled=False, stream=out)
    writer.write_scalars(1, {'loss': 1.0})
    writer.close()
    assert not (tmp_path / 'w').exists() and out.getvalue() == ''


def test_mfu_arithmetic():
    # 6 * 1e9 params * 1e5 tokens = 6e14 FLOPs in 0.5 s on 2 devices of 1e15 peak -> 60%.
    assert metrics.mfu(6e14, 0.5, 2, 1e15) == pytest.approx(0.6)
    assert math.isnan(metrics.mfu(6e14, 0.5, 2, None))
    assert math.isnan(metrics.mfu(6e14, 0.0, 2, 1e15))


def test_peak_flops_pick_the_most_specific_device_kind():
    # Every listed kind resolves to its own entry, not to a shorter name listed before it.
    for name, peak in metrics._PEAK_FLOPS:
        assert metrics.peak_flops_per_device(name.upper()) == peak, name
    # jax's names: 'TPU v5 lite' is v5e, 'TPU v5' is v5p; a PCIe H100 is not an SXM one.
    assert metrics.peak_flops_per_device('TPU v5 lite') < metrics.peak_flops_per_device('TPU v5')
    assert (metrics.peak_flops_per_device('NVIDIA H100 PCIe')
            < metrics.peak_flops_per_device('NVIDIA H100 80GB HBM3'))
    assert metrics.peak_flops_per_device('cpu') is None


def test_peak_flops_of_this_machine_is_unknown_on_cpu():
    assert metrics.peak_flops_per_device() is None
