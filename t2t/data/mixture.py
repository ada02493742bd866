"""A training source that mixes several corpora with weights: `config.train_mixture`.

    --config.train_mixture='embedded=3; tsv:data/bt.en,data/bt.de=1:<BT>'

Members are separated by ';', each `MEMBER=WEIGHT[:TAG]`: MEMBER is `embedded`, `tfds:NAME`
(e.g. tfds:wmt14_translate/de-en) or `tsv:SPEC` (a .tsv file or 'SRC,TGT' files, as
config.tsv_files), read in the config's direction from its training split (config.train_split).
TAG (e.g. <BT>, tagged back-translation) is put first in every source of that member as one token:
the vocabulary holds every tag of the mixture as a sentencepiece user-defined symbol
(t2t/data/pipeline.py trains it so; a vocabulary given by vocab_path must hold them).

Each member is prepared on its own into packed rows (t2t/data/cache.py, its tag in the cache
key), so a member's cache serves every mixture it is in. The rows are mixed by grain's
`MapDataset.mix`: each member's rows shuffled by a seed of its own and repeated, interleaved in
a fixed pattern of the weights (grain scales them to integers, the smallest to 100). Row k of the
stream is an index computation, so the iterator's state (a batch counter) resumes bit for bit.
The weights are shares of packed rows (about shares of tokens), not of sentence pairs. The
vocabulary and the evaluation splits stay config.dataset's.
"""

import dataclasses
import hashlib
import json
import os
import re

import numpy as np

from t2t.data import cache, tsv
from t2t.data.tokenizer import Tokenizer

KINDS = ('embedded', 'tfds', 'tsv')
FORMAT = ("'MEMBER=WEIGHT[:TAG]; ...' with MEMBER embedded, tfds:NAME or tsv:FILE.tsv / "
          "tsv:SRC,TGT, e.g. 'embedded=3; tsv:bt.tsv=1:<BT>' (docs/data.md)")
_MEMBER = re.compile(r'(?P<member>.+)=(?P<weight>[^=:]+)(?::(?P<tag>[^=]*))?')


@dataclasses.dataclass(frozen=True)
class Member:
    text: str  # MEMBER as written: its name in messages
    kind: str  # one of KINDS
    arg: str  # tfds: the dataset name; tsv: the file spec; embedded: ''
    weight: float
    tag: str  # '' or a piece put first in every source


def parse(spec: str) -> tuple[Member, ...]:
    """The members of a train_mixture string; ValueError naming what is wrong (one line)."""
    members = []
    for part in (p.strip() for p in spec.split(';')):
        if not part:
            continue
        m = _MEMBER.fullmatch(part)
        if not m:
            raise ValueError(f'{part!r} is not MEMBER=WEIGHT[:TAG]')
        text, tag = m['member'].strip(), (m['tag'] or '').strip()
        kind, _, arg = text.partition(':')
        if kind not in KINDS or (kind == 'embedded') != (not arg):
            raise ValueError(f'member {text!r} is not embedded, tfds:NAME or tsv:SPEC')
        try:
            weight = float(m['weight'])
        except ValueError:
            raise ValueError(f'member {text!r}: weight {m["weight"]!r} is not a number') from None
        if not weight > 0 or weight == float('inf'):
            raise ValueError(f'member {text!r}: weight {weight:g} must be > 0')
        if m['tag'] is not None and (not tag or any(ch.isspace() for ch in tag)):
            raise ValueError(f'member {text!r}: tag {m["tag"]!r} must be one word, e.g. <BT>')
        members.append(Member(text, kind, arg.strip(), weight, tag))
    if not members:
        raise ValueError('no members')
    if len({(m.text, m.tag) for m in members}) < len(members):
        raise ValueError('a member is named twice with the same tag: give it one weight')
    return tuple(members)


def problem(spec: str) -> str | None:
    """Why a train_mixture string is unusable, or None (also for '': no mixture)."""
    if not spec.strip():
        return None
    try:
        parse(spec)
    except ValueError as e:
        return str(e)
    return None


def missing_files(spec: str) -> list[str]:
    """The TSV members' files (or unusable file specs) of a valid spec that are not there."""
    if problem(spec) is not None or not spec.strip():
        return []
    missing = []
    for m in (m for m in parse(spec) if m.kind == 'tsv'):
        try:
            missing += [p for p in tsv.paths_of(m.arg) if not os.path.exists(p)]
        except ValueError:
            missing.append(m.arg)
    return missing


