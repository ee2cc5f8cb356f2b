"""Issue #15: wrong output with exit 0, files followed where they must not be, unbounded
memory per item. One test per finding, each as a user would meet it: a damaged part
is recomputed or reported, an output holds one job, a changed input is refused, a
planted symlink is never written through or read through, a path column needs a
root, an oversized item is one error row, and the smaller exit-code and log fixes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from PIL import Image
from test_resume import interrupt_after_first_part, manifest
from test_shards import DATA, assert_same_rows, job_args, read_output, write_inputs

from embedjob.cli import main
from embedjob.config import InputConfig
from embedjob.decode import DecodeOptions, MediaError, decode, read_source
from embedjob.decode.containers import matroska_frame_size
from embedjob.io import checkpoint, reader
from embedjob.slurm import LogDir, SubmitOptions, TaskCommand, render_script

DEMO = str(REPO / "jobs" / "demo.yaml")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("inputs"), videos=False)


@pytest.fixture(scope="module")
def reference(small: Path, cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted single-shard output of `small`."""
    out = tmp_path_factory.mktemp("reference")
    assert main(["run", *job_args(small, out, cache_dir)]) == 0
    return out


def run(inputs: Path, out: Path, cache_dir: str, *extra: str) -> int:
    return main(["run", *job_args(inputs, out, cache_dir), *extra])


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("embedjob:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- 1. parts are verified


def test_a_part_truncated_between_a_kill_and_the_rerun_is_recomputed_not_trusted(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir) == 0
    found = manifest(out)
    found["parts"] = found["parts"][:2]  # killed after committing parts 0 and 1
    (out / "_embedjob/manifest-00000.json").write_text(json.dumps(found))
    for name in ("_embedjob/_SUCCESS-00000", "_embedjob/stats-00000.json", "part-00000-00002.parquet"):
        (out / name).unlink()
    part = out / "part-00000-00001.parquet"
    os.truncate(part, part.stat().st_size // 2)

    assert run(small, out, cache_dir) == 0
    assert "part-00000-00001.parquet" in caplog.text and "recomputing rows from 4" in caplog.text
    assert_same_rows(read_output(out), read_output(reference))  # pyarrow opens every part
    stats = json.loads((out / "_embedjob/stats-00000.json").read_text())
    assert stats["resumed_from_row"] == 4
    assert main(["verify", str(out)]) == 0


def test_a_bit_flip_after_success_is_named_by_verify_and_recomputed_by_a_rerun(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    assert "1 shard; 3 parts, 12 rows checked; intact" in capsys.readouterr().out

    part = out / "part-00000-00001.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside the embedding values, the footer still parses
    part.write_bytes(bytes(data))
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out
    assert "part-00000-00001.parquet does not match its recorded sha256" in report and "1 problem" in report
    assert main(["status", str(out), "--verify"]) == 1
    assert "damaged: part-00000-00001.parquet" in capsys.readouterr().out

    assert run(small, out, cache_dir) == 0
    assert_same_rows(read_output(out), read_output(reference))
    assert main(["verify", str(out)]) == 0


def test_verify_names_every_bad_file_of_every_shard(small: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "out"
    for shard in range(3):
        assert run(small, out, cache_dir, "--shard", f"{shard}/3") == 0
    first = sorted(out.glob("part-00000-*.parquet"))[0]
    first.write_bytes(first.read_bytes()[:-10])
    (out / "_embedjob/stats-00001.json").unlink()
    shutil.copy(sorted(out.glob("part-00002-*.parquet"))[0], out / "part-00002-00009.parquet")
    (out / "_embedjob/_SUCCESS-00007").write_text("{}")
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    report = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"{first.name} has ") and "bytes where" in line for line in report)
    assert "_embedjob/stats-00001.json is missing for the finished shard 1" in report
    assert any(line.startswith("part-00002-00009.parquet is not listed in _embedjob/manifest-00002.json") for line in report)
    assert "_embedjob/_SUCCESS-00007 belongs to shard 7, but the output has 3 shards" in report
    # Shard 2 holds both broken rows of four: flagged, but a warning is no problem.
    assert report[-1].endswith("4 problems, 1 warning")


# ---------------------------------------------------------------- 2. one output, one job


def test_a_second_shard_layout_into_a_finished_output_is_refused(small: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir, "--shard", "0/1") == 0
    before = sorted(p.name for p in checkpoint.output_files(out))
    capsys.readouterr()
    assert run(small, out, cache_dir, "--shard", "1/2") == 2
    line = one_line(capsys.readouterr().err)
    assert "different job" in line and "num_shards: 1 -> 2" in line and "--overwrite" in line
    assert sorted(p.name for p in checkpoint.output_files(out)) == before
    assert len(read_output(out, 2)) == 12, "rows of two layouts in one output"


def test_another_pooling_and_dtype_beside_a_shard_is_refused_naming_both(
    small: Path, tmp_path: Path, cache_dir: str, capsys
) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir, "--shard", "0/2") == 0
    capsys.readouterr()
    assert run(small, out, cache_dir, "--shard", "1/2", "--set", "output.pooling=none", "--set", "output.dtype=float16") == 2
    line = one_line(capsys.readouterr().err)
    assert "pooling: 'mean' -> 'none'" in line and "output_dtype: 'float32' -> 'float16'" in line
    assert not list(out.glob("part-00001-*"))


def test_overwrite_with_another_shard_count_removes_every_shard_of_the_old_job(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, capsys
) -> None:
    out = tmp_path / "out"
    for shard in range(2):
        assert run(small, out, cache_dir, "--shard", f"{shard}/2") == 0
    assert run(small, out, cache_dir, "--shard", "0/3") == 2
    assert run(small, out, cache_dir, "--shard", "0/3", "--overwrite") == 0
    assert not [p for p in checkpoint.output_files(out) if checkpoint.shard_file_index(p.name) == 1], "the old shard 1 survived"
    for shard in (1, 2):
        assert run(small, out, cache_dir, "--shard", f"{shard}/3") == 0
    assert_same_rows(read_output(out, 3), read_output(reference))
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    assert "3 shards: 3 done" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0


def test_an_overwrite_killed_while_removing_the_old_job_is_finished_by_the_next_run_and_refuses_the_old(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "out"
    for shard in range(2):
        assert run(small, out, cache_dir, "--shard", f"{shard}/2") == 0
    removed = []
    real_unlink = Path.unlink

    def killed_after_three(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith(("part-", "manifest-", "stats-", "_SUCCESS-")):
            if len(removed) == 3:
                raise KeyboardInterrupt  # as good as SIGKILL here: nothing after it runs
            removed.append(path.name)
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", killed_after_three)
    assert run(small, out, cache_dir, "--overwrite") == 130
    monkeypatch.undo()
    assert json.loads((out / checkpoint.JOB_RECORD).read_text())["state"] == "replacing"
    capsys.readouterr()
    assert run(small, out, cache_dir, "--shard", "1/2") == 2, "the old job resumed into a half-removed output"
    assert "num_shards: 1 -> 2" in capsys.readouterr().err
    assert run(small, out, cache_dir) == 0
    assert_same_rows(read_output(out), read_output(reference))
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p.name for p in reference.glob("part-*"))


def test_submit_checks_the_output_record_too(small: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir, "--shard", "0/1") == 0
    capsys.readouterr()
    assert main(["submit", *job_args(small, out, cache_dir), "--shards", "2", "--dry-run"]) == 2
    assert "num_shards: 1 -> 2" in one_line(capsys.readouterr().err)
    assert main(["submit", *job_args(small, out, cache_dir), "--shards", "2", "--dry-run", "--overwrite"]) == 0
    assert "--array=0-1" in capsys.readouterr().out


# ---------------------------------------------------------------- 3. input identity


def test_an_input_file_rewritten_in_place_is_refused_at_resume(small: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    inputs = tmp_path / "in"
    shutil.copytree(small, inputs)
    out = tmp_path / "out"
    assert run(inputs, out, cache_dir) == 0
    interrupt_after_first_part(out)
    table = pq.read_table(inputs / "b.parquet")
    group = pq.ParquetFile(inputs / "b.parquet").metadata.row_group(0).num_rows
    # The same rows in another order: every row count and row-group size stays the same.
    pq.write_table(table.take(list(reversed(range(len(table))))), inputs / "b.parquet", row_group_size=group)
    capsys.readouterr()
    assert run(inputs, out, cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert f"input file {inputs / 'b.parquet'} changed" in line and "different job" in line


def test_the_listing_records_each_files_size_and_footer_hash(small: Path) -> None:
    listing = reader.scan_input(InputConfig(path=str(small), media_column="image"))
    assert [Path(f.path).name for f in listing.files] == ["a.parquet", "b.parquet", "c.parquet"]
    for f in listing.files:
        data = Path(f.path).read_bytes()
        footer = int.from_bytes(data[-8:-4], "little")
        assert f.size == len(data) and f.footer_sha256 == hashlib.sha256(data[-8 - footer :]).hexdigest()


# ---------------------------------------------------------------- 4, 5, 7: files followed


@pytest.mark.parametrize("name", [".lock-00000", ".lock-job"])
def test_a_lock_symlink_planted_in_the_output_is_refused_and_its_target_untouched(
    small: Path, tmp_path: Path, cache_dir: str, capsys, name: str
) -> None:
    out = tmp_path / "out"
    (out / checkpoint.META).mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me\n")
    (out / checkpoint.META / name).symlink_to(victim)
    assert run(small, out, cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert "is a symbolic link" in line and name in line
    assert victim.read_text() == "do not truncate me\n"


def test_a_json_file_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    from embedjob.io.files import write_json

    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "manifest-00000.json").symlink_to(victim)
    write_json(tmp_path / "manifest-00000.json", {"parts": []})
    assert victim.read_text() == "keep" and not (tmp_path / "manifest-00000.json").is_symlink()


def jpeg_bytes() -> bytes:
    return (DATA / "img2dataset_123_456.jpg").read_bytes()


def test_a_media_file_swapped_for_a_symlink_after_the_reader_checked_it_is_not_read(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.jpg").write_bytes(jpeg_bytes())
    (root / "inside.jpg").symlink_to(root / "a.jpg")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(b"secret bytes")
    pq.write_table(pa.table({"p": ["a.jpg", "inside.jpg"]}), tmp_path / "paths.parquet")
    cfg = InputConfig(path=str(tmp_path / "paths.parquet"), media_column="p", media_root=str(root))
    rows = list(reader.read_rows(cfg, reader.list_fragments(cfg)))
    assert [r.error for r in rows] == [None, None]
    real_root = reader.local_media_root(cfg)
    assert read_source(rows[1].uri, real_root) == jpeg_bytes(), "a symlink inside the root is fine"

    (root / "a.jpg").unlink()
    (root / "a.jpg").symlink_to(secret)  # swapped between the reader's check and the worker's open
    with pytest.raises(MediaError) as err:
        read_source(rows[0].uri, real_root)
    assert err.value.code == "path_escape" and "secret bytes" not in str(err.value)


def path_dataset(directory: Path, paths: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(paths))], "image": paths}), directory / "paths.parquet")
    return directory


def test_a_path_column_without_media_root_is_a_job_error_naming_both_ways_out(
    tmp_path: Path, cache_dir: str, capsys
) -> None:
    inputs = path_dataset(tmp_path / "in", ["/etc/passwd"])
    assert run(inputs, tmp_path / "out", cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert "input.media_root" in line and "input.allow_any_path: true" in line
    assert not (tmp_path / "out").exists()


def test_with_allow_any_path_a_non_media_file_is_an_error_row_that_does_not_echo_it(
    tmp_path: Path, cache_dir: str
) -> None:
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    inputs = path_dataset(tmp_path / "in", [str(text)])
    out = tmp_path / "out"
    # Its one row fails: the default error limit would stop the shard.
    assert run(inputs, out, cache_dir, "--set", "input.allow_any_path=true", "--set", "runtime.max_error_rate=null") == 0
    (row,) = read_output(out)
    assert row["error"].startswith("unknown_format: ")
    assert "root:x" not in row["error"] and "726f6f74" not in row["error"], row["error"]


# ---------------------------------------------------------------- 9. memory per item


def test_an_oversized_file_is_one_too_large_row_found_from_its_size(tmp_path: Path, cache_dir: str) -> None:
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.jpg").write_bytes(jpeg_bytes())
    huge = root / "huge.jpg"
    with huge.open("wb") as f:
        f.truncate(600 * 2**20)  # sparse: 600 MB by its size, nothing on disk
    inputs = path_dataset(tmp_path / "in", ["ok.jpg", "huge.jpg", "ok.jpg"])
    out = tmp_path / "out"
    assert run(inputs, out, cache_dir, "--set", f"input.media_root={root}") == 0
    rows = read_output(out)
    assert [r["error"] is None for r in rows] == [True, False, True]
    assert rows[1]["error"] == f"too_large: {huge}: {600 * 2**20} bytes, more than input.max_item_bytes = {512 * 2**20}"


def test_an_oversized_bytes_cell_is_one_too_large_row(small: Path, tmp_path: Path, cache_dir: str) -> None:
    out = tmp_path / "out"
    limit = 20_000
    # Most cells are over the limit: the default error limit would stop the shard.
    assert run(small, out, cache_dir, "--set", f"input.max_item_bytes={limit}", "--set", "runtime.max_error_rate=null") == 0
    sizes = [len(b) for b in pq.read_table(small, columns=["image"]).column("image").to_pylist()]
    rows = read_output(out)
    for row, size in zip(rows, sizes, strict=True):
        if size > limit:
            assert row["error"] == f"too_large: the media cell holds {size} bytes, more than input.max_item_bytes = {limit}"
    assert any(s > limit for s in sizes) and any(r["error"] is None for r in rows)


def video_declaring(width: int, height: int) -> bytes:
    """A real small MOV whose sample entry claims frames of width x height."""
    data = bytearray((DATA / "decord_video_0.mov").read_bytes())
    at = data.index(b"avc1", data.index(b"stsd")) + 28
    assert struct.unpack_from(">HH", data, at) == (568, 320)
    struct.pack_into(">HH", data, at, width, height)
    return bytes(data)


def test_a_video_declaring_huge_frames_is_one_too_large_row_before_decoding(tmp_path: Path, cache_dir: str) -> None:
    clip = (DATA / "decord_video_0.mov").read_bytes()
    inputs = tmp_path / "in"
    inputs.mkdir()
    table = pa.table({"id": ["ok", "huge"], "image": [clip, video_declaring(16000, 16000)]})
    pq.write_table(table, inputs / "v.parquet")
    out = tmp_path / "out"
    assert run(inputs, out, cache_dir) == 0
    ok, huge = read_output(out)
    assert ok["error"] is None and ok["modality"] == "video"
    assert huge["error"] == (
        "too_large: video frames of 16000x16000 = 256000000 pixels (declared by the container) "
        "exceed video.max_pixels_per_frame = 50000000"
    )


def test_the_decoded_frame_size_and_the_sampled_total_are_capped() -> None:
    clip = (DATA / "decord_video_0.mov").read_bytes()
    options = DecodeOptions("video", 10**9, 2.0, 8, 2, decoder_threads=0)
    shape = decode(clip, options).frames.shape
    frames, height, width = shape[0], shape[1], shape[2]
    limit = frames * height * width - 1
    with pytest.raises(MediaError, match=rf"{frames} sampled frames of {width}x{height} = .* exceed video.max_total_pixels = {limit}"):
        decode(clip, DecodeOptions("video", 10**9, 2.0, 8, 2, video_pixel_limit=limit))
    lying = video_declaring(64, 64)  # the header understates; the decoded frame tells
    with pytest.raises(MediaError, match=r"568x320 = 181760 pixels \(decoded\)"):
        decode(lying, DecodeOptions("video", 10**9, 2.0, 8, 2, frame_pixel_limit=64 * 64))


def test_matroska_headers_declare_their_frame_size() -> None:
    head = (DATA / "torchcodec_av1_video.mkv").read_bytes()[: 1 << 16]
    assert matroska_frame_size(head) == (640, 360)


def test_an_oversized_remote_object_is_refused_from_its_size(tmp_path: Path) -> None:
    import fsspec

    with fsspec.open("memory://hardening/big.bin", "wb") as f:
        f.write(b"x" * 5000)
    with pytest.raises(MediaError, match="too_large: memory://hardening/big.bin: 5000 bytes"):
        read_source("memory://hardening/big.bin", max_bytes=4096)
    assert read_source("memory://hardening/big.bin", max_bytes=5000) == b"x" * 5000


# ---------------------------------------------------------------- 8. dry-run scripts

NASTY_JOB = "job\ntouch PWNED\n.yaml"


def test_a_job_file_name_with_a_newline_stays_one_argument_in_the_script(tmp_path: Path) -> None:
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\njson.dump(sys.argv[1:], open(os.environ['ARGS_OUT'], 'w'))\n")
    stand_in.chmod(0o755)
    logs = LogDir(tmp_path / "out" / "_embedjob" / "logs", "output.path")
    task = TaskCommand(tmp_path / NASTY_JOB, (), logs, tmp_path, str(stand_in), None, "embedjob-job")
    script = render_script(task, [0], SubmitOptions(num_shards=1))
    assert script.splitlines()[1].endswith("; written by `embedjob submit`."), "the comment must stay one line"
    (tmp_path / "job.sbatch").write_text(script)
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "0", "ARGS_OUT": str(tmp_path / "args.json")}
    subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert not (tmp_path / "PWNED").exists()
    assert json.loads((tmp_path / "args.json").read_text())[3] == str(tmp_path / NASTY_JOB)


def test_dry_run_prints_a_script_whose_comment_escapes_the_job_file_name(
    small: Path, tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = job_args(small, tmp_path / "out", cache_dir)
    nasty = tmp_path / NASTY_JOB
    shutil.copy(args[0], nasty)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(nasty), *args[1:], "--shards", "1", "--dry-run"]) == 0
    script = capsys.readouterr().out
    comment = [line for line in script.splitlines() if line.startswith("# embedjob:")]
    assert comment == [f"# embedjob: 1 shard of {tmp_path}/job\\ntouch PWNED\\n.yaml; written by `embedjob submit`."]
    (tmp_path / "printed.sbatch").write_text(script.replace(sys.executable, "true"))
    subprocess.run(["bash", str(tmp_path / "printed.sbatch")], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "SLURM_ARRAY_TASK_ID": "0"})
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- smaller


