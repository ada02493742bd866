"""Sequence-level distillation end to end (t2t/train/distill.py, scripts/distill.py): an ensemble
teacher translates the toy corpus's training sources, a smaller student trains on them with the
teacher's vocabulary; a second run resumes every stage without redoing it."""

import json
import os

import jax
import pytest

from t2t import data
from t2t.data import identity, sources
from t2t.eval import evaluation
from t2t.infra import metrics
from t2t.run import checkpoint_read
from t2t.train import distill
from tests.helpers import run_script
from tests.test_evaluate import _config, run_dir  # noqa: F401  (a fixture: a random tiny workdir)

pytestmark = pytest.mark.xdist_group(__name__)

STUDENT = dict(num_train_steps=3, log_every_steps=3, eval_every_steps=3, checkpoint_every_steps=3,
               eval_bleu_sentences=4, num_eval_batches=1, d_model=16, d_ff=32, num_heads=2,
               num_encoder_layers=1, num_decoder_layers=1, mesh_shape=(1, 1, 1),
               dataset='embedded', vocab_size=1000)


def test_an_ensemble_teacher_distills_into_a_smaller_student(run_dir, tmp_path):  # noqa: F811
    teacher = run_dir['config']
    student = _config(run_dir['root'], **STUDENT)
    workdir = tmp_path / 'student'
    devices = jax.devices()[:1]
    lines = []
    result = distill.run(teacher, run_dir['workdir'], student, str(workdir), ensemble='1,2',
                         devices=devices, echo=lines.append)
    assert result.step == 3
    directory = workdir / distill.DIRNAME
    pairs = sources.open_split(teacher, 'train')
    train_sources = [s for s, _ in pairs.read(0, len(pairs))]
    assert (directory / 'train.src').read_text(encoding='utf-8').splitlines() == train_sources

    # The teacher's translations are evaluate.py --translate --ensemble's, line for line.
    want = tmp_path / 'want.txt'
    evaluation.run(teacher, run_dir['workdir'], translate=True, ensemble='1,2', progress=False,
                   input_path=str(directory / 'train.src'), output_path=str(want),
                   devices=devices, echo=lambda _: None)
    got = (directory / 'train.teacher').read_bytes()
    assert got == want.read_bytes() and got.count(b'\n') == len(train_sources) == 200

    # The student: its own smaller model on those pairs, the teacher's vocabulary, the
    # teacher config's test references.
    config = distill.student_config(teacher, student, str(directory), 'unused')
    assert config.dataset == 'tsv' and config.d_model == 16 and config.vocab_size == 400
    record = json.loads((directory / 'distill.json').read_text())
    assert record['sources'] == 200 and record['ensemble'] == '1,2'
    assert record['decoding'] == 'beam 2, alpha 0.6'
    teacher_vocab = evaluation.workdir_tokenizer(teacher, run_dir['workdir'])
    assert record['vocab_path'] == teacher_vocab.path
    saved = checkpoint_read.read_metadata(workdir, 3)['data_identity']
    assert saved['vocab_sha256'] == identity.vocab_digest(teacher_vocab)
    assert record['empty_translations'] == sum(not h.strip() for h in want.read_text(
        encoding='utf-8').split('\n')[:-1])
    assert record['sources_over_max_position'] == sum(
        len(teacher_vocab.encode(s)) + 1 > teacher.max_position for s in train_sources)
    refs = (directory / 'test.ref').read_text(encoding='utf-8').splitlines()
    assert refs == data.split_texts(teacher, 'test')[1]
    assert metrics.read_jsonl(workdir)[-1]['step'] == 3

    # Again: nothing is translated or trained a second time.
    stamps = {name: os.stat(directory / name).st_mtime_ns
              for name in ('train.src', 'train.teacher.progress', 'test.ref')}
    again = distill.run(teacher, run_dir['workdir'], student, str(workdir), ensemble='1,2',
                        devices=devices, echo=lambda _: None)
    assert again.step == 3 and (directory / 'train.teacher').read_bytes() == got
    assert stamps == {name: os.stat(directory / name).st_mtime_ns for name in stamps}


class _Words:
    """A tokenizer of one piece per word."""

    def encode(self, text):
        return [1] * len(text.split())


def test_empty_translations_say_which_sources_were_too_long(tmp_path):
    # The demo teacher's one empty translation of its training sources was its own EOS-first best
    # hypothesis for a short source, which distill.py used to report as over max_position.
    src, hyp = tmp_path / 'train.src', tmp_path / 'train.teacher'
    src.write_text('a b c\nfired on the spot\none two three four five\nx\n', encoding='utf-8')
    hyp.write_text('A B C\n\n\nX\n', encoding='utf-8')
    # 4 words + EOS fit max_len=5 (the teacher's own empty output); 5 words + EOS do not.
    assert distill.empty_translations(str(src), str(hyp), _Words(), max_len=5) == (2, 1)
    assert distill.empty_translations(str(src), str(hyp), _Words(), max_len=6) == (2, 0)


def test_the_command_says_what_it_needs_in_one_line(tmp_path):
    out = run_script('scripts/distill.py', '--config=configs/tiny.py', f'--workdir={tmp_path}')
    assert out.returncode != 0 and '--teacher' in out.stderr
    out = run_script('scripts/distill.py', '--config=configs/tiny.py', f'--workdir={tmp_path}',
                     f'--teacher={tmp_path / "none"}')
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        f'distill.py: workdir {tmp_path / "none"} does not exist')
    assert not (tmp_path / distill.DIRNAME).exists()  # nothing read or written before
