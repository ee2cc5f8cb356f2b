"""Where an output lives: the one seam between the output's bookkeeping (checkpoint,
writer, verify, status, report) and its storage.

Two sides: `files.LocalStore`, a local or mounted directory (files created fresh with
`O_EXCL`, never through a link, renamed into place, fsynced; `flock` locks), and
`object_store.ObjectStore`, a prefix of an object store reached through fsspec (parts
uploaded to their final keys and completed only when whole, lease locks created with
conditional writes). Everything above the seam names files relative to the output
(`part-00000-00000.parquet`, `_embedjob/manifest-00000.json`) and keeps the same
invariants on both sides: the manifest commits a part, `_SUCCESS` comes last, one
writer per shard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from embedjob.io.files import LocalStore
from embedjob.io.object_store import SCHEME, ObjectStore



class PartUpload(Protocol):
    """A part being written: bytes go to `stream`; visible under its name only after
    `commit`, never after `abandon`."""

    stream: Any

    def commit(self) -> None: ...

    def abandon(self) -> None: ...


class Lock(Protocol):
    """A held lock: `lost` says why it is no longer held (None while it is)."""

    def release(self) -> None: ...

    def lost(self) -> str | None: ...


class Store(Protocol):
    """An output's storage; `name`s are relative to the output, `/`-separated.

    `replace` writes a small file whole (a reader sees the old one or the new one),
    `create` only where nothing is (FileExistsError), `open_part` a part that appears
    whole or not at all; `lock` is exclusive between processes and hosts (JobError
    naming the holder). Missing files raise FileNotFoundError (`remove` excepted).
    """

    location: str

    def where(self, name: str) -> str: ...

    def problem(self) -> str | None: ...

    def prepare(self, folder: str) -> None: ...

    def files(self, folder: str = "") -> list[str]: ...

    def read(self, name: str) -> bytes: ...

    def exists(self, name: str) -> bool: ...

    def replace(self, name: str, data: bytes) -> None: ...

    def create(self, name: str, data: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def size(self, name: str) -> int | None: ...

    def digest(self, name: str) -> tuple[int, str]: ...

    def open_part(self, name: str) -> PartUpload: ...

    def arrow(self, name: str) -> tuple[str, Any]: ...

    def lock(self, name: str, what: str, blocking: bool = False) -> Lock: ...

    def lock_holder(self, name: str) -> str | None: ...

    def link_target(self, name: str) -> str | None: ...

    def remove_debris(self, folders: tuple[str, ...], written: Callable[[str], bool]) -> None: ...


def is_url(location: str) -> bool:
    """Whether `location` names an fsspec URL (`s3://...`) rather than a local path."""
    return bool(SCHEME.match(location)) and not location.startswith("file://")


def output_store(location: str | Path | Store, options: dict[str, Any] | None = None) -> Store:
    """The store of an output named by `location`: an object store for a URL (with
    fsspec's storage `options`), else a directory, relative to the working directory.
    A store is returned as it is."""
    if not isinstance(location, (str, Path)):
        return location
    text = str(location)
    if is_url(text):
        return ObjectStore(text, options)
    return LocalStore(Path(text.removeprefix("file://")))


def job_store(output: Any) -> Store:
    """The store of a job's `output` section (`output.path`, `output.storage_options`)."""
    return output_store(output.path, output.storage_options)


def shared_store(output: Any) -> Store:
    """A job's `output` section as the nodes of a cluster must see it: a directory
    resolved here (absolute, so it names the same directory wherever a task starts,
    provided every node mounts it at the same path), or the object-store URL as it is,
    which every node reaches the same way."""
    store = job_store(output)
    return LocalStore((Path.cwd() / store.path).resolve()) if isinstance(store, LocalStore) else store
