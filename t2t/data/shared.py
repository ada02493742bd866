"""A copy of the prepared data in a bucket, for hosts with their own disks (a TPU VM's).

`config.shared_data_dir` (a bucket URL such as gs://BUCKET/data, or a directory every host sees)
holds what process 0 prepared in its data_dir: the vocabulary, the token shards, the packed rows
and the tokenized evaluation splits. Process 0 prepares an item only when the share lacks it (the
TFDS download and the tokenization happen once, on one host) and then uploads it; every other
host copies the items it needs into its own data_dir, checks their digests, and never reads the
corpus or tokenizes. A host whose data_dir already holds a matching copy reuses it; one whose copy
differs (a torn or corrupt file) gets the share's. Once the share holds an item it is the item
every host uses, process 0 included (a recreated VM copies instead of preparing again).

An item is a file or a directory under data_dir (`vocab/<name>.model`, `tokens/<split>-<key>/`,
`packed/<split>-<key>/`, `eval/<split>-<key>.json`), stored under the same relative path in the
share. Each file goes up in parts of PART_BYTES, one object each, through the workdir I/O layer
(t2t/infra/workdir.py): memory stays bounded, and a failed transfer costs one part. The item's
manifest `<item>.manifest.json` (size and sha256 of every file and part) is uploaded last, so an
item with a manifest is whole. A copy is checked part by part and file by file against it, fsynced,
and only then renamed into place; a directory item is swapped whole, its matching files hard-linked,
not copied. Local digests are memoized by path, size and mtime (identity.content_digest): a matching
copy is not read again at every start, and a file changed since (new size or mtime) is hashed
again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from t2t.data import durable, identity, progress
from t2t.infra import workdir as wd
from t2t.infra.exits import ConfigError

PART_BYTES = 64 << 20  # bytes per object of a file's copy: one read or write, one retry's loss
MANIFEST_SUFFIX = '.manifest.json'
MANIFEST_VERSION = 1
ABSENT, REUSED, COPIED = 'absent', 'reused', 'copied'  # what `fetch` did


class SharedDataError(ConfigError):
    """The shared data_dir lacks an item it should hold, or holds bytes its manifest denies (one
    line in train.py and evaluate.py)."""


def enabled(config) -> bool:
    return bool(config.shared_data_dir)


def relative(config, path: str) -> str | None:
    """`path`'s name in the share (relative to data_dir), or None outside data_dir."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(config.data_dir))
    return None if rel == '.' or rel.startswith('..') else rel.replace(os.sep, '/')


def _name(config, path: str) -> str:
    rel = relative(config, path)
    if rel is None:
        raise ValueError(f'{path} is not under data_dir={config.data_dir}: not a shared item')
    return rel


def _remote(config, rel: str):
    return wd.path(config.shared_data_dir, rel)


def _part(config, name: str, i: int):
    return _remote(config, f'{name}.part-{i:05d}')


def _local_files(config, rel: str) -> list[str]:
    """The item's files (names relative to data_dir); temporary and hidden ones left out."""
    local = os.path.join(config.data_dir, rel)
    if os.path.isfile(local):
        return [rel]
    out = []
    for dirpath, dirnames, filenames in os.walk(local):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith('.'))
        for name in sorted(filenames):
            if not name.startswith('.') and '.tmp-' not in name:
                out.append(relative(config, os.path.join(dirpath, name)))
    return out


