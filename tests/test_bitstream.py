"""Colour tags and frame sizes read from H.264 and HEVC parameter sets, and colour tags
from MP4/MOV `colr` boxes (`embedjob.decode.bitstream`, `containers.mp4_facts`): what the
GPU's decoder path needs to turn NV12 to RGB as decord's FFmpeg does, and the size a
decode worker plans a clip at without decoding a frame.

The expected tags of the real clips are FFmpeg's own reading of them (its `trace_headers`
bitstream filter, FFmpeg 7, recorded here: CI has no FFmpeg). The clips in tests/data/colour
were made for this test with FFmpeg's lavfi testsrc2 and libx264/libx265 (tests/data/LICENSES.tsv).
Parameter sets no encoder at hand writes (scaling lists in the SPS, short-term reference
picture sets, inter-predicted ones among them) are written here bit by bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedjob.decode.bitstream import SignalTags, _Bits, avcc_sps, h264_facts, hevc_facts, hvcc_sps, payload
from embedjob.decode.containers import mp4_facts

DATA = Path(__file__).parent / "data"

# file -> (matrix_coefficients, video_full_range_flag) as FFmpeg's trace_headers reads the SPS
FFMPEG_READS = {
    "decord_video_0.mov": (1, False),
    "decord_video_90.mov": (1, False),
    "decord_unordered.mov": (None, None),
    "derived_testsrc2_untagged_256x144.mp4": (None, None),
    "hfdatasets_test_video_66x50.mov": (1, False),
    "torchcodec_h264_10bits.mp4": (None, None),
    "torchcodec_h265_10bits.mp4": (None, False),
    "torchcodec_h265_video.mp4": (None, False),
    "torchcodec_nasa_13013.mp4": (1, False),
    "colour/derived_h264_444_bt709.mp4": (1, False),
    "colour/derived_h264_bt2020.mov": (9, False),
    "colour/derived_h264_bt470bg_full.mp4": (5, True),
    "colour/derived_h264_smpte170m.mp4": (6, False),
    "colour/derived_hevc_bt470bg_full.mp4": (5, True),
    "colour/derived_hevc_default_scaling_bt709.mp4": (1, False),
}


@pytest.mark.parametrize("name", sorted(FFMPEG_READS))
def test_the_colour_tags_of_a_clips_parameter_set_are_ffmpegs(name: str) -> None:
    matrix, full = FFMPEG_READS[name]
    assert mp4_facts((DATA / name).read_bytes()).stream_tags == SignalTags(matrix, full)


@pytest.mark.parametrize("name", sorted(FFMPEG_READS))
def test_the_frame_size_of_a_clips_parameter_set_is_the_size_decord_decodes(name: str) -> None:
    """Coded size less the cropping window (1080p H.264 is coded 1,088 rows high; the 66 x
    50 clip 80 x 64), as decord hands the frames of the track it is given."""
    import io

    import decord

    from embedjob.decode.video import decoder_bytes

    data = (DATA / name).read_bytes()
    height, width = decord.VideoReader(io.BytesIO(decoder_bytes(data)))[0].shape[:2]
    assert mp4_facts(data).stream_size == (width, height)


def test_the_colr_box_is_the_containers_tag_beside_the_streams() -> None:
    """QuickTime's `nclc` has no range bit; ISO's `nclx` has one. Clips without the box
    have no container tag, whatever their stream says."""
    assert mp4_facts((DATA / "hfdatasets_test_video_66x50.mov").read_bytes()).container_tags == SignalTags(1, None)
    assert mp4_facts((DATA / "torchcodec_nasa_13013.mp4").read_bytes()).container_tags == SignalTags(1, False)
    assert mp4_facts((DATA / "decord_video_0.mov").read_bytes()).container_tags is None


def test_a_clip_outside_mp4_has_no_tags_read_here() -> None:
    facts = mp4_facts((DATA / "colour" / "derived_h264_bt709.mkv").read_bytes())
    assert facts.stream_tags is None and facts.container_tags is None


def _first_sps(name: str) -> tuple[bytes, object]:
    """A real clip's first SPS and the function that reads it."""
    facts_data = (DATA / name).read_bytes()
    codec = mp4_facts(facts_data).video_codecs[0]
    box = b"hvcC" if codec.startswith(("hvc", "hev")) else b"avcC"
    config = facts_data[facts_data.index(box) + 4 :]
    return (hvcc_sps(config), hevc_facts) if box == b"hvcC" else (avcc_sps(config), h264_facts)


@pytest.mark.parametrize("name", ["decord_video_0.mov", "colour/derived_h264_444_bt709.mp4", "colour/derived_hevc_bt470bg_full.mp4"])
def test_every_cut_of_a_parameter_set_reads_as_nothing_or_its_whole_tags(name: str) -> None:
    """A damaged container hands a parameter set cut anywhere: it reads as None (no
    guess) or, cut after the colour fields, as the whole set's facts; never an exception."""
    sps, read = _first_sps(name)
    whole = read(sps)
    assert whole is not None and whole.tags.matrix is not None
    for end in range(len(sps)):
        assert read(sps[:end]) in (None, whole), end


