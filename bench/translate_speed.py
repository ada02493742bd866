"""Bulk translation speed and BLEU: t2t's streaming translator against its own exports.

    python bench/translate_speed.py --config=configs/default.py --workdir=workdirs/demo \\
        --average_last=5 --repeat_to=100000               # the demo model (train it first)
    python bench/translate_speed.py --config=configs/default.py --random_init ...
    python bench/translate_speed.py --tiny --out_dir=DIR   # seconds: tests/test_bench.py

Each runtime translates file to file, text in and text out, beam 4 (config.beam_size), on this
CPU; t2t divides by ((5 + |Y|) / 6)^config.length_penalty_alpha, the exports' runtimes by
|Y|^a with the exponent the export writes (export.runtime_length_penalty: fitted to t2t's):
- t2t: evaluate.py --translate's code (t2t/eval/translate.py: length-sorted windows, token-budget
  batches over a few bucketed shapes, the jitted beam search), for each input a first run
  (its shapes' compiles included: first_run_s) and a second, warm run of the same file
  (--t2t_runs=1: the first run only, for inputs where the compiles are a small part);
- ct2-float32, ct2-int8: CTranslate2 `Translator.translate_file` of the `--format=ct2` export,
  sentencepiece tokenize/detokenize callbacks, batches of --token_budget tokens, 2 threads;
- hf: transformers `generate()` of the `--format=hf` export with MarianTokenizer, sentences
  sorted by length in batches of --hf_batch, torch on 2 threads (only the test split unless
  --hf_repeated: it is the slowest).
Inputs: the config's test split (BLEU by sacreBLEU against its references) and the same text
repeated to --repeat_to lines. "same as t2t": the fraction of lines identical to t2t's output.
One `RESULT {json}` line per measurement and a markdown table at the end.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config.')
_WORKDIR = flags.DEFINE_string('workdir', '', 'A trained workdir (or --random_init).')
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint (default: the latest).')
_AVERAGE_LAST = flags.DEFINE_integer('average_last', 0, 'The mean of the last N checkpoints.')
_RANDOM_INIT = flags.DEFINE_bool('random_init', False,
                                 'No workdir: a random model of the config (BLEU meaningless).')
_TINY = flags.DEFINE_bool('tiny', False, 'configs/tiny.py, random init, 24 test lines repeated '
                          'to 48: the smoke test.')
_OUT_DIR = flags.DEFINE_string('out_dir', '/tmp/t2t-translate-speed', 'Exports and outputs.')
_RUNTIMES = flags.DEFINE_list('runtimes', 't2t,ct2-float32,ct2-int8,hf', 'What to run.')
_MAX_LINES = flags.DEFINE_integer('max_lines', 0, 'Use the first N test lines (0: all).')
_REPEAT_TO = flags.DEFINE_integer('repeat_to', 100_000, 'Lines of the repeated input (0: none).')
_TOKEN_BUDGET = flags.DEFINE_integer('token_budget', 0, 'Source tokens per batch for t2t and '
                                     'CTranslate2 (0: t2t.eval.translate.DEFAULT_TOKEN_BUDGET).')
_HF_BATCH = flags.DEFINE_integer('hf_batch', 32, 'Sentences per generate() call.')
_HF_REPEATED = flags.DEFINE_bool('hf_repeated', False, 'Run generate() on the repeated input.')
_T2T_RUNS = flags.DEFINE_integer('t2t_runs', 2, 't2t runs per input: 2 = the first (compiles '
                                 'included) and a warm one, measured; 1 = the first only '
                                 '(100k lines: the compiles are a small part).')
_THREADS = 2  # this machine's cores


def load_model(config, out_dir):
    """(params unrolled, tokenizer, what was used): a trained workdir's or a random model."""
    import jax
    from flax.core import meta

    from t2t import data
    from t2t.eval import checkpoints as eval_checkpoints
    from t2t.eval import evaluation
    from t2t.model import Transformer, TransformerConfig

    if _RANDOM_INIT.value or _TINY.value:
        tokenizer = data.get_tokenizer(config)
        cfg = TransformerConfig.from_config(config).replace(deterministic=True)
        x = jax.numpy.ones((1, 8), jax.numpy.int32)
        params = meta.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), x, x)['params'])
        return params, tokenizer, 'random init (BLEU meaningless)'
    (label, steps), = eval_checkpoints.select(_WORKDIR.value, step=_STEP.value,
                                              average_last=_AVERAGE_LAST.value)
    tokenizer = evaluation.workdir_tokenizer(config, _WORKDIR.value)
    evaluation.check_vocabulary(_WORKDIR.value, steps, tokenizer, label)
    params = eval_checkpoints.load_params(_WORKDIR.value, steps, scan_layers=False)
    return params, tokenizer, f'{_WORKDIR.value} {label}'


