"""The tests' shared pieces: the tiny config they train and the runner for the scripts they start.

    tiny_config(max_len=16)                    # in-process model tests: no data
    tiny_config(corpus, num_train_steps=6)     # a run on tests/toy_corpus.make_corpus's TSVs
    run_script('evaluate.py', '--config=configs/tiny.py', ...)   # finished: a CompletedProcess
    start_script('train.py', ..., stdout=f)    # running: a Popen
    run_script('-m', 'tests.kill_driver', spec, devices=8)

A script runs from the repository root with this interpreter, on the CPU, with `devices` host
devices (1 unless said) and the tests' XLA flags; it inherits the session's persistent
compilation cache (tests/conftest.py), so a program another process of the run compiled is read
back, not compiled again.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# XLA's CPU compiler at its quickest (tests/conftest.py says why).
TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                  '--xla_cpu_parallel_codegen_split_count=1')
DEVICE_FLAG = '--xla_force_host_platform_device_count'


def tiny_config(corpus: dict | None = None, **overrides):
    """configs/tiny.py shrunk for tests, then `overrides`. Without a corpus: 12 tokens, 8 rows, 50
    ids, for tests that build the model without data. With one (toy_corpus.make_corpus): its
    TSV splits, a 400-piece vocabulary (256 are UTF-8 bytes), 64 tokens (32 in evaluation), 8 rows
    (4 in evaluation)."""
    from configs import tiny

    c = tiny.get_config()
    if corpus is None:
        c.max_len, c.batch_size, c.vocab_size = 12, 8, 50
    else:
        c.dataset = 'tsv'
        c.data_dir = str(corpus['root'] / 'data')
        for split in ('train', 'validation', 'test'):
            c.tsv_files[split] = corpus[split]
        c.vocab_size, c.tokenizer_sentences = 400, 2000
        c.max_len, c.max_eval_len = 64, 32
        c.batch_size, c.eval_batch_size = 8, 4
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


def script_env(devices: int = 1, **extra: str) -> dict:
    """The environment of a script the tests start: the CPU with `devices` host devices, the
    tests' XLA flags, this process's environment otherwise (the compilation cache), then extra."""
    env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
    env['JAX_PLATFORMS'] = 'cpu'
    env['XLA_FLAGS'] = TEST_XLA_FLAGS + (f' {DEVICE_FLAG}={devices}' if devices != 1 else '')
    return {**env, **extra}


def _argv(args) -> list[str]:
    return [sys.executable, *map(str, args)]


def run_script(*args, devices: int = 1, env: dict | None = None, timeout: float = 300,
               **kwargs) -> subprocess.CompletedProcess:
    """`python ARGS...` (a script path, `-m module` or `-c code`, then its flags) from the
    repository root, its output captured as text; env: variables on top of script_env(devices)."""
    return subprocess.run(_argv(args), cwd=ROOT, env={**script_env(devices), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def start_script(*args, devices: int = 1, env: dict | None = None,
                 **popen) -> subprocess.Popen:
    """run_script's process, started and not waited for; popen: stdout, stderr, text ..."""
    return subprocess.Popen(_argv(args), cwd=ROOT, env={**script_env(devices), **(env or {})},
                            **popen)


def source_rows(lengths, width: int, vocab_size: int, seed: int):
    """int32 [len(lengths), width] sources: row i holds lengths[i] - 1 random non-special ids,
    then EOS, then PAD."""
    import numpy as np

    from t2t.ids import EOS_ID, PAD_ID

    rng = np.random.default_rng(seed)
    inputs = np.full((len(lengths), width), PAD_ID, np.int32)
    for row, n in enumerate(lengths):
        inputs[row, :n - 1] = rng.integers(3, vocab_size, n - 1)
        inputs[row, n - 1] = EOS_ID
    return inputs
