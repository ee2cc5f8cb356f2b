"""The Triton kernel behind `torch.ops.embedjob.segment_attention` (`encoders.attention`):
non-causal attention within packed segments, at the tower's own head dim. Imported only
where Triton is installed (`attention.TRITON`), as a job runs without it.

Why a kernel of our own: the flash kernels torch ships round head dims 72 and 80 up to
96 and work in 128-row tiles, so Qwen2.5-VL's 64-patch windows (28 of its 32 layers)
fill half a tile and spend most of their time on padding (benchmarks/RESULTS.md,
section 5). Here a program covers BLOCK_M query rows
of one segment and one head; the head dim is split into a power-of-two main part and a
power-of-two tail of at least 16 columns (tensor-core products need 16), so 80 runs as
64 + 16, never 96 or 128. Dims that do not split so (72 = 64 + 8) are not taken:
masking the tail's columns miscompiled (`head_dims.head_split`).

Invariants: q, k, v and the output are (tokens, heads, dim) with unit stride along dim
(any token and head strides); segment s is rows cu[s]..cu[s+1]; a segment of length 0
(repeated offsets in padded graph buffers) has no program that does work; rows outside
every segment are never written, so a caller that needs them defined must allocate the
output zeroed.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from embedjob.encoders.head_dims import head_split


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: query rows and key rows per step, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}-w{self.warps}-s{self.stages}"


def tiles_for(max_length: int) -> Tiles:
    """The configuration for segments of at most `max_length` tokens: one 64-row tile
    when a segment fits in it (Qwen2.5-VL's windows), else 128 query rows against 64 keys
    a step in four warps (measured fastest at head dim 80 on an H200; benchmarks/attention.py)."""
    if max_length <= 64:
        return Tiles(64, 64, 4, 2)
    return Tiles(128, 64, 4, 3)


def launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cu: torch.Tensor,
    max_length: int, scale: float, tiles: Tiles, wrap: Callable[[Any], Any] = lambda kernel: kernel,
) -> None:
    """Attention of every segment of `cu` (int32, segments + 1 offsets) into `out`.
    `wrap` is `torch.library.wrap_triton` inside a `triton_op`, so the compiler sees the launch."""
    dim, heads = q.shape[-1], q.shape[1]
    split = head_split(dim)
    if split is None:
        raise ValueError(f"segment_attention does not take head dim {dim} (see head_dims.head_split)")
    main, tail = split
    blocks = triton.cdiv(max(max_length, 1), tiles.block_m)
    wrap(segment_attention_kernel)[(blocks * heads * (cu.shape[0] - 1),)](
        q, k, v, out, cu, blocks, heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * 1.4426950408889634,
        D_MAIN=main, D_TAIL=tail, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )


@triton.jit
def segment_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, blocks, heads,
    q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head,
    scale_log2,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (query block, head, segment), the query block varying fastest so that the
    programs reading one segment's keys run together and find them in L2; one grid axis,
    as CUDA bounds the others to 65,535. Online softmax over the segment's keys in steps
    of BLOCK_N, in base 2 (`scale_log2` = softmax scale x log2 e), float32 sums."""
    # Inductor passes Python floats as float64, which would make every score float64.
    scale = tl.full([], scale_log2, tl.float32)
    program = tl.program_id(0)
    block = program % blocks
    head = ((program // blocks) % heads).to(tl.int64)
    segment = program // (blocks * heads)
    start = tl.load(cu_ptr + segment)
    length = tl.load(cu_ptr + segment + 1) - start
    if block * BLOCK_M >= length:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < length
    token_q = (start + rows).to(tl.int64)
    main = tl.arange(0, D_MAIN)
    q0 = tl.load(q_ptr + token_q[:, None] * q_tok + head * q_head + main[None, :], mask=row_in[:, None], other=0.0)
    acc0 = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    if D_TAIL > 0:
        tail = D_MAIN + tl.arange(0, D_TAIL)
        q1 = tl.load(q_ptr + token_q[:, None] * q_tok + head * q_head + tail[None, :], mask=row_in[:, None], other=0.0)
        acc1 = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n in range(0, length, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        col_in = cols < length
        token_k = (start + cols).to(tl.int64)
        k0 = tl.load(k_ptr + token_k[None, :] * k_tok + head * k_head + main[:, None], mask=col_in[None, :], other=0.0)
        s = tl.dot(q0, k0)
        if D_TAIL > 0:
            k1 = tl.load(k_ptr + token_k[None, :] * k_tok + head * k_head + tail[:, None], mask=col_in[None, :], other=0.0)
            s = tl.dot(q1, k1, s)
        s = tl.where(col_in[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v_ptr.dtype.element_ty)
        v0 = tl.load(v_ptr + token_k[:, None] * v_tok + head * v_head + main[None, :], mask=col_in[:, None], other=0.0)
        acc0 = acc0 * alpha[:, None]
        acc0 = tl.dot(p, v0, acc0)
        if D_TAIL > 0:
            v1 = tl.load(v_ptr + token_k[:, None] * v_tok + head * v_head + tail[None, :], mask=col_in[:, None], other=0.0)
            acc1 = acc1 * alpha[:, None]
            acc1 = tl.dot(p, v1, acc1)
        m_i = m_new
    token_o = o_ptr + token_q[:, None] * o_tok + head * o_head
    inverse = 1.0 / l_i[:, None]
    tl.store(token_o + main[None, :], (acc0 * inverse).to(o_ptr.dtype.element_ty), mask=row_in[:, None])
    if D_TAIL > 0:
        tl.store(token_o + tail[None, :], (acc1 * inverse).to(o_ptr.dtype.element_ty), mask=row_in[:, None])
