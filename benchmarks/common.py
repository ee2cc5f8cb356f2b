"""Helpers every benchmark shares: photos, timing, the matmul reference, CLI runs, tables.

One module, so that a figure in `benchmarks/RESULTS.md` is timed, referenced and printed
the same way whichever script made it. Benchmarks import from `embedjob`; `embedjob` never
imports from here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off: the lent machines do not support it, and NCCL would try it."""


def log(script: str, message: str) -> None:
    """Progress on stderr, so stdout keeps only the table."""
    print(f"{script}: {message}", file=sys.stderr, flush=True)


def skipped(script: str, what: str, why: str) -> None:
    """The line a GPU-only measurement prints in `--smoke` instead of its numbers."""
    print(f"{script}: skipped {what}: {why}", flush=True)


# --- tables ------------------------------------------------------------------------------


def fmt(value: Any, spec: str = "") -> str:
    """A value for a table, or `-` where there is none."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return format(value, spec)


def table_row(cells: Sequence[Any]) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: int = 1) -> list[str]:
    """A Markdown table: the first `text_columns` columns left-aligned, the numbers right."""
    rule = ["---" if k < text_columns else "---:" for k in range(len(head))]
    return [table_row(head), table_row(rule), *(table_row(r) for r in rows)]


# --- timing and the matmul reference -------------------------------------------------------


def median_seconds(fn: Callable[[], Any], repeats: int, device: Any, warmup: int = 1) -> float:
    """Median seconds of `fn`: CUDA events on a GPU, wall time on a CPU (`embedjob.bench`)."""
    from embedjob.bench import device_time

    return device_time(fn, repeats, device, warmup)


def matmul_peak(device: Any, script: str) -> float:
    """The MFU denominator, measured in this process: a bf16 8192³ matmul on a GPU; on a
    CPU (`--smoke`) a float32 1024³ one, only so the column has a number."""
    import torch

    if device.type == "cuda":
        from embedjob.bench import matmul_peak as bf16_peak

        peak = bf16_peak()
        torch.cuda.empty_cache()
    else:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        peak = 2 * 1024**3 / median_seconds(lambda: a @ b, 5, device)
    log(script, f"{'bf16' if device.type == 'cuda' else 'float32 CPU'} matmul: {peak / 1e12:.3g} TFLOP/s")
    return peak


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# --- the GPU's video decoders -----------------------------------------------------------------


class DecoderBusy:
    """How busy the GPU's video decoders (all its NVDEC engines together) were while the
    `with` block ran, from NVML's decoder utilisation as `nvidia-smi` samples it every
    `period_ms`, with the video and SM clocks and the board's power in the same samples:
    where NVDEC reads fewer clips beside the encoder with SMs left free, a video clock held
    down at the board's power limit is what would take them. Where nvidia-smi is missing
    (a machine without a GPU) it samples nothing and `summary` is None.

    NVML averages each utilisation sample over its own window of up to a second, so the
    figures are for runs of several seconds: `summary` gives the mean over the samples from
    the first to the last with the decoders busy (a job's setup, before its first clip, is
    left out), the share of those at 90 % or more (the engines full), and the medians of
    the clocks and power over them."""

    QUERY = ("utilization.decoder", "clocks.video", "clocks.sm", "power.draw")

    def __init__(self, period_ms: int = 200) -> None:
        self.period_ms = period_ms
        self.samples: list[tuple[float, ...]] = []
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> DecoderBusy:
        command = ["nvidia-smi", f"--query-gpu={','.join(self.QUERY)}", "--format=csv,noheader,nounits", "-i", "0",
                   f"--loop-ms={self.period_ms}"]
        try:
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        self.samples = parse_samples(out, len(self.QUERY))

    def summary(self) -> tuple[float, float, tuple[float, float, float]] | None:
        """(mean busy %, share of samples at 90 % or more, median (video MHz, SM MHz, W)) over
        the samples from the first to the last with the decoders busy, or None where none was."""
        busy = [k for k, sample in enumerate(self.samples) if sample[0] > 0]
        if not busy:
            return None
        span = self.samples[busy[0] : busy[-1] + 1]
        medians = tuple(float(np.median([sample[k] for sample in span])) for k in (1, 2, 3))
        return sum(s[0] for s in span) / len(span), sum(s[0] >= 90 for s in span) / len(span), medians

    def describe(self) -> str:
        """`summary` for a table cell: "73 % (full 41 %); 1,635 / 1,980 MHz, 512 W", or "-"."""
        summary = self.summary()
        if summary is None:
            return "-"
        mean, full, (video, sm, watts) = summary
        return f"{mean:.0f} % (full {100 * full:.0f} %); {video:,.0f} / {sm:,.0f} MHz, {watts:.0f} W"


def parse_samples(out: str, fields: int) -> list[tuple[float, ...]]:
    """nvidia-smi's CSV lines of `fields` numbers each; a line with a field it could not
    read ("[N/A]") or cut short by its end is left out."""
    samples = []
    for line in out.splitlines():
        values = [value.strip() for value in line.split(",")]
        try:
            numbers = tuple(float(value) for value in values)
        except ValueError:
            continue
        if len(numbers) == fields:
            samples.append(numbers)
    return samples


# --- jobs through the command line ----------------------------------------------------------


PROFILED_CLI = """
import cProfile, sys
from embedjob.cli import main
profile = cProfile.Profile()
try:
    code = profile.runcall(main, sys.argv[2:])
