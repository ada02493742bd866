"""t2t/eval/translate.py: streamed bulk translation keeps order, few shapes, long lines, resumes;
evaluate.py --translate --truncate_long."""

import numpy as np
import pytest

from t2t import data
from t2t.eval import evaluation, translate
from t2t.eval import predict as predict_lib
from tests.test_evaluate import _config, run_dir  # noqa: F401  (a fixture: a random tiny workdir)
from tests.test_predict import _EchoTokenizer  # text '3 4 5' <-> ids [3, 4, 5]


class _EchoPredict:
    """Copies the source (so order is checkable); records shapes; can fail at a given call."""

    def __init__(self, fail_at=None):
        self.shapes, self.fail_at = [], fail_at

    def __call__(self, params, inputs_BS):
        if self.fail_at is not None and len(self.shapes) == self.fail_at:
            raise KeyboardInterrupt('killed')
        ids_BL = np.asarray(inputs_BS)
        self.shapes.append(ids_BL.shape)
        return predict_lib.Prediction(ids_BL=ids_BL, hit_limit_B=np.zeros(len(ids_BL), bool),
                                      capped_B=np.zeros(len(ids_BL), bool))


def _lines(n, seed=0):
    rng = np.random.default_rng(seed)
    out = [' '.join(str(w) for w in rng.integers(3, 40, k)) for k in rng.integers(1, 40, n)]
    out[3] = ''  # a blank line
    return out


def _run(tmp_path, texts, predict, **kwargs):
    src, out = tmp_path / 'in.txt', tmp_path / 'out.txt'
    if not src.exists():
        src.write_text(''.join(t + '\n' for t in texts), encoding='utf-8')
    settings = dict(max_len=32, token_budget=128, window=50, progress=False)
    stats = translate.translate_stream(predict, None, _EchoTokenizer(), str(src), str(out),
                                       **{**settings, **kwargs})
    return stats, out.read_text(encoding='utf-8').split('\n')[:-1]


def test_output_in_input_order_with_few_shapes_and_long_lines_counted(tmp_path):
    texts = _lines(230)
    predict = _EchoPredict()
    stats, got = _run(tmp_path, texts, predict)
    too_long = [i for i, t in enumerate(texts) if len(t.split()) + 1 > 32]
    assert too_long and stats.too_long == len(too_long)
    want = ['' if i in too_long else t for i, t in enumerate(texts)]
    assert got == want and stats.lines == 230 and stats.translated == 229 - len(too_long)
    # Buckets 8, 16, 32 with 128 // length rows, a window's last batch of a bucket halved up to
    # 3 times: at most 4 shapes per bucket however many windows and batches.
    full = {8: 16, 16: 8, 32: 4}
    assert {s for s in predict.shapes if s[0] == full[s[1]]} == {(16, 8), (8, 16), (4, 32)}
    assert all(rows in {full[length] >> k for k in range(4)} for rows, length in predict.shapes)
    assert len(predict.shapes) > 10 and len(set(predict.shapes)) < len(predict.shapes)


def test_last_batch_shrinks_and_pads_with_empty_rows():
    ids = [[3 + i] * (i + 2) + [1] for i in range(5)]  # 5 sentences, all of bucket 8
    (batch,) = translate.window_batches(ids, max_len=32, token_budget=128)
    assert batch['inputs'].shape == (8, 8)  # 16 rows halved once: 5 fit in 8
    assert batch['index'].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    # Padding is empty: the search decodes nothing for it (tests/test_predict.py).
    assert (batch['inputs'][5:] == 0).all()
    assert translate.tail_rows(5, 16, 4) == 8 and translate.tail_rows(3, 16, 4) == 4
    assert translate.tail_rows(1, 64, 1) == 8  # at most 3 halvings
    assert translate.tail_rows(2, 16, 8) == 8 and translate.tail_rows(9, 16, 1) == 16


def test_truncate_long_cuts_to_max_len(tmp_path):
    texts = ['5 ' * 40, '6 7']
    _, got = _run(tmp_path, texts, _EchoPredict(), truncate_long=True)
    assert got == [' '.join(['5'] * 31), '6 7']