def write_lines(path, lines):
    with open(path, 'w', encoding='utf-8') as f:
        f.write(''.join(line.replace('\n', ' ') + '\n' for line in lines))


def read_lines(path):
    with open(path, encoding='utf-8') as f:
        return f.read().split('\n')[:-1]


def _cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn):
    wall, cpu = time.perf_counter(), _cpu_s()
    fn()
    return time.perf_counter() - wall, _cpu_s() - cpu


def run_t2t(config, params, tokenizer, src, out, token_budget):
    from t2t import sharding
    from t2t.eval import predict as predict_lib
    from t2t.eval import translate
    from t2t.model import TransformerConfig

    mesh = sharding.make_mesh((-1, 1, 1))
    model_config = TransformerConfig.from_config(config)
    predict = predict_lib.config_predict_fn(config, model_config,
                                            num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    params = sharding.put_global(params, sharding.replicated(mesh))
    if os.path.exists(out + '.progress'):
        os.remove(out + '.progress')  # a fresh run each time, not a resumed one
    translate.translate_stream(predict, params, tokenizer, src, out, max_len=config.max_position,
                               token_budget=token_budget, progress=False, mesh=mesh)


def runtime_penalty(config) -> float:
    """The |Y|^a exponent the export writes for CTranslate2 and generate()."""
    from t2t import export

    return export.runtime_length_penalty(config.length_penalty_alpha, config.max_decode_len)


def run_ct2(translator, sp, config, src, out, token_budget):
    translator.translate_file(
        src, out, max_batch_size=token_budget, batch_type='tokens', read_batch_size=50_000,
        beam_size=config.beam_size, length_penalty=runtime_penalty(config),
        max_decoding_length=config.max_decode_len, suppress_sequences=[['<pad>']],
        source_tokenize_fn=lambda line: sp.encode(line, out_type=str),
        target_detokenize_fn=lambda pieces: sp.decode(pieces).replace('\n', ' '))  # as t2t


def run_hf(model, hf_tokenizer, config, src, out, batch):
    import torch

    lines = read_lines(src)
    order = sorted(range(len(lines)), key=lambda i: len(lines[i]))
    hypotheses = [''] * len(lines)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            index = [i for i in order[start:start + batch] if lines[i].strip()]
            if not index:
                continue
            inputs = hf_tokenizer([lines[i] for i in index], return_tensors='pt', padding=True)
            ids = model.generate(**inputs, num_beams=config.beam_size,
                                 length_penalty=runtime_penalty(config),
                                 max_new_tokens=config.max_decode_len)
            for i, text in zip(index, hf_tokenizer.batch_decode(ids, skip_special_tokens=True),
                               strict=True):
                hypotheses[i] = text
    write_lines(out, hypotheses)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    logging.set_verbosity(logging.WARNING)
    import jax
    import sacrebleu

    from t2t import export, sharding
    from t2t.data import sources
    from t2t.eval import translate
    from t2t.model import TransformerConfig

    config = _CONFIG.value
    if _TINY.value:
        from configs import tiny

        config = tiny.get_config()
        config.data_dir = os.path.join(_OUT_DIR.value, 'data')
        config.vocab_size, config.tokenizer_sentences = 500, 2000
        config.beam_size, config.max_decode_len, config.max_decode_extra = 4, 16, 8
    elif not _WORKDIR.value and not _RANDOM_INIT.value:
        sys.exit('translate_speed.py: --workdir=DIR (a trained model) or --random_init')
    max_lines = 24 if _TINY.value else _MAX_LINES.value
    repeat_to = 48 if _TINY.value else _REPEAT_TO.value
    token_budget = _TOKEN_BUDGET.value or max(translate.DEFAULT_TOKEN_BUDGET, config.max_position)
    unknown = set(_RUNTIMES.value) - {'t2t', 'ct2-float32', 'ct2-int8', 'hf'}
    if unknown:
        sys.exit(f'translate_speed.py: --runtimes: unknown {sorted(unknown)}')
    out_dir = _OUT_DIR.value
    os.makedirs(out_dir, exist_ok=True)

    params, tokenizer, used = load_model(config, out_dir)
    pairs = sources.open_split(config, config.test_split)
    pairs = pairs.read(0, min(max_lines, len(pairs)) if max_lines else len(pairs))
    src_lines = [s.replace('\n', ' ') for s, _ in pairs]
    references = [t for _, t in pairs]
    inputs = {'test': os.path.join(out_dir, 'test.src')}
    write_lines(inputs['test'], src_lines)
    if repeat_to:
        inputs['repeated'] = os.path.join(out_dir, f'repeated{repeat_to}.src')
        write_lines(inputs['repeated'], itertools.islice(itertools.cycle(src_lines), repeat_to))
    load = ' '.join(open('/proc/loadavg').read().split()[:3])
    common = dict(model=used, d_model=config.d_model, layers=config.num_encoder_layers,
                  beam=config.beam_size, alpha=config.length_penalty_alpha,
                  t2t_beam_stop=config.beam_stop,
                  runtime_length_penalty=runtime_penalty(config),
                  devices=sharding.make_mesh((-1, 1, 1)).size, jax=jax.__version__)

    exported = {}
    for fmt in ('ct2', 'hf'):
        if any(r.startswith(fmt) for r in _RUNTIMES.value):
            path = os.path.join(out_dir, f'export-{fmt}')
            if os.path.exists(path):
                shutil.rmtree(path)
            exported[fmt] = export.write(
                fmt, path, params, TransformerConfig.from_config(config), tokenizer,
                beam_size=config.beam_size,
                alpha=config.length_penalty_alpha, max_decode_len=config.max_decode_len)

    rows, outputs = [], {}

    def record(runtime, name, wall, cpu, extra=None):
        out = os.path.join(out_dir, f'{name}.{runtime}.out')
        hyps = read_lines(out)
        n = sum(1 for line in read_lines(inputs[name]) if line.strip())
        row = dict(runtime=runtime, input=name, lines=len(hyps), wall_s=round(wall, 2),
                   cpu_s=round(cpu, 2), sent_s=round(n / wall, 1), **(extra or {}))
        if name == 'test':
            row['bleu'] = round(sacrebleu.corpus_bleu(hyps, [references]).score, 2)
        base = outputs.get(('t2t', name))
        if base is not None and runtime != 't2t':
            row['same_as_t2t'] = round(sum(a == b for a, b in zip(base, hyps, strict=True))
                                       / len(hyps), 4)
        outputs[(runtime, name)] = hyps
        row.update(common, load=' '.join(open('/proc/loadavg').read().split()[:3]))
        print('RESULT ' + json.dumps(row), flush=True)
        rows.append(row)

    def out_path(runtime, name):
        return os.path.join(out_dir, f'{name}.{runtime}.out')

    if 't2t' in _RUNTIMES.value:
        for name in inputs:  # each input's batch shapes compile in its first run
            run = functools.partial(run_t2t, config, params, tokenizer, inputs[name],
                                    out_path('t2t', name), token_budget)
            wall, cpu = first = timed(run)
            if _T2T_RUNS.value > 1:
                wall, cpu = timed(run)
            record('t2t', name, wall, cpu, {'first_run_s': round(first[0], 2),
                                            'warm': _T2T_RUNS.value > 1})
    for runtime in ('ct2-float32', 'ct2-int8'):
        if runtime not in _RUNTIMES.value:
            continue
        import ctranslate2
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=tokenizer.path)
        translator = ctranslate2.Translator(exported['ct2'], device='cpu',
                                            compute_type=runtime.split('-')[1],
                                            inter_threads=1, intra_threads=_THREADS)
        for name in inputs:
            out = out_path(runtime, name)
            wall, cpu = timed(lambda tr=translator, sp=sp, src=inputs[name], out=out: run_ct2(
                tr, sp, config, src, out, token_budget))
            record(runtime, name, wall, cpu)
    if 'hf' in _RUNTIMES.value:
        import torch
        from transformers import MarianMTModel, MarianTokenizer

        torch.set_num_threads(_THREADS)
        model = MarianMTModel.from_pretrained(exported['hf']).eval()
        hf_tokenizer = MarianTokenizer.from_pretrained(exported['hf'])
        for name in inputs if _HF_REPEATED.value else ['test']:
            wall, cpu = timed(lambda name=name: run_hf(model, hf_tokenizer, config, inputs[name],
                                                       out_path('hf', name), _HF_BATCH.value))
            record('hf', name, wall, cpu)

    print(f'\nmodel: {used}; load average at start {load}, at end '
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}")
    print('| runtime | input | lines | wall s | CPU s | sentences/s | BLEU | same as t2t |')
    print('|---|---|---|---|---|---|---|---|')
    for r in rows:
        print(f"| {r['runtime']} | {r['input']} | {r['lines']} | {r['wall_s']} | {r['cpu_s']} | "
              f"{r['sent_s']} | {r.get('bleu', '')} | {r.get('same_as_t2t', '')} |")


if __name__ == '__main__':
    app.run(main)
