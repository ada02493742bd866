"""Several processes of one jax.distributed job preparing the same data.

Process 0 builds (trains the vocabulary, writes the packed cache) while the others wait; then the
others reuse what it built where they share its filesystem, or, where their data_dir is their own
(a TPU VM's disk), receive the vocabulary's bytes from process 0 and build the deterministic rest
themselves. Files are always written under a unique temporary name and renamed into place, so no
two processes ever write one file.

Several processes means a jax.distributed job (train.py / evaluate.py --coordinator_address=... or
--distributed); otherwise, e.g. `python -m t2t.data`, there is one and no jax backend is started.
"""

import hashlib
import os
import sys
import tempfile

import numpy as np

from t2t import workdir as wd


def _distributed() -> bool:
    if 'jax' not in sys.modules:  # nothing can have started jax.distributed
        return False
    import jax

    return jax.distributed.is_initialized()


def process_count() -> int:
    if not _distributed():
        return 1
    import jax

    return jax.process_count()


def process_index() -> int:
    if not _distributed():
        return 0
    import jax

    return jax.process_index()


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def file_digest(path: str) -> str:
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def share_file(path: str) -> None:
    """Process 0's bytes of `path` on every process's filesystem (written where they differ).

    Every process must call it; it returns on each once process 0 has the file (a barrier too).
    """
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    is_source = process_index() == 0
    data = b''
    if is_source:
        with open(path, 'rb') as f:
            data = f.read()
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buffer = np.frombuffer(data, np.uint8) if is_source else np.zeros(size, np.uint8)
    data = multihost_utils.broadcast_one_to_all(buffer).tobytes()
    if not is_source:
        same = False
        if os.path.exists(path):
            with open(path, 'rb') as f:
                same = f.read() == data
        if not same:
            wd.write_atomic(path, data)


def check_same(what: str, digest: str) -> None:
    """Raises a one-line error when `digest` (hex) differs between processes."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(digest)[:16], np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 16]
    differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if differ:
        raise RuntimeError(f'{what} differs between processes: processes {differ} disagree '
                           'with process 0')