def test_a_full_disk_is_exit_1_at_start_and_mid_run(
    small: Path, tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "write_record", full)
        assert run(small, tmp_path / "start", cache_dir) == 1
    assert "No space left on device" in one_line(capsys.readouterr().err)

    from embedjob.io.files import TMP_MARK
    from embedjob.io.writer import PartFile

    real = PartFile.write
    calls = []

    def full_after_one(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            full()
        return real(*args, **kwargs)

    monkeypatch.setattr(PartFile, "write", full_after_one)
    assert run(small, tmp_path / "mid", cache_dir) == 1
    assert "No space left on device" in one_line(capsys.readouterr().err)
    assert not [p for p in (tmp_path / "mid").rglob("*") if TMP_MARK in p.name]  # the part it was writing is gone


def test_a_checkpoint_torch_refuses_to_unpickle_is_one_line_exit_2(
    tmp_path: Path, cache_dir: str, capsys, qwen_adapter
) -> None:
    builtin = next(Path(cache_dir, "builtin").glob("tiny-qwen2_5_vl-v*"))  # made by the fixture
    model = tmp_path / "model"
    model.mkdir()
    for config in builtin.glob("*.json"):
        shutil.copy(config, model)
    marker = tmp_path / "PWNED"
    torch.save({"w": _Payload(str(marker))}, model / "pytorch_model.bin")
    data = REPO / "jobs" / "data" / "demo-images.parquet"
    code = main(["run", DEMO, "--set", f"input.path={data}", "--set", f"output.path={tmp_path / 'out'}",
                 "--set", f"runtime.cache_dir={cache_dir}", "--set", f"model.path={model}", "--set", "runtime.workers=0"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and "torch refuses to load" in line and "safetensors" in line
    assert not marker.exists()


class _Payload:
    """What a malicious checkpoint holds: unpickling it would run a command."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_decoded_pngs_are_writable_so_no_numpy_warning_reaches_the_log(tmp_path: Path, qwen_adapter) -> None:
    buffer = tmp_path / "rgb.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(buffer)
    decoded = decode(buffer.read_bytes(), DecodeOptions("image", 10**9, 2.0, 8, 2))
    assert decoded.pixels.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qwen_adapter.preprocessor()(decoded)
