"""The batch encoder: a window's items -> packed batches -> every path's graphs -> pooled rows.

Paths are data, as in vLLM's manager: the adapter declares them (`EncoderAdapter.paths`:
one global path for most towers, global + local tiles for a fixed-resolution tower with
`preprocess.tiling: anyres`) and how their outputs combine (`path_input`, `combine`).
Each path gets its own `GraphManager` and budgets; one `packer.pack` call packs against
all of them, and one retry path isolates failing items. `build_encoder` turns a job into
the plan and the encoder. See ARCHITECTURE.md, rows "packing" and "graphs".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from embedjob.config import Job, JobError
from embedjob.encoders.base import EncoderAdapter, EncoderInput
from embedjob.engine import packer
from embedjob.engine.defs import Encoded, GraphStats, ItemCounts, hit_rate, lap
from embedjob.engine.graphs import GraphManager, pool_rows
from embedjob.engine.packer import Batch, BudgetPlan

logger = logging.getLogger(__name__)

# Per path, per item: what the item brings to that path, or None (nothing, e.g. no tiles).
PathInputs = list[list[EncoderInput | None]]


class CaptureLock:
    """Graph capture against the other threads' CUDA work: any number of threads work
    on the device at once (`shared`), while capture (`exclusive`) waits until none does
    and keeps new ones out until it is done. Capture forbids CUDA work on other threads;
    the GPU-decode threads must not exclude each other, or the one that waits inside
    nvjpeg would stall the one that could work meanwhile."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._sharing = 0
        self._capturing = False

    @contextlib.contextmanager
    def shared(self) -> Any:
        with self._changed:
            self._changed.wait_for(lambda: not self._capturing)
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Any:
        with self._changed:
            self._changed.wait_for(lambda: not self._capturing and not self._sharing)
            self._capturing = True
        try:
            yield
        finally:
            with self._changed:
                self._capturing = False
                self._changed.notify_all()


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
class GraphPath:
    """One declared path of the adapter with its graph set.

    `key` is the adapter's `PathSpec.key` (None: whole items); `plan` holds the budgets
    the packer picks from, which for a path after the first start with 0 (a batch with
    no input there skips the path); `manager` captures and replays the positive ones.
    """

    name: str
    key: str | None
    plan: BudgetPlan
    manager: GraphManager


def graph_paths(adapter: EncoderAdapter, plan: BudgetPlan, backend: str | None) -> list[GraphPath]:
    """Every path the adapter declares, each with `plan`'s budgets (further paths add 0)
    and the limits all of them share, since one batch feeds every path."""
    plans = packer.resolve_path_budgets([plan] * len(adapter.paths))
    paths = []
    for spec, path_plan in zip(adapter.paths, plans):
        positive = tuple(b for b in path_plan.token_budgets if b > 0)
        manager = GraphManager(adapter, BudgetPlan(positive, path_plan.max_items, path_plan.max_frames), backend)
        paths.append(GraphPath(spec.name, spec.key, path_plan, manager))
    return paths


