"""The paper's big model on WMT14 English->French (41.8 tokenized BLEU on newstest2014)."""

from configs import common


def get_config():
    c = common.wmt14('fr', 'big')
    c.vocab_size = 32000  # the paper's 32000 word-piece vocabulary for EN-FR
    c.dropout_rate = 0.1  # EN-FR big used P_drop = 0.1, not 0.3
    c.lock()
    return c
