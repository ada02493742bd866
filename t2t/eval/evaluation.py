"""The logic of evaluate.py: pick checkpoints, decode a split, score it, write the results.

    run(config, workdir)                          # the latest checkpoint on config.test_split
    run(config, workdir, step=N)                  # one step
    run(config, workdir, all_steps=True)          # every checkpoint: a table step -> scores
    run(config, workdir, average_last=5, write_averaged=OUT)   # the paper's checkpoint average
    run(config, workdir, average_final=True)      # the run's final part averaged, or the last one
    run(config, workdir, translate=True, input_path='-', output_path='-')

Weights (weights='auto', 'ema' or 'raw'): a checkpoint of a run with ema_decay > 0 holds the moving
average of the params beside them; 'auto' evaluates it when there is one, else the raw params, and
the label of EMA weights ends in -ema (step-N-ema), so the two never share a line or a file.

Each evaluated checkpoint gets a label (step-N, or avgN-FIRST-LAST); its hypotheses go to
WORKDIR/hypotheses-<split>-<label>.txt (one line per example of the split, in order; the references
line for line in WORKDIR/references-<split>.txt, for sacrebleu's own tools such as --paired-bs) and
its scores into WORKDIR/eval-<split>.json, merged by label. Scores are over every example of the
split: an example skipped as longer than max_eval_len counts as an empty hypothesis, and is
counted.

Every user-facing failure is an EvalError (or checkpoint.CheckpointError, startup.ConfigError) with
a one-line message; lengths are checked against the position table before anything is read. With
--all, a checkpoint that fails to load is a `corrupt: ...` row of the table and the others go on.

Several processes (evaluate.py --coordinator_address=... on each): every process reads the
parameters, decodes its rows of each batch on its devices, and receives every hypothesis; only
process 0 prints and writes files. Checkpoints of any mesh or process count evaluate the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
from absl import logging

from t2t import sharding
from t2t.data import identity
from t2t.decode import DecodeConfig
from t2t.eval import averaging, bleu
from t2t.eval import predict as predict_lib
from t2t.eval.checkpoints import EvalError, check_params, load_params, select, weights_label
from t2t.eval.translate import translate_batches
from t2t.infra import workdir as wd
from t2t.model import TransformerConfig
from t2t.run import checkpoint, checkpoint_read, startup

NUM_SHOWN = 3  # source / reference / hypothesis triples printed per evaluation


# ----------------------------------------------------------------------------------------------
# Decoding and scoring


def _load_split(config, tokenizer, split: str):
    from t2t import data

    try:
        return data.eval_split(config, tokenizer, split)
    except (ValueError, OSError) as e:
        raise EvalError(f'cannot read split {split!r}: {e}') from e


def _write_lines(path, lines: list[str]) -> None:
    """One line per entry (a newline inside an entry would shift every later line), atomically."""
    from t2t.eval.translate import one_line

    wd.write_atomic(path, ''.join(one_line(line) + '\n' for line in lines))


def merge_json(path, label: str, record: dict) -> None:
    """Adds `record` under `label` to the JSON object in `path`: rewritten atomically, and no
    label is lost when several evaluate.py runs merge into it at once (workdir.update)."""

    def add(text: str | None) -> str:
        results = json.loads(text) if text else {}
        results[label] = record
        return json.dumps(results, indent=2, sort_keys=True) + '\n'

    wd.update(path, add)


def translate_and_score(predict, params, batches, tokenizer, eval_split, *, lang: str,
                        progress: bool = False, mesh=None, choose=None):
    """(translations, hypotheses, scores) of `batches`, the examples of `eval_split` in order,
    decoded on the devices of `mesh` and scored against its references (bleu.score_all). An
    example skipped as too long counts as an empty hypothesis: evaluate.py's reports and the
    BLEU of training (`make_bleu_eval`) are the same numbers."""
    result = translate_batches(predict, params, batches, tokenizer, len(eval_split.references),
                               progress=progress, mesh=mesh, choose=choose)
    missing = {i for i, h in enumerate(result.hypotheses) if h is None}
    if missing != set(eval_split.skipped):
        raise RuntimeError(f'{len(missing)} examples were not decoded but '
                           f'{len(eval_split.skipped)} were skipped')
    hypotheses = [h or '' for h in result.hypotheses]
    return result, hypotheses, bleu.score_all(hypotheses, eval_split.references, lang=lang)


def make_bleu_eval(config, model_config, tokenizer, eval_data, mesh):
    """The BLEU of training: a function params -> {'eval_bleu', 'eval_chrf'} on the first
    eval_bleu_sentences of `eval_data`, or None (eval_bleu_sentences=0).

    The sentences are decoded on every device of the mesh (each its own rows) and gathered back
    in order on every process.
    """
    if config.eval_bleu_sentences <= 0:
        return None
    predict = predict_lib.config_predict_fn(config, model_config,
                                            num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    n = min(config.eval_bleu_sentences, len(eval_data.references))
    head = dataclasses.replace(
        eval_data, sources=eval_data.sources[:n], references=eval_data.references[:n],
        inputs=eval_data.inputs[:n], targets=eval_data.targets[:n],
        skipped=tuple(i for i in eval_data.skipped if i < n))

    def run(params):
        _, _, scores = translate_and_score(predict, params, head.batches(config.eval_batch_size),
                                           tokenizer, head, lang=config.target_lang, mesh=mesh)
        return {'eval_bleu': scores['sacrebleu'], 'eval_chrf': scores['chrf']}

    return run


def evaluate_params(config, params, tokenizer, eval_split, *, split: str, label: str,
                    steps: list[int], workdir, progress: bool = True,
                    echo: Callable[[str], None] = print, mesh=None,
                    weights: str = 'raw', members=None, constraints=None, mbr=None) -> dict:
    """Decodes `eval_split` (on the devices of `mesh`, default one device), writes hypotheses
    (process 0) and scores, prints the report; returns the record. members: an ensemble's
    (t2t/eval/ensemble.py, params the tuple of theirs, already checked) instead of --config's
    model. constraints: the split's phrases (t2t/eval/terms.py Lines), for a constrained
    search. mbr: MBR decoding's settings (t2t/eval/mbr.py) instead of the config's decoding."""
    from t2t.eval import ensemble

    if members:
        model_config = ensemble.model_configs(members)
    else:
        model_config = TransformerConfig.from_config(config)
        check_params(params, model_config, tokenizer, label)
    n = len(eval_split.sources)
    decoding = _decoding(config, mbr)
    predict = predict_lib.make_predict_fn(model_config, decoding,
                                          num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    batches = eval_split.batches(config.eval_batch_size)
    if constraints is not None:
        batches = constraints.batches(batches)
    result, hypotheses, scores = translate_and_score(
        predict, params, batches, tokenizer, eval_split, lang=config.target_lang,
        progress=progress, mesh=mesh, choose=mbr.choose if mbr else None)

    hyp_path = wd.path(workdir, f'hypotheses-{_split_tag(split)}-{label}.txt')
    ref_path = wd.path(workdir, f'references-{_split_tag(split)}.txt')  # for sacrebleu's tests
    if jax.process_index() == 0:
        _write_lines(hyp_path, hypotheses)
        _write_lines(ref_path, eval_split.references)
    record = {
        **scores,
        'steps': steps,
        'weights': weights,
        **({'ensemble': ensemble.describe(members), 'ensemble_mean': 'log_prob'}
           if members else {}),
        'split': eval_split.name,
        'sentences': n,
        'skipped_too_long': len(eval_split.skipped),
        'hit_length_limit': len(result.hit_limit),
        'capped_at_max_decode_len': len(result.capped),
        'decode_strategy': 'mbr' if mbr else config.decode_strategy,
        **(mbr.record() if mbr else {}),
        **({key: config[key] for key in ('temperature', 'top_k', 'top_p', 'decode_seed')}
           if decoding.decode_strategy == 'sample' else {}),
        'beam_size': config.beam_size,
        'length_penalty_alpha': config.length_penalty_alpha,
        'beam_unfinished': config.beam_unfinished,
        'beam_stop': config.beam_stop,
        'max_decode_extra': config.max_decode_extra,
        'max_decode_len': config.max_decode_len,
        'decode_seconds': round(result.seconds, 3),
        'sentences_per_s': round(result.sentences_per_s, 3),
        'hypotheses_file': str(hyp_path),
        'references_file': str(ref_path),
    }
    if constraints is not None:
        record['constraints'] = constraints.record(hypotheses, result.unmet_constraints)

    described = mbr.describe(decoding) if mbr else predict_lib.describe(decoding)
    echo(f'== {label} on {eval_split.name} ({n} sentences, {described}, '
         f'{result.sentences_per_s:.1f} sentences/s)')
    echo(bleu.format_report(scores))
    echo(f'skipped (longer than max_eval_len={config.max_eval_len}, scored as empty): '
         f'{len(eval_split.skipped)}; ended at the length limit without EOS: '
         f'{len(result.hit_limit)}; of those cut by max_decode_len={config.max_decode_len}: '
         f'{len(result.capped)}')
    if result.capped:
        echo(f'WARNING: {len(result.capped)} hypotheses were truncated by max_decode_len; '
             'raise --config.max_decode_len')
    if constraints is not None:
        c = record['constraints']
        echo(f'constraints ({c["source"]}): {c["phrases_in_hypotheses"]} of {c["phrases"]} '
             f'phrases on {c["lines_with_phrases"]} lines appear in their hypotheses (term '
             f'accuracy {c["term_accuracy"]:.2f}%); best hypotheses without all their phrases\' '
             f'tokens (none with them fit the length limit): '
             f'{c["hypotheses_lacking_a_phrase_token_level"]}')
    shown = [i for i in range(n) if i not in set(eval_split.skipped)][:NUM_SHOWN]
    for i in shown:
        echo(f'  source     [{i}] {eval_split.sources[i]}')
        echo(f'  reference  [{i}] {eval_split.references[i]}')
        echo(f'  hypothesis [{i}] {hypotheses[i]}')
    echo(f'hypotheses -> {hyp_path} (references, line for line: {ref_path})')
    return record


def _decoding(config, mbr=None) -> DecodeConfig:
    """The config's decoding, or the one that yields MBR's candidates."""
    decoding = DecodeConfig.from_config(config)
    return mbr.decoding(decoding) if mbr else decoding


def _decoding_label(label: str, mbr, phrases: tuple[str, str]) -> str:
    """The label of an evaluation decoded by MBR (step-N-mbr-sample16-chrf) or under constraints
    (step-N-terminology, step-N-constraints): its hypotheses and scores kept apart from beam's."""
    constraints, terminology = phrases
    tags = [mbr.tag] if mbr else []
    tags += ['terminology'] if terminology else ['constraints'] if constraints else []
    return '-'.join([label, *tags])


