"""Video decoding of embedjob.decode: frame sampling, orientation, streams, bad input.

Repo-local clips (tests/data, licences in tests/data/LICENSES.tsv) carry the essential
coverage; ../shared/data/videos is used when present and skipped on a clean clone.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from embedjob.decode import DecodedVideo, DecodeOptions, MediaError, decode, sample_frame_indices
from embedjob.decode.video import _decord

LOCAL = Path(__file__).parent / "data"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not present (clean clone)")

QWEN = DecodeOptions(modality="video", max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2)
EVERY_FRAME = DecodeOptions(modality="video", max_image_pixels=1, fps=1000.0, max_frames=64, frame_multiple=1)


def local(name: str) -> bytes:
    return (LOCAL / name).read_bytes()


def decode_video(data: bytes, options: DecodeOptions = QWEN) -> DecodedVideo:
    result = decode(data, options)
    assert isinstance(result, DecodedVideo)
    return result


def error_code(data: bytes, options: DecodeOptions = QWEN) -> str:
    with pytest.raises(MediaError) as err:
        decode(data, options)
    return err.value.code


def decord_frames(data: bytes, indices: list[int]) -> np.ndarray:
    """Frames as decord itself returns them (it applies 90-degree rotations itself)."""
    decord = _decord()
    return decord.VideoReader(io.BytesIO(data)).get_batch(indices).asnumpy()


def assert_frame_contract(video: DecodedVideo, options: DecodeOptions) -> None:
    count = video.frames.shape[0]
    assert video.frames.dtype == np.uint8 and video.frames.ndim == 4 and video.frames.shape[3] == 3
    assert video.frames.flags.c_contiguous
    assert options.frame_multiple <= count <= options.max_frames and count % options.frame_multiple == 0
    assert len(video.timestamps) == count and video.timestamps == sorted(video.timestamps)


# ---------------------------------------------------------------- sampling


def test_sampling_matches_transformers_qwen2_vl() -> None:
    """Same indices as Qwen2VLVideoProcessor.sample_frames (min_frames = frame_multiple)
    wherever transformers returns a valid answer. Its float arange sometimes returns one
    index too many, equal to num_frames (out of range); ours never does."""
    transformers_video = pytest.importorskip("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    from transformers.video_utils import VideoMetadata

    processor = transformers_video.Qwen2VLVideoProcessor()
    compared = 0
    for total in (2, 3, 5, 10, 31, 87, 300, 1001):
        for source_fps in (6.0, 25.0, 29.97, 60.0):
            for fps in (0.5, 2.0, 3.0):
                for max_frames in (4, 32, 33):
                    for multiple in (1, 2):
                        ours = sample_frame_indices(total, source_fps, fps, max_frames, multiple)
                        try:
                            theirs = processor.sample_frames(
                                VideoMetadata(total_num_frames=total, fps=source_fps),
                                temporal_patch_size=multiple, min_frames=multiple, max_frames=max_frames, fps=fps,
                            ).tolist()
                        except ZeroDivisionError:
                            assert total < multiple  # a clip shorter than the patch: we pad instead
                            continue
                        if len(theirs) % multiple == 0 and max(theirs) < total:
                            assert ours == theirs, (total, source_fps, fps, max_frames, multiple)
                            compared += 1
                        else:
                            assert len(ours) == len(theirs) - 1 and ours == theirs[:-1]
    assert compared > 400


@settings(max_examples=300, deadline=None)
@given(
    num_frames=st.integers(1, 5000),
    source_fps=st.one_of(st.floats(0.5, 240.0), st.just(0.0), st.just(float("nan"))),
    fps=st.floats(0.05, 30.0),
    multiple=st.integers(1, 4),
    extra=st.integers(0, 64),
)
def test_sampling_invariants(num_frames: int, source_fps: float, fps: float, multiple: int, extra: int) -> None:
    max_frames = multiple + extra
    indices = sample_frame_indices(num_frames, source_fps, fps, max_frames, multiple)
    assert multiple <= len(indices) <= max_frames and len(indices) % multiple == 0
    assert indices == sorted(indices) and 0 <= indices[0] and indices[-1] < num_frames
    assert indices[0] == 0


def test_sampling_short_clips_and_unknown_rate() -> None:
    assert sample_frame_indices(3, 30.0, 2.0, 8, 4) == [0, 1, 2, 2]  # fewer frames than the patch: repeat the last
    assert sample_frame_indices(1, 30.0, 2.0, 8, 2) == [0, 0]
    assert sample_frame_indices(87, 60.0, 2.0, 32, 2) == [0, 43]  # 1.45 s at 2 fps = 2.9 -> 2
    assert sample_frame_indices(87, 60.0, 0.1, 32, 2) == [0, 43]  # 0.145 frames -> at least frame_multiple
    assert sample_frame_indices(300, 30.0, 2.0, 32, 2) == list(range(0, 300, 15))  # 10 s -> 20 frames
    assert len(sample_frame_indices(10_000, 30.0, 2.0, 32, 2)) == 32
    assert len(sample_frame_indices(100, 0.0, 2.0, 32, 2)) == 32  # unknown duration: the cap


# ---------------------------------------------------------------- real clips

# Local clip -> (frame height, width, frames in the stream) or the error code.
LOCAL_EXPECTED: dict[str, tuple[int, int, int] | str] = {
    "decord_video_0.mov": (320, 568, 3),
    "decord_video_90.mov": (568, 320, 3),
    "decord_video_180.mov": (320, 568, 3),
    "decord_video_270.mov": (568, 320, 3),
    "decord_unordered.mov": (50, 50, 4),  # four white frames
    "hfdatasets_test_video_66x50.mov": (50, 66, 87),
    "torchcodec_h265_video.mp4": (128, 128, 10),
    "torchcodec_h265_10bits.mp4": (200, 200, 30),
    "torchcodec_h264_10bits.mp4": (200, 200, 30),
    "torchcodec_nasa_13013.mp4": (180, 320, 325),  # first of two video streams
    "derived_testsrc2_untagged_256x144.mp4": (144, 256, 4),  # colour bars without colour tags
    "derived_mkv_truncated.mkv": "truncated",  # the first half of a 10.4 s clip: half a clip is not the clip
    "torchcodec_av1_video.mkv": "unsupported_codec",  # FFmpeg 4.1 in decord has no AV1 decoder
    "decord_corrupted.mp4": "corrupt",  # H.264 units corrupt mid-stream
}


def test_every_local_clip_is_listed() -> None:
    assert sorted(LOCAL_EXPECTED) == sorted(p.name for p in LOCAL.iterdir() if p.suffix in (".mov", ".mp4", ".mkv"))


@pytest.mark.parametrize("name", sorted(LOCAL_EXPECTED))
def test_local_clips_give_frames_or_a_precise_error(name: str) -> None:
    expected = LOCAL_EXPECTED[name]
    if isinstance(expected, str):
        assert error_code(local(name)) == expected
        return
    video = decode_video(local(name))
    assert_frame_contract(video, QWEN)
    assert video.frames.shape[1:3] == expected[:2] and video.source_frames == expected[2]
    if name != "decord_unordered.mov":
        assert video.frames.std() > 5  # real picture content, not a blank frame


# decord 0.6.0 (FFmpeg 4.1) truly cannot decode these; everything else must give frames.
DECORD_CANNOT = {"torchcodec_av1_video.mkv": "unsupported_codec"}
SHARED_VIDEOS = sorted((SHARED / "videos").iterdir()) if (SHARED / "videos").is_dir() else []


@needs_shared
@pytest.mark.parametrize("path", SHARED_VIDEOS, ids=lambda p: p.name)
def test_shared_videos_give_frames_or_a_precise_error(path: Path, record_property: pytest.RecordProperty) -> None:
    try:
        video = decode_video(path.read_bytes())
    except MediaError as err:
        print(f"{path.name}: error {err}")
        record_property("outcome", str(err))
        assert DECORD_CANNOT.get(path.name) == err.code
        return
    print(f"{path.name}: frames {video.frames.shape} of {video.source_frames} at {video.source_fps:.2f} fps")
    record_property("outcome", f"frames {video.frames.shape}")
    assert path.name not in DECORD_CANNOT
    assert_frame_contract(video, QWEN)


# ---------------------------------------------------------------- orientation


@pytest.mark.parametrize("angle", [0, 90, 180, 270])
def test_rotated_phone_clips_match_decords_own_rotation(angle: int) -> None:
    """We reset the display matrix and apply it ourselves; the result must be what
    FFmpeg's own rotation (as decord applies it for multiples of 90) shows."""
    data = local(f"decord_video_{angle}.mov")
    ours = decode_video(data, EVERY_FRAME).frames
    assert ours.shape == ((3, 568, 320, 3) if angle in (90, 270) else (3, 320, 568, 3))
    assert np.array_equal(ours, decord_frames(data, [0, 1, 2]))


