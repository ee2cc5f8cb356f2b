"""Video decode: seconds of 1080p video embedded per second with `video.decoder` decord, nvdec and auto (RESULTS.md section 11).

Two steps. Make the clips from real photos, on any machine with `pip install
imageio-ffmpeg` (its FFmpeg has libx264; the H200 has no video encoder of its own), one
process per core:

    python3 benchmarks/video_decode.py --make-clips bench-data/clips --photos bench-data [--count 8]

Each clip is its own slow pan and zoom across one photo (a random start and end window
of the photo, 1920 x 1080, `--seconds` 7 s at 30 fps), H.264 in MP4 by libx264 at CRF 18
with one GOP per clip. Then on the GPU machine (with PyNvVideoCodec installed for `nvdec`):

    PYTHONPATH=. python3 benchmarks/video_decode.py --clips bench-data/clips [--tower siglip] [--decoders decord auto]

It writes the clips into a Parquet file, measures the encoder-only rate of their items
(`benchmarks/encoder_only.py`: `--tower`, the scaling benchmark's Qwen2.5-VL-7B-,
SigLIP-so400m-384- or CLIP-L/14-336-size tower, bf16, compiled, graphs; 2 frames per
second, at most 32 frames), then runs `embedjob run --gpus 1` on them once per
`--decoders` setting (decord first; `--repeats` times each, the median run's row shown): `decord` and `auto` with `--workers` decode
processes, `nvdec` with `--nvdec-workers`, once per `--nvdec-sessions` count of decoder
sessions, `auto` at the count whose nvdec run was fastest; then each `--variants` run, on a copy of
the package with module constants rewritten, e.g. `auto:embedjob.decode.nvdec.FEED_SAMPLED=False`,
and/or with job settings, e.g. `auto:runtime.workers=12`),
and prints one table, saved
again after every run (a run cut off keeps the rows before it): seconds of video
embedded per second of pipeline (the clips' durations over `pipeline_seconds`), clips
per second, that over the encoder-only rate, the same past the head start (the clips after
the first two windows, which the workers may have decoded while the rank set up:
`common.past_head_start`; the figure for a job bound by decoding, on 1,000 clips or more), the clips the GPU decoded, the workers' and
the GPU-decode thread's seconds, the per-clip cosine of each other run's embeddings to
the decord run's (min and median), how busy NVML saw the NVDEC engines, with the video
and SM clocks and the board's power (`common.DecoderBusy`), the GPU decoder threads' milliseconds per clip by part (whole
clip, `Decode` calls, surfaces taken, copies, NV12 conversion: `nvdec.CLOCK`, as
`nvdec_scaling.py` shows them alone), the caching allocator's driver calls while the GPU
decoded (`device_allocations`), and what the rank's main thread waited for (its
`waits`, in seconds), then each GPU setting's four clips furthest from decord's vectors
(clip names say codec, height and keyframe interval). The table is written to
`<workdir>/video_decode.md` and printed. `--profile auto` (or nvdec, decord) runs those
jobs under cProfile (`common.PROFILED_CLI`) and logs where the process's time went, for a
missed target's evidence: the rank's threads, not the decode workers. `--tiny-tower` embeds
with the tower's tiny version on the GPU: the job's decoders then read with next to nothing
else on the device, which says whether the encoder beside them is what slows NVDEC in a job.
`--smoke` runs it on the CPU with the tiny tower on a few of the test clips when
`--clips` has none, 2 workers, and skips the nvdec run (it needs a GPU), saying so
(`auto` there decodes with decord, as on any machine without a video decoder).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
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
    NO_MULTICAST, DecoderBusy, collect_photos, cosine, feed_per_clip, fmt, past_head_start, profile_summary, rank0, run_cli, skipped,
    table_row,
)
from benchmarks.common import log as _log  # noqa: E402
from benchmarks.encoder_only import EncoderOnly, measure  # noqa: E402
from benchmarks.gpu_decode import compare  # noqa: E402
from benchmarks.mixes import TOWERS, save_tower  # noqa: E402
from embedjob.config import DEFAULT_NVDEC_SESSIONS, load_job  # noqa: E402
from embedjob.decode.nvdec import DecoderClock  # noqa: E402
from embedjob.pipeline import ALLOCATOR_COUNTS  # noqa: E402

FPS = 30
SIZE = (1920, 1080)
DECODERS = ("decord", "nvdec", "auto")


def main() -> int:
    args = parse_args()
    if args.make_clips:
        make_clips(Path(args.make_clips), collect_photos(args.photos), args.count, args.seconds, args.seed, args.kinds)
        return 0
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    workdir = Path(args.workdir).resolve()
    clips = Path(args.clips)
    if args.smoke and not clips.is_dir():
        clips = smoke_clips(workdir / "clips")
    parquet, seconds = clips_parquet(clips, workdir)
    job = write_job(workdir, parquet, args.smoke, args.tower, args.tiny_tower)
    device = torch.device("cpu" if args.smoke else "cuda")
    log(f"[video] encoder only on {parquet}")
    encoder = measure(load_job(job, []), device, len(os.sched_getaffinity(0)), 3)
    runs: dict[str, dict[str, Any] | None] = {}
    plans: dict[str, Planned] = {}
    decord: pa.Table | None = None
    compared: dict[str, tuple[tuple[bool, np.ndarray, int], str]] = {}
    text = ""
    for plan in planned_runs(args, runs):
        label = plan.label
        plans[label] = plan
        if plan.decoder == "nvdec" and args.smoke:
            skipped("video_decode", "the nvdec run", "NVDEC needs a CUDA device")
            runs[label] = None
            continue
        output = workdir / f"out-{len(plans)}"
        overrides = [f"{key}={value}" for key, value in _settings(args, plan).items()]
        tree = patched_tree(plan.constants, workdir / f"tree-{len(plans)}") if plan.constants else REPO
        profile = workdir / "logs" / f"run-{len(plans)}.prof" if plan.decoder in args.profile else None
        runs[label] = repeated(plan, args.repeats, lambda repeat: run_cli(
            job, output, 1, overrides, workdir / "logs" / f"run-{len(plans)}{'' if repeat == 0 else f'-{repeat + 1}'}.log", tree,
            profile if repeat == 0 else None))
        if profile is not None and profile.is_file():
            log(f"[video] {label}: cProfile of the job's process (run under it, so slower than the table's other runs):\n"
                f"{profile_summary(profile)}")
        if runs[label] is not None:
            table = pq.read_table(sorted(output.glob("part-*.parquet")))
            if label == "decord":
                decord = table
            elif decord is not None:
                compared[label] = (compare(decord, table), worst_clips(decord, table))
        log(f"[video] {label}: {'done' if runs[label] else 'FAILED'}")
        # Saved after every run, so a call cut off by its limit keeps the rows it finished.
        text = report(workdir, seconds, encoder, runs, plans, compared, args)
        log(f"[video] the table so far:\n{text}")
    print(text, flush=True)
    return 0


def repeated(plan: Planned, repeats: int, run: Callable[[int], dict[str, Any] | None]) -> dict[str, Any] | None:
    """`run` (its argument the repeat, from 0) `repeats` times, the plan's job each time:
    the statistics of the run with the median pipeline seconds (the lower middle of an even
    count), or None if any failed; `plan` keeps every run's pipeline seconds and NVML's
    view of the decoders in the median one. One run of a variant says little: two nvdec
    runs of one tree on 128 clips read 29.6 and 30.2 clips a second."""
    done = []
    for repeat in range(repeats):
        with DecoderBusy() as busy:
            stats = run(repeat)
        if stats is None:
            plan.seconds = []
            return None
        done.append((stats["pipeline_seconds"], repeat, stats, busy.describe()))
    plan.seconds = [seconds for seconds, *_ in done]
    _, _, stats, plan.decoders = sorted(done)[(len(done) - 1) // 2]
    return stats


@dataclass
class Planned:
    """One run of the job: its decoder, its NVDEC sessions, the module constants its copy of
    the tree has rewritten (`--variants`), and, from `repeated`, how busy NVML saw the NVDEC
    engines in the median run and each run's pipeline seconds."""

    decoder: str
    sessions: int
    patches: tuple[tuple[str, str], ...] = ()
    """(module.NAME, value) pairs of `embedjob` constants, and (section.key, value) job settings."""
    decoders: str = "-"
    seconds: list[float] = field(default_factory=list)

    @property
    def constants(self) -> tuple[tuple[str, str], ...]:
        """The patches that rewrite `embedjob` module constants (`patched_tree`)."""
        return tuple(p for p in self.patches if p[0].startswith("embedjob."))

    @property
    def settings(self) -> tuple[tuple[str, str], ...]:
        """The patches that are job settings (`--set`), over the run's own (`_settings`)."""
        return tuple(p for p in self.patches if not p[0].startswith("embedjob."))

    @property
    def label(self) -> str:
        base = "decord" if self.decoder == "decord" else f"{self.decoder}-{self.sessions}"
        return base + "".join(f" {name}={value}" for name, value in self.patches)


