"""Sequence-level knowledge distillation (Kim & Rush, 2016): a student trained on its teacher's
translations of the training sources (scripts/distill.py).

    student = distill.run(teacher_config, teacher_workdir, student_config, workdir,
                          ensemble='', average_last=0)

1. The teacher config's training split, its usable pairs in order, streamed chunk by chunk:
   the sources to WORKDIR/distill/train.src (written whole, then renamed: present means done).
2. The teacher translates them (evaluate.py --translate's path: one checkpoint, the average of
   its last N, or an --ensemble of several, with the teacher config's decoding, or MBR) into
   WORKDIR/distill/train.teacher, streamed and resumable (t2t/eval/translate.py's progress file).
   A source longer than the teacher's max_position has an empty translation, and so does a
   source the teacher answers with EOS alone: the student's TSV reader skips those pairs and
   counts them (its training data line says how many); distill.json counts both kinds.
3. The student config, as given but for its data: dataset 'tsv' with train = those two files,
   validation and test = the teacher config's splits with their own references (written out as
   WORKDIR/distill/<split>.src / .ref), and the teacher's vocabulary (vocab_path: its workdir's
   vocab.model, vocab_size as the teacher's), so that both read the same pieces. It trains in
   WORKDIR (t2t/train/loop.py): killed, the same command resumes it.

WORKDIR/distill/distill.json records the teacher, its decoding and the counts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from t2t.data import sources
from t2t.decode import DecodeConfig
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import evaluation
from t2t.eval import predict as predict_lib
from t2t.eval.translate import count_lines, one_line
from t2t.infra import workdir as wd

DIRNAME = 'distill'


def _write_lines(path: str, lines) -> int:
    """Writes the lines to path.partial, then renames it to path; returns how many."""
    partial = path + '.partial'
    n = 0
    with open(partial, 'w', encoding='utf-8', newline='\n') as f:
        for line in lines:
            f.write(one_line(line) + '\n')
            n += 1
    os.replace(partial, path)
    return n


def empty_translations(src: str, hyp: str, tokenizer, max_len: int) -> tuple[int, int]:
    """(empty translations, of those the sources over max_len tokens with EOS: never decoded,
    as t2t/eval/translate.py leaves them); the rest are the teacher's own empty outputs."""
    empty = too_long = 0
    with open(src, encoding='utf-8', newline='\n') as s, \
            open(hyp, encoding='utf-8', newline='\n') as h:
        for source, line in zip(s, h, strict=True):
            if not line.strip():
                empty += 1
                too_long += len(tokenizer.encode(source.rstrip('\n'))) + 1 > max_len
    return empty, too_long


def _training_sources(config, split: str):
    """The sources of the split's usable pairs, in order, one chunk at a time."""
    from t2t.data import prepare

    chunks, _ = sources.chunks(config, split, prepare.CHUNK_PAIRS)
    for chunk in chunks:
        pairs, _, _ = sources.read_chunk(config, split, chunk)
        yield from (source for source, _ in pairs)


def student_config(teacher_config, student, directory: str, vocab_path: str):
    """The student config on the distilled data (see the module docstring)."""
    config = student.copy_and_resolve_references()
    config.unlock()
    config.dataset = 'tsv'
    config.source_lang, config.target_lang = teacher_config.source_lang, teacher_config.target_lang
    for split in ('train', 'validation', 'test'):
        config.tsv_files[split] = ''
    config.train_split, config.eval_split, config.test_split = 'train', 'validation', 'test'
    config.tsv_files.train = (f'{os.path.join(directory, "train.src")},'
                              f'{os.path.join(directory, "train.teacher")}')
    for split in ('validation', 'test'):
        config.tsv_files[split] = (f'{os.path.join(directory, split + ".src")},'
                                   f'{os.path.join(directory, split + ".ref")}')
    config.vocab_path, config.vocab_size = vocab_path, teacher_config.vocab_size
    config.train_mixture = ''
    config.lock()
    return config


def run(teacher_config, teacher_workdir: str, student, workdir: str, *, ensemble: str = '',
        step: int | None = None, average_last: int = 0, weights: str = 'auto', mbr=None,
        devices=None, echo: Callable[[str], None] = print):
    """Steps 1-3 of the module docstring; returns the student's loop.TrainResult."""
    from t2t import data
    from t2t.train import loop

    if not workdir or not teacher_workdir:
        raise evaluation.EvalError('distillation needs the teacher\'s workdir and the '
                                   'student\'s (--teacher, --workdir)')
    if not ensemble:  # a missing teacher says so before the corpus is read
        eval_checkpoints.select(teacher_workdir, step=step, average_last=average_last)
    directory = os.path.join(wd.path(workdir), DIRNAME)
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, 'train.src')
    if not os.path.exists(src):
        lines = _write_lines(src, _training_sources(teacher_config, teacher_config.train_split))
        echo(f'distill: {lines} training sources of '
             f'{sources.split_name(teacher_config, teacher_config.train_split)} -> {src}')
    for split, key in (('validation', 'eval_split'), ('test', 'test_split')):
        if not os.path.exists(os.path.join(directory, split + '.ref')):
            texts, references = data.split_texts(teacher_config, teacher_config[key])
            _write_lines(os.path.join(directory, split + '.src'), texts)
            _write_lines(os.path.join(directory, split + '.ref'), references)

    hyp = os.path.join(directory, 'train.teacher')
    total = count_lines(src)
    # A finished translation stays as it is (its progress file says every line is done).
    echo(f'distill: the teacher translates {total} sources -> {hyp} (resumable)')
    evaluation.run(teacher_config, teacher_workdir, step=step, average_last=average_last,
                   translate=True, input_path=src, output_path=hyp, weights=weights,
                   ensemble=ensemble, mbr=mbr, devices=devices, echo=echo)
    tokenizer = evaluation.workdir_tokenizer(teacher_config, teacher_workdir)
    empty, too_long = empty_translations(src, hyp, tokenizer, teacher_config.max_position)
    vocab = tokenizer.path
    decoding = DecodeConfig.from_config(teacher_config)
    described = mbr.describe(mbr.decoding(decoding)) if mbr else predict_lib.describe(decoding)
    record = {'teacher_workdir': str(teacher_workdir), 'ensemble': ensemble, 'step': step,
              'average_last': average_last, 'weights': weights, 'decoding': described,
              'sources': total, 'empty_translations': empty,
              'sources_over_max_position': too_long, 'vocab_path': vocab}
    wd.write_atomic(os.path.join(directory, 'distill.json'), json.dumps(record, indent=2) + '\n')
    if empty:
        echo(f'distill: {empty} of {total} translations are empty ({too_long} sources over the '
             f'teacher\'s max_position={teacher_config.max_position} tokens, {empty - too_long} '
             'the teacher\'s own empty outputs): the student skips those pairs')
    config = student_config(teacher_config, student, directory, vocab)
    return loop.train_and_evaluate(config, workdir, devices=devices)