def with_track_matrix(data: bytes, a: int, b: int, c: int, d: int) -> bytes:
    """The clip with its video track's display matrix replaced (version-0 tkhd)."""
    tkhd = data.index(b"tkhd")
    assert data[tkhd + 4] == 0
    offset = tkhd + 4 + 40
    matrix = struct.pack(">9i", a << 16, b << 16, 0, c << 16, d << 16, 0, 0, 0, 1 << 30)
    return data[:offset] + matrix + data[offset + 36 :]


# (a, b, c, d) of ISO 14496-12's matrix (displayed [x y] = [x y] @ [[a b] [c d]]) -> numpy.
DISPLAY_TRANSFORMS = {
    "rotate_90_clockwise": ((0, 1, -1, 0), lambda f: np.rot90(f, k=-1, axes=(1, 2))),
    "rotate_180": ((-1, 0, 0, -1), lambda f: f[:, ::-1, ::-1]),
    "rotate_90_counterclockwise": ((0, -1, 1, 0), lambda f: np.rot90(f, k=1, axes=(1, 2))),
    "mirror_left_right": ((-1, 0, 0, 1), lambda f: f[:, :, ::-1]),
    "mirror_top_bottom": ((1, 0, 0, -1), lambda f: f[:, ::-1]),
    "transpose": ((0, 1, 1, 0), lambda f: f.transpose(0, 2, 1, 3)),
    "anti_transpose": ((0, -1, -1, 0), lambda f: f[:, ::-1, ::-1].transpose(0, 2, 1, 3)),
}