def test_killed_run_resumes_where_it_stopped(tmp_path):
    texts = _lines(230, seed=1)
    ref = tmp_path / 'ref'
    ref.mkdir()
    _, full = _run(ref, texts, _EchoPredict())
    first = _EchoPredict(fail_at=25)  # dies inside a later window
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, texts, first)
    done = (tmp_path / 'out.txt').read_text(encoding='utf-8').count('\n')
    assert 0 < done < 230 and done % 50 == 0  # whole windows only
    second = _EchoPredict()
    stats, got = _run(tmp_path, texts, second)
    assert got == full and stats.resumed_from == done
    # Only the lines after the finished windows were decoded again.
    assert stats.lines == 230 and stats.translated == sum(
        0 < len(t.split()) < 32 for t in texts[done:])


def test_progress_file_of_another_input_is_an_error(tmp_path):
    texts = _lines(20)
    _run(tmp_path, texts, _EchoPredict())
    other = tmp_path / 'other.txt'
    other.write_text('3 4\n', encoding='utf-8')
    with pytest.raises(ValueError, match='not of .*other.txt: remove it'):
        translate.translate_stream(_EchoPredict(), None, _EchoTokenizer(), str(other),
                                   str(tmp_path / 'out.txt'), max_len=32, progress=False)


def test_evaluate_translate_truncate_long_translates_the_cut_line(run_dir, tmp_path,  # noqa: F811
                                                                   caplog):
    # evaluation.run as evaluate.py --translate [--truncate_long] calls it, on a random model
    # whose position table is 32 rows: line 1 (44 tokens) is over the limit, line 2 is its first
    # 31 tokens as text, so the cut line must translate exactly as line 2 does.
    config = _config(run_dir['root'], max_position=32)
    tokenizer = data.get_tokenizer(config)
    long_line = ' '.join(['red house near the old tree .'] * 6)
    ids = tokenizer.encode(long_line)
    assert len(ids) + 1 > 32
    cut = tokenizer.decode(ids[:31])
    assert tokenizer.encode(cut) == ids[:31]
    source = tmp_path / 'in.txt'
    source.write_text(f'two cats .\n{long_line}\n{cut}\n', encoding='utf-8')
    outputs = {}
    for truncate_long in (False, True):
        target = tmp_path / f'out-{truncate_long}.txt'
        caplog.clear()
        evaluation.run(config, run_dir['workdir'], step=1, translate=True,
                       input_path=str(source), output_path=str(target),
                       truncate_long=truncate_long, progress=False, echo=lambda _: None)
        outputs[truncate_long] = target.read_text(encoding='utf-8').split('\n')[:-1]
        word = 'truncated' if truncate_long else 'left empty'
        assert f'1 lines are longer than max_position=32 tokens: {word}' in caplog.text
    kept, cut_out = outputs[False], outputs[True]
    assert kept[1] == '' and kept[0] and kept[2]
    assert cut_out[1] == cut_out[2] == kept[2] and cut_out[0] == kept[0]


def test_a_stray_carriage_return_keeps_every_output_line_on_its_input(tmp_path):
    # Line 2 holds a lone '\r' and line 4 ends in '\r\n': read with universal newlines they would
    # be 2 lines each (7 outputs for 5 inputs, every later one shifted).
    src, out = tmp_path / 'in.txt', tmp_path / 'out.txt'
    src.write_bytes(b'3 4\n5\r6 7\n8 9\n10 11\r\n12\n')
    stats = translate.translate_stream(_EchoPredict(), None, _EchoTokenizer(), str(src),
                                       str(out), max_len=32, token_budget=128, window=2,
                                       progress=False)
    assert translate.count_lines(str(src)) == 5 and stats.lines == 5
    assert out.read_bytes().split(b'\n') == [b'3 4', b'5 6 7', b'8 9', b'10 11', b'12', b'']
    # A hypothesis never splits its output line either.
    assert translate.one_line('a\rb\nc') == 'a b c' and translate.one_line(None) == ''
