"""evaluate.py end to end on a tiny TSV corpus: scores, hypotheses, averaging, and clean errors."""

import json
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest
import sacrebleu

from configs import tiny
from t2t import data, optim, sharding, train_lib
from t2t.eval import bleu, evaluation
from t2t.eval import checkpoints as eval_checkpoints
from t2t.run import checkpoint, checkpoint_read
from tests import toy_corpus

# Its module fixtures are computed once: all its tests run on one xdist worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def _config(root, **overrides):
    c = tiny.get_config()
    c.dataset = 'tsv'
    c.data_dir = str(root / 'data')
    rng = random.Random(0)
    for split, n in (('train', 200), ('validation', 8), ('test', 12)):
        path = root / f'{split}.tsv'
        if not path.exists():
            sentences = [toy_corpus.sentence(rng, 2, 6) for _ in range(n)]
            if split == 'test':  # example 3 is over max_eval_len: skipped and counted
                sentences.insert(3, toy_corpus.sentence(rng, 40, 40))
            toy_corpus.write_tsv(path, sentences)
        c.tsv_files[split] = str(path)
    c.vocab_size, c.tokenizer_sentences = 400, 1000
    c.max_eval_len, c.eval_batch_size = 32, 8
    c.beam_size, c.max_decode_len, c.max_decode_extra = 2, 12, 4
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
    """A workdir with checkpoints 1 and 2 of a random tiny model (different params)."""
    root = tmp_path_factory.mktemp('eval')
    config = _config(root)
    data.get_tokenizer(config)  # prepared, as python -m t2t.data does: evaluate.py trains none
    mesh = sharding.make_mesh(config.mesh_shape)
    state, _ = train_lib.create_sharded_state(config, mesh, optim.make_optimizer(config))
    workdir = root / 'run'
    manager = checkpoint.make_manager(workdir, config, async_=False)
    checkpoint.save(manager, 1, state)
    shifted = jax.tree.map(lambda x: x * 0.5 + 0.01, state.params)
    checkpoint.save(manager, 2, state.replace(step=state.step + 1, params=shifted))
    checkpoint.close(manager)
    return {'root': root, 'config': config, 'workdir': str(workdir)}


def _run(run_dir, config=None, **kwargs):
    lines = []
    results = evaluation.run(config or run_dir['config'], run_dir['workdir'], progress=False,
                             echo=lines.append, **kwargs)
    return results, '\n'.join(lines)


def _read_lines(path):
    with open(path, encoding='utf-8') as f:
        return f.read().splitlines()


def test_latest_checkpoint_writes_scores_and_hypotheses_in_order(run_dir):
    results, report = _run(run_dir)
    assert list(results) == ['step-2']
    record = results['step-2']
    workdir = run_dir['workdir']
    with open(os.path.join(workdir, 'eval-test.json'), encoding='utf-8') as f:
        assert json.load(f)['step-2']['sacrebleu'] == record['sacrebleu']
    hypotheses = _read_lines(os.path.join(workdir, 'hypotheses-test-step-2.txt'))
    assert len(hypotheses) == record['sentences'] == 13
    assert record['skipped_too_long'] == 1 and hypotheses[3] == ''
    assert record['beam_stop'] == 'bound' and record['beam_unfinished'] == 'fallback'
    assert all(hypotheses[:3]) and all(hypotheses[4:])
    # A random model never says EOS on purpose: the limit counts must be reported, not hidden.
    assert 0 <= record['capped_at_max_decode_len'] <= record['hit_length_limit'] <= 13
    # The scores of the written hypotheses, by sacrebleu itself. A random model's output shares
    # nothing with the toy references (chrF 0), so the split is scored a second time
    # against references made of its own hypotheses (every other one) and the first references.
    references = [line.split('\t')[1] for line in _read_lines(run_dir['root'] / 'test.tsv')]
    assert _read_lines(record['references_file']) == references  # sacrebleu -i HYP REF's order
    mixed = [h if i % 2 and h else r for i, (h, r) in enumerate(
        zip(hypotheses, references, strict=True))]
    sources = [line.split('\t')[0] for line in _read_lines(run_dir['root'] / 'test.tsv')]
    mixed_path = run_dir['root'] / 'test_mixed.tsv'
    mixed_path.write_text(''.join(f'{s}\t{r}\n' for s, r in zip(sources, mixed, strict=True)),
                          encoding='utf-8')
    config = _config(run_dir['root'], max_eval_len=64)  # the hypotheses' bytes tokenize long
    config.tsv_files['test'] = str(mixed_path)
    again = _run(run_dir, config)[0]['step-2']
    rescored = _read_lines(os.path.join(workdir, 'hypotheses-test-step-2.txt'))
    for got, hyps, refs in ((record, hypotheses, references), (again, rescored, mixed)):
        assert got['sacrebleu'] == sacrebleu.corpus_bleu(hyps, [refs]).score
        assert got['chrf'] == sacrebleu.CHRF().corpus_score(hyps, [refs]).score
        assert got['tok_bleu_compound_split'] == bleu.tokenized_bleu_compound_split(
            hyps, refs, 'de')[0]
    # chrF had numbers to match (BLEU stays 0: the hypotheses are one or two 13a tokens each)
    assert again['chrf'] > 10
    for text in ('sacreBLEU', 'nrefs:1|case:mixed|eff:no|tok:13a', 'chrF',
                 'tokenized BLEU, compound split', 'ended at the length limit', 'source     [0]',
                 'hypothesis [0]'):
        assert text in report


