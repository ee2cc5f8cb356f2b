"""An output under a prefix of an object store (`s3://`, `gs://`, `az://`, ... through
fsspec): the object-store side of the storage seam (`io/store.py`).

An object store has no rename and no flock, so the local output's guarantees are kept
by other means (docs/output.md, "Object storage"):

- A part is streamed to its final key with the file system's uncommitted writes
  (`autocommit=False`: on S3 a multipart upload), completed only at `commit`, once
  the part is whole; until then nothing is visible under the key, and a failing
  writer aborts the upload (`ObjectPart.abandon`). A killed writer's incomplete
  uploads are invisible too, and aborted by the shard's next run (`remove_debris`).
  The manifest, a small object rewritten whole, is what commits a part: a part key
  it does not list is ignored by its readers and removed by the shard's next run.
- A lock is an object holding its holder and a lease (`LeaseLock`): created only where
  none exists (`If-None-Match: *`), renewed while its holder runs, and taken over
  only once stale (its lease ran out, or its holder's process is gone from this
  host), with `If-Match` on the stale lock's ETag, so two runs cannot both take it.
  On S3 (`conditional` is True) both are atomic. Other stores get fsspec's exclusive
  create where their backend has one (else check-then-write) and a read-back of the
  lock: two runs started within moments of each other may both go ahead there.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from embedjob.config import JobError
from embedjob.io.files import holder_text

logger = logging.getLogger(__name__)

LEASE_S = 60.0
"""How long a lock object holds without renewal: a holder that died on another host
keeps its shard from being run again for at most this long."""
RENEW_S = LEASE_S / 4
"""How often a holder renews its lease."""
POLL_S = 0.5
"""How often a blocking `LeaseLock.acquire` looks again at a held lock."""
_CHUNK = 8 << 20
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
"""What starts an fsspec URL (`s3://`, `gs://`, `file://`, ...)."""


def etag_of(info: dict[str, Any]) -> str | None:
    """The ETag in an fsspec `info` record (s3fs spells it `ETag`, others `etag`), if any."""
    etag = info.get("ETag") or info.get("etag")
    return str(etag) if etag else None


def _conditional(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether the store makes conditional writes atomic for us (S3's If-None-Match and
    If-Match on PutObject, which s3fs passes through)."""
    return "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


