"""The MLPs' GELUs in the products' epilogue (`encoders.epilogues`): which blocks are
changed, and that a changed block computes what it computed; the Triton GEMM behind
`epilogues.TRITON_EPILOGUES` (`encoders.gemm_kernel`) in Triton's interpreter."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, make_job

from embedjob.encoders import epilogues, load_adapter
from embedjob.encoders.epilogues import ActivationLinear, GeluLinear, fuse_gelu_epilogues

CPU = torch.device("cpu")


def blocks_of(cache_dir: str, family: str) -> list[torch.nn.Module]:
    adapter = load_adapter(make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"}), CPU)
    return adapter.compile_units()


def test_siglips_gelu_moves_into_fc1_and_each_block_computes_what_it_did(cache_dir: str) -> None:
    blocks = blocks_of(cache_dir, "siglip")
    before = copy.deepcopy(blocks)
    linears = [block.mlp.fc1 for block in blocks]
    fused = fuse_gelu_epilogues(blocks)
    assert fused == {"mlp.fc1": len(blocks)}
    states = torch.randn(3, 17, blocks[0].mlp.fc1.in_features, generator=torch.Generator().manual_seed(0))
    for old, new, linear in zip(before, blocks, linears):
        assert isinstance(new.mlp.fc1, GeluLinear) and isinstance(new.mlp.activation_fn, torch.nn.Identity)
        assert new.mlp.fc1.weight is linear.weight and new.mlp.fc1.bias is linear.bias  # shared, not copied
        with torch.no_grad():
            want, got = old.mlp(states), new.mlp(states)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["clip", "dinov2"])
def test_towers_whose_gelu_is_not_the_tanh_one_are_left_alone(cache_dir: str, family: str) -> None:
    """CLIP's quick GELU and DINOv2's exact GELU are not what cuBLASLt's epilogue computes."""
    blocks = blocks_of(cache_dir, family)
    assert fuse_gelu_epilogues(blocks) == {}
    assert not any(isinstance(m, GeluLinear) for block in blocks for m in block.modules())


def test_a_layer_without_bias_cannot_take_the_epilogue() -> None:
    with pytest.raises(ValueError, match="needs the layer's bias"):
        GeluLinear(torch.nn.Linear(8, 8, bias=False))


def test_an_adapter_on_the_cpu_keeps_its_mlps_as_they_are(cache_dir: str) -> None:
    """The epilogue is cuBLASLt's: on the CPU the tower stays transformers' own."""
    blocks = blocks_of(cache_dir, "siglip")
    assert not any(isinstance(m, GeluLinear) for block in blocks for m in block.modules())


def clip_vision(hidden_act: str) -> torch.nn.Module:
    """A tiny CLIP vision model (the builtin tower's sizes) of `hidden_act`, random weights (seed 0)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=64, patch_size=16, hidden_act=hidden_act)
    return CLIPVisionModel(config).eval()


def test_where_the_triton_gemm_pays_clips_fc1_takes_its_quick_gelu_and_the_model_computes_what_it_did() -> None:
    """Fused for the Triton GEMM (`triton_gemm_pays`): CLIP's quick GELU moves into fc1, a
    layer that runs our Triton GEMM on CUDA; on the CPU the model's outputs stay what they were."""
    model = clip_vision("quick_gelu")
    before = copy.deepcopy(model)
    blocks = model.encoder.layers
    linears = [block.mlp.fc1 for block in blocks]
    assert fuse_gelu_epilogues(blocks, triton=True) == {"mlp.fc1": len(blocks)}
    for block, linear in zip(blocks, linears):
        assert isinstance(block.mlp.fc1, ActivationLinear) and block.mlp.fc1.activation == "quick_gelu"
        assert isinstance(block.mlp.activation_fn, torch.nn.Identity)
        assert block.mlp.fc1.weight is linear.weight and block.mlp.fc1.bias is linear.bias  # shared, not copied
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = before(pixel_values=pixels), model(pixel_values=pixels)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hidden_act, triton", [("quick_gelu", False), ("gelu", True)])
def test_clips_mlps_stay_as_they_are_off_the_triton_gpus_or_with_an_untimed_gelu(hidden_act: str, triton: bool) -> None:
    """Where the Triton GEMM does not pay, CLIP's quick GELU stays a module of its own after
    its fc1; an exact GELU, which the kernel computes but no tower of which was timed, stays
    so everywhere."""
    model = clip_vision(hidden_act)
    modules = list(model.modules())
    assert fuse_gelu_epilogues(model.encoder.layers, triton=triton) == {}
    assert list(model.modules()) == modules


@pytest.mark.parametrize("setting, capability, pays", [(True, (9, 0), True), (True, (10, 0), True), (True, (8, 0), False),
                                                       (False, (9, 0), False)])
