"""A candidate for the segment kernel's long segments (issue #19, item 1): variants and
tiles of a rewritten kernel against the one the job runs (`encoders.attention_kernel`),
torch's varlen_attn and, on the dense cases, cuDNN's SDPA.

    PYTHONPATH=. python3 benchmarks/segment_variants.py [--repeats 10]     (one GPU)

The candidate (`candidate_kernel`) differs from the job's kernel in three ways, each a
switch here: a segment's whole key blocks are read without masks and only its last,
partial block with them (SPLIT); K is read row by row and transposed for the product
(TRANS_K, where the job's kernel reads it transposed through its pointers); and the
softmax scale is folded into the exponent's multiply-add. Cases (bf16, 16 heads):
qwen-long, full-attention layers like those of the Qwen mixed mix's largest batch (nine
images, 65,280 patches; also read out of one joined qkv product, qwen-long-strided); qwen-full (images of 256-4,096 patches); qwen-window (1,020 windows
of 64); clip (577-token images, head dim 64); siglip at 72 (cuDNN and varlen_attn only:
neither kernel takes 72) and padded to 80. Each row: median milliseconds of --repeats
CUDA-event-timed calls after a warm-up, TFLOP/s, the largest difference to a float32
reference; then per compiled candidate its wgmma count, registers and spills. The table
is the last thing printed. Results: benchmarks/RESULTS.md, "The segment kernel on long
segments".
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attention as bench  # noqa: E402
from embedjob.encoders import attention_kernel  # noqa: E402
from embedjob.encoders.head_dims import head_split  # noqa: E402
from embedjob.encoders.attention_kernel import Tiles  # noqa: E402

QWEN_LONG = (9216, 9216, 8464, 7744, 7056, 6400, 5776, 5184, 6224)
"""65,280 patches in nine images, as the Qwen mixed mix's largest batch (whose images have
6,300-8,836 patches, `precision.py`'s 96 items)."""


@triton.jit
def _step(q0, q1, acc0, acc1, m_i, l_i, k_at, v_at, kn, k_tok, v_tok, main, tail, left, scale,
          D_TAIL: tl.constexpr, MASKED: tl.constexpr, TRANS_K: tl.constexpr):
    """One online-softmax step over the BLOCK_N keys at k_at / v_at, `left` of them in the segment."""
    col_in = kn < left
    if TRANS_K:
        if MASKED:
            k0 = tl.load(k_at + kn[:, None] * k_tok + main[None, :], mask=col_in[:, None], other=0.0)
        else:
            k0 = tl.load(k_at + kn[:, None] * k_tok + main[None, :])
        s = tl.dot(q0, tl.trans(k0))
        if D_TAIL > 0:
            if MASKED:
                k1 = tl.load(k_at + kn[:, None] * k_tok + tail[None, :], mask=col_in[:, None], other=0.0)
            else:
                k1 = tl.load(k_at + kn[:, None] * k_tok + tail[None, :])
            s = tl.dot(q1, tl.trans(k1), s)
    else:
        if MASKED:
            k0 = tl.load(k_at + kn[None, :] * k_tok + main[:, None], mask=col_in[None, :], other=0.0)
        else:
            k0 = tl.load(k_at + kn[None, :] * k_tok + main[:, None])
        s = tl.dot(q0, k0)
        if D_TAIL > 0:
            if MASKED:
                k1 = tl.load(k_at + kn[None, :] * k_tok + tail[:, None], mask=col_in[None, :], other=0.0)
            else:
                k1 = tl.load(k_at + kn[None, :] * k_tok + tail[:, None])
            s = tl.dot(q1, k1, s)
    if MASKED:
        s = tl.where(col_in[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    p = tl.math.exp2(s * scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v_at.dtype.element_ty)
    if MASKED:
        v0 = tl.load(v_at + kn[:, None] * v_tok + main[None, :], mask=col_in[:, None], other=0.0)
    else:
        v0 = tl.load(v_at + kn[:, None] * v_tok + main[None, :])
    acc0 = tl.dot(p, v0, acc0 * alpha[:, None])
    if D_TAIL > 0:
        if MASKED:
            v1 = tl.load(v_at + kn[:, None] * v_tok + tail[None, :], mask=col_in[:, None], other=0.0)
        else:
            v1 = tl.load(v_at + kn[:, None] * v_tok + tail[None, :])
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None])
    return acc0, acc1, m_new, l_i


