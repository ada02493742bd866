"""Train a Transformer.

    python train.py --config=configs/default.py --workdir=workdirs/default
    python train.py --config=configs/wmt14_ende_base.py --config.batch_size=208 --workdir=runs/base
    python train.py --config=configs/wmt14_ende_big.py --dry_run     # parameters and FLOPs only

A workdir that holds checkpoints is resumed from the newest good one. Multi-host: run the same
command on every host; jax.distributed is initialized from --coordinator_address/--num_processes/
--process_id, or detected automatically on TPU pods and SLURM/Open MPI clusters (--distributed).
SIGTERM saves a checkpoint and exits 0; `kill -USR1 <pid>` prints every thread's stack to stderr
(a job that seems stuck). A config, workdir or checkpoint problem is one line on stderr, exit 1.
"""

import faulthandler
import signal
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from t2t import distributed

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and logs go here.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Build the abstract model, print its summary, exit.')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    config = _CONFIG.value
    if _DRY_RUN.value:
        from t2t import summary

        print(summary.summarize(config))
        return
    if not _WORKDIR.value:
        raise app.UsageError('--workdir is required (checkpoints, metrics and logs go there)')
    distributed.initialize()
    if not flags.FLAGS['verbosity'].present:
        absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO

    from t2t import checkpoint, loop, startup

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        result = loop.train_and_evaluate(config, _WORKDIR.value)
    except (startup.ConfigError, checkpoint.CheckpointError, loop.NonFiniteLossError,
            OSError) as e:  # OSError: e.g. metrics.jsonl on a full disk; it names the file
        sys.exit(f'train.py: {e}')
    print(f'finished at step {result.step} ({result.stopped_by}); '
          + ' '.join(f'{k}={v:.4g}' for k, v in result.eval_metrics.items()))


if __name__ == '__main__':
    app.run(main)
