"""Attention maps of a trained model, read from the model itself, as pictures and as numbers.

    python -m t2t.eval.attention_maps --config=configs/default.py --workdir=workdirs/default \
        --sentence="The house is small." --output=attention.png
    python -m t2t.eval.attention_maps --config=configs/recall_toy.py --workdir=DIR --recall_report

A picture: the sentence is decoded as evaluate.py decodes it (beam search with the config's beam
size), then one teacher-forced pass over (sentence, output) with `sow_attention` on stores every
attention's softmax weights (t2t/attention.py sows them into 'intermediates'). The PNG
has three blocks, encoder self-attention, decoder self-attention and cross-attention, each a grid
of layers (rows) x heads (columns). In a panel rows are queries and columns keys, labelled with
the tokenizer's pieces: source pieces for the encoder's queries and for every key of the
cross-attention, output pieces for the decoder's queries (the token each position emits), and
decoder-input pieces (`<start>`, then the output shifted right) for the decoder's own keys.

The recall report (configs/recall_toy.py): greedy-decoded accuracy on held-out sequences, the
cross-attention weight from the position that emits the answer (the first output position) to
source position 0, averaged over the examples, per decoder layer and head, and the encoder
self-attention weight from the other source positions to position 0 (a head that copies the first
symbol everywhere lets the decoder read it at any position).

Shape letters: B batch, H heads, Q queries, K keys, S source length, T target length, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np

from t2t.decode import DecodeConfig
from t2t.eval import checkpoints as eval_checkpoints
from t2t.eval import predict as predict_lib
from t2t.eval import translate
from t2t.eval.checkpoints import EvalError
from t2t.ids import EOS_ID, PAD_ID
from t2t.infra import workdir as wd
from t2t.model import Transformer, TransformerConfig
from t2t.run import checkpoint

KINDS = ('encoder self-attention', 'decoder self-attention', 'cross-attention')
START_PIECE = '<start>'  # the decoder's first input (PAD_ID serves as the start token)


@functools.lru_cache(maxsize=8)
def _weights_fn(model_config: TransformerConfig):
    # The same weights from the plain XLA path, whatever kernel the config trains with.
    config = model_config.replace(deterministic=True, decode=False, sow_attention=True,
                                  attention_impl='xla')
    model = Transformer(config)

    def weights(params, inputs_BS, targets_BT):
        _, state = model.apply({'params': params}, inputs_BS, targets_BT,
                               mutable=['intermediates'])
        found = state['intermediates']

        def get(layer, name):
            return found[layer][name]['attention_weights'][0]

        encoder = [f'encoder_{i}' for i in range(config.num_encoder_layers)]
        decoder = [f'decoder_{i}' for i in range(config.num_decoder_layers)]
        return {KINDS[0]: [get(n, 'self_attention') for n in encoder],
                KINDS[1]: [get(n, 'self_attention') for n in decoder],
                KINDS[2]: [get(n, 'cross_attention') for n in decoder]}

    return jax.jit(weights)


def attention_weights(model_config: TransformerConfig, params, inputs_BS, targets_BT
                      ) -> dict[str, list[np.ndarray]]:
    """{kind: [weights_BHQK of each layer]} of the teacher-forced pass over (inputs, targets)."""
    found = _weights_fn(model_config)(params, jnp.asarray(inputs_BS), jnp.asarray(targets_BT))
    return {kind: [np.asarray(w) for w in layers] for kind, layers in found.items()}


def _restore(config, workdir, step):
    """(label, params, tokenizer, model config), checked against each other as evaluate.py does."""
    from t2t import data

    label, steps = eval_checkpoints.select(workdir, step=step)[0]
    try:
        tokenizer = data.get_tokenizer(config)
    except (ValueError, OSError) as e:
        raise EvalError(f'cannot load the tokenizer: {e}') from e
    # Unrolled layers whatever the config trains with: one sown entry per layer.
    params = eval_checkpoints.load_params(workdir, steps, scan_layers=False)
    model_config = TransformerConfig.from_config(config, scan_layers=False)
    eval_checkpoints.check_params(params, model_config, tokenizer, label)
    return label, params, tokenizer, model_config


# ----------------------------------------------------------------------------------------------
# One sentence -> a picture


@dataclasses.dataclass(frozen=True)
class SentenceMaps:
    """The attention of one decoded sentence: weights and the pieces that label them."""

    label: str  # the checkpoint, e.g. step-950
    translation: str
    source_pieces: list[str]  # S, EOS included
    output_pieces: list[str]  # T: what each decoder position emits (EOS included if emitted)
    decoder_input_pieces: list[str]  # T: <start>, then the output shifted right
    weights: dict[str, list[np.ndarray]]  # kind -> per layer [H, Q, K]


def sentence_maps(config, workdir, sentence: str, *, step: int | None = None) -> SentenceMaps:
    """Decodes `sentence` with the config's beam search and reads the attention of that output."""
    label, params, tokenizer, model_config = _restore(config, workdir, step)
    source = tokenizer.encode(sentence) + [EOS_ID]
    if not sentence.strip() or len(source) > config.max_eval_len:
        raise EvalError(f'--sentence has {len(source)} tokens (EOS included); it must '
                        f'be non-empty and at most max_eval_len={config.max_eval_len}')
    predict = predict_lib.config_predict_fn(config, model_config,
                                            num_valid_ids=tokenizer.vocab_size)
    ids = np.asarray(jax.device_get(predict(params, np.asarray([source], np.int32)).ids_BL))[0]
    ends = np.flatnonzero(ids == EOS_ID)
    output = ids[:ends[0] + 1] if len(ends) else ids[ids != PAD_ID]
    weights = attention_weights(model_config, params, np.asarray([source], np.int32),
                                np.asarray([output], np.int32))
    out_pieces = [tokenizer.piece(i) for i in output]
    return SentenceMaps(
        label=label, translation=tokenizer.decode(output),
        source_pieces=[tokenizer.piece(i) for i in source], output_pieces=out_pieces,
        decoder_input_pieces=[START_PIECE] + out_pieces[:-1],
        weights={kind: [w[0] for w in layers] for kind, layers in weights.items()})


