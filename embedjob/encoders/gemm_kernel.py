"""A linear layer and its activation as one Triton GEMM: `act(x @ W.T + b)`, the bias and the
activation applied to the float32 accumulator before the one store (`epilogues.ActivationLinear`
under `epilogues.TRITON_EPILOGUES`). Imported only where CUDA runs (and by
benchmarks/gemm_epilogue.py and the tests, in Triton's interpreter), since Triton is not needed
elsewhere.

Why: in bf16 a fixed tower's MLP writes fc1's output, the widest tensor of the block, reads it
back in a separate activation kernel and writes it again; on CLIP-L/14-336 that quick-GELU
kernel is about 10 % of a batch (issue #57). cuBLASLt's epilogues have the tanh GELU only
(`epilogues.GeluLinear`), not CLIP's quick GELU `x * sigmoid(1.702 x)` nor the exact GELU
`0.5 x (1 + erf(x / sqrt 2))`. Measured in benchmarks/gemm_epilogue.py on an H100, this kernel
(persistent, TMA, `CONFIG`) ran CLIP-L's fc1 (147,712 x 1,024 x 4,096) in 2.233 ms against
2.525 ms for cuBLAS's addmm and a compiled quick GELU (1.13x), SigLIP-so400m's fc1 shape 1.15x,
at a least row cosine of 0.999998 to float32.

The kernel: a program per SM walks the output tiles, GROUP_M rows of tiles at a time (programs
running together share rows of x and of W in L2), reading and writing tiles through host-side
TMA descriptors (`triton.tools.tensor_descriptor`) or, where those do not import, the GPU is
neither Hopper nor datacenter Blackwell, or a matrix or its rows do not start on 16 bytes,
through pointers (`POINTER_CONFIG`).

Invariants: `linear_activation(x, W, b, activation)` computes `act(x @ W.T + b)` for x [M, K]
(M >= 1), W [N, K] as `nn.Linear` holds it and b [N], all bf16 or all fp16 on one CUDA device,
`act` an `fp8.ACTIVATIONS` name computed as `fp8_kernel.activated` computes it; the products
accumulate in float32, the bias and the activation apply in float32, and the output, in the
input's dtype, is rounded once, where the separate kernel rounded the product first. Anything
else is a ValueError. Which activations a tower sends here is `epilogues.TRITON_ACTIVATIONS`.

The op is a `torch.library.custom_op`, opaque to the compiler (its fake gives the output's
shape), not a `triton_op`: torch 2.11 to 2.14 trace a `triton_op`'s body for the compiler
without its host TMA descriptors (`tma_descriptor_metadata={}`, "not yet supported in non-dynamo
tracing", torch/_higher_order_ops/triton_kernel_wrap.py), keeping each descriptor as a constant
over the trace's fake tensor. Run on real tensors, the op builds its descriptors at each call;
CUDA graphs capture its launch like any kernel's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from embedjob.encoders.fp8 import ACTIVATIONS
from embedjob.encoders.fp8_kernel import activated

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older triton: the pointer path only
    TensorDescriptor = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Under Triton's interpreter (3.8) a bf16 `tl.dot` multiplies its operands' uint16 bits, so
there the kernel takes them to float32 first (`DOT_FP32`); compiled kernels never do."""
DTYPES = (torch.bfloat16, torch.float16)
TMA_CAPABILITIES = (9, 10)
"""CUDA compute capability majors whose GPUs read tiles through TMA with `CONFIG`'s shared
memory: Hopper and datacenter Blackwell."""


@dataclass(frozen=True)
class Config:
    """A launch's tiles (BLOCK_M x BLOCK_N output, BLOCK_K deep), warps, pipeline stages,
    GROUP_M rows of tiles walked together, and whether the tile loop is warp-specialised."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    warp_specialize: bool = False

    def describe(self) -> str:
        ws = " ws" if self.warp_specialize else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.warps} s{self.stages} g{self.group_m}{ws}"


CONFIG = Config(128, 256, 64, 8, 3)
"""The TMA path's: the fastest of benchmarks/gemm_epilogue.py's configs on an H100 at CLIP-L's
and SigLIP's fc1 shapes. Its three stages take about 210 KB of shared memory (Hopper's, and
datacenter Blackwell's, 228 KB)."""
POINTER_CONFIG = Config(128, 128, 64, 8, 3)
"""The pointer path's: the config benchmarks/gemm_epilogue.py times the pointer kernels on
(about 100 KB of shared memory, so it also fits GPUs without TMA)."""


