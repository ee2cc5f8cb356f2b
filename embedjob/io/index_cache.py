"""Tar indexes kept between scans (webdataset input), so a job's planning processes
(`embedjob submit`, every SLURM array task, each Ray planning step) index each tar once
rather than each of them every tar.

An entry is one file per tar under `<cache root>/tar-index/`, named by a hash of the
tar's location, holding what the header walk found: every regular member's name, data
offset and size, the damage note, and the index digest, with the tar's location, size
and `stamp` (what must be unchanged for the entry to stand for the tar: inode and
change times of a local file, the store's ETag of an object). A tar whose stamp or size
changed is indexed again and its entry replaced.

The cache may be shared (a cluster's shared home, other users' jobs), so an entry is
data only: a magic line, then zlib-compressed JSON, never pickle. `load` reads it
without following a link, refuses anything that is not exactly an entry for this tar
(a wrong magic, size bound, type, count, location, size or stamp; an offset that is no
block boundary or whose member would end past the tar; members that do not have the
entry's digest) and says why in one debug line, so the tar is indexed again. Entries are written as every shared file of the project is (`files`): a fresh
file under a name nobody can guess, renamed into place, in a folder that is no link.
A folder that is a link is never read nor written; writing is best effort: a cache that
cannot be written is one warning per scan, and the scan goes on reading what it holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embedjob.config import JobError
from embedjob.io import files

logger = logging.getLogger(__name__)

FOLDER = "tar-index"
MAGIC = b"embedjob tar index 1\n"
"""The first line of an entry; another version's entries are indexed again and replaced."""
_BLOCK = 512
_SLACK = 1 << 16
"""An entry may be this much larger than its tar (a tar of empty members) and no more:
a planted huge file is refused before it is read whole."""
_KEYS = frozenset({"location", "size", "stamp", "damage", "digest", "names", "offsets", "sizes"})

Members = list[tuple[str, int, int]]


@dataclass(frozen=True)
class Entry:
    """What the cache holds for one tar: the header walk's members and damage note,
    and the index digest they were found to have."""

    members: Members
    damage: str | None
    digest: str


@dataclass
class IndexCache:
    """The tar-index folder under one cache root, for one scan: counts its hits; is
    left alone (one warning) when it is no folder (a link, another kind of file); is
    only read (one warning) once a write into it failed (another user's cache, a
    read-only home)."""

    root: Path
    hits: int = 0
    writes: int = 0
    unusable: bool | None = None
    """None until the folder is first looked at."""
    unwritable: bool = False

    @property
    def folder(self) -> Path:
        return self.root / FOLDER

    def load(self, location: str, size: int, stamp: str, digest: Callable[[Members, str | None], str]) -> Entry | None:
        """The entry for the tar at `location` of `size` bytes and `stamp`, or None
        (absent, or not exactly such an entry, its members' `digest` included: one
        debug line says why)."""
        if self._unusable():
            return None
        path = self._path(location)
        try:
            data = _read_plain_file(path, size + _SLACK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.debug("tar index cache entry %s of %s not read (%s); indexing the tar", path, location, exc)
            return None
        try:
            entry = _parse(data, location, size, stamp)
            if digest(entry.members, entry.damage) != entry.digest:
                raise ValueError("its members are not those its digest was made of")
        except ValueError as exc:
            logger.debug("tar index cache entry %s of %s ignored (%s); indexing the tar", path, location, exc)
            return None
        self.hits += 1
        return entry

    def save(self, location: str, size: int, stamp: str, entry: Entry) -> None:
        """Write (or replace) the entry of a tar; a failure is one warning per scan."""
        if self.unwritable or self._unusable():
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            files.own_directory(self.folder)
            files.write_bytes(self._path(location), _encode(location, size, stamp, entry))
        except (OSError, JobError) as exc:
            self.unwritable = True
            logger.warning("cannot keep tar indexes in %s (%s): the rest of this scan only reads them", self.folder, exc)
            return
        self.writes += 1

    def _unusable(self) -> bool:
        """Whether the folder is to be left alone: a link (whoever planted it would
        choose the indexes we read) or anything but a folder; an absent one is made
        by the first save."""
        if self.unusable is None:
            try:
                mode = os.lstat(self.folder).st_mode
            except FileNotFoundError:
                mode = stat.S_IFDIR
            except OSError as exc:
                self._give_up(str(exc))
                return True
            self.unusable = False
            if not stat.S_ISDIR(mode):
                self._give_up("a symbolic link" if stat.S_ISLNK(mode) else "not a directory")
        return self.unusable

    def _give_up(self, why: str) -> None:
        self.unusable = True
        logger.warning("tar indexes are not kept in %s (%s): this scan indexes every tar anew", self.folder, why)

    def _path(self, location: str) -> Path:
        return self.folder / f"{hashlib.sha256(location.encode('utf-8', 'surrogateescape')).hexdigest()[:40]}.idx"


def _encode(location: str, size: int, stamp: str, entry: Entry) -> bytes:
    names, offsets, sizes = zip(*entry.members) if entry.members else ((), (), ())
    body = {
        "location": location, "size": size, "stamp": stamp, "damage": entry.damage, "digest": entry.digest,
        "names": names, "offsets": offsets, "sizes": sizes,
    }
    # ensure_ascii keeps a name's lone surrogates (undecodable bytes) as escapes that load back as they were
    return MAGIC + zlib.compress(json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii"))


def _read_plain_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at `path`, never through a link (O_NOFOLLOW) nor
    from a fifo or device (O_NONBLOCK, then a regular-file check); OSError over `limit`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(f"not a regular file of at most {limit} bytes")
        with open(fd, "rb", closefd=False) as handle:
            return handle.read(limit + 1)
    finally:
        os.close(fd)


def _parse(data: bytes, location: str, size: int, stamp: str) -> Entry:
    """The entry `data` holds for this tar; ValueError naming the first mismatch."""
    if not data.startswith(MAGIC):
        raise ValueError("not an entry of this version")
    inflate = zlib.decompressobj()
    try:
        text = inflate.decompress(data[len(MAGIC) :], 8 * (size + _SLACK))  # names escape to at most 6 characters a byte
    except zlib.error as exc:
        raise ValueError(f"corrupt: {exc}") from None
    if not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise ValueError("corrupt: not one whole compressed body")
    body = json.loads(text)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(body, dict) or set(body) != _KEYS:
        raise ValueError("not an entry's fields")
    if (body["location"], body["size"], body["stamp"]) != (location, size, stamp):
        raise ValueError("an entry of another tar or of this tar before it changed")
    if not isinstance(body["digest"], str) or not (body["damage"] is None or isinstance(body["damage"], str)):
        raise ValueError("a digest or damage note of the wrong type")
    return Entry(_members(body["names"], body["offsets"], body["sizes"], size), body["damage"], body["digest"])


def _members(names: object, offsets: object, sizes: object, tar_size: int) -> Members:
    """(name, data offset, size) triples, each a member that lies within the tar."""
    if not (isinstance(names, list) and isinstance(offsets, list) and isinstance(sizes, list)):
        raise ValueError("members of the wrong type")
    if not len(names) == len(offsets) == len(sizes):
        raise ValueError("member lists of different lengths")
    members = list(zip(names, offsets, sizes))
    for name, offset, length in members:
        if type(name) is not str or type(offset) is not int or type(length) is not int:
            raise ValueError("a member of the wrong type")
        if offset < _BLOCK or offset % _BLOCK or length < 0 or offset + length > tar_size:
            raise ValueError(f"member {name!r} does not lie within the tar")
    return members
