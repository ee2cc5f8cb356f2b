"""A tar's regular members from its 512-byte headers, read faster than `tarfile` reads
them, for the tars webdataset input indexes (`webdataset.index_tar`).

`members` walks the headers of a well-formed tar: ustar/v7 headers (name, with the
ustar prefix; size in octal or base-256; typeflag), each optionally preceded by one GNU
long-name ('L') or long-link ('K') header or one pax extended header ('x', whose `path=`
and `size=` records it applies), up to the end-of-archive zero block. It gives exactly
what `tarfile` gives for such a tar: the same names (decoded as UTF-8 with
surrogateescape), data offsets and sizes, the same members left out (directories,
links, devices). Anything else, so every tar `tarfile` would call damaged, read
differently or read with state this walk does not keep (a bad checksum, an invalid
number field, a truncated header or member, data past the tar's end, pax global
headers, sparse members, chained extension headers, `hdrcharset`), makes it return
None: the caller walks that tar with `tarfile` instead, so damage is reported exactly
as `tarfile` finds it and no tar is ever read two ways.

Why: `tarfile` builds a TarInfo per header and parses every field through several
layers; this walk reads each header once and parses only what an index needs, with the
same checks of the fields `tarfile` rejects a header for (benchmarks/RESULTS.md,
section 15).
"""

from __future__ import annotations

import re
from typing import BinaryIO

BLOCK = 512

_REGULAR = frozenset({b"0", b"\0", b"7"})
"""Regular files: a sample's members (contiguous files, '7', are regular to tarfile)."""
_NO_DATA = frozenset({b"1", b"2", b"3", b"4", b"5", b"6"})
"""Links, devices, directories and fifos: their size field is not followed by data."""
_EXTENSIONS = frozenset({b"L", b"K", b"x"})
# tarfile reads these with state this walk does not keep: global pax headers ('g'),
# sparse members ('S'), Solaris extended headers ('X').
_FALL_BACK = frozenset({b"g", b"S", b"X"})
_NUMBER_FIELDS = ((148, 156), (124, 136), (100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))
"""Checksum, size, then the number fields tarfile parses (and rejects a header for)
whose values an index needs not: mode, uid, gid, mtime, devmajor, devminor."""
_BASE256 = (0o200, 0o377)
_USUAL_NUMBERS = re.compile(rb"(?:[0-7]{7}\0){3}([0-7]{11})\0[0-7]{11}\0([0-7]{6})\0 ")
"""Mode, uid, gid, size, mtime and checksum (bytes 100-156) in octal, as tarfile and GNU tar write them."""
_USUAL_DEVICES = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")
"""Device numbers (bytes 329-345): octal, or left blank."""
_BLANK_CHECKSUM = 8 * ord(" ")
"""The checksum field counts as eight spaces in the sum it holds."""
_READ_AHEAD = 1 << 12
_ZERO = bytes(BLOCK)


class _Irregular(Exception):
    """The tar is not one this walk reads as tarfile does: walk it with tarfile."""


def members(handle: BinaryIO, size: int) -> list[tuple[str, int, int]] | None:
    """(name, data offset, size) of every regular member of the tar of `size` bytes
    open in `handle`, in tar order; None where the tar is not the well-formed kind this
    walk reads exactly as tarfile does (see the module docstring)."""
    try:
        return _walk(_Blocks(handle, size), size)
    except _Irregular:
        return None


class _Blocks:
    """Reads of an open tar `_READ_AHEAD` (4 KiB) at a time: the headers of small
    members (a sample's .txt and .json after its image) lie in the block already read,
    so they cost no read of their own; a larger read ahead wastes more on large
    members than it saves (measured on 20 KB images)."""

    def __init__(self, handle: BinaryIO, size: int):
        self.handle = handle
        self.size = size
        self.start = 0
        self.data = b""

    def read(self, offset: int, count: int) -> bytes:
        """`count` bytes at `offset`; _Irregular when the tar ends before them."""
        if offset + count > self.size:
            raise _Irregular
        end = offset - self.start + count
        if offset < self.start or end > len(self.data):
            self.handle.seek(offset)
            self.data = self.handle.read(max(count, _READ_AHEAD))
            self.start = offset
            end = count
        data = self.data[end - count : end]
        if len(data) != count:
            raise _Irregular
        return data


def _walk(blocks: _Blocks, size: int) -> list[tuple[str, int, int]]:
    found: list[tuple[str, int, int]] = []
    offset = 0
    while True:
        header = blocks.read(offset, BLOCK)
        if header == _ZERO:
            return found
        kind, name, length = _header(header)
        data = offset + BLOCK
        if kind in _EXTENSIONS:
            name, length, data, kind = _extended(blocks, kind, length, data)
        if length < 0 or data + length > size:
            raise _Irregular
        if kind in _REGULAR:
            found.append((name, data, length))
        offset = data if kind in _NO_DATA else data + _round(length)


