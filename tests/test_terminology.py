"""Constrained decoding of the suite's trained model (tests/trained_tiny.py): every phrase in
every output, and evaluate.py's --terminology / --constraints from the files to the report."""

import json
import os
import random

import numpy as np
import pytest
from ml_collections import ConfigDict

from configs import tiny
from t2t.decode import DecodeConfig
from t2t.eval import constraints, evaluation, terms
from t2t.eval import predict as predict_lib
from t2t.eval.checkpoints import EvalError
from tests import toy_corpus
from tests.helpers import run_script
from tests.trained_tiny import GROUP, TRAIN_STEPS

pytestmark = pytest.mark.xdist_group(GROUP)

DECODING = DecodeConfig(beam_size=4, length_penalty_alpha=0.6, max_decode_len=48,
                        max_decode_extra=16)
ABSENT = ('HOUSE', 'RIVER', 'STONE', 'BIRD', 'TREE', 'GREEN')  # inserted where not translated


def _phrases(source: str, rng: random.Random) -> list[str]:
    """Two target phrases: two adjacent words of the translation, and a word it lacks."""
    words = toy_corpus.translate(source).split()[1:]  # without the final '.'
    start = rng.randrange(max(len(words) - 1, 1))
    inside = ' '.join(words[start:start + 2])
    outside = rng.choice([w for w in ABSENT if w not in words])
    return [inside, outside]


def test_every_phrase_appears_in_every_output_of_the_trained_model(trained_tiny):
    m, n = trained_tiny, 64
    tokenizer, x = m['tokenizer'], m['x'][:n]
    rng = random.Random(5)
    phrases = [_phrases(s, rng) for s in m['sources'][:n]]
    ids = [[tokenizer.encode(p) for p in line] for line in phrases]
    batch = next(terms.with_constraints([{'index': np.arange(n)}], ids, terms.shape(ids)))
    predict = predict_lib.make_predict_fn(m['cfg'], DECODING, num_valid_ids=tokenizer.vocab_size)
    free = predict(m['params'], x)
    forced = predict(m['params'], x, constraints.Constraints(batch['constraints']))

    texts = [tokenizer.decode(row.tolist()) for row in np.asarray(forced.ids_BL)]
    assert np.all(np.asarray(forced.constraints_met_B)), np.asarray(forced.constraints_met_B)
    for text, line in zip(texts, phrases, strict=True):
        assert all(p in text for p in line), (text, line)
    assert not np.any(np.asarray(forced.hit_limit_B))  # each ended in EOS, holding its phrases
    met = np.asarray(constraints.contains_all(forced.ids_BL, batch['constraints']))
    assert met.all()
    # The model alone rarely writes the absent word: the constraints did the work.
    free_texts = [tokenizer.decode(row.tolist()) for row in np.asarray(free.ids_BL)]
    assert sum(line[1] in t for t, line in zip(free_texts, phrases, strict=True)) < n // 4
    assert free.constraints_met_B is None
    # The phrase from the translation costs little: most outputs are otherwise the reference.
    references = [toy_corpus.translate(s) for s in m['sources'][:n]]
    assert sum(r.split()[0] in t for r, t in zip(references, texts, strict=True)) > n // 2


def _flags(config) -> list[str]:
    """evaluate.py's --config.key=value for every key where config differs from configs/tiny.py."""
    base, out = tiny.get_config(), []
    for key, value in config.items():
        if isinstance(value, ConfigDict):
            out += [f'--config.{key}.{k}={v}' for k, v in value.items() if v != base[key][k]]
        elif value != base[key] and not isinstance(value, tuple):
            out.append(f'--config.{key}={value}')
    return out


