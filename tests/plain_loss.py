"""The plain label-smoothed cross-entropy over full logits: what t2t/loss.py's fused, chunked
loss must equal (tests/test_speed_paths.py), itself checked by hand (tests/test_train.py)."""

import jax
import jax.numpy as jnp


def label_smoothed_cross_entropy(logits_BTV, targets_BT, smoothing: float):
    """Per-token cross-entropy against the smoothed target distribution, and the plain NLL.

    The smoothed distribution puts 1 - smoothing on the gold token and smoothing / (V - 1) on every
    other token (tensor2tensor's convention). Both are float32 [B, T].
    """
    vocab = logits_BTV.shape[-1]
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    gold_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
    # sum_v q_v log p_v with q = low everywhere plus (confidence - low) on the gold token.
    smoothed_BT = -(confidence - low) * gold_BT - low * logp_BTV.sum(-1)
    return smoothed_BT, -gold_BT
