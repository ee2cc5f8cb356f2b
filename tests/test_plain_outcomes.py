"""Issue #51: a job that says plainly what happened. One test (or a few) per item, each
on what a user sees: the exit code, the one line, what `status`, `verify` and the report
say of the output, the files a signal leaves."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_shards import assert_same_rows, job_args, read_output, write_inputs

from embedjob.cli import main
from embedjob.io.checkpoint import META, PartRecord, open_checkpoint
from embedjob.io.writer import part_name

DEMO = REPO / "jobs" / "demo.yaml"
DEMO_DATA = REPO / "jobs" / "data" / "demo-images.parquet"
README = (REPO / "README.md").read_text()


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


# ---------------------------------------------------------------- 7. SIGTERM and SIGINT keep the work done


def signal_job_args(inputs: Path, out: Path, cache_dir: str) -> list[str]:
    """A CPU job over `inputs` in windows (and chunks) of 4 rows and parts of 5, so
    rows are committed soon after the start and a stop falls inside a part."""
    return [*job_args(inputs, out, cache_dir), "--set", "batching.window=4", "--set", "output.rows_per_part=5"]


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's photos ten times over (120 rows): long enough to stop in the middle."""
    return write_inputs(tmp_path_factory.mktemp("many"), copies=10, videos=False)


def wait_for_committed_part(out: Path, process: subprocess.Popen, limit: float = 300.0) -> None:
    """Until the run's manifest lists a part (the run is encoding), or fail."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if json.loads((out / META / "manifest-00000.json").read_text())["parts"]:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail("no part was committed")


def stop_a_run(inputs: Path, out: Path, cache_dir: str, signum: int) -> tuple[int, str, float]:
    """`embedjob run` in a process of its own, sent `signum` once it has committed a
    part: its exit code, its stderr and the seconds from the signal to its exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "embedjob.cli", "run", *signal_job_args(inputs, out, cache_dir)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    wait_for_committed_part(out, process)
    process.send_signal(signum)
    sent = time.monotonic()
    _, err = process.communicate(timeout=120)
    return process.returncode, err, time.monotonic() - sent


def committed_rows(out: Path) -> int:
    parts = json.loads((out / META / "manifest-00000.json").read_text())["parts"]
    return sum(p["end_row"] - p["first_row"] for p in parts)


@pytest.mark.slow
def test_sigterm_commits_what_is_encoded_exits_143_soon_and_a_rerun_gives_the_uninterrupted_output(
    many: Path, tmp_path: Path, cache_dir: str
) -> None:
    out = tmp_path / "out"
    code, err, seconds = stop_a_run(many, out, cache_dir, signal.SIGTERM)
    assert code == 143, err
    assert seconds < 20, "SLURM sends SIGKILL 30 s after SIGTERM"
    line = one_line(err)
    committed = committed_rows(out)
    assert 0 < committed < 120 and f"has {committed} of 120 rows committed" in line, line
    assert "stopped by SIGTERM" in line and "rerun the same command" in line
    assert not (out / META / "_SUCCESS-00000").exists()
    assert main(["verify", str(out)]) == 1  # unfinished, nothing damaged

    assert main(["run", *signal_job_args(many, out, cache_dir)]) == 0
    reference = tmp_path / "reference"
    assert main(["run", *signal_job_args(many, reference, cache_dir)]) == 0
    assert_same_rows(read_output(out), read_output(reference))
    assert main(["verify", str(out)]) == 0


@pytest.mark.slow
def test_ctrl_c_commits_what_is_encoded_and_exits_130(many: Path, tmp_path: Path, cache_dir: str) -> None:
    code, err, seconds = stop_a_run(many, tmp_path / "out", cache_dir, signal.SIGINT)
    assert code == 130 and seconds < 20, err
    assert "stopped by SIGINT" in one_line(err) and "Traceback" not in err
    assert committed_rows(tmp_path / "out") > 0


def test_a_short_part_is_kept_and_the_next_part_starts_after_it(tmp_path: Path) -> None:
    """What a stopped run leaves: a part shorter than rows_per_part; the next run
    resumes after it and its parts start where it ends."""
    cp = open_checkpoint(tmp_path, 0, 1, 0, 12, 5, {"input": {"rows": 12}}, overwrite=False)
    for part, (first, end) in enumerate([(0, 5), (5, 7)]):
        (tmp_path / part_name(0, part)).write_bytes(b"parquet")
        cp.commit(PartRecord(part, part_name(0, part), first, end, errors=0))
    cp.lock.release()
    again = open_checkpoint(tmp_path, 0, 1, 0, 12, 5, {"input": {"rows": 12}}, overwrite=False)
    assert (again.resume_row, again.next_bounds()) == (7, (7, 12))
    with pytest.raises(ValueError, match="out of order"):
        again.commit(PartRecord(2, part_name(0, 2), 10, 12, errors=0))


