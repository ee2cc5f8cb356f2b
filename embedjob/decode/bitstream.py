"""Colour tags and frame size of an H.264 or HEVC stream, read from its sequence parameter set (SPS).

A stream says how its YUV turns to RGB in two places: its container (an MP4/MOV `colr`
box) and its own SPS, in the VUI (video usability information: `matrix_coefficients`
and `video_full_range_flag`, ITU-T H.264 Annex E and H.265 Annex E). decord's FFmpeg
decodes the SPS, and its tags override the container's, so the GPU's decoder path
(`nvdec.YUV_HERE`), which converts NV12 itself, must read the SPS too: PyNvVideoCodec
reports only the container's tags. The SPS also gives the size the frames decode to
(coded, less its cropping window), which the decode workers otherwise learn by decoding
a frame. This module walks an SPS as far as its VUI's colour fields and no further; the
parameter sets themselves come from the container (`containers.mp4_facts`: the `avcC` or
`hvcC` box of the first video track).

Pure Python, no torch. A parameter set that ends early or breaks the syntax gives None
(the caller does not guess), never an exception. See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

H264_SPS, HEVC_SPS = 7, 33
"""The NAL unit types of an H.264 and an HEVC sequence parameter set."""

_H264_HIGH_PROFILES = {100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135}
"""profile_idc values whose SPS carries chroma format, bit depths and scaling lists."""


@dataclass(frozen=True)
class SignalTags:
    """What a stream's tags say of its YUV: `matrix` the matrix_coefficients code (ITU-T
    H.273: 1 BT.709, 2 unspecified, 5 and 6 BT.601, 9 BT.2020, ...), `full` whether
    luma and chroma span 0-255 (full range); None where the tag is absent."""

    matrix: int | None = None
    full: bool | None = None


@dataclass(frozen=True)
class SequenceFacts:
    """What an SPS says: its colour `tags`, and the (width, height) its frames decode to
    (the coded size less the cropping or conformance window)."""

    tags: SignalTags
    size: tuple[int, int]


class _Ended(Exception):
    """The parameter set ended before the field asked for."""


class _Bits:
    """An MSB-first bit reader over a NAL unit's payload (emulation prevention removed)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def u(self, count: int) -> int:
        value = 0
        for _ in range(count):
            byte = self.pos >> 3
            if byte >= len(self.data):
                raise _Ended
            value = (value << 1) | ((self.data[byte] >> (7 - (self.pos & 7))) & 1)
            self.pos += 1
        return value

    def flag(self) -> bool:
        return bool(self.u(1))

    def ue(self) -> int:
        """An unsigned Exp-Golomb code; more than 31 leading zeros is no valid field."""
        zeros = 0
        while not self.u(1):
            zeros += 1
            if zeros > 31:
                raise _Ended
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        code = self.ue()
        return (code + 1) // 2 if code & 1 else -(code // 2)


def payload(nal: bytes, header: int) -> bytes:
    """A NAL unit's payload: its `header` bytes dropped (1 for H.264, 2 for HEVC) and
    every emulation prevention byte (the 3 of 00 00 03) removed."""
    out = bytearray()
    zeros = 0
    for byte in nal[header:]:
        if zeros >= 2 and byte == 3:
            zeros = 0
            continue
        out.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return bytes(out)


def h264_facts(sps: bytes) -> SequenceFacts | None:
    """The facts of an H.264 SPS NAL unit (header byte included); None where it cannot
    be read to its VUI."""
    return _walked(sps, 1, _h264)


def hevc_facts(sps: bytes) -> SequenceFacts | None:
    """The facts of an HEVC SPS NAL unit (2-byte header included); None where it cannot
    be read to its VUI."""
    return _walked(sps, 2, _hevc)


def _walked(nal: bytes, header: int, walk: Callable[[_Bits], SequenceFacts]) -> SequenceFacts | None:
    try:
        return walk(_Bits(payload(nal, header)))
    except _Ended:
        return None


def avcc_sps(config: bytes) -> bytes | None:
    """The first SPS of an `avcC` box's payload, or None (see `_record_units`)."""
    return _first_of(_record_units("h264", config), H264_SPS)


def hvcc_sps(config: bytes) -> bytes | None:
    """The first SPS of an `hvcC` box's payload, or None (see `_record_units`)."""
    return _first_of(_record_units("hevc", config), HEVC_SPS)


def _first_of(units: Iterator[tuple[int, bytes]], kind: int) -> bytes | None:
    """The first of a record's `units` listed as of `kind`, read up to it: a record cut short
    after it still gives it."""
    try:
        return next((unit for listed, unit in units if listed == kind), None)
    except IndexError:
        return None


@dataclass(frozen=True)
class DecoderConfig:
    """What an MP4 decoder configuration record says the GPU decoder's packet feed needs:
    `codec` "h264" or "hevc", `length_size` the bytes before each NAL unit of a sample,
    `parameter_sets` its VPS, SPS and PPS NAL units in order."""

    codec: str
    length_size: int
    parameter_sets: tuple[bytes, ...]


