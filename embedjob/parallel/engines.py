"""Engines: what runs the shards of a job.

An engine takes a job and the shards to run and runs each with exactly the per-shard
pipeline (`runner.run_job`: the same parts, manifest, statistics, `_SUCCESS` and
resume), returning one `ShardOutcome` per shard. The command line picks one engine,
once, at the top (`embedjob run --engine`); nothing below it knows which one runs:

- `local_engine`: the shards one after another in this process (one shard, `--shard
  I/N`, unless `--shards N` names them all); its first failure stops it, as it stops a
  single run;
- `ray_engine.RayEngine`: every shard as a task on a Ray cluster, side by side; a
  shard that fails is reported in its outcome while the others finish.

SLURM (`embedjob submit`) is the third way to run a job's shards: it queues the same
`embedjob run --shard I/N` as array tasks and leaves, so it is a command of its own
rather than an engine that waits for the shards.
"""

from __future__ import annotations

from embedjob.config import Job, JobError
from embedjob.io.checkpoint import read_output_record
from embedjob.io.store import job_store
from embedjob.parallel.outcome import Engine, ShardOutcome
from embedjob.slurm import Shard

ENGINES = ("local", "ray")
RAY_MISSING = "--engine ray needs Ray, which is not installed here: pip install 'embedjob[ray]'"


def local_engine(job: Job, shards: list[Shard], overwrite: bool = False) -> list[ShardOutcome]:
    """Each shard in this process, in shard order; a failure raises (exit codes as for one shard)."""
    from embedjob.runner import run_job

    return [ShardOutcome(shard, run_job(job, shard, overwrite), attempts=1) for shard in shards]


def pick_engine(
    name: str, address: str | None = None, max_retries: int | None = None, cpus_per_task: int | None = None
) -> Engine:
    """The engine `name` with its options; JobError when it cannot be used here (Ray
    not installed) or an option belongs to another engine."""
    if name == "local":
        given = [flag for flag, value in (("--address", address), ("--max-retries", max_retries),
                                          ("--cpus-per-task", cpus_per_task)) if value is not None]
        if given:
            raise JobError(f"{given[0]} applies to the Ray engine; add --engine ray")
        return local_engine
    if name != "ray":
        raise JobError(f"--engine {name!r}: expected one of {', '.join(ENGINES)}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise JobError(RAY_MISSING) from None
    from embedjob.parallel.ray_engine import RayEngine

    return RayEngine(address, 3 if max_retries is None else max_retries, cpus_per_task)


def shards_to_run(job: Job, shard: str | None, num_shards: int | None, engine: str) -> list[Shard]:
    """The shards a run covers: `--shard I/N` alone, or all N of `--shards N`. Without
    either, the local engine runs `Shard.parse(None)` (SLURM's array variables, else the
    whole input as one shard) and the Ray engine every shard the output records."""
    if shard is not None and num_shards is not None:
        raise JobError("--shard I/N runs one shard and --shards N all of them; give one of the two")
    if num_shards is not None:
        if num_shards < 1:
            raise JobError(f"--shards must be >= 1, got {num_shards}")
        return [Shard(i, num_shards) for i in range(num_shards)]
    if shard is not None or engine == "local":
        return [Shard.parse(shard)]
    recorded = read_output_record(job_store(job.output))
    if recorded is None:
        raise JobError(
            f"--engine ray needs --shards N, the number of shards to cut the input into "
            f"(output.path {job.output.path!r} records it, so later runs may leave it out)"
        )
    return [Shard(i, recorded.num_shards) for i in range(recorded.num_shards)]


def status_report(job: Job, outcomes: list[ShardOutcome]) -> str:
    """What `embedjob status` prints for the output, with the shards this run saw fail
    marked failed (the files alone say only that they are unfinished)."""
    from embedjob.slurm import format_status, output_status

    status = output_status(job_store(job.output))
    failed = {o.shard.index for o in outcomes if o.error is not None}
    for shard in status.shards:
        if shard.shard in failed and shard.state != "done":
            shard.state = "failed"
    report = format_status(status)
    if all(o.stats is not None and o.stats.get("skipped") for o in outcomes):
        report += f"\nall {len(outcomes)} shards were already complete; nothing to do"
    return report
