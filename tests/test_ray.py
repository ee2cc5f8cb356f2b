"""The Ray engine (`embedjob run --engine ray`) on a local Ray cluster: a head started
with `ray start` for this module (3 CPUs, no GPU, everything on 127.0.0.1, no
dashboard) and stopped after it.

A six-shard job of real photos runs through the cluster while one shard's worker
process is SIGKILLed mid-shard (Ray restarts the task, which resumes from its
committed parts) and another shard cannot run (its lock is held here: a JobError,
reported without retrying while the other shards finish); the rerun runs only that
shard, and the output equals the single-process run row for row; a third run
recomputes nothing. The driver runs as a user runs it, `embedjob run` in a process of
its own. Without Ray installed `--engine ray` is a one-line job error.

The cluster has token authentication on, with a token of its own that the head and the
drivers are given explicitly (RAY_AUTH_MODE, RAY_AUTH_TOKEN); the tests run with a stale
token in ~/.ray/auth_token (in the suite's private home), as on a machine where a local
Ray job ran before, and leave it as it was. A driver whose token the cluster refuses is
told so in one line; without `--address` the engine starts a cluster of its own, on
127.0.0.1 only, with its token under the job's cache, and writes nothing into a home."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_shards import assert_same_rows, job_args, read_output

from embedjob.cli import main
from embedjob.config import JobError, job_from_dict
from embedjob.io.checkpoint import META, shard_lock, shard_progress, stats_name
from embedjob.io.store import shared_store
from embedjob.parallel import ray_engine
from embedjob.parallel.engines import RAY_MISSING, pick_engine, shards_to_run
from embedjob.parallel.ray_engine import (
    REACH,
    RayEngine,
    TaskContext,
    TaskShape,
    job_for_tasks,
    probe_task,
    reach_token,
    task_shape,
)
from embedjob.slurm import Shard

SHARDS = 6
ROWS_PER_SHARD = 4
LOCKED = 5
LOOPBACK_ONLY = ray_engine.LOOPBACK_VARIABLE
"""Set to 0, Ray takes 127.0.0.1 as the node's address and binds its servers there (a
Linux node otherwise advertises, and is reached at, its network address)."""
STALE_TOKEN = "token-of-a-cluster-an-earlier-local-ray-job-started"

# Six row groups of four rows (twice the demo's ten photos and two broken rows), one
# row per part and one item per window: each shard commits four parts, a few tenths of
# a second apart, so a kill lands between two of them.
SETTINGS = ["--set", "output.rows_per_part=1", "--set", "batching.window=1"]


def write_photos(directory: Path) -> Path:
    demo = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    rows = [{"id": f"{r['id']}#{k}", "image": r["image"]} for k in range(2) for r in demo]
    assert len(rows) == SHARDS * ROWS_PER_SHARD
    directory.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.string()), ("image", pa.binary())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, directory / "photos.parquet", row_group_size=ROWS_PER_SHARD)
    return directory


@pytest.fixture(scope="module", autouse=True)
def stale_token(private_home: Path) -> Iterator[Path]:
    """~/.ray/auth_token as a local Ray job leaves it: the token of a cluster long gone,
    which Ray takes for every cluster and driver not told otherwise."""
    token = private_home / ".ray" / "auth_token"
    token.parent.mkdir(exist_ok=True)
    token.write_text(STALE_TOKEN)
    yield token
    token.unlink()


def assert_untouched(stale_token: Path) -> None:
    """The user's ~/.ray is as it was: the stale token, alone and unchanged."""
    assert list(stale_token.parent.iterdir()) == [stale_token] and stale_token.read_text() == STALE_TOKEN


# ---------------------------------------------------------------- without a cluster


