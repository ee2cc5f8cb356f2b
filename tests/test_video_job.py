"""Video jobs end to end (`embedjob run` on the CPU): real clips through decode workers,
Qwen2.5-VL preprocessing, frame-limited packing, the replay graph backend and the writer.

The shared clips (../shared/data) join the repo-local ones when present; without them the
same tests run on tests/data alone. `video.max_frames` is kept small so the file stays fast
on two cores; the frame rule itself is tested in tests/test_video_decode.py.
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, SHARED_DATA

from embedjob import pipeline
from embedjob.cli import main
from embedjob.decode import DecodedVideo, DecodeOptions, decode
from embedjob.encoders.qwen import smart_resize
from embedjob.engine.graphs import GraphManager
from embedjob.rows import Decoded, decode_row

LOCAL = REPO / "tests" / "data"
VIDEO_SUFFIXES = (".mov", ".mp4", ".mkv", ".avi")
MAX_FRAMES = 8
EMBED_DIM = 128  # the builtin tiny tower's output width

# What a row gives per modality: "video" / "image" (an embedding) or the error code.
# decord 0.6.0 (FFmpeg 4.1) has no AV1 decoder: the one video it truly cannot decode.
AV1 = {"video": "unsupported_codec", "auto": "unsupported_codec"}
SHARED_VIDEO_ERRORS = {"torchcodec_av1_video.mkv": AV1}
LOCAL_VIDEO_ERRORS = {
    "torchcodec_av1_video.mkv": AV1,
    "derived_mkv_truncated.mkv": {"video": "truncated", "auto": "truncated"},  # half of a clip
    "decord_corrupted.mp4": {"video": "corrupt", "auto": "corrupt"},  # H.264 units corrupt mid-stream
}
# ../shared/data/bad. The MP4 named .jpg is valid video by its bytes, as the decoder decides
# (modality comes from the bytes, never the name); under `modality: image` it is an error.
SHARED_BAD = {
    "decord_corrupted.mp4": {"video": "corrupt", "auto": "corrupt"},
    "derived_jpeg_half.jpg": {"video": "not_a_video", "auto": "truncated"},
    "derived_mkv_truncated.mkv": {"video": "truncated", "auto": "truncated"},
    "derived_mp4_as_jpg.jpg": {"video": "video", "auto": "video"},
    "derived_text_as_mp4.mp4": {"video": "unknown_format", "auto": "unknown_format"},
    "derived_zero_length.mp4": {"video": "empty", "auto": "empty"},
}
LOCAL_IMAGES = ["img2dataset_123_456.jpg", "hfdatasets_test_image_rgba.png"]
IMAGE = {"video": "not_a_video", "auto": "image"}
PLAIN_VIDEO = {"video": "video", "auto": "video"}
UNLISTED = {"video": "unlisted", "auto": "unlisted"}  # a new file in ../shared/data/bad needs a decision


def shared_files(folder: str) -> list[Path]:
    directory = SHARED_DATA / folder
    return sorted(directory.iterdir()) if directory.is_dir() else []


@dataclass
class Entry:
    """One input row: its id, its bytes, and what it gives per modality."""

    id: str
    data: bytes
    expected: dict[str, str]


def acceptance_entries() -> list[Entry]:
    entries = [
        Entry(f"shared/videos/{p.name}", p.read_bytes(), SHARED_VIDEO_ERRORS.get(p.name, PLAIN_VIDEO))
        for p in shared_files("videos")
    ]
    entries += [Entry(f"shared/bad/{p.name}", p.read_bytes(), SHARED_BAD.get(p.name, UNLISTED)) for p in shared_files("bad")]
    entries += [
        Entry(f"local/{p.name}", p.read_bytes(), LOCAL_VIDEO_ERRORS.get(p.name, PLAIN_VIDEO))
        for p in sorted(LOCAL.iterdir())
        if p.suffix in VIDEO_SUFFIXES
    ]
    entries += [Entry(f"local/{name}", (LOCAL / name).read_bytes(), IMAGE) for name in LOCAL_IMAGES]
    return entries


def write_bytes_parquet(path: Path, entries: list[Entry], row_group_size: int = 16) -> Path:
    table = pa.table({"id": [e.id for e in entries], "media": pa.array([e.data for e in entries], pa.binary())})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@dataclass
class JobResult:
    code: int
    rows: list[dict[str, Any]]
    stats: dict[str, Any]

    def by_id(self) -> dict[Any, dict[str, Any]]:
        return {r["id"]: r for r in self.rows}


def run_job(workdir: Path, data: Path, cache_dir: str, **sections: dict[str, Any]) -> JobResult:
    """`embedjob run` on a job file written from these defaults and `sections`."""
    spec: dict[str, dict[str, Any]] = {
        "input": {"path": str(data), "media_column": "media", "id_column": "id", "modality": "auto"},
        "model": {"family": "qwen2_5_vl", "path": "builtin:tiny-qwen2_5_vl"},
        "video": {"fps": 2.0, "max_frames": MAX_FRAMES},
        "output": {"path": str(workdir / "out"), "pooling": "mean", "dtype": "float32"},
        "runtime": {"cache_dir": cache_dir, "workers": 2, "progress": False},
    }
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    workdir.mkdir(parents=True, exist_ok=True)
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    code = main(["run", str(job)])
    return read_output(code, Path(spec["output"]["path"]))


def read_output(code: int, out: Path) -> JobResult:
    parts = sorted(out.glob("part-*.parquet"))
    rows = pq.read_table(parts).to_pylist() if parts else []
    stats_file = out / "_embedjob/stats-00000.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    return JobResult(code, rows, stats)


def outcome(row: dict[str, Any]) -> str:
    """The row's outcome: its modality ("video" or "image") if embedded, else its error code."""
    if row["error"] is not None:
        assert row["embedding"] is None
        return row["error"].split(":", 1)[0]
    return row["modality"]


