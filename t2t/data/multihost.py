"""Several processes of one jax.distributed job preparing the same data.

Process 0 builds (trains the vocabulary, writes the packed cache) while the others wait on a
host-side barrier (jax's key-value store, t2t/infra/distributed.py: a progress line a minute, and
after config.data_wait_timeout_s an error naming what was awaited), never inside a device
collective; then the others reuse what it built where they share its filesystem, or, where their
data_dir is their own (a TPU VM's disk), receive the vocabulary's bytes from process 0 and build the
deterministic rest themselves. Every process then gives a digest of its vocabulary and of its
packed rows, and a host whose data differs (another library version, a stale cache) stops the job
with one line naming it. Files are always written under a unique temporary name and renamed into
place, so no two processes ever write one file.

With config.shared_data_dir (t2t/data/shared.py) the others copy process 0's items from the share
instead of building anything. Either way the names of the prepared items (which hash the corpus
files' contents) are computed by process 0 alone: `process_0_path` gives them to the others, so
no other host needs the corpus to find them.

The barriers and agreements themselves are t2t/infra/distributed.py's (`wait_for`, `agree`,
`share_bytes`, `process_index`); the data's own piece is here: a file of process 0 on every host.
Several processes means a jax.distributed job (train.py / evaluate.py --coordinator_address=...
or --distributed); otherwise, e.g. `python -m t2t.data`, there is one and no jax backend starts.
"""

import hashlib
import json
import os

from t2t.infra import distributed
from t2t.infra import workdir as wd


def file_digest(path: str) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def share_file(path: str, what: str, timeout_s: float) -> None:
    """Process 0's bytes of `path` on every process's filesystem (written where they differ).

    Every process must call it, process 0 once the file is ready; the others wait for it (`what`:
    what they wait for, in the progress lines and the timeout's error).
    """
    if distributed.process_count() == 1:
        return
    name = f'file:{os.path.basename(path)}'  # the same key on every host, whatever its data_dir
    if distributed.process_index() == 0:
        with open(path, 'rb') as f:
            distributed.share_bytes(name, f.read(), what, timeout_s)
        return
    data = distributed.share_bytes(name, None, what, timeout_s)
    if wd.read_bytes(path) != data:
        wd.write_atomic(path, data)


def process_0_path(config, path: str | None, name: str, timeout_s: float) -> str:
    """Process 0's `path` of a prepared item (under its data_dir, or any other path) on every
    process: the same relative path under this process's data_dir. Process 0 passes it, the
    others None (they wait for it, `name` naming what they wait for)."""
    if distributed.process_count() == 1:
        return path
    root = os.path.abspath(config.data_dir)
    if distributed.process_index() == 0:
        rel = os.path.relpath(os.path.abspath(path), root)
        inside = not rel.startswith('..')
        value = json.dumps([inside, rel if inside else path]).encode()
        distributed.share_bytes(f'path:{name}', value, f'process 0 names {name}', timeout_s)
        return path
    inside, value = json.loads(distributed.share_bytes(
        f'path:{name}', None, f'process 0 names {name}', timeout_s))
    return os.path.join(config.data_dir, value) if inside else value
