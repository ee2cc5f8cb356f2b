"""The MLPs' tanh GELU in the products' epilogue (`encoders.epilogues`): which blocks are
changed, and that a changed block computes what it computed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_job

from embedjob.encoders import load_adapter
from embedjob.encoders.epilogues import GeluLinear, fuse_gelu_epilogues

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
