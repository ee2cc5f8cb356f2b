"""Test-only views of the engine: a batch's padded-eager output (what its replay must
equal bit for bit), one packed batch run through every path, and the one-path encoder
over an existing manager. Built on the engine's public methods only."""

from __future__ import annotations

import torch
from conftest import random_image

from embedjob.encoders.base import EncoderInput
from embedjob.engine.encode import BatchEncoder, GraphPath, graph_paths
from embedjob.engine.graphs import GraphManager, Reduce, clone_rows
from embedjob.engine.packer import Batch, BudgetPlan


def padded_eager(manager: GraphManager, items: list[EncoderInput], budget: int) -> torch.Tensor:
    """The graph body run eagerly on this batch's padded buffers of `budget` (every row, pad rows too)."""
    static = manager.padded_inputs(items, budget)
    with torch.inference_mode():
        return manager.adapter.forward(static).clone()


def one_path_encoder(manager: GraphManager, policy: str) -> BatchEncoder:
    """The batch encoder over one existing manager (its adapter's single path)."""
    return BatchEncoder(manager.adapter, [GraphPath("global", None, manager.plan, manager)], policy)


def one_path_encoder_on(adapter, plan: BudgetPlan, backend: str, refine: bool) -> BatchEncoder:
    """A captured one-path encoder over a new manager of `plan` (min_padding)."""
    manager = GraphManager(adapter, plan, backend)
    manager.capture()
    return BatchEncoder(adapter, [GraphPath("global", None, plan, manager)], "min_padding", refine=refine)


def same_size_items(adapter, count: int) -> list[EncoderInput]:
    """`count` distinct 196x224 images: 56 tokens each in the tiny Qwen tower, which a
    doubling ladder fits badly (8 of them are 448 tokens in a 512 budget)."""
    items = [adapter.preprocessor()(random_image(196, 224, seed)) for seed in range(count)]
    assert {item.tokens for item in items} == {56}
    return items


def paths_encoder(adapter, plan: BudgetPlan, backend: str | None, policy: str) -> BatchEncoder:
    """The batch encoder over every path the adapter declares, each with `plan`'s budgets, captured."""
    encoder = BatchEncoder(adapter, graph_paths(adapter, plan, backend), policy)
    encoder.capture()
    return encoder


def batches(encoder: BatchEncoder, items: list[EncoderInput]) -> list[Batch]:
    """How `encode` packs these items."""
    return encoder.pack(encoder.path_inputs(items), [item.frames for item in items])


def run(
    encoder: BatchEncoder, items: list[EncoderInput], budgets: tuple[int | None, ...], reduce: Reduce = clone_rows
) -> list[torch.Tensor]:
    """One packed batch with one budget per path (None: that path runs eagerly): each item's combined rows."""
    rows, counts = encoder.run(encoder.path_inputs(items), list(range(len(items))), budgets)
    return [reduce(item_rows) for item_rows in rows.split(counts)]


def run_padded_eager(
    encoder: BatchEncoder, items: list[EncoderInput], budgets: tuple[int | None, ...]
) -> list[torch.Tensor]:
    """Each path's graph body run eagerly on this batch's padded buffers, combined per item
    like `run`. Every path with items needs a graph budget."""
    inputs = encoder.path_inputs(items)
    parts: list[dict[str, torch.Tensor]] = [{} for _ in items]
    for path, column, budget in zip(encoder.paths, inputs, budgets):
        chosen = [(k, sub) for k, sub in enumerate(column) if sub is not None]
        if not chosen:
            continue
        subs = [sub for _, sub in chosen]
        output = padded_eager(path.manager, subs, budget)
        for (k, _), rows in zip(chosen, encoder.adapter.split(output, subs)):
            parts[k][path.key] = rows
    return [encoder.adapter.combine(p) for p in parts]
