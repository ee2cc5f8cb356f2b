"""Reading a row's path or URI: the bytes of one item, bounded and confined to the media root.

`read_source` is what a worker calls for a row without media bytes: the size is checked
before anything is read (`too_large`), and with a media root the file actually opened must
lie under it (`path_escape`), checked on the open descriptor so that a path swapped for a
symlink after the reader's check cannot lead out. See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

import os
import stat
from typing import Any

from embedjob.config import DEFAULT_MAX_ITEM_BYTES
from embedjob.decode.types import MediaError


def read_source(
    uri: str, root: str | None = None, max_bytes: int | None = DEFAULT_MAX_ITEM_BYTES, options: dict[str, Any] | None = None
) -> bytes:
    """All bytes of a local path or an fsspec URI (s3://, gs://, file://, ...; opened
    with fsspec's storage `options`, the job's `input.storage_options`), checked before
    they are read.

    - An item of more than `max_bytes` bytes is "too_large", known from its size before
      any byte is read (the file's fstat, the store's size), and the read stops one byte
      past the limit in case the file grows meanwhile: a worker never holds more.
    - With `root` (the real path of the media root, `reader.local_media_root`), the file
      actually opened must lie under it ("path_escape"). The check is made on the open
      descriptor, so a path swapped for a symlink after the reader checked it cannot
      lead out, and a swap after the check changes nothing we read.

    Raises MediaError "not_found" for a missing file and "unreadable" for everything
    else that stops the read (directory, permissions, no fsspec backend installed).
    """
    try:
        if "://" not in uri:
            return _read_local(uri, root, max_bytes)
        import fsspec  # only URIs need it; plain paths skip the import
        from fsspec.implementations.local import LocalFileSystem

        fs, path = fsspec.core.url_to_fs(uri, **(options or {}))
        if isinstance(fs, LocalFileSystem):
            return _read_local(path, root, max_bytes)
        with fs.open(path, "rb") as handle:
            _check_size(uri, getattr(handle, "size", None), max_bytes)
            return _bounded_read(uri, handle, max_bytes)
    except FileNotFoundError:
        raise MediaError("not_found", f"{uri}: no such file") from None
    except IsADirectoryError:
        raise MediaError("unreadable", f"{uri}: is a directory") from None
    except PermissionError:
        raise MediaError("unreadable", f"{uri}: permission denied") from None
    except ImportError as exc:
        raise MediaError("unreadable", f"{uri}: no fsspec backend for this protocol ({exc})") from None
    except (OSError, ValueError) as exc:
        raise MediaError("unreadable", f"{uri}: {exc}") from None


def _read_local(path: str, root: str | None, max_bytes: int | None) -> bytes:
    # O_NONBLOCK: a FIFO planted under a media name must not hang the worker in open().
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if root is not None:
            _check_opened_within(fd, path, root)
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise MediaError("unreadable", f"{path}: is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("unreadable", f"{path}: not a regular file")
        _check_size(path, info.st_size, max_bytes)
        with open(fd, "rb", closefd=False) as handle:
            return _bounded_read(path, handle, max_bytes)
    finally:
        os.close(fd)


def _check_opened_within(fd: int, path: str, root: str) -> None:
    """The file open on `fd` lies under `root`, whatever symlinks led to it (the kernel
    names the opened file in /proc/self/fd; a later swap of `path` cannot change it)."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        raise MediaError("unreadable", f"{path}: cannot check that it lies under media_root (/proc is not mounted)") from None
    if os.path.commonpath([real, root]) != root:
        raise MediaError("path_escape", f"{path} leads to {real}, outside media_root {root}")


def _check_size(what: str, size: int | None, max_bytes: int | None) -> None:
    if size is not None and max_bytes is not None and size > max_bytes:
        raise MediaError("too_large", f"{what}: {size} bytes, more than input.max_item_bytes = {max_bytes}")


def _bounded_read(what: str, handle: Any, max_bytes: int | None) -> bytes:
    """At most `max_bytes` bytes; a source that turns out longer than its size said is
    "too_large" (read one byte past the limit to know, never more)."""
    data = handle.read(-1 if max_bytes is None else max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise MediaError("too_large", f"{what}: more than input.max_item_bytes = {max_bytes} bytes")
    return data
