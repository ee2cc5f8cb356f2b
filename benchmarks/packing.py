"""Padding and graph hits: the budgets added for items of one size, the packing policies, thumbnails (RESULTS.md section 12).

Usage (from the repository root): ``python benchmarks/packing.py [--smoke]``;
``python -m benchmarks.packing --thumbnails 3000 30000 [--device cuda]``.

Mixes are generated with a fixed seed so runs are comparable. Token counts follow
Qwen2.5-VL: an image of h x w pixels (sides rounded to multiples of 28) yields
(h/28)*(w/28) output tokens; a video of F frames at h x w yields ceil(F/2) temporal
groups of that many tokens and counts F frames against the frame budget.

The verdict line answers the question the team asked before making min_padding the
default: was it ever worse than greedy (more padded tokens) on any mix?

A second table packs items of one size window by window (256 items) as the encoder does
with `batching.refine_budgets`: pack, add the budgets `packer.refined_budgets` asks for,
pack again; it prints the padding before and after and the budgets added. The sizes:
the 1080p clip of issue #19 (7 s at 2 fps, 4,320 tokens), a 640x480 photo (391 tokens),
a 1280x720 frame (1,196 tokens), a 448x448 image (256 tokens: a power of two), and a
mix of 224-1344 px photos.

`--thumbnails N ...` runs instead N distinct 32x32 JPEGs cut from real photos (the
generator of `benchmarks/mixes.py`) through `embedjob.run` with a Qwen2.5-VL tower (the
builtin tiny one unless `--model` names a checkpoint directory), and prints what decides
whether thumbnails replay their graphs: hit rate, batches that fell back to eager because
they needed more attention segments than the budget's buffers hold
(`capacity_fallbacks`), padding, and rows per second. The packing and the budget buffers
are the same on the CPU as on a GPU, so the hit rate is too.

`--smoke` packs fewer items (256 a table row, 512 of each size, 10 random mixes) and, with
`--thumbnails`, runs at most 64 thumbnails.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import embedjob  # noqa: E402
from benchmarks.common import builtin_sources, collect_photos  # noqa: E402
from benchmarks.common import table as markdown  # noqa: E402
from benchmarks.mixes import TOWERS, jpeg_dataset  # noqa: E402
from benchmarks.mixes import Mix as JpegMix  # noqa: E402
from embedjob.engine.packer import (  # noqa: E402
    MAX_ADDED_BUDGETS,
    POLICIES,
    BudgetPlan,
    generate_budgets,
    pack,
    padding_waste,
    refined_budgets,
    resolve_budgets,
)

SEED = 1234
ITEMS = 4096
RANDOM_MIXES = 200
MODEL_MIN, MODEL_MAX, FRAMES_PER_VIDEO = 64, 16384, 32

Mix = tuple[list[int], list[int]]


def _side(rng: random.Random, low: int, high: int) -> int:
    return 28 * round(rng.uniform(low, high) / 28)


def _image(rng: random.Random, low: int = 224, high: int = 1344) -> tuple[int, int]:
    return (_side(rng, low, high) // 28) * (_side(rng, low, high) // 28), 0


def _video(rng: random.Random) -> tuple[int, int]:
    frames = rng.randint(2, FRAMES_PER_VIDEO)
    per_group = (_side(rng, 224, 448) // 28) * (_side(rng, 224, 448) // 28)
    return math.ceil(frames / 2) * per_group, frames


def _long_tail(rng: random.Random) -> tuple[int, int]:
    # Log-normal pixel area: mostly thumbnails, a few scans larger than any budget.
    side = min(8192, max(224, int(rng.lognormvariate(6.3, 0.7))))
    return (side // 28) ** 2, 0


def mix(rng: random.Random, count: int, kind: str) -> Mix:
    """``count`` items of one of the named mixes, as (tokens, frames)."""
    makers: dict[str, Callable[[], tuple[int, int]]] = {
        "images 224-1344": lambda: _image(rng),
        "80% 224px": lambda: (64, 0) if rng.random() < 0.8 else _image(rng),
        "images+video": lambda: _video(rng) if rng.random() < 0.3 else _image(rng),
        "long tail": lambda: _long_tail(rng),
    }
    pairs = [makers[kind]() for _ in range(count)]
    return [t for t, _ in pairs], [f for _, f in pairs]


MIX_KINDS = ("images 224-1344", "80% 224px", "images+video", "long tail")


def plans() -> dict[str, BudgetPlan]:
    """Auto budgets for the Qwen range, capped budgets, and a tight frame budget."""
    auto = resolve_budgets(None, None, None, MODEL_MIN, MODEL_MAX, FRAMES_PER_VIDEO, True)
    capped = resolve_budgets(
        generate_budgets(64, 4096), None, None, MODEL_MIN, MODEL_MAX, FRAMES_PER_VIDEO, True
    )
    tight = resolve_budgets(None, None, 64, MODEL_MIN, MODEL_MAX, FRAMES_PER_VIDEO, True)
    return {"auto 64..16384": auto, "64..4096": capped, "auto, 64 frames": tight}


def timed_pack(tokens: list[int], frames: list[int], plan: BudgetPlan, policy: str):
    """Batches and the best of three wall times in milliseconds."""
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        batches = pack(tokens, frames, plan, policy)
        best = min(best, time.perf_counter() - start)
    return batches, best * 1000


def table(items: int) -> bool:
    """Print the table; True when min_padding never wasted more than greedy."""
    header = (
        f"{'mix':<16} {'budgets':<16} {'policy':<12} {'items':>6} {'batches':>7} "
        f"{'waste tok':>10} {'waste %':>8} {'eager':>6} {'pack ms':>8}"
    )
    print(header)
    print("-" * len(header))
    never_worse = True
    for kind in MIX_KINDS:
        tokens, frames = mix(random.Random(f"{SEED}-{kind}"), items, kind)
        for plan_name, plan in plans().items():
            waste = {}
            for policy in POLICIES:
                batches, ms = timed_pack(tokens, frames, plan, policy)
                graph = [b for b in batches if b.budget is not None]
                real = sum(b.tokens for b in graph)
                waste[policy] = padding_waste(batches)
                print(
                    f"{kind:<16} {plan_name:<16} {policy:<12} {len(tokens):>6} "
                    f"{len(batches):>7} {waste[policy]:>10} "
                    f"{100 * waste[policy] / max(real, 1):>7.2f}% "
                    f"{len(batches) - len(graph):>6} {ms:>8.1f}"
                )
            never_worse &= waste["min_padding"] <= waste["greedy"]
    return never_worse


def random_mixes(count: int) -> tuple[int, int, int, int, int]:
    """(worse, better, equal, greedy batches, min_padding batches) over random mixes."""
    rng = random.Random(SEED)
    plan_list = list(plans().values())
    worse = better = equal = greedy_batches = best_batches = 0
    for _ in range(count):
        tokens, frames = mix(rng, rng.randint(1, 1500), rng.choice(MIX_KINDS))
        plan = rng.choice(plan_list)
        greedy = pack(tokens, frames, plan, "greedy")
        best = pack(tokens, frames, plan, "min_padding")
        delta = padding_waste(best) - padding_waste(greedy)
        worse += delta > 0
        better += delta < 0
        equal += delta == 0
        greedy_batches += len(greedy)
        best_batches += len(best)
    return worse, better, equal, greedy_batches, best_batches


WINDOW = 256
REPEATED = {
    "1080p clip, 4320 tok": (4320, 14),
    "640x480 photo": ((644 // 28) * (476 // 28), 0),
    "1280x720 frame": ((1288 // 28) * (728 // 28), 0),
    "448x448 image": (256, 0),
}


def refined_padding(tokens: list[int], frames: list[int], plan: BudgetPlan) -> tuple[float, float, list[int]]:
    """Padding over real tokens without and with budgets added window by window, and the
    budgets added (the encoder's loop: pack, refine, pack again)."""
    ladder, added = plan, []
    before = after = real = 0
    for start in range(0, len(tokens), WINDOW):
        window, window_frames = tokens[start : start + WINDOW], frames[start : start + WINDOW]
        real += sum(window)
        before += padding_waste(pack(window, window_frames, ladder, "min_padding"))
        batches = pack(window, window_frames, plan, "min_padding")
        new = refined_budgets(batches, plan.token_budgets, MAX_ADDED_BUDGETS - len(added))
        if new:
            added += new
            plan = BudgetPlan(tuple(sorted({*plan.token_budgets, *new})), plan.max_items, plan.max_frames)
            batches = pack(window, window_frames, plan, "min_padding")
        after += padding_waste(batches)
    return before / real, after / real, sorted(added)


def refined_table(count: int) -> None:
    print(f"{f'items ({count:,} each)':<24} {'padding, ladder':>15} {'padding, refined':>16}  budgets added")
    plan = plans()["auto 64..16384"]
    mixes = {name: ([t] * count, [f] * count) for name, (t, f) in REPEATED.items()}
    mixes["photos 224-1344"] = mix(random.Random(f"{SEED}-refine"), count, "images 224-1344")
    for name, (tokens, frames) in mixes.items():
        before, after, added = refined_padding(tokens, frames, plan)
        print(f"{name:<24} {100 * before:>14.1f}% {100 * after:>15.1f}%  {added or '-'}")


THUMBNAIL_HEAD = ["images", "rows", "hit rate", "graph batches", "eager batches", "capacity fallbacks", "padding / real tokens", "rows/s"]


def thumbnails(count: int, args: argparse.Namespace, work: Path) -> dict:
    """`count` distinct thumbnails through `embedjob.run`: its statistics."""
    jpegs = JpegMix(f"thumbnails-{args.side}", TOWERS["qwen"], (args.side, args.side), count)
    data = jpeg_dataset(jpegs, count, 0, collect_photos([*builtin_sources(), *args.photos]), work / "data", os.cpu_count() or 1)
    job = {
        "input": {"path": str(data.path), "media_column": "image"},
        "model": {"path": args.model or "builtin:tiny-qwen2_5_vl", "family": "qwen2_5_vl"},
        "output": {"path": str(work / f"out-{count}")},
        "runtime": {"device": args.device, "cache_dir": str(work / "cache"), "progress": False},
    }
    return embedjob.run(job, overwrite=True)


def thumbnail_table(args: argparse.Namespace) -> int:
    """`--thumbnails`: one row per count."""
    counts = [min(c, 64) for c in args.thumbnails] if args.smoke else args.thumbnails
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        results = [(count, thumbnails(count, args, work)) for count in counts]
    rows = [
        [count, s["rows"], f"{s['hit_rate']:.1%}", s["graph_batches"], s["eager_batches"], s["capacity_fallbacks"],
         f"{s['padding_waste'] / max(1, s['real_tokens']):.1%}", f"{s['items_per_second']:.0f}"]
        for count, s in results
    ]
    print(f"\n{args.side}x{args.side} JPEGs, {args.model or 'builtin:tiny-qwen2_5_vl'}, device {args.device}\n")
    print("\n".join(markdown(THUMBNAIL_HEAD, rows, text_columns=0)))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="fewer items: checks the script in seconds")
    parser.add_argument("--thumbnails", type=int, nargs="+", metavar="N", help="run N thumbnails through embedjob.run instead")
    parser.add_argument("--side", type=int, default=32, help="--thumbnails: their side in pixels")
    parser.add_argument("--device", default="cpu", help="--thumbnails: runtime.device")
    parser.add_argument("--model", help="--thumbnails: a Qwen2.5-VL checkpoint directory (default: the builtin tiny tower)")
    parser.add_argument("--photos", type=Path, nargs="*", default=[], help="--thumbnails: more photos to cut them from")
    parser.add_argument("--workdir", type=Path, help="--thumbnails: default a temporary directory")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.thumbnails:
        return thumbnail_table(args)
    items, repeated, random_count = (256, 512, 10) if args.smoke else (ITEMS, 2048, RANDOM_MIXES)
    refined_table(repeated)
    print()
    table_ok = table(items)
    worse, better, equal, greedy_batches, best_batches = random_mixes(random_count)
    print()
    print(f"min_padding never worse than greedy on the table's mixes: {table_ok}")
    print(
        f"min_padding never worse than greedy on {random_count} random mixes: {worse == 0} "
        f"(better {better}, equal {equal}, worse {worse}; batches "
        f"greedy {greedy_batches}, min_padding {best_batches})"
    )
    return 0 if table_ok and worse == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
