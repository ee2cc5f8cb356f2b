"""Packed variable-length attention that transformers' vision towers can call.

transformers splits packed sequences with `.tolist()` (a host sync that cannot be
captured in a CUDA graph) unless the attention implementation's name contains
"flash"; then it passes `cu_seq_lens_*` and `max_length_*` straight through. We
register such a function: on CUDA in half precision it calls
`torch.nn.attention.varlen.varlen_attn` (no host sync, capturable); otherwise (a CPU,
or float32 on CUDA, which the flash kernels do not take) it runs scaled-dot-product
attention per segment, which is exact but reads the segments on the host, so a CUDA
graph cannot capture it (`EncoderAdapter.capturable`).

Zero-length segments (cumulative offsets that repeat, as static graph buffers are
padded) are allowed on both paths and contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_NAME = "flash_embedjob_varlen"
HALF = (torch.float16, torch.bfloat16)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over packed segments; inputs (1, heads, tokens, dim), output (1, tokens, heads, dim)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError("varlen attention needs cu_seq_lens_q and max_length_q; pass precomputed cu_seqlens")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if q.is_cuda and q.dtype in HALF:
        out = _cuda_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _segmented_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def _cuda_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = cu.to(torch.int32)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scale)


def _segmented_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*seg, scale=scale)[0].transpose(0, 1)
    return out


def register() -> str:
    """Register the function with transformers (idempotent) and return its name."""
    AttentionInterface.register(ATTN_NAME, varlen_attention)
    return ATTN_NAME
