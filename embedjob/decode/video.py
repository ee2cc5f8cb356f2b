"""Video decode: bytes to sampled `(T, H, W, 3)` uint8 RGB frames, with decord 0.6.0 (FFmpeg 4.1 inside).

- Only the sampled frames are decoded, at most `_BATCH_FRAMES` at a time. The frame count
  follows the Qwen2-VL rule (`sample_frame_indices`); a variable-frame-rate clip is
  sampled evenly in time.
- Decoded pixels are bounded before the sampled frames are decoded (`too_large`): the
  frame size declared by the container (`containers`) is checked before decord opens the
  stream, and the size of the first sampled frame, decoded alone, before the others
  (which covers the formats we do not parse and a header that lies); the frames of the
  whole sample have a total cap too.
- MP4/MOV display matrices (rotation, mirroring) are applied here: decord's CPU reader
  turns multiples of 90 degrees itself but ignores mirroring, so the matrix is reset in
  the bytes handed to decord and the whole matrix applied to the decoded frames (same
  pixels as decord's rotation). Matroska/AVI carry no such matrix for FFmpeg 4.1. Files
  with several video tracks decode the first one (the others are hidden from decord).
- A truncated container whose surviving part decord can index decodes to the frames that
  are there (the original frames, bit for bit); one cut before its index is `truncated`,
  and so is a Matroska file missing more than a tenth of its declared duration. A frame
  that cannot be decoded is an error (`corrupt`), never a substituted frame.
- FFmpeg states the actual reason for a failure only on stderr: it is captured
  (`_StderrCapture`) into the error message.
- decord is imported only when a video is decoded (see `_decord`).

See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedjob.decode.bitstream import DecoderConfig, decoder_config
from embedjob.decode.containers import (
    MATROSKA_HEAD,
    Matrix,
    Mp4Facts,
    Mp4Samples,
    matroska_cut_span,
    matroska_duration,
    matroska_frame_size,
    mp4_facts,
    mp4_samples,
    mp4_with_samples,
    patched,
)
from embedjob.decode.gop import (
    PacketFeed,
    Picture,
    needed_pictures,
    packet_feed,
    prefixed_units,
    sample_pictures,
    shown_at,
)
from embedjob.decode.sniff import sniff_format
from embedjob.decode.types import DecodedVideo, DecodeOptions, DeferredVideo, MediaError, last_line

logger = logging.getLogger(__name__)

# FFmpeg's AVERROR_DECODER_NOT_FOUND and AVERROR_STREAM_NOT_FOUND, as decord prints them
# when av_find_best_stream fails: the way to tell "no decoder" from "no video stream".
_FFMPEG_DECODER_NOT_FOUND = "-1128613112"
_FFMPEG_STREAM_NOT_FOUND = "-1381258232"
_FFMPEG_NO_PIXEL_FORMAT = 'Unable to parse option value "-1" as pixel format'
_FFMPEG_TRUNCATION_WORDS = ("end of file", "ended prematurely", "truncat", "partial file")
_BATCH_FRAMES = 8


def sample_frame_indices(num_frames: int, source_fps: float, fps: float, max_frames: int, frame_multiple: int) -> list[int]:
    """Frame indices to decode: `fps` frames per second of video, uniform over the
    clip, starting at frame 0.

    The rule is Qwen2-VL's (transformers' `Qwen2VLVideoProcessor.sample_frames`):
    count = duration * fps, clamped to [1, min(max_frames, num_frames)], then rounded
    DOWN to a multiple of `frame_multiple`; index k = floor(k * num_frames / count).
    transformers clamps to its `min_frames` (4) instead of 1, and when the rounding
    leaves 0 frames (a clip shorter than `frame_multiple`) it fails with a division
    by zero; its patchify step pads a count that is not a multiple of the temporal
    patch size by repeating the last frame. We keep at least `frame_multiple` frames:
    if rounding leaves none we take `frame_multiple` frames, and a clip with fewer
    frames than that repeats its last frame, like transformers' padding. Indices use
    integer arithmetic: transformers' float `arange` sometimes returns one index too
    many, equal to num_frames (e.g. 300 frames at 10 fps sampled at 0.5 fps).

    Invariants: len >= frame_multiple, len % frame_multiple == 0,
    len <= max(max_frames, frame_multiple), indices ascending in [0, num_frames).
    An unknown frame rate (source_fps <= 0 or not finite) means an unknown duration:
    the count is then the cap.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if frame_multiple < 1 or max_frames < 1:
        raise ValueError(f"max_frames and frame_multiple must be >= 1, got {max_frames}, {frame_multiple}")
    cap = min(max_frames, num_frames)
    wanted = num_frames / source_fps * fps if source_fps > 0 and math.isfinite(source_fps) else cap
    count = math.floor(min(max(wanted, 1), cap) / frame_multiple) * frame_multiple
    if count == 0:
        count = min(frame_multiple, num_frames)
    indices = [k * num_frames // count for k in range(count)]
    indices += [indices[-1]] * (-len(indices) % frame_multiple)
    return indices


class _StderrCapture:
    """While active, file descriptor 2 goes to a temporary file.

    FFmpeg and decord state the actual reason for a failure ("Invalid NAL unit size",
    "End of file") only on stderr. Capturing it lets the error row carry the reason
    and keeps a job's stderr free of per-file decoder chatter. It is process-wide:
    other threads' stderr output during the window is captured too (decode workers
    have no other threads). If fd 2 cannot be duplicated, nothing is captured.
    """

    def __enter__(self) -> _StderrCapture:
        self._sink = tempfile.TemporaryFile()
        self._saved: int | None = None
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:
            return self
        os.dup2(self._sink.fileno(), 2)
        self._saved = saved
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.stderr.flush()
        if self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        self._sink.close()

    def lines(self) -> list[str]:
        """Distinct captured lines, in order, without decord's time/source prefixes
        and FFmpeg's object addresses ("[h264 @ 0x55..] x" -> "h264: x")."""
        fd = self._sink.fileno()
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")
        seen: dict[str, None] = {}
        for line in text.splitlines():
            line = re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", line)
            line = re.sub(r"^\[([^\]@]+?) @ 0x[0-9a-f]+\] ", r"\1: ", line)
            line = re.sub(r"ERROR opening: .*, ", "cannot open: ", line).strip()
            if line:
                seen[line] = None
        return list(seen)

    def summary(self, fallback: str) -> str:
        """The last three captured lines, or `fallback` when nothing was captured."""
        lines = self.lines()
        return "; ".join(lines[-3:])[:400] if lines else fallback


@dataclass
class _VideoJob:
    """One video being decoded: the bytes decord reads (patched), what we know of the
    container, FFmpeg's captured diagnostics, and the item's own bytes."""

    source: bytes | bytearray
    fmt: str | None
    facts: Mp4Facts
    options: DecodeOptions
    log: _StderrCapture
    data: bytes = b""


def decode_video(data: bytes, options: DecodeOptions, fmt: str | None) -> DecodedVideo | DeferredVideo:
    """`fmt` is the sniffed container (None: unknown, left to FFmpeg); only MP4/MOV and
    Matroska are parsed before decord opens the bytes."""
    facts = mp4_facts(data) if fmt in ("MP4", "MOV") else Mp4Facts()
    if facts.truncated:
        raise MediaError("truncated", f"{fmt}: a box runs past the end of the file ({len(data)} bytes)")
    span = matroska_cut_span(data) if fmt == "MATROSKA" else None
    if span is not None:
        # Told before decord opens it: its demuxer has crashed the process on cut Matroska files.
        _check_matroska_complete(data[:MATROSKA_HEAD], span)
    declared = facts.frame_size if fmt != "MATROSKA" else matroska_frame_size(data[:MATROSKA_HEAD])
    if declared is not None:
        # Before decord opens the stream: opening alone may decode a frame at full size.
        _check_frame_pixels(*declared, options, "declared by the container")
    with _StderrCapture() as log:
        job = _VideoJob(patched(data, facts.patches), fmt, facts, options, log, data)
        try:
            video = _decode_video_job(job)
        except MediaError as err:
            if not (options.defer_video and err.code == "unsupported_codec"):
                raise
            # A codec decord lacks (AV1) may be one the GPU's decoder has: the rank plans it.
            video = DeferredVideo.unplanned(data, facts.matrix)
        messages = log.summary("")
        if messages:
            logger.debug("decoder messages: %s", messages)
        return video


def _decode_video_job(job: _VideoJob) -> DecodedVideo:
    options = job.options
    reader = _open_reader(job, None)
    num_frames = len(reader)
    source_fps = float(reader.get_avg_fps())
    indices = sample_frame_indices(num_frames, source_fps, options.fps, options.max_frames, options.frame_multiple)
    times = _frame_times(reader, num_frames)
    if job.fmt == "MATROSKA":
        if times is not None:
            present = float(times[-1, 1] - times[0, 0])
        else:
            present = num_frames / source_fps if source_fps > 0 else 0.0
        _check_matroska_complete(bytes(job.source[:MATROSKA_HEAD]), present)
    if times is not None:
        indices = _time_uniform(indices, times)
    width, height = _planned_size(job, reader, indices[0])
    _check_frame_pixels(width, height, options, "decoded")
    size = _bounded_size(options, width, height)
    _check_video_pixels(len(indices), *size, options)
    if times is not None:
        timestamps = [float(times[i, 0] - times[0, 0]) for i in indices]
    else:
        timestamps = [i / source_fps if source_fps > 0 else 0.0 for i in indices]
    if options.defer_video:
        return _deferred(job, indices, size, timestamps, source_fps, num_frames)
    if size != (width, height):
        logger.debug("decoding %dx%d frames at %dx%d (max_frame_pixels=%s)", width, height, *size, options.max_frame_pixels)
    scaled = size if size != (width, height) else None
    needed = _needed_only(job, indices, num_frames) if READ_NEEDED else None
    if needed is None and scaled is None:
        frames = _read_frames(job, reader, indices)
    else:
        # One decord reader at a time: with the planning reader still open, a core read the
        # copies of 16 clips in 8.4 s, without it in 4.7 (benchmarks/RESULTS.md section 8).
        del reader
        frames = _read_copy(needed, scaled) if needed is not None else None
        if frames is None:
            frames = _read_frames(job, _open_reader(job, scaled), indices)
    frames = _apply_matrix(frames, job.facts.matrix)
    return DecodedVideo(np.ascontiguousarray(frames), timestamps, source_fps, num_frames)


def _read_copy(needed: tuple[_VideoJob, list[int]], size: tuple[int, int] | None) -> np.ndarray | None:
    """The sampled frames, read from `_needed_only`'s copy of the clip holding only the
    pictures they need, or None where the copy cannot be read: then the whole clip is
    read, and a corrupt one's error row names its own frames."""
    copy, positions = needed
    try:
        return _read_frames(copy, _open_reader(copy, size), positions)
    except MediaError:
        return None


READ_NEEDED = True
"""Whether decord reads an H.264 or HEVC MP4/MOV through a copy whose first video track
holds only the pictures the sampled frames need (`gop.needed_pictures`,
`containers.mp4_with_samples`): asked for frame i, decord decodes every picture from the
keyframe before it, and about half of those in a stream with B-frames are references for
none. On: a core decoded 1.7x the clips of the video benchmark's kinds
(benchmarks/RESULTS.md section 8), and the frames are those of a decode from the first
frame, bit for bit (tests/test_gop.py), open GOPs' leading pictures included, which
decord's seeks in the whole clip misread."""


def _needed_only(job: _VideoJob, indices: list[int], frames: int) -> tuple[_VideoJob, list[int]] | None:
    """The job over a copy of its bytes holding only the pictures `indices` need, and
    their indices in it; None where `_track_pictures` finds none, or nothing would be left out."""
    track = _track_pictures(job.source, frames, any_depth=True) if job.fmt in ("MP4", "MOV") else None
    keep = needed_pictures(track.stream, indices) if track is not None else []
    if len(keep) in (0, frames):
        return None
    shown = shown_at(track.stream)
    position = {shown[k]: n for n, k in enumerate(sorted(keep, key=shown.__getitem__))}
    source = mp4_with_samples(job.source, track.samples, keep)
    return dataclasses.replace(job, source=source), [position[index] for index in indices]


@dataclass
class _TrackPictures:
    """An MP4/MOV's first video track read for its pictures: its `samples`, its decoder
    `config`, each sample's NAL `units` and the `stream` of pictures they make."""

    samples: Mp4Samples
    config: DecoderConfig
    units: list[list[bytes | memoryview]]
    stream: list[Picture]


def _track_pictures(data: bytes | bytearray, frames: int, any_depth: bool) -> _TrackPictures | None:
    """The first video track's pictures, or None where it is no H.264 or HEVC stream
    (8-bit 4:2:0 unless `any_depth`) whose sample table is read here and numbers the
    `frames` decord counts at distinct times, or its edit list leaves samples unshown
    (`Mp4Samples.cut`: decord's frame index then counts them otherwise)."""
    samples = mp4_samples(data)
    config = decoder_config(samples.codec, samples.config, any_depth) if samples is not None else None
    if config is None or samples.cut or len(samples.sizes) != frames or len(set(samples.times)) != frames:
        return None
    view = memoryview(data)
    try:
        units = [prefixed_units(view[o : o + n], config.length_size) for o, n in zip(samples.offsets, samples.sizes)]
    except ValueError:
        return None
    return _TrackPictures(samples, config, units, sample_pictures(config.codec, units, samples.times, samples.sync))


def _planned_size(job: _VideoJob, reader: Any, first: int) -> tuple[int, int]:
    """The (width, height) the frames decode to: their SPS's where the container declares
    the same (`Mp4Facts.stream_size`), else that of one frame decoded alone (decord exposes
    none before decoding). A worker then planned 720p and 1080p clips it leaves for the GPU
    in 10.1 ms each instead of 34.8, and decord reads a clip 7 % sooner without that decode
    (benchmarks/RESULTS.md section 8)."""
    facts = job.facts
    if facts.stream_size is not None and facts.stream_size == facts.frame_size:
        return facts.stream_size
    height, width = _to_numpy(_get_batch(job, reader, [first])).shape[1:3]
    return width, height


PACKETS_IN_WORKERS = True
"""Whether a worker that leaves an MP4/MOV's frames to the GPU's decoder also cuts the
pictures they need out of its samples (`gop.packet_feed`, in `DeferredVideo.feed`), so
that the rank feeds them to the decoder without demuxing the clip (the rank's own packet
feed walks a demuxer over every packet of the clip, in Python). In `video.decoder: auto`
on 1,152 clips (SigLIP-so400m, an H100, 16 workers) the job ran 1.18x faster so (31.4 s
against 37.0; the GPU's decoder 21.5 clips/s against 16.0), the rows the same and within
cosine 0.998 of decord's (benchmarks/RESULTS.md section 11)."""


def _deferred(
    job: _VideoJob, indices: list[int], size: tuple[int, int], timestamps: list[float], fps: float, frames: int
) -> DeferredVideo:
    """What the GPU's video decoder needs to read the frames this path would read: the
    item's bytes (`decoder_bytes` makes what decord reads of them), the display matrix,
    applied after decoding as here, and with `PACKETS_IN_WORKERS` the pictures to feed."""
    mp4 = PACKETS_IN_WORKERS and job.fmt in ("MP4", "MOV")
    feed = cut_packets(job.data, indices, frames, job.facts.stream_size) if mp4 else None
    return DeferredVideo(job.data, indices, size, job.facts.matrix, _shown(size, job.facts.matrix), timestamps, fps, frames, feed)


def cut_packets(data: bytes, indices: list[int], frames: int, size: tuple[int, int] | None) -> PacketFeed | None:
    """The pictures the frames at `indices` of an MP4/MOV need (`gop.packet_feed`), or None
    where `_track_pictures` finds no 8-bit 4:2:0 ones or its SPS gave no `size`."""
    track = _track_pictures(data, frames, any_depth=False) if size is not None else None
    return packet_feed(track.config, track.units, track.stream, indices, size) if track is not None else None


def _shown(size: tuple[int, int], matrix: Matrix) -> tuple[int, int]:
    """(height, width) of frames decoded at `size` (width, height) once `matrix` turns them."""
    (a, _), _ = matrix
    return (size[1], size[0]) if a != 0 else (size[0], size[1])


def plan_from_stream(video: DeferredVideo, frames: int, fps: float, width: int, height: int, options: DecodeOptions) -> DeferredVideo:
    """The plan of a video the workers could not plan (`indices` empty: decord lacks its
    codec), made from the stream facts the GPU's decoder reads (frame count, average
    frame rate, coded size) by the CPU path's rules and limits: the same sampling rule,
    uniform in frame index (no per-frame timestamps here), the same size bound."""
    if frames < 1:
        raise MediaError("no_frames", "the video decoder finds no frames in this video")
    _check_frame_pixels(width, height, options, "decoded")
    indices = sample_frame_indices(frames, fps, options.fps, options.max_frames, options.frame_multiple)
    size = _bounded_size(options, width, height)
    _check_video_pixels(len(indices), *size, options)
    timestamps = [i / fps if fps > 0 else 0.0 for i in indices]
    shown = _shown(size, video.matrix)
    return dataclasses.replace(video, indices=indices, decoded=size, shown=shown, timestamps=timestamps, source_fps=fps, source_frames=frames)


def decoder_bytes(data: bytes) -> bytes | bytearray:
    """The bytes a frame decoder is given for a video's `data`, as this path gives
    decord: for MP4/MOV the first video track only and the display matrix reset (it is
    applied to the decoded frames instead, so no decoder turns them itself)."""
    found = sniff_format(data)
    if found is None or found[1] not in ("MP4", "MOV"):
        return data
    return patched(data, mp4_facts(data).patches)


def _check_matroska_complete(head: bytes, present: float) -> None:
    """A Matroska file cut short still opens and decodes the frames before the cut, so
    compare the duration its header declares with the `present` seconds of frames (by
    decord's frame times, or before decord by the blocks' timecodes of a file whose
    Segment runs past its end, `matroska_cut_span`): a file missing more than a tenth of
    it is `truncated` (an embedding of half a clip must not pass for the clip)."""
    declared = matroska_duration(head)
    if declared is None or declared <= 0:
        return
    if present < 0.9 * declared:
        raise MediaError("truncated", f"Matroska declares {declared:.2f}s but only {present:.2f}s of frames are present")


def _apply_matrix(frames: np.ndarray, matrix: Matrix) -> np.ndarray:
    """Frames (T, H, W, C) as displayed under `matrix` ([x y] @ matrix, y down).

    Without a swap, a negative a flips columns and a negative d flips rows. With a
    swap (a == d == 0) the displayed x comes from the source row (x' = c*y) and the
    displayed y from the source column (y' = b*x): transpose, then flip by the signs.
    90 degrees clockwise is b=1, c=-1: transpose, flip columns.
    """
    (a, b), (c, d) = matrix
    if a != 0:
        if a < 0:
            frames = frames[:, :, ::-1]
        if d < 0:
            frames = frames[:, ::-1]
        return frames
    frames = frames.transpose(0, 2, 1, 3)
    if c < 0:
        frames = frames[:, :, ::-1]
    if b < 0:
        frames = frames[:, ::-1]
    return frames


def _decord() -> Any:
    """decord, imported only where a video is decoded.

    decord loads its bundled zlib 1.2.3 with RTLD_GLOBAL: for the rest of the process
    Python's zlib module and a torchvision loaded afterwards bind to it, and
    torchvision's PNG decoder then fails ("libpng error: bad parameters to zlib") or
    crashes. Keeping the import out of module import time confines that to processes
    that decode video (`image` never gives PNG to torchvision).
    """
    import decord

    return decord


def worker_preload(modules: Iterable[str]) -> list[str]:
    """What a decode worker server imports, in order: torchvision's decoders, then
    `modules` (the task function's), then decord, then this package.

    decord comes after the others: its bundled zlib must not be the first one loaded
    (see `_decord`). Workers forked from a server that holds these start without
    importing torch.
    """
    return ["torchvision.io", *modules, "decord", "embedjob.decode"]


def _open_reader(job: _VideoJob, size: tuple[int, int] | None) -> Any:
    """A decord VideoReader over the job's bytes, scaled to `size` (width, height) at
    decode time if given."""
    decord = _decord()
    width, height = size if size else (-1, -1)
    try:
        return decord.VideoReader(
            io.BytesIO(job.source), ctx=decord.cpu(0), width=width, height=height, num_threads=job.options.decoder_threads
        )
    except AssertionError:
        # decord asserts a positive frame count after opening.
        raise MediaError("no_frames", f"{job.fmt or 'the container'} has a video stream with 0 frames") from None
    except (decord.DECORDError, RuntimeError) as exc:
        raise _open_error(job, exc) from None


def _open_error(job: _VideoJob, exc: BaseException) -> MediaError:
    text = str(exc)
    fmt = job.fmt or "the container"
    if _FFMPEG_DECODER_NOT_FOUND in text:
        codec = f" '{job.facts.video_codecs[0]}'" if job.facts.video_codecs else ""
        return MediaError("unsupported_codec", f"decord's FFmpeg 4.1 has no decoder for the video codec{codec} of this {fmt} (AV1 is one)")
    if _FFMPEG_STREAM_NOT_FOUND in text:
        return MediaError("no_video_stream", f"{fmt} has no video stream (audio or data only)")
    captured = "\n".join(job.log.lines())
    detail = job.log.summary(_decord_message(exc))
    if job.fmt is None:
        return MediaError("unknown_format", f"not a recognised video format ({detail})")
    if job.facts.truncated or any(word in captured.lower() for word in _FFMPEG_TRUNCATION_WORDS):
        return MediaError("truncated", f"{fmt} ends before its index can be read ({detail})")
    if _FFMPEG_NO_PIXEL_FORMAT in captured:
        # FFmpeg learns the pixel format from the first decodable frame; there was none.
        return MediaError("no_frames", f"{fmt} has no decodable video frame ({detail})")
    return MediaError("corrupt", f"{fmt} cannot be opened ({detail})")


def _decord_message(exc: BaseException) -> str:
    """decord's message without its '[hh:mm:ss] /path/file.cc:123: ' prefixes."""
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", last_line(exc))[:400]


def _frame_times(reader: Any, num_frames: int) -> np.ndarray | None:
    """(num_frames, 2) presentation start and end of every frame in seconds, or None
    when the container's timestamps are unusable (missing, as in many AVI files, or
    not increasing)."""
    times = np.asarray(reader.get_frame_timestamp(range(num_frames)), dtype=np.float64)
    starts = times[:, 0]
    if not np.all(np.isfinite(times)) or starts[0] < -1.0 or np.any(np.diff(starts) <= 0):
        return None
    return times


def _time_uniform(indices: list[int], times: np.ndarray) -> list[int]:
    """For a variable frame rate, the frames on screen at evenly spaced times.

    `sample_frame_indices` places sample k at frame floor(k * num_frames / count),
    which is evenly spaced in time only at a constant frame rate. When frame durations
    vary by more than 1 %, sample k becomes the frame on screen at
    k / count of the duration (the last frame starting at or before that time).
    A constant rate keeps the index rule exactly (float timestamps would otherwise
    move some samples by a frame). Padded samples (clips shorter than the patch) are
    all the frames already.
    """
    starts = times[:, 0]
    durations = np.diff(starts)
    if len(starts) < 3 or len(set(indices)) < len(indices):
        return indices
    if durations.max() - durations.min() <= 0.01 * float(np.median(durations)):
        return indices
    duration = max(float(times[-1, 1]), float(starts[-1])) - float(starts[0])
    targets = starts[0] + np.arange(len(indices)) * duration / len(indices) + 1e-6
    return [int(i) for i in np.searchsorted(starts, targets, side="right") - 1]


def _bounded_size(options: DecodeOptions, width: int, height: int) -> tuple[int, int]:
    """The (width, height) frames of `width` x `height` are decoded at: scaled down
    (aspect kept) when they exceed max_frame_pixels, else their own."""
    limit = options.max_frame_pixels
    if limit is None or width * height <= limit:
        return width, height
    scale = math.sqrt(limit / (width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def _check_frame_pixels(width: int, height: int, options: DecodeOptions, how: str) -> None:
    limit = options.frame_pixel_limit
    if limit is not None and width * height > limit:
        raise MediaError(
            "too_large",
            f"video frames of {width}x{height} = {width * height} pixels ({how}) exceed video.max_pixels_per_frame = {limit}",
        )


def _check_video_pixels(frames: int, width: int, height: int, options: DecodeOptions) -> None:
    """The sampled frames together, at the size they are decoded to, before the rest of
    them are decoded (only the first one is, to learn its size)."""
    limit = options.video_pixel_limit
    total = frames * width * height
    if limit is not None and total > limit:
        raise MediaError(
            "too_large",
            f"{frames} sampled frames of {width}x{height} = {total} pixels exceed video.max_total_pixels = {limit}",
        )


def _read_frames(job: _VideoJob, reader: Any, indices: list[int]) -> np.ndarray:
    """Decode the distinct indices in ascending chunks of _BATCH_FRAMES into one
    preallocated array (peak memory: the result plus one chunk), then order them."""
    unique = sorted(set(indices))
    out: np.ndarray | None = None
    for begin in range(0, len(unique), _BATCH_FRAMES):
        chunk = _to_numpy(_get_batch(job, reader, unique[begin : begin + _BATCH_FRAMES]))
        if out is None:
            out = np.empty((len(unique), *chunk.shape[1:]), dtype=np.uint8)
        out[begin : begin + len(chunk)] = chunk
    assert out is not None, "indices is never empty"
    if unique == indices:
        return out
    position = {index: k for k, index in enumerate(unique)}
    return out[[position[i] for i in indices]]


def _get_batch(job: _VideoJob, reader: Any, indices: list[int]) -> Any:
    decord = _decord()
    try:
        return reader.get_batch(indices)
    except (decord.DECORDError, RuntimeError) as exc:
        detail = job.log.summary(_decord_message(exc))
        raise MediaError("corrupt", f"frames {indices[0]}..{indices[-1]} cannot be decoded ({detail})") from None


def _to_numpy(batch: Any) -> np.ndarray:
    """decord returns its own NDArray with the native bridge; another bridge set by
    other code in this process (torch, ...) returns a CPU tensor."""
    return batch.asnumpy() if hasattr(batch, "asnumpy") else np.asarray(batch)
