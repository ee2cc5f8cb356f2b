"""Container facts read from the bytes before decord opens them: MP4/MOV boxes and Matroska elements.

decord (FFmpeg 4.1) exposes neither a frame size before decoding nor the display matrix's
mirroring, and it decodes every video track it is given. So the few facts the video
decoder needs are read here, from our own walk of the container:

- MP4/MOV: the first video track's codec, frame size and colour tags (`stsd`: its `colr`
  box, and the VUI of the SPS in its `avcC` or `hvcC`, `bitstream`), its display matrix
  composed with the movie's (`tkhd`, `mvhd`), patches that leave decord only that track
  with an identity matrix (other video `trak` boxes renamed `free`: same size, so no
  offset moves), and whether a top-level box runs past the end.
- Matroska: the first video track's `PixelWidth`/`PixelHeight` and the segment's declared
  duration, from the file's first `MATROSKA_HEAD` bytes.

Every parser stops at a header that does not fit or makes no sense: a damaged container
yields fewer facts, never an exception. See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from embedjob.decode.bitstream import SequenceFacts, SignalTags, avcc_sps, h264_facts, hevc_facts, hvcc_sps

Matrix = tuple[tuple[int, int], tuple[int, int]]
_IDENTITY: Matrix = ((1, 0), (0, 1))
_IDENTITY_MATRIX_BYTES = struct.pack(">9i", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)


@dataclass
class Mp4Facts:
    """What we need from an MP4/MOV before decord sees it.

    `matrix`: the 2x2 display transform of the first video track composed with the
    movie's, in ISO 14496-12's row-vector convention (displayed [x y] = [x y] @ matrix),
    entries in {-1, 0, 1}; identity when absent or not a multiple of 90 degrees.
    `patches`: (offset, bytes) writes that leave decord only the first video track,
    with an identity display matrix. `truncated`: a top-level box runs past the end.
    `frame_size`: (width, height) of the first video track's sample entry, None if absent.
    `container_tags`: its `colr` box's colour tags, None without one (or with an ICC
    profile instead); `stream_tags` and `stream_size`: its SPS's tags and the (width,
    height) its frames decode to (`avcC`/`hvcC`), None where the entry holds no SPS or
    it cannot be read.
    """

    video_codecs: list[str] = field(default_factory=list)
    matrix: Matrix = _IDENTITY
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    truncated: bool = False
    frame_size: tuple[int, int] | None = None
    container_tags: SignalTags | None = None
    stream_tags: SignalTags | None = None
    stream_size: tuple[int, int] | None = None


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, declared end) of each box in data[start:end]. The declared
    end may lie past the data (truncated file); walking stops at a header that does
    not fit or makes no sense."""
    end = min(end, len(data))
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            if pos + 16 > end:
                return
            size = struct.unpack_from(">Q", data, pos + 8)[0]
            header = 16
        elif size == 0:
            size = end - pos
        if size < header:
            return
        yield kind, pos + header, pos + size
        pos += size


def mp4_facts(data: bytes) -> Mp4Facts:
    """The facts of an MP4/MOV; a damaged one yields what its readable boxes hold."""
    facts = Mp4Facts()
    for kind, start, end in _boxes(data, 0, len(data)):
        facts.truncated = facts.truncated or end > len(data)
        if kind == b"moov":
            _read_moov(data, start, end, facts)
    return facts


def _read_moov(data: bytes, start: int, end: int, facts: Mp4Facts) -> None:
    movie_matrix = _IDENTITY
    for kind, box_start, box_end in _boxes(data, start, end):
        if kind == b"mvhd" and box_start < len(data):
            offset = box_start + (48 if data[box_start] == 1 else 36)
            movie_matrix = _read_matrix(data, offset)
            if movie_matrix != _IDENTITY:
                facts.patches.append((offset, _IDENTITY_MATRIX_BYTES))
        elif kind == b"trak":
            _read_trak(data, box_start, box_end, box_start - 8, facts)
    facts.matrix = _matmul(facts.matrix, movie_matrix)