class BitWriter:
    """Writes what `bitstream._Bits` reads: fixed-width fields and Exp-Golomb codes."""

    def __init__(self) -> None:
        self.bits: list[int] = []

    def u(self, count: int, value: int) -> BitWriter:
        self.bits += [(value >> (count - 1 - k)) & 1 for k in range(count)]
        return self

    def ue(self, value: int) -> BitWriter:
        code = value + 1
        return self.u(code.bit_length() - 1, 0).u(code.bit_length(), code)

    def se(self, value: int) -> BitWriter:
        return self.ue(2 * value - 1 if value > 0 else -2 * value)

    def vui(self, matrix: int, full: bool) -> BitWriter:
        """A VUI with a 255 aspect ratio (its 32 bits of SAR), overscan info, and the colour fields."""
        self.u(1, 1).u(8, 255).u(32, 0x00400033).u(1, 1).u(1, 0)
        return self.u(1, 1).u(3, 5).u(1, int(full)).u(1, 1).u(8, 1).u(8, 1).u(8, matrix)

    def nal(self, header: bytes) -> bytes:
        """The bits as a NAL unit: a stop bit, zero padding, emulation prevention added."""
        bits = self.bits + [1] + [0] * (-(len(self.bits) + 1) % 8)
        raw = bytes(int("".join(map(str, bits[k : k + 8])), 2) for k in range(0, len(bits), 8))
        return header + escape(raw)


def escape(raw: bytes) -> bytes:
    """H.264/H.265 7.4.2: a 03 after every 00 00 that a byte of 0-3 follows."""
    out = bytearray()
    zeros = 0
    for byte in raw:
        if zeros >= 2 and byte <= 3:
            out.append(3)
            zeros = 0
        out.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return bytes(out)


FIELDS = st.lists(st.tuples(st.sampled_from(["u", "ue", "se"]), st.integers(0, 1 << 20)), min_size=1, max_size=40)


@given(FIELDS)
def test_fields_read_back_as_written(fields: list[tuple[str, int]]) -> None:
    writer = BitWriter()
    expected = []
    for kind, value in fields:
        if kind == "u":
            writer.u(21, value)
        elif kind == "ue":
            writer.ue(value)
        else:
            value = value - (1 << 19)
            writer.se(value)
        expected.append(value)
    bits = _Bits(payload(writer.nal(b"\x67"), 1))
    assert [bits.u(21) if kind == "u" else bits.ue() if kind == "ue" else bits.se() for kind, _ in fields] == expected


@given(st.binary(max_size=200))
def test_emulation_prevention_bytes_are_taken_out_and_nothing_else(raw: bytes) -> None:
    assert payload(b"\x67" + escape(raw), 1) == raw


def _h264_sps(matrix: int, full: bool, scaling: list[list[int] | None]) -> bytes:
    """A High-profile 4:2:0 SPS with the given scaling lists in it (None: not sent) and
    pic_order_cnt_type 1, frame cropping and field coding, each a branch a reader must walk."""
    w = BitWriter().u(8, 100).u(16, 0x0028).ue(0)
    w.ue(1).ue(0).ue(0).u(1, 0).u(1, 1)
    for values in scaling:
        w.u(1, values is not None)
        for delta in values or []:
            w.se(delta)
    w.ue(4).ue(1).u(1, 0).se(-2).se(3).ue(2).se(5).se(-7)
    w.ue(4).u(1, 0).ue(119).ue(33).u(1, 0).u(1, 1).u(1, 1).u(1, 1).ue(0).ue(4).ue(0).ue(2)
    return w.u(1, 1).vui(matrix, full).nal(b"\x67")


def test_an_h264_sps_with_scaling_lists_reads_to_its_tags() -> None:
    """Scaling lists end early when a delta makes the next scale 0 (then the last one
    repeats): the 4x4 list here stops after 3 deltas, the 8x8 one runs all 64."""
    lists: list[list[int] | None] = [[1, 2, -11]] + [None] * 5 + [[1] * 64, None]
    assert h264_facts(_h264_sps(1, True, lists)).tags == SignalTags(1, True)
    assert h264_facts(_h264_sps(6, False, [None] * 8)).tags == SignalTags(6, False)


def test_an_interlaced_h264_sps_decodes_to_its_cropped_frame_size() -> None:
    """Field coding doubles the map units' height and the crop's vertical unit: 120 x 34
    map units of field pairs (1,920 x 1,088), cropped by offsets of 4 at the right and 2
    at the bottom (crop units of 2 columns and of 2 rows times 2 fields), decode to
    1,912 x 1,080."""
    assert h264_facts(_h264_sps(1, False, [None] * 8)).size == (1912, 1080)


