"""The manifest of committed parts of one shard, and what a restart may skip.

A shard's rows are cut into parts of `rows_per_part` rows aligned to the shard's first
row, so part k always covers the same rows and a restart knows, from the manifest
alone, where to resume. A part is committed when its file has been renamed into place
AND the manifest lists it (the manifest is replaced atomically after the rename); a
part file the manifest does not list, and every temporary file, is debris of a killed
run and is removed on open. `_SUCCESS-SSSSS` is written last.

The manifest also holds the job's fingerprint (model, preprocessing, pooling, dtype,
input, sharding): resuming into output made by a different job would mix embeddings
from two models, so it is refused unless the user asks to overwrite.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedjob.job import JobError
from embedjob.writer import TMP_MARK, stats_name, write_json

logger = logging.getLogger(__name__)


def manifest_name(shard: int) -> str:
    return f"manifest-{shard:05d}.json"


def success_name(shard: int) -> str:
    return f"_SUCCESS-{shard:05d}"


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


@dataclass
class Checkpoint:
    """Committed state of one shard in `directory`.

    Invariant: `parts` are contiguous from the shard's first row, in part order, and
    every listed file exists.
    """

    directory: Path
    shard: int
    num_shards: int
    first_row: int
    end_row: int
    rows_per_part: int
    fingerprint: dict[str, Any]
    parts: list[PartRecord] = field(default_factory=list)

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
        """Write the shard's statistics, then the success marker (last)."""
        write_json(self.directory / stats_name(self.shard), stats)
        write_json(self.directory / success_name(self.shard), {"parts": len(self.parts), "rows": self.end_row - self.first_row})

    def _save(self) -> None:
        write_json(
            self.directory / manifest_name(self.shard),
            {
                "shard": self.shard,
                "num_shards": self.num_shards,
                "first_row": self.first_row,
                "end_row": self.end_row,
                "rows_per_part": self.rows_per_part,
                "fingerprint": self.fingerprint,
                "parts": [p.to_dict() for p in self.parts],
            },
        )


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
    """Load (or start) the shard's checkpoint, clean debris, refuse a changed job.

    With `overwrite`, everything this shard wrote before is removed first.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(directory, shard)
    fresh = Checkpoint(directory, shard, num_shards, first_row, end_row, rows_per_part, fingerprint)
    if overwrite:
        _remove_shard_files(directory, shard)
        fresh._save()
        return fresh
    manifest_path = directory / manifest_name(shard)
    if not manifest_path.exists():
        _remove_unlisted_parts(directory, shard, set())
        fresh._save()
        return fresh
    manifest = json.loads(manifest_path.read_text())
    _refuse_changed_job(manifest, fresh, directory)
    fresh.parts = [PartRecord(**p) for p in manifest["parts"] if (directory / p["name"]).exists()]
    if len(fresh.parts) != len(manifest["parts"]):
        logger.warning("shard %d: some committed parts are missing; they will be recomputed", shard)
        fresh.parts = _contiguous_prefix(fresh)
        (directory / success_name(shard)).unlink(missing_ok=True)
        fresh._save()
    _remove_unlisted_parts(directory, shard, {p.name for p in fresh.parts})
    return fresh


def _refuse_changed_job(manifest: dict[str, Any], current: Checkpoint, directory: Path) -> None:
    old = manifest.get("fingerprint", {})
    changed = sorted(k for k in set(old) | set(current.fingerprint) if old.get(k) != current.fingerprint.get(k))
    layout = ("num_shards", "first_row", "end_row", "rows_per_part")
    changed += [k for k in layout if manifest.get(k) != getattr(current, k)]
    if changed:
        details = "; ".join(
            f"{k}: {old.get(k, manifest.get(k))!r} -> {current.fingerprint.get(k, getattr(current, k, None))!r}"
            for k in changed
        )
        raise JobError(
            f"output {directory} holds shard {current.shard} of a different job ({details}); "
            "use a new output.path, or pass --overwrite to replace it"
        )


def _contiguous_prefix(cp: Checkpoint) -> list[PartRecord]:
    kept: list[PartRecord] = []
    for record in cp.parts:
        if record.part != len(kept):
            break
        kept.append(record)
    return kept


def _shard_pattern(shard: int) -> re.Pattern[str]:
    return re.compile(rf"^part-{shard:05d}-\d{{5}}\.parquet$")


def _remove_temporaries(directory: Path, shard: int) -> None:
    """Temporary files of killed writers: any process may have left them, none is in use
    (one process owns a shard at a time)."""
    names = {f"part-{shard:05d}-", manifest_name(shard), stats_name(shard), success_name(shard)}
    for path in directory.iterdir():
        if TMP_MARK in path.name and any(path.name.startswith("." + n) for n in names):
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
