"""What the launchers share: the command line split at `--`, their argument parser, the script."""

from __future__ import annotations

import argparse


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
