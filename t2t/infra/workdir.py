"""The one I/O layer for files under a workdir, a local directory or a bucket URL (gs://...).

Every file t2t writes or reads in a workdir (metrics.jsonl, TensorBoard events, markers, evaluation
records and hypotheses, watch and sweep state, the vocabulary copy, run records) goes through here;
checkpoints go through orbax, which takes the same paths. Paths are `etils.epath.Path`s: local
paths are made absolute, URLs are kept as given (`gs://` needs gcsfs, a dependency).

Writes are atomic: a reader sees the old file or the whole new one, never a part. Locally that is a
temporary file in the same directory renamed over the target; in a bucket an object upload is
atomic by itself (an object becomes visible only when its upload completes), so the object is
written directly. A bucket has no append: `Appender` keeps the file's content and rewrites the
whole object at each append (metrics files are small: one line per log step). A file that several
processes change at once (eval-<split>.json) goes through `update`, which loses none of their
changes: a lock locally, a generation precondition in a bucket.

Bucket faults: every read and write here is retried on a transient failure (HTTP 408/429/5xx,
connection resets, timeouts: gcsfs's own `is_retriable`, plus OSErrors of those kinds) with
exponential backoff (google-api-core's Retry) for up to RETRY_BUDGET_S, on top of gcsfs's own six
tries per request; then the last error is raised as it was. A missing object (FileNotFoundError)
or a refusal (403) is not retried. `is_transient` and `describe` are the one rule callers use to
tell weather from a mistake and to say it in one line.

Listings are never cached: gcsfs caches a directory listing with no expiry, so a process would
never see objects another process (a training beside evaluate.py --watch, another host) wrote
after its first listing; fsspec's configuration turns that cache off for every gs:// file system
made after this module is imported (orbax's included: it lists through the same epath).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import fsspec.config
from etils import epath
from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry

fsspec.config.conf.setdefault('gs', {})['use_listings_cache'] = False  # see the module doc

# Seconds of retries of one read or write before its error is raised; T2T_STORAGE_RETRY_S sets
# another (tests/test_bucket_faults.py: outages scaled down with it).
RETRY_BUDGET_S = float(os.environ.get('T2T_STORAGE_RETRY_S', '60'))
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
                     errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN}


def is_transient(error: BaseException) -> bool:
    """A failure that may pass by itself (503, 429, a reset, a timeout), not a missing object or
    a refusal."""
    if isinstance(error, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                          NotADirectoryError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True
    if _tensorstore_code(error):
        return _tensorstore_code(error) in _TENSORSTORE_TRANSIENT
    try:
        from gcsfs.retry import is_retriable
    except ImportError:  # no gcsfs: no bucket
        return False
    return is_retriable(error)


def transient_cause(error: BaseException | None) -> BaseException | None:
    """The first transient error in `error`'s chain of causes and contexts, or None (storage
    libraries wrap one another's errors: orbax re-raises gcsfs's, tensorstore's)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if is_transient(error):
            return error
        error = error.__cause__ or error.__context__
    return None


class _NoTransientTracebacks(logging.Filter):
    """orbax logs the traceback of every failed background write; a transient storage failure is
    retried and reported in one line by t2t, so its record keeps the line, not the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and transient_cause(record.exc_info[1]) is not None:
            record.exc_info, record.exc_text = None, None
        return True


def _unraisable(hook):
    """asyncio's 'Event loop is closed' from a write that completes after the loop of the save
    that gave up on it was closed: noise of a failed (and retried) save, not an error."""
    def unraisable(info):
        if isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == \
                'Event loop is closed':
            return
        hook(info)
    return unraisable


def quiet_transient_failures() -> None:
    """Called once by the entry points: the storage libraries' tracebacks of transient failures
    (retried by t2t, which says what stays failed in one line) are not printed."""
    logging.getLogger('gcsfs').setLevel(logging.CRITICAL)  # a traceback per request out of retries
    logging.getLogger('absl').addFilter(_NoTransientTracebacks())
    if not getattr(sys.unraisablehook, 't2t', False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)
        sys.unraisablehook.t2t = True


def describe(error: BaseException) -> str:
    """One line: the error's type and the first line of its message."""
    first = (str(error).strip().splitlines() or [''])[0][:300]
    return f'{type(error).__name__}: {first}' if first else type(error).__name__


class StorageError(OSError):
    """Storage that stayed down: a workdir write or a checkpoint save still failing after its
    retries for longer than the run's limit. Its message is one line naming the object."""


