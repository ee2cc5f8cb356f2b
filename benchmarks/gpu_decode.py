"""JPEG decode on the GPU: `preprocess.decoder` cpu, gpu and auto with few decode cores (RESULTS.md sections 9, 10).

On the GPU machine, from the repository root:

    PYTHONPATH=. python3 benchmarks/gpu_decode.py --photos bench-data [--mixes qwen-224 siglip] [--workers 4] [--repeats 2]

For each mix (`benchmarks/mixes.py`: distinct JPEGs cut from real photos, towers of the
published sizes with random weights, loaded through `model.path`), it measures the
encoder-only rate of the mix's items (`benchmarks/encoder_only.py`), then runs the job
through the CLI as a user would (`embedjob run --gpus 1`, bf16, `batching.compile: true`,
`runtime.workers` = `--workers`) `--repeats` times with each of `--decoders` (`preprocess.decoder`:
cpu, gpu, auto), in turn (one tree's `gpu` runs spread from 0.58 to 0.92 of the encoder
alone on one H200, so one run per decoder says little), and prints one table: per decoder,
the run of median images/s after setup (its pipeline seconds and rank 0's device-busy
seconds, to set beside the encoder-only seconds: equal ones say the device ran the
encoder's work at its own rate and the rest is the run's head and tail; its images/s,
that over the encoder-only rate, the rows the GPU decoded, auto's last GPU share, rank 0's
main-thread ms per row and its seconds in the GPU decode, the workers' decode seconds)
with every run's images/s beside it, and,
per row, the cosine between its embedding in that decoder's run and in the `cpu` run (min
and median: nvjpeg and libjpeg-turbo round differently; the same model, so that is all that
differs, besides batches). The table is also written to
`<workdir>/gpu_decode.md`, after each mix, so a run cut short keeps what it measured.
`--smoke` runs it on the CPU with tiny towers (the GPU decoder then stops with its job
error, which the table shows), to check the script without a GPU.

`--contention` times instead one window (`--window`, 256) of each mix's JPEGs through the
job's batched nvjpeg call, on an idle device and beside a stream replaying a graph of 50
back-to-back GEMMs of the 7B tower's MLP shape, median of `--repeats`; run it once with
CUDA_DEVICE_MAX_CONNECTIONS unset and once with 32 to see what sharing a hardware work
queue with the encoder costs. With `--smoke` it makes the windows and prints the table's
header, and says that it skipped the timings.

`--profile N` adds, per mix, where the GPU decode's time goes on its thread: the first N
rows left undecoded by `rows.decode_row` (as workers leave them), then, a window of 256
at a time, nvjpeg's batched call alone (wall and this thread's CPU seconds, the device
synchronised after it) and the family's resize and patching on the device, against
`decode_row` decoding the same rows on one CPU core; and a cProfile of
`rows.decode_on_device` over them (the top functions by own time).

`--trace` adds, per mix, where the GPU-decoder job's threads wait: the `gpu` job once more,
in this process, under `torch.profiler` (CUDA activity: every CUDA runtime call with its
thread), and per thread the runtime calls that took the most time (count, total ms): a
thread that waits on the device shows it in `cudaStreamSynchronize`, `cudaFreeHost` and
the like. On the CPU (`--smoke`) it lists the thread's operators instead.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import (  # noqa: E402
    NO_MULTICAST,
    builtin_sources,
    collect_photos,
    cosine,
    fmt,
    GemmLoad,
    matmul_peak,
    rank0,
    read_output,
    run_cli,
    skipped,
    table,
    table_row,
    timed_rows,
)
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.encoder_only import EncoderOnly, measure  # noqa: E402
from benchmarks.mixes import MIXES, SMOKE_IMAGES, jpeg_dataset, save_tower, write_job  # noqa: E402
from embedjob import rows as worker  # noqa: E402
from embedjob.bench import wall_passes  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.decode.device import decode_jpegs  # noqa: E402
from embedjob.encoders import load_adapter  # noqa: E402
from embedjob.encoders.base import JPEG_KEY  # noqa: E402
from embedjob.io.reader import InputRow  # noqa: E402

@dataclass
class MixRuns:
    """One mix: its encoder-only rate and, per decoder, each run's statistics (None: failed)."""

    mix: str
    rows: int
    encoder: EncoderOnly | None = None
    runs: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)
    cosines: dict[str, np.ndarray] = field(default_factory=dict)
    same_rows: dict[str, bool] = field(default_factory=dict)
    not_finite: dict[str, int] = field(default_factory=dict)
    profile: str = ""
    trace: str = ""


def log(message: str) -> None:
    """Progress on stderr."""
    _log("gpu_decode", message)


