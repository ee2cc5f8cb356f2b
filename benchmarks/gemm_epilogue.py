"""fc1 with bias and quick GELU in a Triton Hopper GEMM's epilogue against cuBLAS and a separate GELU kernel (RESULTS.md section 7).

Issue #57: CLIP-L/14-336's fc1 output (256 images x 577 tokens x 4,096, bf16) is written by
cuBLAS, read back by quick GELU's kernel (x * sigmoid(1.702 x)) and written again: ~10 % of a
batch; cuBLASLt has no quick-GELU epilogue. This times Triton GEMMs that add the bias and apply
quick GELU to the float32 accumulator before one bf16 write against, in the same process:
`torch.addmm(b, x, w.t())` alone (the ceiling); addmm + eager quick GELU; addmm + a
`torch.compile`d quick GELU (one pointwise kernel, what plain torch.compile gives: every
row's speed is against it); cuBLASLt's tanh-GELU epilogue (`torch._addmm_activation`, another
function: its time only); and a bf16 8192³ matmul, the GPU's reference rate.

Triton rows: "persistent" (the library's kernel, `embedjob.encoders.gemm_kernel`: a program
per SM walking the tiles, GROUP_M rows of tiles at a time) or "tiles" (a program a tile, made
here of the library's tile code); "TMA" (host-side descriptors) or "pointers" (on a GPU one
config, for TMA's gain; all where `triton.tools.tensor_descriptor` does not import); config
BLOCK_MxBLOCK_NxBLOCK_K, wN warps, sN stages, gN GROUP_M, "ws" the tile loop's
`tl.range(..., warp_specialize=True)`. A config that does not compile or launch is a row
"failed: <reason>". Shapes (`--shapes`; M x K x N, the weight [N, K] as nn.Linear holds it):
clip-l 147,712 x 1,024 x 4,096 (256 images), clip-l-64 36,928 x 1,024 x 4,096, siglip
186,624 x 1,152 x 4,352 (256 SigLIP-so400m images, the MLP padded).

Columns: ms (CUDA events, median of `--repeats` single calls after a warm-up), TFLOP/s (2 M N K
over it), speed over addmm + compiled GELU (above 1: faster), the least row cosine and the
largest absolute difference to float32 `quick_gelu(x @ w.T + b)` over the whole output, the
least row cosine to the addmm + compiled GELU output, and the check: a row under 0.9999 to
float32 is WRONG and the script exits 1. The table is printed last.

    PYTHONPATH=. python3 benchmarks/gemm_epilogue.py [--shapes clip-l clip-l-64 siglip] [--repeats 20]

`--smoke` (no GPU) sets TRITON_INTERPRET=1 before triton is imported and runs every kernel in
Triton's interpreter on a 100 x 64 x 128 product with small tiles (the dot's operands taken to
float32 there: `gemm_kernel.INTERPRETED`), checked against torch on the CPU; timings mean
nothing. The TMA kernels run where the interpreter takes descriptors (a probe says); any
failed row exits 1.
Triton 3.6's interpreter cannot run them under numpy 2.5 (its `range` over a tensor bound
fails: "only 0-dimensional arrays..."); 3.8's can. The GPU path runs on both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if "--smoke" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # read as kernels are decorated: before triton (or torch) is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import log, median_seconds, table  # noqa: E402
from embedjob.encoders import gemm_kernel  # noqa: E402
from embedjob.encoders.fp8 import ACTIVATIONS  # noqa: E402
from embedjob.encoders.gemm_kernel import (  # noqa: E402
    INTERPRETED, Config, TensorDescriptor, activated_tile, store_tile, tile_origin,
)

SCRIPT = "gemm_epilogue"
MIN_COSINE = 0.9999
QUICK_GELU = tl.constexpr(ACTIVATIONS["quick_gelu"][0])
"""The activation code the tile kernel applies (`fp8_kernel.activated`)."""


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int

    def describe(self) -> str:
        return f"{self.name} {self.m:,}x{self.k:,}x{self.n:,}"


SHAPES = {s.name: s for s in (Shape("clip-l", 256 * 577, 1024, 4096), Shape("clip-l-64", 64 * 577, 1024, 4096),
                              Shape("siglip", 256 * 729, 1152, 4352))}
SMOKE_SHAPE = Shape("tiny", 100, 64, 128)


CONFIGS = [Config(128, 128, 64, 4, 4), Config(128, 128, 64, 8, 3), Config(128, 256, 64, 8, 3), Config(128, 256, 64, 8, 4)]
WS_CONFIGS = [Config(128, 128, 64, 4, 3, warp_specialize=True), Config(128, 256, 64, 8, 3, warp_specialize=True)]
SMOKE_CONFIGS = [Config(32, 32, 16, 4, 2, group_m=2), Config(32, 64, 16, 4, 3, group_m=2, warp_specialize=True)]


@dataclass
class Row:
    """One line of the table: what ran, its median seconds and its accuracy ("ok", "WRONG: ..." or "failed: ...")."""

    shape: Shape
    variant: str
    seconds: float | None = None
    cosine: float | None = None
    max_error: float | None = None
    cosine_cublas: float | None = None
    check: str = "ok"


# --- the kernels ------------------------------------------------------------------------------


@triton.jit
def tiles_kernel(a, w, bias, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program an output tile (the library's `persistent_kernel` walks them), of the library's tile code."""
    off_m, off_n = tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    out = activated_tile(a, w, bias, off_m, off_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, TMA, DOT_FP32, QUICK_GELU)
    store_tile(c, out, off_m, off_n, M, N, BLOCK_M, BLOCK_N, TMA)


