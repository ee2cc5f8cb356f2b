"""Packed variable-length attention that transformers' vision towers can call.

transformers splits packed sequences with `.tolist()` (a host sync that cannot be
captured in a CUDA graph) unless the attention implementation's name contains
"flash"; then it passes `cu_seq_lens_*` and `max_length_*` straight through. We
register such a function per backend of `model.attention` (`resolve_backend` picks one):

- `varlen`: on CUDA in half precision `torch.nn.attention.varlen.varlen_attn`, and on
  segments of at most SEGMENT_MAX_LENGTH tokens (Qwen2.5-VL's windows) our Triton kernel
  `segment_attention` (`encoders.attention_kernel`, at the tower's own head dim); both
  without a host sync, capturable. Otherwise (a CPU, or float32 on CUDA, which neither
  takes) scaled-dot-product attention per segment, which is exact but reads the segments
  on the host, so a CUDA graph cannot capture it (`EncoderAdapter.capturable`).
- `fa4`: FlashAttention-4 (`flash_attn.cute.flash_attn_varlen_func`, the optional extra
  `embedjob[fast]`) at call sites whose segments may be longer than `FA4_MIN_LENGTH`,
  the `varlen` kernels at the others. Only chosen on CUDA in half precision.

Which kernel a call runs depends only on its length bound (`cuda_kernel`), a Python int
fixed per budget (`StaticInputs.constants`), so a captured graph holds one kernel per
layer and every replay runs that one.

Zero-length segments (cumulative offsets that repeat, as static graph buffers are
padded) are allowed on every path and contribute nothing: the per-segment path skips
them, the segment kernel gives them no work, and so do both flash kernels
(FlashAttention-4's own tests run varlen batches with zero-length sequences,
`zero_lengths_q` in its tests/cute/test_flash_attn.py; tests/test_gpu.py checks every
CUDA kernel against the per-segment result on such offsets).

flash_attn is imported only where a Qwen-VL tower may use it (`fa4_problem`, `_fa4_varlen`):
importing it takes seconds. transformers is imported only by `register` (and
`register_unmasked`, for the SigLIP text towers' SDPA without a mask), so
`encoders.loading` resolves the backend before any model library is loaded.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from embedjob.config import JobError
from embedjob.encoders.head_dims import head_split

logger = logging.getLogger(__name__)

VARLEN = "varlen"
FA4 = "fa4"
SDPA = "sdpa"
ATTN_NAMES = {VARLEN: "flash_embedjob_varlen", FA4: "flash_embedjob_fa4"}
"""The names registered with transformers; each holds "flash" (see above)."""
HALF = (torch.float16, torch.bfloat16)
FAST_EXTRA = "pip install 'embedjob[fast]'"
"""How FlashAttention-4 is installed: the extra pulls flash-attn-4>=4.0.0b36 (pyproject.toml)."""

FA4_MIN_LENGTH = 128
"""Call sites whose length bound exceeds this run FlashAttention-4, the others varlen_attn.

