"""The recorder of the goodput ledger (the package's docstring says what it records)."""

from __future__ import annotations

import collections
import datetime
import functools
import json
import logging
import math
import os
import socket
import threading
import time
import typing

from t2t.infra import uploads
from t2t.infra import workdir as wd
from t2t.run import compile_cache

DIRNAME = 'goodput'
PHASES = ('startup', 'setup', 'data', 'restore', 'compile', 'train', 'data_wait', 'checkpoint',
          'eval', 'profile', 'logging', 'backpressure')
_STEP_PHASES = ('train', 'data_wait')  # a step timed across other phases is not a step time
BUCKET_RATIO = 1.02  # step-time histogram buckets: [1.02^k, 1.02^(k+1)) seconds
_LOG_RATIO = math.log(BUCKET_RATIO)
_IMPORTED = time.time()
_startup: dict[str, float] = {}  # seconds of named start-up stages before the first ledger
_first_attempt_of_process = True
# jax's compile stages (jax._src.dispatch's monitoring events) -> the ledger's names. The
# persistent compilation cache serves 'xla' (compile, or load from the cache); a stored
# executable (t2t/run/compile_cache.py) is 'load' and skips the others, its writing is 'store'.
_JAX_STAGES = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
               '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
               '/jax/core/compile/backend_compile_duration': 'xla',
               compile_cache.LOAD_EVENT: 'load', compile_cache.STORE_EVENT: 'store'}
_active = None  # the ledger of the attempt running in this process
_opened = None  # the _Opened start record that train.py wrote before the process's Ledger
LAUNCH_ENV = 'T2T_ATTEMPT'  # '<launch id>:<n>', set by a launcher that restarts (n from 0)
# How long the end of an attempt that its storage ended waits for its last records (the storage is
# known to be down). A ledger write never holds the loop: its uploader writes in the background.
WRITE_WAIT_S = 5.0


def _on_jax_duration(event: str, duration: float, **_) -> None:
    ledger = _active
    if ledger is not None and ledger._phase == 'compile' and event in _JAX_STAGES:
        ledger._stages[_JAX_STAGES[event]] += duration


def _listen_to_jax() -> None:
    import jax

    if _on_jax_duration not in getattr(_listen_to_jax, 'done', ()):
        jax.monitoring.register_event_duration_secs_listener(_on_jax_duration)
        _listen_to_jax.done = (_on_jax_duration,)


def process_start_time() -> float:
    """Unix time this process started (Linux: from /proc; elsewhere when this module loaded)."""
    try:
        with open('/proc/self/stat', encoding='ascii') as f:
            start_ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22: starttime
        with open('/proc/uptime', encoding='ascii') as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def note_startup(name: str, since: float) -> None:
    """Records a start-up stage that ran before the ledger (e.g. jax.distributed's initialization):
    `since` is its time.perf_counter() at the start. Part of the 'startup' phase."""
    _startup[name] = time.perf_counter() - since


class _Opened(typing.NamedTuple):
    workdir: str
    process: int
    appender: wd.Appender
    path: object
    start: float


def launch_attempt() -> dict | None:
    """{'launch': id, 'number': n} from $T2T_ATTEMPT: the launcher's count of this attempt, by
    which the report counts the attempts that ended before their first record."""
    launch, _, number = os.environ.get(LAUNCH_ENV, '').rpartition(':')
    return {'launch': launch, 'number': int(number)} if launch and number.isdigit() else None


def _start_record(start: float, process_index: int, process_count: int) -> dict:
    return {'at': 'start', 't': round(start, 3), 'host': socket.gethostname(), 'pid': os.getpid(),
            'process': process_index, 'processes': process_count,
            **({'attempt': launch_attempt()} if launch_attempt() else {})}


def open_attempt(workdir, process_index: int | None, process_count: int = 1,
                 all_processes: bool = False) -> None:
    """Writes this process's attempt-start record now: train.py's first act on a workdir, before
    jax and jax.distributed start, so that an attempt killed during start-up is in the ledger.
    The process's first Ledger continues the file. process_index None (not known before
    jax.distributed's detection): nothing now, the Ledger writes the record. Never raises."""
    global _opened
    if process_index is None or (process_index != 0 and not all_processes) or \
            not _first_attempt_of_process:
        return
    start = _process_start()
    try:
        path = attempt_path(workdir, start, process_index)
        appender = uploads.BoundedAppender(path, 0.0)
        appender.append(json.dumps(_start_record(start, process_index, process_count)) + '\n')
    except Exception as e:  # noqa: BLE001 - the Ledger tries again; the run's own checks speak
        logging.warning('goodput: writing the start record failed (%s: %s)', type(e).__name__,
                        str(e)[:200])
        return
    _opened = _Opened(str(wd.path(workdir)), process_index, appender, path, start)


def _process_start() -> float:
    return min(process_start_time(), time.time())


