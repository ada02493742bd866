"""The validation loss of a split: the pure eval_step (t2t/train_lib.py) summed over its batches,
as the training loop and checkpoint averaging (t2t/eval/averaging.py) read it."""

from __future__ import annotations

import jax

from t2t import sharding
from t2t.train_lib import BATCH_KEYS, summarize_metrics


def evaluate_loss(eval_fn, params, batches, mesh, num_batches: int) -> dict:
    """Validation loss/NLL/accuracy over the first num_batches global batches (-1: all).

    Every process iterates the same global batches and puts the rows its devices hold.
    """
    batch_sharding = sharding.batch_sharding(mesh)
    total = None
    for i, batch in enumerate(batches):
        if 0 <= num_batches <= i:
            break
        model_batch = {k: v for k, v in batch.items() if k in BATCH_KEYS}
        sums = jax.device_get(eval_fn(params, sharding.put_global(model_batch, batch_sharding)))
        total = sums if total is None else {k: total[k] + sums[k] for k in total}
    if total is None:
        raise ValueError('the evaluation split gave no batch')
    return summarize_metrics(total)
