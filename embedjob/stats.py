"""A shard's statistics: the clocks a rank keeps, what each rank did, and the one
builder of the dict written to `_embedjob/stats-SSSSS.json`.

Every rank fills a `RankStats` as it works (`StageClock` for where its main thread's
time went, `BusyClock` for its device's); the other ranks send theirs to rank 0, which
merges them with what its writer saw (`ShardRun`) in `shard_stats`. The keys are the
ones the README lists and the report reads (ARCHITECTURE.md, "statistics"): a run that
loaded no model writes the keys it shares with the others from the same code.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from embedjob.config import Job
from embedjob.engine.defs import GraphStats, lap
from embedjob.host import software_versions
from embedjob.io.checkpoint import Checkpoint, count_codes
from embedjob.slurm import Shard
from embedjob.timeline import Timeline


@dataclass
class StageClock:
    """Seconds per stage of one thread, so the statistics say where its time went."""

    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def add(self, stage: str, since: float) -> float:
        return lap(self.seconds, stage, since)


class BusyClock:
    """How long one window occupied its device, from construction to `stop`.

    On a GPU it is the time between two events on the stream, so a window whose work
    queued behind the previous window's is not counted twice and the host never waits
    to measure it; on a CPU the encode is synchronous and wall seconds are the same.
    """

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._start = time.perf_counter()
        self._seconds = 0.0
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float:
        """The measured seconds; on a GPU, waits until the window's work is done."""
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


@dataclass
class RankStats:
    """What one rank did, for the shard's statistics (sent to rank 0 by the others)."""

    rank: int
    device: str
    device_name: str = ""
    rows: int = 0
    items: int = 0
    load: int = 0
    chunks: int = 0
    busy_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Where its JPEGs were decoded ("cpu", "gpu" or "auto", `preprocess.decoder`), with
    # auto the share of rows it last left for the GPU (None before it first chose), how
    # many rows its GPU decoded and the seconds of the thread that finished them (its
    # waits for the nvjpeg thread included: rows over seconds is what the two decode).
    decoder: str = "cpu"
    gpu_share: float | None = None
    device_decoded: int = 0
    device_decode_seconds: float = 0.0
    # With `video.decoder` nvdec or auto: the seconds the GPU decoder's threads spent,
    # summed over them, per part (`nvdec.DecoderClock`: clips, Decode calls, surfaces taken,
    # copies, RGB), reported to the microsecond: a few clips' fused NV12 conversion takes
    # well under a millisecond.
    device_decode_parts: dict[str, float] = field(default_factory=dict)
    # While its GPU decoded media: what the CUDA caching allocator's calls to the driver
    # added (`pipeline.ALLOCATOR_COUNTS`), each a stall of the decode thread or the device.
    device_allocations: dict[str, int] = field(default_factory=dict)
    setup: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None
    ready_at: float | None = None
    graphs: GraphStats | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def launch_seconds(self) -> float:
        """Main-thread seconds inside graph replays and eager forwards: a launch blocks
        once the GPU's queue is full, so on a GPU this is mostly the device's time; on a
        CPU it is the encoder's compute."""
        return (self.graphs or GraphStats()).host_seconds.get("launch", 0.0)

    def to_dict(self) -> dict[str, Any]:
        graphs = self.graphs or GraphStats()
        return {
            "rank": self.rank,
            "device": self.device,
            "device_name": self.device_name,
            "rows": self.rows,
            "items": self.items,
            "load": self.load,
            "chunks": self.chunks,
            "busy_seconds": round(self.busy_seconds, 3),
            "decode_seconds": round(self.decode_seconds, 3),
            "decoder": self.decoder,
            "gpu_share": None if self.gpu_share is None else round(self.gpu_share, 3),
            "device_decoded": self.device_decoded,
            "device_decode_seconds": round(self.device_decode_seconds, 3),
            "device_decode_parts": {k: round(v, 6) for k, v in self.device_decode_parts.items()},
            "device_allocations": dict(self.device_allocations),
            "host_seconds": round(self.stages.get("host", 0.0) - self.launch_seconds, 3),
            "launch_seconds": round(self.launch_seconds, 3),
            "host_cpu_seconds": round(self.stages.get("host cpu", 0.0), 3),
            "encode_host_seconds": {k: round(v, 3) for k, v in sorted(graphs.host_seconds.items())},
            "setup_seconds": round(self.ready_at - self.started_at, 3) if self.ready_at and self.started_at else 0.0,
            "setup": {k: round(v, 3) for k, v in self.setup.items()},
            "waits": {k: round(v, 3) for k, v in self.waits.items()},
            "graph_hits": graphs.hits,
            "graph_misses": graphs.misses,
            "hit_rate": round(graphs.hit_rate, 6),
            "padding_waste": graphs.padding_waste,
            "started_at": round(self.started_at, 3) if self.started_at else None,
            "ready_at": round(self.ready_at, 3) if self.ready_at else None,
            "timeline": self.timeline.to_dict(),
        }