def _split_tag(split: str) -> str:
    """A file-name-safe form of a split name such as 'test' or 'validation[:64]'."""
    return ''.join(c if c.isalnum() or c in '-_.' else '_' for c in split)


def scores_path(workdir, split: str):
    """WORKDIR/eval-<split>.json: the scores of each evaluated checkpoint, by label."""
    return wd.path(workdir, f'eval-{_split_tag(split)}.json')


def _table(results: dict[str, dict]) -> str:
    lines = [f'{"checkpoint":>24}  {"sacreBLEU":>9}  {"chrF":>6}  {"tok.BLEU":>8}  {"capped":>6}']
    for label, r in results.items():
        if 'corrupt' in r:
            lines.append(f'{label:>24}  corrupt: {r["corrupt"]}')
            continue
        lines.append(f'{label:>24}  {r["sacrebleu"]:9.2f}  {r["chrf"]:6.2f}  '
                     f'{r["tok_bleu_compound_split"]:8.2f}  {r["capped_at_max_decode_len"]:6d}')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------
# Entry


def workdir_tokenizer(config, workdir):
    """The vocabulary WORKDIR was trained with (its vocab.model, written by its first run); for a
    workdir from before t2t kept that copy, the config's prepared vocabulary. Never trains one."""
    from t2t import data

    try:
        if config.dataset == 'recall':  # fixed symbols: nothing trained, nothing to pin
            return data.get_tokenizer(config)
        path = identity.local_vocabulary(workdir, config.data_dir)
        if path is None:
            path = data.vocab_path(config)
            if not os.path.exists(path):
                raise EvalError(f'{wd.path(workdir, identity.VOCAB_NAME)} and {path} do not '
                                'exist: evaluate.py never trains a vocabulary (python -m t2t.data '
                                '--config=... prepares the config\'s)')
        return data.Tokenizer(path)
    except (ValueError, OSError) as e:
        raise EvalError(f'cannot load the tokenizer: {e}') from e


