"""WebDataset input (`input.format: webdataset`): `.tar` shards in the img2dataset /
video2dataset layout, indexed once and read by offset.

Samples: a tar's regular members are grouped by key as webdataset groups them: a
member's key is its path up to the first dot of its base name (`dir/00000.seg.png` has
key `dir/00000` and extension `seg.png`), and consecutive members of one key make one
sample, in tar order. A key met again later, after another key, is another sample
(with the same id: `check_ids` warns of repeats). Members whose base name has no dot
(or starts with one), directories, links and other non-files belong to no sample. Two
members of one sample with the same extension: the first is the one read (webdataset
itself refuses such a tar); the index logs one warning per tar that has them.

The index (`index_tar`) holds, per sample, each member's extension, data offset and
size: about 200 bytes a sample in memory, and it travels with the sample's fragment to
the rank that reads it. It reads the tar's headers only, skipping member data: our walk
(`tar_headers`, three times faster than tarfile's) where the tar is well formed, else
`tarfile` in its seeking mode, so a local tar costs about one 4 KiB read per member
larger than that, and a remote one (fsspec, read ahead `READ_BLOCK` at a time) is read
once, front to back, skipping members larger than a block. A member's bytes are then
read by offset (`read_member`): no tar is ever extracted, and a reader holds one member
at a time.

Cache: every process that plans a job (`submit`, each shard's run) scans the whole
input, so an index is kept under the cache root (`index_cache`, keyed by the tar's
location and checked against its size and stamp: inode and file times, or the store's
ETag) and a later scan reads it instead of walking the tar; a changed tar is indexed
again. A cached index is the walk's, damage note included, so the cache changes no row.

Damage (`TarIndex.damage`): a tar that is not a tar at all (no valid first header) is a
JobError. A tar whose headers stop making sense later, or whose last member's data is
cut short, keeps the samples before the damage: the index stops there and says where,
in one line the reader logs, and the rest of the tar is not part of the input (its rows
cannot be counted, so they get no rows). A tar without its end-of-archive blocks keeps
every sample and is named too (it may have been cut at a member boundary).

Identity: a tar's `digest` is the SHA-256 of its index (names, offsets, sizes, and the
damage), the tar's counterpart of a Parquet footer hash; with its size (and ETag) it is
what the job fingerprint records, so a resume over rewritten tars is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tarfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

import fsspec

from embedjob.config import JobError
from embedjob.io import tar_headers
from embedjob.io.index_cache import Entry, IndexCache
from embedjob.io.object_store import SCHEME, etag_of

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "avif", "heic"})
VIDEO_EXTENSIONS = frozenset({"mp4", "webm", "mkv", "mov", "avi", "m4v", "mpg", "mpeg", "ts", "flv", "ogv"})

READ_BLOCK = 1 << 20
"""Bytes a remote tar is read ahead: headers between members smaller than this cost no
extra request, and a reader's range read overshoots by at most this much."""

SETTLED_NS = 2_000_000_000
"""A local tar changed less than this long ago (2 s: the coarsest file-time step, FAT's)
is indexed but its index not kept: a rewrite of the same size within the same time
step would leave its stamp as it was (the racy-timestamp problem git's index has)."""
_MODIFIED_KEYS = ("LastModified", "last_modified", "mtime", "updated")
"""Where fsspec's stores put an object's modification time (s3fs, adlfs, sftp, gcsfs)."""

# webdataset's split: the key is everything up to the first dot of the base name.
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")

Member = tuple[str, int, int]
"""(extension, data offset, size) of one member: plain tuples, as a listing holds
millions of them and pickles them to the ranks."""


@dataclass(frozen=True)
class Sample:
    """One sample: its key and its members in tar order (extensions lower-cased)."""

    key: str
    members: tuple[Member, ...]

    def member(self, extension: str) -> Member | None:
        """The first member with `extension` (case-insensitive), or None."""
        wanted = extension.lower()
        return next((m for m in self.members if m[0] == wanted), None)

    def extensions(self) -> list[str]:
        return [m[0] for m in self.members]


@dataclass(frozen=True)
class TarIndex:
    """What `index_tar` found in one tar: its samples in tar order, its size, the digest
    of its index, the store's ETag where there is one, and why indexing stopped before
    the tar's end (None for a whole tar)."""

    location: str
    size: int
    samples: list[Sample]
    digest: str
    etag: str | None = None
    damage: str | None = None