def test_terminology_through_evaluate_py(trained_tiny, tmp_path):
    # 'dog' -> 'HOUND' is a term the model never learned (its word is DOG); 'red' -> 'RED' is
    # what it writes anyway; 'nowhere' matches no line.
    m = trained_tiny
    tsv = tmp_path / 'terms.tsv'
    tsv.write_text('dog\tHOUND\nred\tRED\n\nnowhere\tNIRGENDS\n', encoding='utf-8')
    workdir = m['workdir']
    scores = f'{workdir}/eval-test.json'
    before = json.load(open(scores, encoding='utf-8')) if os.path.exists(scores) else {}
    proc = run_script('evaluate.py', '--config=configs/tiny.py', f'--workdir={workdir}',
                      f'--terminology={tsv}', '--config.beam_size=3', *_flags(m['config']),
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(scores, encoding='utf-8') as f:
        after = json.load(f)
    record = after[f'step-{TRAIN_STEPS}-terminology']  # kept apart from a plain evaluation's
    assert record['hypotheses_file'].endswith(f'hypotheses-test-step-{TRAIN_STEPS}-terminology.txt')
    assert {k: after[k] for k in before} == before  # nothing evaluated before was overwritten
    with open(record['hypotheses_file'], encoding='utf-8') as f:
        hypotheses = f.read().splitlines()
    sources = [line.split('\t')[0] for line in open(m['corpus']['test'], encoding='utf-8')]
    wanted = terms.match_terms(terms.read_terminology(str(tsv)), sources)
    pairs = sum(map(len, wanted))
    assert sum('HOUND' in line for line in wanted) >= 2 and pairs >= 5, wanted  # a real test
    for hypothesis, line in zip(hypotheses, wanted, strict=True):
        assert all(term in hypothesis for term in line), (hypothesis, line)
    c = record['constraints']
    assert c == {'source': f'--terminology {tsv}', 'lines_with_phrases': sum(map(bool, wanted)),
                 'phrases': pairs, 'phrases_in_hypotheses': pairs, 'term_accuracy': 100.0,
                 'hypotheses_lacking_a_phrase_token_level': 0}, c
    assert f'{pairs} of {pairs} phrases' in proc.stdout and 'term accuracy 100.00%' in proc.stdout


def test_translate_a_file_with_a_constraints_file(trained_tiny, tmp_path):
    # --translate --constraints in-process: lines without phrases, a blank line, a phrase the
    # model would not write; the output keeps the input's lines, each with its phrases.
    m = trained_tiny
    sources = ['red dog sees the cat .', '', 'one small tree .', 'the bird finds a stone .']
    wanted = [['HOUND', 'SEES'], [], [], ['GREEN STONE']]
    src, out, jsonl = tmp_path / 'in.txt', tmp_path / 'out.txt', tmp_path / 'c.jsonl'
    src.write_text(''.join(f'{s}\n' for s in sources), encoding='utf-8')
    jsonl.write_text(''.join(json.dumps(w) + '\n' for w in wanted), encoding='utf-8')
    evaluation.run(m['config'], m['workdir'], translate=True, input_path=str(src),
                   output_path=str(out), constraints=str(jsonl), progress=False,
                   echo=lambda _: None)
    outputs = out.read_text(encoding='utf-8').split('\n')[:-1]
    assert len(outputs) == len(sources) and outputs[1] == ''
    for output, phrases in zip(outputs, wanted, strict=True):
        assert all(p in output for p in phrases), (output, phrases)
    assert outputs[2] == toy_corpus.translate(sources[2])  # unconstrained: the model's own


def test_bad_or_over_long_constraints_are_one_line_errors_before_decoding(trained_tiny, tmp_path):
    m = trained_tiny
    config = m['config']
    n = len(open(m['corpus']['test'], encoding='utf-8').read().splitlines())

    def run(**files):
        with pytest.raises(EvalError) as e:
            evaluation.run(config, m['workdir'], progress=False, echo=lambda _: None, **files)
        assert '\n' not in str(e.value)
        return str(e.value)

    lines = tmp_path / 'c.jsonl'
    lines.write_text('[]\n' * (n - 1), encoding='utf-8')
    assert f'has {n - 1} lines, the source has {n}' in run(constraints=str(lines))
    lines.write_text('[]\n' * 2 + '["A", 3]\n' + '[]\n' * (n - 3), encoding='utf-8')
    assert 'line 3: expected a JSON list of strings' in run(constraints=str(lines))
    # Line 4's phrase: more tokens than its source + max_decode_extra allow.
    long = ' '.join(['STONE'] * (config.max_decode_extra + 20))
    lines.write_text('[]\n' * 3 + json.dumps([long]) + '\n' + '[]\n' * (n - 4), encoding='utf-8')
    message = run(constraints=str(lines))
    assert message.startswith(f'--constraints {lines} line 4: its ') and 'need' in message
    tsv = tmp_path / 'bad.tsv'
    tsv.write_text('dog\tHOUND\nonly one field\n', encoding='utf-8')
    assert f'--terminology {tsv} line 2: expected' in run(terminology=str(tsv))
    assert 'not both' in run(terminology=str(tsv), constraints=str(lines))
    config = config.copy_and_resolve_references()
    config.decode_strategy = 'greedy'
    with pytest.raises(EvalError, match='need decode_strategy=beam'):
        evaluation.run(config, m['workdir'], progress=False, echo=lambda _: None,
                       terminology=str(tsv))


class _NoSnowman:
    """A vocabulary without byte fallback: a snowman is sentencepiece's unknown piece (2)."""

    def encode(self, text):
        return [2 if c == '\u2603' else 3 + ord(c) % 50 for c in text.replace(' ', '')]


def test_a_term_the_vocabulary_cannot_write_is_a_one_line_error(tmp_path):
    tsv = tmp_path / 'terms.tsv'
    tsv.write_text('dog\tHOUND\ncat\tKATZE \u2603\n', encoding='utf-8')
    config = ConfigDict({'decode_strategy': 'beam', 'max_decode_len': 64, 'max_decode_extra': 10})
    with pytest.raises(EvalError, match=r"target term 'KATZE \u2603' \(of 'cat'\) has characters "
                       'the vocabulary cannot write'):
        terms.load(config, _NoSnowman(), terminology_path=str(tsv), num_lines=0)
    lines = tmp_path / 'c.jsonl'
    lines.write_text('["HUND"]\n["\u2603"]\n', encoding='utf-8')
    loaded = terms.load(config, _NoSnowman(), constraints_path=str(lines), num_lines=2)
    with pytest.raises(EvalError, match=f'--constraints {lines} line 2: phrase'):
        terms.lines(loaded, 0, ['a', 'b'], [[5, 1], [6, 1]])


def test_terms_match_whole_words_and_shapes_round_up():
    found = terms.match_terms([('cat', 'KATZE'), ('red cat', 'ROTE KATZE'), ('at', 'BEI')],
                              ['the red cat .', 'a category', 'cat at home', 'red  cat'])
    assert found == [['KATZE', 'ROTE KATZE'], [], ['KATZE', 'BEI'], ['KATZE']]
    assert terms.shape([[[5, 6, 7]], [], [[1], [2], [3]]]) == (4, 4)
    assert terms.shape([[]]) == (1, 2)
    assert terms.term_accuracy(['ROTE KATZE', 'x'], [['KATZE', 'HUND'], ['x']]) == (2, 3)
