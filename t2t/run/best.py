"""Best checkpoints and early stopping: the ranking of a run's evaluations by one metric.

`Tracker` follows a run's evaluations: the best value of `best_metric` so far and its step, the
evaluations since it improved (early_stopping_patience) and the keep_best best steps, each of
which was saved as a checkpoint. It travels in each checkpoint's metadata (META_KEY), so a killed
or preempted run resumes with the same best-so-far, patience count and kept steps as if it had
never stopped; the checkpoint manager keeps its steps beside keep_checkpoints' newest N
(checkpoint.keep_best_steps). `best_step` is evaluate.py --best's.

An improvement is strictly better than the best so far (a tie is not); a value that is not finite
never improves nor ranks. Among equal values the older step ranks first.
"""

from __future__ import annotations

import dataclasses
import math

META_KEY = 'best'  # the Tracker's record in a checkpoint's metadata
BASE_METRICS = ('loss', 'bleu', 'chrf')  # of the validation split, as the loop's evaluation
# best_metric: a base metric of the trained params, or (_ema) of their moving average
METRICS = BASE_METRICS + tuple(f'{m}_ema' for m in BASE_METRICS)


def summary_key(metric: str) -> str:
    """The key of best_metric in the loop's evaluation summary: 'bleu_ema' -> 'eval_bleu_ema'."""
    return f'eval_{metric}'


def lower_is_better(metric: str) -> bool:
    return metric.removesuffix('_ema') == 'loss'


def enabled(config) -> bool:
    """Whether the run ranks its evaluations at all."""
    return config.keep_best > 0 or config.early_stopping_patience > 0


@dataclasses.dataclass
class Tracker:
    metric: str  # a METRICS name
    keep: int  # keep_best: how many of the best steps stay on disk
    patience: int  # early_stopping_patience: evaluations without improvement that stop (0: never)
    best_value: float | None = None
    best_step: int | None = None
    since_best: int = 0  # evaluations since the best one (0: the latest was the best)
    top: list = dataclasses.field(default_factory=list)  # [[value, step], ...], best first

    @classmethod
    def from_config(cls, config, record: dict | None = None) -> Tracker:
        """The tracker of a run: fresh, or continued from a checkpoint's record (a record of
        another metric starts afresh; a smaller keep_best drops the worst kept steps)."""
        tracker = cls(metric=config.best_metric, keep=config.keep_best,
                      patience=config.early_stopping_patience)
        if record and record.get('metric') == tracker.metric:
            tracker.best_value, tracker.best_step = record['best_value'], record['best_step']
            tracker.since_best = int(record['since_best'])
            tracker.top = [list(entry) for entry in record['top']][:tracker.keep]
        return tracker

    def record(self) -> dict:
        """What a checkpoint stores (JSON: floats round-trip exactly)."""
        return {'metric': self.metric, 'best_value': self.best_value,
                'best_step': self.best_step, 'since_best': self.since_best, 'top': self.top}

    def _better(self, a: float, b: float) -> bool:
        return a < b if lower_is_better(self.metric) else a > b

    def update(self, summary: dict, step: int) -> str:
        """Takes the evaluation of `step` in; returns its one-line account."""
        value = summary[summary_key(self.metric)]
        finite = value is not None and math.isfinite(value)
        if finite and (self.best_value is None or self._better(value, self.best_value)):
            self.best_value, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        if finite and self.keep > 0:
            # Older steps of an equal value rank first: insert after every entry not worse.
            at = sum(1 for v, _ in self.top if not self._better(value, v))
            self.top.insert(at, [value, step])
            del self.top[self.keep:]
        line = f'step {step}: {summary_key(self.metric)} {value:.4g}; best '
        line += 'none yet' if self.best_value is None else \
            f'{self.best_value:.4g} at step {self.best_step}'
        if self.patience:
            line += f'; {self.since_best} of {self.patience} evaluations without improvement'
        if self.keep:
            line += f'; kept {", ".join(str(s) for s in self.kept_steps())}'
        return line

    def kept_steps(self) -> list[int]:
        """The steps of the keep_best best evaluations, best first."""
        return [step for _, step in self.top]

    def exhausted(self) -> bool:
        """Early stopping: patience evaluations in a row brought no improvement."""
        return self.patience > 0 and self.since_best >= self.patience

    def stop_line(self, step: int) -> str:
        return (f'early stopping at step {step}: {summary_key(self.metric)} has not improved '
                f'for {self.since_best} evaluations (early_stopping_patience={self.patience}); '
                f'best {self.best_value:.4g} at step {self.best_step}')


def best_step(workdir) -> tuple[int, str]:
    """(step, its description) of WORKDIR's best checkpoint, as its newest checkpoint ranks them.

    Raises CheckpointError in one line when there is none (keep_best=0, no evaluation yet, or
    the step is no longer on disk)."""
    from t2t.run import checkpoint_read

    meta = checkpoint_read.read_metadata(workdir)
    record = meta.get(META_KEY)
    where = f'{checkpoint_read.checkpoint_dir(workdir)} (newest checkpoint {meta.get("step")})'
    if not record or not record.get('top'):
        keep = (meta.get('config') or {}).get('keep_best', 0)
        why = 'the run kept none (keep_best=0)' if not keep else 'no evaluation ranked yet'
        raise checkpoint_read.CheckpointError(f'no best checkpoint in {where}: {why}')
    value, step = record['top'][0]
    if step not in checkpoint_read.finished_steps(workdir):
        raise checkpoint_read.CheckpointError(
            f'the best checkpoint {step} of {where} is not on disk')
    return step, f'{summary_key(record["metric"])} {value:.4g}'
