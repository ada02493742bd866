"""The embedded default corpus: sentence pairs of Debian's `trans-de-en` (Ding dictionary, GPL-2+).

The package is fetched with `apt-get download trans-de-en` and unpacked with `dpkg-deb -x` into
`<data_dir>/trans-de-en/` (nothing is installed); the text is `usr/share/trans/de-en` there. Where
apt is unavailable, point the environment variable T2T_TRANS_DE_EN at a copy of that file.

Each line is `German | German :: English | English`; ` | ` separates sub-entries aligned across the
two sides, `;` separates alternatives (the first is kept), `{..}` and `[..]` are annotations
(removed). Sub-entries whose two sides both end in . ! ? and have >= 4 words are kept, deduplicated,
and split 90/5/5 by a hash of their text (the file is sorted by headword, so never by position).
Pairs that share a sentence are kept in one split, so no sentence is in two splits. The result is
written once as a local TFDS dataset `trans_de_en` (array_record) under `<data_dir>`.
"""

import glob
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable

PACKAGE = 'trans-de-en'
DATASET_VERSION = '1.0.0'  # of the prepared dataset: bump when the parsing or the split changes
ENV_PATH = 'T2T_TRANS_DE_EN'
LANGUAGES = ('de', 'en')
SPLITS = ('train', 'validation', 'test')
MIN_WORDS = 4

_ANNOTATION = re.compile(r'\{[^}]*\}|\[[^\]]*\]')
_SPACES = re.compile(r'\s+')


def _clean(entry: str) -> str:
    first = _ANNOTATION.sub(' ', entry).split(';')[0]
    return _SPACES.sub(' ', first).strip()


def _is_sentence(text: str) -> bool:
    return text[-1:] in ('.', '!', '?') and len(text.split()) >= MIN_WORDS


def parse_line(line: str) -> list[tuple[str, str]]:
    """(german, english) sentence pairs of one dictionary line; [] for comments and phrases."""
    line = line.strip()
    if not line or line.startswith('#'):
        return []
    sides = line.split(' :: ')
    if len(sides) != 2:
        return []
    german, english = (side.split(' | ') for side in sides)
    if len(german) != len(english):  # misaligned sub-entries: a pairing would be a guess
        return []
    pairs = []
    for de, en in zip(german, english, strict=True):
        de, en = _clean(de), _clean(en)
        if _is_sentence(de) and _is_sentence(en):
            pairs.append((de, en))
    return pairs


def parse_corpus(lines: Iterable[str]) -> list[tuple[str, str]]:
    """Unique (german, english) pairs in first-seen order."""
    seen = {}
    for line in lines:
        for pair in parse_line(line):
            seen.setdefault(pair, None)
    return list(seen)


def _bucket(key: str) -> str:
    h = int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'big') % 100
    return 'train' if h < 90 else 'validation' if h < 95 else 'test'


def split_pairs(pairs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """90/5/5 by a hash of the text; pairs linked by a shared sentence share the hash key.

    Union-find over sentences: a group's key is its smallest sentence, so the split of a pair
    depends only on the texts, never on the file position.
    """
    parent: dict[str, str] = {}

    def find(s):
        while parent.setdefault(s, s) != s:
            parent[s] = parent[parent[s]]
            s = parent[s]
        return s

    for de, en in pairs:
        a, b = find('de:' + de), find('en:' + en)
        if a != b:
            parent[max(a, b)] = min(a, b)
    out = {s: [] for s in SPLITS}
    for de, en in pairs:
        out[_bucket(find('de:' + de))].append((de, en))
    return out


def _run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def _fetch_package(target_dir: str) -> None:
    """apt-get download + dpkg-deb -x into target_dir; apt-get update only if lists are missing."""
    help_text = (f'Supply the file yourself: set {ENV_PATH}=/path/to/de-en (from a {PACKAGE} .deb, '
                 f'e.g. `dpkg-deb -x {PACKAGE}_*.deb {target_dir}`), or use --config.dataset=tsv '
                 'with --config.tsv_files.train=... (see t2t/data/tsv.py).')
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = _run(['apt-get', 'download', PACKAGE], tmp)
            if result.returncode != 0 and 'Unable to locate package' in result.stderr:
                _run(['apt-get', 'update'], tmp)
                result = _run(['apt-get', 'download', PACKAGE], tmp)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f'could not run apt-get to fetch {PACKAGE}: {e}. {help_text}') from e
        debs = glob.glob(os.path.join(tmp, f'{PACKAGE}_*.deb'))
        if result.returncode != 0 or not debs:
            msg = result.stderr.strip().splitlines()[-1:] or ['no .deb written']
            raise RuntimeError(f'apt-get download {PACKAGE} failed: {msg[0]}. {help_text}')
        unpack = _run(['dpkg-deb', '-x', debs[0], target_dir], tmp)
        if unpack.returncode != 0:
            raise RuntimeError(f'dpkg-deb -x {debs[0]} failed: {unpack.stderr.strip()}. '
                               + help_text)


def corpus_file(data_dir: str) -> str:
    """Path of the Ding de-en text: $T2T_TRANS_DE_EN, else fetched into data_dir once."""
    env = os.environ.get(ENV_PATH)
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f'{ENV_PATH}={env} is not a file')
        return env
    target_dir = os.path.abspath(os.path.join(data_dir, PACKAGE))
    path = os.path.join(target_dir, 'usr', 'share', 'trans', 'de-en')
    if not os.path.isfile(path):
        os.makedirs(target_dir, exist_ok=True)
        _fetch_package(target_dir)
    return path


def read_corpus(path: str) -> dict[str, list[tuple[str, str]]]:
    with open(path, encoding='utf-8', errors='replace') as f:
        pairs = parse_corpus(f)
    if not pairs:
        raise ValueError(f'{path}: no sentence pairs found (is it the trans-de-en de-en file?)')
    return split_pairs(pairs)


def builder(data_dir: str):
    """The TFDS builder of the prepared corpus (prepares it on first use)."""
    import tensorflow_datasets as tfds

    class TransDeEn(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Sentence pairs of the Ding German-English dictionary (Debian trans-de-en)."""

        VERSION = tfds.core.Version(DATASET_VERSION)
        name = 'trans_de_en'

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description=__doc__,
                features=tfds.features.Translation(languages=LANGUAGES),
                supervised_keys=LANGUAGES,
                homepage='https://dict.tu-chemnitz.de/',
                license='GPL-2.0-or-later',
            )

        def _split_generators(self, dl_manager):
            splits = read_corpus(corpus_file(data_dir))
            return {name: self._generate_examples(splits[name]) for name in SPLITS}

        def _generate_examples(self, pairs):
            for i, (de, en) in enumerate(pairs):
                yield i, {'de': de, 'en': en}

    tfds.disable_progress_bar()
    b = TransDeEn(data_dir=data_dir, file_format='array_record')
    if not b.is_prepared():
        b.download_and_prepare()
    return b
