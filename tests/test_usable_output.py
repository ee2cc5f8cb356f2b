"""Tests for issue #16: output that users read with their usual tools and trust, no
silent defaults, errors that reach the user. One test (or a few) per item of the issue,
each on what a user sees: the rows their tools read, the lines the commands print."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

import embedjob
from embedjob.cli import main
from embedjob.config import JobError, describe, job_from_dict, keys
from embedjob.io.checkpoint import META, open_checkpoint
from embedjob.slurm import format_status, output_status

DEMO = REPO / "jobs" / "demo.yaml"
DEMO_CLIP = REPO / "jobs" / "demo-clip.yaml"
DEMO_DATA = REPO / "jobs" / "data" / "demo-images.parquet"
README = (REPO / "README.md").read_text()
REFERENCE = (REPO / "docs" / "configuration.md").read_text()


def run(job: Path, out: Path, cache_dir: str, *extra: str) -> int:
    """`embedjob run` of a shipped job into `out`, decoding in this process."""
    sets = {"output.path": out, "runtime.cache_dir": cache_dir, "runtime.workers": 0, "runtime.progress": "false"}
    return main(["run", str(job), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), *extra])


def parts(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.startswith("embedjob:")]
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    """The demo's output: 10 photos, a truncated JPEG (row 10) and a text file (row 11)."""
    out = tmp_path_factory.mktemp("usable") / "out" / "demo"
    assert run(DEMO, out, cache_dir) == 0
    return out


# ---------------------------------------------------------------- 1. null error vectors


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_error_rows_have_a_null_embedding_that_no_similarity_search_ranks_first(
    demo: Path, tmp_path: Path, cache_dir: str, pooling: str
) -> None:
    import duckdb

    out = demo if pooling == "mean" else tmp_path / "none"
    if pooling == "none":
        assert run(DEMO, out, cache_dir, "--set", "output.pooling=none") == 0
    rows = parts(out)
    assert [r["embedding"] is None for r in rows] == [False] * 10 + [True] * 2
    assert all((r["embedding"] is None) == (r["error"] is not None) for r in rows)
    if pooling == "none":
        return
    # The searches: nearest neighbours of row 0 in DuckDB and NumPy.
    glob = f"{out}/**/*.parquet"
    query = f"(SELECT embedding FROM read_parquet('{glob}') WHERE row = 0)::FLOAT[128]"
    ranked = duckdb.sql(
        f"SELECT row FROM read_parquet('{glob}') ORDER BY array_cosine_similarity(embedding::FLOAT[128], {query}) DESC"
    ).fetchall()
    assert [r for (r,) in ranked][-2:] == [10, 11], "error rows must sort last, never first"
    vectors = np.stack([np.array(r["embedding"], dtype=np.float32) for r in rows if r["embedding"] is not None])
    assert np.isfinite(vectors).all() and np.isfinite(vectors.mean(axis=0)).all()


# ---------------------------------------------------------------- 2. a readable directory


def test_the_output_directory_reads_as_a_dataset_in_pandas_arrow_polars_and_duckdb(demo: Path) -> None:
    import duckdb
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    expected = list(range(12))
    assert sorted(pd.read_parquet(demo)["row"]) == expected
    assert sorted(ds.dataset(demo, format="parquet").to_table()["row"].to_pylist()) == expected
    assert sorted(pl.read_parquet(f"{demo}/**/*.parquet")["row"].to_list()) == expected
    assert sorted(pl.scan_parquet(f"{demo}/**/*.parquet").collect()["row"].to_list()) == expected
    assert sorted(r for (r,) in duckdb.sql(f"SELECT row FROM read_parquet('{demo}/**/*.parquet')").fetchall()) == expected
    top = sorted(p.name for p in demo.iterdir())
    assert top == [META, "part-00000-00000.parquet", "part-00000-00001.parquet", "part-00000-00002.parquet"]


def _readme_section(title: str) -> str:
    start = README.index(f"## {title}\n")
    return README[start : README.index("\n## ", start + 1)]


