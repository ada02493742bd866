"""Mutation check: does the suite catch deliberate breaks of the paper and of the config wiring?

    python scripts/mutants.py              # every mutant (a few minutes on 2 cores)
    python scripts/mutants.py --list       # the list: name, file, the tests that must catch it
    python scripts/mutants.py --only=embedding_scale,alpha_ignored --jobs=2

Each mutant names a function as MODULE:QUALNAME ('model:Embedder.__call__': the module found by
its name anywhere under t2t/, so moving a file between packages keeps the mutant) and a piece of
text inside that function (runs of whitespace match any whitespace, so re-wrapping keeps it). The
text must occur exactly once in the function, else the mutant is reported stale, not skipped. It
is replaced, and only the tests named for it run, in a temporary copy of the repository.
Caught: those tests fail (pytest exit 1). The unmutated copy runs the union of the named tests
first: they must pass, or nothing could be concluded. Exit status 0 when every mutant is caught.

Not part of `make test`: every mutant is a separate pytest process with its own compiles.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REF = 'tests/test_reference.py::test_logits_equal_the_papers_equations_on_padded_and_packed_rows'
_BEAM = 'tests/test_reference.py::test_wide_beam_search_equals_exhaustive_search_of_the_reference'
_SET = 'tests/test_settings.py::'


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    where: str  # MODULE:QUALNAME of the function holding the text
    old: str
    new: str
    tests: tuple[str, ...]
    what: str  # the break, in words


MUTANTS = (
    # --- the audit's three survivors
    Mutant('embedding_scale', 'model:Embedder.__call__', 'x_BLD = x_BLD * math.sqrt(cfg.d_model)',
           'x_BLD = x_BLD', (_REF,), 'embeddings no longer multiplied by sqrt(d_model)'),
    Mutant('alpha_ignored', 'predict:_search',
           'alpha=decoding.length_penalty_alpha, eos_id=eos_id', 'alpha=0.0, eos_id=eos_id',
           (_SET + 'test_decoding_settings_reach_the_search',),
           'the search is passed alpha=0.0 (no length penalty)'),
    Mutant('eval_drops_last_batch', 'validation:evaluate_loss',
           'for i, batch in enumerate(batches):',
           'for i, batch in enumerate(list(batches)[:-1]):',
           (_SET + 'test_validation_metrics_equal_a_direct_computation_over_the_whole_split',),
           'the validation loss drops its last batch'),
    # --- the paper
    Mutant('causal_mask_off', 'attention:attention_mask', '    if causal:\n        q, k =',
           '    if False:\n        q, k =', (_REF,), 'the decoder sees future targets'),
    Mutant('post_ln_order', 'model:Residual.__call__',
           'return out_BLD if cfg.pre_ln else norm(out_BLD)',
           'return out_BLD if cfg.pre_ln else x_BLD + norm(y_BLD)', (_REF,),
           'post-LN as x + LayerNorm(Sublayer(x)) instead of LayerNorm(x + Sublayer(x))'),
    Mutant('relu_replaced', 'model:FeedForward.__call__', 'h_BLF = nn.relu(h_BLF)',
           'h_BLF = nn.gelu(h_BLF)',
           (_REF,), 'GELU in the feed-forward instead of ReLU'),
    Mutant('tied_softmax_scaled', 'model:Transformer.logits',
           'logits_BTV = self.target_embedder.attend(y_BTD)',
           'logits_BTV = self.target_embedder.attend(y_BTD * math.sqrt(self.config.d_model))',
           (_REF,),
           'the tied output projection multiplied by sqrt(d_model)'),
    Mutant('attention_bias_dropped', 'attention:_head_projection', 'use_bias=cfg.attention_bias,',
           'use_bias=False,',
           ('tests/test_model.py::test_parameter_counts_equal_the_papers_architecture',),
           'attention_bias=True builds q/k/v/o projections without biases'),
    Mutant('cross_mask_ignores_source_padding', 'model:Transformer.decode',
           'cross_mask_B1TS = make_attention_mask(cfg.attention_impl, tgt_valid_BT, src_valid_BS,',
           'cross_mask_B1TS = make_attention_mask(cfg.attention_impl, tgt_valid_BT, '
           'jnp.ones_like(src_valid_BS),', (_REF,),
           'cross-attention attends to source padding'),
    Mutant('packed_segment_mask_off', 'attention:attention_mask',
           'mask &= q_segment_BQ[:, :, None] == k_segment_BK[:, None, :]', 'pass',
           (_REF, _SET + 'test_packed_batch_loss_and_gradients_equal_its_pairs_one_by_one'),
           'attention leaks across packed pairs'),
    Mutant('warmup_exponent', 'optim:learning_rate_schedule', 'warmup_factor = warmup_steps**-1.5',
           'warmup_factor = warmup_steps**-1.0', ('tests/test_optim.py',),
           'warmup schedule with warmup^-1 instead of warmup^-1.5'),
    Mutant('adam_beta2', 'optim:make_optimizer', 'b2=config.adam_b2', 'b2=0.999',
           ('tests/test_optim.py', _SET + 'test_accumulation_with_dropout_and_adam_equals_the_'
            'micro_batches_added_by_hand'), "Adam's beta2 fixed at 0.999"),
    Mutant('label_smoothing_formula', 'loss:_smoothing_weights',
           '    return 1.0 - smoothing, smoothing / (vocab - 1)\n',
           '    return 1.0 - smoothing, smoothing / vocab\n',
           (_SET + 'test_validation_metrics_equal_a_direct_computation_over_the_whole_split',),
           'label smoothing spreads over V instead of V - 1 tokens (the loss value)'),
    Mutant('length_penalty_formula', 'decode:length_penalty', 'jnp.power((5.0 + length) / 6.0,',
           'jnp.power((1.0 + length) / 6.0,',
           ('tests/test_decode.py::test_length_penalty_is_gnmt_formula',
            'tests/test_decode.py::test_wide_beam_equals_exhaustive_search_per_example_limits'),
           'length penalty (1 + |Y|) / 6'),
    Mutant('eos_does_not_end', 'decode:_beam_step',
           'ended_BC = (token_BC == eos_id) | (length >= state.limit_B[:, None])',
           'ended_BC = length >= state.limit_B[:, None]', (_BEAM,),
           'beam search hypotheses do not end at EOS'),
    Mutant('checkpoint_average', 'checkpoint_read:average_checkpoints',
           '(t / len(steps)).astype(r.dtype)',
           '(t / (len(steps) + 1)).astype(r.dtype)',
           ('tests/test_checkpoint.py::test_keeps_last_k_and_averages',),
           'checkpoint averaging divides by n + 1'),
    # --- this issue: every setting reaches its code
    Mutant('label_smoothing_from_config', 'train_lib:StepConfig.from_config',
           'label_smoothing=config.label_smoothing,', 'label_smoothing=0.1,',
           (_SET + 'test_label_smoothing_reaches_the_loss_and_its_gradient',),
           'label_smoothing of the config ignored (always 0.1)'),
    Mutant('scale_attention_ignored', 'attention:MultiHeadAttention.__call__',
           'scale = cfg.head_dim ** -0.5 if cfg.scale_attention else 1.0',
           'scale = cfg.head_dim ** -0.5', (_REF,), 'scale_attention=False has no effect'),
    Mutant('scale_embeddings_ignored', 'model:Embedder.__call__', 'if cfg.scale_embeddings:',
           'if True:',
           (_REF,), 'scale_embeddings=False has no effect'),
    Mutant('beam_size_ignored', 'decode:DecodeConfig.from_config',
           'beam_size=config.beam_size,', 'beam_size=4,',
           (_SET + 'test_beam_size_reaches_the_search',),
           'DecodeConfig.from_config decodes with 4 beams whatever beam_size says'),
    Mutant('max_decode_extra_ignored', 'decode:DecodeConfig.from_config',
           'max_decode_extra=config.max_decode_extra,', 'max_decode_extra=50,',
           (_SET + 'test_decoding_settings_reach_the_search',),
           'DecodeConfig.from_config allows source length + 50 whatever max_decode_extra says'),
    Mutant('attention_dropout_rate', 'attention:MultiHeadAttention.__call__',
           'dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,',
           'dropout_rate=cfg.attention_dropout_rate / 2, dropout_rng=dropout_rng,',
           (_SET + 'test_attention_dropout_rate_on_the_attention_weights',),
           'attention weights dropped at half of attention_dropout_rate'),
    Mutant('relu_dropout_rate', 'model:FeedForward.__call__', 'Dropout(cfg.relu_dropout_rate)',
           'Dropout(cfg.dropout_rate)',
           (_SET + 'test_dropout_rates_reach_every_site_at_their_values',),
           'ReLU activations dropped at dropout_rate, not relu_dropout_rate'),
    Mutant('dropout_scale', 'dropout:dropout', '(1.0 / keep_probability(rate))',
           '(1.0 / (1.0 - rate))',
           (_SET + 'test_dropout_rates_reach_every_site_at_their_values',),
           'kept values scaled by 1 / (1 - rate), not by the exact inverse keep probability'),
    Mutant('perplexity_of_smoothed_loss', 'train_lib:summarize_metrics',
           "'perplexity': math.exp(min(nll, 50.0)),",
           "'perplexity': math.exp(min(float(sums['loss_sum']) / tokens, 50.0)),",
           (_SET + 'test_validation_metrics_equal_a_direct_computation_over_the_whole_split',),
           'perplexity from the smoothed loss instead of the NLL'),
    # --- this issue: packed training, accumulation
    Mutant('shift_right_across_pairs', 'model:shift_right',
           'shifted = jnp.where(segment_ids_BT == prev_segment, shifted, PAD_ID)',
           'shifted = shifted',
           (_SET + 'test_packed_batch_loss_and_gradients_equal_its_pairs_one_by_one',),
           "a packed pair's first decoder input is the previous pair's last token"),
    Mutant('micro_batches_share_rng', 'train_lib:train_step',
           'jax.random.fold_in(step_rng, index),', 'step_rng,',
           (_SET + 'test_accumulation_with_dropout_and_adam_equals_the_micro_batches_added_'
            'by_hand',), 'every micro-batch draws the same dropout masks'),
    # --- this issue: strong assertions on scores and order
    Mutant('scores_swapped', 'evaluation:translate_and_score',
           'bleu.score_all(hypotheses, eval_split.references,',
           'bleu.score_all(eval_split.references, hypotheses,',
           ('tests/test_evaluate.py::test_latest_checkpoint_writes_scores_and_hypotheses_in_order',
            'tests/test_train.py::test_train_leaves_checkpoints_events_and_metrics'),
           "evaluate.py and training's BLEU/chrF score references against hypotheses"),
    Mutant('translate_order_reversed', 'translate:translate_stream',
           'for h in result.hypotheses)',
           'for h in result.hypotheses[::-1])',
           ('tests/test_evaluate.py::test_translate_keeps_line_order',),
           'translated lines written in reverse order'),
    Mutant('sweep_done_by_exit_status', 'runner:outcome',
           'the exit status says\n        return finished_state(finished)\n',
           'the exit status says\n        return finished_state(finished)\n'
           '    if returncode == 0:\n        return finished_state({})\n',
           ('tests/test_sweep.py::'
            'test_a_point_is_done_by_its_training_finished_marker_not_its_exit_status',),
           'a sweep point that exits 0 counts as done without its TRAINING_FINISHED marker'),
)


def _copy_repo(dest: str) -> None:
    """The working tree without .git, virtual environments, caches and run outputs."""
    anywhere = {'.git', '__pycache__', '.pytest_cache', '.ruff_cache'}
    top = {'.venv', 'data', 'runs', 'workdirs'}  # t2t/data is code: only the top-level ones

    def ignore(directory, names):
        return [n for n in names if n in anywhere
                or (n in top and os.path.samefile(directory, ROOT))]

    shutil.copytree(ROOT, dest, ignore=ignore)


def _functions(tree: ast.Module):
    """(qualified name, node) of every function and method of a module, nested ones included."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    yield name, child
                yield from visit(child, name + '.')
    yield from visit(tree, '')