def main() -> int:
    args = parse_args()
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    workdir = Path(args.workdir).resolve()
    cores = len(os.sched_getaffinity(0))
    photos = collect_photos([*builtin_sources(), *args.photos])
    if args.contention:
        return contention(args, photos, workdir, cores)
    counts = {name: args.images or (SMOKE_IMAGES if args.smoke else MIXES[name].images) for name in args.mixes}
    datasets = {name: jpeg_dataset(MIXES[name], counts[name], 0, photos, workdir / "data", cores) for name in args.mixes}
    peak = None if args.smoke else matmul_peak(torch.device("cuda"), "gpu_decode")
    results: list[MixRuns] = []
    for name in args.mixes:
        results.append(bench_mix(name, datasets[name].path, counts[name], workdir, cores, args))
        text = render(results, args, peak)
        (workdir / "gpu_decode.md").write_text(text + "\n")
    print(text)
    return 0


def bench_mix(name: str, parquet: Path, rows: int, workdir: Path, cores: int, args: argparse.Namespace) -> MixRuns:
    mix = MIXES[name]
    tower = save_tower(mix.tower, workdir / "towers", args.smoke)
    mixdir = workdir / name
    job = write_job(mixdir, mix, tower, parquet, workdir / "cache", args.smoke)
    result = MixRuns(name, rows)
    log(f"[{name}] encoder only")
    device = torch.device("cpu" if args.smoke else "cuda")
    result.encoder = measure(load_job(job, []), device, cores, 3)
    tables: dict[str, pa.Table] = {}
    for repeat in range(args.repeats):
        for decoder in args.decoders:
            overrides = [f"runtime.workers={args.workers}", f"preprocess.decoder={decoder}"]
            output = mixdir / f"out-{decoder}"
            stats = run_cli(job, output, 1, overrides, mixdir / "logs" / f"{decoder}-{repeat}.log")
            result.runs.setdefault(decoder, []).append(stats)
            log(f"[{name}] decoder {decoder}, run {repeat + 1}/{args.repeats}: {'done' if stats else 'FAILED'}")
            if stats is not None:
                tables[decoder] = read_output(output)
    for decoder in [d for d in tables if d != "cpu" and "cpu" in tables]:
        result.same_rows[decoder], result.cosines[decoder], result.not_finite[decoder] = compare(tables["cpu"], tables[decoder])
    if args.profile:
        result.profile = profile_decode(job, parquet, args.profile, device)
    if args.trace:
        overrides = [f"runtime.workers={args.workers}", "preprocess.decoder=gpu"]
        result.trace = trace_job(job, mixdir / "out-trace", overrides, device)
    return result


TRACE_TOP = 8


