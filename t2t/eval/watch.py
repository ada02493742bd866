"""evaluate.py --watch: evaluate every checkpoint of a training run once, while it trains.

    run(config, workdir)                  # until training has finished, or an hour without news

The eval-job pattern of large codebases. The loop polls WORKDIR for finished checkpoint steps:
orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it when complete (on GCS it
adds a commit_success.txt instead); `checkpoint_read.finished_steps` lists only such steps, so a
step still being written is never read. Every poll lists the bucket afresh (t2t/infra/workdir.py
turns gcsfs's listing cache off; with it a watcher saw only its first listing). Each new step is
decoded and scored like evaluate.py does (hypotheses file, WORKDIR/eval-<split>.json under the
label step-N) and its scores are written to WORKDIR/watch-<split>/: metrics.jsonl (one record
per step: the scores file) and TensorBoard events under eval/ tags (a run of its own beside the
training run's events).

Restartable: a step with a record in that metrics.jsonl is done (the record is written last); a
restarted watcher skips those and drops anything written after the last one. It returns when
training has finished (WORKDIR/TRAINING_FINISHED, written after the last save) and every step is
evaluated, or after timeout_s without a new checkpoint. A step that keep_checkpoints deleted before
it was read, or that is corrupt, is reported in one line and skipped.

weights ('auto', 'ema', 'raw'; evaluation.py): a step evaluated with EMA weights is labelled
step-N-ema and its tags end in _ema. A step counts as done whichever weights it was evaluated with.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

from t2t import sharding
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import evaluation
from t2t.infra import distributed, metrics
from t2t.infra import workdir as wd
from t2t.run import checkpoint_read, startup


def _done_steps(logdir) -> set[int]:
    if not wd.exists(logdir / metrics.JSONL_NAME):
        return set()
    return {r['step'] for r in metrics.read_jsonl(logdir)}


def run(config, workdir, *, split: str = '', timeout_s: float = 3600.0, poll_s: float = 5.0,
        progress: bool = False, echo: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep, weights: str = 'auto') -> dict[int, dict]:
    """Evaluates each new checkpoint of WORKDIR once; returns {step: record} of this call."""
    from t2t.run import run_record

    startup.check_lengths(config)
    if not workdir:
        raise eval_checkpoints.EvalError('--workdir is required')
    split = split or config.test_split
    tag = evaluation._split_tag(split)
    logdir = wd.path(workdir, f'watch-{tag}')
    json_path = evaluation.scores_path(workdir, split)
    writes = jax.process_index() == 0  # every process decodes its rows; process 0 writes
    if not writes:
        echo = lambda _: None  # noqa: E731
    done = _done_steps(logdir)
    skipped: set[int] = set()
    tokenizer = eval_split = None  # read at the first checkpoint: the run writes its vocabulary
    mesh = sharding.make_mesh((-1, 1, 1))  # decoding: every device its own rows
    echo(f'watching {workdir} ({split}); done before: {sorted(done) or "none"}')
    results = {}
    writer = metrics.MetricWriter(logdir, enabled=writes, start_step=max(done, default=0))
    last_news = clock()
    try:
        while True:
            finished = run_record.read_finished(workdir)  # read before listing: see the last step
            steps = checkpoint_read.finished_steps(workdir) if wd.is_dir(wd.path(workdir)) else []
            # Process 0's view (a listing may differ for a moment between hosts): every process
            # decodes the same steps and stops at the same time.
            todo = distributed.process_0_ints(
                [s for s in steps if s not in done and s not in skipped])
            finished_here = distributed.process_0_ints(
                [] if finished is None else [finished['step']])
            for step in todo:
                label = f'step-{step}'
                used = 'raw'
                if tokenizer is None:
                    tokenizer = evaluation.workdir_tokenizer(config, workdir)
                    eval_split = evaluation._load_split(config, tokenizer, split)
                try:
                    evaluation.check_vocabulary(workdir, [step], tokenizer, label)
                    used = checkpoint_read.choose_weights(workdir, step, weights)
                    params = eval_checkpoints.load_params(
                        workdir, [step], scan_layers=config.scan_layers, weights=used)
                    params = sharding.put_global(params, sharding.replicated(mesh))
                except checkpoint_read.CheckpointError as e:
                    gone = step not in checkpoint_read.finished_steps(workdir)
                    echo(f'== {label}: ' + ('deleted by training (keep_checkpoints) before it '
                                            'was read' if gone else f'corrupt: {e}'))
                    skipped.add(step)
                    continue
                label = eval_checkpoints.weights_label(label, used)
                record = evaluation.evaluate_params(
                    config, params, tokenizer, eval_split, split=split, label=label,
                    steps=[step], workdir=workdir, progress=progress, echo=echo, mesh=mesh,
                    weights=used)
                if writes:
                    evaluation.merge_json(json_path, label, record)
                tail = '_ema' if used == 'ema' else ''
                writer.write_scalars(step, {
                    f'eval/sacrebleu{tail}': record['sacrebleu'],
                    f'eval/chrf{tail}': record['chrf'],
                    f'eval/tok_bleu{tail}': record['tok_bleu_compound_split'],
                    f'eval/hit_length_limit{tail}': record['hit_length_limit']})
                done.add(step)
                results[step] = record
            if todo:
                last_news = clock()
            elif finished_here:
                stopped_by = (finished or {}).get('stopped_by', '?')
                echo(f'training finished at step {finished_here[0]} ({stopped_by}); '
                     f'evaluated {len(results)} new checkpoints -> {logdir}')
                return results
            elif distributed.process_0_ints([1] if clock() - last_news > timeout_s else []):
                echo(f'no new checkpoint for {timeout_s:.0f} s: stopping; evaluated '
                     f'{len(results)} new checkpoints -> {logdir}')
                return results
            else:
                sleep(poll_s)
    finally:
        writer.close()
