"""MBR decoding (t2t/eval/mbr.py): the expected-utility choice, its chrF equal to sacrebleu's,
and evaluate.py's paths (one checkpoint, an average, an ensemble, --translate) on a tiny model."""

import itertools
import json

import jax
import numpy as np
import pytest
import sacrebleu

from t2t.decode import DecodeConfig
from t2t.eval import mbr, translate
from t2t.eval import predict as predict_lib
from t2t.eval.checkpoints import EvalError
from tests.test_evaluate import _run as _run_on_all
from tests.test_evaluate import run_dir  # noqa: F401  (a fixture: a random tiny workdir)

pytestmark = pytest.mark.xdist_group(__name__)  # its module fixture once

# Four candidates of one sentence: index 2 shares the most with the others, index 1 the least.
HAND = ['the small cat sat on a mat .', 'a dog barked all night !',
        'the small cat sat on the mat .', 'the cat sat on the mat .']


def _run(run_dir, **kwargs):  # noqa: F811
    """evaluation.run on one device (the sampler's keys do not depend on devices:
    tests/test_sampling.py): fewer programs to compile."""
    return _run_on_all(run_dir, devices=jax.devices()[:1], **kwargs)


def _expected_by_hand(candidates, sentence_score):
    n = len(candidates)
    return np.array([np.mean([sentence_score(candidates[i], [candidates[j]]).score
                              for j in range(n) if j != i]) for i in range(n)])


@pytest.mark.parametrize('utility', mbr.UTILITIES)
def test_the_candidate_of_highest_expected_utility_is_chosen(utility):
    metric = (sacrebleu.metrics.CHRF() if utility == 'chrf'
              else sacrebleu.metrics.BLEU(effective_order=True))
    want = _expected_by_hand(HAND, metric.sentence_score)
    got = mbr.expected_utility(HAND, utility)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.argmax(want) == 2 and np.argmin(want) == 1 and want[2] > want[3] + 1
    assert mbr.MBR(4, utility=utility).choose([HAND, HAND[::-1], HAND[1:2]]) == [2, 1, 0]


def test_repeated_draws_weigh_as_drawn_and_ties_go_to_the_earlier():
    # 'b' drawn 3 times of 5 wins over 'a', which is more like each of the others
    draws = ['a b c d', 'x y z w', 'x y z w', 'x y z w', 'a b c e']
    assert mbr.MBR(5).choose([draws]) == [1]
    assert mbr.MBR(2).choose([['same text', 'same text'], ['one', 'two']]) == [0, 0]
    assert mbr.MBR(1).choose([['only']]) == [0]


def test_chrf_matrix_equals_sacrebleus_sentence_chrf():
    texts = ['Der Hund bellt.', 'der Hund bellte laut!', '', 'Ärger (über) «Zitate» 42',
             'Der Hund bellt.', 'x', 'Ein ganz anderer, viel längerer Satz ohne Bezug.']
    matrix = mbr.utility_matrix(texts, 'chrf')
    chrf = sacrebleu.metrics.CHRF()
    for i, j in itertools.product(range(len(texts)), repeat=2):
        assert matrix[i, j] == pytest.approx(chrf.sentence_score(texts[i], [texts[j]]).score,
                                             abs=1e-9), (i, j)


def test_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match='--mbr_samples=0 must be >= 1'):
        mbr.MBR(0)
    with pytest.raises(ValueError, match="--mbr_utility='ter'"):
        mbr.MBR(4, utility='ter')
    beam = DecodeConfig(beam_size=4)
    with pytest.raises(ValueError, match='need beam_size >= 5'):
        mbr.MBR(5, candidates='nbest').decoding(beam)
    assert mbr.MBR(3, candidates='nbest').decoding(beam).nbest == 3
    sample = mbr.MBR(6).decoding(beam)
    assert sample.decode_strategy == 'sample' and sample.num_samples == 6
    with pytest.raises(ValueError, match='num_samples=2 needs decode_strategy=sample'):
        DecodeConfig(num_samples=2)


def _hypotheses(results):
    (record,) = results.values()
    with open(record['hypotheses_file'], encoding='utf-8', newline='\n') as f:
        return record, f.read().split('\n')[:-1]