def trace_job(job_path: Path, output: Path, overrides: list[str], device: torch.device) -> str:
    """The job with `overrides` run here under the profiler, and per thread its costliest
    CUDA runtime calls (on a CPU: operators), as text (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from embedjob.runner import run_job

    overrides = [*overrides, f"output.path={output}"]
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    try:
        with profile(activities=[activity]) as prof:
            run_job(load_job(job_path, overrides))
    except Exception as exc:  # the table says so; the other columns stand
        return f"the traced run failed: {type(exc).__name__}: {exc}"
    totals: dict[int, dict[str, list[float]]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if device.type == "cuda" and not event.name.startswith("cu"):
            continue
        entry = totals.setdefault(event.thread, {}).setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.cpu_time_total / 1e3
    lines = []
    for thread, calls in sorted(totals.items(), key=lambda t: -sum(v[1] for v in t[1].values())):
        top = sorted(calls.items(), key=lambda c: -c[1][1])[:TRACE_TOP]
        lines.append(f"thread {thread}: {sum(v[1] for v in calls.values()):.0f} ms in {sum(v[0] for v in calls.values())} calls; "
                     + "; ".join(f"{name} x{count} {ms:.0f} ms" for name, (count, ms) in top))
    return "\n".join(lines) or "no events recorded"


WINDOW = 256


def profile_decode(job_path: Path, parquet: Path, count: int, device: torch.device) -> str:
    """Where the GPU decode's time goes (see the module docstring), as text; on a CPU
    (`--smoke`) libjpeg-turbo stands in for nvjpeg."""
    job = load_job(job_path, [])
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    adapter = load_adapter(job, device)
    preprocess = adapter.preprocessor()
    options = worker.decode_options(job, adapter)
    data = pq.read_table(parquet).column("image").to_pylist()[:count]
    rows = [InputRow(k, k, blob, None, None) for k, blob in enumerate(data)]
    since = time.perf_counter()
    for row in rows:
        worker.decode_row(row, options, preprocess)
    cpu_seconds = time.perf_counter() - since
    deferred = dataclasses.replace(options, defer_jpeg=True)
    windows = [[worker.decode_row(row, deferred, preprocess) for row in rows[k : k + WINDOW]] for k in range(0, len(rows), WINDOW)]
    decode_wall = decode_cpu = finish = 0.0
    for window in windows:
        synchronize()
        wall, cpu = time.perf_counter(), time.thread_time()
        images = decode_jpegs([d.item.tensors[JPEG_KEY] for d in window], device)
        synchronize()
        decode_wall += time.perf_counter() - wall
        decode_cpu += time.thread_time() - cpu
        wall = time.perf_counter()
        worker.finish_pictures(window, list(range(len(window))), images, options, preprocess)
        synchronize()
        finish += time.perf_counter() - wall
    fresh = [[worker.decode_row(row, deferred, preprocess) for row in rows[k : k + WINDOW]] for k in range(0, len(rows), WINDOW)]
    profiler = cProfile.Profile()
    profiler.enable()
    for window in fresh:
        worker.decode_on_device(window, options, preprocess, device)
    synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    per_row = 1e3 / len(rows)
    return "\n".join([
        f"{len(rows)} rows in windows of {WINDOW}, ms per row: CPU decode_row (one core) {cpu_seconds * per_row:.3f}; "
        f"nvjpeg batched call {decode_wall * per_row:.3f} wall, {decode_cpu * per_row:.3f} of this thread's CPU; "
        f"resize and patching on the device {finish * per_row:.3f}",
        "cProfile of rows.decode_on_device (top 15 by own time):",
        text.getvalue().strip(),
    ])


def compare(cpu: pa.Table, gpu: pa.Table) -> tuple[bool, np.ndarray, int]:
    """Whether ids, order, tokens and errors agree, the cosine of each good row's
    embeddings, and how many rows were left out for a value float16 could not hold
    (random towers of these sizes overflow it in a few rows, on either decoder)."""
    keys = [c for c in ("id", "row", "error", "tokens") if c in cpu.column_names]
    same = cpu.select(keys).equals(gpu.select(keys))
    good = np.array([e is None for e in cpu.column("error").to_pylist()])
    a = _vectors(cpu)[good].astype(np.float64)
    b = _vectors(gpu)[good].astype(np.float64)
    finite = np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)
    return same, cosine(a[finite], b[finite]), int((~finite).sum())


def _vectors(table: pa.Table) -> np.ndarray:
    """The embedding column as one (rows, width) array, error rows as zeros (pooled
    embeddings are lists of the model's width: read through numpy, not Python lists)."""
    column = table.column("embedding").combine_chunks()
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    width = len(values) // max(int(valid.sum()), 1)
    out = np.zeros((len(column), width), dtype=np.float32)
    out[valid] = values.reshape(-1, width)
    return out


def render(results: list[MixRuns], args: argparse.Namespace, peak: float | None) -> str:
    head = ["mix", "decoder", "workers", "rows", "seconds", "device busy s", "images/s", "every run", "/ enc.-only", "GPU-decoded rows",
            "GPU share", "main ms/row", "GPU-decode thread s", "worker decode s", "setup s", "cos min", "cos median", "rows identical", "not finite"]
    lines = [
        f"# preprocess.decoder {' vs '.join(args.decoders)} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}; torch {torch.__version__}; "
        f"bf16 matmul {fmt(peak and peak / 1e12, '.0f')} TFLOP/s; command: {' '.join(sys.argv)}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" if k < 2 else "---:" for k in range(len(head))) + " |",
    ]
    for result in results:
        enc = result.encoder.rate if result.encoder is not None else None
        seconds = fmt(result.encoder and result.encoder.seconds, ".2f")
        lines.append(table_row([result.mix, "encoder only", "-", result.rows, seconds, seconds, fmt(enc, ".1f")] + ["-"] * (len(head) - 7)))
        for decoder in args.decoders:
            lines.append(table_row(_run_cells(result, decoder, enc, args.workers)))
    for result in results:
        if result.profile:
            lines += ["", f"## {result.mix}: the GPU decode profiled", "", "```", result.profile, "```"]
        if result.trace:
            lines += ["", f"## {result.mix}: the gpu job's threads traced", "", "```", result.trace, "```"]
    return "\n".join(lines)


def _rate(stats: dict[str, Any]) -> float:
    return timed_rows(stats) / stats["pipeline_seconds"] if stats["pipeline_seconds"] else 0.0


