"""What every engine gives back and the signature it keeps (`parallel.engines` picks
one; `parallel.ray_engine` is one): apart from both, so neither imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from embedjob.config import Job
from embedjob.slurm import Shard


@dataclass
class ShardOutcome:
    """What became of one shard: its statistics (as `run_job` returns them; `skipped`
    when it was already finished), or, when it failed for good, one line saying why."""

    shard: Shard
    stats: dict[str, Any] | None = None
    error: str | None = None
    attempts: int = 0


class Engine(Protocol):
    def __call__(self, job: Job, shards: list[Shard], overwrite: bool = False) -> list[ShardOutcome]: ...
