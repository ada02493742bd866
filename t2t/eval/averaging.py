"""Checkpoint averaging that never hurts: the window comes from the run, and the average must
beat the last checkpoint on the validation split to be used.

The paper averages the last 5 (base) or 20 (big) checkpoints of 100k-300k-step runs: a window of
a few percent of training. The same count over a short run reaches back to early checkpoints,
whose mean can score far below the last checkpoint alone. So:

- `final_window`: the checkpoints of the run's final `average_fraction` of steps (config), the
  only ones `evaluate.py --average_final` averages;
- `wide_window`: the one-line warning for `--average_last=N` when its N checkpoints reach before
  that final part (the user's explicit choice is still evaluated);
- `choose`: the validation NLL (per-token cross-entropy, no label smoothing) of the average and of
  the last checkpoint, each said, and the better of the two (the average only when strictly lower).
"""

from __future__ import annotations

from collections.abc import Callable


def first_step(last_step: int, fraction: float) -> float:
    """The earliest step the final `fraction` of a run of `last_step` steps holds."""
    return last_step * (1.0 - fraction)


def final_window(steps: list[int], fraction: float) -> list[int]:
    """The checkpoint steps (sorted, the last the run's end) in its final `fraction` of steps."""
    start = first_step(steps[-1], fraction)
    return [s for s in steps if s >= start]


def wide_window(window: list[int], fraction: float) -> str | None:
    """The warning line for averaging `window` (sorted steps, last one the run's end) when it
    reaches before the run's final `fraction`, else None."""
    last = window[-1]
    if len(window) < 2 or window[0] >= first_step(last, fraction):
        return None
    return (f'WARNING: averaging steps {window[0]}-{last} spans {(last - window[0]) / last:.0%} '
            f'of the run\'s {last} steps, back before its final average_fraction={fraction:g} '
            f'(steps >= {first_step(last, fraction):.0f}): early checkpoints can make the average '
            'worse than the last checkpoint alone (--average_final compares them on validation)')


def validation_nll(config, tokenizer, mesh, params_by_label: dict) -> dict[str, dict]:
    """{label: validation loss/nll/perplexity/accuracy} of each params (replicated on `mesh`), over
    every batch of config.eval_split, with one compiled evaluation step; ValueError (one line) for
    a split that cannot be read."""
    from t2t import data, sharding, train_lib
    from t2t.eval.validation import evaluate_loss

    try:
        split = data.eval_split(config, tokenizer, config.eval_split)
    except (ValueError, OSError) as e:
        raise ValueError(f'cannot read split {config.eval_split!r}: {e}') from e
    parallel = sharding.data_parallel_size(mesh)
    rows = -(-config.eval_batch_size // parallel) * parallel  # every device the same rows
    step_config = train_lib.StepConfig.from_config(config)
    eval_step = train_lib.jit_eval_step(step_config, sharding.replicated(mesh), mesh)
    return {label: evaluate_loss(eval_step, params, split.batches(config.eval_batch_size, rows),
                                 mesh, -1)
            for label, params in params_by_label.items()}


def choose(config, tokenizer, mesh, average: tuple[str, object], last: tuple[str, object],
           echo: Callable[[str], None]) -> tuple[str, dict[str, dict]]:
    """(the label of the better of `average` and `last`, each a (label, params), by validation
    NLL, {label: its validation metrics}); one line says both and which is used."""
    metrics = validation_nll(config, tokenizer, mesh, dict((average, last)))
    (avg_label, _), (last_label, _) = average, last
    avg_nll, last_nll = metrics[avg_label]['nll'], metrics[last_label]['nll']
    chosen = avg_label if avg_nll < last_nll else last_label
    echo(f'validation NLL on {config.eval_split} (per target token): {avg_nll:.4f} for '
         f'{avg_label} (perplexity {metrics[avg_label]["perplexity"]:.2f}), {last_nll:.4f} for '
         f'{last_label} (perplexity {metrics[last_label]["perplexity"]:.2f}): using {chosen}')
    return chosen, metrics
