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

An encoder whose adapter declares several paths (a global view plus local tiles) runs
one manager per path (`encode.BatchEncoder`); see ARCHITECTURE.md, row "graphs".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from embedjob.encoders.base import PAD_REPEAT_LAST, PAD_ZERO, EncoderAdapter, EncoderInput, StaticInputs
from embedjob.engine.defs import GraphStats, lap
from embedjob.engine.packer import BudgetPlan

logger = logging.getLogger(__name__)

Reduce = Callable[[torch.Tensor], torch.Tensor]
POOLINGS = ("mean", "none")


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

    def __init__(self, body: Callable[[], torch.Tensor], pool: Any, stream: torch.cuda.Stream | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
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
        self.stream: torch.cuda.Stream | None = None
        """The stream graphs are warmed up and captured on, or None for new ones (torch's
        own for capture). A captured kernel runs in the context of the stream it was
        captured on: a green context's (`engine.green`) holds the graphs to its SMs."""

    @property
    def num_graphs(self) -> int:
        """Budgets that replay a graph (captured on CUDA, recorded on the replay backend)."""
        return len(self.plan.token_budgets) if self._captured else 0

    @property
    def budgets(self) -> tuple[int, ...]:
        return self.plan.token_budgets

    def capture(self) -> None:
        """Capture every budget into one new shared pool (see `_capture`)."""
        if self.backend is None or self._captured:
            return
        self.stats.capture_seconds, self.stats.pool_bytes = 0.0, 0
        if self.backend == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._capture(self.plan.token_budgets)
        self._captured = True
        logger.info(
            "captured %d graphs (%s backend) for budgets %s in %.1f s",
            self.num_graphs,
            self.backend,
            list(self.plan.token_budgets),
            self.stats.capture_seconds,
        )

    def add_budgets(self, budgets: Sequence[int]) -> None:
        """Add budgets to the plan; once graphs are captured, capture theirs now into the
        same pool, so the next batch can replay them.

        Called between batches on the thread that replays: capture waits for the device
        to finish what is queued, a pause paid once per added budget.
        """
        new = set(budgets) - set(self.plan.token_budgets)
        if not new:
            return
        if self.backend == "cuda" and self._captured:
            self._capture(new)
        # Only now: a budget in the plan must have its graph (the replay backend makes
        # a budget's entry on its first use).
        plan = self.plan
        self.plan = BudgetPlan(tuple(sorted({*plan.token_budgets, *new})), plan.max_items, plan.max_frames)

    def _capture(self, budgets: Iterable[int]) -> None:
        """Capture `budgets` into the shared pool, largest first so smaller graphs reuse
        its blocks, adding their seconds and the pool's growth to the statistics; if one
        fails, none of them is kept."""
        order = sorted(budgets, reverse=True)
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.adapter.device)
        try:
            with torch.inference_mode():
                for budget in order:
                    self._graphs[budget] = self._make_entry(budget)
            torch.cuda.synchronize(self.adapter.device)
        except BaseException:
            for budget in order:
                self._graphs.pop(budget, None)
            raise
        self.stats.pool_bytes += torch.cuda.memory_reserved(self.adapter.device) - before
        self.stats.capture_seconds += time.perf_counter() - start

    def _make_entry(self, budget: int) -> _Entry:
        static = self.adapter.static_inputs(budget, self.plan.max_items, self.plan.max_frames)

        def body() -> torch.Tensor:
            return self.adapter.forward(static)

        if self.backend == "replay":
            return _Entry(static, _RecordedGraph(body))
        side = self.stream if self.stream is not None else torch.cuda.Stream(self.adapter.device)
        side.wait_stream(torch.cuda.current_stream(self.adapter.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.adapter.device).wait_stream(side)
        return _Entry(static, _CudaGraph(body, self._pool, self.stream))

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
                since = lap(host, "prepare", since)
                output = self.adapter.forward(inputs)
                self._count(items, None, tokens)
            else:
                self._fill(entry.static, self.adapter.batch_values(items, entry.static))
                since = lap(host, "prepare", since)
                entry.graph.replay()
                output = entry.graph.output
                self._count(items, budget, tokens)
            lap(host, "launch", since)
            return output[:rows]

    def run(self, items: list[EncoderInput], budget: int | None, reduce: Reduce = clone_rows) -> list[torch.Tensor]:
        """`run_batch`, then `reduce(rows)` per item, in batch order (before the next replay)."""
        output = self.run_batch(items, budget)
        with torch.inference_mode():
            return [reduce(rows) for rows in self.adapter.split(output, items)]

    def padded_inputs(self, items: list[EncoderInput], budget: int) -> StaticInputs:
        """The static buffers of `budget` holding this batch, padded: what its replay reads.

        `forward` on them is the graph body run eagerly, so replay == this bit for bit
        (the invariant the tests check); the next batch of this budget overwrites them.
        """
        entry = self._entry(budget)
        if entry is None:
            raise ValueError(f"budget {budget} has no graph")
        with torch.inference_mode():
            self._fill(entry.static, self.adapter.batch_values(items, entry.static))
        return entry.static

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
