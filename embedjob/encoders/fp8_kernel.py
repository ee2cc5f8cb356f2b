"""The Triton kernel behind `torch.ops.embedjob.fp8_quantize_rows` (`encoders.fp8`): one
program per row quantises it to FP8 with one scale from its largest magnitude, after the
block's norm or an MLP activation where asked, or, gated, after forming a gated MLP's
hidden state `act(gate) * up` from the two halves of the joined gate|up row. Imported only
where the op is registered (CUDA machines), since Triton is not needed elsewhere.

Invariants: `q * scale` approximates the (normed, activated or gated) row, rounded to
nearest even; columns from `cols` to `padded` are zero; a row of zeros gets the smallest scale.
"""

import triton
import triton.language as tl


@triton.jit
def activated(x, ACTIVATION: tl.constexpr):
    """`x` after the activation of `fp8.ACTIVATIONS` or `fp8.GATES` code `ACTIVATION` (0:
    none), in float32; each maps 0 to 0, so a row stays zero outside its columns."""
    if ACTIVATION == 1:  # gelu, tanh approximation: 0.5 x (1 + tanh(z)) = x sigmoid(2 z)
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACTIVATION == 2:  # gelu
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 3:  # quick_gelu
        x = x * tl.sigmoid(1.702 * x)
    elif ACTIVATION == 4:  # silu
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def normed(x, inside, w_ptr, b_ptr, offsets, cols, eps, NORM: tl.constexpr):
    """`x` (one row, zero outside `inside`) after the norm of `fp8.NORMS` code `NORM` (0:
    none), in float32; still zero outside `inside`."""
    if NORM == 1:  # layer norm
        mean = tl.sum(x, axis=0) / cols
        centred = tl.where(inside, x - mean, 0.0)
        x = centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / cols + eps)
        x = x * tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        x = x + tl.load(b_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    elif NORM == 2:  # RMS norm
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) / cols + eps)
        x = x * tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    return x


@triton.jit
def fp8_quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, w_ptr, b_ptr, stride, cols, padded, up,
    BLOCK: tl.constexpr, TINY: tl.constexpr, LIMIT: tl.constexpr, ACTIVATION: tl.constexpr, NORM: tl.constexpr,
    EPS: tl.constexpr, GATED: tl.constexpr,
):
    """One program per row holds the whole row (`BLOCK` >= `padded`), so it is read once:
    the norm, then the activation, then the scale and the FP8 values. `GATED`: the row is
    the joined gate|up product's, the gate in columns [0, `cols`) and the up half from
    column `up`, and the quantised row is `act(gate) * up` in float32 (no norm: a gated
    MLP's norm comes before its gate and up projections). The norm's epsilon is a
    constant because under the compiler a float argument arrives as float64, which has
    no conversion to FP8."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < cols
    start = x_ptr + row * stride
    x = tl.load(start + offsets, mask=inside, other=0.0).to(tl.float32)
    if GATED:
        x = activated(x, ACTIVATION) * tl.load(start + up + offsets, mask=inside, other=0.0).to(tl.float32)
    else:
        x = activated(normed(x, inside, w_ptr, b_ptr, offsets, cols, EPS, NORM), ACTIVATION)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), TINY) / LIMIT
    q = tl.clamp(x / scale, -LIMIT, LIMIT)
    tl.store(q_ptr + row * padded + offsets, q.to(q_ptr.dtype.element_ty), mask=offsets < padded)
    tl.store(scale_ptr + row, scale)
