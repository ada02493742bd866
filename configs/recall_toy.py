"""The recall toy: the target is the first of `recall_length` symbols (t2t/data/recall.py).

    python train.py --config=configs/recall_toy.py --workdir=workdirs/recall8
    python -m t2t.eval.attention_maps --config=configs/recall_toy.py --workdir=workdirs/recall8 \
        --recall_report
    python train.py --config=configs/recall_toy.py --workdir=workdirs/recall128 \
        --config.recall_length=128                  # the lengths follow recall_length

A small model learns it in a few hundred steps on a CPU; the report gives the held-out accuracy
and the cross-attention weight from the answer's position to source position 0.
"""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'recall'
    c.recall_length = 8
    c.recall_train_examples = 20_000
    c.recall_eval_examples = 1000
    c.vocab_size = 9  # PAD, EOS, UNK, '0', '1', 'a' .. 'd'
    # One example per packed row: the source and its EOS fill max_len (references, so that
    # --config.recall_length=128 resizes them too).
    c.max_len = c.get_ref('recall_length') + 1
    c.max_eval_len = c.get_ref('recall_length') + 1
    c.max_decode_len = 4  # the answer, EOS, and room to show a model that fails to stop
    c.max_decode_extra = 3
    c.max_position = 1024
    c.batch_size = 64
    c.eval_batch_size = 64
    c.d_model, c.d_ff, c.num_heads = 64, 128, 4
    c.num_encoder_layers = c.num_decoder_layers = 2
    c.dropout_rate = 0.0
    c.learning_rate_scale = 1.0
    c.warmup_steps = 100
    c.num_train_steps = 400
    c.train_time_budget_s = 0.0
    c.log_every_steps = 50
    c.eval_every_steps = 100
    c.checkpoint_every_steps = 100
    c.keep_checkpoints = 2
    c.num_eval_batches = -1
    c.eval_bleu_sentences = 0
    c.beam_size = 1
    c.lock()
    return c
