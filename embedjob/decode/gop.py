"""The packets of a video its sampled frames need (ARCHITECTURE.md: decode).

Sampling 2 frames a second of a 30 fps clip reads every frame when a decoder is asked
for frames by index: it decodes from the keyframe before each one, all pictures in
between included. A sampled frame needs only its own picture, the keyframe it is decoded
from and the reference pictures between them in decode order; pictures nothing refers to
(H.264's nal_ref_idc 0, HEVC's sub-layer non-reference pictures of the highest temporal
layer: about half of the pictures of streams with B-frames), whole groups of pictures no
sample falls in, and everything after the last sample's picture are left out.

Pure functions, no torch: the GPU decoder's packet feed (`nvdec`) reads a stream's
packets into `Picture`s and feeds the decoder the ones `needed_pictures` names; a decode
worker may cut them out of an MP4's samples beforehand (`packet_feed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from embedjob.decode.bitstream import DecoderConfig


@dataclass(frozen=True)
class Picture:
    """One coded picture (a packet) of a stream, in decode order: `pts` its presentation
    time in the stream's units, `key` whether decoding may start at it (a sync sample),
    `reference` whether a later picture may refer to it: True wherever that cannot be told."""

    pts: int
    key: bool
    reference: bool = True


@dataclass(frozen=True)
class SliceKind:
    """What a picture's first slice says of it: `referenced` False where no picture of its
    temporal layer refers to it, `layer` that layer (0 for H.264)."""

    referenced: bool
    layer: int = 0


def nal_units(annex_b: bytes) -> Iterator[bytes]:
    """The NAL units of an Annex B byte stream (units after 3- or 4-byte start codes),
    each from its header on (with the zero byte of a 4-byte start code after it, which no
    header read needs); a unit cut off by the end of `annex_b` is given as it is. A start
    code cannot occur inside a unit (emulation prevention), so a search finds them."""
    at = annex_b.find(b"\x00\x00\x01")
    while at >= 0:
        start = at + 3
        at = annex_b.find(b"\x00\x00\x01", start)
        end = len(annex_b) if at < 0 else at
        yield annex_b[start:end]


def slice_kind(codec: str, unit: bytes | memoryview) -> SliceKind | None:
    """`unit`'s `SliceKind` when it is a slice of a picture (`codec` "h264" or "hevc"),
    else None (parameter sets, SEI, delimiters, an unknown codec or a unit too short)."""
    if codec == "h264" and unit:
        kind = _unit_type(codec, unit)
        return SliceKind(referenced=(unit[0] >> 5) & 3 != 0) if 1 <= kind <= 5 else None
    if codec == "hevc" and len(unit) >= 2:
        kind = _unit_type(codec, unit)
        if kind >= 32:
            return None
        # Even types up to RSV_VCL_N14 are sub-layer non-reference pictures.
        return SliceKind(referenced=not (kind <= 14 and kind % 2 == 0), layer=(unit[1] & 7) - 1)
    return None


def prefixed_units(sample: bytes | memoryview, length_size: int) -> list[bytes | memoryview]:
    """The NAL units of an MP4 sample, each after its `length_size`-byte big-endian
    length (a length of 0 gives none). ValueError where a length runs past the sample."""
    units, at = [], 0
    while at + length_size <= len(sample):
        size = int.from_bytes(sample[at : at + length_size], "big")
        at += length_size
        if at + size > len(sample):
            raise ValueError(f"a NAL unit of {size} bytes runs past its sample")
        if size:
            units.append(sample[at : at + size])
        at += size
    return units


def picture_kind(codec: str, units: Iterable[bytes | memoryview]) -> SliceKind | None:
    """The `SliceKind` of the picture made of `units` (an access unit's NAL units, or
    those of its head): referenced where any of its slices is, of its first slice's
    layer. None where no slice is found (then the caller reads more of the packet, or
    takes it for a reference)."""
    kinds = [kind for kind in (slice_kind(codec, unit) for unit in units) if kind is not None]
    if not kinds:
        return None
    return SliceKind(referenced=any(kind.referenced for kind in kinds), layer=kinds[0].layer)


def pictures(packets: Sequence[tuple[int, bool, SliceKind | None]]) -> list[Picture]:
    """(pts, key, kind) of each packet in decode order -> `Picture`s. A sub-layer
    non-reference picture is a reference for none only on the highest temporal layer in
    the stream (pictures refer to their own layer and those below); a picture whose kind
    is unknown is taken for a reference."""
    top = max((kind.layer for _, _, kind in packets if kind is not None), default=0)
    return [
        Picture(pts, key, reference=kind is None or kind.referenced or kind.layer < top)
        for pts, key, kind in packets
    ]


def display_order(stream: Sequence[Picture]) -> list[int]:
    """Decode positions of `stream`'s pictures in the order they are shown (by pts, ties in
    decode order): the frame index decord and the planners count in."""
    return sorted(range(len(stream)), key=lambda k: (stream[k].pts, k))


def shown_at(stream: Sequence[Picture]) -> dict[int, int]:
    """Each decode position's display index (`display_order` inverted)."""
    return {k: index for index, k in enumerate(display_order(stream))}