class ObjectPart:
    """A part being uploaded to its final key, invisible until `commit` completes the
    upload (a multipart upload on S3); `abandon` aborts it."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.stream = fs.open(path, "wb", autocommit=False)

    def commit(self) -> None:
        self.stream.close()
        self.stream.commit()

    def abandon(self) -> None:
        """Drop the upload: closing uploads what is buffered (still uncommitted) and
        leaves the file object in a state `discard` handles; discarding aborts it."""
        try:
            self.stream.close()
        except OSError as exc:
            logger.debug("closing the abandoned upload %s: %s", self.stream.path, exc)
        finally:
            try:
                self.stream.discard()
            except OSError as exc:
                logger.warning(
                    "cannot abort the upload of %s (%s); the shard's next run aborts it", self.stream.path, exc
                )


class ObjectStore:
    """An output at `url`, a prefix of an object store; names are relative to it.

    `options` are fsspec's storage options (`output.storage_options`), over what the
    backend reads itself (the AWS environment, AWS_ENDPOINT_URL, fsspec's config).
    Listings are never cached: other processes write the same output."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **{"use_listings_cache": False, **(options or {})})
        except ImportError as exc:
            raise JobError(f"output.path {url!r} needs fsspec's backend for it: {exc}") from None
        self.root = root.rstrip("/")
        self.location = url.rstrip("/")
        self.conditional = _conditional(self.fs)

    def __str__(self) -> str:
        return self.location

    def where(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def problem(self) -> str | None:
        """Why this is no output to read: an object in its place, or nothing under it."""
        if self.fs.isfile(self.root):
            return "is an object, not an output prefix"
        return None if self.fs.isdir(self.root) else "does not exist"

    def prepare(self, folder: str) -> None:
        """Nothing to create: a prefix exists once an object is written under it."""

    def files(self, folder: str = "") -> list[str]:
        try:
            listed = self.fs.ls(self._key(folder) if folder else self.root, detail=True)
        except FileNotFoundError:
            return []
        return [entry["name"].rsplit("/", 1)[-1] for entry in listed if entry["type"] == "file"]

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._key(name))

    def exists(self, name: str) -> bool:
        return self.fs.isfile(self._key(name))

    def replace(self, name: str, data: bytes) -> None:
        """Write `name` whole: a single put, so a reader sees the old object or the new."""
        self.fs.pipe_file(self._key(name), data)

    def create(self, name: str, data: bytes) -> None:
        """Write `name` where no object is; FileExistsError otherwise."""
        self.fs.pipe_file(self._key(name), data, mode="create")

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name))

    def size(self, name: str) -> int | None:
        info = self.fs.info(self._key(name))
        return int(info["size"]) if info["type"] == "file" else None

    def digest(self, name: str) -> tuple[int, str]:
        """(size, sha256) of the object as the store returns it now."""
        digest, size = hashlib.sha256(), 0
        with self.fs.open(self._key(name), "rb", block_size=_CHUNK) as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return size, digest.hexdigest()

    def open_part(self, name: str) -> ObjectPart:
        return ObjectPart(self.fs, self._key(name))

    def arrow(self, name: str) -> tuple[str, Any]:
        """Where pyarrow reads `name`: its key, through this store's file system."""
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return self._key(name), PyFileSystem(FSSpecHandler(self.fs))

    def lock(self, name: str, what: str, blocking: bool = False) -> "LeaseLock":
        return LeaseLock.acquire(self, name, what, blocking)

    def lock_holder(self, name: str) -> str | None:
        held = self.read_lock(name)
        return None if held is None or held.stale() else held.holder

    def link_target(self, name: str) -> str | None:
        """Never: an object store has no links."""
        return None

    def remove_debris(self, folders: tuple[str, ...], written: Callable[[str], bool]) -> None:
        """Abort the incomplete uploads in `folders` of killed writers whose name
        `written` accepts (invisible, but kept and billed by the store until aborted).
        Only S3 lists them; elsewhere the store's own expiry of incomplete uploads
        applies (docs/output.md)."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return
        bucket, _, prefix = self.root.partition("/")
        for upload in self._uploads(bucket, f"{prefix}/" if prefix else ""):
            name = upload["Key"][len(prefix) + 1 if prefix else 0 :]
            if name.rpartition("/")[0] in folders and written(name):
                logger.info("aborting the incomplete upload of %s left by a stopped run", name)
                self.fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])

    def _uploads(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        uploads: list[dict[str, Any]] = []
        marker: dict[str, str] = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
            uploads += page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return uploads
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    # ------------------------------------------------------------ lock objects

    def read_lock(self, name: str) -> "HeldLock | None":
        """The lock object `name` as it is now, None when there is none."""
        try:
            info = self.fs.info(self._key(name))
            data = json.loads(self.fs.cat_file(self._key(name)))
        except FileNotFoundError:
            return None
        except ValueError:
            data = {}  # unreadable: an expired lease, which a run may take over
        return HeldLock(
            holder=str(data.get("holder", "holder unknown")),
            host=str(data.get("host", "")),
            pid=int(data.get("pid", 0)),
            expires=float(data.get("expires", 0.0)),
            nonce=str(data.get("nonce", "")),
            etag=etag_of(info),
        )

    def put_lock(self, name: str, body: dict[str, Any], replacing: "HeldLock | None") -> "HeldLock":
        """Write the lock object `name` holding `body`: where none is (`replacing`
        None), else over exactly the lock `replacing` read. FileExistsError when
        another writer got there first."""
        data = json.dumps(body).encode()
        key = self._key(name)
        try:
            if replacing is None:
                self.fs.pipe_file(key, data, mode="create")
            elif self.conditional:
                self.fs.pipe_file(key, data, IfMatch=replacing.etag)
            else:
                self.fs.pipe_file(key, data)
        except OSError as exc:
            # S3's PreconditionFailed (If-Match) arrives as EINVAL; a lock removed meanwhile as not found.
            if isinstance(exc, FileExistsError | FileNotFoundError) or exc.errno == errno.EINVAL:
                raise FileExistsError(key) from None
            raise
        held = self.read_lock(name)
        if held is None or held.nonce != body["nonce"]:
            raise FileExistsError(key)  # another writer's lock replaced ours (a store without conditional writes)
        return held


@dataclass(frozen=True)
class HeldLock:
    """A lock object as read: who holds it, until when (wall clock, seconds since the
    epoch) unless renewed, the nonce of its last write, and its ETag."""

    holder: str
    host: str
    pid: int
    expires: float
    nonce: str
    etag: str | None

    def stale(self) -> bool:
        """Whether a run may take it over: its lease ran out, or its holder's process
        is gone from this host (a killed run's, found by its rerun at once)."""
        if self.expires < time.time():
            return True
        return self.host == socket.gethostname() and self.pid > 0 and not _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _body() -> dict[str, Any]:
    return {
        "holder": holder_text(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "expires": time.time() + LEASE_S,
        "nonce": secrets.token_hex(8),
    }


class LeaseLock:
    """A lock object this process holds, renewed every RENEW_S by a thread of its own
    until `release`. A renewal that finds the lock taken over (this process was
    stalled past its lease) marks it `lost`, which the shard's next commit checks."""

    def __init__(self, store: ObjectStore, name: str, held: HeldLock) -> None:
        self.store, self.name, self._held = store, name, held
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"embedjob-lease-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, store: ObjectStore, name: str, what: str, blocking: bool = False) -> "LeaseLock":
        """Take the lock `name` for `what`: create it, or take over a stale one; when
        another process holds it, wait (`blocking`) or JobError naming the holder."""
        while True:
            try:
                return cls(store, name, store.put_lock(name, _body(), None))
            except FileExistsError:
                pass
            held = store.read_lock(name)
            if held is None:
                continue
            if held.stale():
                logger.info("%s: taking over the lock of %s, which is stale", what, held.holder)
                try:
                    return cls(store, name, store.put_lock(name, _body(), held))
                except FileExistsError:
                    continue
            if not blocking:
                until = time.strftime("%H:%M:%S", time.localtime(held.expires))
                raise JobError(
                    f"{what} is being written by another process ({held.holder}); wait for it to finish or stop it, "
                    f"then run again (if it is gone, its lock {store.where(name)} expires at {until})"
                )
            time.sleep(POLL_S)

    def lost(self) -> str | None:
        """Why this process no longer holds the lock, None while it does."""
        return self._lost

    def release(self) -> None:
        """Stop renewing and remove the lock object, unless it was taken over."""
        self._stop.set()
        self._thread.join()
        if self._lost is None:
            self.store.remove(self.name)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._held = self.store.put_lock(self.name, _body(), self._held)
            except FileExistsError:
                taken = self.store.read_lock(self.name)
                self._lost = f"its lock was taken over by {taken.holder if taken else 'another process'}"
                logger.error("%s: %s", self.store.where(self.name), self._lost)
                return
            except OSError as exc:
                logger.warning("cannot renew the lock %s (%s); trying again", self.store.where(self.name), exc)
