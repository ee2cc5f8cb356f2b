"""Video frames decoded by the GPU's video decoder (`video.decoder: nvdec`), through
PyNvVideoCodec (the optional extra `embedjob[nvdec]`).

The decode workers plan a video as the CPU path does (`video.decode_video` with
`defer_video`: which frames, at which size, under which display matrix) and leave the
frames undecoded (`DeferredVideo`); the rank reads exactly those frames here, as RGB on
its GPU, `nvdec_sessions` videos at a time (`video.nvdec_sessions`), and applies the rest
of the CPU path's steps there (`frames_as_decoded`). An 8-bit H.264 or HEVC stream is fed
to the decoder packet by packet from memory, only the pictures its samples need
(`FEED_SAMPLED`, `gop`); any other is read by a SimpleDecoder session from the bytes (a
file in memory while it reads them). A failure raises, and the caller takes the CPU path
for that video. The decoder hands NV12, turned to RGB here as decord's FFmpeg does
(`YUV_HERE`); sessions share the default CUDA stream (`OWN_STREAMS` off). All three were
chosen on a GPU's numbers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import functools
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torchvision.transforms.v2.functional as tvF

from embedjob.decode import gop
from embedjob.decode.bitstream import SignalTags
from embedjob.decode.containers import mp4_facts
from embedjob.decode.sniff import sniff_format
from embedjob.decode.types import DecodeOptions, DeferredVideo, MediaError
from embedjob.decode.video import decoder_bytes, plan_from_stream

PACKAGE = "PyNvVideoCodec"


def nvdec_problem(device: torch.device) -> str | None:
    """Why frames cannot be decoded by `device`'s video decoder, or None."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError as exc:
        return f"{PACKAGE} is not installed ({exc}): pip install 'embedjob[nvdec]'"
    return None


OWN_STREAMS = False
"""Whether each thread's decoder session gets a CUDA stream of its own (PyNvVideoCodec's
`cuda_stream`) instead of the library's default, the legacy stream every session shares.
Off: on an H100, NVDEC alone read 100.5 s of video a second in 4 threads on the shared
stream and 99.9 on streams of their own, 139.4 and 139.8 in 7 (`benchmarks/nvdec_scaling.py`,
benchmarks/RESULTS.md section 11): a stream per session buys threads nothing."""

YUV_HERE = True
"""Whether 8-bit streams come from the decoder as NV12 and are turned to RGB here
(`nv12_to_rgb`: the matrix and range the stream is tagged with, BT.601 and limited range
where it has no tags, as decord's FFmpeg does), instead of by PyNvVideoCodec's RGB output,
whose vectors were down to cosine 0.983 from decord's on untagged clips. The tags are read
here (`media_colour`: the SPS's, then the container's), as decord's FFmpeg reads them;
PyNvVideoCodec's demuxer reports the container's alone, which left a clip tagged BT.709 in
its H.264 stream only 20 levels off decord's. On: SigLIP-so400m's vectors of 1,152 clips
read this way were within cosine 0.99817 of decord's at worst, against 0.98306 through the
RGB output (an H100, benchmarks/RESULTS.md section 11; tests/test_gpu.py compares pixels)."""

COEFFICIENTS = {"bt601": (104597, 132201, 25675, 53279), "bt709": (117489, 138438, 13975, 34925)}
"""YUV -> RGB for limited-range chroma, in 1/65536: V to red, U to blue, U and V off green;
FFmpeg's swscale table (`ff_yuv2rgb_coeffs`), by the matrix it picks for a stream."""


@dataclass(frozen=True)
class Colour:
    """The YUV -> RGB conversion of a stream: `matrix` a `COEFFICIENTS` key, `full` its range."""

    matrix: str = "bt601"
    full: bool = False


# Each thread of `_threads` keeps its decoder sessions (`_session`) in `_sessions` and
# reads one video at a time: 4 threads read 100.5 s of video a second on an H100, 7 of
# them (its decode engines) 139.4 (benchmarks/RESULTS.md section 11).
_sessions = threading.local()
_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


class DecoderClock:
    """Seconds this process's decode threads spent, summed over them, in the GPU decoder's
    parts: whole clips (`decode_frames`, "clip"), and on the packet feed the decoder's
    `Decode` calls (parse, decode and map a picture), taking its wanted surfaces
    (`torch.from_dlpack`, "surface": the decoder's handshake with the taking stream), their
    copies out (the streams' waits, the batch's allocation, the copies' launches) and the
    NV12 conversion. A clip's time beyond its parts is Python and the wait for the GIL;
    a `Decode` slower in a job than alone (`benchmarks/nvdec_scaling.py`) waits for the
    device. The job reports what its run added (`RankStats.device_decode_parts`).

    Each thread adds to counts of its own (a lock only when a thread first counts), so the
    feed's per-packet calls share no lock; a reading sums them."""

    PARTS = ("clip", "Decode", "surface", "copy", "RGB")

    def __init__(self) -> None:
        self._threads: list[dict[str, float]] = []
        self._own = threading.local()
        self._lock = threading.Lock()

    def add(self, part: str, since: float) -> float:
        """Count the seconds from `since` (`time.perf_counter`) to now to `part`; returns
        now, from which the next part counts where parts follow each other."""
        now = time.perf_counter()
        counts = getattr(self._own, "counts", None)
        if counts is None:
            counts = self._own.counts = dict.fromkeys(self.PARTS, 0.0)
            with self._lock:
                self._threads.append(counts)
        counts[part] += now - since
        return now

    def seconds(self) -> dict[str, float]:
        """Each part's seconds so far, summed over the threads."""
        with self._lock:
            threads = list(self._threads)
        return {part: sum(counts[part] for counts in threads) for part in self.PARTS}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """Each part's seconds since `before` (an earlier `seconds()`)."""
        return {part: seconds - before.get(part, 0.0) for part, seconds in self.seconds().items()}


