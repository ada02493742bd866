"""The pieces every benchmark shares: RESULT lines, the timing loop, and the flax examples/wmt peer.

    emit('train', 'BASE', step_ms=12.3)            # prints `RESULT {json}`, appends to files
    time_calls(step, 20)                           # wall seconds of 20 synced calls
    models, decode = load_flax_peer()              # .peer/flax_wmt/{models,decode}.py
    config = flax_peer_config(models, (512, 8, 2048, 6), 32768, 'bfloat16', decode=False)
    step = flax_peer_train_step(models, config)    # its train.train_step, to jit

The peer is google/flax examples/wmt (models.py, decode.py) kept verbatim in .peer/flax_wmt/
(git-ignored: peer code is never committed; flax's source distribution on PyPI ships it:
`pip download flax==<version> --no-deps --no-binary :all:`, then examples/wmt/). Its train step is
train.py's train_step (jit instead of pmap, the loss as compute_weighted_cross_entropy with label
smoothing 0.1, dropout and attention dropout 0.1 as in its config), its beam search train.py's
predict_step (encoder once, beams expanded, decode.beam_search). jax and flax are imported only
inside the functions that need them: the GPU run's torch sections import this file too.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.path.join(ROOT, '.peer', 'flax_wmt')


def emit(section: str, name: str, files=(), **fields) -> dict:
    """Prints `RESULT {json}` (floats to 4 significant digits, non-finite as null: strict JSON)
    and appends the line to each path of `files` (None or '' skipped)."""
    def clean(v):
        if isinstance(v, float):
            return float(f'{v:.4g}') if math.isfinite(v) else None
        return v

    record = {'section': section, 'name': name, **{k: clean(v) for k, v in fields.items()}}
    line = json.dumps(record, default=str)
    print('RESULT ' + line, flush=True)
    for path in files:
        if path:
            os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
            with open(path, 'a') as f:
                f.write(line + '\n')
    return record


def time_calls(run, n: int, cpu: bool = False, stop=None) -> list:
    """Wall seconds of n calls of run() (which must end with a device sync); cpu=True: (wall s,
    process CPU s) pairs. stop(i) -> True ends the loop before call i (a deadline)."""
    times = []
    for i in range(n):
        if stop is not None and stop(i):
            break
        t0, c0 = time.perf_counter(), time.process_time()
        run()
        wall = time.perf_counter() - t0
        times.append((wall, time.process_time() - c0) if cpu else wall)
    return times


# ----------------------------------------------------------------------------------------------
# The flax examples/wmt peer


def load_flax_peer():
    """(models, decode) of .peer/flax_wmt/; SystemExit naming the missing file."""
    if not os.path.isfile(os.path.join(PEER_DIR, 'models.py')):
        raise SystemExit(f'{PEER_DIR}/models.py is missing: put flax examples/wmt there '
                         '(models.py, decode.py; see bench/benchlib.py)')
    sys.path.insert(0, PEER_DIR)
    import decode
    import models
    return models, decode


def flax_peer_config(models, shape, vocab: int, dtype: str, **kw):
    """Its TransformerConfig as train.py builds it (shared embeddings, logits via the
    embedding), dims shape = (d_model, heads, d_ff, layers per side), dtype 'float32' or
    'bfloat16' (the example picks fp16 with loss scaling on GPU)."""
    import jax.numpy as jnp

    d, h, ff, layers = shape
    return models.TransformerConfig(
        vocab_size=vocab, output_vocab_size=vocab, share_embeddings=True,
        logits_via_embedding=True, dtype={'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[dtype],
        emb_dim=d, num_heads=h, num_layers=layers, qkv_dim=d, mlp_dim=ff, max_len=512,
        dropout_rate=0.1, attention_dropout_rate=0.1, **kw)


def flax_peer_params(models, config, src_len: int, tgt_len: int):
    """Parameters as train.py initializes them: jit(init) with the eval config (batch 2)."""
    import jax
    import jax.numpy as jnp

    m = models.Transformer(config.replace(deterministic=True, decode=False))
    ones = lambda n: jnp.ones((2, n), jnp.float32)  # noqa: E731
    return jax.jit(m.init)(jax.random.key(0), ones(src_len), ones(tgt_len))['params']


def flax_peer_state(models, config, params):
    """train_state.TrainState with Adam(0.9, 0.98, 1e-9) (the paper's; the schedule aside)."""
    import optax
    from flax.training import train_state

    return train_state.TrainState.create(apply_fn=models.Transformer(config).apply,
                                         params=params,
                                         tx=optax.adam(1e-3, b1=0.9, b2=0.98, eps=1e-9))


def _xent(logits, targets, weights, label_smoothing):
    """train.compute_weighted_cross_entropy, as a mean over the weighted tokens."""
    import jax.numpy as jnp
    from flax import linen as nn
    from flax.training import common_utils

    v = logits.shape[-1]
    conf, low = 1.0 - label_smoothing, label_smoothing / (v - 1)
    norm = -(conf * jnp.log(conf) + (v - 1) * low * jnp.log(low + 1e-20))
    soft = common_utils.onehot(targets, v, on_value=conf, off_value=low)
    loss = -jnp.sum(soft * nn.log_softmax(logits), axis=-1) - norm
    return (loss * weights).sum() / weights.sum()


def flax_peer_train_step(models, config):
    """train.train_step(state, batch, dropout_rng) -> (state, loss), unjitted (no pmap, no
    metrics); config with deterministic=False, decode=False."""
    import jax
    import jax.numpy as jnp

    def train_step(state, batch, dropout_rng):
        inputs, targets = batch['inputs'], batch['targets']
        weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
        dropout_rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = models.Transformer(config).apply({'params': params}, inputs, targets,
                                                      rngs={'dropout': dropout_rng})
            return _xent(logits, targets, weights, 0.1)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step


def flax_peer_predict(models, decode, config, beams: int, max_decode_len: int, eos_id: int):
    """(predict_step(inputs, params, cache) -> ids, initialize_cache(inputs)), unjitted:
    train.predict_step (the last beam's ids past the start slot) and train.initialize_cache;
    config with deterministic=True, decode=True. max_decode_len counts the start slot."""
    import jax
    import jax.numpy as jnp

    def initialize_cache(inputs):
        target_shape = (inputs.shape[0], max_decode_len) + inputs.shape[2:]
        return models.Transformer(config).init(jax.random.key(0),
                                               jnp.ones(inputs.shape, config.dtype),
                                               jnp.ones(target_shape, config.dtype))['cache']

    def predict_step(inputs, params, cache):
        encoded = decode.flat_batch_beam_expand(models.Transformer(config).apply(
            {'params': params}, inputs, method=models.Transformer.encode), beams)
        raw_inputs = decode.flat_batch_beam_expand(inputs, beams)

        def tokens_ids_to_logits(flat_ids, flat_cache):
            flat_logits, new_vars = models.Transformer(config).apply(
                {'params': params, 'cache': flat_cache}, encoded, raw_inputs, flat_ids,
                mutable=['cache'], method=models.Transformer.decode)
            return flat_logits.squeeze(axis=1), new_vars['cache']

        seqs, _ = decode.beam_search(inputs, cache, tokens_ids_to_logits, beam_size=beams,
                                     alpha=0.6, eos_id=eos_id, max_decode_len=max_decode_len)
        return seqs[:, -1, 1:]

    return predict_step, initialize_cache


def rows_for(tokens: int, max_len: int, mesh: tuple[int, int, int]) -> int:
    """Batch rows for `tokens` target tokens: the nearest multiple of the data-parallel devices."""
    unit = mesh[0] * mesh[1]
    return max(1, round(tokens / max_len / unit)) * unit


def run_child(script: str, spec: str, *, timeout: int, nice: int, root: str, prefix=(),
              env_extra=None) -> tuple[dict | None, str]:
    """Runs `script --child spec` in a process of its own (XLA_FLAGS unset, PYTHONPATH=root): (the
    dict of its last 'RESULT {json}' line, '') when it exits 0 with one, else (None, why not)."""
    cmd = [*prefix, 'nice', '-n', str(nice), 'timeout', str(timeout), sys.executable,
           os.path.abspath(script), '--child', spec]
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env.update(PYTHONPATH=root, **(env_extra or {}))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT ')]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len('RESULT '):]), ''
    tail = (proc.stderr.strip().splitlines() or ['no output'])[-1][:200]
    return None, (f'timed out after {timeout} s' if proc.returncode == 124
                  else f'failed (rc {proc.returncode}): {tail}')


def append_table(out: str, fields: tuple, columns: tuple, values: dict) -> None:
    """Appends `values` to OUT.csv (header `fields`; rows of an older header get today's fields,
    the new ones empty) and writes OUT.md's `columns` from the whole of it, each file whole."""
    rows = []
    if os.path.exists(out + '.csv'):
        with open(out + '.csv', newline='') as f:
            rows = list(csv.DictReader(f))
    rows.append(values)
    with open(out + '.csv.tmp', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=fields, restval='')
        w.writeheader()
        w.writerows(rows)
    os.replace(out + '.csv.tmp', out + '.csv')
    with open(out + '.md.tmp', 'w') as f:
        f.write('| ' + ' | '.join(columns) + ' |\n|' + '---|' * len(columns) + '\n')
        f.writelines('| ' + ' | '.join('' if r.get(k) in (None, '') else str(r[k])
                                       for k in columns) + ' |\n' for r in rows)
    os.replace(out + '.md.tmp', out + '.md')
