"""Media digests: what a committed part's rows were computed from.

The job fingerprint names each input file by its size and a hash of its footer, which
an image changed in place (same size, same footer) does not change. So every row also
carries a digest of the media bytes its decode worker read (`rows.decode_row`: the
Parquet cell's bytes, or the file a path names), a part's record holds one digest of
its rows' digests (`part_digest`), and a rerun that keeps committed parts recomputes
theirs from the input as it is now and refuses to resume over rows whose media changed
(`checkpoint.open_checkpoint`). Without that, a rerun after an in-place change mixes
vectors of the old media (the kept parts) with vectors of the new (the rest).

A row's digest is the first 16 bytes of the SHA-256 of its media bytes: collisions are
beyond reach for the few billion rows of a job, and on a CPU with SHA instructions
(x86 `sha_ni`, ARMv8 SHA2) OpenSSL's SHA-256 is the fastest hash hashlib has: 1.85 GB/s
a core on 100 kB items where BLAKE2b made 1.0 GB/s (one x86 core of the development
machine). The decode workers hash the bytes they already hold, so no byte is read twice.

Two markers stand for rows without such bytes:

- `NO_MEDIA`: the row has no bytes to hash (the reader made it an error row, its path
  names no readable file); recomputed the same way, a row that gained bytes since differs.
- `UNREAD`: no worker finished the row (the decode pool cut it off after a timeout or
  a crash, so its outcome is an error that depends on no byte the rank saw). A part
  lists such rows (`unread_rows`) and the check leaves them out.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_SIZE = 16
"""Bytes of a row's media digest."""

NO_MEDIA = b"\xff" * DIGEST_SIZE
"""The digest of a row whose media could not be read (no bytes to hash)."""

UNREAD = bytes(DIGEST_SIZE)
"""The digest of a row no decode worker finished: not known, not checked."""


def media_digest(data: bytes | memoryview) -> bytes:
    """The digest of one row's media bytes (hashlib releases the GIL for large buffers,
    so the pool's thread hashing a JPEG left for the GPU holds no other thread up)."""
    return hashlib.sha256(data).digest()[:DIGEST_SIZE]


def digest_array(digests: list[bytes]) -> np.ndarray:
    """Row digests as the (rows, DIGEST_SIZE) uint8 array a `RowBlock` carries."""
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), DIGEST_SIZE)


def unread_rows(digests: np.ndarray, first_row: int) -> list[int]:
    """The global rows among `digests` (rows from `first_row` on) whose media is UNREAD."""
    return (np.flatnonzero(~digests.any(axis=1)) + first_row).tolist()


def part_digest(digests: np.ndarray) -> str:
    """The digest of a part's rows (their digests in row order, UNREAD ones included as
    they are), as hex for the manifest."""
    return hashlib.sha256(np.ascontiguousarray(digests, dtype=np.uint8).tobytes()).hexdigest()[: 2 * DIGEST_SIZE]


def recomputed_digest(digests: np.ndarray, first_row: int, unread: list[int]) -> str:
    """`part_digest` of a part's rows (from `first_row` on) as the input gives them now,
    with its `unread` rows (global numbers) set back to UNREAD, as they were committed:
    their outcome depended on no byte a worker read, so any bytes match them."""
    rows = digests.copy()
    rows[np.asarray(unread, dtype=np.int64) - first_row] = 0
    return part_digest(rows)
