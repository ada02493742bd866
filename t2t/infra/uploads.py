"""Writes to a bucket workdir off the caller's thread: a byte-bounded queue, writer threads.

A bucket object cannot be appended to, so a file that grows (metrics.jsonl, an event file, a goodput
ledger) is kept in memory and its object rewritten whole (atomic: a reader sees the old object or
the new one). An `Uploader` owns one writer thread and the files given to it: `add` keeps the new
bytes and returns at once; the thread rewrites, in the order the files were first added, every
file that is behind, so a file added after another is never ahead of it (metrics.jsonl's record
of a step is written after the step's event). A failed write (an outage) is kept and tried again
with back-off (1 s doubling to BACKOFF_MAX_S; each try is one request with the storage client's
own retries), said once when it begins and once when writes work again.

The queue: the bytes kept and not yet written, over every uploader of the process (QUEUE). Its
bound (config.storage_queue_mb) is the only thing that makes the step loop wait: `make_room`
returns at once while the queue holds at most that many bytes, else waits for the writers,
saying so in one line, and books the wait with QUEUE.on_wait (the goodput ledger's 'storage
backpressure'). The writers' own time (background writes) is counted apart, in QUEUE.stats().
Storage that stays down past config.storage_outage_limit_s ends the run: `check` raises
workdir.StorageError naming the limit and the last durable checkpoint.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from t2t.infra import workdir as wd

BACKOFF_MAX_S = 8.0  # the longest wait between two tries of a failed write (or checkpoint save)
DEFAULT_QUEUE_MB = 64


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Queue:
    """The process's bytes waiting for storage (see the module doc)."""

    def __init__(self, max_bytes: int = DEFAULT_QUEUE_MB << 20):
        self.max_bytes = max_bytes
        self.limit_s = 0.0  # storage_outage_limit_s; 0: a failing writer never ends the run
        self.on_wait = None  # callable(seconds): the caller waited that long for room
        self.last_durable = lambda: None  # callable: the newest checkpoint step in storage
        self._cond = threading.Condition()
        self._failing = {}  # uploader -> (since, error, path) while its writes fail
        self._abandoned = None  # the same, of the last uploader closed with writes left
        self._down = {}  # owner -> (since, error, path): other writes failing (a checkpoint's)
        self.reset_stats()

    def configure(self, max_bytes: int, limit_s: float, on_wait=None, last_durable=None) -> None:
        """A run's settings (train.py: storage_queue_mb, storage_outage_limit_s, its ledger)."""
        with self._cond:
            self.max_bytes, self.limit_s, self.on_wait = max_bytes, limit_s, on_wait
            self.last_durable = last_durable or (lambda: None)
            self._abandoned, self._down = None, {}
            self._cond.notify_all()

    def reset_stats(self) -> None:
        with self._cond:
            self.pending = getattr(self, 'pending', 0)
            self.peak = self.pending
            self.written_bytes, self.write_s, self.waited_s = 0, 0.0, 0.0

    def stats(self) -> dict:
        """Background writes since `reset_stats`: bytes and seconds the writers spent, the peak
        of the queue, and how long callers waited for room."""
        with self._cond:
            return {'written_bytes': self.written_bytes, 'write_s': round(self.write_s, 6),
                    'peak_queue_bytes': self.peak, 'waited_s': round(self.waited_s, 6)}

    def _change(self, delta: int, wrote_s: float = 0.0, dropped: bool = False) -> None:
        with self._cond:
            self.pending += delta
            self.peak = max(self.peak, self.pending)
            if delta < 0 and not dropped:
                self.written_bytes -= delta
            self.write_s += wrote_s
            self._cond.notify_all()

    def _set_failing(self, uploader, failure, abandoned: bool = False) -> None:
        with self._cond:
            if failure is None:
                failed = self._failing.pop(uploader, None)
                if abandoned and failed is not None:
                    self._abandoned = failed
            else:
                self._failing.setdefault(uploader, failure)
            self._cond.notify_all()

    def failing(self):
        """(since, error, path) of the longest-failing writer, or None."""
        with self._cond:
            return min(self._failing.values(), key=lambda f: f[0], default=None)

    def down(self):
        """(since, error, path) of a writer failing now, of other writes said to (`set_down`),
        or of the last writer closed with writes left unwritten while failing (since
        `configure`); None: the storage is not known to be down."""
        with self._cond:
            return self.failing() or min(self._down.values(), key=lambda f: f[0],
                                         default=None) or self._abandoned

    def set_down(self, owner, failure) -> None:
        """Writes of `owner` outside the queue (a checkpoint's save) fail since (since, error,
        path), or work again (None): `down` only, no limit of the queue's."""
        with self._cond:
            if failure is None:
                self._down.pop(owner, None)
            else:
                self._down.setdefault(owner, failure)

    def check(self) -> None:
        """Raises workdir.StorageError when a writer has failed longer than limit_s."""
        failing = self.failing()
        if failing is None or self.limit_s <= 0:
            return
        since, error, path = failing
        if time.monotonic() - since >= self.limit_s:
            raise self.limit_error(f'writing {path}', since, error)

    def limit_error(self, what: str, since: float, error) -> wd.StorageError:
        return limit_error(what, since, error, self.limit_s, self.last_durable())

    def make_room(self) -> None:
        """Returns once the queue holds at most max_bytes: at once unless it is full; then waits
        for the writers (one line), up to what is left of limit_s (then StorageError)."""
        with self._cond:
            if self.pending <= self.max_bytes:
                return
            began = time.monotonic()
            _say(f'storage: {self.pending / 2**20:.1f} MiB of writes wait for the storage '
                 f'(storage_queue_mb={self.max_bytes / 2**20:g} is full); training waits for room')
            while self.pending > self.max_bytes:
                failing = min(self._failing.values(), key=lambda f: f[0], default=None)
                if failing and self.limit_s > 0 and \
                        time.monotonic() - failing[0] >= self.limit_s:
                    raise self.limit_error(f'writing {failing[2]}', failing[0], failing[1])
                self._cond.wait(timeout=1.0)
            waited = time.monotonic() - began
            self.waited_s += waited
            on_wait = self.on_wait
        _say(f'storage: the write queue has room again; training waited {waited:.1f} s')
        if on_wait is not None:
            on_wait(waited)


