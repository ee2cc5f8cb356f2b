"""A rerun never mixes vectors of two inputs (issue 50, item 2): an image changed in
place between a kill and the rerun (same file size, same Parquet footer, so the job
fingerprint cannot tell) is found by the committed parts' media digests, and the
resume is refused naming the rows, unless --overwrite, which recomputes them. The same
for a media file a path column names. An unchanged input, and an output an embedjob
before media digests wrote, resume as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_resume import debris, interrupt_after_first_part, manifest, snapshot
from test_shards import assert_same_rows, job_args, read_output
from test_video_job import HANGING_ID, Entry, decode_or_hang, outcome, run_job, write_bytes_parquet

from embedjob import pipeline
from embedjob.cli import main
from embedjob.config import InputConfig
from embedjob.io.digest import UNREAD, digest_array, media_digest, part_digest, recomputed_digest
from embedjob.io.reader import scan_input

DEMO_ROWS = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
CHANGED_ROW = 1  # a photo in part 0 (rows 0-3), which the rerun keeps


def write_input(directory: Path) -> Path:
    """The demo's rows in one file, uncompressed and without statistics of the media
    column, so a byte of an image lies as it is in the file and its footer does not
    depend on it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "images.parquet"
    table = pa.Table.from_pylist(DEMO_ROWS, schema=pa.schema([("id", pa.string()), ("image", pa.binary())]))
    pq.write_table(table, path, row_group_size=4, compression="none", write_statistics=["id"])
    return directory


