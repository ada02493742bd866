"""The paper's base model on WMT14 English->German (newstest2014 test, 27.3 tokenized BLEU)."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'tfds'
    c.tfds_name = 'wmt14_translate/de-en'
    c.source_lang, c.target_lang = 'en', 'de'
    c.vocab_size = 37000  # the paper's shared byte-pair vocabulary of about 37k tokens
    c.max_len = 256
    c.batch_size = 104  # ~25k source and ~25k target tokens per batch, as in the paper
    c.num_train_steps = 100_000
    c.dtype = 'bfloat16'
    c.attention_impl = 'dot_product'
    c.scan_layers = True  # compile time independent of depth (parameters stacked per stack)
    c.rng_impl = 'rbg'  # dropout keys from the hardware-friendly generator
    c.checkpoint_every_steps = 2000
    c.keep_checkpoints = 5  # the paper averages the last 5 checkpoints of base
    c.lock()
    return c
