"""Experiment trackers beside TensorBoard: Weights & Biases and trackio, chosen by config.trackers.

    config.trackers = ('tensorboard', 'wandb', 'trackio')    # any of them; () writes only
                                                              # stdout and metrics.jsonl
    sinks = open_sinks(config, workdir, start_step=S, record=run_record)
    writer = metrics.MetricWriter(workdir, tensorboard='tensorboard' in config.trackers,
                                  sinks=sinks)

'tensorboard' is the MetricWriter's own event files (t2t/infra/metrics.py). Each other tracker
is a sink that the writer hands the very scalars it prints and writes to metrics.jsonl, under
the same names and steps; each gets the config (its keys flattened, 'model.d_model' style) and
the run record (t2t/run/run_record.py) once at the start. Only process 0 opens them.

Nothing leaves the machine unless asked: W&B runs with config.wandb_mode 'offline' by default
(`wandb sync DIR` uploads later), in config.tracker_dir (default WORKDIR/trackers; a bucket
workdir needs a local one); trackio writes its local database there too (its TRACKIO_DIR,
unless the environment sets one; trackio reads it once, at its import, so the first run of a
process fixes it for that process). Their packages are optional (`pip install 't2t[trackers]'`):
a tracker whose package is missing is a one-line error at startup, before any compile
(`problem`).

A resumed run is its own W&B / trackio run, named after the workdir and its first step
(`default@1200`) in the workdir's group: W&B and trackio keep a run's steps increasing, and a
run resumed from a checkpoint logs again the steps after it, which metrics.jsonl and TensorBoard
replace but one W&B run would refuse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from collections.abc import Mapping

from t2t.infra import workdir as wd
from t2t.infra.exits import ConfigError

TRACKERS = ('tensorboard', 'wandb', 'trackio')
WANDB_MODES = ('offline', 'online', 'disabled')
_PACKAGES = {'wandb': 'wandb', 'trackio': 'trackio'}


def names(trackers) -> tuple[str, ...]:
    """config.trackers as names: `--config.trackers=tensorboard,wandb` arrives as one string."""
    items = (trackers,) if isinstance(trackers, str) else tuple(trackers)
    return tuple(n.strip() for item in items for n in str(item).split(',') if n.strip())


def problem(trackers) -> str | None:
    """What is wrong with config.trackers here (it follows 'trackers=VALUE '), else None."""
    trackers = names(trackers)
    unknown = [t for t in trackers if t not in TRACKERS]
    if unknown:
        return f'names {unknown[0]!r}: expected names from {TRACKERS}'
    for tracker in trackers:
        package = _PACKAGES.get(tracker)
        if package and importlib.util.find_spec(package) is None:
            return (f"needs the {package} package, which is not installed (pip install "
                    "'t2t[trackers]')")
    return None


def tracker_dir(config, workdir) -> str:
    """Where W&B and trackio write: config.tracker_dir, else WORKDIR/trackers (local only; a
    ConfigError for a bucket workdir: train.py checks it at startup)."""
    if config.tracker_dir:
        return config.tracker_dir
    if wd.is_url(wd.path(workdir)):
        raise ConfigError(f'trackers {names(config.trackers)} write locally: with the workdir '
                         f'{workdir} set --config.tracker_dir=LOCAL_DIR')
    return os.fspath(wd.path(workdir) / 'trackers')


def check_dir(config, workdir) -> None:
    """A ConfigError at startup where W&B or trackio would have nowhere local to write."""
    if set(names(config.trackers)) - {'tensorboard'}:
        tracker_dir(config, workdir)


def flat_config(config) -> dict:
    """The config as one level of keys ('tsv_files.train'), values JSON-friendly."""
    out = {}

    def walk(prefix, node):
        for key, value in node.items():
            name = f'{prefix}{key}'
            if isinstance(value, Mapping):
                walk(name + '.', value)
            else:
                out[name] = list(value) if isinstance(value, tuple) else value

    walk('', config.to_dict() if hasattr(config, 'to_dict') else config)
    return out


class WandbSink:
    """The scalars of each call as one W&B history row at its step."""

    def __init__(self, config, directory: str, name: str, group: str, record: dict):
        import wandb

        self._run = wandb.init(
            mode=config.wandb_mode, dir=directory, project=config.tracker_project or group,
            name=name, group=group, config=flat_config(config),
            settings=wandb.Settings(console='off', x_disable_stats=True, silent=True))
        self._run.summary['run_record'] = record
        self.directory = self._run.dir

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioSink:
    """The scalars of each call logged to trackio's local database at their step."""

    def __init__(self, config, directory: str, name: str, group: str, record: dict):
        os.environ.setdefault('TRACKIO_DIR', os.path.join(directory, 'trackio'))  # read at import
        import trackio

        project = config.tracker_project or group
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; t2t says where, once
            self._run = trackio.init(project=project, name=name, group=group,
                                     config={**flat_config(config), 'run_record': record},
                                     embed=False, auto_log_gpu=False, auto_log_cpu=False)
        self.directory = os.fspath(trackio.utils.TRACKIO_DIR)
        print(f'trackio: run {name} of project {project} in {self.directory} (trackio show '
              f'--project {project})', flush=True)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self._run.finish()


_SINKS = {'wandb': WandbSink, 'trackio': TrackioSink}


def open_sinks(config, workdir, *, start_step: int, record: dict | None = None,
               enabled: bool = True) -> list:
    """The sinks of config.trackers other than 'tensorboard' (none where not enabled: processes
    other than 0). Call after `problem` passed (startup)."""
    wanted = [t for t in names(config.trackers) if t in _SINKS]
    if not enabled or not wanted:
        return []
    directory = tracker_dir(config, workdir)
    os.makedirs(directory, exist_ok=True)
    group = wd.path(workdir).name or 'run'
    name = f'{group}@{start_step}'
    return [_SINKS[t](config, directory, name, group, record or {}) for t in wanted]
