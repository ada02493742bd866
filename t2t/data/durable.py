"""Local files of a data_dir that survive a host crash whole or not at all.

A rename is atomic, but after a power loss or a kernel crash the file system may have kept the
rename and not the bytes: a renamed file can come back empty or torn. So a prepared file is
written under a temporary name, flushed and fsynced, renamed into place, and its directory is
fsynced (the rename itself reaches the disk). Readers still treat what they cannot parse as not
there (prepared again), never as done.
"""

import os
import tempfile


def fsync_dir(directory: str) -> None:
    """The directory's entries (a rename into it) on disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: str, path: str) -> None:
    """os.replace(tmp, path), then the parent directory fsynced (tmp itself already synced)."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_bytes(path: str, data: bytes) -> None:
    """`data` at `path`: temporary file, fsync, rename, fsync of the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f'.{os.path.basename(path)}.',
                               suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
