"""Issue #51: a job that says plainly what happened. One test (or a few) per item, each
on what a user sees: the exit code, the one line, what `status`, `verify` and the report
say of the output, the files a signal leaves."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from embedjob.cli import main
from embedjob.io.checkpoint import META

DEMO = REPO / "jobs" / "demo.yaml"
DEMO_DATA = REPO / "jobs" / "data" / "demo-images.parquet"


def run(job: Path, out: Path, cache_dir: str, *extra: str) -> int:
    """`embedjob run` of a job into `out`, decoding in this process, without a bar."""
    sets = {"output.path": out, "runtime.cache_dir": cache_dir, "runtime.workers": 0, "runtime.progress": "false"}
    return main(["run", str(job), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), *extra])


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.startswith("embedjob:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def path_inputs(directory: Path, names: list[str]) -> Path:
    """A Parquet file whose `image` column holds file names (relative to a media root)."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [f"r{i}" for i in range(len(names))], "image": names})
    pq.write_table(table, directory / "paths.parquet")
    return directory / "paths.parquet"


# ---------------------------------------------------------------- 1. a job whose rows mostly fail


def test_a_job_whose_every_row_is_not_found_exits_1_naming_the_code_and_finishes_nothing(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    """The issue's wrong media_root: fewer rows than error_rate_min_rows, all of them
    `not_found`; the default limit still stops the shard at its end."""
    inputs = path_inputs(tmp_path / "in", [f"photo-{i}.jpg" for i in range(8)])
    (tmp_path / "wrong-root").mkdir()
    out = tmp_path / "out"
    code = run(DEMO, out, cache_dir, "--set", f"input.path={inputs}", "--set", f"input.media_root={tmp_path / 'wrong-root'}")
    line = one_line(capsys.readouterr().err)
    assert code == 1, line
    assert "8 of 8 rows are errors" in line and "not_found 8" in line and "runtime.max_error_rate" in line
    assert not (out / META / "_SUCCESS-00000").exists()
    assert main(["status", str(out)]) == 0
    assert " 0 done" in capsys.readouterr().out


@pytest.fixture(scope="module")
def failing_output(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    """A finished shard of 12 rows, 7 of them errors (the limit switched off): the demo's
    first five photos and seven text files."""
    base = tmp_path_factory.mktemp("failing")
    demo = pq.read_table(DEMO_DATA).to_pylist()
    rows = demo[:5] + [{"id": f"text-{i}", "image": b"not an image at all"} for i in range(7)]
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(DEMO_DATA)), base / "in.parquet")
    out = base / "out"
    assert run(DEMO, out, cache_dir, "--set", f"input.path={base / 'in.parquet'}", "--set", "runtime.max_error_rate=null") == 0
    return out


def test_status_flags_a_finished_shard_whose_rows_are_mostly_errors(failing_output: Path, capsys) -> None:
    assert main(["status", str(failing_output)]) == 0
    out = capsys.readouterr().out
    assert "1 done" in out
    (warning,) = [line for line in out.splitlines() if line.startswith("warning:")]
    assert "shard 0 finished with 7 of 12 rows as errors (58%" in warning and "unknown_format 7" in warning
    assert main(["status", "--json", str(failing_output)]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == [warning.removeprefix("warning: ")]


def test_verify_warns_of_such_a_shard_but_still_finds_it_intact(failing_output: Path, capsys) -> None:
    assert main(["verify", str(failing_output)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("warning: shard 0 finished with 7 of 12 rows as errors") for line in lines)
    assert lines[-1].endswith("intact, 1 warning")
    assert main(["verify", "--json", str(failing_output)]) == 0
    assert len(json.loads(capsys.readouterr().out)["warnings"]) == 1


def test_the_report_does_not_show_such_a_shard_as_a_green_success(failing_output: Path, tmp_path: Path) -> None:
    assert main(["report", str(failing_output), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert 'id="warnings"' in page and "7 of 12 rows as errors" in page
    assert 'class="text state-warned" data-key="state">done' in page

