"""BLEU / chrF scores: identities, the paper's compound split, agreement with sacrebleu."""

import math
from collections import Counter

import pytest
import sacrebleu

from t2t.eval import bleu

HYPS = [
    'Die Katze sitzt auf der Matte.',
    'Der Hals-Nasen-Ohren-Arzt hat heute keine Zeit.',
    'Es ist ein schöner Tag, z.B. für einen Spaziergang.',
]
REFS = [
    'Die Katze saß auf der Matte.',
    'Der Hals-Nasen-Ohren-Arzt hat morgen keine Zeit.',
    'Es ist ein schöner Tag, etwa für einen langen Spaziergang.',
]


def multi_bleu(hyps_tok, refs_tok):
    """multi-bleu.perl arithmetic on whitespace tokens (one reference, no smoothing)."""
    correct, total = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps_tok, refs_tok, strict=True):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_ngrams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_ngrams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            correct[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
            total[n - 1] += max(0, len(h) - n + 1)
    if min(correct) == 0:
        return 0.0
    bp = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    log_precision = sum(math.log(c / t) for c, t in zip(correct, total, strict=True)) / 4
    return 100 * bp * math.exp(log_precision)


def test_identical_output_scores_100():
    scores = bleu.score_all(REFS, REFS)
    assert scores['sacrebleu'] == pytest.approx(100.0)
    assert scores['chrf'] == pytest.approx(100.0)
    assert scores['tok_bleu_compound_split'] == pytest.approx(100.0)


@pytest.mark.parametrize(
    ('text', 'expected'),
    [
        (
            'Hals-Nasen-Ohren-Arzt',
            'Hals ##AT##-##AT## Nasen ##AT##-##AT## Ohren ##AT##-##AT## Arzt',
        ),
        ('rich-text format', 'rich ##AT##-##AT## text format'),
        ('a - b', 'a - b'),  # a free-standing dash is not a compound
        ('-fach und 3-', '-fach und 3-'),  # nothing on one side
        ('a-b-c', 'a ##AT##-##AT## b-c'),  # non-overlapping matches, as in perl s///g
    ],
)
def test_split_compounds_like_get_ende_bleu(text, expected):
    assert bleu.split_compounds(text) == expected


def test_moses_tokenization_keeps_german_abbreviations():
    tokens = bleu.moses_tokenize('Das kostet z.B. 3,5 Mio. Euro.')
    assert tokens == 'Das kostet z.B. 3,5 Mio. Euro .'


def test_sacrebleu_and_chrf_match_sacrebleu_directly():
    scores = bleu.score_all(HYPS, REFS)
    expected_bleu = sacrebleu.corpus_bleu(HYPS, [REFS])
    expected_chrf = sacrebleu.corpus_chrf(HYPS, [REFS])
    assert scores['sacrebleu'] == pytest.approx(expected_bleu.score)
    assert scores['chrf'] == pytest.approx(expected_chrf.score)
    assert 0 < scores['sacrebleu'] < 100
    assert 'tok:13a' in scores['sacrebleu_signature']
    assert 'case:mixed' in scores['sacrebleu_signature']
    assert 'nc:6' in scores['chrf_signature']


def test_tokenized_bleu_is_multi_bleu_on_split_moses_tokens():
    # Hand-tokenized the way tokenizer.perl -l de and the ##AT## split leave these lines.
    hyps_tok = [
        'Die Katze sitzt auf der Matte .',
        'Der Hals ##AT##-##AT## Nasen ##AT##-##AT## Ohren ##AT##-##AT## Arzt hat heute keine '
        'Zeit .',
        'Es ist ein schöner Tag , z.B. für einen Spaziergang .',
    ]
    refs_tok = [
        'Die Katze saß auf der Matte .',
        'Der Hals ##AT##-##AT## Nasen ##AT##-##AT## Ohren ##AT##-##AT## Arzt hat morgen keine '
        'Zeit .',
        'Es ist ein schöner Tag , etwa für einen langen Spaziergang .',
    ]
    assert [bleu.split_compounds(bleu.moses_tokenize(h)) for h in HYPS] == hyps_tok
    assert [bleu.split_compounds(bleu.moses_tokenize(r)) for r in REFS] == refs_tok
    score, _ = bleu.tokenized_bleu_compound_split(HYPS, REFS)
    assert score == pytest.approx(multi_bleu(hyps_tok, refs_tok))
    # Compound parts count as words, so the matching compound lifts it above sacreBLEU here.
    assert score > bleu.score_all(HYPS, REFS)['sacrebleu']


def test_count_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match='3 hypotheses but 2 references'):
        bleu.score_all(HYPS, REFS[:2])


def test_format_report_labels_every_number():
    report = bleu.format_report(bleu.score_all(HYPS, REFS))
    lines = report.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith('sacreBLEU ') and '(nrefs:1|case:mixed|' in lines[0]
    assert lines[1].startswith('chrF ') and 'nc:6' in lines[1]
    assert lines[2].startswith('tokenized BLEU, compound split (paper) ')
    assert 'tokenizer.perl -l de' in lines[2] and 'tok:none|smooth:none' in lines[2]
