"""`embedjob submit` and `embedjob status` of a job whose output is in a bucket
(`output.path: s3://...`), against moto's S3 on 127.0.0.1 (conftest's `endpoint`).

Without SLURM (stand-in `sbatch` and `scontrol`, as in test_slurm): the script, the job
snapshot and the task logs go to a directory of the working directory (or `--log-dir`),
never to the bucket; a dry run writes nothing anywhere; finished shards in the bucket
are not submitted again, and a shard whose lock object a process holds is running.

With the local SLURM of scripts/slurm-up.sh (skipped when it is not up): a 4-shard CPU
job submitted into the bucket finishes with the parts a local run writes, byte for byte.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_object_output import BUCKET, SETTINGS, fs, inputs, local_parts, s3_parts  # noqa: F401 (fixtures)
from test_shards import job_args
from test_slurm import directives, scontrol_records, slurm_is_up, stand_in, stand_in_scontrol, stand_ins  # noqa: F401

from embedjob.cli import main
from embedjob.io.checkpoint import shard_lock
from embedjob.io.files import LocalStore
from embedjob.io.object_store import ObjectStore
from embedjob.slurm import LOG_PATTERN, SubmitOptions, TaskCommand, format_status, log_dir, output_status, render_script


def bucket_files(fs, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` of the test bucket, by key, with its bytes."""
    return {key: fs.cat_file(key) for key in sorted(fs.find(f"{BUCKET}/{prefix}"))}


def submit(inputs: Path, url: str, cache_dir: str, shards: int, *extra: str) -> int:
    return main(["submit", *job_args(inputs, url, cache_dir), *SETTINGS, "--shards", str(shards), *extra])


def run_shard(inputs: Path, url: str, cache_dir: str, shard: str) -> None:
    assert main(["run", *job_args(inputs, url, cache_dir), *SETTINGS, "--shard", shard]) == 0


# ---------------------------------------------------------------- where the logs go


def test_logs_of_a_bucket_output_go_under_the_working_directory_and_a_directory_output_keeps_its_own() -> None:
    work = Path("/work/dir")
    bucket_logs = log_dir(ObjectStore("s3://my-bucket/runs/2026 v1/"), None, work)
    assert bucket_logs.path == work / "embedjob-logs" / "my-bucket-runs-2026-v1"
    assert log_dir(ObjectStore("s3://b/../../etc"), None, work).path == work / "embedjob-logs" / "b-..-..-etc", (
        "an output URL made the log folder climb out of embedjob-logs"
    )
    assert log_dir(LocalStore(Path("/data/out")), None, work).path == Path("/data/out/_embedjob/logs")
    assert log_dir(ObjectStore("s3://b/o"), "shared/logs", work).path == work / "shared" / "logs"
    task = TaskCommand(Path("/j.yaml"), (), bucket_logs, work, "python", None, "embedjob-j")
    script = render_script(task, [0], SubmitOptions(1))
    assert f"--output={work}/embedjob-logs/my-bucket-runs-2026-v1/{LOG_PATTERN}" in directives(script)