def needed_pictures(stream: Sequence[Picture], wanted: Iterable[int]) -> list[int]:
    """Decode positions, ascending, of the pictures that decoding the frames shown at the
    display indices `wanted` (see `display_order`) needs.

    For each wanted picture p: the last keyframe k at or before it in decode order that is
    shown no later than it (a keyframe shown after p, with p among its leading pictures,
    cannot start p's decoding), then the reference pictures from k to p, and p. The
    leading pictures of k (decoded after it, shown before it, referring to pictures before
    k) are left out: pictures shown after a keyframe do not refer to its leading ones, in a
    stream that may be decoded from that keyframe. Where p is itself a leading picture of a
    later keyframe, it may refer to any picture before that one, so every reference from k
    on is fed, and k moves back to the keyframe the earliest of its own leading references
    is decoded from, until one has none. Without such a keyframe p is decoded from the start.

    Invariants: every wanted picture is in the result; a picture that is no reference is
    there only if it is wanted; nothing after the last wanted picture in decode order is."""
    order = display_order(stream)
    needed: set[int] = set()
    for p in sorted({order[index] for index in wanted}):
        start = _start(stream, p)
        if any(stream[k].key for k in range(start + 1, p)):
            while (lead := _leading_reference(stream, start)) is not None and _start(stream, lead) < start:
                start = _start(stream, lead)
            needed.update(q for q in range(start, p) if stream[q].reference)
        else:
            needed.update(q for q in range(start, p) if stream[q].reference and stream[q].pts >= stream[start].pts)
        needed.add(p)
    return sorted(needed)


def _start(stream: Sequence[Picture], p: int) -> int:
    """The last keyframe at or before decode position p shown no later than p, else 0."""
    return next((k for k in range(p, -1, -1) if stream[k].key and stream[k].pts <= stream[p].pts), 0)


def _leading_reference(stream: Sequence[Picture], key: int) -> int | None:
    """The first reference picture decoded after `key`, before the next keyframe, and shown
    before `key`: a leading picture that may refer to pictures before `key`."""
    for q in range(key + 1, len(stream)):
        if stream[q].key:
            return None
        if stream[q].reference and stream[q].pts < stream[key].pts:
            return q
    return None


@dataclass(frozen=True)
class PacketFeed:
    """The pictures a video's sampled frames need, ready for the GPU's decoder: `codec`
    "h264" or "hevc", `size` the (width, height) they decode to, `stream` the pictures in
    decode order as Annex B (each unit after a 4-byte start code, the parameter sets before
    each keyframe that lacks them), one (offset, size) in it for each in `bounds`, and
    `shown` each one's display index, which the decoder is handed as its pts and hands
    back with its frame."""

    codec: str
    size: tuple[int, int]
    stream: bytes
    bounds: tuple[tuple[int, int], ...]
    shown: tuple[int, ...]


PARAMETER_SETS = {"h264": {7, 8}, "hevc": {32, 33, 34}}
"""NAL unit types of each codec's parameter sets (SPS, PPS; VPS, SPS, PPS)."""


def packet_feed(config: DecoderConfig, units: Sequence[Sequence[bytes | memoryview]], stream: Sequence[Picture],
                wanted: Iterable[int], size: tuple[int, int]) -> PacketFeed:
    """The `PacketFeed` for the frames shown at display indices `wanted` of a stream of
    `config`'s codec whose samples (decode order) hold the NAL `units` and are the
    pictures `stream` (`sample_pictures`)."""
    shown = shown_at(stream)
    needed = needed_pictures(stream, wanted)
    packets = []
    for n, k in enumerate(needed):
        nal = units[k]
        if (stream[k].key or n == 0) and not any(_unit_type(config.codec, unit) in PARAMETER_SETS[config.codec] for unit in nal):
            nal = [*config.parameter_sets, *nal]
        packets.append(b"".join(part for unit in nal for part in (b"\x00\x00\x00\x01", unit)))
    offsets = [0]
    for packet in packets:
        offsets.append(offsets[-1] + len(packet))
    return PacketFeed(config.codec, size, b"".join(packets), tuple(zip(offsets, map(len, packets))), tuple(shown[k] for k in needed))


def sample_pictures(codec: str, units: Sequence[Sequence[bytes | memoryview]], times: Sequence[int], sync: Sequence[bool]) -> list[Picture]:
    """The `Picture`s of an MP4 track's samples: each one's NAL `units`, composition time and sync mark."""
    return pictures([(t, key, picture_kind(codec, nal)) for t, key, nal in zip(times, sync, units, strict=True)])


def _unit_type(codec: str, unit: bytes | memoryview) -> int:
    """The NAL unit type in a (non-empty) unit's header."""
    return (unit[0] & 0x1F) if codec == "h264" else (unit[0] >> 1) & 0x3F
