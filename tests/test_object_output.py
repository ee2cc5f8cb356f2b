"""An output on object storage: `output.path: s3://...` against a real S3 API, moto's
server on 127.0.0.1 started here (as s3fs's own tests do). Rows equal a local run's bit
for bit, a SIGKILLed run resumes to the same bytes, `verify` catches a damaged part
object, `status` and `report` read the output, the shard lock keeps a second writer
out, and `--engine ray` writes there too. No request leaves 127.0.0.1: the endpoint is
set, the credentials are fake, and instance-metadata lookups are off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, S3_BUCKET
from test_resume import Attempt
from test_shards import assert_same_rows, job_args, read_output, write_inputs

from embedjob.cli import main
from embedjob.config import JobError, job_from_dict
from embedjob.io.checkpoint import lock_name, shard_lock
from embedjob.io.object_store import ObjectStore

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = S3_BUCKET
SETTINGS = ["--set", "output.rows_per_part=2", "--set", "batching.window=2"]


@pytest.fixture
def fs(endpoint: str):
    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def s3_rows(fs, prefix: str) -> list[dict]:
    """The output's rows as a reader of the dataset sees them (its parts, `_embedjob/` skipped)."""
    return pq.read_table(f"{BUCKET}/{prefix}", filesystem=fs).sort_by("row").to_pylist()


def s3_parts(fs, prefix: str) -> dict[str, bytes]:
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in sorted(fs.glob(f"{BUCKET}/{prefix}/part-*.parquet"))}


def local_parts(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("part-*.parquet"))}


def s3_manifest(fs, prefix: str) -> dict | None:
    try:
        return json.loads(fs.cat_file(f"{BUCKET}/{prefix}/_embedjob/manifest-00000.json"))
    except FileNotFoundError:
        return None


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_inputs(tmp_path_factory.mktemp("inputs"), copies=2, videos=False)


