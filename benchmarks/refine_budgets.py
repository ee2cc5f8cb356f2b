"""Budgets added for items of one size (issue #19, item 5): padding, capture time, graph
pool and encoder rate of repeated clips, the doubling ladder against the refined one.

Usage (from the repository root, one GPU):

    PYTHONPATH=. python3 benchmarks/refine_budgets.py [--photos DIR ...] [--clips 128]
    PYTHONPATH=. python3 benchmarks/refine_budgets.py --smoke     # CPU, tiny tower, replay backend

Clips: `--clips` distinct clips per size, each of 12 frames cut from the real photos
(every frame another crop, resized to the clip's size), preprocessed by the
Qwen2.5-VL-7B-size tower's processor with the model's video `max_pixels` (768 * 28 * 28):
a 1080p clip is 4,320 tokens, the case of the issue. For each size and each setting of
`refine`, a fresh `BatchEncoder` over the automatic ladder captures its graphs, encodes
the clips in windows of `--window` items as a run does (the first pass adds the budgets),
then encodes them again: the median of REPEATS more passes, CUDA-event timed, is the
steady rate. The last
thing printed is the table: padding over real tokens, budgets added, capture seconds
(ladder, then added), graph pool GiB and items per second.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.mixes import builtin_sources, collect_photos  # noqa: E402
from embedjob.bench import cuda_time  # noqa: E402
from embedjob.encoders.base import EncoderInput  # noqa: E402
from embedjob.engine import packer  # noqa: E402
from embedjob.engine.encode import BatchEncoder, GraphPath  # noqa: E402
from embedjob.engine.graphs import GraphManager  # noqa: E402

VIDEO_MAX_PIXELS = 768 * 28 * 28
FRAMES = 12
REPEATS = 3
SIZES = {"1080p": (1080, 1920), "480p": (480, 854)}
SMOKE_SIZES = {"196x224": (196, 224), "140x252": (140, 252)}


def photos(sources: list[Path]) -> list[Image.Image]:
    """The readable real photos of `sources`, as RGB images."""
    images = []
    for photo in collect_photos(sources):
        try:
            images.append(Image.open(io.BytesIO(photo.data)).convert("RGB"))
        except OSError:
            continue
    if not images:
        raise SystemExit("no readable photo in --photos")
    return images


def bases(images: list[Image.Image], size: tuple[int, int]) -> list[Image.Image]:
    """Each photo resized once to cover (height, width) with room for crops (a fifth
    more), so that a clip's frames are crops, not resizes, of it."""
    height, width = size
    out = []
    for image in images:
        scale = 1.2 * max(height / image.height, width / image.width)
        out.append(image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale)))))
    return out


def clip(bases: list[Image.Image], index: int, size: tuple[int, int]) -> np.ndarray:
    """Clip `index`: FRAMES frames of (height, width), each a different crop of a photo."""
    height, width = size
    frames = []
    for frame in range(FRAMES):
        base = bases[(index * FRAMES + frame) % len(bases)]
        left = (7 * index + 13 * frame) % (base.width - width + 1)
        top = (5 * index + 11 * frame) % (base.height - height + 1)
        frames.append(np.asarray(base.crop((left, top, left + width, top + height))))
    return np.stack(frames)


def clips(adapter, images: list[Image.Image], size: tuple[int, int], count: int) -> list[EncoderInput]:
    from types import SimpleNamespace

    processing = adapter.preprocessor()
    resized = bases(images, size)
    return [processing(SimpleNamespace(frames=clip(resized, i, size))) for i in range(count)]


def encode_all(encoder: BatchEncoder, items: list[EncoderInput], window: int) -> None:
    for start in range(0, len(items), window):
        encoder.encode(items[start : start + window], "mean", torch.float16)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` (CUDA events on a GPU, `embedjob.bench.cuda_time`); the
    caller's first pass was the warm-up."""
    if device.type == "cuda":
        return cuda_time(fn, repeats, warmup=0)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(adapter, items: list[EncoderInput], refine: bool, window: int, backend: str) -> dict:
    plan = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 32, True)
    manager = GraphManager(adapter, plan, backend)
    manager.capture()
    ladder_capture, ladder_pool = manager.stats.capture_seconds, manager.stats.pool_bytes
    encoder = BatchEncoder(adapter, [GraphPath("global", None, plan, manager)], "min_padding", refine=refine)
    encode_all(encoder, items, window)  # the first pass: budgets are added here
    stats = manager.stats
    padding = stats.padding_waste / max(stats.real_tokens, 1)
    seconds = timed(lambda: encode_all(encoder, items, window), adapter.device, REPEATS)
    result = {
        "padding": padding,
        "added": list(encoder.added),
        "graphs": manager.num_graphs,
        "capture_ladder_s": ladder_capture,
        "capture_added_s": stats.capture_seconds - ladder_capture,
        "pool_gib": stats.pool_bytes / 2**30,
        "pool_added_gib": (stats.pool_bytes - ladder_pool) / 2**30,
        "items_per_second": len(items) / seconds,
    }
    manager.clear()
    return result


def tower(smoke: bool):
    """The 7B-size tower (`embedjob bench`'s) with the model's video max_pixels; with
    --smoke the builtin tiny tower on the CPU."""
    if smoke:
        from embedjob.config import load_job
        from embedjob.pipeline import load_encoder_adapter

        return load_encoder_adapter(load_job(str(REPO / "jobs" / "demo.yaml"), ["runtime.device=cpu"]), torch.device("cpu"))
    from embedjob.bench import build_tower

    return build_tower(torch.device("cuda"), video_max_pixels=VIDEO_MAX_PIXELS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", nargs="+", type=Path, default=[])
    parser.add_argument("--clips", type=int, default=128)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    images = photos(args.photos or builtin_sources())
    adapter = tower(args.smoke)
    backend = "replay" if args.smoke else "cuda"
    sizes = SMOKE_SIZES if args.smoke else SIZES
    count = min(args.clips, 64) if args.smoke else args.clips
    rows = []
    for name, size in sizes.items():
        items = clips(adapter, images, size, count)
        tokens = sorted({item.tokens for item in items})
        print(f"{name}: {count} clips of {tokens} tokens", file=sys.stderr, flush=True)
        for refine in (False, True):
            rows.append((name, tokens, refine, measure(adapter, items, refine, args.window, backend)))
    print(f"\n{count} clips per size, {FRAMES} frames each, windows of {args.window}; device {adapter.device}")
    print("| clips | tokens each | budgets | padding | added | graphs | capture s (ladder + added) | pool GiB (added) | items/s |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, tokens, refine, r in rows:
        print(
            f"| {name} | {tokens} | {'refined' if refine else 'ladder'} | {100 * r['padding']:.1f}% | {r['added'] or '-'} "
            f"| {r['graphs']} | {r['capture_ladder_s']:.1f} + {r['capture_added_s']:.1f} "
            f"| {r['pool_gib']:.2f} ({r['pool_added_gib']:.2f}) | {r['items_per_second']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