@pytest.mark.parametrize("where", ["s3://b/logs", "a-file"])
def test_a_log_dir_that_is_no_local_directory_is_refused_before_any_work(
    where: str, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a directory")
    assert main(["submit", *job_args(tmp_path / "no-input", "s3://b/o", cache_dir), "--shards", "2", "--log-dir", where]) == 2
    err = capsys.readouterr().err
    assert f"--log-dir {where!r} is not a directory" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- submission and status without SLURM


def test_dry_run_into_a_bucket_renders_logs_here_and_writes_nothing_anywhere(
    endpoint: str, fs, inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"s3://{BUCKET}/dry"
    for shard in (0, 2):
        run_shard(inputs, url, cache_dir, f"{shard}/4")
    before = bucket_files(fs, "dry")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    capsys.readouterr()

    assert submit(inputs, url, cache_dir, 4, "--dry-run") == 0
    captured = capsys.readouterr()
    lines = directives(captured.out)
    assert "--array=1,3" in lines and "2 of 4 shards are done" in captured.err
    assert f"--output={work.resolve()}/embedjob-logs/{BUCKET}-dry/{LOG_PATTERN}" in lines
    assert submit(inputs, url, cache_dir, 4, "--dry-run", "--log-dir", "shared/logs") == 0
    assert f"--output={work.resolve()}/shared/logs/{LOG_PATTERN}" in directives(capsys.readouterr().out)

    assert bucket_files(fs, "dry") == before, "a dry run wrote to the bucket"
    assert list(work.iterdir()) == [], "a dry run wrote a log directory"


def test_submit_into_a_bucket_keeps_script_and_logs_here_and_follows_the_shards_through_the_store(
    endpoint: str, fs, inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch, stand_ins: Path,
) -> None:
    url = f"s3://{BUCKET}/submitted"
    run_shard(inputs, url, cache_dir, "1/4")
    before = bucket_files(fs, "submitted")
    monkeypatch.chdir(tmp_path)
    stand_in(stand_ins, "sbatch", f'cp "$2" {tmp_path}/submitted.sbatch; echo "4242;cluster"')
    stand_in_scontrol(stand_ins, "exit 1")
    capsys.readouterr()

    assert submit(inputs, url, cache_dir, 4) == 0
    captured = capsys.readouterr()
    logs = tmp_path.resolve() / "embedjob-logs" / f"{BUCKET}-submitted"
    assert captured.out == "4242\n" and f"logs in {logs}" in captured.err and "1 of 4 shards is done" in captured.err
    written = {key: data for key, data in bucket_files(fs, "submitted").items() if before.get(key) != data}
    assert list(written) == [f"{BUCKET}/submitted/_embedjob/slurm-job.json"], "submit wrote more than its record to the bucket"
    (submission,) = json.loads(written[f"{BUCKET}/submitted/_embedjob/slurm-job.json"])["submissions"]
    assert (submission["shards"], submission["logs"]) == ([0, 2, 3], str(logs)), "the finished shard 1 was submitted again"
    script = (tmp_path / "submitted.sbatch").read_text()
    assert Path(submission["script"]).read_text() == script and Path(submission["script"]).parent == logs
    assert f"--output={logs}/{LOG_PATTERN}" in directives(script)
    assert Path(submission["job_snapshot"]).parent == logs and f" run {submission['job_snapshot']} --shard " in script

    # SLURM says tasks 0 and 2 ended without finishing and 3 waits; shard 2's lock
    # object is held (a run by hand): it runs, whatever SLURM says of the earlier task.
    stand_in_scontrol(stand_ins, f"cat <<'EOF'\n{scontrol_records('4242', {'0': 'FAILED', '2': 'FAILED', '3': 'PENDING'})}\nEOF")
    lock = shard_lock(ObjectStore(url), 2)
    try:
        status = output_status(ObjectStore(url))
        assert [(s.state, s.slurm_task) for s in status.shards] == [
            ("failed", "4242_0"), ("done", None), ("running", "4242_2"), ("pending", "4242_3")
        ]
        assert f"pid {os.getpid()} on " in (status.shards[2].holder or "")
        assert f"shard 0 failed; its log: {logs}/shard-00000-job-4242.log" in format_status(status)
        capsys.readouterr()
        assert main(["status", url]) == 0
        assert "4 shards: 1 done, 1 running, 1 pending, 1 failed, 0 unfinished" in capsys.readouterr().out

        stand_in(stand_ins, "sbatch", 'echo "4243"')
        assert submit(inputs, url, cache_dir, 4) == 0
        captured = capsys.readouterr()
        assert captured.out == "4243\n" and "not submitted again: 4242_2, 4242_3" in captured.err
    finally:
        lock.release()
    submissions = json.loads(fs.cat_file(f"{BUCKET}/submitted/_embedjob/slurm-job.json"))["submissions"]
    assert [s["shards"] for s in submissions] == [[0, 2, 3], [0]], "a held or finished shard was submitted again"


# ---------------------------------------------------------------- a real SLURM


@pytest.mark.slow
@pytest.mark.skipif(not slurm_is_up(), reason="no SLURM cluster answers (bring one up with scripts/slurm-up.sh)")
def test_four_shard_job_into_a_bucket_on_local_slurm_writes_the_local_runs_parts(
    endpoint: str, fs, inputs: Path, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tmp_path / "local"
    assert main(["run", *job_args(inputs, local, cache_dir), *SETTINGS, "--shards", "4"]) == 0
    url = f"s3://{BUCKET}/cluster"
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    # The tasks reach moto through the AWS settings `endpoint` exported, which sbatch
    # passes on; this cluster's node has no GPU, so the job says it runs on the CPU.
    assert submit(inputs, url, cache_dir, 4, "--set", "runtime.device=cpu") == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.isdigit()

    logs = tmp_path.resolve() / "embedjob-logs" / f"{BUCKET}-cluster"
    deadline = time.monotonic() + 300
    while (counts := output_status(ObjectStore(url)).counts())["done"] < 4:
        assert counts["failed"] == 0, f"a task failed; logs in {logs}: {counts}"
        assert time.monotonic() < deadline, f"job {job_id} did not finish in 300 s: {counts}"
        time.sleep(0.5)

    assert s3_parts(fs, "cluster") == local_parts(local), "a part in the bucket differs from the local run's"
    assert sorted(p.name for p in logs.glob("*.log")) == [f"shard-{i:05d}-job-{job_id}.log" for i in range(4)]
    assert not fs.glob(f"{BUCKET}/cluster/**/*.log"), "a log went to the bucket"
    assert submit(inputs, url, cache_dir, 4, "--set", "runtime.device=cpu") == 0
    assert "nothing to submit" in capsys.readouterr().err