CLOCK = DecoderClock()


def decode_videos(
    videos: list[DeferredVideo], device: torch.device, options: DecodeOptions
) -> Iterator[tuple[torch.Tensor, DeferredVideo] | Exception]:
    """Each video's frames and plan (`decode_frames`), or the exception that stopped it,
    in the order of `videos`, decoded `options.nvdec_sessions` at a time on threads that
    keep their decoder sessions between calls. All are handed to the threads at once and
    each is yielded as soon as it and those before it are done, so the caller finishes a
    video while the threads decode the next ones (a list would leave them idle through
    the window's finishing). Their copies and resizes queue on the caller's current
    stream, or with `THREAD_STREAMS` on a stream of each thread's own that the caller's
    waits for, the frames recorded as used on the caller's."""
    caller = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def one(video: DeferredVideo) -> tuple[torch.Tensor, DeferredVideo] | Exception:
        stream = _work_stream(device) if THREAD_STREAMS and caller is not None else caller
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                frames, plan = decode_frames(video, device, options)
            except Exception as exc:  # the caller decides: an error row or the CPU path
                return exc
        if stream is not caller:
            caller.wait_stream(stream)
            frames.record_stream(caller)
        return frames, plan

    if len(videos) <= 1:
        return iter([one(video) for video in videos])
    return _threads(options.nvdec_sessions).map(one, videos)


THREAD_STREAMS = False
"""Whether each decode thread queues its videos' copies, conversions and resizes on a CUDA
stream of its own instead of the caller's, which all of them share. One stream runs its
kernels one after another, and beside the encoder each of them waits for the SMs: NVDEC
alone (`benchmarks/nvdec_scaling.py`, whose threads each have a stream) read 72 clips a
second, the `video.decoder: auto` job's threads on one stream 25 (benchmarks/RESULTS.md
section 11). Timed once in a job, with `FUSED_RGB` (377 clips, SigLIP-so400m, an H100):
0.576 of the encoder alone against 0.580 without either, the GPU's decoder 31 clips a
second both ways; in a `video.decoder: nvdec` job on 128 clips 23.4 against 28.5 with
`FUSED_RGB` too, 31.7 against 29.6 on its own (one run each; benchmarks/RESULTS.md section
11): off until a run on 1,152 clips says more. `tests/test_gpu.py` runs the nvdec and auto
jobs both ways."""


def _work_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream on `device` for `THREAD_STREAMS` (made on its first video there)."""
    held = getattr(_sessions, "work_stream", None)
    if held is None or held[0] != device:
        held = _sessions.work_stream = (device, torch.cuda.Stream(device))
    return held[1]


def _threads(sessions: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's decode threads, `sessions` of them: kept between calls (and jobs) with
    their sessions, made anew, sessions and all, when a job asks for another count."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != sessions:
            if _pool is not None:
                _pool[1].shutdown(wait=True)
            _pool = (sessions, concurrent.futures.ThreadPoolExecutor(sessions, thread_name_prefix="embedjob-nvdec"))
        return _pool[1]


# Streams with a side below this take the CPU path. It is HEVC's documented NVDEC
# minimum, the largest of the codecs'; below it an H200 returned a 66 x 50 H.264 clip
# padded to 192 x 96 (a fresh session) or garbled at its own size (a reconfigured one),
# and clips that small cost a CPU little.
MIN_SIDE = 144


class SmallStream(RuntimeError):
    """A stream below `MIN_SIDE`: the CPU path reads it; the session stays trusted."""


def decode_frames(video: DeferredVideo, device: torch.device, options: DecodeOptions) -> tuple[torch.Tensor, DeferredVideo]:
    """`video`'s sampled frames as (T, 3, H, W) uint8 RGB on `device`, in sample order,
    as the CPU path shows them (see `frames_as_decoded`), and its plan: the workers'
    or, for a video they could not plan, one made here (`video.plan_from_stream`).
    A planned 8-bit H.264 or HEVC stream read as NV12 is fed to the decoder packet by
    packet: the pictures its worker cut out (`DeferredVideo.feed`), else those read here
    (`FEED_SAMPLED`); any other, through a session that reads a spilled file. Its
    seconds count to `CLOCK`'s "clip"."""
    since = time.perf_counter()
    try:
        return _decoded_frames(video, device, options)
    finally:
        CLOCK.add("clip", since)


