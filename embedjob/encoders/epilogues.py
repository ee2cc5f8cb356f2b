"""An MLP's tanh GELU applied by the product before it, in bf16 on CUDA (`model.precision: bf16`).

In SigLIP's blocks the first MLP layer's output, the widest tensor of the block (4,304
columns on SigLIP-so400m), is written by the product, read back by the compiler's GELU
kernel and written again: on the SigLIP-so400m-size tower that kernel took 29 ms of a
390-ms batch of 186,624 tokens (benchmarks/RESULTS.md's git history). cuBLASLt can apply a GELU, in the
tanh approximation, to the product's float32 accumulator before it stores the result
(`torch._addmm_activation(..., use_gelu=True)`, which torch's compiler calls as it is), so
the pre-activation tensor is never written. That GELU is the tanh approximation, so only
MLPs whose activation computes `gelu(x, approximate="tanh")` are changed (SigLIP's
`gelu_pytorch_tanh`; CLIP's quick GELU, DINOv2's exact GELU and Qwen's gated SiLU are
not), recognised by its values, not by its class name.

Invariants: a fused layer computes `gelu_tanh(x @ W.T + b)` for any input row count, the
activation in float32 on CUDA (rounded once, where the separate kernel rounded the
product first); elsewhere it computes the same in two torch calls, so CPU tests check the
conversion. It shares the linear layer's parameters (no copy). Only the blocks' MLPs that
feed their first layer to the activation alone (`EPILOGUE_GELUS`, transformers' modeling
code: fc1, the activation, fc2 in turn) are changed; the FP8 path applies its own
activations (`fp8.ACTIVATION_INTO`) and is left alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from embedjob.encoders.fp8 import recognised_activation

logger = logging.getLogger(__name__)

EPILOGUE_GELUS = (("fc1", "activation_fn"), ("fc1", "act"))
"""(layer, activation) names of the blocks' MLPs whose forward hands that layer's output
to that activation alone and the activation's output to the next layer alone."""
EPILOGUES = True
"""Whether CUDA bf16 adapters fuse their MLPs' tanh GELUs into the products (benchmarks
switch it off to measure the separate kernel). Read when an adapter is loaded."""


class GeluLinear(torch.nn.Module):
    """`gelu(linear(x), approximate="tanh")` of an `nn.Linear` with a bias, as one product
    with a GELU epilogue on CUDA."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if linear.bias is None:
            raise ValueError("a GELU epilogue needs the layer's bias (torch._addmm_activation adds one)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda:
            out = torch._addmm_activation(self.bias, rows, self.weight.t(), use_gelu=True)
        else:  # torch's CPU kernel applies the exact GELU, not the tanh approximation
            out = F.gelu(F.linear(rows, self.weight, self.bias), approximate="tanh")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, epilogue=gelu_tanh"


def fuse_gelu_epilogues(blocks: Iterable[torch.nn.Module]) -> Counter[str]:
    """Replace, in place, each `EPILOGUE_GELUS` layer of the blocks' MLPs whose activation
    is the tanh GELU (by its values) by a `GeluLinear`, and the activation by an identity;
    how many of each layer (name relative to its block, e.g. `mlp.fc1`) were fused."""
    fused: Counter[str] = Counter()
    for block in blocks:
        for path, module in list(block.named_modules()):
            layer_name = _fusable(module)
            if layer_name is None:
                continue
            layer, activation_name = layer_name
            setattr(module, layer, GeluLinear(getattr(module, layer)))
            setattr(module, activation_name, torch.nn.Identity())
            fused[f"{path}.{layer}" if path else layer] += 1
    for name, count in fused.items():
        logger.info("model.precision bf16: %s applies its tanh GELU in its product's epilogue, in %d blocks", name, count)
    return fused


def _fusable(module: torch.nn.Module) -> tuple[str, str] | None:
    """The (layer, activation) names of `module` that `fuse_gelu_epilogues` fuses, or None."""
    for layer, activation in EPILOGUE_GELUS:
        linear, function = getattr(module, layer, None), getattr(module, activation, None)
        if type(linear) is not torch.nn.Linear or linear.bias is None or not isinstance(function, torch.nn.Module):
            continue
        if recognised_activation(function) == "gelu_tanh":
            return layer, activation
    return None
