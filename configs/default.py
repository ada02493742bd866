"""The embedded default: a CPU-sized Transformer on the Debian trans-de-en English->German corpus.

`make demo` trains this for a fixed 1200 steps (past the step, about 1,050, after which the
validation loss stops improving on this corpus), so that any machine prints the same scores; only
the wall time depends on the machine, and `train_time_budget_s` is a safety limit that says so if
it cuts the run. It then evaluates the better, on the validation split, of the last checkpoint and
the average of the checkpoints of the run's final `average_fraction` of steps.
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
    c.num_train_steps = 1200
    c.train_time_budget_s = 7200.0  # a safety limit for a very slow machine, not the schedule
    c.log_every_steps = 25
    c.eval_every_steps = 150
    c.checkpoint_every_steps = 150
    c.keep_checkpoints = 5
    c.num_eval_batches = -1
    c.eval_bleu_sentences = 0
    c.max_decode_len = 128
    c.lock()
    return c
