"""The host a rank runs on: its device, its threads, and what the statistics say of it.

Per process settings of a rank (ARCHITECTURE.md, "host"): which device, how many
decode workers, how torch's threads and the GIL are set while a pipeline runs (and
given back after, so a notebook that runs a job keeps its own settings); and the names
and versions a report shows for the machine and the software.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import multiprocessing
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from embedjob.config import JobError
from embedjob.parallel.cluster import cpu_share

logger = logging.getLogger(__name__)

STARTING_PROCESS = (
    "a job was started while multiprocessing was still starting this process (a decode worker or a rank of a job): "
    "such a process imports the script that started the job, so a call to embedjob.run at the script's top level "
    'runs again in each of them; put that call under `if __name__ == "__main__":`'
)


def refuse_starting_process() -> None:
    """End this process (exit 1, STARTING_PROCESS logged as one line) where
    multiprocessing is still starting it, i.e. importing the main script of the process
    that started it.

    A script that calls `embedjob.run` at its top level would otherwise start the job
    again in every decode worker and rank it spawns, and they fail on the shard's lock
    with messages that say nothing of the cause. `_inheriting` is the flag multiprocessing
    itself reads to refuse starting processes at that moment. SystemExit, not an
    exception: the starting process prints no traceback, and the job that started it
    fails on its workers' exit, with this line above its own."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        logger.error("embedjob: error: %s", STARTING_PROCESS)
        raise SystemExit(1)


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """Within, a main script that is no file (`python - < script.py`: its `__file__` is
    '<stdin>') is hidden from the processes a job starts.

    Processes multiprocessing starts run the main script's file again (to find what it
    defines), which fails with FileNotFoundError '<stdin>' before they do anything; the
    decode workers and ranks need nothing of it, and without a `__file__` they do not
    look (as with `python -c`). The `__file__` is put back after."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hidden = path is not None and getattr(main, "__spec__", None) is None and not Path(path).is_file()
    if hidden:
        del main.__file__
    try:
        yield
    finally:
        if hidden:
            main.__file__ = path


def resolve_device(name: str) -> torch.device:
    """The job's device, with its index on CUDA (statistics name the GPU each rank used)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("runtime.device is 'cuda' but no CUDA device is visible; use runtime.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def device_name(device: torch.device) -> str:
    """The device as a report names it: the GPU's model, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({_cpu_model() or platform.machine() or 'unknown'})"


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux); None elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


VERSIONED = ("torch", "torchvision", "transformers", "pyarrow", "numpy")
"""The libraries whose versions the statistics record: what the embeddings depend on."""


def software_versions() -> dict[str, str]:
    """embedjob's, Python's and VERSIONED's versions, so a report says what made an output."""
    from embedjob.version import __version__

    versions = {"embedjob": __version__, "python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def resolve_workers(value: str | int, world_size: int = 1) -> int:
    """Decode workers of one rank. "auto": this rank's share of the cores the process
    may run on (under SLURM, the task's allocation, not the whole node)."""
    return cpu_share(world_size) if value == "auto" else int(value)


HOST_THREADS = 4
"""The most torch CPU threads a process that feeds a GPU uses (see `host_threads`)."""


GIL_SWITCH_SECONDS = 0.0005
"""CPython's GIL switch interval while a pipeline runs (its default is 0.005 s)."""


@contextlib.contextmanager
def host_threads(device: torch.device) -> Iterator[None]:
    """Settle this process's threads for the pipeline, and restore them after.

    - torch's CPU threads are limited while it feeds a GPU: its own CPU work is copying
      items into batches. The decode workers already run one per core, and torch's
      default of one OpenMP thread per core, which spin between parallel regions, takes
      cores from them and from the other ranks (measured; the figures are in git history). On
      a CPU the encoder itself needs the threads.
    - The GIL is handed over sooner. The decode pool's service thread releases it at
      every send, receive and wait, several times per item, and each time must get it
      back from whichever thread runs Python meanwhile (the main thread packing, the
      writer, the chunk reader): at the default interval that is up to 5 ms per
      hand-over, which bounds the whole pipeline's decode rate (68 against 492 items/s
      in a one-off benchmark, now in git history).
    """
    before, interval = torch.get_num_threads(), sys.getswitchinterval()
    if device.type == "cuda":
        torch.set_num_threads(min(before, HOST_THREADS))
    sys.setswitchinterval(min(interval, GIL_SWITCH_SECONDS))
    try:
        yield
    finally:
        torch.set_num_threads(before)
        sys.setswitchinterval(interval)
