"""How long a window's nvjpeg call takes with the device idle, and beside an encoder's GEMMs.

    PYTHONPATH=. python3 benchmarks/nvjpeg_contention.py [--photos DIR ...] [--mixes qwen-224 siglip]
        [--rows 256] [--repeats 7] [--decoders torchvision torchvision-pinned torchcodec ...]

With `preprocess.decoder: gpu` the rank decodes each window's JPEGs in one batched call
while the encoder keeps the device busy (`rows.decode_ahead`). This times that call, on
`--rows` distinct JPEGs cut as the scaling benchmark's mix cuts them (`mixes.jpeg_dataset`),
median of `--repeats`:

- on an idle device;
- beside a stream replaying a CUDA graph of 50 GEMMs of the Qwen2.5-VL-7B tower's MLP
  shape (16,384 x 1,280 x 5,120, bf16) back to back, as the encoder's graphs keep the SMs;
  with `--carveouts`, once per number of SMs cuBLAS is told to leave free (torch's
  experimental SM carve-out, fixed in the graph at capture; if its GEMMs hold every SM
  until they end, a picture's kernel otherwise waits for a whole GEMM).

Decoders: `torchvision` (the job's call, `decode.device.decode_jpegs`: bytes in pageable
memory), `torchvision-pinned` (the same call on views of one pinned buffer: nvjpeg's copy
of each picture's bytes is then a DMA that need not wait for the stream), and, where
`nvidia-nvimgcodec-cu12/13` is installed, `nvimgcodec` (its batched decoder, on a stream of
default priority) and `nvimgcodec-high` (on a stream of the highest priority),
`nvimgcodec-hw(-high)` (the same with only its hardware backend, the JPEG engines); where
`torchcodec` is installed, `torchcodec` and `torchcodec-high` (its nvjpeg decode, which
runs on the caller's current stream, unlike torchvision's: here one of default and one of
the highest priority, so its kernels can go ahead of the GEMMs'). Each decoder's pictures
are compared with torchvision's (largest absolute difference, levels).

The device's hardware work queues are the process's CUDA_DEVICE_MAX_CONNECTIONS, which
this leaves as it finds it (unlike `embedjob run`, which sets 32): run it once with the
variable unset and once with 32 to see what sharing a queue with the GEMMs costs.

Needs a CUDA device. The table is printed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mixes import MIXES, builtin_sources, collect_photos, jpeg_dataset  # noqa: E402

from embedjob.decode.device import decode_jpegs  # noqa: E402

LOAD_SHAPE = (16384, 1280, 5120)
GEMMS_PER_GRAPH = 50
Decode = Callable[[], list[torch.Tensor]]
DECODERS = ["torchvision", "torchvision-pinned", "torchcodec", "torchcodec-high"]
DECODERS += ["nvimgcodec", "nvimgcodec-high", "nvimgcodec-hw", "nvimgcodec-hw-high"]


def window_jpegs(mix: str, rows: int, sources: list[Path], workdir: Path) -> list[bytes]:
    dataset = jpeg_dataset(MIXES[mix], rows, 0, collect_photos(sources), workdir, workers=8)
    return pq.read_table(dataset.path).column("image").to_pylist()


def torchvision_decoder(blobs: list[bytes], device: torch.device, pinned: bool) -> Decode:
    """The job's call; with `pinned`, on views of one pinned buffer holding every picture's bytes."""
    if pinned:
        buffer = torch.empty(sum(map(len, blobs)), dtype=torch.uint8).pin_memory()
        views, start = [], 0
        for blob in blobs:
            views.append(buffer[start : start + len(blob)])
            views[-1].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            start += len(blob)
        data = views
    else:
        data = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]

    def decode() -> list[torch.Tensor]:
        images = decode_jpegs(data, device)
        torch.cuda.current_stream(device).synchronize()
        return images

    return decode


def nvimgcodec_decoder(blobs: list[bytes], device: torch.device, priority: int, hardware: bool) -> Decode:
    """nvImageCodec's batched decode on a stream of `priority`, as (3, H, W) tensors.

    With `hardware`, only its hardware backend (the GPU's JPEG engines, which leave the SMs
    to the encoder) may decode; a picture that engine refuses fails the run.
    """
    from nvidia import nvimgcodec

    backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)] if hardware else []
    decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=backends)
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, sample_format=nvimgcodec.SampleFormat.I_RGB)
    streams = [nvimgcodec.CodeStream(blob) for blob in blobs]
    stream = torch.cuda.Stream(device, priority=priority)

    def decode() -> list[torch.Tensor]:
        images = decoder.decode(streams, params=params, cuda_stream=stream.cuda_stream)
        refused = sum(image is None for image in images)
        if refused:
            raise RuntimeError(f"nvImageCodec refused {refused} of {len(images)} pictures")
        with torch.cuda.stream(stream):
            out = [torch.as_tensor(image, device=device).permute(2, 0, 1) for image in images]
        stream.synchronize()
        return out

    return decode


def torchcodec_decoder(blobs: list[bytes], device: torch.device, priority: int) -> Decode:
    """torchcodec's batched nvjpeg decode, on a current stream of `priority`."""
    from torchcodec.decoders import decode_jpeg

    data = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
    stream = torch.cuda.Stream(device, priority=priority)

    def decode() -> list[torch.Tensor]:
        with torch.cuda.stream(stream):
            images = decode_jpeg(data, device=device)
        stream.synchronize()
        return images

    return decode


