"""A shared data_dir in a bucket for hosts with their own disks (t2t/data/shared.py), on a real
Cloud Storage API on localhost (tests/gcs_server.py).

Two processes of one jax.distributed job (tests/data_driver.py: the data steps train.py takes
before its first step), each with its own local data_dir, config.shared_data_dir=gs://...:
process 0 prepares and uploads; process 1, whose corpus paths do not even exist, copies the
vocabulary, packed rows and evaluation split, tokenizes nothing, reads no corpus, and gets
byte-identical data. Then in this process, as a host restarting on that disk: a matching copy is
reused (nothing downloaded), a corrupt file is found by its digest and replaced alone.
"""

import hashlib
import json
import os
import socket
import subprocess
import time

import pytest

from t2t.data import cache, identity, pipeline, shared, tokenizer
from t2t.infra import workdir as wd
from tests import gcs_server, toy_corpus
from tests.helpers import start_script, tiny_config

pytestmark = pytest.mark.xdist_group(__name__)
TIMEOUT_S = 180  # the two processes take seconds; a loaded 2-core machine a few times that


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def _two_hosts(corpora: list[dict], data_dirs: list[str], share: str, workdir: str,
               log_dir) -> list[dict]:
    """tests/data_driver.py on 2 processes; their JSON lines (raises with stderr on failure)."""
    port = _free_port()
    procs = []
    for i in range(2):
        spec = {'corpus': corpora[i], 'data_dir': data_dirs[i], 'shared_data_dir': share,
                'workdir': workdir, 'distributed': {'coordinator': f'localhost:{port}',
                                                    'num_processes': 2, 'process_id': i}}
        procs.append(start_script('-m', 'tests.data_driver', json.dumps(spec),
                                  stdout=subprocess.PIPE,
                                  stderr=open(log_dir / f'host-{i}.err', 'w+')))
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        # One failed: it (jax.distributed's shutdown) and the other (at a barrier) would wait.
        if any(p.poll() for p in procs) or any(
                'Traceback' in (log_dir / f'host-{i}.err').read_text() for i in range(2)):
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.2)
    outs = []
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        outs.append(proc.communicate()[0].decode())
    if any(p.returncode for p in procs):
        raise AssertionError('\n'.join(
            f'--- process {i} exited with {p.returncode}:\n'
            + (log_dir / f'host-{i}.err').read_text()[-2000:] for i, p in enumerate(procs)))
    return [dict(json.loads(out.strip().splitlines()[-1]), log=out) for out in outs]


@pytest.fixture(scope='module')
def pod(tmp_path_factory):
    root = tmp_path_factory.mktemp('shared')
    corpus = toy_corpus.make_corpus(root)
    paths = {k: str(v) for k, v in corpus.items() if k != 'validation_texts'}
    # Host 1 has none of the corpus: any read of it would fail.
    absent = {**paths, **{s: f'/nonexistent/{s}.tsv' for s in ('train', 'validation', 'test')}}
    data_dirs = [str(root / 'host0'), str(root / 'host1')]
    with gcs_server.serve() as url:
        share = gcs_server.make_bucket(url, 'data') + '/prepared'
        hosts = _two_hosts([paths, absent], data_dirs, share, str(root / 'run'), root)
        yield {'corpus': corpus, 'absent': absent, 'hosts': hosts, 'data_dirs': data_dirs,
               'share': share}


def test_the_second_host_copies_the_data_and_never_tokenizes(pod):
    first, second = pod['hosts']
    assert first['counts']['tokenize'] > 0 and first['counts']['corpus'] > 0  # counters count
    assert second['counts'] == {}  # no encode, no training, no corpus read on host 1
    assert ': copied 5 of 5 files' in second['log'] and 'uploaded' not in second['log']
    assert ': uploaded 5 files' in first['log'] and 'copied' not in first['log']
    # Byte-identical data: every prepared file, the checkpoint's data identity, the batches.
    assert first['files'] == second['files']
    assert {os.path.dirname(f) for f in first['files']} >= {'vocab', 'eval'}
    assert sum(f.startswith('packed/') for f in first['files']) == 5  # 4 arrays + meta.json
    assert first['identity'] == second['identity']
    assert first['batches'] == second['batches'] and first['eval'] == second['eval']
    # The share holds each item whole: a manifest per item, the token shards included.
    for top in ('vocab', 'tokens', 'packed', 'eval'):
        assert len(wd.glob(wd.path(pod['share'], top), '*' + shared.MANIFEST_SUFFIX)) == 1, top


