"""Where `embedjob bench`'s new-family rows depart from plain transformers (issue #53).

Two questions a bench row can raise, answered on the device in one call (RESULTS.md
section 7 has the answers of the last run):

- DINOv3-ViT-L/16 size: is a low cosine between embedjob's bf16 vectors and
  transformers' (0.83 on random pixels) embedjob's departure or bf16's? Each bf16 path
  (transformers eager under each SDPA kernel, embedjob eager, embedjob's compiled
  graphs) is compared with transformers in float32 on the same images. (bf16's: all
  of them sit 0.81-0.83 from float32 at random weights.)
- Qwen3.5-27B size: where embedjob's graphs spend their time against transformers'
  eager packed batches on the mixed mix: per batch, transformers with its own and with
  embedjob's attention, the graphs of the uncompiled and the compiled blocks, the host's
  time to assemble and launch a replay, the kernels of the largest batch, and one
  attention call on the batch's own offsets against the graphs' padded ones.

The table is printed last; `--smoke` runs it on a CPU with tiny towers.
RESULTS.md section: 7 (Compiled bf16 towers).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cosine  # noqa: E402
from embedjob import bench  # noqa: E402
from embedjob.encoders.loading import save_atomically, transformers_class  # noqa: E402
from embedjob.engine import packer  # noqa: E402
from embedjob.engine.graphs import GraphManager  # noqa: E402

SMOKE_DINOV3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, patch_size=16,
                    image_size=64, num_register_tokens=4)
SMOKE_QWEN = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64, out_hidden_size=32)


def cos_min(a: torch.Tensor, b: torch.Tensor) -> float:
    """The smallest row-wise cosine between two batches of vectors (`common.cosine`)."""
    return float(cosine(a.float().cpu().numpy(), b.float().cpu().numpy()).min())


def dinov3_rows(workdir: Path, values: dict, batch: int, device: torch.device, compiled: bool) -> list[tuple[str, str]]:
    """Each bf16 path's smallest cosine to transformers' float32 vectors (and to its bf16
    ones); the graphs' blocks compiled as a job compiles them when `compiled`."""
    from embedjob.encoders.fixed import FAMILIES as FIXED

    directory = workdir / "dinov3-tower"
    if not directory.exists():
        save_atomically(lambda tmp: bench.save_fixed_tower("dinov3", values, tmp), directory)
    ours = bench.checkpoint_adapter("dinov3", directory, "bfloat16", False, device)
    pictures = torch.randint(0, 256, (batch, 3, *ours.processing.input_size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pixels = ours.processing.process(pictures).to(device)
    values32 = ours.processing.normalize(pixels, ours.pixel_scale).float()
    cls = transformers_class(FIXED["dinov3"].vision_class)
    rows = []
    with torch.inference_mode():
        fp32 = cls.from_pretrained(directory, dtype=torch.float32).to(device).eval()
        reference = fp32(pixel_values=values32).pooler_output.float()
        plain = cls.from_pretrained(directory, dtype=torch.bfloat16).to(device).eval()
        plain_default = plain(pixel_values=values32.bfloat16()).pooler_output.float()
        rows.append(("transformers bf16, eager (default SDPA)", f"{cos_min(plain_default, reference):.5f}"))
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                try:
                    with sdpa_kernel(backend):
                        out = plain(pixel_values=values32.bfloat16()).pooler_output.float()
                    rows.append((f"transformers bf16, eager, SDPA {backend.name}", f"{cos_min(out, reference):.5f}"))
                except RuntimeError as exc:
                    rows.append((f"transformers bf16, eager, SDPA {backend.name}", f"not run: {str(exc).splitlines()[0][:60]}"))
        items_eager = ours.forward(ours.eager_inputs(bench.view_items(ours, pixels))).float()
        ours_dtype = str(ours.dtype).removeprefix("torch.")
        rows.append((f"embedjob {ours_dtype} (as it loads on this device), eager", f"{cos_min(items_eager, reference):.5f} (to transformers bf16 {cos_min(items_eager, plain_default):.5f})"))
        apart = cos_min(reference[1:], reference[:-1])
        rows.append(("transformers float32, one image's vector to the next image's", f"{apart:.5f} (how little the images differ)"))
        del fp32, plain
    graphed = ours
    if compiled:
        torch._dynamo.reset()
        graphed = bench.checkpoint_adapter("dinov3", directory, "bfloat16", True, device)
        graphed.compile(dynamic=True)
    _, graphs = bench.graph_seconds(graphed, pixels, 1, device)
    blocks = "compiled" if compiled else "uncompiled"
    rows.append((f"embedjob {ours_dtype}, graphs of the {blocks} blocks", f"{cos_min(graphs, reference):.5f} (to embedjob eager {cos_min(graphs, items_eager):.5f})"))
    return [(f"DINOv3: {name}", value) for name, value in rows]


def qwen3_5_rows(workdir: Path, values: dict, count: int, device: torch.device, compiled: bool, kernels: Path) -> list[tuple[str, str]]:
    """Per batch of the mixed mix, device milliseconds of: transformers with its sdpa
    (split per image) and with embedjob's varlen attention (packed, as the graphs run
    it), embedjob's graphs of the uncompiled and (when `compiled`) of the compiled blocks,
    and the host's milliseconds to assemble and launch the last of those replays; the
    largest batch's kernels in transformers' sdpa run and in that replay; then the
    attention grid's rows (`_attention_grid_rows`). Which of attention, compiling or the
    host departs shows in which column grows."""
    q = bench.Qwen35Setup.make(workdir, values, count, device, compiled)
    adapter, items, plan, batches, plain, inputs = q.adapter, q.items, q.plan, q.batches, q.plain, q.inputs
    del q
    largest = max(range(len(batches)), key=lambda k: batches[k].budget)
    columns = {
        "transformers sdpa": _plain_ms(plain, inputs, "sdpa", kernels / "qwen3_5-plain.txt", device, largest),
        "transformers varlen": _plain_ms(plain, inputs, adapter.model.config._attn_implementation, None, device, largest),
    }
    del plain, inputs
    if compiled:
        columns["graphs, uncompiled"], _ = _replay_ms(adapter, plan, items, batches, device, None, largest)
        torch._dynamo.reset()
        adapter.compile(dynamic=True)
    blocks = "compiled" if compiled else "uncompiled"
    columns[f"graphs, {blocks}"], columns[f"host of {'a' if compiled else 'an'} {blocks} replay"] = _replay_ms(
        adapter, plan, items, batches, device, kernels / "qwen3_5-ours.txt", largest)
    table = []
    for k, b in enumerate(batches):
        name = f"Qwen3.5: batch {k} ({len(b.indices)} items, {sum(items[i].tokens for i in b.indices)} tokens, budget {b.budget})"
        table.append((name, "; ".join(f"{column} {ms[k]:.1f} ms" for column, ms in columns.items())))
    table.append(("Qwen3.5: all batches", "; ".join(f"{column} {sum(ms):.1f} ms" for column, ms in columns.items())))
    return table + _attention_grid_rows(adapter, plan, [items[i] for i in batches[largest].indices], batches[largest].budget, device)


def _attention_grid_rows(adapter, plan, chosen, budget: int, device: torch.device) -> list[tuple[str, str]]:
    """One full-attention call on the largest batch's rows, device milliseconds with the
    batch's own offsets and length bound and with the padded ones its graph replays
    (every slot and the budget's bound) in an image job and in a job that may see videos
    (slots for their frame groups): the cost of the graph's static attention grid. On a
    CPU the layouts alone (nothing to time: the kernels are CUDA's)."""
    from embedjob.encoders.attention import cuda_kernel

    layouts, patches = _grid_layouts(adapter, plan, chosen, budget)
    heads = adapter.model.config.num_heads
    dim = adapter.model.config.hidden_size // heads
    if device.type == "cuda":
        q, k, v = (torch.randn(patches, heads, dim, device=device, dtype=adapter.dtype) for _ in range(3))
    rows = []
    for name, offsets, bound in layouts:
        rows_used = int(offsets[-1])
        ms = "not timed on a CPU"
        if device.type == "cuda":
            cu = torch.from_numpy(offsets).to(device)
            kernel = cuda_kernel(adapter.attention, bound, dim)
            ms = f"{1e3 * bench.device_time(lambda: kernel(q[:rows_used], k[:rows_used], v[:rows_used], cu, bound, None), 5, device):.2f} ms"
        rows.append((f"Qwen3.5: one attention call, {name} offsets ({len(offsets) - 1} segments, bound {bound}, {rows_used} rows)", ms))
    return rows


def _grid_layouts(adapter, plan, chosen, budget: int) -> tuple[list[tuple[str, np.ndarray, int]], int]:
    """(name, cumulative offsets, length bound) of the batch as it is and as an image job's
    and a video-enabled job's graph of `budget` pad it, and the graph's patch rows."""
    from embedjob.encoders.attention import pad_offsets
    from embedjob.encoders.qwen import FULL_PAD_SEGMENT

    eager = adapter.eager_inputs(chosen)
    real = eager.tensors["cu_seqlens"].cpu().numpy()
    layouts = [("the batch's own", real, eager.constants["max_seqlen"])]
    with_video = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 32, True)
    for name, budgets in (("an image job's graph", plan), ("a video-enabled job's graph", with_video)):
        static = adapter.static_inputs(budget, budgets.max_items, budgets.max_frames)
        patches, slots = static.tensors["pixel_values"].shape[0], static.tensors["cu_seqlens"].shape[0]
        layouts.append((name, pad_offsets(real, patches, slots, FULL_PAD_SEGMENT), static.constants["max_seqlen"]))
    return layouts, patches


def _plain_ms(plain, inputs, attention: str, kernels: Path | None, device: torch.device, largest: int) -> list[float]:
    """transformers' own tower on each batch's (pixels, grid), already on the device, with
    the attention implementation `attention`; its kernels of the largest batch into `kernels`."""
    plain.config._attn_implementation = attention
    with torch.inference_mode():
        times = [1e3 * bench.device_time(lambda p=p, g=g: plain(hidden_states=p, grid_thw=g), 3, device) for p, g in inputs]
        if kernels is not None:
            _kernels(lambda: plain(hidden_states=inputs[largest][0], grid_thw=inputs[largest][1]), kernels, device)
    return times


def _replay_ms(adapter, plan, items, batches, device: torch.device, kernels: Path | None, largest: int) -> tuple[list[float], list[float]]:
    """Each batch's device and host milliseconds through graphs captured from the adapter
    as it is now; the largest batch's kernels into `kernels`."""
    manager = GraphManager(adapter, plan, "cuda" if device.type == "cuda" else "replay")
    manager.capture()
    device_ms, host_ms = [], []
    with torch.inference_mode():
        for b in batches:
            chosen = [items[i] for i in b.indices]
            device_ms.append(1e3 * bench.device_time(lambda c=chosen, budget=b.budget: manager.run_batch(c, budget), 3, device))
            host_ms.append(1e3 * _host_seconds(lambda c=chosen, budget=b.budget: manager.run_batch(c, budget), device))
        if kernels is not None:
            chosen = [items[i] for i in batches[largest].indices]
            _kernels(lambda: manager.run_batch(chosen, batches[largest].budget), kernels, device)
    manager.clear()
    return device_ms, host_ms


def _host_seconds(fn, device: torch.device) -> float:
    """Median wall seconds of `fn`'s host work alone: the device is drained first, and the
    clock stops when `fn` returns (before its launched work finishes)."""
    times = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernels(fn, path: Path, device: torch.device) -> None:
    """The device (or CPU) kernels of one run of `fn` after a warm-up, by total time, into `path`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=90))


def logged(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`rows`, logged as soon as a check ends: a device call cut off by its time limit
    still shows the checks that finished before the table that ends a whole run."""
    for name, value in rows:
        logging.info("| %s | %s |", name, value)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/family-checks"))
    parser.add_argument("--checks", nargs="+", default=["dinov3", "qwen3_5"], choices=["dinov3", "qwen3_5"])
    parser.add_argument("--smoke", action="store_true", help="tiny towers on the CPU: checks the code paths, measures nothing")
    parser.add_argument("--no-compile", action="store_true", help="graphs of the uncompiled blocks only (a shorter call)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device("cpu" if args.smoke else "cuda")
    compiled = not (args.smoke or args.no_compile)
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str]] = []
    if "dinov3" in args.checks:
        rows += logged(dinov3_rows(args.workdir, SMOKE_DINOV3 if args.smoke else bench.FIXED_TOWERS["dinov3"][1], 4 if args.smoke else 64,
                                   device, compiled))
    if "qwen3_5" in args.checks:
        rows += logged(qwen3_5_rows(args.workdir, SMOKE_QWEN if args.smoke else bench.QWEN3_5_TOWER[1],
                                    6 if args.smoke else bench.QWEN3_5_IMAGES, device, compiled, args.workdir))
    for path in sorted(args.workdir.glob("qwen3_5-*.txt")):
        print(f"\n--- {path.name} ---\n{path.read_text()}")
    print(f"\ndevice: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}\n\n| check | result |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