def read_manifest(config, rel: str) -> dict | None:
    """The share's manifest of item `rel`, or None when the share has no (usable) one."""
    url = _remote(config, rel + MANIFEST_SUFFIX)
    text = wd.read_text(url)
    if text is None:
        return None
    try:
        manifest = json.loads(text)
        files = manifest['files']
        ok = manifest['version'] == MANIFEST_VERSION and all(
            isinstance(f['size'], int) and isinstance(f['sha256'], str)
            and isinstance(f['parts'], list) for f in files.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        progress.echo(f'{url}: not a manifest of this t2t version: the item counts as absent')
        return None
    return manifest


def _stale(config, manifest: dict) -> list[str]:
    """The manifest's files that this host's data_dir lacks or holds with other bytes."""
    out = []
    for name, want in manifest['files'].items():
        path = os.path.join(config.data_dir, name)
        try:
            matches = (os.path.getsize(path) == want['size']
                       and identity.content_digest(path, config.data_dir) == want['sha256'])
        except OSError:
            matches = False
        if not matches:
            out.append(name)
    return out


def _download(config, name: str, want: dict, dst: str) -> None:
    """File `name` of the share into `dst` (fsynced), each part checked against `want`."""
    whole = hashlib.sha256()
    with open(dst, 'wb') as f:
        for i, part_digest in enumerate(want['parts']):
            url = _part(config, name, i)
            data = wd.read_bytes(url)
            if data is None or hashlib.sha256(data).hexdigest() != part_digest:
                raise SharedDataError(
                    f'{url}: ' + ('missing' if data is None else 'its sha256 differs from the '
                                  'manifest') + f' of {name}: the shared copy is damaged (remove '
                    f'{_remote(config, name + MANIFEST_SUFFIX)} and process 0 uploads it again)')
            whole.update(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if whole.hexdigest() != want['sha256'] or os.path.getsize(dst) != want['size']:
        raise SharedDataError(f'{_remote(config, name)}: its parts do not add up to the sha256 '
                              'and size of its manifest: the shared copy is damaged')


def _place(config, manifest: dict, stale: list[str], rel: str) -> None:
    """The share's copy of item `rel` in place in data_dir: the stale files downloaded, the rest
    linked, the item renamed into place whole."""
    local = os.path.join(config.data_dir, rel)
    parent = os.path.dirname(local)
    os.makedirs(parent, exist_ok=True)
    if list(manifest['files']) == [rel]:  # a single file
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f'.{os.path.basename(local)}.',
                                   suffix='.fetching')
        os.close(fd)
        try:
            _download(config, rel, manifest['files'][rel], tmp)
            durable.replace(tmp, local)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(local)}.fetching-')
    old = None
    try:
        for name, want in manifest['files'].items():
            dst = os.path.join(tmp, os.path.relpath(name, rel))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if name in stale:
                _download(config, name, want, dst)
            else:
                try:
                    os.link(os.path.join(config.data_dir, name), dst)
                except OSError:  # a file system without hard links
                    shutil.copy2(os.path.join(config.data_dir, name), dst)
        durable.fsync_dir(tmp)
        if os.path.exists(local):
            old = tempfile.mkdtemp(dir=parent, prefix=f'.{os.path.basename(local)}.replaced-')
            os.replace(local, os.path.join(old, 'item'))
        durable.replace(tmp, local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def fetch(config, path: str) -> str:
    """Item `path` (under data_dir) as the share holds it. Returns ABSENT (the share has none;
    nothing changed), REUSED (the local copy matches) or COPIED (the share's copy was put in
    place, replacing a local one that differed). Raises SharedDataError for a damaged share."""
    rel = _name(config, path)
    manifest = read_manifest(config, rel)
    if manifest is None:
        return ABSENT
    stale = _stale(config, manifest)
    if not stale:
        return REUSED
    existed = os.path.exists(path)
    _place(config, manifest, stale, rel)
    for name in stale:  # checked while written: not hashed again at the next start
        identity.remember_digest(os.path.join(config.data_dir, name), config.data_dir,
                                 manifest['files'][name]['sha256'])
    size = sum(manifest['files'][n]['size'] for n in stale)
    progress.echo(f'{rel}: copied {len(stale)} of {len(manifest["files"])} files '
                  f'({size / 1e6:.1f} MB) from {config.shared_data_dir}'
                  + (', replacing a local copy that differed' if existed else ''))
    return COPIED


def require(config, path: str, what: str) -> None:
    """fetch for a host that must not prepare: the share lacking the item is an error."""
    if fetch(config, path) == ABSENT:
        raise SharedDataError(
            f'{_remote(config, _name(config, path) + MANIFEST_SUFFIX)} does not exist: process 0 '
            f'prepared {what} but the shared data_dir lacks it (is shared_data_dir the same on '
            'every host?)')


def _upload(config, name: str) -> dict:
    """File `name` of data_dir into the share, part by part; returns its manifest entry."""
    path = os.path.join(config.data_dir, name)
    whole, parts, size = hashlib.sha256(), [], 0
    with open(path, 'rb') as f:
        while block := f.read(PART_BYTES):
            wd.write_atomic(_part(config, name, len(parts)), block)
            whole.update(block)
            parts.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return {'size': size, 'sha256': whole.hexdigest(), 'parts': parts}


def publish(config, path: str) -> None:
    """Uploads item `path` (under data_dir) unless the share holds these very bytes already
    (then nothing is sent). Nothing when the item does not exist locally."""
    rel = _name(config, path)
    files = _local_files(config, rel)
    if not files:
        return
    manifest_url = _remote(config, rel + MANIFEST_SUFFIX)
    remote = read_manifest(config, rel)
    if remote is not None and sorted(remote['files']) == sorted(files) and not _stale(config,
                                                                                remote):
        return
    if remote is not None:  # replaced part by part: no manifest may name a mix meanwhile
        wd.remove(manifest_url)
    entries = {name: _upload(config, name) for name in files}
    wd.write_atomic(manifest_url, json.dumps({'version': MANIFEST_VERSION, 'files': entries},
                                             indent=1, sort_keys=True))
    size = sum(e['size'] for e in entries.values())
    progress.echo(f'{rel}: uploaded {len(files)} files ({size / 1e6:.1f} MB) to '
                  f'{config.shared_data_dir}')
