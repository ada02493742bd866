"""A toy model on the embedded corpus for tests: seconds to compile, a minute to train."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'embedded'
    c.vocab_size = 1000
    c.tokenizer_character_coverage = 1.0  # a small corpus: every letter gets a piece
    c.tokenizer_sentences = 20_000
    c.max_len = 32
    c.max_eval_len = 64
    c.batch_size = 16
    c.eval_batch_size = 16
    c.d_model, c.d_ff, c.num_heads = 32, 64, 4
    c.num_encoder_layers = c.num_decoder_layers = 2
    c.max_position = 256
    c.learning_rate_scale = 2.0
    c.warmup_steps = 20
    c.num_train_steps = 60
    c.log_every_steps = 10
    c.eval_every_steps = 30
    c.checkpoint_every_steps = 30
    c.keep_checkpoints = 3
    c.num_eval_batches = 2
    c.eval_bleu_sentences = 16
    c.beam_size = 2
    c.max_decode_len = 64
    c.max_decode_extra = 10
    # Batches of a few sentences gain nothing from compaction, and each stage compiles again.
    c.beam_shrink_floor = 0
    c.lock()
    return c
