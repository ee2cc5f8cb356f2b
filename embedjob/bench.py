"""`embedjob bench`: the encoder on fixed mixes, four ways, in one process, on one GPU.

Builds a Qwen2.5-VL-7B-size vision tower with random bf16 weights and times, on the
same packed batches of each mix:

  (a) hf_sdpa      plain transformers, sdpa attention (split per segment on the host)
  (b) hf_varlen    transformers with the varlen attention, packed, eager; transformers
                   computes positions and windows itself
  (c) ours_eager   embedjob's adapter, eager: metadata precomputed per item on the CPU
  (d) ours_graphs  embedjob's graph manager: one CUDA graph per budget
  (e) ours_graphs_compiled  (d) with each block compiled (when --compile is on)
  (f) ours_graphs_tuned_compiled_fp8  (e) with the blocks' linear layers in row-wise
                   FP8 (`model.precision: fp8`; --no-fp8 skips it)

and an end-to-end `embedjob run` over a Parquet file of real JPEGs (decode included)
against the encoder-only rate of the same images; then SigLIP-so400m-384,
CLIP-L/14-336, DINOv3-ViT-L/16 and MetaCLIP-2-H/14-size towers (`FIXED_TOWERS`) on
one batch of 256 images already on the GPU, plain transformers with `torch.compile(model)`
against embedjob's graphs over its compiled adapter (`fixed_rows`; --no-fixed skips
them), and a SigLIP 2 so400m-patch16-naflex-size tower on images of mixed aspect ratios,
transformers' padded batches against embedjob's packed graphs (`naflex_rows`;
--no-naflex skips it), and an OpenCLIP ViT-H-14-size model against open_clip's own
`encode_image` where open_clip_torch is installed (`open_clip_rows`). Times are CUDA-event medians after a
warm-up; MFU is useful FLOPs (real tokens only, padding excluded) over the time, against
a bf16 matmul timed in the same process. The last thing printed is the table; each row
is also logged and `bench.md` rewritten as it is timed (`Table`), so a run cut short keeps
its rows. A bare `--mixes` skips the Qwen2.5-VL tower and times only the other families
(`--fixed-towers` picks among the fixed ones).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from embedjob.config import cache_root
from embedjob.encoders.base import EncoderInput, Placement
from embedjob.encoders.qwen import FAMILIES, QwenAdapter, QwenPreprocessor, tune_for_cuda
from embedjob.engine import packer
from embedjob.engine.graphs import GraphManager

logger = logging.getLogger(__name__)

TOWER_7B = dict(
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=3420,
    out_hidden_size=3584,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)
MAX_PIXELS = 1344 * 1344


@dataclass
class Row:
    """One line of the result table."""

    mix: str
    variant: str
    items: int
    seconds: float
    flops: float
    peak: float
    hit_rate: float | None = None
    waste: float | None = None
    note: str = ""

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds

    @property
    def mfu(self) -> float:
        return self.flops / self.seconds / self.peak


def cuda_passes(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` runs of `fn`, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return times


def cuda_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn` over `repeats` runs (`cuda_passes`)."""
    return statistics.median(cuda_passes(fn, repeats, warmup))


def wall_passes(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """`cuda_passes` on a CPU: wall seconds of each run (a CPU runs `fn` as it is called)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def device_passes(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 1) -> list[float]:
    """`cuda_passes` on a GPU, `wall_passes` elsewhere: so a benchmark's code paths can be
    checked on a CPU."""
    passes = cuda_passes if device.type == "cuda" else wall_passes
    return passes(fn, repeats, warmup)


def device_time(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of `fn` over `repeats` runs (`device_passes`)."""
    return statistics.median(device_passes(fn, repeats, device, warmup))


def matmul_peak(size: int = 8192, repeats: int = 10) -> float:
    """Measured bf16 matmul FLOP/s on random data: the MFU denominator."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time(lambda: a @ b, repeats, warmup=3)
    return 2 * size**3 / seconds


def build_tower(device: torch.device, video_max_pixels: int = 448 * 448) -> QwenAdapter:
    """The 7B-size Qwen2.5-VL tower, random bf16 weights (fixed seed), as an adapter;
    its video frames are resized to at most `video_max_pixels`."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
        Qwen2_5_VLVisionConfig,
    )

    from embedjob.encoders.attention import register

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(**TOWER_7B)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).to(device).eval()
    model.requires_grad_(False)
    model.config._attn_implementation = register()
    spec = FAMILIES["qwen2_5_vl"]
    processing = QwenPreprocessor(
        family="qwen2_5_vl",
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=56 * 56,
        max_pixels=MAX_PIXELS,
        video_min_pixels=56 * 56,
        video_max_pixels=video_max_pixels,
        mean=spec.mean,
        std=spec.std,
        window_size=112,
        pos_grid_side=None,
    )
    placement = Placement(device, torch.bfloat16, "bench:qwen2_5_vl-7b-size", 32, cache_root(None))
    return QwenAdapter(spec, model, processing, placement)


