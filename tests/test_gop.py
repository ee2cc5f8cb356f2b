"""The pictures the GPU decoder is fed for a video's sampled frames (embedjob/decode/gop.py).

A frame decoded from fewer pictures than the stream holds is the same frame only if
every picture it refers to, directly or not, was decoded first. The streams below are
made with explicit references (what each picture was predicted from, as an encoder with
B-frames, B-pyramids and open GOPs lays them out), and a picture counts as decoded right
only when it was fed and so was everything it refers to. Real streams: Annex B cuts of
tests/data clips whose slices FFmpeg's trace_headers read (tests/data/LICENSES.tsv).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from embedjob.decode.gop import Picture, SliceKind, display_order, nal_units, needed_pictures, picture_kind, pictures, slice_kind
from embedjob.decode.types import MediaError

DATA = Path(__file__).parent / "data"


@dataclass
class Stream:
    """Pictures in decode order and, for each, the decode positions it refers to."""

    pictures: list[Picture] = field(default_factory=list)
    refers: list[set[int]] = field(default_factory=list)

    def add(self, pts: int, key: bool, reference: bool, refers: set[int]) -> int:
        self.pictures.append(Picture(pts, key, reference))
        self.refers.append(refers)
        return len(self.pictures) - 1

    def decoded_right(self, fed: set[int]) -> set[int]:
        right: set[int] = set()
        for k in range(len(self.pictures)):  # references always come earlier in decode order
            if k in fed and self.refers[k] <= right:
                right.add(k)
        return right


@st.composite
def streams(draw) -> Stream:
    """GOPs of an I picture then mini-GOPs: a P picture (the next anchor), then up to 3
    B pictures shown before it, the middle one a reference for the others when the
    pyramid is drawn. A GOP after the first may be open: its key picture is followed in
    decode order by leading B pictures shown before it, which refer to the previous GOP's
    last anchor, to the key picture and maybe to the previous GOP's leading pictures that
    are references (HEVC lets one RASL picture refer to another), and which nothing shown
    after the key refers to."""
    stream, shown, anchor, earlier_leading = Stream(), 0, None, []
    for g in range(draw(st.integers(1, 4))):
        leading = draw(st.integers(0, 3)) if g and anchor is not None else 0
        key = stream.add(shown + leading, True, True, set())
        references = []
        for i in range(leading):
            refers = {anchor, key} | set(draw(st.lists(st.sampled_from(earlier_leading), max_size=2)) if earlier_leading else [])
            reference = draw(st.booleans())
            at = stream.add(shown + i, False, reference, refers)
            references += [at] if reference else []
        shown, anchor, earlier_leading = shown + leading + 1, key, references
        for _ in range(draw(st.integers(0, 5))):
            bs = draw(st.integers(0, 3))
            p = stream.add(shown + bs, False, True, {anchor})
            middle = stream.add(shown + 1, False, True, {anchor, p}) if bs == 3 and draw(st.booleans()) else None
            for i in range(bs):
                if i != 1 or middle is None:
                    stream.add(shown + i, False, False, {anchor, p} | ({middle} if middle is not None else set()))
            shown, anchor = shown + bs + 1, p
    return stream


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_sampled_frame_decodes_from_the_pictures_fed_and_no_unwanted_picture_nothing_refers_to_is_fed(data) -> None:
    stream = data.draw(streams())
    frames = len(stream.pictures)
    wanted = data.draw(st.sets(st.integers(0, frames - 1), min_size=1))
    fed = needed_pictures(stream.pictures, wanted)
    order = display_order(stream.pictures)
    targets = {order[index] for index in wanted}
    assert fed == sorted(set(fed)) and set(fed) >= targets
    assert targets <= stream.decoded_right(set(fed))
    assert all(stream.pictures[k].reference for k in set(fed) - targets)
    assert max(fed) == max(targets)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_stream_without_b_frames_is_fed_from_the_sampled_frames_keyframe_on(data) -> None:
    """All-P GOPs (phone clips): nothing to leave out between a keyframe and its last
    sample, whole GOPs before it skipped."""
    gops = data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=5))
    stream = [Picture(pts, key=pts in {sum(gops[:g]) for g in range(len(gops))}) for pts in range(sum(gops))]
    index = data.draw(st.integers(0, len(stream) - 1))
    start = max(k for k in range(index + 1) if stream[k].key)
    assert needed_pictures(stream, [index]) == list(range(start, index + 1))


def test_sampling_2_of_30_fps_from_a_stream_with_b_pyramids_skips_the_pictures_nothing_refers_to() -> None:
    """A 1 s GOP of 30 pictures (I, then P B B B minis with a reference middle B), frames
    0 and 15 wanted: the non-reference B pictures before 15 and everything after it stay
    out."""
    stream = Stream()
    key = stream.add(0, True, True, set())
    anchor, shown = key, 1
    while shown + 3 < 30:
        p = stream.add(shown + 3, False, True, {anchor})
        middle = stream.add(shown + 1, False, True, {anchor, p})
        stream.add(shown, False, False, {anchor, p, middle})
        stream.add(shown + 2, False, False, {anchor, p, middle})
        anchor, shown = p, shown + 4
    fed = needed_pictures(stream.pictures, [0, 15])
    assert {0, 15} <= {stream.pictures[k].pts for k in fed} and len(fed) < 15
    assert stream.decoded_right(set(fed)) >= {display_order(stream.pictures)[i] for i in (0, 15)}


def slices(name: str, codec: str) -> list[SliceKind]:
    return [kind for kind in (slice_kind(codec, unit) for unit in nal_units((DATA / name).read_bytes())) if kind is not None]


def test_the_slices_of_a_real_h264_stream_are_read_as_ffmpeg_reads_them() -> None:
    """nasa_13013's first 60 pictures: 60 slices, 29 of them with nal_ref_idc 0."""
    kinds = slices("derived_nasa_13013_60frames.h264", "h264")
    assert len(kinds) == 60 and sum(not k.referenced for k in kinds) == 29 and {k.layer for k in kinds} == {0}