Measured on an H200 at Qwen2.5-VL's head dim 80 (benchmarks/RESULTS.md,
section 5): its 64-token windows take 0.191 ms in varlen_attn and 0.522 ms
in FA4 (whose tiles are wider than a window), its full-attention layers over images of
256-4,096 tokens 0.860 ms in varlen_attn and 0.530 ms in FA4. Lengths between 64 and 256
were not measured; 128 (one FA4 tile) splits them.
"""
TRITON = importlib.util.find_spec("triton") is not None
"""Whether Triton is installed (torch's CUDA builds for Linux bring it). Found once, at
import: `cuda_kernel` runs inside compiled blocks, and torch 2.11's compiler (not
2.14.1's) does not trace importlib.util.find_spec; asking there cut every Qwen-VL window
block into six compiled regions (benchmarks/RESULTS.md's git history)."""
SEGMENT_MAX_LENGTH = 64
"""Call sites whose length bound is at most this run `segment_attention` (our Triton
kernel, `encoders.attention_kernel`) where Triton is installed (it comes with torch's
CUDA builds on Linux) and the kernel takes the head dim, varlen_attn where not: Qwen2.5-VL's
64-patch windows, which varlen_attn runs in 128-row tiles at head dim 96 and FA4 in
tiles wider than a window. Measured on an H200 inside the compiled 7B-size tower
(benchmarks/RESULTS.md, section 5): a window layer
0.325 ms against 0.470 ms in varlen_attn on a batch of 16,320 tokens, 0.083 against
0.113 ms on one of 4,096, and the tower's encoder-only rate 1.03x on both Qwen mixes.
Longer segments stay off it for now: on that 16,320-token batch its full-attention
layers took 20.4 ms a call in the kernel against 10.7 ms in varlen_attn, but that was
measured under torch 2.11 with a graph break in front of the kernel (TRITON), and alone
it is the faster of the two (7.1 against 9.3 ms; benchmarks/RESULTS.md's git history). Benchmarks set it to 0 or
past every length to compare (`benchmarks/precision.py`)."""
FA4_MIN_CAPABILITY = (8, 0)
"""The oldest GPUs FlashAttention-4's kernels build for (it asserts compute capability 8.x or newer)."""
FA4_NOISE: tuple[tuple[str, type[Warning]], ...] = (
    (r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument", UserWarning),
    (r"cutlass\.utils\.smem_allocator\.SmemAllocator", DeprecationWarning),
)
"""Warnings FlashAttention-4 4.0.0b36 and its CuTe DSL print once per run (`prepare_fa4`)."""

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float | None], torch.Tensor]
"""A packed kernel: (q, k, v, cumulative offsets, length bound, softmax scale) -> output."""


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
    backend: str = VARLEN,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over packed segments; inputs (1, heads, tokens, dim), output (1, tokens, heads, dim).

    `backend` is the one this function was registered for (`register`); `max_length_q`
    bounds every segment's length (an upper bound in padded graph buffers).
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError("varlen attention needs cu_seq_lens_q and max_length_q; pass precomputed cu_seqlens")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if q.is_cuda and q.dtype in HALF:
        max_len = int(max_length_q)
        out = cuda_kernel(backend, max_len, q.shape[-1])(q, k, v, cu_seq_lens_q, max_len, scaling)
    else:
        out = _segmented_sdpa(q, k, v, cu_seq_lens_q, scaling)
    return out.unsqueeze(0), None


def cuda_kernel(backend: str, max_length: int, head_dim: int) -> Kernel:
    """The kernel of one call site on CUDA in half precision: FlashAttention-4 where the
    job chose it and the segments may be longer than FA4_MIN_LENGTH, else our segment
    kernel where they are at most SEGMENT_MAX_LENGTH long (windows), Triton is installed
    and the kernel takes the head dim (64 and 80, not Qwen3-VL's 72:
    `head_split`), else varlen_attn.

    A function of values fixed per model and budget only, so a graph captures one kernel
    per layer.
    """
    if backend == FA4 and max_length > FA4_MIN_LENGTH:
        return _fa4_varlen
    if max_length <= SEGMENT_MAX_LENGTH and TRITON and head_split(head_dim) is not None:
        return _segment_attention
    return _cuda_varlen


def _short_kernel() -> str:
    """What the log calls the kernels of the call sites FlashAttention-4 does not take."""
    if TRITON:
        return (
            f"segment_attention (Triton) on segments of at most {SEGMENT_MAX_LENGTH} tokens at head dims it takes, "
            "varlen_attn on the others"
        )
    return "varlen_attn; segment_attention needs Triton"


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        _register_segment_attention()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.embedjob.segment_attention(q, k, v, cu.to(torch.int32), max_len, scale)


@functools.cache
def _register_segment_attention() -> None:
    """Registers `torch.ops.embedjob.segment_attention(q, k, v, cu, max_len, scale)`:
    attention within each segment of the int32 offsets `cu` over (tokens, heads, dim)
    q, k, v, read through their strides (no copies), output contiguous. A
    `torch.library.triton_op`, so compiled blocks call the kernel and CUDA graphs capture
    it. Registered by `register` (at model load) or by an eager first call, never inside a
    compiled region: the compiler does not trace `triton_op` itself."""
    from embedjob.encoders import attention_kernel

    @torch.library.triton_op("embedjob::segment_attention", mutates_args=())
    def segment_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
    ) -> torch.Tensor:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tiles = attention_kernel.tiles_for(max_len)
        attention_kernel.launch(q, k, v, out, cu, max_len, scale, tiles, wrap=torch.library.wrap_triton)
        return out


