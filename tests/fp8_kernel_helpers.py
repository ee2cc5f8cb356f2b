"""Runs the FP8 row kernel (`encoders.fp8_kernel`) on the CPU in Triton's interpreter and
prints, as JSON, what tests/test_fp8.py compares: for each case its scales' largest
relative distance to the torch path's (a scale is the row's largest magnitude after the
norm and activation, so it carries their arithmetic) and whether the padding is zero.

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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.encoders import fp8  # noqa: E402
from embedjob.encoders.fp8_kernel import fp8_quantize_rows_kernel  # noqa: E402

CASES = [  # (columns, norm, activation)
    (72, None, None),
    (72, "layer_norm", "gelu_tanh"),
    (100, "rms_norm", None),
    (100, None, "quick_gelu"),
    (1152, "layer_norm", None),
]
ROWS = 11
"""Rows of each case; one is all zeros (the smallest scale)."""


def launch(x: torch.Tensor, cols: int, norm: fp8.Norm | None, activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 rows and scales of `x` from the row kernel."""
    rows, padded = x.shape[0], fp8._padded(cols)
    quantized = torch.empty(rows, padded, dtype=fp8.FP8)
    scale = torch.empty(rows, 1)
    weight = x if norm is None else norm.weight
    bias = weight if norm is None or norm.bias is None else norm.bias
    constants = dict(
        BLOCK=triton.next_power_of_2(padded), TINY=fp8._TINY, LIMIT=fp8.FP8_MAX,
        ACTIVATION=0 if activation is None else fp8.ACTIVATIONS[activation][0],
        NORM=0 if norm is None else fp8.NORMS[norm.kind], EPS=1e-6 if norm is None else norm.eps,
    )
    fp8_quantize_rows_kernel[(rows,)](x, quantized, scale, weight, bias, x.stride(0), cols, padded, 0, GATED=False, **constants)
    return quantized, scale


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    results = []
    for cols, kind, activation in CASES:
        x = (torch.randn(ROWS, cols, generator=generator) * 3).to(torch.bfloat16)
        x[3] = 0
        weight, bias = torch.randn(cols, generator=generator), torch.randn(cols, generator=generator)
        norm = None if kind is None else fp8.Norm(kind, weight, bias if kind == "layer_norm" else None, 1e-6)
        _, torch_scale = fp8.quantize_input(x, fp8._padded(cols), cols, False, activation=activation, norm=norm)
        quantized, scale = launch(x, cols, norm, activation)
        results.append({
            "case": f"{cols} wide, {kind or 'no norm'}, {activation or 'no activation'}",
            "scale_error": float(((scale - torch_scale).abs() / torch_scale).max()),
            "padding_zero": bool((quantized[:, cols:].view(torch.uint8) == 0).all()),
        })
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
