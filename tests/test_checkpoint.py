"""The checkpoint on its own (no model): what a restart keeps, what it removes as debris
of a killed run, what it refuses, and the lock that keeps two runs off one shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from embedjob.config import JobError
from embedjob.io import sink
from embedjob.io.checkpoint import (
    JOB_RECORD,
    Checkpoint,
    PartRecord,
    lock_name,
    manifest_name,
    open_checkpoint,
    part_problem,
    shard_progress,
    shards_in,
    stats_name,
    success_name,
)
from embedjob.io.digest import digest_array, media_digest
from embedjob.io.files import TMP_MARK, file_digest
from embedjob.io.writer import RowBlock, output_schema, part_name

FINGERPRINT = {"model": {"family": "qwen2_5_vl", "path": "builtin:tiny-qwen2_5_vl"}, "pooling": "mean"}


def start(directory: Path, shard: int = 0, first: int = 100, end: int = 110, per_part: int = 4,
          fingerprint: dict | None = None, overwrite: bool = False, num_shards: int = 2) -> Checkpoint:
    return open_checkpoint(directory, shard, num_shards, first, end, per_part, fingerprint or FINGERPRINT, overwrite)


def commit(cp: Checkpoint, count: int) -> None:
    """Commit the next `count` parts as the runner does: file renamed into place, then recorded."""
    for _ in range(count):
        part = cp.next_part
        first, end = cp.next_bounds()
        name = part_name(cp.shard, part)
        (cp.store.path / name).write_bytes(b"parquet")
        cp.commit(PartRecord(part, name, first, end, errors=part % 2))


def complete(cp: Checkpoint) -> None:
    while cp.resume_row < cp.end_row:
        commit(cp, 1)
    cp.finish({"rows": cp.end_row - cp.first_row})


def names(directory: Path) -> set[str]:
    """Every file of an output, by its path inside it (`_embedjob/manifest-00000.json`)."""
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def temporary(name: str, pid: int) -> str:
    """The temporary name a writer gives `name` (beside it, hidden) while it writes it."""
    folder, _, base = name.rpartition("/")
    return f"{folder}/" * bool(folder) + f".{base}{TMP_MARK}{pid}"


def test_parts_are_aligned_to_the_shard_and_a_restart_resumes_after_the_last_committed(tmp_path: Path) -> None:
    cp = start(tmp_path)
    assert (cp.resume_row, cp.next_bounds()) == (100, (100, 104))
    commit(cp, 2)
    del cp
    again = start(tmp_path)
    assert (again.resume_row, again.next_part, len(again.parts)) == (108, 2, 2)
    manifest = json.loads((tmp_path / manifest_name(0)).read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [(100, 104), (104, 108)]


def test_a_part_out_of_order_is_refused(tmp_path: Path) -> None:
    cp = start(tmp_path)
    with pytest.raises(ValueError, match="out of order"):
        cp.commit(PartRecord(1, part_name(0, 1), 104, 108, 0))


def test_restart_removes_temporaries_and_unlisted_parts_of_its_shard_only(tmp_path: Path) -> None:
    cp = start(tmp_path)
    commit(cp, 1)
    cp.lock.release()
    debris = {
        temporary(part_name(0, 1), 123),  # killed while writing part 1
        part_name(0, 1),  # killed between the rename and the manifest update
        temporary(manifest_name(0), 123),
        temporary(stats_name(0), 77),
    }
    others = {temporary(part_name(1, 0), 9), part_name(1, 0), "notes.txt"}  # shard 1 is another process's
    for name in debris | others:
        (tmp_path / name).write_bytes(b"x")
    again = start(tmp_path)
    assert again.resume_row == 104
    assert names(tmp_path) == {JOB_RECORD, manifest_name(0), part_name(0, 0), lock_name(0)} | others


def test_a_lost_part_is_recomputed_from_there_and_the_success_marker_withdrawn(tmp_path: Path) -> None:
    complete(start(tmp_path))
    (tmp_path / part_name(0, 1)).unlink()
    again = start(tmp_path)
    assert (again.resume_row, again.is_done()) == (104, False)
    assert not (tmp_path / part_name(0, 2)).exists(), "parts after the gap would duplicate recomputed rows"
    assert len(json.loads((tmp_path / manifest_name(0)).read_text())["parts"]) == 1


def test_files_without_a_manifest_are_not_trusted(tmp_path: Path) -> None:
    complete(start(tmp_path))
    (tmp_path / manifest_name(0)).unlink()
    again = start(tmp_path)
    assert not again.is_done(), "a success marker the manifest no longer backs would skip the whole shard"
    assert again.resume_row == 100
    assert names(tmp_path) == {JOB_RECORD, manifest_name(0), lock_name(0)}


@pytest.mark.parametrize("text", ['{"parts": [', '{"parts": [{"part": 0}]}', "[]"])
def test_a_corrupt_manifest_is_a_job_error_that_offers_overwrite(tmp_path: Path, text: str) -> None:
    commit(start(tmp_path), 1)
    (tmp_path / manifest_name(0)).write_text(text)
    with pytest.raises(JobError, match="--overwrite"):
        start(tmp_path)
    assert start(tmp_path, overwrite=True).resume_row == 100


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fingerprint": {**FINGERPRINT, "model": {**FINGERPRINT["model"], "path": "/models/other"}}},
         "model.path: 'builtin:tiny-qwen2_5_vl' -> '/models/other'"),
        ({"fingerprint": {**FINGERPRINT, "pooling": "none"}}, "pooling: 'mean' -> 'none'"),
        ({"num_shards": 4}, "num_shards: 2 -> 4"),
        ({"per_part": 5}, "rows_per_part: 4 -> 5"),
        ({"end": 120}, "end_row: 110 -> 120"),
    ],
)
def test_a_changed_job_is_refused_naming_the_change_and_nothing_is_touched(tmp_path: Path, change, named) -> None:
    commit(start(tmp_path), 2)
    before = {name: (tmp_path / name).stat().st_mtime_ns for name in names(tmp_path) if name != lock_name(0)}
    with pytest.raises(JobError) as err:
        start(tmp_path, **change)
    assert named in str(err.value) and "--overwrite" in str(err.value)
    assert {name: (tmp_path / name).stat().st_mtime_ns for name in names(tmp_path) if name != lock_name(0)} == before
    replaced = start(tmp_path, overwrite=True, **change)
    assert replaced.resume_row == replaced.first_row and not (tmp_path / part_name(0, 0)).exists()


def test_a_finished_shard_of_another_job_is_refused_not_skipped(tmp_path: Path) -> None:
    complete(start(tmp_path))
    with pytest.raises(JobError, match="pooling"):
        start(tmp_path, fingerprint={**FINGERPRINT, "pooling": "none"})


def test_finish_writes_stats_then_success_and_leaves_no_lock(tmp_path: Path) -> None:
    cp = start(tmp_path)
    with pytest.raises(RuntimeError, match=r"\[100, 110\) are not committed"):
        cp.finish({})
    complete(cp)
    assert names(tmp_path) == {
        JOB_RECORD, manifest_name(0), stats_name(0), success_name(0), *(part_name(0, k) for k in range(3))
    }
    again = start(tmp_path)
    finished = again.finished_stats()
    assert again.is_done() and (finished["rows"], finished["skipped"]) == (10, True)
    assert [(a["resumed_from_row"], a["rows"]) for a in finished["attempts"]] == [(100, 10)]
    assert not (tmp_path / lock_name(0)).exists(), "reading a finished shard must not hold its lock"


def test_an_empty_shard_commits_no_part_and_finishes(tmp_path: Path) -> None:
    cp = start(tmp_path, shard=3, first=0, end=0, num_shards=4)
    cp.finish({"rows": 0})
    manifest = json.loads((tmp_path / manifest_name(3)).read_text())
    assert (manifest["parts"], manifest["first_row"], manifest["end_row"]) == ([], 0, 0)
    assert start(tmp_path, shard=3, first=0, end=0, num_shards=4).is_done()
    progress = shard_progress(tmp_path, 3)
    assert (progress.rows, progress.committed, progress.done) == (0, 0, True)


def test_progress_reads_committed_rows_and_errors_per_shard(tmp_path: Path) -> None:
    commit(start(tmp_path, shard=0), 2)
    complete(start(tmp_path, shard=1, first=110, end=113))
    (tmp_path / success_name(5)).write_text("{}")
    assert shards_in(tmp_path) == {0, 1, 5}
    zero, one, none = (shard_progress(tmp_path, s) for s in (0, 1, 2))
    assert (zero.rows, zero.committed, zero.parts, zero.errors, zero.done) == (10, 8, 2, 1, False)
    assert (one.rows, one.committed, one.done, one.num_shards) == (3, 3, True, 2)
    assert (none.rows, none.committed, none.done) == (None, 0, False)


def test_a_second_run_of_a_shard_is_refused_while_the_first_holds_it(tmp_path: Path) -> None:
    first = start(tmp_path)
    with pytest.raises(JobError, match=rf"being written by another process \(pid {os.getpid()} on "):
        start(tmp_path)
    assert start(tmp_path, shard=1).resume_row == 100, "other shards are not locked"
    commit(first, 1)
    del first  # a run that ends without finishing (an exception) drops its lock with it
    assert start(tmp_path).resume_row == 104


def test_the_lock_of_a_killed_process_is_free_and_its_debris_is_removed(tmp_path: Path) -> None:
    holder = (
        "import sys, time; from pathlib import Path; from embedjob.io.checkpoint import open_checkpoint; "
        f"cp = open_checkpoint(Path(sys.argv[1]), 0, 2, 100, 110, 4, {FINGERPRINT!r}, False); "
        "Path(sys.argv[1], '.part-00000-00000.parquet.tmp-1').write_bytes(b'half'); print('locked', flush=True); "
        "time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(JobError, match=rf"pid {proc.pid} on "):
            start(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            cp = start(tmp_path)
            break
        except JobError:
            assert time.monotonic() < deadline, "the kernel did not drop the lock of a killed process"
            time.sleep(0.05)
    assert cp.resume_row == 100
    assert names(tmp_path) == {JOB_RECORD, manifest_name(0), lock_name(0)}


def _rows(first: int, n: int, dim: int = 8, errors: tuple[int, ...] = ()) -> RowBlock:
    """`n` output rows from `first`: row r's vector is all r, rows in `errors` failed."""
    failed = [first + i in errors for i in range(n)]
    vectors = np.array([[first + i] * dim for i in range(n) if not failed[i]], dtype=np.float16).reshape(-1, dim)
    return RowBlock(first, list(range(first, first + n)), ["image"] * n, [4] * n, [1] * n,
                    ["truncated: cut short" if f else None for f in failed], np.array([0 if f else 1 for f in failed]),
                    vectors, digests=digest_array([media_digest(bytes([first + i])) for i in range(n)]))