@triton.jit
def _probe_kernel(src, dst, BLOCK: tl.constexpr):
    tile = src.load([0, 0])
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs[:, None] * BLOCK + offs[None, :], tile)


def descriptors_work(device: torch.device) -> str | None:
    """None where host TMA descriptors run here, else why not (old triton, or an interpreter without them)."""
    if TensorDescriptor is None:
        return "triton.tools.tensor_descriptor does not import"
    src = torch.randn(16, 16, device=device, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    try:
        _probe_kernel[(1,)](TensorDescriptor.from_tensor(src, [16, 16]), dst, BLOCK=16)
    except Exception as error:  # noqa: BLE001 - whatever the interpreter or the compiler says
        return reason(error)
    return None if torch.equal(src, dst) else "the probe's descriptor load read wrong values"


def launcher(kind: str, tma: bool, cfg: Config, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
             programs: int) -> Callable[[], None]:
    """A call of one kernel on one config writing `out`; descriptors made once, outside the timed call."""
    (m, k), n = x.shape, w.shape[0]
    a, wt, c = gemm_kernel.operands(x, w, out, cfg, tma)
    if kind == "persistent":
        return lambda: gemm_kernel.launch(a, wt, b, c, (m, k, n), "quick_gelu", cfg, programs, tma)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return lambda: tiles_kernel[(tiles,)](a, wt, b, c, m, n, k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                          GROUP_M=cfg.group_m, STAGES=cfg.stages, TMA=tma, DOT_FP32=INTERPRETED,
                                          num_warps=cfg.warps, num_stages=cfg.stages)


# --- checks and timing ------------------------------------------------------------------------


quick_gelu = ACTIVATIONS["quick_gelu"][1]
"""The float32 definition the kernel's epilogue computes (`fp8.ACTIVATIONS`)."""


def reason(error: BaseException) -> str:
    """An error's first sentence, short enough for a table cell."""
    line = next((s for s in str(error).splitlines() if s.strip()), type(error).__name__)
    return f"{type(error).__name__}: {line.strip().split('. ')[0]}"[:110].replace("|", "/")


def compare(out: torch.Tensor, target: torch.Tensor, chunk: int = 16384) -> tuple[float, float]:
    """The least row cosine and the largest absolute difference of two [M, N] matrices, in
    float32, `chunk` rows at a time; NaN anywhere gives NaN."""
    cosines, errors = [], []
    for start in range(0, out.shape[0], chunk):
        a, b = out[start:start + chunk].float(), target[start:start + chunk].float()
        cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=1).min())
        errors.append((a - b).abs().max())
    return torch.stack(cosines).min().item(), torch.stack(errors).max().item()