H264_8BIT_420 = {66, 77, 88, 100}
"""profile_idc of H.264 profiles that are 8-bit 4:2:0 (or monochrome) by definition:
Baseline, Main, Extended, High; High 10 and up may carry more."""

RECORDS = {"avc1": "h264", "avc3": "h264", "hvc1": "hevc", "hev1": "hevc"}
"""Sample entries whose configuration record `decoder_config` reads, by codec."""


def decoder_config(entry: str, config: bytes, any_depth: bool = False) -> DecoderConfig | None:
    """The `DecoderConfig` of an `avcC` (sample entry avc1/avc3) or `hvcC` (hvc1/hev1)
    payload of an 8-bit 4:2:0 stream, or with `any_depth` of any bit depth and chroma
    format; None for any other, or a record cut short."""
    codec = RECORDS.get(entry)
    try:
        if codec is None or not (any_depth or _8bit_420(codec, config)):
            return None
        length_size = (config[4] if codec == "h264" else config[21]) & 3
        return DecoderConfig(codec, length_size + 1, tuple(unit for _, unit in _record_units(codec, config)))
    except IndexError:
        return None


def _8bit_420(codec: str, config: bytes) -> bool:
    """Whether a record says 8-bit 4:2:0: an H.264 profile that is (`H264_8BIT_420`), or HEVC's
    chroma format (byte 16, low 2 bits: 1 is 4:2:0) and luma and chroma bit depths less 8
    (bytes 17 and 18, low 3 bits)."""
    if codec == "h264":
        return config[1] in H264_8BIT_420
    return config[16] & 3 == 1 and not config[17] & 7 and not config[18] & 7


def _record_units(codec: str, config: bytes) -> Iterator[tuple[int, bytes]]:
    """The NAL units of a configuration record, in order, each with the NAL unit type its
    record lists it under; an IndexError where the record ends before one does.
    AVCDecoderConfigurationRecord: version, profile, compatibility, level, the length size
    less one, the SPS count (low 5 bits) and SPSs, the PPS count and PPSs, each after its
    16-bit length. HEVCDecoderConfigurationRecord: 22 bytes, the array count, then arrays
    of units of one type each (type in the low 6 bits, 16-bit count, units)."""
    if codec == "h264":
        pos = 5
        for kind, mask in ((H264_SPS, 0x1F), (H264_SPS + 1, 0xFF)):
            count, pos = config[pos] & mask, pos + 1
            for _ in range(count):
                unit, pos = _sized_unit(config, pos)
                yield kind, unit
        return
    pos = 23
    for _ in range(config[22]):
        if pos + 3 > len(config):
            raise IndexError("an array of parameter sets runs past its configuration record")
        kind, count, pos = config[pos] & 0x3F, int.from_bytes(config[pos + 1 : pos + 3], "big"), pos + 3
        for _ in range(count):
            unit, pos = _sized_unit(config, pos)
            yield kind, unit


def _sized_unit(config: bytes, pos: int) -> tuple[bytes, int]:
    """The NAL unit at `pos` of a configuration record, after its 16-bit length, and the
    position after it; IndexError where it runs past the record."""
    size = int.from_bytes(config[pos : pos + 2], "big")
    if pos + 2 > len(config) or pos + 2 + size > len(config):
        raise IndexError("a parameter set runs past its configuration record")
    return bytes(config[pos + 2 : pos + 2 + size]), pos + 2 + size


def _h264(bits: _Bits) -> SequenceFacts:
    profile = bits.u(8)
    bits.u(16)  # constraint flags, level_idc
    bits.ue()  # seq_parameter_set_id
    chroma_format = 1  # 4:2:0 where the profile does not say
    if profile in _H264_HIGH_PROFILES:
        chroma_format = bits.ue()
        if chroma_format == 3 and bits.flag():  # separate_colour_plane_flag: planes coded as monochrome
            chroma_format = 0
        bits.ue(), bits.ue()  # bit depths
        bits.flag()  # qpprime_y_zero_transform_bypass_flag
        if bits.flag():  # seq_scaling_matrix_present_flag
            for index in range(8 if chroma_format != 3 else 12):
                if bits.flag():
                    _scaling_list(bits, 16 if index < 6 else 64)
    bits.ue()  # log2_max_frame_num_minus4
    poc_type = bits.ue()
    if poc_type == 0:
        bits.ue()
    elif poc_type == 1:
        bits.flag()
        bits.se(), bits.se()
        for _ in range(bits.ue()):
            bits.se()
    bits.ue()  # max_num_ref_frames
    bits.flag()  # gaps_in_frame_num_value_allowed_flag
    width, height = 16 * (bits.ue() + 1), 16 * (bits.ue() + 1)  # macroblocks, map units
    frames_only = bits.flag()  # frame_mbs_only_flag
    if not frames_only:
        bits.flag()
        height *= 2  # map units are field macroblock pairs
    bits.flag()  # direct_8x8_inference_flag
    if bits.flag():  # frame_cropping_flag, in chroma samples (H.264 7.4.2.1.1)
        unit_x = 1 if chroma_format in (0, 3) else 2
        unit_y = (2 if chroma_format == 1 else 1) * (1 if frames_only else 2)
        left, right, top, bottom = bits.ue(), bits.ue(), bits.ue(), bits.ue()
        width, height = width - unit_x * (left + right), height - unit_y * (top + bottom)
    return SequenceFacts(_vui(bits) if bits.flag() else SignalTags(), (width, height))