def _host1_config(pod):
    corpus = dict(pod['corpus'], **{k: pod['absent'][k] for k in ('train', 'validation', 'test')})
    return tiny_config(corpus, data_dir=pod['data_dirs'][1],
                       shared_data_dir=pod['share'])


def test_a_matching_copy_is_reused_and_a_corrupt_file_replaced(pod, monkeypatch):
    config = _host1_config(pod)
    downloads = []
    download = shared._download
    monkeypatch.setattr(shared, '_download', lambda c, name, want, dst: (
        downloads.append(name), download(c, name, want, dst)))
    monkeypatch.setattr(tokenizer.Tokenizer, 'encode_batch', None)  # tokenizing would fail
    first_files = pod['hosts'][0]['files']
    packed_rel = next(f for f in first_files if f.endswith('inputs.bin'))
    directory = os.path.join(config.data_dir, os.path.dirname(packed_rel))
    inputs = os.path.join(config.data_dir, packed_rel)
    # Host 1 restarting on its own disk: everything local matches, nothing is copied.
    vocab = os.path.join(config.data_dir, next(f for f in first_files if f.startswith('vocab/')))
    inode = os.stat(inputs).st_ino
    assert shared.fetch(config, vocab) == shared.REUSED
    assert shared.fetch(config, directory) == shared.REUSED
    assert downloads == [] and os.stat(inputs).st_ino == inode
    # A flipped byte (same size): found by its digest; only that file is copied again.
    with open(inputs, 'r+b') as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert shared.fetch(config, directory) == shared.COPIED
    assert downloads == [packed_rel]
    packed = cache._load(directory)
    assert packed.meta['digest'] == pod['hosts'][0]['identity']['train_digest']
    assert hashlib.sha256(open(inputs, 'rb').read()).hexdigest() == first_files[packed_rel]
    assert shared.fetch(config, directory) == shared.REUSED and len(downloads) == 1


def test_a_fresh_single_host_takes_the_share_and_a_damaged_share_is_one_line(pod, tmp_path,
                                                                             monkeypatch):
    # A recreated VM (process 0 alone, an empty disk, no corpus): the share's copy, no training.
    config = tiny_config(
        dict(pod['corpus'], **{k: pod['absent'][k] for k in ('train', 'validation', 'test')}),
        data_dir=str(tmp_path / 'fresh'), shared_data_dir=pod['share'])
    monkeypatch.setattr(tokenizer.Tokenizer, 'encode_batch', None)
    vocab_rel = next(f for f in pod['hosts'][0]['files'] if f.startswith('vocab/'))
    tok = pipeline._load_or_train(config, os.path.join(config.data_dir, vocab_rel))
    assert identity.sha256_file(tok.path) == pod['hosts'][0]['files'][vocab_rel]
    # A part object whose bytes differ from the manifest: one line naming it, nothing placed.
    packed_rel = next(f for f in pod['hosts'][0]['files'] if f.endswith('targets.bin'))
    part = wd.path(pod['share'], packed_rel + '.part-00000')
    good = wd.read_bytes(part)
    wd.write_atomic(part, b'x' + good[1:])
    try:
        with pytest.raises(shared.SharedDataError, match='part-00000: its sha256 differs'):
            shared.fetch(config, os.path.join(config.data_dir, os.path.dirname(packed_rel)))
    finally:
        wd.write_atomic(part, good)
    assert not os.path.exists(os.path.join(config.data_dir, os.path.dirname(packed_rel)))
