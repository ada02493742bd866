"""The paper's big model on WMT14 English->German (28.4 tokenized BLEU on newstest2014)."""

from configs import common


def get_config():
    c = common.base_config()
    c.dataset = 'tfds'
    c.tfds_name = 'wmt14_translate/de-en'
    c.source_lang, c.target_lang = 'en', 'de'
    c.vocab_size = 37000
    c.max_len = 256
    c.batch_size = 104
    c.d_model, c.d_ff, c.num_heads = 1024, 4096, 16
    c.dropout_rate = 0.3  # the paper's P_drop for big EN-DE
    c.num_train_steps = 300_000
    c.dtype = 'bfloat16'
    c.attention_impl = 'dot_product'
    c.scan_layers = True  # compile time independent of depth (parameters stacked per stack)
    c.rng_impl = 'rbg'  # dropout keys from the hardware-friendly generator
    c.checkpoint_every_steps = 5000
    c.keep_checkpoints = 20  # the paper averages the last 20 checkpoints of big
    c.lock()
    return c
