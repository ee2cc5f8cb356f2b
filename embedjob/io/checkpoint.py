"""The manifest of committed parts of one shard, what a restart may skip, and the job
an output belongs to.

Layout of an output: the Parquet parts `part-SSSSS-NNNNN.parquet` at its top level, and
everything else (the job record, each shard's manifest, statistics, success marker and
lock, SLURM's record and logs) under `_embedjob/`. Arrow, pandas and Spark skip names
that start with `_` or `.`, so the output directory reads as one Parquet dataset, and
a glob `**/*.parquet` (polars, DuckDB) finds only parts. Outputs of an embedjob that
kept its bookkeeping beside the parts are refused (`refuse_old_layout`).

A shard's rows are cut into parts of at most `rows_per_part` rows, each starting where
the one before ends: a full part has `rows_per_part` rows (fewer at the shard's end),
and a run stopped by SIGTERM or SIGINT commits what it encoded as a shorter part, so a
restart knows, from the manifest alone, where to resume. A part is committed when its file has been renamed into place
AND the manifest lists it (the manifest is replaced atomically after the rename), with
the file's size, row count and sha256 as committed. A part file the manifest does not
list, and every temporary file, is debris of a killed run and is removed on open (and
at the end of a run). `_SUCCESS-SSSSS` is written last, after the statistics and after
every committed part has been checked once more against its recorded size and sha256,
so it exists only when every part of the shard is committed and intact; a part damaged
while the run went on fails the run instead, naming it, and the next run recomputes
it. A marker without a manifest that backs it is removed with the rest of the shard's
files; a marker without its statistics does not make a shard finished
(`shard_finished`): its next run writes them.

The output may be a directory or a prefix of an object store (`io/store.py`): the
checkpoint names files relative to it and reads and writes them through its `Store`. In
an object store a part appears under its name only when its upload completes, the
manifest is one put, and the locks below are lease objects (`object_store.LeaseLock`)
rather than flocks; everything else here holds as written.

A restart keeps a committed part only while it is intact: same size, same checksum.
The first part that is not (truncated, bit-flipped, replaced, gone) is recomputed, with
a warning naming it, and so is every part after it (parts are contiguous).

A restart also keeps a part only while its input is the one its rows were computed
from: each record holds a digest of its rows' media bytes (`io/digest.py`), and the
kept parts of an unfinished shard are checked against the input as it is now. An input
changed in place where the job fingerprint cannot see it (same size, same footer) is
refused naming the parts' rows, unless --overwrite: the rerun would write vectors of the
new media beside those of the old. A finished shard is not checked (no run adds to it).

One output, one job: the first run (or submission) that writes into an output records
the job's fingerprint (model, preprocessing, pooling, dtype, input and each input
file's identity) and layout (shard count, part size) in `_embedjob/job.json`; every
later run checks it before writing, and each shard's manifest repeats the fingerprint
(its input files as a digest). Output made by a different job
would mix embeddings from two models or two inputs, or rows of two shard layouts, so
it is refused, naming what changed, unless the user asks to overwrite: then every
shard's files of the old job are removed first, all or nothing (`_replace`).

One process writes a shard at a time: `open_checkpoint` takes an exclusive lock on the
shard's `_embedjob/.lock-SSSSS` file and holds it until `finish` (the kernel drops it
when the process dies, SIGKILL included). Removing temporary files on open relies on
this; a second run of the same shard (a duplicate submission, a requeue racing its old
task) stops with a clear error instead of deleting the first run's files under it. The
output's record is read and written under `_embedjob/.lock-job`, held for moments.
The store's `lock_holder` tells, read only, whether a shard's lock is held (`embedjob status`).
Lock files are opened without following a symlink and must be plain files: a link
planted in a shared output directory cannot make a run truncate the file it points to.
Nor can a link at `_embedjob/` itself: a run refuses it (`files.own_directory`). The
output's record is written under its lock only, so a temporary record found under the
lock is a killed run's, and removed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from embedjob.config import Job, JobError, cache_root
from embedjob.io import reader
from embedjob.io.digest import recomputed_digest
from embedjob.io.files import LocalStore, json_bytes
from embedjob.io.store import Lock, Store, output_store
from embedjob.report.counts import plural

logger = logging.getLogger(__name__)

META = "_embedjob"
"""The bookkeeping folder of an output; dataset readers skip names starting with `_`."""
JOB_RECORD = f"{META}/job.json"
OUTPUT_LOCK = f"{META}/.lock-job"
READY, REPLACING = "ready", "replacing"

_MANIFEST = re.compile(r"^manifest-(\d{5})\.json$")
_SUCCESS = re.compile(r"^_SUCCESS-(\d{5})$")
# Every file of a shard, temporary ones and its lock file included (names, in the top
# level for parts and in META for the rest).
_SHARD_FILE = re.compile(r"^\.?(?:part|manifest|stats|_SUCCESS|lock)-(\d{5})(?:[-.]|$)")
# The bookkeeping an earlier embedjob kept at an output's top level.
_OLD_BOOKKEEPING = re.compile(r"^(?:_embedjob\.json|slurm-job\.json|manifest-\d{5}\.json|stats-\d{5}\.json|_SUCCESS-\d{5})$")
_LAYOUT = ("num_shards", "first_row", "end_row", "rows_per_part")
_PART_KEYS = {"part", "name", "first_row", "end_row", "errors"}
_SEAL_KEYS = {"rows", "size", "sha256", "error_codes"}
_MEDIA_KEYS = {"input_digest", "unread_rows"}
_LISTED_FILE_CHANGES = 3


class OutputError(RuntimeError):
    """The output directory cannot be written (a full disk, permissions, a read-only
    mount, a bucket refusing the credentials): not something the job spec can fix, so
    exit code 1, at start as mid-run."""


Output = Store | Path | str
"""An output as callers name it: a store, or a local path or URL (`store.output_store`)."""


def write_record(out: Store, name: str, data: dict[str, Any]) -> None:
    """Replace a small JSON file of the output whole (manifest, marker, statistics, records)."""
    out.replace(name, json_bytes(data))


def _without_default(section: Any, key: str, default: Any) -> dict[str, Any]:
    """A config section's values, less `key` where it holds `default`."""
    return {k: v for k, v in vars(section).items() if (k, v) != (key, default)}


