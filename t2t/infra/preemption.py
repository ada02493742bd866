"""Preemption: a SIGTERM makes the train loop save a checkpoint at once and exit cleanly.

    flag = PreemptionFlag().install()          # in the main thread, before the loop
    for step in ...:
        ...
        if flag.reached(step, at_log_step):    # every step, on every process
            save(...); wait(...); break

Where the notice comes from:
  * jax.distributed initialized with its preemption service (the default): jax's notifier catches
    SIGTERM on any process and `multihost_utils.reached_preemption_sync_point(step)` turns True on
    every process at the same step. The check is local (no collective per step); only a notice
    starts a sync between the processes. No Python handler is installed (it would replace jax's).
  * one process: a Python SIGTERM handler sets a flag, read at every step.
  * several processes without jax's service: the flag, gathered from all processes at log steps.

A second signal while the flag is already set gets the previous behaviour (usually: terminate),
so a loop stuck somewhere can still be stopped.
"""

import logging
import os
import signal
import threading

import jax

from t2t.infra import distributed


def _jax_preemption_service() -> bool:
    """jax.distributed is initialized with its preemption sync manager."""
    if not jax.distributed.is_initialized():
        return False
    from jax._src import distributed  # the public API offers no query for the service

    return distributed.global_state.preemption_sync_manager is not None


class Interrupted(Exception):
    """An iteration stopped on a preemption notice (see PreemptionFlag.interruptible)."""


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGTERM,)):
        self._signals = tuple(signals)
        self._event = threading.Event()
        self._previous = {}
        self._jax_service = False

    def install(self) -> 'PreemptionFlag':
        """Installs the handlers (Python allows this only in the main thread)."""
        self._jax_service = _jax_preemption_service()
        if self._jax_service:
            return self  # jax's notifier owns SIGTERM
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def __enter__(self) -> 'PreemptionFlag':
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum, frame) -> None:
        if self._event.is_set():
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        logging.warning('signal %d received: will save a checkpoint and stop', signum)
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        """This process received the signal."""
        return self._event.is_set()

    def any_process(self) -> bool:
        """Some process received the signal; all processes must call this at the same step."""
        return distributed.any_process(self.is_set())

    def interruptible(self, items):
        """`items`, raising Interrupted once this process got the notice.

        Single-process jobs only (a long evaluation need not finish before the save); with
        several processes the iteration runs to the end, since they would have to agree first.
        """
        for item in items:
            if jax.process_count() == 1 and self.is_set():
                raise Interrupted
            yield item

    def reached(self, step: int, at_log_step: bool) -> bool:
        """Whether every process stops at `step`: call at every step, on every process."""
        if self._jax_service:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        if jax.process_count() == 1:
            return self.is_set()
        return at_log_step and self.any_process()
