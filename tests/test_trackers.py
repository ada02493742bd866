"""Trackers (t2t/infra/trackers.py): a tiny run logs the same scalars to metrics.jsonl, W&B
(offline: its run file, read back here) and trackio (its local database); bad settings are one
line before anything runs."""

import glob
import json
import os
import sqlite3
import struct

import jax
import pytest

from t2t.eval import evaluation
from t2t.infra import metrics, trackers
from t2t.run import config_checks
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import tiny_config

pytestmark = pytest.mark.xdist_group(__name__)

SETTINGS = dict(num_train_steps=4, log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=4,
                eval_bleu_sentences=0, num_eval_batches=1, max_len=32, eval_batch_size=8,
                mesh_shape=(1, 1, 1))


def _wandb_history(path: str) -> list[dict]:
    """The history rows of a W&B run file: a LevelDB-style log (7-byte file header, then 32 KiB
    blocks of records: crc32, length, type, payload; FIRST/MIDDLE/LAST pieces of a long one) of
    wandb_internal_pb2.Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, 'rb').read()
    assert data[:4] == b':W&B'
    block, pos, pending, rows = 32768, 7, b'', []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending += payload
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b''
            if record.WhichOneof('record_type') == 'history':
                rows.append({item.key or '.'.join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_offline_and_trackio_receive_the_same_scalars(tmp_path, monkeypatch):
    monkeypatch.delenv('TRACKIO_DIR', raising=False)
    monkeypatch.setenv('WANDB_SILENT', 'true')
    corpus = toy_corpus.make_corpus(tmp_path, train=200)
    config = tiny_config(corpus, trackers=('tensorboard', 'wandb', 'trackio'), **SETTINGS)
    workdir = tmp_path / 'run'
    monkeypatch.setattr(evaluation, 'make_bleu_eval', lambda *args: lambda params: {})
    assert loop.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1]).step == 4
    logged = metrics.read_jsonl(workdir)
    assert [r['step'] for r in logged] == [2, 4] and 'loss' in logged[0]
    assert any(k.startswith('eval_') for k in logged[-1])

    (run_file,) = glob.glob(str(workdir / 'trackers/wandb/offline-run-*/run-*.wandb'))
    rows = {}  # W&B commits a step's row when a later step comes: one row per step
    for row in _wandb_history(run_file):
        rows.setdefault(row['_step'], {}).update(row)
    assert sorted(rows) == [2, 4]
    for record in logged:
        row = rows[record['step']]
        for key, value in record.items():
            if key != 'step' and value is not None:
                assert row[key] == pytest.approx(value, rel=1e-6), key
    assert glob.glob(str(workdir / 'events.out.tfevents.*'))  # TensorBoard as before

    db = sqlite3.connect(workdir / 'trackers/trackio/run.db')
    stored = {}  # one row per call: step 4's training and evaluation scalars apart
    for step, values in db.execute('SELECT step, metrics FROM metrics WHERE run_name = ?',
                                   ('run@0',)):
        stored.setdefault(step, {}).update(json.loads(values))
    assert sorted(stored) == [2, 4]
    for record in logged:
        values = stored[record['step']]
        assert set(values) == {k for k, v in record.items() if k != 'step' and v is not None}
        for key in values:
            assert values[key] == pytest.approx(record[key], rel=1e-6), key
    (config_json,) = db.execute('SELECT config FROM configs WHERE run_name = ?', ('run@0',))
    saved = json.loads(config_json[0])
    assert saved['d_model'] == config.d_model and saved['tsv_files.train'] == corpus['train']
    assert saved['run_record']['config']['trackers'] == list(config.trackers)


def test_tracker_settings_are_one_line():
    config = tiny_config(trackers=('tensorboard', 'mlflow'))
    assert config_checks.problem(config, keys=('trackers',)) == (
        "trackers=('tensorboard', 'mlflow') names 'mlflow': expected names from "
        "('tensorboard', 'wandb', 'trackio')")
    assert trackers.names('tensorboard, wandb') == trackers.names(('tensorboard,wandb',)) == (
        'tensorboard', 'wandb')  # --config.trackers=tensorboard,wandb: one string
    config = tiny_config(wandb_mode='cloud')
    assert config_checks.problem(config, keys=('wandb_mode',)).startswith(
        "wandb_mode='cloud' must be one of")
    config = tiny_config(trackers=('wandb',), tracker_dir='')
    with pytest.raises(trackers.ConfigError, match='set --config.tracker_dir=LOCAL_DIR'):
        trackers.tracker_dir(config, 'gs://bucket/run')
    assert trackers.tracker_dir(config, '/tmp/x/run') == os.path.join('/tmp/x/run', 'trackers')
    assert trackers.open_sinks(config, '/nonexistent/run', start_step=0, enabled=False) == []