def _video_identity(job: Job) -> dict[str, Any]:
    """The video keys that determine the embeddings: `nvdec_sessions` is left out (how many
    videos the GPU decodes at once changes no frame)."""
    values = _without_default(job.video, "decoder", "decord")
    del values["nvdec_sessions"]
    return values


def _model_identity(job: Job) -> dict[str, Any]:
    """The model keys that determine the embeddings. `attention` is left out: it picks a
    kernel, as `batching.compile` does, and its backends agree to bf16 rounding
    (benchmarks/RESULTS.md), so output resumes across it (and `auto` resolves per machine).
    The pooling `pool` and its deprecated alias `dinov2_pool` pick is recorded once, under
    the alias's name as output written before `pool` existed recorded it, so that output
    resumes and either spelling of one pooling resumes the other's. The FP8 settings are
    `fp8_keys`' (calibration rows are the input's, which the input part identifies)."""
    values = _without_default(job.model, "precision", "bf16")
    del values["attention"], values["pool"], values["fp8_keep"], values["fp8_calibrate"]
    values.update(fp8_keys(job))
    values["dinov2_pool"] = job.model.image_pool
    return values


def fp8_keys(job: Job) -> dict[str, Any]:
    """An fp8 job's layers kept in bf16 (a set, recorded sorted) and calibration rows,
    which change its vectors: in the fingerprint and in each part's metadata, left out
    where unset, so output made before they existed resumes."""
    described: dict[str, Any] = {}
    if job.model.fp8_keep:
        described["fp8_keep"] = sorted(set(job.model.fp8_keep))
    if job.model.fp8_calibrate:
        described["fp8_calibrate"] = job.model.fp8_calibrate
    return described


def job_fingerprint(job: Job, listing: reader.InputListing | None = None) -> dict[str, Any]:
    """What determines the embeddings; output made with another fingerprint is refused.

    The input part names each input file with its size and content identity
    (`reader.InputFile`), so an input rewritten in place is a different input.
    `listing` is `reader.scan_input(job.input)`; without it the input is scanned here.
    """
    listing = listing if listing is not None else reader.scan_input(job.input, cache_root=cache_root(job.runtime.cache_dir))
    keys = ("path", "media_column", "id_column", "modality", "media_root", "max_item_bytes")
    # Defaults of keys added later are left out: output written before they existed resumes.
    return {
        "model": _model_identity(job),
        "preprocessing": {
            "preprocess": _without_default(job.preprocess, "decoder", "cpu"),
            "video": _video_identity(job),
        },
        "pooling": job.output.pooling,
        "output_dtype": job.output.dtype,
        # What a part holds besides the model's vectors: parts of one output must agree.
        "normalize": job.output.normalize,
        "columns": list(job.output.columns),
        **caption_keys(job),
        "input": {
            **{k: getattr(job.input, k) for k in keys},
            **({"format": job.input.format} if job.input.format != "parquet" else {}),
            "rows": sum(f.num_rows for f in listing.fragments),
            "files": [dataclasses.asdict(f) for f in listing.files],
        },
    }


def caption_keys(job: Job) -> dict[str, Any]:
    """The caption column and label prompts, which add columns to every part: in the
    fingerprint and in each part's metadata (`embedjob`), left out where unset, so
    output made before they existed resumes."""
    described: dict[str, Any] = {}
    if job.input.text_column is not None:
        described["text_column"] = job.input.text_column
    if job.output.labels:
        described["labels"] = list(job.output.labels)
    return described


