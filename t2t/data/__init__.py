"""Data: sources (embedded trans-de-en, TFDS WMT, TSV, HF datasets), the tokenizer, grain pipelines.

    tok = get_tokenizer(config)                  # prepares data, trains the vocabulary if missing
    it = train_iterator(config, tok, rows=sharding.process_rows(...))   # .get_state()/.set_state()
    packed = train_rows(config, tok)             # the training rows (a split's, or a mixture's)
    for batch in eval_batches(config, tok, config.eval_split): ...       # batch['index'] -> order
    sources, references = split_texts(config, config.test_split)

Importing this package is cheap: grain, tensorflow_datasets and sentencepiece load on first use of
the functions below.
"""

from t2t.data.cache import packed_split
from t2t.data.pipeline import (
    EvalSplit,
    eval_batches,
    eval_split,
    get_tokenizer,
    split_texts,
    train_iterator,
    train_rows,
    vocab_path,
)
from t2t.data.sources import open_split
from t2t.data.tokenizer import Tokenizer
from t2t.ids import EOS_ID, PAD_ID, UNK_ID

__all__ = ['EOS_ID', 'PAD_ID', 'UNK_ID', 'EvalSplit', 'Tokenizer', 'eval_batches', 'eval_split',
           'get_tokenizer', 'open_split', 'packed_split', 'split_texts',
           'train_iterator', 'train_rows', 'vocab_path']
