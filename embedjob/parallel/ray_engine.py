"""The Ray engine: the shards of a job as tasks on a Ray cluster (`embedjob run --engine ray`).

Each shard is one plain Ray task that runs exactly `embedjob run --shard I/N`
(`runner.run_job`), so the output is what every other way of running the shards
writes: the same parts, manifests, statistics, `_SUCCESS` markers and resume. Why tasks
over shards rather than Ray Data (`read_parquet` -> `map_batches` on an actor pool):
a shard is a contiguous run of row groups whose rows a task commits in order, part by
part, so input order and the resume contract (a restart keeps the committed prefix and
recomputes the rest) hold as they do for one process; a streaming Ray Data pipeline
has neither a committed prefix to resume from nor our part layout, and would keep
order only by giving up its own scheduling freedom. Inside a task the per-GPU pipeline
already overlaps decoding with the GPU, which is what Ray Data's streaming would add.
The price: a shard is the unit of balance and of retry, so cut the input into a few
shards per GPU.

The driver (this process):

1. checks the job, its input and the output's job before queueing anything (as
   `submit` does): a bad spec, an unreadable input or an output of another job stop
   here; shards with `_SUCCESS` are skipped (`--overwrite` recomputes them too);
2. connects to the cluster (`--address`, else `RAY_ADDRESS`; a cluster with token
   authentication that refuses this driver's token is one line at once), or, with
   neither, starts a cluster of its own on this machine for the run: on 127.0.0.1
   only, with token authentication, its token kept under the job's cache directory
   (never ~/.ray, which the user's own clusters read);
3. checks that the output is shared: it writes a random token into output.path (a
   directory every node mounts, or an object-store URL every node can reach), and
   one task shaped like a shard's must find it there and write an answer the driver
   can see (every shard's task checks the token again before it writes anything);
4. queues one task per unfinished shard: on a cluster with GPUs each asks for
   `runtime.gpus` GPUs (1 for `auto`; Ray sets CUDA_VISIBLE_DEVICES, so the task's
   `auto` means them), on a CPU-only cluster (or `runtime.device: cpu`) it is a CPU
   task; each reserves `--cpus-per-task` CPUs (default: the cores per GPU of the
   smallest GPU node, times its GPUs; one per rank on CPU tasks), which its decode
   workers use when `runtime.workers` is `auto`;
5. shows one progress bar: rows committed (read from the shards' manifests, so it
   moves part by part), rows/s, and shards done, running and failed.

A task runs from the driver's working directory when its node has it, so relative
paths in the job mean what they mean for the driver (as SLURM tasks run from the
directory `submit` ran in). Ray restarts a task whose process or node died up to
`--max-retries` times, and a task that raises `RankFailure` (a rank of a multi-GPU
task died); a restarted task resumes from the committed parts. Any other error (a
`JobError`, a full disk) is not retried: the shard is reported failed with its
reason, and the other shards finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from embedjob.config import Job, JobError, cache_root, prepare_process
from embedjob.io import reader
from embedjob.io.checkpoint import (
    OutputError,
    OutputRecord,
    claim_output,
    job_fingerprint,
    shard_finished,
    shard_progress,
)
from embedjob.io.store import Store, output_store, shared_store
from embedjob.parallel.outcome import ShardOutcome
from embedjob.slurm import Shard, shard_ranges

logger = logging.getLogger(__name__)

REACH = ".embedjob-reach-"
"""Name prefix of the driver's token file in the output (and of the probe's answer)."""

TASK_NAME = "embedjob-shard-{:05d}"
"""A shard's task name; Ray shows it in `ray list tasks` and as the process title
(`ray::embedjob-shard-00003`) of the worker running it."""

POLL_S = 1.0


@dataclass(frozen=True)
class TaskShape:
    """What each shard's task asks Ray for: GPUs (0: a CPU task) and CPUs."""

    gpus: int
    cpus: int

    def describe(self) -> str:
        return f"{self.gpus} GPU{'s' * (self.gpus != 1)} and {self.cpus} CPU{'s' * (self.cpus != 1)}"


@dataclass(frozen=True)
class TaskContext:
    """What every task gets besides the job and its shard."""

    cwd: str
    """The driver's working directory: the job's relative paths are taken from it."""
    output: str
    """output.path as the driver resolved it (for messages)."""
    token: str
    """The driver's token in the output; a task that does not find it writes nothing."""


class Board:
    """An actor the tasks tell when they start (a restarted task starts again): the
    driver's view of which shards run and how many attempts each took."""

    def __init__(self) -> None:
        self.starts: dict[int, int] = {}

    def started(self, shard: int) -> int:
        self.starts[shard] = self.starts.get(shard, 0) + 1
        return self.starts[shard]

    def snapshot(self) -> dict[int, int]:
        return dict(self.starts)


