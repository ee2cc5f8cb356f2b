"""`model.precision: fp8` on the CPU: the FP8 linear layer, the blocks it converts, the
whole job on the demo data against the same job in full precision, and the job error
where FP8 cannot run. The GPU side (compiled, inside captured graphs) is in test_gpu.py."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image
from conftest import REPO, make_job

from embedjob.cli import main
from embedjob.encoders import load_adapter
from embedjob.encoders.fp8 import Fp8GatedMlp, Fp8Joint, Fp8Linear, convert_blocks
from embedjob.io.checkpoint import job_fingerprint

DEMO = str(REPO / "jobs" / "demo.yaml")
PHOTOS = sorted((REPO / "tests" / "data").glob("img2dataset_*.jpg"))


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


def fp8_layers_in(module: torch.nn.Module) -> int:
    """The layers of `module` that run in FP8: each `Fp8Linear` on its own and each
    member of a joined product (whose shared `Fp8Linear` is not a layer of the model)."""
    return sum(
        isinstance(m, Fp8Joint) or (isinstance(m, Fp8Linear) and not name.endswith(".product"))
        for name, m in module.named_modules(remove_duplicate=False)
    )


def test_only_the_blocks_linear_layers_are_converted_and_counted(cache_dir: str) -> None:
    adapter = load_adapter(make_job(cache_dir, model={"precision": "fp8"}), torch.device("cpu"))
    blocks = adapter.compile_units()
    assert adapter.fp8_layers and sum(adapter.fp8_layers.values()) == sum(map(fp8_layers_in, blocks))
    assert all(n == len(blocks) for n in adapter.fp8_layers.values())  # each named layer once per block
    assert not any(type(m) is torch.nn.Linear for b in blocks for m in b.modules())
    # nothing outside the blocks (merger, patch embed)
    assert fp8_layers_in(adapter.model) == sum(adapter.fp8_layers.values())
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


def separately_converted(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` with every linear layer in FP8 on its own (no joined products)."""
    module = copy.deepcopy(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Fp8Linear(child))
    return module


