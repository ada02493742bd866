"""An independent float64 NumPy Transformer, written from the paper's equations (Vaswani et al.
2017, sections 3.1-3.5), not from t2t's code: nothing here imports t2t.model.

One (source, target) pair at a time, no padding and no packing: a padded or packed t2t batch is
compared row by row, pair by pair, with this, so masks are checked by their effect alone.

    embed(x)        = E[x] * sqrt(d_model) + PE[pos]      (3.4, 3.5; scaling optional)
    Attention(Q,K,V)= softmax(Q K^T / sqrt(d_k)) V         (3.2.1; scaling optional)
    MultiHead       = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    FFN(x)          = max(0, x W_1 + b_1) W_2 + b_2        (3.3)
    post-LN sublayer: LayerNorm(x + Sublayer(x))            (5.4; pre-LN: x + Sublayer(LN(x)))
    output          = softmax(y E^T)                        (3.4: the embedding tied to the output)

The decoder reads the targets shifted right by one with 0 as the start token, and its
self-attention sees positions <= its own (the causal mask of 3.2.3).

`from_params` is the ONE place that knows t2t's parameter names: a renamed or moved parameter
is a change there only. Attention biases are read when the tree has them (absent: no bias).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Spec:
    """The architecture choices the reference implements."""

    num_heads: int
    pre_ln: bool = False
    positions: str = 'sinusoidal'  # 'sinusoidal', 'learned' or 'none'
    scale_embeddings: bool = True
    scale_attention: bool = True
    epsilon: float = 1e-6


@functools.cache
def sinusoid(length: int, d: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pe = np.zeros((length, d))
    for pos in range(length):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            if i + 1 < d:
                pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return pe


# ----------------------------------------------------------------------------------------------
# The adapter: t2t parameter names -> the reference's plain dict


def _f64(x):
    return np.asarray(x, np.float64)


def _attention(p: dict) -> dict:
    """q/k/v kernels [D, H, K] and biases [H, K] (or None); out kernel [H, K, D], bias [D]."""
    got = {}
    for name in ('query', 'key', 'value', 'out'):
        got[f'w_{name}'] = _f64(p[name]['kernel'])
        got[f'b_{name}'] = _f64(p[name]['bias']) if 'bias' in p[name] else None
    return got


def _norm(p: dict) -> dict:
    return {'gain': _f64(p['norm']['scale']), 'bias': _f64(p['norm']['bias'])}


def _ffn(p: dict) -> dict:
    return {'w1': _f64(p['wi']['kernel']), 'b1': _f64(p['wi']['bias']),
            'w2': _f64(p['wo']['kernel']), 'b2': _f64(p['wo']['bias'])}


def from_params(params, num_encoder_layers: int, num_decoder_layers: int) -> dict:
    """t2t's parameter tree (unboxed, unscanned) -> the reference's parameters (float64).

    Untied or unshared embeddings are read when present (target_embedder, output_projection).
    """
    src = params.get('embedder', params.get('source_embedder'))
    tgt = params.get('embedder', params.get('target_embedder'))
    ref = {
        'src_embedding': _f64(src['embedding']),
        'tgt_embedding': _f64(tgt['embedding']),
        'src_positions': _f64(src['position_embedding']) if 'position_embedding' in src else None,
        'tgt_positions': _f64(tgt['position_embedding']) if 'position_embedding' in tgt else None,
        'output': (_f64(params['output_projection']['kernel']).T if 'output_projection' in params
                   else _f64(tgt['embedding'])),  # [V, D]
        'encoder': [], 'decoder': [],
    }
    for i in range(num_encoder_layers):
        p = params[f'encoder_{i}']
        ref['encoder'].append({'self': _attention(p['self_attention']),
                               'self_norm': _norm(p['attention_block']),
                               'ffn': _ffn(p['ffn']), 'ffn_norm': _norm(p['ffn_block'])})
    for i in range(num_decoder_layers):
        p = params[f'decoder_{i}']
        ref['decoder'].append({'self': _attention(p['self_attention']),
                               'self_norm': _norm(p['self_attention_block']),
                               'cross': _attention(p['cross_attention']),
                               'cross_norm': _norm(p['cross_attention_block']),
                               'ffn': _ffn(p['ffn']), 'ffn_norm': _norm(p['ffn_block'])})
    for stack in ('encoder', 'decoder'):
        final = params.get(f'{stack}_norm')
        ref[f'{stack}_norm'] = None if final is None else {'gain': _f64(final['scale']),
                                                           'bias': _f64(final['bias'])}
    return ref


# ----------------------------------------------------------------------------------------------
# The equations


def layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p['gain'] + p['bias']


def softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def multi_head(x_q, x_kv, p, spec: Spec, causal: bool):
    """Concat(head_1 .. head_h) W^O + b^O; head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i."""
    heads = []
    def proj(name, x, h):
        y = x @ p[f'w_{name}'][:, h, :]
        return y if p[f'b_{name}'] is None else y + p[f'b_{name}'][h]

    for h in range(spec.num_heads):
        q, k, v = proj('query', x_q, h), proj('key', x_kv, h), proj('value', x_kv, h)
        scores = q @ k.T
        if spec.scale_attention:
            scores = scores / math.sqrt(q.shape[-1])
        if causal:
            scores = np.where(np.tril(np.ones(scores.shape, bool)), scores, -np.inf)
        heads.append(softmax(scores) @ v)
    concat = np.concatenate(heads, axis=-1)  # [L, H * K]
    w_o = p['w_out'].reshape(-1, p['w_out'].shape[-1])  # [H * K, D], head-major like the concat
    out = concat @ w_o
    return out if p['b_out'] is None else out + p['b_out']


def ffn(x, p):
    return np.maximum(0.0, x @ p['w1'] + p['b1']) @ p['w2'] + p['b2']


def sublayer(x, fn, norm, spec: Spec):
    if spec.pre_ln:
        return x + fn(layer_norm(x, norm, spec.epsilon))
    return layer_norm(x + fn(x), norm, spec.epsilon)


def embed(ids, table, positions, spec: Spec):
    x = table[np.asarray(ids)]
    if spec.scale_embeddings:
        x = x * math.sqrt(table.shape[1])
    if spec.positions == 'sinusoidal':
        x = x + sinusoid(len(ids), table.shape[1])
    elif spec.positions == 'learned':
        x = x + positions[:len(ids)]
    return x


def encode(ref, source, spec: Spec):
    x = embed(source, ref['src_embedding'], ref['src_positions'], spec)
    for layer in ref['encoder']:
        x = sublayer(x, lambda h, lyr=layer: multi_head(h, h, lyr['self'], spec, causal=False),
                     layer['self_norm'], spec)
        x = sublayer(x, lambda h, lyr=layer: ffn(h, lyr['ffn']), layer['ffn_norm'], spec)
    if spec.pre_ln:
        x = layer_norm(x, ref['encoder_norm'], spec.epsilon)
    return x


def logits(ref, source, target, spec: Spec) -> np.ndarray:
    """Teacher-forced output logits [T, V] of one pair (no padding in source or target)."""
    memory = encode(ref, source, spec)
    decoder_in = [0] + list(target)[:-1]  # shifted right, 0 as the start token
    y = embed(decoder_in, ref['tgt_embedding'], ref['tgt_positions'], spec)
    for layer in ref['decoder']:
        y = sublayer(y, lambda h, lyr=layer: multi_head(h, h, lyr['self'], spec, causal=True),
                     layer['self_norm'], spec)
        y = sublayer(y, lambda h, lyr=layer: multi_head(h, memory, lyr['cross'], spec,
                                                        causal=False),
                     layer['cross_norm'], spec)
        y = sublayer(y, lambda h, lyr=layer: ffn(h, lyr['ffn']), layer['ffn_norm'], spec)
    if spec.pre_ln:
        y = layer_norm(y, ref['decoder_norm'], spec.epsilon)
    return y @ ref['output'].T


# ----------------------------------------------------------------------------------------------
# Decoding by exhaustive search


def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^alpha, |Y| counting EOS."""
    return ((5.0 + length) / 6.0) ** alpha


