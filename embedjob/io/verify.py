"""`embedjob verify OUTPUT`: check a whole output against what its runs committed.

Read only and without locks, so it may run beside writers; that is why the files of an
unfinished shard beyond its manifest are not judged (a writer may be renaming a part
into place). Each problem is one line that names the file:

- `_embedjob` a symbolic link (its files are another folder's; runs refuse the output);
- the output's record (`_embedjob/job.json`) unreadable, or left `replacing` by an
  interrupted --overwrite;
- a shard's manifest unreadable, or of another job or shard layout than the record;
- a committed part missing, not a plain file, of another size, with another sha256
  than at commit (or written by an embedjob that recorded none), or holding another
  number of rows;
- a finished shard (`_SUCCESS`) whose parts do not cover its rows, whose marker
  disagrees with its manifest, without statistics, or with part or temporary files its
  manifest does not list (a reader globbing part files would read them too);
- files of shards beyond the output's shard count;
- shards whose rows do not follow each other from row 0 to the input's last row.

Shards without `_SUCCESS` are reported as unfinished: no file is damaged, but the
output is not whole either. A finished shard whose rows are errors more often than
`counts.HIGH_ERROR_SHARE` is a warning: its files are intact, its input may not be.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from embedjob.config import JobError
from embedjob.io.checkpoint import (
    JOB_RECORD,
    META,
    READY,
    OutputRecord,
    PartRecord,
    count_codes,
    existing_output,
    load_manifest,
    manifest_name,
    output_files,
    part_problem,
    read_output_record,
    record_changes,
    shard_file_index,
    shards_in,
    stats_name,
    success_name,
)
from embedjob.io.store import Store
from embedjob.report.counts import error_share_warning, plural


@dataclass
class Verification:
    """What `verify_output` found: `problems` (one line each), the unfinished shards,
    and how many parts and rows it checked."""

    output: str
    num_shards: int
    problems: list[str] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)
    parts: int = 0
    rows: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unfinished

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["output"] = str(self.output)
        data["ok"] = self.ok
        return data


def verify_output(output: Store | Path) -> Verification:
    """Check every shard, manifest, part and marker of `output` (reads every part whole,
    through its store).

    Raises JobError only when `output` is not an embedjob output at all.
    """
    output = existing_output(output, "verify")
    problems: list[str] = []
    link = output.link_target(META)
    if link is not None:
        problems.append(f"{META} is a symbolic link to {link}: runs refuse this output (remove the link)")
    job = _job_record(output, problems)
    num_shards = job.num_shards if job is not None else _shard_count(output, problems)
    result = Verification(output.location, num_shards, problems)
    ranges = [_verify_shard(output, shard, job, result) for shard in range(num_shards)]
    _check_tiling(ranges, job, result)
    for path in sorted(output_files(output)):
        index = shard_file_index(path.name)
        if index is not None and index >= num_shards and not path.name.startswith(".lock-"):
            problems.append(f"{path} belongs to shard {index}, but the output has {plural(num_shards, 'shard')}")
    return result


def format_verification(result: Verification) -> str:
    """Each problem on its own line, then one summary line."""
    unfinished = f", {len(result.unfinished)} unfinished ({', '.join(map(str, result.unfinished))})" if result.unfinished else ""
    verdict = "intact" if not result.problems else plural(len(result.problems), "problem")
    warned = f", {plural(len(result.warnings), 'warning')}" if result.warnings else ""
    summary = (
        f"{result.output}: {plural(result.num_shards, 'shard')}{unfinished}; {plural(result.parts, 'part')}, "
        f"{plural(result.rows, 'row')} checked; {verdict}{warned}"
    )
    return "\n".join([*result.problems, *(f"warning: {w}" for w in result.warnings), summary])


def _job_record(output: Store, problems: list[str]) -> OutputRecord | None:
    try:
        job = read_output_record(output)
    except JobError as exc:
        problems.append(str(exc))
        return None
    if job is not None and job.state != READY:
        problems.append(f"{JOB_RECORD}: an --overwrite was interrupted while removing the old job's files; run the job again")
    return job


def _shard_count(output: Store, problems: list[str]) -> int:
    """Without a record (an output from before records): what the manifests say."""
    counts = set()
    for shard in shards_in(output):
        try:
            manifest = load_manifest(output, shard)
        except JobError:
            continue
        if manifest is not None:
            counts.add(manifest.get("num_shards"))
    if not counts:
        raise JobError(f"{output} holds no embedjob shards (no {JOB_RECORD} and no {META}/manifest-*.json)")
    if len(counts) > 1:
        problems.append(f"the manifests in {output} disagree on the number of shards ({sorted(counts, key=str)})")
    problems.append(f"{JOB_RECORD} is missing (an output of an older embedjob): the manifests were checked on their own")
    return max(c for c in counts if isinstance(c, int))


def _verify_shard(output: Store, shard: int, job: OutputRecord | None, result: Verification) -> tuple[int, int] | None:
    """Check one shard; its row range [first, end) when its manifest can be read."""
    done = output.exists(success_name(shard))
    try:
        manifest = load_manifest(output, shard)
    except JobError as exc:
        result.problems.append(str(exc))
        return None
    if manifest is None:
        if done:
            result.problems.append(f"{success_name(shard)} marks shard {shard} done, but it has no {manifest_name(shard)}")
        result.unfinished.append(shard)
        return None
    if job is not None:
        stored = OutputRecord(manifest.get("fingerprint") or {}, manifest.get("num_shards"), manifest.get("rows_per_part"))
        changes = record_changes(stored, job)
        if changes:
            result.problems.append(f"{manifest_name(shard)} belongs to a different job than {JOB_RECORD} ({'; '.join(changes)})")
    parts = [PartRecord(**p) for p in manifest["parts"]]
    first, end = manifest["first_row"], manifest["end_row"]
    covered = _verify_parts(output, parts, first, manifest["rows_per_part"], result)
    if done:
        _verify_finished(output, shard, parts, first, end, covered, result)
        codes = count_codes(p.error_codes for p in parts)
        warning = error_share_warning(shard, sum(p.errors for p in parts), end - first, codes)
        result.warnings += [warning] if warning is not None else []
    else:
        result.unfinished.append(shard)
    return first, end


def _verify_parts(output: Store, parts: list[PartRecord], first: int, per_part: int, result: Verification) -> int:
    """Check each listed part; the row where the contiguous, in-place parts end."""
    covered = first
    for k, record in enumerate(parts):
        # A part holds at most `per_part` rows (fewer where a stopped run committed it short).
        if record.part != k or record.first_row != covered or not 0 < record.end_row - record.first_row <= per_part:
            result.problems.append(f"{record.name} is listed out of place (part {record.part}, rows from {record.first_row})")
        covered = record.end_row
        problem = part_problem(output, record) or _rows_problem(output, record)
        if problem is not None:
            result.problems.append(f"{record.name} {problem}")
            continue
        result.parts += 1
        result.rows += record.end_row - record.first_row
    return covered


def _rows_problem(output: Store, record: PartRecord) -> str | None:
    path, filesystem = output.arrow(record.name)
    try:
        rows = pq.read_metadata(path, filesystem=filesystem).num_rows
    except Exception as exc:  # pyarrow raises several types on a file it cannot parse
        return f"cannot be read as Parquet ({type(exc).__name__})"
    if rows == record.end_row - record.first_row == record.rows:
        return None
    return f"holds {plural(rows, 'row')}, {record.rows} {'was' if record.rows == 1 else 'were'} committed"


def _verify_finished(
    output: Store, shard: int, parts: list[PartRecord], first: int, end: int, covered: int, result: Verification
) -> None:
    marker = success_name(shard)
    if covered != end:
        result.problems.append(f"{marker} marks shard {shard} done, but its parts cover rows [{first}, {covered}) of [{first}, {end})")
    try:
        written = json.loads(output.read(marker))
    except (OSError, ValueError):
        written = None
    if written != {"parts": len(parts), "rows": end - first}:
        counts = f"{plural(len(parts), 'part')}, {plural(end - first, 'row')}"
        result.problems.append(f"{marker} does not match {manifest_name(shard)} ({counts})")
    if not output.exists(stats_name(shard)):
        result.problems.append(f"{stats_name(shard)} is missing for the finished shard {shard}")
    listed = {p.name for p in parts} | {manifest_name(shard), marker, stats_name(shard)}
    for path in sorted(output_files(output)):
        name = str(path)
        if shard_file_index(path.name) == shard and name not in listed and not path.name.startswith(".lock-"):
            result.problems.append(f"{name} is not listed in {manifest_name(shard)} (left over; readers of part files would read it)")


def _check_tiling(ranges: list[tuple[int, int] | None], job: OutputRecord | None, result: Verification) -> None:
    """Shards in shard order must be the input's rows in order, each exactly once."""
    expected = 0
    for shard, bounds in enumerate(ranges):
        if bounds is None:
            return
        first, end = bounds
        if first != expected and end > first:
            result.problems.append(f"{manifest_name(shard)} covers rows [{first}, {end}), but the shards before end at row {expected}")
        expected = max(expected, end)
    total = (job.fingerprint.get("input") or {}).get("rows") if job is not None else None
    if total is not None and expected != total:
        result.problems.append(f"the shards cover {plural(expected, 'row')}, but the input has {total}")
