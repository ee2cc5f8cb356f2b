"""CUDA-only checks: real graph capture and replay, varlen attention, the job on a GPU.

Skipped without CUDA (CI has none); run on a GPU machine before calling graph or
encoder work done: `python -m pytest tests/test_gpu.py -q`.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from embedjob.encoders import load_adapter
from embedjob.encoders.attention import _segmented_sdpa, varlen_attention
from embedjob.graphs import GraphManager
from embedjob.packer import BudgetPlan, pack

from conftest import REPO, make_job, random_image, random_video

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

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


def test_cuda_graph_replay_equals_eager_on_the_same_padded_batch(cuda_manager: GraphManager, items) -> None:
    assert cuda_manager.num_graphs == len(PLAN.token_budgets)
    for batch in pack([i.tokens for i in items], [i.frames for i in items], PLAN):
        chosen = [items[i] for i in batch.indices]
        replayed = torch.cat(cuda_manager.run(chosen, batch.budget))
        padded = cuda_manager.run_padded_eager(chosen, batch.budget)
        assert torch.equal(replayed, padded[: replayed.shape[0]])


def test_graph_outputs_match_the_fp32_cpu_reference(cuda_manager: GraphManager, qwen_adapter, items) -> None:
    cpu_items = [qwen_adapter.preprocessor()(m) for m in MEDIA]
    with torch.no_grad():
        refs = qwen_adapter.split(qwen_adapter.forward(qwen_adapter.eager_inputs(cpu_items)), cpu_items)
    outs = cuda_manager.run(items, 1024)
    for out, ref in zip(outs, refs):
        rel = float((out.float().cpu() - ref).norm() / ref.norm())
        assert rel < 3e-2, rel


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
    from embedjob.job import load_job
    from embedjob.runner import run_job

    outputs = {}
    for device in ("cpu", "cuda"):
        job = load_job(
            REPO / "jobs" / "demo.yaml",
            [f"output.path={tmp_path / device}", f"runtime.device={device}", f"runtime.cache_dir={cache_dir}", "runtime.workers=0"],
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
