"""End to end: `embedjob run --gpus N` on four mixes, against the encoder alone (RESULTS.md sections 1, 2, 4).

On the GPU machine, from the repository root (`bench-data`: directories of photos and/or
Parquet files of photos, e.g. a cat dataset; optional, the repository's own few photos
are always used):

    PYTHONPATH=. python3 benchmarks/scaling.py --photos bench-data

Options: `--mixes` (default: all four), `--images NAME=COUNT ...` (rows per mix; a bare
COUNT sets every mix; the defaults grow x N/2 where N > 2 GPUs run), `--gpus 1 2 4 8`
(GPU counts; counts above the visible GPUs are skipped and said so), `--repeats 2` (CLI
runs per GPU count), `--set KEY=VALUE` (a job override for every run and for the
encoder-only measurement, e.g. `runtime.workers=8`), `--seed`, `--workdir scaling-work`.
`--smoke` runs everything on the CPU instead, with tiny towers of the same architectures,
24 images per mix, one CPU rank and one run unless `--gpus` and `--repeats` say otherwise
(`--gpus N` is then N CPU ranks), so the whole script can be checked on a machine without
a GPU.

Each mix's result is saved in `<workdir>/<mix>/result.json`, and `--report` prints the
table of the saved results of `--mixes` without running anything. All four mixes take
longer than one 10-minute command, so they can be run one call each and reported in a
last one (a work directory outside the repository copy survives between calls):

    PYTHONPATH=. python3 benchmarks/scaling.py --photos bench-data --workdir /tmp/sw --mixes qwen-mixed
    ... the same with --mixes qwen-224, then siglip, then clip ...
    PYTHONPATH=. python3 benchmarks/scaling.py --workdir /tmp/sw --report

Towers and JPEGs are built once per work directory and reused by later calls.

The mixes (`benchmarks/mixes.py`):

| mix | tower | rows (default) | JPEGs |
| --- | --- | ---: | --- |
| qwen-mixed | Qwen2.5-VL-7B-size vision tower (`embedjob bench`'s) | 1536 | 224-1344 px, height and width drawn independently |
| qwen-224 | the same tower | 6144 | 224 x 224 |
| siglip | SigLIP-so400m/14-384-size, attention-pooling head | 8192 | 256-1024 px |
| clip | CLIP-ViT-L/14-336-size with projection | 8192 | 256-1024 px |

Towers have random weights (fixed seed) and are saved with `save_pretrained`, their image
processor configs beside them, and loaded through `model.path`. Every row is a distinct
JPEG cut from a real photo (random crop, size and quality; cached in the work directory).
Each run is the command a user types, in a subprocess:
`python -m embedjob.cli run JOB.yaml --gpus N --overwrite --set ...` with bf16,
`batching.compile: true` and CUDA graphs, decoding included. Every process this script
starts gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 unless the environment sets them already.

Table columns (one row per mix and GPU count, plus the mix's encoder-only row):

- rows: rows of the input (every run embeds all of them).
- seconds: the run's `pipeline_seconds` (decode, encode and write; model load, compile
  and capture are setup), median over the repeats. Encoder-only row: the median pass.
- images/s: rows encoded after setup / seconds (a rank ready first encodes its head start
  while the others set up: `rows_during_setup`, left out); per GPU: divided by N.
- scaling eff.: images/s at N / (N x images/s at 1 GPU).
- MFU: encoder FLOPs per item of the encoder-only measurement (real tokens only;
  `embedjob.bench.encoder_flops` for Qwen, `embedjob.bench.fixed_flops` for CLIP and SigLIP)
  x the rows encoded after setup / seconds / (N x the bf16 matmul FLOP/s measured with
  `embedjob.bench.matmul_peak` in the process that ran the mix).
- per GPU / enc.-only: images/s per GPU over the encoder-only images/s (at 1 GPU, how
  close the whole pipeline comes to the encoder alone). The encoder alone runs the mix's
  first rows, as many as its default count (all of them unless the mix grew).
- setup s: the run's `setup_seconds`, the best repeat (a warm compile cache); encoder-only row: load, compile and capture.
- main ms/item: rank 0's main-thread seconds of its own work per row, `ranks[0].host_seconds /
  ranks[0].rows` (preparing, packing and pooling batches, building rows; the seconds inside
  graph launches, which block while the GPU's queue is full, are `launch_seconds`).
- balance, busy: the run's `balance_ratio` (slowest rank's input over the mean, summed
  over windows) and `busy_ratio` (the same for the ranks' measured device seconds).
- hit rate: items that replayed a graph; padding: padded tokens / real tokens.
- rows identical: ids, order, tokens and errors equal to the 1-GPU run's (the first GPU
  count's); bitwise: rows whose embeddings are bitwise equal to it; max rel. diff: the
  largest ||a - b|| / ||a|| over rows (a different share of a window packs items into
  other batches, which can move bf16 results by rounding).

`-` marks a value the run's statistics do not have (older statistics lack per-rank
`rows`, `host_seconds`, `decode_seconds` and `waits`, and a 1-GPU run may lack `ranks`).
Under the table, per mix: the data, the encoder-only measurement, and for each GPU count
the pipeline seconds of every repeat, rank 0's stage seconds and every rank's rows, busy,
decode, host and setup seconds and waits. The same text is written to
`<workdir>/scaling.md`; each run's log is under `<workdir>/<mix>/logs/`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

# The script runs without installing the package, so the repository root goes first.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.encoder_only import EncoderOnly, measure  # noqa: E402
from benchmarks.common import (  # noqa: E402
    NO_MULTICAST,
    builtin_sources,
    collect_photos,
    fmt,
    matmul_peak,
    rank0,
    read_output,
    run_cli,
    table_row,
    timed_rows,
)
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.mixes import MIXES, SMOKE_IMAGES, Dataset, Mix, jpeg_dataset, save_tower, write_job  # noqa: E402
from embedjob.config import load_job  # noqa: E402

ENCODER_PASSES = 3


@dataclass
class Comparison:
    """A run's rows against the reference run's (`against`: its GPU count)."""

    same_rows: bool
    bitwise: int
    rows: int
    worst: float
    against: int = 1


@dataclass
class Run:
    """The repeats of one GPU count of one mix."""

    gpus: int
    stats: list[dict[str, Any]] = field(default_factory=list)
    failed: list[Path] = field(default_factory=list)
    comparison: Comparison | None = None


@dataclass
class MixResult:
    """Everything measured on one mix; `skipped`: GPU counts this machine does not have."""

    mix: Mix
    dataset: Dataset
    job: Path
    runs: list[Run]
    skipped: list[int]
    encoder: EncoderOnly | None = None
    encoder_error: str = ""
    peak: float | None = None
    smoke: bool = False
    command: str = ""
    overrides: list[str] = field(default_factory=list)

    def save(self, path: Path) -> None:
        """The result as JSON, so `--report` can print it from a later call."""
        data = dataclasses.asdict(self)
        data["mix"] = self.mix.name
        path.write_text(json.dumps(data, indent=1, default=str))

    @classmethod
    def load(cls, path: Path) -> MixResult:
        data = json.loads(path.read_text())
        runs = [Run(r["gpus"], r["stats"], [Path(f) for f in r["failed"]], _comparison(r["comparison"])) for r in data["runs"]]
        encoder = None if data["encoder"] is None else EncoderOnly(**data["encoder"])
        dataset = Dataset(Path(data["dataset"]["path"]), data["dataset"]["info"])
        return cls(
            MIXES[data["mix"]], dataset, Path(data["job"]), runs, data["skipped"], encoder, data["encoder_error"],
            data["peak"], data["smoke"], data.get("command", ""), data.get("overrides", []),
        )


def _comparison(data: dict[str, Any] | None) -> Comparison | None:
    return None if data is None else Comparison(**data)


def main() -> int:
    args = parse_args()
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    started = time.perf_counter()
    workdir = Path(args.workdir).resolve()
    results = load_results(workdir, args) if args.report else run_mixes(workdir, args)
    text = render(results, args, time.perf_counter() - started)
    (workdir / "scaling.md").write_text(text + "\n")
    print(text)
    return 0


def run_mixes(workdir: Path, args: argparse.Namespace) -> list[MixResult]:
    """Every mix of `args.mixes`, each result also saved as `<workdir>/<mix>/result.json`."""
    visible = torch.cuda.device_count()
    if not args.smoke and visible == 0:
        raise SystemExit("no CUDA GPU is visible; run with --smoke to exercise the script on the CPU")
    workers = len(os.sched_getaffinity(0))
    counts = image_counts(args, visible)
    photos = collect_photos([*builtin_sources(), *args.photos])
    datasets = {}
    for name in args.mixes:  # CPU work first, before this process touches a GPU
        log(f"[{name}] {counts[name]} JPEGs")
        datasets[name] = jpeg_dataset(MIXES[name], counts[name], args.seed, photos, workdir / "data", workers)
    peak = None if args.smoke else matmul_peak(torch.device("cuda"), "scaling")
    results = []
    for name in args.mixes:
        result = bench_mix(MIXES[name], datasets[name], workdir, visible, workers, args)
        result.peak, result.smoke, result.command, result.overrides = peak, args.smoke, _command(), args.set
        result.save(workdir / name / "result.json")
        results.append(result)
    return results


def load_results(workdir: Path, args: argparse.Namespace) -> list[MixResult]:
    """The saved results of `args.mixes` (`--report`)."""
    results = []
    for name in args.mixes:
        path = workdir / name / "result.json"
        if not path.exists():
            raise SystemExit(f"--report: {path} does not exist; run the mix first (--mixes {name})")
        result = MixResult.load(path)
        if result.smoke != args.smoke:
            raise SystemExit(f"--report: {path} was measured {'with' if result.smoke else 'without'} --smoke; pass the same")
        results.append(result)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument(
        "--images", nargs="+", action="extend", default=[], metavar="NAME=COUNT", help="rows per mix; a bare COUNT sets every mix"
    )
    parser.add_argument(
        "--gpus", nargs="+", type=int, help="GPU counts (default 1 2 4 8, those visible); CPU ranks with --smoke (default 1)"
    )
    parser.add_argument("--repeats", type=int, help="CLI runs per GPU count, the median reported (default 2; 1 with --smoke)")
    parser.add_argument("--workdir", default="scaling-work")
    parser.add_argument(
        "--photos", nargs="+", action="extend", type=Path, default=[], help="directories or files of photos or Parquet files"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override for every run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the JPEG crops, sizes and qualities")
    parser.add_argument("--smoke", action="store_true", help="CPU only: tiny towers, 24 images per mix, no compile")
    parser.add_argument("--report", action="store_true", help="print the table of the mixes' saved results; run nothing")
    parser.add_argument(
        "--encoder-from", type=Path, metavar="DIR",
        help="take each mix's encoder-only result from DIR/<mix>.json (a result.json of an earlier call with the same "
        "encoder code) instead of measuring it; the first CLI run then compiles with a cold cache, so setup is the best repeat's",
    )
    args = parser.parse_args()
    if args.gpus is None:
        args.gpus = [1] if args.smoke else [1, 2, 4, 8]
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 2
    if any(n < 1 for n in args.gpus) or args.repeats < 1:
        parser.error("--gpus and --repeats take positive numbers")
    args.gpus = sorted(set(args.gpus))
    return args


def image_counts(args: argparse.Namespace, visible: int) -> dict[str, int]:
    """Rows per mix: the defaults (SMOKE_IMAGES each with --smoke), then `--images`.

    The defaults are sized for two GPUs; beyond that they grow with the most GPUs that
    will run (x N/2), so a rank of an 8-GPU run still embeds rows past the head start it
    takes while the others set up (which `images/s` leaves out) instead of little else."""
    largest = max([n for n in args.gpus if n <= visible], default=1)
    grow = max(1, largest // 2)
    counts = {name: SMOKE_IMAGES if args.smoke else mix.images * grow for name, mix in MIXES.items()}
    for item in args.images:
        name, _, value = item.rpartition("=")
        if not value.isdigit() or int(value) < 1 or (name and name not in MIXES):
            raise SystemExit(f"--images: expected NAME=COUNT (NAME one of {', '.join(MIXES)}) or COUNT, got {item!r}")
        for key in [name] if name else list(counts):
            counts[key] = int(value)
    return counts


def log(message: str) -> None:
    """Progress on stderr."""
    _log("scaling", message)


# --- one mix ---------------------------------------------------------------------------


def bench_mix(mix: Mix, dataset: Dataset, workdir: Path, visible: int, workers: int, args: argparse.Namespace) -> MixResult:
    """The encoder-only measurement (which also warms the compile cache every run then
    shares), then the CLI runs of every GPU count."""
    tower = save_tower(mix.tower, workdir / "towers", args.smoke)
    mixdir = workdir / mix.name
    job = write_job(mixdir, mix, tower, dataset.path, workdir / "cache", args.smoke)
    runnable = [n for n in args.gpus if args.smoke or n <= visible]
    result = MixResult(mix, dataset, job, [], [n for n in args.gpus if n not in runnable])
    device = torch.device("cpu" if args.smoke else "cuda")
    earlier = args.encoder_from / f"{mix.name}.json" if args.encoder_from else None
    if earlier is not None and earlier.exists():
        log(f"[{mix.name}] encoder only: from {earlier}")
        result.encoder = MixResult.load(earlier).encoder
        result.encoder_error = f"encoder-only measured in an earlier call ({earlier.name})"
    else:
        log(f"[{mix.name}] encoder only")
        try:
            # The mix's default rows are sample enough, and the passes over a grown mix
            # would take minutes of an 8-GPU call.
            rows = None if args.smoke else mix.images
            result.encoder = measure(load_job(job, args.set), device, workers, ENCODER_PASSES, rows=rows)
        except Exception as exc:
            traceback.print_exc()
            result.encoder_error = f"{type(exc).__name__}: {exc}"
    reference: tuple[int, pa.Table] | None = None
    for gpus in runnable:
        run = Run(gpus)
        output = mixdir / f"out-{gpus}"
        for repeat in range(args.repeats):
            logfile = mixdir / "logs" / f"gpus{gpus}-repeat{repeat}.log"
            stats = run_cli(job, output, gpus, args.set, logfile)
            if stats is None:
                run.failed.append(logfile)
            else:
                run.stats.append(stats)
            unit = "CPU rank(s)" if args.smoke else "GPU(s)"
            log(f"[{mix.name}] {gpus} {unit}, repeat {repeat + 1}/{args.repeats}: " + _seconds_line(stats, logfile))
        if stats is not None:  # the output on disk is the last repeat's, complete
            table = read_output(output)
            reference = reference or (gpus, table)
            run.comparison = compare(reference[1], table, reference[0])
        result.runs.append(run)
    return result


def _seconds_line(stats: dict[str, Any] | None, logfile: Path) -> str:
    if stats is None:
        return f"FAILED (log: {logfile})"
    return f"pipeline {fmt(stats.get('pipeline_seconds'), '.2f')} s, setup {fmt(stats.get('setup_seconds'), '.1f')} s"


# --- outputs compared --------------------------------------------------------------------


def compare(reference: pa.Table, table: pa.Table, against: int) -> Comparison:
    """Ids, order, tokens and errors identical; rows with bitwise-equal embeddings; the
    largest relative difference of an embedding."""
    others = [c for c in reference.column_names if c != "embedding"]
    if table.num_rows != reference.num_rows or table.column_names != reference.column_names:
        return Comparison(False, 0, table.num_rows, float("nan"), against)
    same = table.select(others).equals(reference.select(others))
    a, b = _embeddings(reference.column("embedding")), _embeddings(table.column("embedding"))
    if a is None or b is None:
        rows = _compare_rows(same, reference.column("embedding").to_pylist(), table.column("embedding").to_pylist())
        rows.against = against
        return rows
    bits = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    bitwise = int(np.all(a.view(bits) == b.view(bits), axis=1).sum())
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(a64).all(axis=1) & np.isfinite(b64).all(axis=1)
    diff = np.linalg.norm(a64 - b64, axis=1) / np.maximum(np.linalg.norm(a64, axis=1), 1e-12)
    return Comparison(same, bitwise, table.num_rows, float(diff[finite].max()) if finite.any() else 0.0, against)


def _embeddings(column: pa.ChunkedArray) -> np.ndarray | None:
    """A pooled embedding column as one (rows, width) array; None for per-token lists."""
    if not pa.types.is_fixed_size_list(column.type):
        return None
    flat = column.combine_chunks()
    return flat.flatten().to_numpy(zero_copy_only=False).reshape(len(flat), column.type.list_size)


def _compare_rows(same: bool, a_rows: list[Any], b_rows: list[Any]) -> Comparison:
    """`compare` for embeddings that are lists of per-token vectors (`output.pooling: none`)."""
    bitwise, worst = 0, 0.0
    for a, b in zip(a_rows, b_rows):
        if a is None or b is None:
            bitwise += a is None and b is None
            continue
        ea, eb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        bitwise += ea.shape == eb.shape and bool(np.array_equal(ea, eb))
        if ea.shape == eb.shape:
            worst = max(worst, float(np.linalg.norm(ea - eb) / max(np.linalg.norm(ea), 1e-12)))
    return Comparison(same, bitwise, len(a_rows), worst)


# --- the report --------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], pick: Callable[[dict[str, Any]], Any]) -> float | None:
    """The median over the repeats of what `pick` finds; None when no repeat has it."""
    values = [v for v in (_safely(pick, s) for s in runs) if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _safely(pick: Callable[[dict[str, Any]], Any], stats: dict[str, Any]) -> Any:
    try:
        return pick(stats)
    except (KeyError, IndexError, TypeError, ZeroDivisionError):
        return None


def run_rate(run: Run) -> float | None:
    return median_of(run.stats, lambda s: timed_rows(s) / s["pipeline_seconds"] if s["pipeline_seconds"] else None)


COLUMNS = [
    ("mix", "---"), ("run", "---"), ("rows", "---:"), ("seconds", "---:"), ("images/s", "---:"), ("per GPU", "---:"),
    ("scaling eff.", "---:"), ("MFU", "---:"), ("per GPU / enc.-only", "---:"), ("setup s", "---:"),
    ("main ms/item", "---:"), ("balance", "---:"), ("busy", "---:"), ("hit rate", "---:"), ("padding", "---:"),
    ("rows identical", "---"), ("bitwise", "---:"), ("max rel. diff", "---:"),
]


def render(results: list[MixResult], args: argparse.Namespace, wall: float) -> str:
    lines = _header(results, args, wall)
    lines += ["", "| " + " | ".join(c for c, _ in COLUMNS) + " |", "| " + " | ".join(a for _, a in COLUMNS) + " |"]
    for result in results:
        lines += [table_row(cells) for cells in _mix_rows(result, result.peak, args.smoke)]
    for result in results:
        lines += ["", *_details(result, args.smoke)]
    return "\n".join(lines)


def _header(results: list[MixResult], args: argparse.Namespace, wall: float) -> list[str]:
    if args.smoke:
        device = f"CPU only (--smoke: tiny towers, `--gpus N` = N CPU ranks), {os.cpu_count()} CPUs"
    else:
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs"
    peaks = [(r.mix.name, r.peak / 1e12) for r in results if r.peak]
    listed = f"{peaks[0][1]:.0f}" if len({p for _, p in peaks}) == 1 else ", ".join(f"{m} {p:.0f}" for m, p in peaks)
    peak_text = f"{listed} TFLOP/s (8192^3, median of 10, in the process that ran the mix)" if peaks else "not measured"
    commands = sorted({r.command for r in results if r.command and r.command != _command()})
    overrides = sorted({", ".join(r.overrides) or "none" for r in results})
    repeats = sorted({len(run.stats) + len(run.failed) for r in results for run in r.runs})
    lines = [
        f"# embedjob per-GPU pipeline benchmark — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- command: `{_command()}` ({wall / 60:.1f} min)",
        *[f"- measured by: `{command}`" for command in commands],
        (f"- machine: {device}; python {platform.python_version()}, torch {torch.__version__}, "
         f"transformers {_version('transformers')}, pyarrow {pa.__version__}"),
        f"- bf16 matmul: {peak_text}",
        (f"- each run: `python -m embedjob.cli run JOB --gpus N --overwrite` (bf16, "
         f"{'uncompiled' if args.smoke else 'compiled blocks'}, graphs, decode included); extra --set: "
         f"{'; '.join(overrides)}; seconds = pipeline_seconds, median of {'/'.join(map(str, repeats)) or '-'} repeats; "
         f"encoder only: median of {ENCODER_PASSES} passes after a warm-up, same job and checkpoint, 1 "
         f"{'CPU process' if args.smoke else 'GPU'}"),
    ]
    return lines


def _command() -> str:
    return " ".join(["benchmarks/scaling.py", *sys.argv[1:]])


def _mix_rows(result: MixResult, peak: float | None, smoke: bool) -> list[list[str]]:
    unit = "rank" if smoke else "GPU"
    encoder = result.encoder
    enc_rate = encoder.rate if encoder is not None and encoder.passes else None
    flops = encoder.flops / encoder.items if encoder is not None and encoder.items else None  # per item
    base = next((run_rate(r) for r in result.runs if r.gpus == 1), None)
    rows = []
    for run in result.runs:
        label = f"{run.gpus} {unit}{'s' if run.gpus > 1 else ''}" + (f", {len(run.failed)} failed" if run.failed else "")
        if not run.stats:
            rows.append([result.mix.name, label] + ["-"] * (len(COLUMNS) - 2))
            continue
        rate = run_rate(run)
        seconds = median_of(run.stats, lambda s: s["pipeline_seconds"])
        timed = median_of(run.stats, timed_rows)
        c = run.comparison
        rows.append([
            result.mix.name,
            label,
            fmt(median_of(run.stats, lambda s: s["rows"]), ".0f"),
            fmt(seconds, ".2f"),
            fmt(rate, ".1f"),
            fmt(rate / run.gpus if rate else None, ".1f"),
            fmt(rate / (run.gpus * base) if rate and base else None, ".2f"),
            fmt(flops * timed / seconds / (run.gpus * peak) if flops and timed and seconds and peak else None, ".1%"),
            fmt(rate / run.gpus / enc_rate if rate and enc_rate else None, ".0%"),
            fmt(min((s["setup_seconds"] for s in run.stats if "setup_seconds" in s), default=None), ".1f"),
            fmt(median_of(run.stats, lambda s: rank0(s)["host_seconds"] / rank0(s)["rows"] * 1000), ".2f"),
            fmt(median_of(run.stats, lambda s: s["balance_ratio"]), ".3f"),
            fmt(median_of(run.stats, lambda s: s["busy_ratio"]), ".3f"),
            fmt(median_of(run.stats, lambda s: s["hit_rate"]), ".0%"),
            fmt(median_of(run.stats, lambda s: s["padding_waste"] / s["real_tokens"]), ".1%"),
            "-" if c is None else ("yes" if c.same_rows else "NO") + ("" if c.against == 1 else f" (vs {c.against})"),
            "-" if c is None else f"{c.bitwise}/{c.rows}",
            "-" if c is None else fmt(c.worst, ".2e"),
        ])
    rows.append(_encoder_row(result, peak, smoke))
    return rows


def _encoder_row(result: MixResult, peak: float | None, smoke: bool) -> list[str]:
    label = f"encoder only, 1 {'CPU process' if smoke else 'GPU'}"
    e = result.encoder
    if e is None or not e.passes:
        return [result.mix.name, label + " (not measured)"] + ["-"] * (len(COLUMNS) - 2)
    cells = [
        result.mix.name, label, str(e.items), f"{e.seconds:.2f}", f"{e.rate:.1f}", f"{e.rate:.1f}", "-",
        fmt(e.flops / e.seconds / peak if peak else None, ".1%"), "-", f"{e.setup_seconds:.1f}", "-", "-", "-",
        fmt(e.hit_rate, ".0%"), fmt(e.padding, ".1%"), "-", "-", "-",
    ]
    return cells


def _details(result: MixResult, smoke: bool) -> list[str]:
    mix, info = result.mix, result.dataset.info
    lines = [
        (f"**{mix.name}**: {mix.describe(smoke)}; {info['rows']} rows, {info['distinct_jpegs']} distinct JPEGs "
        f"({info['megabytes']} MB) cut from {info['photos']} photos ({info['unreadable_photos']} unreadable skipped); "
        f"`{result.dataset.path.name}`, job `{result.job}`"),
    ]
    e = result.encoder
    if e is not None:
        passes = ", ".join(f"{p:.3f}" for p in e.passes) or "-"
        lines.append(
            f"- encoder only: {e.items} items ({e.failed} did not decode), {e.batches} batches, passes {passes} s, "
            f"{e.flops / max(e.items, 1) / 1e9:.4g} GFLOP per item, budgets {e.budgets}, load+compile+capture "
            f"{e.setup_seconds:.1f} s, CPU preprocessing {e.preprocess_seconds:.1f} s {e.note}".rstrip()
        )
    elif result.encoder_error:
        lines.append(f"- encoder only: failed: {result.encoder_error}")
    for run in result.runs:
        lines += _run_details(run, smoke)
    if result.skipped:
        lines.append(f"- skipped: {', '.join(map(str, result.skipped))} GPUs ({torch.cuda.device_count()} visible); not run, not estimated")
    return lines


def _run_details(run: Run, smoke: bool) -> list[str]:
    unit = ("rank" if smoke else "GPU") + ("s" if run.gpus > 1 else "")
    failed = f"; failed repeats, logs: {', '.join(str(p) for p in run.failed)}" if run.failed else ""
    if not run.stats:
        return [f"- {run.gpus} {unit}: no run finished{failed}"]
    seconds = ", ".join(fmt(s.get("pipeline_seconds"), ".2f") for s in run.stats)
    last = run.stats[-1]
    stages = ", ".join(f"{k} {v:.2f}" for k, v in (last.get("stage_seconds") or {}).items()) or "-"
    lines = [f"- {run.gpus} {unit}: pipeline s per repeat {seconds}; rank 0 stages (last repeat) {stages}{failed}"]
    if not last.get("ranks"):
        lines.append("  - ranks: - (not in this run's statistics)")
    for rank in last.get("ranks") or []:
        waits = rank.get("waits", rank.get("exchange_seconds"))
        wait_text = "-" if waits is None else ", ".join(f"{k} {v:.2f}" for k, v in waits.items()) or "none"
        lines.append(
            f"  - rank {fmt(rank.get('rank'))} ({fmt(rank.get('device'))}): rows {fmt(rank.get('rows'))}, "
            f"items {fmt(rank.get('items'))}, busy {fmt(rank.get('busy_seconds'), '.2f')} s, "
            f"decode {fmt(rank.get('decode_seconds'), '.2f')} s, host {fmt(rank.get('host_seconds'), '.2f')} s, "
            f"in launches {fmt(rank.get('launch_seconds'), '.2f')} s, main-thread steps {rank.get('encode_host_seconds')}, "
            f"setup {fmt(rank.get('setup_seconds'), '.1f')} s ({_setup_text(rank)}), waits s: {wait_text}"
        )
    return lines


def _setup_text(rank: dict[str, Any]) -> str:
    """A rank's setup stages; `spawn` and `join` (a spawned rank's start) come before
    its `setup_seconds` and are in the shard's."""
    return ", ".join(f"{k} {v:.1f}" for k, v in (rank.get("setup") or {}).items()) or "-"


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


if __name__ == "__main__":
    raise SystemExit(main())
