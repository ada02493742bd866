"""What ran: WORKDIR/run-<UTC start>.json at the start of every training run, and one line of it.

The code (git commit of the t2t checkout and whether tracked files differ from it), the library
versions, python, the devices, processes and mesh, the command line and the full config.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

import jax

from t2t.infra import workdir as wd

PACKAGES = ('jax', 'jaxlib', 'libtpu', 'flax', 'optax', 'orbax-checkpoint', 'grain', 't2t')
_SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(config, mesh) -> dict:
    """The record of a run starting now with `config` on `mesh` (the same on every process)."""
    devices = jax.devices()
    return {
        'start': datetime.datetime.now(datetime.UTC).strftime('%Y%m%dT%H%M%SZ'),
        'git': git_state(_SOURCE_DIR),
        'versions': {name: _version(name) for name in PACKAGES},
        'python': platform.python_version(),
        'argv': list(sys.argv),
        'host': socket.gethostname(),  # process 0's
        'platform': devices[0].platform,
        'device_kind': devices[0].device_kind,
        'device_count': len(devices),
        'process_count': jax.process_count(),
        'mesh_shape': {str(k): int(v) for k, v in mesh.shape.items()},
        'mesh_devices': int(mesh.size),
        'config': json.loads(config.to_json_best_effort()),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(directory: str) -> dict | None:
    """{'commit', 'dirty'} of the git checkout holding `directory`; None outside one (or no git).

    dirty: tracked files differ from the commit (untracked files are not counted).
    """
    def git(*args):
        return subprocess.run(['git', '-C', directory, *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    try:
        commit = git('rev-parse', 'HEAD')
        dirty = bool(git('status', '--porcelain', '--untracked-files=no'))
    except (OSError, subprocess.SubprocessError):
        return None
    return {'commit': commit, 'dirty': dirty}


def summary(rec: dict, path: str) -> str:
    """One line: where the record is and the essentials of it."""
    git = rec['git']
    code = (f'{git["commit"][:12]}{" (dirty)" if git["dirty"] else ""}' if git else
            'not a git checkout')
    versions = rec['versions']
    mesh = ' x '.join(f'{k} {v}' for k, v in rec['mesh_shape'].items())
    return (f'run record {path}: t2t {versions["t2t"]} at {code}; jax {versions["jax"]}, '
            f'python {rec["python"]}; {rec["device_count"]} {rec["device_kind"]} devices, '
            f'{rec["process_count"]} process{"es" if rec["process_count"] > 1 else ""}; '
            f'mesh {mesh}')


def write(workdir: str, rec: dict) -> str | None:
    """Writes WORKDIR/run-<start>.json from process 0 (returns its path; None elsewhere) and
    prints the one-line summary."""
    if jax.process_index() != 0:
        return None
    path = wd.path(workdir, f'run-{rec["start"]}.json')
    wd.write_atomic(path, json.dumps(rec, indent=1) + '\n')
    path = str(path)
    print(summary(rec, path), flush=True)
    return path


# The finished marker: written after the last save, read by evaluate.py --watch, sweeps and the
# launchers to tell a run with nothing left to do from one that may still save steps.
FINISHED_NAME = 'TRAINING_FINISHED'  # JSON {step, stopped_by}


def clear_finished(workdir) -> None:
    """A run that starts (or resumes) is not finished until it says so again."""
    if jax.process_index() == 0:
        wd.remove(wd.path(workdir, FINISHED_NAME))


def mark_finished(workdir, step: int, stopped_by: str) -> None:
    """WORKDIR/TRAINING_FINISHED: every checkpoint of this run is on disk (for --watch)."""
    if jax.process_index() == 0:
        wd.write_atomic(wd.path(workdir, FINISHED_NAME),
                        json.dumps({'step': step, 'stopped_by': stopped_by}))


def read_finished(workdir) -> dict | None:
    """The TRAINING_FINISHED record of WORKDIR, or None while training may still save steps."""
    text = wd.read_text(wd.path(workdir, FINISHED_NAME))
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None
