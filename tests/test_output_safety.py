"""No file the job creates is written through a link someone planted, a committed part
damaged while the run goes on is never marked done, an output that lost its statistics
is completed by a rerun, and a killed run's temporary record is removed. Each test runs
the builtin tiny model on the demo photos, as a user would."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_hardening import reference, run, small  # noqa: F401 (the photos, their undisturbed output)
from test_shards import assert_same_rows, job_args, read_output
from test_slurm import stand_in, stand_in_scontrol

from embedjob.cli import main
from embedjob.io import checkpoint, sink
from embedjob.io.checkpoint import META, Checkpoint
from embedjob.io.writer import PartFile

PARTS = 3
"""The demo photos (12 rows) in parts of 4 rows (`job_args`)."""


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("embedjob:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def shards_done(out: Path, capsys: pytest.CaptureFixture) -> int:
    """How many shards `embedjob status` calls done."""
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["counts"]["done"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative name, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def victims(folder: Path, count: int) -> list[Path]:
    """`count` files of someone else's, outside any output."""
    folder.mkdir()
    files = [folder / f"precious-{k}.txt" for k in range(count)]
    for k, path in enumerate(files):
        path.write_text(f"file {k}: do not overwrite\n")
    return files


# ---------------------------------------------------------------- 1. planted links