def manifest_name(shard: int) -> str:
    return f"{META}/manifest-{shard:05d}.json"


def success_name(shard: int) -> str:
    return f"{META}/_SUCCESS-{shard:05d}"


def lock_name(shard: int) -> str:
    return f"{META}/.lock-{shard:05d}"


def stats_name(shard: int) -> str:
    return f"{META}/stats-{shard:05d}.json"


def output_files(output: Output) -> Iterator[PurePosixPath]:
    """The files of an output, by name relative to it: its top level (parts) and its
    bookkeeping folder."""
    out = output_store(output)
    for folder in ("", META):
        yield from (PurePosixPath(folder, name) for name in out.files(folder))


def old_layout(output: Output) -> list[str]:
    """The bookkeeping files an earlier embedjob left at the top level of the output."""
    return sorted(name for name in output_store(output).files() if _OLD_BOOKKEEPING.match(name))


def old_layout_message(output: Store | Path, names: list[str], remedy: str) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"output {output} was written by an earlier embedjob, which kept its bookkeeping ({shown}) beside "
        f"the parts; this embedjob keeps it under {META}/ and cannot resume that output: {remedy}"
    )


def existing_output(output: Output, verb: str) -> Store:
    """The store of an output that `verb`s (`status`, `verify`, `export`) can read: a
    JobError where it is missing or no directory (`Store.problem`), or of the earlier
    layout (naming what to do instead)."""
    store = output_store(output)
    problem = store.problem()
    if problem is not None:
        raise JobError(f"output {store} {problem}")
    names = old_layout(store)
    if names:
        raise JobError(old_layout_message(store, names, f"{verb} it with that embedjob, or rerun the job into a new output.path"))
    return store


def refuse_old_layout(output: Output, overwrite: bool) -> None:
    """JobError for an output in the earlier layout, unless `overwrite` replaces it."""
    names = old_layout(output)
    if names and not overwrite:
        raise JobError(old_layout_message(output_store(output), names, "use a new output.path, or pass --overwrite to replace it"))


@dataclass
class PartRecord:
    """A committed part: its file, the global row range [first_row, end_row) it holds,
    and, sealed at commit, its row count, size in bytes and sha256; and what its rows
    were computed from: `input_digest`, the digest of their media (`digest.part_digest`),
    with `unread_rows` the rows no worker finished reading (`digest.UNREAD`). A part
    committed by an embedjob before media digests has `input_digest` None."""

    part: int
    name: str
    first_row: int
    end_row: int
    errors: int
    rows: int | None = None
    size: int | None = None
    sha256: str | None = None
    error_codes: dict[str, int] = field(default_factory=dict)
    input_digest: str | None = None
    unread_rows: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def part_problem(output: Output, record: PartRecord) -> str | None:
    """Why the committed part `record` cannot be trusted, or None when its file is the
    one committed: present, a plain file, of the recorded size and checksum (read back
    whole through the store)."""
    out = output_store(output)
    try:
        size = out.size(record.name)
    except FileNotFoundError:
        return "is missing"
    if size is None:
        return "is not a plain file"
    if record.sha256 is None:
        return "has no recorded checksum (written by an older embedjob)"
    if size != record.size:
        return f"has {size} bytes where {record.size} were committed"
    try:
        sha256 = out.digest(record.name)[1]
    except FileNotFoundError:
        return "is missing"
    if sha256 != record.sha256:
        return "does not match its recorded sha256 (its content changed)"
    return None


def shard_lock(output: Output, shard: int) -> Lock:
    out = output_store(output)
    return out.lock(lock_name(shard), f"shard {shard} of {out}")


# ---------------------------------------------------------------- the output's job


@dataclass
class OutputRecord:
    """The job an output belongs to (`_embedjob/job.json`).

    `state` is REPLACING from the moment an overwrite starts removing the old job's
    files until all are gone: a run of the new job that finds it so finishes the
    removal before writing anything.
    """

    fingerprint: dict[str, Any]
    num_shards: int
    rows_per_part: int
    state: str = READY

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_output_record(output: Output) -> OutputRecord | None:
    """The output's record, None if it has none; JobError if it cannot be read."""
    out = output_store(output)
    try:
        data = json.loads(out.read(JOB_RECORD))
        return OutputRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise JobError(
            f"cannot read {out.where(JOB_RECORD)} ({exc}); use a new output.path, or pass --overwrite to replace the output"
        ) from None


