"""The manifest of committed parts of one shard, and what a restart may skip.

A shard's rows are cut into parts of `rows_per_part` rows aligned to the shard's first
row, so part k always covers the same rows and a restart knows, from the manifest
alone, where to resume. A part is committed when its file has been renamed into place
AND the manifest lists it (the manifest is replaced atomically after the rename); a
part file the manifest does not list, and every temporary file, is debris of a killed
run and is removed on open. `_SUCCESS-SSSSS` is written last, so it exists only when
every part of the shard is committed; a marker without a manifest that backs it is
removed with the rest of the shard's files.

The manifest also holds the job's fingerprint (model, preprocessing, pooling, dtype,
input) and the shard layout (number of shards, row range, part size): resuming into
output made by a different job would mix embeddings from two models or cut parts at
other rows, so it is refused, naming what changed, unless the user asks to overwrite.

One process writes a shard at a time: `open_checkpoint` takes an exclusive lock on the
shard's `.lock-SSSSS` file and holds it until `finish` (the kernel drops it when the
process dies, SIGKILL included). Removing temporary files on open relies on this; a
second run of the same shard (a duplicate submission, a requeue racing its old task)
stops with a clear error instead of deleting the first run's files under it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedjob.job import Job, JobError
from embedjob.writer import TMP_MARK, stats_name, write_json

logger = logging.getLogger(__name__)

_MANIFEST = re.compile(r"^manifest-(\d{5})\.json$")
_SUCCESS = re.compile(r"^_SUCCESS-(\d{5})$")
_LAYOUT = ("num_shards", "first_row", "end_row", "rows_per_part")
_PART_KEYS = {"part", "name", "first_row", "end_row", "errors"}


def job_fingerprint(job: Job) -> dict[str, Any]:
    """What determines the embeddings; a resume into output with another fingerprint is refused."""
    return {
        "model": vars(job.model),
        "preprocessing": {"preprocess": vars(job.preprocess), "video": vars(job.video)},
        "pooling": job.output.pooling,
        "output_dtype": job.output.dtype,
        "input": {k: getattr(job.input, k) for k in ("path", "media_column", "id_column", "modality", "media_root")},
    }


def manifest_name(shard: int) -> str:
    return f"manifest-{shard:05d}.json"


def success_name(shard: int) -> str:
    return f"_SUCCESS-{shard:05d}"


def lock_name(shard: int) -> str:
    return f".lock-{shard:05d}"


@dataclass
class PartRecord:
    """A committed part: its file and the global row range [first_row, end_row) it holds."""

    part: int
    name: str
    first_row: int
    end_row: int
    errors: int

    def to_dict(self) -> dict[str, Any]:
        return dict(part=self.part, name=self.name, first_row=self.first_row, end_row=self.end_row, errors=self.errors)


class ShardLock:
    """An exclusive `flock` on a shard's lock file, held by the process writing the shard.

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
    def acquire(cls, directory: Path, shard: int) -> "ShardLock":
        """Lock shard `shard` of `directory`; JobError if another process holds it.

        On a filesystem without working `flock` (e.g. Lustre mounted without `flock`)
        the run goes ahead unlocked, with a warning.
        """
        path = directory / lock_name(shard)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise JobError(
                    f"shard {shard} of {directory} is being written by another process ({holder}); "
                    "wait for it to finish or stop it, then run again"
                ) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                logger.warning("cannot lock %s (%s); make sure no other process runs shard %d", path, exc, shard)
                return cls(path, None)
            if _same_file(fd, path):
                os.ftruncate(fd, 0)
                os.write(fd, _holder_text().encode())
                return cls(path, fd)
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order: see the class docstring)."""
        if self._finalizer is not None:
            self._finalizer()


def _unlock(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _holder_text() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"pid {os.getpid()} on {socket.gethostname()}" + (f", SLURM job {job}" if job else "")


def _read_holder(fd: int) -> str:
    text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    return text or "holder unknown"


@dataclass
class Checkpoint:
    """Committed state of one shard in `directory`.

    Invariant: `parts` are contiguous from the shard's first row, in part order, each
    covers `part_bounds(part)`, and every listed file exists.
    """

    directory: Path
    shard: int
    num_shards: int
    first_row: int
    end_row: int
    rows_per_part: int
    fingerprint: dict[str, Any]
    parts: list[PartRecord] = field(default_factory=list)
    lock: ShardLock | None = field(default=None, repr=False, compare=False)

    @property
    def resume_row(self) -> int:
        """The first global row not yet committed."""
        return self.parts[-1].end_row if self.parts else self.first_row

    @property
    def next_part(self) -> int:
        return len(self.parts)

    def part_bounds(self, part: int) -> tuple[int, int]:
        """Global row range of part `part` of this shard."""
        start = self.first_row + part * self.rows_per_part
        return start, min(start + self.rows_per_part, self.end_row)

    def is_done(self) -> bool:
        return (self.directory / success_name(self.shard)).exists()

    def finished_stats(self) -> dict[str, Any]:
        """The statistics a finished shard wrote, marked as skipped by this run."""
        path = self.directory / stats_name(self.shard)
        stats = json.loads(path.read_text()) if path.exists() else {"rows": self.end_row - self.first_row}
        stats["skipped"] = True
        return stats

    def commit(self, record: PartRecord) -> None:
        """Record a part whose file is already renamed into place."""
        expected = self.part_bounds(self.next_part)
        if (record.part, record.first_row, record.end_row) != (self.next_part, *expected):
            raise ValueError(f"part {record.part} rows [{record.first_row}, {record.end_row}) out of order; expected {expected}")
        self.parts.append(record)
        self._save()

    def finish(self, stats: dict[str, Any]) -> None:
        """Write the shard's statistics, then the success marker (last), then unlock.

        Raises RuntimeError if the committed parts do not cover the shard: a success
        marker over missing rows would make every later run skip them.
        """
        if self.resume_row != self.end_row:
            raise RuntimeError(f"shard {self.shard}: rows [{self.resume_row}, {self.end_row}) are not committed")
        write_json(self.directory / stats_name(self.shard), stats)
        write_json(self.directory / success_name(self.shard), {"parts": len(self.parts), "rows": self.end_row - self.first_row})
        if self.lock is not None:
            self.lock.release()

    def manifest(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "num_shards": self.num_shards,
            "first_row": self.first_row,
            "end_row": self.end_row,
            "rows_per_part": self.rows_per_part,
            "fingerprint": self.fingerprint,
            "parts": [p.to_dict() for p in self.parts],
        }

    def _save(self) -> None:
        write_json(self.directory / manifest_name(self.shard), self.manifest())


def open_checkpoint(
    directory: Path,
    shard: int,
    num_shards: int,
    first_row: int,
    end_row: int,
    rows_per_part: int,
    fingerprint: dict[str, Any],
    overwrite: bool,
) -> Checkpoint:
    """Lock the shard, refuse a changed job (touching nothing), clean the debris of
    killed runs, and load (or start) the shard's checkpoint.

    With `overwrite`, everything this shard wrote before is removed first. The
    returned checkpoint holds the shard's lock until `finish` (or until it is
    dropped), except for a finished shard, which this run only reads.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lock = ShardLock.acquire(directory, shard)
    fresh = Checkpoint(directory, shard, num_shards, first_row, end_row, rows_per_part, _plain(fingerprint), lock=lock)
    try:
        return _load(fresh, overwrite)
    except BaseException:
        lock.release()
        raise