def test_the_slices_of_a_real_hevc_stream_are_read_as_ffmpeg_reads_them() -> None:
    """h265_video: 10 pictures, 3 of them RASL_N (sub-layer non-reference), all on temporal
    layer 0: those 3 are references for nothing."""
    kinds = slices("derived_torchcodec_h265_video.hevc", "hevc")
    assert len(kinds) == 10 and sum(not k.referenced for k in kinds) == 3 and {k.layer for k in kinds} == {0}
    stream = pictures([(k, False, kind) for k, kind in enumerate(kinds)])
    assert sum(not p.reference for p in stream) == 3


def test_a_picture_is_a_reference_where_any_of_its_slices_is_and_unknown_where_it_has_none() -> None:
    sps, idr, plain, unreferenced = b"\x67\x64", b"\x65\x88", b"\x41\x9a", b"\x01\x9e"
    annex_b = b"".join(b"\x00\x00\x00\x01" + unit for unit in (sps, unreferenced, plain))
    assert picture_kind("h264", nal_units(annex_b)) == SliceKind(referenced=True)
    assert picture_kind("h264", [unreferenced]) == SliceKind(referenced=False)
    assert picture_kind("h264", [idr]) == SliceKind(referenced=True)
    assert picture_kind("h264", [sps]) is None
    assert picture_kind("av1", [unreferenced]) is None


def test_hevc_non_reference_pictures_below_the_top_temporal_layer_stay_references() -> None:
    """A TRAIL_N picture on layer 0 of a stream with a layer 1 may be referred to by layer 1."""
    trail_n = lambda layer: bytes([0 << 1, layer + 1])  # noqa: E731
    trail_r = lambda layer: bytes([1 << 1, layer + 1])  # noqa: E731
    kinds = [picture_kind("hevc", [unit]) for unit in (trail_r(0), trail_n(0), trail_n(1), trail_r(1))]
    assert kinds[1] == SliceKind(referenced=False, layer=0) and kinds[2] == SliceKind(referenced=False, layer=1)
    stream = pictures([(k, k == 0, kind) for k, kind in enumerate(kinds)])
    assert [p.reference for p in stream] == [True, True, False, True]
    assert [p.reference for p in pictures([(0, True, None)])] == [True]


# Cut by a decode worker (`video.cut_packets`, `gop.packet_feed`): the first video track's
# sample table read here (`containers.mp4_samples`), its decoder configuration
# (`bitstream.decoder_config`), and the pictures as Annex B. Keyframes and frame counts are
# FFmpeg's (its showinfo filter on these files); the Annex B streams its bitstream filters'.

