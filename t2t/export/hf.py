"""A Hugging Face MarianMT directory: MarianMTModel / MarianTokenizer.from_pretrained(DIR) load it.

Marian (transformers) is the paper's post-LN encoder-decoder with fixed sinusoidal positions,
embeddings x sqrt(d_model), ReLU feed-forward and optional shared / tied embeddings; it has no
pre-LN, learned, rotary or absent positions, so those are a one-line ExportError. Its sinusoids
are [sin | cos] where t2t interleaves them: the model dimension is permuted in every weight
(weights.permute_model_dim), which leaves every output the same.

What the format cannot say, and what it changes:
- LayerNorm epsilon: transformers' Marian fixes 1e-5 (t2t: config.layer_norm_epsilon, 1e-6). On
  the tested models this moves logits by < 1e-4 (tests/test_export.py).
- MarianTokenizer runs Moses punctuation normalization before sentencepiece; t2t does not. Text
  that the normalizer changes (e.g. typographic quotes, some spacing) tokenizes differently.
- generate()'s beam search ranks finished beams by sum log p / |Y|^length_penalty; t2t by the
  GNMT penalty ((5 + |Y|) / 6)^alpha (|Y| with EOS in both). The written length_penalty is the
  exponent fitted to t2t's curve (export.fitted_length_penalty); the curves still differ, so
  beams of different lengths may rank differently (tests/test_export.py, docs/export.md).
- t2t allows each sentence source length + max_decode_extra tokens (at most max_decode_len);
  generate() has one max_new_tokens for the batch: max_decode_len is written.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from t2t.export import weights as weights_lib
from t2t.export.weights import Attention, Layer, Linear, Norm, Weights
from t2t.ids import EOS_ID, PAD_ID, UNK_ID
from t2t.model import TransformerConfig

WEIGHTS_FILE = 'model.safetensors'


class UnsupportedError(ValueError):
    """The model uses an option the target format cannot express."""


def check_supported(cfg: TransformerConfig) -> None:
    if cfg.pre_ln:
        raise UnsupportedError('pre_ln=True cannot be exported to --format=hf: transformers\' '
                               'Marian is post-LN only (--format=ct2 supports pre-LN)')
    if cfg.position_embedding != 'sinusoidal':
        raise UnsupportedError(
            f'position_embedding={cfg.position_embedding!r} cannot be exported to --format=hf: '
            'transformers\' Marian has fixed sinusoidal positions only (--format=ct2 supports it)')


def _linear(out: dict, name: str, x: Linear) -> None:
    out[f'{name}.weight'] = x.w
    if x.b is not None:
        out[f'{name}.bias'] = x.b


def _norm(out: dict, name: str, n: Norm) -> None:
    out[f'{name}.weight'], out[f'{name}.bias'] = n.gamma, n.beta


def _attention(out: dict, name: str, a: Attention) -> None:
    for part, x in (('q_proj', a.q), ('k_proj', a.k), ('v_proj', a.v), ('out_proj', a.o)):
        _linear(out, f'{name}.{part}', x)


def _layer(out: dict, name: str, layer: Layer) -> None:
    _attention(out, f'{name}.self_attn', layer.self_attention)
    _norm(out, f'{name}.self_attn_layer_norm', layer.self_attention.norm)
    if layer.cross_attention is not None:
        _attention(out, f'{name}.encoder_attn', layer.cross_attention)
        _norm(out, f'{name}.encoder_attn_layer_norm', layer.cross_attention.norm)
    _linear(out, f'{name}.fc1', layer.ffn_in)
    _linear(out, f'{name}.fc2', layer.ffn_out)
    _norm(out, f'{name}.final_layer_norm', layer.ffn_norm)


def state_dict(w: Weights, cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """MarianMTModel's tensors (names as in its state_dict) of Weights already in Marian's order.

    Tied copies are left out: from_pretrained ties them again from the config.
    """
    out: dict[str, np.ndarray] = {}
    if cfg.share_embeddings:
        out['model.shared.weight'] = w.source_embedding
    else:
        out['model.encoder.embed_tokens.weight'] = w.source_embedding
        out['model.decoder.embed_tokens.weight'] = w.target_embedding
    if not cfg.tie_output:
        out['lm_head.weight'] = w.output
    out['final_logits_bias'] = np.zeros((1, w.output.shape[0]), np.float32)
    for i, layer in enumerate(w.encoder):
        _layer(out, f'model.encoder.layers.{i}', layer)
    for i, layer in enumerate(w.decoder):
        _layer(out, f'model.decoder.layers.{i}', layer)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def marian_config(cfg: TransformerConfig, vocab_size: int) -> dict:
    """config.json's fields (MarianConfig) for model `cfg` with `vocab_size` pieces."""
    return dict(
        architectures=['MarianMTModel'], model_type='marian',
        vocab_size=vocab_size, decoder_vocab_size=vocab_size,
        d_model=cfg.d_model, encoder_layers=cfg.num_encoder_layers,
        decoder_layers=cfg.num_decoder_layers, encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function='relu', max_position_embeddings=cfg.max_position,
        scale_embedding=cfg.scale_embeddings,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.tie_output,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID,
        bos_token_id=None, forced_eos_token_id=None, is_encoder_decoder=True, use_cache=True,
        torch_dtype='float32',
    )


def generation_config(*, beam_size: int, length_penalty: float, max_decode_len: int) -> dict:
    """generate()'s defaults closest to t2t's beam search (module docstring: the differences)."""
    return dict(
        num_beams=beam_size, length_penalty=length_penalty,
        # t2t stops only when no alive beam can still win (decode.py): transformers' exhaustive
        # criterion; PAD is never generated (t2t sets its log-prob to -inf, unrenormalized).
        early_stopping='never', bad_words_ids=[[PAD_ID]],
        max_new_tokens=max_decode_len, do_sample=False,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID,
        forced_eos_token_id=None,
    )


def write(out_dir: str, weights: Weights, cfg: TransformerConfig, *, spm_path: str,
          pieces: list[str], beam_size: int, length_penalty: float, max_decode_len: int,
          source_lang: str = '', target_lang: str = '') -> str:
    """Writes the MarianMT directory; returns out_dir. Needs safetensors, not torch."""
    from safetensors.numpy import save_file

    check_supported(cfg)
    marian = weights_lib.permute_model_dim(weights, weights_lib.sin_cos_permutation(cfg.d_model))
    os.makedirs(out_dir, exist_ok=True)
    save_file(state_dict(marian, cfg), os.path.join(out_dir, WEIGHTS_FILE),
              metadata={'format': 'pt'})

    def dump(name, obj):
        with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write('\n')

    dump('config.json', marian_config(cfg, len(pieces)))
    dump('generation_config.json', generation_config(
        beam_size=beam_size, length_penalty=length_penalty, max_decode_len=max_decode_len))
    # One shared sentencepiece model serves both sides; vocab.json maps its pieces to its ids.
    for name in ('source.spm', 'target.spm'):
        shutil.copyfile(spm_path, os.path.join(out_dir, name))
    dump('vocab.json', {piece: i for i, piece in enumerate(pieces)})
    dump('tokenizer_config.json', dict(
        tokenizer_class='MarianTokenizer', source_lang=source_lang or None,
        target_lang=target_lang or None, unk_token=pieces[UNK_ID], eos_token=pieces[EOS_ID],
        pad_token=pieces[PAD_ID],
        model_max_length=cfg.max_position, separate_vocabs=False))
    return out_dir