def _read_trak(data: bytes, start: int, end: int, box_offset: int, facts: Mp4Facts) -> None:
    if not _is_video(data, start, end):
        return
    tkhd = _child(data, start, end, b"tkhd")
    mdia = _child(data, start, end, b"mdia")
    minf = _child(data, *mdia, b"minf")
    stbl = _child(data, *minf, b"stbl") if minf else None
    stsd = _child(data, *stbl, b"stsd") if stbl else None
    codec = data[stsd[0] + 12 : stsd[0] + 16].decode("latin-1") if stsd else ""
    facts.video_codecs.append(codec or "?")
    if len(facts.video_codecs) > 1:
        # Hide later video tracks from FFmpeg: same size, unknown to the demuxer, skipped.
        facts.patches.append((box_offset + 4, b"free"))
        return
    if stsd:
        facts.frame_size = _sample_entry_size(data, stsd[0])
        facts.container_tags, stream = _sample_entry_facts(data, stsd[0], codec)
        if stream is not None:
            facts.stream_tags, facts.stream_size = stream.tags, stream.size
    if tkhd and tkhd[0] < len(data):
        offset = tkhd[0] + (52 if data[tkhd[0]] == 1 else 40)
        facts.matrix = _read_matrix(data, offset)
        if facts.matrix != _IDENTITY:
            facts.patches.append((offset, _IDENTITY_MATRIX_BYTES))


@dataclass
class Mp4Samples:
    """The coded samples of an MP4/MOV's first video track, in decode order: where each
    lies in the file (`offsets`, `sizes`), when it is decoded (`decode`) and shown (`times`:
    composition times in the track's units; their order is the display order, whatever the
    edit list shifts), whether decoding may start at it (`sync`); the track's `trak` box
    (`track`: its payload start and end), its sample entry type (`codec`) and
    the payload of its decoder configuration box (`config`: `avcC` or `hvcC`); `cut`:
    whether its edit list leaves samples unshown (more than one edit that shows media, or
    one that starts after the first composition time), whose frames decord still counts."""

    codec: str
    config: bytes
    offsets: list[int]
    sizes: list[int]
    times: list[int]
    sync: list[bool]
    decode: list[int]
    track: tuple[int, int]
    cut: bool = False


def mp4_samples(data: bytes) -> Mp4Samples | None:
    """The first video track's samples (`Mp4Samples`), or None where they cannot all be
    placed: no video track, no `avcC`/`hvcC` sample entry or more than one sample entry,
    sample tables missing, not adding up or pointing past the end of `data` (a fragmented
    MP4 keeps its samples in `moof` boxes, which are not read here)."""
    trak = _first_video_trak(data)
    mdia = _child(data, *trak, b"mdia") if trak else None
    minf = _child(data, *mdia, b"minf") if mdia else None
    stbl = _child(data, *minf, b"stbl") if minf else None
    if stbl is None:
        return None
    boxes = {kind: (start, end) for kind, start, end in _boxes(data, *stbl)}
    if not {b"stsd", b"stts", b"stsz", b"stsc"} <= boxes.keys() or not {b"stco", b"co64"} & boxes.keys():
        return None
    stsd = boxes[b"stsd"][0]
    codec = data[stsd + 12 : stsd + 16].decode("latin-1")
    # One sample description: the copies and cuts made of these samples describe them all by it.
    if codec not in _PARAMETER_SETS or stsd + 16 > len(data) or data[stsd + 4 : stsd + 8] != b"\x00\x00\x00\x01":
        return None
    entry = stsd + 8
    try:
        config = _child(data, entry + 8 + _VISUAL_SAMPLE_ENTRY, entry + struct.unpack_from(">I", data, entry)[0], _PARAMETER_SETS[codec][0])
        sizes = _sample_sizes(data, *boxes[b"stsz"])
        offsets = _sample_offsets(data, boxes, sizes)
        decode, times = _sample_times(data, boxes, len(sizes))
        sync = _sync_samples(data, boxes.get(b"stss"), len(sizes))
        starts = _edit_starts(data, trak)
    except (struct.error, ValueError):
        return None
    if config is None or not sizes or any(o + n > len(data) for o, n in zip(offsets, sizes)):
        return None
    cut = len(starts) > 1 or any(start > min(times) for start in starts)
    return Mp4Samples(codec, bytes(data[config[0] : config[1]]), offsets, sizes, times, sync, decode, trak, cut)


