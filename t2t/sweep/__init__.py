"""Sweeps: a config's `get_sweep()` points, each trained by train.py in its own directory.

    points.py   what a sweep is: override dicts (`product`, `zipped`), point names, their configs
    report.py   the sweep directory read back: summary.md, summary.csv, curves.png
    runner.py   running it: launchers, child processes, state on disk, signals, evaluation

sweep.py (the entry point) and docs/sweeps.md say how to run one.
"""
