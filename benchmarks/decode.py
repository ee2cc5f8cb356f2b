"""Video decode throughput of embedjob.decode on real clips.

Decodes every video in ../shared/data/videos (fps 2, max_frames 32, frame_multiple 2,
as for Qwen2-VL) and prints a Markdown report:

- per video: frames decoded, seconds (best of --repeat), decoded frames per second,
  peak RSS while decoding it and the growth over the RSS before it;
- overall frames/s in this one process (decoder_threads=1, i.e. one worker's worth,
  and decoder_threads=0, FFmpeg's own threading), and with a DecodePool of N worker
  processes (default N = CPU count), with frames/s per worker.

Peak RSS per video uses Linux's /proc/self/clear_refs (reset the high-water mark)
and VmHWM; where that is unavailable the column shows the process-lifetime peak.

    python -m benchmarks.decode [--videos DIR] [--workers N] [--repeat R]   (from the repo root)
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path

from embedjob.decode import DecodedVideo, DecodeOptions, MediaError, decode, worker_preload
from embedjob.workers.pool import DecodePool

OPTIONS = DecodeOptions(modality="video", max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2, decoder_threads=1)
DEFAULT_VIDEOS = Path(__file__).resolve().parents[2] / "shared" / "data" / "videos"


@dataclass
class Row:
    name: str
    outcome: str
    frames: int
    seconds: float
    peak_mib: float
    growth_mib: float


def rss_mib(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def measure(path: Path, repeat: int) -> Row:
    data = path.read_bytes()
    before = rss_mib("VmRSS")
    reset_peak_rss()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            video = decode(data, OPTIONS)
        except MediaError as err:
            return Row(path.name, f"error {err.code}", 0, time.perf_counter() - start, rss_mib("VmHWM"), 0.0)
        best = min(best, time.perf_counter() - start)
    peak = rss_mib("VmHWM")
    assert isinstance(video, DecodedVideo)
    _, height, width, _ = video.frames.shape
    outcome = f"{width}x{height} of {video.source_frames} @ {video.source_fps:.1f}"
    return Row(path.name, outcome, video.frames.shape[0], best, peak, peak - before)


def single_process_rate(paths: list[Path], threads: int, repeat: int) -> float:
    options = replace(OPTIONS, decoder_threads=threads)
    blobs = [p.read_bytes() for p in paths]
    best = float("inf")
    frames = 0
    for _ in range(repeat):
        start = time.perf_counter()
        frames = sum(frame_count(decode_or_error(blob, options)) for blob in blobs)
        best = min(best, time.perf_counter() - start)
    return frames / best


def decode_or_error(blob: bytes, options: DecodeOptions) -> DecodedVideo | MediaError:
    try:
        result = decode(blob, options)
    except MediaError as err:
        return err
    assert isinstance(result, DecodedVideo)
    return result


def frame_count(result: object) -> int:
    return result.frames.shape[0] if isinstance(result, DecodedVideo) else 0


def pool_rate(paths: list[Path], workers: int, repeat: int) -> float:
    blobs = [p.read_bytes() for p in paths]
    fn = functools.partial(decode, options=OPTIONS)
    with DecodePool(fn, workers=workers, timeout=120, preload=worker_preload([]), error=MediaError) as pool:
        list(pool.imap(blobs))  # warm-up: workers started and their imports done
        start = time.perf_counter()
        frames = sum(frame_count(r) for r in pool.imap(blobs * repeat))
        return frames / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", type=Path, default=DEFAULT_VIDEOS)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    paths = sorted(p for p in args.videos.iterdir() if p.is_file())
    if not paths:
        raise SystemExit(f"no videos in {args.videos}")

    decode_or_error(paths[0].read_bytes(), OPTIONS)  # imports and first-use costs out of the timings
    rows = [measure(p, args.repeat) for p in paths]
    print("| video | result (WxH of N @ fps) | frames | seconds | frames/s | peak RSS MiB | +RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        rate = row.frames / row.seconds if row.frames else 0.0
        print(f"| {row.name} | {row.outcome} | {row.frames} | {row.seconds:.3f} | {rate:.0f} | {row.peak_mib:.0f} | {row.growth_mib:.0f} |")

    one = single_process_rate(paths, threads=1, repeat=args.repeat)
    auto = single_process_rate(paths, threads=0, repeat=args.repeat)
    pooled = pool_rate(paths, args.workers, args.repeat)
    print()
    print(f"CPU cores: {os.cpu_count()}; videos: {len(paths)}; frames per pass: {sum(r.frames for r in rows)}")
    print()
    print("| setup | frames/s | frames/s per worker |")
    print("| --- | ---: | ---: |")
    print(f"| one process, decoder_threads=1 | {one:.0f} | {one:.0f} |")
    print(f"| one process, decoder_threads=0 (FFmpeg threads) | {auto:.0f} | - |")
    print(f"| DecodePool, {args.workers} workers, decoder_threads=1 | {pooled:.0f} | {pooled / args.workers:.0f} |")


if __name__ == "__main__":
    main()