def _edit_starts(data: bytes, trak: tuple[int, int]) -> list[int]:
    """The media time each edit of the track's edit list (`edts`/`elst`) starts showing
    at, leaving out empty edits (media time -1, a delay)."""
    edts = _child(data, *trak, b"edts")
    elst = _child(data, *edts, b"elst") if edts else None
    if elst is None:
        return []
    entries = _table(data, elst, ">QqHH" if data[elst[0]] == 1 else ">IiHH")
    return [media for _, media, _, _ in entries if media != -1]


def mp4_with_samples(data: bytes | bytearray, samples: Mp4Samples, keep: list[int]) -> bytes | bytearray:
    """`data` (an MP4/MOV whose first video track's samples are `samples`) made to hold
    only the samples at decode positions `keep` (ascending) in that track, and no other
    track: its `moov` renamed `free` (same size, so no sample moves) and a new one
    appended, copying the movie and track headers (matrices included, so pass the bytes
    decord is given) and the sample description, with sample tables listing each kept
    sample as a chunk of its own, at its decode and composition times. No edit list: the
    kept samples are shown in their order, which is all a frame index counts. Only the
    first kept sample is a sync sample, so a reader decodes the copy in order from it
    (every picture in it is needed anyway) and never seeks into an open GOP, whose
    leading pictures decord misreads after a seek."""
    moov = _spans(data, 0, len(data))[b"moov"]
    movie = _spans(data, moov[1], moov[2])
    track = _spans(data, *samples.track)
    mdia = _spans(data, track[b"mdia"][1], track[b"mdia"][2])
    minf = _spans(data, mdia[b"minf"][1], mdia[b"minf"][2])
    stbl = _spans(data, minf[b"stbl"][1], minf[b"stbl"][2])
    decode = samples.decode
    ends = [decode[k] for k in keep[1:]] + [decode[keep[-1]] + max(decode[keep[-1]] - decode[keep[-2]], 1) if len(keep) > 1 else decode[keep[-1]] + 1]
    tables = b"".join([
        _raw(data, stbl[b"stsd"]),
        _full_box(b"stts", [struct.pack(">II", 1, end - decode[k]) for k, end in zip(keep, ends)]),
        _full_box(b"ctts", [struct.pack(">Ii", 1, samples.times[k] - decode[k]) for k in keep], version=1),
        _full_box(b"stss", [struct.pack(">I", 1)]),
        _box(b"stsz", struct.pack(">4xII", 0, len(keep)) + b"".join(struct.pack(">I", samples.sizes[k]) for k in keep)),
        _full_box(b"stsc", [struct.pack(">III", 1, 1, 1)]),
        _full_box(b"co64", [struct.pack(">Q", samples.offsets[k]) for k in keep]),
    ])
    media_info = b"".join(_raw(data, span) for kind, span in _all_spans(data, *mdia[b"minf"][1:]) if kind != b"stbl") + _box(b"stbl", tables)
    media = b"".join(_raw(data, span) for kind, span in _all_spans(data, *track[b"mdia"][1:]) if kind != b"minf") + _box(b"minf", media_info)
    track_box = _box(b"trak", _raw(data, track[b"tkhd"]) + _box(b"mdia", media))
    new_moov = _box(b"moov", _raw(data, movie[b"mvhd"]) + track_box)
    return data[: moov[0] + 4] + b"free" + data[moov[0] + 8 :] + new_moov