def tags(config) -> tuple[str, ...]:
    """The mixture's tags, sorted (the vocabulary's user-defined symbols); () without one."""
    if not config.train_mixture.strip():
        return ()
    return tuple(sorted({m.tag for m in parse(config.train_mixture) if m.tag}))


def member_config(config, member: Member):
    """The config that reads `member` as the training split of a single corpus."""
    c = config.copy_and_resolve_references()
    c.unlock()
    c.train_mixture = ''
    c.dataset = member.kind
    if member.kind == 'tfds':
        c.tfds_name = member.arg
    if member.kind == 'tsv':
        c.tsv_files[config.train_split] = member.arg
    c.lock()
    return c


def proportions(weights) -> list[int]:
    """The integer proportions grain's MapDataset.mix interleaves by (its own scaling)."""
    scale = 100 / min(weights)
    return [int(w * scale) for w in weights]


def member_seed(seed: int, index: int) -> int:
    """The shuffle seed of member `index`'s rows: independent streams from one config seed."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class MixedRows:
    """The packed rows of every member, with a meta like a PackedSplit's (the same keys the
    data summary and the data identity read) plus `members`."""

    members: tuple[Member, ...]
    parts: tuple[cache.PackedSplit, ...]
    meta: dict

    @property
    def num_rows(self) -> int:
        return self.meta['rows']

    def stream(self, seed: int):
        """The endless grain MapDataset of row keys [member, row] in training order."""
        import grain

        streams = [grain.MapDataset.range(p.num_rows).shuffle(seed=member_seed(seed, i)).repeat()
                   .map(lambda r, i=i: np.array([i, r], np.int64))
                   for i, p in enumerate(self.parts)]
        return grain.MapDataset.mix(streams, [m.weight for m in self.members])

    def gather(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """A batch of the rows keys [b, 2] (member, row) name, in their order."""
        keys = np.asarray(keys).reshape(-1, 2)
        out = None
        for i, part in enumerate(self.parts):
            where = np.flatnonzero(keys[:, 0] == i)
            if not len(where):
                continue
            rows = part.gather(keys[where, 1])
            if out is None:
                out = {k: np.zeros((len(keys),) + v.shape[1:], v.dtype) for k, v in rows.items()}
            for k, v in rows.items():
                out[k][where] = v
        return out


def _describe(member: Member, share: float, meta: dict) -> str:
    tag = f' tag {member.tag}' if member.tag else ''
    return (f'{member.text} x{member.weight:g}{tag} ({share:.1%} of rows: {meta["rows"]:,} '
            f'packed rows of {meta["examples"]:,} pairs)')


def mixed_rows(config, tokenizer: Tokenizer) -> MixedRows:
    """Every member prepared (packed rows built where missing) and the mixture's meta.

    Its `digest` covers the members' rows, weights and tags (the run's data identity); `rows` is
    the members' total (one pass over every member's rows)."""
    members = parse(config.train_mixture)
    parts = []
    for i, member in enumerate(members):
        if member.tag:
            tokenizer.tag_id(member.tag)  # one line before any preparation if it is missing
        parts.append(cache.packed_split(member_config(config, member), tokenizer,
                                        config.train_split, tag=member.tag,
                                        label=f'{config.train_split}-mixture-{i}'))
    ints = proportions([m.weight for m in members])
    shares = [p / sum(ints) for p in ints]
    metas = [p.meta for p in parts]
    skipped = {}
    for meta in metas:
        for k, v in meta['skipped'].items():
            skipped[k] = skipped.get(k, 0) + v
    rows = sum(m['rows'] for m in metas)
    max_len = metas[0]['max_len']
    identity = [[m.text, m.weight, m.tag, meta['rows'], meta['digest']]
                for m, meta in zip(members, metas, strict=True)]
    described = ' + '.join(_describe(m, s, meta)
                           for m, s, meta in zip(members, shares, metas, strict=True))
    meta = {'source': f'mixture of {len(members)}: {described}', 'rows': rows,
            'max_len': max_len, 'examples': sum(m['examples'] for m in metas),
            'pairs_read': sum(m['pairs_read'] for m in metas), 'skipped': skipped,
            'target_tokens': sum(m['target_tokens'] for m in metas),
            'fill': sum(m['target_tokens'] for m in metas) / max(1, rows * max_len),
            'digest': hashlib.sha256(json.dumps(identity).encode()).hexdigest(),
            'members': [{'member': m.text, 'weight': m.weight, 'tag': m.tag, 'share': s,
                         'rows': meta['rows'], 'examples': meta['examples'],
                         'directory': p.directory}
                        for m, s, meta, p in zip(members, shares, metas, parts, strict=True)]}
    return MixedRows(members, tuple(parts), meta)