@pytest.mark.parametrize("name", DISPLAY_TRANSFORMS)
def test_display_matrix_is_applied_to_the_pixels(name: str) -> None:
    matrix, transform = DISPLAY_TRANSFORMS[name]
    upright = local("decord_video_0.mov")
    plain = decode_video(upright, EVERY_FRAME).frames
    turned = decode_video(with_track_matrix(upright, *matrix), EVERY_FRAME).frames
    assert np.array_equal(turned, transform(plain))


def test_first_of_several_video_streams_is_decoded() -> None:
    data = local("torchcodec_nasa_13013.mp4")
    video = decode_video(data)
    assert (video.frames.shape[1:3], video.source_frames, video.source_fps) == ((180, 320), 325, 25.0)
    # Left alone, FFmpeg would pick the other (480x270) stream.
    assert decord_frames(data, [0]).shape[1:3] == (270, 480)


# ---------------------------------------------------------------- timing


def test_out_of_order_frames_come_in_presentation_order() -> None:
    data = local("decord_unordered.mov")
    video = decode_video(data, EVERY_FRAME)
    assert video.timestamps == pytest.approx([0.0, 0.03125, 0.0625, 0.09375])
    assert np.array_equal(video.frames, decord_frames(data, [0, 1, 2, 3]))


def test_timestamps_follow_the_sampling_rate() -> None:
    video = decode_video(local("torchcodec_nasa_13013.mp4"))  # 13 s at 25 fps
    assert len(video.timestamps) == 26
    assert np.allclose(np.diff(video.timestamps), 0.5, atol=1 / 25)


@needs_shared
@pytest.mark.slow
def test_variable_frame_rate_is_sampled_uniformly_in_time() -> None:
    """demo_skeleton.mp4 has frame durations from 33 ms to 200 ms. Each sampled frame
    must be the one on screen at its evenly spaced target time."""
    data = (SHARED / "videos" / "mmaction2_demo_demo_skeleton.mp4").read_bytes()
    options = DecodeOptions("video", max_image_pixels=1, fps=10.0, max_frames=32, frame_multiple=1)
    video = decode_video(data, options)
    times = _decord().VideoReader(io.BytesIO(data)).get_frame_timestamp(range(video.source_frames))
    starts = times[:, 0].astype(np.float64) - times[0, 0]
    duration = float(times[-1, 1]) - float(times[0, 0])
    count = len(video.timestamps)
    assert count == 25  # 2.57 s at 10 fps
    for k, shown in enumerate(video.timestamps):
        target = k * duration / count
        on_screen = starts[np.searchsorted(starts, target + 1e-6, side="right") - 1]
        assert shown == pytest.approx(on_screen, abs=1e-5), (k, target)