def _all_spans(data: bytes, start: int, end: int) -> Iterator[tuple[bytes, tuple[int, int, int]]]:
    """(type, (box start, payload start, end)) of each box in data[start:end]."""
    pos = start
    for kind, payload, box_end in _boxes(data, start, end):
        yield kind, (pos, payload, box_end)
        pos = box_end


def _spans(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int, int]]:
    """The first box of each type in data[start:end], as `_all_spans` gives it."""
    found: dict[bytes, tuple[int, int, int]] = {}
    for kind, span in _all_spans(data, start, end):
        found.setdefault(kind, span)
    return found


def _is_video(data: bytes, start: int, end: int) -> bool:
    """Whether the `trak` payload data[start:end] is a video track. Only mdia's own hdlr
    names the track type; QuickTime also puts a data-handler hdlr inside minf."""
    mdia = _child(data, start, end, b"mdia")
    hdlr = _child(data, *mdia, b"hdlr") if mdia else None
    return bool(hdlr) and data[hdlr[0] + 8 : hdlr[0] + 12] == b"vide"


def _raw(data: bytes, span: tuple[int, int, int]) -> bytes:
    return bytes(data[span[0] : span[2]])


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def _full_box(kind: bytes, entries: list[bytes], version: int = 0) -> bytes:
    """A full box of version `version`, no flags, its entry count, then `entries`."""
    return _box(kind, struct.pack(">BxxxI", version, len(entries)) + b"".join(entries))


def _first_video_trak(data: bytes) -> tuple[int, int] | None:
    """(payload start, end) of the first video track's `trak` box, as `_read_trak` finds it."""
    moov = _child(data, 0, len(data), b"moov")
    for kind, start, end in _boxes(data, *moov) if moov else ():
        if kind == b"trak" and _is_video(data, start, end):
            return start, end
    return None


def _table(data: bytes, box: tuple[int, int], fmt: str) -> list[tuple[int, ...]]:
    """A full box's entries after its version, flags and entry count, each `fmt` (struct)."""
    start, end = box
    count = struct.unpack_from(">I", data, start + 4)[0]
    size = struct.calcsize(fmt)
    if start + 8 + count * size > min(end, len(data)):
        raise ValueError("a sample table runs past its box")
    return list(struct.iter_unpack(fmt, data[start + 8 : start + 8 + count * size]))


def _sample_sizes(data: bytes, start: int, end: int) -> list[int]:
    size, count = struct.unpack_from(">II", data, start + 4)
    if size:
        if size * count > len(data):
            raise ValueError("stsz declares more sample bytes than the file holds")
        return [size] * count
    if start + 12 + 4 * count > min(end, len(data)):
        raise ValueError("stsz runs past its box")
    return list(struct.unpack_from(f">{count}I", data, start + 12))


def _sample_offsets(data: bytes, boxes: dict[bytes, tuple[int, int]], sizes: list[int]) -> list[int]:
    """Each sample's file offset: chunks (`stco` or `co64`) hold runs of samples (`stsc`)."""
    chunks = [c for (c,) in (_table(data, boxes[b"stco"], ">I") if b"stco" in boxes else _table(data, boxes[b"co64"], ">Q"))]
    runs = _table(data, boxes[b"stsc"], ">III")
    offsets: list[int] = []
    for k, (first, per_chunk, _) in enumerate(runs):
        last = runs[k + 1][0] - 1 if k + 1 < len(runs) else len(chunks)
        for chunk in range(first - 1, min(last, len(chunks))):
            at = chunks[chunk]
            for _ in range(per_chunk):
                if len(offsets) == len(sizes):
                    break
                offsets.append(at)
                at += sizes[len(offsets) - 1]
    if len(offsets) != len(sizes):
        raise ValueError("the chunks do not hold every sample")
    return offsets