def output_changes(output: Output, record: OutputRecord) -> list[str]:
    """What differs between the job that owns the output and `record` (read only).

    Without a record (an output of an embedjob from before records, or a fresh one),
    the shards' manifests speak for the job that made them.
    """
    out = output_store(output)
    existing = read_output_record(out)
    if existing is not None:
        return record_changes(existing, record)
    changes: list[str] = []
    for shard in sorted(shards_in(out)):
        try:
            manifest = load_manifest(out, shard)
        except JobError:
            changes.append(f"{manifest_name(shard)} cannot be read")
            continue
        if manifest is not None:
            old = OutputRecord(manifest.get("fingerprint") or {}, manifest.get("num_shards"), manifest.get("rows_per_part"))
            changes += [c for c in record_changes(old, record) if c not in changes]
    return changes


def record_changes(old: OutputRecord, new: OutputRecord) -> list[str]:
    """`key: old -> new` for each setting that differs, input files named one by one."""
    before, after = _plain(old.fingerprint), _plain(new.fingerprint)
    old_files, new_files = _input_files(before), _input_files(after)
    if isinstance(old_files, list) and isinstance(new_files, list):
        changes = _leaf_changes(_without_files(before), _without_files(after)) + _file_changes(old_files, new_files)
    else:
        changes = _leaf_changes(_compact(before), _compact(after))
    for key in ("num_shards", "rows_per_part"):
        if getattr(old, key) != getattr(new, key):
            changes.append(f"{key}: {getattr(old, key)!r} -> {getattr(new, key)!r}")
    return changes


def refuse_other_job(output: Output, record: OutputRecord, overwrite: bool) -> list[str]:
    """The changes between the output's job and `record`, or JobError when they may not
    be overwritten: a different job, output it committed, and no `overwrite`. An
    output whose old job committed nothing has nothing to protect."""
    out = output_store(output)
    refuse_old_layout(out, overwrite)
    changes = output_changes(out, record)
    if changes and not overwrite and _holds_committed(out):
        raise JobError(
            f"output {out} holds output of a different job ({'; '.join(changes)}); "
            "use a new output.path, or pass --overwrite to replace it"
        )
    return changes


def claim_output(output: Output, record: OutputRecord, overwrite: bool, shard: int | None = None) -> Lock | None:
    """Make the output that of the job `record` describes, or refuse (JobError); with
    `shard`, also take that shard's lock and return it.

    The first run or submission writes the record; the same job finds it unchanged; a
    different job is refused naming each change, unless `overwrite` or the old job
    committed nothing: then every shard's files of the old job are removed first. All
    of this happens under the output's lock, so concurrent starts of one job's shards
    agree on one record, and a shard is never removed under its running writer.
    """
    out = output_store(output)
    refuse_old_layout(out, overwrite)
    out.prepare(META)
    with _output_lock(out):
        # The record is written only under the output's lock: nothing of it is in flight.
        out.remove_debris((META,), lambda name: name == JOB_RECORD)
        if old_layout(out):
            _retire_old_layout(out)
        changes = refuse_other_job(out, record, overwrite)
        existing = read_output_record(out)
        own = shard_lock(out, shard) if shard is not None else None
        try:
            if changes or (existing is not None and existing.state == REPLACING):
                _replace(out, record, shard)
            elif existing is None:
                write_record(out, JOB_RECORD, record.to_dict())
        except BaseException:
            if own is not None:
                own.release()
            raise
        return own


@contextlib.contextmanager
def _output_lock(out: Store) -> Iterator[None]:
    lock = out.lock(OUTPUT_LOCK, f"output {out}", blocking=True)
    try:
        yield
    finally:
        lock.release()


def _replace(out: Store, record: OutputRecord, own_shard: int | None) -> None:
    """Remove every shard's files of the old job, then record the new one.

    Kill-safe, all or nothing: the record says REPLACING before the first file goes, so
    a run killed part-way leaves an output no job resumes as the old one, and the next
    run of the new job finishes the removal first. Every other shard's lock is taken
    first: one still held means a writer still runs (JobError naming it).
    """
    locks = [shard_lock(out, s) for s in sorted(_shard_indices(out) - {own_shard})]
    try:
        logger.warning("output %s: removing every shard's files of the job it held before", out)
        write_record(out, JOB_RECORD, dataclasses.replace(record, state=REPLACING).to_dict())
        for path in output_files(out):
            if shard_file_index(path.name) is not None and not path.name.startswith(".lock-"):
                out.remove(str(path))
        write_record(out, JOB_RECORD, dataclasses.replace(record, state=READY).to_dict())
    finally:
        for lock in locks:
            lock.release()


def _shard_indices(out: Store) -> set[int]:
    return {index for path in output_files(out) if (index := shard_file_index(path.name)) is not None}