def check(row: Row, out: torch.Tensor, reference: torch.Tensor, cublas: torch.Tensor | None) -> Row:
    """Fills a row's accuracy columns: WRONG where its least row cosine to float32 is under MIN_COSINE (or NaN)."""
    row.cosine, row.max_error = compare(out, reference)
    row.cosine_cublas = None if cublas is None else compare(out, cublas)[0]
    row.check = "ok"
    if not row.cosine >= MIN_COSINE:
        row.check = f"WRONG: cosine {row.cosine:.6f} < {MIN_COSINE}"
    return row


def inputs(shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K], w [N, K] at nn.Linear's scale and a bias large enough that leaving it out shows, all bf16, seeded."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.m, shape.k, generator=generator, device=device, dtype=torch.bfloat16)
    w = (torch.randn(shape.n, shape.k, generator=generator, device=device) / shape.k**0.5).to(torch.bfloat16)
    b = (0.2 * torch.randn(shape.n, generator=generator, device=device)).to(torch.bfloat16)
    return x, w, b


def variants(smoke: bool, tma: bool) -> list[tuple[str, bool, Config]]:
    """(kernel, through TMA, config) to run: ws on the persistent tile loop only; with TMA on a
    GPU, the pointer kernels on one config."""
    configs = SMOKE_CONFIGS if smoke else CONFIGS + WS_CONFIGS
    return [(kind, through, cfg) for kind in ("persistent", "tiles") for through in ((True, False) if tma else (False,))
            for cfg in configs if (kind == "persistent" or not cfg.warp_specialize)
            and (through or smoke or not tma or cfg == CONFIGS[1])]


def shape_rows(shape: Shape, repeats: int, smoke: bool, device: torch.device, programs: int, tma: bool) -> list[Row]:
    """The baselines' rows, then each Triton variant's."""
    x, w, b = inputs(shape, device)
    reference = quick_gelu(x.float() @ w.float().T + b.float())
    compiled = torch.compile(quick_gelu, dynamic=False)
    baselines = {
        "cuBLAS addmm, no activation (ceiling)": lambda: torch.addmm(b, x, w.t()),
        "cuBLAS addmm + compiled quick gelu": lambda: compiled(torch.addmm(b, x, w.t())),
        "cuBLAS addmm + eager quick gelu": lambda: quick_gelu(torch.addmm(b, x, w.t())),
        "cuBLASLt tanh-GELU epilogue (another function)": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
    }
    rows, cublas = [], None
    for name, fn in baselines.items():
        row, out = Row(shape, name, check="-"), fn()
        if "quick gelu" in name:  # the others compute another function
            check(row, out, reference, cublas)
            cublas = out if cublas is None else cublas  # the compiled path's output
        row.seconds = median_seconds(fn, repeats, device, warmup=3)
        rows.append(log_row(row))
    out = torch.empty_like(reference, dtype=torch.bfloat16)
    for rows_at_a_time in CHUNK_ROWS if not smoke else (32,):
        row = Row(shape, f"cuBLAS addmm + compiled quick gelu in place, {rows_at_a_time} rows at a time (one graph)")
        rows.append(log_row(triton_row(row, in_chunks(x, w, b, out, rows_at_a_time), out, reference, cublas, repeats)))
    for kind, through, cfg in variants(smoke, tma):
        fn = launcher(kind, through, cfg, x, w, b, out, programs)
        row = Row(shape, f"{kind}, {'TMA' if through else 'pointers'}, {cfg.describe()}")
        rows.append(log_row(triton_row(row, fn, out, reference, cublas, repeats)))
    return rows


CHUNK_ROWS = (1024, 2048, 4096, 8192)
"""Rows of fc1 a chunked variant makes at a time: at 4,096 columns of bf16, 8-64 MB, so up to
4,096 rows the chunk's product may still sit in L2 (50 MB on an H100) when the GELU reads it."""


