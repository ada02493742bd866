"""Forced decoding: the log-probability a model gives to given translations (evaluate.py --score).

    score = make_score_fn(model_config, num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    result = score_pairs(score, params, tokenizer, sources, targets, max_len=256, mesh=mesh)
    text = tsv(result)   # index, tokens, log_prob, log_prob_per_token

A pair's log_prob is the sum over the target's tokens, EOS included, of log p(token | source,
the tokens before it): the distribution beam search ranks by (t2t/decode.py), i.e. log_softmax of
the decoder's float32 logits with the ids the tokenizer lacks (num_valid_ids) masked first; PAD
takes part in the softmax but is never a target, as beam search sets it to -inf without
renormalizing. Beam search's score of a hypothesis of `tokens` tokens (EOS included) is then
log_prob / ((5 + tokens) / 6) ** alpha (decode.length_penalty).

The text is scored as the tokenizer segments it. A model may generate another segmentation of the
same text (sentencepiece: '.' as a bare piece where encoding '.' gives '▁', '.'); such an n-best
hypothesis scores here as the tokenizer's segmentation, a different token sequence, whose
log_prob differs from the one beam search ranked.

A pair whose source or target is longer than max_len tokens (EOS included: the position table)
is never cut: it is not scored, it is counted, and its row has empty score fields. Pairs run in
batches of a few bucketed shapes (translate.py's buckets over the longer side), one compile each.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec

from t2t import sharding
from t2t.eval import predict as predict_lib
from t2t.eval import translate
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import Transformer, TransformerConfig

TSV_HEADER = 'index\ttokens\tlog_prob\tlog_prob_per_token\n'


@dataclasses.dataclass(frozen=True)
class Scores:
    log_probs: list[float | None]  # per pair: sum of log p over the target's tokens; None: too long
    tokens: list[int]  # per pair: the target's tokens, EOS included
    too_long: list[int]  # indices of the pairs over max_len tokens on either side (not scored)
    seconds: float

    @property
    def scored(self) -> int:
        return len(self.log_probs) - len(self.too_long)


def make_score_fn(model_config: TransformerConfig | tuple[TransformerConfig, ...], *,
                  num_valid_ids: int | None = None, mesh=None) -> Callable:
    """A jitted score(params, inputs_BS, targets_BT) -> float32[B], each row's log_prob (targets
    end in EOS, then PAD). With a mesh, each device scores its own rows (as predict.py's predict);
    rows must divide by mesh.size. An ensemble (evaluate.py --score --ensemble): model_config a
    tuple of its members' configs, params the tuple of theirs; each token's log-probability is
    the mean of the members' (over the vocabulary rows all have), as its beam search reads it."""
    configs = model_config if isinstance(model_config, tuple) else (model_config,)
    configs = tuple(c.replace(deterministic=True, decode=False) for c in configs)

    def member_log_probs(config, params, inputs_BS, targets_BT):
        logits_BTV = Transformer(config).apply({'params': params}, inputs_BS, targets_BT)
        logits_BTV = logits_BTV.astype(jnp.float32)
        if num_valid_ids is not None and num_valid_ids < logits_BTV.shape[-1]:
            valid_V = jnp.arange(logits_BTV.shape[-1]) < num_valid_ids  # as predict masks them
            logits_BTV = jnp.where(valid_V, logits_BTV, -1e9)
        return jax.nn.log_softmax(logits_BTV)

    def score(params, inputs_BS, targets_BT):
        members = params if isinstance(model_config, tuple) else (params,)
        log_probs = [member_log_probs(c, p, inputs_BS, targets_BT)
                     for c, p in zip(configs, members, strict=True)]
        V = min(lp.shape[-1] for lp in log_probs)
        log_probs_BTV = jnp.mean(jnp.stack([lp[..., :V] for lp in log_probs]), axis=0)
        token_BT = jnp.take_along_axis(log_probs_BTV, targets_BT[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(targets_BT != PAD_ID, token_BT, 0.0), axis=1)

    if mesh is None:
        return jax.jit(score)

    def score_block(params, inputs_BS, targets_BT):
        with nn.logical_axis_rules(()):  # every mesh axis is manual here
            return score(params, inputs_BS, targets_BT)

    rows = PartitionSpec(sharding.MESH_AXES)
    return jax.jit(jax.shard_map(score_block, mesh=mesh, in_specs=(PartitionSpec(), rows, rows),
                                 out_specs=rows, check_vma=False))


def score_pairs(score, params, tokenizer, sources: list[str], targets: list[str], *,
                max_len: int, token_budget: int = translate.DEFAULT_TOKEN_BUDGET,
                mesh=None) -> Scores:
    """The log_prob of each (source, target) pair, in order (see the module docstring)."""
    if len(sources) != len(targets):
        raise ValueError(f'{len(sources)} sources but {len(targets)} targets')
    if token_budget < max_len:
        raise ValueError(f'token_budget={token_budget} is below max_len={max_len}')
    src = [tokenizer.encode(t) + [EOS_ID] for t in sources]
    tgt = [tokenizer.encode(t) + [EOS_ID] for t in targets]
    too_long = [i for i in range(len(src)) if max(len(src[i]), len(tgt[i])) > max_len]
    log_probs: list[float | None] = [None] * len(src)
    multiple = mesh.size if mesh is not None else 1
    start = time.perf_counter()
    skip = set(too_long)
    todo = sorted((i for i in range(len(src)) if i not in skip),
                  key=lambda i: max(len(src[i]), len(tgt[i])))
    pending = None
    for batch in _batches(todo, src, tgt, max_len, token_budget, multiple):
        out = score(params, predict_lib.feed(batch['inputs'], mesh),
                    predict_lib.feed(batch['targets'], mesh))  # asynchronous dispatch
        if pending is not None:
            _collect(*pending, log_probs)
        pending = (batch['index'], out)
    if pending is not None:
        _collect(*pending, log_probs)
    return Scores(log_probs, [len(t) for t in tgt], too_long, time.perf_counter() - start)


def _batches(todo, src, tgt, max_len, token_budget, multiple):
    """{'inputs', 'targets' [B, L], 'index' [B] (-1: padding)} of the pairs `todo`, sorted by
    their longer side; L is its bucket (translate.bucket_length), B the bucket's rows."""
    groups: dict[int, list[int]] = {}
    for i in todo:
        groups.setdefault(translate.bucket_length(max(len(src[i]), len(tgt[i])), max_len),
                          []).append(i)
    for length, group in groups.items():
        full = translate.batch_rows(length, token_budget, multiple)
        for begin in range(0, len(group), full):
            chunk = group[begin:begin + full]
            rows = translate.tail_rows(len(chunk), full, multiple)
            inputs = np.full((rows, length), PAD_ID, np.int32)
            targets = np.full((rows, length), PAD_ID, np.int32)
            index = np.full((rows,), -1, np.int64)
            for r, i in enumerate(chunk):
                inputs[r, :len(src[i])] = src[i]
                targets[r, :len(tgt[i])] = tgt[i]
                index[r] = i
            yield {'inputs': inputs, 'targets': targets, 'index': index}


def _collect(index_B, out_B, log_probs) -> None:
    from jax.experimental import multihost_utils

    values = np.asarray(multihost_utils.process_allgather(out_B, tiled=True))[:len(index_B)]
    for row, i in enumerate(np.asarray(index_B).tolist()):
        if i >= 0:
            log_probs[i] = float(values[row])


def tsv(scores: Scores) -> str:
    """The header, then one row per pair: index (from 0), the target's tokens (EOS included),
    log_prob and log_prob / tokens; a pair not scored (too long) has empty score fields."""
    rows = [TSV_HEADER]
    for i, (lp, n) in enumerate(zip(scores.log_probs, scores.tokens, strict=True)):
        rows.append(f'{i}\t{n}\t\t\n' if lp is None else f'{i}\t{n}\t{lp:.6f}\t{lp / n:.6f}\n')
    return ''.join(rows)


def report(scores: Scores, max_len: int) -> str:
    """One line: what was scored, the totals, and the pairs left unscored as too long."""
    done = [(lp, n) for lp, n in zip(scores.log_probs, scores.tokens, strict=True)
            if lp is not None]
    total, tokens = sum(lp for lp, _ in done), sum(n for _, n in done)
    per_token = f'{total / tokens:.4f}' if tokens else 'n/a'
    return (f'scored {scores.scored} of {len(scores.log_probs)} pairs in {scores.seconds:.1f} s: '
            f'log_prob {total:.4f} over {tokens} target tokens (EOS included), {per_token} per '
            f'token; {len(scores.too_long)} pairs over max_position={max_len} tokens on a side '
            'not scored (empty fields)')


def _read_lines(path: str) -> list[str]:
    with open(path, encoding='utf-8', newline='\n') as f:  # lines end at '\n' only
        return [line.rstrip('\r\n') for line in f]


def run(config, workdir, *, input_path: str, references_path: str, output_path: str = '-',
        step: int | None = None, average_last: int = 0, echo: Callable[[str], None] = print,
        devices=None, weights: str = 'auto', ensemble: str = '') -> Scores:
    """evaluate.py --score: one checkpoint (--step, --average_last or the latest; its EMA or raw
    weights as evaluation's), or an ensemble's members ('DIR_OR_STEP,...', t2t/eval/ensemble.py),
    scores the pairs of two line-aligned files; the TSV goes to output_path ('-': stdout), from
    process 0."""
    from t2t.eval import averaging, evaluation
    from t2t.eval import checkpoints as eval_checkpoints
    from t2t.eval import ensemble as ensembles
    from t2t.infra import workdir as wd
    from t2t.run import checkpoint_read, startup

    startup.check_lengths(config)
    if not workdir:
        raise eval_checkpoints.EvalError('--workdir is required')
    if not input_path or input_path == '-' or not references_path:
        raise eval_checkpoints.EvalError('--score needs --input=FILE and --references=FILE')
    if ensemble and (step is not None or average_last):
        raise eval_checkpoints.EvalError('--ensemble names its members: it takes no --step or '
                                   '--average_last')
    try:
        sources, targets = _read_lines(input_path), _read_lines(references_path)
    except (OSError, UnicodeDecodeError) as e:
        raise eval_checkpoints.EvalError(f'--score: {e}') from e
    if len(sources) != len(targets):
        raise eval_checkpoints.EvalError(f'--input {input_path} has {len(sources)} lines but '
                                   f'--references {references_path} has {len(targets)}')
    tokenizer = evaluation.workdir_tokenizer(config, workdir)
    mesh = sharding.make_mesh((-1, 1, 1), devices)
    if ensemble:
        members = ensembles.resolve(config, workdir, ensemble, tokenizer, weights)
        label = ensembles.label(members)
        model_config = ensembles.model_configs(members)
        max_len = min(c.max_position for c in model_config)  # every member's table holds it
        params = ensembles.load_params(config, members, tokenizer, mesh)
    else:
        ((label, steps),) = eval_checkpoints.select(workdir, step=step, average_last=average_last)
        warning = average_last and averaging.wide_window(steps, config.average_fraction)
        if warning:
            echo(warning)
        evaluation.check_vocabulary(workdir, steps, tokenizer, label)
        model_config = TransformerConfig.from_config(config)
        max_len = config.max_position
        used = checkpoint_read.choose_weights(workdir, steps[-1], weights)
        label = eval_checkpoints.weights_label(label, used)
        params = eval_checkpoints.load_params(workdir, steps, scan_layers=config.scan_layers,
                                        weights=used)
        eval_checkpoints.check_params(params, model_config, tokenizer, label)
        params = sharding.put_global(params, sharding.replicated(mesh))
    score = make_score_fn(model_config, num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    scores = score_pairs(score, params, tokenizer, sources, targets, max_len=max_len,
                         token_budget=max(translate.DEFAULT_TOKEN_BUDGET, max_len), mesh=mesh)
    if jax.process_index() == 0:
        text = tsv(scores)
        if output_path == '-':
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            wd.write_atomic(wd.path(output_path), text)
        echo(f'== {label}: {report(scores, max_len)}')
    return scores