@triton.jit
def tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """A tile's first row and column, tiles numbered down GROUP_M rows of tiles at a time
    (so programs running together share x's rows and W's columns in L2)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    at = tile % in_group
    return (first_m + at % rows) * BLOCK_M, (at // rows) * BLOCK_N


@triton.jit
def _offsets(row, col, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """A [BR, BC] tile's element offsets in a row-major [R, C] matrix, and which lie inside it."""
    rows = row + tl.arange(0, BR)
    cols = col + tl.arange(0, BC)
    return rows[:, None].to(tl.int64) * C + cols[None, :], (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _load(src, row, col, R, C, BR: tl.constexpr, BC: tl.constexpr, TMA: tl.constexpr):
    """A tile of a descriptor's or a pointer's matrix (zeros past its edges)."""
    if TMA:
        tile = src.load([row, col])
    else:
        offsets, inside = _offsets(row, col, R, C, BR, BC)
        tile = tl.load(src + offsets, mask=inside, other=0.0)
    return tile


@triton.jit
def store_tile(dst, out, row, col, R, C, BR: tl.constexpr, BC: tl.constexpr, TMA: tl.constexpr):
    """Writes a tile into a descriptor's or a pointer's matrix (nothing past its edges)."""
    if TMA:
        dst.store([row, col], out)
    else:
        offsets, inside = _offsets(row, col, R, C, BR, BC)
        tl.store(dst + offsets, out, mask=inside)


@triton.jit
def activated_tile(a, w, bias, off_m, off_n, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr,
                   ACTIVATION: tl.constexpr):
    """act(a @ w.T + bias) on one output tile, in float32, rounded once to the bias's dtype;
    `ACTIVATION` an `fp8.ACTIVATIONS` code (`fp8_kernel.activated`)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        x = _load(a, off_m, k * BLOCK_K, M, K, BLOCK_M, BLOCK_K, TMA)
        wt = _load(w, off_n, k * BLOCK_K, N, K, BLOCK_N, BLOCK_K, TMA)
        if DOT_FP32:
            x, wt = x.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(x, wt.T, acc)
    cols = off_n + tl.arange(0, BLOCK_N)
    acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return activated(acc, ACTIVATION).to(bias.dtype.element_ty)


@triton.jit
def persistent_kernel(a, w, bias, c, M, N, K, PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                      DOT_FP32: tl.constexpr, ACTIVATION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """PROGRAMS programs (the SMs), each walking every PROGRAMS-th output tile."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        off_m, off_n = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        out = activated_tile(a, w, bias, off_m, off_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, TMA, DOT_FP32,
                             ACTIVATION)
        store_tile(c, out, off_m, off_n, M, N, BLOCK_M, BLOCK_N, TMA)


def operands(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: Config, tma: bool) -> tuple[Any, Any, Any]:
    """x [M, K], weight [N, K] and out [M, N] (row-major) as the kernel reads them: TMA
    descriptors of the config's tiles, or the tensors themselves."""
    if not tma:
        return x, weight, out
    return (TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k]),
            TensorDescriptor.from_tensor(out, [config.block_m, config.block_n]))


def launch(a: Any, w: Any, bias: torch.Tensor, c: Any, shape: tuple[int, int, int], activation: str, config: Config,
           programs: int, tma: bool) -> None:
    """Queues `persistent_kernel` writing `act(a @ w.T + bias)` into `c` (`operands`' three),
    `shape` (M, K, N), on at most `programs` programs (one per SM: more would only wait)."""
    m, k, n = shape
    grid = min(programs, triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n))
    persistent_kernel[(grid,)](
        a, w, bias, c, m, n, k, grid, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, STAGES=config.stages, TMA=tma, DOT_FP32=INTERPRETED,
        ACTIVATION=ACTIVATIONS[activation][0], WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.warps, num_stages=config.stages,
    )


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str) -> None:
    """A ValueError unless the op computes this (the module docstring's invariants)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear_activation: activation {activation!r} is not one of {tuple(ACTIVATIONS)}")
    tensors = (x, weight, bias)
    if any(not t.is_cuda or t.device != x.device or t.dtype != x.dtype for t in tensors) or x.dtype not in DTYPES:
        raise ValueError("linear_activation: x, weight and bias must be bf16 or fp16 of one dtype on one CUDA device, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    if x.dim() != 2 or x.shape[0] < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_activation: x [M >= 1, K], weight [N, K] and bias [N], got {list(x.shape)}, "
                         f"{list(weight.shape)} and {list(bias.shape)}")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs(device: torch.device) -> int:
    """The persistent GEMM's programs on `device`: one per SM that torch's SM carveout (the
    process's, which cuBLAS and cuDNN honour too) leaves, at least one. A persistent kernel
    holds every SM it runs on until its last tile, so the carveout is the only way work on
    other streams (a GPU decoder's copies and conversions) gets SMs while it runs; read at
    each launch, so a graph captured under a carveout keeps it."""
    return max(1, _multiprocessors(device) - (torch._C._get_sm_carveout_experimental() or 0))


def _takes_descriptors(*matrices: torch.Tensor) -> bool:
    """Whether TMA reads these row-major matrices here: descriptors import, the GPU is
    Hopper or datacenter Blackwell (`CONFIG`'s shared memory), and each matrix starts and
    each of its rows starts on 16 bytes, as a descriptor must."""
    return (TensorDescriptor is not None and torch.cuda.get_device_capability(matrices[0].device)[0] in TMA_CAPABILITIES
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in matrices))


@torch.library.custom_op("embedjob::linear_activation", mutates_args=())
def linear_activation(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(x2d @ weight.T + bias)`, `act` an `fp8.ACTIVATIONS` name, as one kernel queued on
    the current stream (the module docstring's invariants); a ValueError for anything else."""
    _checked(x2d, weight, bias, activation)
    x2d, weight, bias = x2d.contiguous(), weight.contiguous(), bias.contiguous()
    out = torch.empty(x2d.shape[0], weight.shape[0], dtype=x2d.dtype, device=x2d.device)
    tma = _takes_descriptors(x2d, weight, out)
    config = CONFIG if tma else POINTER_CONFIG
    a, w, c = operands(x2d, weight, out, config, tma)
    launch(a, w, bias, c, (x2d.shape[0], x2d.shape[1], weight.shape[0]), activation, config, programs(x2d.device), tma)
    return out


@linear_activation.register_fake
def _(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    _checked(x2d, weight, bias, activation)
    return x2d.new_empty(x2d.shape[0], weight.shape[0])
