"""A flag set by SIGTERM (preemption notice): the train loop polls it, saves a checkpoint and exits.

    flag = PreemptionFlag().install()          # in the main thread, before the loop
    for step in ...:
        ...
        if step % N == 0 and flag.any_process():   # a collective: call on every process
            save(...); wait(...); break

A second signal while the flag is already set gets the previous behaviour (usually: terminate),
so a loop stuck somewhere can still be stopped.
"""

import logging
import os
import signal
import threading

import jax
import numpy as np


class PreemptionFlag:
    def __init__(self, signals=(signal.SIGTERM,)):
        self._signals = tuple(signals)
        self._event = threading.Event()
        self._previous = {}

    def install(self) -> 'PreemptionFlag':
        """Installs the handlers (Python allows this only in the main thread)."""
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
        if jax.process_count() == 1:
            return self.is_set()
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.is_set(), np.int32))
        return bool(np.any(flags))
