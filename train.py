"""Train a Transformer: python train.py --config=configs/default.py --workdir=DIR [--dry_run]."""

from absl import app, flags
from ml_collections import config_flags

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
    raise app.UsageError('training lands with the training issue; use --dry_run')


if __name__ == '__main__':
    app.run(main)
