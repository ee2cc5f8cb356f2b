"""What the graph manager, the batch encoder and the pipeline hand each other.

Plain data (`Encoded`, `GraphStats`, `ItemCounts`) and the `Encoder` protocol the
pipeline calls, kept apart from torch-heavy code so that every side imports them without
the others (ARCHITECTURE.md, rows "packing" and "graphs").
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from embedjob.config import Job
from embedjob.encoders.base import EncoderInput


def lap(seconds: MutableMapping[str, float], stage: str, since: float) -> float:
    """Add the wall seconds since `since` to `seconds[stage]`; the time now."""
    now = time.perf_counter()
    seconds[stage] += now - since
    return now


def to_host(values: torch.Tensor) -> torch.Tensor:
    """`values` on the host: from a GPU, one copy into page-locked memory queued behind
    the work that makes them (read it once that work is done)."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def hit_rate(hits: int, misses: int) -> float:
    """The share of items that replayed a graph; 0 before any item ran."""
    total = hits + misses
    return hits / total if total else 0.0


@dataclass
class Encoded:
    """Results of one `encode` call, item by item.

    Item i's rows are `rows[offsets[i] : offsets[i] + counts[i]]` (one row when
    pooled), in the requested output dtype, in memory of their own (no later replay
    overwrites them); a failed item has counts[i] == 0 and `failures[i]` says why.
    `rows` stays on the encoder's device: the caller copies it to the host once.
    """

    rows: torch.Tensor
    offsets: list[int]
    counts: list[int]
    failures: list[str | None]

    def item(self, index: int) -> torch.Tensor | None:
        """Item `index`'s rows, or None for a failed item."""
        if self.failures[index] is not None:
            return None
        start = self.offsets[index]
        return self.rows[start : start + self.counts[index]]


# The GraphStats counts that ranks and paths add up as they are.
_SUMMED = ("hits", "misses", "graph_batches", "eager_batches", "real_tokens", "padding_waste", "capacity_fallbacks")


@dataclass
class GraphStats:
    """Per-item hits and misses, and what the budgets cost in padding.

    Invariant: hits + misses == number of items run; padding_waste is the sum over graph
    batches of (budget - real tokens).
    """

    hits: int = 0
    misses: int = 0
    graph_batches: int = 0
    eager_batches: int = 0
    real_tokens: int = 0
    padding_waste: int = 0
    budget_batches: Counter = field(default_factory=Counter)
    budget_items: Counter = field(default_factory=Counter)
    capacity_fallbacks: int = 0
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    host_seconds: Counter = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hits, self.misses)

    def merge(self, other: GraphStats) -> None:
        """Add another manager's counts (e.g. another rank's)."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.budget_batches.update(other.budget_batches)
        self.budget_items.update(other.budget_items)
        self.host_seconds.update(other.host_seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph_hits": self.hits,
            "graph_misses": self.misses,
            "hit_rate": round(self.hit_rate, 6),
            "graph_batches": self.graph_batches,
            "eager_batches": self.eager_batches,
            "real_tokens": self.real_tokens,
            "padding_waste": self.padding_waste,
            "budget_batches": {str(k): v for k, v in sorted(self.budget_batches.items())},
            "budget_items": {str(k): v for k, v in sorted(self.budget_items.items())},
            "capacity_fallbacks": self.capacity_fallbacks,
            "capture_seconds": round(self.capture_seconds, 3),
            "graph_pool_bytes": self.pool_bytes,
            "encode_host_seconds": {k: round(v, 3) for k, v in sorted(self.host_seconds.items())},
        }


@dataclass
class ItemCounts:
    """Per-item outcome over every path an item used.

    Invariant: hits + misses == items encoded; an item is a hit when every path it used
    replayed a graph, a miss otherwise; `partial` counts the misses in which some path
    did replay while another fell back to eager (only possible with several paths).
    """

    hits: int = 0
    misses: int = 0
    partial: int = 0

    def count(self, replayed: list[bool], items: int = 1) -> None:
        """Record `items` items that share whether each path they used replayed (a
        batch's items on one path do: counted once per batch, not per item)."""
        if all(replayed):
            self.hits += items
            return
        self.misses += items
        self.partial += items * int(any(replayed))


class Encoder(Protocol):
    """What the pipeline calls on an encoder (`encode.BatchEncoder` is the one there is).

    `graph_stats` is what data-parallel ranks merge (hits and misses per item), and
    `plan_stats` plus `graph_stats().to_dict()` is what `stats` gives and stats-*.json
    holds, so their keys are part of the output format.
    """

    def capture(self) -> None: ...

    def clear(self) -> None: ...

    @property
    def hit_rate(self) -> float: ...

    def graph_stats(self) -> GraphStats: ...

    def plan_stats(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def encode(self, items: list[EncoderInput], pooling: str, dtype: torch.dtype) -> Encoded: ...


def output_dtype(job: Job) -> torch.dtype:
    """The dtype vectors leave the device in: `output.dtype`'s."""
    return torch.float16 if job.output.dtype == "float16" else torch.float32
