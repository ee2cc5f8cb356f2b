"""Where the device sits idle during one `embedjob run`: its kernels traced, the gaps between them measured (RESULTS.md section 3).

Usage (from the repository root, one GPU; the job's compile cache warm, e.g. the
scaling benchmark's job after one of its runs):

    PYTHONPATH=. python3 benchmarks/device_gaps.py JOB.yaml [--set KEY=VALUE ...] [--top 12] [--kernels 20]

The job runs in this process under `torch.profiler` with CUDA activity only (kernels,
copies and memsets on the device, each with its start and end on the device; the
host's calls are not traced, so the run keeps its pace). Only the pipeline counts:
from the moment the rank was ready (`ranks[0].ready_at` in the run's statistics) to
the end of its `pipeline_seconds`. The device is busy where some activity runs (the
union of their intervals); the rest of the pipeline is idle, split into

- head: from ready to the first activity (the first window's decode, pack and copy);
- tail: from the end of the last activity to the end of the pipeline (the last rows'
  copy back, the last row group, the part's fsync and the manifest);
- gaps between activities, counted by length, and the longest ones with their offset
  from ready and the activities on either side (kernel names shortened).

A gap inside a graph's replay is a few microseconds (the device moving between
kernels); gaps between batches or windows longer than that are the host arriving late.
The profiler adds some time to every kernel, so compare the shares, not the seconds, with
an untraced run.

What the host did meanwhile: the process's garbage collections (`gc.callbacks`: each
one's generation and seconds; a collection holds the GIL, so the thread that launches
the graphs waits it out) and the steps of a shard's end (`PROBED`: the writer's row
groups and commits, the checkpoint's manifest, the rank's last window and its graphs'
release), timed by wrapping them. The report lists those that ran during the tail or
overlap one of the longest gaps, and every collection of the oldest generation.

`--kernels N` adds the N activities with the most device time in the pipeline: with
`preprocess.decoder=gpu`, how much of the device the decode's own kernels take beside
the encoder's.

`--smoke` runs the job (`jobs/demo.yaml` unless one is named) on the CPU with the host
probe but without the profiler, says that it skipped the device trace, and prints the
report with no device activity: every idle second is then the head.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import skipped  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.runner import run_job  # noqa: E402

PROBED = (
    "embedjob.io.sink:PartSink._write",
    "embedjob.io.sink:PartSink._commit",
    "embedjob.io.writer:PartFile.commit",
    "embedjob.io.checkpoint:Checkpoint.commit",
    "embedjob.io.checkpoint:Checkpoint.finish",
    "embedjob.pipeline:WindowEncoder.finalize",
    "embedjob.pipeline:RankPipeline._finish",
    "embedjob.engine.encode:BatchEncoder.clear",
)
"""Host steps timed during the run (module:Class.method)."""

BINS_US = (20, 100, 1_000, 10_000)
"""Upper bounds (microseconds) of the gap-length classes in the table; the last class is open."""


@dataclass(frozen=True)
class Activity:
    """One kernel, copy or memset on the device, in epoch seconds."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class HostStep:
    """A probed host step or a garbage collection, in epoch seconds, on `thread`."""

    name: str
    thread: str
    start: float
    end: float


@contextlib.contextmanager
def host_probe() -> Iterator[list[HostStep]]:
    """Record every garbage collection and every call of `PROBED` while inside."""
    steps: list[HostStep] = []
    began: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[threading.get_ident()] = time.time()
        elif (start := began.pop(threading.get_ident(), None)) is not None:
            steps.append(HostStep(f"gc gen{info['generation']}", threading.current_thread().name, start, time.time()))

    def timed(name: str, method):
        def wrapper(*args, **kwargs):
            start = time.time()
            try:
                return method(*args, **kwargs)
            finally:
                steps.append(HostStep(name, threading.current_thread().name, start, time.time()))
        return wrapper

    originals = []
    for target in PROBED:
        module, _, qualified = target.partition(":")
        owner_name, method_name = qualified.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        originals.append((owner, method_name, getattr(owner, method_name)))
        setattr(owner, method_name, timed(qualified, getattr(owner, method_name)))
    gc.callbacks.append(on_gc)
    try:
        yield steps
    finally:
        gc.callbacks.remove(on_gc)
        for owner, method_name, method in originals:
            setattr(owner, method_name, method)