def test_links_planted_mid_run_at_the_next_parts_temporary_names_are_never_written_through(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local user reads the pid from the lock file and plants links at the names the
    next parts would be written under; the run must neither follow them nor leave them
    for readers of the output to trip over."""
    out = tmp_path / "out"
    targets = victims(tmp_path / "elsewhere", 16)
    before = snapshot(tmp_path / "elsewhere")

    class Planted(PartFile):
        def __init__(self, store, name: str, schema) -> None:
            if not planted:
                for part, target in enumerate(targets):
                    link = f".part-00000-{part:05d}.parquet.tmp-{os.getpid()}"
                    (store.path / link).symlink_to(target)
                    planted.append(link)
            super().__init__(store, name, schema)

    planted: list[str] = []
    monkeypatch.setattr(sink, "PartFile", Planted)
    assert run(small, out, cache_dir) == 0
    assert planted, "the links were planted while the run wrote its parts"
    assert snapshot(tmp_path / "elsewhere") == before, "a file outside the output was written"
    assert_same_rows(read_output(out), read_output(reference))
    assert main(["verify", str(out)]) == 0  # the planted links are gone with the run's temporaries


def test_an_output_whose_bookkeeping_folder_is_a_link_is_refused_and_the_folder_it_points_to_untouched(
    small: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir) == 0
    elsewhere = tmp_path / "elsewhere"
    (out / META).rename(elsewhere)  # someone's folder that looks like an output's bookkeeping
    (out / META).symlink_to(elsewhere)
    for name in ("_SUCCESS-00000", "stats-00000.json"):
        (elsewhere / name).unlink()  # so that a run would write them there
    before = snapshot(elsewhere)
    capsys.readouterr()

    assert run(small, out, cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert f"{out / META} is a symbolic link" in line
    assert main(["report", str(out)]) == 2
    assert f"{out / META} is a symbolic link" in one_line(capsys.readouterr().err)
    assert main(["verify", str(out)]) == 1
    assert f"{META} is a symbolic link to {elsewhere}" in capsys.readouterr().out
    assert main(["status", str(out), "--verify"]) == 1
    assert f"damaged: {META} is a symbolic link to {elsewhere}" in capsys.readouterr().out
    assert snapshot(elsewhere) == before


def test_a_link_planted_at_the_builtin_models_temporary_name_is_not_built_into(
    small: Path, tmp_path: Path, reference: Path
) -> None:
    """A model cache shared by several users: the builtin model's build must not write
    its weights into the folder a link at its old temporary name points to."""
    cache = tmp_path / "cache"
    (cache / "builtin").mkdir(parents=True)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "config.json").write_text('{"theirs": true}\n')
    before = snapshot(tmp_path / "theirs")
    (cache / "builtin" / f".tiny-qwen2_5_vl-v1.tmp-{os.getpid()}").symlink_to(tmp_path / "theirs")

    assert run(small, tmp_path / "out", str(cache)) == 0
    assert snapshot(tmp_path / "theirs") == before
    model = cache / "builtin" / "tiny-qwen2_5_vl-v1"
    assert model.is_dir() and not model.is_symlink()
    assert_same_rows(read_output(tmp_path / "out"), read_output(reference))


def test_submit_refuses_a_logs_folder_that_is_a_link_and_writes_nothing_where_it_points(
    small: Path, tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`submit` writes the job's copy and its sbatch script under `_embedjob/logs`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    stand_in(bin_dir, "sbatch", f"touch {tmp_path}/sbatch-called; echo 4242")
    stand_in_scontrol(bin_dir, "exit 1")
    out = tmp_path / "out"
    victims(tmp_path / "elsewhere", 1)
    before = snapshot(tmp_path / "elsewhere")
    (out / META).mkdir(parents=True)
    (out / META / "logs").symlink_to(tmp_path / "elsewhere")

    assert main(["submit", *job_args(small, out, cache_dir), "--shards", "2"]) == 2
    assert f"{out / META / 'logs'} is a symbolic link" in one_line(capsys.readouterr().err)
    assert snapshot(tmp_path / "elsewhere") == before
    assert not (tmp_path / "sbatch-called").exists()


# ---------------------------------------------------------------- 3. damaged while running


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside the embedding values: the footer still parses
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, flip])
def test_a_part_damaged_while_the_run_goes_on_fails_the_run_and_the_rerun_recomputes_it(
    small: Path, reference: Path, tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture, damage,
) -> None:
    out = tmp_path / "out"
    commit = Checkpoint.commit

    def damaging_part_0_after_part_1(self: Checkpoint, record: checkpoint.PartRecord) -> None:
        commit(self, record)
        if record.part == 1:
            damage(out / "part-00000-00000.parquet")

    with monkeypatch.context() as patch:
        patch.setattr(Checkpoint, "commit", damaging_part_0_after_part_1)
        assert run(small, out, cache_dir) == 1
    line = one_line(capsys.readouterr().err)
    assert "part-00000-00000.parquet" in line and "run it again" in line
    assert not (out / META / "_SUCCESS-00000").exists()

    assert main(["verify", str(out)]) == 1
    verified = capsys.readouterr().out
    assert main(["status", str(out), "--verify"]) == 1
    status = capsys.readouterr().out
    damaged = [line for line in verified.splitlines() if line.startswith("part-")]
    assert damaged and all(f"damaged: {line}" in status for line in damaged)
    assert "unfinished" in verified and shards_done(out, capsys) == 0

    assert run(small, out, cache_dir) == 0
    assert_same_rows(read_output(out), read_output(reference))
    assert main(["verify", str(out)]) == 0
    assert main(["status", str(out), "--verify"]) == 0


def test_a_finished_shard_that_lost_its_statistics_is_completed_by_a_rerun_not_called_complete(
    small: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir) == 0
    parts = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    stats = out / META / "stats-00000.json"
    rows = json.loads(stats.read_text())["rows"]
    stats.unlink()
    assert main(["verify", str(out)]) == 1
    assert main(["status", str(out), "--verify"]) == 1
    assert shards_done(out, capsys) == 0

    assert run(small, out, cache_dir) == 0
    assert "already complete" not in capsys.readouterr().err
    assert json.loads(stats.read_text())["rows"] == rows
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")} == parts, "no part is recomputed"
    assert main(["verify", str(out)]) == 0
    assert main(["status", str(out), "--verify"]) == 0
    assert shards_done(out, capsys) == 1


# ---------------------------------------------------------------- 7. a killed run's record


def test_the_temporary_record_of_a_killed_run_is_removed_by_the_next(small: Path, tmp_path: Path, cache_dir: str) -> None:
    out = tmp_path / "out"
    assert run(small, out, cache_dir) == 0
    left = out / META / f".job.json.tmp-4242-{'0' * 16}"
    left.write_text('{"fingerprint": ')  # killed while writing the output's record
    assert run(small, out, cache_dir) == 0
    assert not left.exists()