def _run_cells(result: MixRuns, decoder: str, enc: float | None, workers: int) -> list[Any]:
    """The decoder's row: the run of median images/s (the lower middle of an even count),
    with every run's images/s beside it."""
    done = sorted((s for s in result.runs.get(decoder, []) if s is not None), key=_rate)
    if not done:
        return [result.mix, decoder, workers, result.rows, "FAILED"] + ["-"] * 14
    stats = done[(len(done) - 1) // 2]
    rate = _rate(stats)
    every = ", ".join(fmt(_rate(s) if s else None, ".1f") for s in result.runs[decoder])
    first = rank0(stats)
    cos = result.cosines.get(decoder)
    cos = cos if cos is not None and len(cos) else None
    return [
        result.mix, decoder, workers, stats["rows"], fmt(stats["pipeline_seconds"], ".2f"), fmt(first.get("busy_seconds"), ".2f"),
        fmt(rate, ".1f"), every,
        fmt(rate / enc if rate and enc else None, ".3f"), stats.get("device_decoded", "-"), fmt(first.get("gpu_share"), ".2f"),
        fmt(first.get("host_seconds", 0) * 1e3 / max(first.get("rows", 1), 1), ".3f"),
        fmt(first.get("device_decode_seconds"), ".2f"), fmt(first.get("decode_seconds"), ".1f"),
        fmt(stats.get("setup_seconds"), ".1f"), fmt(cos.min() if cos is not None else None, ".5f"),
        fmt(float(np.median(cos)) if cos is not None else None, ".5f"),
        "-" if decoder not in result.same_rows else ("yes" if result.same_rows[decoder] else "NO"),
        result.not_finite.get(decoder, "-"),
    ]


# --- --contention: one window's nvjpeg call beside the encoder's GEMMs ------------------------

CONTENTION_HEAD = ["mix", "CUDA_DEVICE_MAX_CONNECTIONS", "GEMM graph alone TFLOP/s", "idle ms", "beside GEMMs ms", "slower"]


def window_decode(blobs: list[bytes], device: torch.device) -> Callable[[], list[torch.Tensor]]:
    """The job's batched call (`decode.device.decode_jpegs`) on one window, waited for."""
    data = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]

    def decode() -> list[torch.Tensor]:
        images = decode_jpegs(data, device)
        torch.cuda.current_stream(device).synchronize()
        return images

    return decode


def wall_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall milliseconds: the call waits for its own stream, not for the load's,
    which CUDA events on the current stream would not tell apart."""
    return statistics.median(wall_passes(fn, repeats, warmup=0)) * 1e3


def contention(args: argparse.Namespace, photos: list[Any], workdir: Path, cores: int) -> int:
    """`--contention`: one window of each mix's JPEGs decoded by the job's nvjpeg call on an
    idle device and beside `GemmLoad`, median of `--repeats` (RESULTS.md, "Hardware work
    queues"). Run it once per CUDA_DEVICE_MAX_CONNECTIONS, which it leaves as it finds it."""
    windows = {name: jpeg_dataset(MIXES[name], args.window, 0, photos, workdir / "data", cores) for name in args.mixes}
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    rows: list[list[Any]] = []
    if args.smoke or not torch.cuda.is_available():
        skipped("gpu_decode", "--contention's timings", "nvjpeg and the GEMM load need a CUDA device")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        for name, dataset in windows.items():
            decode = window_decode(pq.read_table(dataset.path).column("image").to_pylist(), device)
            for _ in range(3):
                decode()
            idle = wall_ms(decode, args.repeats)
            load = GemmLoad(device)
            rate = load.tflops()
            with load:
                busy = wall_ms(decode, args.repeats)
            rows.append([name, queues, f"{rate:.0f}", f"{idle:.1f}", f"{busy:.1f}", f"{busy / idle:.1f}x"])
    print(f"\n# nvjpeg beside GEMMs: {args.window} distinct JPEGs a call, median of {args.repeats}\n")
    print(f"command: {' '.join(sys.argv)}\n")
    print("\n".join(table(CONTENTION_HEAD, rows, text_columns=2)))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=["qwen-224", "siglip"], choices=list(MIXES))
    parser.add_argument("--images", type=int, default=0, help="rows per mix (0: the mix's default)")
    parser.add_argument("--workers", type=int, default=4, help="runtime.workers: decode processes for the one GPU")
    parser.add_argument("--repeats", type=int, help="runs per decoder, the decoders in turn; the median is reported (2; 1 with --smoke)")
    parser.add_argument("--decoders", nargs="+", default=["cpu", "gpu", "auto"], choices=["cpu", "gpu", "auto"],
                        help="preprocess.decoder values to run; cosines are against cpu")
    parser.add_argument("--workdir", default="gpu-decode-work")
    parser.add_argument("--photos", nargs="+", action="extend", type=Path, default=[], help="directories or files of photos")
    parser.add_argument("--smoke", action="store_true", help="CPU only: tiny towers, 24 images per mix")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile the GPU decode of N rows per mix")
    parser.add_argument("--trace", action="store_true", help="trace the gpu job's threads' CUDA runtime calls")
    parser.add_argument("--contention", action="store_true",
                        help="time one window's nvjpeg call idle and beside GEMMs instead (RESULTS.md section 10)")
    parser.add_argument("--window", type=int, default=256, help="--contention: JPEGs per call (the job's window)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 2)
    return args


if __name__ == "__main__":
    sys.exit(main())
