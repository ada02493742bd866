"""evaluate.py with a workdir in a bucket (a real Cloud Storage API on localhost, tests/gcs_server.py):
--watch sees every checkpoint a training beside it writes, concurrent merges of eval-<split>.json
keep every record, and a storage failure is one line."""

import json
import threading

import pytest

from t2t import evaluation
from t2t import workdir as wd
from tests import gcs_server

# One server for the module: its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)


@pytest.fixture(scope='module')
def bucket():
    with gcs_server.serve() as url:
        yield gcs_server.make_bucket(url, 'evals')


@pytest.mark.parametrize('where', ['local', 'bucket'])
def test_concurrent_merges_keep_every_label(where, bucket, tmp_path):
    path = wd.path(tmp_path if where == 'local' else f'{bucket}/merge', 'eval-test.json')
    start = threading.Barrier(2)
    errors = []

    def writer(name: str) -> None:
        try:
            start.wait()
            for i in range(30):
                evaluation.merge_json(path, f'{name}-{i}', {'sacrebleu': float(i)})
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ('a', 'b')]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    merged = json.loads(wd.read_text(path))
    assert sorted(merged) == sorted(f'{n}-{i}' for n in 'ab' for i in range(30))
    assert merged['b-29'] == {'sacrebleu': 29.0}