def _retire_old_layout(out: Store) -> None:
    """Remove an earlier embedjob's output (asked for with --overwrite): its parts and
    top-level bookkeeping go, its logs move under META. Its shards' locks are taken
    first, so an earlier embedjob still writing one stops this (JobError naming it)."""
    old = out.files()
    locks = [out.lock(name, f"shard {index} of {out}") for name in old
             if name.startswith(".lock-") and (index := shard_file_index(name)) is not None]
    try:
        logger.warning("output %s: removing the output an earlier embedjob wrote there", out)
        for name in old:
            shard_file = shard_file_index(name) is not None and not name.startswith(".lock-")
            if shard_file or _OLD_BOOKKEEPING.match(name):
                out.remove(name)
        out.remove(".lock-job")
        # Only a directory holds an earlier embedjob's SLURM logs (no embedjob before
        # this one wrote to an object store).
        if isinstance(out, LocalStore):
            logs = out.path / "logs"
            if logs.is_dir() and not (out.path / META / "logs").exists():
                logs.rename(out.path / META / "logs")
    finally:
        for lock in locks:
            lock.release()


def shard_file_index(name: str) -> int | None:
    """The shard a file of an output belongs to (parts, manifests, statistics, markers,
    lock and temporary files), None for any other file."""
    match = _SHARD_FILE.match(name)
    return int(match.group(1)) if match else None


def _holds_committed(out: Store) -> bool:
    """Whether any shard committed output (a manifest listing parts, or a success
    marker); a manifest that cannot be read is taken to."""
    for shard in shards_in(out):
        if out.exists(success_name(shard)):
            return True
        try:
            manifest = load_manifest(out, shard)
        except JobError:
            return True
        if manifest is not None and manifest["parts"]:
            return True
    return False


def _input_files(fingerprint: dict[str, Any]) -> Any:
    return (fingerprint.get("input") or {}).get("files")


def _without_files(fingerprint: dict[str, Any]) -> dict[str, Any]:
    if "input" not in fingerprint:
        return fingerprint
    return {**fingerprint, "input": {k: v for k, v in fingerprint["input"].items() if k != "files"}}


