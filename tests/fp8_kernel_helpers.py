"""Runs the FP8 row kernel (`encoders.fp8_kernel`) on the CPU in Triton's interpreter and
prints, as JSON, what tests/test_fp8.py compares: for each case and block count
(`fp8.ROW_BLOCKS`) its scales' largest relative distance to the torch path's (a scale is
the row's largest magnitude after the norm and activation, so it carries their
arithmetic), whether the padding is zero, and whether its bytes are those of the row held
in one block (the interpreter's own arithmetic on both sides).

Run with TRITON_INTERPRET=1 in the environment (Triton reads it when the kernels are
defined), as `python tests/fp8_kernel_helpers.py`. The interpreter's FP8 conversion is
not the GPU's (it made 64 of values that torch rounds to 128), so the FP8 values are
tests/test_gpu.py's to check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.encoders import fp8  # noqa: E402
from embedjob.encoders.fp8_kernel import fp8_quantize_rows_kernel  # noqa: E402

CASES = [  # (columns, norm, activation; "silu" with no norm: a joined gate|up row, gated)
    (72, None, None),
    (72, "layer_norm", "gelu_tanh"),
    (100, "rms_norm", None),
    (100, None, "quick_gelu"),
    (1152, "layer_norm", None),
    (1552, "layer_norm", "gelu"),
    (4304, None, "gelu_tanh"),
    (3420, None, "silu"),
]
BLOCKS = (1, 3)
"""`fp8.ROW_BLOCKS` values each case runs at: one block of the next power of two, and up to three."""
ROWS = 11
"""Rows of each case; one is all zeros (the smallest scale)."""


def launch(
    x: torch.Tensor, cols: int, norm: fp8.Norm | None, activation: str | None, blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 rows and scales of `x` from the row kernel, the row held in at most `blocks`
    blocks; with activation "silu", `x` is a joined gate|up row, the up half from column `padded`."""
    rows, padded = x.shape[0], fp8._padded(cols)
    gated = activation == "silu"
    quantized = torch.empty(rows, padded, dtype=fp8.FP8)
    scale = torch.empty(rows, 1)
    weight = x if norm is None else norm.weight
    bias = weight if norm is None or norm.bias is None else norm.bias
    head, mid, tail = fp8.row_blocks(padded, blocks)
    code = 0 if activation is None else (fp8.GATES if gated else fp8.ACTIVATIONS)[activation][0]
    constants = dict(
        HEAD=head, MID=mid, TAIL=tail, TINY=fp8._TINY, LIMIT=fp8.FP8_MAX, ACTIVATION=code,
        NORM=0 if norm is None else fp8.NORMS[norm.kind], EPS=1e-6 if norm is None else norm.eps, GATED=gated,
    )
    fp8_quantize_rows_kernel[(rows,)](x, quantized, scale, weight, bias, x.stride(0), cols, padded, padded if gated else 0, **constants)
    return quantized, scale


def torch_scale(x: torch.Tensor, cols: int, norm: fp8.Norm | None, activation: str | None) -> torch.Tensor:
    """The scales of the torch path of the same call (`fp8.quantize_input`)."""
    padded = fp8._padded(cols)
    if activation == "silu":
        return fp8.quantize_input(x, padded, cols, False, gate="silu", up=padded)[1]
    return fp8.quantize_input(x, padded, cols, False, activation=activation, norm=norm)[1]


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    results = []
    for cols, kind, activation in CASES:
        width = 2 * fp8._padded(cols) if activation == "silu" else cols
        x = (torch.randn(ROWS, width, generator=generator) * 3).to(torch.bfloat16)
        x[3] = 0
        weight, bias = torch.randn(cols, generator=generator), torch.randn(cols, generator=generator)
        norm = None if kind is None else fp8.Norm(kind, weight, bias if kind == "layer_norm" else None, 1e-6)
        want = torch_scale(x, cols, norm, activation)
        one_block = launch(x, cols, norm, activation, 1)[0].view(torch.uint8)
        for blocks in BLOCKS:
            quantized, scale = launch(x, cols, norm, activation, blocks)
            results.append({
                "case": f"{cols} wide, {kind or 'no norm'}, {activation or 'no activation'}, at most {blocks} blocks",
                "scale_error": float(((scale - want).abs() / want).max()),
                "padding_zero": bool((quantized[:, cols:].view(torch.uint8) == 0).all()),
                "as_one_block": bool(torch.equal(quantized.view(torch.uint8), one_block)),
            })
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
