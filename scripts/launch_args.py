"""What the launchers share: the command line split at `--`, their argument parser, the script."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from t2t.infra import exits  # noqa: E402


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own arguments, those after `--` for the script it runs)."""
    if '--' not in argv:
        return argv, []
    i = argv.index('--')
    return argv[:i], argv[i + 1:]


def parser(doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog='Arguments after -- are passed to train.py verbatim.')


def script(args) -> str:
    """The t2t script a launcher runs on the hosts: evaluate.py with --evaluate, else train.py."""
    return 'evaluate.py' if args.evaluate else 'train.py'


def restartable_pattern() -> str:
    """A shell `case` pattern of the exit statuses a rerun can fix: t2t's pod weather (hang, peer
    lost, storage outage: t2t/infra/exits.py) and a process ended by a signal (128 + N in the
    shell). 0 (finished, or saved on SIGTERM) and 1 (an error a rerun repeats) are not in it."""
    return '|'.join(str(s) for s in sorted(exits.RESTARTABLE)) + '|129|13[0-9]|14[0-9]|15[0-9]'