finally:
    profile.dump_stats(sys.argv[1])
sys.exit(code)
"""
"""`python -c PROFILED_CLI OUT.prof ARGS...`: `embedjob ARGS...` under cProfile, its statistics
dumped to OUT.prof whatever the exit. From Python 3.12 cProfile sees every thread of the
process (rank 0's pipeline, decode threads and writer); the decode workers are processes of
their own and are not in it."""


def run_cli(job: Path, output: Path, gpus: int, overrides: list[str], logfile: Path, tree: Path = REPO,
            profile: Path | None = None) -> dict[str, Any] | None:
    """One `embedjob run` through the CLI of the source tree `tree`, as a user runs it, its
    output in `logfile`; its statistics, or None if it failed. With `profile` the command's
    process runs under cProfile (`PROFILED_CLI`), its statistics written there."""
    python = os.path.abspath(sys.executable)
    entry = [python, "-c", PROFILED_CLI, str(profile)] if profile is not None else [python, "-m", "embedjob.cli"]
    command = [*entry, "run", str(job), "--gpus", str(gpus), "--overwrite"]
    for override in [*overrides, f"output.path={output}"]:
        command += ["--set", override]
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**NO_MULTICAST, **os.environ, "PYTHONPATH": path}
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("w") as out:
        out.write(" ".join("PROFILED_CLI" if c == PROFILED_CLI else c for c in command) + "\n")
        out.flush()
        code = subprocess.run(command, env=env, cwd=tree, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    stats = sorted(output.glob("_embedjob/stats-*.json"))
    if code != 0 or not stats:
        tail = logfile.read_text().splitlines()[-15:]
        log("run_cli", f"run failed (exit code {code}); last lines of {logfile}:\n" + "\n".join(tail))
        return None
    return json.loads(stats[0].read_text())


def profile_summary(path: Path, rows: int = 25) -> str:
    """What a `run_cli(..., profile=path)` run's process spent its time on: the `rows`
    functions with the most own time, then the package's own functions by cumulative time
    (a thread's waits show there: own times of all threads add up past the wall time)."""
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats("embedjob", rows)
    return text.getvalue()


def read_output(directory: Path) -> pa.Table:
    """A job's output parts, in order, as one table."""
    return pa.concat_tables([pq.read_table(p) for p in sorted(directory.glob("part-*.parquet"))])


def rank0(stats: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's statistics of a shard's stats-*.json."""
    return (stats.get("ranks") or [{}])[0]


def past_head_start(stats: dict[str, Any], least_seconds: float = 5.0) -> tuple[int, float] | None:
    """(rows, seconds) of rank 0's run after its first 2 x `batching.window` rows, from its
    time series: the decode workers start while the rank compiles and captures, and hold
    up to that many rows decoded when it is ready, which it then encodes at the encoder's
    pace. In a job bound by decoding, `pipeline_seconds` counts those rows without the
    time they took (331 clips, all decoded during a 28 s setup, looked 0.86 of the encoder
    alone). None where fewer than `least_seconds` remain after them."""
    first = rank0(stats)
    timeline = first.get("timeline") or {}
    series = (timeline.get("series") or {}).get("rows")
    window = ((stats.get("job") or {}).get("batching") or {}).get("window")
    if not series or not window:
        return None
    width, end, skip = timeline["width"], timeline["end"], 2 * window
    done = 0.0
    for k, rows in enumerate(series):
        done += rows
        if done >= skip:
            seconds = end - (k + 1) * width
            return (round(sum(series) - done), seconds) if seconds >= least_seconds else None
    return None


def timed_rows(stats: dict[str, Any]) -> int:
    """Rows encoded after setup: ranks ready first encode their head start while the others
    still set up (`rows_during_setup`, absent from statistics older than that key)."""
    return stats["rows"] - stats.get("rows_during_setup", 0)


# --- photos ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Photo:
    """A real photo's encoded bytes and where they came from."""

    name: str
    data: bytes


def builtin_sources() -> list[Path]:
    """The repository's real photos: the demo dataset (whose two broken rows are dropped
    as unreadable) and the test images."""
    tests = sorted(p for p in (REPO / "tests" / "data").iterdir() if p.suffix.lower() in (".jpg", ".png"))
    return [REPO / "jobs" / "data" / "demo-images.parquet", *tests]


def collect_photos(sources: Sequence[Path]) -> list[Photo]:
    """Every candidate photo in `sources` (image files, Parquet files, directories of
    either, searched recursively), in a fixed order; unreadable ones are not yet removed."""
    photos: list[Photo] = []
    for source in sources:
        if source.is_dir():
            files = sorted(p for p in source.rglob("*") if p.is_file())
        elif source.exists():
            files = [source]
        else:
            raise SystemExit(f"--photos: {source} does not exist")
        for path in files:
            if path.suffix.lower() == ".parquet":
                photos += _parquet_photos(path)
            elif path.suffix.lower() in IMAGE_SUFFIXES:
                photos.append(Photo(str(path), path.read_bytes()))
    return photos


def _parquet_photos(path: Path) -> list[Photo]:
    """The image bytes of a Parquet file: its binary column, or the `bytes` of an HF
    image struct<bytes, path> (a column named like an image column wins if several)."""
    schema = pq.read_schema(path)
    found = [f for f in schema if _image_field(f.type) is not None]
    if not found:
        raise SystemExit(f"--photos: {path} has no binary or struct<bytes, path> column")
    named = [f for f in found if f.name.lower() in ("image", "img", "jpg", "jpeg", "png", "photo")]
    column = (named or found)[0]
    values = pq.read_table(path, columns=[column.name]).column(column.name).combine_chunks()
    if pa.types.is_struct(column.type):
        values = values.field("bytes")
    return [Photo(f"{path}#{i}", blob) for i, blob in enumerate(values.to_pylist()) if blob]


def _image_field(kind: pa.DataType) -> str | None:
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "binary"
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        if index >= 0 and (pa.types.is_binary(kind.field(index).type) or pa.types.is_large_binary(kind.field(index).type)):
            return "struct"
    return None


def open_photo(data: bytes) -> Any:
    """The photo upright (EXIF orientation applied) in RGB; raises on anything unreadable."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image).convert("RGB")


def readable(data: bytes) -> bool:
    """Whether Pillow opens the photo."""
    try:
        open_photo(data)
    except Exception:
        return False
    return True


LOAD_SHAPE = (16384, 1280, 5120)
"""The Qwen2.5-VL-7B tower's MLP product (tokens x width x MLP width), bf16."""
GEMMS_PER_GRAPH = 50


def feed_per_clip(parts: dict[str, float], clips: int) -> list[str] | None:
    """Each of the GPU decoder's parts over a run (`nvdec.CLOCK.since`, or a job's
    `device_decode_parts`: whole clips, `Decode` calls, surfaces taken, their copies, NV12
    conversion, summed over the threads) in milliseconds a clip, in `DecoderClock.PARTS`' order; None where the
    packet feed counted nothing (no clip fed: decord standing in for NVDEC, or none decoded)."""
    from embedjob.decode.nvdec import DecoderClock

    if not parts.get("Decode") or not clips:
        return None
    return [f"{1000 * parts.get(part, 0.0) / clips:.1f}" for part in DecoderClock.PARTS]


class GemmLoad:
    """A stream replaying a graph of GEMMs back to back until stopped, as the encoder's
    graphs keep the SMs busy; with `carveout`, its cuBLAS kernels captured leaving that
    many SMs free, as a job's with `pipeline.GPU_DECODE_SM_CARVEOUT`; with `green`, the
    stream one of a green context leaving that many SMs free (`engine.green`), which
    holds every kernel, not only cuBLAS's."""

    def __init__(self, device: Any, carveout: int | None = None, green: int | None = None) -> None:
        import torch

        from embedjob.engine.green import green_stream
        from embedjob.pipeline import sm_carveout

        m, k, n = LOAD_SHAPE
        self.stream = green_stream(device, green).stream if green else torch.cuda.Stream(device)
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        with torch.cuda.stream(self.stream), sm_carveout(carveout):
            for _ in range(3):
                a @ b
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                for _ in range(GEMMS_PER_GRAPH):
                    a @ b
        torch.cuda.synchronize(device)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def tflops(self, replays: int = 5) -> float:
        """The graph's GEMM rate alone."""
        import torch

        m, k, n = LOAD_SHAPE
        with torch.cuda.stream(self.stream):
            seconds = median_seconds(self.graph.replay, replays, self.stream.device)
        return 2 * m * k * n * GEMMS_PER_GRAPH / seconds / 1e12

    def _run(self) -> None:
        import torch

        # A thread starts on the legacy default stream, which would wait for every other stream.
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.graph.replay()
                self.stream.synchronize()

    def __enter__(self) -> GemmLoad:
        self.thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