@pytest.fixture(scope="module")
def reference(inputs: Path, tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    """The job run into a local directory: what every object-store run must equal."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(["run", *job_args(inputs, out, cache_dir), *SETTINGS]) == 0
    return out


@pytest.fixture(scope="module")
def finished(endpoint: str, inputs: Path, reference: Path, cache_dir: str) -> str:
    """The job run into s3://BUCKET/done (the tests that damage it work on copies)."""
    url = f"s3://{BUCKET}/done"
    assert main(["run", *job_args(inputs, url, cache_dir), *SETTINGS]) == 0
    return url


def copy_of(fs, url: str, name: str) -> str:
    fs.copy(url.removeprefix("s3://"), f"{BUCKET}/{name}", recursive=True)
    return f"s3://{BUCKET}/{name}"


@pytest.mark.slow
def test_a_run_into_s3_writes_the_local_runs_parts_byte_for_byte(finished: str, reference: Path, fs) -> None:
    got = s3_rows(fs, "done")
    assert [r["row"] for r in got] == list(range(24))
    assert_same_rows(got, read_output(reference))
    assert s3_parts(fs, "done") == local_parts(reference), "a part object differs from the local run's file"
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/done/_embedjob")}
    assert {"job.json", "manifest-00000.json", "stats-00000.json", "_SUCCESS-00000"} <= names
    assert not [n for n in names if n.startswith(".lock-")], "a finished run leaves no lock object"
    assert fs.list_multipart_uploads(BUCKET) == [], "an upload was left incomplete"


@pytest.mark.slow
def test_a_job_reads_and_writes_s3_with_its_storage_options(
    endpoint: str, inputs: Path, reference: Path, cache_dir: str, fs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint given only by input/output.storage_options: the environment's points
    at a closed local port, so a store opened without the options fails (locally)."""
    for path in sorted(inputs.glob("*.parquet")):
        fs.put_file(str(path), f"{BUCKET}/in/{path.name}")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    options = "{endpoint_url: %s}" % endpoint
    args = job_args(inputs, f"s3://{BUCKET}/optioned", cache_dir)
    args += ["--set", f"input.path=s3://{BUCKET}/in", "--set", f"input.storage_options={options}",
             "--set", f"output.storage_options={options}", *SETTINGS]
    assert main(["run", *args]) == 0
    assert s3_parts(fs, "optioned") == local_parts(reference)
    stats = json.loads(fs.cat_file(f"{BUCKET}/optioned/_embedjob/stats-00000.json"))
    assert stats["job"]["output"]["storage_options"] == ["endpoint_url"], "an option's value was recorded"


@pytest.mark.slow
def test_media_cells_naming_s3_objects_are_read_with_the_inputs_storage_options(
    endpoint: str, inputs: Path, reference: Path, cache_dir: str, fs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Parquet of s3:// URIs (the img2dataset url-list layout) whose store is reachable
    only through input.storage_options: every row's media is read from the bucket and
    gets the vector the same bytes get inside Parquet, a missing object is one
    not_found row, and nothing is read from the environment's endpoint."""
    table = pq.read_table(sorted(inputs.glob("*.parquet"))[0]).to_pylist()
    uris = []
    for k, row in enumerate(table):
        fs.pipe_file(f"{BUCKET}/media/{k}.bin", row["image"])
        uris.append({"id": row["id"], "image": f"s3://{BUCKET}/media/{k}.bin"})
    uris.append({"id": "gone", "image": f"s3://{BUCKET}/media/missing.bin"})
    listing = tmp_path / "uris.parquet"
    pq.write_table(pa.Table.from_pylist(uris), listing)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    out = tmp_path / "out"
    args = job_args(listing, out, cache_dir) + [
        "--set", f"input.storage_options={{endpoint_url: {endpoint}}}", "--set", f"input.media_root=s3://{BUCKET}/media",
    ]
    assert main(["run", *args]) == 0
    got = read_output(out)
    expected = {r["id"]: r for r in read_output(reference)}
    assert [r["id"] for r in got] == [u["id"] for u in uris]
    for row in got[:-1]:
        want = expected[row["id"]]
        assert row["error"] == want["error"], row["id"]
        if want["embedding"] is not None:
            ours, theirs = np.array(row["embedding"]), np.array(want["embedding"])
            assert np.linalg.norm(ours - theirs) <= 1e-5 * np.linalg.norm(theirs), row["id"]
    assert got[-1]["error"].startswith("not_found")


@pytest.mark.slow
def test_three_sigkills_then_a_resume_give_the_local_runs_parts(
    endpoint: str, inputs: Path, reference: Path, cache_dir: str, fs, tmp_path: Path
) -> None:
    """Killed before its first commit, after one part, then mid-stream; the rerun finds
    the killed runs' locks stale (their processes are gone), aborts their uploads,
    drops an unlisted part and ends with the uninterrupted run's bytes."""
    args = job_args(inputs, f"s3://{BUCKET}/killed", cache_dir) + SETTINGS
    committed = lambda: len((s3_manifest(fs, "killed") or {"parts": []})["parts"])  # noqa: E731
    history = []
    for attempt, target in enumerate([0, 1, 4]):
        run = Attempt(args, tmp_path / f"attempt-{attempt}.log")
        before = committed()
        run.wait_for(lambda: s3_manifest(fs, "killed") is not None and committed() >= max(target, before + (target > 0)))
        assert run.kill(), f"attempt {attempt} finished before it was killed:\n{run.log.read_text()}"
        history.append(committed())
    assert history == sorted(history) and history[-1] < 12, history
    final = Attempt(args, tmp_path / "final.log")
    assert final.proc.wait(timeout=300) == 0, final.log.read_text()
    assert s3_parts(fs, "killed") == local_parts(reference)
    assert fs.list_multipart_uploads(BUCKET) == [], "a killed run's upload was never aborted"
    assert main(["verify", f"s3://{BUCKET}/killed"]) == 0


@pytest.mark.slow
def test_verify_names_an_altered_and_a_missing_part_object(finished: str, fs, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", finished]) == 0
    damaged = copy_of(fs, finished, "damaged")
    key = f"{BUCKET}/damaged/part-00000-00001.parquet"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    fs.rm_file(f"{BUCKET}/damaged/part-00000-00003.parquet")
    capsys.readouterr()
    assert main(["verify", damaged]) == 1
    out = capsys.readouterr().out
    assert "part-00000-00001.parquet does not match its recorded sha256" in out
    assert "part-00000-00003.parquet is missing" in out


@pytest.mark.slow
def test_export_reads_an_s3_output_as_it_reads_the_local_one(finished: str, reference: Path, tmp_path: Path) -> None:
    """`embedjob export s3://...` gives the files the same job's local output exports to."""
    assert main(["export", finished, str(tmp_path / "from-s3")]) == 0
    assert main(["export", str(reference), str(tmp_path / "from-disk")]) == 0
    exported = sorted(p.relative_to(tmp_path / "from-disk") for p in (tmp_path / "from-disk").rglob("*") if p.is_file())
    assert exported and any(p.suffix == ".npy" for p in exported)
    for name in exported:
        assert (tmp_path / "from-s3" / name).read_bytes() == (tmp_path / "from-disk" / name).read_bytes(), name


@pytest.mark.slow
def test_status_and_report_read_an_s3_output(finished: str, fs, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["status", finished]) == 0
    assert f"{finished}: 1 shard: 1 done" in capsys.readouterr().out
    assert main(["report", finished]) == 0
    assert capsys.readouterr().out.strip() == f"{finished}/_embedjob/report.html"
    page = fs.cat_file(f"{BUCKET}/done/_embedjob/report.html").decode()
    assert "<html" in page and "24" in page


def test_a_second_writer_is_refused_while_the_first_holds_the_shard_lock(endpoint: str, fs) -> None:
    store = ObjectStore(f"s3://{BUCKET}/locked")
    first = shard_lock(store, 0)
    try:
        assert f"pid {os.getpid()} on " in (store.lock_holder(lock_name(0)) or ""), "status would not name the holder"
        with pytest.raises(JobError, match="shard 0 of s3://.*/locked is being written by another process"):
            shard_lock(ObjectStore(f"s3://{BUCKET}/locked"), 0)
    finally:
        first.release()
    assert store.lock_holder(lock_name(0)) is None and not fs.exists(f"{BUCKET}/locked/{lock_name(0)}")
    shard_lock(store, 0).release()


def test_a_lock_left_by_a_process_that_died_here_is_taken_over_at_once(endpoint: str, fs) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = {"holder": "a killed run", "host": os.uname().nodename, "pid": int(gone.stdout), "expires": 4e9, "nonce": "x"}
    fs.pipe_file(f"{BUCKET}/stale/{lock_name(0)}", json.dumps(body).encode())
    store = ObjectStore(f"s3://{BUCKET}/stale")
    assert store.lock_holder(lock_name(0)) is None, "a dead holder's lock read as held"
    lock = shard_lock(store, 0)
    assert json.loads(fs.cat_file(f"{BUCKET}/stale/{lock_name(0)}"))["pid"] == os.getpid()
    lock.release()


def test_a_part_is_invisible_until_its_upload_completes_and_an_abandoned_one_leaves_nothing(endpoint: str, fs) -> None:
    store = ObjectStore(f"s3://{BUCKET}/parts")
    part = store.open_part("part-00000-00000.parquet")
    part.stream.write(b"x" * 1000)
    part.stream.flush()
    assert not fs.exists(f"{BUCKET}/parts/part-00000-00000.parquet")
    part.commit()
    assert fs.cat_file(f"{BUCKET}/parts/part-00000-00000.parquet") == b"x" * 1000
    dropped = store.open_part("part-00000-00001.parquet")
    dropped.stream.write(b"y" * 1000)
    dropped.abandon()
    assert not fs.exists(f"{BUCKET}/parts/part-00000-00001.parquet")
    assert fs.list_multipart_uploads(BUCKET) == []


def test_storage_options_must_be_a_mapping() -> None:
    spec = {"input": {"path": "i.parquet", "media_column": "m"}, "model": {"path": "builtin:tiny-qwen2_5_vl"},
            "output": {"path": "s3://b/o", "storage_options": "anon"}}
    with pytest.raises(JobError, match=r"output.storage_options' = 'anon' is not allowed; expected a mapping"):
        job_from_dict(spec)


@pytest.mark.slow
def test_the_ray_engine_writes_the_same_parts_into_s3(
    endpoint: str, inputs: Path, reference: Path, cache_dir: str, fs, tmp_path: Path
) -> None:
    pytest.importorskip("ray")
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "embedjob.cli", "run", *job_args(inputs, f"s3://{BUCKET}/ray", cache_dir), *SETTINGS,
         "--engine", "ray", "--shards", "1"],
        cwd=REPO, env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert s3_parts(fs, "ray") == local_parts(reference)
    assert not [p for p in fs.ls(f"{BUCKET}/ray") if ".embedjob-reach-" in p], "the driver's token stayed"