@pytest.mark.parametrize(("family", "part", "siblings"), [("siglip", None, 3), ("qwen2_5_vl", "mlp", 2)])
def test_sibling_layers_share_one_fp8_product_and_compute_as_separate_layers_do(
    family: str, part: str | None, siblings: int, cache_dir: str
) -> None:
    """q, k and v (SigLIP's attention) and gate and up (Qwen's MLP) read one input: FP8
    joins them into one product per block; the block computes what it computes with
    each layer in FP8 on its own, eager and compiled, and holds no tensor once it has
    returned."""
    adapter = load_adapter(make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"}), torch.device("cpu"))
    block = adapter.compile_units()[0]
    full = block if part is None else getattr(block, part)
    joined = copy.deepcopy(full)
    convert_blocks([joined])
    separate = separately_converted(full)
    members = [m for m in joined.modules() if isinstance(m, Fp8Joint)]
    assert len(members) == siblings and len({id(m.product) for m in members}) == 1
    width = next(m for m in full.modules() if isinstance(m, torch.nn.Linear)).in_features
    torch.manual_seed(1)
    x, other = torch.randn(2, 17, width), torch.randn(2, 17, width)

    def call(module: torch.nn.Module, value: torch.Tensor) -> torch.Tensor:
        out = module(value, attention_mask=None) if part is None else module(value)
        return out[0] if isinstance(out, tuple) else out

    products = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        products.append(sum("scaled_mm" in str(node.target) for node in gm.graph.nodes))
        return gm

    with torch.inference_mode():
        got, exact = call(joined, x), call(full, x)
        torch.testing.assert_close(got, call(separate, x), rtol=1e-5, atol=1e-5)
        assert torch.nn.functional.cosine_similarity(got.flatten(0, -2), exact.flatten(0, -2)).min() > 0.99
        assert all(m.shared.input is None and m.shared.output is None for m in members)
        torch.testing.assert_close(call(joined, other), call(separate, other), rtol=1e-5, atol=1e-5)
        joined.compile(backend=counting, dynamic=True)
        torch.testing.assert_close(call(joined, x), got, rtol=1e-5, atol=1e-5)
        assert all(m.shared.input is None for m in members)
    products_made = sum(isinstance(m, Fp8Linear) for m in joined.modules())  # modules() counts the shared one once
    assert products == [products_made] and products_made == fp8_layers_in(joined) - siblings + 1


def test_a_joined_layer_called_out_of_order_or_on_other_inputs_gives_its_own_output() -> None:
    """The siblings' shared product is reused only for the very input it was made from:
    any order, a repeated call, or a different input of equal values still gives each
    layer its own `x @ W.T + b`."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(40, width) for width in (24, 40, 8)]
    holder = torch.nn.Module()
    for name, layer in zip(("q_proj", "k_proj", "v_proj"), layers):
        setattr(holder, name, layer)
    convert_blocks([holder])
    members = [holder.q_proj, holder.k_proj, holder.v_proj]
    assert all(isinstance(m, Fp8Joint) for m in members)
    x, y = torch.randn(5, 40), torch.randn(5, 40)
    calls = [(2, x), (0, x), (0, x), (1, y), (2, x), (1, x), (0, y.clone())]
    with torch.inference_mode():
        for index, value in calls:
            want = Fp8Linear(layers[index])(value)
            got = members[index](value)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kept_layers_stay_in_full_precision_and_bring_the_vectors_closer(tmp_path: Path, cache_dir: str) -> None:
    """The demo job with model.fp8_keep: the kept layers run as they are in every block,
    the stats leave them out of the FP8 layers, the rows are the same and each vector is
    closer to the full-precision job's than every-layer FP8 puts it, on the whole."""
    common = ("--set", "runtime.workers=0")
    assert run(tmp_path / "full", cache_dir, *common) == 0
    assert run(tmp_path / "fp8", cache_dir, *common, "--set", "model.precision=fp8") == 0
    kept = ("--set", "model.fp8_keep=[attn.proj, mlp.down_proj]")
    assert run(tmp_path / "kept", cache_dir, *common, "--set", "model.precision=fp8", *kept) == 0
    (full_rows, full), (_, fp8), (kept_rows, kept_vectors) = (embeddings(tmp_path / n) for n in ("full", "fp8", "kept"))
    assert [(r["row"], r["error"]) for r in kept_rows] == [(r["row"], r["error"]) for r in full_rows]
    stats = json.loads((tmp_path / "kept" / "_embedjob" / "stats-00000.json").read_text())
    assert stats["fp8_layers"] == {name: 4 for name in ("attn.qkv", "mlp.gate_proj", "mlp.up_proj")}
    described = json.loads(pq.read_schema(sorted((tmp_path / "kept").glob("part-*.parquet"))[0]).metadata[b"embedjob"])
    assert described["fp8_keep"] == ["attn.proj", "mlp.down_proj"] and "fp8_calibrate" not in described
    assert (1 - cosines(kept_vectors, full)).mean() < (1 - cosines(fp8, full)).mean()


def test_keeping_one_sibling_joins_the_others_and_leaves_its_norm_and_mlp_apart(cache_dir: str) -> None:
    """SigLIP with v_proj kept: q and k share one product without it, and the norm that v
    reads runs on its own; Qwen with its down projection kept: gate and up stay joined
    but no gated FP8 MLP forms. Each converted block computes what the block with its
    remaining layers in FP8 on their own computes."""
    siglip = {"family": "siglip", "path": "builtin:tiny-siglip"}
    full = load_adapter(make_job(cache_dir, model=siglip), torch.device("cpu"))
    kept = load_adapter(make_job(cache_dir, model={**siglip, "precision": "fp8", "fp8_keep": ["self_attn.v_proj"]}),
                        torch.device("cpu"))
    assert "self_attn.v_proj" not in kept.fp8_layers and kept.fp8_layers["self_attn.q_proj"] == len(kept.compile_units())
    for block in kept.compile_units():
        attention = block.self_attn
        assert type(attention.v_proj) is torch.nn.Linear and isinstance(block.layer_norm1, torch.nn.LayerNorm)
        assert isinstance(attention.q_proj, Fp8Joint) and attention.q_proj.siblings == 2 and attention.q_proj.product.norm is None
    reference = full.compile_units()[0]
    expected = copy.deepcopy(reference)
    for name in ("q_proj", "k_proj", "out_proj"):
        setattr(expected.self_attn, name, Fp8Linear(getattr(reference.self_attn, name)))
    expected.mlp.fc1, expected.mlp.fc2 = Fp8Linear(reference.mlp.fc1), Fp8Linear(reference.mlp.fc2)
    width = reference.self_attn.q_proj.in_features
    torch.manual_seed(4)
    x = torch.randn(2, 9, width) * 2 + 0.5
    with torch.inference_mode():
        got, want = kept.compile_units()[0](x, attention_mask=None), expected(x, attention_mask=None)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert torch.nn.functional.cosine_similarity(got.flatten(0, -2), want.flatten(0, -2)).min() > 0.999

    qwen = load_adapter(make_job(cache_dir, model={"precision": "fp8", "fp8_keep": ["mlp.down_proj"]}), torch.device("cpu"))
    for block in qwen.compile_units():
        assert not isinstance(block.mlp, Fp8GatedMlp) and type(block.mlp.down_proj) is torch.nn.Linear
        assert isinstance(block.mlp.gate_proj, Fp8Joint) and block.mlp.gate_proj.shared is block.mlp.up_proj.shared


def test_a_kept_layer_no_block_has_or_a_keep_without_fp8_stops_before_any_row(tmp_path: Path, cache_dir: str, capsys) -> None:
    """A misspelt path names the blocks' real ones; model.fp8_keep in a bf16 job is a spec error."""
    assert run(tmp_path, cache_dir, "--set", "model.precision=fp8", "--set", "model.fp8_keep=[attn.out_proj]") == 2
    err = capsys.readouterr().err
    assert "model.fp8_keep names attn.out_proj, which no block of this tower has" in err
    assert "attn.proj, attn.qkv, mlp.down_proj, mlp.gate_proj, mlp.up_proj" in err
    assert run(tmp_path, cache_dir, "--set", "model.fp8_keep=[attn.proj]") == 2
    assert "model.precision is not fp8; remove model.fp8_keep" in capsys.readouterr().err
    assert not list(tmp_path.glob("part-*.parquet"))


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
    assert "fp8_keep" not in fp8["model"]
    def kept(layers: list[str]) -> dict:
        return job_fingerprint(make_job(cache_dir, input={"path": str(table)}, model={"precision": "fp8", "fp8_keep": layers}))

    assert kept(["mlp.down_proj", "attn.proj"])["model"]["fp8_keep"] == ["attn.proj", "mlp.down_proj"]
    assert kept(["attn.proj", "mlp.down_proj", "attn.proj"]) == kept(["mlp.down_proj", "attn.proj"]) != kept(["attn.proj"])


@pytest.mark.parametrize(
    ("act", "expected"),
    [("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"), ("gelu", "gelu"), ("quick_gelu", "quick_gelu"),
     ("relu", None), ("silu", None)],
)
def test_activations_are_recognised_by_their_values(act: str, expected: str | None) -> None:
    from transformers.activations import ACT2FN

    from embedjob.encoders.fp8 import recognised_activation

    assert recognised_activation(ACT2FN[act]) == expected


@pytest.mark.parametrize(("family", "activation", "norm"), [("siglip", "activation_fn", "layer_norm2"),
                                                            ("clip", "activation_fn", "layer_norm2"),
                                                            ("dinov2", "activation_fn", "norm2"), ("qwen2_vl", "act", "norm2")])
def test_the_mlp_activation_runs_inside_the_fp8_layer_that_reads_it(family: str, activation: str, norm: str, cache_dir: str) -> None:
    """fc2 applies the MLP's activation as it quantises its input (the activation module
    becomes an identity), fc1 the norm before the MLP: norm and MLP compute what they do
    with the norm and the activation on their own, to FP8 rounding, and the embeddings
    stay within FP8 rounding of full precision."""
    job = make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"})
    full = load_adapter(job, torch.device("cpu"))
    fp8 = load_adapter(make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}", "precision": "fp8"}),
                       torch.device("cpu"))
    block, reference = fp8.compile_units()[0], full.compile_units()[0]
    mlp = block.mlp
    assert mlp.fc2.activation is not None and isinstance(getattr(mlp, activation), torch.nn.Identity)
    assert mlp.fc1.norm is not None and isinstance(getattr(block, norm), torch.nn.Identity)
    separate = separately_converted(reference.mlp)
    torch.manual_seed(2)
    x = torch.randn(3, 11, reference.mlp.fc1.in_features) * 4 + 1
    with torch.inference_mode():
        got, want = mlp(getattr(block, norm)(x)), separate(getattr(reference, norm)(x))
        assert torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1)).min() > 0.999
        items = [full.preprocessor()(SimpleNamespace(pixels=np.array(Image.open(path).convert("RGB")))) for path in PHOTOS]
        a = full.forward(full.eager_inputs(items)).float()
        b = fp8.forward(fp8.eager_inputs(items)).float()
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.99