def attempt_path(workdir, start: float, process_index: int):
    stamp = datetime.datetime.fromtimestamp(start, datetime.UTC).strftime('%Y%m%dT%H%M%S.%fZ')
    return wd.path(workdir, DIRNAME, f'attempt-{stamp}-p{process_index}.jsonl')


def bucket(seconds: float) -> int:
    """The histogram bucket of a step time (seconds > 0)."""
    return math.floor(math.log(seconds) / _LOG_RATIO)


def bucket_value(k: int) -> float:
    """The middle (geometric) of bucket k, in seconds."""
    return math.exp((k + 0.5) * _LOG_RATIO)


class Ledger:
    """One attempt's phases, slices and findings (see the module docstring).

    The loop calls `mark(phase)` where a phase starts, `next_step()` at the top of every step,
    `flush(at)` where a slice is due; `compiling(fn)` and `timed(phase)` wrap functions.
    Writes never stop training: in a bucket a writer thread writes them (kept while the bucket
    fails and written when it answers again, t2t/infra/uploads.py); a failed local write is
    logged once and retried with the next. `waited(seconds)` books the loop's waits for room in
    the write queue as 'backpressure'; each slice also records the background writes since the
    previous one (uploads.QUEUE.stats(): bytes, the writers' seconds, the queue's peak).
    """

    def __init__(self, workdir, process_index: int = 0, process_count: int = 1,
                 enabled: bool = True, outage_limit_s: float = 0.0):
        """outage_limit_s: how long the run's own writes wait out a storage outage
        (config.storage_outage_limit_s); `end` waits as long for the attempt's last records."""
        global _first_attempt_of_process, _opened
        now, clock = time.time(), time.perf_counter()
        # A process's first attempt began when the process did; a later one (tests, notebooks)
        # when train_and_evaluate was called.
        opened = _opened if _first_attempt_of_process else None
        self.start = opened.start if opened else (
            _process_start() if _first_attempt_of_process else now)
        _first_attempt_of_process, _opened = False, None
        self.step = None  # the step reached (set by `begin`, counted by `next_step`)
        self._phase, self._since = 'startup', clock
        self._seconds = collections.defaultdict(float)
        self._seconds['startup'] = now - self.start
        self._hist = collections.Counter()  # step-time buckets of the current slice
        self._stages = collections.defaultdict(float)  # jax's stages inside 'compile' phases
        self._max_step = 0.0
        self._step_start, self._clean = None, False
        self._lock = threading.Lock()  # the watchdog's thread writes findings
        self._warned = False
        self._outage_limit_s = outage_limit_s
        self._appender = self.path = None
        if opened is not None and opened[:2] != (str(wd.path(workdir)), process_index):
            opened.appender.close()  # another workdir's or process's: that attempt has no ledger
            opened = None
        if opened is not None:  # train.py wrote the start record before jax started
            self._appender, self.path = opened.appender, opened.path
        elif enabled:
            self.path = attempt_path(workdir, self.start, process_index)
            self._appender = uploads.BoundedAppender(self.path, 0.0)
            self._write(_start_record(self.start, process_index, process_count))
        # The start-up so far as a slice: a kill from here on still leaves its time accounted.
        self.flush('ledger', startup={k: round(v, 6) for k, v in _startup.items()})
        self._phase = 'setup'

    @classmethod
    def from_config(cls, config, workdir) -> Ledger:
        """The ledger of an attempt starting now; it also books jax's compile stages."""
        import jax

        global _active
        _listen_to_jax()
        index = jax.process_index()
        _active = cls(workdir, index, jax.process_count(),
                      enabled=index == 0 or config.goodput_all_processes,
                      outage_limit_s=config.get('storage_outage_limit_s', 0.0))
        return _active

    # --- the loop's calls --------------------------------------------------------------------

    def mark(self, phase: str, flush: str | None = None) -> None:
        """From now on the attempt is in `phase`; with `flush`, a slice is written at once."""
        now = time.perf_counter()
        self._seconds[self._phase] += now - self._since
        self._phase, self._since = phase, now
        if phase not in _STEP_PHASES:
            self._clean = False
        if flush:
            self.flush(flush)

    def begin(self, step: int) -> None:
        """Training starts (or resumes) at `step`: a slice that records it."""
        self.step = int(step)
        self.flush('ready')

    def next_step(self) -> None:
        """The top of a step: times the previous one (if only training ran since), waits for
        data until `mark('train')`."""
        now = time.perf_counter()
        self._seconds[self._phase] += now - self._since
        self._phase, self._since = 'data_wait', now
        if self._clean:
            seconds = now - self._step_start
            if seconds > 0:
                self._hist[bucket(seconds)] += 1
                self._max_step = max(self._max_step, seconds)
        self._step_start, self._clean = now, True
        self.step = (self.step or 0) + 1

    def waited(self, seconds: float) -> None:
        """The loop waited `seconds` (just now, inside the current phase) for room in the write
        queue: they move from the current phase to 'backpressure'. Called by uploads.QUEUE."""
        self._seconds['backpressure'] += seconds
        self._seconds[self._phase] -= seconds
        self._clean = False

    def compiling(self, fn):
        """fn, whose first call is timed as 'compile' (then back to the phase it was called in)."""
        first = True

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal first
            if not first:
                return fn(*args, **kwargs)
            first = False
            previous = self._phase
            self.mark('compile')
            out = fn(*args, **kwargs)
            self.mark(previous, flush='compiled')
            return out

        return call

    def timed(self, phase: str, slice_after: bool = True):
        """A decorator: the function's calls are `phase`, then back to the phase they were called
        in; each followed by a slice (slice_after=False: none, the next slice holds them)."""
        def wrap(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                previous = self._phase
                self.mark(phase)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.mark(previous, flush=phase if slice_after else None)
            return call
        return wrap

    def flush(self, at: str, **extra) -> None:
        """Writes the slice since the previous one: each phase's seconds, the step reached."""
        now = time.perf_counter()
        self._seconds[self._phase] += now - self._since
        self._since = now
        record = {'at': at, 't': round(time.time(), 3), 'step': self.step,
                  'seconds': {k: round(v, 6) for k, v in self._seconds.items() if v > 0}}
        background = uploads.QUEUE.stats()
        if background['written_bytes'] or background['peak_queue_bytes']:
            record['background_writes'] = background
            uploads.QUEUE.reset_stats()
        if self._stages:
            record['compile_stages'] = {k: round(v, 6) for k, v in self._stages.items()}
            self._stages.clear()
        if self._hist:
            record['step_times'] = {str(k): n for k, n in sorted(self._hist.items())}
            record['max_step_s'] = round(self._max_step, 6)
        self._seconds.clear()
        self._hist.clear()
        self._max_step = 0.0
        self._write({**record, **extra})

    def finding(self, kind: str, step: int, elapsed_s: float, limit_s: float) -> None:
        """The watchdog saw a step or a save run past its limit (called from its thread)."""
        self._write({'at': 'finding', 't': round(time.time(), 3), 'kind': kind, 'step': step,
                     'elapsed_s': round(elapsed_s, 3), 'limit_s': round(limit_s, 3)})

    def end(self, outcome) -> None:
        """The attempt's last slice with its exit cause: a TrainResult.stopped_by or the
        exception that ended it."""
        if isinstance(outcome, BaseException):
            cause = f'error: {type(outcome).__name__}'
        else:
            cause = {'num_train_steps': 'finished', 'preemption': 'preempted'}.get(outcome,
                                                                                 outcome)
        self.flush('end', cause=cause)
        global _active
        if _active is self:
            _active = None
        if self._appender is not None:
            wait_s = self.close_wait_s(outcome)
            # Preempted in an outage: the run's one line named what is not in storage, this too.
            said = outcome == 'preemption' and uploads.QUEUE.down() is not None
            if not self._appender.close(wait_s) and not said:
                logging.warning('goodput: the last records of %s were not written in %.0f s; '
                                'its report ends this attempt where its records do, as killed',
                                self.path, wait_s)

    def close_wait_s(self, outcome) -> float:
        """How long `end` waits for the attempt's records to reach a bucket: ended by its storage
        (exit 5), WRITE_WAIT_S (it is known to be down); by another error, the storage layer's
        retries; preempted, WRITE_WAIT_S too (a SIGTERM's grace went to the checkpoint and the
        metrics: t2t/run/outage.py); otherwise as long as the run's own writes wait out an outage,
        since the uploader may still be in the storage client's back-off with the outage's
        account unwritten."""
        if isinstance(outcome, BaseException):
            return WRITE_WAIT_S if wd.storage_failure(outcome) is not None else wd.RETRY_BUDGET_S
        if outcome == 'preemption':
            return WRITE_WAIT_S
        return max(wd.RETRY_BUDGET_S, self._outage_limit_s)

    def _write(self, record: dict) -> None:
        if self._appender is None:
            return
        with self._lock:
            try:
                self._appender.append(json.dumps(record) + '\n')
            except Exception as e:  # noqa: BLE001 - the ledger never stops training
                if not self._warned:
                    self._warned = True
                    logging.warning('goodput: writing %s failed (%s: %s); training goes on',
                                    self.path, type(e).__name__, str(e)[:200])


def read_attempts(workdir, process_index: int = 0) -> list[tuple[str, list[dict]]]:
    """(file name, records) of every attempt of `process_index`, oldest first. A torn last line
    (a kill mid-write) is skipped."""
    out = []
    for path in wd.glob(wd.path(workdir, DIRNAME), f'attempt-*-p{process_index}.jsonl'):
        records = []
        for line in (wd.read_text(path) or '').splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        if records and records[0].get('at') == 'start':
            out.append((path.name, records))
    return out

