"""A sweep's points: override dicts (by hand, or with `product` / `zipped`), their names, and the
config each one trains with.

A config file may define `get_sweep()` returning a list of override dicts, {'num_heads': 1,
'scale_attention': False}. A point is named from its overrides (`num_heads=1,scale_attention=False`,
`default` for none; a short hash is added when a name needs characters unsafe in file names, or is
long): that name is its directory. Bad keys and mistyped values are errors naming the point,
before anything runs; points whose configs come out identical (an override equal to the config's
own value) run once.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_NAME = 100  # characters of a point directory name before it is shortened with a hash
_SAFE = re.compile(r'[^A-Za-z0-9._,=+-]')


class SweepError(Exception):
    """A problem with the sweep's definition or directory, stated in one line."""


def product(**axes: Sequence) -> list[dict]:
    """Every combination: product(a=[1, 2], b=[True, False]) -> 4 points, the first key slowest."""
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def zipped(**axes: Sequence) -> list[dict]:
    """Values side by side: zipped(a=[1, 2], b=[3, 4]) -> [{'a': 1, 'b': 3}, {'a': 2, 'b': 4}]."""
    lengths = {k: len(v) for k, v in axes.items()}
    if len(set(lengths.values())) > 1:
        raise SweepError(f'zipped needs equally long value lists, got lengths {lengths}')
    keys = list(axes)
    return [dict(zip(keys, values, strict=True))
            for values in zip(*axes.values(), strict=True)]


def format_value(value) -> str:
    """A value as `--config.key=VALUE` takes it (and as point names show it)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return '(' + ', '.join(format_value(v) for v in value) + (',)' if len(value) == 1 else ')')
    return str(value)


def point_name(overrides: dict) -> str:
    """Readable, stable (sorted keys), unique and safe as a directory name."""
    if not overrides:
        return 'default'
    name = ','.join(f'{k}={format_value(overrides[k])}' for k in sorted(overrides))
    safe = _SAFE.sub('_', name)
    if safe != name or len(safe) > MAX_NAME or safe.startswith('.'):
        digest = hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str)
                                .encode()).hexdigest()[:8]
        safe = safe[:MAX_NAME].lstrip('.') + '-' + digest
    return safe


def script_args(overrides: dict) -> list[str]:
    """The overrides as train.py's flags: `--config.key=value`, in the dict's order."""
    return [f'--config.{k}={format_value(v)}' for k, v in overrides.items()]


def apply_overrides(config, overrides: dict, what: str):
    """A copy of `config` with `overrides` (dotted keys) set; unknown keys and bad types raise."""
    config = copy.deepcopy(config)  # keeps FieldReferences: derived fields follow their source
    for key, value in overrides.items():
        *parents, leaf = key.split('.')
        node = config
        for part in parents:
            node = node.get(part) if hasattr(node, 'get') else None
        if node is None or not hasattr(node, 'keys') or leaf not in node:
            raise SweepError(f'{what}: unknown config key {key!r}')
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:
            raise SweepError(f'{what}: {key}={value!r}: {str(e).splitlines()[0]}') from e
    return config


def config_json(config) -> str:
    """The config as the state file records it: a point whose config changed trains on."""
    return config.to_json_best_effort(sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Point:
    name: str
    overrides: dict  # the point's own overrides, as get_sweep gave them
    config: object  # the effective ConfigDict: the file's config + base overrides + the point's
    same_as: tuple[str, ...] = ()  # names of later points with an identical config (run once)


def make_points(config, sweep: list[dict], base_overrides: dict | None = None) -> list[Point]:
    """The sweep's points with their configs; checked before anything runs."""
    if not isinstance(sweep, list) or not sweep:
        raise SweepError('get_sweep() must return a non-empty list of override dicts')
    base = apply_overrides(config, base_overrides or {}, 'sweep flags')
    points, by_config = [], {}
    for i, overrides in enumerate(sweep):
        if not isinstance(overrides, dict):
            raise SweepError(f'get_sweep() point {i} is {type(overrides).__name__}, not a dict')
        name = point_name(overrides)
        point_config = apply_overrides(base, overrides, f'point {i} ({name})')
        key = config_json(point_config)
        if key in by_config:  # identical run: keep the first name, remember the others
            first = by_config[key]
            points[first] = dataclasses.replace(points[first],
                                                same_as=points[first].same_as + (name,))
            continue
        by_config[key] = len(points)
        points.append(Point(name, dict(overrides), point_config))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f'two different points share a name: {sorted(names)}')
    return points


def load_sweep(config_path: str) -> list[dict]:
    """`get_sweep()` of a config file."""
    spec = importlib.util.spec_from_file_location('_t2t_sweep_config', config_path)
    module = importlib.util.module_from_spec(spec)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # config files import `configs.common`
    spec.loader.exec_module(module)
    if not hasattr(module, 'get_sweep'):
        raise SweepError(f'{config_path} defines no get_sweep()')
    return module.get_sweep()


def count_params(config) -> int:
    """The point's parameter count, from the model's abstract shapes (nothing is allocated)."""
    from t2t import model

    return model.count_params(model.abstract_params(model.TransformerConfig.from_config(config)))
