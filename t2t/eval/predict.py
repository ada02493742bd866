"""Model glue for decoding: a jitted predict function over one batch.

    decoding = DecodeConfig.from_config(config)   # t2t/decode.py; or DecodeConfig(beam_size=4)
    predict = make_predict_fn(model_config, decoding, mesh=mesh)
    prediction = predict(params, feed(inputs_BS, mesh))   # Prediction(ids_BL, hit_limit_B, ...)

Per batch the encoder runs once and the decode cache is created once for B rows, then
t2t/decode.py searches (beam, greedy or sampling; DecodeConfig, the decoding keys of a config,
checked at startup). Each example may generate its source length (EOS included) +
max_decode_extra tokens, at most max_decode_len (the paper: source + 50); the buffers are that
long for the bucket's source length S, so one compile per (B, S). A row without source tokens is
padding: nothing is decoded for it. A hypothesis that ends at its limit without EOS is flagged
(hit_limit), and again (capped) when the limit was max_decode_len, i.e. the buffer truncated it.

With a mesh, predict is shard_map-ped over every device: each decodes its own rows (`feed` pads
them to a multiple of the devices) with the parameters replicated, without logical axis rules
(every mesh axis is manual inside). An ensemble (a tuple of configs, t2t/eval/ensemble.py)
decodes with the mean of its members' log-probabilities. Bulk translation of many batches, in
order: t2t/eval/translate.py.

Shape letters: B batch, S source length, K beam size, N rows fed to the decoder (B * K, or B for
greedy), L generated positions, D d_model, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

from t2t import decode, sharding
from t2t.decode import DecodeConfig
from t2t.ids import PAD_ID
from t2t.model import Transformer, TransformerConfig


@struct.dataclass
class Prediction:
    """What `predict` returns for one batch (device arrays); None where not asked for."""

    ids_BL: jax.Array  # int32: the best hypothesis, EOS then 0s (no EOS when it hit its limit)
    hit_limit_B: jax.Array  # bool: ended at its length limit without emitting EOS
    capped_B: jax.Array  # bool: hit_limit where the limit was max_decode_len (truncated)
    score_B: jax.Array | None = None  # beam search's score of ids_BL (sum log p / penalty)
    nbest_ids_BNL: jax.Array | None = None  # DecodeConfig.nbest = N > 1: the best N, best first
    nbest_scores_BN: jax.Array | None = None  # their scores, -inf for an empty slot
    constraints_met_B: jax.Array | None = None  # predict(..., constraints): ids_BL has them all
    samples_BNL: jax.Array | None = None  # num_samples = N > 1: every draw (ids_BL is draw 0)
    limit_is_cap_B: jax.Array | None = None  # the length limit is max_decode_len


Predict = Callable[..., Prediction]  # (params, inputs_BS[, constraints])


# Beam search's first cache: the bucket's source length + 8, grown to the whole buffer once a
# step needs it, unless that saves fewer than 16 positions; each stage of compaction is its own
# compiled loop, and quarters compile half the stages of halves for the same warm time
# (bench/RESULTS.md, "Bulk translation: compaction, a short first cache and the stop rules").
SHORT_CACHE_OVER_SOURCE = 8
SHORT_CACHE_MIN_SAVING = 16
SHRINK_FACTOR = 4


def _self_attention_buffers(cache):
    return [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(cache)
            if path[-1].key in ('cached_key', 'cached_value')]


def _cache_length(cache) -> int:
    """The positions the decode cache holds (its key/value buffers: [..., H, length, K])."""
    return _self_attention_buffers(cache)[0][1].shape[-2]


def _grow_cache(cache, length: int):
    """The cache with its key/value buffers padded with zeros to `length` positions."""
    grown = {path: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, length - x.shape[-2]), (0, 0)])
             for path, x in _self_attention_buffers(cache)}
    return jax.tree_util.tree_map_with_path(lambda path, x: grown.get(path, x), cache)


# Odd multiplier of the source hash that seeds a row's sampling key (any odd 32-bit number).
_HASH_MULTIPLIER = 0x01000193


def sample_keys(inputs_BS, seed: int):
    """A PRNG key per row from the seed and the row's source tokens alone (a polynomial hash,
    mod 2**32, in which padding counts for nothing): a sentence's sample does not depend on its
    batch mates, its bucket's length or the device that decodes it. Equal sources get equal
    keys."""
    weights_S = np.array([pow(_HASH_MULTIPLIER, i, 1 << 32) for i in range(inputs_BS.shape[1])],
                         np.uint32)
    hash_B = jnp.sum(inputs_BS.astype(jnp.uint32) * weights_S, axis=1, dtype=jnp.uint32)
    base = jax.random.key(seed, impl='threefry2x32')  # not rng_impl: the same on every backend
    return jax.vmap(jax.random.fold_in, (None, 0))(base, hash_B)


def draw_keys(keys_B, num_samples: int):
    """The keys of num_samples draws per row, [B * num_samples] (a row's draws adjacent): draw 0
    keeps the row's key (the sentence's single sample), draw j > 0 folds j into it."""
    keys_BN = jax.vmap(lambda key: jax.vmap(jax.random.fold_in, (None, 0))(
        key, jnp.arange(num_samples)))(keys_B)
    data_BN2 = jax.random.key_data(keys_BN)
    first_BN = (jnp.arange(num_samples) == 0)[None, :, None]
    data_BN2 = jnp.where(first_BN, jax.random.key_data(keys_B)[:, None], data_BN2)
    return jax.random.wrap_key_data(data_BN2.reshape(-1, data_BN2.shape[-1]),
                                    impl='threefry2x32')


def shrink_ladder(rows: int, floor: int) -> tuple[int, ...]:
    """The batch sizes beam search compacts a batch of `rows` examples to (decode.beam_search's
    shrink_to): quarters while they stay whole and >= floor (0: none, one stage)."""
    ladder = []
    while floor and rows % SHRINK_FACTOR == 0 and rows // SHRINK_FACTOR >= floor:
        rows //= SHRINK_FACTOR
        ladder.append(rows)
    return tuple(ladder)


def next_logits(model: Transformer, encoded_BSD, inputs_BS, prev_ids_B1):
    """A decode-mode model's apply method: the logits [B, 1, V] of the token after prev_ids_B1."""
    return model.logits(model.decode(encoded_BSD, inputs_BS, prev_ids_B1))


