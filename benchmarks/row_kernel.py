"""The FP8 row kernel's launch settings, timed on the activation shapes of the towers.

On the GPU machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/row_kernel.py [--rows 186624] [--repeats 20]

For each activation of a block (SigLIP-so400m's 1,152 and 4,304 columns with and without
the MLP's tanh GELU, CLIP-L's 1,024 and 4,096 with quick GELU, Qwen2.5-VL-7B's 1,280 and
3,456, the latter also gated: silu(gate) * up formed from the joined gate|up product's
6,912-column rows), it times `torch.ops.embedjob.fp8_quantize_rows` (CUDA events, median of
`--repeats` after a warm-up) under each `fp8.ROW_WARPS` setting, and a
bf16-to-FP8 cast of the same tensor (`Tensor.to`, which reads and writes the same bytes
with no reduction; for the gated rows, of the joined rows, which reads as many bytes and
writes twice as many) as the memory-bound floor. It prints one table: milliseconds, GB/s
of bytes read and written, and the time over the cast's.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.bench import cuda_time  # noqa: E402
from embedjob.encoders import fp8  # noqa: E402

SHAPES = (
    ("siglip qkv/fc1 input", 1152, None, False),
    ("siglip fc2 input", 4304, None, False),
    ("siglip fc2 input + gelu_tanh", 4304, "gelu_tanh", False),
    ("clip fc2 input + quick_gelu", 4096, "quick_gelu", False),
    ("clip qkv input", 1024, None, False),
    ("qwen qkv input", 1280, None, False),
    ("qwen down_proj input", 3456, None, False),
    ("qwen down_proj input, gated silu", 3456, "silu", True),
)
"""(label, columns, activation, gated): every width is a multiple of 16, so nothing is
padded; a gated row holds gate and up side by side (`fp8.Fp8GatedMlp`), its activation
one of `fp8.GATES`."""
WARPS = (None, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=186624, help="tokens of the batch (SigLIP's largest: 186,624)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    fp8._register_row_quantizer()
    lines = ["| activation | columns | ROW_WARPS | ms | GB/s | / cast |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, cols, activation, gated in SHAPES:
        up = cols if gated else 0
        x = torch.randn(args.rows, up + cols, device="cuda", dtype=torch.bfloat16)
        code = (fp8.GATES if gated else fp8.ACTIVATIONS)[activation][0] if activation else 0
        moved = args.rows * (x.shape[1] * 2 + cols + 4) / 1e9  # bf16 read, FP8 written, a float32 scale
        cast_moved = moved + args.rows * up / 1e9  # the cast writes the up half too
        cast = cuda_time(lambda: x.to(fp8.FP8), args.repeats, warmup=2) * 1e3
        lines.append(f"| {label} | {cols} | cast | {cast:.3f} | {cast_moved / cast * 1e3:,.0f} | 1.00 |")
        for warps in WARPS:
            fp8.ROW_WARPS = warps
            quantize = functools.partial(torch.ops.embedjob.fp8_quantize_rows, x, cols, cols, up, code, 0, None, None, 0.0)
            ms = cuda_time(quantize, args.repeats, warmup=2) * 1e3
            lines.append(f"| {label} | {cols} | {warps or 'default'} | {ms:.3f} | {moved / ms * 1e3:,.0f} | {ms / cast:.2f} |")
        fp8.ROW_WARPS = None
        del x
    print(f"# FP8 row kernel settings, {args.rows} rows, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