def group_samples(members: Iterable[tuple[str, int, int]]) -> tuple[list[Sample], int]:
    """Samples of (name, data offset, size) members in tar order, and how many members
    repeated an extension within their sample (left out: the first is kept)."""
    samples: list[Sample] = []
    key: str | None = None
    current: list[Member] = []
    extensions: set[str] = set()
    repeated = 0
    match = _KEY_AND_EXTENSION.match  # bound once: this loop is most of a cached index's load
    for name, offset, size in members:
        split = match(name)
        if split is None:
            continue
        if split[1] != key:
            if key is not None:
                samples.append(Sample(key, tuple(current)))
            key, current, extensions = split[1], [], set()
        extension = split[2].lower()
        if extension in extensions:
            repeated += 1
            continue
        extensions.add(extension)
        current.append((extension, offset, size))
    if key is not None:
        samples.append(Sample(key, tuple(current)))
    return samples, repeated


def open_tar(location: str, options: dict[str, Any]) -> BinaryIO:
    """A tar opened for reading by offset: a local file, or a remote one (with fsspec's
    storage `options`) read ahead `READ_BLOCK` at a time."""
    if not SCHEME.match(location):
        return open(location, "rb")
    fs, path = fsspec.core.url_to_fs(location, **options)
    return fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead")


def read_member(handle: BinaryIO, offset: int, size: int) -> bytes:
    """`size` bytes at `offset` of an open tar; OSError when the tar holds fewer."""
    handle.seek(offset)
    data = handle.read(size)
    if len(data) != size:
        raise OSError(f"the tar ends {size - len(data)} bytes before the member does")
    return data


def index_tar(location: str, options: dict[str, Any], cache: IndexCache | None = None) -> TarIndex:
    """Index one tar (see the module docstring), from `cache` where it holds the index
    of the tar as it is now, else by walking its headers (then kept in `cache`);
    JobError when it cannot be read or is no tar."""
    try:
        found = _stat(location, options)
        entry = cache.load(location, found.size, found.stamp, _digest) if cache and found.stamp else None
        if entry is None:
            entry = _index(location, options, found, cache)
    except OSError as exc:
        raise JobError(f"cannot read input file {location}: {exc}") from None
    samples, repeated = group_samples(entry.members)
    if repeated:
        logger.warning(
            "%s has %d members whose sample already has a member with their extension; the first of each is read",
            location, repeated,
        )
    if entry.damage is not None:
        logger.warning("%s", entry.damage)
    return TarIndex(location, found.size, samples, entry.digest, found.etag, entry.damage)


@dataclass(frozen=True)
class _Stat:
    """What the store says of a tar: its size, ETag, the `stamp` a cached index of it
    must match (None: never cached), and whether it last changed long enough ago
    (`SETTLED_NS`) that an index of it may be kept."""

    size: int
    etag: str | None
    stamp: str | None
    settled: bool


def _stat(location: str, options: dict[str, Any]) -> _Stat:
    """A local tar's stamp is its inode and its modification and change times (a
    rewrite in place that keeps the size and resets the modification time still moves
    the change time); a remote one's is its ETag (with its modification time where the
    store gives one); without an ETag a remote tar is indexed every time."""
    if not SCHEME.match(location):
        info = os.stat(location)
        stamp = f"inode {info.st_ino} mtime_ns {info.st_mtime_ns} ctime_ns {info.st_ctime_ns}"
        changed = max(info.st_mtime_ns, info.st_ctime_ns)
        return _Stat(info.st_size, None, stamp, time.time_ns() - changed >= SETTLED_NS)
    fs, path = fsspec.core.url_to_fs(location, **options)
    info = fs.info(path)
    etag = etag_of(info)
    modified = next((str(info[k]) for k in _MODIFIED_KEYS if info.get(k)), None)
    stamp = f"etag {etag} modified {modified}" if etag else None
    return _Stat(int(info["size"]), etag, stamp, True)


