"""Host time of batch assembly (`batch_values`, `eager_inputs`) per item; prints one table.

Usage (from the repository root; a CPU is enough):

    python benchmarks/host_path.py [--repeats 7] [--device cpu]

The runner's main thread assembles every batch before the device runs it, so what an
adapter spends there per item bounds the items per second of the whole pipeline (the
target is ~0.2 ms per item in total on the 224 px mix). Each torch call on that thread
costs microseconds and releases and re-takes the GIL, which the decode-pool receiver
and the writer compete for, so the table also counts the torch calls per batch.

It builds the builtin tiny Qwen2.5-VL and CLIP adapters (made once, with fixed-seed
weights, in a temporary cache), preprocesses two fixed-seed mixes as decode workers do
(256 random 224 x 224 images; 48 random images of 56-1344 px and 8 short videos), packs
them with the job's automatic budgets, and times per mix: `batch_values` into each
batch's budget (what a graph replay copies) and `eager_inputs` (the exact-size batch a
miss runs). Times are the best of `--repeats` passes over all batches, in microseconds
per item; calls are torch function calls per batch (attribute reads such as `.shape`
excluded: they neither dispatch an op nor release the GIL).

On a CPU the time of large items is mostly the first writes into the freshly allocated
batch tensor (page faults: 1-2 GB/s on a small shared VM) and varies with the machine's
load; the call counts do not. A CUDA adapter's page-locked batch tensors come from
torch's caching host allocator, which reuses them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import transformers
from torch.overrides import TorchFunctionMode

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.config import job_from_dict  # noqa: E402
from embedjob.encoders import EncoderAdapter, EncoderInput, load_adapter  # noqa: E402
from embedjob.engine.encode import budget_plan  # noqa: E402
from embedjob.engine.packer import pack  # noqa: E402

FAMILIES = ("qwen2_5_vl", "clip")


def load(family: str, cache: Path, device: torch.device) -> tuple[EncoderAdapter, Any]:
    """The builtin adapter of `family` and the packing plan of a default job for it."""
    job = job_from_dict(
        {
            "input": {"path": "unused.parquet", "media_column": "image", "modality": "auto"},
            "model": {"family": family, "path": f"builtin:tiny-{family}"},
            "output": {"path": "unused"},
            "runtime": {"cache_dir": str(cache)},
        }
    )
    adapter = load_adapter(job, device)
    return adapter, budget_plan(job, adapter)


def mixes() -> dict[str, list[SimpleNamespace]]:
    """Decoded media as the decode stage hands it over, from fixed seeds."""
    rng = np.random.default_rng(0)
    square = [SimpleNamespace(pixels=rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(256)]
    mixed = []
    for k in range(56):
        h, w = (int(v) for v in rng.integers(56, 1345, size=2))
        if k % 7 == 3:
            frames = int(rng.integers(2, 9))
            mixed.append(SimpleNamespace(frames=rng.integers(0, 256, (frames, h // 4 + 28, w // 4 + 28, 3), dtype=np.uint8)))
        else:
            mixed.append(SimpleNamespace(pixels=rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    return {"224px x256": square, "mixed x56": mixed}


class CallCounter(TorchFunctionMode):
    """Counts torch function calls, attribute reads excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") != "__get__":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def calls_per_batch(run: Callable[[], None], batches: int) -> float:
    with CallCounter() as counter:
        run()
    return counter.calls / batches


def measure(adapter: EncoderAdapter, plan: Any, items: list[EncoderInput], repeats: int) -> list[tuple[str, int, float, float]]:
    """(method, batches, microseconds per item, torch calls per batch) for both assembly
    paths, over the batches that fit a budget."""
    batches = pack([i.tokens for i in items], [i.frames for i in items], plan, "min_padding")
    graphed = [([items[i] for i in b.indices], b.budget) for b in batches if b.budget is not None]
    statics = {b: adapter.static_inputs(b, plan.max_items, plan.max_frames) for b in {b for _, b in graphed}}
    per_item = [i for chosen, _ in graphed for i in chosen]

    def replay_values() -> None:
        for chosen, budget in graphed:
            adapter.batch_values(chosen, statics[budget])

    def eager_values() -> None:
        for chosen, _ in graphed:
            adapter.eager_inputs(chosen)

    out = []
    with torch.inference_mode():
        for name, run in (("batch_values", replay_values), ("eager_inputs", eager_values)):
            seconds = best_seconds(run, repeats)
            out.append((name, len(graphed), 1e6 * seconds / len(per_item), calls_per_batch(run, len(graphed))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()  # the builtin models' save and load bars
    torch.set_num_threads(1)  # the main thread's own cost, not what idle cores can hide
    device = torch.device(args.device)
    media = mixes()
    print(f"{'encoder':<12} {'mix':<12} {'method':<14} {'batches':>7} {'us/item':>9} {'calls/batch':>12}")
    with tempfile.TemporaryDirectory() as cache:
        for family in FAMILIES:
            adapter, plan = load(family, Path(cache), device)
            for mix, decoded in media.items():
                items = [adapter.preprocessor()(m) for m in decoded]
                for method, batches, micros, calls in measure(adapter, plan, items, args.repeats):
                    print(f"{family:<12} {mix:<12} {method:<14} {batches:>7} {micros:>9.1f} {calls:>12.1f}")


if __name__ == "__main__":
    main()
