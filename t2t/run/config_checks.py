"""The values each config key must have, checked before any data is read or compiled.

The first value a config gets wrong is one line naming the key, its value and what it needs:

    warmup_steps=0 must be >= 1 (the steps the learning rate rises over)
    max_len=300 exceeds max_position=256 (--config.max_len or --config.max_position)

Every rule lives once. The keys of the core's frozen dataclasses are checked by the dataclasses
themselves when `problem` makes them from the config: model.TransformerConfig, train_lib.StepConfig,
optim.OptimConfig and decode.DecodeConfig (their ValueError is already the one line). The
table below holds the rest: keys no dataclass has (data, loop, checkpoints, storage, trackers,
the mesh), values only a config has (attention_impl='auto') and rules between keys of different
objects (max_len against max_position); it answers first. `cli.check_values` prints the line for
every entry point (train.py, evaluate.py, sweep.py, t2t.data, t2t.export);
`startup.check_lengths` raises the length rules for the library's own callers. Whether the mesh
fits the devices needs the devices: startup.make_mesh, before data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from t2t import attention_choice, optim, sharding, train_lib
from t2t.data import hf, mixture, sources
from t2t.data.tokenizer import MIN_VOCAB_SIZE
from t2t.decode import DecodeConfig
from t2t.infra import trackers, uploads
from t2t.run import best

# Every length a config asks the model to handle; positions 0 .. length - 1 index the table.
LENGTH_KEYS = ('max_len', 'max_eval_len', 'max_decode_len')


@dataclasses.dataclass(frozen=True)
class Rule:
    key: str
    ok: Callable[[Any, Any], bool]  # (value, config) -> whether the value is usable
    needs: str  # follows 'key=value '; {c.other_key} reads another key of the config

    def problem(self, config) -> str | None:
        """The one line if config[key] breaks the rule, else None (also for a key not there)."""
        if self.key not in config or self.ok(config[self.key], config):
            return None
        return f'{self.key}={config[self.key]!r} {self.needs.format(c=config)}'


def _at_least(least) -> Callable:
    return lambda v, c: v >= least


def _one_of(choices) -> tuple[Callable, str]:
    return (lambda v, c: v in choices), f'must be one of {tuple(choices)}'


def _mesh(v, c, allow_rest: bool) -> bool:
    """A tuple of one size per mesh axis, each >= 1 (or, with allow_rest, one -1)."""
    if not isinstance(v, tuple | list) or len(v) != len(sharding.MESH_AXES):
        return False
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in v):
        return False
    rest = v.count(-1) if allow_rest else 0
    return rest <= 1 and all(n >= 1 for n in v if n != -1 or not allow_rest)


class _Why(str):
    """A rule's `needs` computed from the config: what exactly is wrong with a value whose
    problems are many (a mixture spec). Rule.problem formats it like any other."""

    def __new__(cls, why: Callable):
        self = super().__new__(cls, '')
        self.why = why
        return self

    def format(self, *args, **kwargs) -> str:
        return self.why(kwargs['c'])


def _cudnn_problem(config) -> str | None:
    """What keeps cuDNN flash attention from config on every GPU (the newest's limits)."""
    if config.d_model < 1 or config.num_heads < 1:
        return None  # their own rules answer
    return attention_choice.cudnn_problem(config, attention_choice.HOPPER)


GE1, GE0 = 'must be >= 1', 'must be >= 0'


def _data_rules() -> list[Rule]:
    """The corpus, its vocabulary, batches, mixtures and subword sampling."""
    return [
        # data
        Rule('dataset', *_one_of(sources.DATASETS)),
        Rule('hf_path', lambda v, c: c.dataset != 'hf' or hf.check(c) is None,
             _Why(lambda c: hf.check(c))),
        Rule('vocab_size', lambda v, c: c.dataset == 'recall' or v >= MIN_VOCAB_SIZE,
             f'must be >= {MIN_VOCAB_SIZE} (256 UTF-8 byte pieces, PAD/EOS/UNK and the '
             "corpus's characters)"),
        Rule('tokenizer_sentences', _at_least(1), GE1),
        Rule('tokenizer_character_coverage', lambda v, c: 0 < v <= 1, 'must be in (0, 1]'),
        Rule('data_wait_timeout_s', lambda v, c: v > 0, 'must be > 0 (seconds)'),
        Rule('batch_size', _at_least(1), GE1),
        Rule('eval_batch_size', _at_least(1), GE1),
        Rule('recall_length', _at_least(2), 'must be >= 2 (the first symbol and one other)'),
        Rule('recall_train_examples', _at_least(1), GE1),
        Rule('recall_eval_examples', _at_least(1), GE1),
        # mixtures and subword regularization (t2t/data/mixture.py, t2t/data/subword.py)
        Rule('train_mixture', lambda v, c: mixture.problem(v) is None,
             _Why(lambda c: f'is unusable: {mixture.problem(c.train_mixture)} (expected '
                            f'{mixture.FORMAT})')),
        Rule('train_mixture', lambda v, c: not v.strip() or c.dataset != 'recall',
             'needs dataset embedded, tfds or tsv (its training split trains the vocabulary)'),
        Rule('train_mixture', lambda v, c: not mixture.missing_files(v),
             _Why(lambda c: 'names TSV files that do not exist (or are not FILE.tsv / SRC,TGT): '
                            + ', '.join(mixture.missing_files(c.train_mixture)))),
        Rule('spm_alpha', lambda v, c: v >= 0, 'must be >= 0 (0: the 1-best segmentation)'),
        Rule('spm_alpha', lambda v, c: v == 0 or c.dataset != 'recall',
             'needs a sentencepiece vocabulary (dataset=recall has fixed symbols)'),
        Rule('spm_nbest_size', lambda v, c: v == -1 or v >= 2,
             'must be -1 (sample among every segmentation) or >= 2 (among the n best)'),
    ]


def _model_rules() -> list[Rule]:
    """The lengths the config asks of the model, and its kernel (values the config alone has:
    'auto', resolved for the devices). The model's own fields: TransformerConfig's checks."""
    return [
        *(Rule(key, _at_least(1), GE1) for key in ('max_len', 'max_eval_len')),
        # Longer sequences would read positions beyond the table (the model refuses them at
        # trace time too: model.Embedder); checked for rotary positions as well, so that a
        # config is valid or not whatever its position_embedding.
        *(Rule(key, lambda v, c: c.max_position < 1 or v <= c.max_position,
               f'exceeds max_position={{c.max_position}} (--config.{key} or '
               '--config.max_position)') for key in LENGTH_KEYS),
        Rule('attention_impl', *_one_of(attention_choice.IMPLS)),
        # cuDNN's conditions that no GPU meets; the device's own (platform, head dim on older
        # GPUs) are checked once the devices are known (cli.check_platform)
        Rule('attention_impl', lambda v, c: v != 'cudnn' or _cudnn_problem(c) is None,
             _Why(lambda c: f'cannot run: {_cudnn_problem(c)} (use auto or xla)')),
    ]


def _optim_rules() -> list[Rule]:
    """The batch and the length of training (the optimizer's own keys: optim.OptimConfig's)."""
    return [
        Rule('batch_size', lambda v, c: c.grad_accum_steps < 1 or v % c.grad_accum_steps == 0,
             'must be a multiple of grad_accum_steps={c.grad_accum_steps}'),
        Rule('num_train_steps', _at_least(1), GE1),
        Rule('train_time_budget_s', _at_least(0), 'must be >= 0 (0: no budget)'),
    ]


def _run_rules() -> list[Rule]:
    """The loop, checkpoints, evaluation, guards, storage, trackers and the mesh."""
    axes = ', '.join(sharding.MESH_AXES)
    return [
        # loop, checkpoints, evaluation
        Rule('log_every_steps', _at_least(1), GE1),
        Rule('eval_every_steps', _at_least(1), GE1),
        Rule('checkpoint_every_steps', _at_least(1), GE1),
        Rule('keep_checkpoints', _at_least(1), GE1),
        Rule('average_fraction', lambda v, c: 0 < v <= 1, 'must be in (0, 1] (the final part of '
             'a run whose checkpoints are averaged)'),
        Rule('num_eval_batches', lambda v, c: v >= 1 or v == -1, 'must be >= 1, or -1 for all'),
        Rule('eval_bleu_sentences', _at_least(0), 'must be >= 0 (0: no BLEU during training)'),
        # divergence guards (spike_skip: train_lib.StepConfig's)
        Rule('spike_window', _at_least(2), 'must be >= 2 (steps whose loss spread spike_skip '
             'measures)'),
        Rule('rollback_after', _at_least(0), 'must be >= 0 (0: off)'),
        Rule('rollback_after', lambda v, c: v == 0 or c.spike_skip > 0 or c.skip_nonfinite,
             'needs spike_skip > 0 or skip_nonfinite=True (the steps it counts are skipped ones)'),
        # best checkpoints and early stopping
        Rule('keep_best', _at_least(0), 'must be >= 0 (0: off)'),
        Rule('early_stopping_patience', _at_least(0), 'must be >= 0 (0: off)'),
        Rule('best_metric', *_one_of(best.METRICS)),
        Rule('best_metric', lambda v, c: not best.enabled(c) or v.startswith('loss')
             or c.eval_bleu_sentences > 0,
             'needs eval_bleu_sentences > 0 (BLEU and chrF are scored during training only then)'),
        Rule('best_metric', lambda v, c: not best.enabled(c) or not v.endswith('_ema')
             or c.ema_decay > 0, 'needs ema_decay > 0 (the EMA weights it ranks)'),
        Rule('straggler_factor', _at_least(0), 'must be >= 0 (0: off)'),
        Rule('straggler_min_s', _at_least(0), GE0),
        Rule('slow_save_s', _at_least(0), 'must be >= 0 (0: off)'),
        Rule('storage_outage_limit_s', lambda v, c: v == 0 or v >= uploads.BACKOFF_MAX_S,
             f'must be 0 (not retried) or >= {uploads.BACKOFF_MAX_S:g} s, the longest wait '
             'between two tries of a failed write (a shorter limit ends the run before its '
             'second try)'),
        Rule('storage_queue_mb', lambda v, c: v > 0,
             'must be > 0: the MiB of writes kept for a storage that does not answer'),
        Rule('trackers', lambda v, c: trackers.problem(v) is None,
             _Why(lambda c: trackers.problem(c.trackers))),
        Rule('wandb_mode', *_one_of(trackers.WANDB_MODES)),
        # devices
        Rule('mesh_shape', lambda v, c: _mesh(v, c, allow_rest=True),
             f'must be {len(sharding.MESH_AXES)} sizes ({axes}), each >= 1 or one -1 (the devices '
             'left), e.g. --config.mesh_shape=-1,1,1'),
        Rule('dcn_mesh_shape', lambda v, c: _mesh(v, c, allow_rest=False),
             f'must be {len(sharding.MESH_AXES)} sizes >= 1 ({axes}), e.g. '
             '--config.dcn_mesh_shape=2,1,1'),
    ]


def _rules() -> tuple[Rule, ...]:
    return (*_data_rules(), *_model_rules(), *_optim_rules(), *_run_rules())


RULES = _rules()


def problem(config, keys=None) -> str | None:
    """The first rule (of those on `keys`, default all) that config breaks, as one line; None
    when it breaks none. With every key: then what the core's dataclasses of the config refuse."""
    for rule in RULES:
        if keys is None or rule.key in keys:
            line = rule.problem(config)
            if line:
                return line
    if keys is None:
        if config.get('attention_impl') == attention_choice.AUTO:
            # The kernel is chosen once the devices are known; asking jax for them here would
            # start its backends before jax.distributed (cli.check_platform resolves it).
            config = config.copy_and_resolve_references()
            config.attention_impl = 'xla'
        for make in (train_lib.StepConfig.from_config, optim.OptimConfig.from_config,
                     DecodeConfig.from_config):
            try:
                make(config)
            except ValueError as e:
                return str(e).splitlines()[0]
    return None
