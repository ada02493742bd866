"""A small synthetic parallel corpus written as TSV files, shared by the tests.

The "target language" is the source reversed and upper-cased: learnable by a toy model in a few
steps, and every split is made of real lines the TSV source reads like a user's own data.
"""

import random

from tests.helpers import tiny_config  # noqa: F401 (the config of a run on this corpus)

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
