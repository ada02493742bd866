"""Trained t2t models as Hugging Face MarianMT or CTranslate2 model directories.

    python -m t2t.export --config=configs/default.py --workdir=DIR [--step=N | --average_last=N]
        --format=hf|ct2 --output=OUT [--quantization=int8]   (ct2 only; default float32)
        [--length_penalty=fitted|alpha]

    export(config, workdir, fmt='hf', output=OUT, average_last=5)   # the same from Python

Both formats compute the same function as t2t (tests/test_export.py checks logits and scores on
random models and decoded outputs on a trained one); weights.py turns the parameters into plain
matrices, hf.py and ct2.py write each format and say what each cannot express.

Length penalty: t2t ranks finished beams by sum log p / ((5 + |Y|) / 6)^alpha, transformers and
CTranslate2 by sum log p / |Y|^a. The export writes the a that imitates t2t's penalty best
(fitted_length_penalty; --length_penalty=alpha writes length_penalty_alpha unchanged).
"""

from __future__ import annotations

import os
import sys

import numpy as np

FORMATS = ('hf', 'ct2')
LENGTH_PENALTIES = ('fitted', 'alpha')


class ExportError(Exception):
    """A problem with the request or the model, stated in one line."""


def pieces_of(tokenizer) -> list[str]:
    """Every piece of the sentencepiece model, by id."""
    return [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]


def fitted_length_penalty(alpha: float, max_length: int) -> float:
    """The exponent a of |Y|^a that ranks hypotheses of lengths 1..max_length most like t2t's
    ((5 + |Y|) / 6)^alpha, rounded to 3 decimals (the value written is the value printed).

    A ranking depends only on ratios of penalties between lengths, so a constant factor is free:
    a is the least-squares slope of alpha log(5 + L) on log L with an intercept. The export knows
    no length distribution, so every length a hypothesis can have (|Y| counts EOS: 1 is the empty
    output) weighs the same; near one length L0 the curves' slopes match at alpha L0 / (5 + L0).
    """
    if max_length < 2:
        raise ValueError(f'a length penalty fit needs lengths 1..N with N >= 2, not {max_length}')
    length = np.arange(1, max_length + 1, dtype=np.float64)
    log_length, log_gnmt = np.log(length), alpha * np.log(5.0 + length)
    centred = log_length - log_length.mean()
    return round(float(centred @ (log_gnmt - log_gnmt.mean()) / (centred @ centred)), 3)


def runtime_length_penalty(alpha: float, max_decode_len: int, mode: str = 'fitted') -> float:
    """The length_penalty the export writes for generate() and CTranslate2 (`mode`: fitted or
    alpha, see LENGTH_PENALTIES)."""
    if mode not in LENGTH_PENALTIES:
        raise ExportError(f'--length_penalty={mode!r}; one of {LENGTH_PENALTIES}')
    if mode == 'alpha':
        return float(alpha)
    try:
        return fitted_length_penalty(alpha, max_decode_len)
    except ValueError as e:
        raise ExportError(str(e)) from e


def length_penalty_note(fmt: str, alpha: float, max_decode_len: int,
                        mode: str = 'fitted') -> str:
    """One line: the length penalty the export wrote, what it stands for, and where it is."""
    from t2t.export.ct2 import DECODING_FILE

    a = runtime_length_penalty(alpha, max_decode_len, mode)
    where = ("generate()'s default in generation_config.json" if fmt == 'hf'
             else f'in {DECODING_FILE}: pass length_penalty={a} to translate_batch')
    if mode == 'fitted':
        return (f"length penalty: |Y|^{a}, the least-squares fit of t2t's ((5+|Y|)/6)^{alpha} "
                f'over lengths 1-{max_decode_len} ({where})')
    return (f"length penalty: |Y|^{a}, length_penalty_alpha unchanged; t2t divides by "
            f'((5+|Y|)/6)^{alpha} ({where})')


