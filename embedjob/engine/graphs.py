"""Budget graph manager: one captured encoder graph per token budget, replayed per batch.

The design of vLLM's EncoderCudaGraphManager: each budget gets static input buffers
from the adapter and one graph, captured largest budget first into one shared memory
pool after one eager warm-up. A batch is copied into the buffers of the smallest budget
that fits (the packer chose it), the graph is replayed, and each item's rows are read
out of the static output before the next replay overwrites them. Items over the largest
budget run eagerly ("misses").

Two backends share this code: `cuda` captures real `torch.cuda.CUDAGraph`s; `replay`
(used on CPU, so CI exercises buffer filling, padding and slicing without a GPU)
records the graph body at capture and re-runs it on the same static buffers at replay,
writing into a static output buffer exactly like a graph does.

Encoders that see a global view plus local tiles run two such managers, one per path
(`DualPathEncoder`), packed together by `packer.pack_dual`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from embedjob.config import Job, JobError
from embedjob.encoders.base import PAD_REPEAT_LAST, PAD_ZERO, EncoderAdapter, EncoderInput, StaticInputs
from embedjob.encoders.fixed import FixedResAdapter
from embedjob.engine import packer
from embedjob.engine.packer import BudgetPlan, DualBatch, DualPlan, pack, pack_dual

logger = logging.getLogger(__name__)

Reduce = Callable[[torch.Tensor], torch.Tensor]
POOLINGS = ("mean", "none")


def _lap(seconds: Counter, stage: str, since: float) -> float:
    """Add the wall seconds since `since` to `seconds[stage]`; the time now."""
    now = time.perf_counter()
    seconds[stage] += now - since
    return now


def clone_rows(rows: torch.Tensor) -> torch.Tensor:
    """The default per-item read-out of `GraphManager.run`: a copy that survives the next replay."""
    return rows.clone()


def pool_rows(rows: torch.Tensor, counts: Sequence[int], pooling: str) -> tuple[torch.Tensor, list[int]]:
    """One batch's output rows (items' rows in order, `counts` each) pooled per item:
    `mean` gives one float32 row per item, `none` keeps every row.

    The mean of a run of items with equal row counts is one reduction over a (items,
    rows, dim) view, so a batch costs one call per distinct count, not one per item
    (a 224 px image mix is one call per batch; fixed-resolution images need none).
    Each item's mean still reduces only its own rows in their order, so it does not
    depend on the other items of its batch: a resumed or data-parallel run, which
    batches differently, gives the same bits on a CPU.
    """
    if pooling == "none":
        return rows, list(counts)
    if pooling != "mean":
        raise ValueError(f"unknown pooling {pooling!r}; allowed: {', '.join(POOLINGS)}")
    if all(c == 1 for c in counts):
        return rows.float(), [1] * len(counts)
    means, start, index = [], 0, 0
    while index < len(counts):
        count, run = counts[index], 1
        while index + run < len(counts) and counts[index + run] == count:
            run += 1
        block = rows[start : start + run * count].view(run, count, -1)
        means.append(block.float().mean(dim=1))
        start, index = start + run * count, index + run
    return torch.cat(means) if len(means) > 1 else means[0], [1] * len(counts)


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


class _Collector:
    """Builds an `Encoded` from batches finished in any order."""

    def __init__(self, count: int, width: int, pooling: str, dtype: torch.dtype, device: torch.device) -> None:
        self.pooling = pooling
        self.dtype = dtype
        self.width = width
        self.device = device
        self.parts: list[torch.Tensor] = []
        self.total = 0
        self.offsets = [0] * count
        self.counts = [0] * count
        self.failures: list[str | None] = [None] * count

    def add(self, indices: Sequence[int], rows: torch.Tensor, counts: Sequence[int]) -> None:
        """The rows of items `indices` (their rows in order, `counts` each), pooled here."""
        pooled, pooled_counts = pool_rows(rows, counts, self.pooling)
        self.parts.append(pooled.to(self.dtype, copy=True))
        for index, count in zip(indices, pooled_counts):
            self.offsets[index], self.counts[index] = self.total, count
            self.total += count

    def fail(self, index: int, reason: str) -> None:
        self.failures[index] = reason

    def result(self) -> Encoded:
        if not self.parts:
            rows = torch.empty((0, self.width), dtype=self.dtype, device=self.device)
        else:
            rows = torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]
        return Encoded(rows, self.offsets, self.counts, self.failures)


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
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def merge(self, other: "GraphStats") -> None:
        """Add another manager's counts (e.g. another rank's)."""
        for name in ("hits", "misses", "graph_batches", "eager_batches", "real_tokens", "padding_waste", "capacity_fallbacks"):
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


def _pinned(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and value.device.type == "cpu" and not value.is_pinned():
        return value.pin_memory()
    return value


class _RecordedGraph:
    """The `replay` backend's graph: the recorded body re-run on the static buffers.

    Like a CUDA graph it writes into one output tensor that every replay overwrites;
    that tensor is allocated by the first replay, so capturing costs nothing on a CPU.
    """

    def __init__(self, body: Callable[[], torch.Tensor]) -> None:
        self.body = body
        self.output: torch.Tensor | None = None

    def replay(self) -> None:
        result = self.body()
        if self.output is None:
            self.output = result
        else:
            self.output.copy_(result)


class _CudaGraph:
    """A captured CUDA graph and the static output tensor it writes."""

    def __init__(self, body: Callable[[], torch.Tensor], pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = body()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Entry:
    static: StaticInputs
    graph: _RecordedGraph | _CudaGraph


class GraphManager:
    """Captures one graph per budget of `plan` and runs packed batches through them."""

    BACKENDS = ("cuda", "replay")

    def __init__(self, adapter: EncoderAdapter, plan: BudgetPlan, backend: str | None) -> None:
        if backend is not None and backend not in self.BACKENDS:
            raise ValueError(f"unknown graph backend {backend!r}; allowed: {', '.join(self.BACKENDS)} or None (eager)")
        if backend == "cuda" and adapter.device.type != "cuda":
            raise ValueError("the cuda graph backend needs the adapter on a CUDA device")
        self.adapter = adapter
        self.plan = plan
        self.backend = backend
        self.stats = GraphStats()
        self._graphs: dict[int, _Entry] = {}
        self._pool: Any = None
        self._captured = False

    @property
    def num_graphs(self) -> int:
        """Budgets that replay a graph (captured on CUDA, recorded on the replay backend)."""
        return len(self.plan.token_budgets) if self._captured else 0

    @property
    def budgets(self) -> tuple[int, ...]:
        return self.plan.token_budgets

    def capture(self) -> None:
        """Capture every budget, largest first so smaller graphs reuse the shared pool's blocks."""
        if self.backend is None or self._captured:
            return
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.adapter.device) if self.backend == "cuda" else 0
        if self.backend == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        if self.backend == "cuda":
            with torch.inference_mode():
                for budget in sorted(self.plan.token_budgets, reverse=True):
                    self._graphs[budget] = self._make_entry(budget)
            torch.cuda.synchronize(self.adapter.device)
            self.stats.pool_bytes = torch.cuda.memory_reserved(self.adapter.device) - before
        self._captured = True
        self.stats.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d graphs (%s backend) for budgets %s in %.1f s",
            self.num_graphs,
            self.backend,
            list(self.plan.token_budgets),
            self.stats.capture_seconds,
        )

    def _make_entry(self, budget: int) -> _Entry:
        static = self.adapter.static_inputs(budget, self.plan.max_items, self.plan.max_frames)

        def body() -> torch.Tensor:
            return self.adapter.forward(static)

        if self.backend == "replay":
            return _Entry(static, _RecordedGraph(body))
        side = torch.cuda.Stream(self.adapter.device)
        side.wait_stream(torch.cuda.current_stream(self.adapter.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.adapter.device).wait_stream(side)
        return _Entry(static, _CudaGraph(body, self._pool))

    def _entry(self, budget: int | None) -> _Entry | None:
        """The graph of `budget`; the replay backend allocates a budget's buffers on first
        use, since host memory for every budget's buffers would be spent for nothing."""
        if budget is None or not self._captured or budget not in self.plan.token_budgets:
            return None
        entry = self._graphs.get(budget)
        if entry is None:
            entry = self._graphs[budget] = self._make_entry(budget)
        return entry

    def run_batch(self, items: list[EncoderInput], budget: int | None) -> torch.Tensor:
        """Embed one packed batch; the items' output rows in batch order (`row_counts` each).

        `budget` is the packer's choice: a captured budget (replay) or None (eager). A
        replay returns a view of the graph's static output: read it before the next
        replay overwrites it.
        """
        tokens = sum(item.tokens for item in items)
        entry = self._entry(budget)
        if entry is not None and not self.adapter.fits(items, entry.static):
            self.stats.capacity_fallbacks += 1
            entry = None
        rows = sum(self.adapter.row_counts(items))
        host = self.stats.host_seconds
        since = time.perf_counter()
        with torch.inference_mode():
            if entry is None:
                inputs = self.adapter.eager_inputs(items)
                since = _lap(host, "prepare", since)
                output = self.adapter.forward(inputs)
                self._count(items, None, tokens)
            else:
                self._fill(entry.static, self.adapter.batch_values(items, entry.static))
                since = _lap(host, "prepare", since)
                entry.graph.replay()
                output = entry.graph.output
                self._count(items, budget, tokens)
            _lap(host, "launch", since)
            return output[:rows]

    def run(self, items: list[EncoderInput], budget: int | None, reduce: Reduce = clone_rows) -> list[torch.Tensor]:
        """`run_batch`, then `reduce(rows)` per item, in batch order (before the next replay)."""
        output = self.run_batch(items, budget)
        with torch.inference_mode():
            return [reduce(rows) for rows in self.adapter.split(output, items)]

    def run_padded_eager(self, items: list[EncoderInput], budget: int) -> torch.Tensor:
        """The graph body run eagerly on this batch's padded buffers (for equality checks)."""
        entry = self._entry(budget)
        if entry is None:
            raise ValueError(f"budget {budget} has no graph")
        with torch.inference_mode():
            self._fill(entry.static, self.adapter.batch_values(items, entry.static))
            return self.adapter.forward(entry.static).clone()

    @staticmethod
    def _fill(static: StaticInputs, values: dict[str, torch.Tensor]) -> None:
        """Copy a batch into the static buffers: prefix copy, then the key's pad rule for the tail.

        Host values are page-locked first: a copy from pageable memory blocks the host
        until it has run, i.e. until the previous replay is done, which would serialise
        the host's batch preparation with the device's work.
        """
        for key, buffer in static.tensors.items():
            value = _pinned(values[key], buffer.device)
            count = value.shape[0]
            if count > buffer.shape[0]:
                raise ValueError(f"batch value {key!r} has {count} rows but the budget's buffer holds {buffer.shape[0]}")
            buffer[:count].copy_(value, non_blocking=True)
            if count == buffer.shape[0]:
                continue
            rule = static.pad.get(key, PAD_ZERO)
            if rule == PAD_REPEAT_LAST:
                buffer[count:].copy_(value[-1:].expand(buffer.shape[0] - count, *value.shape[1:]), non_blocking=True)
            elif rule == PAD_ZERO:
                buffer[count:].zero_()
            else:
                raise ValueError(f"unknown pad rule {rule!r} for {key!r}")

    def _count(self, items: list[EncoderInput], budget: int | None, tokens: int) -> None:
        stats = self.stats
        stats.real_tokens += tokens
        if budget is None:
            stats.misses += len(items)
            stats.eager_batches += 1
            return
        stats.hits += len(items)
        stats.graph_batches += 1
        stats.padding_waste += budget - tokens
        stats.budget_batches[budget] += 1
        stats.budget_items[budget] += len(items)
        if stats.graph_batches % 100 == 0:
            logger.debug("graph stats: %s", stats.to_dict())

    def clear(self) -> None:
        """Release every graph, its buffers and the shared pool."""
        self._graphs.clear()
        self._captured = False
        self._pool = None
        if self.backend == "cuda":
            torch.cuda.empty_cache()


class BatchEncoder:
    """Packs items under a plan and runs every batch through one GraphManager.

    This is the interface the runner uses to encode a window (the dual-path encoder
    provides the same methods): `encode` returns every item's rows, pooled per batch
    (`pool_rows`), or, for an item that failed, a reason. A failed batch is retried one
    item at a time eagerly, so one bad item (e.g. out of memory on a huge video) costs
    one error row, not the batch.
    """

    def __init__(self, manager: GraphManager, policy: str) -> None:
        self.manager = manager
        self.policy = policy

    def capture(self) -> None:
        self.manager.capture()

    def clear(self) -> None:
        self.manager.clear()

    @property
    def hit_rate(self) -> float:
        return self.manager.stats.hit_rate

    def graph_stats(self) -> GraphStats:
        """The counts as one GraphStats (what data-parallel ranks merge)."""
        return self.manager.stats

    def plan_stats(self) -> dict[str, Any]:
        """The plan and its graphs, as written to stats-*.json."""
        plan = self.manager.plan
        return {
            "num_graphs": self.manager.num_graphs,
            "token_budgets": list(plan.token_budgets),
            "max_items_per_batch": plan.max_items,
            "max_frames_per_batch": plan.max_frames,
            "graph_backend": self.manager.backend,
        }

    def stats(self) -> dict[str, Any]:
        """The plan and the graph statistics."""
        return {**self.plan_stats(), **self.manager.stats.to_dict()}

    def encode(self, items: list[EncoderInput], pooling: str, dtype: torch.dtype) -> Encoded:
        """Every item's rows, pooled per `pooling`, in `dtype`, on the device."""
        out = _Collector(len(items), self.width, pooling, dtype, self.manager.adapter.device)
        tokens = [item.tokens for item in items]
        frames = [item.frames for item in items]
        since = time.perf_counter()
        batches = pack(tokens, frames, self.manager.plan, self.policy)
        _lap(self.manager.stats.host_seconds, "pack", since)
        for batch in batches:
            self._run(items, list(batch.indices), batch.budget, out)
        since = time.perf_counter()
        result = out.result()
        _lap(self.manager.stats.host_seconds, "collect", since)
        return result

    @property
    def width(self) -> int:
        return self.manager.adapter.embed_dim

    def _run(self, items: list[EncoderInput], indices: list[int], budget: int | None, out: _Collector) -> None:
        chosen = [items[i] for i in indices]
        try:
            rows = self.manager.run_batch(chosen, budget)
            since = time.perf_counter()
            with torch.inference_mode():
                out.add(indices, rows, self.manager.adapter.row_counts(chosen))
            _lap(self.manager.stats.host_seconds, "pool", since)
        except Exception as exc:
            if len(indices) == 1 and budget is None:
                out.fail(indices[0], f"encode_failed: {type(exc).__name__}: {exc}")
                logger.warning("an item failed to encode: %s", exc)
                return
            logger.warning("batch of %d items failed (%s); retrying one at a time", len(indices), exc)
            for i in indices:
                self._run(items, [i], None, out)


def budget_plan(job: Job, adapter: EncoderAdapter) -> packer.BudgetPlan:
    """The packer's plan from the job's batching keys and the adapter's budget range."""
    b = job.batching
    try:
        return packer.resolve_budgets(
            _auto(b.token_budgets),
            _auto(b.max_items_per_batch),
            _auto(b.max_frames_per_batch),
            model_min=b.min_budget or adapter.min_budget,
            model_max=b.max_budget or adapter.max_budget,
            max_frames_per_video=job.video.max_frames,
            video_enabled=job.input.modality != "image",
        )
    except ValueError as exc:
        raise JobError(f"batching: {exc}") from None


def _auto(value: Any) -> Any:
    """The job's "auto" is the packer's None."""
    return None if value == "auto" else value


def _backend(job: Job, device: torch.device) -> str | None:
    """Real CUDA graphs on a GPU, the replay backend on a CPU, none when graphs are off."""
    if not job.batching.cuda_graphs:
        return None
    return "cuda" if device.type == "cuda" else "replay"


def whole_image_plan(plan: BudgetPlan, tokens_per_image: int) -> BudgetPlan:
    """A fixed-resolution encoder's plan: budgets rounded down to whole images.

    A budget's buffers hold budget // tokens_per_image images, so the rest of a budget
    that is not a multiple could never be used and would only inflate the padding count.
    A budget below one image is a configuration error (JobError naming the numbers).
    """
    budgets = sorted({b // tokens_per_image * tokens_per_image for b in plan.token_budgets})
    if budgets[0] == 0:
        raise JobError(
            f"batching: token budget {plan.token_budgets[0]} is smaller than one image, which is "
            f"{tokens_per_image} tokens for this encoder; use budgets that are multiples of {tokens_per_image}"
        )
    if tuple(budgets) != plan.token_budgets:
        logger.info("token budgets %s rounded down to whole images: %s", list(plan.token_budgets), budgets)
    return BudgetPlan(tuple(budgets), plan.max_items, plan.max_frames)


def build_encoder(job: Job, adapter: EncoderAdapter, device: torch.device) -> BatchEncoder | DualPathEncoder:
    """The batch encoder for this job and adapter: budgets, graph backend, packing policy.

    The backend is real CUDA graphs on a GPU, the replay backend on a CPU (same packing
    and padding, so results and statistics match), or none when graphs are turned off.
    A fixed-resolution adapter that makes local tiles (`preprocess.tiling: anyres`) gets
    the dual-path encoder, whose two paths share the job's budgets (the local one adds 0).
    """
    backend = _backend(job, device)
    plan = budget_plan(job, adapter)
    if isinstance(adapter, FixedResAdapter):
        plan = whole_image_plan(plan, adapter.tokens_per_image)
        if len(adapter.views) > 1:
            paths = dual_paths(adapter, packer.resolve_dual_budgets(plan, plan), backend)
            return DualPathEncoder(adapter, paths, job.batching.policy)
    return BatchEncoder(GraphManager(adapter, plan, backend), job.batching.policy)


@dataclass
class EncoderPath:
    """One graph set of a multi-path encoder, as data.

    `key` names the item tensor the path encodes (the adapter's `path_input` makes an
    ordinary item of it); `plan` holds the budgets the packer picks from, which for the
    local path start with 0 (a batch without tiles skips the path); `manager` captures
    and replays the positive budgets of that plan.
    """

    name: str
    key: str
    plan: BudgetPlan
    manager: GraphManager


def dual_paths(adapter: FixedResAdapter, plan: DualPlan, backend: str | None) -> list[EncoderPath]:
    """The global and local paths of `plan`, in the order `pack_dual` gives their budgets."""
    paths = []
    for name, key, path_plan in zip(("global", "local"), adapter.views, (plan.global_plan, plan.local_plan)):
        positive = BudgetPlan(tuple(b for b in path_plan.token_budgets if b > 0), path_plan.max_items, path_plan.max_frames)
        paths.append(EncoderPath(name, key, path_plan, GraphManager(adapter, positive, backend)))
    return paths


@dataclass
class DualStats:
    """Per-item outcome over both paths.

    Invariant: hits + misses == items encoded; an item is a hit when every path it used
    replayed a graph, a miss otherwise; `partial` counts the misses in which one path
    did replay while the other fell back to eager.
    """

    hits: int = 0
    misses: int = 0
    partial: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def count(self, replayed: list[bool]) -> None:
        """Record one item from whether each path it used replayed."""
        if all(replayed):
            self.hits += 1
            return
        self.misses += 1
        self.partial += int(any(replayed))


class DualPathEncoder:
    """A global view plus local tiles per item, each path with its own graph set, behind
    BatchEncoder's interface.

    Items are packed with `pack_dual` against both paths' budgets at once; per batch,
    each path runs the items that have views for it, replaying the budget the packer
    chose for that path or running eagerly where it chose None, so one path may replay
    while the other falls back. The paths' per-view rows are merged by the adapter's
    `combine` before `reduce`. Statistics: each path's manager counts its own hits and
    misses; `DualStats` counts items over both. As in BatchEncoder, a failed batch is
    retried one item at a time eagerly (the failed attempt's path counts stay, since
    that work was done; the per-item counts only record the attempt that succeeded).
    """

    def __init__(self, adapter: FixedResAdapter, paths: list[EncoderPath], policy: str) -> None:
        if len(paths) != 2:
            raise ValueError(f"a dual-path encoder needs a global and a local path, got {[p.name for p in paths]}")
        self.adapter = adapter
        self.paths = paths
        self.plan = DualPlan(paths[0].plan, paths[1].plan)
        self.policy = policy
        self.counts = DualStats()

    def capture(self) -> None:
        for path in self.paths:
            path.manager.capture()

    def clear(self) -> None:
        for path in self.paths:
            path.manager.clear()

    @property
    def hit_rate(self) -> float:
        return self.counts.hit_rate

    def graph_stats(self) -> GraphStats:
        """Both paths as one GraphStats (what data-parallel ranks merge): hits and misses
        per item over both paths, every other count summed over the paths."""
        total = GraphStats()
        for path in self.paths:
            total.merge(path.manager.stats)
            total.capture_seconds += path.manager.stats.capture_seconds
            total.pool_bytes += path.manager.stats.pool_bytes
        total.hits, total.misses = self.counts.hits, self.counts.misses
        return total

    def plan_stats(self) -> dict[str, Any]:
        """Both paths' plans under the single-path keys, the partial fallbacks, and each
        path's own budgets and statistics under `paths`."""
        return {
            "num_graphs": sum(p.manager.num_graphs for p in self.paths),
            "token_budgets": list(self.paths[0].plan.token_budgets),
            "max_items_per_batch": self.plan.global_plan.max_items,
            "max_frames_per_batch": self.plan.global_plan.max_frames,
            "graph_backend": self.paths[0].manager.backend,
            "partial_fallbacks": self.counts.partial,
            "paths": {p.name: {"token_budgets": list(p.plan.token_budgets), **p.manager.stats.to_dict()} for p in self.paths},
        }

    def stats(self) -> dict[str, Any]:
        """The plan and the combined statistics under the single-path keys."""
        return {**self.plan_stats(), **self.graph_stats().to_dict()}

    def path_inputs(self, items: list[EncoderInput]) -> list[list[EncoderInput | None]]:
        """Per path, per item: the item's input on that path, or None (no views there)."""
        return [[self.adapter.path_input(item, path.key) for item in items] for path in self.paths]

    def batches(self, items: list[EncoderInput]) -> list[DualBatch]:
        """How `encode` packs these items (both paths' limits at once)."""
        return self._pack(self.path_inputs(items), [item.frames for item in items])

    def _pack(self, inputs: list[list[EncoderInput | None]], frames: list[int]) -> list[DualBatch]:
        tokens = [[0 if sub is None else sub.tokens for sub in column] for column in inputs]
        return pack_dual(tokens[0], tokens[1], frames, self.plan, self.policy)

    def encode(self, items: list[EncoderInput], pooling: str, dtype: torch.dtype) -> Encoded:
        """Every item's combined rows, pooled per `pooling`, in `dtype`, on the device."""
        out = _Collector(len(items), self.adapter.embed_dim, pooling, dtype, self.adapter.device)
        inputs = self.path_inputs(items)
        for batch in self._pack(inputs, [item.frames for item in items]):
            budgets = (batch.global_budget, batch.local_budget)
            self._encode_batch(inputs, list(batch.indices), budgets, out)
        return out.result()

    def run(self, items: list[EncoderInput], budgets: tuple[int | None, ...], reduce: Reduce = clone_rows) -> list[torch.Tensor]:
        """Embed one packed batch with one budget per path (None: that path runs eagerly)."""
        inputs = self.path_inputs(items)
        return [reduce(rows) for rows in self._run_paths(inputs, list(range(len(items))), budgets)]

    def run_padded_eager(self, items: list[EncoderInput], budgets: tuple[int | None, ...]) -> list[torch.Tensor]:
        """Each path's graph body run eagerly on this batch's padded buffers, combined per
        item like `run` (for equality checks). Every path with items needs a graph budget."""
        inputs = self.path_inputs(items)
        parts: list[dict[str, torch.Tensor]] = [{} for _ in items]
        for path, column, budget in zip(self.paths, inputs, budgets):
            chosen = [(k, sub) for k, sub in enumerate(column) if sub is not None]
            if not chosen:
                continue
            subs = [sub for _, sub in chosen]
            output = path.manager.run_padded_eager(subs, budget)
            for (k, _), rows in zip(chosen, self.adapter.split(output, subs)):
                parts[k][path.key] = rows
        return [self.adapter.combine(p) for p in parts]

    def _encode_batch(
        self, inputs: list[list[EncoderInput | None]], indices: list[int], budgets: tuple[int | None, ...], out: _Collector
    ) -> None:
        try:
            outputs = self._run_paths(inputs, indices, budgets)
            with torch.inference_mode():
                out.add(indices, torch.cat(outputs), [rows.shape[0] for rows in outputs])
        except Exception as exc:
            if len(indices) == 1 and all(b is None for b in budgets):
                out.fail(indices[0], f"encode_failed: {type(exc).__name__}: {exc}")
                logger.warning("an item failed to encode: %s", exc)
                return
            logger.warning("dual-path batch of %d items failed (%s); retrying one at a time", len(indices), exc)
            for i in indices:
                self._encode_batch(inputs, [i], (None,) * len(self.paths), out)

    def _run_paths(
        self, inputs: list[list[EncoderInput | None]], indices: list[int], budgets: tuple[int | None, ...]
    ) -> list[torch.Tensor]:
        """Run every path on its share of the batch, then combine per item."""
        parts: list[dict[str, torch.Tensor]] = [{} for _ in indices]
        replayed: list[list[bool]] = [[] for _ in indices]
        for path, column, budget in zip(self.paths, inputs, budgets):
            chosen = [(k, column[i]) for k, i in enumerate(indices) if column[i] is not None]
            if not chosen:
                continue
            hits = path.manager.stats.hits
            rows = path.manager.run([sub for _, sub in chosen], budget)
            hit = path.manager.stats.hits > hits
            for (k, _), item_rows in zip(chosen, rows):
                parts[k][path.key] = item_rows
                replayed[k].append(hit)
        combined = [self.adapter.combine(p) for p in parts]
        for item_replayed in replayed:
            self.counts.count(item_replayed)
        return combined
