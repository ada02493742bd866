"""The goodput report of a workdir: `python -m t2t.goodput WORKDIR [--json] [--process=N]`.

Reads the attempts' ledgers (t2t/goodput/ledger.py) and splits the wall time from the first
attempt's start to the last attempt's last record into productive training and the kinds of badput
(definitions: docs/goodput.md). Prints a table over all attempts and one line per attempt, writes
the totals as TensorBoard scalars to WORKDIR/goodput/ (at the last step reached) and, with --json,
prints the whole report as one JSON object instead of the table.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import sys

from t2t.goodput import ledger as goodput
from t2t.infra import uploads
from t2t.infra import workdir as wd

# category -> the ledger phases it is made of ('lost_progress' and 'idle' come from the
# attempts' steps and gaps; 'productive' is the training time that was not lost)
CATEGORIES = {
    'productive': ('train',),
    'initialization': ('startup', 'setup', 'data'),
    'compile': ('compile',),
    'restore': ('restore',),
    'checkpoint': ('checkpoint',),
    'evaluation': ('eval',),
    'data_wait': ('data_wait',),
    'profiling': ('profile',),
    'logging': ('logging',),
    'storage_backpressure': ('backpressure',),
    'lost_progress': (),
    'idle': (),
}
STAGES = ('trace', 'lower', 'xla', 'load', 'store')  # of compile (t2t/goodput/ledger.py)
# The writer threads' work beside the loop (t2t/infra/uploads.py): not wall time of the loop.
BACKGROUND = ('written_bytes', 'write_s', 'peak_queue_bytes', 'waited_s')
LABELS = {'productive': 'productive training', 'data_wait': 'data wait',
          'logging': 'metrics writes', 'storage_backpressure': 'storage backpressure',
          'lost_progress': 'lost progress', 'idle': 'idle between attempts'}


def _merge(ranges):
    """Disjoint sorted (lo, hi] intervals covering the given ones."""
    out = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _overlap(lo: int, hi: int, merged) -> int:
    """How many of the steps (lo, hi] the merged intervals cover."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in merged)


def _quantile(hist: dict[int, int], q: float) -> float | None:
    total = sum(hist.values())
    if not total:
        return None
    rank = q * (total - 1)
    seen = 0
    for k in sorted(hist):
        seen += hist[k]
        if seen > rank:
            return goodput.bucket_value(k)
    return goodput.bucket_value(max(hist))


def _attempt(name: str, records: list[dict]) -> dict:
    """One attempt's own account: phases, steps, slices, step times, findings, cause."""
    start = records[0]['t']
    phases = dict.fromkeys(goodput.PHASES, 0.0)
    slices, hist, findings, stages = [], {}, [], {}
    background = dict.fromkeys(BACKGROUND, 0.0)
    max_step, previous, first_step, last_step, cause = 0.0, None, None, None, 'killed'
    for r in records[1:]:
        if r['at'] == 'finding':
            findings.append({k: r[k] for k in ('kind', 'step', 'elapsed_s', 'limit_s', 't')})
            continue
        for phase, s in r.get('seconds', {}).items():
            phases[phase] = phases.get(phase, 0.0) + s
        step = r.get('step')
        if step is not None:
            if previous is not None:
                slices.append((previous, step, r.get('seconds', {}).get('train', 0.0)))
            if first_step is None:
                first_step = step
            previous = last_step = step
        for k, s in r.get('compile_stages', {}).items():
            stages[k] = stages.get(k, 0.0) + s
        for k, n in r.get('step_times', {}).items():
            hist[int(k)] = hist.get(int(k), 0) + n
        max_step = max(max_step, r.get('max_step_s', 0.0))
        for k, v in r.get('background_writes', {}).items():
            background[k] = max(background[k], v) if k == 'peak_queue_bytes' else \
                background[k] + v
        if r['at'] == 'end':
            cause = r['cause']
    if cause == 'killed' and records[-1]['at'] == 'finding':
        cause = f'killed after a watchdog finding ({findings[-1]["kind"]})'
    end = max(r['t'] for r in records if 'seconds' in r or r['at'] == 'start')  # accounted to
    return {'file': name, 'start': start, 'end': end, 'cause': cause, 'phases': phases,
            'slices': slices, 'first_step': first_step, 'last_step': last_step,
            'step_times': {'steps': sum(hist.values()), 'median_s': _quantile(hist, 0.5),
                           'p90_s': _quantile(hist, 0.9), 'max_s': max_step or None},
            'findings': findings, 'attempt': records[0].get('attempt'),
            'background_writes': background,
            'startup': next((r['startup'] for r in records if 'startup' in r), {}),
            'compile_stages': {k: stages.get(k, 0.0) for k in STAGES}}


