"""MBR decoding against beam search on a trained model: BLEU and chrF with sacrebleu's paired
bootstrap, and seconds per sentence.

    python bench/mbr.py --config=configs/default.py --workdir=workdirs/default --step=N \\
        --sentences=300 --samples=8 --out_dir=/tmp/mbr-bench [--utility=chrf] [--warm] \\
        [--skip_nbest]

The first --sentences pairs of the config's test split are decoded by the checkpoint (--step,
default the latest; its EMA weights where it has them) with the config's beam search, and by MBR
(t2t/eval/mbr.py) over --samples draws (the config's temperature, top_k, top_p) and over beam
search's n-best (beam_size candidates). Nothing is written into --workdir: the checkpoint is
read through links from OUT_DIR/run, where the hypotheses and eval-test.json go. Seconds per
sentence: decoding and MBR's choice together, compiles included unless --warm (each system runs
twice and the second run is timed). The paired bootstrap (1000 resamples) compares each MBR
system with beam search; sacrebleu prints its own signature lines.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _linked_workdir(workdir: str, out_dir: str) -> str:
    """OUT_DIR/run: links to WORKDIR's checkpoints and vocabulary (the results go here)."""
    run = os.path.join(out_dir, 'run')
    os.makedirs(run, exist_ok=True)
    for name in ('checkpoints', 'vocab.model'):
        link = os.path.join(run, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(workdir, name)), link)
    return run


def _subset(config, run: str, out_dir: str, sentences: int):
    """The config, reading the first `sentences` test pairs from a TSV file under OUT_DIR."""
    from t2t import data
    from t2t.eval import evaluation

    tokenizer = evaluation.workdir_tokenizer(config, run)
    del tokenizer  # the workdir's vocabulary exists: evaluation reads it again
    texts, references = data.split_texts(config, config.test_split)
    path = os.path.join(out_dir, f'test-{sentences}.tsv')
    with open(path, 'w', encoding='utf-8') as f:
        for s, t in list(zip(texts, references, strict=True))[:sentences]:
            f.write(f'{s}\t{t}\n')
    subset = config.copy_and_resolve_references()
    subset.unlock()
    subset.dataset, subset.tsv_files.test = 'tsv', path
    subset.tsv_files.train = path  # names the vocabulary only: the workdir's is used
    subset.data_dir = os.path.join(out_dir, 'data')
    subset.lock()
    return subset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--config', default='configs/default.py')
    parser.add_argument('--workdir', required=True)
    parser.add_argument('--step', type=int, default=None)
    parser.add_argument('--sentences', type=int, default=300)
    parser.add_argument('--samples', type=int, default=8)
    parser.add_argument('--utility', default='chrf', choices=('chrf', 'bleu'))
    parser.add_argument('--out_dir', required=True)
    parser.add_argument('--warm', action='store_true')
    parser.add_argument('--skip_nbest', action='store_true', help='no MBR over the n-best')
    args = parser.parse_args()

    import importlib.util

    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    from t2t.eval import evaluation, mbr

    spec = importlib.util.spec_from_file_location('experiment', args.config)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    run = _linked_workdir(args.workdir, args.out_dir)
    config = _subset(config, run, args.out_dir, args.sentences)
    systems = {'beam': None,
               f'mbr-sample{args.samples}': mbr.MBR(args.samples, 'sample', args.utility)}
    if not args.skip_nbest:
        systems[f'mbr-nbest{config.beam_size}'] = mbr.MBR(config.beam_size, 'nbest',
                                                          args.utility)
    records = {}
    for name, choice in systems.items():
        for _ in range(2 if args.warm else 1):
            (record,) = evaluation.run(config, run, step=args.step, split='test', mbr=choice,
                                       progress=False).values()
        records[name] = record
    hyps = {}
    for name, record in records.items():
        with open(record['hypotheses_file'], encoding='utf-8', newline='\n') as f:
            hyps[name] = f.read().split('\n')[:-1]
    with open(records['beam']['references_file'], encoding='utf-8', newline='\n') as f:
        refs = f.read().split('\n')[:-1]
    _, scores = PairedTest(list(hyps.items()), {'BLEU': BLEU(), 'chrF': CHRF()}, [refs],
                           test_type='bs', n_samples=1000)()
    bleu_key, chrf_key = (key for key in scores if key != 'System')  # sacrebleu's names
    print(f'| system ({args.sentences} sentences, step {records["beam"]["steps"]}) | BLEU '
          '(95% CI) | p vs beam | chrF (95% CI) | p vs beam | s / sentence |')
    print('|---|---|---|---|---|---|')
    for k, name in enumerate(scores['System']):
        bleu, chrf = scores[bleu_key][k], scores[chrf_key][k]
        seconds = records[name]['decode_seconds'] / records[name]['sentences']
        p = (lambda r: '' if r.p_value is None else f'{r.p_value:.4f}')
        print(f'| {name} | {bleu.score:.2f} ({bleu.mean:.2f} ± {bleu.ci:.2f}) | {p(bleu)} | '
              f'{chrf.score:.2f} ({chrf.mean:.2f} ± {chrf.ci:.2f}) | {p(chrf)} | {seconds:.3f} |')


if __name__ == '__main__':
    main()