def _decoded_frames(video: DeferredVideo, device: torch.device, options: DecodeOptions) -> tuple[torch.Tensor, DeferredVideo]:
    """The body of `decode_frames`."""
    colour = media_colour(video.data) if YUV_HERE else None
    if video.feed is not None and colour is not None:
        try:
            return _fed_as_cut(video, device, colour)
        except Unfed:
            pass
    data = decoder_bytes(video.data)
    if FEED_SAMPLED and colour is not None and video.indices:
        try:
            return _fed(data, video, device, colour)
        except Unfed:
            pass
    with _spilled(data) as path:
        try:
            decoder, facts, colour = _session(path, device, colour)
            if not video.indices:
                video = plan_from_stream(video, facts.num_frames, facts.average_fps, facts.width, facts.height, options)
            unique = sorted(set(video.indices))
            frames = _frames(decoder, unique, (facts.height, facts.width), device, colour)
        except (MediaError, SmallStream):
            raise
        except Exception:
            _drop_current()  # a session that failed is not trusted with the next video
            raise
    return _in_sample_order(frames, unique, video), video


def _in_sample_order(frames: torch.Tensor, unique: list[int], video: DeferredVideo) -> torch.Tensor:
    """The (T, 3, H, W) frames at the ascending indices `unique` as `video.indices` orders
    (and repeats) them, as shown."""
    position = {index: k for k, index in enumerate(unique)}
    return frames_as_decoded(frames[[position[i] for i in video.indices]], video)


def refusal(exc: Exception) -> str:
    """What the decoder said when it refused a video, in one line: PyNvVideoCodec's
    errors span lines ("HandleVideoSequence : / Error code : 801 / Error Type : Codec
    not supported on this GPU / at <source file>"); its error type and code are what a
    user can act on."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    fields = dict(line.split(" : ", 1) for line in lines if " : " in line)
    if "Error Type" in fields:
        code = f" (error {fields['Error code']})" if "Error code" in fields else ""
        return fields["Error Type"] + code
    return lines[0] if lines else type(exc).__name__


def _frames(decoder: Any, unique: list[int], coded: tuple[int, int], device: torch.device, colour: Colour | None) -> torch.Tensor:
    """The frames at `unique` as (T, 3, H, W) uint8 RGB on `device`: the decoder's RGB, or,
    from a session that hands NV12 (`colour` given), turned here (`nv12_to_rgb`)."""
    decoded = decoder.get_batch_frames_by_index(unique)
    stream = getattr(_sessions, "stream", None)
    if stream is not None:
        # The frames were made on the session's stream; the copies below run on the caller's.
        torch.cuda.current_stream(device).wait_stream(stream)
    if colour is not None:
        frames = [nv12_to_rgb(torch.from_dlpack(frame).to(device), coded, colour) for frame in decoded]
    else:
        frames = [_chw(torch.from_dlpack(frame), coded, device) for frame in decoded]
    if len(frames) != len(unique):
        raise RuntimeError(f"the video decoder returned {len(frames)} of {len(unique)} frames")
    return torch.stack(frames)


SESSIONS_PER_THREAD = 4
"""Decoder sessions a decode thread keeps, one per kind of stream (codec, size and output), the least
recently used dropped first. A corpus of H.264 and HEVC clips at 1080p and 720p has 4
kinds; a thread that kept one session made a new one (about 0.18 s) for most clips of it."""


def _session(path: str, device: torch.device, colour: Colour | None) -> tuple[Any, Any, Colour | None]:
    """A decoder pointed at the video in `path`, the stream's facts, and, for an 8-bit
    stream given its `colour`, that colour (the session then hands NV12, else RGB).

    The thread keeps a session per kind of stream (codec, size and output, as the demuxer
    says them), up to `SESSIONS_PER_THREAD`, and reconfigures the one of the video's kind
    (making one costs about 0.18 s); a kind it has none of gets a new one. A session is
    never reconfigured for another kind: so reconfigured, an H200 returned garbled frames
    at the right size (a 66 x 50 H.264 clip) that a new session read right or refused. A
    session whose facts after reconfiguring differ from its own when made is dropped for a
    new one. A stream of more than 8 bits (a 200 x 200 10-bit HEVC clip came back garbled
    from a session reconfigured for it, even one of its own kind) gets an RGB session of
    its own, used once. A stream with a side below `MIN_SIDE` is refused (`SmallStream`)
    before any session sees it."""
    import PyNvVideoCodec as nvc

    _sessions.current = None
    demuxer = nvc.CreateDemuxer(path)
    width, height = demuxer.Width(), demuxer.Height()
    _check_side(width, height)
    if demuxer.BitDepth() > 8:
        decoder = _new_session(nvc, path, device, native=False)
        return decoder, decoder.get_stream_metadata(), None
    native = colour is not None
    kind = (str(demuxer.GetNvCodecId()), width, height, native)
    kept = _kept(nvc, device)
    held = kept.pop(kind, None)
    if held is not None:
        held[0].reconfigure_decoder(path)
        facts = held[0].get_stream_metadata()
        if _kind(facts) != held[1]:
            held = None
    if held is None:
        decoder = _new_session(nvc, path, device, native=native)
        facts = decoder.get_stream_metadata()
        held = (decoder, _kind(facts))
    kept[kind] = held
    _sessions.current = kind
    while len(kept) > SESSIONS_PER_THREAD:
        kept.popitem(last=False)
    return held[0], facts, colour


def _kept(nvc: Any, device: torch.device) -> collections.OrderedDict:
    """This thread's kept sessions by kind, least recently used first; none carried over
    from another device or decoder module."""
    owner = getattr(_sessions, "owner", None)
    if owner is None or owner[0] is not nvc or owner[1] != device:
        _sessions.owner, _sessions.kept = (nvc, device), collections.OrderedDict()
    return _sessions.kept


def _drop_current() -> None:
    """Forgets the session the thread's last video was given, if it was a kept one."""
    kind, _sessions.current = getattr(_sessions, "current", None), None
    if kind is not None and hasattr(_sessions, "kept"):
        _sessions.kept.pop(kind, None)