def check_vocabulary(workdir, steps: list[int], tokenizer, label: str) -> None:
    """The tokenizer is the one checkpoint `steps[-1]` was trained with (when it recorded it)."""
    saved = checkpoint_read.read_metadata(workdir, steps[-1]).get(identity.DATA_KEY)
    if saved and saved['vocab_sha256'] != identity.vocab_digest(tokenizer):
        raise EvalError(
            f'checkpoint {label} was trained with vocabulary {saved["vocab_sha256"][:12]} but '
            f'{tokenizer.path} is {identity.vocab_digest(tokenizer)[:12]}: its hypotheses would '
            'be other words (evaluate with the run\'s own WORKDIR/vocab.model)')


def _check_request(config, *, average_last: int, write_averaged: str, translate: bool,
                   all_steps: bool, nbest: int, mbr, input_path: str) -> None:
    """run()'s arguments that cannot go together: an EvalError of one line, before any work."""
    if write_averaged and not average_last:
        raise EvalError('--write_averaged needs --average_last=N')
    if translate and all_steps:
        raise EvalError('--translate takes one checkpoint: --step, --average_last or the latest')
    if nbest != 1 and not translate:
        raise EvalError(f'--nbest={nbest} needs --translate')
    if mbr and nbest != 1:
        raise EvalError('--nbest and --mbr_samples both choose the output: give one of them')
    try:
        DecodeConfig.from_config(config, nbest=nbest)  # --nbest against the beam
        _decoding(config, mbr)  # MBR's n-best against the beam
    except ValueError as e:
        raise EvalError(str(e)) from e
    if translate and input_path == '-' and jax.process_count() > 1:
        raise EvalError('with several processes --translate reads --input=FILE, not stdin')