def untraced(job_path: str, overrides: list[str], output: Path) -> tuple[list[Activity], dict, list[HostStep]]:
    """`--smoke`: the job with the host probe only, so no device activity."""
    job = load_job(job_path, [*overrides, f"output.path={output}"])
    with host_probe() as steps:
        stats = run_job(job, overwrite=True)
    return [], stats, steps


def trace(job_path: str, overrides: list[str], output: Path) -> tuple[list[Activity], dict, list[HostStep]]:
    """Run the job under the profiler; its device activities, statistics and host steps."""
    from torch.profiler import ProfilerActivity, profile

    job = load_job(job_path, [*overrides, f"output.path={output}"])
    with host_probe() as steps, profile(activities=[ProfilerActivity.CUDA]) as prof:
        stats = run_job(job, overwrite=True)
    base = prof.profiler.kineto_results.trace_start_ns() / 1e9
    activities = [
        Activity(e.name, base + e.time_range.start / 1e6, base + e.time_range.end / 1e6)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    return sorted(activities, key=lambda a: a.start), stats, steps


def idle_spans(activities: list[Activity], begin: float, end: float) -> tuple[float, list[tuple[float, float, str, str]], float, float]:
    """Busy seconds inside [begin, end], the interior gaps (start, length, activity
    before, activity after), and the idle head and tail."""
    inside = [a for a in activities if a.end > begin and a.start < end]
    if not inside:
        return 0.0, [], end - begin, 0.0
    busy, gaps = 0.0, []
    current_start, current_end, last = max(inside[0].start, begin), min(inside[0].end, end), inside[0]
    for act in inside[1:]:
        start, stop = max(act.start, begin), min(act.end, end)
        if start > current_end:
            busy += current_end - current_start
            gaps.append((current_end, start - current_end, last.name, act.name))
            current_start = start
        if stop >= current_end:
            current_end, last = stop, act
    busy += current_end - current_start
    head = max(inside[0].start, begin) - begin
    return busy, gaps, head, end - current_end


def short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def report(activities: list[Activity], stats: dict, steps: list[HostStep], top: int, kernels: int = 0) -> str:
    rank = stats["ranks"][0]
    begin = rank["ready_at"]
    end = begin + stats["pipeline_seconds"]
    busy, gaps, head, tail = idle_spans(activities, begin, end)
    pipeline = end - begin
    lines = [
        f"pipeline {pipeline:.3f} s, device busy {busy:.3f} s ({busy / pipeline:.1%}), idle {pipeline - busy:.3f} s: "
        f"head {head * 1e3:.1f} ms, tail {tail * 1e3:.1f} ms, between activities {sum(g[1] for g in gaps) * 1e3:.1f} ms "
        f"in {len(gaps)} gaps; run: {stats['rows']} rows, {stats['items_per_second']:.1f} rows/s, "
        f"batches {sum(stats.get('budget_batches', {}).values())}, busy_seconds (events) {rank['busy_seconds']:.3f}; "
        f"setup {stats['setup_seconds']:.1f} s {rank.get('setup')}",
        "",
        "| gap length | gaps | idle ms | share of idle |",
        "| --- | ---: | ---: | ---: |",
    ]
    idle = max(pipeline - busy, 1e-9)
    lower = 0
    for upper in (*BINS_US, None):
        chosen = [g for g in gaps if g[1] * 1e6 >= lower and (upper is None or g[1] * 1e6 < upper)]
        label = f"{lower}–{upper} µs" if upper is not None else f"≥ {lower} µs"
        total = sum(g[1] for g in chosen)
        lines.append(f"| {label} | {len(chosen)} | {total * 1e3:.1f} | {total / idle:.1%} |")
        lower = upper or lower
    lines.append(f"| head + tail | 2 | {(head + tail) * 1e3:.1f} | {(head + tail) / idle:.1%} |")
    lines += ["", f"the {top} longest gaps:", "", "| at s after ready | ms | before | after |", "| ---: | ---: | --- | --- |"]
    longest = sorted(gaps, key=lambda g: -g[1])[:top]
    for at, length, before, after in longest:
        lines.append(f"| {at - begin:.3f} | {length * 1e3:.2f} | {short(before)} | {short(after)} |")
    lines += ["", *host_lines(steps, begin, end, end - tail, [(at, at + length) for at, length, *_ in longest if length > 1e-3])]
    if kernels:
        lines += ["", *kernel_lines(activities, begin, end, kernels)]
    return "\n".join(lines)


def kernel_lines(activities: list[Activity], begin: float, end: float, count: int) -> list[str]:
    """The `count` activity names with the most device seconds inside [begin, end], as a
    table. Activities of different streams may overlap (the GPU decoder's beside the
    graphs'), so the shares are of the summed activity time, not of the busy time."""
    totals: dict[str, list[float]] = {}
    for act in activities:
        seconds = min(act.end, end) - max(act.start, begin)
        if seconds > 0:
            entry = totals.setdefault(act.name, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
    summed = max(sum(seconds for _, seconds in totals.values()), 1e-9)
    lines = [
        f"activity time in the pipeline: {summed:.3f} s in {sum(n for n, _ in totals.values())} activities of {len(totals)} names",
        "",
        "| activity | count | ms | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (n, seconds) in sorted(totals.items(), key=lambda item: -item[1][1])[:count]:
        lines.append(f"| {short(name, 72)} | {n} | {seconds * 1e3:.1f} | {seconds / summed:.1%} |")
    return lines


def host_lines(steps: list[HostStep], begin: float, end: float, tail_from: float, spans: list[tuple[float, float]]) -> list[str]:
    """The host steps of the pipeline that ran in the tail or overlap a long gap, and its
    oldest-generation collections, as a table (seconds after ready)."""
    def overlaps(step: HostStep, lo: float, hi: float) -> bool:
        return step.start < hi and step.end > lo

    inside = [s for s in steps if overlaps(s, begin, end)]
    collections = [s for s in inside if s.name.startswith("gc")]
    before = [s for s in steps if s.name.startswith("gc") and s.end <= begin]
    chosen = [
        s for s in inside
        if s.name == "gc gen2" or overlaps(s, tail_from, end) or any(overlaps(s, lo, hi) for lo, hi in spans)
    ]
    lines = [
        f"garbage collections in the pipeline: {len(collections)}, {sum(s.end - s.start for s in collections) * 1e3:.1f} ms "
        f"(oldest generation: {sum(s.name == 'gc gen2' for s in collections)}, "
        f"{sum(s.end - s.start for s in collections if s.name == 'gc gen2') * 1e3:.1f} ms); before it (setup): "
        f"{len(before)}, {sum(s.end - s.start for s in before) * 1e3:.1f} ms (oldest generation: "
        f"{sum(s.name == 'gc gen2' for s in before)}, {sum(s.end - s.start for s in before if s.name == 'gc gen2') * 1e3:.1f} ms)",
        "",
        "| host step | thread | from s after ready | ms | in |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for step in sorted(chosen, key=lambda s: s.start):
        where = "tail" if overlaps(step, tail_from, end) else "gap" if any(overlaps(step, lo, hi) for lo, hi in spans) else "-"
        lines.append(f"| {step.name} | {step.thread} | {step.start - begin:.3f} | {(step.end - step.start) * 1e3:.1f} | {where} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", nargs="?", help="the job file (with --smoke, default jobs/demo.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override")
    parser.add_argument("--top", type=int, default=12, help="how many of the longest gaps to list")
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="also list the N activities with the most device time")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, without the device trace")
    args = parser.parse_args()
    if args.job is None and not args.smoke:
        parser.error("the job file is required without --smoke")
    if not args.smoke and not torch.cuda.is_available():
        print("device_gaps.py traces a GPU's kernels: no CUDA device here (--smoke checks the script on a CPU)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            skipped("device_gaps", "the device trace", "torch.profiler's CUDA activity needs a GPU")
            job = args.job or str(REPO / "jobs" / "demo.yaml")
            activities, stats, steps = untraced(job, [*args.set, "runtime.device=cpu"], Path(tmp) / "out")
        else:
            activities, stats, steps = trace(args.job, [*args.set, "runtime.device=cuda"], Path(tmp) / "out")
    print(report(activities, stats, steps, args.top, args.kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