FEED_SAMPLED = True
"""Whether a planned 8-bit H.264 or HEVC stream read as NV12 is fed to a decoder packet by
packet from memory, only the pictures its sampled frames need (`gop.needed_pictures`:
no picture nothing refers to unless sampled, nothing past the last sample, no group of
pictures without one), instead of read through a SimpleDecoder session, which decodes
every picture from the keyframe before each sample and reads from a spilled file. About
half the pictures of a stream with B-frames are references for none. On: on an H100,
NVDEC alone read 75.2 s of video a second in one thread fed so against 42.8 through a
session, 161.9 against 149.4 in 7 (where the feed's Python steps, then two demuxer passes
a clip, held the GIL half the time; now one, `_fed`: 225.6 in 7 on 331 clips), and the
feed reads the leading pictures of open GOPs as a decode from the first frame does, where
a session's seeks misread them or failed (benchmarks/RESULTS.md section 11;
tests/test_gpu.py)."""

CODECS = {"H264": "h264", "HEVC": "hevc"}
"""The decoder's codec ids (their last dotted part) whose pictures `gop` can tell apart."""

HEAD = 4096
"""Bytes of a packet read to find its first slice: the parameter sets and SEI before it
(x264 writes its settings into one of some 700 bytes) rarely take more; a packet without
a slice in them is read whole."""


class Unfed(Exception):
    """A stream the packet feed does not take (`FEED_SAMPLED`): not 8-bit H.264 or HEVC,
    packets not in Annex B, or not numbering the frames its plan counted. A session reads it."""


class _Reader:
    """A demuxer's reads (PyNvVideoCodec's callback: fill the buffer handed, say how much,
    0 at the end) from bytes in memory."""

    def __init__(self, data: bytes | bytearray) -> None:
        self.view, self.at = memoryview(data), 0

    def __call__(self, buffer: Any) -> int:
        count = min(len(buffer), len(self.view) - self.at)
        buffer[:count] = self.view[self.at : self.at + count]
        self.at += count
        return count


def _fed(data: bytes | bytearray, video: DeferredVideo, device: torch.device, colour: Colour) -> tuple[torch.Tensor, DeferredVideo]:
    """`decode_frames` by the packet feed: the stream's packets read once, each copied out
    with its picture (`gop.Picture`: pts, keyframe, reference), then those
    `gop.needed_pictures` names fed from the copies to a kept decoder of the stream's
    kind, and the end of the stream, which flushes it. Frames are taken by pts as they
    come out. One demuxer pass: a second, to feed its packets, cost the rank 6 ms a clip
    of Python holding the GIL (2 to open a demuxer, 4 to walk 139 packets) against under
    1 ms to copy them."""
    import PyNvVideoCodec as nvc

    _sessions.current = None
    demuxer = nvc.CreateDemuxer(_Reader(data))
    width, height = demuxer.Width(), demuxer.Height()
    _check_side(width, height)
    codec_id = demuxer.GetNvCodecId()
    codec = CODECS.get(str(codec_id).rsplit(".", 1)[-1].upper())
    if codec is None or demuxer.BitDepth() > 8:
        raise Unfed(f"{codec_id} at {demuxer.BitDepth()} bits")
    copies = [(packet.pts, bool(packet.key), ctypes.string_at(packet.bsl_data, packet.bsl)) for packet in demuxer if packet.bsl]
    stream = gop.pictures([(pts, key, _picture_kind(codec, unit)) for pts, key, unit in copies])
    if len(stream) != video.source_frames or len({picture.pts for picture in stream}) != len(stream):
        raise Unfed(f"{len(stream)} packets for {video.source_frames} frames")
    unique = sorted(set(video.indices))
    order = gop.display_order(stream)
    wanted = {stream[order[index]].pts: k for k, index in enumerate(unique)}
    needed = sorted(gop.needed_pictures(stream, unique))
    packets = [_packet(nvc, _address(copies[k][2]), len(copies[k][2]), copies[k][0]) for k in needed]
    frames = _feed(nvc, [*packets, nvc.PacketData()], wanted, (("fed", codec, width, height), codec_id), device, colour, (height, width))
    return _in_sample_order(frames, unique, video), video


