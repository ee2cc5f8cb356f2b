"""Sharding end to end on the CPU: running shards 0..N-1 and concatenating their
outputs in shard order gives the single-process output row for row, embeddings bitwise
equal, whatever N (more shards than row groups included); SLURM's array variables pick
the same shard as --shard. `write_inputs` and `read_output` are shared with
test_resume.py and test_slurm.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from embedjob.cli import main
from embedjob.config import InputConfig
from embedjob.io.reader import list_fragments

DEMO = str(REPO / "jobs" / "demo.yaml")
DATA = REPO / "tests" / "data"
EXTRA_MEDIA = ["img2dataset_456_123.jpg", "decord_video_90.mov", "hfdatasets_test_image_rgba.png", "decord_video_0.mov"]


def write_inputs(directory: Path, copies: int = 1, videos: bool = True) -> Path:
    """A dataset of three files with row groups of different sizes, from real media: the
    demo's photos and broken rows (`copies` times, ids made unique) and, with `videos`,
    a few files of tests/data (two rotated MOV videos among them)."""
    demo = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    rows = [{"id": f"{r['id']}#{k}", "image": r["image"]} for k in range(copies) for r in demo]
    if videos:
        extra = [{"id": name, "image": (DATA / name).read_bytes()} for name in EXTRA_MEDIA]
        rows = rows[:5] + extra[:2] + rows[5:] + extra[2:]
    directory.mkdir(parents=True, exist_ok=True)
    third = len(rows) // 3
    schema = pa.schema([("id", pa.string()), ("image", pa.binary())])
    for name, chunk, group in (("a", rows[:third], 3), ("b", rows[third : 2 * third], 2), ("c", rows[2 * third :], 100)):
        pq.write_table(pa.Table.from_pylist(chunk, schema=schema), directory / f"{name}.parquet", row_group_size=group)
    return directory


def job_args(inputs: Path, out: Path, cache_dir: str, *extra: str) -> list[str]:
    """`embedjob run` arguments for the demo job on `inputs`: float32 output (so "bitwise
    equal" is not helped by float16 rounding), small parts, decoding in-process, and
    small pictures and few frames so that many runs stay cheap on a CPU."""
    settings = {
        "input.path": inputs,
        "input.modality": "auto",
        "preprocess.max_pixels": 112 * 112,
        "video.max_pixels": 56 * 56,
        "video.max_frames": 4,
        "output.path": out,
        "output.dtype": "float32",
        "output.rows_per_part": 4,
        "batching.window": 6,
        "runtime.workers": 0,
        "runtime.progress": "false",
        "runtime.cache_dir": cache_dir,
    }
    return [DEMO, *(a for k, v in settings.items() for a in ("--set", f"{k}={v}")), *extra]


def read_output_shard(out: Path, shard: int) -> list[dict]:
    """The rows of one shard, its parts in part order."""
    files = sorted(out.glob(f"part-{shard:05d}-*.parquet"))
    return pq.read_table(files).to_pylist() if files else []


def read_output(out: Path, num_shards: int = 1) -> list[dict]:
    """All rows of an output, shards in shard order."""
    return [row for shard in range(num_shards) for row in read_output_shard(out, shard)]


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    """Row for row: every column equal, embeddings bitwise (NaN of error rows included)."""
    assert [r["row"] for r in got] == [r["row"] for r in want]
    for a, b in zip(got, want, strict=True):
        a, b = dict(a), dict(b)
        ea, eb = np.array(a.pop("embedding"), dtype=np.float32), np.array(b.pop("embedding"), dtype=np.float32)
        assert a == b
        assert ea.tobytes() == eb.tobytes(), f"row {a['row']}: embeddings differ"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def single(inputs: Path, cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("single")
    assert main(["run", *job_args(inputs, out, cache_dir)]) == 0
    rows = read_output(out)
    assert [r["row"] for r in rows] == list(range(16))
    assert {r["modality"] for r in rows if r["error"] is None} == {"image", "video"}
    assert sum(r["error"] is not None for r in rows) == 2
    return rows


def fragment_count(inputs: Path) -> int:
    return len(list_fragments(InputConfig(path=str(inputs), media_column="image")))


@pytest.mark.parametrize("num_shards", [1, 3, 4, "more than row groups"])
@pytest.mark.slow
def test_shards_in_shard_order_are_the_single_process_output(
    inputs: Path, single: list[dict], cache_dir: str, tmp_path: Path, num_shards
) -> None:
    fragments = fragment_count(inputs)
    n = fragments + 2 if num_shards == "more than row groups" else num_shards
    for shard in range(n):
        assert main(["run", *job_args(inputs, tmp_path, cache_dir), "--shard", f"{shard}/{n}"]) == 0
    assert_same_rows(read_output(tmp_path, n), single)
    end = 0
    for shard in range(n):
        manifest = json.loads((tmp_path / f"_embedjob/manifest-{shard:05d}.json").read_text())
        stats = json.loads((tmp_path / f"_embedjob/stats-{shard:05d}.json").read_text())
        assert (tmp_path / f"_embedjob/_SUCCESS-{shard:05d}").exists()
        rows = [r["row"] for r in read_output_shard(tmp_path, shard)]
        assert stats["rows"] == len(rows) == manifest["end_row"] - manifest["first_row"]
        if rows:
            assert rows == list(range(end, end + len(rows))), f"shard {shard} is not the next contiguous rows"
            end += len(rows)
        else:
            assert manifest["parts"] == [] and shard >= fragments, "only trailing shards may be empty"
    assert end == 16


def test_slurm_array_variables_choose_the_same_shard_as_the_option(
    inputs: Path, single: list[dict], cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert main(["run", *job_args(inputs, tmp_path / "env", cache_dir)]) == 0
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert main(["run", *job_args(inputs, tmp_path / "flag", cache_dir), "--shard", "1/3"]) == 0
    by_env, by_flag = read_output_shard(tmp_path / "env", 1), read_output_shard(tmp_path / "flag", 1)
    assert by_env and not list((tmp_path / "env").glob("part-00000-*"))
    assert_same_rows(by_env, by_flag)
    first = by_env[0]["row"]
    assert_same_rows(by_env, single[first : first + len(by_env)])
