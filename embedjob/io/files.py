"""Files an embedjob creates, under an output that other users may share.

Nothing planted under a name we use may be written through: every file is created
fresh (`O_CREAT | O_EXCL`, never following a symlink, under a name nobody can guess),
and a file that replaces another is written under such a temporary name first, then
put in place by `os.replace`, which replaces a planted link itself, never its target.
A folder we write into must be a real directory, not a link to someone else's
(`own_directory`). Parts are checksummed so later runs can tell a damaged file from
the one that was committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from embedjob.config import JobError

TMP_MARK = ".tmp-"
"""In the name of every temporary file (`.NAME.tmp-PID-RANDOM`): a run that finds one
of its shard's, left by a killed run, knows it for debris."""

_CHUNK = 1 << 20
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temporary_path(path: Path) -> Path:
    """A hidden name beside `path` for writing it: the pid says whose it was, the
    random suffix keeps anyone from planting a link there ahead of us."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(8)}")


def create_new(path: Path) -> int:
    """A file descriptor, open for writing, of a file this call created at `path`.

    FileExistsError when anything is there already, a dangling symlink included: the
    kernel creates the file itself or nothing, so no write lands outside `path`.
    """
    return os.open(path, _CREATE, 0o644)


def write_new(path: Path, data: bytes) -> None:
    """Create `path` with `data`; FileExistsError if anything is there already."""
    fd = create_new(path)
    try:
        with open(fd, "wb", closefd=False) as handle:
            handle.write(data)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace a small JSON file (manifest, marker, statistics, records)."""
    write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace a file of an output (a JSON record, a report, a figure)."""
    tmp = temporary_path(path)
    fd = create_new(tmp)
    try:
        with open(fd, "wb", closefd=False) as handle:
            handle.write(data)
        os.fsync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, path)


def own_directory(path: Path) -> None:
    """Create the folder `path` (its parent must exist), or check that the one there is
    a real directory: JobError for a symbolic link or any other kind of file.

    `Path.mkdir(exist_ok=True)` accepts a link to a directory, and every file written
    under it would then land in the directory it points to (someone else's).
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise JobError(
                f"{path} is a symbolic link, not a directory; remove it (nobody should have put it there), then run again"
            ) from None
        if not stat.S_ISDIR(info.st_mode):
            raise JobError(f"{path} is not a directory; remove it, then run again") from None


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex digest) of a file, without following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    digest = hashlib.sha256()
    size = 0
    try:
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, digest.hexdigest()