def test_one_candidate_is_beam_search_and_samples_are_chosen_by_utility(run_dir):  # noqa: F811
    config = run_dir['config']
    beam, beam_hyps = _hypotheses(_run(run_dir, step=2)[0])
    one, one_hyps = _hypotheses(_run(run_dir, step=2, mbr=mbr.MBR(1, 'nbest'))[0])
    assert one_hyps == beam_hyps and one['sacrebleu'] == beam['sacrebleu']
    assert one['decode_strategy'] == 'mbr' and one['mbr_samples'] == 1
    assert one['hypotheses_file'].endswith('-step-2-mbr-nbest1-chrf.txt')

    # Four draws per sentence, decoded here directly: MBR outputs the draw the rule picks.
    choice = mbr.MBR(4, 'sample', 'bleu')
    results, text = _run(run_dir, step=2, mbr=choice)
    record, hyps = _hypotheses(results)
    assert 'MBR (bleu) over 4 candidates from sampling: 4 draws' in text
    from t2t import data
    from t2t.eval import evaluation
    from t2t.eval.checkpoints import load_params
    from t2t.model import TransformerConfig

    tokenizer = evaluation.workdir_tokenizer(config, run_dir['workdir'])
    split = data.eval_split(config, tokenizer, config.test_split)
    decoding = choice.decoding(DecodeConfig.from_config(config))
    predict = predict_lib.make_predict_fn(TransformerConfig.from_config(config), decoding,
                                          num_valid_ids=tokenizer.vocab_size)
    params = load_params(run_dir['workdir'], [2], scan_layers=False, weights='raw')
    single = predict_lib.make_predict_fn(TransformerConfig.from_config(config),
                                         decoding.replace(num_samples=1),
                                         num_valid_ids=tokenizer.vocab_size)
    picked_other = 0
    for batch in split.batches(config.eval_batch_size):
        got = predict_lib.fetch(predict(params, batch['inputs']), len(batch['index']))
        first = np.asarray(single(params, batch['inputs']).ids_BL)
        np.testing.assert_array_equal(got.samples_BNL[:, 0], first)  # draw 0: the plain sample
        for row, i in enumerate(batch['index'].tolist()):
            if i < 0:
                continue
            draws = [tokenizer.decode(ids.tolist()) for ids in got.samples_BNL[row]]
            utilities = mbr.expected_utility(draws, 'bleu')
            assert hyps[i] == translate.one_line(draws[int(np.argmax(utilities))])
            picked_other += int(np.argmax(utilities)) != 0
    assert picked_other > 0  # not always draw 0
    assert hyps != beam_hyps  # sampled candidates are others: the equality above is no accident
    assert record['skipped_too_long'] == 1 and hyps[3] == ''  # the long example: empty, counted


def test_mbr_with_an_average_an_ensemble_and_translate(run_dir, tmp_path):  # noqa: F811
    choice = mbr.MBR(2, 'nbest', 'chrf')
    results, _ = _run(run_dir, average_last=2, mbr=choice)
    assert list(results) == ['avg2-1-2-mbr-nbest2-chrf']
    ensemble, _ = _run(run_dir, ensemble='1,2', mbr=choice)
    (label,) = ensemble
    assert label.endswith('-mbr-nbest2-chrf') and ensemble[label]['ensemble_mean'] == 'log_prob'
    scores = json.loads(open(run_dir['workdir'] + '/eval-test.json').read())
    assert {'avg2-1-2-mbr-nbest2-chrf', label} <= set(scores)

    src = tmp_path / 'in.txt'
    src.write_text('a b c\n\nd e f g\n', encoding='utf-8')
    out = tmp_path / 'out.txt'
    _run(run_dir, step=2, translate=True, input_path=str(src), output_path=str(out),
         mbr=mbr.MBR(1, 'nbest'))
    beam = tmp_path / 'beam.txt'
    _run(run_dir, step=2, translate=True, input_path=str(src), output_path=str(beam))
    assert out.read_text(encoding='utf-8') == beam.read_text(encoding='utf-8')
    assert out.read_text(encoding='utf-8').split('\n')[1] == ''
    with pytest.raises(EvalError, match='--nbest and --mbr_samples'):
        _run(run_dir, translate=True, nbest=2, mbr=choice)
    with pytest.raises(EvalError, match='need beam_size >= 3'):
        _run(run_dir, mbr=mbr.MBR(3, 'nbest'))
