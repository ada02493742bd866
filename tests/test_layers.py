"""The house drawn from its imports: no cycle; the core (t2t/*.py) imports nothing of the harness
around it; each floor of the harness imports only from its own floor and those below; and
importing t2t changes no jax setting and no environment variable (the entry points choose the
platforms)."""

import ast
import json
import os
import subprocess
import sys

from tests.helpers import ROOT

# The floors of the package, lowest first: a module imports only from its own floor or below.
# The core is t2t/*.py (the model, attention, loss, train step, the searches, optimizer,
# sharding rules, dropout, ids): what a researcher edits. Everything else is the harness around
# it, in the subpackages above; aot stands on eval (it compiles eval's predict function).
FLOORS = ('core', 'infra', 'data', 'run', 'goodput', 'eval', 'aot', 'train', 'export', 'sweep')


def floor(module: str) -> str:
    """The floor of a module: its subpackage of t2t, or 'core' for a module of t2t itself."""
    parts = module.split('.')
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else 'core'



def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module under t2t/ (a package by its own name)."""
    out = {}
    for directory, _, files in os.walk(os.path.join(ROOT, 't2t')):
        for f in files:
            if f.endswith('.py'):
                path = os.path.join(directory, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
                out[name.removesuffix('.__init__')] = path
    return out


def _imports(name: str, path: str, modules) -> set[str]:
    """The t2t modules `name` imports, anywhere in it: at module level, inside functions (lazy
    imports are edges of the design even where they break a cycle at import time) and under
    `if TYPE_CHECKING:` (a type named for annotations is a dependency too)."""
    package = name if path.endswith('__init__.py') else name.rpartition('.')[0]
    found = set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                parts = package.split('.')[:len(package.split('.')) - node.level + 1]
                base = '.'.join(parts + ([base] if base else []))
            for a in node.names:
                full = f'{base}.{a.name}'
                found.add(full if full in modules else base)
    return {m for m in found if m in modules} - {name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = 'open'
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 'open':
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 'done'

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': set()}) == [['a', 'b', 'c', 'a']]
    assert _cycles({'a': {'b'}, 'b': set()}) == []


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    # the graph is really read
    assert len(graph) > 40 and 't2t.run.run_record' in graph['t2t.eval.watch']
    assert _cycles(graph) == []


def test_type_checking_imports_are_edges_too(tmp_path):
    path = tmp_path / 'layer.py'
    path.write_text('from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                    '    from t2t.model import TransformerConfig\n')
    modules = {'t2t.model': '', 't2t.layer': str(path)}
    assert _imports('t2t.layer', str(path), modules) == {'t2t.model'}


def test_every_module_has_a_floor_and_every_floor_exists():
    modules = _modules()
    assert {floor(m) for m in modules if m != 't2t'} == set(FLOORS)
    core = sorted(m for m in modules if m != 't2t' and floor(m) == 'core')
    assert 't2t.model' in core and 't2t.train_lib' in core and len(core) <= 14, core


def test_the_core_imports_nothing_of_the_harness():
    graph = _graph()
    harness = sorted((name, other) for name, imported in graph.items()
                     if name != 't2t' and floor(name) == 'core'
                     for other in imported if floor(other) != 'core')
    assert harness == []


def test_no_module_imports_a_floor_above_its_own():
    graph = _graph()
    upward = []
    for name, imported in graph.items():
        if name == 't2t' or name.endswith('__main__'):  # entry points stand above every floor
            continue
        for other in imported:
            if other.endswith('__main__') or FLOORS.index(floor(other)) > FLOORS.index(
                    floor(name)):
                upward.append((name, other))
            # a module of a package importing the package (its __init__ gathers the modules)
            if name.startswith(other + '.'):
                upward.append((name, other))
    assert upward == []


def test_the_floor_check_finds_an_upward_import():
    assert floor('t2t.model') == 'core' and floor('t2t.infra.workdir') == 'infra'
    assert floor('t2t.data') == 'data' and floor('t2t.data.pipeline') == 'data'
    assert FLOORS.index(floor('t2t.train.loop')) > FLOORS.index(floor('t2t.eval.bleu'))


def _libraries() -> list[str]:
    """The libraries t2t's modules import at module level (they may set variables of their own on
    import, e.g. joblib's KMP_INIT_AT_FORK: what they do is not t2t's doing)."""
    found = set()
    for path in _modules().values():
        with open(path) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    found.add(node.module)
    return sorted(m for m in found if m.split('.')[0] != 't2t' and m != '__future__')


_PROBE = r'''
import json, os, pkgutil, importlib, sys
import jax
for library in sys.argv[1:]:
    try:
        importlib.import_module(library)
    except ImportError:
        pass  # a name imported from a module, not a module: its module is in the list too
before_config, before_env = dict(jax.config.values), dict(os.environ)
import t2t
names = [m.name for m in pkgutil.walk_packages(t2t.__path__, 't2t.')
         if not m.name.endswith('__main__')]  # entry points define absl flags: not a library
for name in names:
    importlib.import_module(name)
changed = {k: [repr(before_config.get(k)), repr(v)] for k, v in jax.config.values.items()
           if before_config.get(k) != v}
env = {k: [before_env.get(k), v] for k, v in os.environ.items() if before_env.get(k) != v}
env.update({k: [v, None] for k, v in before_env.items() if k not in os.environ})
print(json.dumps({'modules': len(names), 'config': changed, 'env': env,
                  't2t': os.path.dirname(t2t.__file__)}))
'''


def test_importing_every_t2t_module_changes_no_jax_setting():
    # JAX_PLATFORMS unset: the platform choice (libtpu installed, no TPU chip) is the entry
    # points' to make, not an import's.
    env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
    proc = subprocess.run([sys.executable, '-c', _PROBE, *_libraries()], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result['t2t'] == os.path.join(ROOT, 't2t')
    assert result['modules'] > 40
    assert result['config'] == {} and result['env'] == {}
