"""FP8 row quantisation alone: the row kernel's memory rate at the towers' shapes, by blocks and warps per row (RESULTS.md section 6).

On an H200 the quantisation took 23 % of SigLIP-so400m's FP8 batch (108 calls of 618 us,
about 1.75 TB/s of the memory's 4.8; section 6), which keeps FP8 at 1.25x bf16 where the
target is 1.3x. This script times `torch.ops.embedjob.fp8_quantize_rows` (the Triton
kernel of `encoders.fp8_kernel`) alone on `--rows` rows (186,624: 256 SigLIP images of 729
patches, its largest batch) for each input the FP8 layers quantise, at each `--blocks`
(`fp8.ROW_BLOCKS`: the most power-of-two blocks a program holds its row in; 1 is one
block of the next power of two) and each `--warps` (`fp8.ROW_WARPS`; `default` is the rule
a job runs, `fp8.ROW_WARPS_BY_KIND`'s warps for the row's kind):

- SigLIP-so400m: 1,152 wide after the layer norm (q, k, v and fc1), 1,152 plain (the
  attention output), 4,304 after the tanh GELU (fc2);
- CLIP-L/14: 1,024 after the layer norm, 1,024 plain, 4,096 after quick GELU;
- the Qwen2.5-VL-7B tower: 1,280 after the RMS norm, the gated MLP's 3,420 (silu(gate) * up).

Per row: microseconds per call (CUDA events, median of `--repeats` after a warm-up), the
bytes it moves (bf16 in, FP8 and a scale out) per second, and that over the rate of a bf16
copy of the same input in the same process (a read and a write: what the memory gives a
kernel of this shape). The table is printed last.

    PYTHONPATH=. python3 benchmarks/quantize_rows.py [--rows 186624] [--blocks 3 1] [--warps default 2 4 8 16]

`--smoke` (no GPU) times the torch path of the same call (`fp8.quantize_input`) on the CPU
on 256 rows, saying so: the table and its arithmetic are checked, not the kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import log, median_seconds, skipped, table  # noqa: E402
from benchmarks.encoder_only import module_settings  # noqa: E402
from embedjob.encoders import fp8  # noqa: E402

SCRIPT = "quantize_rows"


@dataclass(frozen=True)
class Case:
    """One input an FP8 layer quantises: its tower, what reads it, its width and what is
    applied first (an `fp8.NORMS` name, an `fp8.ACTIVATIONS` name, or `fp8.GATES` "silu"
    on a joined gate|up row)."""

    tower: str
    reader: str
    cols: int
    norm: str | None = None
    activation: str | None = None
    gated: bool = False

    def describe(self) -> str:
        first = self.norm or self.activation or ("silu(gate) * up" if self.gated else "nothing")
        return f"{self.tower}: {self.reader}, {self.cols:,} wide after {first}"


CASES = [
    Case("SigLIP-so400m", "q, k, v and fc1", 1152, norm="layer_norm"),
    Case("SigLIP-so400m", "out_proj", 1152),
    Case("SigLIP-so400m", "fc2", 4304, activation="gelu_tanh"),
    Case("CLIP-L/14", "q, k, v and fc1", 1024, norm="layer_norm"),
    Case("CLIP-L/14", "out_proj", 1024),
    Case("CLIP-L/14", "fc2", 4096, activation="quick_gelu"),
    Case("Qwen2.5-VL-7B tower", "q, k, v, gate and up", 1280, norm="rms_norm"),
    Case("Qwen2.5-VL-7B tower", "down", 3420, gated=True),
]


def inputs(case: Case, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows the layer reads (bf16, seeded; a gated case's joined gate|up row), and a norm's weight and bias."""
    generator = torch.Generator(device=device).manual_seed(0)
    width = 2 * fp8._padded(case.cols) if case.gated else case.cols
    x = torch.randn(rows, width, generator=generator, device=device, dtype=torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(case.cols, generator=generator, device=device, dtype=torch.bfloat16)
    return x, weight, torch.zeros_like(weight)


def quantizer(case: Case, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, smoke: bool):
    """The call an FP8 layer makes for this input (`fp8.quantize_input`): the row kernel on a
    GPU, its torch path with --smoke."""
    if not smoke:
        fp8._register_row_quantizer()
    padded = fp8._padded(case.cols)
    norm = None
    if case.norm:
        norm = fp8.Norm(case.norm, weight, bias if case.norm == "layer_norm" else None, 1e-6 if case.norm == "rms_norm" else 1e-5)
    gate, up = ("silu", padded) if case.gated else (None, 0)
    return lambda: fp8.quantize_input(x, padded, case.cols, not smoke, activation=case.activation, norm=norm, gate=gate, up=up)


def moved(case: Case, x: torch.Tensor) -> int:
    """Bytes a call reads and writes: the bf16 rows it reads, FP8 rows of the padded width and a float32 scale each."""
    read = x.shape[0] * (2 * case.cols if case.gated else case.cols) * 2
    return read + x.shape[0] * (fp8._padded(case.cols) + 4)


def main() -> int:
    args = parse_args()
    if args.smoke:
        skipped(SCRIPT, "the Triton kernel", "--smoke times the torch path on the CPU instead")
    elif not torch.cuda.is_available():
        raise SystemExit("quantize_rows.py needs a CUDA device (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    rows = 256 if args.smoke else args.rows
    warps = ["default"] if args.smoke else args.warps
    blocks = [fp8.ROW_BLOCKS] if args.smoke else args.blocks
    lines = []
    for case in CASES:
        x, weight, bias = inputs(case, rows, device)
        copy = median_seconds(lambda: x.clone(), args.repeats, device)
        lines += case_lines(case, x, weight, bias, copy, blocks, warps, args)
    name = "cpu, the torch path standing in for the kernel" if args.smoke else torch.cuda.get_device_name(0)
    head = ["input (tower: the layers reading it)", "blocks (lanes)", "warps", "us a call", "TB/s", "/ bf16 copy's rate"]
    print("\n".join([f"# FP8 row quantisation, {rows:,} rows ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
                     f"device: {name}; torch {torch.__version__}; command: {' '.join(sys.argv)}", "", *table(head, lines, 2)]), flush=True)
    return 0


def case_lines(case: Case, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, copy: float,
               blocks: list[int], warps: list[str], args: argparse.Namespace) -> list[list[str]]:
    """The table's lines of one case: a call timed at each warps setting for each distinct
    split of its row into blocks (a width that splits no further under a larger `--blocks`
    runs the same kernel, so it is timed once)."""
    lines, timed = [], set()
    for most in blocks:
        widths = " + ".join(f"{width:,}" for width in fp8.row_blocks(fp8._padded(case.cols), most) if width)
        if widths in timed:
            continue
        timed.add(widths)
        for setting in warps:
            with module_settings({(fp8, "ROW_BLOCKS"): most, (fp8, "ROW_WARPS"): None if setting == "default" else int(setting)}):
                took = median_seconds(quantizer(case, x, weight, bias, args.smoke), args.repeats, x.device)
            rate = moved(case, x) / took
            lines.append([case.describe(), widths, setting, f"{took * 1e6:.1f}", f"{rate / 1e12:.2f}", f"{rate / (2 * x.nbytes / copy):.2f}"])
            log(SCRIPT, f"{case.describe()}, blocks {widths}, warps {setting}: {took * 1e6:.1f} us")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=186_624, help="rows a call quantises (SigLIP's largest batch: 256 x 729)")
    parser.add_argument("--blocks", nargs="+", type=int, default=[fp8.ROW_BLOCKS, 1], choices=[1, 2, 3],
                        help="fp8.ROW_BLOCKS values (the job's first)")
    parser.add_argument("--warps", nargs="+", default=["default", "2", "4", "8", "16"], help="fp8.ROW_WARPS values (default: a job's rule)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU only: the torch path on 256 rows")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
