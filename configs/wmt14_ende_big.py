"""The paper's big model on WMT14 English->German (28.4 tokenized BLEU on newstest2014)."""

from configs import common


def get_config():
    c = common.wmt14('de', 'big')
    c.vocab_size = 37000  # the paper's shared byte-pair vocabulary of about 37k tokens
    c.dropout_rate = 0.3  # the paper's P_drop for big EN-DE
    c.lock()
    return c
