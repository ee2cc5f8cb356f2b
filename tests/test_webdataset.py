"""WebDataset input (`input.format: webdataset`) on the CPU: tars in the img2dataset
layout (`00000.jpg`, `00000.txt`, `00000.json` per key) built here from real photos and
a video give the vectors the same media give from Parquet, bit for bit, with `txt` and
`json` carried like Parquet columns; a sample without media is one error row; two
shards, one of them SIGKILLed and resumed, give the uninterrupted output; a damaged tar
keeps what it could index; a rewritten tar is refused on resume."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SHARED_DATA
from test_resume import Attempt, manifest
from test_shards import DATA, DEMO, assert_same_rows, read_output

from embedjob.cli import main
from embedjob.config import InputConfig, JobError
from embedjob.io import reader
from embedjob.io.webdataset import group_samples, index_tar

PHOTOS = sorted(p for p in (SHARED_DATA / "images").iterdir() if p.suffix in (".jpg", ".png"))
VIDEO = DATA / "decord_video_90.mov"


def media() -> list[tuple[str, str, bytes]]:
    """(key, extension, bytes) of every photo and one video, keys as img2dataset makes them."""
    files = [*PHOTOS, VIDEO]
    return [(f"{k:05d}", path.suffix[1:], path.read_bytes()) for k, path in enumerate(files)]


def caption(key: str) -> str:
    return f"a caption of {key} \N{SNOWMAN}"


def meta(key: str, extension: str) -> str:
    return json.dumps({"key": key, "status": "success", "ext": extension})


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tars(directory: Path, items: list[tuple[str, str, bytes]], sizes: tuple[int, ...]) -> Path:
    """`items` in tars of `sizes` samples each, every sample with its media, txt and json."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for number, size in enumerate(sizes):
        with tarfile.open(directory / f"{number:05d}.tar", "w") as tar:
            for key, extension, data in items[start : start + size]:
                add(tar, f"{key}.{extension}", data)
                add(tar, f"{key}.txt", caption(key).encode())
                add(tar, f"{key}.json", meta(key, extension).encode())
        start += size
    assert start == len(items)
    return directory