def test_average_last_two_equals_their_mean_and_is_written(run_dir):
    out = str(run_dir['root'] / 'averaged')
    _run(run_dir)  # the latest checkpoint's scores, to check that labels merge in one JSON
    results, _ = _run(run_dir, average_last=2, write_averaged=out)
    assert list(results) == ['avg2-1-2'] and results['avg2-1-2']['steps'] == [1, 2]
    one, two = (checkpoint_read.restore_params(run_dir['workdir'], s) for s in (1, 2))
    averaged = checkpoint_read.restore_params(out)
    for a, b, mean in zip(*map(jax.tree.leaves, (one, two, averaged)), strict=True):
        np.testing.assert_allclose(mean, (a + b) / 2, rtol=1e-6)
    with open(os.path.join(run_dir['workdir'], 'eval-test.json'), encoding='utf-8') as f:
        assert {'step-2', 'avg2-1-2'} <= set(json.load(f))  # merged by label

    table, report = _run(run_dir, all_steps=True)
    assert list(table) == ['step-1', 'step-2'] and 'checkpoint' in report
    with pytest.raises(eval_checkpoints.EvalError, match='--average_last=3 but .* only 2'):
        _run(run_dir, average_last=3)


def test_translate_keeps_line_order(run_dir, tmp_path):
    # Distinct lines in a shuffled order: each output line is the hypothesis of its own input,
    # as the test-split evaluation of the same checkpoint decoded it.
    results, _ = _run(run_dir, step=1)
    hypotheses = _read_lines(os.path.join(run_dir['workdir'], 'hypotheses-test-step-1.txt'))
    sources = [line.split('\t')[0] for line in _read_lines(run_dir['root'] / 'test.tsv')]
    order = [i for i in random.Random(1).sample(range(len(sources)), len(sources)) if i != 3]
    source = tmp_path / 'in.txt'
    lines = [sources[i] for i in order]
    lines.insert(4, '')  # a blank line stays blank
    source.write_text('\n'.join(lines) + '\n', encoding='utf-8')
    target = tmp_path / 'out.txt'
    _run(run_dir, translate=True, input_path=str(source), output_path=str(target), step=1)
    want = [hypotheses[i] for i in order]
    want.insert(4, '')
    assert len(set(want)) >= 4  # outputs differ enough for a wrong order to show
    assert _read_lines(target) == want


# After a failed read, orbax's tensorstore callback may hit its already closed event loop.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_errors_are_one_line_and_name_the_thing(run_dir, tmp_path):
    config = run_dir['config']

    def error(exc_type, workdir, config=config, **kwargs):
        with pytest.raises(exc_type) as info:
            evaluation.run(config, str(workdir), progress=False, echo=lambda _: None, **kwargs)
        assert '\n' not in str(info.value)
        return str(info.value)

    assert 'does not exist' in error(eval_checkpoints.EvalError, tmp_path / 'missing')
    (tmp_path / 'empty' / 'checkpoints').mkdir(parents=True)
    assert 'no checkpoint in' in error(eval_checkpoints.EvalError, tmp_path / 'empty')
    assert 'no checkpoint for step 7' in error(eval_checkpoints.EvalError, run_dir['workdir'],
                                               step=7)

    # A flipped byte in the stored arrays: caught by the checkpoint's checksums.
    corrupt = tmp_path / 'corrupt'
    state = {'params': checkpoint_read.restore_params(run_dir['workdir'], 1)}
    manager = checkpoint.make_manager(corrupt, config, async_=False)
    checkpoint.save(manager, 3, state)
    checkpoint.close(manager)
    files = [os.path.join(r, f) for r, _, fs in os.walk(corrupt / 'checkpoints' / '3' / 'state')
             for f in fs]
    with open(max(files, key=os.path.getsize), 'r+b') as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0x10
        f.seek(0)
        f.write(raw)
    assert 'corrupt' in error(checkpoint.CheckpointError, corrupt)

    other_vocab = _config(run_dir['root'], vocab_size=450)
    assert 'never trains a vocabulary' in error(eval_checkpoints.EvalError, run_dir['workdir'],
                                                config=other_vocab)
    data.get_tokenizer(other_vocab)  # prepared: then the sizes disagree
    message = error(eval_checkpoints.EvalError, run_dir['workdir'], config=other_vocab)
    assert 'embedding of 400 rows' in message and 'tokenizer' in message
    bigger = _config(run_dir['root'], d_model=64)
    assert 'does not fit the model of --config' in error(eval_checkpoints.EvalError,
                                                          run_dir['workdir'], config=bigger)


def test_command_line_error_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, 'evaluate.py', '--config=configs/tiny.py', f'--workdir={tmp_path}/none'],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f'evaluate.py: workdir {tmp_path}/none does not exist')
    assert 'Traceback' not in proc.stderr