def default_output(workdir):
    """WORKDIR/attention.png: a local path or an object in the workdir's bucket."""
    return wd.path(workdir, 'attention.png')


def plot(maps: SentenceMaps, path, title: str = ''):
    """Writes the PNG to `path` (local or gs://..., atomically); returns the matplotlib figure
    (one axes per layer x head x kind)."""
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    labels = {  # (query labels, key labels) of each kind
        KINDS[0]: (maps.source_pieces, maps.source_pieces),
        KINDS[1]: (maps.output_pieces, maps.decoder_input_pieces),
        KINDS[2]: (maps.output_pieces, maps.source_pieces),
    }
    heads = maps.weights[KINDS[0]][0].shape[0]
    rows = max(len(layers) for layers in maps.weights.values())
    longest = max(len(maps.source_pieces), len(maps.output_pieces))
    panel = 0.9 + 0.13 * longest  # inches: room for the pieces as tick labels
    fig = plt.figure(figsize=(3 * heads * panel + 1, rows * panel + 1.2), layout='constrained')
    blocks = fig.subfigures(1, len(KINDS), wspace=0.02)
    font = max(4.0, min(8.0, 220 / longest / heads))
    for block, kind in zip(blocks, KINDS, strict=True):
        layers = maps.weights[kind]
        block.suptitle(kind, fontsize=10)
        grid = block.subplots(len(layers), heads, squeeze=False)
        queries, keys = labels[kind]
        for layer, row in enumerate(grid):
            for head, ax in enumerate(row):
                ax.imshow(layers[layer][head], cmap='viridis', vmin=0.0, vmax=1.0,
                          aspect='auto', interpolation='nearest')
                ax.set_title(f'layer {layer + 1} head {head + 1}', fontsize=7)
                ax.set_xticks(range(len(keys)))
                ax.set_yticks(range(len(queries)))
                bottom, first = layer == len(layers) - 1, head == 0
                ax.set_xticklabels(keys if bottom else [], rotation=90, fontsize=font)
                ax.set_yticklabels(queries if first else [], fontsize=font)
                ax.tick_params(length=0)
    fig.suptitle(title or f'{maps.label}: {maps.translation}', fontsize=11)
    png = io.BytesIO()  # matplotlib writes local files only: the bytes go through workdir.py
    fig.savefig(png, format='png', dpi=110)
    wd.write_atomic(path, png.getvalue())
    plt.close(fig)
    return fig