def test_the_output_is_described_and_the_readmes_pandas_and_duckdb_examples_run(demo: Path) -> None:
    layout = (REPO / "docs" / "output.md").read_text()
    assert "_embedjob/" in layout and "manifest-00000.json" in layout and "stats-00000.json" in layout
    section = _readme_section("Reading the output")
    assert "docs/output.md" in section
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and "pandas" in blocks[0] and "duckdb" in blocks[1]
    cwd = os.getcwd()
    os.chdir(demo.parent.parent)  # the examples read out/demo
    try:
        pandas_example, duckdb_example = {}, {}
        exec(blocks[0], pandas_example)
        exec(blocks[1], duckdb_example)
    finally:
        os.chdir(cwd)
    assert pandas_example["vectors"].shape == (10, 128)
    nearest = duckdb_example["nearest"]
    assert nearest[0][0] == 0 and all(error is None for _, _, error, _ in nearest), "error rows won the search"


def _old_layout(out: Path) -> None:
    """What an embedjob before issue #16 left: bookkeeping beside the parts."""
    out.mkdir(parents=True)
    (out / "part-00000-00000.parquet").write_bytes(b"old part")
    (out / "manifest-00000.json").write_text(json.dumps({"parts": []}))
    (out / "_embedjob.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "logs" / "shard-00000-job-1.log").write_text("old log\n")


def test_an_output_of_the_earlier_layout_is_refused_saying_what_to_do(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "old"
    _old_layout(out)
    assert run(DEMO, out, cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert "earlier embedjob" in line and "new output.path" in line and "--overwrite" in line
    assert main(["status", str(out)]) == 2 and "earlier embedjob" in capsys.readouterr().err
    assert main(["verify", str(out)]) == 2 and "earlier embedjob" in capsys.readouterr().err
    assert (out / "manifest-00000.json").exists(), "a refused run must touch nothing"
    assert run(DEMO, out, cache_dir, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [META, *(f"part-00000-0000{k}.parquet" for k in range(3))]
    assert (out / META / "logs" / "shard-00000-job-1.log").read_text() == "old log\n", "logs are kept"
    assert len(parts(out)) == 12


# ---------------------------------------------------------------- 3. no silent random weights


def test_a_job_without_a_model_is_refused_and_builtin_models_are_named_random(
    demo: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"input: {{path: {DEMO_DATA}, media_column: image}}\noutput: {{path: {tmp_path / 'o'}}}\n")
    assert main(["run", str(job)]) == 2
    assert "model.path is required" in one_line(capsys.readouterr().err)
    assert main(["run", str(job), "--set", "model.family=clip"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "model.path is required" in line and "builtin:tiny-qwen2_5_vl" not in line
    assert not (tmp_path / "o").exists(), "nothing may be written for a job without a model"
    with caplog.at_level(logging.WARNING, logger="embedjob"):
        assert run(DEMO, tmp_path / "demo", cache_dir) == 0
    assert any("builtin:tiny-qwen2_5_vl" in r.message and "random weights" in r.message for r in caplog.records)


# ---------------------------------------------------------------- 4. empty shards warn


def test_running_a_shard_without_rows_warns_why_and_what_to_do(
    tmp_path: Path, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    single = tmp_path / "one-group.parquet"
    pq.write_table(pq.read_table(DEMO_DATA), single, row_group_size=100)
    with caplog.at_level(logging.WARNING, logger="embedjob"):
        assert run(DEMO, tmp_path / "out", cache_dir, "--set", f"input.path={single}", "--shard", "1/2") == 0
    warning = " ".join(r.message for r in caplog.records if r.levelno == logging.WARNING and "no rows" in r.message)
    assert "shard 1/2 has no rows" in warning and "1 row group for 2 shards" in warning
    assert "N <= 1" in warning and "row_group_size" in warning


# ---------------------------------------------------------------- 5. errors reach the user


def test_error_codes_reach_the_statistics_the_summary_and_status(
    demo: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    stats = json.loads((demo / META / "stats-00000.json").read_text())
    assert stats["error_codes"] == {"truncated": 1, "unknown_format": 1}
    assert run(DEMO, tmp_path / "again", cache_dir) == 0
    assert "2 errors (truncated 1, unknown_format 1)" in capsys.readouterr().err
    assert main(["status", str(demo)]) == 0
    assert "errors by code: truncated 1, unknown_format 1" in capsys.readouterr().out


def test_max_error_rate_stops_the_shard_with_one_line_and_keeps_its_committed_parts(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    # Chunks of 6 rows: the first (no error) is written, the second (2 errors) stops the shard.
    limits = ("--set", "runtime.max_error_rate=0.1", "--set", "runtime.error_rate_min_rows=6", "--set", "batching.window=6")
    assert run(DEMO, out, cache_dir, *limits) == 1
    line = one_line(capsys.readouterr().err)
    assert "2 of 12 rows are errors (16.7%), above runtime.max_error_rate = 0.1" in line
    assert "truncated 1, unknown_format 1" in line and "committed parts are kept" in line
    manifest = json.loads((out / META / "manifest-00000.json").read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [(0, 5)]
    assert not (out / META / "_SUCCESS-00000").exists()
    assert run(DEMO, out, cache_dir, "--set", "batching.window=6") == 0, "without the limit the shard resumes"
    # The summary counts this run's rows apart from the shard's (item 8: a resumed run).
    summary = capsys.readouterr().err.splitlines()[-1]
    assert "12 rows, 2 errors" in summary and "this run: 7 rows, resumed at row 5 in " in summary
    assert len(parts(out)) == 12


# ---------------------------------------------------------------- 6. per-token output with its grid


def test_pooling_none_gives_patch_tokens_with_their_grid_for_fixed_resolution_families(
    tmp_path: Path, cache_dir: str
) -> None:
    assert run(DEMO_CLIP, tmp_path / "clip", cache_dir, "--set", "output.pooling=none", "--set", "output.dtype=float32") == 0
    for row in parts(tmp_path / "clip")[:10]:
        # 64 px views of 16 px patches: a 1 x 4 x 4 grid of projected (48-wide) tokens; CLS not among them.
        assert row["grid"] == [1, 4, 4] and np.array(row["embedding"]).shape == (16, 48) and row["tokens"] == 17
    # DINOv2's patch_mean vector is the mean of its patch tokens: the rows are the real tokens, in order of the grid.
    sets = ("--set", "model.family=dinov2", "--set", "model.path=builtin:tiny-dinov2", "--set", "output.dtype=float32")
    assert run(DEMO_CLIP, tmp_path / "tokens", cache_dir, *sets, "--set", "output.pooling=none") == 0
    assert run(DEMO_CLIP, tmp_path / "mean", cache_dir, *sets, "--set", "model.pool=patch_mean") == 0
    for token_row, mean_row in zip(parts(tmp_path / "tokens")[:10], parts(tmp_path / "mean")[:10], strict=True):
        tokens = np.array(token_row["embedding"], dtype=np.float32)
        assert token_row["grid"] == [1, 4, 4] and tokens.shape == (16, 64)
        assert np.allclose(tokens.mean(axis=0), mean_row["embedding"], rtol=1e-4, atol=1e-5)


def test_pooling_none_rows_of_qwen_carry_the_grid_of_their_merged_tokens(tmp_path: Path, cache_dir: str) -> None:
    assert run(DEMO, tmp_path / "out", cache_dir, "--set", "output.pooling=none") == 0
    rows = parts(tmp_path / "out")
    for row in rows[:10]:
        t, h, w = row["grid"]
        assert t == 1 and t * h * w == len(row["embedding"]) == row["tokens"]
    assert rows[10]["grid"] is None and rows[11]["grid"] is None


def test_per_token_output_with_tiles_is_a_job_error() -> None:
    raw = {"input": {"path": "x", "media_column": "m"}, "model": {"family": "clip", "path": "builtin:tiny-clip"},
           "output": {"path": "o", "pooling": "none"}, "preprocess": {"tiling": "anyres"}}
    with pytest.raises(JobError, match="use preprocess.tiling: none for per-token output"):
        job_from_dict(raw)


# ---------------------------------------------------------------- 7. normalised vectors, input columns, Python API


def test_normalize_writes_unit_vectors(demo: Path, tmp_path: Path, cache_dir: str) -> None:
    assert run(DEMO, tmp_path / "unit", cache_dir, "--set", "output.normalize=true") == 0
    for plain, unit in zip(parts(demo)[:10], parts(tmp_path / "unit")[:10], strict=True):
        a, b = np.array(plain["embedding"], dtype=np.float32), np.array(unit["embedding"], dtype=np.float32)
        assert abs(np.linalg.norm(b) - 1) < 2e-3 and np.allclose(a / np.linalg.norm(a), b, atol=2e-3)


def test_output_columns_are_copied_and_a_missing_one_lists_the_columns_there_are(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    table = pq.read_table(DEMO_DATA)
    urls = [f"https://example.com/{i}.jpg" for i in range(12)]
    table = table.append_column("url", pa.array(urls)).append_column("caption", pa.array([f"photo {i}" for i in range(12)]))
    data = tmp_path / "with-captions.parquet"
    pq.write_table(table, data, row_group_size=6)
    common = ("--set", f"input.path={data}")
    assert run(DEMO, tmp_path / "out", cache_dir, *common, "--set", "output.columns=[url, caption]") == 0
    rows = parts(tmp_path / "out")
    assert [r["url"] for r in rows] == urls and rows[11]["caption"] == "photo 11" and rows[11]["error"] is not None
    assert run(DEMO, tmp_path / "missing", cache_dir, *common, "--set", "output.columns=[link]") == 2
    line = one_line(capsys.readouterr().err)
    assert "output.columns 'link' is not a column" in line and "available columns: id, image, url, caption" in line
    assert not (tmp_path / "missing").exists(), "checked before any work"


def readme_script(tmp_path: Path, cache_dir: str, guarded: bool) -> subprocess.CompletedProcess:
    """README's Python example run as a script file (decode workers on: they import it),
    from the repository, whose paths the demo job names; without its `__main__` guard
    when not `guarded`."""
    example = re.search(r"```python\n(import embedjob\n.*?)```", README, re.S).group(1)
    assert len([line for line in example.splitlines() if line.strip()]) == 4
    example = example.replace("out/demo-api", str(tmp_path / "api")).replace(
        '"output.path', f'"runtime.cache_dir={cache_dir}", "runtime.progress=false", "runtime.workers=2", "output.path'
    )
    if not guarded:
        example = example.replace('if __name__ == "__main__":\n', "").replace("\n    ", "\n")
    script = tmp_path / "embed.py"
    script.write_text(example)
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_python_api_runs_a_shard_as_the_readme_shows_and_import_loads_no_torch(tmp_path: Path, cache_dir: str) -> None:
    done = readme_script(tmp_path, cache_dir, guarded=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "12 2 {'truncated': 1, 'unknown_format': 1}"
    spec = {"input": {"path": str(DEMO_DATA), "media_column": "image"}, "model": {"path": "builtin:tiny-qwen2_5_vl"},
            "output": {"path": str(tmp_path / "dict")}}
    first = embedjob.run(spec, overrides=[f"runtime.cache_dir={cache_dir}", "runtime.progress=false"], shard=(0, 1))
    assert (first["rows"], first["errors"]) == (12, 2)
    assert embedjob.run(spec, overrides=[f"runtime.cache_dir={cache_dir}"], shard="0/1")["skipped"] is True
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, embedjob; print(sorted(m for m in ('torch', 'pyarrow', 'transformers') if m in sys.modules))"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert imported.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_script_that_runs_a_job_at_its_top_level_is_told_to_guard_it(tmp_path: Path, cache_dir: str) -> None:
    """Each decode worker imports the script that started the job: an unguarded call runs
    there again, and must say so rather than fail on the shard's lock."""
    done = readme_script(tmp_path, cache_dir, guarded=False)
    assert done.returncode != 0
    assert 'put that call under `if __name__ == "__main__":`' in done.stderr
    assert "being written by another process" not in done.stderr
    assert not list((tmp_path / "api").glob("part-*.parquet"))


# ---------------------------------------------------------------- 8. progress and rates


def test_the_bar_advances_per_batch_and_its_rate_is_the_summarys(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from embedjob.encoders.qwen import QwenAdapter
    from embedjob.io import sink

    forward = QwenAdapter.forward

    def slow_forward(self, inputs):
        time.sleep(0.15)  # a batch long enough for the bar to be seen between batches
        return forward(self, inputs)

    monkeypatch.setattr(QwenAdapter, "forward", slow_forward)
    monkeypatch.setattr(sink, "PROGRESS_INTERVAL", 0.02)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # the bar is for terminals
    sets = ("--set", "runtime.progress=true", "--set", "batching.max_items_per_batch=1", "--set", "batching.cuda_graphs=false")
    assert run(DEMO, tmp_path / "out", cache_dir, *sets) == 0
    err = capsys.readouterr().err
    counts = {int(n) for n in re.findall(r"\b(\d+)/12 \[", err)}
    assert len(counts - {0, 12}) >= 4, f"the bar moved only at {sorted(counts)}"
    assert not re.search(r"\b(?:[1-9]|1[01])/12 \[[^\]]*\?row/s", err), "a rate must show from the first batch on"
    bar_rate = float(re.findall(r"12/12 \[[^\]]*?([\d.]+)row/s[,\]]", err)[-1])
    assert "errors=2]" in err
    summary = err.strip().splitlines()[-1]
    summary_rate = float(re.search(r"([\d.]+) rows/s", summary).group(1))
    assert "s of setup" in summary and abs(bar_rate - summary_rate) <= 0.2 * summary_rate, (bar_rate, summary)


# ---------------------------------------------------------------- 9. the smaller findings


def test_status_reports_a_shard_whose_lock_is_held_as_running(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = open_checkpoint(out, 0, 2, 0, 6, 5, {"model": {"path": "m"}}, False)
    status = output_status(out)
    assert [s.state for s in status.shards] == ["running", "unfinished"]
    assert f"pid {os.getpid()}" in format_status(status).splitlines()[2]
    holder.lock.release()
    assert [s.state for s in output_status(out).shards] == ["unfinished", "unfinished"]


def test_a_relative_path_that_does_not_exist_names_the_directory_it_was_looked_for_in(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    assert run(DEMO, tmp_path / "out", cache_dir, "--set", "input.path=no/such/input.parquet") == 2
    line = one_line(capsys.readouterr().err)
    assert "'no/such/input.parquet' does not exist" in line and f"working directory, {os.getcwd()}" in line
    assert "resolve against the directory you run `embedjob`" in README


def test_the_job_spec_reports_every_error_at_once(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("input: {path: x.parquet}\noutput: {path: o, pooling: max, rows_per_part: 0}\nruntime: {workrs: 2}\n")
    assert main(["run", str(job)]) == 2
    line = one_line(capsys.readouterr().err)
    for problem in ("input.media_column is required", "model.path is required", "'output.pooling' = 'max'",
                    "'output.rows_per_part' = 0", "unknown key 'runtime.workrs'"):
        assert problem in line, problem
    assert line.count("(") >= 5 and "5 problems" in line


def test_every_key_has_a_one_line_description_in_inspect_and_the_configuration_page(capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(keys()) == len(describe().splitlines())
    for (name, _, _, doc), line in zip(keys(), listed, strict=True):
        assert line.startswith(f"{name}: ") and line.endswith(f" - {doc}") and doc, line
        assert f"| `{name}` |" in REFERENCE and doc in REFERENCE, f"{name} is not described in docs/configuration.md"


@pytest.mark.slow
def test_no_third_party_warning_reaches_the_output(tmp_path: Path, cache_dir: str) -> None:
    """A library warning (as torch's UserWarnings) during a run stays out of stderr;
    -v shows it in the log."""
    script = (
        "import sys, warnings\n"
        "import embedjob.pipeline as pipeline\n"
        "load = pipeline.load_encoder_adapter\n"
        "def noisy(*args):\n"
        "    warnings.warn('TypedStorage is deprecated', UserWarning)\n"
        "    return load(*args)\n"
        "pipeline.load_encoder_adapter = noisy\n"
        "from embedjob.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for verbose in ([], ["-v"]):
        args = [*verbose, "run", str(DEMO), "--set", f"output.path={tmp_path / str(len(verbose))}",
                "--set", f"runtime.cache_dir={cache_dir}", "--set", "runtime.progress=false", "--set", "runtime.workers=1"]
        done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert ("TypedStorage" in done.stderr) == bool(verbose), done.stderr
        if not verbose:
            assert "Warning:" not in done.stderr, done.stderr


def test_counts_read_right_in_the_singular(demo: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture) -> None:
    one_error = tmp_path / "one-error.parquet"
    pq.write_table(pq.read_table(DEMO_DATA).slice(9, 2), one_error)  # a photo and the truncated JPEG
    assert run(DEMO, tmp_path / "out", cache_dir, "--set", f"input.path={one_error}") == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "2 rows, 1 error (truncated 1)" in summary
    assert main(["status", str(demo)]) == 0
    assert f"{demo}: 1 shard: 1 done" in capsys.readouterr().out
    assert main(["verify", str(demo)]) == 0
    assert "1 shard; 3 parts, 12 rows checked; intact" in capsys.readouterr().out
