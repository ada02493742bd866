"""Analytic model FLOPs of one training step, the denominator-free half of MFU.

Counted the way the peer benchmarks count them (../bench: train_flops_per_step), so that MFU numbers
compare like for like. Matmuls: a weight with P entries applied to N tokens costs 2PN FLOPs forward
and 4PN backward, 6PN per step:
  encoder layer : self q,k,v,o (4 d^2) + FFN (2 d ff)                      x source tokens
  decoder layer : self q,k,v,o (4 d^2) + cross q,o (2 d^2) + FFN (2 d ff)  x target tokens
                  cross k,v (2 d^2), projected from the encoder output      x source tokens
  output proj.  : d x vocab (tied with the embedding)                      x target tokens
Attention: QK^T and AV cost 4 L d per query token and layer forward for L attended keys, x3 with
the backward pass: 12 L d. Encoder self-attention and cross-attention attend L = source length;
causal decoder self-attention is counted half, L = (target length + 1) / 2.
Not counted: embedding lookups, biases, LayerNorm, softmax, dropout, loss and the optimizer.
"""

from __future__ import annotations


def train_flops_per_step(batch: int, src_len: int, tgt_len: int, d: int, ff: int, n_enc: int,
                         n_dec: int, vocab: int, causal_half: bool = True) -> tuple[float, float]:
    """(total FLOPs, attention-only FLOPs) of one forward+backward step on [batch, len] pairs."""
    src_tok, tgt_tok = batch * src_len, batch * tgt_len
    params_x_tokens = (n_enc * (4 * d * d + 2 * d * ff) * src_tok
                       + n_dec * (6 * d * d + 2 * d * ff) * tgt_tok
                       + n_dec * 2 * d * d * src_tok
                       + d * vocab * tgt_tok)
    dec_self_len = (tgt_len + 1) / 2 if causal_half else tgt_len
    attn = 12 * d * (n_enc * src_len * src_tok + n_dec * (dec_self_len + src_len) * tgt_tok)
    return float(6 * params_x_tokens + attn), float(attn)


def config_flops_per_step(config, causal_half: bool = True) -> float:
    """FLOPs of one optimizer step of a ConfigDict's batch: batch_size rows of max_len per side
    (causal_half=False: the decoder's self-attention whole, as a dense kernel computes it)."""
    total, _ = train_flops_per_step(
        config.batch_size, config.max_len, config.max_len, config.d_model, config.d_ff,
        config.num_encoder_layers, config.num_decoder_layers, config.vocab_size, causal_half)
    return total


def flops_per_token(src_len: int, tgt_len: int, d: int, ff: int, n_enc: int, n_dec: int,
                    vocab: int, causal_half: bool = True) -> tuple[float, float]:
    """(FLOPs per source token, FLOPs per target token) of one training step on rows of
    src_len / tgt_len slots: `train_flops_per_step` is batch * (src_len * the first +
    tgt_len * the second).

    Multiplied by the real (non-pad) token counts of a batch this gives the model FLOPs spent on
    real tokens. Approximation: a token's attention is counted over the keys of its whole row
    (src_len, or the causal half of tgt_len), as a dense kernel computes it, not over the shorter
    sentence it belongs to in a packed row; for the models here attention is a small share.
    """
    per_source = 6 * (n_enc * (4 * d * d + 2 * d * ff) + n_dec * 2 * d * d)
    per_source += 12 * d * n_enc * src_len
    dec_self_len = (tgt_len + 1) / 2 if causal_half else tgt_len
    per_target = 6 * (n_dec * (6 * d * d + 2 * d * ff) + d * vocab)
    per_target += 12 * d * n_dec * (dec_self_len + src_len)
    return float(per_source), float(per_target)


def config_flops_per_token(config) -> tuple[float, float]:
    """`flops_per_token` of a ConfigDict's training rows (max_len slots per side)."""
    return flops_per_token(config.max_len, config.max_len, config.d_model, config.d_ff,
                           config.num_encoder_layers, config.num_decoder_layers,
                           config.vocab_size)
