"""Run a config's sweep: every point of its get_sweep() trained, evaluated and summarized.

    python sweep.py --config=configs/table3_mini.py --workdir=runs/table3 --split=validation
    python sweep.py --config=... --workdir=... --dry_run            # points and commands only
    python sweep.py --config=... --workdir=... --config.train_time_budget_s=60   # every point
    python sweep.py --config=... --workdir=... --only=default --only=num_heads=1   # some now
    python sweep.py --summarize=runs/table3                        # summary from disk alone
    python sweep.py --config=... --workdir=/shared/runs/t3 --launcher=slurm \
        --launcher_flags='--nodes=1 --gpus_per_node=8 --partition=gpu'   # each point a job
    python sweep.py --config=... --workdir=/mnt/gcs/runs/t3 --launcher=tpu \
        --launcher_flags='--tpu=my-v5e --zone=us-west4-a'           # each point on a TPU slice

Re-running skips finished points and resumes unfinished ones; --retry_failed reruns failed ones.
With a cluster launcher each point's train.py and evaluate.py run on the cluster, one job after
another, and --workdir must be the same path here and there: a shared file system for SLURM; for
a TPU slice a bucket mounted with gcsfuse at the same path on this machine and on every worker
(the sweep's state files are written with local file APIs, so a gs:// workdir is refused).
The logic lives in t2t/sweep/ (points, runner, report).
"""

import shlex
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config with get_sweep().')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The sweep directory: one subdirectory a point.')
_SPLIT = flags.DEFINE_string('split', '', 'Split to evaluate each point on (default: test_split).')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', 0,
                                     'Evaluate the mean of the last N checkpoints of each point.')
_RETRY_FAILED = flags.DEFINE_bool('retry_failed', False, 'Run failed points again.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print each point and its command; run nothing.')
_LAUNCHER = flags.DEFINE_enum('launcher', 'local', ['local', 'tpu', 'slurm'],
                              'How a point runs: local (train.py here), tpu '
                              '(scripts/launch_tpu.py) or slurm (scripts/launch_slurm.py).')
_LAUNCHER_FLAGS = flags.DEFINE_string('launcher_flags', '', 'Flags of the cluster launcher, one '
                                      "string: '--tpu=NAME --zone=ZONE' or '--nodes=2 "
                                      "--gpus_per_node=8 --partition=gpu'.")
_ONLY = flags.DEFINE_multi_string('only', [], 'Run only this point (a name as --dry_run lists '
                                   'it); repeat the flag for several.')
_SUMMARIZE = flags.DEFINE_string('summarize', '', 'Rebuild DIR/summary.* and curves.png, exit.')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    from t2t.sweep import points, report, runner

    try:
        if _SUMMARIZE.value:
            rows = report.write_summary(_SUMMARIZE.value)
            print(f'{len(rows)} points -> {_SUMMARIZE.value}/summary.md, summary.csv, curves.png')
            return 0
        if _CONFIG.value is None or not _WORKDIR.value and not _DRY_RUN.value:
            raise app.UsageError('--config and --workdir are required (or --summarize=DIR)')
        from t2t.run import cli

        cli.check_values(_CONFIG.value, 'sweep.py')  # a point's own values: its train.py
        config_path = config_flags.get_config_filename(flags.FLAGS['config'])
        overrides = config_flags.get_override_values(flags.FLAGS['config'])
        return runner.run(config_path, _CONFIG.value, _WORKDIR.value or 'SWEEP_DIR',
                          base_overrides=overrides, split=_SPLIT.value,
                          average_last=_AVERAGE_LAST.value, retry_failed=_RETRY_FAILED.value,
                          dry_run=_DRY_RUN.value, launcher=_LAUNCHER.value,
                          launcher_flags=shlex.split(_LAUNCHER_FLAGS.value), only=_ONLY.value)
    except points.SweepError as e:
        sys.exit(f'sweep.py: {e}')


if __name__ == '__main__':
    from t2t.infra import platforms

    platforms.skip_absent_tpu()  # the sweep's own process (dry runs, summaries) as cli.run does
    app.run(main)