def run(config, workdir, *, step: int | None = None, all_steps: bool = False,
        average_last: int = 0, average_final: bool = False, write_averaged: str = '',
        split: str = '', translate: bool = False, input_path: str = '-', output_path: str = '-',
        truncate_long: bool = False, nbest: int = 1, progress: bool = True,
        echo: Callable[[str], None] = print, devices=None,
        weights: str = 'auto', ensemble: str = '', constraints: str = '',
        terminology: str = '', mbr=None) -> dict[str, dict]:
    """Everything evaluate.py does; returns {label: record} (empty for --translate).

    Decodes on `devices` (default: all devices of all processes). ensemble: 'DIR_OR_STEP,...',
    decode with those checkpoints together (t2t/eval/ensemble.py) instead of one. constraints /
    terminology: a file of phrases per source line / of terms (t2t/eval/terms.py). mbr: MBR
    decoding (t2t/eval/mbr.py MBR) instead of the config's decoding. average_final: the mean of
    the checkpoints of the run's final config.average_fraction of steps or the last checkpoint,
    whichever has the lower validation NLL (t2t/eval/averaging.py).
    """
    startup.check_lengths(config)
    if not workdir:
        raise EvalError('--workdir is required')
    _check_request(config, average_last=average_last, write_averaged=write_averaged,
                   translate=translate, all_steps=all_steps, nbest=nbest, mbr=mbr,
                   input_path=input_path)
    if ensemble:
        if step is not None or all_steps or average_last or average_final or write_averaged:
            raise EvalError('--ensemble names its members: it takes no --step, --all, '
                            '--average_last, --average_final or --write_averaged')
        return _run_ensemble(config, workdir, ensemble, split=split, translate=translate,
                             input_path=input_path, output_path=output_path,
                             truncate_long=truncate_long, nbest=nbest, progress=progress,
                             echo=echo, devices=devices, weights=weights,
                             phrases=(constraints, terminology), mbr=mbr)
    selection = select(workdir, step=step, all_steps=all_steps, average_last=average_last,
                       average_final=config.average_fraction if average_final else 0.0)
    tokenizer = workdir_tokenizer(config, workdir)
    mesh = sharding.make_mesh((-1, 1, 1), devices)  # decoding: every device its own rows
    if jax.process_index() != 0:
        echo, progress = (lambda _: None), False

    for label, steps in selection:
        check_vocabulary(workdir, steps, tokenizer, label)
    if average_last:
        warning = averaging.wide_window(selection[0][1], config.average_fraction)
        if warning:
            echo(warning)
    loaded, on_validation = {}, {}  # --average_final: the chosen params, both candidates' NLL
    if average_final and len(selection[0][1]) > 1:
        selection, loaded, on_validation = _average_or_last(
            config, workdir, selection[0], tokenizer, mesh, weights, echo)
    elif average_final:
        echo(f'--average_final: the run\'s final average_fraction={config.average_fraction:g} '
             f'of its steps holds one checkpoint ({selection[0][0]}): nothing to average')
    if translate:
        label, steps = selection[0]
        file_phrases = _constraints(config, tokenizer, constraints, terminology, input_path)
        params, _ = loaded.get(label) or _params_for(config, workdir, label, steps,
                                                     write_averaged, mesh, weights)
        check_params(params, TransformerConfig.from_config(config), tokenizer, label)
        translate_file(config, params, tokenizer, input_path, output_path, mesh,
                       truncate_long=truncate_long, nbest=nbest, constraints=file_phrases,
                       mbr=mbr)
        return {}

    split = split or config.test_split
    eval_split = _load_split(config, tokenizer, split)
    split_phrases = _split_phrases(config, tokenizer, constraints, terminology, eval_split)
    json_path = scores_path(workdir, split)
    results = {}
    for label, steps in selection:
        try:
            params, used = loaded.get(label) or _params_for(config, workdir, label, steps,
                                                            write_averaged, mesh, weights)
        except checkpoint.CorruptCheckpointError as e:
            if len(selection) == 1:
                raise
            echo(f'== {label}: corrupt: {e}')  # --all: report it and go on
            results[label] = {'corrupt': str(e), 'steps': steps}
            continue
        label = _decoding_label(weights_label(label, used), mbr, (constraints, terminology))
        record = evaluate_params(config, params, tokenizer, eval_split, split=split, label=label,
                                 steps=steps, workdir=workdir, progress=progress, echo=echo,
                                 mesh=mesh, weights=used, constraints=split_phrases, mbr=mbr)
        if on_validation:  # chosen over the other candidate by validation NLL
            record['chosen_by_validation_nll'] = on_validation
        if jax.process_index() == 0:
            merge_json(json_path, label, record)
        results[label] = record
    if len(results) > 1:
        echo(_table(results))
    echo(f'scores -> {json_path}')
    return results


