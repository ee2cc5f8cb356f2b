"""Small files of an output directory, which other users may share.

Nothing planted under a name we use may be written through: a temporary file is
created fresh (`O_EXCL`, never following a symlink, under a name nobody can guess),
and `os.replace` puts it in place by renaming, which replaces a planted link itself,
never its target. Parts are checksummed so later runs can tell a damaged file from
the one that was committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from embedjob.io.writer import TMP_MARK

_CHUNK = 1 << 20


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace a small JSON file (manifest, marker, statistics, records)."""
    write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace a file of an output (a JSON record, a report, a figure).

    The temporary name keeps the writer's pattern (`.NAME.tmp-PID...`), so a run that
    finds one left by a killed run knows it for debris.
    """
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
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
