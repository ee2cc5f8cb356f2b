"""An MLP's GELU applied by the product before it, in bf16 on CUDA (`model.precision: bf16`).

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

With `TRITON_EPILOGUES`, on Hopper and datacenter Blackwell GPUs, MLPs whose activation is
the quick GELU (CLIP's, Qwen2-VL's), `TRITON_ACTIVATIONS`, have it applied by our Triton
GEMM (`ActivationLinear`, `gemm_kernel.linear_activation`), which cuBLASLt cannot; the tanh
GELU stays cuBLASLt's.

Invariants: a fused layer computes `act(x @ W.T + b)` (its recognised activation) for any
input row count, the activation in float32 on CUDA (rounded once, where the separate kernel
rounded the product first); elsewhere it computes the same in two torch calls, so CPU tests
check the conversion. It shares the linear layer's parameters (no copy). Only the blocks' MLPs that
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

from embedjob.encoders.fp8 import ACTIVATIONS, recognised_activation

logger = logging.getLogger(__name__)

EPILOGUE_GELUS = (("fc1", "activation_fn"), ("fc1", "act"))
"""(layer, activation) names of the blocks' MLPs whose forward hands that layer's output
to that activation alone and the activation's output to the next layer alone."""
EPILOGUES = True
"""Whether CUDA bf16 adapters fuse their MLPs' tanh GELUs into the products (benchmarks
switch it off to measure the separate kernel). Read when an adapter is loaded."""
TRITON_EPILOGUES = True
"""Whether, with `EPILOGUES`, they also fuse the quick GELU into its product through our
Triton GEMM (`ActivationLinear`), on the GPUs where that GEMM reads through TMA and was timed
(`triton_gemm_pays`). On an H100 it ran CLIP-L's fc1 1.13x cuBLAS's product and the compiled
GELU (benchmarks/gemm_epilogue.py) and the CLIP-L/14-336 tower, compiled in graphs, 1.03x
(1,271.7 images/s against 1,239.9, cosine 0.99996 to it; `benchmarks/precision.py --mixes
clip --precisions bf16-quick-gelu-apart` times it off). Read when an adapter is loaded."""
TRITON_ACTIVATIONS = ("quick_gelu",)
"""The recognised activations (`fp8.ACTIVATIONS` names) that `TRITON_EPILOGUES` fuses through
the Triton GEMM: CLIP's (and Qwen2-VL's) quick GELU, which cuBLASLt has no epilogue for. The
kernel computes the exact GELU too, but no tower of it was timed, so those stay a kernel of
their own; the tanh GELU stays cuBLASLt's."""
EPILOGUE_NAMES = {"gelu_tanh": "tanh GELU", "quick_gelu": "quick GELU (Triton GEMM)"}
"""How the log names each fused activation."""


def triton_gemm_pays(device: torch.device) -> bool:
    """Whether an adapter on `device` fuses `TRITON_ACTIVATIONS` through the Triton GEMM:
    `TRITON_EPILOGUES` is on and `device` is a GPU where the GEMM reads its tiles through TMA
    (`gemm_kernel.TMA_CAPABILITIES`: Hopper and datacenter Blackwell, where it was timed);
    elsewhere cuBLAS's product stays."""
    if not TRITON_EPILOGUES or device.type != "cuda":
        return False
    from embedjob.encoders.gemm_kernel import TMA_CAPABILITIES  # imports Triton: only where CUDA is

    return torch.cuda.get_device_capability(device)[0] in TMA_CAPABILITIES


class EpilogueLinear(torch.nn.Module):
    """`act(linear(x))` of an `nn.Linear` with a bias, `act` the `activation` (an
    `fp8.ACTIVATIONS` name) its product applies on CUDA (`on_cuda`, a subclass's); elsewhere
    the layer and then the activation, as the model computed them. It shares the linear
    layer's parameters."""

    activation = ""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if linear.bias is None:
            raise ValueError("an activation epilogue needs the layer's bias (the product adds one)")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda:
            out = self.on_cuda(rows)
        else:
            out = ACTIVATIONS[self.activation][1](F.linear(rows, self.weight, self.bias))
        return out.reshape(*x.shape[:-1], self.out_features)

    def on_cuda(self, rows: torch.Tensor) -> torch.Tensor:
        """`act(rows @ W.T + b)` as one product with its epilogue (each subclass's own)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, epilogue={self.activation}"


class GeluLinear(EpilogueLinear):
    """`gelu(linear(x), approximate="tanh")` as one product with cuBLASLt's GELU epilogue on CUDA."""

    activation = "gelu_tanh"

    def on_cuda(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._addmm_activation(self.bias, rows, self.weight.t(), use_gelu=True)


class ActivationLinear(EpilogueLinear):
    """`act(linear(x))`, `act` one of `TRITON_ACTIVATIONS`, as one Triton GEMM with the
    activation in its epilogue on CUDA (`torch.ops.embedjob.linear_activation`,
    `gemm_kernel.linear_activation`: registered as the layer is made where CUDA is, never
    inside a compiled region)."""

    def __init__(self, linear: torch.nn.Linear, activation: str) -> None:
        super().__init__(linear)
        if activation not in TRITON_ACTIVATIONS:
            raise ValueError(f"the Triton GEMM applies {TRITON_ACTIVATIONS}, not {activation!r}")
        if torch.cuda.is_available():
            from embedjob.encoders import gemm_kernel  # noqa: F401 - registers the op (and imports Triton)
        self.activation = activation

    def on_cuda(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.embedjob.linear_activation(rows, self.weight, self.bias, self.activation)


def fuse_gelu_epilogues(blocks: Iterable[torch.nn.Module], triton: bool = False) -> Counter[str]:
    """Replace, in place, each `EPILOGUE_GELUS` layer of the blocks' MLPs whose activation
    is the tanh GELU (by its values) by a `GeluLinear`, and, with `triton` (`triton_gemm_pays`),
    each whose activation is one of `TRITON_ACTIVATIONS` by an `ActivationLinear`; the activation
    by an identity. How many of each layer (name relative to its block, e.g. `mlp.fc1`) were fused."""
    fused: Counter[tuple[str, str]] = Counter()
    for block in blocks:
        for path, module in list(block.named_modules()):
            found = _fusable(module, triton)
            if found is None:
                continue
            layer, activation_name, activation = found
            linear = getattr(module, layer)
            setattr(module, layer, GeluLinear(linear) if activation == "gelu_tanh" else ActivationLinear(linear, activation))
            setattr(module, activation_name, torch.nn.Identity())
            fused[f"{path}.{layer}" if path else layer, activation] += 1
    for (name, activation), count in fused.items():
        logger.info("model.precision bf16: %s applies its %s in its product's epilogue, in %d blocks",
                    name, EPILOGUE_NAMES[activation], count)
    by_layer: Counter[str] = Counter()
    for (name, _), count in fused.items():
        by_layer[name] += count
    return by_layer


def _fusable(module: torch.nn.Module, triton: bool) -> tuple[str, str, str] | None:
    """The (layer, activation) names of `module` that `fuse_gelu_epilogues` fuses and the
    activation it recognised, or None."""
    fused = ("gelu_tanh", *TRITON_ACTIVATIONS) if triton else ("gelu_tanh",)
    for layer, activation in EPILOGUE_GELUS:
        linear, function = getattr(module, layer, None), getattr(module, activation, None)
        if type(linear) is not torch.nn.Linear or linear.bias is None or not isinstance(function, torch.nn.Module):
            continue
        recognised = recognised_activation(function)
        if recognised in fused:
            return layer, activation, recognised
    return None