@dataclass
class BatchRecord:
    """What GraphManager.run was given for one batch."""

    frames: list[int]
    modalities: list[str]
    budget: int | None


@pytest.fixture
def batch_log(monkeypatch: pytest.MonkeyPatch) -> list[BatchRecord]:
    """Every batch the encoder runs in this process (the runner encodes in-process)."""
    log: list[BatchRecord] = []
    original = GraphManager.run_batch

    def recording(self: GraphManager, items: list, budget: int | None) -> Any:
        log.append(BatchRecord([i.frames for i in items], [i.modality for i in items], budget))
        return original(self, items, budget)

    monkeypatch.setattr(GraphManager, "run_batch", recording)
    return log


# ---------------------------------------------------------------- every clip, both modalities


@dataclass
class Acceptance:
    entries: list[Entry]
    runs: dict[str, JobResult]


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Acceptance:
    """The acceptance set run twice: `video` with mean pooling, `auto` with per-token rows."""
    workdir = tmp_path_factory.mktemp("acceptance")
    entries = acceptance_entries()
    data = write_bytes_parquet(workdir / "clips.parquet", entries)
    runs = {
        "video": run_job(workdir / "video", data, cache_dir, input={"modality": "video"}),
        "auto": run_job(workdir / "auto", data, cache_dir, input={"modality": "auto"}, output={"pooling": "none"}),
    }
    return Acceptance(entries, runs)


@pytest.mark.parametrize("modality", ["video", "auto"])
@pytest.mark.slow
def test_every_clip_gives_an_embedding_or_its_precise_error_in_input_order(acceptance: Acceptance, modality: str) -> None:
    entries = acceptance.entries
    result = acceptance.runs[modality]
    assert result.code == 0
    assert [r["row"] for r in result.rows] == list(range(len(entries)))
    assert [r["id"] for r in result.rows] == [e.id for e in entries]
    got = {r["id"]: outcome(r) for r in result.rows}
    assert got == {e.id: e.expected[modality] for e in entries}
    errors = sum(e.expected[modality] not in ("video", "image") for e in entries)
    assert (result.stats["rows"], result.stats["errors"]) == (len(entries), errors)
    assert result.stats["graph_hits"] + result.stats["graph_misses"] == len(entries) - errors


def test_shared_bad_files_are_all_listed() -> None:
    if not shared_files("bad"):
        pytest.skip("../shared/data is not present (clean clone)")
    assert sorted(p.name for p in shared_files("bad")) == sorted(SHARED_BAD)


