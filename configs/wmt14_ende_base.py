"""The paper's base model on WMT14 English->German (newstest2014 test, 27.3 tokenized BLEU)."""

from configs import common


def get_config():
    c = common.wmt14('de', 'base')
    c.vocab_size = 37000  # the paper's shared byte-pair vocabulary of about 37k tokens
    c.lock()
    return c
