"""No function in t2t/ runs past 100 lines: a function that long is several steps without names.
And the core (t2t/*.py, what a researcher reads) stays at most 2,600 lines, model.py 400; that it
imports nothing of the harness is tests/test_layers.py's.

A function's length is its lines from `def` to its last line, nested functions included. The ones
over the limit today are listed with their lengths; an entry may only shrink, and goes once its
function fits.
"""

import ast
import os

from tests.helpers import ROOT

LIMIT = 100
CORE_LINES, MODEL_LINES = 2600, 400
# path under t2t/ : qualified name -> its length when this list was written
OVER_LIMIT = {
}


def _lengths(path: str, rel: str) -> dict[str, int]:
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), path)
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f'{prefix}{child.name}'
                if not isinstance(child, ast.ClassDef):
                    out[f'{rel}:{name}'] = child.end_lineno - child.lineno + 1
                visit(child, f'{name}.')
            else:
                visit(child, prefix)

    visit(tree, '')
    return out


def _all_lengths() -> dict[str, int]:
    package = os.path.join(ROOT, 't2t')
    out = {}
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                out.update(_lengths(path, os.path.relpath(path, package).replace(os.sep, '/')))
    return out


def test_no_function_in_t2t_is_over_100_lines_but_the_listed_ones_which_only_shrink():
    lengths = _all_lengths()
    assert len(lengths) > 500 and lengths['loss.py:chunk_length'] < 20  # the walk sees t2t/
    new = {k: n for k, n in lengths.items() if n > LIMIT and k not in OVER_LIMIT}
    assert not new, f'over {LIMIT} lines (name the steps as functions): {new}'
    grown = {k: (lengths[k], n) for k, n in OVER_LIMIT.items() if lengths.get(k, 0) > n}
    assert not grown, f'(now, listed) of listed functions that grew: {grown}'
    fits = [k for k in OVER_LIMIT if lengths.get(k, 0) <= LIMIT]
    assert not fits, f'within {LIMIT} lines now (or gone): take them off OVER_LIMIT: {fits}'


def _core_lines() -> dict[str, int]:
    """{file name: lines} of the modules directly in t2t/ (not its subpackages)."""
    package = os.path.join(ROOT, 't2t')
    out = {}
    for name in sorted(os.listdir(package)):
        if name.endswith('.py'):
            with open(os.path.join(package, name), encoding='utf-8') as f:
                out[name] = sum(1 for _ in f)
    return out


def test_the_core_stays_within_its_line_budget():
    lines = _core_lines()
    assert {'model.py', 'decode.py', 'loss.py'} <= set(lines) and len(lines) >= 10  # sees t2t/
    assert lines['model.py'] <= MODEL_LINES, f'model.py: {lines["model.py"]} lines'
    biggest = sorted(lines.items(), key=lambda item: -item[1])[:5]
    assert sum(lines.values()) <= CORE_LINES, f'core {sum(lines.values())} lines; {biggest}'
