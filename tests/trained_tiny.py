"""The suite's trained model: configs/tiny.py trained on the toy corpus (reverse and upper-case).

tests/conftest.py's session fixture `trained_tiny` trains it once per process; the modules that
use it share one xdist group (GROUP), so `make test` trains it once.
"""

import random

import jax
import numpy as np

from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import evaluation
from t2t.ids import EOS_ID, PAD_ID
from t2t.model import TransformerConfig
from t2t.train import loop
from tests import toy_corpus
from tests.helpers import tiny_config

GROUP = 'trained_tiny'
TRAIN_STEPS = 400  # ~0.03 s each on one CPU device; the compile is most of the fixture's time


def train(root) -> dict:
    """The trained run under root/run: its config, workdir, model config, params, tokenizer,
    and 300 new sources of 1-12 words in one padded batch x."""
    corpus = toy_corpus.make_corpus(root, train=2000)
    config = tiny_config(
        corpus, num_train_steps=TRAIN_STEPS, checkpoint_every_steps=TRAIN_STEPS,
        log_every_steps=100, eval_every_steps=10 * TRAIN_STEPS, eval_bleu_sentences=0,
        num_eval_batches=1, mesh_shape=(1, 1, 1), batch_size=32, max_len=32, dropout_rate=0.0,
        learning_rate_scale=1.0, warmup_steps=100)
    workdir = str(root / 'run')
    result = loop.train_and_evaluate(config, workdir, devices=jax.devices()[:1])
    assert result.step == TRAIN_STEPS and result.train_metrics['accuracy'] > 0.8, result
    tokenizer = evaluation.workdir_tokenizer(config, workdir)
    rng = random.Random(11)
    sources = [toy_corpus.sentence(rng, 1, 12) for _ in range(300)]
    ids = [tokenizer.encode(s) + [EOS_ID] for s in sources]
    width = max(map(len, ids))
    x = np.array([r + [PAD_ID] * (width - len(r)) for r in ids], np.int32)
    return dict(config=config, workdir=workdir, corpus=corpus,
                cfg=TransformerConfig.from_config(config).replace(deterministic=True),
                max_decode_len=config.max_decode_len, alpha=config.length_penalty_alpha,
                params=eval_checkpoints.load_params(workdir, [TRAIN_STEPS], scan_layers=False),
                tokenizer=tokenizer, sources=sources, x=x)
