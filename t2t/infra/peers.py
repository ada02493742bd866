"""A process of the job that stops answering ends the job in one line, with exits.PEER_LOST.

jax's coordination service notices missing heartbeats itself, but then aborts every process from
C++ ("Terminating process because the JAX distributed service detected fatal errors"), after a
delay the job does not report; the Python callback its client could take instead cannot receive
the error (jaxlib has no conversion for it: the call ends in std::terminate). So t2t keeps its
own heartbeats, over the same service's key-value store, with --heartbeat_timeout_s, and gives
jax twice that as the backstop:

- every process sets t2t/alive/<its index> to a new count every interval;
- process 0 (which hosts the service) reads them all; a process whose count has not changed for
  heartbeat_timeout_s is lost: process 0 writes the verdict under t2t/lost, gives the others a
  moment to read it and exit with the same line, and exits;
- the other processes read t2t/lost, and give up on process 0 when the service has not answered
  for heartbeat_timeout_s (a stopped host keeps its connections open, so only a deadline tells).

A process 0 that dies outright closes the service's connections: jax's client on every other
process aborts at once from C++ (its error polling), before any of this can speak.
At exit (an atexit hook that runs before jax's shutdown barrier) a process writes
t2t/exited/<its index>, which process 0 counts as alive from then on (it is waiting in that
barrier), and stops and joins its threads: a daemon thread still inside a call to the service
when the interpreter finalizes is unwound through C++ and aborts the process. The threads need
the GIL: a Python call that holds it for longer than the timeout (none of t2t's does) would look
like a lost process.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from t2t.infra import exits

ALIVE, EXITED, LOST = 't2t/alive/', 't2t/exited/', 't2t/lost'
MAX_INTERVAL_S = 2.0  # heartbeats at least this often (and 5 per timeout)


def jax_heartbeat_timeout(timeout_s: float) -> int:
    """jax's own heartbeat timeout: later than ours, so that ours speaks first."""
    return int(2 * timeout_s) + 10


class PeerWatch:
    """Two daemon threads, started at once: heartbeats and the verdicts (see the module doc)."""

    def __init__(self, client, count: int, index: int, timeout_s: float, prog: str,
                 stream=None):
        self.client, self.count, self.index, self.timeout_s = client, count, index, timeout_s
        self.prog, self.stream = prog, stream
        self.interval_s = min(max(timeout_s / 5, 0.1), MAX_INTERVAL_S)
        self._answered = time.monotonic()  # the service's last answer to this process
        self._stop, self._exiting = threading.Event(), threading.Event()
        atexit.register(self._at_exit)  # after jax's own hook: runs before it
        self._threads = [threading.Thread(target=target, daemon=True, name=name)
                         for target, name in ((self._beat, 't2t-heartbeat'),
                                              (self._deadline, 't2t-peers'))]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()

    def _at_exit(self) -> None:
        self._exiting.set()
        try:
            self.client.key_value_set(f'{EXITED}{self.index}', '1', allow_overwrite=True)
        except Exception:
            pass  # the service has gone: nobody is left to count this process lost
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval_s + 5)

    def _beat(self) -> None:
        start = time.monotonic()
        heard = dict.fromkeys(range(self.count), start)  # process -> when its count last changed
        seen: dict[int, str] = {}
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self.client.key_value_set(f'{ALIVE}{self.index}', str(beat), allow_overwrite=True)
                if self.index == 0:
                    entries = self.client.key_value_dir_get(ALIVE)
                    exited = {int(k.rsplit('/', 1)[-1]) for k, _ in
                              self.client.key_value_dir_get(EXITED)}
                else:
                    verdict = self._try_get(LOST)
            except Exception as e:  # jax's runtime error: the service has gone
                if self._stop.is_set() or self._exiting.is_set():
                    return
                self._exit(f'the coordination service (process 0) stopped answering: '
                           f'{str(e).splitlines()[0] if str(e) else type(e).__name__}')
            self._answered = now = time.monotonic()
            if self._exiting.is_set():
                pass
            elif self.index == 0:
                for key, value in entries:
                    pid = int(key.rsplit('/', 1)[-1])
                    if seen.get(pid) != value:
                        seen[pid], heard[pid] = value, now
                lost = [p for p in range(1, self.count)
                        if p not in exited and now - heard[p] > self.timeout_s]
                if lost:
                    self._lost(lost, now - min(heard[p] for p in lost))
            elif verdict is not None:
                self._exit(f'process 0 {verdict}')
            self._stop.wait(self.interval_s)

    def _try_get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:
            if 'NOT_FOUND' in str(e):
                return None
            raise

    def _lost(self, lost: list[int], silent_s: float) -> None:
        who = ('process ' if len(lost) == 1 else 'processes ') + ', '.join(map(str, lost[:20]))
        verdict = (f'lost {who}: no heartbeat for {silent_s:.1f} s (--heartbeat_timeout_s='
                   f'{self.timeout_s:g})')
        if self.count - 1 > len(lost):  # the others read it, exit with the same line, then
            try:  # the service goes
                self.client.key_value_set(LOST, verdict, allow_overwrite=True)
                time.sleep(2 * self.interval_s + 0.5)
            except Exception:
                pass
        self._exit(verdict)

    def _deadline(self) -> None:
        while not self._stop.wait(self.interval_s):
            silent = time.monotonic() - self._answered
            if silent > self.timeout_s and not self._exiting.is_set():
                self._exit(f'the coordination service (process 0) has not answered for '
                           f'{silent:.1f} s (--heartbeat_timeout_s={self.timeout_s:g})')

    def _exit(self, why: str) -> None:
        print(f'{self.prog}: process {self.index}: {why}; exiting with status '
              f'{exits.PEER_LOST} (peer lost)', file=self.stream or sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exits.PEER_LOST)  # the main thread may be waiting in a collective forever