def _scaling_list(bits: _Bits, size: int) -> None:
    """Deltas come until one makes the next scale 0 (the list then repeats its last)."""
    scale = 8
    for _ in range(size):
        scale = (scale + bits.se() + 256) % 256
        if scale == 0:
            return


def _hevc(bits: _Bits) -> SequenceFacts:
    bits.u(4)  # sps_video_parameter_set_id
    sub_layers = bits.u(3)  # sps_max_sub_layers_minus1
    bits.flag()  # sps_temporal_id_nesting_flag
    _profile_tier_level(bits, sub_layers)
    bits.ue()  # sps_seq_parameter_set_id
    chroma_format = bits.ue()
    if chroma_format == 3 and bits.flag():  # separate_colour_plane_flag
        chroma_format = 0
    width, height = bits.ue(), bits.ue()  # luma samples
    if bits.flag():  # conformance_window_flag, in chroma samples (H.265 7.4.3.2.1)
        unit_x, unit_y = (2, 2) if chroma_format == 1 else (2, 1) if chroma_format == 2 else (1, 1)
        left, right, top, bottom = bits.ue(), bits.ue(), bits.ue(), bits.ue()
        width, height = width - unit_x * (left + right), height - unit_y * (top + bottom)
    bits.ue(), bits.ue()  # bit depths
    poc_bits = bits.ue() + 4
    ordering = bits.flag()  # sps_sub_layer_ordering_info_present_flag
    for _ in range(0 if ordering else sub_layers, sub_layers + 1):
        bits.ue(), bits.ue(), bits.ue()
    for _ in range(6):  # coding and transform block sizes and depths
        bits.ue()
    if bits.flag() and bits.flag():  # scaling_list_enabled_flag, sps_scaling_list_data_present_flag
        _hevc_scaling_lists(bits)
    bits.flag(), bits.flag()  # amp, sample adaptive offset
    if bits.flag():  # pcm_enabled_flag
        bits.u(8)
        bits.ue(), bits.ue()
        bits.flag()
    _short_term_sets(bits, bits.ue())
    if bits.flag():  # long_term_ref_pics_present_flag
        for _ in range(bits.ue()):
            bits.u(poc_bits)
            bits.flag()
    bits.flag(), bits.flag()  # temporal MVP, strong intra smoothing
    return SequenceFacts(_vui(bits) if bits.flag() else SignalTags(), (width, height))


def _profile_tier_level(bits: _Bits, sub_layers: int) -> None:
    bits.u(88)  # general profile space, tier, profile, compatibility and constraint flags
    bits.u(8)  # general_level_idc
    present = [(bits.flag(), bits.flag()) for _ in range(sub_layers)]
    if sub_layers:
        bits.u(2 * (8 - sub_layers))
    for profile, level in present:
        bits.u((88 if profile else 0) + (8 if level else 0))


def _hevc_scaling_lists(bits: _Bits) -> None:
    for size_id in range(4):
        for _ in range(0, 6, 3 if size_id == 3 else 1):
            if not bits.flag():  # scaling_list_pred_mode_flag
                bits.ue()
                continue
            if size_id > 1:
                bits.se()
            for _ in range(min(64, 1 << (4 + (size_id << 1)))):
                bits.se()


def _short_term_sets(bits: _Bits, count: int) -> None:
    """The SPS's st_ref_pic_set()s, kept only as far as the next set needs: each one's
    count of delta POCs (H.265 7.3.7, 7.4.8)."""
    deltas: list[int] = []
    for index in range(count):
        if index and bits.flag():  # inter_ref_pic_set_prediction_flag
            bits.flag()  # delta_rps_sign
            bits.ue()  # abs_delta_rps_minus1
            kept = 0
            for _ in range(deltas[index - 1] + 1):
                used = bits.flag()
                kept += used or bits.flag()  # use_delta_flag, 1 where absent
            deltas.append(kept)
            continue
        negative, positive = bits.ue(), bits.ue()
        for _ in range(negative + positive):
            bits.ue()
            bits.flag()
        deltas.append(negative + positive)


def _vui(bits: _Bits) -> SignalTags:
    """The colour fields at the head of a VUI (the same in H.264 and HEVC)."""
    if bits.flag() and bits.u(8) == 255:  # aspect_ratio_info_present_flag, aspect_ratio_idc
        bits.u(32)  # sar width and height
    if bits.flag():  # overscan_info_present_flag
        bits.flag()
    if not bits.flag():  # video_signal_type_present_flag
        return SignalTags()
    bits.u(3)  # video_format
    full = bits.flag()
    if not bits.flag():  # colour_description_present_flag
        return SignalTags(full=full)
    bits.u(16)  # colour_primaries, transfer_characteristics
    return SignalTags(matrix=bits.u(8), full=full)
