"""Encoder only: a mix's rows decoded beforehand, then encoded alone (the bound of RESULTS.md sections 1, 5-7, 9, 11).

    PYTHONPATH=. python3 benchmarks/encoder_only.py --photos bench-data [--mixes qwen-224 ...] [--repeats 3]
    PYTHONPATH=. python3 benchmarks/encoder_only.py --smoke        (CPU, tiny towers)

The other benchmarks import `measure` to set a run beside the encoder alone; run as a
script it prints one table of the mixes of `benchmarks/mixes.py`: items, median seconds
of a pass, images/s, MFU against the matmul rate of this process, batches, graph hit
rate, padding and setup (load, compile, capture).

Every row is decoded and preprocessed on the CPU first (`embedjob.decode.decode` and the
adapter's own preprocessor, in a process pool), so the timed part is the encoder alone:
the job's checkpoint loaded through `load_adapter` with the job itself (same dtype,
preprocessing and budgets), compiled as the runner compiles it, the job's budget plan
(rounded to whole images for a fixed-resolution tower, as `encode.build_encoder` does),
one graph per budget, and every packed batch run through `GraphManager.run` with the
job's pooling as the read-out. The time is the median of `repeats` passes over all
batches after one warm-up pass: CUDA events on a GPU, wall time on a CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import gc
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import builtin_sources, collect_photos, fmt, matmul_peak, table  # noqa: E402
from benchmarks.mixes import MIXES, SMOKE_IMAGES, items_flops, jpeg_dataset, save_tower, write_job  # noqa: E402
from embedjob.bench import device_passes  # noqa: E402
from embedjob.calibration import calibration_for  # noqa: E402
from embedjob.config import Job, load_job  # noqa: E402
from embedjob.decode import DecodeOptions, MediaError, decode  # noqa: E402
from embedjob.encoders import EncoderInput, load_adapter  # noqa: E402
from embedjob.engine import packer  # noqa: E402
from embedjob.engine.encode import budget_plan  # noqa: E402
from embedjob.engine.graphs import GraphManager, pool_rows  # noqa: E402


@contextlib.contextmanager
def module_settings(settings: dict[tuple[Any, str], Any]) -> Iterator[None]:
    """Module-level settings (`{(module, name): value}`, e.g. `encoders.base.COMPILE_OPTIONS`)
    in force while inside, the previous values back afterwards."""
    saved = {(module, key): getattr(module, key) for module, key in settings}
    for (module, key), value in settings.items():
        setattr(module, key, value)
    try:
        yield
    finally:
        for (module, key), value in saved.items():
            setattr(module, key, value)


TUNED = {
    "cd-tuned": {"coordinate_descent_tuning": True},
    "autotuned": {"max_autotune": True, "coordinate_descent_tuning": True},
}
"""Inductor options (`encoders.base.COMPILE_OPTIONS`) that `fixed_compile.py` and `precision.py`
compare with its defaults, by the name of their variants."""


@dataclass
class EncoderOnly:
    """What one encoder-only measurement found."""

    items: int
    failed: int
    seconds: float
    passes: list[float]
    flops: float
    batches: int
    hit_rate: float | None
    padding: float | None
    budgets: list[int]
    setup_seconds: float
    preprocess_seconds: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.items / self.seconds


def measure(
    job: Job,
    device: torch.device,
    workers: int,
    repeats: int,
    prepared: tuple[list[EncoderInput], int] | None = None,
    outputs: list[torch.Tensor] | None = None,
    rows: int | None = None,
) -> EncoderOnly:
    """Load, preprocess, capture, then time every batch of the job's input (see the module
    docstring). `prepared`: the items (and the count of rows that did not decode) of an
    earlier `preprocess_rows` of the same input and preprocessing, to compare variants
    of one model on the same items; `outputs`: see `_timed`; `rows`: only the input's
    first rows (all by default). A job with `model.fp8_calibrate` calibrates its FP8
    weights on its input's first rows as a job does (`calibration_for`, `workers` decoding)."""
    start = time.perf_counter()
    adapter = load_adapter(job, device, calibration_for(job, workers))
    if job.batching.compile and device.type == "cuda":
        torch._dynamo.reset()
        adapter.compile(dynamic=True)
    loaded = time.perf_counter()
    items, failed = prepared if prepared is not None else preprocess_rows(job, adapter, workers, rows)
    preprocessed = time.perf_counter()
    try:
        with _host_threads(device):
            return _timed(job, adapter, items, failed, device, repeats, (loaded - start, preprocessed - loaded), outputs)
    finally:
        del adapter, items
        if device.type == "cuda":  # give the GPU back to the runs that follow
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()