RPS = st.lists(
    st.one_of(
        st.tuples(st.just("explicit"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("inter"), st.lists(st.sampled_from(["used", "delta", "dropped"]), min_size=0, max_size=12)),
    ),
    max_size=6,
)


def _hevc_sps(matrix: int, full: bool, sub_layers: int, sets: list[tuple]) -> bytes:
    """An HEVC SPS with `sub_layers` + 1 temporal layers (a sub-layer profile and level for
    each), SPS scaling lists, PCM, the short-term reference picture sets `sets` and two
    long-term pictures, then a VUI. An "inter" set predicts from the set before it: one
    flag pair per delta POC of that set plus one, as many as the list gives, the list cut
    or padded with "used" to that count."""
    w = BitWriter().u(4, 0).u(3, sub_layers).u(1, 1)
    w.u(88, 0x1234).u(8, 93)
    for _ in range(sub_layers):
        w.u(1, 1).u(1, 1)
    if sub_layers:
        w.u(2 * (8 - sub_layers), 0)
    for _ in range(sub_layers):
        w.u(88, 7).u(8, 90)
    w.ue(0).ue(1).ue(1920).ue(1080).u(1, 1).ue(0).ue(0).ue(0).ue(4).ue(0).ue(0).ue(4)
    w.u(1, 1)
    for _ in range(sub_layers + 1):
        w.ue(4).ue(2).ue(0)
    for value in (0, 3, 0, 3, 4, 4):
        w.ue(value)
    w.u(1, 1).u(1, 1)
    for size_id in range(4):
        for matrix_id in range(0, 6, 3 if size_id == 3 else 1):
            if matrix_id % 2:
                w.u(1, 0).ue(matrix_id)
                continue
            w.u(1, 1)
            if size_id > 1:
                w.se(8)
            for _ in range(min(64, 1 << (4 + (size_id << 1)))):
                w.se(-1)
    w.u(1, 1).u(1, 1).u(1, 1).u(4, 7).u(4, 7).ue(0).ue(1).u(1, 0)
    w.ue(len(sets))
    deltas: list[int] = []
    for index, spec in enumerate(sets):
        if spec[0] == "inter" and index:
            flags = (list(spec[1]) + ["used"] * (deltas[-1] + 1))[: deltas[-1] + 1]
            w.u(1, 1).u(1, 0).ue(2)
            for flag in flags:
                w.u(1, flag == "used")
                if flag != "used":
                    w.u(1, flag == "delta")
            deltas.append(sum(flag != "dropped" for flag in flags))
            continue
        negative, positive = (spec[1], spec[2]) if spec[0] == "explicit" else (1, 1)
        if index:
            w.u(1, 0)
        w.ue(negative).ue(positive)
        for k in range(negative + positive):
            w.ue(k).u(1, k % 2)
        deltas.append(negative + positive)
    w.u(1, 1).ue(2).u(8, 17).u(1, 1).u(8, 200).u(1, 0)
    w.u(1, 1).u(1, 0)
    return w.u(1, 1).vui(matrix, full).nal(b"\x42\x01")


@given(st.integers(0, 6), RPS, st.sampled_from([1, 5, 9]), st.booleans())
def test_an_hevc_sps_reads_to_its_tags_past_layers_scaling_lists_and_reference_sets(
    sub_layers: int, sets: list[tuple], matrix: int, full: bool
) -> None:
    facts = hevc_facts(_hevc_sps(matrix, full, sub_layers, sets))
    assert facts is not None and facts.tags == SignalTags(matrix, full)
    assert facts.size == (1920, 1072)  # 1,080 rows less a conformance window of 4 chroma rows (8 rows)


def test_an_sps_without_a_vui_or_colour_description_has_no_tags() -> None:
    """No VUI: nothing said. A VUI with the signal type but no colour description says
    the range only, which is how FFmpeg then reads it."""
    bare = BitWriter().u(8, 66).u(16, 0x001E).ue(0).ue(0).ue(0).ue(0).ue(1).u(1, 0).ue(19).ue(14).u(1, 1).u(1, 1).u(1, 0)
    assert h264_facts(bare.u(1, 0).nal(b"\x67")).tags == SignalTags()
    ranged = BitWriter().u(8, 66).u(16, 0x001E).ue(0).ue(0).ue(0).ue(0).ue(1).u(1, 0).ue(19).ue(14).u(1, 1).u(1, 1).u(1, 0)
    assert h264_facts(ranged.u(1, 1).u(1, 0).u(1, 0).u(1, 1).u(3, 5).u(1, 1).u(1, 0).nal(b"\x67")).tags == SignalTags(None, True)