CLIPS = sorted(p.relative_to(DATA).as_posix() for p in [*DATA.glob("*.mp4"), *DATA.glob("*.mov"), *DATA.glob("gop/*.mp4")])
KEYFRAMES_SHOWN = {"torchcodec_nasa_13013.mp4": [0, 202], "torchcodec_h265_video.mp4": [0, 2, 4, 6, 8],
                   "gop/derived_testsrc2_hevc_open_gop_256x144.mp4": [0, 20, 40], "gop/derived_testsrc2_h264_open_gop_256x144.mp4": [0, 20, 40]}


def test_the_sample_table_numbers_decords_frames_and_shows_the_keyframes_where_ffmpeg_does() -> None:
    import io

    import decord

    from embedjob.decode.containers import mp4_samples
    from embedjob.decode.video import decoder_bytes

    for name in CLIPS:
        data = (DATA / name).read_bytes()
        samples = mp4_samples(data)
        assert samples is not None, name
        assert len(samples.sizes) == len(decord.VideoReader(io.BytesIO(decoder_bytes(data)))), name
        assert len(set(samples.times)) == len(samples.times), name
        stream = pictures([(t, key, None) for t, key in zip(samples.times, samples.sync)])
        shown = {k: index for index, k in enumerate(display_order(stream))}
        if name in KEYFRAMES_SHOWN:
            assert sorted(shown[k] for k, key in enumerate(samples.sync) if key) == KEYFRAMES_SHOWN[name], name
    assert mp4_samples(b"\x00\x00\x00\x08ftyp") is None
    truncated = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()[:-100_000]
    assert mp4_samples(truncated) is None
    two_entries = bytearray((DATA / "torchcodec_nasa_13013.mp4").read_bytes())
    at = two_entries.index(b"stsd") + 4
    two_entries[at + 4 : at + 8] = (2).to_bytes(4, "big")  # samples may then be described by another entry
    assert mp4_samples(bytes(two_entries)) is None