def _load(fresh: Checkpoint, overwrite: bool) -> Checkpoint:
    """The checkpoint `fresh` describes, filled from the shard's manifest when resuming."""
    directory, shard, end_row = fresh.directory, fresh.shard, fresh.end_row
    manifest = None if overwrite else load_manifest(directory, shard)
    if manifest is not None and not manifest.get("parts") and not (directory / success_name(shard)).exists():
        # A run that committed nothing (e.g. stopped by a spec error after the manifest was
        # written) has no output to protect: the corrected job starts afresh.
        manifest = None
    changes = manifest_changes(manifest, fresh) if manifest is not None else []
    if changes:
        raise JobError(
            f"output {directory} holds shard {shard} of a different job ({'; '.join(changes)}); "
            "use a new output.path, or pass --overwrite to replace it"
        )
    _remove_temporaries(directory, shard)
    if manifest is None:
        # No manifest: nothing of this shard is committed, whatever else lies there.
        _remove_shard_files(directory, shard)
        fresh._save()
        return fresh
    listed = [PartRecord(**p) for p in manifest["parts"]]
    fresh.parts = _valid_prefix(fresh, listed)
    if len(fresh.parts) != len(listed):
        logger.warning(
            "shard %d: %d of %d committed parts are missing; rows from %d are recomputed",
            shard, len(listed) - len(fresh.parts), len(listed), fresh.resume_row,
        )
        fresh._save()
    if fresh.resume_row != end_row:
        (directory / success_name(shard)).unlink(missing_ok=True)
    _remove_unlisted_parts(directory, shard, {p.name for p in fresh.parts})
    if fresh.is_done():
        # From here on a finished shard is only read; releasing now lets a duplicate
        # run of it skip it too instead of failing on the lock.
        fresh.lock.release()
        fresh.lock = None
    return fresh