def _sample_times(data: bytes, boxes: dict[bytes, tuple[int, int]], count: int) -> tuple[list[int], list[int]]:
    """Decode times (`stts`), and those plus composition offsets (`ctts`): read signed
    whatever its version says, as FFmpeg does (muxers write negative offsets into version 0 boxes)."""
    times, at = [], 0
    for samples, delta in _table(data, boxes[b"stts"], ">II"):
        if len(times) + samples > count:
            raise ValueError("stts counts more samples than stsz")
        times += range(at, at + samples * delta, delta) if delta else [at] * samples
        at += samples * delta
    if len(times) != count:
        raise ValueError("stts and stsz count different samples")
    if b"ctts" in boxes:
        shifted: list[int] = []
        for samples, offset in _table(data, boxes[b"ctts"], ">Ii"):
            if len(shifted) + samples > count:
                raise ValueError("ctts counts more samples than stsz")
            shifted += [offset] * samples
        if len(shifted) != count:
            raise ValueError("ctts and stsz count different samples")
        return times, [t + o for t, o in zip(times, shifted)]
    return times, times


def _sync_samples(data: bytes, stss: tuple[int, int] | None, count: int) -> list[bool]:
    """Whether each sample is a sync sample: those `stss` lists (1-based), or all without one."""
    if stss is None:
        return [True] * count
    sync = [False] * count
    for (number,) in _table(data, stss, ">I"):
        if not 1 <= number <= count:
            raise ValueError("stss names a sample that is not there")
        sync[number - 1] = True
    return sync


def _sample_entry_size(data: bytes, stsd: int) -> tuple[int, int] | None:
    """(width, height) of the first VisualSampleEntry of an `stsd` payload (ISO 14496-12:
    version/flags, entry count, then the entry's 8-byte header and 24 bytes before them)."""
    offset = stsd + 8 + 32
    if offset + 4 > len(data):
        return None
    width, height = struct.unpack_from(">HH", data, offset)
    return (width, height) if width and height else None


_VISUAL_SAMPLE_ENTRY = 78
"""Bytes of a VisualSampleEntry after its box header, before its child boxes."""

_PARAMETER_SETS = {"avc1": (b"avcC", avcc_sps, h264_facts), "avc3": (b"avcC", avcc_sps, h264_facts),
                   "hvc1": (b"hvcC", hvcc_sps, hevc_facts), "hev1": (b"hvcC", hvcc_sps, hevc_facts)}
"""Sample entry type -> its decoder configuration box, the SPS in it and what that SPS says."""


def _sample_entry_facts(data: bytes, stsd: int, codec: str) -> tuple[SignalTags | None, SequenceFacts | None]:
    """The `colr` box's tags and what the SPS says of the first sample entry of an `stsd`
    payload (see `Mp4Facts`)."""
    if stsd + 16 > len(data):
        return None, None
    entry = stsd + 8
    children = entry + 8 + _VISUAL_SAMPLE_ENTRY, entry + struct.unpack_from(">I", data, entry)[0]
    colr = _child(data, *children, b"colr")
    container = _colr_tags(data[colr[0] : colr[1]]) if colr else None
    if codec not in _PARAMETER_SETS:
        return container, None
    kind, first_sps, read = _PARAMETER_SETS[codec]
    config = _child(data, *children, kind)
    sps = first_sps(data[config[0] : config[1]]) if config else None
    return container, read(sps) if sps else None


def _colr_tags(colr: bytes) -> SignalTags | None:
    """The tags of a `colr` payload: `nclx` (ISO 14496-12: primaries, transfer, matrix,
    then the full-range bit) or QuickTime's `nclc` (no range); None for an ICC profile."""
    if len(colr) < 10 or colr[:4] not in (b"nclx", b"nclc"):
        return None
    matrix = struct.unpack_from(">H", colr, 8)[0]
    full = bool(colr[10] & 0x80) if colr[:4] == b"nclx" and len(colr) > 10 else None
    return SignalTags(matrix=matrix, full=full)