def write_parquet(path: Path, items: list[tuple[str, str, bytes]]) -> Path:
    """The same samples as one Parquet file: id = key, media bytes, txt and json columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": k, "image": d, "txt": caption(k), "json": meta(k, e)} for k, e, d in items]
    schema = pa.schema([("id", pa.string()), ("image", pa.binary()), ("txt", pa.string()), ("json", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=4)
    return path


def run_args(inputs: Path, out: Path, cache_dir: str, webdataset: bool, *extra: str) -> list[str]:
    """`embedjob run` of the demo job on `inputs` (tars or Parquet), float32 output,
    small pictures, the carried columns, decoding in-process."""
    settings = {
        "input.path": inputs,
        "input.modality": "auto",
        "input.media_column": "jpg" if webdataset else "image",
        "preprocess.max_pixels": 112 * 112,
        "video.max_pixels": 56 * 56,
        "video.max_frames": 4,
        "output.path": out,
        "output.dtype": "float32",
        "output.rows_per_part": 3,
        "output.columns": "[txt, json]",
        "batching.window": 4,
        "runtime.workers": 0,
        "runtime.progress": "false",
        "runtime.cache_dir": cache_dir,
    }
    if webdataset:
        settings["input.format"] = "webdataset"
        settings["input.id_column"] = "null"
    return [DEMO, *(a for k, v in settings.items() for a in ("--set", f"{k}={v}")), *extra]


@pytest.mark.parametrize(
    ("model", "extra"),
    [("builtin:tiny-qwen2_5_vl", []), ("builtin:tiny-clip", []),
     ("builtin:tiny-qwen2_5_vl", ["--set", "model.precision=fp8", "--set", "model.fp8_calibrate=6"])],
)
def test_the_same_media_in_tars_and_in_parquet_give_bitwise_equal_vectors(
    tmp_path: Path, cache_dir: str, model: str, extra: list[str]
) -> None:
    """Tars and Parquet of the same samples: the same rows, columns and vectors, bit for
    bit; FP8 weights calibrated on the first six samples (across the first two tars) too."""
    items = media()
    tars = write_tars(tmp_path / "tars", items, (5, 4, len(items) - 9))
    table = write_parquet(tmp_path / "parquet" / "all.parquet", items)
    family = ["--set", f"model.path={model}", "--set", f"model.family={model.split('tiny-')[1]}", *extra]
    assert main(["run", *run_args(tars, tmp_path / "from-tars", cache_dir, True), *family]) == 0
    assert main(["run", *run_args(table, tmp_path / "from-parquet", cache_dir, False), *family]) == 0
    got, want = read_output(tmp_path / "from-tars"), read_output(tmp_path / "from-parquet")
    assert [r["id"] for r in got] == [k for k, _, _ in items]
    assert [r["error"] for r in got] == [None] * len(items), "a photo or the video did not embed from its tar"
    assert [r["modality"] for r in got] == ["image"] * len(PHOTOS) + ["video"]
    assert [(r["txt"], r["json"]) for r in got] == [(caption(k), meta(k, e)) for k, e, _ in items]
    assert_same_rows(got, want)


def test_a_sample_without_its_media_member_is_one_error_row_and_a_missing_caption_a_null(tmp_path: Path) -> None:
    items = media()[:3]
    directory = tmp_path / "tars"
    directory.mkdir()
    with tarfile.open(directory / "00000.tar", "w") as tar:
        add(tar, "00000.jpg", items[0][2])
        add(tar, "00000.txt", b"first")
        add(tar, "00001.txt", b"text only")
        add(tar, "00001.json", b"{}")
        add(tar, "00002.jpg", items[2][2])
    cfg = InputConfig(path=str(directory), media_column="jpg", format="webdataset")
    listing = reader.scan_input(cfg, ["txt"])
    rows = list(reader.read_rows(cfg, listing.fragments, columns=["txt"]))
    assert [(r.row, r.id, r.extra) for r in rows] == [(0, "00000", ("first",)), (1, "00001", ("text only",)), (2, "00002", (None,))]
    assert [r.data for r in rows] == [items[0][2], None, items[2][2]]
    assert [r.error for r in rows][0::2] == [None, None]
    assert rows[1].error.startswith("no_media: sample '00001'") and "members: .txt, .json" in rows[1].error


def test_media_over_max_item_bytes_is_too_large_without_reading_it(tmp_path: Path) -> None:
    items = media()[:2]
    tars = write_tars(tmp_path / "tars", items, (2,))
    limit = min(len(d) for _, _, d in items) + 1
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset", max_item_bytes=limit)
    rows = list(reader.read_rows(cfg, reader.scan_input(cfg).fragments))
    small = [len(d) < limit for _, _, d in items]
    assert [r.error is None for r in rows] == small
    assert all(r.error.startswith("too_large: member") for r, fits in zip(rows, small) if not fits)


def test_keys_group_consecutive_members_as_webdataset_does() -> None:
    members = [
        ("shard/a/00000.jpg", 512, 10), ("shard/a/00000.seg.png", 1024, 5), ("shard/a/00000.JSON", 2048, 2),
        ("README", 3072, 4), (".hidden.txt", 4096, 1),
        ("shard/a/00001.jpg", 5120, 3), ("shard/a/00001.jpg", 6144, 3),
        ("shard/a/00000.txt", 7168, 1),
    ]
    samples, repeated = group_samples(members)
    assert [(s.key, s.extensions()) for s in samples] == [
        ("shard/a/00000", ["jpg", "seg.png", "json"]), ("shard/a/00001", ["jpg"]), ("shard/a/00000", ["txt"]),
    ]
    assert repeated == 1 and samples[1].member("JPG") == ("jpg", 5120, 3)


def test_rows_are_numbered_over_tars_in_path_order_and_shards_cut_between_fragments(tmp_path: Path) -> None:
    items = media()
    write_tars(tmp_path / "tars", items, (len(items) - 4, 4))
    (tmp_path / "tars" / "00000.tar").rename(tmp_path / "tars" / "00002.tar")  # now the last in path order
    cfg = InputConfig(path=str(tmp_path / "tars" / "*.tar"), media_column="jpg", format="webdataset")
    listing = reader.scan_input(cfg)
    rows = list(reader.read_rows(cfg, listing.fragments))
    keys = [k for k, _, _ in items]
    assert [r.id for r in rows] == keys[-4:] + keys[:-4] and [r.row for r in rows] == list(range(len(items)))
    shards = reader.assign_shards(listing.fragments, 2)
    assert [f.first_row for s in shards for f in s] == [f.first_row for f in listing.fragments]
    assert all(shards), "a shard of two tars is empty"


def test_a_damaged_tar_keeps_the_samples_before_the_damage_and_says_so(tmp_path: Path, caplog) -> None:
    items = media()[:4]
    tars = write_tars(tmp_path / "tars", items, (4,))
    path = tars / "00000.tar"
    whole = path.read_bytes()
    index = index_tar(str(path), {})
    assert index.damage is None and len(index.samples) == 4
    third = index.samples[2].members[0]  # the third sample's media: cut in its middle
    path.write_bytes(whole[: third[1] + third[2] // 2])
    with caplog.at_level(logging.WARNING):
        damaged = index_tar(str(path), {})
    assert [s.key for s in damaged.samples] == ["00000", "00001"], "a member cut short was indexed"
    assert damaged.damage is not None and "is damaged at byte" in damaged.damage and damaged.damage in caplog.text
    header = index.samples[0].members[1][1] - 512  # the first sample's txt member's header
    path.write_bytes(whole[:header] + b"\x01" * 512 + whole[header + 512 :])
    garbled = index_tar(str(path), {})
    assert [s.extensions() for s in garbled.samples] == [["jpg"]] and "invalid header" in (garbled.damage or "")
    path.write_bytes(b"not a tar at all, just some text" * 40)
    with pytest.raises(JobError, match="is not a tar file"):
        index_tar(str(path), {})


def test_two_shards_one_killed_and_resumed_give_the_uninterrupted_output(tmp_path: Path, cache_dir: str) -> None:
    items = media()
    tars = write_tars(tmp_path / "tars", items, (4, 4, len(items) - 8))
    settings = ["--set", "output.rows_per_part=1", "--set", "batching.window=1"]
    reference = tmp_path / "reference"
    assert main(["run", *run_args(tars, reference, cache_dir, True), *settings]) == 0
    out = tmp_path / "out"
    for shard in (0, 1):
        args = [*run_args(tars, out, cache_dir, True), *settings, "--shard", f"{shard}/2"]
        killed = Attempt(args, tmp_path / f"killed-{shard}.log")
        killed.wait_for(lambda: len((manifest(out, shard) or {"parts": []})["parts"]) >= 1)
        assert killed.kill(), f"shard {shard} finished before it could be killed"
        assert main(["run", *args]) == 0
    assert_same_rows(read_output(out, 2), read_output(reference))
    assert [r["id"] for r in read_output(out, 2)] == [k for k, _, _ in items]
    assert main(["verify", str(out)]) == 0


def test_a_rewritten_tar_is_refused_on_resume_naming_it(tmp_path: Path, cache_dir: str, capsys) -> None:
    items = media()[:3]
    tars = write_tars(tmp_path / "tars", items, (3,))
    out = tmp_path / "out"
    assert main(["run", *run_args(tars, out, cache_dir, True)]) == 0
    write_tars(tmp_path / "tars", items[:2], (2,))
    capsys.readouterr()
    assert main(["run", *run_args(tars, out, cache_dir, True)]) == 2
    assert "00000.tar" in capsys.readouterr().err


def test_job_errors_name_what_to_change(tmp_path: Path, cache_dir: str, capsys) -> None:
    tars = write_tars(tmp_path / "tars", media()[:2], (2,))
    out = tmp_path / "out"
    assert main(["run", *run_args(tars, out, cache_dir, True), "--set", "input.id_column=id"]) == 2
    assert "each row's id is its key" in capsys.readouterr().err
    assert main(["run", *run_args(tars, out, cache_dir, True), "--set", "output.columns=[caption]"]) == 2
    assert "output.columns 'caption' is no member extension" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["run", *run_args(tmp_path / "empty", out, cache_dir, True)]) == 2
    assert "no *.tar file" in capsys.readouterr().err


def test_a_tar_behind_an_fsspec_uri_reads_as_the_local_one(tmp_path: Path) -> None:
    import fsspec

    items = media()[:3]
    local = write_tars(tmp_path / "tars", items, (3,))
    fsspec.filesystem("memory").pipe("/wds-test/00000.tar", (local / "00000.tar").read_bytes())
    rows = {}
    for path in (str(local), "memory://wds-test"):
        cfg = InputConfig(path=path, media_column="jpg", format="webdataset")
        listing = reader.scan_input(cfg, ["txt"])
        rows[path] = [(r.id, r.data, r.extra) for r in reader.read_rows(cfg, listing.fragments, columns=["txt"])]
        assert listing.files[0].size == (local / "00000.tar").stat().st_size
    assert rows["memory://wds-test"] == rows[str(local)] == [(k, d, (caption(k),)) for k, _, d in items]