def load_manifest(directory: Path, shard: int) -> dict[str, Any] | None:
    """The shard's manifest, None if there is none; JobError if it cannot be read."""
    path = directory / manifest_name(shard)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read {path} ({exc}); pass --overwrite to recompute shard {shard}") from None
    parts = manifest.get("parts") if isinstance(manifest, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, dict) and set(p) == _PART_KEYS for p in parts):
        raise JobError(f"{path} is not an embedjob manifest; pass --overwrite to recompute shard {shard}")
    return manifest


def manifest_changes(manifest: dict[str, Any], current: Checkpoint) -> list[str]:
    """What differs between a stored manifest and the current job, as `key: old -> new`.

    Fingerprint keys are named down to the leaf (`model.path`, `pooling`), so the user
    sees which setting changed rather than a whole section.
    """
    old = _flatten(manifest.get("fingerprint") or {})
    new = _flatten(_plain(current.fingerprint))
    changes = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    changes += [f"{k}: {manifest.get(k)!r} -> {getattr(current, k)!r}" for k in _LAYOUT if manifest.get(k) != getattr(current, k)]
    return changes


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it reads back from JSON (tuples become lists), so that an
    unchanged job compares equal to its stored manifest."""
    return json.loads(json.dumps(fingerprint, sort_keys=True))


def _valid_prefix(cp: Checkpoint, listed: list[PartRecord]) -> list[PartRecord]:
    """The listed parts up to the first one that is out of place or whose file is gone."""
    kept: list[PartRecord] = []
    for record in listed:
        in_place = record.part == len(kept) and (record.first_row, record.end_row) == cp.part_bounds(record.part)
        if not in_place or not (cp.directory / record.name).exists():
            break
        kept.append(record)
    return kept


def _shard_pattern(shard: int) -> re.Pattern[str]:
    return re.compile(rf"^part-{shard:05d}-\d{{5}}\.parquet$")


def _remove_temporaries(directory: Path, shard: int) -> None:
    """Temporary files of killed writers of this shard (none is in use: we hold its lock)."""
    names = {f"part-{shard:05d}-", manifest_name(shard), stats_name(shard), success_name(shard)}
    for path in directory.iterdir():
        if TMP_MARK in path.name and any(path.name.startswith("." + n) for n in names):
            logger.info("removing temporary file %s of a stopped run", path.name)
            path.unlink(missing_ok=True)


def _remove_unlisted_parts(directory: Path, shard: int, listed: set[str]) -> None:
    pattern = _shard_pattern(shard)
    for path in directory.iterdir():
        if pattern.match(path.name) and path.name not in listed:
            logger.info("removing uncommitted part %s", path.name)
            path.unlink()


def _remove_shard_files(directory: Path, shard: int) -> None:
    _remove_unlisted_parts(directory, shard, set())
    for name in (manifest_name(shard), stats_name(shard), success_name(shard)):
        (directory / name).unlink(missing_ok=True)


@dataclass
class ShardProgress:
    """What the files of one shard say, read without locking (for `embedjob status`).

    `rows` is None while the shard has no manifest (not started); `committed` counts
    the rows of the parts its manifest lists.
    """

    shard: int
    num_shards: int | None
    rows: int | None
    committed: int
    parts: int
    errors: int
    done: bool


def shard_progress(directory: Path, shard: int) -> ShardProgress:
    manifest = load_manifest(directory, shard)
    done = (directory / success_name(shard)).exists()
    if manifest is None:
        return ShardProgress(shard, None, None, 0, 0, 0, done)
    parts = manifest["parts"]
    return ShardProgress(
        shard=shard,
        num_shards=manifest.get("num_shards"),
        rows=manifest["end_row"] - manifest["first_row"],
        committed=sum(p["end_row"] - p["first_row"] for p in parts),
        parts=len(parts),
        errors=sum(p["errors"] for p in parts),
        done=done,
    )


def shards_in(directory: Path) -> set[int]:
    """Shard indices that have a manifest or a success marker in `directory`."""
    found = set()
    for path in directory.iterdir() if directory.is_dir() else ():
        match = _MANIFEST.match(path.name) or _SUCCESS.match(path.name)
        if match:
            found.add(int(match.group(1)))
    return found