# tensorstore (orbax's array writer) raises ValueError('CODE: ...') with absl status codes.
_TENSORSTORE_TRANSIENT = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED', 'ABORTED')
_TENSORSTORE_CODES = _TENSORSTORE_TRANSIENT + ('NOT_FOUND', 'PERMISSION_DENIED', 'UNAUTHENTICATED',
                                               'INTERNAL', 'UNKNOWN', 'FAILED_PRECONDITION')


def _tensorstore_code(error: BaseException) -> str | None:
    if type(error) is ValueError and 'tensorstore' in str(error):
        code = str(error).split(':', 1)[0]
        return code if code in _TENSORSTORE_CODES else None
    return None


def is_storage_error(error: BaseException) -> bool:
    """An error of the storage under the workdir (an OSError; gcsfs's, google-auth's and
    google-api-core's errors; tensorstore's coded ValueErrors), not of t2t's own logic."""
    if isinstance(error, OSError) or _tensorstore_code(error):
        return True
    names = {f'{c.__module__}.{c.__name__}' for c in type(error).__mro__}
    return any(n.startswith(('gcsfs.', 'google.auth.', 'google.api_core.')) for n in names)


def storage_failure(error: BaseException | None) -> BaseException | None:
    """The storage failure that `error` is or carries, or None: the error itself when it is one
    (is_storage_error), else the first transient error among its causes (one library's storage
    failure raised inside another library's error). The one rule by which a run that ends on an
    error tells a storage failure (exit STORAGE or ERROR, t2t/run/cli.py) from a bug."""
    if error is None or is_storage_error(error):
        return error
    return transient_cause(error)


_RETRY = api_retry.Retry(predicate=is_transient, initial=1.0, maximum=16.0, multiplier=2.0,
                         timeout=RETRY_BUDGET_S)


def retried(fn, *args, budget_s: float = RETRY_BUDGET_S, **kwargs):
    """fn(*args, **kwargs), retried on transient failures for up to budget_s (0: one try, gcsfs's
    own retries aside); the last error is raised as it was (not wrapped)."""
    if budget_s <= 0:
        return fn(*args, **kwargs)
    try:
        return _RETRY.with_timeout(budget_s)(fn)(*args, **kwargs)
    except api_exceptions.RetryError as e:
        raise (e.cause or e) from None


def is_url(location) -> bool:
    """True for gs://, s3:// and the like (anything that is not a local path)."""
    return '://' in os.fspath(location)


def path(location, *parts) -> epath.Path:
    """WORKDIR/part/...: an absolute local path, or the URL as given."""
    location = os.fspath(location)
    base = epath.Path(location if is_url(location) else os.path.abspath(location))
    return base.joinpath(*parts) if parts else base


def exists(p) -> bool:
    return retried(epath.Path(p).exists)


def is_dir(p) -> bool:
    return retried(epath.Path(p).is_dir)


def makedirs(p) -> None:
    """Creates a local directory and its parents (a bucket needs none; a no-op there)."""
    p = epath.Path(p)
    if not is_url(p):
        p.mkdir(parents=True, exist_ok=True)


def read_bytes(p) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    try:
        return retried(epath.Path(p).read_bytes)
    except FileNotFoundError:
        return None


def read_text(p) -> str | None:
    """The file's text (UTF-8), or None when it does not exist."""
    data = read_bytes(p)
    return None if data is None else data.decode('utf-8')