def test_without_ray_the_engine_is_a_one_line_job_error(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    inputs = write_photos(tmp_path / "in")
    assert main(["run", *job_args(inputs, tmp_path / "out", cache_dir), "--engine", "ray", "--shards", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"embedjob: error: {RAY_MISSING}"] and "pip install 'embedjob[ray]'" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--address", "auto"], "--address applies to the Ray engine"),
        (["--max-retries", "2"], "--max-retries applies to the Ray engine"),
        (["--shard", "0/2", "--shards", "2"], "give one of the two"),
        (["--shards", "0"], "--shards must be >= 1"),
    ],
)
def test_options_that_do_not_fit_are_job_errors(
    argv: list[str], named: str, tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    inputs = write_photos(tmp_path / "in")
    assert main(["run", *job_args(inputs, tmp_path / "out", cache_dir), *argv]) == 2
    assert named in capsys.readouterr().err


def test_the_ray_engine_needs_a_shard_count_and_takes_a_mounted_or_object_store_output(tmp_path: Path) -> None:
    job = job_from_dict({"input": {"path": "i.parquet", "media_column": "m"}, "model": {"path": "builtin:tiny-qwen2_5_vl"}, "output": {"path": str(tmp_path / "o")}})
    with pytest.raises(JobError, match="needs --shards N"):
        shards_to_run(job, None, None, "ray")
    assert [s.index for s in shards_to_run(job, None, 3, "ray")] == [0, 1, 2]
    assert [(s.index, s.count) for s in shards_to_run(job, "1/4", None, "ray")] == [(1, 4)]
    bucket = job_from_dict({"input": {"path": "in.parquet", "media_column": "image"}, "model": {"path": "builtin:tiny-qwen2_5_vl"}, "output": {"path": "s3://b/o"}})
    assert shared_store(bucket.output).location == "s3://b/o", "an object-store output is every node's as it is"


def test_the_local_engine_runs_every_shard_in_turn_and_then_nothing(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture
) -> None:
    inputs = write_photos(tmp_path / "in")
    args = ["run", *job_args(inputs, tmp_path / "out", cache_dir, "--shards", "3")]
    assert main(args) == 0
    assert "3 shards: 3 done, 0 running, 0 pending, 0 failed, 0 unfinished; 24 of 24 rows" in capsys.readouterr().err
    parts = part_times(tmp_path / "out")
    assert main(args) == 0
    assert "all 3 shards were already complete; nothing to do" in capsys.readouterr().err
    assert part_times(tmp_path / "out") == parts


def test_a_task_writes_nothing_into_an_output_that_is_not_the_drivers(tmp_path: Path) -> None:
    job = job_from_dict({"input": {"path": "in.parquet", "media_column": "image"}, "model": {"path": "builtin:tiny-qwen2_5_vl"}, "output": {"path": "out"}})
    (tmp_path / "out").mkdir()
    with reach_token(tmp_path / "out") as token:
        here = TaskContext(str(tmp_path), str(tmp_path / "out"), token)
        answer = probe_task(job, here)  # relative paths are taken from the driver's directory
        assert (tmp_path / "out" / answer).is_file() and answer.startswith(REACH + token)
        elsewhere = TaskContext(str(tmp_path / "missing"), str(tmp_path / "out"), token)
        with pytest.raises(JobError, match=r"output.path 'out' on node .* is not the directory the driver writes to"):
            probe_task(job, elsewhere)
    assert not list((tmp_path / "out").iterdir()), "the token and the answers go with the run"


def test_a_task_keeps_pythons_bytecode_as_a_run_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray starts every GPU task in a new worker process (max_calls=1 for GPU tasks),
    which imports torch and transformers anew: where Python writes no bytecode (as in
    many cluster images) each shard compiled them from source, 7-8 s of its setup. The
    task keeps the bytecode under the job's cache before the shard's pipeline starts,
    for itself and the processes it starts, as `embedjob run` does."""
    ray = pytest.importorskip("ray")
    from embedjob import config, runner

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(config, "_torch_has_bytecode", lambda: False)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "unset-below")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    seen = {}

    def run_job(job, shard, overwrite):
        seen.update(prefix=sys.pycache_prefix, inherited=os.environ.get("PYTHONPYCACHEPREFIX"))
        return {"shard": shard.index}

    monkeypatch.setattr(runner, "run_job", run_job)

    def started(index):
        raise ray.exceptions.RayError("no board in this test")

    board = types.SimpleNamespace(started=types.SimpleNamespace(remote=started))
    job = job_from_dict({
        "input": {"path": "in.parquet", "media_column": "image"}, "model": {"path": "builtin:tiny-qwen2_5_vl"},
        "output": {"path": "out"}, "runtime": {"cache_dir": str(tmp_path / "cache")},
    })
    (tmp_path / "out").mkdir()
    with reach_token(tmp_path / "out") as token:
        context = TaskContext(str(tmp_path), str(tmp_path / "out"), token)
        assert ray_engine.run_shard_task(job, Shard(1, 4), context, board, False) == {"shard": 1}
    kept = str(tmp_path / "cache" / "pycache")
    assert seen == {"prefix": kept, "inherited": kept}


def node(cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_tasks_take_a_gpu_each_where_there_are_gpus_and_a_cpu_elsewhere() -> None:
    def job(**runtime):
        return job_from_dict({"input": {"path": "i", "media_column": "m"}, "model": {"path": "builtin:tiny-qwen2_5_vl"}, "output": {"path": "o"}, "runtime": runtime})

    gpu_cluster = [node(64, 8), node(32, 8), node(16), node(128, 4, alive=False)]
    assert task_shape(job(), gpu_cluster) == TaskShape(gpus=1, cpus=4)  # the smallest GPU node's cores per GPU
    assert task_shape(job(gpus=2), gpu_cluster) == TaskShape(gpus=2, cpus=8)
    assert task_shape(job(gpus=2), gpu_cluster, cpus_per_task=3) == TaskShape(gpus=2, cpus=3)
    assert task_shape(job(device="cpu"), gpu_cluster) == TaskShape(gpus=0, cpus=1)
    assert task_shape(job(), [node(3)]) == TaskShape(gpus=0, cpus=1)
    assert task_shape(job(gpus=2), [node(3)]) == TaskShape(gpus=0, cpus=2)
    with pytest.raises(JobError, match="no node of the Ray cluster has a GPU"):
        task_shape(job(device="cuda"), [node(3)])
    # A task's decode workers share its CPUs (not every core of the node), and it shows no bar of its own.
    runtime = job_for_tasks(job(gpus=2), TaskShape(gpus=2, cpus=8)).runtime
    assert (runtime.workers, runtime.progress) == (4, False)
    assert job_for_tasks(job(workers=0), TaskShape(gpus=1, cpus=8)).runtime.workers == 0


def test_pick_engine_names_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # Ray itself stays out of pytest's process
    with pytest.raises(JobError, match="expected one of local, ray"):
        pick_engine("spark")
    with pytest.raises(JobError, match="--max-retries must be >= 0"):
        pick_engine("ray", max_retries=-1)
    assert isinstance(pick_engine("ray", "auto", 2, 4), RayEngine)


def test_a_ray_client_connection_is_tried_again_and_then_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Ray Client's server may answer a loaded head's first connection with an
    initialization failure: the driver tries again, and names the address if it never
    connects. A local address is tried once."""
    calls: list[str | None] = []
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False
    fake.shutdown = lambda: None

    def init(address, **_):
        calls.append(address)
        if len(calls) < 2 or address == "auto":
            raise ConnectionError("Initialization failure from server:")

    fake.init = init
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_engine.time, "sleep", lambda seconds: None)
    checked: list[str] = []
    monkeypatch.setattr(ray_engine, "check_token", checked.append)
    with ray_engine.connect("ray://127.0.0.1:10001", tmp_path):
        assert calls == ["ray://127.0.0.1:10001"] * 2 and checked == ["ray://127.0.0.1:10001"]
    calls.clear()
    with pytest.raises(RuntimeError, match=r"cannot connect to the Ray cluster at auto: ConnectionError: Initialization"):
        with ray_engine.connect("auto", tmp_path):
            pass
    assert calls == ["auto"]