def _compact(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as a shard manifest holds it: the input file list (long for a
    large dataset, and rewritten with every commit) as its count and digest."""
    files = _input_files(fingerprint)
    if not isinstance(files, list):
        return fingerprint
    text = json.dumps(files, sort_keys=True).encode()
    digest = {"count": len(files), "sha256": hashlib.sha256(text).hexdigest()}
    return {**fingerprint, "input": {**fingerprint["input"], "files": digest}}


def _file_changes(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """One line per input file added, gone or changed (the first few, then a count)."""
    before, after = {f["path"]: f for f in old}, {f["path"]: f for f in new}
    lines = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        if a is None:
            lines.append(f"input file {path} was added")
        elif b is None:
            lines.append(f"input file {path} is gone")
        else:
            what = f"size {a['size']} -> {b['size']}" if a["size"] != b["size"] else "same size, other content"
            lines.append(f"input file {path} changed ({what})")
    if len(lines) > _LISTED_FILE_CHANGES:
        lines[_LISTED_FILE_CHANGES:] = [f"and {len(lines) - _LISTED_FILE_CHANGES} more input files"]
    return lines


def _leaf_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Fingerprint keys named down to the leaf (`model.path`, `pooling`), so the user
    sees which setting changed rather than a whole section."""
    a, b = flatten(_plain(old)), flatten(_plain(new))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as one level of dotted keys (`batching.window`), as the job spec names them."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it reads back from JSON (tuples become lists), so that an
    unchanged job compares equal to its stored manifest."""
    return json.loads(json.dumps(fingerprint, sort_keys=True))


# ---------------------------------------------------------------- one shard


@dataclass
class Checkpoint:
    """Committed state of one shard in the output `store`.

    Invariant: `parts` are contiguous from the shard's first row, in part order, each
    within the `next_bounds` of the parts before it, and every listed file is the one
    committed (size and checksum checked on open). `fingerprint` is in its manifest
    form (`_compact`).
    """

    store: Store
    shard: int
    num_shards: int
    first_row: int
    end_row: int
    rows_per_part: int
    fingerprint: dict[str, Any]
    parts: list[PartRecord] = field(default_factory=list)
    lock: Lock | None = field(default=None, repr=False, compare=False)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    _attempt: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    _attempt_started: float = field(default=0.0, repr=False, compare=False)

    @property
    def resume_row(self) -> int:
        """The first global row not yet committed."""
        return self.parts[-1].end_row if self.parts else self.first_row

    @property
    def next_part(self) -> int:
        return len(self.parts)

    def next_bounds(self) -> tuple[int, int]:
        """Global row range of the next part when it is full; a part committed when the
        run stops may end before it."""
        start = self.resume_row
        return start, min(start + self.rows_per_part, self.end_row)

    def is_done(self) -> bool:
        return shard_finished(self.store, self.shard)

    def finished_stats(self) -> dict[str, Any]:
        """The statistics a finished shard wrote, marked as skipped by this run."""
        try:
            stats = json.loads(self.store.read(stats_name(self.shard)))
        except FileNotFoundError:
            stats = {"rows": self.end_row - self.first_row}
        stats["skipped"] = True
        return stats

    def commit(self, record: PartRecord) -> None:
        """Record a part whose file is already in place (renamed, or its upload
        completed), sealing it with its row count, size and checksum: those of the
        record when its writer kept them as it wrote the file (`PartFile`), else read
        from the file as it is now. OutputError when this run lost the shard's lock (a
        lease taken over while the run stalled): the manifest is no longer its own."""
        self._check_lock()
        if not _fits(record, self.next_part, self.next_bounds()):
            raise ValueError(
                f"part {record.part} rows [{record.first_row}, {record.end_row}) out of order; expected {self.next_bounds()}"
            )
        if record.size is None or record.sha256 is None:
            size, sha256 = self.store.digest(record.name)
        else:
            size, sha256 = record.size, record.sha256
        self.parts.append(dataclasses.replace(record, rows=record.end_row - record.first_row, size=size, sha256=sha256))
        self._count_attempt(record.end_row - record.first_row)
        self._save()

    def start_attempt(self) -> None:
        """Record that a run starts on this shard: every run that commits anything
        (killed ones too) stays in the manifest with its rows and seconds, so a resumed
        shard's statistics cover the whole shard."""
        self._attempt_started = time.monotonic()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._attempt = {"started": started, "resumed_from_row": self.resume_row, "rows": 0, "seconds": 0.0}
        self.attempts.append(self._attempt)

    def _count_attempt(self, rows: int) -> None:
        """This run's attempt: `rows` more committed, seconds so far."""
        if self._attempt is not None:
            self._attempt["rows"] += rows
            self._attempt["seconds"] = round(time.monotonic() - self._attempt_started, 3)

    def finish(self, stats: dict[str, Any]) -> None:
        """Check every committed part, write the shard's statistics, then the success
        marker (last), then unlock.

        Raises RuntimeError if the committed parts do not cover the shard: a success
        marker over missing rows would make every later run skip them. Raises
        OutputError (unlocked, no marker) naming the parts that are no longer the files
        committed (truncated, changed, removed while the run went on): a marker over
        them would bless them, and the next run recomputes them instead. The check
        reads every part once more, seconds for a shard of gigabytes against the hours
        that wrote them.
        """
        if self.resume_row != self.end_row:
            raise RuntimeError(f"shard {self.shard}: rows [{self.resume_row}, {self.end_row}) are not committed")
        self._check_lock()
        self._count_attempt(0)
        self._save()
        damaged = [f"{p.name} {problem}" for p in self.parts if (problem := part_problem(self.store, p)) is not None]
        if damaged:
            if self.lock is not None:
                self.lock.release()
            shown = "; ".join(damaged[:_LISTED_FILE_CHANGES]) + (
                f"; and {len(damaged) - _LISTED_FILE_CHANGES} more" if len(damaged) > _LISTED_FILE_CHANGES else ""
            )
            raise OutputError(
                f"shard {self.shard}: {len(damaged)} of its committed parts changed while the run went on ({shown}); "
                "the shard is not marked done: run it again to recompute them"
            )
        # Nothing of ours is in flight now; anything else under a temporary name of this
        # shard (a killed run's, a link someone planted) would read as a leftover part.
        _remove_temporaries(self.store, self.shard)
        stats = {**stats, "attempts": self.attempts, "seconds_all_attempts": round(sum(a["seconds"] for a in self.attempts), 3)}
        write_record(self.store, stats_name(self.shard), stats)
        self._check_lock()
        write_record(self.store, success_name(self.shard), {"parts": len(self.parts), "rows": self.end_row - self.first_row})
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
            "attempts": self.attempts,
        }

    def _save(self) -> None:
        write_record(self.store, manifest_name(self.shard), self.manifest())

    def _check_lock(self) -> None:
        lost = self.lock.lost() if self.lock is not None else None
        if lost is not None:
            raise OutputError(f"shard {self.shard} of {self.store}: {lost}; this run stops without committing more")


def shard_finished(output: Output, shard: int) -> bool:
    """Whether the shard is finished: its success marker and its statistics are there.

    A run writes the statistics before the marker, so a marker without them means the
    statistics were lost afterwards: the shard is not finished, and its next run
    writes them again instead of skipping it (every engine and `status` ask here).
    """
    out = output_store(output)
    return out.exists(success_name(shard)) and out.exists(stats_name(shard))


