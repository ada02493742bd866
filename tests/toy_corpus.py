"""A small synthetic parallel corpus written as TSV files, shared by the tests.

The "target language" is the source reversed and upper-cased: learnable by a toy model in a few
steps, and every split is made of real lines the TSV source reads like a user's own data.
"""

import random

WORDS = ('red green blue small large old new house tree river stone cat dog bird sees finds '
         'likes near under over the a one two three'.split())


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) + ' .'


def translate(text: str) -> str:
    return ' '.join(w.upper() for w in reversed(text.split()))


def write_tsv(path, sources) -> str:
    path.write_text(''.join(f'{s}\t{translate(s)}\n' for s in sources), encoding='utf-8')
    return str(path)


def make_corpus(root, seed: int = 0, train: int = 400, validation: int = 37, test: int = 21,
                long_validation: int = 3) -> dict:
    """Writes train/validation/test TSVs under root; validation has a few over-long pairs."""
    rng = random.Random(seed)
    train_src = [sentence(rng, 2, 12) for _ in range(train)]
    validation_src = ([sentence(rng, 2, 5) for _ in range(validation)]
                      + [sentence(rng, 20, 24) for _ in range(long_validation)])
    rng.shuffle(validation_src)
    test_src = [sentence(rng, 2, 5) for _ in range(test)]
    return {'root': root, 'train': write_tsv(root / 'train.tsv', train_src),
            'validation': write_tsv(root / 'validation.tsv', validation_src),
            'test': write_tsv(root / 'test.tsv', test_src), 'validation_texts': validation_src}


def tiny_config(corpus: dict, **overrides):
    """configs/tiny.py on the toy corpus, with a 400-piece vocabulary (256 are UTF-8 bytes)."""
    from configs import tiny

    c = tiny.get_config()
    c.dataset = 'tsv'
    c.data_dir = str(corpus['root'] / 'data')
    for split in ('train', 'validation', 'test'):
        c.tsv_files[split] = corpus[split]
    c.vocab_size, c.tokenizer_sentences = 400, 2000
    c.max_len, c.max_eval_len = 64, 32
    c.batch_size, c.eval_batch_size = 8, 4
    for key, value in overrides.items():
        setattr(c, key, value)
    return c