def locate(repo: str, where: str) -> tuple[str, int, int]:
    """(path, start offset, end offset) of the function MODULE:QUALNAME under repo/t2t."""
    module, qualname = where.split(':')
    paths = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(repo, 't2t'))
             for f in files if f == module + '.py']
    found = []
    for path in paths:
        with open(path, encoding='utf-8') as f:
            text = f.read()
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        found += [(path, starts[node.lineno - 1], starts[node.end_lineno])
                  for name, node in _functions(ast.parse(text)) if name == qualname]
    if len(found) != 1:
        raise LookupError(f'{where} names {len(found)} functions under t2t/, not one')
    return found[0]


def mutate(repo: str, mutant: Mutant) -> tuple[str, str]:
    """(path, the file's text with the mutant's text replaced inside its function)."""
    path, start, end = locate(repo, mutant.where)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    pattern = re.compile(r'\s+'.join(re.escape(part) for part in mutant.old.split()))
    body = text[start:end]
    matches = list(pattern.finditer(body))
    if len(matches) != 1:
        raise LookupError(f'the text occurs {len(matches)} times in {mutant.where}, not once')
    m = matches[0]
    # The match starts and ends at the text's first and last characters: its surrounding
    # whitespace stays in the file, so the same whitespace comes off the replacement.
    lead = mutant.old[:len(mutant.old) - len(mutant.old.lstrip())]
    trail = mutant.old[len(mutant.old.rstrip()):]
    new = mutant.new.removeprefix(lead)
    new = new.removesuffix(trail) if trail else new
    return path, text[:start] + body[:m.start()] + new + body[m.end():] + text[end:]