@pytest.mark.parametrize(
    ("family", "norms"),
    [("siglip", {"layer_norm1": ("self_attn.q_proj", "layer_norm"), "layer_norm2": ("mlp.fc1", "layer_norm")}),
     ("dinov2", {"norm1": ("attention.q_proj", "layer_norm"), "norm2": ("mlp.fc1", "layer_norm")}),
     ("qwen2_5_vl", {"norm1": ("attn.qkv", "rms_norm"), "norm2": ("mlp.gate_proj", "rms_norm")})],
)
def test_the_blocks_norms_run_inside_the_fp8_layers_that_read_them(family: str, norms: dict, cache_dir: str) -> None:
    """Each block's norms become identities and the FP8 layers reading them normalise
    their input as they quantise it (once for joined siblings); a whole block computes
    what the block with its norms on their own and every layer in FP8 computes, and so
    does the tower's first block when given an input its norm must not see twice."""
    model = {"family": family, "path": f"builtin:tiny-{family}"}
    full = load_adapter(make_job(cache_dir, model=model), torch.device("cpu"))
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), torch.device("cpu"))
    for block in fp8.compile_units():
        for norm, (reader, kind) in norms.items():
            layer = block.get_submodule(reader)
            product = layer.product if isinstance(layer, Fp8Joint) else layer
            assert isinstance(block.get_submodule(norm), torch.nn.Identity) and product.norm.kind == kind
    reference = separately_converted(full.compile_units()[0])
    block = fp8.compile_units()[0]
    width = next(m for m in reference.modules() if isinstance(m, Fp8Linear)).in_features
    torch.manual_seed(3)
    with torch.inference_mode():
        if family == "qwen2_5_vl":
            x = torch.randn(1, 16, width) * 2 + 0.5
            got, want = block.mlp(block.norm2(x)), reference.mlp(reference.norm2(x))
        else:
            x = torch.randn(2, 9, width) * 2 + 0.5
            got, want = block(x, attention_mask=None), reference(x, attention_mask=None)
            got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, -2).float(), want.flatten(0, -2).float())
    assert cos.min() > 0.999, float(cos.min())


