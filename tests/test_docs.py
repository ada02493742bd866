"""The documents name only what the repository holds: every path they name exists, none outside."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(['README.md', *glob.glob('docs/*.md', root_dir=ROOT),
               *glob.glob('bench/*.md', root_dir=ROOT)])
# Pages other branches add (docs/export.md: the exporters; docs/development.md: working on t2t);
# the README links them already. Remove an entry once its page is merged.
PENDING = set()
# Paths a command or its example names on the user's machine or cluster, not in this repository:
# scratch space (/tmp), a shared file system or a gcsfuse mount in the cluster examples.
EXAMPLE_ROOTS = ('/tmp/', '/nfs/', '/mnt/')

LINK = re.compile(r'\]\(([^)\s]+)\)')
CODE = re.compile(r'```.*?\n(.*?)```|`([^`\n]+)`', re.S)
TOKEN_SPLIT = re.compile(r'[\s=,;()\[\]"\'`]+')
TOP = {entry for entry in os.listdir(ROOT) if not entry.startswith('.')} - {
    'data', 'workdirs', 'shared', 'logs', 'wheels'}  # made by runs, git-ignored


def _read(doc):
    with open(os.path.join(ROOT, doc), encoding='utf-8') as f:
        return f.read()


def _links(doc, text):
    """Relative link targets of doc, as repository paths."""
    for target in LINK.findall(text):
        if re.match(r'[a-z]+:', target) or target.startswith('#'):
            continue
        path = target.split('#')[0]
        yield os.path.normpath(os.path.join(os.path.dirname(doc), path))


def _code_paths(text):
    """Tokens of code spans and blocks that name a file or folder under a top-level entry."""
    for block, span in CODE.findall(text):
        for token in TOKEN_SPLIT.split(block or span):
            token = token.rstrip('.:')
            if '/' not in token and token not in TOP:
                continue
            if re.search(r'[<>*{}|$]|\.\.\.|[A-Z]{3,}', token):  # placeholders: <step>, DIR, $OUT
                continue
            first = token.split('/')[0]
            if first in TOP and not token.startswith('/'):
                yield os.path.normpath(token)


def test_readme_is_short():
    with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
        assert len(f.readlines()) <= 150


def test_every_path_a_document_names_exists():
    missing = []
    for doc in DOCS:
        text = _read(doc)
        for path in {*_links(doc, text), *_code_paths(text)}:
            if path.startswith('..'):
                missing.append(f'{doc}: {path} is outside the repository')
            elif not os.path.exists(os.path.join(ROOT, path)) and path not in PENDING:
                missing.append(f'{doc}: {path}')
    assert not missing, '\n'.join(sorted(missing))


def test_no_document_names_a_path_outside_the_repository():
    outside = []
    for doc in DOCS:
        for token in TOKEN_SPLIT.split(_read(doc)):
            if '../shared' in token or '/work/' in token:
                outside.append(f'{doc}: {token}')
            elif re.match(r'/[A-Za-z][\w.-]*/', token) and not token.startswith(EXAMPLE_ROOTS):
                outside.append(f'{doc}: {token}')
    assert not outside, '\n'.join(sorted(outside))


def test_the_checks_see_links_and_code_paths():
    text = ('[a](../bench/RESULTS.md#x) `configs/tiny.py` and `python bench/data_speed.py '
            '--config=configs/default.py`\n```\npython -m t2t.attention --output=docs/a.png\n```')
    assert set(_links('docs/x.md', text)) == {'bench/RESULTS.md'}
    assert set(_code_paths(text)) == {'configs/tiny.py', 'bench/data_speed.py',
                                      'configs/default.py', 'docs/a.png'}
    assert list(_code_paths('`WORKDIR/corrupt/<step>-<time>` `DIR/<name>` `data/vocab`')) == []


def _layout_blocks() -> tuple[str, dict[str, str]]:
    """README's layout: the core's block, and {package: its lines} of the harness block."""
    text = _read('README.md')
    section = text[text.index('## Layout'):text.index('## Documentation')]
    core, harness = re.findall(r'```\n(.*?)```', section, re.S)[:2]
    packages, current = {}, None
    for line in harness.splitlines():
        m = re.match(r't2t/(\w+)/', line)
        if m or not line.startswith(' '):
            current = m.group(1) if m else None
        if current:
            packages[current] = packages.get(current, '') + line + '\n'
        for other in re.findall(r't2t/(\w+)/ ', line)[1:]:  # two packages on one line
            packages[other] = packages.get(other, '') + line[line.index(f't2t/{other}/'):] + '\n'
    return core, packages


def test_the_readme_layout_names_every_module():
    core, packages = _layout_blocks()
    missing = []
    for directory, _, files in os.walk(os.path.join(ROOT, 't2t')):
        package = os.path.relpath(directory, os.path.join(ROOT, 't2t'))
        for f in sorted(files):
            name = f[:-3]
            if not f.endswith('.py') or name in ('__init__', '__main__') or \
                    '__pycache__' in directory:
                continue
            if package == '.':
                found = re.search(rf'\b{name}\.py\b', core)
            else:
                found = re.search(rf'\b{name}\b', packages.get(package, ''))
            if not found:
                missing.append(f'{package}/{f}')
    assert missing == []
    assert set(packages) >= {'infra', 'data', 'run', 'goodput', 'aot', 'eval', 'train', 'export',
                             'sweep'}