QUEUE = Queue()


def limit_error(what: str, since: float, error, limit_s: float, durable) -> wd.StorageError:
    """The one line of a run that its storage ends: what failed since when, the limit, the
    error and the last checkpoint in storage (None: none)."""
    return wd.StorageError(
        f'{what} failed for {time.monotonic() - since:.0f} s (storage_outage_limit_s='
        f'{limit_s:g}): {wd.describe(error)}; '
        + (f'the last checkpoint saved is step {durable}' if durable is not None else
           'no checkpoint was saved before'))


class _File:
    __slots__ = ('content', 'pending', 'version', 'replaced', 'added', 'done')

    def __init__(self, content: bytes):
        self.content, self.pending, self.version, self.replaced = content, 0, 0, 0
        self.added = self.done = 0  # bytes given to `add`, and of those, written


class Uploader:
    """One writer thread and its files (see the module doc). `say(line)` reports an outage's
    start and end (default: a warning in the log)."""

    def __init__(self, name: str, queue: Queue = QUEUE, say=None):
        self.name, self.queue = name, queue
        self._say = say or (lambda line: logging.warning('%s', line))
        self._files: dict = {}  # path -> _File, in the order first added
        self._cond = threading.Condition()
        self._closed, self._deadline = False, float('inf')
        self.behind = False  # a write failed and not every byte is written since
        self._thread = threading.Thread(target=self._run, daemon=True, name=f't2t-upload-{name}')
        self._thread.start()

    def track(self, path, content: bytes = b'') -> None:
        """`path` holds `content` already (e.g. read back at a resume): kept, nothing to write."""
        with self._cond:
            self._files.setdefault(str(path), _File(bytes(content)))

    def add(self, path, data: bytes, replace: bool = False) -> None:
        """Keeps `data` at the end of `path` (replace=True: as its whole content) for the thread
        to write; returns at once."""
        data = bytes(data)
        with self._cond:
            f = self._files.setdefault(str(path), _File(b''))
            before = f.pending
            f.version += 1
            f.added += len(data)
            if replace:
                f.content, f.pending, f.replaced = data, len(data), f.version
            else:
                f.content += data
                f.pending += len(data)
            self.queue._change(f.pending - before)
            self._cond.notify_all()

    def mark(self) -> dict[str, int]:
        """Where every file is now: `wait(seconds, mark)` waits for the bytes added up to here."""
        with self._cond:
            return {p: f.added for p, f in self._files.items()}

    def unwritten(self) -> dict[str, int]:
        """{path: bytes kept and not yet written}."""
        with self._cond:
            return {p: f.pending for p, f in self._files.items() if f.pending}

    def unwritten_lines(self, path) -> int:
        """The lines among `path`'s bytes kept and not yet written (a JSON-lines file's
        records)."""
        with self._cond:
            f = self._files.get(str(path))
            return f.content[len(f.content) - f.pending:].count(b'\n') if f else 0

    def wait(self, seconds: float, mark: dict[str, int] | None = None) -> bool:
        """Waits up to `seconds` for every byte (given a `mark`: every byte added before it) to
        be written: True when it is."""
        def done():
            if mark is None:
                return not self._any_pending()
            return all(self._files[p].done >= n for p, n in mark.items())

        with self._cond:
            return self._cond.wait_for(done, timeout=seconds)

    def _any_pending(self) -> bool:
        return any(f.pending for f in self._files.values())

    def _snapshot(self):
        return [(p, f.content, f.pending, (f.version, f.added))
                for p, f in self._files.items() if f.pending]

    def _run(self) -> None:
        delay, failing = 1.0, None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._any_pending())
                if not self._any_pending():
                    return  # closed with everything written
                todo = self._snapshot()
            try:
                for path, content, pending, version in todo:
                    began = time.monotonic()
                    wd.write_atomic(path, content, budget_s=0.0)
                    self._written(path, pending, version, time.monotonic() - began)
            except Exception as e:  # noqa: BLE001 - kept and tried again; never raised here
                if failing is None:
                    failing = (time.monotonic(), e, path)
                    self.queue._set_failing(self, failing)
                    self._say(f'{self.name}: writing {path} failed ({wd.describe(e)}); kept in '
                              'memory and written in the background, training goes on')
                self.behind = True
                with self._cond:  # the back-off; close() cuts short the one under way
                    self._cond.wait_for(
                        lambda closed=self._closed: self._closed != closed,
                        timeout=min(delay, max(0.0, self._deadline - time.monotonic())))
                    if self._closed and time.monotonic() >= self._deadline:
                        return
                delay = min(2 * delay, BACKOFF_MAX_S)
                continue
            if failing is not None:
                self.queue._set_failing(self, None)
                self._say(f'{self.name}: writing works again after '
                          f'{time.monotonic() - failing[0]:.0f} s; every record kept is written')
            delay, failing = 1.0, None

    def _written(self, path, pending: int, version: tuple[int, int], seconds: float) -> None:
        version, added = version
        with self._cond:
            f = self._files[path]
            f.done = max(f.done, added)
            # Bytes added after the snapshot stay pending; after a replacement, all of it.
            left = f.pending if f.replaced > version else f.pending - pending
            self.queue._change(left - f.pending, seconds)
            f.pending = left
            if not self._any_pending():
                self.behind = False
            self._cond.notify_all()

    def close(self, wait_s: float) -> bool:
        """Waits up to wait_s for every byte to be written (a back-off under way ends and the
        next try is now), then stops the thread: True when all was written. Unwritten bytes
        leave the queue."""
        with self._cond:
            self._deadline = time.monotonic() + wait_s
            self._closed = True
            self._cond.notify_all()
        written = self.wait(wait_s)
        self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()) + 1.0)
        with self._cond:
            self.queue._change(-sum(f.pending for f in self._files.values()), dropped=True)
            for f in self._files.values():
                f.pending = 0
        self.queue._set_failing(self, None, abandoned=not written)
        return written


