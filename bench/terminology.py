"""Terminology constraints on a trained model: term accuracy and BLEU without and with them.

    python bench/terminology.py --config=configs/default.py --workdir=workdirs/demo \\
        --out_dir=workdirs/terminology [--step=N]

1. A terminology TSV from the test split (written to --out_dir/terms.tsv): the German nouns of
   its references (a capitalized word of letters only, at least 4 of them, not first in its
   sentence), each paired with the English source word of the same pair that goes with it most
   often in the training split (Dice coefficient of the pairs holding each, at least
   MIN_DICE, at least MIN_PAIRS pairs holding both); one target per source term, the most
   associated.
2. evaluate.py's code (t2t/eval/evaluation.py) on the test split twice, beam search as the config
   says: without constraints, then with --terminology=terms.tsv.
3. For both: term accuracy (t2t/eval/terms.py: the target term in the hypothesis, over every
   (line, term) pair whose line holds the source term), sacreBLEU and chrF of the whole split,
   decoding seconds per sentence: of the last of --runs runs (the first includes its compiles;
   --runs=2 times a warm second run).
The checkpoint is read from --workdir; everything written (hypotheses, scores) goes to --out_dir,
whose checkpoints/ and vocab.model link to the workdir's, which is never written. Each decoding
keeps its own hypotheses (hypotheses-test-step-N.txt, ...-step-N-terminology.txt), named in its
RESULT line, for sacrebleu's paired bootstrap against references-test.txt.
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'A trained workdir (read only).')
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint (default: the latest).')
_OUT_DIR = flags.DEFINE_string('out_dir', '/tmp/t2t-terminology', 'Terms, hypotheses, scores.')
_RUNS = flags.DEFINE_integer('runs', 1, 'Decodes of each setting; the last one is timed.')

MIN_DICE = 0.3
MIN_PAIRS = 3
NOUN = re.compile(r'^[A-ZÄÖÜ][a-zäöüß]{3,}$')
WORD = re.compile(r"[\w']+")


def nouns(reference: str) -> list[str]:
    """Capitalized words of a German sentence, not the first (capitalized anyway)."""
    words = WORD.findall(reference)
    return [w for w in words[1:] if NOUN.match(w)]


def source_words(source: str) -> set[str]:
    return {w for w in WORD.findall(source) if len(w) >= 3 and w.isalpha()}


def build_terms(train: tuple[list[str], list[str]], test: tuple[list[str], list[str]]):
    """[(source term, target term)] from the test references' nouns (module docstring)."""
    en_count, de_count, both = collections.Counter(), collections.Counter(), collections.Counter()
    wanted = {g for ref in test[1] for g in nouns(ref)}
    for src, ref in zip(*train, strict=True):
        ens, des = source_words(src), {g for g in WORD.findall(ref) if g in wanted}
        en_count.update(ens)
        de_count.update(des)
        both.update((e, g) for e in ens for g in des)
    best: dict[str, tuple[float, str]] = {}
    for src, ref in zip(*test, strict=True):
        for g in nouns(ref):
            scored = [(2 * both[e, g] / (en_count[e] + de_count[g]), e) for e in source_words(src)
                      if both[e, g] >= MIN_PAIRS]
            if not scored:
                continue
            dice, e = max(scored)
            if dice >= MIN_DICE and dice > best.get(e, (0.0, ''))[0]:
                best[e] = (dice, g)
    return sorted((e, g) for e, (_, g) in best.items())


def _link_workdir(workdir: str, out_dir: str) -> None:
    """out_dir reads the workdir's checkpoints and vocabulary through links."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ('checkpoints', 'vocab.model'):
        link = os.path.join(out_dir, name)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(workdir, name)), link)


def main(argv):
    del argv
    from t2t.data import pipeline
    from t2t.eval import evaluation, terms

    config = _CONFIG.value
    out_dir = _OUT_DIR.value
    _link_workdir(_WORKDIR.value, out_dir)
    test = pipeline.split_texts(config, config.test_split)
    pairs = build_terms(pipeline.split_texts(config, config.train_split), test)
    tsv = os.path.join(out_dir, 'terms.tsv')
    with open(tsv, 'w', encoding='utf-8') as f:
        f.writelines(f'{e}\t{g}\n' for e, g in pairs)
    phrases = terms.match_terms(pairs, test[0])
    print(f'{len(pairs)} terms -> {tsv}; {sum(map(len, phrases))} (line, term) pairs on '
          f'{sum(map(bool, phrases))} of {len(test[0])} test lines')

    rows = {}
    for name, extra in (('beam', {}), ('beam + terminology', {'terminology': tsv})):
        for _ in range(_RUNS.value):
            (label, record), = evaluation.run(config, out_dir, step=_STEP.value, progress=False,
                                              echo=lambda _: None, **extra).items()
        with open(record['hypotheses_file'], encoding='utf-8') as f:
            hypotheses = f.read().splitlines()
        if len(hypotheses) != len(phrases):  # the split as evaluate.py read it: line for line
            raise SystemExit(f'{len(hypotheses)} hypotheses for {len(phrases)} test lines')
        present, total = terms.term_accuracy(hypotheses, phrases)
        rows[name] = dict(checkpoint=label, term_accuracy=round(100 * present / total, 2),
                          terms_present=present, term_pairs=total,
                          sacrebleu=round(record['sacrebleu'], 2), chrf=round(record['chrf'], 2),
                          ms_per_sentence=round(1000 * record['decode_seconds']
                                                / record['sentences'], 1),
                          compiles_included=_RUNS.value == 1,
                          hit_length_limit=record['hit_length_limit'],
                          lacking_a_term=record.get('constraints', {}).get(
                              'hypotheses_lacking_a_phrase_token_level'),
                          hypotheses_file=record['hypotheses_file'])
        print('RESULT ' + json.dumps({'decoding': name, **rows[name]}))
    timed = 'with compiles' if _RUNS.value == 1 else 'warm'
    print(f'| decoding | term accuracy | sacreBLEU | chrF | ms / sentence ({timed}) |')
    print('|---|---|---|---|---|')
    for name, r in rows.items():
        print(f'| {name} | {r["term_accuracy"]:.2f}% ({r["terms_present"]}/{r["term_pairs"]}) '
              f'| {r["sacrebleu"]:.2f} | {r["chrf"]:.2f} | {r["ms_per_sentence"]:.1f} |')


if __name__ == '__main__':
    flags.mark_flag_as_required('workdir')
    app.run(main)