# ----------------------------------------------------------------------------------------------
# The recall toy's report


def _best(weights_LH: np.ndarray) -> tuple[int, int, float]:
    """(layer, head, weight) of the largest entry, 1-based."""
    layer, head = np.unravel_index(np.argmax(weights_LH), weights_LH.shape)
    return int(layer) + 1, int(head) + 1, float(weights_LH[layer, head])


def _table(weights_LH: np.ndarray) -> list[str]:
    layers, heads = weights_LH.shape
    lines = ['         ' + ''.join(f'  head {h + 1:<3}' for h in range(heads))]
    for layer in range(layers):
        lines.append(f'layer {layer + 1:<3}'
                     + ''.join(f'  {weights_LH[layer, h]:8.3f}' for h in range(heads)))
    return lines


@dataclasses.dataclass(frozen=True)
class RecallReport:
    """What a recall-toy model does with source position 0 (weights: means over examples).

    The answer can reach the decoder two ways: its cross-attention reads position 0 directly
    (first_weights_LH high), or an encoder self-attention head first copies position 0 to every
    position (encoder_weights_LH high) and the decoder reads it anywhere.
    """

    label: str  # the checkpoint
    split: str
    examples: int
    accuracy: float  # greedy output == the first symbol, over every example of the split
    first_weights_LH: np.ndarray  # cross-attention, first output position -> source position 0
    by_answer: dict[str, np.ndarray]  # the same, over the examples of each answer
    encoder_weights_LH: np.ndarray  # encoder self-attention, source positions 1.. -> position 0

    @property
    def best(self) -> tuple[int, int, float]:
        """(layer, head, weight) of the decoder head that reads source position 0 most."""
        return _best(self.first_weights_LH)

    @property
    def encoder_best(self) -> tuple[int, int, float]:
        """(layer, head, weight) of the encoder head that copies position 0 most."""
        return _best(self.encoder_weights_LH)

    def format(self) -> str:
        layer, head, weight = self.best
        split = ', '.join(f'{w[layer - 1, head - 1]:.3f} when the answer is {a}'
                          for a, w in sorted(self.by_answer.items()))
        e_layer, e_head, e_weight = self.encoder_best
        return '\n'.join([
            f'{self.label} on {self.split}: {self.examples} held-out sequences, greedy '
            f'accuracy {self.accuracy:.4f}',
            'cross-attention weight from the first output position (the answer) to source '
            'position 0, mean over the examples:',
            *_table(self.first_weights_LH),
            f'best: layer {layer} head {head}: {weight:.3f} ({split})',
            'encoder self-attention weight from source positions 1.. to position 0, mean over '
            'positions and examples:',
            *_table(self.encoder_weights_LH),
            f'best: layer {e_layer} head {e_head}: {e_weight:.3f}'])