class BoundedAppender(wd.Appender):
    """An Appender whose bucket writes go through an Uploader and hold the caller for at most
    `wait_s` (0: never): the goodput ledger.

    Locally as Appender. In a bucket, `append` waits for the line to be written up to wait_s
    while the bucket answers, and not at all once a write has run past wait_s or failed, until
    one completes again. With a healthy bucket and wait_s > 0 a line is written when `append`
    returns, as with Appender.
    """

    def __init__(self, p, wait_s: float, queue: Queue = QUEUE):
        super().__init__(p)
        self.wait_s = wait_s
        self._late = False  # a wait ran out since every line was last written
        self._uploader = None
        if self._content is not None:
            self._uploader = Uploader(self.path.name, queue)
            self._uploader.track(self.path, self._content.encode('utf-8'))

    def append(self, text: str, budget_s: float = wd.RETRY_BUDGET_S) -> bool:
        """Keeps `text`; in a bucket waits for it to be written (see the class doc). True when
        every line kept is written. budget_s is not used: the uploader retries until close."""
        del budget_s
        if self._uploader is None:
            self.keep(text)
            return True
        self._uploader.add(self.path, text.encode('utf-8'))
        return self.flush()

    def flush(self, budget_s: float = wd.RETRY_BUDGET_S) -> bool:
        del budget_s
        if self._uploader is None:
            return True
        behind = self._late or self._uploader.behind
        written = self._uploader.wait(0.0 if behind else self.wait_s)
        self._late = not written
        return written

    def close(self, wait_s: float = wd.RETRY_BUDGET_S) -> bool:
        """Waits up to wait_s for every line to be written, then stops the uploader: True when
        all were written."""
        if self._uploader is None:
            super().close()
            return True
        return self._uploader.close(wait_s)