def test_clip_shorter_than_the_patch_repeats_its_last_frame() -> None:
    options = DecodeOptions("video", max_image_pixels=1, fps=2.0, max_frames=8, frame_multiple=4)
    video = decode_video(local("decord_video_0.mov"), options)
    assert video.frames.shape[0] == 4
    assert np.array_equal(video.frames[:3], decode_video(local("decord_video_0.mov"), EVERY_FRAME).frames)
    assert np.array_equal(video.frames[3], video.frames[2])
    assert video.timestamps[3] == video.timestamps[2]


# ---------------------------------------------------------------- size


def test_large_frames_are_decoded_downscaled_keeping_aspect() -> None:
    data = local("decord_video_90.mov")
    full = decode_video(data, EVERY_FRAME).frames
    bounded = DecodeOptions("video", max_image_pixels=1, fps=1000.0, max_frames=64, frame_multiple=1, max_frame_pixels=20_000)
    small = decode_video(data, bounded).frames
    height, width = small.shape[1:3]
    assert height * width <= 20_000 and height > width  # still portrait: scaled before our rotation
    assert abs(height / width - 568 / 320) < 0.02
    reference = np.asarray(Image.fromarray(full[0]).resize((width, height), Image.Resampling.BILINEAR))
    assert np.abs(small[0].astype(int) - reference).mean() < 8


def test_small_frames_are_left_alone_by_the_pixel_bound() -> None:
    bounded = DecodeOptions("video", max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2, max_frame_pixels=66 * 50)
    data = local("hfdatasets_test_video_66x50.mov")
    assert np.array_equal(decode_video(data, bounded).frames, decode_video(data).frames)


def test_ten_bit_h264_and_hevc_decode_to_the_same_picture() -> None:
    h264 = decode_video(local("torchcodec_h264_10bits.mp4")).frames.astype(int)
    hevc = decode_video(local("torchcodec_h265_10bits.mp4")).frames.astype(int)
    assert np.abs(h264 - hevc).mean() < 4
    red_bar = h264[0, 100:140, 5:25].reshape(-1, 3).mean(axis=0)
    assert red_bar[0] > 200 and red_bar[1] < 40 and red_bar[2] < 40


# ---------------------------------------------------------------- bad input


def without_video_tracks(data: bytes) -> bytes:
    """An audio-only MP4: every trak with a video media header renamed to 'free'."""
    out = bytearray(data)
    moov = out.index(b"moov") - 4
    moov_end = moov + struct.unpack_from(">I", out, moov)[0]
    pos = moov + 8
    while pos < moov_end:
        size, kind = struct.unpack_from(">I4s", out, pos)
        if kind == b"trak" and b"vmhd" in out[pos : pos + size]:
            out[pos + 4 : pos + 8] = b"free"
        pos += size
    return bytes(out)


def without_samples(data: bytes) -> bytes:
    """The clip with empty sample tables: a video track with no frame to decode."""
    out = bytearray(data)
    for box in (b"stts", b"stsc", b"stco", b"ctts", b"stss"):
        at = out.find(box)
        if at >= 0:
            out[at + 8 : at + 12] = bytes(4)
    at = out.index(b"stsz")
    out[at + 12 : at + 16] = bytes(4)
    return bytes(out)


def cut_before_first_cluster(data: bytes) -> bytes:
    return data[: data.index(b"\x1f\x43\xb6\x75")]


BAD_VIDEOS = {
    "zero_length": (lambda: b"", "empty"),
    "text": (lambda: b"this is not a video\n", "unknown_format"),
    "audio_only_mp4": (lambda: without_video_tracks(local("torchcodec_nasa_13013.mp4")), "no_video_stream"),
    "no_samples": (lambda: without_samples(local("decord_unordered.mov")), "no_frames"),
    "mov_cut_before_its_index": (lambda: local("hfdatasets_test_video_66x50.mov")[:20_000], "truncated"),
    "mkv_cut_before_any_frame": (lambda: cut_before_first_cluster(local("derived_mkv_truncated.mkv")), "truncated"),
    "av1": (lambda: local("torchcodec_av1_video.mkv"), "unsupported_codec"),
    "corrupt_h264": (lambda: local("decord_corrupted.mp4"), "corrupt"),
}


