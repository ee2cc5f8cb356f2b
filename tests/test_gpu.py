"""CUDA-only checks: real graph capture and replay, varlen attention, the job on a GPU.

Skipped without CUDA (CI has none); run on a GPU machine before calling graph or
encoder work done: `python -m pytest tests/test_gpu.py -q`.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job, random_image, random_video
from engine_helpers import (
    batches,
    one_path_encoder_on,
    padded_eager,
    paths_encoder,
    run,
    run_padded_eager,
    same_size_items,
)

from embedjob.decode import DecodeOptions
from embedjob.encoders import attention, load_adapter
from embedjob.encoders.attention import (
    _cuda_varlen,
    _fa4_varlen,
    _segment_attention,
    _segmented_sdpa,
    cuda_kernel,
    fa4_problem,
    varlen_attention,
)
from embedjob.engine.graphs import GraphManager
from embedjob.engine.packer import BudgetPlan, pack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def nan_pool_replays(adapter, reference, plan: BudgetPlan, items: list):
    """Capture `adapter`'s graphs into a pool first filled with NaN (memory handed back to
    the driver, which the pool's first segments reuse) and replay `items` batch by batch:
    each batch's real rows must be finite and equal the padded eager run bit for bit.
    Yields (replayed rows, `reference`'s eager rows of the same batch)."""
    filler = torch.full((1 << 28,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del filler
    torch.cuda.empty_cache()
    manager = GraphManager(adapter, plan, "cuda")
    manager.capture()
    eager = GraphManager(reference, plan, None)
    for batch in pack([i.tokens for i in items], [i.frames for i in items], plan):
        chosen = [items[i] for i in batch.indices]
        replayed = torch.cat(manager.run(chosen, batch.budget))
        assert torch.isfinite(replayed).all()
        assert torch.equal(replayed, padded_eager(manager, chosen, batch.budget)[: replayed.shape[0]])
        yield replayed, torch.cat(eager.run(chosen, None))
    manager.clear()

PLAN = BudgetPlan(token_budgets=(64, 128, 256, 512, 1024), max_items=16, max_frames=16)
MEDIA = [
    random_image(224, 224, 1),
    random_image(300, 500, 2),
    random_video(4, 112, 168, 3),
    random_image(56, 56, 4),
    random_image(448, 448, 5),
    random_image(90, 400, 6),
]


@pytest.fixture(scope="module")
def cuda_adapter(cache_dir: str):
    return load_adapter(make_job(cache_dir, model={"dtype": "bfloat16"}), torch.device("cuda"))


@pytest.fixture(scope="module")
def cuda_manager(cuda_adapter) -> GraphManager:
    manager = GraphManager(cuda_adapter, PLAN, "cuda")
    manager.capture()
    return manager


@pytest.fixture(scope="module")
def items(cuda_adapter):
    return [cuda_adapter.preprocessor()(m) for m in MEDIA]


def test_varlen_attention_on_cuda_matches_per_segment_sdpa() -> None:
    torch.manual_seed(0)
    heads, dim = 4, 32
    cu = torch.tensor([0, 16, 80, 80, 144, 144], dtype=torch.int32)
    q, k, v = (torch.randn(1, heads, 144, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, _ = varlen_attention(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu.cuda(), max_length_q=64)
    ref = _segmented_sdpa(*(t[0].transpose(0, 1).float() for t in (q, k, v)), cu, None)
    assert (out[0].float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dim", [32, 64, 80])
@pytest.mark.parametrize(("lengths", "bound"), [
    ([0, 64, 16, 0, 64, 1, 0, 40, 0, 0], 64),  # Qwen2.5-VL's windows, edge windows and pad slots
    ([0, 300, 0, 1024, 0, 0, 64, 513, 0, 0], 1536),  # full-attention images, a budget's bound
])
def test_segment_attention_equals_the_float32_reference_from_strided_q_k_v(
    dim: int, lengths: list[int], bound: int, compiled: bool
) -> None:
    """Our Triton kernel at the head dims it takes (powers of two, and Qwen2.5-VL's 80,
    which it splits as 64 + 16), eager and compiled, reading q, k and v straight out of a
    joined qkv product (token stride 3 x heads x dim) with zero-length segments first,
    between and last: every row finite and within bf16 rounding of float32 attention and
    of varlen_attn. Windows are what `cuda_kernel` gives it; longer segments it takes too
    (benchmarks raise SEGMENT_MAX_LENGTH)."""
    attention.register()
    torch.manual_seed(dim + bound)
    heads, scale = 16, dim**-0.5
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lengths), 3, heads, dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    assert (cuda_kernel("varlen", bound, dim) is _segment_attention) == (bound <= attention.SEGMENT_MAX_LENGTH)
    kernel = _segment_attention
    if compiled:
        torch._dynamo.reset()
        kernel = torch.compile(kernel, fullgraph=True, dynamic=True)
    out = kernel(q, k, v, cu, bound, scale).float()
    ref = _segmented_sdpa(q.float(), k.float(), v.float(), cu.cpu(), scale)
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    torch.testing.assert_close(out, _cuda_varlen(q, k, v, cu, bound, scale).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_segment_kernel_captured_into_a_nan_filled_pool_replays_like_varlen_attn(
    cache_dir: str, compiled: bool, monkeypatch
) -> None:
    """Qwen2.5-VL's tiny tower with its 64-patch windows in our Triton kernel (the
    default), blocks compiled or not, captured into a pool first filled with NaN: every
    replay's real rows are finite, equal the padded eager run bit for bit and are close to
    the rows of the same tower with every layer in varlen_attn."""
    job = make_job(cache_dir, model={"dtype": "bfloat16", "attention": "varlen"})
    ours, plain = (load_adapter(job, torch.device("cuda")) for _ in range(2))
    if compiled:
        ours.compile(dynamic=True)
    items = [ours.preprocessor()(m) for m in MEDIA]
    batched = [[items[i] for i in batch.indices] for batch in pack([i.tokens for i in items], [i.frames for i in items], PLAN)]
    with monkeypatch.context() as patch:
        patch.setattr(attention, "SEGMENT_MAX_LENGTH", 0)
        varlen = [torch.cat(GraphManager(plain, PLAN, None).run(chosen, None)).float() for chosen in batched]
    replays = list(nan_pool_replays(ours, plain, PLAN, items))
    assert len(replays) == len(varlen)
    for (replayed, _), want in zip(replays, varlen):
        rel = float((replayed.float() - want).norm() / want.norm())
        assert rel < 2e-2, rel


FA4_PROBLEM = fa4_problem(torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else "no CUDA"
needs_fa4 = pytest.mark.skipif(FA4_PROBLEM is not None, reason=f"needs FlashAttention-4 ({FA4_PROBLEM}; pip install 'embedjob[fast]')")


@needs_fa4
@pytest.mark.parametrize("dim", [64, 72, 80])
def test_fa4_attention_equals_varlen_on_packed_segments_with_zero_length_ones(dim: int) -> None:
    """The towers' head dims, full-attention segment lengths with zero-length segments
    first, between and last (as padded graph buffers have them) and a length bound above
    the longest (as a budget's): FA4 writes finite rows equal to varlen_attn's and to the
    float32 per-segment reference, to bf16 rounding."""
    torch.manual_seed(dim)
    heads, bound, scale = 16, 1536, dim**-0.5
    lengths = [0, 300, 0, 1024, 0, 0, 64, 513, 0, 0]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, heads, sum(lengths), dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert cuda_kernel("fa4", bound, dim) is _fa4_varlen
    outs = {
        backend: varlen_attention(torch.nn.Module(), q, k, v, None, scaling=scale, cu_seq_lens_q=cu, max_length_q=bound,
                                  backend=backend)[0][0].float()
        for backend in ("fa4", "varlen")
    }
    ref = _segmented_sdpa(*(t[0].transpose(0, 1).float() for t in (q, k, v)), cu.cpu(), scale)
    assert torch.isfinite(outs["fa4"]).all()
    for backend, out in outs.items():
        assert (out - ref).norm() / ref.norm() < 1e-2, backend
    torch.testing.assert_close(outs["fa4"], outs["varlen"], atol=1e-2, rtol=1e-2)


@needs_fa4
@pytest.mark.parametrize("compiled", [False, True])
def test_an_fa4_tower_captured_into_a_nan_filled_pool_replays_like_eager(cache_dir: str, compiled: bool) -> None:
    """Qwen2.5-VL's tiny tower with model.attention fa4 (its full-attention layers in FA4,
    its 64-patch windows in varlen_attn), its blocks compiled or not, captured into a pool
    first filled with NaN: every replay's real rows are finite, equal the padded eager run
    bit for bit and are close to the varlen tower's eager rows."""
    model = {"dtype": "bfloat16"}
    fa4 = load_adapter(make_job(cache_dir, model={**model, "attention": "fa4"}), torch.device("cuda"))
    varlen = load_adapter(make_job(cache_dir, model={**model, "attention": "varlen"}), torch.device("cuda"))
    assert fa4.attention == "fa4" and varlen.attention == "varlen"
    if compiled:
        fa4.compile(dynamic=True)
    items = [fa4.preprocessor()(m) for m in MEDIA]
    for replayed, eager in nan_pool_replays(fa4, varlen, PLAN, items):
        rel = float((replayed.float() - eager.float()).norm() / eager.float().norm())
        assert rel < 2e-2, rel


@needs_fa4
def test_an_fa4_job_keeps_its_kernels_for_the_next_process_and_prints_no_fa4_warnings(tmp_path: Path, cache_dir: str) -> None:
    """The demo with model.attention fa4, run as a user runs it (a process of its own):
    it reports fa4, FlashAttention-4's compiled kernels land under the cache root where
    the next process finds them, and neither of the packages' per-run warnings reaches
    the output."""
    sets = [f"runtime.cache_dir={cache_dir}", f"output.path={tmp_path / 'out'}", "runtime.device=cuda",
            "model.dtype=bfloat16", "model.attention=fa4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_ATTENTION_CUTE_DSL_CACHE")}
    done = subprocess.run(
        [sys.executable, "-m", "embedjob.cli", "run", str(REPO / "jobs" / "demo.yaml"), *(a for k in sets for a in ("--set", k))],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(next((tmp_path / "out").glob("_embedjob/stats-*.json")).read_text())
    assert stats["attention"] == "fa4"
    assert [p for p in (Path(cache_dir) / "fa4").rglob("*") if p.is_file()]
    assert "JitArgument" not in done.stderr + done.stdout and "SmemAllocator" not in done.stderr + done.stdout


def test_cuda_graph_replay_equals_eager_on_the_same_padded_batch(cuda_manager: GraphManager, items) -> None:
    assert cuda_manager.num_graphs == len(PLAN.token_budgets)
    for batch in pack([i.tokens for i in items], [i.frames for i in items], PLAN):
        chosen = [items[i] for i in batch.indices]
        replayed = torch.cat(cuda_manager.run(chosen, batch.budget))
        padded = padded_eager(cuda_manager, chosen, batch.budget)
        assert torch.equal(replayed, padded[: replayed.shape[0]])


def test_graph_outputs_match_the_fp32_cpu_reference(cuda_manager: GraphManager, qwen_adapter, items) -> None:
    cpu_items = [qwen_adapter.preprocessor()(m) for m in MEDIA]
    with torch.no_grad():
        refs = qwen_adapter.split(qwen_adapter.forward(qwen_adapter.eager_inputs(cpu_items)), cpu_items)
    outs = cuda_manager.run(items, 1024)
    for out, ref in zip(outs, refs):
        rel = float((out.float().cpu() - ref).norm() / ref.norm())
        assert rel < 3e-2, rel


def test_batches_are_page_locked_and_normalise_on_the_device_bitwise(cuda_adapter, items) -> None:
    """Host values must be page-locked for the copies to the device to be asynchronous;
    the uint8 rows normalised on the GPU must be the CPU's (so the processor's) bits."""
    static = cuda_adapter.static_inputs(1024, PLAN.max_items, PLAN.max_frames)
    assert all(t.device.type == "cuda" for t in static.tensors.values())
    values = cuda_adapter.batch_values(items[:3], static)
    assert all(v.device.type == "cpu" and v.is_pinned() for v in values.values())
    pixels, p = values["pixel_values"], cuda_adapter.processing
    assert all(t.device.type == "cuda" for t in cuda_adapter.pixel_scale)
    assert torch.equal(p.normalize(pixels.cuda(), cuda_adapter.pixel_scale).cpu(), p.normalize(pixels))


def test_eager_fallback_and_statistics_on_cuda(cuda_adapter, items) -> None:
    manager = GraphManager(cuda_adapter, BudgetPlan(token_budgets=(64, 128), max_items=4, max_frames=8), "cuda")
    manager.capture()
    batches = pack([i.tokens for i in items], [i.frames for i in items], manager.plan)
    for batch in batches:
        manager.run([items[i] for i in batch.indices], batch.budget)
    stats = manager.stats
    assert stats.hits + stats.misses == len(items)
    assert stats.misses == sum(i.tokens > 128 for i in items) > 0
    assert stats.pool_bytes > 0
    manager.clear()
    assert manager.num_graphs == 0


def test_demo_job_on_cuda_matches_the_cpu_run(tmp_path: Path, cache_dir: str) -> None:
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs = {}
    for device in ("cpu", "cuda"):
        job = load_job(
            REPO / "jobs" / "demo.yaml",
            [f"output.path={tmp_path / device}", f"runtime.device={device}", f"runtime.cache_dir={cache_dir}", "runtime.workers=0", "runtime.gpus=1"],
        )
        stats = run_job(job)
        assert stats["rows"] == 12 and stats["errors"] == 2
        outputs[device] = pq.read_table(sorted((tmp_path / device).glob("part-*.parquet"))).to_pylist()
    assert stats["graph_backend"] == "cuda" and stats["hit_rate"] == 1.0
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["cuda"]):
        assert (cpu_row["row"], cpu_row["error"]) == (gpu_row["row"], gpu_row["error"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float((a - b).norm() / a.norm()) < 3e-2


def test_a_float32_job_on_cuda_runs_eagerly_and_matches_the_cpu_run(tmp_path: Path, cache_dir: str, caplog) -> None:
    """The flash kernels take half precision only: float32 attention runs per segment,
    which graphs cannot capture, so the job says so and runs every batch eagerly."""
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs = {}
    for device in ("cpu", "cuda"):
        job = load_job(
            REPO / "jobs" / "demo.yaml",
            [f"output.path={tmp_path / device}", f"runtime.device={device}", f"runtime.cache_dir={cache_dir}",
             "runtime.workers=0", "model.dtype=float32"],
        )
        stats = run_job(job)
        outputs[device] = pq.read_table(sorted((tmp_path / device).glob("part-*.parquet"))).to_pylist()
    assert stats["graph_backend"] is None and stats["graph_misses"] == 10
    assert "cannot be captured in CUDA graphs" in caplog.text
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["cuda"], strict=True):
        assert (cpu_row["row"], cpu_row["error"]) == (gpu_row["row"], gpu_row["error"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float((a - b).norm() / a.norm()) < 5e-3  # float16 output of float32 vectors


# Fixed-resolution encoders (CLIP, SigLIP, DINOv2) and the dual path (global view + tiles).

FIXED_MEDIA = [random_image(300, 500, 11), random_image(40, 60, 12), random_image(640, 480, 13), random_video(3, 120, 200, 14)]


def _fixed_job(cache_dir: str, family: str, pooling: str = "mean", **preprocess):
    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    return make_job(cache_dir, model=model, preprocess=preprocess, output={"pooling": pooling})


def test_dual_path_cuda_replay_equals_eager_on_the_same_padded_batch(cache_dir: str) -> None:
    adapter = load_adapter(_fixed_job(cache_dir, "clip", tiling="anyres", max_tiles=6), torch.device("cuda"))
    t = adapter.tokens_per_image
    single = BudgetPlan(tuple(t * 2**k for k in range(6)), max_items=8, max_frames=16)
    encoder = paths_encoder(adapter, single, "cuda", "min_padding")
    assert encoder.stats()["num_graphs"] == 12
    items = [adapter.preprocessor()(m) for m in FIXED_MEDIA]
    for batch in batches(encoder, items):
        budgets = batch.budgets
        assert None not in budgets
        chosen = [items[i] for i in batch.indices]
        replayed = run(encoder, chosen, budgets)
        padded = run_padded_eager(encoder, chosen, budgets)
        assert all(torch.equal(a, b) for a, b in zip(replayed, padded))
    stats = encoder.stats()
    assert stats["graph_hits"] == len(items) and stats["partial_fallbacks"] == 0
    assert stats["paths"]["local"]["graph_hits"] == 2  # the two large photos have tiles
    encoder.clear()
    assert encoder.stats()["num_graphs"] == 0


@pytest.mark.parametrize("pooling", ["mean", "none"])
@pytest.mark.parametrize("family", ["clip", "siglip", "dinov2"])
def test_fixed_res_cuda_graphs_equal_padded_eager_and_the_fp32_cpu_reference(cache_dir: str, family: str, pooling: str) -> None:
    """Pooled vectors, or (pooling: none) every view's patch tokens, which a graph
    writes into a static output of budget images x patches rows."""
    gpu = load_adapter(_fixed_job(cache_dir, family, pooling), torch.device("cuda"))
    cpu = load_adapter(_fixed_job(cache_dir, family, pooling), torch.device("cpu"))
    t = gpu.tokens_per_image
    manager = GraphManager(gpu, BudgetPlan((t, 2 * t, 4 * t, 8 * t), max_items=8, max_frames=8), "cuda")
    manager.capture()
    items = [gpu.preprocessor()(m) for m in FIXED_MEDIA]  # 6 images: 3 photos and 3 frames
    replayed = torch.cat(manager.run(items, 8 * t))
    padded = padded_eager(manager, items, 8 * t)
    rows = 6 * gpu.rows_per_view
    assert replayed.shape == (rows, gpu.embed_dim) and torch.equal(replayed, padded[:rows])
    cpu_items = [cpu.preprocessor()(m) for m in FIXED_MEDIA]
    with torch.no_grad():
        ref = cpu.forward(cpu.eager_inputs(cpu_items))
    rel = (replayed.float().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) < 3e-2, rel.tolist()
    assert manager.stats.hits == len(items)


@pytest.mark.parametrize("family", ["clip", "siglip", "dinov2"])
def test_fixed_res_batches_are_page_locked_uint8_normalised_on_the_device_bitwise(cache_dir: str, family: str) -> None:
    """The views travel as uint8 and are normalised on the device to the CPU's bits, also
    by the compiled normalisation (`FixedResAdapter.compile`) in the model's dtype."""
    gpu = load_adapter(_fixed_job(cache_dir, family), torch.device("cuda"))
    static = gpu.static_inputs(8 * gpu.tokens_per_image, max_items=8, max_frames=8)
    buffer = static.tensors["pixel_values"]
    assert buffer.dtype == torch.uint8 and buffer.device.type == "cuda"
    assert all(t.device.type == "cuda" for t in gpu.pixel_scale)
    views = gpu.batch_values([gpu.preprocessor()(m) for m in FIXED_MEDIA], static)["pixel_values"]
    assert views.dtype == torch.uint8 and views.is_pinned()
    assert torch.equal(gpu.processing.normalize(views.cuda(), gpu.pixel_scale).cpu(), gpu.processing.normalize(views))
    gpu.compile(dynamic=True)
    compiled = gpu.pixels(views.cuda())
    assert compiled.dtype == gpu.dtype and torch.equal(compiled.cpu(), gpu.processing.normalize(views).to(gpu.dtype))


@pytest.mark.parametrize(("job_file", "extra"), [("demo-clip.yaml", ["preprocess.tiling=anyres"]), ("demo-siglip-video.yaml", [])])
def test_fixed_res_demo_jobs_on_cuda_match_the_cpu_run(tmp_path: Path, cache_dir: str, job_file: str, extra: list[str]) -> None:
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs = {}
    for device in ("cpu", "cuda"):
        overrides = [f"output.path={tmp_path / device}", f"runtime.device={device}", f"runtime.cache_dir={cache_dir}"]
        stats = run_job(load_job(REPO / "jobs" / job_file, [*overrides, "runtime.workers=0", "runtime.gpus=1", *extra]))
        outputs[device] = pq.read_table(sorted((tmp_path / device).glob("part-*.parquet"))).to_pylist()
    assert stats["graph_backend"] == "cuda" and stats["hit_rate"] == 1.0
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["cuda"], strict=True):
        assert (cpu_row["row"], cpu_row["error"], cpu_row["tokens"]) == (gpu_row["row"], gpu_row["error"], gpu_row["tokens"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float((a - b).norm() / a.norm()) < 3e-2


def test_small_windows_and_chunks_give_the_plain_runs_rows(tmp_path: Path, cache_dir: str) -> None:
    """Windows of 4 items (chunks of 4 rows, batches packed differently) on the GPU give
    the rows of a run in one window: same ids, order and errors, embeddings equal to
    bf16 rounding; the rank's device time is measured with CUDA events."""
    from embedjob.cli import main

    demo = REPO / "jobs" / "demo.yaml"
    common = ["runtime.device=cuda", f"runtime.cache_dir={cache_dir}", "runtime.workers=2", "runtime.gpus=1"]

    def cli(name: str, *extra: str) -> tuple[list[dict], dict]:
        sets = [arg for key in (f"output.path={tmp_path / name}", *common, *extra) for arg in ("--set", key)]
        assert main(["run", str(demo), *sets]) == 0
        stats = json.loads(next((tmp_path / name).glob("_embedjob/stats-*.json")).read_text())
        return pq.read_table(sorted((tmp_path / name).glob("part-*.parquet"))).to_pylist(), stats

    (plain, _), (small, stats) = cli("plain"), cli("small", "batching.window=4")
    assert stats["graph_backend"] == "cuda" and stats["hit_rate"] == 1.0
    rank = stats["ranks"][0]
    # Two row groups of 6 rows, each cut into two chunks of 3 (at most 4 rows each).
    assert rank["device"] == "cuda:0" and rank["busy_seconds"] > 0 and rank["rows"] == 12 and rank["chunks"] == 4
    for a, b in zip(plain, small, strict=True):
        assert {k: v for k, v in a.items() if k != "embedding"} == {k: v for k, v in b.items() if k != "embedding"}
        if a["error"] is None:
            ea, eb = (torch.tensor(r["embedding"], dtype=torch.float32) for r in (a, b))
            assert torch.allclose(ea, eb, rtol=1e-3, atol=1e-3), (a["row"], float((ea - eb).abs().max()))


def test_pooling_per_batch_on_cuda_is_deterministic_and_equals_each_items_own_mean() -> None:
    from embedjob.engine.graphs import pool_rows

    torch.manual_seed(0)
    counts = [64] * 5 + [16, 16, 100]
    rows = torch.randn(sum(counts), 1280, device="cuda", dtype=torch.bfloat16)
    first, _ = pool_rows(rows, counts, "mean")
    again, _ = pool_rows(rows, counts, "mean")
    assert torch.equal(first, again)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    alone = torch.stack([rows[o : o + c].float().mean(0) for o, c in zip(offsets, counts)])
    assert torch.allclose(first, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpus_2_equals_the_plain_run(tmp_path: Path, cache_dir: str) -> None:
    """Two ranks on two GPUs, each decoding and encoding its own chunks: the same rows,
    order and errors as one process, every item encoded through a graph on some rank,
    and each rank's device time measured."""
    from embedjob.cli import main

    demo = REPO / "jobs" / "demo.yaml"
    # Chunks of 1 row: the rank ready first takes at most 4 (`Runner._head_start`)
    # before the other is, so both take some of the demo's 12 rows.
    common = ["runtime.device=cuda", f"runtime.cache_dir={cache_dir}", "batching.window=1"]

    def cli(name: str, *extra: str) -> tuple[list[dict], dict]:
        sets = [arg for key in (f"output.path={tmp_path / name}", *common) for arg in ("--set", key)]
        assert main(["run", str(demo), *sets, *extra]) == 0
        stats = json.loads(next((tmp_path / name).glob("_embedjob/stats-*.json")).read_text())
        return pq.read_table(sorted((tmp_path / name).glob("part-*.parquet"))).to_pylist(), stats

    (plain, _), (two, stats) = cli("plain", "--gpus", "1"), cli("two", "--gpus", "2")
    assert stats["world_size"] == 2 and {r["device"] for r in stats["ranks"]} == {"cuda:0", "cuda:1"}
    assert all(r["rows"] > 0 for r in stats["ranks"]) and stats["hit_rate"] == 1.0
    assert all(r["busy_seconds"] > 0 for r in stats["ranks"] if r["items"])  # not a rank of error rows only
    for a, b in zip(plain, two, strict=True):
        assert {k: v for k, v in a.items() if k != "embedding"} == {k: v for k, v in b.items() if k != "embedding"}
        if a["error"] is None:
            ea, eb = (torch.tensor(r["embedding"], dtype=torch.float32) for r in (a, b))
            assert torch.allclose(ea, eb, rtol=1e-3, atol=1e-3), (a["row"], float((ea - eb).abs().max()))


def test_a_budget_added_mid_run_is_captured_into_the_pool_and_replays_like_eager(cuda_adapter) -> None:
    """Equal items that fill the ladder badly add a budget between windows: its graph is
    captured into the shared pool after the others and replays the padded batch bit for
    bit; the other graphs still replay after it; no real row is NaN."""
    plan = BudgetPlan(token_budgets=(64, 128, 256, 512), max_items=8, max_frames=16)  # 8 x 56 = 448 of 512
    encoder = one_path_encoder_on(cuda_adapter, plan, "cuda", refine=True)
    manager = encoder.paths[0].manager
    items = same_size_items(cuda_adapter, 24)
    encoded = encoder.encode(items, "mean", torch.float32)
    assert encoder.added == [448] and manager.num_graphs == len(plan.token_budgets) + 1
    assert manager.stats.padding_waste == 0 and manager.stats.hits == len(items)
    assert torch.isfinite(encoded.rows).all()
    chosen = items[:8]
    replayed = torch.cat(manager.run(chosen, 448))
    assert torch.equal(replayed, padded_eager(manager, chosen, 448)[: replayed.shape[0]])
    for other in (64, 512):  # graphs captured before the added one are intact
        first = items[:1]
        assert torch.equal(torch.cat(manager.run(first, other)), padded_eager(manager, first, other)[:56])
    manager.clear()


@pytest.mark.parametrize(
    ("family", "keep"),
    [("qwen2_5_vl", []), ("siglip", []), ("clip", []), ("qwen2_5_vl", ["attn.proj", "mlp.down_proj"]), ("siglip", ["self_attn.v_proj"])],
)
def test_fp8_compiled_graphs_replay_like_eager_and_stay_close_to_bf16(cache_dir: str, family: str, keep: list[str]) -> None:
    """model.precision fp8 on the GPU: the blocks compiled with their FP8 layers (and the
    layers model.fp8_keep names in bf16 beside them), captured into a pool first filled
    with NaN; every replay equals the padded eager run, every real row is finite and
    within FP8 rounding of the bf16 tower's."""
    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    bf16 = load_adapter(make_job(cache_dir, model=model), torch.device("cuda"))
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8", "fp8_keep": keep}), torch.device("cuda"))
    assert fp8.fp8_layers and sum(fp8.fp8_layers.values()) >= 2 * len(fp8.compile_units())
    assert not set(keep) & set(fp8.fp8_layers)
    fp8.compile(dynamic=True)
    items = [fp8.preprocessor()(m) for m in MEDIA if not hasattr(m, "frames")]
    plan = BudgetPlan(tuple(fp8.budget_unit * 2**k for k in range(6)) if fp8.budget_unit > 1 else PLAN.token_budgets,
                      max_items=8, max_frames=16)
    for replayed, full in nan_pool_replays(fp8, bf16, plan, items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), full.float(), dim=-1)
        assert cos.min() > 0.98, float(cos.min())


@pytest.mark.parametrize("job_file", ["demo.yaml", "demo-clip.yaml"])
def test_a_calibrated_fp8_job_on_cuda_is_closer_to_bf16_and_calibrates_alike_every_run(
    tmp_path: Path, cache_dir: str, job_file: str
) -> None:
    """model.fp8_calibrate on the GPU, compiled and captured: the rows are the bf16 job's,
    on the rows after the four it calibrated on the vectors are closer to bf16's than
    nearest rounding puts them, and a second run rounds the same weights (as every shard
    and rank of a job must): the same vectors, bit for bit."""
    from embedjob.config import load_job
    from embedjob.runner import run_job

    def vectors(name: str, *overrides: str) -> tuple[list, torch.Tensor]:
        common = [f"output.path={tmp_path / name}", "runtime.device=cuda", f"runtime.cache_dir={cache_dir}", "runtime.workers=0"]
        run_job(load_job(REPO / "jobs" / job_file, [*common, *overrides]))
        rows = pq.read_table(sorted((tmp_path / name).glob("part-*.parquet"))).to_pylist()
        good = [r["embedding"] for r in rows if r["error"] is None]
        return [(r["row"], r["error"]) for r in rows], torch.tensor(good)

    calibrate = ("model.precision=fp8", "model.fp8_calibrate=4")
    (rows, bf16), (_, fp8), (calibrated_rows, calibrated), (_, again) = (
        vectors("bf16"), vectors("fp8", "model.precision=fp8"), vectors("calibrated", *calibrate), vectors("again", *calibrate)
    )
    assert calibrated_rows == rows and torch.equal(calibrated, again)

    def distance(v: torch.Tensor) -> float:
        return float((1 - torch.nn.functional.cosine_similarity(v[4:], bf16[4:], dim=-1)).mean())

    assert distance(calibrated) < 0.85 * distance(fp8), (distance(calibrated), distance(fp8))


@pytest.mark.parametrize(
    ("cols", "padded", "wider", "activation", "norm"),
    [(1152, 1152, 0, None, None), (4304, 4304, 0, None, None), (72, 80, 0, None, None), (3420, 3424, 16, None, None),
     (4304, 4304, 0, "gelu_tanh", None), (4096, 4096, 0, "quick_gelu", None), (1540, 1552, 0, "gelu", None),
     (3420, 3424, 16, "gelu_tanh", None), (1152, 1152, 0, None, "layer_norm"), (72, 80, 16, None, "layer_norm"),
     (1280, 1280, 0, None, "rms_norm")],
)
@pytest.mark.parametrize(("blocks", "warps"), [(3, None), (1, None), (3, 4)])
def test_the_fp8_row_kernel_quantises_as_the_reference_does(
    cols: int, padded: int, wider: int, activation: str | None, norm: str | None, blocks: int, warps: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton quantiser that CUDA layers use gives `quantize_rows`' scales and
    values (round to nearest even, one e4m3 step at most where the two divisions round
    apart), zeros in the padded columns, also from rows of a wider tensor, after an
    MLP's activation and after a block's norm (against their float32 definitions),
    whether a program holds its row in up to three blocks or in one (`fp8.ROW_BLOCKS`), in
    a job's warps by row kind or in four for every row (`fp8.ROW_WARPS`)."""
    from embedjob.encoders import fp8

    monkeypatch.setattr(fp8, "ROW_BLOCKS", blocks)
    monkeypatch.setattr(fp8, "ROW_WARPS", warps)
    fp8._register_row_quantizer()
    generator = torch.Generator(device="cuda").manual_seed(cols)
    magnitudes = torch.logspace(-4, 4, 300, device="cuda")[:, None]
    wide = (torch.randn(300, cols + wider, device="cuda", generator=generator) * magnitudes).to(torch.bfloat16)
    x = wide[:, :cols]
    x[7] = 0
    code, function = fp8.ACTIVATIONS[activation] if activation else (0, lambda v: v)
    if norm is None:
        quantized, scale = torch.ops.embedjob.fp8_quantize_rows(x, padded, cols, 0, code, 0, None, None, 0.0)
    else:
        weight = (torch.rand(cols, device="cuda", generator=generator) + 0.5).to(torch.bfloat16)
        bias = torch.randn(cols, device="cuda", generator=generator).to(torch.bfloat16) if norm == "layer_norm" else None
        quantized, scale = torch.ops.embedjob.fp8_quantize_rows(x, padded, cols, 0, code, fp8.NORMS[norm], weight, bias, 1e-6)
        function = fp8.Norm(norm, weight, bias, 1e-6)
    want, want_scale = fp8.quantize_rows(torch.nn.functional.pad(function(x.float()), (0, padded - cols)))
    torch.testing.assert_close(scale, want_scale, rtol=1e-4 if norm else 1e-5 if activation else 1e-6, atol=0)
    got, want = quantized.float(), want.float()
    assert quantized.shape == (300, padded) and (got[:, cols:] == 0).all()
    assert norm == "layer_norm" or (got[7] == 0).all()  # a layer norm of zeros is its bias
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp(min=2**-6))) - 3)
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean() > 0.999


@pytest.mark.parametrize(("cols", "up", "wider"), [(3420, 3424, 0), (100, 112, 16), (3456, 3456, 0)])
def test_the_fp8_row_kernel_forms_a_gated_mlps_gating_as_the_reference_does(cols: int, up: int, wider: int) -> None:
    """Gated (`up` > 0), the row kernel reads a joined gate|up row, the gate in its first
    `cols` columns and the up half from column `up`, and quantises silu(gate) * up formed
    in float32: `q * scale` is the float32 reference's quantisation of it (the same
    scales, one e4m3 step at most apart), zeros in the padded columns and for a row of
    zeros, also from rows of a wider tensor."""
    from embedjob.encoders import fp8

    fp8._register_row_quantizer()
    generator = torch.Generator(device="cuda").manual_seed(cols + wider)
    magnitudes = torch.logspace(-2, 2, 300, device="cuda")[:, None]
    wide = (torch.randn(300, up + cols + wider, device="cuda", generator=generator) * magnitudes).to(torch.bfloat16)
    joined = wide[:, : up + cols]
    joined[7] = 0
    padded = -(-cols // 16) * 16
    code, silu = fp8.GATES["silu"]
    quantized, scale = torch.ops.embedjob.fp8_quantize_rows(joined, padded, cols, up, code, 0, None, None, 0.0)
    hidden = silu(joined[:, :cols].float()) * joined[:, up : up + cols].float()
    want, want_scale = fp8.quantize_rows(torch.nn.functional.pad(hidden, (0, padded - cols)))
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0)
    assert quantized.shape == (300, padded) and (quantized[:, cols:].float() == 0).all() and (quantized[7].float() == 0).all()
    got, want = quantized.float(), want.float()
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp(min=2**-6))) - 3)
    # one e4m3 step of the row's scale at most, the scales' own difference aside
    assert ((got * scale - want * want_scale).abs() <= step * want_scale * 1.001).all()
    assert (got == want).float().mean() > 0.999


# JPEG decode on the GPU (`preprocess.decoder: gpu`).

GPU_JPEGS = sorted((REPO.parent / "shared" / "data" / "images").glob("*.jpg")) + sorted((REPO / "tests" / "data").glob("*.jpg"))
"""Good JPEGs only: ../shared/data/bad holds files that must fail (`bad_media` makes the
same kinds here), so its folder is never globbed as a source of pictures."""
MADE_JPEGS = ("progressive", "gray", "orientation_1", "orientation_6", "cmyk", "half_jpeg", "bytes_after_the_end")


def bad_media() -> list[bytes]:
    """What ../shared/data/bad holds, made from this repository's files (that folder does
    not reach the GPU machine): real photos cut in half, a video where an image is
    expected, text, and nothing."""
    photos = [p.read_bytes() for p in sorted((REPO / "tests" / "data").glob("*.jpg"))]
    video = (REPO / "tests" / "data" / "decord_video_0.mov").read_bytes()
    return [photo[: len(photo) // 2] for photo in photos] + [video, b"this is not a video\n", b""]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "siglip", "clip"])
def test_a_window_decoded_by_nvjpeg_is_the_cpu_window_up_to_the_decoders_rounding(cache_dir: str, family: str) -> None:
    """Every deferred JPEG (baseline, progressive, gray) decodes on the GPU; the items
    keep the CPU path's tokens and grids, their pixels stay on the device and differ from
    libjpeg-turbo's by rounding only (nvjpeg upsamples chroma without libjpeg's smoothing:
    a synthetic pure red/blue edge averages 2 levels after CLIP's resize to 64 px); every
    file that is an error row on the CPU (truncated JPEGs, a video, text, an empty file)
    is the same error row."""
    from test_device_decode import ALL_JPEGS

    from embedjob import rows as worker
    from embedjob.decode import DecodeOptions
    from embedjob.encoders.base import JPEG_KEY
    from embedjob.io.reader import InputRow

    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    preprocess = load_adapter(make_job(cache_dir, model=model), torch.device("cuda")).preprocessor()
    options = DecodeOptions(modality="image", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)
    media = [p.read_bytes() for p in GPU_JPEGS] + [ALL_JPEGS[name]() for name in MADE_JPEGS] + bad_media()
    rows = [InputRow(k, k, data, None, None) for k, data in enumerate(media)]
    cpu = [worker.decode_row(row, options, preprocess) for row in rows]
    window = [worker.decode_row(row, dataclasses.replace(options, defer_jpeg=True), preprocess) for row in rows]
    waiting = sum(d.item is not None and JPEG_KEY in d.item.tensors for d in window)
    assert waiting >= 5
    assert worker.decode_on_device(window, options, preprocess, torch.device("cuda")) == waiting
    key = "pixel_values"
    for got, want in zip(window, cpu, strict=True):
        assert (got.error, got.modality) == (want.error, want.modality)
        if want.item is None:
            continue
        assert (got.item.tokens, got.item.grid, got.item.token_grid) == (want.item.tokens, want.item.grid, want.item.token_grid)
        a, b = got.item.tensors[key], want.item.tensors[key]
        assert a.shape == b.shape
        diff = (a.to("cpu", torch.int16) - b.to(torch.int16)).abs().float()
        assert float(diff.mean()) < 3.0, got.id


def same_size_jpegs(width: int, height: int) -> list[bytes]:
    """The quarters of every real photo here, each re-encoded at one size: distinct
    pictures whose decoded memory the caching allocator can hand from one to the next."""
    import io

    from PIL import Image

    out = []
    for path in GPU_JPEGS:
        photo = Image.open(path).convert("RGB")
        w, h = photo.size
        for left, top in ((0, 0), (w // 2, 0), (0, h // 2), (w // 2, h // 2)):
            buffer = io.BytesIO()
            photo.crop((left, top, left + w // 2, top + h // 2)).resize((width, height)).save(buffer, "JPEG", quality=90)
            out.append(buffer.getvalue())
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "siglip"])
def test_nvjpeg_never_writes_over_pictures_the_decode_stream_has_still_to_read(
    cache_dir: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvjpeg writes on a stream of torchvision's that waits for nothing of the caller's.
    With the caller's stream held back (a sleep queued first) and one picture per nvjpeg
    call, each picture is freed before the kernels that read it have run; the next
    call's picture must not get its memory. The items are those of the same window
    decoded with nothing held back, bit for bit."""
    from embedjob import rows as worker
    from embedjob.decode import DecodeOptions
    from embedjob.io.reader import InputRow

    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    preprocess = load_adapter(make_job(cache_dir, model=model), torch.device("cuda")).preprocessor()
    options = DecodeOptions(modality="image", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)
    deferred = dataclasses.replace(options, defer_jpeg=True)
    rows = [InputRow(k, k, data, None, None) for k, data in enumerate(same_size_jpegs(320, 240))]
    assert len(rows) >= 8

    def window_decoded(lag: bool) -> list:
        window = [worker.decode_row(row, deferred, preprocess) for row in rows]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            if lag:
                torch.cuda._sleep(1_000_000_000)
            assert worker.decode_on_device(window, options, preprocess, torch.device("cuda")) == len(rows)
        stream.synchronize()
        return window

    want = window_decoded(lag=False)
    monkeypatch.setattr(worker, "pixel_groups", lambda sizes: [range(k, k + 1) for k in range(len(sizes))])
    got = window_decoded(lag=True)
    for a, b in zip(got, want, strict=True):
        assert sorted(a.item.tensors) == sorted(b.item.tensors)
        for key, value in b.item.tensors.items():
            assert torch.equal(a.item.tensors[key], value), (a.id, key)


@pytest.mark.parametrize("job_file", ["demo.yaml", "demo-clip.yaml"])
def test_a_gpu_decoder_job_gives_the_cpu_decoder_jobs_rows(tmp_path: Path, cache_dir: str, job_file: str) -> None:
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs, stats = {}, {}
    for decoder in ("cpu", "gpu"):
        overrides = [f"output.path={tmp_path / decoder}", "runtime.device=cuda", f"runtime.cache_dir={cache_dir}",
                     "runtime.workers=2", "runtime.gpus=1", f"preprocess.decoder={decoder}"]
        stats[decoder] = run_job(load_job(REPO / "jobs" / job_file, overrides))
        outputs[decoder] = pq.read_table(sorted((tmp_path / decoder).glob("part-*.parquet"))).to_pylist()
    assert stats["cpu"]["device_decoded"] == 0 and stats["gpu"]["device_decoded"] == 9
    assert stats["gpu"]["ranks"][0]["decoder"] == "gpu" and stats["gpu"]["hit_rate"] == 1.0
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["gpu"], strict=True):
        assert (cpu_row["id"], cpu_row["error"], cpu_row["tokens"]) == (gpu_row["id"], gpu_row["error"], gpu_row["tokens"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99


def test_an_auto_decoder_job_splits_its_jpegs_and_gives_the_cpu_decoder_jobs_rows(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`preprocess.decoder: auto` with the GPU's share held at a half from the first
    window on: windows then mix rows the workers decoded with rows the GPU decoded, and
    each row is still the CPU path's, in order, up to the decoders' rounding."""
    import pyarrow as pa

    from embedjob import pipeline, runner
    from embedjob.config import load_job

    monkeypatch.setattr(pipeline, "AUTO_ROWS", 1)
    monkeypatch.setattr(pipeline, "gpu_share", lambda *rates: 0.5)
    sizes = [(w, h) for w in (200, 240, 320) for h in (180, 240, 300, 360)]
    jpegs = [jpeg for width, height in sizes for jpeg in same_size_jpegs(width, height)]
    table = tmp_path / "jpegs.parquet"
    pq.write_table(pa.table({"id": [f"p{k}" for k in range(len(jpegs))], "image": jpegs}), table)
    outputs, stats = {}, {}
    for decoder in ("cpu", "auto"):
        overrides = [f"input.path={table}", f"output.path={tmp_path / decoder}", "runtime.device=cuda",
                     f"runtime.cache_dir={cache_dir}", "runtime.workers=2", "runtime.gpus=1", "batching.window=4",
                     f"preprocess.decoder={decoder}"]
        stats[decoder] = runner.run_job(load_job(REPO / "jobs" / "demo.yaml", overrides))
        outputs[decoder] = pq.read_table(sorted((tmp_path / decoder).glob("part-*.parquet"))).to_pylist()
    rank = stats["auto"]["ranks"][0]
    assert rank["decoder"] == "auto" and rank["gpu_share"] == 0.5
    assert len(jpegs) // 4 <= stats["auto"]["device_decoded"] <= len(jpegs) // 2 + 1
    assert [r["id"] for r in outputs["auto"]] == [r["id"] for r in outputs["cpu"]] == [f"p{k}" for k in range(len(jpegs))]
    for cpu_row, auto_row in zip(outputs["cpu"], outputs["auto"], strict=True):
        assert cpu_row["error"] is None and auto_row["error"] is None and cpu_row["tokens"] == auto_row["tokens"]
        a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(auto_row["embedding"])
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99


# Video frames decoded by the GPU's video decoder (`video.decoder: nvdec`; needs PyNvVideoCodec).


AV1 = "torchcodec_av1_video.mkv"


def _has_nvdec() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError:
        return False
    return True


def _nvdec_reads(name: str) -> bool:
    """Whether this GPU's video decoder reads the first frame of tests/data/`name` (an
    H200's NVDEC has no AV1: error 801, "Codec not supported on this GPU")."""
    import PyNvVideoCodec as nvc

    try:
        decoder = nvc.SimpleDecoder(str(REPO / "tests" / "data" / name), gpu_id=0, output_color_type=nvc.OutputColorType.RGB)
        return len(decoder.get_batch_frames_by_index([0])) == 1
    except Exception:
        return False


def _assert_av1_row(error: str | None, frames: int | None, cpu_error: str) -> None:
    """AV1 (which decord lacks: an error row on the CPU) is embedded where the GPU reads
    it, and otherwise is the CPU path's error row saying the GPU refused it too."""
    assert cpu_error.startswith("unsupported_codec: ")
    if _nvdec_reads(AV1):
        assert error is None and frames >= 2
    else:
        assert error.startswith(cpu_error + "; the GPU's video decoder refused it too: ")


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
@pytest.mark.parametrize("family", ["qwen2_5_vl", "siglip"])
def test_videos_decoded_by_nvdec_are_the_cpu_rows_up_to_the_decoders_rounding(cache_dir: str, family: str) -> None:
    """The frames the CPU path samples (same indices, rotations applied), read by NVDEC:
    the same tokens, grids and error rows, pixels within a few levels (the two convert
    YUV to RGB with their own rounding). The 8-bit H.264 clips are decoded on the GPU;
    clips below nvdec.MIN_SIDE (50 x 50, 66 x 50, 128 x 128), what the hardware refuses
    (10-bit H.264, corrupt frames) or returns at another size than the stream's are the
    CPU path's rows, bit for bit.
    AV1, which decord cannot read (an error row on the CPU), is planned on the rank and
    decoded where the hardware has AV1 (`_assert_av1_row`)."""
    from embedjob import rows as worker
    from embedjob.decode import DecodeOptions
    from embedjob.io.reader import InputRow

    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    preprocess = load_adapter(make_job(cache_dir, model=model), torch.device("cuda")).preprocessor()
    options = DecodeOptions(modality="auto", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=preprocess.frame_multiple)
    paths = sorted(p for p in (REPO / "tests" / "data").iterdir() if p.suffix in (".mov", ".mp4", ".mkv"))
    media = [(p.name, p.read_bytes()) for p in paths] + [("text", b"this is not a video\n"), ("empty", b"")]
    rows = [InputRow(k, name, data, None, None) for k, (name, data) in enumerate(media)]
    cpu = [worker.decode_row(row, options, preprocess) for row in rows]
    window = [worker.decode_row(row, dataclasses.replace(options, defer_video=True), preprocess) for row in rows]
    done = worker.decode_on_device(window, options, preprocess, torch.device("cuda"))
    on_gpu = {d.id for d in window if d.item is not None and d.item.tensors["pixel_values"].is_cuda}
    h264 = {"decord_video_0.mov", "decord_video_90.mov", "decord_video_180.mov", "decord_video_270.mov", "torchcodec_nasa_13013.mp4"}
    small = {"decord_unordered.mov", "hfdatasets_test_video_66x50.mov", "torchcodec_h265_video.mp4"}
    assert done == len(on_gpu) and h264 | ({AV1} if _nvdec_reads(AV1) else set()) <= on_gpu
    assert not on_gpu & {"decord_corrupted.mp4", "torchcodec_h264_10bits.mp4", *small}
    for got, want in zip(window, cpu, strict=True):
        if got.id == AV1:
            _assert_av1_row(got.error, got.item.frames if got.item else None, want.error)
            continue
        assert (got.id, got.error, got.modality) == (want.id, want.error, want.modality)
        if want.item is None:
            continue
        assert (got.item.tokens, got.item.frames, got.item.grid, got.item.token_grid) == (
            want.item.tokens, want.item.frames, want.item.grid, want.item.token_grid
        ), got.id
        a, b = got.item.tensors["pixel_values"], want.item.tensors["pixel_values"]
        diff = (a.to("cpu", torch.int16) - b.to(torch.int16)).abs().float()
        assert float(diff.mean()) < (6.0 if got.id in on_gpu else 1e-9), (got.id, float(diff.mean()))


NVDEC_OPTIONS = DecodeOptions(modality="video", max_image_pixels=1 << 24, fps=2.0, max_frames=32, frame_multiple=1, defer_video=True)
"""A video job's sampling (2 frames a second, at most 32) for the NVDEC tests that decode clips directly."""


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
@pytest.mark.parametrize("name", ["derived_testsrc2_untagged_256x144.mp4", "torchcodec_nasa_13013.mp4", "decord_video_0.mov"])
def test_nvdec_frames_turned_to_rgb_on_the_rank_are_decords_within_a_level_or_two(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvdec.YUV_HERE`: NVDEC hands NV12 and the rank turns it to RGB with the conversion
    `nvdec.media_colour` reads from the clip (BT.601 for the untagged colour bars, BT.709
    for nasa, tagged in its container and stream, and for decord_video_0.mov, tagged in its
    stream only, which PyNvVideoCodec's demuxer does not report): frame 0 within 2 levels
    of decord's everywhere, under a level on average."""
    import decord

    from embedjob.decode import nvdec
    from embedjob.decode.types import DeferredVideo
    from embedjob.decode.video import decoder_bytes

    monkeypatch.setattr(nvdec, "YUV_HERE", True)  # its sessions hand NV12: a kind of their own
    data = (REPO / "tests" / "data" / name).read_bytes()
    want = torch.from_numpy(decord.VideoReader(io.BytesIO(decoder_bytes(data)))[0].asnumpy()).permute(2, 0, 1)
    height, width = want.shape[1:]
    video = DeferredVideo(data, [0], (width, height), ((1, 0), (0, 1)), (height, width), [0.0], 30.0, 1)
    frames, _ = nvdec.decode_frames(video, torch.device("cuda"), NVDEC_OPTIONS)
    diff = (frames[0].cpu().to(torch.int16) - want.to(torch.int16)).abs().float()
    assert float(diff.mean()) < 1.0 and float(diff.max()) <= 2, (float(diff.mean()), float(diff.max()))


FED_CLIPS = ["torchcodec_nasa_13013.mp4", "gop/derived_testsrc2_hevc_open_gop_256x144.mp4", "gop/derived_testsrc2_h264_open_gop_256x144.mp4"]
"""H.264 with B-pyramids; HEVC and H.264 with open GOPs (leading pictures that refer to the GOP before)."""


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
def test_frames_read_by_the_packet_feed_are_decords_from_fewer_pictures(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvdec.FEED_SAMPLED`: the frames a plan samples, fed only the pictures they need
    (every 15th frame: 2 of 30 fps; the frames shown just before each keyframe, leading
    pictures in an open GOP; all of the first 60), on one decode thread that keeps its
    decoders: decord's frames of a decode from the first frame to the last (its seeks, like
    PyNvVideoCodec's SimpleDecoder's, misread leading pictures of these open GOPs), within
    a level on average, from fewer pictures than the stream has where frames are skipped."""
    import decord

    from embedjob.decode import nvdec
    from embedjob.decode.types import DeferredVideo
    from embedjob.decode.video import decoder_bytes

    fed: list[int] = []
    real = nvdec.gop.needed_pictures

    def counted(stream: Any, wanted: Any) -> list[int]:
        needed = real(stream, wanted)
        fed.append(len(needed))
        return needed

    monkeypatch.setattr(nvdec.gop, "needed_pictures", counted)
    monkeypatch.setattr(nvdec, "_pool", None)
    thread = nvdec._threads(1)
    cuda = torch.device("cuda")
    for name in FED_CLIPS:
        data = (REPO / "tests" / "data" / name).read_bytes()
        reader = decord.VideoReader(io.BytesIO(decoder_bytes(data)))
        count, (height, width) = len(reader), reader[0].shape[:2]
        every = torch.from_numpy(reader.get_batch(list(range(count))).asnumpy()).permute(0, 3, 1, 2).to(torch.int16)
        plans = (list(range(0, count, 15)), [i for i in range(count) if i % 20 in (17, 18, 19)], list(range(min(count, 60))))
        for indices in plans:
            video = DeferredVideo(data, indices, (width, height), ((1, 0), (0, 1)), (height, width), [i / 30 for i in indices], 30.0, count)
            fed.clear()
            frames, _ = thread.submit(nvdec.decode_frames, video, cuda, NVDEC_OPTIONS).result()
            assert len(fed) == 1 and (fed[0] < count or len(indices) == count), (name, fed)
            diff = (frames.cpu().to(torch.int16) - every[indices]).abs().float().mean(dim=(1, 2, 3))
            assert float(diff.max()) < 1.0, (name, [(i, round(float(d), 2)) for i, d in zip(indices, diff) if d >= 1.0])
    thread.shutdown(wait=True)


@pytest.mark.parametrize("matrix, full", [("bt601", False), ("bt709", False), ("bt601", True)])
def test_the_fused_nv12_kernel_gives_the_torch_paths_rgb_on_the_gpu(monkeypatch: pytest.MonkeyPatch, matrix: str, full: bool) -> None:
    """`nvdec.FUSED_RGB`: 1080p NV12 surfaces padded to 1,088 rows, as the decoder hands
    them, turned to RGB by the one Triton kernel and by the torch path: the same pixels
    but where the GPU's fused multiply-add rounds a value at a whole level the other way
    (one level, a rare pixel), for one frame and a batch."""
    from embedjob.decode import nvdec

    generator = torch.Generator(device="cuda").manual_seed(5)
    surfaces = torch.randint(0, 256, (5, 1088 * 3 // 2, 1920), dtype=torch.uint8, device="cuda", generator=generator)
    colour = nvdec.Colour(matrix, full)
    made = {}
    for fused in (False, True):
        monkeypatch.setattr(nvdec, "FUSED_RGB", fused)
        made[fused] = (nvdec.nv12_to_rgb(surfaces, (1080, 1920), colour), nvdec.nv12_to_rgb(surfaces[2], (1080, 1920), colour))
    for torch_path, fused in zip(made[False], made[True], strict=True):
        assert fused.shape == torch_path.shape and fused.dtype == torch.uint8
        diff = (fused.to(torch.int16) - torch_path.to(torch.int16)).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3, (int(diff.max()), float((diff > 0).float().mean()))
    assert torch.equal(made[True][1], made[True][0][2])


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
@pytest.mark.parametrize("on_feed_stream, fused, engine", [(True, False, False), (False, False, False), (False, True, False), (False, False, True)],
                         ids=["on_feed_stream", "caller", "fused_rgb", "copy_engine"])
def test_frames_fed_from_the_pictures_a_worker_cut_out_are_decords(
    monkeypatch: pytest.MonkeyPatch, on_feed_stream: bool, fused: bool, engine: bool
) -> None:
    """`video.PACKETS_IN_WORKERS`: the pictures a worker cuts out of a clip's samples
    (`gop.packet_feed`), handed to the decoder as packets made here with no demuxer on the
    rank, give decord's frames of a decode from the first frame to the last, within a level
    on average, for the plans of the test above and the worker's own (2 frames a second),
    whichever stream copies the surfaces out (`nvdec.COPIES_ON_FEED_STREAM`) and whatever
    copies them (`nvdec.COPY_ENGINE`: the driver's 2D copy), and with the NV12 turned to
    RGB by the fused kernel (`nvdec.FUSED_RGB`)."""
    import decord

    from embedjob.decode import nvdec, video
    from embedjob.decode.sniff import sniff_format
    from embedjob.decode.types import DeferredVideo

    monkeypatch.setattr(video, "PACKETS_IN_WORKERS", True)
    monkeypatch.setattr(nvdec, "COPIES_ON_FEED_STREAM", on_feed_stream)
    monkeypatch.setattr(nvdec, "COPY_ENGINE", engine)
    monkeypatch.setattr(nvdec, "FUSED_RGB", fused)
    monkeypatch.setattr(nvdec, "FEED_SAMPLED", False)  # what the feed cannot take fails here, not on the rank's demuxer
    monkeypatch.setattr(nvdec, "_pool", None)
    thread = nvdec._threads(1)
    cuda = torch.device("cuda")
    for name in FED_CLIPS:
        data = (REPO / "tests" / "data" / name).read_bytes()
        reader = decord.VideoReader(io.BytesIO(video.decoder_bytes(data)))
        count = len(reader)
        every = torch.from_numpy(reader.get_batch(list(range(count))).asnumpy()).permute(0, 3, 1, 2).to(torch.int16)
        planned = video.decode_video(data, NVDEC_OPTIONS, sniff_format(data)[1])
        assert isinstance(planned, DeferredVideo) and planned.feed is not None, name
        plans = [planned] + [
            dataclasses.replace(planned, indices=indices, timestamps=[i / 30 for i in indices],
                                feed=video.cut_packets(data, indices, count, video.mp4_facts(data).stream_size))
            for indices in ([i for i in range(count) if i % 20 in (17, 18, 19)], list(range(min(count, 60))))
        ]
        for plan in plans:
            frames, _ = thread.submit(nvdec.decode_frames, plan, cuda, NVDEC_OPTIONS).result()
            diff = (frames.cpu().to(torch.int16) - every[plan.indices]).abs().float().mean(dim=(1, 2, 3))
            assert float(diff.max()) < 1.0, (name, [(i, round(float(d), 2)) for i, d in zip(plan.indices, diff) if d >= 1.0])
            assert len(plan.feed.bounds) < count or len(plan.indices) == count, name
    thread.shutdown(wait=True)


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
def test_nvdec_sessions_kept_by_kind_read_clips_of_alternating_kinds_as_fresh_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode thread, clips of two kinds in turn (568 x 320 and 320 x 180 H.264): each
    clip is read from the session kept for its kind (`nvdec.SESSIONS_PER_THREAD`), two made
    in all, and its frames are those a session made for it alone gives."""
    from embedjob.decode import nvdec
    from embedjob.decode.types import DeferredVideo

    names = ["decord_video_0.mov", "torchcodec_nasa_13013.mp4", "decord_video_180.mov", "torchcodec_nasa_13013.mp4", "decord_video_0.mov"]
    videos = [DeferredVideo.unplanned((REPO / "tests" / "data" / name).read_bytes()) for name in names]
    cuda = torch.device("cuda")
    made = []
    real = nvdec._new_session

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1])
        return real(*args, **kwargs)

    def alone(video: DeferredVideo) -> tuple[torch.Tensor, DeferredVideo]:
        nvdec._sessions.__dict__.clear()  # this thread forgets its kept sessions
        return nvdec.decode_frames(video, cuda, NVDEC_OPTIONS)

    monkeypatch.setattr(nvdec, "_new_session", counted)
    monkeypatch.setattr(nvdec, "_pool", None)
    thread = nvdec._threads(1)
    in_turn = thread.submit(lambda: [nvdec.decode_frames(video, cuda, NVDEC_OPTIONS) for video in videos]).result()
    assert len(made) == 2, made
    for name, video, (frames, plan) in zip(names, videos, in_turn, strict=True):
        fresh_frames, fresh_plan = thread.submit(alone, video).result()
        assert plan == fresh_plan, name
        assert torch.equal(frames, fresh_frames), name
    thread.shutdown(wait=True)


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
def test_nvdec_sessions_on_streams_of_their_own_read_the_frames_of_the_shared_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvdec.OWN_STREAMS` (each session's decoder on a CUDA stream of its own, measured by
    benchmarks/nvdec_scaling.py) changes where the frames are made, not what they are: the
    H.264 test clips read by 3 sessions give the same frames and plans either way."""
    from embedjob.decode import nvdec
    from embedjob.decode.types import DeferredVideo

    names = ["decord_video_0.mov", "decord_video_90.mov", "decord_video_180.mov", "torchcodec_nasa_13013.mp4"]
    videos = [DeferredVideo.unplanned((REPO / "tests" / "data" / name).read_bytes()) for name in names]
    read = {}
    for own in (False, True):
        monkeypatch.setattr(nvdec, "OWN_STREAMS", own)
        monkeypatch.setattr(nvdec, "_pool", None)  # new threads: new sessions, made under this setting
        read[own] = list(nvdec.decode_videos(videos, torch.device("cuda"), dataclasses.replace(NVDEC_OPTIONS, nvdec_sessions=3)))
        torch.cuda.synchronize()
        nvdec._pool[1].shutdown(wait=True)
    for name, shared, own in zip(names, read[False], read[True], strict=True):
        assert not isinstance(shared, Exception) and not isinstance(own, Exception), (name, shared, own)
        assert own[1] == shared[1], name
        assert torch.equal(own[0], shared[0]), name


@pytest.mark.skipif(not _has_nvdec(), reason="needs PyNvVideoCodec (pip install 'embedjob[nvdec]')")
@pytest.mark.parametrize("setting", ["nvdec", "auto"])
@pytest.mark.parametrize("thread_streams, fused, carveout, free_sms",
                         [(False, False, None, None), (True, False, None, None), (True, True, None, None), (False, False, 8, None),
                          (False, False, None, 16)],
                         ids=["caller_stream", "thread_streams", "fused_rgb", "sm_carveout", "green_context"])
def test_an_nvdec_job_gives_the_decord_jobs_rows(
    tmp_path: Path, cache_dir: str, setting: str, thread_streams: bool, fused: bool, carveout: int | None, free_sms: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`video.decoder` nvdec, or auto, here made to leave every other clip to the GPU from
    the first row on, through setup too (`decode_split.SETUP_SHARE`, none in a job: the
    two workers would decode the 9 clips before the tiny tower's graphs are captured; the
    first, a 568 x 320 H.264 clip, is one the GPU reads), and to hold that share (windows
    then mix clips the workers decoded with clips the GPU decoded):
    each row is the decord job's, in order, up to the decoders' rounding. The 8-bit H.264
    and HEVC clips the GPU reads go through the packet feed (`nvdec._feed`), not a decoder
    session: the plan a worker sends carries what the feed needs. The decode threads queue
    their work on the caller's stream or on their own (`nvdec.THREAD_STREAMS`), and so
    with the NV12 turned to RGB by the fused kernel (`nvdec.FUSED_RGB`), or the encoder
    leaves SMs to the decoder (`pipeline.GPU_DECODE_SM_CARVEOUT`, the decord job none; or
    `GPU_DECODE_FREE_SMS`: its graphs captured and replayed in a green context). The
    rank reports the decoder threads' seconds by part (`device_decode_parts`) and the caching
    allocator's calls while they ran (`device_allocations`), a decord job neither."""
    from embedjob import decode_split, pipeline
    from embedjob.config import load_job
    from embedjob.decode import nvdec
    from embedjob.runner import run_job

    fed: list[int] = []
    feed = nvdec._feed

    def counted(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        frames = feed(*args, **kwargs)
        fed.append(len(frames))
        return frames

    monkeypatch.setattr(nvdec, "_feed", counted)
    monkeypatch.setattr(nvdec, "THREAD_STREAMS", thread_streams)
    monkeypatch.setattr(nvdec, "FUSED_RGB", fused)
    monkeypatch.setattr(pipeline, "AUTO_ROWS", 1)
    monkeypatch.setattr(pipeline, "gpu_share", lambda *rates: 0.5)
    monkeypatch.setattr(decode_split, "SETUP_SHARE", 0.5)
    monkeypatch.setattr(pipeline, "GPU_DECODE_SM_CARVEOUT", carveout)
    carveouts: list[int | None] = []
    carved = pipeline.sm_carveout
    monkeypatch.setattr(pipeline, "sm_carveout", lambda sms: carveouts.append(sms) or carved(sms))
    monkeypatch.setattr(pipeline, "GPU_DECODE_FREE_SMS", free_sms)
    greens: list[Any] = []
    made = pipeline.green_stream
    monkeypatch.setattr(pipeline, "green_stream", lambda device, free: greens.append(made(device, free)) or greens[-1])
    outputs, stats = {}, {}
    for decoder in ("decord", setting):
        overrides = [f"output.path={tmp_path / decoder}", "runtime.device=cuda", f"runtime.cache_dir={cache_dir}",
                     "runtime.workers=2", "runtime.gpus=1", f"video.decoder={decoder}", "input.modality=video", "batching.window=4"]
        stats[decoder] = run_job(load_job(REPO / "jobs" / "demo-video.yaml", overrides))
        outputs[decoder] = pq.read_table(sorted((tmp_path / decoder).glob("part-*.parquet"))).to_pylist()
    assert stats["decord"]["device_decoded"] == 0 and stats[setting]["device_decoded"] > 0
    assert [(g.total - g.sms >= free_sms) for g in greens] == ([True] if free_sms else [])
    assert carveouts == [None, greens[0].total - greens[0].sms if greens else carveout]
    assert torch._C._get_sm_carveout_experimental() is None
    assert 0 < len(fed) <= stats[setting]["device_decoded"]
    parts = stats[setting]["ranks"][0]["device_decode_parts"]
    assert parts["clip"] >= parts["Decode"] > 0 and parts["RGB"] > 0
    assert stats["decord"]["ranks"][0]["device_decode_parts"] == {}
    allocations = stats[setting]["ranks"][0]["device_allocations"]
    assert set(allocations) == set(pipeline.ALLOCATOR_COUNTS.values()) and min(allocations.values()) >= 0
    assert stats["decord"]["ranks"][0]["device_allocations"] == {}
    if setting == "auto":
        assert stats["auto"]["ranks"][0]["gpu_share"] == 0.5
    for cpu_row, gpu_row in zip(outputs["decord"], outputs[setting], strict=True):
        if cpu_row["id"] == AV1.removesuffix(".mkv"):
            # auto may have left it to the workers: then it is their error row as it is.
            if not (setting == "auto" and gpu_row["error"] == cpu_row["error"]):
                _assert_av1_row(gpu_row["error"], gpu_row["frames"], cpu_row["error"])
            continue
        assert (cpu_row["id"], cpu_row["error"], cpu_row["tokens"], cpu_row["frames"]) == (
            gpu_row["id"], gpu_row["error"], gpu_row["tokens"], gpu_row["frames"]
        )
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99


@pytest.mark.parametrize("width, kind", [(1152, "layer"), (1280, "rms")])
def test_compiled_norms_of_the_towers_widths_read_each_row_in_one_pass(width: int, kind: str) -> None:
    """SigLIP-so400m's 1,152-wide and Qwen2.5-VL's 1,280-wide norms: torch's heuristic
    loops over rows wider than 1,024 (each row read twice); after
    `reduce_rows_in_one_pass` the compiled norm is one persistent reduction, and equal."""
    from torch._inductor.utils import run_and_get_code

    from embedjob.encoders.base import WIDE_ROWS, reduce_rows_in_one_pass

    torch.manual_seed(0)
    norm = (torch.nn.LayerNorm(width) if kind == "layer" else torch.nn.RMSNorm(width, eps=1e-6)).cuda().bfloat16()
    norm.requires_grad_(False)  # as the towers run: no backward graph, whose weight-gradient sums loop over rows
    x = torch.randn(4096, width, device="cuda", dtype=torch.bfloat16)
    try:
        reduce_rows_in_one_pass(WIDE_ROWS)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            out, codes = run_and_get_code(torch.compile(norm, dynamic=True), x)
    finally:
        reduce_rows_in_one_pass(0)
        torch._dynamo.reset()
    code = "\n".join(codes)
    assert "triton_per_" in code and "triton_red_" not in code
    torch.testing.assert_close(out, norm(x), rtol=2e-2, atol=2e-2)


def test_siglips_gelu_in_the_products_epilogue_is_the_tanh_gelu_of_the_product(cache_dir: str, monkeypatch) -> None:
    """On CUDA in bf16 SigLIP's fc1 applies its GELU in cuBLASLt's epilogue: each layer
    equals the product then `gelu(approximate="tanh")` up to bf16 rounding, and the tower's
    embeddings equal those of the tower without the fusion closely."""
    from embedjob.encoders import epilogues
    from embedjob.encoders.epilogues import GeluLinear

    job = make_job(cache_dir, model={"family": "siglip", "path": "builtin:tiny-siglip"})
    fused = load_adapter(job, torch.device("cuda"))
    layers = [block.mlp.fc1 for block in fused.compile_units()]
    assert layers and all(isinstance(layer, GeluLinear) for layer in layers)
    x = torch.randn(300, layers[0].in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.nn.functional.gelu(torch.nn.functional.linear(x.float(), layers[0].weight.float(), layers[0].bias.float()), approximate="tanh")
        torch.testing.assert_close(layers[0](x).float(), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(epilogues, "EPILOGUES", False)
    plain = load_adapter(job, torch.device("cuda"))
    assert not any(isinstance(m, GeluLinear) for m in plain.tower.modules())
    items = [fused.preprocessor()(random_image(90 + 7 * k, 60, k)) for k in range(4)]
    with torch.no_grad():
        a = fused.forward(fused.eager_inputs(items)).float()
        b = plain.forward(plain.eager_inputs(items)).float()
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.999


def test_clips_quick_gelu_in_the_triton_gemms_epilogue_keeps_the_towers_vectors(cache_dir: str, monkeypatch) -> None:
    """With `epilogues.TRITON_EPILOGUES` (on), CLIP's fc1 on a Hopper or Blackwell GPU in
    bf16 applies its quick GELU in our Triton GEMM's epilogue: each layer equals the product
    then the quick GELU in float32 up to bf16 rounding, and the tower, eager and then compiled
    (batching.compile) and replayed from graphs in a NaN-filled pool, gives every item the
    vector of the tower without it (cosine over 0.9999)."""
    from embedjob.encoders import epilogues
    from embedjob.encoders.epilogues import ActivationLinear

    if not epilogues.triton_gemm_pays(torch.device("cuda")):
        pytest.skip("the Triton GEMM runs on Hopper and datacenter Blackwell GPUs")
    job = make_job(cache_dir, model={"family": "clip", "path": "builtin:tiny-clip", "dtype": "bfloat16"})
    monkeypatch.setattr(epilogues, "TRITON_EPILOGUES", False)
    plain = load_adapter(job, torch.device("cuda"))
    assert not any(isinstance(m, ActivationLinear) for m in plain.tower.modules())
    monkeypatch.setattr(epilogues, "TRITON_EPILOGUES", True)
    fused = load_adapter(job, torch.device("cuda"))
    layers = [block.mlp.fc1 for block in fused.compile_units()]
    assert layers and all(isinstance(layer, ActivationLinear) and layer.activation == "quick_gelu" for layer in layers)
    x = torch.randn(300, layers[0].in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        product = torch.nn.functional.linear(x.float(), layers[0].weight.float(), layers[0].bias.float())
        torch.testing.assert_close(layers[0](x).float(), product * torch.sigmoid(1.702 * product), rtol=2e-2, atol=2e-2)
    items = [fused.preprocessor()(m) for m in MEDIA if not hasattr(m, "frames")]
    with torch.no_grad():
        a = fused.forward(fused.eager_inputs(items)).float()
        b = plain.forward(plain.eager_inputs(items)).float()
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9999
    fused.compile(dynamic=True)
    plan = BudgetPlan(tuple(fused.budget_unit * 2**k for k in range(4)), max_items=8, max_frames=16)
    for replayed, full in nan_pool_replays(fused, plain, plan, items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), full.float(), dim=-1)
        assert cos.min() > 0.9999, float(cos.min())


# SigLIP 2 NaFlex (`model.family: siglip2`, encoders/siglip2.py): packed views, graphs per budget.

SIGLIP2_MEDIA = [random_image(300, 500, 21), random_image(40, 60, 22), random_image(640, 480, 23), random_image(20, 900, 24),
                 random_video(3, 120, 200, 25)]


@pytest.fixture(scope="module")
def siglip2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full Siglip2Model at so400m's head dim (72) and its 16 x 16 table for up to 256
    patches (FlashAttention-4 takes the segments over 128 tokens where it is installed),
    random weights (seed 5), saved with its image processor as a user's checkpoint is."""
    from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model

    from embedjob.encoders.siglip2 import BUILTIN_TEXT

    directory = tmp_path_factory.mktemp("siglip2-gpu")
    vision = dict(hidden_size=288, intermediate_size=576, num_hidden_layers=2, num_attention_heads=4, patch_size=16, num_patches=256)
    torch.manual_seed(5)
    Siglip2Model(Siglip2Config(text_config=BUILTIN_TEXT, vision_config=vision)).save_pretrained(directory)
    Siglip2ImageProcessor(patch_size=16, max_num_patches=256).save_pretrained(directory)
    return directory


def _siglip2(cache_dir: str, checkpoint: Path, pooling: str = "mean", **model):
    spec = {"family": "siglip2", "path": str(checkpoint), "dtype": "bfloat16", **model}
    return load_adapter(make_job(cache_dir, model=spec, output={"pooling": pooling}), torch.device("cuda"))


SIGLIP2_PLAN = BudgetPlan((256, 512, 1024, 2048), max_items=8, max_frames=8)


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_siglip2_cuda_graphs_replay_like_padded_eager_in_a_nan_filled_pool(cache_dir: str, siglip2_checkpoint: Path, pooling: str) -> None:
    """Every batch's replay equals its padded eager run bit for bit and its real rows are
    finite (pad rows and pad segments never reach them), and stays within bf16 rounding of
    the same batch run eagerly at its exact size."""
    adapter = _siglip2(cache_dir, siglip2_checkpoint, pooling)
    items = [adapter.preprocessor()(m) for m in SIGLIP2_MEDIA]
    assert len({i.tokens for i in items}) > 2
    seen = 0
    for replayed, eager in nan_pool_replays(adapter, adapter, SIGLIP2_PLAN, items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), eager.float(), dim=-1)
        assert cos.min() > 0.999, float(cos.min())
        seen += replayed.shape[0]
    assert seen == sum(adapter.row_counts(items))


def _siglip2_reference(checkpoint: Path, images: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' bf16 model on the processor's padded batch, one image at a time: the
    pooled vector and the real tokens' final states of each."""
    from transformers import Siglip2ImageProcessor, Siglip2Model

    processor = Siglip2ImageProcessor.from_pretrained(checkpoint)
    tower = Siglip2Model.from_pretrained(checkpoint, dtype=torch.bfloat16).vision_model.cuda().eval()
    pooled, states = [], []
    for image in images:
        inputs = processor(images=[torch.from_numpy(image.pixels).permute(2, 0, 1)], return_tensors="pt").to("cuda")
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            out = tower(**inputs)
        pooled.append(out.pooler_output[0].float())
        states.append(out.last_hidden_state[0, : int(inputs["pixel_attention_mask"].sum())].float())
    return pooled, states


@pytest.mark.parametrize("pooling", ["mean", "none"])
def test_siglip2_bf16_graph_rows_are_the_transformers_bf16_models(cache_dir: str, siglip2_checkpoint: Path, pooling: str) -> None:
    """The graphs' vectors (or per-token rows, one per patch of each image's grid) against
    transformers' own bf16 tower on its padded batch, by cosine."""
    images = [m for m in SIGLIP2_MEDIA if not hasattr(m, "frames")]
    adapter = _siglip2(cache_dir, siglip2_checkpoint, pooling)
    manager = GraphManager(adapter, SIGLIP2_PLAN, "cuda")
    manager.capture()
    items = [adapter.preprocessor()(m) for m in images]
    rows = manager.run(items, 2048)
    pooled, states = _siglip2_reference(siglip2_checkpoint, images)
    for item, ours, vector, tokens in zip(items, rows, pooled, states):
        if pooling == "mean":
            assert ours.shape == (1, adapter.embed_dim)
            assert float(torch.nn.functional.cosine_similarity(ours.float(), vector[None])) > 0.995
        else:
            assert ours.shape == tokens.shape == (item.tokens, adapter.embed_dim) and item.token_grid[1] * item.token_grid[2] == item.tokens
            assert torch.nn.functional.cosine_similarity(ours.float(), tokens, dim=-1).min() > 0.98
    manager.clear()


def test_siglip2_fp8_compiled_graphs_stay_close_to_bf16(cache_dir: str, siglip2_checkpoint: Path) -> None:
    """model.precision fp8 with batching.compile: the encoder layers compiled with their
    FP8 layers (q, k, v joined, norms and the GELU applied by the row kernel), captured in
    a NaN-filled pool; every replay equals its padded eager run and each vector is within
    cosine 0.99 of the bf16 tower's."""
    bf16 = _siglip2(cache_dir, siglip2_checkpoint)
    fp8 = _siglip2(cache_dir, siglip2_checkpoint, precision="fp8")
    assert fp8.fp8_layers and sum(fp8.fp8_layers.values()) >= 6 * len(fp8.compile_units())
    fp8.compile(dynamic=True)
    items = [fp8.preprocessor()(m) for m in SIGLIP2_MEDIA]
    for replayed, full in nan_pool_replays(fp8, bf16, SIGLIP2_PLAN, items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), full.float(), dim=-1)
        assert cos.min() >= 0.99, float(cos.min())


def test_siglip2_jpegs_decoded_by_nvjpeg_keep_the_cpu_grids(cache_dir: str, siglip2_checkpoint: Path) -> None:
    """`preprocess.decoder: gpu`: a deferred JPEG's grid follows from its header, and its
    patches, made on the device, are the CPU path's up to the decoders' rounding."""
# OpenCLIP towers (`model.family: open_clip`; needs open_clip_torch).


def open_clip_cuda(tmp_path: Path, cache_dir: str, **model: object):
    """A user's OpenCLIP checkpoint (random weights, seed 0, a 224-px ViT-B-16-shaped tower
    of 4 blocks) loaded on CUDA in bfloat16, with its directory."""
    pytest.importorskip("open_clip")
    from test_open_clip import job, user_checkpoint

    directory = tmp_path / "open_clip"
    if not directory.exists():
        user_checkpoint(directory, {"image_size": 224, "patch_size": 16, "width": 768, "head_width": 64, "layers": 4, "mlp_ratio": 4.0})
    adapter = load_adapter(job(cache_dir, directory, model={"dtype": "bfloat16", **model}), torch.device("cuda"))
    return adapter, directory


def test_open_clip_compiled_graphs_replay_like_padded_eager_and_match_open_clip_in_bf16(tmp_path: Path, cache_dir: str) -> None:
    """Every replay of the compiled bf16 tower equals its padded eager run bit for bit,
    with finite rows; each photo's vector is open_clip's own bf16 `encode_image` of it
    (pure bf16, open_clip's transform) to bf16 rounding, and near its fp32 vector."""
    import open_clip
    from PIL import Image
    from test_open_clip import PHOTOS, decoded

    adapter, directory = open_clip_cuda(tmp_path, cache_dir)
    adapter.compile(dynamic=True)
    t = adapter.tokens_per_image
    manager = GraphManager(adapter, BudgetPlan((t, 4 * t, 16 * t), max_items=16, max_frames=16), "cuda")
    manager.capture()
    media = [decoded(p) for p in PHOTOS] + [random_image(90, 60, 1), random_video(3, 50, 80, 2)]
    items = [adapter.preprocessor()(m) for m in media]
    replayed = torch.cat(manager.run(items, 16 * t))
    padded = padded_eager(manager, items, 16 * t)
    assert replayed.shape == (len(PHOTOS) + 4, adapter.embed_dim)
    assert torch.equal(replayed, padded[: replayed.shape[0]]) and torch.isfinite(replayed).all()
    manager.clear()
    pictures = [Image.open(p) for p in PHOTOS]
    wants = {}
    for precision in ("pure_bf16", "fp32"):
        model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{directory}", precision=precision, device="cuda")
        pixels = torch.stack([transform(p) for p in pictures]).to("cuda", next(model.parameters()).dtype)
        with torch.inference_mode():
            wants[precision] = model.eval().encode_image(pixels).float()
    ours = replayed[: len(PHOTOS)].float()
    assert torch.nn.functional.cosine_similarity(ours, wants["pure_bf16"]).min() > 0.999
    assert float(((ours - wants["fp32"]).norm(dim=-1) / wants["fp32"].norm(dim=-1)).max()) < 0.05


def test_open_clip_fp8_graphs_stay_close_to_bf16(tmp_path: Path, cache_dir: str) -> None:
    """model.precision fp8: the attention's packed in-projection and out_proj and the
    MLPs' c_fc and c_proj in FP8 (the image blocks attend batch first), compiled and
    captured; every photo's vector within cosine 0.99 of bf16."""
    from test_open_clip import PHOTOS, decoded

    bf16, _ = open_clip_cuda(tmp_path, cache_dir)
    fp8, _ = open_clip_cuda(tmp_path, cache_dir, precision="fp8")
    assert fp8.fp8_layers == {"attn.qkv": 4, "attn.out_proj": 4, "mlp.c_fc": 4, "mlp.c_proj": 4}
    fp8.compile(dynamic=True)
    items = [fp8.preprocessor()(decoded(p)) for p in PHOTOS]
    t = fp8.tokens_per_image
    plan = BudgetPlan((t, 4 * t, 8 * t), max_items=8, max_frames=8)
    for replayed, full in nan_pool_replays(fp8, bf16, plan, items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), full.float(), dim=-1)
        assert cos.min() > 0.99, float(cos.min())


def test_open_clip_jpegs_decoded_by_nvjpeg_are_the_cpu_views_up_to_the_resize(tmp_path: Path, cache_dir: str) -> None:
    """`preprocess.decoder: gpu`: the views of OpenCLIP's transform made on the device
    (torchvision's tensor resize where the workers use PIL's) are the CPU views to a few
    levels, and the vectors to cosine 0.99."""
    from embedjob import rows as worker
    from embedjob.decode import DecodeOptions
    from embedjob.io.reader import InputRow

    adapter, _ = open_clip_cuda(tmp_path, cache_dir)
    preprocess = adapter.preprocessor()
    options = DecodeOptions(modality="image", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=1)
    rows = [InputRow(k, k, p.read_bytes(), None, None) for k, p in enumerate(GPU_JPEGS)]
    cpu = [worker.decode_row(row, options, preprocess) for row in rows]
    window = [worker.decode_row(row, dataclasses.replace(options, defer_jpeg=True), preprocess) for row in rows]
    assert worker.decode_on_device(window, options, preprocess, torch.device("cuda")) >= 5
    for got, want in zip(window, cpu, strict=True):
        assert (got.error, got.item.grid, got.item.tokens) == (want.error, want.item.grid, want.item.tokens)
        a, b = got.item.tensors["pixel_values"], want.item.tensors["pixel_values"]
        assert a.is_cuda and a.shape == b.shape
        assert float((a.cpu().to(torch.int16) - b.to(torch.int16)).abs().float().mean()) < 3.0, got.id
    with torch.inference_mode():
        gpu = adapter.forward(adapter.eager_inputs([d.item for d in window])).float()
        host = adapter.forward(adapter.eager_inputs([d.item for d in cpu])).float()
    assert torch.nn.functional.cosine_similarity(gpu, host).min() > 0.99


# ---------------------------------------------------------------- WebDataset input (issue #54)


def test_a_webdataset_job_on_cuda_gives_the_parquet_jobs_rows_bit_for_bit(tmp_path: Path, cache_dir: str) -> None:
    """The demo's rows as a tar (key = id, `jpg` member, `txt` caption) and as Parquet,
    each run on CUDA with graphs and nvjpeg: the same ids, errors, tokens and vectors,
    bit for bit (the same bytes reach the same batches), and the captions carried."""
    import io
    import tarfile

    from embedjob.config import load_job
    from embedjob.runner import run_job

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    demo = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "00000.tar", "w") as tar:
        for row in demo:
            add(tar, f"{row['id']}.jpg", row["image"])
            add(tar, f"{row['id']}.txt", f"caption of {row['id']}".encode())
    common = ["runtime.device=cuda", f"runtime.cache_dir={cache_dir}", "runtime.workers=2", "runtime.gpus=1",
              "preprocess.decoder=gpu", "output.dtype=float32"]
    tars = [f"input.path={tmp_path / 'tars'}", "input.format=webdataset", "input.media_column=jpg", "input.id_column=null",
            "output.columns=[txt]", f"output.path={tmp_path / 'from-tars'}"]
    stats = run_job(load_job(REPO / "jobs" / "demo.yaml", [*common, *tars]))
    run_job(load_job(REPO / "jobs" / "demo.yaml", [*common, f"output.path={tmp_path / 'from-parquet'}"]))
    got = pq.read_table(sorted((tmp_path / "from-tars").glob("part-*.parquet"))).to_pylist()
    want = pq.read_table(sorted((tmp_path / "from-parquet").glob("part-*.parquet"))).to_pylist()
    assert stats["device_decoded"] == 9 and stats["hit_rate"] == 1.0
    assert [r["txt"] for r in got] == [f"caption of {r['id']}" for r in demo]
    for a, b in zip(got, want, strict=True):
        assert (a["id"], a["row"], a["error"], a["tokens"]) == (b["id"], b["row"], b["error"], b["tokens"])
        assert a["embedding"] == b["embedding"], a["id"]


# ---------------------------------------------------------------- DINOv3 and MetaCLIP 2 (model.family dinov3, metaclip2)

DINO_METACLIP = ["dinov3", "metaclip2"]


@pytest.mark.parametrize("pooling", ["mean", "none"])
@pytest.mark.parametrize("family", DINO_METACLIP)
def test_dinov3_and_metaclip2_cuda_graphs_equal_padded_eager_and_the_fp32_cpu_reference(
    cache_dir: str, family: str, pooling: str
) -> None:
    """The fixed-resolution check above, for the two towers: DINOv3's per-token rows
    leave its CLS and registers out, its budgets count them."""
    test_fixed_res_cuda_graphs_equal_padded_eager_and_the_fp32_cpu_reference(cache_dir, family, pooling)


def test_metaclip2_batches_are_page_locked_uint8_normalised_on_the_device_bitwise(cache_dir: str) -> None:
    test_fixed_res_batches_are_page_locked_uint8_normalised_on_the_device_bitwise(cache_dir, "metaclip2")


def test_dinov3_batches_are_page_locked_float32_views_normalised_on_the_device_bitwise(cache_dir: str) -> None:
    """DINOv3's processor resizes rescaled float32 pixels: its views, static buffers
    and batches are float32, and the device's normalisation is the CPU's bit for bit."""
    gpu = load_adapter(_fixed_job(cache_dir, "dinov3"), torch.device("cuda"))
    static = gpu.static_inputs(8 * gpu.tokens_per_image, max_items=8, max_frames=8)
    buffer = static.tensors["pixel_values"]
    assert buffer.dtype == torch.float32 and buffer.device.type == "cuda"
    views = gpu.batch_values([gpu.preprocessor()(m) for m in FIXED_MEDIA], static)["pixel_values"]
    assert views.dtype == torch.float32 and views.is_pinned()
    assert torch.equal(gpu.processing.normalize(views.cuda(), gpu.pixel_scale).cpu(), gpu.processing.normalize(views))


@pytest.mark.parametrize("family", DINO_METACLIP)
def test_dinov3_and_metaclip2_compiled_blocks_replay_like_eager_and_stay_the_uncompiled_towers(cache_dir: str, family: str) -> None:
    """batching.compile: the blocks (DINOv3's `model.layer`, MetaCLIP 2's
    `encoder.layers`) compiled, captured into a NaN-filled pool, replay the padded eager
    run bit for bit and stay within bf16 rounding of the uncompiled tower."""
    plain = load_adapter(_fixed_job(cache_dir, family), torch.device("cuda"))
    compiled = load_adapter(_fixed_job(cache_dir, family), torch.device("cuda"))
    assert len(compiled.compile_units()) == 2
    compiled.compile(dynamic=True)
    t = compiled.tokens_per_image
    items = [compiled.preprocessor()(m) for m in FIXED_MEDIA]
    for replayed, eager in nan_pool_replays(compiled, plain, BudgetPlan((t, 2 * t, 4 * t, 8 * t), max_items=8, max_frames=8), items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), eager.float(), dim=-1)
        assert cos.min() > 0.99, float(cos.min())


def test_dinov3_at_dinov3_l_size_departs_from_float32_no_further_than_transformers_own_bf16(tmp_path: Path, cache_dir: str) -> None:
    """DINOv3-ViT-L/16's blocks, heads (16 of 64) and sequence (CLS, 4 registers, 196
    patches) with random bf16 weights, on random pixels as `embedjob bench` feeds them.
    At this size bf16 itself departs from float32 (transformers' own bf16 model: cosine
    0.81-0.83 on an H100, by SDPA kernel), so the bench's 0.834 between our graphs and
    transformers is bf16's spread, not ours: our eager adapter is transformers' bf16 path
    (its patch convolution as our one product, `patch_products`: a summation order of its
    own, which this spread would amplify like any other), and our compiled graphs sit no
    further from float32 than transformers' bf16 kernels do, and far nearer their own
    image's float32 vector than one image's is to the next."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from embedjob.bench import graph_seconds, save_fixed_tower, view_items
    from embedjob.encoders.fixed import FAMILIES as FIXED, patch_products
    from embedjob.encoders.loading import transformers_class

    def cos_min(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())

    values = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, patch_size=16,
                  image_size=224, num_register_tokens=4)
    directory = tmp_path / "dinov3-l"
    directory.mkdir()
    save_fixed_tower("dinov3", values, directory)
    job = make_job(cache_dir, model={"family": "dinov3", "path": str(directory), "dtype": "bfloat16"})
    ours = load_adapter(job, torch.device("cuda"))
    pictures = torch.randint(0, 256, (16, 3, *ours.processing.input_size), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    pixels = ours.processing.process(pictures).cuda()
    values32 = ours.processing.normalize(pixels, ours.pixel_scale).float()
    cls = transformers_class(FIXED["dinov3"].vision_class)
    items = view_items(ours, pixels)
    kernels = {}
    with torch.inference_mode():
        reference = cls.from_pretrained(directory, dtype=torch.float32).cuda().eval()(pixel_values=values32).pooler_output
        plain = cls.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
        patch_products(plain.embeddings)
        default = plain(pixel_values=values32.bfloat16()).pooler_output
        for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            with sdpa_kernel(backend):
                kernels[backend.name] = cos_min(plain(pixel_values=values32.bfloat16()).pooler_output, reference)
        eager = ours.forward(ours.eager_inputs(items))
    ours.compile(dynamic=True)
    _, graphs = graph_seconds(ours, pixels, 1, torch.device("cuda"))
    apart, kept = cos_min(reference[1:], reference[:-1]), cos_min(graphs, reference)
    assert cos_min(eager, default) > 0.999
    assert kept > min(kernels.values()) - 0.03, (kept, kernels)
    assert kept > apart + 0.2, (kept, apart)


@pytest.mark.parametrize("family", DINO_METACLIP)
def test_dinov3_and_metaclip2_fp8_graphs_replay_like_eager_and_stay_close_to_bf16(cache_dir: str, family: str) -> None:
    """model.precision fp8 on real photos: every linear layer of the blocks in FP8
    (DINOv3's q, k and v one product though k has no bias), compiled and captured; each
    replay equals its padded eager run and each vector's cosine to bf16 is at least 0.99."""
    import io
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    table = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    photos = [SimpleNamespace(pixels=np.asarray(Image.open(io.BytesIO(row["image"])).convert("RGB")))
              for row in table if row["id"].startswith("img2dataset_")]
    model = {"family": family, "path": f"builtin:tiny-{family}", "dtype": "bfloat16"}
    bf16 = load_adapter(make_job(cache_dir, model=model), torch.device("cuda"))
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), torch.device("cuda"))
    assert sum(fp8.fp8_layers.values()) == 6 * len(fp8.compile_units())
    fp8.compile(dynamic=True)
    items = [fp8.preprocessor()(m) for m in photos]
    t = fp8.tokens_per_image
    for replayed, full in nan_pool_replays(fp8, bf16, BudgetPlan((t, 2 * t, 4 * t, 8 * t), max_items=8, max_frames=8), items):
        cos = torch.nn.functional.cosine_similarity(replayed.float(), full.float(), dim=-1)
        assert cos.min() >= 0.99, float(cos.min())


def test_dinov3_dual_path_replays_equal_eager_on_the_same_padded_batches(cache_dir: str) -> None:
    """preprocess.tiling: anyres with DINOv3's float32 views: tiles are cut from the
    rescaled picture, and both paths' graphs replay their padded eager runs."""
    adapter = load_adapter(_fixed_job(cache_dir, "dinov3", tiling="anyres", max_tiles=6), torch.device("cuda"))
    t = adapter.tokens_per_image
    encoder = paths_encoder(adapter, BudgetPlan(tuple(t * 2**k for k in range(6)), max_items=8, max_frames=16), "cuda", "min_padding")
    items = [adapter.preprocessor()(m) for m in FIXED_MEDIA]
    assert any(item.tensors["tile_pixels"].shape[0] > 0 for item in items)
    for batch in batches(encoder, items):
        chosen = [items[i] for i in batch.indices]
        replayed = run(encoder, chosen, batch.budgets)
        assert all(torch.equal(a, b) for a, b in zip(replayed, run_padded_eager(encoder, chosen, batch.budgets)))
    stats = encoder.stats()
    assert stats["graph_hits"] == len(items) and stats["paths"]["local"]["graph_hits"] >= 1
    encoder.clear()


def test_a_dinov3_gpu_decoder_job_gives_the_cpu_decoder_jobs_rows(tmp_path: Path, cache_dir: str) -> None:
    """preprocess.decoder: gpu resizes DINOv3's rescaled float32 pictures on the device."""
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs, stats = {}, {}
    for decoder in ("cpu", "gpu"):
        overrides = [f"output.path={tmp_path / decoder}", "runtime.device=cuda", f"runtime.cache_dir={cache_dir}",
                     "runtime.workers=2", "runtime.gpus=1", f"preprocess.decoder={decoder}", "model.family=dinov3",
                     "model.path=builtin:tiny-dinov3", "output.dtype=float32"]
        stats[decoder] = run_job(load_job(REPO / "jobs" / "demo-clip.yaml", overrides))
        outputs[decoder] = pq.read_table(sorted((tmp_path / decoder).glob("part-*.parquet"))).to_pylist()
    assert stats["gpu"]["device_decoded"] == 9 and stats["gpu"]["hit_rate"] == 1.0
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["gpu"], strict=True):
        assert (cpu_row["id"], cpu_row["error"], cpu_row["tokens"]) == (gpu_row["id"], gpu_row["error"], gpu_row["tokens"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99

# ---------------------------------------------------------------- output on object storage (objstore)


def test_a_cuda_run_into_s3_writes_the_parts_a_local_cuda_run_writes(tmp_path: Path, cache_dir: str, monkeypatch) -> None:
    """The writer thread uploading parts to an S3 API (moto's server on 127.0.0.1) while
    the GPU encodes: the same part bytes as the same job written to a directory."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    from embedjob.config import load_job
    from embedjob.runner import run_job

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(name, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        fs.mkdir("gpu")
        settings = [f"runtime.cache_dir={cache_dir}", "runtime.device=cuda", "runtime.gpus=1", "runtime.workers=0", "output.rows_per_part=3"]
        for where in (str(tmp_path / "local"), "s3://gpu/out"):
            stats = run_job(load_job(REPO / "jobs" / "demo.yaml", [f"output.path={where}", *settings]))
            assert stats["rows"] == 12 and stats["graph_backend"] == "cuda"
        local = {p.name: p.read_bytes() for p in sorted((tmp_path / "local").glob("part-*.parquet"))}
        uploaded = {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in sorted(fs.glob("gpu/out/part-*.parquet"))}
        assert len(local) == 4 and uploaded == local
        assert fs.exists("gpu/out/_embedjob/_SUCCESS-00000") and fs.list_multipart_uploads("gpu") == []
    finally:
        server.stop()


# Qwen3.5 (`model.family: qwen3_5`): its tower on CUDA from a user's full checkpoint.


@pytest.fixture(scope="module")
def qwen35_cuda_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full Qwen3.5 checkpoint whose tower has the published towers' head dim (72)."""
    from test_qwen import QWEN35_VISION, make_qwen3_5_checkpoint

    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5_cuda"), {**QWEN35_VISION, "hidden_size": 144})


def qwen35_media() -> tuple[list, list]:
    """The demo's real photos (decoded as a user decodes them) and a clip, as decoded media."""
    from types import SimpleNamespace

    from test_qwen import _demo_photos, _photo_pixels

    photos = []
    for _, data in _demo_photos():
        try:
            photos.append(_photo_pixels(data))
        except OSError:
            continue  # the demo's broken rows
    return photos, [SimpleNamespace(pixels=p) for p in photos] + [random_video(6, 180, 240, 8)]


def test_qwen3_5_graphs_replay_eager_and_stay_close_to_transformers_bf16(cache_dir: str, qwen35_cuda_checkpoint: Path) -> None:
    """bf16 on CUDA, every budget captured: each batch's replay equals the padded eager
    run bit for bit, and each photo's per-token rows and their mean are transformers'
    bf16 merged tokens (get_image_features) up to bf16 rounding."""
    from test_qwen import qwen35_reference

    adapter = load_adapter(make_job(cache_dir, model={"path": str(qwen35_cuda_checkpoint), "dtype": "bfloat16"}), torch.device("cuda"))
    assert adapter.family == "qwen3_5" and adapter.capturable
    photos, media = qwen35_media()
    items = [adapter.preprocessor()(m) for m in media]
    manager = GraphManager(adapter, PLAN, "cuda")
    manager.capture()
    rows: dict[int, torch.Tensor] = {}
    for batch in pack([i.tokens for i in items], [i.frames for i in items], PLAN):
        chosen = [items[i] for i in batch.indices]
        replayed = manager.run(chosen, batch.budget)
        joined = torch.cat(replayed)
        assert torch.isfinite(joined).all()
        assert torch.equal(joined, padded_eager(manager, chosen, batch.budget)[: joined.shape[0]])
        rows.update((k, r.float().cpu()) for k, r in zip(batch.indices, replayed))
    assert manager.stats.misses == 0
    manager.clear()
    refs = qwen35_reference(qwen35_cuda_checkpoint, images=photos, device="cuda", dtype=torch.bfloat16)
    for k, ref in enumerate(refs):
        assert rows[k].shape == ref.shape
        assert torch.nn.functional.cosine_similarity(rows[k], ref, dim=-1).min() > 0.99, k
        assert float((rows[k].mean(0) - ref.mean(0)).norm() / ref.mean(0).norm()) < 3e-2, k


def test_qwen3_5_compiled_job_with_gpu_jpeg_decoding_gives_the_cpu_jobs_rows(
    tmp_path: Path, cache_dir: str, qwen35_cuda_checkpoint: Path
) -> None:
    """`embedjob run` on CUDA with batching.compile and preprocess.decoder: gpu against
    the float32 CPU run: the same rows, errors and token counts, each vector within bf16
    rounding of the CPU one; every JPEG decoded by nvjpeg, every batch a graph replay."""
    from embedjob.config import load_job
    from embedjob.runner import run_job

    outputs, stats = {}, {}
    runs = {"cpu": ["runtime.device=cpu"],
            "cuda": ["runtime.device=cuda", "runtime.gpus=1", "batching.compile=true", "preprocess.decoder=gpu"]}
    for name, overrides in runs.items():
        common = [f"model.path={qwen35_cuda_checkpoint}", "model.family=qwen3_5", f"output.path={tmp_path / name}", f"runtime.cache_dir={cache_dir}",
                  "runtime.workers=2", "output.dtype=float32"]
        stats[name] = run_job(load_job(REPO / "jobs" / "demo.yaml", [*common, *overrides]))
        outputs[name] = pq.read_table(sorted((tmp_path / name).glob("part-*.parquet"))).to_pylist()
    assert stats["cuda"]["graph_backend"] == "cuda" and stats["cuda"]["hit_rate"] == 1.0
    assert stats["cuda"]["device_decoded"] == 9 and stats["cuda"]["errors"] == 2
    for cpu_row, gpu_row in zip(outputs["cpu"], outputs["cuda"], strict=True):
        assert (cpu_row["id"], cpu_row["error"], cpu_row["tokens"]) == (gpu_row["id"], gpu_row["error"], gpu_row["tokens"])
        if cpu_row["error"] is None:
            a, b = torch.tensor(cpu_row["embedding"]), torch.tensor(gpu_row["embedding"])
            assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.99, cpu_row["id"]


def test_qwen3_5_fp8_compiled_graphs_replay_like_eager_and_keep_a_cosine_of_099_to_bf16(
    cache_dir: str, qwen35_cuda_checkpoint: Path
) -> None:
    """model.precision fp8 on the Qwen3.5 tower: qkv, proj and the MLP (its GELU and
    norms applied as inputs are quantised) in FP8, compiled and captured into a pool
    first filled with NaN; every replay equals the padded eager run, and each item's
    mean vector keeps a cosine of at least 0.99 to the bf16 tower's."""
    model = {"path": str(qwen35_cuda_checkpoint), "dtype": "bfloat16"}
    bf16 = load_adapter(make_job(cache_dir, model=model), torch.device("cuda"))
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), torch.device("cuda"))
    blocks = len(fp8.compile_units())
    assert fp8.fp8_layers == {name: blocks for name in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    fp8.compile(dynamic=True)
    _, media = qwen35_media()
    items = [fp8.preprocessor()(m) for m in media]
    plan = BudgetPlan(token_budgets=(128, 256, 512, 1024), max_items=8, max_frames=16)
    by_batch = list(nan_pool_replays(fp8, bf16, plan, items))
    for batch, (replayed, full) in zip(pack([i.tokens for i in items], [i.frames for i in items], plan), by_batch):
        counts = [items[i].tokens for i in batch.indices]
        ours = torch.stack([rows.float().mean(0) for rows in replayed.split(counts)])
        theirs = torch.stack([rows.float().mean(0) for rows in full.split(counts)])
        cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        assert cos.min() >= 0.99, float(cos.min())


# --- captions: text embeddings, scores and zero-shot labels (issue #55) ------------------


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_text_graphs_replay_equal_padded_eager_on_cuda_and_the_fp32_cpu_reference(tmp_path: Path, cache_dir: str, family: str) -> None:
    """A text tower's graphs, one per batch size at the fixed length, captured into a pool
    first filled with NaN: each replay's real rows are finite and equal the padded eager
    run bit for bit (`nan_pool_replays`), and the bf16 vectors stay close to the float32
    CPU tower's."""
    from caption_helpers import SENTENCES, job, save_checkpoint

    from embedjob.captions import text_plan
    from embedjob.config import job_from_dict

    model = save_checkpoint(family, tmp_path / "model")
    spec = job_from_dict(job(tmp_path, cache_dir, family, model, runtime={"device": "cuda"}))
    gpu, cpu = load_adapter(spec, torch.device("cuda")).text, load_adapter(spec, torch.device("cpu")).text
    captions = [*SENTENCES, " ".join(SENTENCES), ""]
    items = [gpu.preprocessor()(c) for c in captions]
    assert sum(replayed.shape[0] for replayed, _ in nan_pool_replays(gpu, gpu, text_plan(gpu), items)) == len(items)
    manager = GraphManager(gpu, text_plan(gpu), "cuda")
    manager.capture()
    replayed = torch.cat(manager.run(items, 16 * gpu.length))  # room for 16 captions: 7 pad rows
    with torch.no_grad():
        ref = cpu.forward(cpu.eager_inputs([cpu.preprocessor()(c) for c in captions]))
    rel = (replayed.float().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) < 3e-2, rel.tolist()
    assert manager.stats.hits == len(items)


def _text_modules(text) -> dict[str, torch.nn.Module]:
    """The text model's stages in order: embeddings, each layer's attention, MLP and
    output, the final norm and (SigLIP's) head."""
    model = text.tower.model
    modules = {"embeddings": model.embeddings}
    for k, layer in enumerate(model.encoder.layers):
        modules.update({f"layer {k} attention": layer.self_attn, f"layer {k} mlp": layer.mlp, f"layer {k}": layer})
    modules.update({name: getattr(model, name) for name in ("final_layer_norm", "head") if hasattr(model, name)})
    return modules


@pytest.mark.parametrize("family", ["clip", "siglip", "siglip2"])
def test_every_stage_of_a_text_graph_replays_its_eager_run_on_the_same_padded_batch(tmp_path: Path, cache_dir: str, family: str) -> None:
    """Each stage of a text tower's graph (embeddings, attention, MLP, layer, norm, head),
    replayed on a padded batch, equals the same stage run eagerly on the same buffers bit
    for bit, and the eager run equals itself: where a whole-tower replay departs from
    eager, the message names the first stage that does."""
    from caption_helpers import SENTENCES, job, save_checkpoint

    from embedjob.config import job_from_dict

    model = save_checkpoint(family, tmp_path / "model")
    text = load_adapter(job_from_dict(job(tmp_path, cache_dir, family, model, runtime={"device": "cuda"})), torch.device("cuda")).text
    items = [text.preprocessor()(c) for c in [*SENTENCES, ""]]
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, out) -> None:
            seen[name] = (out[0] if isinstance(out, tuple) else out).clone()
        return hook

    modules = _text_modules(text)
    handles = [module.register_forward_hook(keep(name)) for name, module in modules.items()]
    budget = 16 * text.length
    manager = GraphManager(text, BudgetPlan((budget,), 16, 0), "cuda")
    manager.capture()
    captured = dict(seen)  # the clones the graph writes at each replay
    static = manager.padded_inputs(items, budget)
    manager.run_batch(items, budget)
    torch.cuda.synchronize()
    with torch.inference_mode():
        first, eager = text.forward(static).clone(), dict(seen)
        again = text.forward(static)
    for handle in handles:
        handle.remove()
    assert torch.equal(first, again), "the eager text tower is not deterministic on one batch"
    differ = [name for name in modules if not torch.equal(captured[name], eager[name])]
    assert not differ, f"replay departs from eager first at {differ[0]} (then: {differ[1:]})"
    manager.clear()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_captions_job_on_cuda_matches_the_cpu_run(tmp_path: Path, cache_dir: str, compiled: bool) -> None:
    """CLIP with captions and labels on the GPU (text graphs replayed, compiled or not)
    gives the CPU run's rows: the same nulls, close vectors and scores, and the CPU's
    label, unless the GPU's is within bf16 noise of it by the CPU's own cosines."""
    import transformers
    from caption_helpers import LABELS, job, read, save_checkpoint

    import embedjob

    model = save_checkpoint("clip", tmp_path / "model")
    tables, stats = {}, {}
    for device in ("cpu", "cuda"):
        raw = job(tmp_path, cache_dir, "clip", model, output={"path": str(tmp_path / device)},
                  runtime={"device": device, "gpus": 1}, batching={"compile": compiled and device == "cuda"})
        stats[device] = embedjob.run(raw)
        tables[device] = read(tmp_path / device).to_pylist()
    text = stats["cuda"]["text"]
    assert text["graph_backend"] == "cuda" and text["hit_rate"] == 1.0 and text["graph_misses"] == 0
    full, tokenizer = transformers.CLIPModel.from_pretrained(model), transformers.AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        prompts = full.get_text_features(**tokenizer(LABELS, padding=True, return_tensors="pt")).pooler_output
    _caption_rows_agree(tables["cpu"], tables["cuda"], prompts)


def _caption_rows_agree(cpu_rows: list[dict], gpu_rows: list[dict], prompts: torch.Tensor) -> None:
    """A captions job's CUDA rows are its CPU rows: the same nulls, text vectors, scores
    and label scores close, and a label that differs only where two prompts nearly tie."""
    from caption_helpers import LABELS

    for cpu_row, gpu_row in zip(cpu_rows, gpu_rows, strict=True):
        for name in ("error", "text_embedding", "score", "label"):
            assert (cpu_row[name] is None) == (gpu_row[name] is None), name
        if cpu_row["text_embedding"] is not None:
            a, b = torch.tensor(cpu_row["text_embedding"]), torch.tensor(gpu_row["text_embedding"])
            assert float((a - b).norm() / a.norm()) < 3e-2
        if cpu_row["score"] is not None:
            assert abs(cpu_row["score"] - gpu_row["score"]) < 2e-2
        if cpu_row["label"] is not None:
            assert abs(cpu_row["label_score"] - gpu_row["label_score"]) < 2e-2
            cosines = torch.nn.functional.cosine_similarity(torch.tensor(cpu_row["embedding"])[None], prompts)
            assert cosines[LABELS.index(cpu_row["label"])] - cosines[LABELS.index(gpu_row["label"])] < 2e-2


# --- captions for SigLIP 2 and OpenCLIP (issue #55) ---------------------------------------


@pytest.mark.parametrize("kind", ["siglip2", "open_clip", "open_clip_hf"])
def test_siglip2_and_open_clip_text_graphs_replay_equal_padded_eager_on_cuda(tmp_path: Path, cache_dir: str, kind: str) -> None:
    """SigLIP 2's text tower and OpenCLIP's (`encode_text`: a CLIP on OpenCLIP's default
    tokenizer, and a SigLIP-like custom text tower on a Hugging Face tokenizer) in bf16 on
    CUDA: graphs, one per batch size at the fixed length, captured into a pool first filled
    with NaN, replay each batch's padded eager run bit for bit with finite rows
    (`nan_pool_replays`); 9 captions in the 16-caption graph equal its padded eager run and
    stay close to the float32 CPU tower's vectors."""
    if kind.startswith("open_clip"):
        pytest.importorskip("open_clip")
    from caption_helpers import FAMILY_OF, SENTENCES, job, save_checkpoint

    from embedjob.captions import text_plan
    from embedjob.config import job_from_dict

    model = save_checkpoint(kind, tmp_path / "model")
    spec = job_from_dict(job(tmp_path, cache_dir, FAMILY_OF.get(kind, kind), model, runtime={"device": "cuda"}))
    gpu, cpu = load_adapter(spec, torch.device("cuda")).text, load_adapter(spec, torch.device("cpu")).text
    assert gpu.dtype == torch.bfloat16
    captions = [*SENTENCES, " ".join(SENTENCES), ""]
    items = [gpu.preprocessor()(c) for c in captions]
    assert sum(replayed.shape[0] for replayed, _ in nan_pool_replays(gpu, gpu, text_plan(gpu), items)) == len(items)
    manager = GraphManager(gpu, text_plan(gpu), "cuda")
    manager.capture()
    budget = 16 * gpu.length  # room for 16 captions: 7 pad rows
    replayed = torch.cat(manager.run(items, budget))
    assert torch.equal(replayed, padded_eager(manager, items, budget)[: len(items)])
    with torch.no_grad():
        ref = cpu.forward(cpu.eager_inputs([cpu.preprocessor()(c) for c in captions]))
    rel = (replayed.float().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) < 3e-2, rel.tolist()
    assert manager.stats.hits == len(items)
    manager.clear()


@pytest.mark.parametrize("family", ["siglip", "siglip2"])
def test_compiled_siglip_text_graphs_captured_into_a_nan_filled_pool_replay_like_eager(tmp_path: Path, cache_dir: str, family: str) -> None:
    """batching.compile compiles SigLIP's and SigLIP 2's text blocks (their attention takes
    no mask, so nothing differs between warm-up and capture): every budget's graph
    captures, and each replay into a pool first filled with NaN equals the compiled padded
    eager run bit for bit and stays within bf16 rounding of the uncompiled tower."""
    from caption_helpers import SENTENCES, job, save_checkpoint

    from embedjob.captions import text_plan
    from embedjob.config import job_from_dict

    model = save_checkpoint(family, tmp_path / "model")
    spec = job_from_dict(job(tmp_path, cache_dir, family, model, runtime={"device": "cuda"}))
    plain, compiled = (load_adapter(spec, torch.device("cuda")).text for _ in range(2))
    assert compiled.compiles
    compiled.compile(dynamic=True)
    items = [compiled.preprocessor()(c) for c in [*SENTENCES, " ".join(SENTENCES), ""]]
    replays = list(nan_pool_replays(compiled, plain, text_plan(compiled), items))
    assert sum(replayed.shape[0] for replayed, _ in replays) == len(items)
    replayed, reference = (torch.cat([pair[k] for pair in replays]).float() for k in (0, 1))
    rel = (replayed - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert float(rel.max()) < 2e-2, rel.tolist()


@pytest.mark.parametrize("kind", ["siglip", "siglip2", "open_clip"])
def test_a_compiled_siglip2_or_open_clip_captions_job_on_cuda_matches_the_cpu_run(tmp_path: Path, cache_dir: str, kind: str) -> None:
    """SigLIP, SigLIP 2 and OpenCLIP with captions and labels on the GPU, blocks compiled
    (SigLIP's and SigLIP 2's text blocks too) and text graphs replayed, give the CPU run's rows: the same nulls, close text vectors, scores and
    label scores, and the CPU's label unless the GPU's is within bf16 noise of it by the
    CPU's own cosines with the prompts."""
    if kind.startswith("open_clip"):
        pytest.importorskip("open_clip")
    from caption_helpers import LABELS, job, read, save_checkpoint

    import embedjob
    from embedjob.config import job_from_dict

    model = save_checkpoint(kind, tmp_path / "model")
    tables, stats = {}, {}
    for device in ("cpu", "cuda"):
        raw = job(tmp_path, cache_dir, kind, model, output={"path": str(tmp_path / device)},
                  runtime={"device": device, "gpus": 1}, batching={"compile": device == "cuda"})
        stats[device] = embedjob.run(raw)
        tables[device] = read(tmp_path / device).to_pylist()
    text = stats["cuda"]["text"]
    assert text["graph_backend"] == "cuda" and text["hit_rate"] == 1.0 and text["graph_misses"] == 0
    prompts = load_adapter(job_from_dict(job(tmp_path, cache_dir, kind, model)), torch.device("cpu")).text.embed(LABELS)
    _caption_rows_agree(tables["cpu"], tables["cuda"], prompts)