def test_the_decoder_configuration_of_8_bit_clips_is_read_and_deeper_ones_are_refused() -> None:
    from embedjob.decode.bitstream import decoder_config
    from embedjob.decode.containers import mp4_samples

    def config(name: str):
        samples = mp4_samples((DATA / name).read_bytes())
        return decoder_config(samples.codec, samples.config)

    h264, hevc = config("torchcodec_nasa_13013.mp4"), config("gop/derived_testsrc2_hevc_open_gop_256x144.mp4")
    assert (h264.codec, h264.length_size, [u[0] & 0x1F for u in h264.parameter_sets]) == ("h264", 4, [7, 8])
    assert (hevc.codec, hevc.length_size, [(u[0] >> 1) & 0x3F for u in hevc.parameter_sets]) == ("hevc", 4, [32, 33, 34, 39])
    assert config("torchcodec_h264_10bits.mp4") is None and config("torchcodec_h265_10bits.mp4") is None
    for name, entry in (("torchcodec_nasa_13013.mp4", "avc1"), ("gop/derived_testsrc2_hevc_open_gop_256x144.mp4", "hvc1")):
        record = mp4_samples((DATA / name).read_bytes()).config
        whole = decoder_config(entry, record)
        cut_short = [decoder_config(entry, record[:n]) for n in range(len(record))]
        assert all(c is None or c == whole for c in cut_short) and cut_short[len(record) // 2] is None, name


def vcl_units(codec: str, annex_b: bytes) -> list[bytes]:
    return [bytes(unit).rstrip(b"\x00") for unit in nal_units(annex_b) if slice_kind(codec, unit) is not None]


def test_every_picture_cut_is_the_annex_b_ffmpeg_makes_with_the_parameter_sets_before_each_keyframe() -> None:
    from embedjob.decode.video import cut_packets, mp4_facts

    for clip, annex_b, codec in (("torchcodec_nasa_13013.mp4", "derived_nasa_13013_60frames.h264", "h264"),
                                 ("torchcodec_h265_video.mp4", "derived_torchcodec_h265_video.hevc", "hevc")):
        data = (DATA / clip).read_bytes()
        frames = len(slices(annex_b, codec)) if codec == "hevc" else 325
        feed = cut_packets(data, list(range(frames)), frames, mp4_facts(data).stream_size)
        want = vcl_units(codec, (DATA / annex_b).read_bytes())
        packets = [feed.stream[offset : offset + size] for offset, size in feed.bounds]
        assert len(packets) == frames and b"".join(packets) == feed.stream
        assert vcl_units(codec, b"".join(packets[: len(want)])) == want, clip
        first = [bytes(unit) for unit in nal_units(packets[0])]
        assert {(u[0] & 0x1F) if codec == "h264" else (u[0] >> 1) & 0x3F for u in first[:2]} <= {7, 8, 32, 33}


def test_a_cut_for_2_frames_a_second_holds_the_sampled_pictures_and_only_references_besides() -> None:
    from embedjob.decode.video import cut_packets, mp4_facts

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    wanted = list(range(0, 325, 12))
    feed = cut_packets(data, wanted, 325, mp4_facts(data).stream_size)
    assert feed.codec == "h264" and feed.size == (320, 180) and set(wanted) <= set(feed.shown) and len(feed.shown) < 325
    for (offset, size), shown in zip(feed.bounds, feed.shown):
        kind = picture_kind("h264", nal_units(feed.stream[offset : offset + size]))
        assert kind.referenced or shown in wanted
    assert cut_packets(data, wanted, 324, mp4_facts(data).stream_size) is None  # decord counts other frames


@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255), st.booleans()), min_size=1, max_size=12), cut=st.integers(0, 100))
def test_a_damaged_sample_table_yields_no_samples_or_what_it_holds_never_an_exception(flips, cut) -> None:
    """Bytes of nasa_13013 changed (in its `moov`, or anywhere), or the file cut short: the worker
    leaves the clip to the rank's demuxer (None) rather than stop, whatever a count or a
    NAL unit's length says."""
    from embedjob.decode.containers import mp4_samples
    from embedjob.decode.gop import PacketFeed
    from embedjob.decode.video import cut_packets

    data = bytearray((DATA / "torchcodec_nasa_13013.mp4").read_bytes())
    moov = data.index(b"moov")
    for at, value, anywhere in flips:
        data[at % len(data) if anywhere else moov + at % (len(data) - moov)] = value
    damaged = bytes(data[: len(data) * (100 - cut) // 100 or 1])
    samples = mp4_samples(damaged)
    assert samples is None or all(o + n <= len(damaged) for o, n in zip(samples.offsets, samples.sizes))
    feed = cut_packets(damaged, list(range(0, 325, 12)), 325, (320, 180))
    assert feed is None or isinstance(feed, PacketFeed)


# Read by decord (`video.READ_NEEDED`): the CPU path decodes a copy of the clip holding only
# the pictures its samples need (`containers.mp4_with_samples`).

FULL_DECODE_CLIPS = [*KEYFRAMES_SHOWN, "torchcodec_h265_10bits.mp4", "decord_video_90.mov"]


def test_frames_read_from_the_needed_pictures_alone_are_those_of_a_decode_from_the_first_frame() -> None:
    """Sampled frames (a sixth of the clip apart; those just before each 20th frame,
    leading pictures in the open GOPs), bit for bit what decord gives decoding every frame
    in order, from a copy holding fewer pictures (10-bit HEVC included)."""
    import io

    import decord
    import numpy as np

    from embedjob.decode import video
    from embedjob.decode.types import DecodeOptions

    options = DecodeOptions(modality="video", max_image_pixels=1 << 24, fps=2.0, max_frames=32, frame_multiple=1)
    for name in FULL_DECODE_CLIPS:
        data = (DATA / name).read_bytes()
        source = video.decoder_bytes(data)
        every = decord.VideoReader(io.BytesIO(source))
        count = len(every)
        frames = every.get_batch(list(range(count))).asnumpy()
        reduced_any = False
        for indices in (list(range(0, count, max(1, count // 6))), [i for i in range(count) if i % 20 in (17, 18, 19)] or [count - 1]):
            job = video._VideoJob(source, "MP4", video.mp4_facts(data), options, None, data)
            needed = video._needed_only(job, indices, count)
            if needed is None:  # every picture is needed
                continue
            reduced_any = True
            reduced, positions = needed
            reader = decord.VideoReader(io.BytesIO(reduced.source))
            assert len(reader) < count, name
            assert np.array_equal(reader.get_batch(positions).asnumpy(), frames[indices]), (name, indices)
        assert reduced_any or count <= 10, name


def test_a_video_job_reads_the_same_frames_with_and_without_the_pictures_left_out(monkeypatch) -> None:
    """`decode_video` on the closed-GOP test clips, at 4 and 30 frames a second, scaled
    down: the frames, timestamps and counts of reading the whole clip, bit for bit; a clip
    whose edit list hides samples (66 x 50) is read whole; a corrupt clip is the same error
    row, naming its own frames."""
    import numpy as np

    from embedjob.decode import video
    from embedjob.decode.sniff import sniff_format
    from embedjob.decode.types import DecodeOptions

    names = ("torchcodec_nasa_13013.mp4", "decord_corrupted.mp4", "decord_video_270.mov", "torchcodec_h264_10bits.mp4",
             "hfdatasets_test_video_66x50.mov")
    errors = set()
    for fps in (4.0, 30.0):
        options = DecodeOptions(modality="video", max_image_pixels=1 << 24, fps=fps, max_frames=300, frame_multiple=2, max_frame_pixels=200 * 120)
        for name in names:
            data = (DATA / name).read_bytes()
            read = {}
            for needed in (True, False):
                monkeypatch.setattr(video, "READ_NEEDED", needed)
                try:
                    read[needed] = video.decode_video(data, options, sniff_format(data)[1])
                except MediaError as exc:
                    read[needed] = str(exc)
            if isinstance(read[True], str) or isinstance(read[False], str):
                assert read[True] == read[False], name
                errors.add(name)
                continue
            assert np.array_equal(read[True].frames, read[False].frames), (name, fps)
            assert (read[True].timestamps, read[True].source_frames) == (read[False].timestamps, read[False].source_frames), name
    assert errors == {"decord_corrupted.mp4"}


def test_a_video_is_read_by_one_decord_reader_at_a_time(monkeypatch) -> None:
    """`decode_video` drops the reader it planned with before it opens the one that reads
    the copy of the needed pictures, or the scaled one: with the planning reader still
    open, a core read the benchmark's clips 1.7x slower (benchmarks/RESULTS.md section 8).
    The frames stay those of reading the whole clip."""
    import weakref

    import numpy as np

    from embedjob.decode import video
    from embedjob.decode.sniff import sniff_format
    from embedjob.decode.types import DecodeOptions

    opened: list[weakref.ref] = []
    real = video._open_reader

    def tracked(job, size):
        assert all(ref() is None for ref in opened), "a decord reader opened while another is still open"
        reader = real(job, size)
        opened.append(weakref.ref(reader))
        return reader

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    for scaled in (None, 200 * 120):
        options = DecodeOptions(modality="video", max_image_pixels=1 << 24, fps=4.0, max_frames=32, frame_multiple=1, max_frame_pixels=scaled)
        read = {}
        for needed in (True, False):
            monkeypatch.setattr(video, "READ_NEEDED", needed)
            monkeypatch.setattr(video, "_open_reader", tracked)
            opened.clear()
            read[needed] = video.decode_video(data, options, sniff_format(data)[1])
            assert len(opened) == (2 if needed or scaled else 1), (needed, scaled)
        assert np.array_equal(read[True].frames, read[False].frames), scaled


def test_open_gops_leading_pictures_are_read_as_a_decode_from_the_first_frame_gives_them() -> None:
    """`decode_video`, scaled down, 8 frames a second of the open-GOP clips: decord's frames
    of a decode of every frame in order at that size, bit for bit (its seeks in the whole
    clip gave other pictures for some)."""
    import io

    import decord
    import numpy as np

    from embedjob.decode import video
    from embedjob.decode.sniff import sniff_format
    from embedjob.decode.types import DecodeOptions

    options = DecodeOptions(modality="video", max_image_pixels=1 << 24, fps=8.0, max_frames=64, frame_multiple=2, max_frame_pixels=200 * 120)
    for name in ("gop/derived_testsrc2_h264_open_gop_256x144.mp4", "gop/derived_testsrc2_hevc_open_gop_256x144.mp4", "torchcodec_h265_video.mp4"):
        data = (DATA / name).read_bytes()
        got = video.decode_video(data, options, sniff_format(data)[1])
        height, width = got.frames.shape[1:3]
        reader = decord.VideoReader(io.BytesIO(video.decoder_bytes(data)), width=width, height=height)
        indices = video.sample_frame_indices(len(reader), float(reader.get_avg_fps()), options.fps, options.max_frames, options.frame_multiple)
        assert np.array_equal(got.frames, reader.get_batch(list(range(len(reader)))).asnumpy()[indices]), name
