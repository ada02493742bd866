"""A sweep directory read back: each point's row, and WORKDIR/summary.md, summary.csv and
curves.png built from what is on disk alone (`sweep.py --summarize=DIR`).

The directory holds sweep.json (the sweep's config file, flags and point names) and, in each
point's directory, sweep_point.json (its state, written by t2t/sweep/runner.py), the run's
metrics.jsonl and checkpoints, and the scores of its evaluation.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
import os

from t2t.infra import workdir as wd
from t2t.sweep.points import SweepError, format_value

STATE_NAME = 'sweep_point.json'
SWEEP_NAME = 'sweep.json'
STATUSES = ('pending', 'running', 'done', 'failed')


def read_json(path) -> dict | None:
    text = wd.read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SweepError(f'{path} is not valid JSON ({e}); delete it to start the point over') \
            from e


def read_state(point_dir: str) -> dict:
    return read_json(os.path.join(point_dir, STATE_NAME)) or {'status': 'pending'}


def _curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds, validation perplexity) of each evaluation.

    Training seconds: the sum of logged step times up to that step (compiles included,
    evaluation and checkpointing excluded), so points compare by the time spent training.
    """
    points, seconds, last_step = [], 0.0, 0
    for r in records:
        if r.get('step_time_s') is not None:
            seconds += r['step_time_s'] * (r['step'] - last_step)
            last_step = r['step']
        if r.get('eval_perplexity') is not None:
            points.append((r['step'], seconds, r['eval_perplexity']))
    return points


def point_row(workdir: str, name: str) -> dict:
    """One summary row, from the point directory alone."""
    from t2t.infra import metrics
    from t2t.run import checkpoint_read

    point_dir = os.path.join(workdir, name)
    state = read_state(point_dir)
    row = {'point': name, 'status': state.get('status', 'pending'),
           'overrides': state.get('overrides', {}), 'params': state.get('params'),
           'steps': None, 'train_seconds': None, 'best_val_perplexity': None,
           'best_val_step': None, 'final_val_perplexity': None, 'eval_label': '', 'split': '',
           'sacrebleu': None, 'chrf': None, 'error': state.get('error', ''), 'curve': []}
    jsonl = os.path.join(point_dir, metrics.JSONL_NAME)
    if os.path.exists(jsonl):
        row['curve'] = _curve(metrics.read_jsonl(jsonl))
    if row['curve']:
        best = min(row['curve'], key=lambda c: c[2])
        row.update(best_val_perplexity=best[2], best_val_step=best[0],
                   final_val_perplexity=row['curve'][-1][2])
    if os.path.isdir(os.path.join(point_dir, 'checkpoints')):
        try:
            meta = checkpoint_read.read_metadata(point_dir)
            row.update(steps=meta.get('step'), train_seconds=meta.get('train_seconds'))
        except checkpoint_read.CheckpointError as e:
            row['error'] = row['error'] or str(e)
    result = state.get('eval') or {}
    if 'error' in result:
        row['error'] = '; '.join(x for x in (row['error'], result['error']) if x)
    else:
        row.update(eval_label=result.get('label', ''), split=result.get('split', ''),
                   sacrebleu=result.get('sacrebleu'), chrf=result.get('chrf'))
    return row


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ''
    return f'{value:.{digits}f}' if isinstance(value, float) else str(value)


CSV_COLUMNS = ('point', 'status', 'params', 'steps', 'train_seconds', 'best_val_perplexity',
               'best_val_step', 'final_val_perplexity', 'split', 'eval_label', 'sacrebleu',
               'chrf', 'overrides', 'error')


def _csv(rows: list[dict], keys: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator='\n')
    writer.writerow([*CSV_COLUMNS, *keys])
    for r in rows:
        writer.writerow([json.dumps(r[c], sort_keys=True) if c == 'overrides' else
                         ('' if r[c] is None else r[c]) for c in CSV_COLUMNS]
                        + [format_value(r['overrides'][k]) if k in r['overrides'] else ''
                           for k in keys])
    return buffer.getvalue()