def open_checkpoint(
    output: Output,
    shard: int,
    num_shards: int,
    first_row: int,
    end_row: int,
    rows_per_part: int,
    fingerprint: dict[str, Any],
    overwrite: bool,
    media: MediaDigests | None = None,
) -> Checkpoint:
    """Check the output's job (`claim_output`) and lock the shard, refuse a changed job
    (touching nothing), clean the debris of killed runs, and load (or start) the
    shard's checkpoint, keeping only the committed parts that are intact.

    With `media`, an unfinished shard's kept parts are checked against the input's
    media as it is now (`_refuse_changed_media`); without it (a caller that has no
    input, as a benchmark of the writer) they are kept on the fingerprint alone.

    With `overwrite`, everything this shard wrote before is removed first (and every
    shard's files, when the output held another job). The returned checkpoint holds
    the shard's lock until `finish` (or until it is dropped), except for a finished
    shard, which this run only reads. Raises OutputError when the directory cannot be
    written (exit code 1, as for a disk that fills up mid-run).
    """
    plain = _plain(fingerprint)
    out = output_store(output)
    try:
        lock = claim_output(out, OutputRecord(plain, num_shards, rows_per_part), overwrite, shard)
        fresh = Checkpoint(out, shard, num_shards, first_row, end_row, rows_per_part, _compact(plain), lock=lock)
        try:
            return _load(fresh, overwrite, media)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    except OSError as exc:
        raise OutputError(f"cannot write to output.path {out}: {exc.strerror or exc}") from None


def _load(fresh: Checkpoint, overwrite: bool, media: MediaDigests | None) -> Checkpoint:
    """The checkpoint `fresh` describes, filled from the shard's manifest when resuming."""
    out, shard, end_row = fresh.store, fresh.shard, fresh.end_row
    manifest = None if overwrite else load_manifest(out, shard)
    if manifest is not None and not manifest.get("parts") and not out.exists(success_name(shard)):
        # A run that committed nothing (e.g. stopped by a spec error after the manifest was
        # written) has no output to protect: the corrected job starts afresh.
        manifest = None
    changes = manifest_changes(manifest, fresh) if manifest is not None else []
    if changes:
        raise JobError(
            f"output {out} holds shard {shard} of a different job ({'; '.join(changes)}); "
            "use a new output.path, or pass --overwrite to replace it"
        )
    if manifest is None:
        # No manifest: nothing of this shard is committed, whatever else lies there.
        _remove_temporaries(out, shard)
        _remove_shard_files(out, shard)
        fresh.start_attempt()
        fresh._save()
        return fresh
    listed = [PartRecord(**p) for p in manifest["parts"]]
    fresh.parts = _valid_prefix(fresh, listed)
    if media is not None and not fresh.is_done():
        _refuse_changed_media(fresh, media)
    _remove_temporaries(out, shard)
    fresh.attempts = [a for a in manifest.get("attempts", []) if isinstance(a, dict)]
    if fresh.resume_row != end_row:
        out.remove(success_name(shard))
        fresh.start_attempt()
        fresh._save()
    elif len(fresh.parts) != len(listed):
        fresh._save()
    _remove_unlisted_parts(out, shard, {p.name for p in fresh.parts})
    if fresh.resume_row == end_row and not fresh.is_done() and out.exists(success_name(shard)):
        logger.warning("shard %d: %s is missing; writing it again from the manifest", shard, stats_name(shard))
    if fresh.is_done():
        # From here on a finished shard is only read; releasing now lets a duplicate
        # run of it skip it too instead of failing on the lock.
        fresh.lock.release()
        fresh.lock = None
    return fresh


