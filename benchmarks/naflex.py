"""SigLIP 2 NaFlex: packed graphs against transformers' padded batch (RESULTS.md section 13).

Usage (from the repository root, on a CUDA machine; --smoke checks the script on the CPU):

    python3 benchmarks/naflex.py [--photos DIR ...] [--images 256] [--batch 64] [--max-patches 256 1024] [--eager]

Builds a SigLIP 2 so400m-patch16-naflex-size vision tower with random bf16 weights (fixed
seed; `embedjob.bench.save_naflex_tower`), saved with its image processor config at each
`--max-patches`, and cuts `--images` crops of aspect ratios from 1:4 to 4:1 out of real
photos (the repository's, or `--photos`). Per `--max-patches`, in one process on one GPU,
every crop is embedded two ways (`embedjob.bench.naflex_rows`):

  plain_transformers_compile  Siglip2VisionModel from the checkpoint, torch.compile(model),
                              on the processor's output in batches of `--batch` images,
                              each padded to max_num_patches (what transformers does)
  ours_graphs_compiled        embedjob's adapter (`load_adapter`, blocks compiled as a job
                              compiles them), the crops packed under the job's automatic
                              budgets, one CUDA graph per budget replayed

and with --eager the same two uncompiled. The pixels are on the device beforehand on both
sides. Times are CUDA-event medians after a warm-up; MFU is the useful FLOPs of the real
patches (`embedjob.bench.naflex_flops`) over the time, against a bf16 matmul timed in the
same run; "padding" is the computed tokens beyond the real ones over the real ones; the
note of our row gives its speed over transformers' and the smallest cosine between the two
sides' vectors. The table is printed last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import builtin_sources, collect_photos, fmt, log, matmul_peak, open_photo, readable, table  # noqa: E402
from embedjob.bench import NAFLEX_TOWER, Row, naflex_rows, save_naflex_tower  # noqa: E402

SCRIPT = "naflex"
SMOKE_TOWER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, patch_size=16, num_patches=64)
HEAD = ["tower", "max patches", "variant", "images", "padding", "seconds", "images/s", "MFU", "note"]


def crops(sources: list[Path], count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` (H, W, 3) uint8 crops of the readable photos in `sources`, in turn, each of
    a random aspect ratio from 1:4 to 4:1 and at least a third of the photo's shorter side."""
    photos = [np.asarray(open_photo(p.data)) for p in collect_photos(sources) if readable(p.data)]
    if not photos:
        raise SystemExit("--photos: no readable photo")
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        photo = photos[k % len(photos)]
        height, width = photo.shape[:2]
        ratio = float(np.exp(rng.uniform(np.log(0.25), np.log(4.0))))
        h = int(rng.integers(max(1, min(height, width) // 3), height + 1))
        w = max(1, min(width, int(h * ratio)))
        top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        out.append(np.array(photo[top : top + h, left : left + w]))  # its own, writable copy
    return out


def render(row: Row, patches: int) -> list[str]:
    """One table row of `naflex_rows`' `row` at `patches` max_num_patches."""
    return [
        row.mix, str(patches), row.variant, str(row.items), fmt(row.waste, ".1%"), f"{row.seconds:.4f}",
        f"{row.items_per_second:.1f}", fmt(row.mfu, ".1%"), row.note,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=Path, nargs="+", default=None, help="image files, Parquet files or folders (the repository's photos)")
    parser.add_argument("--images", type=int, default=None, help="crops embedded per pass (256; 6 with --smoke)")
    parser.add_argument("--batch", type=int, default=None, help="transformers' padded batch (64; 3 with --smoke)")
    parser.add_argument("--max-patches", type=int, nargs="+", default=None, help="max_num_patches of each run (256 1024; 64 with --smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per variant (10; 1 with --smoke)")
    parser.add_argument("--eager", action="store_true", help="also both sides uncompiled")
    parser.add_argument("--smoke", action="store_true", help="a tiny tower on the CPU, uncompiled: checks the script")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/naflex.py needs a CUDA device (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    count = args.images or (6 if args.smoke else 256)
    batch = args.batch or (3 if args.smoke else 64)
    repeats = args.repeats or (1 if args.smoke else 10)
    patch_counts = args.max_patches or ([64] if args.smoke else [256, 1024])
    label, values = ("tiny SigLIP 2", SMOKE_TOWER) if args.smoke else NAFLEX_TOWER
    modes = [False] if args.smoke else ([True, False] if args.eager else [True])
    images = crops(args.photos or builtin_sources(), count)
    peak = matmul_peak(device, SCRIPT)
    lines: list[list[str]] = []
    with tempfile.TemporaryDirectory() as workdir:
        for patches in patch_counts:
            directory = Path(workdir) / f"tower-{patches}"
            save_naflex_tower(values, patches, directory)
            for compiled in modes:
                log(SCRIPT, f"{label}, max_num_patches {patches}, {'compiled' if compiled else 'eager'}")
                for row in naflex_rows(directory, label, images, batch, repeats, peak, device, compiled):
                    lines.append(render(row, patches))
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--smoke: plumbing only)"
    print(f"# SigLIP 2 NaFlex, packed against padded — {device_name}, {count} crops, torch {torch.__version__}")
    print("\n".join(table(HEAD, lines, text_columns=3)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