def recall_report(config, workdir, *, split: str = '', step: int | None = None) -> RecallReport:
    """Accuracy and first-position attention of a recall-toy checkpoint on a held-out split."""
    from t2t import data

    if config.dataset != 'recall':
        raise EvalError(f'--recall_report needs dataset=recall, not {config.dataset!r}')
    label, params, tokenizer, model_config = _restore(config, workdir, step)
    split = split or config.test_split
    eval_split = data.eval_split(config, tokenizer, split)
    greedy = DecodeConfig.from_config(config).replace(decode_strategy='greedy')
    predict = predict_lib.make_predict_fn(model_config, greedy, num_valid_ids=tokenizer.vocab_size)
    n = len(eval_split.sources)
    result = translate.translate_batches(predict, params, eval_split.batches(
        config.eval_batch_size), tokenizer, n, progress=False)
    correct = sum(h == r for h, r in zip(result.hypotheses, eval_split.references, strict=True))
    sums, counts = {}, {}  # per answer id: [L, H] sums of the weight of query 0 on key 0
    encoder_sum, rows = 0.0, 0
    for batch in eval_split.batches(config.eval_batch_size):
        maps = attention_weights(model_config, params, batch['inputs'], batch['targets'])
        real_N = batch['index'] >= 0
        first_NLH = np.stack([w[:, :, 0, 0] for w in maps[KINDS[2]]], axis=1)
        for answer in np.unique(batch['targets'][real_N, 0]).tolist():
            rows_N = real_N & (batch['targets'][:, 0] == answer)
            sums[answer] = sums.get(answer, 0.0) + first_NLH[rows_N].sum(axis=0)
            counts[answer] = counts.get(answer, 0) + int(rows_N.sum())
        # queries 1 .. last real token of each row, onto key 0; averaged over them per row
        later_NS = (batch['inputs'] != PAD_ID) & (np.arange(batch['inputs'].shape[1]) > 0)
        share_N = later_NS / np.maximum(later_NS.sum(axis=1, keepdims=True), 1)
        encoder_NLH = np.stack([np.einsum('nhs,ns->nh', w[:, :, :, 0], share_N)
                                for w in maps[KINDS[0]]], axis=1)
        encoder_sum = encoder_sum + encoder_NLH[real_N].sum(axis=0)
        rows += int(real_N.sum())
    by_answer = {tokenizer.piece(a): sums[a] / counts[a] for a in sorted(sums)}
    return RecallReport(label=label, split=eval_split.name, examples=n, accuracy=correct / n,
                        first_weights_LH=sum(sums.values()) / max(rows, 1), by_answer=by_answer,
                        encoder_weights_LH=encoder_sum / max(rows, 1))


# ----------------------------------------------------------------------------------------------
# Entry


def main(argv):
    from absl import app, flags

    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    f = flags.FLAGS
    try:
        if f.recall_report:
            print(recall_report(f.config, f.workdir, split=f.split, step=f.step).format())
            return
        if not f.sentence:
            raise app.UsageError('give --sentence="..." (a picture) or --recall_report')
        maps = sentence_maps(f.config, f.workdir, f.sentence, step=f.step)
        output = f.output or default_output(f.workdir)
        plot(maps, output)
        print(f'{maps.label}: {f.sentence!r} -> {maps.translation!r}\nattention maps -> {output}')
    except (EvalError, checkpoint.CheckpointError) as e:
        sys.exit(f't2t.eval.attention_maps: {e}')


if __name__ == '__main__':
    from absl import app, flags, logging
    from ml_collections import config_flags

    config_flags.DEFINE_config_file('config', None, 'Experiment config.')
    flags.DEFINE_string('workdir', None, 'The training workdir (holds checkpoints/).')
    flags.DEFINE_integer('step', None, 'Use this checkpoint step (default: the latest).')
    flags.DEFINE_string('sentence', '', 'A source sentence to decode and picture.')
    flags.DEFINE_string('output', '', 'The PNG (default: WORKDIR/attention.png).')
    flags.DEFINE_bool('recall_report', False, 'Print the recall toy\'s accuracy and attention.')
    flags.DEFINE_string('split', '', 'With --recall_report: the split (default: test_split).')
    flags.mark_flags_as_required(['config', 'workdir'])
    logging.set_verbosity(logging.WARNING)
    from t2t.infra import platforms

    platforms.skip_absent_tpu()
    app.run(main)
