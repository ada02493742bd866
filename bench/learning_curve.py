"""Plot a run's learning curve from WORKDIR/metrics.jsonl and print it as a Markdown table.

    python bench/learning_curve.py --workdir=workdirs/default [--out=docs/learning_curve.png]

Training loss (label-smoothed) and validation perplexity against steps, with wall-clock seconds of
training on the top axis when the run logged step times.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t2t.infra import metrics  # noqa: E402


def table(records: list[dict]) -> str:
    rows = ['| step | train s | train loss | val loss | val perplexity | val accuracy |',
            '|---|---|---|---|---|---|']
    seconds = 0.0
    last_step = 0
    for r in records:
        if 'step_time_s' in r:
            seconds += r['step_time_s'] * (r['step'] - last_step)
            last_step = r['step']
        if 'eval_loss' in r:
            rows.append(f"| {r['step']} | {seconds:.0f} | {r.get('loss', float('nan')):.3f} | "
                        f"{r['eval_loss']:.3f} | {r['eval_perplexity']:.1f} | "
                        f"{r['eval_accuracy']:.3f} |")
    return '\n'.join(rows)


def plot(records: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    train = [(r['step'], r['loss']) for r in records if r.get('loss') is not None]
    evals = [(r['step'], r['eval_perplexity']) for r in records if 'eval_perplexity' in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train, strict=True), label='train loss (label-smoothed)', color='tab:blue')
    ax.set_xlabel('step')
    ax.set_ylabel('train loss')
    if evals:
        ax2 = ax.twinx()
        ax2.plot(*zip(*evals, strict=True), 'o-', label='validation perplexity',
                 color='tab:orange')
        ax2.set_ylabel('validation perplexity')
        ax2.set_yscale('log')
        fig.legend(loc='upper right', bbox_to_anchor=(0.88, 0.88))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--workdir', required=True)
    parser.add_argument('--out', default='', help='PNG path (default: WORKDIR/learning_curve.png)')
    parser.add_argument('--title', default='t2t configs/default.py on trans-de-en (EN->DE)')
    args = parser.parse_args()
    records = metrics.read_jsonl(args.workdir)
    if not records:
        sys.exit(f'learning_curve.py: no records in {args.workdir}/metrics.jsonl')
    out = args.out or os.path.join(args.workdir, 'learning_curve.png')
    plot(records, out, args.title)
    print(table(records))
    print(f'learning curve -> {out}')


if __name__ == '__main__':
    main()