class RayEngine:
    """`Engine` over a Ray cluster: every shard a task, side by side (module docstring)."""

    def __init__(self, address: str | None = None, max_retries: int = 3, cpus_per_task: int | None = None) -> None:
        if max_retries < 0:
            raise JobError(f"--max-retries must be >= 0, got {max_retries}")
        if cpus_per_task is not None and cpus_per_task < 1:
            raise JobError(f"--cpus-per-task must be >= 1, got {cpus_per_task}")
        self.address = address
        self.max_retries = max_retries
        self.cpus_per_task = cpus_per_task

    def __call__(self, job: Job, shards: list[Shard], overwrite: bool = False) -> list[ShardOutcome]:
        output = shared_store(job.output)
        rows = _claim(job, output, shards[0].count, overwrite)
        outcomes = {}
        for shard in shards:
            if not overwrite and shard_finished(output, shard.index):
                first, end = rows[shard.index]
                stats = {"shard": shard.index, "num_shards": shard.count, "rows": end - first, "skipped": True}
                outcomes[shard.index] = ShardOutcome(shard, stats)
        todo = [s for s in shards if s.index not in outcomes]
        if todo:
            with connect(self.address, cache_root(job.runtime.cache_dir)) as ray:
                outcomes.update(self._run(ray, job, todo, output, rows, overwrite))
        return [outcomes[s.index] for s in shards]

    def _run(
        self, ray: Any, job: Job, todo: list[Shard], output: Store, rows: list[tuple[int, int]], overwrite: bool
    ) -> dict[int, ShardOutcome]:
        from embedjob.parallel.cluster import RankFailure

        nodes = ray.nodes()
        shape = task_shape(job, nodes, self.cpus_per_task)
        if not fits(shape, nodes):
            logger.warning("no node of the cluster has %s for a task now; the tasks wait for one", shape.describe())
        resources = {"num_gpus": shape.gpus, "num_cpus": shape.cpus}
        task_job = job_for_tasks(job, shape)
        with reach_token(output) as token:
            context = TaskContext(os.getcwd(), str(output), token)
            _check_shared(ray, task_job, context, resources, output)
            board = ray.remote(num_cpus=0)(Board).remote()
            task = ray.remote(run_shard_task)
            retries = {"max_retries": self.max_retries, "retry_exceptions": [RankFailure]}
            refs = {
                task.options(**resources, **retries, name=TASK_NAME.format(s.index)).remote(
                    task_job, s, context, board, overwrite
                ): s
                for s in todo
            }
            logger.info("queued %d shards as Ray tasks of %s each", len(refs), shape.describe())
            return _follow(ray, refs, board, output, {s.index: rows[s.index] for s in todo}, job.runtime.progress)


# ---------------------------------------------------------------- the driver's checks


def _claim(job: Job, output: Store, num_shards: int, overwrite: bool) -> list[tuple[int, int]]:
    """Check the input and the output's job, record the job there (replacing another
    job's output with `overwrite`); each shard's global row range."""
    listing = reader.scan_input(job.input, cache_root=cache_root(job.runtime.cache_dir))
    ranges = shard_ranges(listing.fragments, num_shards)
    record = OutputRecord(job_fingerprint(job, listing), num_shards, job.output.rows_per_part)
    try:
        claim_output(output, record, overwrite)
    except OSError as exc:
        raise OutputError(f"cannot write to output.path {output}: {exc.strerror or exc}") from None
    return ranges


@contextlib.contextmanager
def reach_token(output: Store | Path) -> Iterator[str]:
    """A random token written into the output for the tasks to find; removed (with the
    answers tasks wrote next to it) when the run ends."""
    out = output_store(output)
    token = secrets.token_hex(8)
    try:
        out.create(f"{REACH}{token}", token.encode())
    except OSError as exc:
        raise OutputError(f"cannot write to output.path {out}: {exc.strerror or exc}") from None
    try:
        yield token
    finally:
        for name in out.files():
            if name.startswith(f"{REACH}{token}"):
                out.remove(name)


def _check_shared(ray: Any, job: Job, context: TaskContext, resources: dict[str, int], output: Store) -> None:
    """One task shaped like a shard's must find the token and answer with a file the
    driver sees; its JobError or OutputError is the run's."""
    logger.info("checking that a task sees output.path %s (waiting for a node with room for one)", output)
    probe = ray.remote(probe_task).options(**resources, max_retries=0, name="embedjob-check-output")
    try:
        answer = ray.get(probe.remote(job, context))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, (JobError, OutputError)):
            raise exc.cause from None
        raise RuntimeError(f"the task checking output.path failed: {_reason(exc)}") from None
    if not output.exists(answer):
        raise JobError(
            f"output.path {output}: a task wrote {answer} into it, but the driver does not see that file; "
            "every node and the driver must see output.path at the same path (a shared filesystem)"
        )