def make_mix(name: str, processing: QwenPreprocessor) -> list[EncoderInput]:
    """Fixed-seed mixes of random pixels, preprocessed like real media."""
    from types import SimpleNamespace

    rng = np.random.default_rng({"mixed": 1, "224px": 2, "video": 3}[name])
    media = []
    if name == "mixed":
        for _ in range(64):
            h, w = (int(v) for v in rng.integers(224, 1345, size=2))
            media.append(SimpleNamespace(pixels=rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    elif name == "224px":
        media = [SimpleNamespace(pixels=rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(256)]
    else:
        for i in range(16):
            frames = int(rng.choice([8, 16, 32]))
            h, w = (int(v) for v in rng.integers(224, 449, size=2))
            media.append(SimpleNamespace(frames=rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)))
            if i % 2 == 0:
                h, w = (int(v) for v in rng.integers(224, 897, size=2))
                media.append(SimpleNamespace(pixels=rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    return [processing(m) for m in media]


def encoder_flops(items: list[EncoderInput], config: Any) -> float:
    """Useful FLOPs of the tower on these items (multiply-adds count 2)."""
    d, inner, out = config.hidden_size, config.intermediate_size, config.out_hidden_size
    depth, full = config.depth, len(config.fullatt_block_indexes)
    total = 0.0
    for item in items:
        t, h, w = item.tensors["grid_thw"].tolist()
        n = t * h * w
        windows = item.tensors["cu_window_seqlens"].double()
        window_sq = float(((windows[1:] - windows[:-1]) ** 2).sum())
        full_sq = t * float(h * w) ** 2
        dense = n * (2 * 3 * d * d + 2 * d * d + 3 * 2 * d * inner)
        attention = (depth - full) * 4 * d * window_sq + full * 4 * d * full_sq
        total += 2 * n * 1176 * d + depth * dense + attention + 2 * (n // 4) * (4 * d) * (4 * d) + 2 * (n // 4) * 4 * d * out
    return total


class MixRunner:
    """Runs one mix's packed batches through a variant."""

    def __init__(self, adapter: QwenAdapter, items: list[EncoderInput], plan: packer.BudgetPlan) -> None:
        self.adapter = adapter
        self.items = items
        self.plan = plan
        self.batches = packer.pack([i.tokens for i in items], [i.frames for i in items], plan, "min_padding")

    def hf(self, attention: str) -> Callable[[], None]:
        model = self.adapter.model
        device = self.adapter.device
        inputs = []
        for batch in self.batches:
            chosen = [self.items[i] for i in batch.indices]
            pixels = torch.cat([self.adapter.processing.model_pixels(i.tensors["pixel_values"]) for i in chosen])
            pixels = pixels.to(device, torch.bfloat16)
            grid = torch.stack([i.tensors["grid_thw"] for i in chosen]).to(device)
            inputs.append((pixels, grid))

        def run() -> None:
            saved = model.config._attn_implementation
            model.config._attn_implementation = attention
            try:
                with torch.inference_mode():
                    for pixels, grid in inputs:
                        model(hidden_states=pixels, grid_thw=grid)
            finally:
                model.config._attn_implementation = saved

        return run

    def ours(self, manager: GraphManager) -> Callable[[], None]:
        def run() -> None:
            for batch in self.batches:
                chosen = [self.items[i] for i in batch.indices]
                manager.run(chosen, batch.budget if manager.backend else None, reduce=_mean)

        return run


def _mean(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().mean(dim=0)


def _our_managers(adapter: QwenAdapter, plan: packer.BudgetPlan, notes: dict[str, Any], suffix: str) -> dict[str, GraphManager]:
    graphs = GraphManager(adapter, plan, "cuda")
    graphs.capture()
    notes[f"capture{suffix}_s"] = round(graphs.stats.capture_seconds, 1)
    notes[f"graph_pool{suffix}_GiB"] = round(graphs.stats.pool_bytes / 2**30, 2)
    return {f"ours_eager{suffix}": GraphManager(adapter, plan, None), f"ours_graphs{suffix}": graphs}


def save_checkpoint(adapter: QwenAdapter, workdir: Path) -> Path:
    """The untuned tower saved like a user's checkpoint, for the end-to-end run."""
    checkpoint = workdir / "tower"
    adapter.model.save_pretrained(checkpoint)
    (checkpoint / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 56 * 56, "max_pixels": MAX_PIXELS}))
    return checkpoint


class Fidelity:
    """Per-item relative error against an fp32 reference of the same weights.

    The reference is transformers' own forward (sdpa attention) of the untuned tower
    upcast to fp32, one image at a time; each variant is compared on the same images.
    The target: embedjob's graphs (tuned, compiled) are no worse than transformers' own
    bf16 forward.
    """

    def __init__(self, adapter: QwenAdapter, count: int) -> None:
        import copy

        self.items = make_mix("mixed", adapter.preprocessor())[:count]
        reference = copy.deepcopy(adapter.model).float()
        self.refs = self._hf(reference, adapter, torch.float32)
        del reference
        torch.cuda.empty_cache()
        self.errors: dict[str, list[float]] = {}

    def _hf(self, model: torch.nn.Module, adapter: QwenAdapter, dtype: torch.dtype) -> list[torch.Tensor]:
        saved = model.config._attn_implementation
        model.config._attn_implementation = "sdpa"
        try:
            with torch.inference_mode():
                return [
                    model(
                        hidden_states=adapter.processing.model_pixels(i.tensors["pixel_values"]).to(adapter.device, dtype),
                        grid_thw=i.tensors["grid_thw"][None].to(adapter.device),
                    ).pooler_output.float()
                    for i in self.items
                ]
        finally:
            model.config._attn_implementation = saved

    def transformers_bf16(self, adapter: QwenAdapter) -> None:
        self._record("transformers bf16", self._hf(adapter.model, adapter, torch.bfloat16))

    def graphs(self, name: str, manager: GraphManager) -> None:
        outputs = []
        for item in self.items:
            budget = next(b for b in manager.plan.token_budgets if b >= item.tokens)
            outputs.extend(manager.run([item], budget, reduce=lambda rows: rows.float().clone()))
        self._record(name, outputs)

    def _record(self, name: str, outputs: list[torch.Tensor]) -> None:
        self.errors[name] = [float((o - r).norm() / r.norm()) for o, r in zip(outputs, self.refs)]

    def summary(self) -> str:
        return "; ".join(
            f"{name}: median {statistics.median(e):.2e}, max {max(e):.2e}" for name, e in self.errors.items()
        )


def bench_mix(name: str, adapter: QwenAdapter, plan: packer.BudgetPlan, managers: dict[str, GraphManager], args: argparse.Namespace, peak: float) -> list[Row]:
    items = make_mix(name, adapter.preprocessor())
    runner = MixRunner(adapter, items, plan)
    flops = encoder_flops(items, adapter.model.config)
    waste = packer.padding_waste(runner.batches) / sum(i.tokens for i in items)
    rows = []
    plain = [("hf_sdpa", runner.hf("sdpa")), ("hf_varlen", runner.hf(adapter.model.config._attn_implementation))]
    for variant, fn in plain:
        if variant in args.skip:
            continue
        rows.append(Row(name, variant, len(items), cuda_time(fn, args.hf_repeats), flops, peak))
        logger.info("%s %s done", name, variant)
    for variant, manager in managers.items():
        before = manager.stats.hits, manager.stats.misses
        seconds = cuda_time(runner.ours(manager), args.repeats)
        hits, misses = manager.stats.hits - before[0], manager.stats.misses - before[1]
        hit_rate = hits / (hits + misses) if manager.backend else None
        rows.append(Row(name, variant, len(items), seconds, flops, peak, hit_rate, waste if manager.backend else None))
        logger.info("%s %s done", name, variant)
    return rows


def kernel_table(adapter: QwenAdapter, plan: packer.BudgetPlan, workdir: Path, rows: int = 20, name: str = "kernels.txt") -> None:
    """The CUDA kernels of one compiled eager forward of the largest budget, by device time:
    where the time goes when MFU stays below the matmul rate."""
    items = make_mix("mixed", adapter.preprocessor())
    batch, table = largest_batch_kernels(adapter, items, plan, "min_padding", rows)
    (workdir / name).write_text(table)
    logger.info("kernel table of a %d-token batch:\n%s", batch.tokens, table)


def largest_batch_kernels(
    adapter: Any, items: list[EncoderInput], plan: packer.BudgetPlan, policy: str, rows: int
) -> tuple[packer.Batch, str]:
    """The largest batch `items` pack into, and the CUDA kernels of one eager forward of
    it after a warm-up one (compiled where the adapter is), by total device time."""
    from torch.profiler import ProfilerActivity, profile

    batches = packer.pack([i.tokens for i in items], [i.frames for i in items], plan, policy)
    batch = max(batches, key=lambda b: b.tokens)
    inputs = adapter.eager_inputs([items[i] for i in batch.indices])
    with torch.inference_mode():
        adapter.forward(inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            adapter.forward(inputs)
            torch.cuda.synchronize()
    return batch, prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def make_jpeg_parquet(path: Path, count: int, seed: int = 0) -> None:
    """A Parquet file of real JPEGs: the repository's real photos re-encoded at sizes 224-1344."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    repo = Path(__file__).resolve().parent.parent
    table = pq.read_table(repo / "jobs" / "data" / "demo-images.parquet")
    photos = []
    for blob in table.column("image").to_pylist():
        try:
            photos.append(Image.open(io.BytesIO(blob)).convert("RGB"))
        except Exception:
            continue
    rng = np.random.default_rng(seed)
    blobs = []
    for i in range(count):
        h, w = (int(v) for v in rng.integers(224, 1345, size=2))
        out = io.BytesIO()
        photos[i % len(photos)].resize((w, h)).save(out, format="JPEG", quality=90)
        blobs.append(out.getvalue())
    pq.write_table(pa.table({"image": pa.array(blobs, type=pa.binary())}), path, row_group_size=128)


def end_to_end(adapter: QwenAdapter, checkpoint: Path, workdir: Path, args: argparse.Namespace, peak: float, compiled: bool) -> list[Row]:
    """`embedjob run` on real JPEGs against the encoder-only rate of the same images."""
    from embedjob.config import job_from_dict
    from embedjob.decode import DecodeOptions, decode
    from embedjob.runner import Runner

    parquet = workdir / "jpegs.parquet"
    make_jpeg_parquet(parquet, args.e2e_images)
    job = job_from_dict(
        {
            "input": {"path": str(parquet), "media_column": "image"},
            "model": {"path": str(checkpoint), "dtype": "bfloat16"},
            "output": {"path": str(workdir / "out"), "rows_per_part": 100_000},
            "batching": {"compile": compiled},
            "runtime": {"device": "cuda", "progress": False, "cache_dir": str(workdir / "cache")},
        }
    )
    start = time.perf_counter()
    stats = _profiled(Runner(job, overwrite=True).run, workdir / "e2e-profile.txt") if args.e2e_profile else Runner(job, overwrite=True).run()
    wall = time.perf_counter() - start
    e2e_seconds = stats["pipeline_seconds"]
    options = DecodeOptions("image", 10**9, 2.0, 32, 2)
    import pyarrow.parquet as pq

    blobs = pq.read_table(parquet).column("image").to_pylist()
    items = [adapter.preprocessor()(decode(b, options)) for b in blobs]
    flops = encoder_flops(items, adapter.model.config)
    plan = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 32, False)
    manager = GraphManager(adapter, plan, "cuda")
    manager.capture()
    encoder = cuda_time(MixRunner(adapter, items, plan).ours(manager), args.repeats)
    manager.clear()
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in stats["stage_seconds"].items())
    note = f"wall {wall:.1f}s incl. {stats['setup_seconds']:.1f}s setup; e2e/encoder {encoder / e2e_seconds:.0%}; stages: {stages}"
    return [
        Row("jpeg e2e", "embedjob run", len(items), e2e_seconds, flops, peak, stats["hit_rate"], stats["padding_waste"] / stats["real_tokens"], note),
        Row("jpeg e2e", "encoder only", len(items), encoder, flops, peak),
    ]


def _profiled(fn: Callable[[], Any], path: Path, rows: int = 30) -> Any:
    """Run `fn` under cProfile and log the functions with the most own time. From Python
    3.12 cProfile sees every thread (the decode pool's service thread and the writer as
    well as the main thread that prepares batches), so own times add up past the wall time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(fn)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(rows)
    path.write_text(out.getvalue())
    logger.info("profile of the end-to-end run:\n%s", out.getvalue())
    return result


def fp8_rows(
    adapter: QwenAdapter, plan: packer.BudgetPlan, workdir: Path, args: argparse.Namespace, peak: float, fidelity: Any,
    notes: dict[str, Any],
) -> list[Row]:
    """Variant (f): the tuned tower with its blocks in row-wise FP8, compiled (dynamic),
    one graph per budget. Last, since the conversion is in place."""
    from embedjob.config import JobError

    try:
        adapter.use_fp8()
    except JobError as exc:
        notes["fp8"] = str(exc)
        return []
    start = time.perf_counter()
    torch._dynamo.reset()
    adapter.compile(dynamic=True)
    manager = GraphManager(adapter, plan, "cuda")
    manager.capture()
    notes["fp8 compile+capture_s"] = round(time.perf_counter() - start, 1)
    fidelity.graphs("embedjob graphs tuned compiled fp8", manager)
    only_ours = argparse.Namespace(**{**vars(args), "skip": {"hf_sdpa", "hf_varlen"}})
    rows: list[Row] = []
    for mix in args.mixes:
        rows += bench_mix(mix, adapter, plan, {"ours_graphs_tuned_compiled_fp8": manager}, only_ours, peak)
    manager.clear()
    if args.profile:
        kernel_table(adapter, plan, workdir, name="kernels-fp8.txt")
    return rows


# --- fixed-resolution towers against plain transformers + torch.compile ------------------

FIXED_TOWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "siglip": (
        "SigLIP-so400m-384-size",
        dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304, patch_size=14,
             image_size=384, vision_use_head=True),
    ),
    "clip": (
        "CLIP-L/14-336-size",
        dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, patch_size=14,
             image_size=336, projection_dim=768),
    ),
    "dinov3": (
        "DINOv3-ViT-L/16-size",
        dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, patch_size=16,
             image_size=224, num_register_tokens=4),
    ),
    "metaclip2": (
        "MetaCLIP-2-worldwide-H/14-size",
        dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120, patch_size=14,
             image_size=224, projection_dim=1024),
    ),
}
"""The fixed-resolution towers `embedjob bench` (and the scaling benchmark) build: a label
and the transformers vision config of the published checkpoint's size."""
FIXED_BATCH = 256