def test_video_rows_carry_sampled_frames_and_tokens_of_their_grid(acceptance: Acceptance, qwen_adapter) -> None:
    """frames: the sampled count (a multiple of the temporal patch, <= video.max_frames);
    tokens: t * (h/2) * (w/2) with t = frames / 2 and (h, w) the patch grid of Qwen's
    resize of the clip's frame size."""
    processing = qwen_adapter.processing
    factor = processing.patch_size * processing.merge_size
    options = DecodeOptions("video", max_image_pixels=1, fps=2.0, max_frames=MAX_FRAMES, frame_multiple=2)
    rows = acceptance.runs["video"].by_id()
    checked = 0
    for entry in acceptance.entries:
        row = rows[entry.id]
        if row["error"] is not None:
            continue
        decoded = decode(entry.data, options)
        assert isinstance(decoded, DecodedVideo)
        frames, height, width = decoded.frames.shape[:3]
        assert row["frames"] == frames and frames % 2 == 0 and 2 <= frames <= MAX_FRAMES, entry.id
        h, w = smart_resize(height, width, factor, processing.video_min_pixels, processing.video_max_pixels)
        assert row["tokens"] == (frames // 2) * (h // factor) * (w // factor), entry.id
        vector = np.array(row["embedding"], dtype=np.float32)
        assert vector.shape == (EMBED_DIM,) and np.isfinite(vector).all() and np.abs(vector).sum() > 0
        checked += 1
    assert checked >= 10
    assert any(r["frames"] == MAX_FRAMES for r in rows.values())  # the cap is reached by the longer clips


def test_per_token_rows_average_to_the_pooled_vector(acceptance: Acceptance) -> None:
    pooled = acceptance.runs["video"].by_id()
    per_token = acceptance.runs["auto"].by_id()
    compared = 0
    for entry_id, row in per_token.items():
        if row["error"] is not None:
            assert row["embedding"] is None
            continue
        matrix = np.array(row["embedding"], dtype=np.float32)
        assert matrix.shape == (row["tokens"], EMBED_DIM)
        if row["modality"] == "video":
            assert (row["tokens"], row["frames"]) == (pooled[entry_id]["tokens"], pooled[entry_id]["frames"])
            assert np.allclose(matrix.mean(axis=0), pooled[entry_id]["embedding"], rtol=1e-4, atol=1e-5), entry_id
            compared += 1
        else:
            assert row["modality"] == "image" and row["frames"] == 0
    assert compared >= 10


# ---------------------------------------------------------------- modality auto, from the bytes


@pytest.fixture(scope="module")
def mislabelled(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> dict[str, JobResult]:
    """Paths whose names lie about their content, in a string path column, run as auto and image."""
    workdir = tmp_path_factory.mktemp("mislabelled")
    clip_named_jpg = workdir / "clip.jpg"
    shutil.copyfile(LOCAL / "hfdatasets_test_video_66x50.mov", clip_named_jpg)
    photo_named_mp4 = workdir / "photo.mp4"
    shutil.copyfile(LOCAL / "img2dataset_123_456.jpg", photo_named_mp4)
    paths = {
        "clip_named_jpg": clip_named_jpg,
        "photo_named_mp4": photo_named_mp4,
        "png": LOCAL / "hfdatasets_test_image_rgba.png",
        "mov": LOCAL / "decord_video_0.mov",
    }
    if shared_files("bad"):
        paths["shared_mp4_as_jpg"] = SHARED_DATA / "bad" / "derived_mp4_as_jpg.jpg"
    data = workdir / "paths.parquet"
    pq.write_table(pa.table({"id": list(paths), "media": [str(p) for p in paths.values()]}), data)
    return {
        # The paths lie in three directories: no one media_root holds them. Under
        # modality: image most rows are not_an_image rows, which the error limit would stop.
        modality: run_job(workdir / modality, data, cache_dir, input={"modality": modality, "allow_any_path": True},
                          runtime={"max_error_rate": None})
        for modality in ("auto", "image")
    }


MISLABELLED_EXPECTED = {
    "auto": {"clip_named_jpg": "video", "photo_named_mp4": "image", "png": "image", "mov": "video", "shared_mp4_as_jpg": "video"},
    "image": {
        "clip_named_jpg": "not_an_image",
        "photo_named_mp4": "image",
        "png": "image",
        "mov": "not_an_image",
        "shared_mp4_as_jpg": "not_an_image",
    },
}


@pytest.mark.parametrize("modality", ["auto", "image"])
@pytest.mark.slow
def test_auto_decides_each_row_from_its_bytes_not_its_name(mislabelled: dict[str, JobResult], modality: str) -> None:
    result = mislabelled[modality]
    assert result.code == 0
    got = {r["id"]: outcome(r) for r in result.rows}
    assert got == {k: v for k, v in MISLABELLED_EXPECTED[modality].items() if k in got}
    assert len(got) >= 4
    for row in result.rows:
        if row["error"] is None:
            assert (row["frames"] > 0) == (row["modality"] == "video")


def test_images_embed_the_same_under_auto_and_image(mislabelled: dict[str, JobResult]) -> None:
    auto, image = mislabelled["auto"].by_id(), mislabelled["image"].by_id()
    for key in ("photo_named_mp4", "png"):
        assert auto[key]["tokens"] == image[key]["tokens"]
        assert np.allclose(auto[key]["embedding"], image[key]["embedding"], rtol=1e-4, atol=1e-5), key


# ---------------------------------------------------------------- frame budget, mixed batches

FRAME_LIMIT = 6
ITEM_LIMIT = 4
# 4 fps: the one-second clips give 4 frames, the short ones 2, the long ones MAX_FRAMES
# (above FRAME_LIMIT, so they must run eagerly on their own).
LIMITED_CLIPS = [
    "decord_video_0.mov",
    "decord_unordered.mov",
    "hfdatasets_test_video_66x50.mov",
    "torchcodec_h265_video.mp4",
    "torchcodec_h264_10bits.mp4",
    "torchcodec_h265_10bits.mp4",
    "torchcodec_nasa_13013.mp4",
]
LIMITED_IMAGES = ["img2dataset_123_456.jpg", "img2dataset_456_123.jpg", "hfdatasets_test_image_rgba.png"]


@pytest.fixture(scope="module")
def limited_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    names = LIMITED_CLIPS[:3] + LIMITED_IMAGES[:1] + LIMITED_CLIPS[3:6] + LIMITED_IMAGES[1:] + LIMITED_CLIPS[6:]
    entries = [Entry(name, (LOCAL / name).read_bytes(), {}) for name in names]
    return write_bytes_parquet(tmp_path_factory.mktemp("limited") / "mixed.parquet", entries, row_group_size=4)


LIMITED = {"video": {"fps": 4.0}, "batching": {"max_frames_per_batch": FRAME_LIMIT, "max_items_per_batch": ITEM_LIMIT}}


@pytest.mark.slow
def test_no_batch_exceeds_the_frame_limit_and_oversized_clips_run_eagerly(
    limited_data: Path, tmp_path: Path, cache_dir: str, batch_log: list[BatchRecord]
) -> None:
    result = run_job(tmp_path, limited_data, cache_dir, **LIMITED)
    assert result.code == 0 and all(r["error"] is None for r in result.rows)
    frames = sorted(r["frames"] for r in result.rows if r["modality"] == "video")
    assert set(frames) == {2, 4, MAX_FRAMES}  # the set really spans the limit
    graph_batches = [b for b in batch_log if b.budget is not None]
    assert graph_batches and all(sum(b.frames) <= FRAME_LIMIT and len(b.frames) <= ITEM_LIMIT for b in graph_batches)
    oversized = [b for b in batch_log if any(f > FRAME_LIMIT for f in b.frames)]
    assert len(oversized) == frames.count(MAX_FRAMES)
    assert all(b.budget is None and len(b.frames) == 1 for b in oversized)
    stats = result.stats
    assert stats["max_frames_per_batch"] == FRAME_LIMIT
    assert stats["graph_hits"] + stats["graph_misses"] == len(result.rows) == sum(len(b.frames) for b in batch_log)
    assert stats["graph_misses"] == len(oversized) + stats["capacity_fallbacks"]


@pytest.mark.slow
def test_images_and_videos_share_batches_and_match_each_item_run_alone(
    limited_data: Path, tmp_path: Path, cache_dir: str, batch_log: list[BatchRecord]
) -> None:
    packed = run_job(tmp_path / "packed", limited_data, cache_dir, **LIMITED)
    mixed = [b for b in batch_log if b.budget is not None and {"image", "video"} <= set(b.modalities)]
    assert mixed, [(b.modalities, b.budget) for b in batch_log]
    batch_log.clear()
    alone = run_job(
        tmp_path / "alone",
        limited_data,
        cache_dir,
        video={"fps": 4.0},
        batching={"cuda_graphs": False, "max_items_per_batch": 1},
    )
    assert all(len(b.frames) == 1 for b in batch_log) and alone.stats["graph_hits"] == 0
    assert packed.code == alone.code == 0
    for a, b in zip(packed.rows, alone.rows, strict=True):
        assert (a["id"], a["tokens"], a["frames"]) == (b["id"], b["tokens"], b["frames"])
        assert np.allclose(a["embedding"], b["embedding"], rtol=1e-4, atol=1e-5), a["id"]


# ---------------------------------------------------------------- a decoder that hangs

HANGING_ID = "hangs"


def decode_or_hang(row: Any, options: DecodeOptions, preprocess: Any, captions: Any = None) -> Decoded:
    """`decode_row`, except that the row with id HANGING_ID never returns.

    Module level so that the decode workers (forkserver: fresh processes) unpickle it by
    reference from this module: a monkeypatch alone would not reach them.
    """
    if row.id == HANGING_ID:
        time.sleep(3600)
    return decode_row(row, options, preprocess, captions)


@pytest.mark.slow
def test_a_hanging_decoder_is_cut_off_and_its_worker_replaced(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker: rows after the hanging one can only be decoded by its replacement."""
    monkeypatch.setattr(pipeline, "decode_row", decode_or_hang)
    names = {"first": "decord_video_0.mov", HANGING_ID: "torchcodec_h265_video.mp4",
             "after": "img2dataset_123_456.jpg", "last": "hfdatasets_test_video_66x50.mov"}
    entries = [Entry(key, (LOCAL / name).read_bytes(), {}) for key, name in names.items()]
    data = write_bytes_parquet(tmp_path / "hang.parquet", entries)
    timeout = 3.0
    result = run_job(tmp_path, data, cache_dir, runtime={"workers": 1, "decode_timeout": timeout})
    assert result.code == 0
    assert [outcome(r) for r in result.rows] == ["video", "decode_timeout", "image", "video"]
    assert f"no result after {timeout:g}s" in result.rows[1]["error"]


# ---------------------------------------------------------------- job spec errors


def test_max_frames_below_the_temporal_patch_is_a_one_line_spec_error(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_bytes_parquet(tmp_path / "one.parquet", [Entry("clip", (LOCAL / "decord_video_0.mov").read_bytes(), {})])
    bad = run_job(tmp_path, data, cache_dir, video={"max_frames": 1})
    err = capsys.readouterr().err.strip().splitlines()
    assert bad.code == 2 and err[-1].startswith("embedjob: error: ") and "video.max_frames" in err[-1]
    fixed = run_job(tmp_path, data, cache_dir, video={"max_frames": 2})
    assert fixed.code == 0 and [outcome(r) for r in fixed.rows] == ["video"]


# ---------------------------------------------------------------- the video demo

DEMO = REPO / "jobs" / "demo-video.yaml"
DEMO_DATA = REPO / "jobs" / "data" / "demo-videos.parquet"
DEMO_EXPECTED = {
    "decord_video_90": "video",
    "decord_unordered": "video",
    "hfdatasets_test_video_66x50": "video",
    "img2dataset_123_456": "image",
    "torchcodec_h265_video": "video",
    "torchcodec_h264_10bits": "video",
    "torchcodec_av1_video": "unsupported_codec",
    "decord_corrupted": "corrupt",
    "truncated_mov": "truncated",
}


def test_video_demo_runs_with_its_expected_error_rows(tmp_path: Path, cache_dir: str) -> None:
    code = main(["run", str(DEMO), "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}",
                 "--set", "runtime.workers=2", "--set", "runtime.progress=false"])
    result = read_output(code, tmp_path)
    assert result.code == 0
    assert {r["id"]: outcome(r) for r in result.rows} == DEMO_EXPECTED
    assert [r["id"] for r in result.rows] == list(DEMO_EXPECTED)
    assert (result.stats["rows"], result.stats["errors"]) == (9, 3)
    for row in result.rows:
        if row["modality"] == "video" and row["error"] is None:
            assert row["frames"] % 2 == 0 and 2 <= row["frames"] <= 8
    assert max(r["frames"] or 0 for r in result.rows) == 4  # fps 4 on the one-second clips


def test_video_demo_data_is_small_and_every_row_has_a_licence_line() -> None:
    assert DEMO_DATA.stat().st_size < 1_000_000
    with open(REPO / "jobs" / "data" / "LICENSES.tsv", newline="") as handle:
        listed = {row["id"] for row in csv.DictReader(handle, delimiter="\t")}
    assert set(pq.read_table(DEMO_DATA, columns=["id"]).column("id").to_pylist()) <= listed
