"""embedjob: images and videos in Parquet datasets to vision-encoder embeddings.

`embedjob.run` is the Python entry point (the `embedjob run` command without the
process around it). Importing the package imports nothing else: torch and the models
load when a job runs.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedjob.config import Job

from embedjob.version import __version__

__all__ = ["__version__", "run"]


def run(
    job_or_path: "Job | dict[str, Any] | str | os.PathLike[str]",
    overrides: list[str] | tuple[str, ...] = (),
    shard: str | tuple[int, int] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run (or resume) one shard of a job and return its statistics (what
    `_embedjob/stats-SSSSS.json` holds).

    `job_or_path` is a job YAML file, a job as nested dicts (the YAML's structure) or a
    `Job`; `overrides` are `section.key=value` strings as `--set` takes them; `shard` is
    `"I/N"` or `(I, N)` (default: SLURM's array task, else the whole input). Raises
    `embedjob.config.JobError` for a job that cannot run as written (a bad spec, input or
    model: the command's exit 2) and RuntimeError when a run fails (a full disk, a dead
    rank, more error rows than runtime.max_error_rate allows: exit 1), and
    `embedjob.stopping.Stopped` (a KeyboardInterrupt) when SIGTERM or SIGINT stopped it
    from the main thread, after committing what it had encoded. Like the command,
    it sets up the process first (`config.prepare_process`: CUDA_DEVICE_MAX_CONNECTIONS=32
    unless set, Python's bytecode kept where none is written), which takes full effect only
    where the calling process has not used CUDA yet. An exception it raises carries no
    traceback through embedjob's own code unless the `embedjob` logger is at DEBUG.
    """
    try:
        return _run(job_or_path, overrides, shard, overwrite)
    except Exception as exc:
        if logging.getLogger("embedjob").isEnabledFor(logging.DEBUG):
            raise
        # The message says what went wrong and what to do; a script's traceback through
        # embedjob's internals (a hundred lines) only buries it. DEBUG keeps it.
        raise exc.with_traceback(None) from None


def _run(
    job_or_path: "Job | dict[str, Any] | str | os.PathLike[str]",
    overrides: list[str] | tuple[str, ...],
    shard: str | tuple[int, int] | None,
    overwrite: bool,
) -> dict[str, Any]:
    from embedjob.config import Job, job_from_dict, load_job, prepare_process
    from embedjob.slurm import Shard
    from embedjob.stopping import on_signals

    if isinstance(job_or_path, Job):
        job = job_from_dict(job_or_path.to_dict(), overrides)
    elif isinstance(job_or_path, dict):
        job = job_from_dict(job_or_path, overrides)
    else:
        job = load_job(job_or_path, overrides)
    prepare_process(job.runtime.cache_dir)
    from embedjob.runner import run_job

    text = f"{shard[0]}/{shard[1]}" if isinstance(shard, tuple) else shard
    with on_signals():
        return run_job(job, Shard.parse(text), overwrite=overwrite)