def test_local_clusters_keep_their_token_under_the_cache_for_its_owner_alone(tmp_path: Path) -> None:
    path = ray_engine.cluster_token(tmp_path / "cache")
    assert path == tmp_path / "cache" / "ray" / "auth_token"
    token = path.read_text()
    assert len(token) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ray_engine.cluster_token(tmp_path / "cache").read_text() == token  # runs side by side share it
    assert list(path.parent.iterdir()) == [path]


# ---------------------------------------------------------------- a local Ray cluster


@pytest.fixture(scope="module")
def ray_installed() -> None:
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("CI"):
            pytest.fail("Ray is not installed; scripts/setup.sh installs embedjob[test,ray]")
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")


LOCAL_CLUSTER = """
import json, os, sys
from pathlib import Path
from ray._raylet import AuthenticationMode, get_authentication_mode
from embedjob.parallel import ray_engine

def listening(port):
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(local.rsplit(":", 1)[0])
    return found

def auth_settings():
    return {name: os.environ.get(name) for name in ray_engine.AUTH_VARIABLES}

with ray_engine.connect(None, Path(sys.argv[1])) as ray:
    node = ray.nodes()[0]
    gcs_host, gcs_port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    ports = [int(gcs_port), node["NodeManagerPort"], node["ObjectManagerPort"]]
    seen = {"node": node["NodeManagerAddress"], "gcs": gcs_host, "listening": [listening(p) for p in ports],
            "task": ray.get(ray.remote(auth_settings).remote(), timeout=120)}
seen["after"] = {**auth_settings(), "loopback": os.environ.get(ray_engine.LOOPBACK_VARIABLE)}
seen["token_auth_after"] = get_authentication_mode() == AuthenticationMode.TOKEN
print(json.dumps(seen))
"""
"""Connects as the engine does without an address, reports what the cluster looked like
from inside, and what was left in the process after it."""

LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
"""127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp and tcp6 write them."""


@pytest.mark.slow
def test_without_an_address_the_engine_starts_a_cluster_of_its_own_on_127_0_0_1_with_its_token_under_the_cache(
    ray_installed: None, stale_token: Path, tmp_path: Path
) -> None:
    """Ray's own local cluster listens on every interface and takes the token of
    ~/.ray/auth_token (or writes one there, which the user's next `ray start` takes)."""
    env = {name: value for name, value in os.environ.items() if name != LOOPBACK_ONLY}
    done = subprocess.run(
        [sys.executable, "-c", LOCAL_CLUSTER, str(tmp_path / "cache")], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["node"] == seen["gcs"] == "127.0.0.1"
    assert all(found and set(found) <= LOOPBACK for found in seen["listening"]), seen["listening"]
    token = tmp_path / "cache" / "ray" / "auth_token"
    assert seen["task"] == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None, "RAY_AUTH_TOKEN_PATH": str(token)}
    # Nothing that decides how the user's own clusters are reached is left behind.
    assert seen["after"] == dict.fromkeys([*ray_engine.AUTH_VARIABLES, "loopback"]) and not seen["token_auth_after"]
    assert_untouched(stale_token)


@pytest.mark.slow
def test_a_run_without_an_address_leaves_nothing_in_the_users_home(
    ray_installed: None, tmp_path: Path, cache_dir: str
) -> None:
    """Such a run used to start Ray's default local cluster, which wrote its token into
    ~/.ray/auth_token: every cluster started on the machine afterwards took that token
    and wanted it from drivers that did not send it."""
    inputs = write_photos(tmp_path / "in")
    home = tmp_path / "home"
    home.mkdir()
    env = {**{name: value for name, value in os.environ.items() if name != LOOPBACK_ONLY}, "HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "embedjob.cli", "run", *job_args(inputs, tmp_path / "out", cache_dir),
         "--engine", "ray", "--shards", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "2 shards: 2 done, 0 running, 0 pending, 0 failed, 0 unfinished; 24 of 24 rows" in done.stderr
    assert list(home.iterdir()) == [] and (Path(cache_dir) / "ray" / "auth_token").is_file()


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


class RayHead:
    """`ray start --head --block` in a session of its own: every process of the
    cluster (its workers included) is in that session, and it is stopped by its
    process group. Token authentication is on, with a token of its own (`driver_env`
    gives it to drivers); its state is under RAY_TMPDIR, where `--address auto` finds it."""

    def __init__(self, temp: Path) -> None:
        self.log = temp / "ray-start.log"
        self.port, self.client_port = _free_ports(2)
        self.token = secrets.token_hex(32)
        command = [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1", "--port", str(self.port),
            "--ray-client-server-port", str(self.client_port),
            "--num-cpus", "3", "--num-gpus", "0", "--include-dashboard", "false",
            "--object-store-memory", str(200 * 2**20), "--disable-usage-stats",
        ]
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.driver_env},
            )
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in self.log.read_text():
            assert self.proc.poll() is None, f"ray start failed:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"ray start did not come up in 120 s:\n{self.log.read_text()}"
            time.sleep(0.2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def driver_env(self) -> dict[str, str]:
        """What a driver of this cluster sets: its token, and its node on 127.0.0.1."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, LOOPBACK_ONLY: "0"}

    @property
    def client_address(self) -> str:
        """The Ray Client address (a driver that is not a node of the cluster)."""
        return f"ray://127.0.0.1:{self.client_port}"

    def task_pid(self, shard: int) -> int | None:
        """The worker process of this cluster now running the task of `shard` (Ray
        titles it `ray::embedjob-shard-SSSSS`)."""
        title = f"ray::embedjob-shard-{shard:05d}"
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                words = (entry / "cmdline").read_bytes().replace(b"\0", b" ").split()
                if words[:1] == [title.encode()] and os.getsid(int(entry.name)) == self.proc.pid:
                    return int(entry.name)
            except (OSError, IndexError):
                continue
        return None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL, the cluster's process group (gcs_server and raylet
        outlive a SIGTERM for a while); its workers, each in a group of its own, end
        with the raylet, and any still there after that is killed by its id."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 15
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def processes(self) -> list[int]:
        """Live processes of the cluster's session."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z" and os.getsid(int(entry.name)) == self.proc.pid:
                        found.append(int(entry.name))
        return found


@pytest.fixture(scope="module")
def ray_head(ray_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    head = RayHead(tmp_path_factory.mktemp("ray"))
    try:
        yield head
    finally:
        head.stop()


class Killer(threading.Thread):
    """SIGKILLs the task process of the first shard (other than `spare`) seen with
    some, not all, of its parts committed."""

    def __init__(self, head: RayHead, out: Path, spare: int) -> None:
        super().__init__(daemon=True)
        self.head, self.out, self.spare = head, out, spare
        self.killed: tuple[int, int] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for shard in set(range(SHARDS)) - {self.spare}:
                committed = self._committed(shard)
                pid = self.head.task_pid(shard) if committed is not None and 0 < committed < ROWS_PER_SHARD else None
                # Finding the pid reads /proc and can take longer than the shard has left:
                # kill only if the shard is still part-way after it.
                now = self._committed(shard) if pid is not None else None
                if pid is not None and now is not None and 0 < now < ROWS_PER_SHARD:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = (shard, now)
                    return
            time.sleep(0.02)

    def _committed(self, shard: int) -> int | None:
        try:
            return shard_progress(self.out, shard).committed
        except (JobError, OSError):
            return None


def part_times(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}


def embedjob(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`embedjob ARGS` in a process of its own with `env` added, as a user runs it: the
    Ray driver's state stays out of pytest's process, and a run that hangs fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "embedjob.cli", *args], cwd=REPO, env={**os.environ, **env},
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.slow
def test_a_six_shard_job_on_ray_survives_a_killed_worker_and_equals_the_single_process_run(
    ray_head: RayHead, stale_token: Path, tmp_path: Path, cache_dir: str
) -> None:
    inputs = write_photos(tmp_path / "in")
    single = tmp_path / "single"
    assert main(["run", *job_args(inputs, single, cache_dir), *SETTINGS]) == 0
    reference = read_output(single)
    assert len(reference) == SHARDS * ROWS_PER_SHARD and sum(r["error"] is not None for r in reference) == 4

    out = tmp_path / "ray"
    (out / META).mkdir(parents=True)
    ray_run = ["run", *job_args(inputs, out, cache_dir), *SETTINGS, "--engine", "ray"]
    lock = shard_lock(out, LOCKED)  # as if another process were writing that shard
    killer = Killer(ray_head, out, spare=LOCKED)
    killer.start()
    try:
        first = embedjob(
            *ray_run, "--address", ray_head.address, "--shards", str(SHARDS), "--max-retries", "2",
            env=ray_head.driver_env,
        )
    finally:
        killer.done.set()
        lock.release()
    assert first.returncode == 1, first.stderr
    assert killer.killed is not None, f"no shard was seen part-way to kill:\n{first.stderr}"
    shard, committed = killer.killed
    assert f"{SHARDS} shards: {SHARDS - 1} done, 0 running, 0 pending, 1 failed, 0 unfinished" in first.stderr
    held = f"shard {LOCKED} of {out} is being written by another process"
    assert f"embedjob: shard {LOCKED}/{SHARDS} failed: {held}" in first.stderr
    assert f"embedjob: failed: 1 of {SHARDS} shards did not finish" in first.stderr.strip().splitlines()[-1]
    assert not list(out.glob(".embedjob-reach-*")), "the driver's token stays behind"

    # The killed shard's task was restarted and resumed from its committed parts.
    attempts = json.loads((out / stats_name(shard)).read_text())["attempts"]
    first_row = shard * ROWS_PER_SHARD
    assert len(attempts) == 2 and attempts[0]["resumed_from_row"] == first_row
    assert attempts[1]["resumed_from_row"] >= first_row + committed
    assert sum(a["rows"] for a in attempts) == ROWS_PER_SHARD

    # The rerun (its shard count from the output; through Ray Client this time) runs
    # only the shard that failed.
    before = part_times(out)
    second = embedjob(*ray_run, "--address", ray_head.client_address, env=ray_head.driver_env)
    assert second.returncode == 0, second.stderr
    assert f"{SHARDS} shards: {SHARDS} done, 0 running" in second.stderr
    after = part_times(out)
    assert {name: t for name, t in after.items() if not name.startswith(f"part-{LOCKED:05d}-")} == before
    assert_same_rows(read_output(out, SHARDS), reference)
    assert main(["verify", str(out)]) == 0

    # Once every shard is done, nothing is recomputed, and no cluster is even asked:
    # an address where none answers does.
    third = embedjob(*ray_run, "--address", f"127.0.0.1:{_free_ports(1)[0]}", env=ray_head.driver_env, timeout=120)
    assert third.returncode == 0, third.stderr
    assert f"all {SHARDS} shards were already complete; nothing to do" in third.stderr
    assert part_times(out) == after
    assert_untouched(stale_token)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "auth", "refused"),
    [
        ("head", {}, "this driver's request, which carries no token (RAY_AUTH_MODE is not 'token')"),
        ("client", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64}, "the token in RAY_AUTH_TOKEN"),
        # `auto` finds the cluster in RAY_TMPDIR, and Ray then sends the token of ~/.ray/auth_token.
        ("auto", {}, "the token in {stale_token}"),
    ],
)
def test_a_token_the_cluster_refuses_is_one_line_naming_what_to_set(
    how: str, auth: dict[str, str], refused: str, ray_head: RayHead, stale_token: Path, tmp_path: Path, cache_dir: str
) -> None:
    """Ray itself would try for a minute, then say only that it could not connect."""
    address = {"head": ray_head.address, "client": ray_head.client_address, "auto": "auto"}[how]
    inputs = write_photos(tmp_path / "in")
    run = ["run", *job_args(inputs, tmp_path / "out", cache_dir), "--engine", "ray", "--shards", "2", "--address", address]
    done = embedjob(*run, env={LOOPBACK_ONLY: "0", **auth})
    assert done.returncode == 1, done.stderr
    *before, last = done.stderr.strip().splitlines()
    assert last == (
        f"embedjob: failed: RuntimeError: cannot connect to the Ray cluster at {address}: it uses token authentication "
        f"and refused {refused.format(stale_token=stale_token)}; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the "
        "cluster's token (or RAY_AUTH_TOKEN_PATH to a file that holds it)"
    )
    assert [line for line in before if " INFO embedjob." not in line] == [], "Ray's retries and warnings stay out"
    assert not list((tmp_path / "out").glob("part-*")) and not list((tmp_path / "out").glob(".embedjob-reach-*"))
    assert_untouched(stale_token)