def _child(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    """(payload start, declared end) of the first child box of this type, or None."""
    for found, box_start, box_end in _boxes(data, start, end):
        if found == kind:
            return box_start, box_end
    return None


def _read_matrix(data: bytes, offset: int) -> Matrix:
    """The 2x2 part of a 16.16 display matrix, snapped to {-1, 0, 1}; identity unless it
    is a rotation and/or mirror by multiples of 90 degrees (no scale, no shear)."""
    if offset + 36 > len(data):
        return _IDENTITY
    a, b, _, c, d = (round(v / 0x10000) for v in struct.unpack_from(">5i", data, offset))
    keeps_axes = a in (-1, 1) and d in (-1, 1) and b == 0 and c == 0
    swaps_axes = b in (-1, 1) and c in (-1, 1) and a == 0 and d == 0
    return ((a, b), (c, d)) if keeps_axes or swaps_axes else _IDENTITY


def _matmul(left: Matrix, right: Matrix) -> Matrix:
    (a, b), (c, d) = left
    (e, f), (g, h) = right
    return ((a * e + b * g, a * f + b * h), (c * e + d * g, c * f + d * h))


MATROSKA_HEAD = 1 << 16
"""Bytes of a Matroska file searched for its header elements (Segment > Info, Tracks)."""
_EBML_SEGMENT, _EBML_INFO, _EBML_SCALE, _EBML_DURATION = 0x18538067, 0x1549A966, 0x2AD7B1, 0x4489
_EBML_TRACKS, _EBML_TRACK_ENTRY, _EBML_TRACK_TYPE, _EBML_VIDEO = 0x1654AE6B, 0xAE, 0x83, 0xE0
_EBML_PIXEL_WIDTH, _EBML_PIXEL_HEIGHT = 0xB0, 0xBA
_MATROSKA_VIDEO_TRACK = 1


def matroska_frame_size(head: bytes) -> tuple[int, int] | None:
    """(PixelWidth, PixelHeight) of the first video track in Segment > Tracks, None when
    the file's start does not hold it."""
    segment = _ebml_child(head, 0, len(head), _EBML_SEGMENT)
    tracks = segment and _ebml_child(head, *segment, _EBML_TRACKS)
    if not tracks:
        return None
    for ident, start, stop in _ebml_elements(head, *tracks):
        kind = _ebml_child(head, start, stop, _EBML_TRACK_TYPE) if ident == _EBML_TRACK_ENTRY else None
        if kind and int.from_bytes(head[kind[0] : kind[1]], "big") == _MATROSKA_VIDEO_TRACK:
            video = _ebml_child(head, start, stop, _EBML_VIDEO)
            width = video and _ebml_child(head, *video, _EBML_PIXEL_WIDTH)
            height = video and _ebml_child(head, *video, _EBML_PIXEL_HEIGHT)
            if not (width and height):
                return None
            size = (int.from_bytes(head[width[0] : width[1]], "big"), int.from_bytes(head[height[0] : height[1]], "big"))
            return size if all(size) else None
    return None


def matroska_duration(head: bytes) -> float | None:
    """Segment > Info > Duration (seconds, scaled by TimecodeScale) from the file's start."""
    segment = _ebml_child(head, 0, len(head), _EBML_SEGMENT)
    info = segment and _ebml_child(head, *segment, _EBML_INFO)
    if not info:
        return None
    duration = _ebml_child(head, *info, _EBML_DURATION)
    if not duration or duration[1] - duration[0] not in (4, 8):
        return None
    raw = head[duration[0] : duration[1]]
    value = struct.unpack(">f" if len(raw) == 4 else ">d", raw)[0]
    scale = _ebml_child(head, *info, _EBML_SCALE)
    nanoseconds = int.from_bytes(head[scale[0] : scale[1]], "big") if scale else 1_000_000
    return value * nanoseconds / 1e9


_EBML_CLUSTER, _EBML_TIMECODE, _EBML_SIMPLE_BLOCK, _EBML_BLOCK_GROUP, _EBML_BLOCK = 0x1F43B675, 0xE7, 0xA3, 0xA0, 0xA1


def matroska_cut_span(data: bytes) -> float | None:
    """Seconds from the first block to the last one whose header `data` holds, where the
    Segment declares more bytes than `data` has (a file cut short); None where it fits
    or its size is unknown. Read from the clusters' timecodes alone, so a cut file is
    told before a decoder opens it (decord's demuxer has crashed on some)."""
    pos = 0
    while pos < len(data):
        ident, pos = _ebml_vint(data, pos, keep_marker=True)
        size, pos = _ebml_vint(data, pos, keep_marker=False)
        if ident is None or size is None:
            return None
        if ident == _EBML_SEGMENT:
            break
        pos += max(size, 0)
    else:
        return None
    if size < 0 or pos + size <= len(data):
        return None
    info = _ebml_child(data, pos, len(data), _EBML_INFO)
    scale = info and _ebml_child(data, *info, _EBML_SCALE)
    nanoseconds = int.from_bytes(data[scale[0] : scale[1]], "big") if scale else 1_000_000
    times = [t for ident, start, stop in _ebml_elements(data, pos, len(data)) if ident == _EBML_CLUSTER
             for t in _block_times(data, start, stop)]
    return (max(times) - min(times)) * nanoseconds / 1e9 if times else 0.0


def _block_times(data: bytes, start: int, stop: int) -> list[int]:
    """The timecodes (cluster timecode plus each block's own) of the blocks of the cluster in data[start:stop]."""
    timecode = _ebml_child(data, start, stop, _EBML_TIMECODE)
    if timecode is None:
        return []
    base, times = int.from_bytes(data[timecode[0] : timecode[1]], "big"), []
    for ident, first, last in _ebml_elements(data, start, stop):
        if ident == _EBML_SIMPLE_BLOCK:
            block: tuple[int, int] | None = (first, last)
        else:
            block = _ebml_child(data, first, last, _EBML_BLOCK) if ident == _EBML_BLOCK_GROUP else None
        if block:
            track, at = _ebml_vint(data, block[0], keep_marker=False)
            if track is not None and at + 2 <= block[1]:
                times.append(base + int.from_bytes(data[at : at + 2], "big", signed=True))
    return times


def _ebml_child(data: bytes, start: int, end: int, wanted: int) -> tuple[int, int] | None:
    """(payload start, payload end) of the first element `wanted` in data[start:end]."""
    for ident, payload, stop in _ebml_elements(data, start, end):
        if ident == wanted:
            return payload, stop
    return None


def _ebml_elements(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(id, payload start, payload end) of each element in data[start:end]; an unknown
    or overlong size runs to `end`; walking stops at a header that cannot be read."""
    pos = start
    while pos < end:
        ident, pos = _ebml_vint(data, pos, keep_marker=True)
        size, pos = _ebml_vint(data, pos, keep_marker=False)
        if ident is None or size is None:
            return
        stop = min(end, pos + size) if size >= 0 else end
        yield ident, pos, stop
        pos = stop


def _ebml_vint(data: bytes, pos: int, keep_marker: bool) -> tuple[int | None, int]:
    """An EBML variable-length integer at `pos`; -1 for the reserved "unknown size"."""
    if pos >= len(data) or data[pos] == 0:
        return None, pos
    length = 8 - data[pos].bit_length() + 1
    if pos + length > len(data):
        return None, pos
    value = int.from_bytes(data[pos : pos + length], "big")
    if keep_marker:
        return value, pos + length
    value &= (1 << (7 * length)) - 1
    return (-1 if value == (1 << (7 * length)) - 1 else value), pos + length


def patched(data: bytes, patches: list[tuple[int, bytes]]) -> bytes | bytearray:
    """`data` with each (offset, bytes) written over it; the bytes themselves when there
    is nothing to write (no copy)."""
    if not patches:
        return data
    out = bytearray(data)
    for offset, value in patches:
        out[offset : offset + len(value)] = value
    return out