def save_fixed_tower(family: str, values: dict[str, Any], directory: Path) -> None:
    """A SigLIP, CLIP, MetaCLIP 2 or DINOv3 vision tower of config `values` with random
    bf16 weights (seed 0), saved with `save_pretrained` beside its image processor
    config, as a user's vision-only checkpoint is (CLIP and MetaCLIP 2 with their projection)."""
    import transformers

    torch.manual_seed(0)
    side = values["image_size"]
    if family == "clip":
        model = transformers.CLIPVisionModelWithProjection._from_config(transformers.CLIPVisionConfig(**values), dtype=torch.bfloat16)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    elif family == "metaclip2":
        config = transformers.MetaClip2VisionConfig(**values)
        model = transformers.MetaClip2VisionModelWithProjection._from_config(config, dtype=torch.bfloat16)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    elif family == "dinov3":
        model = transformers.DINOv3ViTModel._from_config(transformers.DINOv3ViTConfig(**values), dtype=torch.bfloat16)
        processor = transformers.DINOv3ViTImageProcessor(size={"height": side, "width": side})
    else:
        model = transformers.SiglipVisionModel._from_config(transformers.SiglipVisionConfig(**values), dtype=torch.bfloat16)
        processor = transformers.SiglipImageProcessor(size={"height": side, "width": side})
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def fixed_flops(family: str, config: Any, projection: int | None) -> float:
    """Useful FLOPs of one image through a CLIP, MetaCLIP 2, SigLIP, DINOv2 or DINOv3
    vision tower (multiply-adds count 2).

    With P = (image_size / patch_size)^2 patches, n = P + prefix tokens (the CLS token of
    CLIP, MetaCLIP 2 and DINOv2; CLS and the registers of DINOv3; none for SigLIP), width
    d, MLP width m, L layers:

        patch embedding   2 * P * (3 * patch_size^2) * d
        per layer         2 * n * 4 * d^2          q, k, v and output projections
                        + 2 * n * 2 * d * m        MLP up and down (3 * d * m gated: gate, up, down)
                        + 4 * n^2 * d              attention scores and weighted sum
        SigLIP head       4 * d^2 + 4 * n * d^2    probe query and output projections, keys and values
                        + 4 * n * d                the probe's attention over n tokens
                        + 4 * d * m                the head's MLP, one token
        CLIP projection   2 * d * projection       the pooled CLS token (MetaCLIP 2's too)

    Layer norms, activations, biases, layer scales and position embeddings (rotary
    ones included) are left out (not matmuls). DINOv2 configs give `mlp_ratio`, not `intermediate_size`.
    """
    from embedjob.encoders.fixed import FAMILIES as FIXED

    d, layers, patch = config.hidden_size, config.num_hidden_layers, config.patch_size
    m = config.intermediate_size if hasattr(config, "intermediate_size") else int(d * config.mlp_ratio)
    patches = (config.image_size // patch) ** 2
    n = patches + FIXED[family].prefix_tokens(config)
    mlp_matrices = 3 if getattr(config, "use_gated_mlp", False) else 2
    total = 2 * patches * 3 * patch**2 * d
    total += layers * (2 * n * 4 * d * d + 2 * n * mlp_matrices * d * m + 4 * n * n * d)
    # A SigLIP vision config saved without `vision_use_head` (transformers 5.17 writes none)
    # has the head: the model reads the key with that default too.
    if family == "siglip" and getattr(config, "vision_use_head", True):
        total += 4 * d * d + 4 * n * d * d + 4 * n * d + 4 * d * m
    if projection:
        total += 2 * d * projection
    return float(total)


def checkpoint_adapter(family: str, directory: Path, dtype: str, compiled: bool, device: torch.device) -> Any:
    """The adapter a job loads for the checkpoint in `directory` (as a user's is loaded),
    marked to compile as a job compiles it when `compiled`; its cache beside the checkpoint."""
    from embedjob.config import job_from_dict
    from embedjob.encoders import load_adapter

    return load_adapter(job_from_dict({
        "input": {"path": "unused.parquet", "media_column": "image"},
        "model": {"family": family, "path": str(directory), "dtype": dtype},
        "output": {"path": "unused"},
        "batching": {"compile": compiled},
        "runtime": {"cache_dir": str(directory.parent / "cache")},
    }), device)


def fixed_rows(
    workdir: Path, towers: dict[str, tuple[str, dict[str, Any]]], batch: int, repeats: int, peak: float,
    device: torch.device, compiled: bool = True,
) -> list[Row]:
    """For each tower, one batch of `batch` images already on the device, two ways: plain
    transformers (`torch.compile(model)` when `compiled`: the three lines a user writes)
    and embedjob's graph replay of its adapter, compiled as a job compiles it. The
    second row's note gives its speed over the first and the smallest cosine between
    their embeddings."""
    from embedjob.encoders.loading import save_atomically

    rows: list[Row] = []
    for family, (label, values) in towers.items():
        directory = workdir / f"{family}-tower"
        if not directory.exists():
            save_atomically(lambda tmp: save_fixed_tower(family, values, tmp), directory)
        rows += _fixed_tower_rows(family, label, directory, batch, repeats, peak, device, compiled)
    return rows


def _fixed_tower_rows(
    family: str, label: str, directory: Path, batch: int, repeats: int, peak: float, device: torch.device, compiled: bool
) -> list[Row]:
    from embedjob.encoders.fixed import FAMILIES as FIXED
    from embedjob.encoders.loading import transformers_class

    adapter = checkpoint_adapter(family, directory, "bfloat16", compiled, device)
    projection = adapter.projection.out_features if adapter.projection is not None else None
    flops = batch * fixed_flops(family, adapter.tower.config, projection)
    generator = torch.Generator().manual_seed(1)
    # Views as the workers make them (float32 for processors that rescale before resizing).
    pictures = torch.randint(0, 256, (batch, 3, *adapter.processing.input_size), dtype=torch.uint8, generator=generator)
    pixels = adapter.processing.process(pictures).to(device)
    spec = FIXED[family]
    plain = transformers_class(spec.projected_class or spec.vision_class).from_pretrained(directory, dtype=adapter.dtype)
    values = adapter.processing.normalize(pixels, adapter.pixel_scale).to(adapter.dtype)
    plain = plain.to(device).eval().requires_grad_(False)
    plain_rows = _plain_seconds(plain, spec.projected_class is not None, values, repeats, compiled, device)
    return _against_plain(label, "transformers", "model", adapter, pixels, plain_rows, flops, peak, repeats, device, compiled)


def _against_plain(
    label: str, library: str, call: str, adapter: Any, pixels: torch.Tensor, plain: tuple[float, torch.Tensor, torch.Tensor],
    flops: float, peak: float, repeats: int, device: torch.device, compiled: bool,
) -> list[Row]:
    """The plain library's row (`plain`, timed by the caller: its median seconds, its
    float32 vectors, and those of its uncompiled model) and our graph replay's on the same
    `pixels` (the adapter compiled as a job compiles it when `compiled`), whose note gives
    its speed over the plain one and the smallest cosine between their vectors; compiled,
    also to the uncompiled model's, the reference of the fidelity tests, so a departure
    says which side made it."""
    plain_seconds, reference, uncompiled = plain
    torch._dynamo.reset()
    if compiled:
        adapter.compile(dynamic=True)
    ours_seconds, ours = graph_seconds(adapter, pixels, repeats, device)
    cosine = float(torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min())
    batch = pixels.shape[0]
    kind = f"torch.compile({call})" if compiled else "eager"
    to_uncompiled = ""
    if compiled:
        to_uncompiled = f"min cos to plain uncompiled {float(torch.nn.functional.cosine_similarity(ours, uncompiled, dim=-1).min()):.5f}; "
    return [
        Row(label, f"plain_{library}_{'compile' if compiled else 'eager'}", batch, plain_seconds, flops, peak,
            note=f"{kind}, batch {batch} on the device"),
        Row(label, "ours_graphs_compiled" if compiled else "ours_graphs", batch, ours_seconds, flops, peak,
            note=f"{plain_seconds / ours_seconds:.3f}x plain; {to_uncompiled}min cos to plain {cosine:.5f}"),
    ]


def view_items(adapter: Any, views: torch.Tensor) -> list[EncoderInput]:
    """A fixed-resolution adapter's items of the (N, 3, h, w) `views` (the processor's
    output), one image each, holding slices of `views` where they are (on the device,
    as with `preprocess.decoder: gpu`)."""
    from embedjob.encoders.fixed import GLOBAL_KEY

    t = adapter.tokens_per_image
    return [EncoderInput({GLOBAL_KEY: views[k : k + 1]}, tokens=t, frames=0, size=t) for k in range(views.shape[0])]


def graph_seconds(adapter: Any, pixels: torch.Tensor, repeats: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """A fixed-resolution adapter's median seconds replaying one graph of the batch of
    uint8 `pixels` (already on the device) and its embeddings in float32."""
    batch = pixels.shape[0]
    budget = batch * adapter.tokens_per_image
    manager = GraphManager(adapter, packer.BudgetPlan((budget,), batch, 0), "cuda" if device.type == "cuda" else "replay")
    manager.capture()
    items = view_items(adapter, pixels)
    with torch.inference_mode():
        seconds = device_time(lambda: manager.run_batch(items, budget), repeats, device)
        embeddings = manager.run_batch(items, budget)[:batch].float()
    manager.clear()
    return seconds, embeddings


OPEN_CLIP_TOWER = "ViT-H-14"
"""The OpenCLIP model config (open_clip's own, by name) of `embedjob bench`'s OpenCLIP row:
the size of hf-hub:laion/CLIP-ViT-H-14-laion2B-s32B-b79K."""


def open_clip_rows(
    workdir: Path, label: str, model_cfg: dict[str, Any], batch: int, repeats: int, peak: float, device: torch.device,
    compiled: bool = True,
) -> list[Row]:
    """An OpenCLIP model of `model_cfg` (random weights, seed 0, saved in the hub layout)
    on one batch of `batch` images already on the device, two ways: open_clip's own
    `model.encode_image` (through `torch.compile` when `compiled`) and embedjob's graph
    replay of its adapter, compiled as a job compiles it. The second row's note gives
    its speed over the first and the smallest cosine between their embeddings."""
    from embedjob.encoders.loading import save_atomically
    from embedjob.encoders.open_clip import import_open_clip, save_checkpoint

    open_clip = import_open_clip()
    directory = workdir / f"open_clip-{label.replace('/', '-').replace(' ', '-')}"

    def build(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            save_checkpoint(open_clip.CLIP(**model_cfg).to(torch.bfloat16), model_cfg, {}, tmp)

    save_atomically(build, directory)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    adapter = checkpoint_adapter("open_clip", directory, dtype, compiled, device)
    tower = adapter.tower
    shape = SimpleNamespace(
        hidden_size=tower.transformer.width, intermediate_size=tower.transformer.resblocks[0].mlp.c_fc.out_features,
        num_hidden_layers=len(tower.transformer.resblocks), patch_size=tower.patch_size[0], image_size=tower.image_size[0],
    )
    flops = batch * fixed_flops("clip", shape, adapter.embed_dim)
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (batch, 3, *adapter.processing.input_size), dtype=torch.uint8, generator=generator).to(device)
    values = adapter.processing.normalize(pixels, adapter.pixel_scale).to(adapter.dtype)
    precision = "pure_bf16" if adapter.dtype == torch.bfloat16 else "fp32"
    plain = open_clip.create_model(f"local-dir:{directory}", precision=precision, device=device).eval().requires_grad_(False)
    encode = torch.compile(plain.encode_image) if compiled else plain.encode_image
    with torch.inference_mode():
        plain_seconds = device_time(lambda: encode(values), repeats, device)
        reference = encode(values).float()
        uncompiled = plain.encode_image(values).float() if compiled else reference
    del plain, encode
    return _against_plain(
        label, "open_clip", "model.encode_image", adapter, pixels, (plain_seconds, reference, uncompiled), flops, peak, repeats,
        device, compiled,
    )


def _plain_seconds(
    model: torch.nn.Module, projected: bool, values: torch.Tensor, repeats: int, compiled: bool, device: torch.device
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The transformers model's median seconds on `values` (compiled with torch.compile
    when asked), its embeddings in float32 (`projected`, CLIP and MetaCLIP 2:
    image_embeds; SigLIP and DINOv3: the pooled output), and the uncompiled model's."""
    run = torch.compile(model) if compiled else model

    def embed(module: Any) -> torch.Tensor:
        out = module(pixel_values=values)
        return out.image_embeds if projected else out.pooler_output

    with torch.inference_mode():
        seconds, reference = device_time(lambda: embed(run), repeats, device), embed(run).float()
        return seconds, reference, embed(model).float() if compiled else reference



# --- SigLIP 2 NaFlex: packed graphs against transformers' padded batch ---------------------

NAFLEX_TOWER = (
    "SigLIP2-so400m-patch16-naflex-size",
    dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304, patch_size=16, num_patches=256),
)
"""The NaFlex tower `embedjob bench` (and benchmarks/naflex.py) builds: a label and the
transformers vision config of the published checkpoint's size."""
NAFLEX_PATCHES = 256
"""The published checkpoints' `max_num_patches`."""
NAFLEX_BATCH = 64


def save_naflex_tower(values: dict[str, Any], max_patches: int, directory: Path) -> None:
    """A Siglip2VisionModel of config `values` with random bf16 weights (seed 0), saved with
    `save_pretrained` beside its image processor config, as a user's vision-only NaFlex
    checkpoint is."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Siglip2VisionConfig(**values)
    transformers.Siglip2VisionModel._from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    transformers.Siglip2ImageProcessor(patch_size=values["patch_size"], max_num_patches=max_patches).save_pretrained(directory)


def naflex_flops(config: Any, tokens: list[int]) -> float:
    """Useful FLOPs of images of `tokens` patches each through a NaFlex tower: per image
    `fixed_flops`' terms for SigLIP at its own token count n (patch embedding, the layers
    with their n^2 attention, the pooling head); the position table's resize is left out
    (0.1 % of a block at so400m's size, and not a matmul of the model's)."""
    d, m, layers, patch = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.patch_size
    total = 0
    for n in tokens:
        total += 2 * n * 3 * patch**2 * d + layers * (2 * n * 4 * d * d + 2 * n * 2 * d * m + 4 * n * n * d)
        total += 4 * d * d + 4 * n * d * d + 4 * n * d + 4 * d * m
    return float(total)


def naflex_mix(count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` random-pixel (H, W, 3) uint8 images of aspect ratios from 1:4 to 4:1 and
    200-1,200 pixels a side: the token counts NaFlex gives photos, without the photos."""
    rng = np.random.default_rng(seed)
    sides = rng.integers(200, 1200, size=(count, 2))
    return [rng.integers(0, 256, (max(h, w // 4), max(w, h // 4), 3), dtype=np.uint8) for h, w in sides]


def naflex_rows(
    directory: Path, label: str, images: list[np.ndarray], batch: int, repeats: int, peak: float, device: torch.device,
    compiled: bool = True,
) -> list[Row]:
    """`images` through the NaFlex tower saved in `directory`, two ways: transformers'
    Siglip2VisionModel on the processor's output in batches of `batch` padded to
    `max_num_patches` (`torch.compile(model)` when `compiled`), and embedjob's graphs
    over its packed adapter (compiled as a job compiles it) with the job's automatic
    budgets. Each pass encodes every image; the pixels are on the device beforehand on
    both sides. The second row's note gives its speed over the first, its padding and
    the smallest cosine between the two sides' vectors."""
    from embedjob.encoders.loading import transformers_class

    adapter = checkpoint_adapter("siglip2", directory, "bfloat16", compiled, device)
    processor = transformers_class("Siglip2ImageProcessor").from_pretrained(directory)
    chw = [torch.from_numpy(image).permute(2, 0, 1) for image in images]
    inputs = [processor(images=chw[k : k + batch], return_tensors="pt").to(device) for k in range(0, len(chw), batch)]
    for padded in inputs:
        padded["pixel_values"] = padded["pixel_values"].to(adapter.dtype)
    items = [adapter.preprocessor()(SimpleNamespace(pixels=image)) for image in images]
    items = [replace(item, tensors={k: v.to(device) for k, v in item.tensors.items()}) for item in items]
    flops = naflex_flops(adapter.tower.config, [item.tokens for item in items])
    plain = transformers_class("Siglip2VisionModel").from_pretrained(directory, dtype=adapter.dtype).to(device).eval()
    run = torch.compile(plain) if compiled else plain

    def transformers_pass() -> torch.Tensor:
        return torch.cat([run(**padded).pooler_output for padded in inputs])

    with torch.inference_mode():
        plain_seconds = device_time(transformers_pass, repeats, device)
        reference = transformers_pass().float()
    torch._dynamo.reset()
    if compiled:
        adapter.compile(dynamic=True)
    plan = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 1, False)
    manager = GraphManager(adapter, plan, "cuda" if device.type == "cuda" else "replay")
    manager.capture()
    packed = packer.pack([item.tokens for item in items], [0] * len(items), plan, "min_padding")

    def ours_pass() -> torch.Tensor:
        out = torch.empty(len(items), adapter.embed_dim, dtype=adapter.dtype, device=device)
        for chosen in packed:
            out[list(chosen.indices)] = manager.run_batch([items[i] for i in chosen.indices], chosen.budget)
        return out

    with torch.inference_mode():
        ours_seconds = device_time(ours_pass, repeats, device)
        ours = ours_pass().float()
    cosine = float(torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min())
    real = sum(item.tokens for item in items)
    waste = sum(b.budget for b in packed) / real - 1
    manager.clear()
    kind = "torch.compile(model)" if compiled else "eager"
    return [
        Row(label, f"plain_transformers_{'compile' if compiled else 'eager'}", len(items), plain_seconds, flops, peak,
            waste=len(inputs) * batch * processor.max_num_patches / real - 1, note=f"{kind}, padded batches of {batch}"),
        Row(label, "ours_graphs_compiled" if compiled else "ours_graphs", len(items), ours_seconds, flops, peak, waste=waste,
            note=f"{plain_seconds / ours_seconds:.3f}x plain; min cos to plain {cosine:.5f}"),
    ]


def bench_naflex(workdir: Path, repeats: int, peak: float, device: torch.device, compiled: bool) -> list[Row]:
    """`embedjob bench`'s NaFlex rows: the so400m-patch16-naflex-size tower on 4 x
    NAFLEX_BATCH images of mixed aspect ratios (`naflex_mix`)."""
    from embedjob.encoders.loading import save_atomically

    label, values = NAFLEX_TOWER
    directory = workdir / "siglip2-tower"
    if not directory.exists():
        save_atomically(lambda tmp: save_naflex_tower(values, NAFLEX_PATCHES, tmp), directory)
    return naflex_rows(directory, label, naflex_mix(4 * NAFLEX_BATCH), NAFLEX_BATCH, repeats, peak, device, compiled)


# --- the Qwen3.5 vision tower against plain transformers ----------------------------------

QWEN3_5_TOWER = (
    "Qwen3.5-27B-size",
    dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16, spatial_merge_size=2,
         temporal_patch_size=2, num_position_embeddings=2304, out_hidden_size=3584),
)
"""The Qwen3.5 tower `embedjob bench` builds: transformers' `Qwen3_5VisionConfig` defaults,
which its docstring gives for Qwen/Qwen3.5-27B (27 blocks of width 1152, MLP 4304, 16
heads of 72, patch 16, a 48 x 48 position table); `out_hidden_size`, the merger's output
(a checkpoint's language-model width), is that config's default."""
QWEN3_5_IMAGES = 64


def save_qwen3_5_tower(values: dict[str, Any], directory: Path) -> None:
    """A Qwen3.5 vision tower of config `values` with random bf16 weights (seed 0), saved
    with `save_pretrained` beside Qwen3.5's image processor (images of up to MAX_PIXELS),
    as a user's tower-only checkpoint is."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(0)
    model = Qwen3_5VisionModel._from_config(transformers.Qwen3_5VisionConfig(**values), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": 56 * 56, "longest_edge": MAX_PIXELS}, patch_size=values["patch_size"], temporal_patch_size=2,
        merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(directory)


def qwen3_5_flops(items: list[EncoderInput], config: Any) -> float:
    """Useful FLOPs of the Qwen3.5 tower on these items (multiply-adds count 2): per patch
    the patch embedding, per block the qkv and output projections and the two-layer MLP,
    full attention over each temporal group's patches, and the merger's two layers per
    merged token. Norms, activations and position embeddings are left out."""
    d, inner, out, depth = config.hidden_size, config.intermediate_size, config.out_hidden_size, config.depth
    patch = 3 * config.temporal_patch_size * config.patch_size**2
    total = 0.0
    for item in items:
        t, h, w = item.grid
        n = t * h * w
        dense = n * (2 * 4 * d * d + 2 * 2 * d * inner)
        attention = 4 * d * t * float(h * w) ** 2
        merged = n // 4
        total += 2 * n * patch * d + depth * (dense + attention) + 2 * merged * (4 * d) ** 2 + 2 * merged * 4 * d * out
    return total


@dataclass
class Qwen35Setup:
    """What the Qwen3.5 comparisons share: the tower of config `values` saved like a
    user's checkpoint, the adapter a job loads for it, the first `count` images of the
    mixed mix packed into batches under the budgets of an image job (`input.modality`
    image: no video frames, so no slots for them in the graphs' offsets), transformers' own tower of the
    checkpoint on the device, and each batch's (pixels, grid) already there for it."""

    adapter: Any
    items: list[EncoderInput]
    plan: packer.BudgetPlan
    batches: list[packer.Batch]
    plain: torch.nn.Module
    inputs: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def make(cls, workdir: Path, values: dict[str, Any], count: int, device: torch.device, compiled: bool) -> Qwen35Setup:
        from embedjob.encoders.loading import save_atomically, transformers_class

        directory = workdir / "qwen3_5-tower"
        if not directory.exists():
            save_atomically(lambda tmp: save_qwen3_5_tower(values, tmp), directory)
        adapter = checkpoint_adapter("qwen3_5", directory, "bfloat16", compiled, device)
        items = make_mix("mixed", adapter.preprocessor())[:count]
        plan = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 32, False)
        batches = packer.pack([i.tokens for i in items], [i.frames for i in items], plan, "min_padding")
        plain = transformers_class("Qwen3_5VisionModel").from_pretrained(directory, dtype=adapter.dtype).to(device).eval()
        inputs = []
        for batch in batches:
            chosen = [items[i] for i in batch.indices]
            pixels = torch.cat([adapter.processing.model_pixels(i.tensors["pixel_values"]) for i in chosen])
            inputs.append((pixels.to(device, adapter.dtype), torch.tensor([i.grid for i in chosen], device=device)))
        return cls(adapter, items, plan, batches, plain, inputs)


def qwen3_5_rows(
    workdir: Path, label: str, values: dict[str, Any], count: int, repeats: int, peak: float, device: torch.device,
    compiled: bool = True,
) -> list[Row]:
    """The Qwen3.5 tower of config `values` saved like a user's checkpoint, on the first
    `count` images of the mixed mix packed into the same batches two ways: plain
    transformers (its own sdpa attention, split per image on the host, one call per batch,
    pixels already on the device) and embedjob's graphs over the adapter a job loads
    (compiled as a job compiles it when `compiled`). The second row's note gives its
    speed over the first and the smallest cosine between their mean vectors."""
    q = Qwen35Setup.make(workdir, values, count, device, compiled)
    adapter, items, plan, batches, plain, inputs = q.adapter, q.items, q.plan, q.batches, q.plain, q.inputs
    del q

    def run_plain() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [plain(hidden_states=pixels, grid_thw=grid).pooler_output for pixels, grid in inputs]

    plain_seconds = device_time(run_plain, repeats, device)
    reference = torch.stack([rows.float().mean(0) for out, batch in zip(run_plain(), batches)
                             for rows in out.split([items[i].tokens for i in batch.indices])])
    del plain
    if compiled:
        torch._dynamo.reset()
        adapter.compile(dynamic=True)
    manager = GraphManager(adapter, plan, "cuda" if device.type == "cuda" else "replay")
    manager.capture()

    def run_ours() -> list[torch.Tensor]:
        return [v for batch in batches for v in manager.run([items[i] for i in batch.indices], batch.budget, reduce=_mean)]

    with torch.inference_mode():
        ours_seconds = device_time(run_ours, repeats, device)
        ours = torch.stack(run_ours()).float()
    cosine = float(torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min())
    hit_rate = manager.stats.hits / max(1, manager.stats.hits + manager.stats.misses)
    manager.clear()
    flops = qwen3_5_flops(items, adapter.model.config)
    waste = packer.padding_waste(batches) / sum(i.tokens for i in items)
    return [
        Row(label, "plain_transformers_sdpa", count, plain_seconds, flops, peak, note="eager, packed batches on the device"),
        Row(label, "ours_graphs_compiled" if compiled else "ours_graphs", count, ours_seconds, flops, peak, hit_rate, waste,
            note=f"{plain_seconds / ours_seconds:.3f}x plain; min cos to plain {cosine:.5f}"),
    ]


def render(rows: list[Row], header: dict[str, Any]) -> str:
    lines = [f"# embedjob bench — {header['date']}", ""]
    lines += [f"- {k}: {v}" for k, v in header.items() if k != "date"]
    lines += ["", "| mix | variant | items | seconds | items/s | MFU | hit rate | padding | note |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    return "\n".join(lines + [_row_line(r) for r in rows])


def _row_line(r: Row) -> str:
    hit = "-" if r.hit_rate is None else f"{r.hit_rate:.0%}"
    waste = "-" if r.waste is None else f"{r.waste:.1%}"
    return f"| {r.mix} | {r.variant} | {r.items} | {r.seconds:.3f} | {r.items_per_second:.1f} | {r.mfu:.1%} | {hit} | {waste} | {r.note} |"


class Table:
    """The rows measured so far, logged as each arrives and written to `bench.md` after
    each tower's rows: a run cut short (a device call's time limit) keeps what it measured."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.rows: list[Row] = []

    def add(self, rows: list[Row]) -> None:
        for row in rows:
            logger.info("bench row: %s", _row_line(row))
        self.rows += rows
        self.path.write_text(render(self.rows, self.header) + "\n")

    def text(self) -> str:
        return render(self.rows, self.header)


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("embedjob bench needs a CUDA GPU")
    device = torch.device("cuda")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    peak = matmul_peak()
    table = Table(workdir / "bench.md", {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, transformers {_version('transformers')}",
        "bf16 matmul": f"{peak / 1e12:.0f} TFLOP/s (8192^3, median of 10)",
    })
    if args.mixes:
        qwen2_5_rows(args, device, peak, workdir, table)
    compiled = bool(args.compile_modes)
    towers = {name: FIXED_TOWERS[name] for name in args.fixed_towers if name in FIXED_TOWERS}
    if args.fixed:
        for name, tower in towers.items():
            table.add(fixed_rows(workdir, {name: tower}, FIXED_BATCH, args.repeats, peak, device, compiled=compiled))
    if args.fixed and "open_clip" in args.fixed_towers:
        if importlib.util.find_spec("open_clip") is None:
            table.header["open_clip"] = "skipped: open_clip_torch is not installed (pip install 'embedjob[open_clip]')"
        else:
            table.add(open_clip_rows(
                workdir, f"OpenCLIP {OPEN_CLIP_TOWER}-size", _open_clip_config(OPEN_CLIP_TOWER), FIXED_BATCH, args.repeats, peak,
                device, compiled=compiled,
            ))
    if args.naflex:
        table.add(bench_naflex(workdir, args.repeats, peak, device, compiled=compiled))
    if args.qwen3_5:
        table.add(qwen3_5_rows(workdir, *QWEN3_5_TOWER, QWEN3_5_IMAGES, args.repeats, peak, device, compiled=compiled))
    print(table.text())
    return 0


def qwen2_5_rows(args: argparse.Namespace, device: torch.device, peak: float, workdir: Path, table: Table) -> None:
    """The Qwen2.5-VL-7B-size tower on `args.mixes`, every way the module docstring lists,
    into `table` (its header gets the tower's budgets, fidelity and setup notes)."""
    adapter = build_tower(device)
    checkpoint = save_checkpoint(adapter, workdir) if args.e2e_images else None
    plan = packer.resolve_budgets(None, None, None, adapter.min_budget, adapter.max_budget, 32, True)
    notes = table.header
    notes["tower"] = "Qwen2.5-VL-7B-size vision tower, random bf16 weights"
    notes["budgets"] = list(plan.token_budgets)
    notes["max_items/max_frames"] = f"{plan.max_items}/{plan.max_frames}"
    fidelity = Fidelity(adapter, args.fidelity_items)
    fidelity.transformers_bf16(adapter)
    untuned = _our_managers(adapter, plan, notes, "")
    fidelity.graphs("embedjob graphs", untuned["ours_graphs"])
    for mix in args.mixes:
        table.add(bench_mix(mix, adapter, plan, untuned, args, peak))
    untuned["ours_graphs"].clear()
    tune_for_cuda(adapter.model)
    only_ours = argparse.Namespace(**{**vars(args), "skip": {"hf_sdpa", "hf_varlen"}})
    tuned = _our_managers(adapter, plan, notes, "_tuned")
    for mix in args.mixes:
        table.add(bench_mix(mix, adapter, plan, tuned, only_ours, peak))
    tuned["ours_graphs_tuned"].clear()
    for mode in args.compile_modes:
        start = time.perf_counter()
        torch._dynamo.reset()
        adapter.compile(dynamic=mode == "dynamic")
        compiled = GraphManager(adapter, plan, "cuda")
        compiled.capture()
        notes[f"{mode} compile+capture_s"] = round(time.perf_counter() - start, 1)
        notes[f"{mode} compiled pool_GiB"] = round(compiled.stats.pool_bytes / 2**30, 2)
        fidelity.graphs(f"embedjob graphs tuned compiled {mode}", compiled)
        mixes = args.mixes if mode == "dynamic" else args.mixes[:1]
        for mix in mixes:
            table.add(bench_mix(mix, adapter, plan, {f"ours_graphs_tuned_compiled_{mode}": compiled}, only_ours, peak))
        compiled.clear()
        if mode == "dynamic" and args.profile:
            kernel_table(adapter, plan, workdir)
    if checkpoint is not None:
        table.add(end_to_end(adapter, checkpoint, workdir, args, peak, compiled="dynamic" in args.compile_modes))
    if args.fp8:
        table.add(fp8_rows(adapter, plan, workdir, args, peak, fidelity, notes))
    notes["fidelity vs fp32 (per image, first images of the mixed mix)"] = fidelity.summary()


def _open_clip_config(name: str) -> dict[str, Any]:
    """open_clip's own model config of that name (the published model's sizes)."""
    import open_clip

    return open_clip.get_model_config(name)


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)