def qwen_block(intermediate: int, act: str = "silu", mlp: type | None = None) -> torch.nn.Module:
    """A tiny Qwen2.5-VL vision block (the builtin tower's sizes, fixed seed) with that
    MLP width and activation, optionally its MLP of class `mlp` instead."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock

    from embedjob.encoders.qwen import BUILTIN_CONFIGS

    config = Qwen2_5_VLVisionConfig(**{**BUILTIN_CONFIGS["qwen2_5_vl"], "intermediate_size": intermediate, "hidden_act": act})
    torch.manual_seed(0)
    block = Qwen2_5_VLVisionBlock(config)
    if mlp is not None:
        block.mlp = mlp(config, bias=True)
    return block.eval()


def mlp_outputs(block: torch.nn.Module, reference: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP of each block on its norm of one random input, flattened to rows."""
    torch.manual_seed(4)
    x = torch.randn(2, 23, reference.norm2.weight.shape[0]) * 2 + 0.5
    with torch.inference_mode():
        return block.mlp(block.norm2(x)).flatten(0, 1), reference.mlp(reference.norm2(x)).flatten(0, 1)


@pytest.mark.parametrize("intermediate", [256, 100])
def test_a_gated_mlps_down_projection_forms_silu_gate_times_up_from_the_joined_product(intermediate: int) -> None:
    """Qwen2.5-VL's MLP becomes an `Fp8GatedMlp`: gate and up stay one joined product
    (reading the block's norm), down forms silu(gate) * up from its output rows (the up
    half at a multiple of 16 where the width is not one), so the compiled MLP runs two
    FP8 products and no more; it computes the MLP to FP8 rounding and what every layer in
    FP8 on its own computes, and the counts name the same layers as before."""
    reference = qwen_block(intermediate)
    block = copy.deepcopy(reference)
    assert convert_blocks([block]) == {name: 1 for name in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    mlp = block.mlp
    assert isinstance(mlp, Fp8GatedMlp) and mlp.activation == "silu" and not hasattr(mlp, "act_fn")
    assert mlp.gate_proj.product is mlp.up_proj.product and mlp.up_start == -(-intermediate // 16) * 16
    assert mlp.gate_proj.product.norm.kind == "rms_norm" and isinstance(block.norm2, torch.nn.Identity)
    assert fp8_layers_in(block) == 5
    got, exact = mlp_outputs(block, reference)
    _, separate = mlp_outputs(block, separately_converted(reference))
    assert torch.nn.functional.cosine_similarity(got, exact).min() > 0.99
    assert torch.nn.functional.cosine_similarity(got, separate).min() > 0.999
    products = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        products.append(sum("scaled_mm" in str(node.target) for node in gm.graph.nodes))
        return gm

    mlp.compile(backend=counting, dynamic=True)
    compiled, _ = mlp_outputs(block, reference)
    torch.testing.assert_close(compiled, got, rtol=1e-5, atol=1e-5)
    assert products == [2]


class SwappedMlp(torch.nn.Module):
    """An MLP with Qwen2.5-VL's layer names whose forward gates the other way round."""

    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


@pytest.mark.parametrize(
    ("act", "mlp", "gated_mlps"),
    [("gelu_pytorch_tanh", None, None), ("relu", None, None), ("silu", SwappedMlp, None), ("silu", None, ())],
)
def test_a_gated_mlp_that_is_not_silu_gate_times_up_keeps_its_own_forward(
    act: str, mlp: type | None, gated_mlps: tuple | None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another activation (one the row kernel has for ungated MLPs, one it has not), a
    forward that the probe at load finds other than down(silu(gate) * up) (a warning
    says so) and `GATED_MLPS` empty (benchmarks/precision.py's fp8-gated-apart): the
    MLP keeps its module and activation, its layers are FP8 (gate and up still joined)
    and it computes what it did to FP8 rounding."""
    from embedjob.encoders import fp8

    if gated_mlps is not None:
        monkeypatch.setattr(fp8, "GATED_MLPS", gated_mlps)
    reference = qwen_block(100, act, mlp)
    block = copy.deepcopy(reference)
    with caplog.at_level("WARNING", logger="embedjob.encoders.fp8"):
        converted = convert_blocks([block])
    assert type(block.mlp) is type(reference.mlp) and type(block.mlp.act_fn) is type(reference.mlp.act_fn)
    assert ("does not compute down_proj(silu(gate_proj(x)) * up_proj(x))" in caplog.text) == (mlp is SwappedMlp)
    assert isinstance(block.mlp.gate_proj, Fp8Joint) and isinstance(block.mlp.down_proj, Fp8Linear)
    assert converted["mlp.down_proj"] == 1 and fp8_layers_in(block) == 5
    got, exact = mlp_outputs(block, reference)
    assert torch.nn.functional.cosine_similarity(got, exact).min() > 0.99


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_vl"])
def test_qwen3_blocks_in_fp8_apply_their_norms_and_tanh_gelu_as_they_quantise(family: str, cache_dir: str) -> None:
    """Qwen3.5's (and Qwen3-VL's) blocks: qkv, proj, linear_fc1 and linear_fc2 in FP8,
    linear_fc2 applying the MLP's tanh GELU and qkv and linear_fc1 the layer norms before
    them; a block computes what it computes with each layer in FP8 on its own, and the
    photos' embeddings stay within FP8 rounding of full precision."""
    model = {"family": family, "path": f"builtin:tiny-{family}"}
    full = load_adapter(make_job(cache_dir, model=model), torch.device("cpu"))
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), torch.device("cpu"))
    blocks = len(fp8.compile_units())
    assert fp8.fp8_layers == {name: blocks for name in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    block = fp8.compile_units()[0]
    assert block.mlp.linear_fc2.activation == "gelu_tanh" and isinstance(block.mlp.act_fn, torch.nn.Identity)
    assert block.attn.qkv.norm.kind == block.mlp.linear_fc1.norm.kind == "layer_norm"
    assert isinstance(block.norm1, torch.nn.Identity) and isinstance(block.norm2, torch.nn.Identity)
    reference = separately_converted(full.compile_units()[0])
    torch.manual_seed(4)
    x = torch.randn(24, reference.mlp.linear_fc1.in_features) * 2 + 0.5
    with torch.inference_mode():
        got, want = block.mlp(block.norm2(x)), reference.mlp(reference.norm2(x))
        assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999
        items = [full.preprocessor()(SimpleNamespace(pixels=np.array(Image.open(path).convert("RGB")))) for path in PHOTOS]
        a = full.forward(full.eager_inputs(items)).float()
        b = fp8.forward(fp8.eager_inputs(items)).float()
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.99


KERNEL_HELPERS = Path(__file__).with_name("fp8_kernel_helpers.py")


def test_the_row_kernel_quantises_as_the_torch_path_does_in_tritons_interpreter() -> None:
    """The kernel CUDA layers use, run by Triton's interpreter on the CPU: the torch path's
    scales (a row of zeros among them: the smallest scale) and zero padding, after a layer
    norm, an RMS norm, an activation or none, and of a gated MLP's joined gate|up row; a
    row held in up to three blocks (SigLIP's 1,152 as 1,024 + 128) gives the bytes of the
    same row held in one. Its FP8 values are tests/test_gpu.py's to check, on a GPU."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, str(KERNEL_HELPERS)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert len(results) == 16
    wrong = [r for r in results if not (r["padding_zero"] and r["scale_error"] < 1e-5 and r["as_one_block"])]
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.parametrize("width, norm, activation", [(1152, 1, 0), (4304, 0, 1), (1024, 0, 3), (1280, 2, 0)])
def test_the_row_kernels_compile_for_hopper_at_the_towers_widths(width: int, norm: int, activation: int) -> None:
    """CI has no GPU, but Triton's compiler (its ptxas included) builds the row kernel for
    an H100 or H200 (sm_90): one that only the device would reject fails here first. The
    widths are SigLIP's q/k/v and fc2 inputs, CLIP's fc2 and Qwen's q/k/v."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from embedjob.encoders import fp8
    from embedjob.encoders.fp8_kernel import fp8_quantize_rows_kernel

    pointers = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "w_ptr": "*bf16", "b_ptr": "*bf16", "stride": "i64"}
    head, mid, tail = fp8.row_blocks(fp8._padded(width), fp8.ROW_BLOCKS)
    constants = {"HEAD": head, "MID": mid, "TAIL": tail, "TINY": fp8._TINY, "LIMIT": fp8.FP8_MAX,
                 "ACTIVATION": activation, "NORM": norm, "EPS": 1e-6}
    scalars = {"cols": "i32", "padded": "i32", "up": "i32"}
    for gated in (False, True):
        names = {**constants, "GATED": gated}
        source = ASTSource(fp8_quantize_rows_kernel, {**pointers, **scalars, **{name: "constexpr" for name in names}}, names)
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert built.asm["cubin"], f"gated {gated}"


@given(st.integers(1, 1024).map(lambda n: 16 * n), st.integers(1, 3))
@example(1152, 3)
def test_the_row_kernels_blocks_cover_a_row_with_fewer_lanes_than_a_power_of_two(padded: int, most: int) -> None:
    """The blocks a row kernel's program holds a row in (`fp8.row_blocks`) are at most
    `most` powers of two, largest first, covering the row; past the largest, the lanes
    they add beyond the row are fewer than the smallest block (no block is wasted), and
    never more than one block of the next power of two has; one block is that power of two."""
    from embedjob.encoders.fp8 import row_blocks

    blocks = row_blocks(padded, most)
    widths = [width for width in blocks if width]
    assert len(blocks) == 3 and 1 <= len(widths) <= most and blocks[len(widths):] == (0,) * (3 - len(widths))
    assert all(width & (width - 1) == 0 for width in widths) and widths == sorted(widths, reverse=True)
    assert padded <= sum(widths) <= 1 << (padded - 1).bit_length()
    assert len(widths) == 1 or sum(widths) - padded < widths[-1]
    if most == 1:
        assert widths == [1 << (padded - 1).bit_length()]
    if padded == 1152 and most == 3:  # SigLIP's width: 1,024 + 128 lanes, not 2,048
        assert widths == [1024, 128]


def test_calibrated_rounding_moves_the_output_on_such_inputs_less_than_rounding_to_nearest() -> None:
    """On inputs like those of the product (correlated columns, as real tokens have), the
    calibrated rows' output error is well below nearest rounding's, on other inputs of the
    same kind too; the scales are nearest rounding's, so a layer takes either; a column
    whose inputs were all zero is rounded to nearest."""
    from embedjob.encoders.fp8 import calibrated_rows, quantize_rows

    torch.manual_seed(0)
    weight = torch.randn(96, 160)
    mixing = torch.randn(160, 160) / 4 + torch.eye(160)

    def inputs(rows: int) -> torch.Tensor:
        x = torch.randn(rows, 160) @ mixing + 2.0
        x[:, 7] = 0.0  # a column no calibration input reaches
        return x

    seen = inputs(512)
    quantized, scale = calibrated_rows(weight, seen.T @ seen)
    nearest, nearest_scale = quantize_rows(weight)
    assert quantized.dtype == torch.float8_e4m3fn and torch.equal(scale, nearest_scale)
    assert torch.equal(quantized[:, 7], nearest[:, 7])
    held_out = inputs(256)
    exact = held_out @ weight.T

    def error(q: torch.Tensor) -> float:
        return float((held_out @ (q.float() * scale).T - exact).norm() / exact.norm())

    assert error(quantized) < 0.75 * error(nearest)


def test_a_product_that_cannot_be_inverted_rounds_to_nearest_with_a_warning(caplog) -> None:
    from embedjob.encoders.fp8 import calibrated_rows, quantize_rows

    weight = torch.randn(32, 48)
    product = torch.full((48, 48), float("nan"))
    with caplog.at_level("WARNING"):
        quantized, scale = calibrated_rows(weight, product)
    assert all(torch.equal(a, b) for a, b in zip((quantized.float(), scale), (t.float() for t in quantize_rows(weight))))
    assert "cannot be inverted" in caplog.text


def test_input_products_are_what_each_layer_read_and_siblings_share_theirs(cache_dir: str) -> None:
    """SigLIP's q, k and v read the normed state: one product, equal to x^T x of those
    rows; fc2 reads the activation; after the block nothing is hooked any more."""
    from embedjob.encoders.fp8 import input_products

    adapter = load_adapter(make_job(cache_dir, model={"family": "siglip", "path": "builtin:tiny-siglip"}), torch.device("cpu"))
    block = adapter.compile_units()[0]
    torch.manual_seed(1)
    x = torch.randn(2, 5, block.self_attn.q_proj.in_features)
    seen: dict[str, torch.Tensor] = {}

    def read(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen["fc2"] = args[0].reshape(-1, args[0].shape[-1])

    block.mlp.fc2.register_forward_pre_hook(read)
    with torch.inference_mode(), input_products([block]) as products:
        block(x, attention_mask=None)
    normed = block.layer_norm1(x).reshape(-1, x.shape[-1])
    attention = block.self_attn
    torch.testing.assert_close(products[attention.q_proj], normed.T @ normed, rtol=1e-5, atol=1e-4)
    assert torch.equal(products[attention.q_proj], products[attention.v_proj])
    torch.testing.assert_close(products[block.mlp.fc2], seen["fc2"].T @ seen["fc2"], rtol=1e-5, atol=1e-4)
    assert len(products) == sum(type(m) is torch.nn.Linear for m in block.modules())
    with torch.inference_mode(), input_products([block], keep=["mlp.fc2"]) as kept:
        block(x, attention_mask=None)
    assert block.mlp.fc2 not in kept and len(kept) == len(products) - 1
    with torch.inference_mode(), input_products([]) as none:
        block(x, attention_mask=None)
    assert none == {} and not attention.q_proj._forward_pre_hooks


def test_calibrated_fp8_job_is_closer_to_full_precision_on_rows_it_was_not_calibrated_on(tmp_path: Path, cache_dir: str, caplog) -> None:
    """The demo job with model.fp8_calibrate: 4 (the input's first four rows): the rows
    are those of the full-precision job, the log names what calibrated, and on the other
    rows the vectors are closer to full precision than nearest rounding puts them."""
    common = ("--set", "runtime.workers=0", "--set", "model.precision=fp8")
    assert run(tmp_path / "full", cache_dir, "--set", "runtime.workers=0") == 0
    assert run(tmp_path / "fp8", cache_dir, *common) == 0
    with caplog.at_level("INFO"):
        assert run(tmp_path / "calibrated", cache_dir, *common, "--set", "model.fp8_calibrate=4") == 0
    assert "model.fp8_calibrate: the inputs of 20 linear layers read over 4 rows (of the input's first 4)" in caplog.text
    assert "weights rounded to suit the calibration rows' inputs in" in caplog.text
    (full_rows, full), (_, fp8), (rows, calibrated) = (embeddings(tmp_path / n) for n in ("full", "fp8", "calibrated"))
    assert [(r["row"], r["error"]) for r in rows] == [(r["row"], r["error"]) for r in full_rows]
    for path in sorted((tmp_path / "calibrated").glob("part-*.parquet")):
        described = json.loads(pq.read_schema(path).metadata[b"embedjob"])
        assert (described["precision"], described["fp8_calibrate"]) == ("fp8", 4) and "fp8_keep" not in described
    other = slice(4, None)
    assert (1 - cosines(calibrated[other], full[other])).mean() < 0.7 * (1 - cosines(fp8[other], full[other])).mean()


def test_every_shard_calibrates_on_the_same_rows(tmp_path: Path, cache_dir: str) -> None:
    """Shard 1/2 starts at row 6 but calibrates on the input's first rows, as shard 0/2
    and a one-shard run do: the two shards' vectors are the one-shard run's, bit for bit."""
    common = ("--set", "runtime.workers=0", "--set", "model.precision=fp8", "--set", "model.fp8_calibrate=3")
    assert run(tmp_path / "one", cache_dir, *common) == 0
    for shard in ("0/2", "1/2"):
        assert run(tmp_path / "two", cache_dir, *common, "--shard", shard) == 0
    (one_rows, one), (two_rows, two) = embeddings(tmp_path / "one"), embeddings(tmp_path / "two")
    assert [r["id"] for r in two_rows] == [r["id"] for r in one_rows]
    assert np.array_equal(one, two)


def test_calibration_where_the_first_rows_do_not_decode(tmp_path: Path, cache_dir: str, caplog, capsys) -> None:
    """Fewer rows that decode than asked: a warning and the job runs on those; none among
    the rows read: one line naming their errors and what to change, before any part."""
    photo = PHOTOS[0].read_bytes()
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": [b"not an image"] * 3 + [photo] + [b"junk"] * 6}), table)
    job = ("--set", f"input.path={table}", "--set", "input.id_column=null", "--set", "runtime.workers=0",
           "--set", "model.precision=fp8", "--set", "runtime.max_error_rate=null")
    with caplog.at_level("WARNING"):
        assert run(tmp_path / "few", cache_dir, *job, "--set", "model.fp8_calibrate=2") == 0
    assert "model.fp8_calibrate asks for 2 rows; only 1 of the input's first 8 rows decoded (unknown_format 7)" in caplog.text
    pq.write_table(pa.table({"image": [b"not an image"] * 10 + [photo]}), table)
    assert run(tmp_path / "none", cache_dir, *job, "--set", "model.fp8_calibrate=2") == 2
    err = capsys.readouterr().err
    assert "model.fp8_calibrate: none of the input's first 8 rows decoded (unknown_format 8)" in err
    assert "set model.fp8_calibrate: 0" in err and not list((tmp_path / "none").glob("part-*.parquet"))


def test_calibration_is_in_the_fingerprint_and_needs_fp8(tmp_path: Path, cache_dir: str, capsys) -> None:
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": [b"x"]}), table)

    def model(values: dict) -> dict:
        return job_fingerprint(make_job(cache_dir, input={"path": str(table)}, model=values))["model"]

    assert "fp8_calibrate" not in model({"precision": "fp8"})
    assert model({"precision": "fp8", "fp8_calibrate": 64})["fp8_calibrate"] == 64
    assert run(tmp_path, cache_dir, "--set", "model.fp8_calibrate=8") == 2
    assert "model.precision is not fp8; remove model.fp8_calibrate" in capsys.readouterr().err
