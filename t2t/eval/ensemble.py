"""Ensembles for evaluate.py --ensemble=DIR_OR_STEP,...: who the members are, their checks, params.

    members = ensemble.resolve(config, workdir, 'runs/b,runs/c,3000', tokenizer)
    params = ensemble.load_params(config, members, tokenizer, mesh)   # a tuple, one per member
    predict = predict_lib.config_predict_fn(config, ensemble.model_configs(members), ...)

A member is a workdir (its latest checkpoint) or a step of --workdir (a bare integer); the same
one may appear twice. Each brings its own model: its architecture (every TransformerConfig field
but how to run it, RUNTIME_FIELDS) is the config its checkpoint recorded, so members may differ
in size and layout; dtype, attention kernel and layer layout come from --config. Every member
must have been trained with --workdir's vocabulary, the one the hypotheses are detokenized with:
its checkpoint's recorded vocabulary digest (or its WORKDIR/vocab.model's) is compared with it,
and a difference is one line before anything is restored or compiled.

The search (t2t/eval/predict.py) reads at every step the arithmetic mean of the members'
log-probabilities (log_softmax of each one's logits), as OpenNMT-py and Marian combine them; it is
not renormalized, so the beam score of a hypothesis is the mean of its members' scores. fairseq
averages the probabilities instead (the log of the mean of softmaxes).
"""

from __future__ import annotations

import dataclasses
import os

from t2t import sharding
from t2t.data import identity
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval.checkpoints import EvalError
from t2t.infra import workdir as wd
from t2t.model import TransformerConfig
from t2t.run import checkpoint_read

# How a model is run rather than what was trained: taken from --config for every member.
RUNTIME_FIELDS = frozenset({'dtype', 'attention_impl', 'remat', 'scan_layers', 'deterministic',
                            'decode', 'decode_len', 'sow_attention', 'table_copies'})
DECODE_LENGTHS = ('max_eval_len', 'max_decode_len')  # must fit each member's position table


@dataclasses.dataclass(frozen=True)
class Member:
    workdir: str
    step: int
    weights: str  # 'raw' or 'ema'
    model_config: TransformerConfig
    label: str  # step-N for a step of --workdir, <workdir name>-step-N for another (-ema)


def _name(workdir) -> str:
    """A file-name-safe short name of a workdir (its last path component)."""
    base = os.path.basename(os.fspath(workdir).rstrip('/')) or 'workdir'
    return ''.join(c if c.isalnum() or c in '-_.' else '_' for c in base)


def member_model_config(config, saved: dict | None) -> TransformerConfig:
    """--config's model with the architecture a checkpoint recorded (its config JSON)."""
    base = TransformerConfig.from_config(config)
    arch = {f.name: saved[f.name] for f in dataclasses.fields(TransformerConfig)
            if saved and f.name not in RUNTIME_FIELDS and f.name in saved}
    return base.replace(**arch)


def _digest(meta: dict, workdir, config) -> str | None:
    """The vocabulary digest a checkpoint recorded, else its workdir's vocab.model's."""
    recorded = (meta.get(identity.DATA_KEY) or {}).get('vocab_sha256')
    if recorded:
        return recorded
    path = identity.local_vocabulary(workdir, config.data_dir)
    return identity.sha256_file(path) if path else None


def resolve(config, workdir, spec: str, tokenizer, weights: str = 'auto') -> list[Member]:
    """The members of `spec` ('DIR_OR_STEP,...'), checked: at least two, each checkpoint there,
    one vocabulary (the tokenizer's), decode lengths within each position table. Reads only
    checkpoint metadata; every problem is an EvalError of one line."""
    items = [item.strip() for item in spec.split(',')]
    if len(items) < 2 or not all(items):
        raise EvalError(f'--ensemble={spec!r}: give two or more members, '
                                   'comma-separated, each a workdir or a step of --workdir')
    want = identity.vocab_digest(tokenizer)
    members = []
    for item in items:
        own = item.isdigit()
        where = workdir if own else item
        steps = eval_checkpoints.list_steps(where)
        step = int(item) if own else steps[-1]
        if step not in steps:
            raise EvalError(f'--ensemble member {item}: no checkpoint for step {step} '
                                       f'in {workdir}; have {steps}')
        label = f'step-{step}' if own else f'{_name(where)}-step-{step}'
        meta = checkpoint_read.read_metadata(where, step)
        digest = _digest(meta, where, config)
        if digest is None and not own:
            raise EvalError(
                f'--ensemble member {item}: {wd.path(where, identity.VOCAB_NAME)} is missing and '
                'its checkpoint records no vocabulary: cannot check it shares --workdir\'s')
        if digest is not None and digest != want:
            raise EvalError(
                f'--ensemble member {item} was trained with vocabulary {digest[:12]} but '
                f'--workdir {workdir} decodes with {want[:12]} ({tokenizer.path}): members '
                'must share one vocabulary')
        try:
            model_config = member_model_config(config, meta.get('config'))
        except (ValueError, TypeError) as e:
            raise EvalError(f'--ensemble member {item}: its recorded config does not '
                                       f'make a model: {e}') from e
        for key in DECODE_LENGTHS:
            if config[key] > model_config.max_position:
                raise EvalError(
                    f'--ensemble member {item}: --config.{key}={config[key]} exceeds its '
                    f'max_position={model_config.max_position}')
        used = checkpoint_read.choose_weights(where, step, weights)
        members.append(Member(workdir=os.fspath(where), step=step, weights=used,
                              model_config=model_config,
                              label=eval_checkpoints.weights_label(label, used)))
    return members


def label(members: list[Member]) -> str:
    """The ensemble's label: its members' labels, e.g. ens-step-3+other-step-5."""
    return 'ens-' + '+'.join(m.label for m in members)


def model_configs(members: list[Member]) -> tuple[TransformerConfig, ...]:
    return tuple(m.model_config for m in members)


def describe(members: list[Member]) -> list[dict]:
    """What the evaluation record says of each member."""
    return [{'workdir': m.workdir, 'step': m.step, 'weights': m.weights,
             'd_model': m.model_config.d_model,
             'layers': [m.model_config.num_encoder_layers, m.model_config.num_decoder_layers]}
            for m in members]


def load_params(config, members: list[Member], tokenizer, mesh) -> tuple:
    """Each member's params (checked against its model and the tokenizer), replicated once on
    the mesh's devices."""
    params = []
    for m in members:
        p = eval_checkpoints.load_params(m.workdir, [m.step], scan_layers=config.scan_layers,
                                   weights=m.weights)
        eval_checkpoints.check_params(p, m.model_config, tokenizer, m.label)
        params.append(sharding.put_global(p, sharding.replicated(mesh)))
    return tuple(params)
