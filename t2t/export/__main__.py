"""python -m t2t.export: see t2t/export/__init__.py."""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from t2t.export import FORMATS, LENGTH_PENALTIES

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The training workdir (holds checkpoints/).')
_STEP = flags.DEFINE_integer('step', None, 'Export this checkpoint step (default: the latest).')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', 0,
                                     'Export the mean of the last N checkpoints.')
_WEIGHTS = flags.DEFINE_enum('weights', 'auto', ['auto', 'ema', 'raw'],
                             'ema: the moving average of a run with ema_decay > 0; raw: the '
                             'params as trained; auto: ema when the checkpoint holds it.')
_FORMAT = flags.DEFINE_enum('format', None, list(FORMATS),
                            'hf: transformers MarianMT directory; ct2: CTranslate2 model.')
_OUTPUT = flags.DEFINE_string('output', None, 'The directory to write (new or empty).')
_QUANTIZATION = flags.DEFINE_string(
    'quantization', '', 'ct2 only: weight type, e.g. int8 or float16 (default float32).')
_LENGTH_PENALTY = flags.DEFINE_enum(
    'length_penalty', 'fitted', list(LENGTH_PENALTIES),
    "The runtimes' |Y|^a length penalty: fitted: the a closest to t2t's ((5+|Y|)/6)^alpha over "
    'lengths 1..max_decode_len; alpha: length_penalty_alpha unchanged.')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.WARNING)
    from t2t import export
    from t2t.run import checkpoint, cli, startup

    cli.check_values(_CONFIG.value, 't2t.export')

    if not _WORKDIR.value or not _FORMAT.value or not _OUTPUT.value:
        sys.exit('t2t.export: --workdir, --format and --output are required')
    try:
        out = export.export(_CONFIG.value, _WORKDIR.value, fmt=_FORMAT.value,
                            output=_OUTPUT.value, step=_STEP.value,
                            average_last=_AVERAGE_LAST.value, quantization=_QUANTIZATION.value,
                            length_penalty=_LENGTH_PENALTY.value, weights=_WEIGHTS.value)
    except (export.ExportError, checkpoint.CheckpointError, startup.ConfigError) as e:
        sys.exit(f't2t.export: {e}')
    config = _CONFIG.value
    print(export.length_penalty_note(_FORMAT.value, config.length_penalty_alpha,
                                     config.max_decode_len, _LENGTH_PENALTY.value))
    print(out)


if __name__ == '__main__':
    from t2t.run import cli

    cli.run(main, 't2t.export')