def _host_threads(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The runner's limit on torch CPU threads in a process that feeds a GPU, so batches
    are assembled on the host as in a run; torch's default where the runner has none."""
    try:
        from embedjob.host import host_threads
    except ImportError:
        return contextlib.nullcontext()
    return host_threads(device)


def _timed(
    job: Job,
    adapter: Any,
    items: list[EncoderInput],
    failed: int,
    device: torch.device,
    repeats: int,
    seconds: tuple[float, float],
    outputs: list[torch.Tensor] | None = None,
) -> EncoderOnly:
    """`outputs`, when given, receives each item's pooled vector (float32, on the host,
    in item order) from a first pass, before the timed ones."""
    flops = items_flops(adapter, items)
    plan = budget_plan(job, adapter)
    if len(adapter.paths) > 1:
        return _not_measured(items, failed, flops, seconds, "the dual-path (tiled) encoder is not measured here")
    backend = None if not job.batching.cuda_graphs else ("cuda" if device.type == "cuda" else "replay")
    capture_start = time.perf_counter()
    manager = GraphManager(adapter, plan, backend)
    manager.capture()
    capture = time.perf_counter() - capture_start
    batches = packer.pack([i.tokens for i in items], [i.frames for i in items], plan, job.batching.policy)
    chosen = [[items[i] for i in batch.indices] for batch in batches]

    def one_pass() -> None:
        """Every batch and its pooling, as the pipeline runs them (`pool_rows` per batch)."""
        for batch, batch_items in zip(batches, chosen):
            rows = manager.run_batch(batch_items, batch.budget)
            with torch.inference_mode():
                pool_rows(rows, adapter.row_counts(batch_items), job.output.pooling)

    if outputs is not None:
        outputs.extend(_pooled(job, adapter, manager, batches, chosen, len(items)))
    passes = device_passes(one_pass, repeats, device)
    real = sum(i.tokens for i in items)
    manager.clear()
    return EncoderOnly(
        items=len(items),
        failed=failed,
        seconds=statistics.median(passes),
        passes=passes,
        flops=flops,
        batches=len(batches),
        hit_rate=manager.stats.hit_rate if backend else None,
        padding=packer.padding_waste(batches) / real if backend and real else None,
        budgets=list(plan.token_budgets),
        setup_seconds=seconds[0] + capture,
        preprocess_seconds=seconds[1],
    )


def _pooled(job: Job, adapter: Any, manager: GraphManager, batches: list[Any], chosen: list[list[Any]], count: int) -> list[torch.Tensor]:
    """Each item's pooled output as the timed passes compute it, in item order."""
    out: list[torch.Tensor | None] = [None] * count
    for batch, batch_items in zip(batches, chosen):
        rows = manager.run_batch(batch_items, batch.budget)
        with torch.inference_mode():
            pooled, counts = pool_rows(rows, adapter.row_counts(batch_items), job.output.pooling)
            pooled = pooled.float().cpu()
        for index, row in zip(batch.indices, pooled.split(1) if job.output.pooling == "mean" else pooled.split(counts)):
            out[index] = row
    return [t for t in out if t is not None]


def _not_measured(items: list[EncoderInput], failed: int, flops: float, seconds: tuple[float, float], note: str) -> EncoderOnly:
    return EncoderOnly(len(items), failed, float("nan"), [], flops, 0, None, None, [], seconds[0], seconds[1], note)


# --- preprocessing on the CPU ---------------------------------------------------------


def preprocess_rows(job: Job, adapter: Any, workers: int, rows: int | None = None) -> tuple[list[EncoderInput], int]:
    """Every row of the job's input (one Parquet file, binary media column), or its first
    `rows`, decoded and preprocessed by `workers` processes; the items of the rows that
    decoded, and how many did not."""
    preprocessor = adapter.preprocessor()
    options = DecodeOptions(
        modality=job.input.modality,
        max_image_pixels=job.preprocess.max_image_pixels,
        fps=job.video.fps,
        max_frames=job.video.max_frames,
        frame_multiple=preprocessor.frame_multiple,
    )
    column = job.input.media_column
    blobs = pq.read_table(Path(job.input.path), columns=[column]).column(column).slice(0, rows).to_pylist()
    work = functools.partial(_decode_one, options=options, preprocess=preprocessor)
    context = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=context, initializer=_one_thread) as pool:
        results = list(pool.map(work, blobs, chunksize=8))
    items = [r for r in results if r is not None]
    return items, len(results) - len(items)


def _one_thread() -> None:
    """One torch thread per worker: the workers already run one per core."""
    torch.set_num_threads(1)


def _decode_one(data: bytes, options: DecodeOptions, preprocess: Any) -> EncoderInput | None:
    """Worker: bytes -> EncoderInput, or None for a row that does not decode (an error row in a run)."""
    try:
        return preprocess(decode(data, options))
    except MediaError:
        return None


# --- the command line ------------------------------------------------------------------------

HEAD = ["mix", "items", "not decoded", "seconds", "images/s", "MFU", "batches", "hit rate", "padding", "setup s"]


def table_rows(name: str, result: EncoderOnly, peak: float) -> list[str]:
    """One mix's row of the table."""
    return [
        name, str(result.items), str(result.failed), fmt(result.seconds, ".3f"), fmt(result.rate, ".1f"),
        fmt(result.flops / result.seconds / peak, ".1%"), str(result.batches), fmt(result.hit_rate, ".0%"),
        fmt(result.padding, ".1%"), f"{result.setup_seconds:.1f}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=["qwen-224"], choices=list(MIXES))
    parser.add_argument("--images", type=int, default=0, help="rows per mix (0: the mix's default; 24 with --smoke)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--photos", nargs="+", action="extend", type=Path, default=[], help="directories or files of photos")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override, e.g. model.precision=fp8")
    parser.add_argument("--workdir", default="encoder-only-work")
    parser.add_argument("--smoke", action="store_true", help="CPU only: tiny towers, no compile")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    workdir = Path(args.workdir).resolve()
    cores = len(os.sched_getaffinity(0))
    photos = collect_photos([*builtin_sources(), *args.photos])
    peak = matmul_peak(device, "encoder_only")
    rows = []
    for name in args.mixes:
        mix = MIXES[name]
        count = args.images or (SMOKE_IMAGES if args.smoke else mix.images)
        dataset = jpeg_dataset(mix, count, 0, photos, workdir / "data", cores)
        tower = save_tower(mix.tower, workdir / "towers", args.smoke)
        job = write_job(workdir / name, mix, tower, dataset.path, workdir / "cache", args.smoke)
        rows.append(table_rows(name, measure(load_job(job, args.set), device, cores, args.repeats), peak))
    print(f"\n# encoder only on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, median of {args.repeats} passes\n")
    print(f"command: {' '.join(sys.argv)}\n")
    print("\n".join(table(HEAD, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
