"""`embedjob submit` and `embedjob status`.

Without SLURM: the rendered sbatch script (run through bash with a stand-in Python, so
the arguments a task receives are checked, not the text), GPU lines only when asked,
resubmission of unfinished shards only, and status from the files plus a stand-in
`scontrol` that prints records in SLURM's own format.

With the local SLURM of scripts/slurm-up.sh (skipped when it is not up): a 4-shard job
submitted, watched with `embedjob status` while it runs, merged and compared row for
row with a single-process run; resubmitting it submits nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_shards import assert_same_rows, job_args, read_output, write_inputs

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.io.checkpoint import output_files
from embedjob.slurm import (
    LogDir,
    SubmitOptions,
    TaskCommand,
    array_spec,
    format_status,
    output_status,
    parse_array_spec,
    render_script,
)

NASTY = (
    "output.path=/tmp/with space/out",
    "model.path=it's \"quoted\"",
    "input.path=$(touch PWNED)",
    "runtime.cache_dir=x;touch PWNED2",
    "input.media_root=`touch PWNED3` ${HOME} \\ end",
)


def task(tmp_path: Path, python: str = "/opt/venv/bin/python", overrides: tuple[str, ...] = ()) -> TaskCommand:
    return TaskCommand(
        job_file=Path("/jobs/my job.yaml"),
        overrides=overrides,
        logs=LogDir(tmp_path / "out" / "_embedjob" / "logs", "output.path"),
        workdir=tmp_path,
        python=python,
        python_path="/src/embedjob root",
        job_name="embedjob-my_job",
    )


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


# ---------------------------------------------------------------- the script


@pytest.mark.parametrize(
    ("indices", "spec"), [([0], "0"), ([0, 1, 2, 3], "0-3"), ([1, 3, 4, 5, 9], "1,3-5,9"), ([7, 9], "7,9")]
)
def test_array_spec_collapses_runs(indices, spec) -> None:
    assert array_spec(indices) == spec
    assert parse_array_spec(spec) == indices


@given(st.sets(st.integers(0, 5000), min_size=1))
def test_array_spec_names_exactly_the_shards(indices) -> None:
    assert parse_array_spec(array_spec(sorted(indices))) == sorted(indices)


def test_scontrol_array_forms_with_limit_and_step_parse() -> None:
    assert parse_array_spec("2-3%1") == [2, 3]
    assert parse_array_spec("0-9:3") == [0, 3, 6, 9]
    assert parse_array_spec("0,4-6") == [0, 4, 5, 6]


def test_script_requests_one_requeueable_task_per_shard_with_logs_under_the_output(tmp_path: Path) -> None:
    script = render_script(task(tmp_path), [0, 2, 3], SubmitOptions(num_shards=4))
    lines = directives(script)
    assert "--array=0,2-3" in lines and "--requeue" in lines and "--ntasks=1" in lines
    assert f"--output={tmp_path}/out/_embedjob/logs/shard-%5a-job-%A.log" in lines
    assert "--open-mode=append" in lines, "a requeued task must not wipe its first attempt's log"
    assert f"--chdir={tmp_path}" in lines
    assert not [line for line in lines if "gpu" in line or "gres" in line], "no GPU lines when G = 0"
    assert not [line for line in lines if line.startswith(("--partition", "--time", "--cpus"))]


def test_gpu_partition_time_and_extra_lines_appear_only_when_asked(tmp_path: Path) -> None:
    options = SubmitOptions(4, gpus_per_task=2, partition="gpu-h200", time="4:00:00", cpus_per_task=16,
                            sbatch_options=("--account=proj", "--exclusive"))
    lines = directives(render_script(task(tmp_path), [0, 1, 2, 3], options))
    for wanted in ("--gpus-per-task=2", "--partition=gpu-h200", "--time=4:00:00", "--cpus-per-task=16",
                   "--account=proj", "--exclusive"):
        assert wanted in lines


def test_each_task_runs_its_shard_with_the_submitters_python_and_the_exact_overrides(tmp_path: Path) -> None:
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'pythonpath': os.environ.get('PYTHONPATH')}, open(os.environ['ARGS_OUT'], 'w'))\n"
    )
    stand_in.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(task(tmp_path, str(stand_in), NASTY), [3], SubmitOptions(num_shards=4)))
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "3", "ARGS_OUT": str(tmp_path / "args.json"), "PYTHONPATH": "/site"}
    subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, check=True, capture_output=True)
    seen = json.loads((tmp_path / "args.json").read_text())
    sets = [a for o in NASTY for a in ("--set", o)]
    assert seen["argv"] == ["-m", "embedjob.cli", "run", "/jobs/my job.yaml", "--shard", "3/4", *sets]
    assert seen["pythonpath"] == "/src/embedjob root:/site"
    assert not list(tmp_path.glob("PWNED*")), "an override was executed by the shell"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (SubmitOptions(2, partition="gpu; rm"), "--partition 'gpu; rm' cannot go into an #SBATCH line"),
        (SubmitOptions(2, time="1:00 --wrap"), "--time '1:00 --wrap' cannot go"),
        (SubmitOptions(2, sbatch_options=("--account=a\n#SBATCH --wrap",)), "must be one sbatch option"),
        (SubmitOptions(2, sbatch_options=("account=a",)), "must be one sbatch option"),
    ],
)
def test_values_sbatch_cannot_take_are_refused(tmp_path: Path, options, named) -> None:
    with pytest.raises(JobError, match=named):
        render_script(task(tmp_path), [0, 1], options)


def test_an_output_path_with_spaces_is_refused_for_the_log_line(tmp_path: Path) -> None:
    spaced = TaskCommand(Path("/j.yaml"), (), LogDir(tmp_path / "my out" / "_embedjob" / "logs", "output.path"), tmp_path, "python", None, "embedjob-j")
    with pytest.raises(JobError, match="output.path .* cannot go into an #SBATCH line"):
        render_script(spaced, [0], SubmitOptions(1))


# ---------------------------------------------------------------- submission and status without SLURM


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("inputs"), copies=2, videos=False)


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin directory first on PATH for stand-in `sbatch` / `scontrol` scripts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def stand_in_scontrol(bin_dir: Path, jobs: str, max_array_size: int = 1001) -> None:
    """`scontrol show config` with the given MaxArraySize; `scontrol show job` runs `jobs`."""
    config = f"MaxArraySize            = {max_array_size}\nMinJobAge               = 300 sec"
    stand_in(bin_dir, "scontrol", f'if [ "$2" = config ]; then\ncat <<\'EOF\'\n{config}\nEOF\nexit 0\nfi\n{jobs}')


def scontrol_records(job: str, states: dict[str, str]) -> str:
    """Records as `scontrol show job -o` prints them (fields trimmed, order kept)."""
    return "\n".join(
        f"JobId={100 + i} ArrayJobId={job} ArrayTaskId={task} JobName=embedjob-demo UserId=root(0) "
        f"Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState={state} Reason=None Dependency=(null) "
        f"Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 Partition=debug WorkDir=/w"
        for i, (task, state) in enumerate(states.items())
    )


def submit(inputs: Path, out: Path, cache_dir: str, shards: int, *extra: str) -> int:
    return main(["submit", *job_args(inputs, out, cache_dir), "--shards", str(shards), *extra])


def test_dry_run_renders_only_unfinished_shards_and_writes_nothing(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    for shard in (0, 2):
        assert main(["run", *job_args(inputs, out, cache_dir), "--shard", f"{shard}/4"]) == 0
    before = sorted(p.name for p in output_files(out))
    capsys.readouterr()
    assert submit(inputs, out, cache_dir, 4, "--dry-run") == 0
    captured = capsys.readouterr()
    assert "--array=1,3" in directives(captured.out) and "2 of 4 shards are done" in captured.err
    assert sorted(p.name for p in output_files(out)) == before, "a dry run wrote to the output"

    for shard in (1, 3):
        assert main(["run", *job_args(inputs, out, cache_dir), "--shard", f"{shard}/4"]) == 0
    capsys.readouterr()
    assert submit(inputs, out, cache_dir, 4, "--dry-run") == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "nothing to submit" in captured.err


def test_submission_to_output_of_another_job_is_refused_before_queueing(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, stand_ins: Path
) -> None:
    stand_in(stand_ins, "sbatch", f"touch {tmp_path}/sbatch-called; echo 1")
    out = tmp_path / "out"
    assert main(["run", *job_args(inputs, out, cache_dir), "--shard", "0/2"]) == 0
    assert submit(inputs, out, cache_dir, 4) == 2
    assert "num_shards: 2 -> 4" in capsys.readouterr().err
    assert submit(inputs, out, cache_dir, 2, "--set", "output.pooling=none") == 2
    assert "pooling: 'mean' -> 'none'" in capsys.readouterr().err
    assert not (tmp_path / "sbatch-called").exists()


def test_submit_records_the_job_status_follows_it_and_resubmission_skips_active_shards(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, stand_ins: Path
) -> None:
    out = tmp_path / "out"
    stand_in(stand_ins, "sbatch", f'cp "$2" {tmp_path}/submitted.sbatch; echo "$1" > {tmp_path}/sbatch-args; echo "4242;cluster"')
    stand_in_scontrol(stand_ins, "exit 1")
    assert submit(inputs, out, cache_dir, 4) == 0
    assert capsys.readouterr().out == "4242\n"
    record = json.loads((out / "_embedjob/slurm-job.json").read_text())
    (submission,) = record["submissions"]
    assert (submission["job_id"], submission["shards"], record["num_shards"]) == ("4242", [0, 1, 2, 3], 4)
    assert sum(record["shard_rows"]) == 24
    assert (tmp_path / "sbatch-args").read_text().strip() == "--parsable"
    script = (tmp_path / "submitted.sbatch").read_text()
    assert Path(submission["script"]).read_text() == script and Path(submission["script"]).parent == out / "_embedjob" / "logs"
    snapshot = Path(submission["job_snapshot"])
    assert f" run {snapshot} --shard " in script, "tasks must run the copy, not a job file that may change"
    assert snapshot.parent == out / "_embedjob" / "logs" and snapshot.read_text() == Path(job_args(inputs, out, cache_dir)[0]).read_text()

    # Shard 3 finished; SLURM says 0 ended without it finishing, 1 runs, 2 waits.
    assert main(["run", *job_args(inputs, out, cache_dir), "--shard", "3/4"]) == 0
    records = scontrol_records("4242", {"0": "FAILED", "1": "RUNNING", "2%1": "PENDING", "3": "COMPLETED"})
    stand_in_scontrol(stand_ins, f"cat <<'EOF'\n{records}\nEOF")
    status = output_status(out)
    assert status.scheduler == "scontrol"
    assert [(s.state, s.slurm_task) for s in status.shards] == [
        ("failed", "4242_0"), ("running", "4242_1"), ("pending", "4242_2"), ("done", "4242_3")
    ]
    assert [s.rows for s in status.shards] == record["shard_rows"]
    assert f"its log: {out}/_embedjob/logs/shard-00000-job-4242.log" in format_status(status)
    assert status.shards[3].committed == record["shard_rows"][3] and status.shards[0].committed == 0

    capsys.readouterr()
    stand_in(stand_ins, "sbatch", 'echo "4243"')
    assert submit(inputs, out, cache_dir, 4) == 0
    captured = capsys.readouterr()
    assert captured.out == "4243\n" and "4242_1, 4242_2" in captured.err
    record = json.loads((out / "_embedjob/slurm-job.json").read_text())
    assert record["submissions"][-1]["shards"] == [0]

    # Once SLURM has forgotten both jobs they ended: what is not done failed.
    stand_in_scontrol(stand_ins, "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    assert main(["status", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["counts"] == {"done": 1, "running": 0, "pending": 0, "failed": 3, "unfinished": 0}
    assert data["shards"][0]["slurm_task"] == "4243_0"


def test_more_shards_than_the_cluster_takes_array_indices_is_refused_before_sbatch(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, stand_ins: Path
) -> None:
    stand_in(stand_ins, "sbatch", f"touch {tmp_path}/sbatch-called; echo 1")
    stand_in_scontrol(stand_ins, "exit 1", max_array_size=3)
    assert submit(inputs, tmp_path / "out", cache_dir, 4) == 2
    assert "beyond this cluster's MaxArraySize (3)" in capsys.readouterr().err
    assert not (tmp_path / "sbatch-called").exists()


def test_status_without_slurm_reports_from_the_files(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    assert main(["run", *job_args(inputs, out, cache_dir), "--shard", "1/3"]) == 0
    (out / "_embedjob/slurm-job.json").write_text(json.dumps({"num_shards": 3, "submissions": [{"job_id": "7", "num_shards": 3, "shards": [0, 1, 2]}]}))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 shards: 1 done, 0 running, 0 pending, 0 failed, 2 unfinished" in text
    assert "scontrol not found" in text
    rows = json.loads((out / "_embedjob/stats-00001.json").read_text())["rows"]
    table = [line.split()[:3] for line in text.splitlines()[2:5]]
    assert table == [["0", "unfinished", "0/?"], ["1", "done", f"{rows}/{rows}"], ["2", "unfinished", "0/?"]]
    assert text.splitlines()[5].startswith("errors by code: ")


def test_status_of_a_directory_without_shards_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "holds no embedjob shards" in capsys.readouterr().err


# ---------------------------------------------------------------- a real SLURM


def slurm_is_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return "is UP" in ping.stdout


@pytest.mark.slow
@pytest.mark.skipif(not slurm_is_up(), reason="no SLURM cluster answers (bring one up with scripts/slurm-up.sh)")
def test_four_shard_job_on_local_slurm_equals_a_single_process_run(
    inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    # Full-size pictures and one row per part: each task commits parts for seconds,
    # long enough for status to see a shard part-way.
    settings = ["--set", "preprocess.max_pixels=null", "--set", "output.rows_per_part=1", "--set", "batching.window=1"]
    single = tmp_path / "single"
    assert main(["run", *job_args(inputs, single, cache_dir), *settings]) == 0
    out = tmp_path / "sharded"
    capsys.readouterr()
    # This cluster's node has no GPU: a CPU job says so, or its tasks would ask for one.
    on_cpu = ["--set", "runtime.device=cpu"]
    assert submit(inputs, out, cache_dir, 4, *settings, *on_cpu) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.isdigit()

    observations, deadline = [], time.monotonic() + 300
    while True:
        status = output_status(out)
        observations.append(status)
        counts = status.counts()
        assert counts["failed"] == 0, f"a task failed; logs in {out / 'logs'}: {status.to_dict()}"
        if counts["done"] == 4:
            break
        assert time.monotonic() < deadline, f"job {job_id} did not finish in 300 s: {status.to_dict()}"
        time.sleep(0.25)

    rows = [s.rows for s in observations[-1].shards]
    assert sum(rows) == 24 and all(rows), "every shard of this input has rows"
    assert any(s.state == "running" and 0 < s.committed < s.rows for o in observations for s in o.shards), (
        "status never saw a running shard part-way"
    )
    for earlier, later in zip(observations, observations[1:]):
        assert all(a.committed <= b.committed for a, b in zip(earlier.shards, later.shards))
    for o in observations:
        assert sum(o.counts().values()) == 4 and [s.rows for s in o.shards] == rows
        assert all(s.committed <= s.rows and (s.state != "done" or s.committed == s.rows) for s in o.shards)
    final = observations[-1]
    assert [s.slurm_task for s in final.shards] == [f"{job_id}_{i}" for i in range(4)]
    assert {s.slurm_state for s in final.shards} <= {"COMPLETED", "COMPLETING", "RUNNING"}

    assert_same_rows(read_output(out, 4), read_output(single))
    logs = sorted(p.name for p in (out / "_embedjob" / "logs").glob("*.log"))
    assert logs == [f"shard-{i:05d}-job-{job_id}.log" for i in range(4)]

    assert main(["status", str(out)]) == 0
    assert "4 shards: 4 done, 0 running, 0 pending, 0 failed, 0 unfinished; 24 of 24 rows committed" in capsys.readouterr().out
    assert submit(inputs, out, cache_dir, 4, *settings, *on_cpu) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "nothing to submit" in captured.err
    assert len(json.loads((out / "_embedjob/slurm-job.json").read_text())["submissions"]) == 1