@dataclass
class ShardRun:
    """What a run that encoded rows adds to its shard's statistics: every rank's
    statistics (rank 0's first) and what rank 0's writer saw. `started` is the run's
    wall-clock start, `resumed` the row it started at, `rows_during_setup` the rows that
    ranks ready first encoded before the last rank was ready (not in the rate)."""

    ranks: list[RankStats]
    rows: int
    write_seconds: float
    timeline: Timeline
    started: float
    resumed: int
    rows_during_setup: int = 0

    def setup_seconds(self, seconds: float) -> float:
        """From the start until the last rank was ready to encode; all of `seconds`
        when no rank got there."""
        ready = [r.ready_at for r in self.ranks if r.ready_at is not None]
        return max(ready) - self.started if ready else seconds


def shard_stats(
    job: Job, shard: Shard, checkpoint: Checkpoint, seconds: float, run: ShardRun | None = None
) -> dict[str, Any]:
    """The shard's statistics after a run of `seconds`, as `Checkpoint.finish` writes them.

    The one builder for both ways a run ends: with `run` when it encoded rows, and
    without when there was nothing to encode (an empty shard, or one whose rows were all
    committed before its success marker was written). The latter loads no model, so it
    has no device, per-rank or time-series keys and zero graph counts; the keys both
    have are computed the same way (its setup is all of `seconds`, its rate 0).
    """
    rows = run.rows if run is not None else 0
    early = run.rows_during_setup if run is not None else 0
    setup = run.setup_seconds(seconds) if run is not None else seconds
    pipeline = max(seconds - setup, 1e-9)
    stats: dict[str, Any] = {
        "shard": shard.index,
        "num_shards": shard.count,
        "rows": checkpoint.end_row - checkpoint.first_row,
        "rows_this_run": rows,
        "errors": sum(p.errors for p in checkpoint.parts),
        "error_codes": count_codes(p.error_codes for p in checkpoint.parts),
        "seconds": round(seconds, 3),
        "setup_seconds": round(setup, 3),
        "pipeline_seconds": round(pipeline, 3),
        "rows_during_setup": early,
        "items_per_second": round((rows - early) / pipeline, 3),
        **_provenance(job),
    }
    stats.update(_encoded(job, run) if run is not None else _nothing_encoded())
    return stats


def _provenance(job: Job) -> dict[str, Any]:
    """What made the output: the job as this run read it (defaults filled in) and the
    software versions; the report shows them."""
    return {"job": job.recorded(), "versions": software_versions()}


def _encoded(job: Job, run: ShardRun) -> dict[str, Any]:
    """The keys of a run that encoded: rank 0's device and stages, the writer's time
    series, the plan, every rank's graph counts summed, and the per-rank ledger."""
    first = run.ranks[0]
    return {
        "resumed_from_row": run.resumed,
        "device": first.device,
        "device_name": first.device_name,
        "model": job.model.path,
        "stage_seconds": {k: round(v, 3) for k, v in first.stages.items()},
        "write_seconds": round(run.write_seconds, 3),
        "device_decoded": sum(r.device_decoded for r in run.ranks),
        "started_at": round(run.started, 3),
        "timeline": run.timeline.to_dict(),
        **_plan(run.ranks),
        **_merged_graphs(run.ranks).to_dict(),
        **_ledger(run.ranks),
    }


def _nothing_encoded() -> dict[str, Any]:
    """The plan and graph keys of a run that loaded no model: no graphs, none run."""
    return {**_plan([]), "graph_hits": 0, "graph_misses": 0, "hit_rate": 0.0, "padding_waste": 0}


def _plan(ranks: list[RankStats]) -> dict[str, Any]:
    """The budgets and limits every rank started with (the same plan on each), and the
    budgets any rank added for its windows (`added_budgets`; ranks see other windows)."""
    plan = dict(next((r.plan for r in ranks if r.plan), {"num_graphs": 0, "token_budgets": []}))
    added = sorted({b for r in ranks for b in r.plan.get("added_budgets", [])})
    if added:
        plan["added_budgets"] = added
    return plan


def _merged_graphs(ranks: list[RankStats]) -> GraphStats:
    """Every rank's graph statistics summed; ranks capture at once, so capture time is the longest."""
    total = GraphStats()
    graphs = [r.graphs for r in ranks if r.graphs is not None]
    for stats in graphs:
        total.merge(stats)
    total.capture_seconds = max((s.capture_seconds for s in graphs), default=0.0)
    total.pool_bytes = sum(s.pool_bytes for s in graphs)
    return total


def _ledger(ranks: list[RankStats]) -> dict[str, Any]:
    """Per-rank statistics and how evenly the work was spread: the largest rank's input
    size (and device seconds) over the mean, 1.0 for a perfect spread."""

    def ratio(values: list[float]) -> float | None:
        mean = sum(values) / len(values)
        return round(max(values) / mean, 4) if mean else None

    return {
        "world_size": len(ranks),
        "balance_ratio": ratio([r.load for r in ranks]),
        "busy_ratio": ratio([r.busy_seconds for r in ranks]),
        "ranks": [r.to_dict() for r in ranks],
    }