def _run_ensemble(config, workdir, spec: str, *, split: str, translate: bool, input_path: str,
                  output_path: str, truncate_long: bool, nbest: int, progress: bool, echo,
                  devices, weights: str, phrases: tuple[str, str], mbr=None) -> dict[str, dict]:
    """run() for --ensemble: its members decode together; results go to --workdir."""
    from t2t.eval import ensemble

    tokenizer = workdir_tokenizer(config, workdir)
    members = ensemble.resolve(config, workdir, spec, tokenizer, weights)  # before any restore
    mesh = sharding.make_mesh((-1, 1, 1), devices)
    if jax.process_index() != 0:
        echo, progress = (lambda _: None), False
    if translate:
        file_phrases = _constraints(config, tokenizer, *phrases, input_path)
    else:
        split = split or config.test_split
        eval_split = _load_split(config, tokenizer, split)
        split_phrases = _split_phrases(config, tokenizer, *phrases, eval_split)
    params = ensemble.load_params(config, members, tokenizer, mesh)
    if translate:
        translate_file(config, params, tokenizer, input_path, output_path, mesh,
                       truncate_long=truncate_long, nbest=nbest, members=members,
                       constraints=file_phrases, mbr=mbr)
        return {}
    label = _decoding_label(ensemble.label(members), mbr, phrases)
    record = evaluate_params(config, params, tokenizer, eval_split, split=split, label=label,
                             steps=[m.step for m in members], workdir=workdir,
                             progress=progress, echo=echo, mesh=mesh,
                             weights='+'.join(m.weights for m in members), members=members,
                             constraints=split_phrases, mbr=mbr)
    json_path = scores_path(workdir, split)
    if jax.process_index() == 0:
        merge_json(json_path, label, record)
    echo(f'scores -> {json_path}')
    return {label: record}