class _Member:
    """One model's side of decoding: the encoder once per batch, then one token per step."""

    def __init__(self, model_config: TransformerConfig, num_valid_ids: int | None):
        self.config = model_config.replace(deterministic=True, decode=False)
        self.num_valid_ids = num_valid_ids

    def _decoder(self, length: int) -> Transformer:
        return Transformer(self.config.replace(decode=True, decode_len=length))

    def start(self, params, inputs_BS, first: int):
        """(the decode cache for B rows with `first` positions, the search's constants)."""
        encoded_BSD = Transformer(self.config).apply({'params': params}, inputs_BS,
                                                     method=Transformer.encode)
        # The first call only builds the cache: self-attention buffers, cross keys/values.
        _, variables = self._decoder(first).apply(
            {'params': params}, encoded_BSD, inputs_BS,
            jnp.full((inputs_BS.shape[0], 1), PAD_ID, jnp.int32),
            method=next_logits, mutable=['cache', 'cross_cache'])
        # Then the decoder reads only the source mask and the cross keys/values: constants.
        return variables['cache'], {'inputs': inputs_BS, 'cross_cache': variables['cross_cache']}

    def step(self, params, ids_N1, cache, constants):
        """decode.TokensToLogits with the params bound: (logits_NV, the advanced cache)."""
        unused_N1D = jnp.zeros((ids_N1.shape[0], 1, self.config.d_model), self.config.dtype)
        logits_N1V, new_vars = self._decoder(_cache_length(cache)).apply(
            {'params': params, 'cache': cache, 'cross_cache': constants['cross_cache']},
            unused_N1D, constants['inputs'], ids_N1, method=next_logits, mutable=['cache'])
        logits_NV = logits_N1V[:, 0]
        if self.num_valid_ids is not None and self.num_valid_ids < logits_NV.shape[-1]:
            # Rows the tokenizer cannot detokenize; finite, so log_softmax stays finite.
            valid_V = jnp.arange(logits_NV.shape[-1]) < self.num_valid_ids
            logits_NV = jnp.where(valid_V, logits_NV, -1e9)
        return logits_NV, new_vars['cache']


def _ensemble_step(members: Sequence[_Member], params, ids_N1, caches, constants):
    """An ensemble's decode.TokensToLogits: the mean of the members' log-probabilities (not
    renormalized) over the vocabulary rows all have; each member advances its own cache."""
    stepped = [m.step(p, ids_N1, c, k)
               for m, p, c, k in zip(members, params, caches, constants, strict=True)]
    V = min(logits_NV.shape[-1] for logits_NV, _ in stepped)
    log_probs_MNV = jnp.stack([jax.nn.log_softmax(logits_NV.astype(jnp.float32))[:, :V]
                               for logits_NV, _ in stepped])
    return jnp.mean(log_probs_MNV, axis=0), tuple(cache for _, cache in stepped)


