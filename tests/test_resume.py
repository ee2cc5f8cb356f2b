"""Resume after a kill, on the CPU: `embedjob run` SIGKILLed at 21 random moments and
restarted each time ends with exactly the output of an uninterrupted run, part files
byte for byte; a resume
recomputes only what was not committed; a changed job is refused, naming what changed,
unless --overwrite; a finished shard does nothing."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_shards import assert_same_rows, job_args, read_output, write_inputs

from embedjob.cli import main
from embedjob.io.checkpoint import output_files

SEED = 20261129


def manifest(out: Path, shard: int = 0) -> dict | None:
    try:
        return json.loads((out / f"_embedjob/manifest-{shard:05d}.json").read_text())
    except FileNotFoundError:
        return None


def committed_parts(out: Path) -> int:
    found = manifest(out)
    return len(found["parts"]) if found else 0


def debris(out: Path) -> list[str]:
    """Temporary files, lock files and part files the manifest does not list."""
    listed = {p["name"] for p in (manifest(out) or {"parts": []})["parts"]}
    return sorted(
        p.name for p in output_files(out)
        if ".tmp-" in p.name or p.name.startswith(".lock-") or (p.name.startswith("part-") and p.name not in listed)
    )


def assert_committed_parts_are_whole(out: Path, rows_per_part: int) -> None:
    """What a kill leaves committed: contiguous parts, each file complete with its rows."""
    for k, part in enumerate((manifest(out) or {"parts": []})["parts"]):
        assert (part["part"], part["first_row"]) == (k, k * rows_per_part)
        rows = pq.read_table(out / part["name"], columns=["row"]).column("row").to_pylist()
        assert rows == list(range(part["first_row"], part["end_row"]))


class Attempt:
    """One `python -m embedjob.cli run` in its own process group (its decode workers
    die with it, as under SLURM), logging to a file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "embedjob.cli", "run", *args],
                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, condition, timeout: float = 120) -> bool:
        """Poll `condition` until it holds (True) or the process ends (False)."""
        deadline = time.monotonic() + timeout
        while self.running():
            if condition():
                return True
            assert time.monotonic() < deadline, f"no progress in {timeout} s; log:\n{self.log.read_text()}"
            time.sleep(0.01)
        return False

    def pause(self, seconds: float, unless) -> None:
        """Wait `seconds`, less if `unless()` holds first or the process ends."""
        deadline = time.monotonic() + seconds
        while self.running() and time.monotonic() < deadline and not unless():
            time.sleep(0.005)

    def kill(self) -> bool:
        """SIGKILL the whole group; True if it was still running."""
        alive = self.running()
        if alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return alive


def part_digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("part-*.parquet"))}


