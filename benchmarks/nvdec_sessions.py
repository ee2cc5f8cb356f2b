"""How NVDEC decoder sessions should be used: a new one per clip or one reconfigured.

On the GPU machine, with PyNvVideoCodec and decord installed, over the clips of
`benchmarks/video_decode.py` (1080p H.264, made with its `--make-clips`):

    PYTHONPATH=. python3 benchmarks/nvdec_sessions.py --clips bench-data/clips [--frames 14]

For each way it reads `--frames` evenly spaced frames of every clip (as RGB on the GPU,
each copied out of the decoder's surface) and prints one table: seconds per clip to make
or reconfigure the session and to read the frames. The ways: a new `SimpleDecoder` per
clip from its bytes (plain, with `bWaitForSessionWarmUp`, with `max_width/height`), one
decoder reconfigured per clip (`reconfigure_decoder` takes a path: the clip is written to
/dev/shm first), one decoder reading every frame of each clip, and decord on one core
reading the same sampled frames. This is what `embedjob.decode.nvdec.SESSIONS` and its
kept sessions rest on (benchmarks/RESULTS.md, "NVDEC video decode").
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def main() -> int:
    args = parse_args()
    try:
        import decord
        import PyNvVideoCodec as nvc
    except ImportError as exc:
        print(f"{exc}: this benchmark needs decord and PyNvVideoCodec (pip install 'embedjob[nvdec]')", file=sys.stderr)
        return 2

    warnings.simplefilter("ignore")  # the decoder warns about every in-memory clip over 8 MiB
    clips = [p.read_bytes() for p in sorted(Path(args.clips).glob("*.mp4"))]
    if not clips:
        print(f"no .mp4 clips in {args.clips}", file=sys.stderr)
        return 2
    torch.zeros(1, device="cuda")
    spill = tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    paths = []
    for k, data in enumerate(clips):
        path = Path(spill) / f"clip-{k}.mp4"
        path.write_bytes(data)
        paths.append(str(path))

    def sampled(count: int) -> list[int]:
        return [round(i * (count - 1) / max(args.frames - 1, 1)) for i in range(args.frames)]

    def read(decoder: object, indices: list[int]) -> None:
        for frame in decoder.get_batch_frames_by_index(indices):
            torch.from_dlpack(frame).clone()

    def fresh(**options: object) -> Callable[[int], tuple[float, float]]:
        def one(k: int) -> tuple[float, float]:
            since = time.perf_counter()
            decoder = nvc.SimpleDecoder(clips[k], gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.RGB, **options)
            made = time.perf_counter()
            read(decoder, sampled(len(decoder)))
            return made - since, time.perf_counter() - made
        return one

    held: list[object] = []

    def reconfigured(every_frame: bool) -> Callable[[int], tuple[float, float]]:
        def one(k: int) -> tuple[float, float]:
            since = time.perf_counter()
            if not held:
                held.append(nvc.SimpleDecoder(paths[k], gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.RGB))
            else:
                held[0].reconfigure_decoder(paths[k])
            made = time.perf_counter()
            decoder = held[0]
            if every_frame:
                decoder.get_batch_frames(len(decoder))
            else:
                read(decoder, sampled(len(decoder)))
            return made - since, time.perf_counter() - made
        return one

    def on_cpu(k: int) -> tuple[float, float]:
        since = time.perf_counter()
        reader = decord.VideoReader(io.BytesIO(clips[k]), ctx=decord.cpu(0), num_threads=1)
        made = time.perf_counter()
        reader.get_batch(sampled(len(reader))).asnumpy()
        return made - since, time.perf_counter() - made

    ways = [
        ("a new SimpleDecoder per clip, from bytes", fresh()),
        ("the same, bWaitForSessionWarmUp", fresh(bWaitForSessionWarmUp=True)),
        ("the same, max_width/height 1920x1080", fresh(max_width=1920, max_height=1080)),
        ("one decoder, reconfigure_decoder(path)", reconfigured(False)),
        ("one decoder, every frame of the clip", reconfigured(True)),
        ("decord, one core", on_cpu),
    ]
    rows = []
    for name, way in ways:
        held.clear()
        torch.cuda.synchronize()
        times = [way(k) for k in range(len(clips))]
        torch.cuda.synchronize()
        rows.append((name, sum(t[0] for t in times) / len(clips), sum(t[1] for t in times) / len(clips)))
    print(f"\n{len(clips)} clips from {args.clips}, {args.frames} sampled frames each; seconds per clip\n")
    print("| how | make / reconfigure s | read s |")
    print("| --- | ---: | ---: |")
    for name, made, reading in rows:
        print(f"| {name} | {made:.3f} | {reading:.3f} |")
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="bench-data/clips", help="directory of .mp4 clips")
    parser.add_argument("--frames", type=int, default=14, help="frames sampled per clip (7 s at 2 fps: 14)")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
