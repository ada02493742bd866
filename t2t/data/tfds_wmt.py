"""TFDS translation datasets (wmt14_translate/de-en, wmt14_translate/fr-en, wmt17_translate/de-en)
read with `tfds.data_source`: random access to array_record files, no TensorFlow.

TFDS's supervised keys are (xx, en), but the paper trains EN->DE and EN->FR, so the direction comes
from `config.source_lang` / `config.target_lang` and is checked against the dataset's languages.
The first use downloads and prepares the dataset under `config.data_dir` (hours for WMT; offline it
fails only after minutes of DNS retries).
"""

import importlib


def languages(tfds_name: str) -> tuple[str, str]:
    """('de', 'en') from 'wmt14_translate/de-en'."""
    _, _, config_name = tfds_name.partition('/')
    langs = tuple(config_name.split('-'))
    if len(langs) != 2 or not all(langs):
        raise ValueError(f'tfds_name {tfds_name!r}: expected "<dataset>/<xx>-<yy>", '
                         'e.g. "wmt14_translate/de-en"')
    return langs


def check_direction(available: tuple[str, str], source: str, target: str, what: str) -> None:
    if source == target or {source, target} != set(available):
        raise ValueError(f'source_lang={source!r}, target_lang={target!r} do not fit {what}, '
                         f'whose languages are {available[0]!r} and {available[1]!r}')


def _text(value) -> str:
    # array_record gives bytes; tfds.testing.mock_data gives str
    return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


class RecordPairs:
    """(source, target) texts of a TFDS translation data source, by index, in the split's order."""

    def __init__(self, data_source, source_lang: str, target_lang: str, name: str):
        self._ds = data_source
        self._keys = (source_lang, target_lang)
        self.name = name

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> tuple[str, str]:
        record = self._ds[i]
        return _text(record[self._keys[0]]).strip(), _text(record[self._keys[1]]).strip()

    def read(self, start: int, stop: int) -> list[tuple[str, str]]:
        """Pairs [start, stop), in one batched read where the source supports it."""
        keys = list(range(start, stop))
        try:
            records = self._ds.__getitems__(keys)
        except (AttributeError, TypeError):  # no batched read (e.g. under tfds mock_data)
            records = [self._ds[i] for i in keys]
        a, b = self._keys
        return [(_text(r[a]).strip(), _text(r[b]).strip()) for r in records]


def open_split(tfds_name: str, data_dir: str, split: str, source_lang: str,
               target_lang: str) -> RecordPairs:
    check_direction(languages(tfds_name), source_lang, target_lang, tfds_name)
    import tensorflow_datasets as tfds

    # built-in builders register on import of their module; the package does not import them
    family = tfds_name.split('/')[0]
    try:
        importlib.import_module(f'tensorflow_datasets.translate.{family.split("_")[0]}')
    except ModuleNotFoundError:
        pass  # not a built-in translate family: tfds.data_source names what is missing
    ds = tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=True)
    return RecordPairs(ds, source_lang, target_lang, f'{tfds_name}/{split}')