def _cuda_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = cu.to(torch.int32)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, scale=scale)


# A custom op, so blocks compiled with torch.compile (`batching.compile`) keep FA4 as one
# opaque call (its fake gives the output's shape) instead of tracing into the CuTe DSL's
# Python, which is what varlen_attn, itself a custom op, gets too.
@torch.library.custom_op("embedjob::fa4_varlen", mutates_args=())
def _fa4_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    """FlashAttention-4 over packed (tokens, heads, dim) segments, non-causal."""
    from flash_attn.cute import flash_attn_varlen_func

    cu = cu.to(torch.int32)
    out, _ = flash_attn_varlen_func(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu, cu_seqlens_k=cu,
        max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=scale, causal=False,
    )
    return out


@_fa4_varlen.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    return torch.empty_like(q)


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


def prepare_fa4(directory: Path) -> None:
    """Have FlashAttention-4 keep its compiled kernels in `directory` across processes,
    and silence the two warnings its packages print on every run.

    Without its cache it compiles every kernel with the CuTe DSL in each new process,
    about 4 s of a Qwen2.5-VL-7B-size tower's capture on an H200 (benchmarks/RESULTS.md),
    paid by every rank of every shard; the directory sits under embedjob's cache root, as
    the compiler's cache does (`EncoderAdapter.compile`). FlashAttention-4 reads these
    variables when it is imported, so this runs before `fa4_problem`; a user's own
    settings win. The warnings (an argument its kernels pass that the DSL cannot turn into
    a JIT argument, a deprecated allocator it calls) say nothing a user can act on, and
    the kernels they come from are checked against varlen_attn in tests/test_gpu.py.
    """
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # off unless asked for
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(directory))
    for message, category in FA4_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)


def fa4_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashAttention-4 cannot run on `device` in `dtype`, or None.

    It needs CUDA, half precision, `flash_attn.cute` importing and a GPU of compute
    capability FA4_MIN_CAPABILITY or newer; the import is tried only where the rest holds
    and before the GPU is asked, so a machine without the package never reaches its driver.
    """
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if dtype not in HALF:
        return f"it takes bfloat16 or float16, not {str(dtype).removeprefix('torch.')}"
    problem = fa4_import_problem()
    if problem is not None:
        return problem
    capability = torch.cuda.get_device_capability(device)
    if capability < FA4_MIN_CAPABILITY:
        have, need = (".".join(map(str, c)) for c in (capability, FA4_MIN_CAPABILITY))
        return f"{torch.cuda.get_device_name(device)} has compute capability {have}, below {need}"
    return None


def fa4_import_problem() -> str | None:
    """Why `flash_attn.cute` does not import, or None."""
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as exc:
        return f"flash-attn-4 is not installed ({exc})"
    except Exception as exc:  # the CuTe DSL can fail to load for reasons other than absence
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"flash_attn.cute does not import ({type(exc).__name__}: {first})"
    return None


def resolve_backend(
    setting: str, packed: bool, device: torch.device, dtype: torch.dtype, kernel_cache: Path | None = None
) -> str:
    """The attention a tower runs for `model.attention` = `setting`, said in one log line:
    "sdpa" for towers that are not `packed` (CLIP, SigLIP, DINOv2 run transformers'
    scaled-dot-product attention; the job spec refuses any other setting for them), else
    "fa4" or "varlen".

    `auto` takes fa4 where it can run (`fa4_problem`) and varlen elsewhere; `fa4` where
    it cannot is a JobError, raised before any model is loaded, naming what to install.
    Where FlashAttention-4 may run, it keeps its kernels in `kernel_cache` (`prepare_fa4`,
    before `fa4_problem` imports it).
    """
    if not packed:
        logger.info("attention: sdpa (transformers' scaled-dot-product attention)")
        return SDPA
    problem = None
    if setting != VARLEN:
        if kernel_cache is not None:
            prepare_fa4(kernel_cache)
        problem = fa4_problem(device, dtype)
    if setting == FA4 and problem is not None:
        raise JobError(
            f"model.attention: fa4 cannot run here: {problem}; FlashAttention-4 needs a CUDA GPU, model.dtype "
            f"bfloat16 or float16 and {FAST_EXTRA} (flash-attn-4>=4.0.0b36); or set model.attention: varlen"
        )
    if setting != VARLEN and problem is None:
        logger.info(
            "attention: fa4 (FlashAttention-4) where segments may exceed %d tokens, %s on shorter ones "
            "(model.attention %s)",
            FA4_MIN_LENGTH, _short_kernel(), setting,
        )
        return FA4
    kernel = _short_kernel() if device.type == "cuda" and dtype in HALF else "scaled-dot-product attention per segment"
    why = "" if problem is None else f"; FlashAttention-4 not used: {problem}"
    logger.info("attention: varlen (%s; model.attention %s%s)", kernel, setting, why)
    return VARLEN


def register(backend: str = VARLEN) -> str:
    """Register `backend`'s function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    function = varlen_attention if backend == VARLEN else functools.partial(varlen_attention, backend=backend)
    AttentionInterface.register(ATTN_NAMES[backend], function)
    if TRITON:
        _register_segment_attention()
    return ATTN_NAMES[backend]


