"""Files an embedjob creates, under an output that other users may share, and the
local side of the output's storage seam (`LocalStore`, `io/store.py`).

Nothing planted under a name we use may be written through: every file is created
fresh (`O_CREAT | O_EXCL`, never following a symlink, under a name nobody can guess),
and a file that replaces another is written under such a temporary name first, then
put in place by `os.replace`, which replaces a planted link itself, never its target.
A folder we write into must be a real directory, not a link to someone else's
(`own_directory`). Parts are checksummed so later runs can tell a damaged file from
the one that was committed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import secrets
import socket
import stat
import time
import weakref
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from embedjob.config import JobError

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
"""In the name of every temporary file (`.NAME.tmp-PID-RANDOM`): a run that finds one
of its shard's, left by a killed run, knows it for debris."""

_CHUNK = 1 << 20
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP)


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


def json_bytes(data: dict[str, Any]) -> bytes:
    """How the output's small JSON files are written (manifest, marker, statistics,
    records): indented, keys sorted, so a rewrite of the same record is the same bytes."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace a small JSON file of a local output (`json_bytes`)."""
    write_bytes(path, json_bytes(data))


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


# ---------------------------------------------------------------- locks


class FileLock:
    """An exclusive `flock` on a lock file: a shard's, held by the process writing the
    shard, or the output's, held while its record is checked.

    The file is removed on release, so a finished output holds no lock files. Because
    of that, `acquire` checks after locking that the path still names the locked file
    (another process may have removed it between our open and our lock) and retries.
    """

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        # A run that stops with an exception never reaches release(); the lock goes
        # with the lock object then, so a later run in the same process can take it.
        self._finalizer = weakref.finalize(self, _unlock, path, fd) if fd is not None else None

    @classmethod
    def acquire(cls, path: Path, what: str, blocking: bool = False) -> "FileLock":
        """Lock `path` for `what`: wait for it when `blocking`, else JobError naming the
        holder if another process has it. JobError as well if `path` is a symlink or
        not a plain file.

        On a filesystem without working `flock` (e.g. Lustre mounted without `flock`)
        the run goes ahead unlocked, with a warning.
        """
        deadline = time.monotonic() + LOCK_PROBE_GRACE
        while True:
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if time.monotonic() < deadline:
                    # Perhaps only `lock_holder` looking, for an instant.
                    time.sleep(LOCK_PROBE_GRACE / 10)
                    continue
                raise JobError(
                    f"{what} is being written by another process ({holder}); wait for it to finish or stop it, then run again"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                logger.warning("cannot lock %s (%s); make sure no other process writes %s", path, exc, what)
                return cls(path, None)
            if _same_file(fd, path):
                os.ftruncate(fd, 0)
                os.write(fd, holder_text().encode())
                return cls(path, fd)
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: see the class docstring)."""
        if self._finalizer is not None:
            self._finalizer()

    def lost(self) -> str | None:
        """Never: the kernel keeps an flock for as long as the process that took it lives."""
        return None


LOCK_PROBE_GRACE = 0.2
"""Seconds a non-blocking `FileLock.acquire` retries before naming the holder:
`lock_holder` (`embedjob status`) holds a shared lock for an instant."""


def lock_holder(path: Path) -> str | None:
    """The holder line of the process that holds the lock at `path` now, None when
    none does. Read only: the file is never created, and the shared lock that tests
    whether it is held lasts an instant (`FileLock.acquire` retries past it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    except OSError:
        return None  # a filesystem without flock: nobody could have locked it either
    finally:
        os.close(fd)
    return None


def _open_lock_file(path: Path) -> int:
    """The lock file, opened read-write without following a symlink, checked to be a
    plain file with one name: we write our holder line into it, which through a planted
    symlink or hard link would overwrite someone else's file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise JobError(f"{path} is a symbolic link, not a lock file; remove it (nobody should have put it there), then run again") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise JobError(f"{path} is not a plain lock file (another kind of file, or a hard link); remove it, then run again")
    return fd


def _unlock(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        named, held = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def holder_text() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"pid {os.getpid()} on {socket.gethostname()}" + (f", SLURM job {job}" if job else "")


def _read_holder(fd: int) -> str:
    text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    return text or "holder unknown"


# ---------------------------------------------------------------- a local output


class LocalPart:
    """A part being written to a hidden temporary file (`create_new`), which becomes
    `target` only at `commit` (flushed, fsynced, renamed): a part under its name is
    always whole, and a run killed before leaves a temporary file a rerun removes."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmp = temporary_path(target)
        self.stream = io.FileIO(create_new(self.tmp), "wb", closefd=True)

    def commit(self) -> None:
        self.stream.flush()
        os.fsync(self.stream.fileno())
        self.stream.close()
        os.replace(self.tmp, self.target)

    def abandon(self) -> None:
        self.stream.close()
        self.tmp.unlink(missing_ok=True)


class LocalStore:
    """An output in a local (or mounted) directory: the `io/store.py` seam over the
    functions above, so every file is created fresh and renamed into place, folders
    are checked not to be links, and locks are `flock`s the kernel drops with their
    process. Names are relative to the directory, `/`-separated."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.location = str(self.path)

    def __str__(self) -> str:
        return self.location

    def where(self, name: str) -> str:
        return str(self.path / name)

    def problem(self) -> str | None:
        """Why this is no output to read: a file in its place, or nothing there."""
        if self.path.is_dir():
            return None
        return "is a file, not an output directory" if self.path.exists() else "does not exist"

    def prepare(self, folder: str) -> None:
        """Create the output (and its parents) and its bookkeeping `folder`, which must
        be a real directory (`own_directory`)."""
        self.path.mkdir(parents=True, exist_ok=True)
        own_directory(self.path / folder)

    def files(self, folder: str = "") -> list[str]:
        """Names of the files (links included) directly in `folder`; none if it is absent."""
        where = self.path / folder
        return [p.name for p in where.iterdir() if not p.is_dir()] if where.is_dir() else []

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    def replace(self, name: str, data: bytes) -> None:
        write_bytes(self.path / name, data)

    def create(self, name: str, data: bytes) -> None:
        write_new(self.path / name, data)

    def remove(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def size(self, name: str) -> int | None:
        """The file's size; None when it is not a plain file. FileNotFoundError if absent."""
        info = os.lstat(self.path / name)
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def digest(self, name: str) -> tuple[int, str]:
        return file_digest(self.path / name)

    def open_part(self, name: str) -> LocalPart:
        return LocalPart(self.path / name)

    def arrow(self, name: str) -> tuple[str, None]:
        """Where pyarrow reads `name`: its path, on the local filesystem."""
        return str(self.path / name), None

    def lock(self, name: str, what: str, blocking: bool = False) -> FileLock:
        return FileLock.acquire(self.path / name, what, blocking)

    def lock_holder(self, name: str) -> str | None:
        return lock_holder(self.path / name)

    def link_target(self, name: str) -> str | None:
        """Where `name` points when it is a symbolic link, else None."""
        return os.readlink(self.path / name) if (self.path / name).is_symlink() else None

    def remove_debris(self, folders: tuple[str, ...], written: Callable[[str], bool]) -> None:
        """Remove the temporary files in `folders` of killed writers whose final name
        (relative to the output) `written` accepts. Only under the lock of what they
        were writing: none is in use then."""
        for folder in folders:
            for name in self.files(folder):
                final = _final_name(name)
                if final is not None and written(str(PurePosixPath(folder, final))):
                    logger.info("removing temporary file %s of a stopped run", name)
                    (self.path / folder / name).unlink(missing_ok=True)


def _final_name(name: str) -> str | None:
    """The name a temporary file (`.NAME.tmp-PID-RANDOM`) was written for, else None."""
    if not name.startswith(".") or TMP_MARK not in name:
        return None
    return name[1:].partition(TMP_MARK)[0]
