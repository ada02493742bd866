"""The embedded default: a CPU-sized Transformer on the Debian trans-de-en English->German corpus.

`make demo` trains this within `train_time_budget_s` on a 2-core machine (about 2000 steps),
then evaluates the average of its last 5 checkpoints (150 steps apart) on the held-out test split.
"""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'embedded'
    c.source_lang, c.target_lang = 'en', 'de'
    c.vocab_size = 4000
    c.tokenizer_character_coverage = 1.0  # a small corpus: every letter gets a piece
    c.tokenizer_sentences = 100_000
    c.max_len = 64
    c.max_eval_len = 128
    c.batch_size = 64
    c.eval_batch_size = 64
    c.d_model, c.d_ff, c.num_heads = 128, 512, 4
    c.num_encoder_layers = c.num_decoder_layers = 3
    c.max_position = 256
    c.learning_rate_scale = 0.8
    c.warmup_steps = 300
    c.num_train_steps = 100_000
    c.train_time_budget_s = 1000.0
    c.log_every_steps = 25
    c.eval_every_steps = 150
    c.checkpoint_every_steps = 150
    c.keep_checkpoints = 5
    c.num_eval_batches = -1
    c.eval_bleu_sentences = 0
    c.max_decode_len = 128
    c.lock()
    return c