def _address(data: bytes) -> int:
    """Where `data`'s bytes are: a packet handed to the decoder points into them, so they
    must outlive the feed (its caller holds them)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def _fed_as_cut(video: DeferredVideo, device: torch.device, colour: Colour) -> tuple[torch.Tensor, DeferredVideo]:
    """`decode_frames` from the pictures the worker cut out (`gop.PacketFeed`): each one
    handed to a kept decoder of the stream's kind as a packet of its own, with its
    display index for pts, then an empty packet, which ends the stream; frames are taken
    by display index as they come out. No demuxer runs here."""
    import PyNvVideoCodec as nvc

    feed = video.feed
    width, height = feed.size
    _check_side(width, height)
    codec_id = getattr(getattr(nvc, "cudaVideoCodec", None), feed.codec.upper(), None)
    if codec_id is None:
        raise Unfed(f"{PACKAGE} names no codec {feed.codec.upper()}")
    _sessions.current = None
    base = _address(feed.stream)
    packets = [_packet(nvc, base + offset, size, shown) for (offset, size), shown in zip(feed.bounds, feed.shown)]
    unique = sorted(set(video.indices))
    frames = _feed(nvc, [*packets, nvc.PacketData()], {index: k for k, index in enumerate(unique)},
                   (("fed", feed.codec, width, height), codec_id), device, colour, (height, width))
    return _in_sample_order(frames, unique, video), video


def _packet(nvc: Any, address: int, size: int, pts: int) -> Any:
    """A decoder's packet of the `size` bytes at `address`, shown at `pts`."""
    packet = nvc.PacketData()
    packet.bsl_data, packet.bsl, packet.pts = address, size, pts
    return packet


def _picture_kind(codec: str, unit: bytes) -> gop.SliceKind | None:
    """The `gop.SliceKind` of the picture in a demuxer's packet (Annex B), from its first
    `HEAD` bytes or, where they hold no slice, all of it. A packet that does not start
    with a start code is refused: the lengths before AVCC's units could pass for one."""
    if not (unit.startswith(b"\x00\x00\x01") or unit.startswith(b"\x00\x00\x00\x01")):
        raise Unfed("packets not in Annex B")
    kind = gop.picture_kind(codec, gop.nal_units(unit[:HEAD]))
    if kind is None and len(unit) > HEAD:
        kind = gop.picture_kind(codec, gop.nal_units(unit))
    return kind


def _feed(nvc: Any, packets: Iterable[Any], wanted: dict[int, int], kind: tuple[tuple, Any],
          device: torch.device, colour: Colour, coded: tuple[int, int]) -> torch.Tensor:
    """The frames whose pts are `wanted`'s keys, in its values' order, as RGB on `device`
    ((T, 3, H, W) uint8): `packets` (ending with the empty one that ends the stream) fed
    to this thread's decoder of `kind`. The decoder makes its frames on the thread's
    stream and reuses their memory, so whatever it does after they are copied out (in
    this video or the next) waits for the copies: queued on that stream after its writes
    (`COPIES_ON_FEED_STREAM`, `COPY_ENGINE`), else on the caller's, which the two streams
    wait for in turn. A decoder that fails is dropped: it is not trusted with the next video."""
    try:
        return _fed_frames(nvc, packets, wanted, kind, device, colour, coded)
    except Exception:
        _drop_current()
        raise


def _fed_frames(nvc: Any, packets: Iterable[Any], wanted: dict[int, int], kind: tuple[tuple, Any],
                device: torch.device, colour: Colour, coded: tuple[int, int]) -> torch.Tensor:
    """The body of `_feed`, which drops the decoder where this fails. Each wanted frame's
    NV12 is copied out of its surface into its place in one batch as it comes (on the
    decoder's stream with `COPIES_ON_FEED_STREAM` or `COPY_ENGINE`); the batch is turned
    to RGB at the end, `BATCH_RGB` frames a call, on the caller's stream."""
    decoder, own = _fed_session(nvc, kind, device)
    current = torch.cuda.current_stream(device) if own is not None else None
    on_own = own is not None and (COPIES_ON_FEED_STREAM or COPY_ENGINE)
    apart = own is not None and not on_own
    batch: torch.Tensor | None = None
    copied: set[int] = set()
    for packet in packets:
        since = time.perf_counter()
        out = decoder.Decode(packet)
        CLOCK.add("Decode", since)
        decoded = [frame for frame in out if frame.getPTS() in wanted and frame.getPTS() not in copied]
        if not decoded:
            continue
        mark = time.perf_counter()
        if apart:
            current.wait_stream(own)
        with torch.cuda.stream(own) if on_own else contextlib.nullcontext():
            for frame in decoded:
                mark = CLOCK.add("copy", mark)
                surface = torch.from_dlpack(frame).to(device)
                mark = CLOCK.add("surface", mark)
                batch = _copied_out(frame.getPTS(), surface, batch, wanted)
                copied.add(frame.getPTS())
        if apart:
            own.wait_stream(current)
        CLOCK.add("copy", mark)
    if batch is None or len(copied) != len(wanted):
        raise RuntimeError(f"the video decoder returned {len(copied)} of {len(wanted)} frames")
    if on_own:
        current.wait_stream(own)
        batch.record_stream(current)
    since = time.perf_counter()
    rgb = torch.cat([nv12_to_rgb(chunk, coded, colour) for chunk in batch.split(BATCH_RGB)])
    CLOCK.add("RGB", since)
    return rgb