def _categories(phases: dict, lost: float) -> dict:
    out = {c: sum(phases.get(p, 0.0) for p in ps) for c, ps in CATEGORIES.items()}
    out['productive'] -= lost
    out['lost_progress'] = lost
    return out


def report(workdir, process_index: int = 0) -> dict | None:
    """The report (a JSON-compatible dict) of WORKDIR's ledgers of `process_index`; None if none."""
    attempts = [_attempt(n, r) for n, r in goodput.read_attempts(workdir, process_index)]
    if not attempts:
        return None
    ranges = [(a['first_step'], a['last_step']) for a in attempts if a['first_step'] is not None]
    per_attempt, totals = [], dict.fromkeys(CATEGORIES, 0.0)
    lost_steps_total = 0
    for k, a in enumerate(attempts):
        # A step trained here and again by a later attempt was lost here.
        later = _merge((lo, hi) for b in attempts[k + 1:] if b['first_step'] is not None
                       for lo, hi in [(b['first_step'], b['last_step'])])
        lost = sum(train * _overlap(lo, hi, later) / (hi - lo)
                   for lo, hi, train in a['slices'] if hi > lo)
        lost_steps = (_overlap(a['first_step'], a['last_step'], later)
                      if a['first_step'] is not None else 0)
        lost_steps_total += lost_steps
        seconds = _categories(a['phases'], lost)
        idle = max(0.0, attempts[k + 1]['start'] - a['end']) if k + 1 < len(attempts) else 0.0
        seconds['idle'] = idle  # after this attempt, until the next one started
        for c in CATEGORIES:
            totals[c] += seconds[c]
        wall = a['end'] - a['start']
        per_attempt.append({
            'attempt': k + 1, 'file': a['file'], 'start': _utc(a['start']), 'cause': a['cause'],
            'launch_attempt': a['attempt'],
            'steps': [a['first_step'], a['last_step']], 'lost_steps': lost_steps,
            'wall_s': wall, 'seconds': seconds,
            'goodput': seconds['productive'] / wall if wall > 0 else None,
            'startup': a['startup'], 'compile_stages': a['compile_stages'],
            'step_times': a['step_times'], 'findings': a['findings'],
            'background_writes': a['background_writes']})
    wall = max(a['end'] for a in attempts) - attempts[0]['start']
    accounted = sum(totals.values())
    unrecorded = _unrecorded(attempts)
    count = len(attempts) + len(unrecorded)
    return {
        'workdir': str(workdir), 'process': process_index, 'attempts': count,
        'restarts': count - 1, 'unrecorded_attempts': unrecorded,
        'first_start': _utc(attempts[0]['start']),
        'wall_s': wall, 'seconds': totals,
        'shares': {c: s / wall if wall > 0 else None for c, s in totals.items()},
        'unaccounted_s': wall - accounted,  # clock drift; negative if attempts overlapped
        'goodput': totals['productive'] / wall if wall > 0 else None,
        'lost_steps': lost_steps_total,
        'background_writes': {
            k: max(a['background_writes'][k] for a in attempts) if k == 'peak_queue_bytes'
            else sum(a['background_writes'][k] for a in attempts) for k in BACKGROUND},
        'steps': [ranges[0][0], max(hi for _, hi in ranges)] if ranges else [None, None],
        'per_attempt': per_attempt,
    }


