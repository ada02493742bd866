"""BLEU and chrF of detokenized hypotheses, each number labelled with how it was computed.

Papers mix incomparable BLEU numbers, so every score here says what it is:

  sacreBLEU   corpus BLEU on detokenized text, tokenize='13a', cased, exponential smoothing;
              the comparable number, reported with sacrebleu's signature string.
  chrF        sacrebleu CHRF (character 6-grams, beta 2), with its signature.
  tokenized BLEU with compound splitting: the number of Vaswani et al. 2017 (EN-DE 27.3 / 28.4),
              computed the tensor2tensor `get_ende_bleu.sh` way:
                1. tokenizer.perl -l de on hypotheses and references; here sacremoses, the Python
                   port of that script (same non-breaking prefixes, no aggressive dash split,
                   XML escaping on). sacrebleu's '13a' / 'intl' tokenizers are not used: they
                   split the periods of German abbreviations and ordinals ('z.B.', 'Mio.',
                   '3. Mai') that tokenizer.perl keeps, which changes the token counts.
                2. perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g' (split_compounds): each hyphen
                   between non-space characters becomes its own ##AT##-##AT## token, so a
                   compound counts as several words.
                3. multi-bleu.perl: cased BLEU on whitespace tokens with no smoothing; here
                   sacrebleu with tokenize='none', smooth_method='none', which does the same
                   arithmetic (single reference, brevity penalty exp(1 - r / c), 0 when any
                   n-gram precision is 0).
              It runs higher than sacreBLEU (the paper's 28.4 is about 27.7 in sacreBLEU).
"""

import functools
import importlib.metadata
import re

import sacrebleu
from sacremoses import MosesTokenizer

# The perl one-liner works on bytes, where \s is ASCII whitespace only; re.ASCII matches that.
_COMPOUND_RE = re.compile(r'(\S)-(\S)', re.ASCII)


def _check_pairs(hypotheses, references):
    for name, texts in (('hypotheses', hypotheses), ('references', references)):
        if isinstance(texts, str):
            raise TypeError(f'{name} must be a list of strings, one per segment, not a str')
    if len(hypotheses) != len(references):
        raise ValueError(
            f'got {len(hypotheses)} hypotheses but {len(references)} references; '
            'they must pair one to one'
        )
    if not hypotheses:
        raise ValueError('got 0 hypotheses and 0 references; nothing to score')


def sacrebleu_score(hypotheses, references):
    """Corpus sacreBLEU (tokenize '13a', cased, one reference each) -> (score, signature)."""
    _check_pairs(hypotheses, references)
    metric = sacrebleu.BLEU(tokenize='13a', lowercase=False)
    score = metric.corpus_score(list(hypotheses), [list(references)]).score
    return float(score), str(metric.get_signature())


def chrf_score(hypotheses, references):
    """Corpus chrF (sacrebleu defaults: char 6-grams, beta 2) -> (score, signature)."""
    _check_pairs(hypotheses, references)
    metric = sacrebleu.CHRF()
    score = metric.corpus_score(list(hypotheses), [list(references)]).score
    return float(score), str(metric.get_signature())


@functools.cache
def _moses_tokenizer(lang):
    return MosesTokenizer(lang=lang)


def moses_tokenize(text, lang='de'):
    """tokenizer.perl -l lang with its defaults (escaping on, no aggressive dash split)."""
    return _moses_tokenizer(lang).tokenize(text, escape=True, return_str=True)


def split_compounds(text):
    """get_ende_bleu.sh compound split: 'A-B' -> 'A ##AT##-##AT## B' for non-space A, B.

    Matches do not overlap, exactly like the perl one-liner: 'a-b-c' -> 'a ##AT##-##AT## b-c'
    (the 'b' is consumed by the first match); parts of two or more characters split fully.
    """
    return _COMPOUND_RE.sub(r'\1 ##AT##-##AT## \2', text)


def tokenized_bleu_compound_split(hypotheses, references, lang='de'):
    """The paper's BLEU: Moses-tokenize both sides, split compounds, multi-bleu (no smoothing).

    Returns (score, signature); the signature names the tokenizer, the split and the BLEU.
    """
    _check_pairs(hypotheses, references)

    def prepare(text):
        return split_compounds(moses_tokenize(text, lang))

    hyps = [prepare(h) for h in hypotheses]
    refs = [prepare(r) for r in references]
    metric = sacrebleu.BLEU(tokenize='none', smooth_method='none', force=True)
    score = metric.corpus_score(hyps, [refs]).score
    signature = (
        f'tokenizer.perl -l {lang} (sacremoses {importlib.metadata.version("sacremoses")})'
        f'|compound-split ##AT##|multi-bleu ({metric.get_signature()})'
    )
    return float(score), signature


def score_all(hypotheses, references, *, lang='de'):
    """All scores of detokenized hypotheses against one reference each.

    Args:
      hypotheses, references: lists of str, one segment each, paired by index.
      lang: target language for the Moses tokenizer of the tokenized BLEU ('de' for EN-DE,
        'fr' for EN-FR).

    Returns:
      {'sacrebleu', 'sacrebleu_signature', 'chrf', 'chrf_signature', 'tok_bleu_compound_split',
       'tok_bleu_signature'}; scores are floats in [0, 100].

    Raises:
      ValueError: when the counts differ (naming both) or both are empty.
    """
    _check_pairs(hypotheses, references)
    bleu, bleu_sig = sacrebleu_score(hypotheses, references)
    chrf, chrf_sig = chrf_score(hypotheses, references)
    tok_bleu, tok_bleu_sig = tokenized_bleu_compound_split(hypotheses, references, lang)
    return {
        'sacrebleu': bleu,
        'sacrebleu_signature': bleu_sig,
        'chrf': chrf,
        'chrf_signature': chrf_sig,
        'tok_bleu_compound_split': tok_bleu,
        'tok_bleu_signature': tok_bleu_sig,
    }


_REPORT_LINES = (
    ('sacrebleu', 'sacreBLEU', 'sacrebleu_signature'),
    ('chrf', 'chrF', 'chrf_signature'),
    ('tok_bleu_compound_split', 'tokenized BLEU, compound split (paper)', 'tok_bleu_signature'),
)


def format_report(scores):
    """One labelled line per score present in `scores` (as returned by score_all)."""
    lines = []
    for key, label, sig_key in _REPORT_LINES:
        if key in scores:
            sig = f' ({scores[sig_key]})' if scores.get(sig_key) else ''
            lines.append(f'{label} {scores[key]:.2f}{sig}')
    return '\n'.join(lines)