def _markdown(rows: list[dict], meta: dict) -> str:
    counts = {s: sum(r['status'] == s for r in rows) for s in STATUSES}
    split = next((r['split'] for r in rows if r['split']), meta.get('split') or 'test split')
    base = ' '.join(f'--config.{k}={format_value(v)}'
                    for k, v in (meta.get('base_overrides') or {}).items())
    averaged = (f'the average of the last {meta["average_last"]} checkpoints'
                if meta.get('average_last') else 'the latest checkpoint')
    lines = [f'# Sweep of `{meta.get("config", "?")}`' + (f' with `{base}`' if base else ''),
             '',
             f'{len(rows)} points: ' + ', '.join(f'{n} {s}' for s, n in counts.items() if n)
             + f'. Written {datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}.',
             '',
             'Validation perplexity from metrics.jsonl (best and last evaluation); train s: the '
             'seconds the time budget counted (checkpoint metadata); sacreBLEU and chrF of '
             f'evaluate.py on {split} ({averaged}).',
             '',
             '| point | status | params | steps | train s | best val ppl (step) '
             '| final val ppl | sacreBLEU | chrF | note |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        best = (f'{_fmt(r["best_val_perplexity"], 2)} ({r["best_val_step"]})'
                if r['best_val_perplexity'] is not None else '')
        note = r['error'].replace('|', '/')
        lines.append(f'| `{r["point"]}` | {r["status"]} | {_fmt(r["params"], 0)} | '
                     f'{_fmt(r["steps"], 0)} | {_fmt(r["train_seconds"], 0)} | {best} | '
                     f'{_fmt(r["final_val_perplexity"], 2)} | {_fmt(r["sacrebleu"], 2)} | '
                     f'{_fmt(r["chrf"], 2)} | {note} |')
    return '\n'.join(lines) + '\n'


def plot_curves(rows: list[dict], path: str, title: str = ''):
    """Validation perplexity against step and against training seconds; returns the figure."""
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = plt.get_cmap('tab20' if len(rows) > 10 else 'tab10')
    for i, r in enumerate(rows):
        if not r['curve']:
            continue
        steps, seconds, ppl = zip(*r['curve'], strict=True)
        style = dict(color=colors(i % colors.N), marker='o', markersize=3,
                     linestyle='-' if i < colors.N else '--')
        by_step.plot(steps, ppl, label=r['point'], **style)
        by_time.plot(seconds, ppl, **style)
    by_step.set_xlabel('step')
    by_time.set_xlabel('training seconds (sum of step times; evaluation excluded)')
    by_step.set_ylabel('validation perplexity')
    for ax in (by_step, by_time):
        ax.set_yscale('log')
        ax.grid(alpha=0.3, which='both')
    if any(r['curve'] for r in rows):  # no legend without a curve
        fig.legend(loc='center right', fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=110)
    plt.close(fig)
    wd.write_atomic(path, buffer.getvalue())
    return fig


def write_summary(workdir: str) -> list[dict]:
    """summary.md, summary.csv and curves.png from what is on disk; returns the rows."""
    meta = read_json(os.path.join(workdir, SWEEP_NAME))
    if meta is None:
        raise SweepError(f'{workdir} holds no {SWEEP_NAME}: not a sweep directory')
    rows = [point_row(workdir, name) for name in meta['points']]
    keys = sorted({k for r in rows for k in r['overrides']})
    wd.write_atomic(os.path.join(workdir, 'summary.md'), _markdown(rows, meta))
    wd.write_atomic(os.path.join(workdir, 'summary.csv'), _csv(rows, keys))
    plot_curves(rows, os.path.join(workdir, 'curves.png'),
                f'{meta.get("config", "")}: {os.path.basename(os.path.abspath(workdir))}')
    return rows