@triton.jit
def candidate_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, blocks, heads,
    q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head, scale_log2,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, TAIL_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, TRANS_K: tl.constexpr,
):
    """The job's program layout and head split (`attention_kernel.segment_attention_kernel`),
    with the module docstring's three changes; TAIL_W is D_TAIL, or 16 where there is none."""
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
    main = tl.arange(0, D_MAIN)
    tail = D_MAIN + tl.arange(0, TAIL_W)
    first = start.to(tl.int64)
    q_at = q_ptr + first * q_tok + head * q_head + rows.to(tl.int64)[:, None] * q_tok
    q0 = tl.load(q_at + main[None, :], mask=row_in[:, None], other=0.0)
    if D_TAIL > 0:
        q1 = tl.load(q_at + tail[None, :], mask=row_in[:, None], other=0.0)
    else:
        q1 = tl.zeros([BLOCK_M, TAIL_W], dtype=q_ptr.dtype.element_ty)
    acc0 = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, TAIL_W], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + first * k_tok + head * k_head
    v_base = v_ptr + first * v_tok + head * v_head
    kn = tl.arange(0, BLOCK_N)
    if SPLIT:
        full = (length // BLOCK_N) * BLOCK_N
    else:
        full = length * 0
    for n in range(0, full, BLOCK_N):
        acc0, acc1, m_i, l_i = _step(q0, q1, acc0, acc1, m_i, l_i, k_base + n * k_tok, v_base + n * v_tok, kn, k_tok, v_tok,
                                     main, tail, length - n, scale, D_TAIL, False, TRANS_K)
    for n in range(full, length, BLOCK_N):
        acc0, acc1, m_i, l_i = _step(q0, q1, acc0, acc1, m_i, l_i, k_base + n * k_tok, v_base + n * v_tok, kn, k_tok, v_tok,
                                     main, tail, length - n, scale, D_TAIL, True, TRANS_K)
    o_at = o_ptr + (first + rows.to(tl.int64))[:, None] * o_tok + head * o_head
    inverse = 1.0 / l_i[:, None]
    tl.store(o_at + main[None, :], (acc0 * inverse).to(o_ptr.dtype.element_ty), mask=row_in[:, None])
    if D_TAIL > 0:
        tl.store(o_at + tail[None, :], (acc1 * inverse).to(o_ptr.dtype.element_ty), mask=row_in[:, None])


PTX: dict[str, str] = {}


def candidate(case: bench.Case, tiles: Tiles, split: bool, trans_k: bool):
    """A run of `candidate_kernel` over the case's segments; its first launch per
    configuration records the PTX's product instructions, registers and spills."""
    longest = max(case.segments)
    main, tail = head_split(case.head_dim)
    key = f"{case.head_dim}-{tiles.name}-{int(split)}{int(trans_k)}"

    def run(q, k, v, cu):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        blocks = triton.cdiv(longest, tiles.block_m)
        compiled = candidate_kernel[(blocks * q.shape[1] * (cu.shape[0] - 1),)](
            q, k, v, out, cu, blocks, q.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            case.head_dim**-0.5 * 1.4426950408889634,
            D_MAIN=main, D_TAIL=tail, TAIL_W=tail or 16, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            SPLIT=split, TRANS_K=trans_k, num_warps=tiles.warps, num_stages=tiles.stages,
        )
        if key not in PTX and hasattr(compiled, "asm"):
            ptx = compiled.asm.get("ptx", "")
            regs, spills = getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?")
            PTX[key] = f"wgmma {ptx.count('wgmma.mma_async')} mma.sync {ptx.count('mma.sync')} regs {regs} spills {spills}"
        return out

    return run


TILES = [Tiles(128, 64, 4, 3), Tiles(128, 64, 8, 3), Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 2), Tiles(128, 64, 4, 2),
         Tiles(64, 64, 4, 3), Tiles(128, 32, 4, 3), Tiles(128, 64, 8, 2)]
WINDOW_TILES = [Tiles(64, 64, 4, 2), Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 2)]


CASES = [
    (bench.Case("qwen-long", 80, QWEN_LONG, False), False),
    (bench.Case("qwen-long-strided", 80, QWEN_LONG, False), True),
    (bench.Case("qwen-full", 80, tuple(bench.QWEN_FULL_IMAGES), False), False),
    (bench.Case("qwen-window", 80, (64,) * 1020, False), True),
    (bench.Case("clip", 64, (577,) * 28, True), False),
    (bench.Case("siglip-as-80", 80, (729,) * 22, False), False),
    (bench.Case("siglip", 72, (729,) * 22, True), False),
]
"""(case, q, k and v read out of one joined qkv product)."""


def makers(case: bench.Case) -> dict[str, Callable[[], Callable[..., torch.Tensor]]]:
    """varlen_attn, cuDNN's SDPA on the dense cases, and at the head dims the kernels take
    the job's kernel in its own tiles and every candidate variant in each of the tiles swept."""
    out: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {"varlen": lambda: bench.varlen(case)}
    if case.dense:
        out["sdpa-cudnn"] = lambda: bench.dense(case, torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    if head_split(case.head_dim):
        chosen = attention_kernel.tiles_for(max(case.segments))
        out[f"job-{chosen.name}"] = lambda: bench.triton_tiles(case, chosen)
        for t in WINDOW_TILES if max(case.segments) <= 64 else TILES:
            for split, trans in ((True, True), (True, False), (False, True)):
                out[f"candidate-{t.name}-split{int(split)}-trans{int(trans)}"] = (
                    lambda t=t, split=split, trans=trans: candidate(case, t, split, trans))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for case, strided in CASES:
        rows += bench.measure(case, device, dtype, args.repeats, makers(case), strided)
        torch.cuda.empty_cache()
    print(f"\nsegment kernel candidates, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(bench.HEADER)
    print("\n".join(rows))
    print("\nptx")
    for key, text in PTX.items():
        print(key, text)


if __name__ == "__main__":
    main()
