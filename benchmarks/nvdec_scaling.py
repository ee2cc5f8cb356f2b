"""NVDEC alone: how its rate grows with decoder sessions, as threads of one process and as processes (RESULTS.md section 11).

In `embedjob run`, `video.decoder: nvdec` read 52-54 s of video a second on an H200
with 4, 7 or 14 sessions alike (section 11): something serialises the sessions. This
script takes the encoder and the job away and reads the clips of `benchmarks/video_decode.py
--make-clips` through `embedjob.decode.nvdec.decode_frames` (the job's own call: plan from
the stream at 2 frames a second, at most 32, the sampled frames as RGB on the GPU), at each
`--sessions` count:

- `threads`: one process, a thread per session, each keeping its decoder sessions between
  clips (one per kind of stream), as the job's GPU-decode pool does (`nvdec.decode_videos`), `--window` clips at a
  time (the job decodes a window, then the next);
- `processes`: a process per session, each reading its share of the clips in its main
  thread, all started together once every process has its CUDA context;

each with the sessions on the library's default CUDA stream (`shared-stream`), on streams
of their own (`own-streams`: `nvdec.OWN_STREAMS`), fed only the packets the samples need
(`fed`: `nvdec.FEED_SAMPLED`, what a job runs), and fed the pictures a worker cut out
(`cut`: `video.PACKETS_IN_WORKERS`, no demuxer on the rank), and so with the surfaces
copied out on the caller's stream, which the threads share (`cut-caller-copies`:
`nvdec.COPIES_ON_FEED_STREAM` off), and so with the NV12 turned to RGB by one Triton kernel
(`cut-fused`: `nvdec.FUSED_RGB`), and so with the surfaces copied out by the driver's 2D
copy, which the copy engines run (`cut-engine`: `nvdec.COPY_ENGINE`), as `--variants` says. The
clips are planned first, as the decode workers plan them (`video.decode_video` with
`defer_video`; the cut, too, is made then, untimed).

With `--loads`, each run is repeated beside what a job runs next to the GPU's decoder:
`cpu`, `--load-workers` processes decoding the clips with decord, as a job's decode
workers do (their clips a second are in the row), at each `--load-nice` niceness (the
job's workers run at `workers.pool.WORKER_NICE`, so the rank's threads win a core); `gpu`, a thread of this process replaying
a CUDA graph of bf16 products back to back on a stream of its own (`common.GemmLoad`), as
the encoder's graphs keep the device busy; `both`; `python`, a thread of this process running
Python `--python-busy` of the time (`PythonLoad`), as the rank's main thread holds the GIL
between its waits, under `--switch-interval` (Python's thread switch interval); the `gpu`
load's products leave `--load-carveout` SMs free, one run each (the job's
`pipeline.GPU_DECODE_SM_CARVEOUT`; the row names the products' rate alone, lower by the SMs'
share where they left them: 16 asked for left NVDEC's rate unchanged, RESULTS.md section 11),
or `--load-green` SMs by a green context (`engine.green`: every kernel of the products held
to the rest, where the carveout reaches cuBLAS's alone). The process takes the job's 32
hardware work queues (`config.spread_device_queues`; runs before 12-08 had CUDA's 8).
In `video.decoder: auto` the GPU's decoder read about half what it reads alone (RESULTS.md
section 11): these rows say which neighbour takes it.

Per row: clips per second, seconds of video per second, the sessions' parallelism (the
seconds the clips took, summed over sessions, over the wall time: N when N sessions never
wait for each other, 1 when they take turns) and, for threads, the share of the time a
Python probe thread woke when it asked to (the GIL free: near 1 when the decoder's calls release
it, near 0 when they hold it while the GPU decodes), how busy NVML saw the NVDEC engines
(`common.DecoderBusy`: near 100 % where they bound the rate) with the video and SM clocks
and the board's power meanwhile, and, for threads on the packet feed, the milliseconds a
clip's threads spent in the whole clip, the decoder's `Decode` calls, the surfaces taken
from it, their copies and the NV12 conversion (`nvdec.CLOCK`, which a job reports too: a
clip's time beyond its parts is Python and the wait for the GIL). A first pass over as many
clips as sessions, not timed, opens the sessions (each process opens its own on its first clip).

    PYTHONPATH=. python3 benchmarks/nvdec_scaling.py --clips DIR [--sessions 1 4 7 14] [--clips-limit 128]
        [--loads none cpu gpu both] [--load-workers 16] [--load-nice 0 10]

`--smoke` (no GPU) runs both modes on the repository's test clips with decord standing in
for NVDEC (`video.decode_video` on the CPU), saying so: the timing, the probe and the CPU
load are checked, the numbers are not NVDEC's; the GPU load needs a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import DecoderBusy, GemmLoad, feed_per_clip, fmt, log, skipped, table  # noqa: E402
from embedjob.config import spread_device_queues  # noqa: E402
from embedjob.decode import nvdec  # noqa: E402
from embedjob.decode.types import DecodeOptions, DeferredVideo  # noqa: E402
from embedjob.workers.pool import WORKER_NICE  # noqa: E402

SCRIPT = "nvdec_scaling"
MODES = ("threads", "processes")
SMOKE_CLIPS = ("decord_video_0.mov", "torchcodec_h265_video.mp4")
IMAGE_PIXELS = 1 << 24
"""A bound on image pixels, which no clip meets (DecodeOptions asks for one)."""


PROCESS_SECONDS = 600
"""The longest a process may take to report (a crashed one never does)."""

_BASE = {"OWN_STREAMS": False, "FEED_SAMPLED": True, "COPIES_ON_FEED_STREAM": True, "COPY_ENGINE": False, "FUSED_RGB": False}
_CUT = {**_BASE, "PACKETS_IN_WORKERS": True}
VARIANTS = {
    "shared-stream": {**_BASE, "FEED_SAMPLED": False},
    "own-streams": {**_BASE, "OWN_STREAMS": True, "FEED_SAMPLED": False},
    "fed": _BASE,
    "cut": _CUT,
    "cut-caller-copies": {**_CUT, "COPIES_ON_FEED_STREAM": False},
    "cut-fused": {**_CUT, "FUSED_RGB": True},
    "cut-engine": {**_CUT, "COPY_ENGINE": True},
}
"""`--variants`: the `nvdec` settings each runs with, and `video.PACKETS_IN_WORKERS` for the plans."""

NVDEC_SETTINGS = tuple(_BASE)


@dataclass
class Run:
    """One mode and variant at one session count: the clips read, their seconds of video,
    the wall time, the seconds each clip took summed over sessions, and the GIL probe's
    free share."""

    mode: str
    sessions: int
    clips: int = 0
    video_seconds: float = 0.0
    wall: float = 0.0
    busy: float = 0.0
    gil_free: float | None = None
    decoders: str = "-"
    """How busy the NVDEC engines were (`common.DecoderBusy`)."""
    load_rate: float | None = None
    """Clips a second the `cpu` load's decord processes read meanwhile."""
    error: str | None = None
    """Why the run stopped (its row says so; the runs after it go on)."""
    feed: list[str] | None = None
    """`feed_per_clip` of a `threads` run (None: not counted, as for processes)."""


