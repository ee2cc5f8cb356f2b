"""The Triton kernel behind `torch.ops.embedjob.fp8_quantize_rows` (`encoders.fp8`): one
program per row quantises it to FP8 with one scale from its largest magnitude, after the
block's norm or an MLP activation where asked, or, gated, after forming a gated MLP's
hidden state `act(gate) * up` from the two halves of the joined gate|up row. Imported only
where the op is registered (CUDA machines), since Triton is not needed elsewhere.

A program holds its row as up to three blocks of power-of-two widths (`HEAD`, `MID`,
`TAIL`; `fp8.row_blocks` picks them), not one block of the next power of two: SigLIP's
1,152 columns are 1,024 + 128 lanes, not 2,048, and its 4,304 are 4,096 + 128 + 128, not
8,192, so a program does not compute on, nor hold registers for, lanes outside its row.

Invariants: `q * scale` approximates the (normed, activated or gated) row, rounded to
nearest even; columns from `cols` to `padded` are zero; a row of zeros gets the smallest
scale; the blocks together cover `padded` columns.
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
def loaded(start, FIRST: tl.constexpr, SIZE: tl.constexpr, cols, up, ACTIVATION: tl.constexpr, GATED: tl.constexpr):
    """Columns [`FIRST`, `FIRST` + `SIZE`) of the row at `start` in float32, zero from
    `cols` on; `GATED`: `act(gate) * up` of those columns, the up half from column `up`."""
    offsets = FIRST + tl.arange(0, SIZE)
    inside = offsets < cols
    x = tl.load(start + offsets, mask=inside, other=0.0).to(tl.float32)
    if GATED:
        x = activated(x, ACTIVATION) * tl.load(start + up + offsets, mask=inside, other=0.0).to(tl.float32)
    return x


@triton.jit
def total(head, mid, tail, MID: tl.constexpr, TAIL: tl.constexpr):
    """The sum over the row's blocks (`mid` and `tail` count only where their width is not 0)."""
    result = tl.sum(head, axis=0)
    if MID > 0:
        result += tl.sum(mid, axis=0)
    if TAIL > 0:
        result += tl.sum(tail, axis=0)
    return result


@triton.jit
def largest(head, mid, tail, MID: tl.constexpr, TAIL: tl.constexpr):
    """The largest magnitude over the row's blocks (as `total`)."""
    result = tl.max(tl.abs(head), axis=0)
    if MID > 0:
        result = tl.maximum(result, tl.max(tl.abs(mid), axis=0))
    if TAIL > 0:
        result = tl.maximum(result, tl.max(tl.abs(tail), axis=0))
    return result


@triton.jit
def centred(x, FIRST: tl.constexpr, SIZE: tl.constexpr, cols, mean):
    """A block of the row less the row's `mean`, still zero from `cols` on."""
    return tl.where(FIRST + tl.arange(0, SIZE) < cols, x - mean, 0.0)


@triton.jit
def scaled(x, FIRST: tl.constexpr, SIZE: tl.constexpr, cols, factor, w_ptr, b_ptr, NORM: tl.constexpr):
    """A block of the row times the norm's `factor`, its weight and (a layer norm's) bias;
    still zero from `cols` on."""
    offsets = FIRST + tl.arange(0, SIZE)
    inside = offsets < cols
    x = x * factor * tl.load(w_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if NORM == 1:
        x = x + tl.load(b_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    return x


@triton.jit
def stored(q_ptr, x, FIRST: tl.constexpr, SIZE: tl.constexpr, padded, scale, LIMIT: tl.constexpr):
    """Writes a block of the row as FP8 of `scale`, up to column `padded`."""
    offsets = FIRST + tl.arange(0, SIZE)
    q = tl.clamp(x / scale, -LIMIT, LIMIT)
    tl.store(q_ptr + offsets, q.to(q_ptr.dtype.element_ty), mask=offsets < padded)


@triton.jit
def fp8_quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, w_ptr, b_ptr, stride, cols, padded, up,
    HEAD: tl.constexpr, MID: tl.constexpr, TAIL: tl.constexpr, TINY: tl.constexpr, LIMIT: tl.constexpr,
    ACTIVATION: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, GATED: tl.constexpr,
):
    """One program per row holds the whole row (blocks of `HEAD`, `MID` and `TAIL`
    columns in turn, `MID` and `TAIL` possibly 0, together at least `padded`), so it is
    read once: the norm, then the activation, then the scale and the FP8 values.
    `GATED`: the row is the joined gate|up product's, the gate in columns [0, `cols`) and
    the up half from column `up`, and the quantised row is `act(gate) * up` in float32
    (no norm: a gated MLP's norm comes before its gate and up projections). The norm's
    epsilon is a constant because under the compiler a float argument arrives as
    float64, which has no conversion to FP8."""
    MID_LANES: tl.constexpr = MID if MID > 0 else 1  # an absent block: one lane past the row, never stored or reduced
    TAIL_LANES: tl.constexpr = TAIL if TAIL > 0 else 1
    TAIL_FIRST: tl.constexpr = HEAD + MID
    row = tl.program_id(0).to(tl.int64)
    start = x_ptr + row * stride
    head = loaded(start, 0, HEAD, cols, up, ACTIVATION, GATED)
    mid = loaded(start, HEAD, MID_LANES, cols, up, ACTIVATION, GATED)
    tail = loaded(start, TAIL_FIRST, TAIL_LANES, cols, up, ACTIVATION, GATED)
    if NORM == 1:
        mean = total(head, mid, tail, MID, TAIL) / cols
        head = centred(head, 0, HEAD, cols, mean)
        mid = centred(mid, HEAD, MID_LANES, cols, mean)
        tail = centred(tail, TAIL_FIRST, TAIL_LANES, cols, mean)
    if NORM != 0:
        factor = tl.rsqrt(total(head * head, mid * mid, tail * tail, MID, TAIL) / cols + EPS)
        head = scaled(head, 0, HEAD, cols, factor, w_ptr, b_ptr, NORM)
        mid = scaled(mid, HEAD, MID_LANES, cols, factor, w_ptr, b_ptr, NORM)
        tail = scaled(tail, TAIL_FIRST, TAIL_LANES, cols, factor, w_ptr, b_ptr, NORM)
    if not GATED:
        head = activated(head, ACTIVATION)
        mid = activated(mid, ACTIVATION)
        tail = activated(tail, ACTIVATION)
    scale = tl.maximum(largest(head, mid, tail, MID, TAIL), TINY) / LIMIT
    out = q_ptr + row * padded
    stored(out, head, 0, HEAD, padded, scale, LIMIT)
    if MID > 0:
        stored(out, mid, HEAD, MID, padded, scale, LIMIT)
    if TAIL > 0:
        stored(out, tail, TAIL_FIRST, TAIL, padded, scale, LIMIT)
    tl.store(scale_ptr + row, scale)