def decoders(names: list[str], blobs: list[bytes], device: torch.device) -> dict[str, Decode]:
    made: dict[str, Decode] = {}
    highest = torch.cuda.Stream.priority_range()[1]
    for name in names:
        try:
            if name.startswith("torchvision"):
                made[name] = torchvision_decoder(blobs, device, pinned=name.endswith("pinned"))
            elif name.startswith("torchcodec"):
                made[name] = torchcodec_decoder(blobs, device, priority=highest if name.endswith("high") else 0)
            else:
                priority = highest if name.endswith("high") else 0
                made[name] = nvimgcodec_decoder(blobs, device, priority, hardware="-hw" in name)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})", file=sys.stderr)
    return made


class GemmLoad:
    """A stream replaying a graph of GEMMs back to back until stopped."""

    def __init__(self, device: torch.device, carveout: int) -> None:
        """`carveout`: SMs cuBLAS leaves free (torch's experimental SM carve-out), fixed
        in the graph at capture."""
        m, k, n = LOAD_SHAPE
        self.stream = torch.cuda.Stream(device)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            with torch.cuda.stream(self.stream):
                for _ in range(3):
                    a @ b
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    for _ in range(GEMMS_PER_GRAPH):
                        a @ b
        finally:
            torch._C._set_sm_carveout_experimental(None)
        torch.cuda.synchronize(device)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def tflops(self, replays: int = 5) -> float:
        """The graph's GEMM rate alone, median over `replays`."""
        m, k, n = LOAD_SHAPE
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record()
                self.graph.replay()
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return 2 * m * k * n * GEMMS_PER_GRAPH / statistics.median(times) / 1e12

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.graph.replay()
                self.graph.replay()
                self.stream.synchronize()

    def __enter__(self) -> GemmLoad:
        self.thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def median_ms(decode: Decode, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def largest_difference(images: list[torch.Tensor], reference: list[torch.Tensor]) -> int:
    return max(int((a.int() - b.int()).abs().max()) for a, b in zip(images, reference, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--photos", nargs="+", type=Path, default=None, help="directories or files of photos")
    parser.add_argument("--mixes", nargs="+", default=["qwen-224", "siglip"], choices=sorted(MIXES))
    parser.add_argument("--rows", type=int, default=256, help="pictures per call (the job's window)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nvjpeg-contention"))
    parser.add_argument("--decoders", nargs="+", default=DECODERS, choices=DECODERS)
    parser.add_argument("--carveouts", nargs="+", type=int, default=[0], help="SMs cuBLAS leaves to others in the GEMMs' graph, one load each")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nvjpeg_contention.py needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    sources = args.photos or builtin_sources()
    measured: list[tuple[str, str, int, float, float, float, int]] = []
    for mix in args.mixes:
        blobs = window_jpegs(mix, args.rows, sources, args.workdir)
        calls = decoders(args.decoders, blobs, device)
        reference = torchvision_decoder(blobs, device, pinned=False)()
        idle, differences = {}, {}
        for name, decode in list(calls.items()):
            try:
                for _ in range(3):
                    images = decode()
            except RuntimeError as exc:
                print(f"{mix} {name}: {exc}", file=sys.stderr)
                del calls[name]
                continue
            differences[name] = largest_difference(images, reference)
            idle[name] = median_ms(decode, args.repeats)
        for carveout in args.carveouts:
            load = GemmLoad(device, carveout)
            rate = load.tflops()
            with load:
                busy = {name: median_ms(decode, args.repeats) for name, decode in calls.items()}
            measured += [(mix, name, carveout, rate, idle[name], busy[name], differences[name]) for name in calls]
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset: CUDA's 8")
    print(f"\n# nvjpeg beside GEMMs ({torch.cuda.get_device_name(device)}; torch {torch.__version__}; {args.rows} distinct JPEGs a call, median of {args.repeats}; CUDA_DEVICE_MAX_CONNECTIONS {queues})\n")
    print(f"command: benchmarks/nvjpeg_contention.py {' '.join(sys.argv[1:])}\n")
    print("| mix | decoder | SMs carved out | GEMM TFLOP/s alone | idle ms | idle ms/row | beside GEMMs ms | beside ms/row | slower | max diff to torchvision |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mix, name, carveout, rate, idle_ms, busy_ms, difference in measured:
        row = args.rows
        print(f"| {mix} | {name} | {carveout} | {rate:.0f} | {idle_ms:.1f} | {idle_ms / row:.3f} | {busy_ms:.1f} | {busy_ms / row:.3f} | {busy_ms / idle_ms:.1f}x | {difference} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