# ---------------------------------------------------------------- what each task asks for


def task_shape(job: Job, nodes: list[dict[str, Any]], cpus_per_task: int | None = None) -> TaskShape:
    """GPU tasks where the cluster has GPUs (`runtime.gpus` each, 1 for `auto`), CPU
    tasks on a CPU-only cluster or for `runtime.device: cpu`; CPUs: `cpus_per_task`,
    else the smallest GPU node's cores per GPU times the task's GPUs, else one per rank.
    `nodes` is `ray.nodes()`."""
    ranks = 1 if job.runtime.gpus == "auto" else int(job.runtime.gpus)
    gpu_nodes = [n["Resources"] for n in nodes if n.get("Alive") and n["Resources"].get("GPU", 0) > 0]
    if job.runtime.device == "cuda" and not gpu_nodes:
        raise JobError(
            "runtime.device is 'cuda' but no node of the Ray cluster has a GPU; use runtime.device=auto or cpu"
        )
    gpus = ranks if gpu_nodes and job.runtime.device != "cpu" else 0
    if cpus_per_task is not None:
        return TaskShape(gpus, cpus_per_task)
    if gpus:
        return TaskShape(gpus, max(1, min(int(r.get("CPU", 0) // r["GPU"]) for r in gpu_nodes) * gpus))
    return TaskShape(0, ranks)


def fits(shape: TaskShape, nodes: list[dict[str, Any]]) -> bool:
    """Whether some live node has room for one task of this shape (when idle)."""
    return any(
        n["Resources"].get("GPU", 0) >= shape.gpus and n["Resources"].get("CPU", 0) >= shape.cpus
        for n in nodes
        if n.get("Alive")
    )


def job_for_tasks(job: Job, shape: TaskShape) -> Job:
    """The job as its tasks run it: no progress bar of their own (the driver shows one
    for all), and `runtime.workers: auto` as the task's CPUs shared by its ranks
    (`auto` would take every core of the node, which the node's other tasks share)."""
    workers = job.runtime.workers
    if workers == "auto":
        ranks = shape.gpus or (1 if job.runtime.gpus == "auto" else int(job.runtime.gpus))
        workers = max(1, shape.cpus // ranks)
    return dataclasses.replace(job, runtime=dataclasses.replace(job.runtime, progress=False, workers=workers))


# ---------------------------------------------------------------- in the tasks


def node_name() -> str:
    return socket.gethostname()


@contextlib.contextmanager
def driver_cwd(cwd: str) -> Iterator[None]:
    """Run from the driver's working directory where this node has it (a Ray worker
    process runs many tasks: its own directory comes back afterwards)."""
    before = os.getcwd()
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(before)


def check_reach(job: Job, context: TaskContext) -> Store:
    """output.path as this task sees it, which must hold the driver's token."""
    here = shared_store(job.output)
    if not here.exists(f"{REACH}{context.token}"):
        seen = "" if str(here) == context.output else f" (here {here}, the driver's {context.output})"
        raise JobError(
            f"output.path {job.output.path!r} on node {node_name()} is not the directory the driver writes to{seen}: "
            "every node must see output.path at the same path (a shared filesystem)"
        )
    return here


def probe_task(job: Job, context: TaskContext) -> str:
    """Find the driver's token, answer with a file next to it; the answer's name."""
    with driver_cwd(context.cwd):
        here = check_reach(job, context)
        answer = f"{REACH}{context.token}.{secrets.token_hex(4)}"
        try:
            here.create(answer, b"")
        except OSError as exc:
            where = f"output.path {here} on node {node_name()}"
            raise OutputError(f"cannot write to {where}: {exc.strerror or exc}") from None
        return answer


def run_shard_task(job: Job, shard: Shard, context: TaskContext, board: Any, overwrite: bool) -> dict[str, Any]:
    """One shard, exactly as `embedjob run --shard I/N` runs it; its statistics.

    Only a shard's first attempt may overwrite: a restarted one resumes from what the
    first committed."""
    import ray

    try:
        attempt = ray.get(board.started.remote(shard.index), timeout=60)
    except ray.exceptions.RayError:
        attempt = 0  # no board: progress shows less, and nothing is overwritten
    with driver_cwd(context.cwd):
        check_reach(job, context)
        # Before torch is imported: each GPU task is a new worker process (Ray gives GPU
        # tasks max_calls=1), so it imports torch and transformers anew, as a run does.
        prepare_process(job.runtime.cache_dir)
        _quiet_transformers()
        from embedjob.runner import run_job

        return run_job(job, shard, overwrite=overwrite and attempt == 1)


def _quiet_transformers() -> None:
    """Model loading chatter in a task's log would reach the driver's terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------- following the tasks


def _follow(
    ray: Any, refs: dict[Any, Shard], board: Any, output: Store, rows: dict[int, tuple[int, int]], progress: bool
) -> dict[int, ShardOutcome]:
    """Wait for every task, with one progress bar over the shards' committed rows;
    Ctrl-C (or any error here) cancels the tasks still out."""
    pending = dict(refs)
    outcomes: dict[int, ShardOutcome] = {}
    committed = {s.index: _committed(output, s.index, 0) for s in pending.values()}
    starts: dict[int, int] = {}
    total = sum(end - first for first, end in rows.values())
    with tqdm(
        total=total, initial=sum(committed.values()), unit="row", desc=f"{len(pending)} shards",
        disable=not progress, dynamic_ncols=True,
    ) as bar:
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
                starts = _snapshot(ray, board, starts)
                finished = [(ref, pending.pop(ref)) for ref in ready]
                for ref, shard in finished:
                    outcomes[shard.index] = _outcome(ray, ref, shard, starts.get(shard.index, 0))
                for shard in [*(s for _, s in finished), *pending.values()]:
                    if shard.index in starts:
                        committed[shard.index] = _committed(output, shard.index, committed[shard.index])
                running = sum(s.index in starts for s in pending.values())
                failed = sum(o.error is not None for o in outcomes.values())
                shards = f"shards: {len(outcomes) - failed} done, {running} running, {failed} failed"
                bar.set_postfix_str(shards, refresh=False)
                bar.update(sum(committed.values()) - bar.n)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    return outcomes


def _committed(output: Store, shard: int, before: int) -> int:
    """Rows the shard's manifest lists as committed (`before` while it cannot be read)."""
    try:
        return shard_progress(output, shard).committed
    except (JobError, OSError):
        return before


def _snapshot(ray: Any, board: Any, before: dict[int, int]) -> dict[int, int]:
    try:
        return ray.get(board.snapshot.remote(), timeout=10)
    except ray.exceptions.RayError:
        return before


def _outcome(ray: Any, ref: Any, shard: Shard, attempts: int) -> ShardOutcome:
    try:
        return ShardOutcome(shard, ray.get(ref), attempts=attempts)
    except ray.exceptions.RayError as exc:
        return ShardOutcome(shard, None, _reason(exc), attempts)


def _reason(exc: BaseException) -> str:
    """One line: our own errors as they are, a task's other exceptions and Ray's own
    (a worker or node that died for good, a cancelled task) with their type."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    first = (str(exc).strip().splitlines() or [""])[0]
    return first if isinstance(exc, (JobError, OutputError)) else f"{type(exc).__name__}: {first}"


# ---------------------------------------------------------------- the connection


@contextlib.contextmanager
def connect(address: str | None, cache: Path) -> Iterator[Any]:
    """The `ray` module, connected for the run (left connected when the caller had
    connected already): to `address`, else to RAY_ADDRESS, else to a new cluster on
    this machine (`local_cluster`, its token kept under `cache`).

    Without an address the run never joins a cluster it finds on this machine: it
    starts one whose token it knows, so the token files and settings of the user's own
    clusters neither matter to it nor change (`--address auto` joins the local one)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        with local_cluster(ray, cache):
            yield ray
        return
    _init(ray, address)
    try:
        yield ray
    finally:
        ray.shutdown()


CLIENT_ATTEMPTS = 3
"""Tries of a Ray Client connection (`ray://`): its server starts a process per client
and, on a loaded head, may answer the first try with an initialization failure."""


def _init(ray: Any, address: str) -> None:
    """`ray.init` for `address`, after `check_token`; a Ray Client connection is tried
    CLIENT_ATTEMPTS times."""
    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            if attempt == 1:
                check_token(address)
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
            return
        except ConnectionError as exc:
            if attempt == attempts:
                raise RuntimeError(f"cannot connect to the Ray cluster at {address}: {_reason(exc)}") from None
            logger.warning("connecting to %s failed (%s); trying again", address, _reason(exc))
            ray.shutdown()
            time.sleep(2.0 * attempt)


# ---------------------------------------------------------------- token authentication

TOKEN_CHECK_S = 10.0
"""How long the token check waits for the cluster's answer; a cluster that does not
answer in time is left to `ray.init`, which says why it cannot connect."""

AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""What Ray (2.52+) reads to authenticate: the mode (`token` or `disabled`), then the
token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token."""

LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""At 0, Ray keeps 127.0.0.1 as a node's address (and binds its servers there) rather
than replacing it with the machine's network address."""


def check_token(address: str) -> None:
    """One line (RuntimeError) if the cluster at `address` refuses this driver's token.

    `ray.init` meets a refused token with a minute of retries, then says only that it
    could not connect; one call to the cluster (the GCS, or the Ray Client server for
    `ray://`) on a channel Ray itself builds, so with the token and TLS `ray.init` would
    use, tells at once. Any other answer, or none, is left to `ray.init`. A Ray without
    token authentication (before 2.52) has nothing to check."""
    try:
        import grpc
        from ray._private import services
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc
    except ImportError:
        return
    if address == "auto" and not os.environ.get("RAY_ADDRESS"):
        # As `ray.init` does for a cluster it finds on this machine: a token in
        # ~/.ray/auth_token turns token authentication on. Ray's notice of that would
        # come before, and read as a second cause of, a refusal.
        notices = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
        level = notices.level
        notices.setLevel(logging.ERROR)
        try:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        finally:
            notices.setLevel(level)
    if address.startswith("ray://"):
        channel = init_grpc_channel(address.removeprefix("ray://"))
        ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        call = functools.partial(ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo, ping)
    else:
        channel = init_grpc_channel(services.canonicalize_bootstrap_address_or_die(address))
        request = gcs_service_pb2.GetClusterIdRequest()
        call = functools.partial(gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId, request)
    with channel:
        try:
            call(timeout=TOKEN_CHECK_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise RuntimeError(
                    f"cannot connect to the Ray cluster at {address}: it uses token authentication and refused "
                    f"{_what_this_driver_sends()}; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token "
                    "(or RAY_AUTH_TOKEN_PATH to a file that holds it)"
                ) from None


def _what_this_driver_sends() -> str:
    """The token this driver sends, by where Ray takes it from (AUTH_VARIABLES)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return "this driver's request, which carries no token (RAY_AUTH_MODE is not 'token')"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the token in RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"the token in RAY_AUTH_TOKEN_PATH ({os.environ['RAY_AUTH_TOKEN_PATH']})"
    if (Path.home() / ".ray" / "auth_token").is_file():
        return f"the token in {Path.home() / '.ray' / 'auth_token'}"
    return "this driver's request, which carries no token (none in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"


@contextlib.contextmanager
def local_cluster(ray: Any, cache: Path) -> Iterator[None]:
    """A new Ray cluster on this machine, for the run: its servers on 127.0.0.1 only,
    token authentication on with the token of `cluster_token(cache)`; stopped with the run.

    Ray's own local cluster would listen on every interface, and take (or write) the
    token of ~/.ray/auth_token, the file every later `ray start` on this machine reads:
    a cluster the user starts afterwards would then want a token their drivers do not
    send. The settings apply to this process only while the cluster runs (its
    processes keep them) and are put back afterwards, as Ray reads them again."""
    settings = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": None,  # it would win over the token file
        "RAY_AUTH_TOKEN_PATH": str(cluster_token(cache)),
        LOOPBACK_VARIABLE: "0",
    }
    try:
        with _environment(settings), _loopback_node():
            _reload_auth_settings()
            try:
                ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                         logging_level=logging.WARNING)
                yield
            finally:
                ray.shutdown()
    finally:
        _reload_auth_settings()


def cluster_token(cache: Path) -> Path:
    """The token file of the local clusters of runs with this cache: a random token,
    readable by its owner only, made by the first run and kept (runs side by side
    share it, so none replaces a token another's cluster still reads)."""
    path = cache / "ray" / "auth_token"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, draft = tempfile.mkstemp(dir=path.parent, prefix=".auth_token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as sink:
            sink.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):  # another run made it first: theirs stays
            os.link(draft, path)
    finally:
        os.unlink(draft)
    return path


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """These environment variables set (None: unset) inside, as they were afterwards."""
    before = {name: os.environ.get(name) for name in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(before)


def _set_environment(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Ray reads LOOPBACK_VARIABLE once, on import (the command has imported Ray before
    it knows it needs a local cluster), and without it turns the node address
    127.0.0.1 into the machine's network address: the flag as the variable would have
    set it, while the local cluster runs."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _reload_auth_settings() -> None:
    """Make Ray read AUTH_VARIABLES again: it reads them once per process and keeps the
    token it loaded (a Ray before 2.52 reads none)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
