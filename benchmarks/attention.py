"""Attention kernels at the towers' own head dims, per call on their segment layouts (RESULTS.md section 5).

What each backend that torch ships, our Triton segment kernel, and FlashAttention-4 where
it is installed take per call, on the segment layouts the towers run.

    PYTHONPATH=. python3 benchmarks/attention.py [--repeats 20]     (one GPU)
    PYTHONPATH=. python3 benchmarks/attention.py --smoke            (CPU, tiny, plumbing only)

Cases (bf16, 16 heads, about 16,384 tokens, random q, k, v of a fixed seed):

- qwen-window: Qwen2.5-VL-7B's windowed layers, head dim 80, segments of 64 tokens;
- qwen-full: its full-attention layers, head dim 80, images of 256 to 4,096 tokens;
- siglip: SigLIP-so400m-384, head dim 72, 22 images of 729 tokens;
- clip: CLIP-L/14-336, head dim 64, 28 images of 577 tokens.

Backends: `varlen` (torch.nn.attention.varlen.varlen_attn, the Qwen path's fallback),
`triton` (our segment kernel, `embedjob.encoders.attention_kernel`, in the tiles
`tiles_for` picks; `triton-<tiles>` the other configurations of TRITON_SWEEP; not at
head dim 72, which it does not take),
`flex` (compiled FlexAttention with a block-diagonal mask), and for the fixed-resolution
cases, whose images are one dense batch, scaled_dot_product_attention restricted to
`flash`, `efficient` and `cudnn` (the fixed-resolution path runs transformers' `sdpa`,
which lets torch choose). `varlen-pad-N` runs varlen with q, k, v zero-padded to head
dim N and the scale of the true head dim: what a kernel that rounds the head dim up
does. `fa4` runs `flash_attn.cute.flash_attn_varlen_func` from the `flash-attn-4`
package (CuTe DSL kernels compiled at their first call, so its first call per case is
not timed, like every backend's), on the same packed q, k, v and offsets as `varlen`;
it runs only where `flash_attn.cute` imports and on CUDA, and its row says why not
otherwise; it comes last in each case, so a kernel that faults leaves the other rows of
that case measured. Each row: median milliseconds of `--repeats` CUDA-event-timed calls
after a warm-up, TFLOP/s (4 x sum of squared segment lengths x heads x head dim), and the
largest absolute difference to a float32 per-segment reference; a backend that cannot
run the case says why. The table is the last thing printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from embedjob.encoders.attention_kernel import Tiles

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.bench import cuda_time  # noqa: E402
from embedjob.encoders.attention import fa4_problem  # noqa: E402

HEADS = 16
TRITON_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3), (128, 64, 8, 4)]
"""Tile configurations of `segment_attention` timed besides the one `tiles_for` picks."""
HEADER = (
    "| case | head dim | tokens | backend | ms | TFLOP/s | max abs diff to fp32 | note |\n"
    "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"
)
"""The head of `measure`'s table."""
QWEN_FULL_IMAGES = [4096, 2048, 2048, 1024, 1024, 1024, 1024, 1024, 512, 512, 512, 512, 256, 256, 256, 256, 1024]


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    segments: tuple[int, ...]
    dense: bool  # equal segments: also a (images, heads, tokens, dim) batch for SDPA

    @property
    def tokens(self) -> int:
        return sum(self.segments)

    @property
    def flops(self) -> float:
        return 4.0 * sum(s * s for s in self.segments) * HEADS * self.head_dim


def cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("qwen-window", 80, (64,) * 4, False), Case("siglip", 72, (49,) * 3, True)]
    return [
        Case("qwen-window", 80, (64,) * 256, False),
        Case("qwen-full", 80, tuple(QWEN_FULL_IMAGES), False),
        Case("siglip", 72, (729,) * 22, True),
        Case("clip", 64, (577,) * 28, True),
    ]