@pytest.mark.parametrize("name", BAD_VIDEOS)
@pytest.mark.parametrize("modality", ["video", "auto"])
def test_bad_videos_are_typed_errors(name: str, modality: str) -> None:
    make, code = BAD_VIDEOS[name]
    options = DecodeOptions(modality, max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2)
    assert error_code(make(), options) == code


def test_decoder_diagnostics_go_into_the_error_not_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(MediaError) as err:
        decode(local("decord_corrupted.mp4"), QWEN)
    assert "Invalid NAL unit size" in err.value.message
    assert capfd.readouterr().err == ""


def test_truncated_mkv_is_an_error_that_says_how_much_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Told from the clusters before decord opens the bytes: its demuxer has crashed the
    decoding process on this file now and then, which made the row decoder_crashed."""
    import embedjob.decode.video as video

    def no_decoder(*args, **kwargs):
        raise AssertionError("decord opened a Matroska file cut short")

    monkeypatch.setattr(video, "_decord", no_decoder)
    with pytest.raises(MediaError) as err:
        decode(local("derived_mkv_truncated.mkv"), QWEN)
    assert err.value.code == "truncated"
    assert "declares 10.38s but only 5.00s" in err.value.message


def test_only_a_matroska_segment_running_past_the_end_has_a_cut_span() -> None:
    from embedjob.decode.containers import matroska_cut_span

    whole = (SHARED / "videos" / "decord_flipping_a_pancake.mkv").read_bytes() if SHARED.exists() else None
    assert matroska_cut_span(local("derived_mkv_truncated.mkv")) == pytest.approx(5.0)
    assert matroska_cut_span(local("torchcodec_av1_video.mkv")) is None
    if whole is not None:
        assert matroska_cut_span(whole) is None
        assert 0 < matroska_cut_span(whole[: len(whole) // 2]) < matroska_cut_span(whole[: 3 * len(whole) // 4])




# ---------------------------------------------------------------- planned on the rank

_TURNS = [((1, 0), (0, 1)), ((-1, 0), (0, -1)), ((0, 1), (-1, 0)), ((0, -1), (1, 0))]


@settings(max_examples=200, deadline=None)
@given(
    frames=st.integers(1, 5000), fps=st.floats(0.5, 240.0), width=st.integers(16, 8192), height=st.integers(16, 8192),
    turn=st.sampled_from(_TURNS), multiple=st.sampled_from([1, 2]), max_frames=st.integers(2, 64),
)
def test_a_plan_made_on_the_rank_follows_the_cpu_paths_rules(frames, fps, width, height, turn, multiple, max_frames) -> None:
    """What `video.decoder: nvdec` plans for a clip decord cannot open (AV1): the CPU
    path's frame rule, its decode-size bound, the display matrix's turn, and its limits
    as the same too_large rows."""
    from embedjob.decode.types import DeferredVideo
    from embedjob.decode.video import plan_from_stream

    options = DecodeOptions(
        modality="video", max_image_pixels=50_000_000, fps=2.0, max_frames=max_frames, frame_multiple=multiple,
        max_frame_pixels=2_000_000, frame_pixel_limit=33_177_600, video_pixel_limit=500_000_000,
    )
    unplanned = DeferredVideo.unplanned(b"", turn)
    try:
        plan = plan_from_stream(unplanned, frames, fps, width, height, options)
    except MediaError as err:
        assert err.code == "too_large"
        assert width * height > 33_177_600 or "video.max_total_pixels" in str(err)
        return
    assert plan.indices == sample_frame_indices(frames, fps, 2.0, max_frames, multiple)
    decoded_w, decoded_h = plan.decoded
    if width * height <= 2_000_000:
        assert (decoded_w, decoded_h) == (width, height)
    else:
        assert decoded_w * decoded_h <= 2_000_000
    assert abs(decoded_w / decoded_h - width / height) < 0.02 * width / height + 1 / decoded_h
    turned = turn[0][0] == 0
    assert plan.shown == ((decoded_w, decoded_h) if turned else (decoded_h, decoded_w))
    assert len(plan.indices) * decoded_w * decoded_h <= 500_000_000
    assert plan.source_frames == frames and plan.matrix == turn


def test_a_clip_the_rank_finds_no_frames_in_is_a_no_frames_row() -> None:
    from embedjob.decode.types import DeferredVideo
    from embedjob.decode.video import plan_from_stream

    options = DecodeOptions(modality="video", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)
    with pytest.raises(MediaError) as err:
        plan_from_stream(DeferredVideo.unplanned(b"", _TURNS[0]), 0, 30.0, 640, 360, options)
    assert err.value.code == "no_frames"


@pytest.mark.parametrize("name, decodes", [
    ("decord_video_90.mov", False),  # H.264 in MOV: the SPS says 568 x 320, as the container does
    ("torchcodec_h265_video.mp4", False),
    ("colour/derived_h264_bt709.mkv", True),  # Matroska: no SPS read, a frame is decoded
])
def test_a_video_left_for_the_gpu_is_planned_as_the_cpu_path_would_without_decoding_a_frame_where_its_sps_says_the_size(
    name: str, decodes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan (frames, size, display matrix, times) is the one made by decoding the first
    frame to learn the size; for H.264 and HEVC in MP4/MOV the worker takes the size from
    the SPS and decodes nothing (8 such 720p and 1080p clips: 10.1 ms a clip on a core
    instead of 34.8, benchmarks/RESULTS.md section 8)."""
    from embedjob.decode import video

    options = DecodeOptions(modality="video", max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2, defer_video=True)
    data = (LOCAL / name).read_bytes()
    fmt = "MATROSKA" if name.endswith(".mkv") else "MOV" if name.endswith(".mov") else "MP4"
    real = video._get_batch
    calls: list[list[int]] = []

    def counted(job, reader, indices):
        calls.append(indices)
        return real(job, reader, indices)

    monkeypatch.setattr(video, "_get_batch", counted)
    planned = video.decode_video(data, options, fmt)
    assert bool(calls) == decodes
    read_facts = video.mp4_facts
    monkeypatch.setattr(video, "mp4_facts", lambda data: dataclasses.replace(read_facts(data), stream_size=None))
    # Without the SPS's size the worker cuts no pictures (`video.PACKETS_IN_WORKERS`): the rank feeds them itself.
    assert dataclasses.replace(video.decode_video(data, options, fmt), feed=None) == dataclasses.replace(planned, feed=None)