def _copied_out(pts: int, surface: torch.Tensor, batch: torch.Tensor | None, wanted: dict[int, int]) -> torch.Tensor:
    """`batch` (made here for the first frame: one NV12 surface per wanted pts) with
    `surface`, the decoder's frame shown at `pts`, copied into its place, queued on the
    current stream."""
    if batch is None:
        batch = surface.new_empty((len(wanted), *surface.shape))
    if surface.shape != batch.shape[1:]:
        raise RuntimeError(f"the video decoder returned NV12 frames of shapes {tuple(surface.shape)} and {tuple(batch.shape[1:])}")
    if COPY_ENGINE:
        engine_copy(batch[wanted[pts]], surface)
    else:
        batch[wanted[pts]].copy_(surface)
    return batch


COPY_ENGINE = False
"""Whether a fed decoder's wanted surfaces are copied out by the driver's 2D copy
(`engine_copy`) on the decoder's own stream, instead of by `Tensor.copy_` on the caller's:
the lever where the copy engines run it apart from the SMs. The decoder waits for its
stream before each picture it shows, and a copy queued behind the encoder's kernels waits
there too: in a `video.decoder: nvdec` job NVDEC read 29.6 clips a second beside
SigLIP-so400m, 44.7 beside the tower's tiny version. Beside bf16 products, with CUDA's 8
hardware queues, the driver's copy waited for the product in flight as torch's did
(`benchmarks/copy_wait.py`, benchmarks/RESULTS.md section 11): off until it is timed
under the job's 32."""

_DEVICE_MEMORY = 2
"""CU_MEMORYTYPE_DEVICE: both sides of `engine_copy` are device memory."""


class _Copy2D(ctypes.Structure):
    """The driver's CUDA_MEMCPY2D: where a pitched copy reads, where it writes, how much."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


def engine_copy(target: torch.Tensor, surface: torch.Tensor) -> None:
    """`surface` (rows of uint8 on a GPU, each contiguous, any pitch) copied into `target`
    (the same shape, contiguous, on that GPU) by the driver on the current stream. Anything
    else (rows not each contiguous, host memory) is copied by `Tensor.copy_`."""
    if (surface.dim() != 2 or surface.stride(1) != 1 or not target.is_contiguous() or surface.dtype != torch.uint8
            or target.dtype != torch.uint8 or not (surface.is_cuda and target.is_cuda) or surface.shape != target.shape):
        target.copy_(surface)
        return
    rows, width = surface.shape
    copy = _Copy2D(srcMemoryType=_DEVICE_MEMORY, srcDevice=surface.data_ptr(), srcPitch=surface.stride(0),
                   dstMemoryType=_DEVICE_MEMORY, dstDevice=target.data_ptr(), dstPitch=width,
                   WidthInBytes=width, Height=rows)
    status = _driver().cuMemcpy2DAsync_v2(ctypes.byref(copy), ctypes.c_void_p(torch.cuda.current_stream(target.device).cuda_stream))
    if status:
        raise RuntimeError(f"the driver's 2D copy of a decoded frame failed (CUDA error {status})")


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, which PyNvVideoCodec's decoder runs on too."""
    return ctypes.CDLL("libcuda.so.1")


COPIES_ON_FEED_STREAM = False
"""Whether a fed decoder's wanted surfaces are copied out on the decoder's own stream (the
thread's feed stream: after the decoder's writes and before its next, by stream order)
instead of on the caller's, which the decode threads share and which also holds the
clips' conversions and resizes. Those wait for the SMs behind the encoder's products, and
a decoder reusing a surface whose copy was queued behind them waits too: in `video.decoder:
auto` NVDEC read 25 clips a second where alone it read 72. Timed in a `video.decoder: nvdec`
job (128 clips, SigLIP-so400m, an H100): the copies took 6 ms a clip instead of 36, but the
decoder's calls as much longer, 28.6 clips a second against 28.5 (benchmarks/RESULTS.md
section 11), so off; `tests/test_gpu.py` reads the feed's frames both ways."""


