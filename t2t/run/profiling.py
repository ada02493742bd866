"""Profiles on demand: a jax.profiler trace of chosen training steps into WORKDIR/profiles/.

    --config.profile_start_step=100 --config.profile_num_steps=3 [--config.profile_every_steps=1000]

traces steps 100, 101 and 102 (and 1100-1102, 2100-2102, ... with profile_every_steps). The loop
calls `step(n, state)` before it dispatches step n: at a window's first step the device is
drained and the trace starts; at the step after its last the device is drained again (so the
window's steps are in the trace whole) and the trace is written. Outside the windows the call is
one integer comparison. TensorBoard's profile plugin opens the result (`tensorboard
--logdir=WORKDIR`: the run "profiles"). A bucket workdir: the trace is written to a local
temporary directory, then copied through t2t/infra/workdir.py. Process 0 traces, or every process
with profile_all_processes (process i > 0 into profiles/process-<i>/).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from t2t.infra import workdir as wd
from t2t.run.startup import ConfigError

DIRNAME = 'profiles'


def check(config) -> None:
    """Raises ConfigError naming the key when the profile settings cannot work."""
    if config.profile_start_step < 0:
        raise ConfigError(f'profile_start_step={config.profile_start_step} must be >= 0 '
                         '(0: no profile)')
    if config.profile_start_step and config.profile_num_steps < 1:
        raise ConfigError(f'profile_num_steps={config.profile_num_steps} must be >= 1')
    if config.profile_every_steps and config.profile_every_steps < config.profile_num_steps:
        raise ConfigError(f'profile_every_steps={config.profile_every_steps} must be 0 or at '
                         f'least profile_num_steps={config.profile_num_steps}')


def next_window(start: int, num: int, every: int, step: int) -> tuple[int, int] | None:
    """The first window [a, b) of steps with b > step (a may be < step: a resume inside it)."""
    if start <= 0:
        return None
    if step < start + num:
        return start, start + num
    if every <= 0:
        return None
    k = (step - start - num) // every + 1
    a = start + k * every
    return a, a + num


class Profiler:
    def __init__(self, workdir, start: int = 0, num: int = 3, every: int = 0,
                 enabled: bool = True, subdir: str = ''):
        self.target = wd.path(workdir, DIRNAME, *([subdir] if subdir else []))
        self.start, self.num, self.every = start, num, every
        self._window = None
        self._edge = 0 if enabled and start > 0 else None  # the next step that acts (None: none)
        self._local = None  # where jax writes the trace running now
        self.written = []  # (first step, last step, directory) of each trace written

    @classmethod
    def from_config(cls, config, workdir, ledger=None) -> Profiler:
        """ledger: a goodput.Ledger that books starting and writing traces as 'profile'."""
        import jax

        check(config)
        index = jax.process_index()
        profiler = cls(workdir, config.profile_start_step, config.profile_num_steps,
                       config.profile_every_steps,
                       enabled=index == 0 or config.profile_all_processes,
                       subdir=f'process-{index}' if index else '')
        if ledger is not None:
            profiler._begin = ledger.timed('profile')(profiler._begin)
            profiler._stop = ledger.timed('profile')(profiler._stop)
        return profiler

    def step(self, step: int, state) -> None:
        """Before step `step` is dispatched (state: what it trains on)."""
        if self._edge is None or step < self._edge:
            return
        if self._local is not None:  # the step after the window: write it
            self._stop(state, step - 1)
        window = next_window(self.start, self.num, self.every, step)
        if window is None:
            self._edge = None
        elif window[0] <= step:  # the window starts here (or a resume is inside it)
            self._begin(state, step)
            self._edge = window[1]
        else:
            self._edge = window[0]

    def close(self, state=None, last_step: int | None = None) -> None:
        """Writes a trace the run ended inside of."""
        if self._local is not None:
            self._stop(state, last_step)
        self._edge = None

    def _begin(self, state, step: int) -> None:
        import jax

        jax.block_until_ready(state)  # earlier steps stay out of the trace
        local = os.fspath(self.target)
        if wd.is_url(self.target):
            local = tempfile.mkdtemp(prefix='t2t-profile-')
        else:
            wd.makedirs(self.target)
        jax.profiler.start_trace(local)
        self._local, self._first = local, step

    def _stop(self, state, last_step) -> None:
        import jax

        try:
            jax.block_until_ready(state)  # the window's steps end inside the trace
        except Exception:  # noqa: BLE001 - a step that failed: write what was traced
            pass
        jax.profiler.stop_trace()
        local, self._local = self._local, None
        if wd.is_url(self.target):
            for root, _, files in os.walk(local):
                for name in files:
                    rel = os.path.relpath(os.path.join(root, name), local)
                    wd.copy(os.path.join(root, name), self.target.joinpath(*rel.split(os.sep)))
            shutil.rmtree(local, ignore_errors=True)
        self.written.append((self._first, last_step, str(self.target)))
        print(f'profile of steps {self._first}-{last_step} written to {self.target}', flush=True)
