"""Data: sources (embedded trans-de-en, TFDS WMT, TSV), the shared tokenizer, grain pipelines.

    tok = get_tokenizer(config)                  # prepares data, trains the vocabulary if missing
    it = train_iterator(config, tok, process_index=i, process_count=n)   # .get_state()/.set_state()
    for batch in eval_batches(config, tok, config.eval_split): ...       # batch['index'] -> order
    sources, references = split_texts(config, config.test_split)

Importing this package is cheap: grain, tensorflow_datasets and sentencepiece load on first use of
the functions below, so the model and train-step path never import them.
"""

import importlib

from t2t.ids import EOS_ID, PAD_ID, UNK_ID

_EXPORTS = {
    'Tokenizer': 'tokenizer',
    'EvalSplit': 'pipeline',
    'eval_batches': 'pipeline',
    'eval_split': 'pipeline',
    'get_tokenizer': 'pipeline',
    'split_names': 'pipeline',
    'split_texts': 'pipeline',
    'train_iterator': 'pipeline',
    'vocab_path': 'pipeline',
    'packed_split': 'cache',
    'open_split': 'sources',
}

__all__ = ['EOS_ID', 'PAD_ID', 'UNK_ID', *_EXPORTS]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
