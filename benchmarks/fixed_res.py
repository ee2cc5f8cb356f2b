"""Eager against CUDA-graph replay for fixed-resolution towers at small batches; prints one table.

Usage (from the repository root, on a CUDA machine):

    python benchmarks/fixed_res.py [--repeats 50] [--batches 1 2 4 8] [--compile]

Builds CLIP-B/16-size and SigLIP-B/16-size vision towers with random bf16 weights (224 x
224 input, 12 layers of width 768), saves each as a vision-only checkpoint with its image
processor config and loads it through `embedjob.encoders.load_adapter`, the path a job
takes. For each batch of 1, 2, 4 and 8 images it times, with CUDA-event medians after a
warm-up, the same batch run (a) eagerly at its exact size and (b) through the graph
manager, replaying the graph captured for exactly that many images. Both include the
host-to-device copy of the pixels. Small batches are where graphs matter: the work is a
few milliseconds of kernels and the eager run spends much of it launching them. Each row
also checks that the replayed embeddings equal the eager run on the same padded buffers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.bench import cuda_time  # noqa: E402
from embedjob.config import job_from_dict  # noqa: E402
from embedjob.encoders import EncoderAdapter, load_adapter  # noqa: E402
from embedjob.engine.graphs import GraphManager  # noqa: E402
from embedjob.engine.packer import BudgetPlan  # noqa: E402

TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224, patch_size=16)


def save_tower(family: str, directory: Path) -> None:
    """A random tower of the family saved as a vision-only checkpoint with its processor config."""
    import transformers

    torch.manual_seed(0)
    if family == "clip":
        config = transformers.CLIPVisionConfig(**TOWER, projection_dim=512)
        model = transformers.CLIPVisionModelWithProjection(config)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    else:
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TOWER))
        processor = transformers.SiglipImageProcessor(size={"height": 224, "width": 224})
    model.to(torch.bfloat16).save_pretrained(directory)
    processor.save_pretrained(directory)


def load(family: str, directory: Path, compile_blocks: bool) -> EncoderAdapter:
    job = job_from_dict(
        {
            "input": {"path": "unused.parquet", "media_column": "image"},
            "model": {"family": family, "path": str(directory), "dtype": "bfloat16"},
            "output": {"path": "unused"},
            "runtime": {"cache_dir": str(directory.parent / "cache")},
        }
    )
    adapter = load_adapter(job, torch.device("cuda"))
    if compile_blocks:
        adapter.compile(dynamic=False)
    return adapter


def images(adapter: EncoderAdapter, count: int) -> list[Any]:
    """Random photos of mixed aspect ratios, preprocessed like decode workers do."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(count)
    sizes = [(480, 640), (640, 480), (300, 300), (720, 1280)]
    media = []
    for k in range(count):
        height, width = sizes[k % len(sizes)]
        pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        media.append(SimpleNamespace(pixels=pixels.numpy()))
    return [adapter.preprocessor()(m) for m in media]


def bench_family(family: str, workdir: Path, batches: list[int], repeats: int, compile_blocks: bool) -> list[tuple]:
    directory = workdir / family
    save_tower(family, directory)
    adapter = load(family, directory, compile_blocks)
    per_image = adapter.tokens_per_image
    plan = BudgetPlan(tuple(b * per_image for b in batches), max_items=max(batches), max_frames=0)
    manager = GraphManager(adapter, plan, "cuda")
    manager.capture()
    rows = []
    for count in batches:
        items = images(adapter, count)
        budget = count * per_image

        def eager() -> None:
            with torch.inference_mode():
                adapter.forward(adapter.eager_inputs(items))

        def graph() -> None:
            manager.run(items, budget)

        eager_s = cuda_time(eager, repeats, warmup=3)
        graph_s = cuda_time(graph, repeats, warmup=3)
        with torch.inference_mode():
            padded = adapter.forward(manager.padded_inputs(items, budget))[:count]
        same = torch.equal(torch.cat(manager.run(items, budget)), padded)
        rows.append((family, count, per_image, eager_s, graph_s, same))
    manager.clear()
    return rows


def render(rows: list[tuple], compiled: bool) -> str:
    header = f"{'model':<16} {'images':>6} {'tokens':>6} {'eager ms':>9} {'graphs ms':>9} {'speedup':>7} {'graph img/s':>11}  replay==eager"
    lines = [f"fixed-resolution towers, bf16, {torch.cuda.get_device_name()}{', blocks compiled' if compiled else ''}", header]
    for family, count, per_image, eager_s, graph_s, same in rows:
        name = {"clip": "CLIP-B/16", "siglip": "SigLIP-B/16"}[family]
        lines.append(
            f"{name:<16} {count:>6} {count * per_image:>6} {eager_s * 1e3:>9.3f} {graph_s * 1e3:>9.3f} "
            f"{eager_s / graph_s:>6.2f}x {count / graph_s:>11.0f}  {same}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fixed_res.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as workdir:
        rows = []
        for family in ("clip", "siglip"):
            rows += bench_family(family, Path(workdir), sorted(args.batches), args.repeats, args.compile)
    print(render(rows, args.compile))
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