UNMASKED = "embedjob_sdpa_unmasked"
"""The name `register_unmasked` registers: no "flash" in it, so transformers treats the
tower as it treats SDPA in all but the mask."""


def register_unmasked() -> str:
    """Register, for text towers that attend to every position of every caption (SigLIP
    and SigLIP 2: captions padded to the model's length and the pads attended, as they
    were trained), transformers' own SDPA under a name transformers builds no mask for
    (`unmasked_sdpa`); idempotent; returns the name.

    Why: under the default "sdpa", transformers decides whether to build the all-True
    bidirectional mask by asking whether it is tracing, which some of its versions
    answer yes to while a CUDA graph is captured. The captured graph then ran SDPA with a
    mask (the memory-efficient kernel) and the eager run without one (flash), so replay
    and eager differed in the last bits from the first layer's attention on (seen on an
    H100 with transformers 5.17, tests/test_gpu.py). With no mask at all, both run the
    same call: the one the default makes eagerly, so the vectors are unchanged."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNMASKED, functools.partial(unmasked_sdpa, sdpa=sdpa_attention_forward))
    return UNMASKED


def unmasked_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *, sdpa: Callable[..., tuple[torch.Tensor, None]], **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention with no mask. A mask means a caller that masks some
    position, which these towers never do (their captions are not masked): a ValueError
    rather than a mask silently ignored."""
    if attention_mask is not None:
        raise ValueError(f"{UNMASKED} serves towers that attend to every position, but a mask was passed")
    return sdpa(module, query, key, value, None, **kwargs)


def segment_offsets(lengths: np.ndarray) -> np.ndarray:
    """Cumulative int32 offsets, from 0, of consecutive segments of `lengths` rows
    (`PackedAdapter._view_patches`: one per view of every item, in batch order)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def all_pad_offsets(total: int, length: int, segment: int) -> np.ndarray:
    """A dummy batch's `length` offsets over `total` rows that are all pad rows (`pad_offsets` from 0)."""
    return pad_offsets(np.zeros(1, dtype=np.int32), total, length, segment)


def pad_offsets(offsets: np.ndarray, total: int, length: int, segment: int) -> np.ndarray:
    """Extend cumulative offsets to `total` with segments of <= `segment`, then repeat the last.

    Pad rows get segments of their own so they never attend to real rows and cost no
    quadratic work; the repeated offsets make zero-length segments that kernels skip.
    """
    last = int(offsets[-1])
    extra = list(range(last + segment, total, segment))
    if last < total:
        extra.append(total)
    needed = offsets.shape[0] + len(extra)
    if needed > length:
        raise ValueError(f"batch needs {needed} segment offsets but the budget's buffer holds {length}")
    tail = [total] * (length - needed)
    return np.concatenate([offsets.astype(np.int32), np.array(extra + tail, dtype=np.int32)])