# ---------------------------------------------------------------- 2. submit asks SLURM for a GPU


def submitted_script(tmp_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> tuple[list[str], str]:
    """`embedjob submit --dry-run` of the demo: the #SBATCH options and the task's command line."""
    capsys.readouterr()
    assert main(["submit", str(DEMO), "--shards", "2", "--dry-run", "--set", f"output.path={tmp_path / 'out'}", *extra]) == 0
    script = capsys.readouterr().out.splitlines()
    options = [line.removeprefix("#SBATCH ") for line in script if line.startswith("#SBATCH ")]
    (command,) = [line for line in script if line.startswith("exec ")]
    return options, command


def test_submit_asks_for_one_gpu_per_task_unless_the_job_runs_on_the_cpu(tmp_path: Path, capsys) -> None:
    options, command = submitted_script(tmp_path, capsys)
    assert "--gpus-per-task=1" in options and " run " in command and "--require-cuda" in command
    options, _ = submitted_script(tmp_path, capsys, "--set", "runtime.gpus=2")
    assert "--gpus-per-task=2" in options
    for extra in (("--set", "runtime.device=cpu"), ("--gpus-per-task", "0")):
        options, command = submitted_script(tmp_path, capsys, *extra)
        assert not [o for o in options if o.startswith(("--gpu", "--gres"))] and "--require-cuda" not in command


def test_a_task_that_requires_cuda_and_finds_none_stops_with_exit_1(tmp_path: Path, cache_dir: str, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    assert run(DEMO, out, cache_dir, "--require-cuda") == 1
    line = one_line(capsys.readouterr().err)
    assert "sees none" in line and "runtime.device: cpu" in line and not out.exists()
    assert run(DEMO, out, cache_dir, "--require-cuda", "--set", "runtime.device=cpu") == 0, "asked for the CPU: runs"


# ---------------------------------------------------------------- 6. parts that describe their vectors


@pytest.fixture(scope="module")
def clip_output(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    """The CLIP demo's output: 48-wide vectors, its last two rows errors."""
    out = tmp_path_factory.mktemp("clip") / "out"
    assert run(REPO / "jobs" / "demo-clip.yaml", out, cache_dir, "--set", "output.normalize=true") == 0
    return out


def test_every_part_says_which_model_made_its_vectors_how_and_how_wide_they_are(clip_output: Path) -> None:
    files = sorted(clip_output.glob("part-*.parquet"))
    assert len(files) > 1
    for path in files:
        described = json.loads(pq.read_schema(path).metadata[b"embedjob"])
        assert described["width"] == 48 and described["family"] == "clip"
        assert described["model_path"] == "builtin:tiny-clip" and described["pooling"] == "mean"
        assert described["normalize"] is True and described["dtype"] == "float16" and described["precision"] == "bf16"
    vectors = [r["embedding"] for r in pq.read_table(files).to_pylist() if r["embedding"] is not None]
    assert {len(v) for v in vectors} == {48}


def test_the_readme_duckdb_recipe_works_for_any_width(clip_output: Path) -> None:
    section = README[README.index("## Reading the output\n") :]
    recipe = re.findall(r"```python\n(.*?)```", section, re.S)[1]
    assert "duckdb" in recipe and "FLOAT[128]" not in recipe
    names: dict = {}
    exec(recipe.replace("out/demo", str(clip_output)), names)
    assert names["nearest"][0][0] == 0 and all(error is None for _, _, error, _ in names["nearest"])


def test_tokens_and_frames_read_as_nullable_integers_in_pandas(clip_output: Path) -> None:
    import pandas as pd

    df = pd.read_parquet(clip_output).sort_values("row")
    assert str(df.tokens.dtype) == "Int32" and str(df.frames.dtype) == "Int32"
    assert df.tokens.isna().tolist()[-2:] == [True, True] and (df.tokens.dropna() > 0).all()


# ---------------------------------------------------------------- 3. every failure is one line


def test_a_broken_yaml_file_is_one_line_naming_the_file_and_the_place(tmp_path: Path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("input:\n  path: x.parquet\n  media_column: [image\nmodel:\n  path: builtin:tiny-clip\n")
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"job file {job} is not valid YAML: line 4, column 6: expected ',' or ']'" in err


def test_an_input_a_network_library_cannot_list_is_one_line_naming_input_path(
    tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an hf:// input offline raised: the HTTP library's own error, no OSError."""
    from embedjob.io import reader

    class ConnectError(Exception):
        pass

    def offline(*args, **kwargs):
        raise ConnectError("[Errno -2] Name or service not known\nmore lines of the library's message")

    monkeypatch.setattr(reader, "scan_input", offline)
    code = run(DEMO, tmp_path / "out", cache_dir, "--set", "input.path=hf://datasets/someone/photos/data.parquet")
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "cannot list input.path 'hf://datasets/someone/photos/data.parquet': ConnectError: [Errno -2]" in err


SCRIPT_RUN = (
    "embedjob.run({job!r}, ['output.path={out}', 'runtime.workers=1', 'runtime.progress=false', "
    "'runtime.cache_dir={cache}'])"
)


def run_script(source: str, *, stdin: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """`source` run by Python from a file (or fed on stdin), from the repository."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if stdin:
        return subprocess.run([sys.executable, "-"], input=source, capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=timeout)
    path = Path(env.get("TMPDIR", "/tmp")) / f"embedjob-script-{os.getpid()}-{time.monotonic_ns()}.py"
    path.write_text(source)
    try:
        return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=timeout)
    finally:
        path.unlink()


@pytest.mark.slow
def test_a_top_level_embedjob_run_fails_in_a_few_lines_that_say_what_to_do(tmp_path: Path, cache_dir: str) -> None:
    call = SCRIPT_RUN.format(job=str(DEMO), out=tmp_path / "out", cache=cache_dir)
    done = run_script(f"import embedjob\n{call}\n")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) < 20 and not any(f"embedjob/{m}.py" in done.stderr for m in ("runner", "pipeline")), done.stderr
    assert any(line.startswith("embedjob: error: ") and 'if __name__ == "__main__":' in line for line in lines)


@pytest.mark.slow
def test_a_script_fed_on_stdin_runs_its_job(tmp_path: Path, cache_dir: str) -> None:
    call = SCRIPT_RUN.format(job=str(DEMO), out=tmp_path / "out", cache=cache_dir)
    done = run_script(f"import embedjob\nif __name__ == '__main__':\n    print({call}['rows'])\n", stdin=True)
    assert done.returncode == 0 and done.stdout.split() == ["12"], done.stderr


@pytest.mark.slow
def test_ctrl_c_during_start_up_prints_one_line_and_no_worker_traceback(tmp_path: Path, cache_dir: str) -> None:
    """Ctrl-C reaches the whole process group, the decode workers' server importing torch included."""
    sets = {"output.path": tmp_path / "out", "runtime.workers": 2, "runtime.cache_dir": cache_dir}
    command = [sys.executable, "-m", "embedjob.cli", "run", str(DEMO), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    for line in process.stderr:
        if "embedjob.io.reader: input" in line:
            break
    time.sleep(0.5)  # into the model's load, while the workers' server imports torch
    os.killpg(process.pid, signal.SIGINT)
    err = process.stderr.read()
    assert process.wait(timeout=120) == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert one_line(err).startswith("embedjob: stopped by SIGINT")


# ---------------------------------------------------------------- 4. the summary names every error code


def test_the_summary_and_status_name_every_error_code_up_to_ten() -> None:
    from embedjob.cli import _summary
    from embedjob.config import job_from_dict
    from embedjob.report.counts import codes_text

    five = {"too_large": 2, "truncated": 2, "corrupt": 1, "not_found": 1, "unknown_format": 1}
    assert codes_text(five) == "too_large 2, truncated 2, corrupt 1, not_found 1, unknown_format 1"
    stats = {"rows": 20, "errors": 7, "error_codes": five, "rows_this_run": 20, "pipeline_seconds": 1.0,
             "setup_seconds": 1.0, "items_per_second": 13.0, "num_graphs": 2, "hit_rate": 1.0, "padding_waste": 0}
    job = job_from_dict({"input": {"path": "in.parquet", "media_column": "image"}, "model": {"path": "builtin:tiny-clip"},
                         "output": {"path": "out"}})
    assert "7 errors (too_large 2, truncated 2, corrupt 1, not_found 1, unknown_format 1)" in _summary(job, stats)
    twelve = {f"code_{k:02d}": 12 - k for k in range(12)}
    assert codes_text(twelve).endswith("code_09 3, 2 more codes")


# ---------------------------------------------------------------- 5. no carriage returns in a log


def test_where_stderr_is_no_terminal_progress_is_a_log_line_with_rows_rate_and_time_left(
    tmp_path: Path, cache_dir: str, capsys, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embedjob.encoders.qwen import QwenAdapter
    from embedjob.io import sink

    forward = QwenAdapter.forward

    def slow_forward(self, inputs):
        time.sleep(0.2)  # a run long enough for a few progress lines
        return forward(self, inputs)

    monkeypatch.setattr(QwenAdapter, "forward", slow_forward)
    monkeypatch.setattr(sink, "PROGRESS_LOG_INTERVAL", 0.1)
    caplog.set_level("INFO", logger="embedjob.io.sink")
    sets = ("--set", "runtime.progress=true", "--set", "batching.max_items_per_batch=1", "--set", "batching.cuda_graphs=false")
    assert run(DEMO, tmp_path / "out", cache_dir, *sets) == 0
    assert "\r" not in capsys.readouterr().err, "a bar redrawn in a log file"
    lines = [r.getMessage() for r in caplog.records if r.name == "embedjob.io.sink"]
    assert lines and all(re.fullmatch(r"shard 0/1: \d+ of 12 rows done, \d+ errors?; [\d.]+ rows/s, \S+ left", m) for m in lines), lines


# ---------------------------------------------------------------- 8. small ones


def test_model_family_may_be_left_out_where_the_checkpoint_names_it(tmp_path: Path) -> None:
    from embedjob.config import job_from_dict

    def family(model: dict) -> str:
        raw = {"input": {"path": "in.parquet", "media_column": "image"}, "model": model, "output": {"path": "out"}}
        return job_from_dict(raw).model.family

    assert family({"path": "builtin:tiny-clip"}) == "clip"
    checkpoint = tmp_path / "siglip-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "siglip_vision_model"}))
    assert family({"path": str(checkpoint)}) == "siglip"
    assert family({"path": str(checkpoint), "family": "dinov2"}) == "dinov2", "a family given is kept (the loader checks it)"


def test_a_mistyped_builtin_model_names_the_family_it_would_need(tmp_path: Path, cache_dir: str, capsys) -> None:
    assert run(DEMO, tmp_path / "out", cache_dir, "--set", "model.path=builtin:tiny-clip-vit") == 2
    line = one_line(capsys.readouterr().err)
    assert "unknown builtin model 'builtin:tiny-clip-vit'; did you mean builtin:tiny-clip (model.family: clip)?" in line


def test_status_says_how_many_shards_have_no_known_row_count_yet(tmp_path: Path) -> None:
    from embedjob.slurm import OutputStatus, ShardStatus, format_status

    status = OutputStatus(tmp_path, 2, [ShardStatus(0, "done", 34, 34, 0), ShardStatus(1, "unfinished", None, 0, 0)], "files")
    first = format_status(status).splitlines()[0]
    assert "34 of at least 34 rows (1 shard not started) committed" in first and "rows+" not in first


def test_an_output_path_that_is_a_file_says_so(tmp_path: Path, cache_dir: str, capsys) -> None:
    target = tmp_path / "embeddings.parquet"
    target.write_bytes(b"someone's file")
    assert run(DEMO, target, cache_dir) == 2
    line = one_line(capsys.readouterr().err)
    assert f"output.path '{target}' is a file, not a directory" in line
    assert target.read_bytes() == b"someone's file"
    assert main(["status", str(target)]) == 2
    assert "is a file, not an output directory" in capsys.readouterr().err


def test_an_empty_input_says_it_is_empty_without_advice_about_shards(tmp_path: Path, cache_dir: str, caplog) -> None:
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "image": pa.array([], pa.binary())}), empty)
    caplog.set_level("WARNING", logger="embedjob")
    assert run(DEMO, tmp_path / "out", cache_dir, "--set", f"input.path={empty}") == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("has no rows: nothing to embed" in w and str(empty) in w for w in warnings), warnings
    assert not any("row group" in w for w in warnings), warnings


def test_the_readme_first_screen_says_the_first_demo_is_mostly_pip() -> None:
    first = README[: README.index("\n## ", README.index("## Two commands") + 1)]
    assert "The first `scripts/demo.sh` is mostly pip" in first and "under a minute" in first