def in_chunks(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: int) -> Callable[[], None]:
    """cuBLAS's product and the compiled quick GELU (in place) `rows` rows at a time into `out`,
    so each GELU may read its chunk from L2 rather than memory; on a GPU the chunks' launches
    are one CUDA graph (as the engine replays its blocks), so only the kernels are timed."""
    gelu = torch.compile(lambda y: y.copy_(quick_gelu(y)), dynamic=False)

    def run() -> None:
        for start in range(0, x.shape[0], rows):
            chunk = out[start:start + rows]
            torch.addmm(b, x[start:start + rows], w.t(), out=chunk)
            gelu(chunk)

    if not out.is_cuda:
        return run
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles each chunk shape before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def triton_row(row: Row, fn: Callable[[], None], out: torch.Tensor, reference: torch.Tensor, cublas: torch.Tensor,
               repeats: int) -> Row:
    """Compiles and runs a kernel once into a NaN-filled `out`, checks it, then times it."""
    out.fill_(float("nan"))
    try:
        fn()
        if out.is_cuda:
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a config that does not compile or launch is a row
        row.check = f"failed: {reason(error)}"
        return row
    check(row, out, reference, cublas)
    row.seconds = median_seconds(fn, repeats, out.device, warmup=3)
    return row


def log_row(row: Row) -> Row:
    took = "-" if row.seconds is None else f"{row.seconds * 1e3:.3f} ms"
    log(SCRIPT, f"{row.shape.describe()}, {row.variant}: {took}, {row.check}")
    return row


def reference_matmul(device: torch.device, size: int, repeats: int) -> Row:
    """The bf16 size³ matmul's rate, the GPU's reference."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    row = Row(Shape("reference", size, size, size), "bf16 matmul", check="-")
    row.seconds = median_seconds(lambda: a @ b, repeats, device, warmup=3)
    return log_row(row)


def cells(row: Row, compiled: dict[str, float]) -> list[str]:
    shape, s = row.shape, row.seconds
    speed = "-" if s is None or shape.name not in compiled else f"{compiled[shape.name] / s:.3f}x"
    flops = "-" if s is None else f"{2 * shape.m * shape.n * shape.k / s / 1e12:.1f}"
    accuracy = ((row.cosine, ".6f"), (row.max_error, ".4f"), (row.cosine_cublas, ".6f"))
    return [shape.describe(), row.variant, "-" if s is None else f"{s * 1e3:.3f}", flops, speed,
            *("-" if v is None else f"{v:{spec}}" for v, spec in accuracy), row.check]


def main() -> int:
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gemm_epilogue.py needs a CUDA device (or --smoke)")
    torch.set_float32_matmul_precision("highest")  # the float32 reference without TF32
    device = torch.device("cpu" if args.smoke else "cuda")
    programs = 3 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    repeats = min(args.repeats, 2) if args.smoke else args.repeats
    no_tma = descriptors_work(device)
    rows = [reference_matmul(device, 256 if args.smoke else 8192, repeats)]
    for shape in [SMOKE_SHAPE] if args.smoke else [SHAPES[name] for name in args.shapes]:
        rows += shape_rows(shape, repeats, args.smoke, device, programs, no_tma is None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    compiled = {r.shape.name: r.seconds for r in rows if r.variant == "cuBLAS addmm + compiled quick gelu"}
    head = ["shape", "variant", "ms", "TFLOP/s", "vs addmm + compiled gelu", "min cos to fp32", "max abs err",
            "min cos to cuBLAS + gelu", "check"]
    notes = [f"TMA kernels skipped ({no_tma}): the pointer kernels only" if no_tma else "TMA: host-side TensorDescriptor"]
    if args.smoke:
        notes.append("--smoke: TRITON_INTERPRET=1 on the CPU (torch's CPU ops for cuBLAS): timings not meaningful")
    name = "cpu, Triton's interpreter" if args.smoke else torch.cuda.get_device_name(0)
    print("\n".join([f"# GEMM + bias + quick GELU epilogue ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
                     f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; command: {' '.join(sys.argv)}",
                     *notes, "", *table(head, [cells(r, compiled) for r in rows], 2)]), flush=True)
    bad = [r for r in rows if r.check.startswith("WRONG") or (args.smoke and r.check != "ok" and r.check != "-")]
    right = [r for r in rows if r.variant.startswith(("persistent", "tiles")) and r.check == "ok"]
    if bad or not right:
        log(SCRIPT, f"{len(bad)} rows wrong (or failed in --smoke), {len(right)} Triton rows right: exit 1")
        return 1
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="products to time (M x K x N above)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each variant (the median is reported)")
    parser.add_argument("--smoke", action="store_true", help="CPU only: Triton's interpreter on a 100 x 64 x 128 product")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