def _index(location: str, options: dict[str, Any], found: _Stat, cache: IndexCache | None) -> Entry:
    """Walk a tar's headers; keep what was found in `cache` (a damaged tar's partial
    index and its note too, so the warning is given again from the cache)."""
    with open_tar(location, options) as handle:
        members, damage = _members(handle, location, found.size)
    entry = Entry(members, damage, _digest(members, damage))
    if cache is not None and found.stamp is not None and found.settled:
        cache.save(location, found.size, found.stamp, entry)
    return entry


def _members(handle: BinaryIO, location: str, size: int) -> tuple[list[tuple[str, int, int]], str | None]:
    """(name, data offset, size) of every regular member, and why the walk stopped
    before the end-of-archive blocks (None when it reached them): our header walk
    where the tar is one it reads as tarfile does, else tarfile's."""
    members = tar_headers.members(handle, size)
    if members is not None:
        return members, None
    logger.debug("%s: walking its headers with tarfile (damaged, or a kind of header ours leaves to it)", location)
    return tarfile_members(handle, location, size)


def tarfile_members(handle: BinaryIO, location: str, size: int) -> tuple[list[tuple[str, int, int]], str | None]:
    """`_members` as tarfile finds them: the reference `tar_headers` is held to, and
    the walk of every tar it leaves (damage is named as tarfile finds it)."""
    handle.seek(0)
    try:
        archive = tarfile.open(fileobj=handle, mode="r:", encoding="utf-8", errors="surrogateescape")
    except tarfile.ReadError as exc:
        raise JobError(f"{location} is not a tar file ({exc}); input.format: webdataset reads uncompressed .tar shards") from None
    members: list[tuple[str, int, int]] = []
    while True:
        try:
            info = archive.next()
        except tarfile.TarError as exc:
            return members, _damaged(location, members, archive.offset, str(exc))
        if info is None:
            return members, _end_problem(handle, location, members, archive.offset, size)
        if info.offset_data + info.size > size:
            return members, _damaged(location, members, info.offset, f"member {info.name} is cut short")
        if info.isreg() and not info.issparse():
            members.append((info.name, info.offset_data, info.size))


def _end_problem(handle: BinaryIO, location: str, members: list[tuple[str, int, int]], offset: int, size: int) -> str | None:
    """Why the header walk ended at `offset`: None at the end-of-archive blocks, else a
    line naming the damage (tarfile ends its walk quietly at an invalid header)."""
    if offset >= size:
        return (
            f"{location} ends without its end-of-archive blocks after {len(members)} members: it may have been cut "
            "short at a member boundary; its members are read"
        )
    handle.seek(offset)
    if not handle.read(tarfile.BLOCKSIZE).strip(b"\0"):
        return None
    return _damaged(location, members, offset, "an invalid header")


def _damaged(location: str, members: list[tuple[str, int, int]], offset: int, why: str) -> str:
    last = f" (the last: {members[-1][0]})" if members else ""
    return (
        f"{location} is damaged at byte {offset} ({why}): the {len(members)} members before it are read{last}, "
        "the rest of the tar is left out of the input"
    )


def _digest(members: list[tuple[str, int, int]], damage: str | None) -> str:
    digest = hashlib.sha256()
    for name, offset, size in members:
        digest.update(f"{name}\0{offset}\0{size}\n".encode("utf-8", "surrogateescape"))
    digest.update((damage or "").encode())
    return digest.hexdigest()


def media_member(sample: Sample, extension: str, modality: str) -> Member | None:
    """The member a sample's media is read from: the one with `extension`, or else its
    first image or video member (of the job's modality; either with `auto`)."""
    named = sample.member(extension)
    if named is not None:
        return named
    kinds = {"image": IMAGE_EXTENSIONS, "video": VIDEO_EXTENSIONS}.get(modality, IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    return next((m for m in sample.members if m[0].rsplit(".", 1)[-1] in kinds), None)


def no_media(sample: Sample, location: str, extension: str, modality: str) -> str:
    """The error of a sample without a media member."""
    kind = "image or video" if modality == "auto" else modality
    members = ", ".join(f".{e}" for e in sample.extensions()) or "none"
    return f"no_media: sample {sample.key!r} of {location} has no .{extension} member and no other {kind} member (members: {members})"


def member_text(data: bytes) -> str:
    """A carried member's value: its text (UTF-8; an undecodable byte becomes U+FFFD,
    as a caption column holds strings)."""
    return data.decode("utf-8", errors="replace")
