"""Prepares the data of a config and prints one line per split.

    python -m t2t.data --config=configs/default.py [--config.key=value ...]

Downloads / builds the corpus if needed, trains the tokenizer if missing, builds the packed training
cache, and reports where they are (the config's data_dir), pairs read, examples, skips (and why)
and token lengths (EOS included) of each split. The training split is streamed and prepared by
worker processes (T2T_DATA_WORKERS, default all cores) with a progress line every 20 s; a killed
preparation resumes from its finished chunks (t2t/data/prepare.py).

The documented preparation step of a pod run: prepare once, then train.py on every host reads the
prepared data_dir (a shared, even read-only, file system such as NFS; a host whose data_dir lacks
the cache waits for process 0 to build it, then builds its own copy, and all hosts compare
digests of their rows and vocabulary). With --config.shared_data_dir=gs://... it also uploads
what it prepared, and hosts with their own disks copy it from there (t2t/data/shared.py).
"""

import logging

import numpy as np
from absl import app
from ml_collections import config_flags

from t2t.data import cache, identity, pipeline
from t2t.run import cli

_CONFIG = config_flags.DEFINE_config_file('config', None, 'experiment config file',
                                          lock_config=True)


def _skips(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return f'skipped={total}' + (' (' + ', '.join(f'{k}={v}' for k, v in sorted(counts.items()))
                                 + ')' if total else '')


def _stats(stats: dict) -> str:
    return ' '.join(f'{s}_tokens mean={stats[f"{s}_mean"]:.1f} p95={stats[f"{s}_p95"]:.0f} '
                    f'max={stats[f"{s}_max"]}' for s in ('src', 'tgt'))


def report(config) -> list[str]:
    tokenizer = pipeline.get_tokenizer(config)
    lines = []
    packed = pipeline.train_rows(config, tokenizer)
    train = packed.meta
    lines.append(f'vocabulary: {tokenizer.path} ({tokenizer.vocab_size} pieces, sha256 '
                 f'{identity.vocab_digest(tokenizer)[:12]})')
    for member in train.get('members', ()):  # a mixture: where each member's rows come from
        tag = f' tag={member["tag"]}' if member['tag'] else ''
        lines.append(f'mixture member {member["member"]}: weight={member["weight"]:g}{tag} '
                     f'share={member["share"]:.1%} of rows, packed_rows={member["rows"]} '
                     f'examples={member["examples"]} in {member["directory"]}')
    where = getattr(packed, 'directory', 'the members above')
    lines.append(f'packed training rows: {where} (digest {train["digest"][:12]})')
    lines.append(f'train: split={config.train_split} pairs_read={train["pairs_read"]} '
                 f'examples={train["examples"]} '
                 f'{_skips(train["skipped"])} {_stats(train["stats"]) if "stats" in train else ""}'
                 f' packed_rows={train["rows"]} '
                 f'fill={train["fill"]:.3f} vocab={tokenizer.vocab_size}')
    for label, split in (('validation', config.eval_split), ('test', config.test_split)):
        ev = pipeline.eval_split(config, tokenizer, split)
        skips = dict(ev.read_skipped)
        if ev.skipped:
            skips[f'longer_than_max_eval_len_{config.max_eval_len}'] = len(ev.skipped)
        stats = cache.length_stats(np.array([len(x) for x in ev.inputs]),
                                   np.array([len(x) for x in ev.targets]))
        read = len(ev.sources) + sum(ev.read_skipped.values())
        lines.append(f'{label}: split={split} pairs_read={read} '
                     f'examples={len(ev.sources) - len(ev.skipped)} '
                     f'{_skips(skips)} {_stats(stats)}')
    return lines


def _not_tfds_info(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO or 'tensorflow_datasets' not in record.pathname


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    # TFDS logs 'Load dataset info from ...' at INFO at every read of a prepared split; t2t's own
    # INFO lines (training a vocabulary, packing) and every warning stay.
    logging.getLogger('absl').addFilter(_not_tfds_info)
    cli.check_values(_CONFIG.value, 't2t.data')
    for line in report(_CONFIG.value):
        print(line, flush=True)


if __name__ == '__main__':
    cli.run(main, 't2t.data')