def _constraints(config, tokenizer, constraints_path: str, terminology_path: str,
                 input_path: str):
    """--constraints / --terminology for --translate --input (t2t/eval/terms.py), or None."""
    from t2t.eval import terms

    if (constraints_path or terminology_path) and input_path == '-':
        raise EvalError('--constraints and --terminology read --input=FILE, not stdin')
    num_lines = 0
    if constraints_path:
        from t2t.eval import translate

        num_lines = translate.count_lines(input_path)
    return terms.load(config, tokenizer, constraints_path=constraints_path,
                      terminology_path=terminology_path, num_lines=num_lines)


def _split_phrases(config, tokenizer, constraints_path: str, terminology_path: str, eval_split):
    """--constraints / --terminology for a split: its lines' phrases, checked (or None)."""
    from t2t.eval import terms

    loaded = terms.load(config, tokenizer, constraints_path=constraints_path,
                        terminology_path=terminology_path, num_lines=len(eval_split.sources))
    if loaded is None:
        return None
    skipped = set(eval_split.skipped)
    source_ids = [[] if i in skipped else ids for i, ids in enumerate(eval_split.inputs)]
    return terms.lines(loaded, 0, eval_split.sources, source_ids)
def _average_or_last(config, workdir, entry, tokenizer, mesh, weights, echo):
    """([(label, steps)] of the better, by validation NLL, of the average `entry` and its last
    checkpoint, {label: (params, weights)} of it, {weights label: validation NLL} of both)."""
    label, steps = entry
    echo(f'--average_final: steps {steps[0]}-{steps[-1]}, the checkpoints of the run\'s final '
         f'average_fraction={config.average_fraction:g} of its {steps[-1]} steps, against the '
         'last checkpoint')
    entries = {label: steps, f'step-{steps[-1]}': steps[-1:]}
    loaded = {name: _params_for(config, workdir, name, chosen, '', mesh, weights)
              for name, chosen in entries.items()}
    shown = {}  # weights label (step-N-ema for EMA weights) -> label
    for name, (params, used) in loaded.items():
        check_params(params, TransformerConfig.from_config(config), tokenizer, name)
        shown[weights_label(name, used)] = name
    average, last = ((shown_name, loaded[name][0]) for shown_name, name in shown.items())
    try:
        chosen, metrics = averaging.choose(config, tokenizer, mesh, average, last, echo)
    except ValueError as e:
        raise EvalError(str(e)) from e
    nll = {shown_name: round(m['nll'], 6) for shown_name, m in metrics.items()}
    name = shown[chosen]
    return [(name, entries[name])], {name: loaded[name]}, nll