def options() -> DecodeOptions:
    """The video_decode.py job's sampling: 2 frames a second, at most 32."""
    return DecodeOptions(modality="video", max_image_pixels=IMAGE_PIXELS, fps=2.0, max_frames=32, frame_multiple=1, defer_video=True)


_streams = threading.local()


def planned(data: bytes, cut: bool = False) -> DeferredVideo:
    """A clip planned as a decode worker plans it for the GPU: its sampled frames, their
    size, and with `cut` the pictures they need (`video.PACKETS_IN_WORKERS`)."""
    from embedjob.decode import video as worker
    from embedjob.decode.sniff import sniff_format

    found = sniff_format(data)
    worker.PACKETS_IN_WORKERS = cut
    video = worker.decode_video(data, options(), found[1] if found else None)
    return video if isinstance(video, DeferredVideo) else DeferredVideo.unplanned(data)


def read_one(video: DeferredVideo, device: torch.device) -> tuple[float, float]:
    """One clip read by NVDEC (`read_nvdec`), or with `device` a CPU by decord (`--smoke`)."""
    return read_nvdec(video, device) if device.type == "cuda" else read_decord(video.data)


def read_decord(data: bytes) -> tuple[float, float]:
    """One clip's sampled frames decoded on the CPU, as a decode worker does; (seconds it took, seconds of video)."""
    from embedjob.decode.sniff import sniff_format
    from embedjob.decode.video import decode_video

    since = time.perf_counter()
    found = sniff_format(data)
    video = decode_video(data, replace(options(), defer_video=False), found[1] if found else None)
    return time.perf_counter() - since, video.source_frames / video.source_fps if video.source_fps > 0 else 0.0