def planned_runs(args: argparse.Namespace, runs: dict[str, dict[str, Any] | None]) -> Iterator[Planned]:
    """Each run, in order: decord, nvdec once per `--nvdec-sessions` count, then auto at the
    count whose nvdec run was fastest (the first count when none ran), then each of
    `--variants` (auto's and nvdec's at that count too). `runs` fills as they end: the later
    runs read it."""
    for decoder in args.decoders:
        if decoder == "decord":
            yield Planned(decoder, args.nvdec_sessions[0])
        elif decoder == "nvdec":
            for sessions in args.nvdec_sessions:
                yield Planned(decoder, sessions)
        else:
            yield Planned(decoder, fastest_sessions(args, runs))
    for decoder, patches in args.variants:
        yield Planned(decoder, args.nvdec_sessions[0] if decoder == "decord" else fastest_sessions(args, runs), patches)


def parse_variant(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """`--variants` item "DECODER:NAME=VALUE[,NAME=VALUE]" as (decoder, patches): each NAME
    an `embedjob.module.CONSTANT` or a job setting (`runtime.workers`)."""
    decoder, _, rest = text.partition(":")
    patches = tuple(tuple(item.split("=", 1)) for item in rest.split(",") if item)
    if decoder not in DECODERS or not patches or any(len(p) != 2 or "." not in p[0] for p in patches):
        raise argparse.ArgumentTypeError(f"{text!r}: want DECODER:NAME=VALUE[,...] with DECODER one of {', '.join(DECODERS)} "
                                         "and each NAME embedjob.module.CONSTANT or a job setting such as runtime.workers")
    return decoder, patches  # type: ignore[return-value]


def patched_tree(patches: tuple[tuple[str, str], ...], directory: Path) -> Path:
    """A copy of the repository's `embedjob` package in `directory` with each patched module's
    `NAME = ...` line (exactly one, at the start of a line) rewritten to `NAME = VALUE`: a
    constant A/B'd in the job's own processes, its decode workers included (they import the
    package afresh, so a patch made in this process would not reach them)."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(REPO / "embedjob", directory / "embedjob", ignore=shutil.ignore_patterns("__pycache__"))
    for name, value in patches:
        module, _, constant = name.rpartition(".")
        path = directory.joinpath(*module.split(".")).with_suffix(".py")
        if not path.is_file():
            raise SystemExit(f"--variants: no module {module} ({path})")
        source, count = re.subn(rf"^{re.escape(constant)}( *:[^=]*)? = .*$", f"{constant} = {value}", path.read_text(), flags=re.M)
        if count != 1:
            raise SystemExit(f"--variants: {module} has {count} lines assigning {constant}, not one")
        path.write_text(source)
    return directory


def fastest_sessions(args: argparse.Namespace, runs: dict[str, dict[str, Any] | None]) -> int:
    """The `--nvdec-sessions` count whose nvdec run had the shortest pipeline (the first without one)."""
    timed = [(stats["pipeline_seconds"], sessions) for sessions in args.nvdec_sessions
             if (stats := runs.get(f"nvdec-{sessions}")) and stats.get("pipeline_seconds")]
    return min(timed)[1] if timed else args.nvdec_sessions[0]


def report(workdir: Path, seconds: float, encoder: EncoderOnly, runs: dict[str, dict[str, Any] | None], plans: dict[str, Planned],
           compared: dict[str, tuple[tuple[bool, np.ndarray, int], str]], args: argparse.Namespace) -> str:
    """The table of the runs so far (`compared`: each GPU run's comparison with decord's
    rows and its clips furthest from decord's vectors), also written to
    `<workdir>/video_decode.md`."""
    text = render(seconds, encoder, runs, plans, {label: cosines for label, (cosines, _) in compared.items()}, args)
    text += "".join(f"\nlowest cosines to decord, {label}: {worst}" for label, (_, worst) in compared.items())
    (workdir / "video_decode.md").write_text(text + "\n")
    return text


def log(message: str) -> None:
    """Progress on stderr."""
    _log("video_decode", message)


SMOKE_CLIPS = ("decord_video_0.mov", "torchcodec_h265_video.mp4")
"""Test clips decord reads, for `--smoke` without clips of 1080p."""


def smoke_clips(directory: Path) -> Path:
    """A directory of a few of the repository's test clips."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SMOKE_CLIPS:
        shutil.copyfile(REPO / "tests" / "data" / name, directory / name)
    return directory


# --- the clips --------------------------------------------------------------------------


KINDS = [(codec, size, gop) for gop in (1, 2, 4, 8) for size in ((1920, 1080), (1280, 720)) for codec in ("libx264", "libx265")]
"""`--kinds mixed`: clip k is KINDS[k % 16]: H.264 or HEVC, 1080p (`--seconds`) or 720p
(three quarters of it), a keyframe every 1, 2, 4 or 8 s."""


def make_clips(directory: Path, photos: list[Any], count: int, seconds: float, seed: int, kinds: str = "h264-1080p") -> None:
    """`count` clips, each a pan and zoom over its own photo (see the module docstring),
    made by as many processes as there are cores: all 1080p H.264 of one GOP, or with
    `kinds` "mixed" the codecs, sizes and GOPs of `KINDS` in turn. Clips already in
    `directory` are kept (each is written under another name and renamed when whole), so
    a run cut short is topped up by the next with the same arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    usable = [p.data for p in photos if _opens(p.data)]
    if not usable:
        raise SystemExit("no readable photo in --photos")
    rng = np.random.default_rng(seed)
    jobs = []
    for k in range(count):
        photo = usable[k % len(usable)]
        size = _photo_size(photo)
        codec, frame, gop = KINDS[k % len(KINDS)] if kinds == "mixed" else ("libx264", SIZE, None)
        length = seconds if frame == SIZE else 0.75 * seconds
        name = f"clip-{k:04d}-{codec.removeprefix('lib').replace('x26', 'h26')}-{frame[1]}p{f'-gop{gop}s' if gop else ''}.mp4"
        jobs.append(ClipJob(directory / name, photo, _window(size, rng), _window(size, rng), round(length * FPS), codec, frame, gop))
    jobs = [job for job in jobs if not job.path.exists()]
    if not jobs:
        return
    processes = min(len(jobs), len(os.sched_getaffinity(0)))
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        for path in pool.imap(make_clip, jobs):
            log(f"made {path} ({path.stat().st_size / 1e6:.1f} MB)")


@dataclass
class ClipJob:
    """One clip to make: a pan from the `start` to the `end` window of `photo` (bytes)."""

    path: Path
    photo: bytes
    start: tuple[float, float, float, float]
    end: tuple[float, float, float, float]
    frames: int
    codec: str = "libx264"
    size: tuple[int, int] = SIZE
    gop: int | None = None
    """Seconds between keyframes; None: the encoder's default (one GOP for these clips)."""


def make_clip(job: ClipJob) -> Path:
    from PIL import Image

    photo = Image.open(io.BytesIO(job.photo)).convert("RGB")
    partial = job.path.with_name(job.path.name + ".part")
    writer = ClipWriter(partial, job.codec, job.size, job.gop)
    for f in range(job.frames):
        t = f / max(job.frames - 1, 1)
        box = tuple(a + (b - a) * t for a, b in zip(job.start, job.end))
        writer.send(np.asarray(photo.resize(job.size, Image.Resampling.BILINEAR, box=box)))
    writer.close()
    partial.rename(job.path)
    return job.path


class ClipWriter:
    """libx264 or libx265 (imageio-ffmpeg's FFmpeg; IMAGEIO_FFMPEG_EXE names another),
    CRF 18, a keyframe every `gop` seconds or the encoder's default (keyint 250: one GOP
    per clip)."""

    def __init__(self, path: Path, codec: str = "libx264", size: tuple[int, int] = SIZE, gop: int | None = None) -> None:
        import imageio_ffmpeg

        keyframes = ["-g", str(gop * FPS)] if gop else []
        tag = ["-tag:v", "hvc1"] if codec == "libx265" else []
        quiet = ["-x265-params", "log-level=error"] if codec == "libx265" else []
        self.writer = imageio_ffmpeg.write_frames(
            str(path), size, fps=FPS, codec=codec, pix_fmt_out="yuv420p", macro_block_size=1,
            output_params=["-crf", "18", "-preset", "veryfast", *keyframes, *tag, *quiet, "-f", "mp4"],
        )
        self.writer.send(None)

    def send(self, rgb: np.ndarray) -> None:
        self.writer.send(rgb.tobytes())

    def close(self) -> None:
        self.writer.close()


def _photo_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(data)).size


def _opens(data: bytes) -> bool:
    from PIL import Image

    try:
        Image.open(io.BytesIO(data)).verify()
    except Exception:
        return False
    return True


def _window(size: tuple[int, int], rng: np.random.Generator) -> tuple[float, float, float, float]:
    """A 16:9 window of 50-100 % of the photo's width (or the largest 16:9 that fits)."""
    width, height = size
    w = min(width, height * SIZE[0] / SIZE[1]) * rng.uniform(0.5, 1.0)
    h = w * SIZE[1] / SIZE[0]
    left, top = rng.uniform(0, width - w), rng.uniform(0, height - h)
    return left, top, left + w, top + h


def clips_parquet(directory: Path, workdir: Path) -> tuple[Path, float]:
    """The clips of `directory` as one Parquet file (`video`: their bytes) and their total
    seconds (frames over frame rate, as decord reads them)."""
    import decord

    paths = sorted(p for p in directory.iterdir() if p.suffix in (".mp4", ".mov", ".mkv"))
    if not paths:
        raise SystemExit(f"--clips: no .mp4, .mov or .mkv in {directory}")
    seconds = 0.0
    for path in paths:
        reader = decord.VideoReader(str(path))
        seconds += len(reader) / float(reader.get_avg_fps())
    megabits = sum(p.stat().st_size for p in paths) * 8 / 1e6
    log(f"{len(paths)} clips, {seconds:.1f} s of video, {megabits / seconds:.1f} Mbit/s on average")
    workdir.mkdir(parents=True, exist_ok=True)
    parquet = workdir / "clips.parquet"
    pq.write_table(pa.table({"video": [p.read_bytes() for p in paths], "id": [p.name for p in paths]}), parquet, row_group_size=4)
    return parquet, seconds


def write_job(workdir: Path, parquet: Path, smoke: bool, name: str = "qwen", tiny: bool = False) -> Path:
    """The job every run starts from: `name`'s tower at its published size, or its tiny
    version (`smoke` or `tiny`), on the GPU unless `smoke`."""
    import yaml

    tower = save_tower(TOWERS[name], workdir / "towers", smoke or tiny)
    job = {
        "input": {"path": str(parquet), "media_column": "video", "id_column": "id", "modality": "video"},
        "model": {"family": TOWERS[name].family, "path": str(tower), "dtype": "bfloat16"},
        "video": {"fps": 2.0, "max_frames": 32},
        "output": {"path": str(workdir / "out"), "rows_per_part": 100_000},
        "batching": {"compile": not smoke},
        "runtime": {"device": "cpu" if smoke else "cuda", "progress": False, "cache_dir": str(workdir / "cache")},
    }
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


# --- the table --------------------------------------------------------------------------


def render(
    seconds: float, encoder: EncoderOnly, runs: dict[str, dict[str, Any] | None], plans: dict[str, Planned],
    cosines: dict[str, tuple[bool, np.ndarray, int]], args: argparse.Namespace,
) -> str:
    head = ["decoder", "workers", "clips", "video s", "pipeline s", "video s / s", "clips/s", "/ enc.-only",
            "past the head start: / enc.-only", "GPU-decoded", "worker decode s", "GPU-decode thread s", "cos min", "cos median", "rows identical",
            "NVDEC busy; video / SM clock, power", f"GPU decoder ms / clip: {', '.join(DecoderClock.PARTS)}",
            f"allocator while the GPU decoded: {', '.join(ALLOCATOR_COUNTS.values())}", "main thread's waits s"]
    lines = [
        f"# video.decoder: {', '.join(args.decoders)} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}; torch {torch.__version__}; "
        f"tower: {TOWERS[args.tower].describe(args.smoke or args.tiny_tower)}; command: {' '.join(sys.argv)}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |",
        table_row(["encoder only", "-", encoder.items, f"{seconds:.1f}", f"{encoder.seconds:.2f}", f"{seconds / encoder.seconds:.1f}",
              f"{encoder.rate:.2f}"] + ["-"] * (len(head) - 7)),
    ]
    for label, stats in runs.items():
        plan = plans[label]
        decoder, sessions = plan.decoder, plan.sessions
        workers = _settings(args, plan)["runtime.workers"]
        if stats is None:
            said = "skipped (needs a GPU)" if args.smoke and decoder == "nvdec" else "FAILED"
            lines.append(table_row([label, workers, said] + ["-"] * (len(head) - 3)))
            continue
        pipeline = stats["pipeline_seconds"]
        rate = stats["rows"] / pipeline if pipeline else None
        compared = cosines.get(label)
        cos = compared[1] if compared is not None and len(compared[1]) else None
        first = rank0(stats)
        name = decoder if decoder == "decord" else f"{decoder} ({sessions} sessions)"
        if decoder == "auto" and first.get("gpu_share") is not None:
            name = f"auto ({sessions} sessions, last GPU share {first['gpu_share']:.2f})"
        name += "".join(f", {patch}={value}" for patch, value in plan.patches)
        lines.append(table_row([
            name, workers, stats["rows"], f"{seconds:.1f}", _pipeline_seconds(pipeline, plan.seconds),
            fmt(seconds / pipeline if pipeline else None, ".1f"),
            fmt(rate, ".2f"), fmt(rate / encoder.rate if rate else None, ".3f"), _past_head_start(stats, encoder),
            stats.get("device_decoded", "-"),
            fmt(first.get("decode_seconds"), ".1f"), fmt(first.get("device_decode_seconds"), ".2f"),
            fmt(cos.min() if cos is not None else None, ".5f"), fmt(float(np.median(cos)) if cos is not None else None, ".5f"),
            "-" if compared is None else ("yes" if compared[0] else "NO"),
            plan.decoders, _decoder_parts(first), _allocations(first), _waits(first),
        ]))
    return "\n".join(lines)


def worst_clips(decord: pa.Table, other: pa.Table, count: int = 4) -> str:
    """The `count` clips whose vectors are furthest from decord's (by cosine), with their
    names, which say codec, height and keyframe interval: where a decoder departs."""
    pairs = [(name, x, y) for name, x, y in zip(decord.column("id").to_pylist(), decord.column("embedding").to_pylist(),
                                                  other.column("embedding").to_pylist()) if x is not None and y is not None]
    if not pairs:
        return "none"
    names, a, b = zip(*pairs)
    cos = cosine(np.array(a), np.array(b))
    order = [k for k in np.argsort(cos) if np.isfinite(cos[k])][:count]
    return ", ".join(f"{names[k]} {cos[k]:.5f}" for k in order) or "none"


def _settings(args: argparse.Namespace, plan: Planned) -> dict[str, str]:
    """The job settings of a run, each once: its decode processes (`--nvdec-workers` for
    nvdec, `--workers` for the others), decoder and sessions, then its variant's, which win."""
    workers = args.nvdec_workers if plan.decoder == "nvdec" else args.workers
    own = {"runtime.workers": str(workers), "video.decoder": plan.decoder, "video.nvdec_sessions": str(plan.sessions)}
    return {**own, **dict(plan.settings)}


def _pipeline_seconds(median: float | None, each: list[float]) -> str:
    """The median run's pipeline seconds, with the spread of all where there were several:
    "4.32 (3 runs, 4.12-4.50)"."""
    if len(each) < 2:
        return fmt(median, ".2f")
    return f"{fmt(median, '.2f')} ({len(each)} runs, {min(each):.2f}-{max(each):.2f})"


def _past_head_start(stats: dict[str, Any], encoder: EncoderOnly) -> str:
    """The run's clips per second after the rows its workers could have decoded during setup
    (`common.past_head_start`), over the encoder-only rate, with the clips it counts."""
    past = past_head_start(stats)
    if past is None:
        return "- (too few clips)"
    rows, seconds = past
    return f"{rows / seconds / encoder.rate:.3f} ({rows} clips)"


def _decoder_parts(rank: dict[str, Any]) -> str:
    """The GPU decoder threads' milliseconds per clip they decoded by part (`common.feed_per_clip`):
    set beside `nvdec_scaling.py`'s alone, a part that grew in the job names what the job takes
    from the decoder; "-" where the GPU fed it nothing."""
    ms = feed_per_clip(rank.get("device_decode_parts") or {}, rank.get("device_decoded") or 0)
    return ", ".join(ms) if ms else "-"


def _allocations(rank: dict[str, Any]) -> str:
    """The caching allocator's driver calls while the rank's GPU decoded
    (`device_allocations`, in `pipeline.ALLOCATOR_COUNTS`' order): allocations and frees
    that stall the decode thread where the job takes more memory than its heap holds, and
    the retries and syncs that stall the device; "-" where its GPU decoded nothing."""
    counts = rank.get("device_allocations") or {}
    return ", ".join(str(counts.get(name, 0)) for name in ALLOCATOR_COUNTS.values()) if counts else "-"


def _waits(rank: dict[str, Any]) -> str:
    """The rank's main-thread waits over 0.05 s, largest first: what the pipeline's
    seconds went to besides its own work."""
    waits = sorted(((s, name) for name, s in (rank.get("waits") or {}).items() if s >= 0.05), reverse=True)
    return "; ".join(f"{name} {s:.2f}" for s, name in waits) or "-"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-clips", metavar="DIR", help="make the clips into DIR and stop")
    parser.add_argument("--photos", nargs="+", type=Path, default=[], help="photos the clips are made from")
    parser.add_argument("--count", type=int, default=8, help="clips to make")
    parser.add_argument("--seconds", type=float, default=7.0, help="seconds per clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", choices=["h264-1080p", "mixed"], default="h264-1080p",
                        help="the clips made: 1080p H.264 of one GOP, or H.264 and HEVC, 1080p and 720p, keyframes every 1-8 s (KINDS)")
    parser.add_argument("--clips", default="bench-data/clips", help="directory of the clips to embed")
    parser.add_argument("--workers", type=int, help="runtime.workers of the decord run (16; 2 with --smoke)")
    parser.add_argument("--nvdec-workers", type=int, default=4, help="runtime.workers of the nvdec run")
    parser.add_argument("--nvdec-sessions", type=int, nargs="+", default=[DEFAULT_NVDEC_SESSIONS],
                        help="video.nvdec_sessions: an nvdec run at each count, auto at the fastest's")
    parser.add_argument("--tower", choices=sorted(TOWERS), default="qwen", help="the vision tower, at its published size (qwen: Qwen2.5-VL-7B)")
    parser.add_argument("--tiny-tower", action="store_true",
                        help="the tower's tiny version on the GPU: the decoders read in the job with next to nothing "
                             "else on the device, against what they read beside the published size's encoder")
    parser.add_argument("--decoders", nargs="+", choices=DECODERS, default=list(DECODERS),
                        help="video.decoder settings to run, decord first (auto: decord and NVDEC in the shares the rank measures); "
                             "the cosines are to decord's run, so they need it")
    parser.add_argument("--variants", nargs="+", type=parse_variant, default=[], metavar="DECODER:NAME=VALUE",
                        help="more runs, after --decoders', each on a copy of the tree with module constants rewritten "
                             "(e.g. auto:embedjob.decode.video.PACKETS_IN_WORKERS=False) and/or with job settings "
                             "(e.g. auto:runtime.workers=12)")
    parser.add_argument("--profile", nargs="+", choices=DECODERS, default=[], metavar="DECODER",
                        help="run these decoders' jobs (their --variants too) under cProfile and log what the job's process "
                             "spent its time on (the profile itself beside the run's log)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each job; its row is the median run's, its pipeline seconds with the spread")
    parser.add_argument("--workdir", default="video-decode-work")
    parser.add_argument("--smoke", action="store_true", help="CPU only: the tiny tower, test clips where --clips has none")
    args = parser.parse_args()
    args.workers = args.workers or (2 if args.smoke else 16)
    args.decoders = sorted(dict.fromkeys(args.decoders), key=DECODERS.index)
    return args


if __name__ == "__main__":
    sys.exit(main())