def _unrecorded(attempts) -> list[str]:
    """'<launch>:<n>' of the attempts a launcher counted ($T2T_ATTEMPT) that left no record (killed
    before their first write): the numbers missing below a launch's highest recorded one. Their
    time is in the idle time before the next recorded attempt."""
    seen = {}
    for a in attempts:
        if a['attempt']:
            seen.setdefault(a['attempt']['launch'], set()).add(a['attempt']['number'])
    return [f'{launch}:{n}' for launch, numbers in seen.items()
            for n in range(max(numbers)) if n not in numbers]


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


def _s(x) -> str:
    return '-' if x is None else f'{x:.1f}' if x >= 10 else f'{x:.2f}'


def _pct(x) -> str:
    return '-' if x is None or math.isnan(x) else f'{100 * x:.1f}%'


def format_report(r: dict) -> str:
    lo, hi = r['steps']
    lines = [f'goodput of {r["workdir"]} (process {r["process"]}): {_pct(r["goodput"])} of '
             f'{_s(r["wall_s"])} s wall time from the first start ({r["first_start"]}), '
             f'{r["attempts"]} attempt{"s" if r["attempts"] != 1 else ""} '
             f'({r["restarts"]} restart{"s" if r["restarts"] != 1 else ""}), steps {lo} -> {hi}',
             f'  {"":24}{"seconds":>10}{"share":>8}']
    for c, s in r['seconds'].items():
        note = f'   ({r["lost_steps"]} steps trained again)' if c == 'lost_progress' else ''
        lines.append(f'  {LABELS.get(c, c):24}{_s(s):>10}{_pct(r["shares"][c]):>8}{note}')
    bg = r['background_writes']
    if bg['written_bytes']:
        lines.append(f'  background writes (beside training, not in the rows above): '
                     f'{bg["written_bytes"] / 2**20:.2f} MiB in {_s(bg["write_s"])} s of the '
                     f'writer threads; the write queue\'s peak '
                     f'{bg["peak_queue_bytes"] / 2**20:.2f} MiB')
    if r['unrecorded_attempts']:
        n = len(r['unrecorded_attempts'])
        lines.append(f'  ({n} attempt{"s" if n != 1 else ""} ended before writing a record: '
                     'in idle between attempts)')
    if abs(r['unaccounted_s']) > 1e-3 * max(r['wall_s'], 1e-9):
        lines.append(f'  {"unaccounted":24}{_s(r["unaccounted_s"]):>10}'
                     f'{_pct(r["unaccounted_s"] / r["wall_s"]):>8}')
    columns = [('train', 'productive'), ('init', 'initialization'), ('compile', 'compile'),
               ('xla', 'xla'), ('load', 'load'), ('restore', 'restore'), ('ckpt', 'checkpoint'),
               ('eval', 'evaluation'), ('data', 'data_wait'), ('prof', 'profiling'),
               ('log', 'logging'), ('wait', 'storage_backpressure'), ('lost', 'lost_progress'),
               ('idle', 'idle')]
    lines.append('per attempt (seconds; xla: the part of compile that XLA compiled or loaded from '
                 "jax's cache; load: a stored executable's load; step times from 2% buckets):")
    lines.append('  #  start                 steps      ' + ''.join(f'{h:>8}' for h, _ in columns)
                 + '  goodput  step median/p90/max    end')
    for a in r['per_attempt']:
        st = a['step_times']
        steps = f'{a["steps"][0]}->{a["steps"][1]}' if a['steps'][0] is not None else '-'
        times = (f'{_s3(st["median_s"])}/{_s3(st["p90_s"])}/{_s3(st["max_s"])}'
                 if st['steps'] else '-')
        findings = (f'; watchdog: {len(a["findings"])} finding'
                    f'{"s" if len(a["findings"]) != 1 else ""} (steps '
                    + ', '.join(str(f['step']) for f in a['findings'][:5]) + ')'
                    if a['findings'] else '')
        values = [a['compile_stages'][c] if c in STAGES else a['seconds'][c]
                  for _, c in columns]
        lines.append(f'  {a["attempt"]:<2} {a["start"]:21} {steps:10} '
                     + ''.join(f'{_s(v):>8}' for v in values)
                     + f'{_pct(a["goodput"]):>9}  {times:21}  {a["cause"]}'
                     + (f', {a["lost_steps"]} steps lost' if a['lost_steps'] else '')
                     + findings)
    return '\n'.join(lines)