class BatchEncoder:
    """Packs items against every path's budgets and runs each batch through the paths.

    This is the `defs.Encoder` the pipeline uses to encode a window: `encode` returns
    every item's rows, pooled per batch (`pool_rows`), or, for an item that failed, a
    reason. A failed batch is retried one item at a time eagerly on every path, so one
    bad item (e.g. out of memory on a huge video) costs one error row, not the batch;
    the failed attempt's per-path counts stay (that work was done), the per-item counts
    record only the attempt that finished.

    With `refine` (one path, graphs on), a window whose batches pay more than
    `packer.REFINE_PADDING` of their tokens in padding adds the budgets that fit them
    (`packer.refined_budgets`, at most `packer.MAX_ADDED_BUDGETS` over the run), whose
    graphs are captured before the window is packed again; `added` lists them.

    Statistics: each path's manager counts its own batches, hits and misses; `items`
    counts items over all paths (a hit only when every path it used replayed), which
    is what `graph_stats` reports as hits and misses. With one path the two agree.
    """

    def __init__(self, adapter: EncoderAdapter, paths: list[GraphPath], policy: str, refine: bool = False) -> None:
        self.adapter = adapter
        self.paths = paths
        self.policy = policy
        self.refine = refine and len(paths) == 1 and paths[0].manager.backend is not None
        self.added: list[int] = []
        self.items = ItemCounts()
        self.host_seconds: Counter = Counter()
        # Held while graphs are captured mid-run: capture forbids CUDA work on other
        # threads, so a thread that works on the device beside this one shares it.
        self.capture_lock = CaptureLock()

    @property
    def plans(self) -> tuple[BudgetPlan, ...]:
        """Every path's plan, as the packer takes them (a path's grows with added budgets)."""
        return tuple(path.plan for path in self.paths)

    def capture(self) -> None:
        for path in self.paths:
            path.manager.capture()

    def capture_on(self, stream: torch.cuda.Stream | None) -> None:
        """Warm up and capture every path's graphs on `stream` (`GraphManager.stream`) from now on."""
        for path in self.paths:
            path.manager.stream = stream

    def clear(self) -> None:
        for path in self.paths:
            path.manager.clear()

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.items.hits, self.items.misses)

    def graph_stats(self) -> GraphStats:
        """Every path as one GraphStats (what data-parallel ranks merge): hits and misses
        per item over the paths, every other count summed over them."""
        total = GraphStats()
        for path in self.paths:
            total.merge(path.manager.stats)
            total.capture_seconds += path.manager.stats.capture_seconds
            total.pool_bytes += path.manager.stats.pool_bytes
        total.host_seconds.update(self.host_seconds)
        total.hits, total.misses = self.items.hits, self.items.misses
        return total

    def plan_stats(self) -> dict[str, Any]:
        """The first path's plan and all graphs, as written to stats-*.json; with several
        paths also the partial fallbacks and each path's budgets and statistics."""
        first = self.paths[0]
        stats: dict[str, Any] = {
            "num_graphs": sum(path.manager.num_graphs for path in self.paths),
            "token_budgets": [b for b in first.plan.token_budgets if b not in self.added],
            "added_budgets": list(self.added),
            "max_items_per_batch": first.plan.max_items,
            "max_frames_per_batch": first.plan.max_frames,
            "graph_backend": first.manager.backend,
            "precision": "fp8" if self.adapter.fp8_layers else "bf16",
            "attention": self.adapter.attention,
        }
        if self.adapter.fp8_layers:
            stats["fp8_layers"] = dict(self.adapter.fp8_layers)
        if len(self.paths) > 1:
            stats["partial_fallbacks"] = self.items.partial
            stats["paths"] = {
                p.name: {"token_budgets": list(p.plan.token_budgets), **p.manager.stats.to_dict()} for p in self.paths
            }
        return stats

    def stats(self) -> dict[str, Any]:
        """The plan and the combined statistics."""
        return {**self.plan_stats(), **self.graph_stats().to_dict()}

    def encode(self, items: list[EncoderInput], pooling: str, dtype: torch.dtype) -> Encoded:
        """Every item's rows, pooled per `pooling`, in `dtype`, on the device."""
        out = _Collector(len(items), self.adapter.embed_dim, pooling, dtype, self.adapter.device)
        since = time.perf_counter()
        inputs = self.path_inputs(items)
        frames = [item.frames for item in items]
        batches = self.pack(inputs, frames)
        if self.refine and self._add_budgets(batches):
            batches = self.pack(inputs, frames)
        lap(self.host_seconds, "pack", since)
        for batch in batches:
            self._encode_batch(inputs, list(batch.indices), batch.budgets, out)
        since = time.perf_counter()
        result = out.result()
        lap(self.host_seconds, "collect", since)
        return result

    def _add_budgets(self, batches: list[Batch]) -> bool:
        """Add the budgets these batches ask for (see the class docstring); whether any were."""
        path = self.paths[0]
        budgets = packer.refined_budgets(batches, path.plan.token_budgets, packer.MAX_ADDED_BUDGETS - len(self.added))
        if not budgets:
            return False
        before = packer.padding_share(batches)
        try:
            with self.capture_lock.exclusive():
                path.manager.add_budgets(budgets)
        except Exception as exc:  # the ladder still serves every batch: go on without
            logger.warning(
                "could not capture the graphs of added budgets %s (%s); keeping %s",
                budgets, exc, list(self.plans[0].token_budgets),
            )
            self.refine = False
            return False
        path.plan = path.manager.plan
        self.added = sorted([*self.added, *budgets])
        logger.info(
            "added token budgets %s: this window's batches paid %.0f%% of their tokens in padding",
            budgets, 100 * before,
        )
        return True

    def path_inputs(self, items: list[EncoderInput]) -> PathInputs:
        """Per path, per item: the item's input on that path (a path without a key takes
        items whole), or None where it has none."""
        return [
            list(items) if path.key is None else [self.adapter.path_input(item, path.key) for item in items]
            for path in self.paths
        ]

    def pack(self, inputs: PathInputs, frames: list[int]) -> list[Batch]:
        """How `encode` batches these inputs: against every path's limits at once."""
        tokens = [[0 if sub is None else sub.tokens for sub in column] for column in inputs]
        return packer.pack(tokens, frames, self.plans, self.policy)

    def run(
        self, inputs: PathInputs, indices: list[int], budgets: tuple[int | None, ...]
    ) -> tuple[torch.Tensor, list[int]]:
        """One packed batch, one budget per path (None: that path runs eagerly): the
        items' rows in batch order and each item's row count; counts each item's outcome.

        With one path the batch's rows are already the items' rows in order and go to
        pooling as one tensor (a constant number of torch calls per batch); with several,
        each item's rows from every path are merged by the adapter's `combine` first.
        """
        if len(self.paths) == 1:
            return self._run_one(inputs[0], indices, budgets[0])
        return self._run_combined(inputs, indices, budgets)

    def _encode_batch(
        self, inputs: PathInputs, indices: list[int], budgets: tuple[int | None, ...], out: _Collector
    ) -> None:
        try:
            rows, counts = self.run(inputs, indices, budgets)
            since = time.perf_counter()
            with torch.inference_mode():
                out.add(indices, rows, counts)
            lap(self.host_seconds, "pool", since)
        except Exception as exc:
            if len(indices) == 1 and all(budget is None for budget in budgets):
                out.fail(indices[0], f"encode_failed: {type(exc).__name__}: {exc}")
                logger.warning("an item failed to encode: %s", exc)
                return
            logger.warning("batch of %d items failed (%s); retrying one at a time", len(indices), exc)
            for i in indices:
                self._encode_batch(inputs, [i], (None,) * len(self.paths), out)

    def _run_one(
        self, column: list[EncoderInput | None], indices: list[int], budget: int | None
    ) -> tuple[torch.Tensor, list[int]]:
        chosen = [column[i] for i in indices]
        manager = self.paths[0].manager
        hits = manager.stats.hits
        rows = manager.run_batch(chosen, budget)
        self.items.count([manager.stats.hits > hits], len(chosen))
        return rows, self.adapter.row_counts(chosen)

    def _run_combined(
        self, inputs: PathInputs, indices: list[int], budgets: tuple[int | None, ...]
    ) -> tuple[torch.Tensor, list[int]]:
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
            self.items.count(item_replayed)
        with torch.inference_mode():
            return torch.cat(combined), [rows.shape[0] for rows in combined]