def read_nvdec(video: DeferredVideo, device: torch.device) -> tuple[float, float]:
    """Decode one clip's sampled frames on this thread's session, its copies on this
    thread's own stream (a shared one would make each thread's wait for its clip a wait
    for the others'); (seconds it took, seconds of video)."""
    from embedjob.decode.nvdec import decode_frames

    if getattr(_streams, "stream", None) is None:
        _streams.stream = torch.cuda.Stream(device)
    since = time.perf_counter()
    with torch.cuda.stream(_streams.stream):
        _, plan = decode_frames(video, device, options())
    _streams.stream.synchronize()
    return time.perf_counter() - since, plan.source_frames / plan.source_fps if plan.source_fps > 0 else 0.0


FEED_PARTS = nvdec.DecoderClock.PARTS


class Beside:
    """A daemon thread of this process running `step` over and over while the block runs."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()

    def step(self) -> None:
        """One turn of the thread's work (each subclass's own)."""
        raise NotImplementedError

    def __enter__(self) -> Beside:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class GilProbe(Beside):
    """A thread waking every millisecond: its wake-ups while the decoders run over its
    wake-ups alone are the share of the time the GIL was free to it (each wake-up needs
    the GIL; a C call that holds it while the GPU decodes holds the probe off, while a
    spinning probe would itself hold the decoders' Python steps off)."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0

    def step(self) -> None:
        time.sleep(0.001)
        self.turns += 1

    def rate(self, seconds: float) -> float:
        before, since = self.turns, time.perf_counter()
        time.sleep(seconds)
        return (self.turns - before) / (time.perf_counter() - since)


LOADS = ("none", "cpu", "gpu", "both", "python")
LOAD_NAMES = {"cpu": "beside {workers} decord processes at nice {nice}", "gpu": "beside bf16 products",
              "both": "beside both (nice {nice})", "python": "beside a thread running Python {busy:.0%} of the time"}
"""How a run's row names its load."""


def _load_main(paths: list[str], nice: int, stop: multiprocessing.Event, done: multiprocessing.Value) -> None:
    """One `cpu` load process: decord reads `paths` round and round, as a decode worker
    reads clips, at `nice` more niceness, until `stop`, counting each clip it finishes in `done`."""
    if nice:
        os.nice(nice)
    datas = [Path(p).read_bytes() for p in paths]
    for k in itertools.count():
        if stop.is_set():
            return
        read_decord(datas[k % len(datas)])
        with done.get_lock():
            done.value += 1


class CpuLoad:
    """`workers` processes of `_load_main` over `paths` (each its own share), at `nice`, while the
    block runs; `rate`, once it ends, the clips a second they finished between the end of
    `LOAD_SETTLE_SECONDS` and the block's end."""

    def __init__(self, paths: list[Path], workers: int, nice: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._done = context.Event(), context.Value("q", 0)
        shares = [[str(p) for p in paths[k::workers]] or [str(paths[k % len(paths)])] for k in range(workers)]
        self._workers = [context.Process(target=_load_main, args=(share, nice, self._stop, self._done), daemon=True) for share in shares]
        self._counted = (0, 0.0)
        self.rate: float | None = None

    def __enter__(self) -> CpuLoad:
        for worker in self._workers:
            worker.start()
        time.sleep(LOAD_SETTLE_SECONDS)
        self._counted = (self._done.value, time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        done, since = self._counted
        self.rate = (self._done.value - done) / (time.perf_counter() - since)
        self._stop.set()
        for worker in self._workers:
            worker.join(PROCESS_SECONDS)


class PythonLoad(Beside):
    """A thread of this process that runs Python, which holds the GIL, for `busy` of every
    `PYTHON_PERIOD` seconds and sleeps the rest, as a rank's main thread runs its Python
    between its waits for the device: a decode thread coming back from a decoder call waits
    for the GIL up to Python's switch interval (`--switch-interval`) each time."""

    def __init__(self, busy: float) -> None:
        super().__init__()
        self.busy = busy

    def step(self) -> None:
        until = time.perf_counter() + self.busy * PYTHON_PERIOD
        while time.perf_counter() < until:
            pass
        time.sleep((1 - self.busy) * PYTHON_PERIOD)


PYTHON_PERIOD = 0.01
"""Seconds of the `python` load's cycle of Python and sleep."""

LOAD_SETTLE_SECONDS = 3.0
"""Seconds the load processes get to import and start reading before a run is timed."""


@dataclass
class Loads:
    """What runs beside the decoder: the CPU load, whose rate is read after, and the GPU
    load's product rate alone (TFLOP/s, before the decoder starts): with a carveout it says
    whether the products left the SMs free, as a rate that much lower."""

    cpu: CpuLoad | None = None
    gemm_tflops: float | None = None


@contextlib.contextmanager
def loaded(load: str, paths: list[Path], workers: int, nice: int, device: torch.device, busy: float,
           carveout: int | None = None, green: int | None = None) -> Iterator[Loads]:
    """The `load` (`LOADS`) running while the block runs (its decord processes at `nice`, its
    Python thread `busy`, its products leaving `carveout` SMs free to cuBLAS, or `green`
    by a green context)."""
    loads = Loads()
    with contextlib.ExitStack() as stack:
        if load in ("gpu", "both"):
            gemms = GemmLoad(device, carveout, green)
            loads.gemm_tflops = gemms.tflops()
            stack.enter_context(gemms)
        if load == "python":
            stack.enter_context(PythonLoad(busy))
        if load in ("cpu", "both"):
            loads.cpu = stack.enter_context(CpuLoad(paths, workers, nice))
        yield loads


def threads_run(clips: list[DeferredVideo], sessions: int, window: int, device: torch.device) -> Run:
    """`clips` on `sessions` threads of this process, a window at a time, with the GIL probe running.
    New threads, so new sessions, made under the variant's settings."""
    with concurrent.futures.ThreadPoolExecutor(sessions, thread_name_prefix="nvdec-scaling") as pool:
        list(pool.map(lambda data: read_one(data, device), clips[:sessions]))
        before = nvdec.CLOCK.seconds()
        with GilProbe() as probe:
            alone = probe.rate(0.5)
            turns, since = probe.turns, time.perf_counter()
            done = [r for start in range(0, len(clips), window) for r in pool.map(lambda data: read_one(data, device), clips[start : start + window])]
            wall = time.perf_counter() - since
            free = (probe.turns - turns) / wall / alone if alone else None
    feed = feed_per_clip(nvdec.CLOCK.since(before), len(done))
    return Run("threads", sessions, len(done), sum(v for _, v in done), wall, sum(s for s, _ in done), free, feed=feed)


def _process_main(paths: list[str], device: torch.device, variant: dict[str, bool], ready: multiprocessing.Barrier, out: multiprocessing.Queue) -> None:
    """One process of `processes_run`: its result, or what stopped it (which breaks the
    barrier, so the others stop too), on `out`."""
    try:
        out.put(_process_reads(paths, device, variant, ready))
    except Exception as exc:  # said by the parent, in the run's row
        ready.abort()
        out.put(repr(exc))


def _process_reads(paths: list[str], device: torch.device, variant: dict[str, bool], ready: multiprocessing.Barrier) -> tuple[float, float, float, float, int]:
    """(start, end, seconds the clips took, seconds of video, clips) of this process's share,
    read after its first clip (its session made) and the barrier."""
    for name in NVDEC_SETTINGS:
        setattr(nvdec, name, variant[name])
    if device.type == "cuda":
        torch.cuda.init()
    clips = [planned(Path(p).read_bytes(), variant.get("PACKETS_IN_WORKERS", False)) for p in paths]
    if clips:
        read_one(clips[0], device)
    ready.wait()
    start = time.time()
    done = [read_one(data, device) for data in clips]
    return start, time.time(), sum(s for s, _ in done), sum(v for _, v in done), len(done)


def processes_run(paths: list[Path], sessions: int, device: torch.device, variant: dict[str, bool]) -> Run:
    """`paths` split round-robin over `sessions` processes, timed from their common start
    to the last one's end; each process runs with the `variant`'s settings."""
    context = multiprocessing.get_context("spawn")
    ready, out = context.Barrier(sessions), context.Queue()
    shares = [[str(p) for p in paths[k::sessions]] for k in range(sessions)]
    workers = [context.Process(target=_process_main, args=(share, device, variant, ready, out)) for share in shares]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=PROCESS_SECONDS) for _ in workers]
    for worker in workers:
        worker.join()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(errors[0])
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    return Run("processes", sessions, sum(r[4] for r in results), sum(r[3] for r in results), end - start, sum(r[2] for r in results))


def render(runs: list[Run], device: str) -> str:
    """The table of the runs so far."""
    head = ["mode", "sessions", "clips", "video s", "seconds", "clips/s", "video s / s", "vs 1 session", "parallelism", "GIL free",
            "NVDEC busy; video / SM clock, power", "CPU load clips/s", *(f"{part} ms / clip" for part in FEED_PARTS)]
    # Each mode's (threads or processes, the variant and the load) own 1-session row is its reference.
    single = {r.mode: r.video_seconds / r.wall for r in runs if r.sessions == 1 and r.wall}
    rows = []
    for r in runs:
        if r.error is not None:
            rows.append([r.mode, r.sessions, f"FAILED: {r.error[:200]}"] + ["-"] * (len(head) - 3))
            continue
        rate = r.video_seconds / r.wall
        scaling = f"{rate / single[r.mode]:.2f}x" if r.mode in single else "-"
        rows.append([r.mode, r.sessions, r.clips, f"{r.video_seconds:.1f}", f"{r.wall:.2f}", f"{r.clips / r.wall:.2f}",
                     f"{rate:.1f}", scaling, f"{r.busy / r.wall:.2f}", fmt(r.gil_free, ".2f"), r.decoders, fmt(r.load_rate, ".1f"),
                     *(r.feed or ["-"] * len(FEED_PARTS))])
    lines = [f"# NVDEC alone, by sessions ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"device: {device}; torch {torch.__version__}; Python's switch interval {1000 * sys.getswitchinterval():g} ms; "
             f"command: {' '.join(sys.argv)}", ""]
    return "\n".join(lines + table(head, rows))


def clip_paths(args: argparse.Namespace) -> list[Path]:
    directory = REPO / "tests" / "data" if args.smoke else Path(args.clips)
    if args.smoke:
        return [directory / name for name in SMOKE_CLIPS]
    paths = sorted(p for p in directory.iterdir() if p.suffix in (".mp4", ".mov", ".mkv"))
    if not paths:
        raise SystemExit(f"--clips: no .mp4, .mov or .mkv in {directory}")
    return paths[: args.clips_limit] if args.clips_limit else paths


def main() -> int:
    args = parse_args()
    spread_device_queues()  # the job's 32 hardware queues: with 8 the load's stream may share the decode's
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    paths = clip_paths(args)
    log(SCRIPT, f"{len(paths)} clips from {paths[0].parent}")
    if args.smoke:
        skipped(SCRIPT, "NVDEC", "--smoke reads the clips with decord on the CPU instead")
    elif not torch.cuda.is_available():
        raise SystemExit("nvdec_scaling.py needs a CUDA device (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    name = "cpu, decord standing in for NVDEC" if args.smoke else torch.cuda.get_device_name(0)
    if not args.smoke:
        # Before decord, which the planning imports: the other way round, the process
        # crashed (an H100; each brings an FFmpeg of its own).
        import PyNvVideoCodec  # noqa: F401
    datas = [p.read_bytes() for p in paths]
    # Planned once: a plan with the cut is the plan without it, and the cut (tests/test_device_decode.py).
    cut = [planned(data, any(VARIANTS[v].get("PACKETS_IN_WORKERS", False) for v in args.variants)) for data in datas]
    plans = {True: cut, False: [replace(video, feed=None) for video in cut]}
    runs = []
    for variant in args.variants:
        for setting in NVDEC_SETTINGS:
            setattr(nvdec, setting, VARIANTS[variant][setting])
        clips = plans[VARIANTS[variant].get("PACKETS_IN_WORKERS", False)]
        # The python load holds this process's GIL, which only the threads share.
        freed = [("carveout", sms) for sms in args.load_carveout] + [("green context", sms) for sms in args.load_green]
        runs_wanted = [(m, n, load, nice, free) for load in args.loads for nice in (args.load_nice if load in ("cpu", "both") else [0])
                       for free in (freed if load in ("gpu", "both") else [("carveout", 0)])
                       for m in args.modes for n in args.sessions if not (load == "python" and m == "processes")]
        for mode, sessions, load, nice, (how, sms) in runs_wanted:
            try:
                with loaded(load, paths, args.load_workers, nice, device, args.python_busy, sms if how == "carveout" and sms else None,
                            sms if how != "carveout" else None) as loads, DecoderBusy() as busy:
                    run = threads_run(clips, sessions, args.window, device) if mode == "threads" else processes_run(paths, sessions, device, VARIANTS[variant])
                run.decoders = busy.describe()
                run.load_rate = loads.cpu.rate if loads.cpu is not None else None
            except Exception as exc:  # a variant the decoder refuses is a row, and the others still run
                run, loads = Run(mode, sessions, error=repr(exc)), Loads()
            said = LOAD_NAMES[load].format(workers=args.load_workers, nice=nice, busy=args.python_busy) if load != "none" else ""
            said += f" ({loads.gemm_tflops:.0f} TFLOP/s alone)" if loads.gemm_tflops is not None else ""
            said += f" leaving {sms} SMs free ({how})" if sms else ""
            run.mode = f"{mode}, {variant}" + (f", {said}" if said else "")
            runs.append(run)
            log(SCRIPT, f"{run.mode} x {sessions}: {run.error or f'{run.clips / run.wall:.2f} clips/s'}")
            # Printed after every run, so a call cut off by its limit keeps the rows before it.
            print(render(runs, name), flush=True)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="bench-data/clips", help="directory of the clips (video_decode.py --make-clips)")
    parser.add_argument("--clips-limit", type=int, default=128, help="read the first N clips (0: all)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 7, 14], help="decoder session counts")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="threads of one process, processes, or both")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                        help="the sessions on the library's default stream, on streams of their own, fed only the packets the samples need (a job's)")
    parser.add_argument("--window", type=int, default=256, help="clips the threads take at a time, as the job's windows (batching.window)")
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=["none"],
                        help="run each beside nothing, decord processes (cpu), bf16 products on the GPU (gpu) or both")
    parser.add_argument("--load-workers", type=int, default=16, help="decord processes of the cpu load (a job's runtime.workers)")
    parser.add_argument("--load-nice", type=int, nargs="+", default=[WORKER_NICE],
                        help="niceness the cpu load's processes add to their own, one run each (a job's workers: WORKER_NICE)")
    parser.add_argument("--load-carveout", type=int, nargs="+", default=[0],
                        help="SMs the gpu load's products leave free (torch's SM carveout), one run each "
                             "(0: none; a job's pipeline.GPU_DECODE_SM_CARVEOUT)")
    parser.add_argument("--load-green", type=int, nargs="*", default=[],
                        help="SMs the gpu load's products leave free in a green context (engine.green: every kernel, "
                             "not only cuBLAS's), one run each after the carveout's")
    parser.add_argument("--python-busy", type=float, default=0.5,
                        help="share of the time the python load's thread runs Python (the rest it sleeps)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="Python's thread switch interval for the runs, seconds (default: Python's 0.005), "
                             "as the job's pipeline.GPU_DECODE_SWITCH_INTERVAL sets it")
    parser.add_argument("--smoke", action="store_true", help="CPU only: the test clips, read by decord instead of NVDEC")
    args = parser.parse_args()
    if args.smoke and {"gpu", "both"} & set(args.loads):
        parser.error("--loads gpu and both need a GPU; --smoke runs on a CPU")
    if not 0 < args.python_busy < 1:
        parser.error("--python-busy is a share of the time: between 0 and 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
