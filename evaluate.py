"""Evaluate or use trained checkpoints (the logic lives in t2t/eval/evaluation.py).

  python evaluate.py --config=configs/default.py --workdir=DIR            # the latest checkpoint
      [--step=N | --best | --all | --average_final | --average_last=N [--write_averaged=OUT_DIR]]
      [--split=test]
  python evaluate.py --config=... --workdir=DIR --translate [--input=FILE|-] [--output=FILE|-]
      [--truncate_long] [--nbest=N]
  python evaluate.py --config=... --workdir=DIR --score --input=SRC --references=TGT [--output=FILE]
  python evaluate.py --config=... --workdir=DIR --watch [--split=...] [--timeout=3600] [--poll=5]
  any of them with --weights=ema|raw (default auto: the EMA of a run with ema_decay > 0, else raw)
  python evaluate.py --config=... --workdir=DIR --ensemble=DIR_OR_STEP,DIR_OR_STEP[,...]
      [--split=test | --translate ... | --score ...]   # the members together (t2t/eval/ensemble.py)
  a split or --translate with --constraints=FILE (a JSON list of phrases per source line) or
      --terminology=FILE.tsv (source term<TAB>target term): constrained beam search
      (t2t/eval/terms.py)
  evaluating or --translate: --mbr_samples=N [--mbr_candidates=sample|nbest]
      [--mbr_utility=chrf|bleu]   # minimum Bayes risk decoding (t2t/eval/mbr.py)

Several processes: the same command on each, with --coordinator_address/--num_processes/
--process_id or --distributed as for train.py; they split the sentences, process 0 writes.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from t2t.infra import distributed
from t2t.run import cli, compile_cache

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The training workdir (holds checkpoints/).')
_STEP = flags.DEFINE_integer('step', None, 'Evaluate this checkpoint step (default: the latest).')
_BEST = flags.DEFINE_bool('best', False, 'Evaluate the best checkpoint of a run with keep_best > 0 '
                          '(ranked by its best_metric during training).')
_ALL = flags.DEFINE_bool('all', False, 'Evaluate every checkpoint: a table step -> scores.')
_AVERAGE_LAST = flags.DEFINE_integer(
    'average_last', 0, 'Evaluate the mean of the last N checkpoints (paper: 5 base, 20 big); a '
    'window reaching before the run\'s final average_fraction of steps warns.')
_AVERAGE_FINAL = flags.DEFINE_bool(
    'average_final', False, 'Evaluate the mean of the checkpoints of the run\'s final '
    'config.average_fraction of steps, or the last checkpoint if its validation NLL is as low or '
    'lower (both printed); make demo\'s choice.')
_WRITE_AVERAGED = flags.DEFINE_string(
    'write_averaged', '', 'With --average_last: also write the averaged params to this workdir.')
_SPLIT = flags.DEFINE_string('split', '', 'The split to decode (default: config.test_split).')
_TRANSLATE = flags.DEFINE_bool('translate', False, 'Translate --input line by line instead.')
_INPUT = flags.DEFINE_string('input', '-', 'With --translate: a file of sentences, - for stdin.')
_OUTPUT = flags.DEFINE_string('output', '-', 'With --translate: the output file, - for stdout.')
_TRUNCATE_LONG = flags.DEFINE_bool(
    'truncate_long', False, 'With --translate: a line over max_position tokens is cut to it '
    '(and counted) instead of left empty.')
_NBEST = flags.DEFINE_integer(
    'nbest', 1, 'With --translate: beam search\'s best N per line (N <= beam_size), as TSV: '
    'index, rank, score (sum log-prob / length penalty), text.')
_SCORE = flags.DEFINE_bool('score', False, 'Forced decoding: the log-probability of each '
                           '--references line given its --input line, as TSV '
                           '(t2t/eval/scoring.py).')
_REFERENCES = flags.DEFINE_string('references', '', 'With --score: the translations, one per '
                                  '--input line.')
_WATCH = flags.DEFINE_bool('watch', False, 'Evaluate each new checkpoint while training runs, '
                           'until training finishes (see t2t/eval/watch.py).')
_WEIGHTS = flags.DEFINE_enum(
    'weights', 'auto', ['auto', 'ema', 'raw'], 'ema: the moving average of the params that a run '
    'with ema_decay > 0 saved (labels end in -ema); raw: the params as trained; auto: ema when '
    'the checkpoint holds it, else raw.')
_ENSEMBLE = flags.DEFINE_string(
    'ensemble', '', 'Decode with several checkpoints at once: comma-separated members, each a '
    'workdir (its latest checkpoint) or a step of --workdir; any sizes, one vocabulary. Each '
    'step reads the arithmetic mean of the members\' log-probabilities (not of their '
    'probabilities, as fairseq). Results go to --workdir.')
# Lexically constrained decoding (t2t/eval/terms.py, t2t/eval/constraints.py).
_CONSTRAINTS = flags.DEFINE_string(
    'constraints', '', 'A file of one JSON list of phrases per source line (of the split, or of '
    '--input with --translate): each translation must contain its line\'s phrases (beam search '
    'with dynamic beam allocation; fairseq\'s --constraints).')
_TERMINOLOGY = flags.DEFINE_string(
    'terminology', '', 'A TSV of "source term<TAB>target term" lines: the target term is a '
    'constraint of every source line holding the source term as whole words.')

_TIMEOUT = flags.DEFINE_float('timeout', 3600.0, 'With --watch: give up after this many seconds '
                              'without a new checkpoint.')
_POLL = flags.DEFINE_float('poll', 5.0, 'With --watch: seconds between looks for a new checkpoint.')

# Minimum Bayes risk decoding (t2t/eval/mbr.py)
_MBR_SAMPLES = flags.DEFINE_integer(
    'mbr_samples', 0, 'MBR decoding over N candidates per sentence: of them, the one of highest '
    'mean utility against the others (0: off; labels end in -mbr-<candidates>N-<utility>).')
_MBR_CANDIDATES = flags.DEFINE_enum(
    'mbr_candidates', 'sample', ['sample', 'nbest'], 'sample: N draws with the config\'s '
    'temperature, top_k, top_p, decode_seed; nbest: beam search\'s best N (N <= beam_size).')
_MBR_UTILITY = flags.DEFINE_enum('mbr_utility', 'chrf', ['chrf', 'bleu'],
                                 'MBR\'s utility: sacrebleu\'s sentence chrF or BLEU.')


def _mbr():
    """The MBR settings of the --mbr_* flags, or None."""
    from t2t.eval import mbr

    if not _MBR_SAMPLES.value:
        return None
    if _SCORE.value or _WATCH.value:
        sys.exit('evaluate.py: --mbr_samples decodes: not with --score or --watch')
    try:
        return mbr.MBR(_MBR_SAMPLES.value, _MBR_CANDIDATES.value, _MBR_UTILITY.value)
    except ValueError as e:
        sys.exit(f'evaluate.py: {e}')


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    cli.check_values(_CONFIG.value, 'evaluate.py')
    try:
        distributed.initialize()
    except distributed.StartupError as e:  # one line naming the processes that did not join
        sys.exit(f'evaluate.py: {e}')
    import jax

    cli.check_devices(_CONFIG.value, 'evaluate.py')
    compile_cache.setup(_CONFIG.value)
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    # after flag parsing: fast --help
    from t2t.eval import evaluation, scoring, watch
    from t2t.eval.checkpoints import EvalError
    from t2t.infra import workdir
    from t2t.run import checkpoint, startup

    workdir.quiet_transient_failures()

    if (_CONSTRAINTS.value or _TERMINOLOGY.value) and (_SCORE.value or _WATCH.value):
        sys.exit('evaluate.py: --constraints and --terminology shape a search: they take a '
                 'split or --translate, not --score or --watch')
    mbr = _mbr()
    if mbr and (_CONSTRAINTS.value or _TERMINOLOGY.value):
        sys.exit('evaluate.py: --mbr_samples picks among unconstrained candidates: it takes no '
                 '--constraints or --terminology')
    if _ENSEMBLE.value and _WATCH.value:
        sys.exit('evaluate.py: --watch with --ensemble is not supported: --watch evaluates the '
                 'checkpoints of one run (--workdir) as they come')
    if _AVERAGE_FINAL.value and (_SCORE.value or _WATCH.value):
        sys.exit('evaluate.py: --average_final chooses the checkpoint of a split\'s evaluation or '
                 '--translate; --score takes --step or --average_last, --watch neither')
    try:
        step = _STEP.value
        if _BEST.value:
            step = _best_step(_WORKDIR.value, jax.process_index())
        if _SCORE.value:
            scoring.run(_CONFIG.value, _WORKDIR.value, input_path=_INPUT.value,
                        references_path=_REFERENCES.value, output_path=_OUTPUT.value,
                        step=step, average_last=_AVERAGE_LAST.value,
                        echo=lambda line: print(line, file=sys.stderr),
                        weights=_WEIGHTS.value, ensemble=_ENSEMBLE.value)
            return
        if _WATCH.value:
            watch.run(_CONFIG.value, _WORKDIR.value, split=_SPLIT.value, timeout_s=_TIMEOUT.value,
                      poll_s=_POLL.value, weights=_WEIGHTS.value)
            return
        evaluation.run(
            _CONFIG.value, _WORKDIR.value, step=step, all_steps=_ALL.value,
            average_last=_AVERAGE_LAST.value, average_final=_AVERAGE_FINAL.value,
            write_averaged=_WRITE_AVERAGED.value,
            split=_SPLIT.value, translate=_TRANSLATE.value, input_path=_INPUT.value,
            output_path=_OUTPUT.value, truncate_long=_TRUNCATE_LONG.value,
            weights=_WEIGHTS.value, nbest=_NBEST.value, ensemble=_ENSEMBLE.value,
            constraints=_CONSTRAINTS.value, terminology=_TERMINOLOGY.value, mbr=mbr)
    except distributed.PeerLost as e:  # exit 4: another process of the job is gone
        distributed.exit_peer_lost(f'evaluate.py: {e}')
    except (EvalError, checkpoint.CheckpointError, startup.ConfigError, distributed.SyncError) as e:
        sys.exit(f'evaluate.py: {e}')
    except Exception as e:  # the workdir's storage (a bucket down, a missing one): one line
        cli.exit_storage_error('evaluate.py', e)  # raises e again when it is not one


def _best_step(workdir_path, process_index: int) -> int:
    """--best: the step of the run's best checkpoint (t2t/run/best.py), said on stderr."""
    from t2t.eval.checkpoints import EvalError
    from t2t.run import best

    if _STEP.present or _ALL.value or _AVERAGE_LAST.value or _AVERAGE_FINAL.value or _WATCH.value:
        raise EvalError('--best takes the place of --step, --all, --average_last, '
                        '--average_final and --watch: give one of them')
    if not workdir_path:
        raise EvalError('--workdir is required')
    step, what = best.best_step(workdir_path)
    if process_index == 0:
        print(f'the best checkpoint: step {step} ({what})', file=sys.stderr)
    return step


if __name__ == '__main__':
    cli.run(main, 'evaluate.py')