def _params_for(config, workdir, label, steps, write_averaged, mesh, weights='auto'):
    """(the params of `steps` (averaged when several), replicated once on the mesh's devices,
    the weights they are: 'raw' or 'ema')."""
    used = checkpoint_read.choose_weights(workdir, steps[-1], weights)
    params = load_params(workdir, steps, scan_layers=config.scan_layers, weights=used)
    if write_averaged and len(steps) > 1:
        # The run's vocabulary digest goes along: the average is then an --ensemble member.
        data_identity = checkpoint_read.read_metadata(workdir, steps[-1]).get(identity.DATA_KEY)
        out = checkpoint.write_averaged(
            write_averaged, params, steps[-1], config=config,
            extra_metadata={'averaged': steps, 'source': workdir, 'weights': used,
                            **({identity.DATA_KEY: data_identity} if data_identity else {})})
        logging.info('averaged checkpoint %s -> %s', weights_label(label, used), out)
    return sharding.put_global(params, sharding.replicated(mesh)), used


def translate_file(config, params, tokenizer, input_path: str, output_path: str,
                   mesh=None, truncate_long: bool = False, nbest: int = 1,
                   members=None, constraints=None, mbr=None) -> None:
    """Translates the lines of a file (or stdin, '-') into a file (or stdout, '-'), in order,
    streamed and resumable (t2t/eval/translate.py); nbest > 1: beam search's best nbest per line as
    TSV. With several processes each reads the file and decodes its rows; process 0 writes.
    members: an ensemble's (t2t/eval/ensemble.py), params the tuple of theirs. constraints:
    t2t/eval/terms.py Constraints, each line's phrases. mbr: each line's MBR choice
    (t2t/eval/mbr.py)."""
    from t2t.eval import ensemble, translate

    if members:
        model_config = ensemble.model_configs(members)
        max_len = min(c.max_position for c in model_config)  # every member's table holds it
    else:
        model_config = TransformerConfig.from_config(config)
        max_len = config.max_position
    decoding = _decoding(config, mbr) if mbr else DecodeConfig.from_config(config, nbest=nbest)
    predict = predict_lib.make_predict_fn(model_config, decoding,
                                          num_valid_ids=tokenizer.vocab_size, mesh=mesh)
    try:
        stats = translate.translate_stream(
            predict, params, tokenizer, input_path, output_path, max_len=max_len,
            token_budget=max(translate.DEFAULT_TOKEN_BUDGET, max_len),
            truncate_long=truncate_long, mesh=mesh, write=jax.process_index() == 0,
            nbest_alpha=config.length_penalty_alpha if nbest > 1 else None,
            progress=output_path != '-' and jax.process_index() == 0, constraints=constraints,
            choose=mbr.choose if mbr else None)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise EvalError(f'--translate {input_path} -> {output_path}: {e}') from e
    if stats.too_long:
        logging.warning('%d lines are longer than max_position=%d tokens: %s', stats.too_long,
                        max_len, 'truncated' if truncate_long else 'left empty')
    if stats.capped:
        logging.warning('%d translations were truncated by max_decode_len=%d', stats.capped,
                        config.max_decode_len)
    if stats.unmet_constraints:
        logging.warning('%d translations lack one of their phrases (%s): none with all of them '
                        'fit the length limit', stats.unmet_constraints, constraints.what)
