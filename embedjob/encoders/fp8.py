"""Row-wise FP8 linear layers for the transformer blocks (`model.precision: fp8`).

The blocks' matrix products are most of a vision tower's time and run near the bf16
matmul rate already; FP8 (e4m3) products run at up to twice that rate on GPUs that have
them (Hopper and newer). Scales are per row on both sides: one per output channel of a
weight, quantised once at load, and one per token of an activation, computed at every
call, so an outlier token or channel costs only its own row's precision. Everything
else (patch embedding, norms, attention, pooling heads, mergers) stays in the model's
dtype: they are a small share of the time and the most sensitive to precision.

On CUDA an activation is quantised by one Triton kernel per call
(`torch.ops.embedjob.fp8_quantize_rows`), which reads each row once. Left to the compiler, the quantisation fuses into the kernel
that makes its input (a norm, an activation) as a looped reduction that reads the row
twice: on the SigLIP-so400m-size tower the GELU and the scales of the down projection's
input took 3.7 ms a block of a 186,624-token batch; with the row kernel the GELU takes
1.0 ms and each of the kernel's six calls a block 0.29 ms on average
(benchmarks/RESULTS.md).

Invariants: a converted layer computes `x @ W.T + b` up to FP8 rounding, for any input
row count and any layer shape (the FP8 product needs both matrix dimensions multiples
of 16: weights are zero-padded once, inputs along their last dimension at each call);
an input row of zeros gives the bias. Both quantisers give one scale per row from the
row's largest magnitude and round the same way.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from embedjob.config import JobError

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ALIGN = 16
"""The FP8 product's alignment of both matrix dimensions (torch._scaled_mm)."""
_TINY = 1e-12
FAST_ACCUM = True
"""Whether new layers let the FP8 product accumulate at the tensor cores' own precision
(`use_fast_accum`), skipping the periodic promotion of partial sums to float32: on an
H200 the SigLIP-so400m-size tower's FP8 products took 121 ms of a batch with it and 154
without (bf16: 219), and the per-item cosine to bf16 did not move
(benchmarks/RESULTS.md). Read when a layer is made."""
ROW_KERNEL = True
"""Whether new layers quantise activations on CUDA with the Triton row kernel rather than
the compiler's fused reduction (see the module docstring). Read when a layer is made."""


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (rows, k) as FP8 with one float32 scale per row: x ~= q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _register_row_quantizer() -> None:
    """Registers `torch.ops.embedjob.fp8_quantize_rows(x, padded)`: `quantize_rows` of a
    (rows, k) CUDA tensor as one Triton kernel, zero-padded to `padded` columns; one
    program per row holds the whole row, so it is read once. A `torch.library.triton_op`,
    so compiled blocks call the kernel and CUDA graphs capture it; registered once, when
    the first layer is made (Triton is imported only where CUDA runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, stride, cols, padded, BLOCK: tl.constexpr, TINY: tl.constexpr, LIMIT: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), TINY) / LIMIT
        q = tl.clamp(x / scale, -LIMIT, LIMIT)
        tl.store(q_ptr + row * padded + offsets, q.to(q_ptr.dtype.element_ty), mask=offsets < padded)
        tl.store(scale_ptr + row, scale)

    @torch.library.triton_op("embedjob::fp8_quantize_rows", mutates_args=())
    def quantize(x: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = x if x.stride(-1) == 1 else x.contiguous()
        rows, cols = x.shape
        quantized = torch.empty(rows, padded, dtype=FP8, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(padded)
        torch.library.wrap_triton(fp8_quantize_rows_kernel)[(rows,)](
            x, quantized, scale, x.stride(0), cols, padded,
            BLOCK=block, TINY=_TINY, LIMIT=FP8_MAX, num_warps=8 if block >= 4096 else 4,
        )
        return quantized, scale


class Fp8Linear(torch.nn.Module):
    """An `nn.Linear` whose product runs in row-wise FP8 (see the module docstring);
    its output is in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = FAST_ACCUM
        self.row_kernel = ROW_KERNEL and torch.cuda.is_available()
        if self.row_kernel:
            _register_row_quantizer()
        k, n = _padded(self.in_features), _padded(self.out_features)
        weight = F.pad(linear.weight.detach().float(), (0, k - self.in_features, 0, n - self.out_features))
        quantized, scale = quantize_rows(weight)
        self.register_buffer("weight", quantized)  # (n, k): its transpose is the column-major operand
        self.register_buffer("weight_scale", scale.reshape(1, n).contiguous())
        bias = linear.bias
        self.register_buffer(
            "bias", None if bias is None else F.pad(bias.detach(), (0, n - self.out_features)).to(linear.weight.dtype)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        padded = self.weight.shape[1]
        if self.row_kernel and rows.is_cuda:
            quantized, scale = torch.ops.embedjob.fp8_quantize_rows(rows, padded)
        else:
            quantized, scale = quantize_rows(rows if padded == self.in_features else F.pad(rows, (0, padded - self.in_features)))
        out = torch._scaled_mm(
            quantized,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
            use_fast_accum=self.fast_accum,
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=row-wise"


def check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    """A JobError when this device cannot run the FP8 product into `dtype`: one tiny
    product is tried, since which GPUs, dtypes and scalings torch supports changes
    between releases (row-wise scaling needs Hopper or newer and bfloat16 output on CUDA)."""
    try:
        x = torch.ones(ALIGN, ALIGN, device=device, dtype=dtype)
        Fp8Linear(torch.nn.Linear(ALIGN, ALIGN, device=device, dtype=dtype))(x)
    except (RuntimeError, NotImplementedError, TypeError, ImportError) as exc:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobError(
            f"model.precision: fp8 cannot run on {name} with model.dtype {str(dtype).removeprefix('torch.')} "
            f"({reason}); it needs a GPU of compute capability 9.0 or newer (H100, H200, B200) and model.dtype: "
            "bfloat16; set model.precision: bf16"
        ) from None


def convert_blocks(blocks: Iterable[torch.nn.Module]) -> Counter[str]:
    """Replace every `nn.Linear` inside `blocks` by its `Fp8Linear`, in place; how many
    of each (name relative to its block, e.g. `mlp.down_proj`) were converted."""
    converted: Counter[str] = Counter()
    for block in blocks:
        for name, module in list(block.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(module, child_name, Fp8Linear(child))
                    converted[f"{name}.{child_name}" if name else child_name] += 1
    return converted
