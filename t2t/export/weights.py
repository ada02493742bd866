"""t2t parameters as plain numpy matrices in the layout both serving formats share.

Every linear map becomes (W [out, in], b [out]) as torch's nn.Linear and CTranslate2's LinearSpec
hold it; heads stay grouped head-major along the output (index h * K + k), as both split them.
Attention without the 1/sqrt(d_k) scale (scale_attention=False) is folded into the query
projection, since both formats always scale: q * sqrt(d_k) * d_k^-0.5 = q. Embeddings are cut
to the tokenizer's pieces when the checkpoint's embedding has more rows (decoding never emits
those ids: t2t masks them, the exported models do not have them).

Shape letters: V vocabulary (the tokenizer's), D d_model, F d_ff, P positions.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from t2t.model import TransformerConfig, sinusoidal_table


@dataclasses.dataclass
class Linear:
    w: np.ndarray  # [out, in]
    b: np.ndarray | None  # [out]


@dataclasses.dataclass
class Norm:
    gamma: np.ndarray  # [D]
    beta: np.ndarray  # [D]


@dataclasses.dataclass
class Attention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    norm: Norm  # the LayerNorm of the block (after the residual post-LN, before it pre-LN)


@dataclasses.dataclass
class Layer:
    self_attention: Attention
    ffn_in: Linear  # D -> F, ReLU after
    ffn_out: Linear  # F -> D
    ffn_norm: Norm
    cross_attention: Attention | None = None  # decoder layers only


@dataclasses.dataclass
class Weights:
    """The whole model, format-neutral; every array float32."""

    source_embedding: np.ndarray  # [V, D]
    target_embedding: np.ndarray  # [V, D] (the same array when shared)
    output: np.ndarray  # [V, D] output projection (the target embedding when tied)
    source_positions: np.ndarray | None  # [P, D] added after the scaled embedding; None: rope
    target_positions: np.ndarray | None
    encoder: list[Layer]
    decoder: list[Layer]
    encoder_norm: Norm | None  # pre-LN only: the norm after the last layer
    decoder_norm: Norm | None


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float32)


def _norm(p) -> Norm:
    return Norm(_f32(p['scale']), _f32(p['bias']))


def _bias(p, size: int) -> np.ndarray:
    """The projection's bias, flattened; zeros when the model has none (attention_bias=False):
    both formats always have attention biases."""
    return _f32(p['bias']).reshape(-1) if 'bias' in p else np.zeros((size,), np.float32)


def _head_in(p, scale: float = 1.0) -> Linear:
    """A [D, H, K] kernel and [H, K] bias (or none) -> W [H*K, D], b [H*K]."""
    w = _f32(p['kernel']).reshape(p['kernel'].shape[0], -1).T
    return Linear(w * scale, _bias(p, w.shape[0]) * scale)


def _head_out(p) -> Linear:
    """A [H, K, D] kernel and [D] bias (or none) -> W [D, H*K], b [D]."""
    w = _f32(p['kernel']).reshape(-1, p['kernel'].shape[-1]).T
    return Linear(w, _bias(p, w.shape[0]))


def _dense(p) -> Linear:
    return Linear(_f32(p['kernel']).T, _f32(p['bias']))


def _attention(p, norm, q_scale: float) -> Attention:
    return Attention(q=_head_in(p['query'], q_scale), k=_head_in(p['key']),
                     v=_head_in(p['value']), o=_head_out(p['out']), norm=_norm(norm['norm']))


def _positions(cfg: TransformerConfig, embedder) -> np.ndarray | None:
    if cfg.position_embedding == 'sinusoidal':
        return sinusoidal_table(cfg.max_position, cfg.d_model)
    if cfg.position_embedding == 'learned':
        return _f32(embedder['position_embedding'])
    if cfg.position_embedding == 'none':
        return np.zeros((cfg.max_position, cfg.d_model), np.float32)
    return None  # rope: inside self-attention


def from_params(params, cfg: TransformerConfig, num_pieces: int) -> Weights:
    """The Weights of unrolled t2t `params` (layers encoder_i / decoder_i) of model `cfg`.

    num_pieces: the tokenizer's size; embedding rows from it up are dropped.
    """
    if any(k.endswith('_layers') for k in params):
        raise ValueError('scanned parameters: convert with layers_convert.to_unrolled first')
    rows = params['embedder' if cfg.share_embeddings else 'target_embedder']['embedding'].shape[0]
    if num_pieces > rows:
        raise ValueError(f'the tokenizer has {num_pieces} pieces, the embedding only {rows} rows')
    q_scale = 1.0 if cfg.scale_attention else math.sqrt(cfg.head_dim)
    src = params['embedder' if cfg.share_embeddings else 'source_embedder']
    tgt = params['embedder' if cfg.share_embeddings else 'target_embedder']
    source_embedding = _f32(src['embedding'])[:num_pieces]
    target_embedding = (source_embedding if cfg.share_embeddings
                        else _f32(tgt['embedding'])[:num_pieces])
    output = (target_embedding if cfg.tie_output
              else _f32(params['output_projection']['kernel']).T[:num_pieces])
    encoder = []
    for i in range(cfg.num_encoder_layers):
        p = params[f'encoder_{i}']
        encoder.append(Layer(
            self_attention=_attention(p['self_attention'], p['attention_block'], q_scale),
            ffn_in=_dense(p['ffn']['wi']), ffn_out=_dense(p['ffn']['wo']),
            ffn_norm=_norm(p['ffn_block']['norm'])))
    decoder = []
    for i in range(cfg.num_decoder_layers):
        p = params[f'decoder_{i}']
        decoder.append(Layer(
            self_attention=_attention(p['self_attention'], p['self_attention_block'], q_scale),
            cross_attention=_attention(p['cross_attention'], p['cross_attention_block'], q_scale),
            ffn_in=_dense(p['ffn']['wi']), ffn_out=_dense(p['ffn']['wo']),
            ffn_norm=_norm(p['ffn_block']['norm'])))
    return Weights(
        source_embedding=source_embedding, target_embedding=target_embedding, output=output,
        source_positions=_positions(cfg, src), target_positions=_positions(cfg, tgt),
        encoder=encoder, decoder=decoder,
        encoder_norm=_norm(params['encoder_norm']) if cfg.pre_ln else None,
        decoder_norm=_norm(params['decoder_norm']) if cfg.pre_ln else None)


def sin_cos_permutation(d_model: int) -> np.ndarray:
    """perm with t2t_table[:, perm] = the concatenated [sin | cos] table (Marian's layout).

    t2t interleaves (column 2i sin, 2i+1 cos of the same frequency); Marian puts every sin first.
    """
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def permute_model_dim(w: Weights, perm: np.ndarray) -> Weights:
    """The same function with the model dimension D reordered by `perm` in every weight.

    LayerNorm is blind to the order of its features, the residual stream carries the order
    through, and every matrix that reads (writes) D has its input columns (output rows)
    permuted, so outputs are unchanged while hidden states come out as h[..., perm].
    """
    def lin_in(x: Linear) -> Linear:  # reads D
        return Linear(x.w[:, perm], x.b)

    def lin_out(x: Linear) -> Linear:  # writes D
        return Linear(x.w[perm], None if x.b is None else x.b[perm])

    def norm(n: Norm | None) -> Norm | None:
        return None if n is None else Norm(n.gamma[perm], n.beta[perm])

    def attention(a: Attention | None) -> Attention | None:
        if a is None:
            return None
        return Attention(q=lin_in(a.q), k=lin_in(a.k), v=lin_in(a.v), o=lin_out(a.o),
                         norm=norm(a.norm))

    def layer(x: Layer) -> Layer:
        return Layer(self_attention=attention(x.self_attention),
                     cross_attention=attention(x.cross_attention), ffn_in=lin_in(x.ffn_in),
                     ffn_out=lin_out(x.ffn_out), ffn_norm=norm(x.ffn_norm))

    def cols(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[:, perm]

    source = cols(w.source_embedding)
    target = source if w.target_embedding is w.source_embedding else cols(w.target_embedding)
    output = target if w.output is w.target_embedding else cols(w.output)
    return Weights(source_embedding=source, target_embedding=target, output=output,
                   source_positions=cols(w.source_positions),
                   target_positions=cols(w.target_positions),
                   encoder=[layer(x) for x in w.encoder], decoder=[layer(x) for x in w.decoder],
                   encoder_norm=norm(w.encoder_norm), decoder_norm=norm(w.decoder_norm))