def _s3(x) -> str:
    return '-' if x is None else f'{x:.3g}'


def summary_line(r: dict) -> str:
    """One line: goodput and the largest badputs."""
    bad = sorted(((s, c) for c, s in r['seconds'].items() if c != 'productive'), reverse=True)
    return (f'goodput {_pct(r["goodput"])} of {_s(r["wall_s"])} s over {r["attempts"]} '
            f'attempt{"s" if r["attempts"] != 1 else ""}; badput: '
            + ', '.join(f'{LABELS.get(c, c)} {_pct(r["shares"][c])}' for s, c in bad[:3] if s > 0)
            + f' (python -m t2t.goodput {r["workdir"]})')


def print_summary(workdir) -> None:
    """train.py's last line: the summary line, or why there is none (training is over: never an
    error; a workdir whose storage is failing is not read, which would wait out its retries)."""
    failing = uploads.QUEUE.down()
    if failing is not None:
        print(f'goodput: no report ({wd.describe(failing[1])}: the workdir\'s storage is failing; '
              f'python -m t2t.goodput {workdir} later)', flush=True)
        return
    try:
        r = report(workdir)
    except Exception as e:  # noqa: BLE001 - e.g. a bucket outage
        print(f'goodput: no report ({type(e).__name__}: {str(e)[:200]})', flush=True)
        return
    if r is not None:
        print(summary_line(r), flush=True)


def scalars(r: dict) -> dict:
    """The report's totals as TensorBoard scalars."""
    out = {'goodput': r['goodput'], 'goodput/wall_s': r['wall_s'],
           'goodput/attempts': r['attempts'], 'goodput/lost_steps': r['lost_steps']}
    for c, s in r['seconds'].items():
        out[f'goodput/{c}_s'] = s
        out[f'goodput/{c}_share'] = r['shares'][c]
    return out


def write_scalars(workdir, r: dict) -> None:
    """The scalars in WORKDIR/goodput/'s event file and metrics.jsonl, at the last step reached
    (a later report at the same step replaces them)."""
    from t2t.infra import metrics

    step = r['steps'][1] or 0
    with metrics.MetricWriter(wd.path(workdir, goodput.DIRNAME), stream=io.StringIO(),
                              start_step=step - 1) as writer:
        writer.write_scalars(step, scalars(r))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog='python -m t2t.goodput', description=__doc__.split('\n')[0])
    ap.add_argument('workdir')
    ap.add_argument('--json', action='store_true', help='print the report as one JSON object')
    ap.add_argument('--process', type=int, default=0, help="the process whose ledger to read")
    ap.add_argument('--no_tensorboard', action='store_true',
                    help='do not write the TensorBoard scalars')
    args = ap.parse_args(argv)
    r = report(args.workdir, args.process)
    if r is None:
        sys.exit(f'python -m t2t.goodput: no goodput ledger of process {args.process} in '
                 f'{wd.path(args.workdir, goodput.DIRNAME)}')
    if not args.no_tensorboard:
        write_scalars(args.workdir, r)
    print(json.dumps(r, indent=1) if args.json else format_report(r))


if __name__ == '__main__':
    main()