def write(fmt: str, output: str, params, model_config, tokenizer, *, beam_size: int = 4,
          alpha: float = 0.6, max_decode_len: int = 256, length_penalty: str = 'fitted',
          quantization: str | None = None, source_lang: str = '', target_lang: str = '') -> str:
    """Writes unrolled t2t `params` of `model_config` in format `fmt` to `output`; the runtimes'
    length penalty as `length_penalty` says (runtime_length_penalty)."""
    from t2t.export import ct2, hf, weights

    if fmt not in FORMATS:
        raise ExportError(f'--format={fmt!r}; one of {FORMATS}')
    penalty = runtime_length_penalty(alpha, max_decode_len, length_penalty)
    if quantization and fmt != 'ct2':
        raise ExportError('--quantization applies to --format=ct2 only')
    if os.path.exists(output) and os.listdir(output):
        raise ExportError(f'--output {output} exists and is not empty')
    try:
        if fmt == 'hf':
            hf.check_supported(model_config)
        w = weights.from_params(params, model_config, tokenizer.vocab_size)
    except ValueError as e:
        raise ExportError(str(e)) from e
    pieces = pieces_of(tokenizer)
    if fmt == 'hf':
        return hf.write(output, w, model_config, spm_path=tokenizer.path, pieces=pieces,
                        beam_size=beam_size, length_penalty=penalty,
                        max_decode_len=max_decode_len, source_lang=source_lang,
                        target_lang=target_lang)
    return ct2.write(output, w, model_config, spm_path=tokenizer.path, pieces=pieces,
                     quantization=quantization or None, beam_size=beam_size,
                     length_penalty=penalty, max_decode_len=max_decode_len)


def export(config, workdir: str, *, fmt: str, output: str, step: int | None = None,
           average_last: int = 0, quantization: str = '', length_penalty: str = 'fitted',
           weights: str = 'auto') -> str:
    """Exports checkpoint `step` (default: the latest) or the mean of the last `average_last`
    checkpoints of `workdir`, trained with experiment `config`; returns the output directory.
    weights: 'ema', 'raw' or 'auto' (the EMA when the checkpoints hold one; evaluation.py)."""
    from t2t.eval import averaging, evaluation
    from t2t.eval import checkpoints as eval_checkpoints
    from t2t.model import TransformerConfig
    from t2t.run import checkpoint_read

    if fmt not in FORMATS:
        raise ExportError(f'--format={fmt!r}; one of {FORMATS}')
    # a bad mode or length is one line before any checkpoint is read
    runtime_length_penalty(config.length_penalty_alpha, config.max_decode_len, length_penalty)
    if not output:
        raise ExportError('--output is required')
    model_config = TransformerConfig.from_config(config)
    if fmt == 'hf':  # before any checkpoint is read
        from t2t.export import hf

        try:
            hf.check_supported(model_config)
        except ValueError as e:
            raise ExportError(str(e)) from e
    try:
        (label, steps), = eval_checkpoints.select(workdir, step=step, average_last=average_last)
        warning = average_last and averaging.wide_window(steps, config.average_fraction)
        if warning:
            print(warning, file=sys.stderr)
        tokenizer = evaluation.workdir_tokenizer(config, workdir)  # the run's pinned copy
        evaluation.check_vocabulary(workdir, steps, tokenizer, label)
        used = checkpoint_read.choose_weights(workdir, steps[-1], weights)
        params = eval_checkpoints.load_params(workdir, steps, scan_layers=False, weights=used)
        eval_checkpoints.check_params(params, model_config.replace(scan_layers=False), tokenizer,
                                      label)
    except eval_checkpoints.EvalError as e:
        raise ExportError(str(e)) from e
    return write(fmt, output, params, model_config, tokenizer, beam_size=config.beam_size,
                 alpha=config.length_penalty_alpha, max_decode_len=config.max_decode_len,
                 length_penalty=length_penalty, quantization=quantization or None,
                 source_lang=config.source_lang, target_lang=config.target_lang)
