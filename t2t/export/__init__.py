"""Trained t2t models as Hugging Face MarianMT or CTranslate2 model directories.

    python -m t2t.export --config=configs/default.py --workdir=DIR [--step=N | --average_last=N]
        --format=hf|ct2 --output=OUT [--quantization=int8]   (ct2 only; default float32)

    export(config, workdir, fmt='hf', output=OUT, average_last=5)   # the same from Python

Both formats compute the same function as t2t (tests/test_export.py checks logits and scores on
random models and decoded outputs on a trained one); weights.py turns the parameters into plain
matrices, hf.py and ct2.py write each format and say what each cannot express.
"""

from __future__ import annotations

import os

FORMATS = ('hf', 'ct2')


class ExportError(Exception):
    """A problem with the request or the model, stated in one line."""


def pieces_of(tokenizer) -> list[str]:
    """Every piece of the sentencepiece model, by id."""
    return [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]


def write(fmt: str, output: str, params, model_config, tokenizer, *, beam_size: int = 4,
          alpha: float = 0.6, max_decode_len: int = 256, quantization: str | None = None,
          source_lang: str = '', target_lang: str = '') -> str:
    """Writes unrolled t2t `params` of `model_config` in format `fmt` to `output`."""
    from t2t.export import ct2, hf, weights

    if fmt not in FORMATS:
        raise ExportError(f'--format={fmt!r}; one of {FORMATS}')
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
                        beam_size=beam_size, alpha=alpha, max_decode_len=max_decode_len,
                        source_lang=source_lang, target_lang=target_lang)
    return ct2.write(output, w, model_config, spm_path=tokenizer.path, pieces=pieces,
                     quantization=quantization or None)


def export(config, workdir: str, *, fmt: str, output: str, step: int | None = None,
           average_last: int = 0, quantization: str = '') -> str:
    """Exports checkpoint `step` (default: the latest) or the mean of the last `average_last`
    checkpoints of `workdir`, trained with experiment `config`; returns the output directory."""
    from t2t import evaluation
    from t2t.model import TransformerConfig

    if fmt not in FORMATS:
        raise ExportError(f'--format={fmt!r}; one of {FORMATS}')
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
        (label, steps), = evaluation.select(workdir, step=step, average_last=average_last)
        tokenizer = evaluation.workdir_tokenizer(config, workdir)  # the run's pinned copy
        evaluation.check_vocabulary(workdir, steps, tokenizer, label)
        params = evaluation.load_params(workdir, steps, scan_layers=False)
        evaluation.check_params(params, model_config.replace(scan_layers=False), tokenizer,
                                label)
    except evaluation.EvalError as e:
        raise ExportError(str(e)) from e
    return write(fmt, output, params, model_config, tokenizer, beam_size=config.beam_size,
                 alpha=config.length_penalty_alpha, max_decode_len=config.max_decode_len,
                 quantization=quantization or None, source_lang=config.source_lang,
                 target_lang=config.target_lang)
