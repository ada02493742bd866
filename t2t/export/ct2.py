"""A CTranslate2 model directory, built with ctranslate2's spec API (numpy only, no torch).

CTranslate2's TransformerSpec expresses every t2t option: post- or pre-LN (with the final
norms), explicit position tables (t2t's own interleaved sinusoids, learned ones, zeros for
'none'), rotary positions (t2t's pairs (i, i + K/2) are CTranslate2's non-interleaved rotary),
separate source / target embeddings and an untied output projection. The LayerNorm epsilon is
written to config.json. The decoder starts from PAD (t2t's start token) and the source gets EOS
appended, as t2t feeds it.

CTranslate2 reads no decoding options from a model directory: t2t_decoding.json beside the model
holds translate_batch's keyword arguments closest to t2t's beam search
(`translate_batch(src, **json.load(...))`).

Differences that remain in decoding (tested in tests/test_export.py, measured in bench/):
- beam scores: CTranslate2 normalizes by |Y|^length_penalty; t2t by ((5 + |Y|) / 6)^alpha
  (|Y| with EOS in both): the recipe's length_penalty is the exponent fitted to t2t's curve
  (export.fitted_length_penalty), which ranks most but not all beams of different lengths as
  t2t does. CTranslate2's search lets a hypothesis end only from the top K candidates of a step
  (t2t: from all 2K);
- PAD must be kept out of the output with suppress_sequences=[['<pad>']] (t2t never emits it);
- one max_decoding_length per call instead of t2t's source length + max_decode_extra.
"""

from __future__ import annotations

import json

import numpy as np

from t2t.export.weights import Attention, Linear, Norm, Weights
from t2t.ids import EOS_ID, PAD_ID, UNK_ID
from t2t.model import TransformerConfig

DECODING_FILE = 't2t_decoding.json'  # translate_batch's options, beside the model

SPM_FILE = 'sentencepiece.model'


def _linear(spec, x: Linear) -> None:
    spec.weight = x.w
    if x.b is not None:
        spec.bias = x.b


def _fused(spec, parts: list[Linear]) -> None:
    spec.weight = np.concatenate([p.w for p in parts], axis=0)
    spec.bias = np.concatenate([p.b for p in parts], axis=0)


def _norm(spec, n: Norm) -> None:
    spec.gamma, spec.beta = n.gamma, n.beta


def _self_attention(spec, a: Attention) -> None:
    _fused(spec.linear[0], [a.q, a.k, a.v])
    _linear(spec.linear[1], a.o)
    _norm(spec.layer_norm, a.norm)


def _cross_attention(spec, a: Attention) -> None:
    _linear(spec.linear[0], a.q)
    _fused(spec.linear[1], [a.k, a.v])
    _linear(spec.linear[2], a.o)
    _norm(spec.layer_norm, a.norm)


def _ffn(spec, layer) -> None:
    _linear(spec.linear_0, layer.ffn_in)
    _linear(spec.linear_1, layer.ffn_out)
    _norm(spec.layer_norm, layer.ffn_norm)


def build_spec(w: Weights, cfg: TransformerConfig, pieces: list[str]):
    """The ctranslate2.specs.TransformerSpec of `w`, vocabularies and config registered."""
    from ctranslate2.specs import common_spec, transformer_spec

    rope = cfg.position_embedding == 'rope'
    rotary = dict(rotary_dim=0, rotary_interleave=False) if rope else {}
    encoder = transformer_spec.TransformerEncoderSpec(
        cfg.num_encoder_layers, cfg.num_heads, pre_norm=cfg.pre_ln,
        activation=common_spec.Activation.RELU, **rotary)
    decoder = transformer_spec.TransformerDecoderSpec(
        cfg.num_decoder_layers, cfg.num_heads, pre_norm=cfg.pre_ln,
        activation=common_spec.Activation.RELU, **rotary)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    encoder.embeddings[0].weight = w.source_embedding
    decoder.embeddings.weight = w.target_embedding
    encoder.scale_embeddings = decoder.scale_embeddings = cfg.scale_embeddings
    if not rope:
        encoder.position_encodings.encodings = w.source_positions
        decoder.position_encodings.encodings = w.target_positions
    for layer_spec, layer in zip(encoder.layer, w.encoder, strict=True):
        _self_attention(layer_spec.self_attention, layer.self_attention)
        _ffn(layer_spec.ffn, layer)
    for layer_spec, layer in zip(decoder.layer, w.decoder, strict=True):
        _self_attention(layer_spec.self_attention, layer.self_attention)
        _cross_attention(layer_spec.attention, layer.cross_attention)
        _ffn(layer_spec.ffn, layer)
    decoder.projection.weight = w.output
    if cfg.pre_ln:
        _norm(encoder.layer_norm, w.encoder_norm)
        _norm(decoder.layer_norm, w.decoder_norm)

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    config = spec.config
    config.layer_norm_epsilon = cfg.layer_norm_epsilon
    config.add_source_eos = True
    config.add_source_bos = False
    config.decoder_start_token = pieces[PAD_ID]
    config.bos_token = pieces[PAD_ID]  # t2t has no BOS; PAD starts the decoder
    config.eos_token = pieces[EOS_ID]
    config.unk_token = pieces[UNK_ID]
    return spec


def decoding_options(*, beam_size: int, length_penalty: float, max_decode_len: int,
                     pieces: list[str]) -> dict:
    """translate_batch's keyword arguments closest to t2t's beam search (module docstring)."""
    return dict(beam_size=beam_size, length_penalty=length_penalty,
                max_decoding_length=max_decode_len, suppress_sequences=[[pieces[PAD_ID]]])


def write(out_dir: str, weights: Weights, cfg: TransformerConfig, *, spm_path: str,
          pieces: list[str], beam_size: int, length_penalty: float, max_decode_len: int,
          quantization: str | None = None) -> str:
    """Writes model.bin, config.json, shared_vocabulary.json, the sentencepiece model and the
    decoding recipe t2t_decoding.json."""
    import os

    spec = build_spec(weights, cfg, pieces)
    spec.register_file(spm_path, SPM_FILE)
    spec.validate()
    spec.optimize(quantization=quantization)
    os.makedirs(out_dir, exist_ok=True)
    spec.save(out_dir)
    with open(os.path.join(out_dir, DECODING_FILE), 'w', encoding='utf-8') as f:
        json.dump(decoding_options(beam_size=beam_size, length_penalty=length_penalty,
                                   max_decode_len=max_decode_len, pieces=pieces),
                  f, indent=2, ensure_ascii=False)
        f.write('\n')
    return out_dir
