"""A thread that dumps every thread's stack when a training step or a checkpoint save runs too long,
and ends the process when one runs so long that it is stuck.

The loop marks what it is doing (`step`, `save`, `other`); the thread wakes every second and, when
the current step has run longer than straggler_factor x the median of the recent steps (and at
least straggler_min_s), or the current save longer than slow_save_s, prints one line naming the
process and the step, then every thread's stack (faulthandler), to stderr. Training goes on, and
a hang is caught while it hangs, not only after the step finally ends.

A step, a save or an evaluation (`other`) that has run hang_timeout_s (a save: plus
storage_outage_limit_s, which it may spend waiting out a bucket outage) is stuck: a collective
whose peer never arrives has no timeout of its own, and a live peer keeps sending heartbeats. The
thread prints one line (process, what, how long), every stack, and ends the process with
exits.HANG through os._exit (the main thread is inside C++ and would never see an exception), so
a supervisor restarts the job from its last checkpoint.

A step is timed from one `step` mark to the next (the loop marks at the top of each iteration):
that is fetching the batch, dispatching step s and waiting for step s-1 on the device (the host
runs one step ahead), so in the steady state it measures one step of the device. Evaluation is
marked `other`: not timed against the median, only against hang_timeout_s. The loop's metrics
writes are `paused`: a step's clock stops while they wait for the workdir's storage.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback

from t2t.infra import exits

_HISTORY = 100  # the median is over the last this many steps
_MIN_HISTORY = 5  # no straggler verdict before this many steps (the first one compiles)
POLL_S = 1.0  # the thread looks this often


class Watchdog:
    """`mark(kind, step)` from the loop; `close()` at the end. Cheap: no device sync, no I/O."""

    def __init__(self, straggler_factor: float, straggler_min_s: float, slow_save_s: float,
                 process_index: int = 0, poll_s: float = POLL_S, stream=None,
                 hang_timeout_s: float = 0.0, save_grace_s: float = 0.0, on_finding=None):
        self.on_finding = on_finding  # (kind, step, elapsed_s, limit_s), e.g. the goodput ledger
        self.factor, self.min_s, self.slow_save_s = straggler_factor, straggler_min_s, slow_save_s
        self.process_index, self.stream = process_index, stream
        self.hang_s, self.save_grace_s = hang_timeout_s, save_grace_s
        self._steps = collections.deque(maxlen=_HISTORY)  # seconds of the finished steps
        self._current = None  # (kind, step, start time, limit in seconds or None, median)
        self._fired = None  # the _current that has dumped already: once per step or save
        self._stop = threading.Event()
        self._thread = None
        if straggler_factor > 0 or slow_save_s > 0 or hang_timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True,
                                            name='t2t-watchdog')
            self._thread.start()

    @classmethod
    def from_config(cls, config, process_index: int = 0, on_finding=None) -> Watchdog:
        return cls(config.straggler_factor, config.straggler_min_s, config.slow_save_s,
                   process_index, POLL_S, hang_timeout_s=config.hang_timeout_s,
                   save_grace_s=config.get('storage_outage_limit_s', 0.0), on_finding=on_finding)

    def mark(self, kind: str, step: int) -> None:
        """From now on the loop does `kind` ('step', 'save' or 'other') for `step`."""
        now = time.perf_counter()
        previous = self._current
        if previous is not None and previous[0] == 'step':
            self._steps.append(now - previous[2])
        median = statistics.median(self._steps) if self._steps else None
        # One assignment, which the thread reads: it never touches _steps.
        self._current = (kind, step, now, self._limit(kind, median), median)

    def paused(self, fn):
        """fn, during whose calls a step's clock stops (the loop's metrics writes, which a bucket
        outage holds: a storage wait, not a slow step); the call is watched as `other`."""
        def call(*args, **kwargs):
            current, since = self._current, time.perf_counter()
            if current is None or current[0] != 'step':
                return fn(*args, **kwargs)
            self._current = ('other', current[1], since, None, None)
            try:
                return fn(*args, **kwargs)
            finally:
                kind, step, start, limit, median = current
                self._current = (kind, step, start + time.perf_counter() - since, limit, median)
        return call

    def _limit(self, kind: str, median: float | None) -> float | None:
        if kind == 'save':
            return self.slow_save_s if self.slow_save_s > 0 else None
        if kind == 'step' and self.factor > 0 and len(self._steps) >= _MIN_HISTORY:
            return max(self.factor * median, self.min_s)
        return None

    def _hang_limit(self, kind: str) -> float | None:
        if self.hang_s <= 0:
            return None
        return self.hang_s + (self.save_grace_s if kind == 'save' else 0.0)

    def close(self) -> None:
        self._current = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            current = self._current
            if current is None:
                continue
            kind, step, start, limit, median = current
            elapsed = time.perf_counter() - start
            hang = self._hang_limit(kind)
            if hang is not None and elapsed > hang:
                self._hang(kind, step, elapsed)
            if limit is not None and current is not self._fired and elapsed > limit:
                self._fired = current
                if self.on_finding is not None:
                    self.on_finding(kind, step, elapsed, limit)
                self._dump(kind, step, elapsed, limit, median)

    def _dump(self, kind: str, step: int, elapsed: float, limit: float, median) -> None:
        if kind == 'save':
            why = f'the checkpoint save of step {step} has run {elapsed:.1f} s (slow_save_s='
            why += f'{self.slow_save_s:g})'
        else:
            why = (f'step {step} has run {elapsed:.1f} s, over {limit:.1f} s = max('
                   f'{self.factor:g} x the median step {median:.3f} s, straggler_min_s='
                   f'{self.min_s:g})')
        self._print_stacks(why + "; every thread's stack follows")

    def _hang(self, kind: str, step: int, elapsed: float) -> None:
        """Stuck: one line, every stack, then the process ends with exits.HANG."""
        what = {'step': f'step {step}', 'save': f'the checkpoint save of step {step}'}.get(
            kind, f'the evaluation at step {step}')
        grace = f' + storage_outage_limit_s={self.save_grace_s:g}' if kind == 'save' and (
            self.save_grace_s) else ''
        self._print_stacks(f'{what} has run {elapsed:.1f} s, over hang_timeout_s={self.hang_s:g}'
                           f'{grace}: stuck, exiting with status {exits.HANG} (every thread\'s '
                           'stack follows)')
        sys.stdout.flush()
        os._exit(exits.HANG)

    def _print_stacks(self, line: str) -> None:
        stream = self.stream or sys.stderr
        print(f'watchdog: process {self.process_index}: {line}', file=stream, flush=True)
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stream without a file descriptor
            for ident, frame in sys._current_frames().items():
                print(f'Thread {ident:#x}:', file=stream)
                traceback.print_stack(frame, file=stream)
        stream.flush()