def test_a_part_is_written_a_row_group_at_a_time_and_appears_only_when_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows are written as they arrive (a shard's end then waits for one row group, not
    a whole part), yet a reader never sees a part before its last row is in."""
    monkeypatch.setattr(sink, "ROW_GROUP_BYTES", 3 * 8 * 2)  # three rows of 8 float16
    cp = start(tmp_path, first=100, end=110, per_part=8)
    schema = output_schema(pa.int64(), "mean", "float16")
    parts = sink.PartSink(cp, schema)
    for first in range(100, 106, 2):
        parts.add(_rows(first, 2, errors=(103,)))
    assert not (tmp_path / part_name(0, 0)).exists() and cp.resume_row == 100
    assert any(TMP_MARK in name for name in names(tmp_path))  # rows 100-103 (3 vectors) are on disk already
    assert len(parts.buffer) == 1  # rows 104-105 wait for the next row group
    parts.add(_rows(106, 4))  # the part's last two rows, then the last part's two
    assert cp.resume_row == 110 and cp.parts[0].errors == 1 and cp.parts[0].error_codes == {"truncated": 1}
    table = pq.read_table(tmp_path / part_name(0, 0))
    assert table.column("row").to_pylist() == list(range(100, 108))
    assert [v and v[0] for v in table.column("embedding").to_pylist()] == [100, 101, 102, None, 104, 105, 106, 107]
    assert pq.ParquetFile(tmp_path / part_name(0, 0)).metadata.num_row_groups == 2  # 100-103, 104-107
    parts.close()  # nothing left: the last part was committed when its last row came
    assert pq.read_table(tmp_path / part_name(0, 1)).column("row").to_pylist() == [108, 109]
    assert not any(TMP_MARK in name for name in names(tmp_path))
    for record in cp.parts:  # sealed as written, without reading the part back: the file's own
        assert (record.size, record.sha256) == file_digest(tmp_path / record.name)
        assert part_problem(tmp_path, record) is None


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_a_part_keeps_statistics_to_filter_by_except_the_vectors(tmp_path: Path, pooling: str) -> None:
    """Readers skip row groups by `row`, `id` or a copied column with min/max statistics;
    the vectors' would serve no filter and cost the writer a third of its time."""
    cp = start(tmp_path, first=100, end=104, per_part=4)
    parts = sink.PartSink(cp, output_schema(pa.int64(), pooling, "float16", {"caption": pa.string()}))
    block = _rows(100, 4)
    if pooling == "none":
        block.grids = [(1, 1, 1)] * 4
    block.extra = {"caption": ["a cat", "a dog", "two cats", "a bird"]}
    parts.add(block)
    meta = pq.ParquetFile(tmp_path / part_name(0, 0)).metadata.row_group(0)
    stats = {meta.column(i).path_in_schema: meta.column(i).statistics for i in range(meta.num_columns)}
    assert (stats["row"].min, stats["row"].max) == (100, 103)
    assert (stats["id"].min, stats["id"].max) == (100, 103)
    assert (stats["caption"].min, stats["caption"].max) == ("a bird", "two cats")
    vectors = [path for path in stats if path.startswith("embedding.")]
    assert len(vectors) == 1 and stats[vectors[0]] is None
    assert pq.read_table(tmp_path / part_name(0, 0), filters=[("row", ">=", 102)]).column("caption").to_pylist() == [
        "two cats", "a bird"
    ]


def test_a_failing_run_drops_the_part_it_was_writing_and_keeps_the_committed(tmp_path: Path) -> None:
    cp = start(tmp_path, first=0, end=8, per_part=4)
    parts = sink.PartSink(cp, output_schema(pa.int64(), "mean", "float16"))
    parts.add(_rows(0, 6))
    parts.abandon()
    assert cp.resume_row == 4 and names(tmp_path) == {JOB_RECORD, manifest_name(0), part_name(0, 0), lock_name(0)}


def test_a_stream_that_ends_short_of_the_shard_is_an_error_not_a_short_part(tmp_path: Path) -> None:
    cp = start(tmp_path, first=0, end=8, per_part=4)
    parts = sink.PartSink(cp, output_schema(pa.int64(), "mean", "float16"))
    parts.add(_rows(0, 6))
    with pytest.raises(RuntimeError, match=r"part \[4, 8\) ends at row 5: rows are missing"):
        parts.close()
    assert cp.resume_row == 4
