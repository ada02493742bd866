"""Which checkpoints an evaluation reads and whether their params fit: the steps of a workdir,
the selection (one step, every step, the last N averaged), the params in the model's layer
layout (raw or EMA), and the checks against the tokenizer and --config's model. evaluation.py and
ensemble.py both stand on it; every failure is an EvalError of one line."""

from __future__ import annotations

import jax

from t2t.eval import averaging
from t2t.infra import workdir as wd
from t2t.model import TransformerConfig, abstract_params
from t2t.run import checkpoint_read, layers_convert


class EvalError(Exception):
    """A problem with the user's request or files, stated in one line."""


def list_steps(workdir) -> list[int]:
    """Finished checkpoint steps of WORKDIR, read-only (never touches a training run's saves)."""
    if not wd.is_dir(wd.path(workdir)):
        raise EvalError(f'workdir {workdir} does not exist')
    directory = checkpoint_read.checkpoint_dir(workdir)
    if not directory.exists():
        raise EvalError(f'no checkpoint in {workdir}: {directory} does not exist')
    steps = checkpoint_read.listed_steps(workdir)
    if not steps:
        raise EvalError(f'no checkpoint in {directory}')
    return steps


def select(workdir, *, step: int | None = None, all_steps: bool = False,
           average_last: int = 0, average_final: float = 0.0) -> list[tuple[str, list[int]]]:
    """[(label, steps)]: what to evaluate; several steps in one entry are averaged.
    average_final > 0: the checkpoints of the run's final fraction of steps (averaging.py)."""
    if sum([step is not None, all_steps, average_last > 0, average_final > 0]) > 1:
        raise EvalError('choose one of --step, --all, --average_last and --average_final')
    steps = list_steps(workdir)
    if average_final:
        window = averaging.final_window(steps, average_final)
        return [(average_label(window) if len(window) > 1 else f'step-{steps[-1]}', window)]
    if step is not None:
        if step not in steps:
            raise EvalError(f'no checkpoint for step {step} in {workdir}; have {steps}')
        return [(f'step-{step}', [step])]
    if all_steps:
        return [(f'step-{s}', [s]) for s in steps]
    if average_last:
        if average_last > len(steps):
            raise EvalError(f'--average_last={average_last} but {workdir} has only '
                            f'{len(steps)} checkpoints {steps}')
        return [(average_label(steps[-average_last:]), steps[-average_last:])]
    return [(f'step-{steps[-1]}', [steps[-1]])]


def average_label(steps: list[int]) -> str:
    """avgN-FIRST-LAST: the label of the mean of checkpoints `steps`."""
    return f'avg{len(steps)}-{steps[0]}-{steps[-1]}'


def load_params(workdir, steps: list[int], *, scan_layers: bool = False, weights: str = 'raw'):
    """Params of one step, or the element-wise mean of several (host numpy arrays), in the layer
    layout of a model with this scan_layers setting whatever layout they were saved in.
    weights: 'raw' or 'ema' (checkpoint_read.choose_weights)."""
    if len(steps) == 1:
        params = checkpoint_read.restore_params(workdir, steps[0], weights=weights)
    else:
        params = checkpoint_read.average_checkpoints(workdir, steps, weights=weights)
    return layers_convert.to_layout(params, scan_layers=scan_layers)


def _embedding_rows(params) -> int:
    for name in ('embedder', 'target_embedder'):
        if name in params:
            return int(params[name]['embedding'].shape[0])
    raise EvalError('the checkpoint params have no embedder/embedding: not a t2t Transformer')


def check_params(params, model_config: TransformerConfig, tokenizer, label: str) -> None:
    """The tokenizer fits the checkpoint's embedding, and the config's model fits its params."""
    bias = checkpoint_read.attention_bias_mismatch(f'checkpoint {label}', params,
                                                   model_config.attention_bias)
    if bias:
        raise EvalError(bias)
    rows = _embedding_rows(params)
    # A tokenizer trained with hard_vocab_limit=False may come out smaller than the configured
    # vocab_size the model was built with; that pairing is the only tolerated difference.
    fits = rows == tokenizer.vocab_size or (rows == model_config.vocab_size
                                            and tokenizer.vocab_size < rows)
    if not fits:
        raise EvalError(
            f'tokenizer {getattr(tokenizer, "path", "")} has {tokenizer.vocab_size} pieces but '
            f'checkpoint {label} has an embedding of {rows} rows (config vocab_size='
            f'{model_config.vocab_size}): wrong --config.vocab_size or vocab_path?')
    want = jax.tree_util.tree_flatten_with_path(abstract_params(model_config))[0]
    have = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, leaf in want:
        got = have.get(path)
        if got is None or tuple(got.shape) != tuple(leaf.shape):
            name = jax.tree_util.keystr(path)
            found = 'missing' if got is None else f'shape {tuple(got.shape)}'
            raise EvalError(f'checkpoint {label} does not fit the model of --config: {name} is '
                            f'{found}, the config wants {tuple(leaf.shape)}')
    if len(have) != len(want):
        raise EvalError(f'checkpoint {label} has {len(have)} parameter arrays, the model of '
                        f'--config has {len(want)}: a different architecture')


def weights_label(label: str, weights: str) -> str:
    """The label of a checkpoint's EMA weights ends in -ema; raw weights keep the plain one."""
    return f'{label}-ema' if weights == 'ema' else label