def write_atomic(p, data: str | bytes, budget_s: float = RETRY_BUDGET_S) -> None:
    """Writes `data` to `p` so that no reader ever sees a partial file (see the module doc);
    budget_s: how long a bucket write is retried (see `retried`)."""
    p = epath.Path(p)
    data = data.encode('utf-8') if isinstance(data, str) else bytes(data)
    if is_url(p):
        # One object upload, visible only when complete; repeating it after a lost answer
        # writes the same bytes again.
        retried(_fs(p).pipe_file, os.fspath(p), data, budget_s=budget_s)
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.fspath(p.parent), prefix=f'.{p.name}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.fspath(p))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _fs(p: epath.Path):
    """The fsspec file system epath uses for the URL `p` (one per protocol, shared)."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(p)


def update(p, change: Callable[[str | None], str]) -> None:
    """Rewrites the text file `p` as change(its text, None when absent), never losing an update
    that another process or host makes at the same time (read-modify-write made safe).

    Locally: under an exclusive lock (flock on `.<name>.lock` beside it), then replaced atomically
    (readers never need the lock). In a bucket: the new object is written only if the object is
    still the generation that was read (Cloud Storage's ifGenerationMatch precondition; 0: still
    absent); when another writer came first (412), read, changed and written again.
    """
    p = epath.Path(p)
    if is_url(p):
        _update_in_bucket(p, change)
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(os.fspath(p.parent / f'.{p.name}.lock'), 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        write_atomic(p, change(read_text(p)))


_BOUNDARY = '==t2t-update=='


def _update_in_bucket(p: epath.Path, change: Callable[[str | None], str]) -> None:
    from urllib.parse import quote

    fs = _fs(p)
    bucket, key, _ = fs.split_path(os.fspath(p))
    upload = f'{fs._location}/upload/storage/v1/b/{quote(bucket)}/o'
    deadline = time.monotonic() + RETRY_BUDGET_S
    while True:
        try:
            generation = retried(fs.info, os.fspath(p))['generation']
            # That generation's bytes: if it was replaced meanwhile, this is a 404 or the write
            # below fails its precondition, and the loop goes round again.
            data = retried(fs.cat_file, os.fspath(p), generation=generation)
            text = data.decode('utf-8')
        except FileNotFoundError:
            generation, text = 0, None
        # A multipart upload, as gcsfs's own: one request, atomic, with the precondition.
        body = (f'--{_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n'
                f'{json.dumps({"name": key})}\n--{_BOUNDARY}\n'
                f'Content-Type: application/octet-stream\n\n').encode()
        body += change(text).encode('utf-8') + f'\n--{_BOUNDARY}--'.encode()
        try:
            retried(fs.call, 'POST', upload, uploadType='multipart', data=body,
                    ifGenerationMatch=str(generation), json_out=True,
                    headers={'Content-Type': f'multipart/related; boundary="{_BOUNDARY}"'})
            return
        except FileExistsError:  # 412: another writer's generation is there now
            if time.monotonic() > deadline:
                raise StorageError(f'{p}: still changed by other writers after '
                                   f'{RETRY_BUDGET_S:.0f} s of tries') from None
            time.sleep(random.uniform(0.01, 0.2))


def remove(p) -> bool:
    """Removes a file; False when there was none."""
    try:
        retried(epath.Path(p).unlink)
    except FileNotFoundError:
        return False
    return True


def glob(directory, pattern: str) -> list[epath.Path]:
    """The files of `directory` matching `pattern`, sorted by name ([] when it does not exist)."""
    directory = epath.Path(directory)
    if not exists(directory):
        return []
    return sorted(retried(lambda: list(directory.glob(pattern))), key=lambda q: q.name)


def copy(src, dst) -> None:
    """Copies a file (local or URL, either side) atomically to `dst`."""
    data = read_bytes(src)
    if data is None:
        raise FileNotFoundError(f'{src} does not exist')
    write_atomic(dst, data)


def check_writable(location) -> None:
    """WORKDIR can be created, and a file in it written, read back and deleted (a probe object in
    a bucket). Raises OSError with the reason; callers turn it into a one-line error."""
    probe = path(location, f'.t2t-write-probe-{uuid.uuid4().hex}')
    try:
        makedirs(probe.parent)
        probe.write_bytes(b't2t')
        if probe.read_bytes() != b't2t':
            raise OSError(f'{probe} read back different bytes')
        probe.unlink()
    except Exception as e:  # gcsfs / google-auth raise their own types too
        first = (str(e).strip().splitlines() or [''])[0][:200]
        if isinstance(e, FileNotFoundError) and is_url(location):
            first = f'no such bucket ({first})'
        elif isinstance(e, PermissionError):
            first = f'permission denied ({first})'
        elif not isinstance(e, OSError) or not e.strerror:
            first = f'{type(e).__name__}: {first}'
        else:
            raise
        raise OSError(first) from e


class Appender:
    """A text file that grows by whole lines, e.g. metrics.jsonl.

    Locally: opened for append, each `append` flushed at once. In a bucket: the content so far is
    kept in memory and the whole object rewritten by each `append` (atomic), since objects cannot
    be appended to. Either way a crash loses at most the call in flight.
    """

    def __init__(self, p):
        self.path = epath.Path(p)
        self._file = None
        self._content = None
        if is_url(self.path):
            self._content = read_text(self.path) or ''
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(os.fspath(self.path), 'a', encoding='utf-8')  # noqa: SIM115

    def append(self, text: str, budget_s: float = RETRY_BUDGET_S) -> None:
        """In a bucket, a failed write keeps `text`: the next append (or `flush`) writes it."""
        self.keep(text)
        self.flush(budget_s)

    def keep(self, text: str) -> None:
        """Adds `text` without writing it (a bucket: the next `flush` writes it)."""
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
        else:
            self._content += text

    def flush(self, budget_s: float = RETRY_BUDGET_S) -> None:
        if self._file is None:
            write_atomic(self.path, self._content, budget_s)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
