"""The shell commands of the documents: lists them all, runs the quick ones, says which ran.

    python scripts/doc_commands.py [--list] [--timeout=180] [--docs README.md docs/x.md ...]

Reads the code blocks of README.md, docs/*.md and bench/*.md, joins continued lines, drops
comments, and sorts every command into one of:
  quick     run here with a timeout, from the repository root on the CPU, and reported ok or
            failed: `--help`, a `--dry_run` without `--topology` (a parameter count, a sweep's
            points, a launcher's script), `python -m t2t.data` on configs/tiny.py;
  template  names a placeholder (CONFIG, DIR, BUCKET, `...`, `[--optional flags]`): not runnable;
  long      training, evaluation, sweeps, benchmarks, cluster launches, `make`: not run here; the
            date of its last run is given when its section of the document names one.
Exit 1 if a quick command failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r'^```[^\n]*\n(.*?)^```', re.M | re.S)
DATE = re.compile(r'\b20\d\d-\d\d-\d\d\b')
PLACEHOLDER = re.compile(r'\b(CONFIG|DIR|BUCKET|ORG|SLICE|WORKDIR)\b|\.\.\.|\s\[--|<[a-z]')
COMMAND_START = re.compile(r'^(\S+=\S+ )*(python\S*|\.venv/bin/python|make|bash|flock|git|echo|'
                           r'gcloud|JAX_PLATFORMS)\b')


@dataclasses.dataclass
class Command:
    doc: str
    line: int
    text: str
    kind: str = ''
    last_run: str = ''
    status: str = ''
    seconds: float = 0.0


def _python_script(words: list[str]) -> list[str]:
    """The words after the interpreter (and its -m module), or [] for another program."""
    while words and '=' in words[0] and not words[0].startswith('-'):
        words = words[1:]  # leading VAR=value
    if not words or not re.match(r'(python3?(\.\d+)?|\.venv/bin/python)$', words[0]):
        return []
    return words[1:]


def kind_of(text: str) -> str:
    if PLACEHOLDER.search(text):
        return 'template'
    try:
        words = shlex.split(text)
    except ValueError:
        return 'template'
    if any(c in text for c in ('|', '&&', ';', '>')):
        return 'long'  # pipelines and chains: set-up steps or real runs, never quick
    args = _python_script(words)
    if not args:
        return 'long'
    if '--help' in args or '-h' in args:
        return 'quick'
    if '--dry_run' in args and not any(a.startswith('--topology') for a in args) and \
            args[0] in ('train.py', 'sweep.py', 'scripts/launch_slurm.py', 'scripts/launch_tpu.py'):
        return 'quick'
    if args[:2] == ['-m', 't2t.data'] and '--config=configs/tiny.py' in args:
        return 'quick'
    return 'long'


def _paragraph_dates(before: str, after: str) -> list[str]:
    """Dates in the paragraph just before a code block and the one just after it (a heading or
    another code block ends a paragraph): where a document says when a command last ran."""
    last = re.split(r'\n\s*\n|^#.*$|^```', before.rstrip(), flags=re.M)[-1]
    first = re.split(r'\n\s*\n|^#.*$|^```', after.strip('\n'), flags=re.M)[0]
    return DATE.findall(last) + DATE.findall(first)


def extract(doc: str) -> list[Command]:
    with open(os.path.join(ROOT, doc), encoding='utf-8') as f:
        text = f.read()
    commands = []
    for block in FENCE.finditer(text):
        dates = _paragraph_dates(text[:block.start()], text[block.end():])
        first_line = text.count('\n', 0, block.start(1)) + 1
        pending, start = '', 0
        for i, raw in enumerate(block.group(1).splitlines()):
            line = raw.rstrip()
            if not pending:
                start = first_line + i
                if not COMMAND_START.match(line.strip()):
                    continue  # comments, layout listings, prose in a block
            body = line[:-1] if line.endswith('\\') else line
            pending += ' ' + body.strip()
            if line.endswith('\\'):
                continue
            command = re.sub(r'\s+#.*$', '', pending).strip()  # a trailing comment
            pending = ''
            commands.append(Command(doc, start, command, kind_of(command),
                                    max(dates) if dates else ''))
    return commands


def run(command: Command, timeout: float) -> None:
    words = shlex.split(command.text)
    while '=' in words[0]:
        words = words[1:]
    words[0] = sys.executable
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
    start = time.perf_counter()
    try:
        proc = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ['']
        command.status = 'ok' if proc.returncode == 0 else f'failed ({proc.returncode}: {tail[0]})'
    except subprocess.TimeoutExpired:
        command.status = f'failed (timeout after {timeout:.0f} s)'
    command.seconds = time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--list', action='store_true', help='list only, run nothing')
    parser.add_argument('--timeout', type=float, default=180.0, help='seconds per quick command')
    parser.add_argument('--docs', nargs='*', help='documents (default: README, docs/, bench/)')
    args = parser.parse_args()
    docs = args.docs or ['README.md', *sorted(glob.glob('docs/*.md', root_dir=ROOT)),
                         *sorted(glob.glob('bench/*.md', root_dir=ROOT))]
    commands = [c for doc in docs for c in extract(doc)]
    seen = set()
    for c in commands:
        where = f'{c.doc}:{c.line}'
        if c.kind == 'quick' and not args.list and c.text not in seen:
            seen.add(c.text)
            run(c, args.timeout)
            print(f'{c.status:<8} {c.seconds:5.1f} s  {where}  {c.text}', flush=True)
        elif c.kind == 'quick':
            print(f'{"listed" if args.list else "ran above":<16} {where}  {c.text}')
        else:
            last = f', last run {c.last_run} per the doc' if c.last_run else ''
            print(f'not run ({c.kind}{last})  {where}  {c.text}')
    counts = {k: sum(c.kind == k for c in commands) for k in ('quick', 'long', 'template')}
    failed = [c for c in commands if c.status.startswith('failed')]
    ran = len([c for c in commands if c.status])
    print(f'\n{len(commands)} commands in {len(docs)} documents: {counts["quick"]} quick '
          f'({ran} run, {len(failed)} failed), {counts["long"]} long and {counts["template"]} '
          'templates not run here')
    sys.exit(1 if failed else 0)


if __name__ == '__main__':
    main()