KILLS = 21


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_output(tmp_path: Path, cache_dir: str) -> None:
    rows_per_part = 1  # many parts, so that every one of the kills lands between others' commits
    inputs = write_inputs(tmp_path / "in", copies=8, videos=False)
    settings = ["--set", f"output.rows_per_part={rows_per_part}", "--set", "batching.window=1",
                "--set", "preprocess.max_pixels=50176"]
    reference = tmp_path / "reference"
    assert main(["run", *job_args(inputs, reference, cache_dir), *settings]) == 0
    want = read_output(reference)
    total_parts = len(manifest(reference)["parts"])
    assert len(want) == 96 and total_parts == 96
    part_seconds = json.loads((reference / "_embedjob/stats-00000.json").read_text())["pipeline_seconds"] / total_parts

    out = tmp_path / "out"
    args = job_args(inputs, out, cache_dir) + settings
    rng = random.Random(SEED)
    # One kill between opening the checkpoint and the first commit (model load, first
    # windows), then kills at random points in the stream of commits: after a random
    # part is committed, a random fraction of a part's time later (while encoding,
    # while writing a part, between its rename and the manifest update ...), and
    # never later than two more commits, so that the kill lands before the end. The
    # moments follow progress, not the clock, so a loaded machine only slows them.
    # The last target leaves a third of the parts: on a fast machine an attempt commits
    # a few parts between two polls, and every kill must land before the end.
    targets = sorted(rng.sample(range(2, total_parts * 2 // 3), KILLS - 1))
    kills, history = [], [0]
    for attempt, target in enumerate([None, *targets]):
        run = Attempt(args, tmp_path / f"attempt-{attempt}.log")
        before = committed_parts(out)
        if target is None:
            run.wait_for(lambda: manifest(out) is not None)
        else:
            run.wait_for(lambda: committed_parts(out) >= max(target, before + 1))
        reached = committed_parts(out)
        run.pause(rng.uniform(0, 1.5 * part_seconds if target else 0.5), lambda: committed_parts(out) >= reached + 2)
        if run.kill():
            kills.append((attempt, before, committed_parts(out)))
        assert_committed_parts_are_whole(out, rows_per_part)
        history.append(committed_parts(out))
    assert len(kills) == KILLS, f"only {len(kills)} kills landed while the job ran: {kills}"
    assert history == sorted(history), f"a kill lost committed parts: {history}"
    assert all(after > before for _, before, after in kills[1:]), f"kills did not land mid-run: {kills}"

    final = Attempt(args, tmp_path / "final.log")
    assert final.proc.wait(timeout=120) == 0, final.log.read_text()
    got = read_output(out)  # every part file there is, listed or not: a leftover would show as a duplicate
    assert [r["row"] for r in got] == list(range(96)), "a row is missing or duplicated"
    assert_same_rows(got, want)
    assert part_digests(out) == part_digests(reference), "a part differs from the uninterrupted run's, byte for byte"
    assert debris(out) == []
    assert main(["verify", str(out)]) == 0
    stats = json.loads((out / "_embedjob/stats-00000.json").read_text())
    assert stats["resumed_from_row"] == history[-1] * rows_per_part and stats["rows"] == 96


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write_inputs(tmp_path / "in", videos=False)


def snapshot(out: Path) -> dict[str, int]:
    return {p.name: (out / p).stat().st_mtime_ns for p in output_files(out)}


def interrupt_after_first_part(out: Path) -> None:
    """Leave `out` as a run killed after committing part 0 and renaming parts 1 and 2
    into place (not yet in the manifest), in the middle of writing part 1 again."""
    found = manifest(out)
    found["parts"] = found["parts"][:1]
    (out / "_embedjob/manifest-00000.json").write_text(json.dumps(found))
    for name in ("_embedjob/_SUCCESS-00000", "_embedjob/stats-00000.json"):
        (out / name).unlink()
    (out / ".part-00000-00001.parquet.tmp-4242").write_bytes(b"half a part")


def test_resume_recomputes_only_the_uncommitted_rows(small: Path, tmp_path: Path, cache_dir: str) -> None:
    out = tmp_path / "out"
    assert main(["run", *job_args(small, out, cache_dir)]) == 0
    want = read_output(out)
    first_part = (out / "part-00000-00000.parquet").stat().st_mtime_ns
    interrupt_after_first_part(out)
    assert main(["run", *job_args(small, out, cache_dir)]) == 0
    stats = json.loads((out / "_embedjob/stats-00000.json").read_text())
    assert (stats["resumed_from_row"], stats["rows_this_run"], stats["rows"]) == (4, 8, 12)
    # The statistics cover the whole shard: the first run's committed rows and this run's.
    attempts = stats["attempts"]
    assert [a["resumed_from_row"] for a in attempts][-1] == 4 and attempts[-1]["rows"] == 8
    assert sum(a["rows"] for a in attempts) >= 12 and stats["items_per_second"] > 0
    assert (out / "part-00000-00000.parquet").stat().st_mtime_ns == first_part, "a committed part was rewritten"
    assert_same_rows(read_output(out), want)
    assert debris(out) == []


def test_a_changed_job_refuses_to_resume_naming_the_change_and_overwrite_replaces(
    small: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert main(["run", *job_args(small, out, cache_dir)]) == 0
    interrupt_after_first_part(out)
    before = snapshot(out)
    capsys.readouterr()
    changed = [*job_args(small, out, cache_dir), "--set", "preprocess.max_pixels=50176"]
    assert main(["run", *changed]) == 2
    err = capsys.readouterr().err
    assert "different job" in err and "preprocessing.preprocess.max_pixels: 12544 -> 50176" in err
    assert "--overwrite" in err and "\n" not in err.strip()
    assert snapshot(out) == before, "a refused run changed the output"

    assert main(["run", *changed, "--overwrite"]) == 0
    after = snapshot(out)
    assert all(after[name] != mtime for name, mtime in before.items() if name in after), "an old file survived"
    assert manifest(out)["fingerprint"]["preprocessing"]["preprocess"]["max_pixels"] == 50176
    rows = read_output(out)
    assert [r["row"] for r in rows] == list(range(12)) and debris(out) == []
    assert max(r["tokens"] for r in rows if r["tokens"]) > 16, "the new preprocessing was not applied"


def test_a_finished_shard_does_nothing(small: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "out"
    assert main(["run", *job_args(small, out, cache_dir), "--shard", "1/2"]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(["run", *job_args(small, out, cache_dir), "--shard", "1/2"]) == 0
    assert "shard 1/2: already complete" in capsys.readouterr().err
    assert snapshot(out) == before