def flip_a_byte(path: Path, media: bytes) -> None:
    """Flip one byte in the middle of `media` where `path` holds it, in place: same
    size, and (for a Parquet file) the same footer."""
    raw = bytearray(path.read_bytes())
    at = raw.find(media)
    assert at >= 0 and raw.find(media, at + 1) < 0
    raw[at + len(media) // 2] ^= 0xFF
    path.write_bytes(raw)


def identity(inputs: Path) -> list:
    return scan_input(InputConfig(path=str(inputs), media_column="image")).files


def test_an_image_changed_in_place_refuses_the_resume_naming_its_rows_and_overwrite_recomputes(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    inputs = write_input(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    before_change = read_output(out)
    interrupt_after_first_part(out)
    files = identity(inputs)
    flip_a_byte(inputs / "images.parquet", DEMO_ROWS[CHANGED_ROW]["image"])
    assert identity(inputs) == files, "the job fingerprint already sees the change; the test shows nothing"
    before = snapshot(out)
    capsys.readouterr()

    assert main(["run", *job_args(inputs, out, cache_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the input changed under shard 0" in err and "rows 0-3 (part-00000-00000.parquet)" in err
    assert "--overwrite" in err and "\n" not in err
    assert snapshot(out) == before, "a refused run changed the output"

    assert main(["run", *job_args(inputs, out, cache_dir), "--overwrite"]) == 0
    reference = tmp_path / "reference"
    assert main(["run", *job_args(inputs, reference, cache_dir)]) == 0
    got = read_output(out)
    assert_same_rows(got, read_output(reference))
    assert got[CHANGED_ROW]["embedding"] != before_change[CHANGED_ROW]["embedding"], "the changed image was not recomputed"
    assert debris(out) == []


def test_a_media_file_changed_in_place_refuses_the_resume(tmp_path: Path, cache_dir: str, capsys) -> None:
    """Media named by a path column: the digest is of the file the worker read."""
    media = tmp_path / "media"
    media.mkdir()
    rows = []
    for k, row in enumerate(r for r in DEMO_ROWS if r["image"]):
        (media / f"{k}.bin").write_bytes(row["image"])
        rows.append({"id": row["id"], "image": f"{k}.bin"})
    inputs = tmp_path / "in"
    inputs.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), inputs / "paths.parquet", row_group_size=4)
    out = tmp_path / "out"
    args = [*job_args(inputs, out, cache_dir), "--set", f"input.media_root={media}"]
    assert main(["run", *args]) == 0
    interrupt_after_first_part(out)
    flip_a_byte(media / f"{CHANGED_ROW}.bin", DEMO_ROWS[CHANGED_ROW]["image"])
    capsys.readouterr()
    assert main(["run", *args]) == 2
    assert "rows 0-3 (part-00000-00000.parquet)" in capsys.readouterr().err


def test_an_unchanged_input_resumes_to_the_uninterrupted_output(tmp_path: Path, cache_dir: str) -> None:
    inputs = write_input(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    want = read_output(out)
    recorded = manifest(out)["parts"]
    assert all(p["input_digest"] and p["unread_rows"] == [] for p in recorded)
    assert len({p["input_digest"] for p in recorded}) == len(recorded)
    interrupt_after_first_part(out)
    assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    assert_same_rows(read_output(out), want)
    assert manifest(out)["parts"] == recorded
    assert debris(out) == []


def test_an_output_recorded_without_media_digests_still_resumes(
    tmp_path: Path, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Parts an older embedjob committed have no digest: they are kept on the job
    fingerprint, as that embedjob kept them, and the log says so."""
    inputs = write_input(tmp_path / "in")
    out = tmp_path / "out"
    assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    want = read_output(out)
    interrupt_after_first_part(out)
    old = manifest(out)
    for part in old["parts"]:
        del part["input_digest"], part["unread_rows"]
    (out / "_embedjob/manifest-00000.json").write_text(json.dumps(old))
    with caplog.at_level("INFO", logger="embedjob.io.checkpoint"):
        assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    assert "1 committed part recorded without media digests" in caplog.text
    assert_same_rows(read_output(out), want)


def test_rows_no_worker_finished_are_left_out_of_the_check() -> None:
    """A row the decode pool cut off (timeout, crash) was committed as an error that no
    byte decided: whatever its media is now, the part still matches."""
    committed = digest_array([media_digest(b"a"), UNREAD, media_digest(b"c")])
    now = digest_array([media_digest(b"a"), media_digest(b"b"), media_digest(b"c")])
    assert recomputed_digest(now, 10, [11]) == part_digest(committed)
    assert recomputed_digest(now, 10, []) != part_digest(committed)
    changed = digest_array([media_digest(b"a"), media_digest(b"b"), media_digest(b"d")])
    assert recomputed_digest(changed, 10, [11]) != part_digest(committed)


@pytest.mark.slow
def test_a_row_cut_off_by_its_decode_timeout_does_not_stop_the_resume(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the row whose worker hung is committed as unread, and the rerun,
    which reads that row's media now, keeps the part it lies in."""
    monkeypatch.setattr(pipeline, "decode_row", decode_or_hang)
    keys = ["first", HANGING_ID, "after", "last"]
    data = write_bytes_parquet(tmp_path / "hang.parquet", [Entry(k, r["image"], {}) for k, r in zip(keys, DEMO_ROWS)])
    settings = {"runtime": {"workers": 1, "decode_timeout": 3.0}, "output": {"rows_per_part": 2}}
    first = run_job(tmp_path, data, cache_dir, **settings)
    assert first.code == 0 and outcome(first.rows[1]) == "decode_timeout"
    out = tmp_path / "out"
    # The row after it may time out too on a loaded machine (it waits for the new worker).
    assert 1 in manifest(out)["parts"][0]["unread_rows"]
    interrupt_after_first_part(out)
    monkeypatch.undo()
    again = run_job(tmp_path, data, cache_dir, **settings)
    assert again.code == 0 and again.rows[:2] == first.rows[:2]


@pytest.mark.slow
def test_ranks_send_the_digests_of_their_rows_to_rank_zero(tmp_path: Path, cache_dir: str) -> None:
    """With --gpus 2 (CPU ranks) rank 1's rows reach the writer with their digests:
    every part records what a single process records."""
    inputs = write_input(tmp_path / "in")
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    settings = ["--set", "output.rows_per_part=2", "--set", "batching.window=2"]
    assert main(["run", *job_args(inputs, single, cache_dir), *settings]) == 0
    assert main(["run", *job_args(inputs, ranks, cache_dir), *settings, "--gpus", "2"]) == 0
    digests = [p["input_digest"] for p in manifest(single)["parts"]]
    assert [p["input_digest"] for p in manifest(ranks)["parts"]] == digests and None not in digests
    stats = json.loads((ranks / "_embedjob/stats-00000.json").read_text())
    assert stats["ranks"][1]["rows"] > 0, "rank 1 encoded nothing; the test shows nothing"
    assert np.unique(digests).size == len(digests)