def exhaustive_search(ref, source, spec: Spec, *, limit: int, alpha: float, eos_id: int,
                      pad_id: int, num_valid: int, unfinished: str = 'fallback'):
    """(best sequence, its score): every sequence of at most `limit` tokens that ends with EOS
    or at the limit, scored sum(log p) / length_penalty(|Y|, alpha). Tokens are the ids below
    num_valid except PAD (never generated). unfinished: t2t.decode.beam_search's rule for the
    sequences cut at the limit without EOS: 'fallback' (the default there) counts them only
    when no sequence ends with EOS (always, unless EOS is not a valid id); 'compete' counts
    them with the rest."""
    if unfinished not in ('fallback', 'compete'):
        raise ValueError(f'unfinished={unfinished!r}')
    best_eos, best_cut = (None, -np.inf), (None, -np.inf)
    stack = [((), 0.0)]  # (prefix, its sum of log p)
    while stack:
        prefix, prefix_lp = stack.pop()
        # log p of the token after `prefix`: the last position of a teacher-forced pass
        logp = log_softmax(logits(ref, source, list(prefix) + [pad_id], spec)[-1][:num_valid])
        for token in range(num_valid):
            if token == pad_id:
                continue
            seq, lp = prefix + (token,), prefix_lp + float(logp[token])
            if token == eos_id or len(seq) == limit:
                score = lp / length_penalty(len(seq), alpha)
                if token == eos_id and score > best_eos[1]:
                    best_eos = (list(seq), score)
                elif token != eos_id and score > best_cut[1]:
                    best_cut = (list(seq), score)
            else:
                stack.append((seq, lp))
    if unfinished == 'fallback' and best_eos[0] is not None:
        return best_eos
    return max(best_eos, best_cut, key=lambda b: b[1])