def budget_plan(job: Job, adapter: EncoderAdapter) -> BudgetPlan:
    """The packer's plan from the job's batching keys and the adapter's budget range,
    its budgets rounded down to whole items where every item costs the same
    (`EncoderAdapter.budget_unit`)."""
    b = job.batching
    try:
        plan = packer.resolve_budgets(
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
    return _whole_image_plan(plan, adapter.budget_unit) if adapter.budget_unit > 1 else plan


def _auto(value: Any) -> Any:
    """The job's "auto" is the packer's None."""
    return None if value == "auto" else value


def _backend(job: Job, device: torch.device, adapter: EncoderAdapter) -> str | None:
    """Real CUDA graphs on a GPU, the replay backend on a CPU, none when graphs are off
    or the adapter cannot be captured on its device (then said once)."""
    if not job.batching.cuda_graphs:
        return None
    if device.type != "cuda":
        return "replay"
    if not adapter.capturable:
        logger.warning(
            "model.dtype %s: this model's attention cannot be captured in CUDA graphs on the GPU in that dtype, "
            "so every batch runs eagerly (slower); use bfloat16 for speed", job.model.dtype,
        )
        return None
    return "cuda"


def _whole_image_plan(plan: BudgetPlan, tokens_per_image: int) -> BudgetPlan:
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


def build_encoder(job: Job, adapter: EncoderAdapter, device: torch.device, plan: BudgetPlan | None = None) -> BatchEncoder:
    """The batch encoder for this job and adapter: budgets, graph backend, packing policy.

    The backend is real CUDA graphs on a GPU, the replay backend on a CPU (same packing
    and padding, so results and statistics match), or none when graphs are turned off.
    Every path the adapter declares shares the job's budgets (a further path adds 0);
    `plan` replaces them where the job's batching keys are not this adapter's (a text
    tower's batches of captions).
    """
    plan = plan if plan is not None else budget_plan(job, adapter)
    paths = graph_paths(adapter, plan, _backend(job, device, adapter))
    return BatchEncoder(adapter, paths, job.batching.policy, refine=job.batching.refine_budgets)