def _extended(blocks: _Blocks, kind: bytes, length: int, data: int) -> tuple[str, int, int, bytes]:
    """(name, size, data offset, typeflag) of the member that the extension header of
    `kind` whose `length` bytes start at `data` describes: those of the member's own
    header, with the long name or the pax records applied."""
    if data + length > blocks.size:
        raise _Irregular
    payload = blocks.read(data, _round(length))
    following = data + _round(length)
    kind_next, name_next, length_next = _header(blocks.read(following, BLOCK))
    if kind_next in _EXTENSIONS:
        raise _Irregular
    if kind == b"L":
        name_next = _text(payload)
    elif kind == b"x":
        path, pax_size = _pax(payload)
        name_next = path if path is not None else name_next
        length_next = pax_size if pax_size is not None else length_next
    return name_next, length_next, following + BLOCK, kind_next


def _header(header: bytes) -> tuple[bytes, str, int]:
    """(typeflag, name, size) of one header; _Irregular for a header tarfile rejects
    (a bad checksum, an invalid number field) or reads with state (`_FALL_BACK`)."""
    kind = header[156:157]
    if kind in _FALL_BACK:
        raise _Irregular
    checksum, length = _numbers(header)
    if checksum != sum(header) - sum(header[148:156]) + _BLANK_CHECKSUM or length < 0:
        raise _Irregular
    raw = header[:100].split(b"\0", 1)[0]
    if kind == b"\0" and raw.endswith(b"/"):
        kind = b"5"  # tarfile's reading of an old V7 directory
    name = raw.decode("utf-8", "surrogateescape")
    prefix = _text(header[345:500])
    if prefix and kind not in (b"L", b"K", b"S"):
        name = f"{prefix}/{name}"
    return kind, name, length


def _numbers(header: bytes) -> tuple[int, int]:
    """(checksum, size) of a header whose number fields tarfile would all accept;
    _Irregular otherwise. The fields as tarfile and GNU tar write them are checked with
    one match (parsing eight fields one by one was most of the walk's time)."""
    usual = _USUAL_NUMBERS.match(header, 100)
    if usual is not None and _USUAL_DEVICES.fullmatch(header, 329, 345):
        return int(usual[2], 8), int(usual[1], 8)
    try:
        checksum, length, *_ = [
            _base256(field) if field[0] in _BASE256 else int(field.split(b"\0", 1)[0].strip() or b"0", 8)
            for field in [header[start:end] for start, end in _NUMBER_FIELDS]
        ]
    except ValueError:
        raise _Irregular from None
    return checksum, length


def _base256(field: bytes) -> int:
    """A number field in GNU's base-256 (first byte 0o200, or 0o377 for a negative one)."""
    value = int.from_bytes(field[1:], "big")
    return value - 256 ** (len(field) - 1) if field[0] == 0o377 else value


def _pax(records: bytes) -> tuple[str | None, int | None]:
    """The `path` (trailing slashes removed, as tarfile does) and `size` records of a
    pax extended header's blocks, read as tarfile reads them: record after record up to
    the NUL padding, whatever the header's size says; _Irregular for anything tarfile
    would read otherwise (a malformed record, anything but NULs after the records, an
    invalid size, `hdrcharset`, GNU sparse keys)."""
    if b"hdrcharset=" in records:
        raise _Irregular
    path: str | None = None
    size: int | None = None
    position = 0
    while position < len(records) and records[position]:
        space = records.find(b" ", position)
        digits = records[position:space] if space > position else b""
        if not digits.isdigit():
            raise _Irregular
        length = int(digits)
        record = records[space + 1 : position + length]
        keyword, equals, value = record.partition(b"=")
        if position + length > len(records) or not equals or not record.endswith(b"\n"):
            raise _Irregular
        if not keyword or keyword.startswith(b"GNU.sparse."):
            raise _Irregular
        if keyword == b"path":
            path = value[:-1].decode("utf-8", "surrogateescape").rstrip("/")
        elif keyword == b"size":
            try:
                size = int(value[:-1])
            except ValueError:
                raise _Irregular from None
        position += length
    if records[position:].strip(b"\0"):
        raise _Irregular
    return path, size


def _text(field: bytes) -> str:
    """A name field up to its first NUL, as tarfile decodes it."""
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _round(length: int) -> int:
    return -(-length // BLOCK) * BLOCK