def _run_tests(repo: str, tests, timeout: float) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
    env['JAX_PLATFORMS'] = 'cpu'
    command = [sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', *tests]
    try:
        proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, 'timed out'
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    # pytest's last line, not the compile count tests/conftest.py prints after it
    lines = [ln for ln in lines if not ln.startswith('XLA: ')]
    return proc.returncode, lines[-1] if lines else ''


def check_mutant(mutant: Mutant, timeout: float) -> tuple[str, float, str]:
    """('caught' | 'NOT CAUGHT' | 'ERROR', seconds, pytest's last line) in a fresh copy."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f't2t-mutant-{mutant.name}-') as tmp:
        repo = os.path.join(tmp, 'repo')
        _copy_repo(repo)
        try:
            path, text = mutate(repo, mutant)
        except LookupError as e:
            return 'ERROR', 0.0, f'stale: {e}'
        with open(path, 'w', encoding='utf-8') as f:
            f.write(text)
        code, last = _run_tests(repo, mutant.tests, timeout)
    verdict = {1: 'caught', 0: 'NOT CAUGHT'}.get(code, 'ERROR')
    return verdict, time.monotonic() - start, last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--list', action='store_true', help='print the mutants and exit')
    parser.add_argument('--check', action='store_true',
                        help="find every mutant's text in its function; no tests run")
    parser.add_argument('--only', default='', help='comma-separated mutant names')
    parser.add_argument('--jobs', type=int, default=1, help='mutants checked at once')
    parser.add_argument('--timeout', type=float, default=900, help='seconds per pytest run')
    parser.add_argument('--skip_baseline', action='store_true',
                        help='do not run the named tests on the unmutated code first')
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        wanted = args.only.split(',')
        unknown = set(wanted) - {m.name for m in MUTANTS}
        if unknown:
            parser.error(f'unknown mutants: {sorted(unknown)}')
        mutants = tuple(m for m in MUTANTS if m.name in wanted)
    if args.list:
        for m in mutants:
            print(f'{m.name}: {m.where}: {m.what}\n    {m.old!r} -> {m.new!r}\n    '
                  + '\n    '.join(m.tests))
        return 0

    if args.check:
        stale = []
        for m in mutants:
            try:
                mutate(ROOT, m)
            except LookupError as e:
                stale.append(f'{m.name}: {e}')
        print('\n'.join(stale) or f'all {len(mutants)} mutants found in their functions')
        return 1 if stale else 0

    if not args.skip_baseline:
        tests = sorted({t for m in mutants for t in m.tests})
        with tempfile.TemporaryDirectory(prefix='t2t-mutant-baseline-') as tmp:
            _copy_repo(os.path.join(tmp, 'repo'))
            start = time.monotonic()
            code, last = _run_tests(os.path.join(tmp, 'repo'), tests, args.timeout)
        print(f'baseline (unmutated, {len(tests)} test targets): {last} '
              f'[{time.monotonic() - start:.0f} s]', flush=True)
        if code != 0:
            print('the named tests fail without any mutation: nothing to conclude')
            return 2

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        futures = {pool.submit(check_mutant, m, args.timeout): m for m in mutants}
        results = {}
        for future in concurrent.futures.as_completed(futures):
            m = futures[future]
            results[m.name] = future.result()
            verdict, seconds, last = results[m.name]
            print(f'{verdict:10s} {m.name:36s} {seconds:5.0f} s  {m.where}: {m.what}'
                  + ('' if verdict == 'caught' else f'  [{last}]'), flush=True)
    failed = sum(results[m.name][0] != 'caught' for m in mutants)
    print(f'{len(mutants) - failed} of {len(mutants)} mutants caught')
    return 0 if failed == 0 else 1


if __name__ == '__main__':
    sys.exit(main())