def load_manifest(output: Output, shard: int) -> dict[str, Any] | None:
    """The shard's manifest, None if there is none; JobError if it cannot be read."""
    out = output_store(output)
    path = out.where(manifest_name(shard))
    try:
        manifest = json.loads(out.read(manifest_name(shard)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read {path} ({exc}); pass --overwrite to recompute shard {shard}") from None
    parts = manifest.get("parts") if isinstance(manifest, dict) else None
    known = _PART_KEYS | _SEAL_KEYS | _MEDIA_KEYS
    if not isinstance(parts, list) or not all(isinstance(p, dict) and _PART_KEYS <= set(p) <= known for p in parts):
        raise JobError(f"{path} is not an embedjob manifest; pass --overwrite to recompute shard {shard}")
    return manifest


def manifest_changes(manifest: dict[str, Any], current: Checkpoint) -> list[str]:
    """What differs between a stored manifest and the current job, as `key: old -> new`."""
    changes = _leaf_changes(_compact(manifest.get("fingerprint") or {}), current.fingerprint)
    changes += [f"{k}: {manifest.get(k)!r} -> {getattr(current, k)!r}" for k in _LAYOUT if manifest.get(k) != getattr(current, k)]
    return changes


MediaDigests = Callable[[int, int], np.ndarray]
"""The media digests of global rows [first, end) as the input holds them now, one row
of `digest.DIGEST_SIZE` bytes each (`rows.input_digests`)."""


def _refuse_changed_media(cp: Checkpoint, media: MediaDigests) -> None:
    """JobError naming the kept parts (and their rows) whose input media differ from
    the media they were computed from; the run would keep their vectors beside vectors
    of the new media. Only an unfinished shard is checked: a finished one is skipped,
    so no run mixes anything into it, and the check reads its committed rows' media
    again (a pass over the shard's input at read speed, no decode).

    Parts committed before media digests existed (`input_digest` None, always a
    prefix) are kept on the job fingerprint alone, which names each input file by size
    and footer: an output written by an older embedjob still resumes, and says so once.
    """
    digested = [p for p in cp.parts if p.input_digest is not None]
    if len(digested) < len(cp.parts):
        logger.info(
            "shard %d: %s recorded without media digests (an older embedjob) are checked by the input files' size and footer only",
            cp.shard, plural(len(cp.parts) - len(digested), "committed part"),
        )
    if not digested:
        return
    since = time.perf_counter()
    first = digested[0].first_row
    try:
        now = media(first, digested[-1].end_row)
    except OSError as exc:
        # Not the output's fault, which `open_checkpoint` would report it as: exit 1 all the same.
        raise RuntimeError(f"cannot read the input to check shard {cp.shard}'s committed rows against it: {exc}") from None
    changed = [
        p for p in digested
        if recomputed_digest(now[p.first_row - first : p.end_row - first], p.first_row, p.unread_rows) != p.input_digest
    ]
    if changed:
        named = [f"rows {p.first_row}-{p.end_row - 1} ({p.name})" for p in changed[:_LISTED_FILE_CHANGES]]
        if len(changed) > _LISTED_FILE_CHANGES:
            named.append(plural(len(changed) - _LISTED_FILE_CHANGES, "more part"))
        raise JobError(
            f"the input changed under shard {cp.shard} of {cp.store}: the media of committed {', '.join(named)} "
            "differ from the media they were computed from; use a new output.path, or pass --overwrite to recompute the shard"
        )
    logger.info("shard %d: the media of %d committed rows match the input (%.1f s)", cp.shard, len(now), time.perf_counter() - since)


def _valid_prefix(cp: Checkpoint, listed: list[PartRecord]) -> list[PartRecord]:
    """The listed parts up to the first one that is out of place or not intact, which
    is named in a warning: it and every part after it are recomputed."""
    kept: list[PartRecord] = []
    for record in listed:
        start = kept[-1].end_row if kept else cp.first_row
        in_place = _fits(record, len(kept), (start, min(start + cp.rows_per_part, cp.end_row)))
        problem = part_problem(cp.store, record) if in_place else "is out of place"
        if problem is not None:
            after = len(listed) - len(kept) - 1
            logger.warning(
                "shard %d: committed part %s %s; recomputing rows from %d%s",
                cp.shard, record.name, problem, record.first_row, f" ({after} later parts with it)" if after else "",
            )
            break
        kept.append(record)
    return kept


def _fits(record: PartRecord, part: int, bounds: tuple[int, int]) -> bool:
    """Whether `record` can be part `part` of rows `bounds`: it starts there, holds a
    row, and ends by the end of a full part (earlier when a stopped run cut it short)."""
    first, end = bounds
    return record.part == part and record.first_row == first and first < record.end_row <= end


def _shard_pattern(shard: int) -> re.Pattern[str]:
    return re.compile(rf"^part-{shard:05d}-\d{{5}}\.parquet$")


def _remove_temporaries(out: Store, shard: int) -> None:
    """What killed writers of this shard left in flight: temporary files in a
    directory, incomplete uploads in an object store (none is in use: we hold its lock)."""
    out.remove_debris(("", META), lambda name: shard_file_index(PurePosixPath(name).name) == shard)


def _remove_unlisted_parts(out: Store, shard: int, listed: set[str]) -> None:
    """Part files of this shard that its manifest does not list: a run killed between
    putting a part in place and listing it (readers of the manifest ignore them)."""
    pattern = _shard_pattern(shard)
    for name in out.files():
        if pattern.match(name) and name not in listed:
            logger.info("removing uncommitted part %s", name)
            out.remove(name)


def _remove_shard_files(out: Store, shard: int) -> None:
    _remove_unlisted_parts(out, shard, set())
    for name in (manifest_name(shard), stats_name(shard), success_name(shard)):
        out.remove(name)


# ---------------------------------------------------------------- reading an output


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
    error_codes: dict[str, int] = field(default_factory=dict)


def shard_progress(output: Output, shard: int) -> ShardProgress:
    out = output_store(output)
    manifest = load_manifest(out, shard)
    done = shard_finished(out, shard)
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
        error_codes=count_codes(p.get("error_codes") or {} for p in parts),
    )


def count_codes(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Error codes summed over parts (or shards), most frequent first."""
    total: collections.Counter[str] = collections.Counter()
    for part in counts:
        total.update(part)
    return dict(total.most_common())


def shards_in(output: Output) -> set[int]:
    """Shard indices that have a manifest or a success marker in the output."""
    found = set()
    for name in output_store(output).files(META):
        match = _MANIFEST.match(name) or _SUCCESS.match(name)
        if match:
            found.add(int(match.group(1)))
    return found
