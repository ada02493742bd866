"""Split the embedded corpus's training pairs into halves A and B, for the back-translation round
trip (docs/recipes.md, "A back-translation round trip on one corpus"; bench/RESULTS.md).

    python -m t2t.data --config=configs/default.py     # the corpus, prepared
    python scripts/split_halves.py [--data_dir=data]   # DATA_DIR/{A,B}.{en,de}

The training pairs in the prepared split's order, permuted by np.random.default_rng(--seed): the
first half is A, the rest B, each written in that order, one sentence a line, the .en and .de
files line-parallel.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import default  # noqa: E402
from t2t.data import sources  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--data_dir', default='data')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    config = default.get_config().unlock()
    config.data_dir = args.data_dir
    config.source_lang, config.target_lang = 'en', 'de'
    split = sources.open_split(config, 'train')
    pairs = list(split.read(0, len(split)))
    if any('\n' in en + de or '\r' in en + de for en, de in pairs):
        sys.exit('split_halves.py: a sentence holds a line break; the halves would not be '
                 'line-parallel')
    order = np.random.default_rng(args.seed).permutation(len(pairs))
    half = len(pairs) // 2
    for name, rows in (('A', order[:half]), ('B', order[half:])):
        for lang, column in (('en', 0), ('de', 1)):
            with open(os.path.join(args.data_dir, f'{name}.{lang}'), 'w', encoding='utf-8') as f:
                f.writelines(pairs[i][column] + '\n' for i in rows)
        print(f'{name}: {len(rows)} pairs -> {args.data_dir}/{name}.en, {args.data_dir}/{name}.de')


if __name__ == '__main__':
    main()
