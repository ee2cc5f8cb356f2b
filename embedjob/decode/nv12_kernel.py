"""The Triton kernel behind `nvdec.nv12_to_rgb` on CUDA with `nvdec.FUSED_RGB`: one pass
from the decoder's NV12 surfaces to RGB, each output row read once and written once.

The torch path makes some twenty kernels of a batch, each reading and writing float32
frames (about 40 bytes a pixel in all); this one reads the NV12 (1.5 bytes a pixel) and
writes the RGB (3). Beside the encoder each kernel also waits for SMs, so one launch in
place of twenty matters as much as the bytes. Imported only on CUDA machines, where the
caller has a GPU tensor, since Triton is not needed elsewhere.

Invariants: the arithmetic is the torch path's, in float32 and in its order (luma from
16-235 unless full range, chroma less 128, the matrix, then floor, clamp to 0-255), so
the two agree to the level but where the compiler fuses a multiply and an add into one
rounding: a value within a rounding of a whole level may floor one level apart.
"""

import threading

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Output columns per program (a 1080p row is two programs)."""


@triton.jit
def _nv12_rows(nv12, rgb, frame_stride, row_stride, rows, height, width, red_v, blue_u, green_u, green_v,
               FULL: tl.constexpr, BLOCK: tl.constexpr):
    """One output row (`program_id(0)` = frame * height + row) of `BLOCK` columns: luma
    from the row, chroma from its pair's interleaved U, V row below the `rows` luma rows."""
    line = tl.program_id(0)
    frame = line // height
    y = line % height
    x = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = x < width
    source = nv12 + frame.to(tl.int64) * frame_stride
    luma = tl.load(source + y * row_stride + x, mask=inside, other=0).to(tl.float32)
    pair = source + (rows + y // 2) * row_stride + (x // 2) * 2
    u = tl.load(pair, mask=inside, other=128).to(tl.float32) - 128.0
    v = tl.load(pair + 1, mask=inside, other=128).to(tl.float32) - 128.0
    if not FULL:
        luma = (luma - 16.0) * 1.1643835616438356
    red = tl.minimum(tl.maximum(tl.floor(luma + red_v * v), 0.0), 255.0)
    green = tl.minimum(tl.maximum(tl.floor(luma - green_u * u - green_v * v), 0.0), 255.0)
    blue = tl.minimum(tl.maximum(tl.floor(luma + blue_u * u), 0.0), 255.0)
    plane = height * width
    target = rgb + frame.to(tl.int64) * 3 * plane + y * width + x
    tl.store(target, red.to(tl.uint8), mask=inside)
    tl.store(target + plane, green.to(tl.uint8), mask=inside)
    tl.store(target + 2 * plane, blue.to(tl.uint8), mask=inside)


_launching = threading.Lock()


def nv12_to_rgb(nv12: torch.Tensor, height: int, width: int, rows: int, coefficients: tuple[float, float, float, float],
                full: bool) -> torch.Tensor:
    """(T, 3, `height`, `width`) uint8 RGB of the (T, S, `width`) uint8 NV12 frames whose
    luma takes the first `rows` rows (`height` of them shown), by the float `coefficients`
    (V to red, U to blue, U and V off green, already scaled for `full` range), queued on
    the current stream. Launched under a lock: Triton compiles a kernel for each new
    specialisation (range, alignments) on the thread that first launches it, and decode
    threads starting together would each compile it; a launch holds the GIL anyway."""
    if nv12.stride(-1) != 1:
        nv12 = nv12.contiguous()
    frames = nv12.shape[0]
    rgb = torch.empty((frames, 3, height, width), dtype=torch.uint8, device=nv12.device)
    grid = (frames * height, triton.cdiv(width, BLOCK))
    with _launching:
        _nv12_rows[grid](nv12, rgb, nv12.stride(0), nv12.stride(1), rows, height, width, *coefficients, FULL=full, BLOCK=BLOCK)
    return rgb