def test_the_triton_gemm_is_used_on_hopper_and_blackwell_gpus_while_the_setting_is_on(
    monkeypatch: pytest.MonkeyPatch, setting: bool, capability: tuple[int, int], pays: bool
) -> None:
    """The quick GELU goes to the Triton GEMM only where it reads through TMA and was timed
    (an A100 keeps cuBLAS's product and the GELU kernel), never on a CPU."""
    monkeypatch.setattr(epilogues, "TRITON_EPILOGUES", setting)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert epilogues.triton_gemm_pays(torch.device("cuda", 0)) is pays
    assert epilogues.triton_gemm_pays(CPU) is False


def test_the_triton_gemm_takes_only_the_gelus_cublaslt_lacks_and_a_bias() -> None:
    with pytest.raises(ValueError, match="not 'gelu_tanh'"):
        ActivationLinear(torch.nn.Linear(8, 8), "gelu_tanh")
    with pytest.raises(ValueError, match="needs the layer's bias"):
        ActivationLinear(torch.nn.Linear(8, 8, bias=False), "quick_gelu")


def test_the_gemm_op_refuses_cpu_tensors_and_gives_the_compiler_its_output_shape() -> None:
    """`torch.ops.embedjob.linear_activation` runs on CUDA only; traced on fake CUDA tensors
    (as torch.compile traces a block) it gives its [M, N] output without running a kernel."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from embedjob.encoders import gemm_kernel

    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    with pytest.raises(ValueError, match="on one CUDA device"):
        gemm_kernel.linear_activation(x.bfloat16(), w.bfloat16(), b.bfloat16(), "quick_gelu")
    with FakeTensorMode():
        x, w, b = (t.to("cuda", torch.bfloat16) for t in (torch.empty(300, 64), torch.empty(128, 64), torch.empty(128)))
        out = torch.ops.embedjob.linear_activation(x, w, b, "gelu")
        assert (out.shape, out.dtype, out.device.type) == ((300, 128), torch.bfloat16, "cuda")
        with pytest.raises(ValueError, match="'silu' is not one of"):
            torch.ops.embedjob.linear_activation(x, w, b, "silu")


def test_the_persistent_gemm_leaves_the_sms_torchs_carveout_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A persistent GEMM holds every SM it runs on, so under torch's SM carveout (a GPU
    decoding videos beside the encoder: `pipeline.GPU_DECODE_SM_CARVEOUT`) it runs that many
    programs fewer, never none; without one, a program per SM."""
    pytest.importorskip("triton")
    from embedjob.encoders import gemm_kernel

    monkeypatch.setattr(gemm_kernel, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda", 0)
    before = torch._C._get_sm_carveout_experimental()
    try:
        torch._C._set_sm_carveout_experimental(None)
        assert gemm_kernel.programs(gpu) == 132
        torch._C._set_sm_carveout_experimental(16)
        assert gemm_kernel.programs(gpu) == 116
        torch._C._set_sm_carveout_experimental(200)
        assert gemm_kernel.programs(gpu) == 1
    finally:
        torch._C._set_sm_carveout_experimental(before)


KERNEL_CHECK = """
import torch
from embedjob.encoders import gemm_kernel

EXPECTED = {"quick_gelu": lambda y: y * torch.sigmoid(1.702 * y),
            "gelu": lambda y: 0.5 * y * (1 + torch.erf(y / 2 ** 0.5))}
config = gemm_kernel.Config(32, 32, 16, 4, 2, group_m=2)
m, k, n = 70, 48, 80  # 3 x 3 tiles, the last row and column of tiles partly outside; 4 programs walk them
generator = torch.Generator().manual_seed(0)
x = torch.randn(m, k, generator=generator)
w = torch.randn(n, k, generator=generator) / k ** 0.5
b = 0.5 * torch.randn(n, generator=generator)
for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):  # the interpreter rounds to bf16 toward zero
    xs, ws, bs = (t.to(dtype) for t in (x, w, b))
    for activation, function in EXPECTED.items():
        want = function(xs.double() @ ws.double().T + bs.double())
        for tma in (False, True) if gemm_kernel.TensorDescriptor is not None else (False,):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            a, wt, c = gemm_kernel.operands(xs, ws, out, config, tma)
            gemm_kernel.launch(a, wt, bs, c, (m, k, n), activation, config, 4, tma)
            torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=1e-5, msg=f"{dtype} {activation} tma={tma}")
print("same")
"""


def test_the_triton_gemm_computes_the_activation_of_the_product_plus_bias() -> None:
    """`gemm_kernel`'s kernel, run by Triton's interpreter on the CPU (TMA descriptors and
    pointers): act(x @ W.T + b) for the quick and the exact GELU, to float32's precision in
    float32 and within one bf16 step in bf16, on tiles partly past the matrices' edges."""
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8):
        pytest.skip("Triton 3.6's interpreter fails on a loop bound that is a tensor under numpy 2.5 (gemm_epilogue.py)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]
