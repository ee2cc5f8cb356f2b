"""Graph hit rate on thumbnails: many tiny images, each a few tokens.

Cuts N distinct 32x32 JPEGs from real photos (random crops, qualities; the same
generator as `benchmarks/scaling.py`), runs them through `embedjob.run` with a
Qwen2.5-VL tower (the builtin tiny one unless `--model` names a checkpoint directory)
and prints what decides whether thumbnails replay their graphs: hit rate, batches that
fell back to eager because they needed more attention segments than the budget's
buffers hold (`capacity_fallbacks`), padding, and rows per second. The packing and the
budget buffers are the same on the CPU as on a GPU, so the hit rate is too.

    python -m benchmarks.thumbnails [--images 3000 30000] [--device cpu|cuda] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import embedjob
from benchmarks.mixes import TOWERS, Mix, builtin_sources, collect_photos, jpeg_dataset


def run(count: int, args: argparse.Namespace, work: Path) -> dict:
    mix = Mix(f"thumbnails-{args.side}", TOWERS["qwen"], (args.side, args.side), count)
    data = jpeg_dataset(mix, count, 0, collect_photos([*builtin_sources(), *args.photos]), work / "data", os.cpu_count() or 1)
    job = {
        "input": {"path": str(data.path), "media_column": "image"},
        "model": {"path": args.model or "builtin:tiny-qwen2_5_vl", "family": "qwen2_5_vl"},
        "output": {"path": str(work / f"out-{count}")},
        "runtime": {"device": args.device, "cache_dir": str(work / "cache")},
    }
    return embedjob.run(job, overwrite=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, nargs="+", default=[3000, 30000])
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="a Qwen2.5-VL checkpoint directory (default: the builtin tiny tower)")
    parser.add_argument("--photos", type=Path, nargs="*", default=[], help="more photos to cut thumbnails from")
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        results = [(count, run(count, args, work)) for count in args.images]
    print(f"\n{args.side}x{args.side} JPEGs, {args.model or 'builtin:tiny-qwen2_5_vl'}, device {args.device}\n")
    print("| images | rows | hit rate | graph batches | eager batches | capacity fallbacks | padding / real tokens | rows/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for count, stats in results:
        padding = stats["padding_waste"] / max(1, stats["real_tokens"])
        print(
            f"| {count} | {stats['rows']} | {stats['hit_rate']:.1%} | {stats['graph_batches']} | {stats['eager_batches']} "
            f"| {stats['capacity_fallbacks']} | {padding:.1%} | {stats['items_per_second']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
