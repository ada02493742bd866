"""Training-batch throughput from the prepared packed cache.

    python bench/data_speed.py --config=configs/default.py [--steps=2000] [--threads=2]

Prepares the data if needed (not timed), then times `train_iterator` batches and reports packed
target tokens per second (real tokens, padding excluded) and the packing fill ratio
(real target tokens / target slots) over the timed batches.
"""

import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from t2t import data  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'experiment config file',
                                          lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 2000, 'batches to time')
_WARMUP = flags.DEFINE_integer('warmup', 50, 'batches before the clock starts')
_THREADS = flags.DEFINE_integer('threads', 2, 'grain read threads')


def main(argv):
    del argv
    config = _CONFIG.value
    tokenizer = data.get_tokenizer(config)
    it = data.train_iterator(config, tokenizer, num_threads=_THREADS.value)
    for _ in range(_WARMUP.value):
        next(it)
    tokens = slots = 0
    start = time.perf_counter()
    for _ in range(_STEPS.value):
        batch = next(it)
        tokens += int((batch['targets_segment_ids'] > 0).sum())
        slots += batch['targets'].size
    seconds = time.perf_counter() - start
    print(f'batches={_STEPS.value} rows={config.batch_size} max_len={config.max_len} '
          f'threads={_THREADS.value} seconds={seconds:.2f} '
          f'batches_per_s={_STEPS.value / seconds:.0f} '
          f'target_tokens_per_s={tokens / seconds:,.0f} fill={tokens / slots:.3f}')


if __name__ == '__main__':
    app.run(main)