FUSED_RGB = False
"""Whether `nv12_to_rgb` runs on CUDA as one Triton kernel (`nv12_kernel`: the NV12 read
once, the RGB written once) rather than some twenty torch kernels over float32 frames,
each of which, beside the encoder, waits for SMs on the decode thread's stream. The same
arithmetic: the same pixels to the level (`tests/test_gpu.py`). NVDEC alone read 1.06x
as many clips with it, 1.07x beside bf16 products (`benchmarks/nvdec_scaling.py
--variants cut cut-fused`, 128 clips, an H100), but in a `video.decoder: auto` job on 377
clips it ran 0.518 of the encoder alone against 0.580 (one run each; benchmarks/RESULTS.md
section 11), so it stays off until a run on 1,152 clips or more settles it
(`benchmarks/video_decode.py --variants auto:embedjob.decode.nvdec.FUSED_RGB=True`)."""


BATCH_RGB = 8
"""Frames of a video turned from NV12 to RGB by one `nv12_to_rgb` call. The conversion is
some twenty tensor operations whatever the batch, each a kernel launch by the decode
thread, holding the GIL: a call per frame cost the thread about 20 launches for each of a
1080p clip's 11 sampled frames. Its float32 intermediates peak at some 40 bytes a pixel:
0.7 GB for 8 1080p frames, per decode thread."""


def _fed_session(nvc: Any, kind: tuple[tuple, Any], device: torch.device) -> tuple[Any, torch.cuda.Stream | None]:
    """This thread's decoder for packets of `kind` ((key, codec id)), kept among its
    sessions (`SESSIONS_PER_THREAD`, least recently used dropped first), made on the
    thread's own CUDA stream (none off a GPU), and that stream."""
    key, codec_id = kind
    if device.type == "cuda" and getattr(_sessions, "feed_stream", None) is None:
        _sessions.feed_stream = torch.cuda.Stream(device)
    own = _sessions.feed_stream if device.type == "cuda" else None
    kept = _kept(nvc, device)
    held = kept.pop(key, None)
    if held is None:
        decoder = nvc.CreateDecoder(gpuid=device.index or 0, codec=codec_id, cudacontext=0,
                                    cudastream=own.cuda_stream if own is not None else 0, usedevicememory=True)
        held = (decoder, key)
    kept[key] = held
    _sessions.current = key
    while len(kept) > SESSIONS_PER_THREAD:
        kept.popitem(last=False)
    return held[0], own


def _check_side(width: int, height: int) -> None:
    """Refuses (`SmallStream`) a stream with a side below `MIN_SIDE`."""
    if min(width, height) < MIN_SIDE:
        raise SmallStream(f"a {width} x {height} stream is below {MIN_SIDE} px a side, "
                          "which the GPU's decoder does not read reliably")


MATRICES = {1: "bt709", 2: "bt601", 5: "bt601", 6: "bt601"}
"""matrix_coefficients codes (ITU-T H.273) -> the `COEFFICIENTS` FFmpeg's swscale uses for
them: BT.709; unspecified, BT.470BG and SMPTE 170M all BT.601. Others (BT.2020, FCC,
SMPTE 240M, ...) have tables of their own, which `nv12_to_rgb` does not hold."""


def media_colour(data: bytes | bytearray) -> Colour | None:
    """The conversion decord's FFmpeg gives the video in `data`: its SPS's tags where it
    has them, else its container's (FFmpeg's decoder lets the stream's override the
    demuxer's), else BT.601 and limited range. None where that cannot be told here
    (not MP4/MOV, no readable SPS) or the matrix is not one of `MATRICES`: the session
    then hands RGB, as without `YUV_HERE`."""
    found = sniff_format(data)
    if found is None or found[1] not in ("MP4", "MOV"):
        return None
    facts = mp4_facts(data)
    if facts.stream_tags is None:
        return None
    container = facts.container_tags or SignalTags()
    matrix = next((m for m in (facts.stream_tags.matrix, container.matrix) if m is not None), 2)
    full = next((f for f in (facts.stream_tags.full, container.full) if f is not None), False)
    return Colour(MATRICES[matrix], full) if matrix in MATRICES else None


def _new_session(nvc: Any, path: str, device: torch.device, native: bool) -> Any:
    """A decoder session on `device` handing RGB frames, or NV12 ones with `native`; on this
    thread's own CUDA stream with `OWN_STREAMS`."""
    if OWN_STREAMS and getattr(_sessions, "stream", None) is None:
        _sessions.stream = torch.cuda.Stream(device)
    stream = {"cuda_stream": _sessions.stream.cuda_stream} if OWN_STREAMS else {}
    output = nvc.OutputColorType.NATIVE if native else nvc.OutputColorType.RGB
    return nvc.SimpleDecoder(path, gpu_id=device.index or 0, use_device_memory=True, output_color_type=output, **stream)


def _kind(facts: Any) -> tuple[str, int, int]:
    """What a kept session reports of its stream, which a video reconfigured into it must
    report too: codec and coded size (the frames it hands, NV12 or RGB, are its key's)."""
    return facts.codec_name, facts.width, facts.height