@pytest.mark.parametrize("name, decodes", [
    ("decord_video_90.mov", False),
    ("torchcodec_h265_video.mp4", False),
    ("colour/derived_h264_bt709.mkv", True),
])
def test_decord_reads_the_same_frames_without_decoding_one_alone_where_the_sps_says_the_size(
    name: str, decodes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU path learns the frame size as a worker planning for the GPU does: from the
    SPS of an H.264 or HEVC MP4/MOV whose container says the same, with no frame decoded
    alone (7 % of a clip's decode, benchmarks/RESULTS.md section 8); the frames, times and
    counts are those of decoding the first frame to learn it, scaled down or not."""
    import numpy as np

    from embedjob.decode import video

    data = (LOCAL / name).read_bytes()
    fmt = "MATROSKA" if name.endswith(".mkv") else "MOV" if name.endswith(".mov") else "MP4"
    real = video._get_batch
    alone: list[list[int]] = []

    def counted(job, reader, indices):
        if len(indices) == 1:
            alone.append(indices)
        return real(job, reader, indices)

    read_facts = video.mp4_facts
    for scaled in (None, 200 * 120):
        options = DecodeOptions(modality="video", max_image_pixels=1, fps=2.0, max_frames=32, frame_multiple=2, max_frame_pixels=scaled)
        monkeypatch.setattr(video, "_get_batch", counted)
        monkeypatch.setattr(video, "mp4_facts", read_facts)
        alone.clear()
        read = video.decode_video(data, options, fmt)
        assert bool(alone) == decodes, (scaled, alone)
        monkeypatch.setattr(video, "mp4_facts", lambda data: dataclasses.replace(read_facts(data), stream_size=None))
        sized = video.decode_video(data, options, fmt)
        assert np.array_equal(read.frames, sized.frames), scaled
        assert (read.timestamps, read.source_frames) == (sized.timestamps, sized.source_frames)