def inputs(case: Case, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(case.tokens, HEADS, case.head_dim, generator=generator).to(device, dtype) for _ in range(3))
    offsets = torch.tensor([0, *torch.tensor(case.segments).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, offsets


def reference(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 attention per segment (the math backend)."""
    out, start = torch.empty_like(q, dtype=torch.float32), 0
    for length in case.segments:
        seg = [t[start : start + length].float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            out[start : start + length] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)
        start += length
    return out


def varlen(case: Case, pad_to: int | None = None) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.varlen import varlen_attn

    longest = max(case.segments)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if pad_to is None:
            return varlen_attn(q, k, v, offsets, offsets, longest, longest)
        padded = [F.pad(t, (0, pad_to - case.head_dim)) for t in (q, k, v)]
        out = varlen_attn(*padded, offsets, offsets, longest, longest, scale=case.head_dim**-0.5)
        return out[..., : case.head_dim]

    return run


def flex(case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = torch.repeat_interleave(torch.arange(len(case.segments), device=device), torch.tensor(case.segments, device=device))

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    mask = create_block_mask(same_document, None, None, case.tokens, case.tokens, device=str(device))
    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        batch = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        return attend(*batch, block_mask=mask)[0].transpose(0, 1)

    return run


def fa4(case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
    problem = fa4_problem(device, torch.bfloat16)  # its rows run in bf16 on a GPU
    if problem is not None:
        raise RuntimeError(problem)
    from flash_attn.cute import flash_attn_varlen_func

    longest = max(case.segments)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        result = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=case.head_dim**-0.5, causal=False,
        )
        return result[0] if isinstance(result, tuple) else result  # 4.0.0b36 returns (out, lse)

    return run


def triton_tiles(case: Case, tiles: Tiles) -> Callable[..., torch.Tensor]:
    from embedjob.encoders import attention_kernel

    longest = max(case.segments)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        attention_kernel.launch(q, k, v, out, offsets, longest, case.head_dim**-0.5, tiles)
        return out

    return run


def dense(case: Case, backend: torch.nn.attention.SDPBackend) -> Callable[..., torch.Tensor]:
    images, length = len(case.segments), case.segments[0]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        batch = [t.view(images, length, HEADS, case.head_dim).transpose(1, 2) for t in (q, k, v)]
        with torch.nn.attention.sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(*batch)
        return out.transpose(1, 2).reshape(case.tokens, HEADS, case.head_dim)

    return run


def backends(case: Case, device: torch.device) -> dict[str, Callable[[], Callable[..., torch.Tensor]]]:
    SDP = torch.nn.attention.SDPBackend
    out: dict[str, Callable[[], Callable[..., torch.Tensor]]] = {}
    if device.type == "cuda":
        out["varlen"] = lambda: varlen(case)
        for width in (96, 128):
            if width > case.head_dim:
                out[f"varlen-pad-{width}"] = lambda width=width: varlen(case, width)
    out["flex"] = lambda: flex(case, device)
    if case.dense:
        names = {"flash": SDP.FLASH_ATTENTION, "efficient": SDP.EFFICIENT_ATTENTION, "cudnn": SDP.CUDNN_ATTENTION}
        if device.type != "cuda":
            names = {"math": SDP.MATH}
        for name, backend in names.items():
            out[f"sdpa-{name}"] = lambda backend=backend: dense(case, backend)
    if device.type == "cuda":
        from embedjob.encoders.head_dims import head_split
        from embedjob.encoders.attention_kernel import Tiles, tiles_for

        chosen = tiles_for(max(case.segments))
        sweep = [chosen, *(Tiles(*t) for t in TRITON_SWEEP if Tiles(*t) != chosen)] if head_split(case.head_dim) else []
        for tiles in sweep:
            tag = "" if tiles == chosen else f"-{tiles.name}"
            out[f"triton{tag}"] = lambda tiles=tiles: triton_tiles(case, tiles)
    out["fa4"] = lambda: fa4(case, device)  # last: a faulting kernel leaves this case's other rows
    return out


def joined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same q, k and v read out of one joined qkv product (token stride 3 x heads x
    dim), as a Qwen block's are."""
    qkv = torch.stack([q, k, v], 1).contiguous()
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


def measure(
    case: Case, device: torch.device, dtype: torch.dtype, repeats: int,
    makers: dict[str, Callable[[], Callable[..., torch.Tensor]]] | None = None, strided: bool = False,
) -> list[str]:
    """One table row per backend of `makers` (default `backends`) on the case's inputs,
    read out of one joined qkv product where `strided`."""
    q, k, v, offsets = inputs(case, device, dtype)
    if strided:
        q, k, v = joined(q, k, v)
    ref = reference(case, q, k, v)
    rows = []
    for name, make in (backends(case, device) if makers is None else makers).items():
        try:
            fn = make()
            out = fn(q, k, v, offsets)
            error = float((out.float() - ref).abs().max())
            if device.type == "cuda":
                seconds = cuda_time(lambda: fn(q, k, v, offsets), repeats)
            else:
                start = time.perf_counter()
                fn(q, k, v, offsets)
                seconds = time.perf_counter() - start
            rows.append(
                f"| {case.name} | {case.head_dim} | {case.tokens} | {name} | {1000 * seconds:.3f} "
                f"| {case.flops / seconds / 1e12:.1f} | {error:.2e} | |"
            )
        except Exception as exc:  # a backend that cannot run this case is a row, not the end
            reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
            rows.append(f"| {case.name} | {case.head_dim} | {case.tokens} | {name} | - | - | - | {reason} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="timed calls per backend, the median reported (20; 2 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny cases: checks the script, measures nothing")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.smoke else 20)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = [row for case in cases(args.smoke) for row in measure(case, device, dtype, args.repeats)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\nattention backends on {name}, torch {torch.__version__}, {HEADS} heads, {dtype}; median of {args.repeats}")
    print(HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