def describe(decoding: DecodeConfig) -> str:
    """The decoding settings for a report line."""
    if decoding.decode_strategy == 'greedy':
        return 'greedy'
    if decoding.decode_strategy == 'sample':
        draws = f'{decoding.num_samples} draws, ' if decoding.num_samples > 1 else ''
        return (f'sampling: {draws}temperature {decoding.temperature}, top_k {decoding.top_k}, '
                f'top_p {decoding.top_p}, seed {decoding.decode_seed}')
    stop = '' if decoding.beam_stop == 'bound' else f', stop {decoding.beam_stop}'
    return f'beam {decoding.beam_size}, alpha {decoding.length_penalty_alpha}{stop}'


def _search(decoding: DecodeConfig, tokens_to_logits, cache, constants, *, keys_B,
            batch_size: int, L: int, limit_B, first: int, log_probs: bool, constraints):
    """The decoding.decode_strategy search of one bucket: (ids_BL, score_B, nbest_ids_BNL,
    nbest_scores_BN), the last three None where the strategy has none."""
    strategy, eos_id = decoding.decode_strategy, decoding.eos_id
    score_B = nbest_ids_BNL = nbest_scores_BN = None
    if strategy == 'sample':
        ids_BL = decode.sample_search(
            tokens_to_logits, cache, keys_B=keys_B, batch_size=batch_size, eos_id=eos_id,
            max_decode_len=L, max_lengths=limit_B, constants=constants,
            temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
    elif strategy == 'greedy':
        ids_BL = decode.greedy_search(
            tokens_to_logits, cache, batch_size=batch_size, eos_id=eos_id,
            max_decode_len=L, max_lengths=limit_B, constants=constants)
    else:
        seqs_BKL, scores_BK = decode.beam_search(
            tokens_to_logits, cache, batch_size=batch_size, beam_size=decoding.beam_size,
            alpha=decoding.length_penalty_alpha, eos_id=eos_id, max_decode_len=L,
            max_lengths=limit_B, unfinished=decoding.beam_unfinished,
            stop=decoding.beam_stop, constants=constants,
            shrink_to=shrink_ladder(batch_size, decoding.beam_shrink_floor), cache_lengths=(first,),
            grow_cache=_grow_cache, log_probs=log_probs, constraints=constraints)
        ids_BL, score_B = seqs_BKL[:, 0], scores_BK[:, 0]
        if decoding.nbest > 1:
            nbest_ids_BNL = seqs_BKL[:, :decoding.nbest]
            nbest_scores_BN = scores_BK[:, :decoding.nbest]
    return ids_BL, score_B, nbest_ids_BNL, nbest_scores_BN


@functools.lru_cache(maxsize=32)
def make_predict_fn(model_config: TransformerConfig | tuple[TransformerConfig, ...],
                    decoding: DecodeConfig, *, num_valid_ids: int | None = None,
                    mesh=None) -> Predict:
    """A jitted predict(params, inputs_BS, constraints=None) -> Prediction, decoding as
    `decoding` says; constraints: each row's phrases for beam search (t2t/eval/constraints.py).
    Cached: every caller with the same settings shares the function and its compiled buckets.

    mesh: the batch split over all its devices (rows a multiple of mesh.size, e.g. from `feed`),
    the parameters replicated inside. num_valid_ids: the tokenizer's size when the embedding has
    more rows; ids from it up are never generated. An ensemble: model_config a tuple of its
    members' configs, params the tuple of theirs; each step reads the mean of their
    log-probabilities (`_ensemble_step`).
    """
    configs = model_config if isinstance(model_config, tuple) else (model_config,)
    for member in configs:  # positions beyond a table would clamp
        if decoding.max_decode_len > member.max_position:
            raise ValueError(f'max_decode_len={decoding.max_decode_len} exceeds the model\'s '
                             f'max_position={member.max_position}')
    members = [_Member(member, num_valid_ids) for member in configs]
    ensemble = isinstance(model_config, tuple)
    strategy, eos_id = decoding.decode_strategy, decoding.eos_id
    max_decode_len, max_decode_extra = decoding.max_decode_len, decoding.max_decode_extra
    num_samples = decoding.num_samples

    def predict(params, inputs_BS, constraints=None) -> Prediction:
        keys_B = samples_BNL = None
        if strategy == 'sample':
            keys_B = sample_keys(inputs_BS, decoding.decode_seed)
        if num_samples > 1:  # each row num_samples times (adjacent), each with its draw's key
            keys_B = draw_keys(keys_B, num_samples)
            inputs_BS = jnp.repeat(inputs_BS, num_samples, axis=0)
        B, S = inputs_BS.shape
        if constraints is not None and strategy != 'beam':
            raise ValueError(f'constraints need decode_strategy=beam, not {strategy!r}')
        L = min(max_decode_len, S + max_decode_extra)  # static: the longest limit in this bucket
        src_len_B = jnp.sum(inputs_BS != PAD_ID, axis=1).astype(jnp.int32)
        wanted_B = src_len_B + max_decode_extra
        # A row without source tokens is padding (a real source holds EOS at least): limit 0
        # decodes nothing for it.
        limit_B = jnp.where(src_len_B > 0, jnp.minimum(wanted_B, max_decode_len), 0)

        # Beam search starts with a cache of `first` positions and grows it to L once (decode.py's
        # cache_lengths): most sentences end before, and every step's reorder and attention
        # cost follows the cache's length.
        first = S + SHORT_CACHE_OVER_SOURCE
        # Greedy and sampling never grow the cache; a short saving is not worth its compile.
        if strategy != 'beam' or L - first < SHORT_CACHE_MIN_SAVING:
            first = L
        if ensemble:
            started = [m.start(p, inputs_BS, first) for m, p in zip(members, params, strict=True)]
            cache = tuple(c for c, _ in started)
            constants = tuple(k for _, k in started)
            tokens_to_logits = functools.partial(_ensemble_step, members, params)
        else:
            cache, constants = members[0].start(params, inputs_BS, first)
            tokens_to_logits = functools.partial(members[0].step, params)

        ids_BL, score_B, nbest_ids_BNL, nbest_scores_BN = _search(
            decoding, tokens_to_logits, cache, constants, keys_B=keys_B, batch_size=B, L=L,
            limit_B=limit_B, first=first, log_probs=ensemble, constraints=constraints)
        limit_is_cap_B = wanted_B > max_decode_len
        if num_samples > 1:  # back to one row per sentence: draw 0 the output, all draws beside
            samples_BNL = ids_BL.reshape(-1, num_samples, L)
            ids_BL, src_len_B = samples_BNL[:, 0], src_len_B[::num_samples]
            limit_is_cap_B = limit_is_cap_B[::num_samples]
        hit_limit_B = ~jnp.any(ids_BL == eos_id, axis=1) & (src_len_B > 0)
        return Prediction(ids_BL=ids_BL, hit_limit_B=hit_limit_B,
                          capped_B=hit_limit_B & limit_is_cap_B, score_B=score_B,
                          nbest_ids_BNL=nbest_ids_BNL, nbest_scores_BN=nbest_scores_BN,
                          samples_BNL=samples_BNL, limit_is_cap_B=limit_is_cap_B,
                          constraints_met_B=None if constraints is None else
                          constraints.met(ids_BL))

    if mesh is None:
        return jax.jit(predict)

    def predict_rows(params, inputs_BS, constraints) -> Prediction:
        with nn.logical_axis_rules(()):  # sharding constraints: no-ops, every mesh axis is manual
            return predict(params, inputs_BS, constraints)

    rows = PartitionSpec(sharding.MESH_AXES)  # each device: its own rows, the whole search
    blocks = jax.shard_map(predict_rows, mesh=mesh, in_specs=(PartitionSpec(), rows, rows),
                           out_specs=rows, check_vma=False)

    def predict_block(params, inputs_BS, constraints=None) -> Prediction:
        return blocks(params, inputs_BS, constraints)  # shard_map takes no default

    return jax.jit(predict_block)


def config_predict_fn(config, model_config: TransformerConfig | tuple[TransformerConfig, ...],
                      *, num_valid_ids: int, nbest: int = 1, mesh=None) -> Predict:
    """The predict function of an experiment config's decoding keys (`DecodeConfig`), with beam
    search's best `nbest` hypotheses too; an ensemble's for a tuple of member configs."""
    return make_predict_fn(model_config, DecodeConfig.from_config(config, nbest=nbest),
                           num_valid_ids=num_valid_ids, mesh=mesh)


def feed(inputs_BS, mesh=None):
    """A batch every process holds in full -> what predict(mesh=mesh) takes: rows padded to a
    multiple of the mesh's devices, each device given its own rows. Without a mesh: as is."""
    if mesh is None:
        return inputs_BS
    inputs_BS = np.asarray(inputs_BS)
    pad = -len(inputs_BS) % mesh.size
    if pad:
        inputs_BS = np.concatenate([inputs_BS, np.zeros((pad,) + inputs_BS.shape[1:],
                                                        inputs_BS.dtype)])
    return sharding.put_global(inputs_BS, sharding.decode_sharding(mesh))


def fetch(prediction: Prediction, rows: int) -> Prediction:
    """Host copies of the first `rows` rows of a prediction, on every process (a collective when
    the arrays span several processes: every process must call it)."""
    return jax.tree.map(lambda x: np.asarray(x)[:rows],
                        multihost_utils.process_allgather(prediction, tiled=True))
