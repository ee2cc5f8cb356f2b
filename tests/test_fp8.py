"""`model.precision: fp8` on the CPU: the FP8 linear layer, the blocks it converts, the
whole job on the demo data against the same job in full precision, and the job error
where FP8 cannot run. The GPU side (compiled, inside captured graphs) is in test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job

from embedjob.cli import main
from embedjob.encoders import load_adapter
from embedjob.encoders.fp8 import Fp8Linear, convert_blocks
from embedjob.io.checkpoint import job_fingerprint

DEMO = str(REPO / "jobs" / "demo.yaml")


def run(out: Path, cache_dir: str, *extra: str) -> int:
    return main(["run", DEMO, "--set", f"output.path={out}", "--set", f"runtime.cache_dir={cache_dir}", *extra])


def embeddings(out: Path) -> tuple[list[dict], np.ndarray]:
    rows = pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()
    good = [r for r in rows if r["error"] is None]
    return rows, np.array([r["embedding"] for r in good], dtype=np.float32)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize(("inputs", "outputs", "bias"), [(64, 96, True), (72, 100, True), (1152, 4304, False)])
def test_an_fp8_layer_computes_the_linear_layer_at_any_shape(inputs: int, outputs: int, bias: bool) -> None:
    """Head dims and MLP widths that are not multiples of 16 (72, 100) are padded inside;
    the result keeps the layer's shape and its value to FP8 rounding, for 1 row or many."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(inputs, outputs, bias=bias)
    fp8 = Fp8Linear(linear)
    for shape in ((1, inputs), (3, 37, inputs)):
        x = torch.randn(*shape)
        exact, approx = linear(x), fp8(x)
        assert approx.shape == exact.shape and approx.dtype == x.dtype
        cos = torch.nn.functional.cosine_similarity(approx.reshape(-1, outputs), exact.reshape(-1, outputs), dim=-1)
        assert cos.min() > 0.995
    if bias:  # a row of zeros (a pad row) gives the bias, exactly
        assert torch.equal(fp8(torch.zeros(2, inputs)), linear.bias.detach().expand(2, -1))


def test_only_the_blocks_linear_layers_are_converted_and_counted(cache_dir: str) -> None:
    adapter = load_adapter(make_job(cache_dir, model={"precision": "fp8"}), torch.device("cpu"))
    blocks = adapter.compile_units()
    assert adapter.fp8_layers and sum(adapter.fp8_layers.values()) == sum(
        isinstance(m, Fp8Linear) for b in blocks for m in b.modules()
    )
    assert all(n == len(blocks) for n in adapter.fp8_layers.values())  # each named layer once per block
    assert not any(type(m) is torch.nn.Linear for b in blocks for m in b.modules())
    outside = [m for m in adapter.model.modules() if isinstance(m, Fp8Linear)]
    assert len(outside) == sum(adapter.fp8_layers.values())  # nothing outside the blocks (merger, patch embed)
    assert adapter.describe()["precision"] == "fp8"
    assert convert_blocks(blocks) == {}  # converting twice changes nothing


def test_an_fp8_job_embeds_every_row_close_to_the_full_precision_job(tmp_path: Path, cache_dir: str) -> None:
    """The demo job with precision fp8: same rows, same errors, each embedding within
    FP8 rounding of the full-precision one; the stats say which layers ran in FP8."""
    assert run(tmp_path / "full", cache_dir, "--set", "runtime.workers=0") == 0
    assert run(tmp_path / "fp8", cache_dir, "--set", "runtime.workers=0", "--set", "model.precision=fp8") == 0
    (full_rows, full), (fp8_rows, fp8) = embeddings(tmp_path / "full"), embeddings(tmp_path / "fp8")
    assert [(r["row"], r["error"]) for r in fp8_rows] == [(r["row"], r["error"]) for r in full_rows]
    assert len(fp8) == 10 and cosines(fp8, full).min() > 0.99 and not np.array_equal(fp8, full)
    stats = json.loads((tmp_path / "fp8" / "_embedjob" / "stats-00000.json").read_text())
    assert stats["precision"] == "fp8" and stats["fp8_layers"] == {
        name: 4 for name in ("attn.proj", "attn.qkv", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")  # 4 blocks
    }
    full_stats = json.loads((tmp_path / "full" / "_embedjob" / "stats-00000.json").read_text())
    assert full_stats["precision"] == "bf16" and "fp8_layers" not in full_stats


def test_fp8_on_a_fixed_resolution_tower_converts_its_attention_and_mlp(cache_dir: str) -> None:
    adapter = load_adapter(
        make_job(cache_dir, model={"family": "siglip", "path": "builtin:tiny-siglip", "precision": "fp8"}),
        torch.device("cpu"),
    )
    assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"} <= set(
        adapter.fp8_layers
    )


def test_fp8_where_the_device_cannot_is_one_line_before_any_row(
    tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")

    monkeypatch.setattr(torch, "_scaled_mm", unsupported)
    assert run(tmp_path, cache_dir, "--set", "model.precision=fp8") == 2
    err = capsys.readouterr().err
    assert "model.precision: fp8 cannot run on cpu" in err and "set model.precision: bf16" in err
    assert not list(tmp_path.glob("part-*.parquet"))


def test_fp8_without_triton_where_cuda_runs_is_one_line_before_any_row(
    tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA layers quantise their inputs with a Triton kernel: a machine whose Triton
    cannot be imported gets the job error, not a traceback."""
    from embedjob.encoders import fp8

    def no_triton():
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp8, "_register_row_quantizer", no_triton)
    assert run(tmp_path, cache_dir, "--set", "model.precision=fp8", "--set", "runtime.device=cpu") == 2
    err = capsys.readouterr().err
    assert "model.precision: fp8 cannot run on cpu" in err and "No module named 'triton'" in err
    assert not list(tmp_path.glob("part-*.parquet"))


def test_the_default_precision_leaves_the_fingerprint_of_earlier_output_unchanged(tmp_path: Path, cache_dir: str) -> None:
    """Output written before `model.precision` existed resumes; an fp8 job's differs."""
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": [b"x"]}), table)
    bf16 = job_fingerprint(make_job(cache_dir, input={"path": str(table)}))
    fp8 = job_fingerprint(make_job(cache_dir, input={"path": str(table)}, model={"precision": "fp8"}))
    assert "precision" not in bf16["model"] and fp8["model"]["precision"] == "fp8"