@contextlib.contextmanager
def _spilled(data: bytes | bytearray) -> Iterator[str]:
    """`data` as a file in memory (/dev/shm where there is one) for as long as the
    block runs: a decoder session is reused through `reconfigure_decoder`, which takes
    a path only."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=folder, prefix="embedjob-nvdec-") as spill:
        spill.write(data)
        spill.flush()
        yield spill.name


def _chw(frame: torch.Tensor, coded: tuple[int, int], device: torch.device) -> torch.Tensor:
    """One decoded frame as (3, H, W) uint8 on `device`, copied out of the decoder's
    surface (which it reuses); the decoder hands interleaved RGB (H, W, 3) of the
    stream's `coded` (height, width). A frame of another size is refused: NVDEC pads
    streams below its minimum size (a 66 x 50 H.264 clip came back 192 x 96; see
    `MIN_SIDE`), and those pixels are not the picture."""
    if frame.dim() != 3 or frame.shape[-1] != 3 or frame.dtype != torch.uint8:
        raise RuntimeError(f"the video decoder returned a frame of shape {tuple(frame.shape)} and type {frame.dtype}")
    if tuple(frame.shape[:2]) != coded:
        raise RuntimeError(f"the video decoder returned {frame.shape[1]} x {frame.shape[0]} frames of a {coded[1]} x {coded[0]} stream")
    return frame.to(device).permute(2, 0, 1).contiguous()


def nv12_to_rgb(nv12: torch.Tensor, coded: tuple[int, int], colour: Colour) -> torch.Tensor:
    """One NV12 frame ((H * 3 / 2, W) uint8: the luma rows, then rows of interleaved U, V
    pairs; H may be the stream's height padded by up to 15 rows, as decoder surfaces are),
    or a batch of them ((T, H * 3 / 2, W)), of a stream of `coded` (height, width) as
    (3, H, W) (or (T, 3, H, W)) uint8 RGB, each frame as alone, as FFmpeg's
    swscale makes RGB24 of it for decord: each chroma pair for its 2 x 2 pixels, the
    `colour` matrix, luma from 16-235 and chroma from 16-240 unless `colour.full`. Within
    a level or two of decord's pixels (its fixed-point code rounds its own way), where a
    BT.709 reading of an untagged stream is several levels off on saturated colours.
    Another layout (odd sides, other bit depths) is refused: the caller takes the CPU path."""
    height, width = coded
    rows = nv12.shape[-2] * 2 // 3 if nv12.dim() in (2, 3) else 0  # luma rows: the stream's, or a surface padded to 16
    if (nv12.dim() not in (2, 3) or nv12.dtype != torch.uint8 or nv12.shape[-2] % 3 or not height <= rows < height + 16
            or nv12.shape[-1] != width or height % 2 or width % 2):
        raise RuntimeError(f"the video decoder returned an NV12 frame of shape {tuple(nv12.shape)} and type {nv12.dtype} "
                           f"for a {width} x {height} stream")
    red_v, blue_u, green_u, green_v = (c / 65536 for c in COEFFICIENTS[colour.matrix])
    if colour.full:
        red_v, blue_u, green_u, green_v = (c * 224 / 255 for c in (red_v, blue_u, green_u, green_v))
    if nv12.is_cuda and FUSED_RGB:
        from embedjob.decode import nv12_kernel

        frames = nv12_kernel.nv12_to_rgb(nv12.reshape(-1, *nv12.shape[-2:]), height, width, rows,
                                         (red_v, blue_u, green_u, green_v), colour.full)
        return frames.reshape(*nv12.shape[:-2], *frames.shape[1:])
    batch = nv12.shape[:-2]
    luma = nv12[..., :height, :].float()
    chroma = nv12[..., rows : rows + height // 2, :].reshape(*batch, height // 2, width // 2, 2).float() - 128.0
    chroma = chroma.repeat_interleave(2, dim=-3).repeat_interleave(2, dim=-2)
    u, v = chroma[..., 0], chroma[..., 1]
    if not colour.full:
        luma = (luma - 16.0) * (255 / 219)
    rgb = torch.stack([luma + red_v * v, luma - green_u * u - green_v * v, luma + blue_u * u], dim=-3)
    # floor, not round: FFmpeg's code lands half a level lower than exact arithmetic on average.
    return rgb.floor_().clamp_(0, 255).to(torch.uint8)


def frames_as_decoded(frames: torch.Tensor, video: DeferredVideo) -> torch.Tensor:
    """(T, 3, H, W) frames at their coded size -> what the CPU path makes of them: scaled
    to `video.decoded` (its decode-time bound on frame pixels), then shown under the
    display matrix (mirrored and/or turned, as `video._apply_matrix`)."""
    width, height = video.decoded
    if tuple(frames.shape[-2:]) != (height, width):
        frames = tvF.resize(frames, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    (a, b), (c, d) = video.matrix
    if a != 0:
        if a < 0:
            frames = frames.flip(-1)
        if d < 0:
            frames = frames.flip(-2)
        return frames
    frames = frames.transpose(-1, -2)
    if c < 0:
        frames = frames.flip(-1)
    if b < 0:
        frames = frames.flip(-2)
    return frames
