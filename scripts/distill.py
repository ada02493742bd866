"""Sequence-level knowledge distillation in one command (t2t/train/distill.py): the teacher's
translations of its training sources, then a student trained on them.

    python scripts/distill.py --config=configs/default.py --teacher=workdirs/default \
        --student_config=configs/distill_student.py --workdir=workdirs/student \
        [--average_last=5 | --step=N | --ensemble=DIR_OR_STEP,...] [--weights=ema|raw]
        [--mbr_samples=N ...] [--config.beam_size=...] [--student_config.d_model=...]

--config is the teacher's config (its data, vocabulary and decoding), --teacher its workdir;
the student trains in --workdir on WORKDIR/distill/train.{src,teacher}, with the teacher's
vocabulary, and is evaluated on the teacher config's validation and test references. Each stage
resumes: run the same command again after a kill. One process.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t2t.run import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', "The teacher's config.")
_STUDENT = config_flags.DEFINE_config_file('student_config', 'configs/distill_student.py',
                                           "The student's config (its data is replaced).")
_TEACHER = flags.DEFINE_string('teacher', None, "The teacher's workdir (its vocabulary, and its "
                               'checkpoints unless --ensemble names others).')
_WORKDIR = flags.DEFINE_string('workdir', None, "The student's workdir.")
_STEP = flags.DEFINE_integer('step', None, 'The teacher checkpoint (default: the latest).')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', 0, 'The teacher: the mean of its last N '
                                     'checkpoints.')
_ENSEMBLE = flags.DEFINE_string('ensemble', '', 'The teacher: these members together '
                                '(DIR_OR_STEP,...; as evaluate.py --ensemble).')
_WEIGHTS = flags.DEFINE_enum('weights', 'auto', ['auto', 'ema', 'raw'], "The teacher's weights.")
_MBR_SAMPLES = flags.DEFINE_integer('mbr_samples', 0, 'The teacher decodes with MBR over N '
                                    'candidates (0: its config\'s decoding; evaluate.py).')
_MBR_CANDIDATES = flags.DEFINE_enum('mbr_candidates', 'sample', ['sample', 'nbest'],
                                    'With --mbr_samples: as evaluate.py.')
_MBR_UTILITY = flags.DEFINE_enum('mbr_utility', 'chrf', ['chrf', 'bleu'],
                                 'With --mbr_samples: as evaluate.py.')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if not _TEACHER.value or not _WORKDIR.value:
        raise app.UsageError('--teacher (the teacher\'s workdir) and --workdir (the student\'s) '
                             'are required')
    cli.check_values(_CONFIG.value, 'distill.py')
    cli.check_values(_STUDENT.value, 'distill.py')
    from t2t.eval import mbr
    from t2t.eval.checkpoints import EvalError
    from t2t.run import checkpoint, startup
    from t2t.train import distill, loop

    try:
        choice = (mbr.MBR(_MBR_SAMPLES.value, _MBR_CANDIDATES.value, _MBR_UTILITY.value)
                  if _MBR_SAMPLES.value else None)
        result = distill.run(_CONFIG.value, _TEACHER.value, _STUDENT.value, _WORKDIR.value,
                             ensemble=_ENSEMBLE.value, step=_STEP.value,
                             average_last=_AVERAGE_LAST.value, weights=_WEIGHTS.value, mbr=choice)
    except (ValueError, EvalError, checkpoint.CheckpointError, startup.ConfigError,
            loop.NonFiniteLossError) as e:
        sys.exit(f'distill.py: {e}')
    print(f'student finished at step {result.step} ({result.stopped_by}); '
          + ' '.join(f'{k}={v:.4g}' for k, v in result.eval_metrics.items()))


if __name__ == '__main__':
    cli.run(main, 'distill.py')
