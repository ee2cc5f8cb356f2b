"""How long a decoded frame's copy waits beside the encoder's products (RESULTS.md section 11).

In a `video.decoder: nvdec` job the GPU's decoder reads 30 clips a second where alone it
reads 55, and with the tower's tiny version 45: its calls wait for work queued behind the
encoder's kernels. Each `Decode` that shows a picture ends in PyNvVideoCodec's copy of it
and a wait for the decoder's stream, and the job copies every wanted frame out before the
decoder reuses it. A copy that runs on the SMs waits for them behind the products; one
the copy engines run does not. This script says which each way of copying is, at the
size of a 1080p NV12 frame: the time from queueing the copy on a stream of its own to its
end (`perf_counter` around the queueing and the stream's wait, median and 90th percentile
of `--repeats`), alone and beside `common.GemmLoad` (bf16 products replayed back to back
on another stream, as the encoder's graphs run), the products leaving 16 SMs free by
torch's carveout (cuBLAS's kernels only) or by a green context (`engine.green`, every
kernel on its stream), their rate alone under the table. The process takes the job's 32
hardware work queues (`config.spread_device_queues`; the first run, 12-08, had CUDA's 8,
which a copy's stream may share with the products'):

- `torch copy_`: `Tensor.copy_` between contiguous frames (what `nvdec._copied_out` does);
- `torch copy_, pitched source`: from a frame whose rows are 2,048 bytes apart, as a
  decoder's mapped surface is;
- `driver DtoD`: `cuMemcpyDtoDAsync` of the contiguous frame;
- `driver 2D`: `cuMemcpy2DAsync` from the pitched frame (`nvdec.engine_copy`, what
  `nvdec.COPY_ENGINE` copies with);
- `kernel`: one elementwise torch kernel over the frame (`bitwise_not`), as the NV12
  conversion's twenty are.

    PYTHONPATH=. python3 benchmarks/copy_wait.py [--repeats 40]

`--smoke` (no GPU) prints the table with every row skipped, saying so.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import GemmLoad, fmt, skipped, table  # noqa: E402
from embedjob.config import spread_device_queues  # noqa: E402
from embedjob.decode.nvdec import engine_copy  # noqa: E402

SCRIPT = "copy_wait.py"
HEIGHT, WIDTH, PITCH = 1080 * 3 // 2, 1920, 2048
OPS = ("torch copy_", "torch copy_, pitched source", "driver DtoD", "driver 2D", "kernel")
FREE_SMS = 16
SETTINGS = ("alone", "beside bf16 products", f"beside them, cuBLAS leaving {FREE_SMS} SMs (carveout)",
            f"beside them, a green context leaving {FREE_SMS} SMs")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40, help="copies timed per row (40)")
    parser.add_argument("--smoke", action="store_true", help="no GPU: the table with every row skipped")
    return parser.parse_args()


def ops(device: torch.device) -> dict[str, Callable[[torch.cuda.Stream], None]]:
    """Each way of copying a 1080p NV12 frame, queued on the stream given."""
    driver = ctypes.CDLL("libcuda.so.1")
    pitched = torch.randint(0, 255, (HEIGHT, PITCH), dtype=torch.uint8, device=device)
    source = pitched[:, :WIDTH]
    flat = source.contiguous()
    target = torch.empty_like(flat)

    def checked(status: int, call: str) -> None:
        if status:
            raise RuntimeError(f"{call} returned CUDA error {status}")

    return {
        "torch copy_": lambda stream: target.copy_(flat),
        "torch copy_, pitched source": lambda stream: target.copy_(source),
        "driver DtoD": lambda stream: checked(driver.cuMemcpyDtoDAsync_v2(
            ctypes.c_uint64(target.data_ptr()), ctypes.c_uint64(flat.data_ptr()), ctypes.c_size_t(flat.numel()),
            ctypes.c_void_p(stream.cuda_stream)), "cuMemcpyDtoDAsync"),
        "driver 2D": lambda stream: engine_copy(target, source),
        "kernel": lambda stream: torch.bitwise_not(flat, out=target),
    }


def waits(op: Callable[[torch.cuda.Stream], None], stream: torch.cuda.Stream, repeats: int) -> tuple[float, float]:
    """Median and 90th percentile ms from queueing `op` on `stream` to its end."""
    seconds = []
    with torch.cuda.stream(stream):
        for k in range(repeats + 2):
            since = time.perf_counter()
            op(stream)
            stream.synchronize()
            if k >= 2:
                seconds.append(time.perf_counter() - since)
    seconds.sort()
    return 1000 * statistics.median(seconds), 1000 * seconds[int(0.9 * (len(seconds) - 1))]


def measure(repeats: int) -> tuple[dict[tuple[str, str], tuple[float, float]], list[str]]:
    """Each copy's waits in each setting, and what each setting's products ran at alone."""
    device = torch.device("cuda")
    copies = ops(device)
    stream = torch.cuda.Stream(device)
    found = {(name, SETTINGS[0]): waits(op, stream, repeats) for name, op in copies.items()}
    notes = []
    for setting, options in zip(SETTINGS[1:], ({}, {"carveout": FREE_SMS}, {"green": FREE_SMS})):
        try:
            load = GemmLoad(device, **options)
        except Exception as exc:  # a driver without green contexts: the row says so
            notes.append(f"{setting}: no load ({exc})")
            continue
        notes.append(f"{setting}: the products alone {load.tflops():.0f} TFLOP/s")
        with load:
            for name, op in copies.items():
                found[(name, setting)] = waits(op, stream, repeats)
    return found, notes


def main() -> int:
    args = parse_args()
    spread_device_queues()  # the job's 32 hardware queues: with 8 two streams may share one
    if args.smoke:
        skipped(SCRIPT, "every copy", "--smoke has no GPU: the rows are empty")
        found: dict[tuple[str, str], tuple[float, float]] = {}
        notes: list[str] = []
    elif not torch.cuda.is_available():
        raise SystemExit("copy_wait.py needs a CUDA device (or --smoke)")
    else:
        found, notes = measure(args.repeats)
    rows = []
    for name in OPS:
        cells = [found.get((name, setting)) for setting in SETTINGS]
        rows.append([name, *("skipped" if cell is None else f"{fmt(cell[0], '.3f')} ({fmt(cell[1], '.3f')})" for cell in cells)])
    print(f"\n# A 1080p NV12 frame's copy, ms from queueing to its end: median (90th percentile) of {args.repeats}")
    print("\n".join(table(["copy", *SETTINGS], rows)))
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
