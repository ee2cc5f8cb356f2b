"""`preprocess.decoder: gpu` on the CPU: which JPEGs the workers leave for the device, the
rank's completion of them, nvjpeg's refusals, the job spec and auto's choice.

`decode_on_device` given the CPU decodes with libjpeg-turbo through the same torchvision
call nvjpeg serves on a GPU, so here its items must be bitwise the workers' own: that
checks every step around the decoder (what is deferred, the resize, the patch order,
the metadata, batch assembly). The CUDA side is in test_gpu.py."""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, make_job
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from test_media import IMAGE, JPEGS, PARITY_JPEGS, encode, exif_orientation, halves, shared_files

from embedjob import rows as worker
from embedjob.cli import main
from embedjob.config import JobError, job_from_dict
from embedjob.decode import DeferredImage, MediaError, decode
from embedjob.decode import image as image_decode
from embedjob.decode.device import GROUP_PIXELS, pixel_groups
from embedjob.decode_split import DecodeSplit, gpu_share
from embedjob.encoders import load_adapter
from embedjob.encoders.base import JPEG_KEY
from embedjob.io.checkpoint import job_fingerprint
from embedjob.io.reader import InputRow
from embedjob.pipeline import RankPipeline, video_decoder

DEFER = dataclasses.replace(IMAGE, defer_jpeg=True)
RED, BLUE = (220, 20, 30), (10, 40, 200)
EXTRA_JPEGS = {
    "gray": lambda: encode(halves((90,), (200,), "L"), "JPEG"),
    "cmyk": lambda: encode(halves((0, 200, 100, 0), (200, 0, 0, 50), "CMYK"), "JPEG"),
    "orientation_1": lambda: encode(halves(RED, BLUE, "RGB"), "JPEG", exif=exif_orientation(1)),
    "orientation_6": lambda: encode(halves(RED, BLUE, "RGB"), "JPEG", exif=exif_orientation(6)),
    "bytes_after_the_end": lambda: encode(halves(RED, BLUE, "RGB"), "JPEG") + b"trailing",
}
ALL_JPEGS = {**PARITY_JPEGS, **EXTRA_JPEGS}


def outcome(data: bytes, options) -> tuple:
    try:
        result = decode(data, options)
    except MediaError as err:
        return ("error", str(err))
    if isinstance(result, DeferredImage):
        return ("deferred", result.width, result.height)
    return ("pixels", result.pixels.tobytes())


@pytest.mark.parametrize("name", ALL_JPEGS)
def test_only_jpegs_the_cpu_decodes_without_a_word_are_left_for_the_gpu(name: str) -> None:
    """A deferred JPEG is one the CPU path decodes, upright, at its header's size; any
    other gives exactly the CPU path's outcome (so an error row stays that row)."""
    data = ALL_JPEGS[name]()
    deferred, cpu = outcome(data, DEFER), outcome(data, IMAGE)
    if deferred[0] != "deferred":
        assert deferred == cpu
        return
    assert cpu[0] == "pixels"
    picture = decode(data, IMAGE).pixels
    assert (deferred[2], deferred[1]) == picture.shape[:2] == Image.open(io.BytesIO(data)).size[::-1]


def test_the_common_jpegs_defer_and_the_unusual_ones_stay_on_the_cpu() -> None:
    deferred = {name for name, make in ALL_JPEGS.items() if isinstance(_try(make()), DeferredImage)}
    for name in ("progressive", "gray", "orientation_1", "L_jpeg", "img2dataset_123_456.jpg", "img2dataset_456_123.jpg"):
        assert name in deferred, name
    for name in ("cmyk", "CMYK_jpeg", "orientation_6", "JPEG_orientation_6", "orientation_8", "bytes_after_the_end", "half_jpeg"):
        assert name not in deferred, name
    shared = [f"shared/{p.name}" for p in shared_files("images") if p.suffix == ".jpg"]
    assert all(name in deferred for name in shared)


def _try(data: bytes):
    try:
        return decode(data, DEFER)
    except MediaError as err:
        return err


@pytest.mark.parametrize("order", ["II", "MM"])
@pytest.mark.parametrize("value", range(1, 9))
def test_the_exif_orientation_is_read_in_either_byte_order(order: str, value: int) -> None:
    endian = "little" if order == "II" else "big"
    entry = (0x0110).to_bytes(2, endian) + (2).to_bytes(2, endian) + (4).to_bytes(4, endian) + b"abcd"
    orientation = (0x0112).to_bytes(2, endian) + (3).to_bytes(2, endian) + (1).to_bytes(4, endian)
    orientation += value.to_bytes(2, endian) + b"\x00\x00"
    tiff = order.encode() + (42).to_bytes(2, endian) + (8).to_bytes(4, endian) + (2).to_bytes(2, endian)
    tiff += entry + orientation + b"\x00" * 4
    assert image_decode.exif_orientation(tiff) == value
    assert image_decode.exif_orientation(tiff[:20]) == 0
    pillow = encode(halves(RED, BLUE, "RGB"), "JPEG", exif=exif_orientation(value))
    assert image_decode.jpeg_header(pillow).orientation == value


def rows_of(names: list[str]) -> list[InputRow]:
    return [InputRow(k, name, ALL_JPEGS[name](), None, None) for k, name in enumerate(names)]


CORPUS = ["progressive", "gray", "orientation_1", "orientation_6", "cmyk", "half_jpeg", *JPEGS]
CORPUS += [f"shared/{p.name}" for p in shared_files("images") if p.suffix == ".jpg"]
FAMILIES = {"qwen": "builtin:tiny-qwen2_5_vl", "siglip": "builtin:tiny-siglip", "clip": "builtin:tiny-clip", "siglip2": "builtin:tiny-siglip2"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def preprocess(request: pytest.FixtureRequest, cache_dir: str):
    job = make_job(cache_dir, model={"path": FAMILIES[request.param], "family": request.param.replace("qwen", "qwen2_5_vl")})
    return load_adapter(job, torch.device("cpu")).preprocessor()


def assert_same_rows(got: list[worker.Decoded], want: list[worker.Decoded]) -> None:
    for a, b in zip(got, want, strict=True):
        assert (a.row, a.id, a.error, a.modality) == (b.row, b.id, b.error, b.modality), a.id
        if b.item is None:
            assert a.item is None
            continue
        assert (a.item.tokens, a.item.frames, a.item.size, a.item.grid, a.item.token_grid) == (
            b.item.tokens, b.item.frames, b.item.size, b.item.grid, b.item.token_grid
        ), a.id
        assert sorted(a.item.tensors) == sorted(b.item.tensors), a.id
        for key, value in b.item.tensors.items():
            assert torch.equal(a.item.tensors[key], value), (a.id, key)


def test_a_window_completed_by_the_rank_equals_what_the_workers_make(preprocess) -> None:
    """Deferred rows, sent through a pickle as from a worker, then completed: the items
    (pixels, grid, metadata, tokens) and error rows of the CPU path, bit for bit."""
    rows = rows_of(CORPUS)
    want = [worker.decode_row(row, IMAGE, preprocess) for row in rows]
    window = [pickle.loads(pickle.dumps(worker.decode_row(row, DEFER, preprocess), protocol=5)) for row in rows]
    deferred = {d.id for d in window if d.item is not None and JPEG_KEY in d.item.tensors}
    assert {"progressive", "gray", "orientation_1", "L_jpeg", "img2dataset_123_456.jpg", "img2dataset_456_123.jpg"} <= deferred
    waiting = len(deferred)
    assert worker.decode_on_device(window, IMAGE, preprocess, torch.device("cpu")) == waiting
    assert_same_rows(window, want)


@pytest.mark.parametrize("limit", [GROUP_PIXELS, 1])
def test_a_window_whose_first_nvjpeg_call_was_made_ahead_is_the_same_window_and_lets_its_pictures_go(
    preprocess, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """The rank's nvjpeg thread decodes a window's first group ahead (`decode_ahead`);
    the window finished from it has the CPU path's rows, with one group or one a picture, and
    the pictures decoded ahead are no longer held once resized, although the thread's
    result still is (full-size pictures held longer than their group would break the
    bound on the device's memory)."""
    monkeypatch.setattr(worker, "pixel_groups", lambda sizes: pixel_groups(sizes, limit))
    rows = rows_of(CORPUS)
    want = [worker.decode_row(row, IMAGE, preprocess) for row in rows]
    window = [worker.decode_row(row, DEFER, preprocess) for row in rows]
    waiting = sum(d.item is not None and JPEG_KEY in d.item.tensors for d in window)
    ahead = worker.decode_ahead(window, torch.device("cpu"))
    assert sum(map(len, ahead.groups)) == waiting and len(ahead.groups) == (1 if limit == GROUP_PIXELS else waiting)
    assert len(ahead.first) == len(ahead.groups[0]) and all(image is not None for image in ahead.first)
    assert worker.decode_on_device(window, IMAGE, preprocess, torch.device("cpu"), ahead) == waiting
    assert ahead.first == []
    assert_same_rows(window, want)


def test_pictures_of_one_size_are_finished_in_one_call_and_a_failure_stays_with_its_row(preprocess) -> None:
    """The rank resizes and patches the pictures of one size together; where that fails
    for one of them, it alone is an error row and the rest are the workers' items."""
    names = ["progressive", "gray", "orientation_1", "orientation_6", "img2dataset_123_456.jpg", "img2dataset_456_123.jpg"]
    rows = rows_of(names)
    window = [worker.decode_row(row, DEFER, preprocess) for row in rows]
    poisoned = window[2].item.tensors[JPEG_KEY]
    calls: list[int] = []

    class CountingPreprocess:
        def on_device(self, items: list, images: torch.Tensor) -> list:
            calls.append(len(items))
            if any(item.tensors[JPEG_KEY] is poisoned for item in items):
                raise ValueError("a picture it cannot take")
            return preprocess.on_device(items, images)

    # orientation_6 is decoded by its worker (the GPU's decoder would not turn it).
    assert worker.decode_on_device(window, IMAGE, CountingPreprocess(), torch.device("cpu")) == len(rows) - 1
    # progressive, gray and orientation_1 (60 x 40): one call, then one each after it failed;
    # the two photos of other sizes: one call each.
    assert sorted(calls) == [1, 1, 1, 1, 1, 3]
    want = [worker.decode_row(row, IMAGE, preprocess) for row in rows]
    assert window[2].item is None and window[2].error == "preprocess_failed: ValueError: a picture it cannot take"
    assert_same_rows(window[:2] + window[3:], want[:2] + want[3:])


def test_a_jpeg_nvjpeg_refuses_takes_the_cpu_path_row_for_row(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the device's decoder refuses a file, its row is what a worker makes of it:
    the picture, or the same error row (a JPEG whose header is plain and whose data is
    garbage)."""
    garbage = bytearray(ALL_JPEGS["progressive"]())
    start = garbage.index(b"\xff\xda") + 20
    garbage[start : len(garbage) - 2] = bytes(len(garbage) - 2 - start)
    ALL_JPEGS_WITH = {**ALL_JPEGS, "garbage_scan": lambda: bytes(garbage)}
    rows = [InputRow(k, name, ALL_JPEGS_WITH[name](), None, None) for k, name in enumerate([*CORPUS, "garbage_scan"])]
    monkeypatch.setattr(worker, "decode_jpegs", lambda data, device: [None] * len(data))
    window = [worker.decode_row(row, DEFER, preprocess) for row in rows]
    assert worker.decode_on_device(window, IMAGE, preprocess, torch.device("cpu")) == 0
    assert_same_rows(window, [worker.decode_row(row, IMAGE, preprocess) for row in rows])


def test_a_refused_jpeg_of_an_auto_modality_job_is_the_workers_error_row(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `input.modality: auto` a row that does not decode has no modality, on either path."""
    auto = dataclasses.replace(IMAGE, modality="auto")
    garbage = bytearray(ALL_JPEGS["gray"]())
    table = garbage.index(b"\xff\xc4") + 5  # a Huffman table's 16 code counts, after the frame header
    garbage[table : table + 16] = b"\xff" * 16
    rows = [InputRow(0, "garbage", bytes(garbage), None, None), InputRow(1, "gray", ALL_JPEGS["gray"](), None, None)]
    monkeypatch.setattr(worker, "decode_jpegs", lambda data, device: [None] * len(data))
    window = [worker.decode_row(row, dataclasses.replace(auto, defer_jpeg=True), preprocess) for row in rows]
    assert all(JPEG_KEY in d.item.tensors for d in window)
    worker.decode_on_device(window, auto, preprocess, torch.device("cpu"))
    want = [worker.decode_row(row, auto, preprocess) for row in rows]
    assert_same_rows(window, want)
    assert want[0].error is not None and want[0].modality is None


@given(st.lists(st.integers(0, 300), max_size=40), st.integers(1, 500))
def test_pixel_groups_cover_every_index_in_order_within_the_limit(pixels: list[int], limit: int) -> None:
    groups = pixel_groups(pixels, limit)
    assert [k for group in groups for k in group] == list(range(len(pixels)))
    for group in groups:
        assert len(group) == 1 or sum(pixels[k] for k in group) <= limit
    for first, second in zip(groups, groups[1:]):
        assert sum(pixels[k] for k in first) + pixels[second[0]] > limit


def spec(**preprocess) -> dict:
    return {"input": {"path": "x.parquet", "media_column": "image"}, "model": {"path": "builtin:tiny-siglip"},
            "output": {"path": "out"}, "preprocess": preprocess}


@pytest.mark.parametrize(
    ("change", "key", "says"),
    [
        ({"preprocess": {"decoder": "gpu", "tiling": "anyres"}}, "preprocess.decoder", "use decoder: cpu or tiling: none"),
        ({"preprocess": {"decoder": "gpu"}, "runtime": {"device": "cpu"}}, "preprocess.decoder", "runtime.device is 'cpu'; use decoder: cpu"),
        ({"preprocess": {"decoder": "gpu"}, "input": {"modality": "video"}}, "preprocess.decoder", "input.modality is 'video'"),
        ({"preprocess": {"decoder": "nvjpeg"}}, "preprocess.decoder", "'cpu' | 'gpu' | 'auto'"),
        ({"video": {"decoder": "nvdec"}, "runtime": {"device": "cpu"}}, "video.decoder", "runtime.device is 'cpu'; use video.decoder: decord"),
        ({"video": {"decoder": "nvdec"}, "input": {"modality": "image"}}, "video.decoder", "input.modality is 'image'"),
    ],
)
def test_a_decoder_the_job_cannot_use_is_refused_with_what_to_change(change: dict, key: str, says: str) -> None:
    raw = spec()
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(JobError, match=key) as err:
        job_from_dict(raw)
    assert says in str(err.value)


def test_the_default_decoders_leave_the_fingerprint_of_earlier_output_unchanged(tmp_path: Path, cache_dir: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"image": [b"x"]}), table)
    cpu = job_fingerprint(make_job(cache_dir, input={"path": str(table)}))
    gpu = job_fingerprint(make_job(cache_dir, input={"path": str(table)}, preprocess={"decoder": "gpu"}))
    assert "decoder" not in cpu["preprocessing"]["preprocess"] and gpu["preprocessing"]["preprocess"]["decoder"] == "gpu"
    nvdec = job_fingerprint(make_job(cache_dir, input={"path": str(table), "modality": "auto"}, video={"decoder": "nvdec"}))
    assert "decoder" not in cpu["preprocessing"]["video"] and nvdec["preprocessing"]["video"]["decoder"] == "nvdec"


DEMO = str(REPO / "jobs" / "demo.yaml")


def test_a_gpu_decoder_without_a_gpu_is_one_line_before_any_row(tmp_path: Path, cache_dir: str, capsys) -> None:
    code = main(["run", DEMO, "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}",
                 "--set", "preprocess.decoder=gpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "preprocess.decoder = 'gpu' cannot run here: cpu is not a CUDA device; use decoder: cpu" in err
    assert not list(tmp_path.glob("part-*.parquet"))


def test_auto_without_a_gpu_decodes_in_the_workers(tmp_path: Path, cache_dir: str) -> None:
    code = main(["run", DEMO, "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}",
                 "--set", "preprocess.decoder=auto"])
    assert code == 0
    stats = json.loads(next((tmp_path / "_embedjob").glob("stats-*.json")).read_text())
    assert stats["device_decoded"] == 0 and [r["decoder"] for r in stats["ranks"]] == ["cpu"]
    assert stats["rows"] == 12 and stats["errors"] == 2


@pytest.mark.parametrize(
    ("worker_rate", "device_rate", "gpu_rate", "share"),
    [
        (2400.0, 1000.0, float("inf"), 0.0),  # the workers keep up with room to spare: all on the CPU
        (900.0, 1000.0, float("inf"), 0.25),  # they would hold the device back: the GPU takes the rest
        (900.0, 1000.0, 2000.0, 0.25),  # the GPU can take it
        (400.0, 1000.0, 600.0, 0.6),  # together they cannot keep up: each finishes its part together
        (0.0, 1000.0, float("inf"), 1.0),
    ],
)
def test_auto_leaves_the_gpu_what_the_workers_cannot_decode(worker_rate, device_rate, gpu_rate, share) -> None:
    assert gpu_share(worker_rate, device_rate, gpu_rate, margin=1.2) == pytest.approx(share)


@given(st.floats(0, 1e5), st.floats(1, 1e5), st.floats(1, 1e5) | st.just(float("inf")))
def test_the_gpus_share_is_a_fraction_no_larger_than_the_workers_need(worker_rate, device_rate, gpu_rate) -> None:
    share = gpu_share(worker_rate, device_rate, gpu_rate, margin=1.2)
    assert 0.0 <= share <= 1.0
    if worker_rate >= 1.2 * device_rate:
        assert share == 0.0
    assert share <= max(0.0, 1.0 - worker_rate / (1.2 * device_rate)) + 1e-9


@pytest.mark.parametrize("share", [0.0, 0.25, 0.4, 1.0])
def test_auto_leaves_its_share_of_rows_evenly_spread(share: float) -> None:
    split = DecodeSplit(share=share)
    left = [split.leave() for _ in range(100)]
    assert sum(left) == round(100 * share)
    runs = "".join("g" if x else "c" for x in left).split("g")
    if 0 < share < 1:
        assert max(len(r) for r in runs[1:-1]) <= round(1 / share)


@pytest.mark.parametrize(("splitting", "setting", "media"), [("jpeg", "preprocess.decoder", "JPEGs"), ("video", "video.decoder", "videos")])
def test_auto_splits_the_media_from_the_rates_it_measures_and_says_so(
    caplog: pytest.LogCaptureFixture, splitting: str, setting: str, media: str
) -> None:
    """4 workers at 10 ms a row (400 rows/s) against a device at 1,000 items/s and a
    GPU decoder still unmeasured: the GPU gets 1 - 400 / 1,200 of the rows (JPEGs with
    `preprocess.decoder: auto`, videos with `video.decoder: auto`). Nothing is decided
    before AUTO_ROWS items; then every window's figures move the share."""
    job = job_from_dict(spec(decoder="auto"))
    rank = RankPipeline(job, torch.device("cpu"), 0, 4, lambda: None, lambda *a: None, lambda: None, lambda t: True)
    rank.decoder, rank.video = ("auto", "decord") if splitting == "jpeg" else ("cpu", "auto")
    assert rank.splitting == splitting
    stats, split = rank.stats, rank.split
    worker_rows = [worker.Decoded(k, k, None, None, "bad", seconds=0.01) for k in range(32)]
    split.count(worker_rows)
    stats.rows = stats.items = 32
    stats.busy_seconds = 32 / 1000
    stats.device_decode_seconds = 0.001  # the GPU-decode thread's windows with nothing to decode
    rank._split_decoding()
    assert split.share == 0.0 and stats.gpu_share is None and not any(split.leave() for _ in range(10))
    split.count(worker_rows)
    stats.rows = stats.items = 64
    stats.busy_seconds = 64 / 1000
    with caplog.at_level("INFO", logger="embedjob.pipeline"):
        rank._split_decoding()
    assert split.share == stats.gpu_share == pytest.approx(2 / 3)
    assert f"{setting} auto: 4 decode workers make 400 rows/s" in caplog.text
    assert f"67% of the {media} from here on decode on the GPU" in caplog.text
    assert sum(split.leave() for _ in range(300)) == 200
    stats.device_decoded, stats.device_decode_seconds = 100, 0.501
    rank._split_decoding()
    assert split.share == pytest.approx(200 / 600, rel=1e-2)


def test_a_task_says_whether_its_jpeg_is_left_for_the_gpu(preprocess) -> None:
    """`decoder: auto` hands the workers (row, defer) tasks: the same row gives the CPU
    path's item, or the undecoded JPEG's, as the rank decided when it submitted it."""
    row = rows_of(["gray"])[0]
    deferring = dataclasses.replace(IMAGE, defer_jpeg=True)
    on_cpu = worker.decode_task((row, False), IMAGE, deferring, preprocess)
    left = worker.decode_task((row, True), IMAGE, deferring, preprocess)
    assert JPEG_KEY not in on_cpu.item.tensors and JPEG_KEY in left.item.tensors
    assert_same_rows([on_cpu], [worker.decode_row(row, IMAGE, preprocess)])


def test_the_rank_reads_a_plain_jpegs_header_as_a_worker_would_and_leaves_it_every_other_row(preprocess) -> None:
    """The pool's local path (`jpeg_on_rank`): for a JPEG a worker would leave for the
    GPU, that worker's row (item, size, tokens, copied columns); None for any other row
    (a JPEG the CPU must decode, a PNG, a path, a row the reader failed, any row of a
    video job), so a worker makes it as before."""
    png = encode(halves(RED, BLUE, "RGB"), "PNG")
    rows = [dataclasses.replace(row, extra=(row.id,)) for row in rows_of(CORPUS)]
    rows += [InputRow(len(rows), "png", png, None, None), InputRow(len(rows) + 1, "unread", None, None, "unreadable: gone")]
    rows.append(InputRow(len(rows), "path", None, "missing.jpg", None))
    on_rank = 0
    for row in rows:
        want = worker.decode_row(row, DEFER, preprocess)
        got = worker.jpeg_on_rank(row, DEFER, preprocess)
        if want.item is None or JPEG_KEY not in want.item.tensors:
            assert got is None, row.id
            continue
        assert_same_rows([got], [want])
        assert got.extra == want.extra == (row.id,)
        on_rank += 1
    assert on_rank >= 6
    video_job = dataclasses.replace(DEFER, modality="video")
    assert all(worker.jpeg_on_rank(row, video_job, preprocess) is None for row in rows)
    gray = rows_of(["gray"])[0]
    assert worker.task_on_rank((gray, False), IMAGE, preprocess) is None
    assert_same_rows([worker.task_on_rank((gray, True), IMAGE, preprocess)], [worker.decode_task((gray, True), IMAGE, dataclasses.replace(IMAGE, defer_jpeg=True), preprocess)])


def test_videos_and_other_images_in_a_window_pass_the_gpu_decode_untouched(preprocess) -> None:
    """With `input.modality: auto`, a window mixes deferred JPEGs with videos and PNGs,
    which the workers decoded: only the JPEGs change."""
    auto = dataclasses.replace(IMAGE, modality="auto")
    media = [ALL_JPEGS["gray"](), (Path(__file__).parent / "data" / "hfdatasets_test_video_66x50.mov").read_bytes(),
             (Path(__file__).parent / "data" / "hfdatasets_test_image_rgba.png").read_bytes(), ALL_JPEGS["progressive"]()]
    rows = [InputRow(k, k, data, None, None) for k, data in enumerate(media)]
    window = [worker.decode_row(row, dataclasses.replace(auto, defer_jpeg=True), preprocess) for row in rows]
    assert [JPEG_KEY in d.item.tensors for d in window] == [True, False, False, True]
    assert window[1].modality == "video"
    assert worker.decode_on_device(window, auto, preprocess, torch.device("cpu")) == 2
    assert_same_rows(window, [worker.decode_row(row, auto, preprocess) for row in rows])


# Videos decoded by the GPU's video decoder (`video.decoder: nvdec`). PyNvVideoCodec needs
# a GPU; here a stand-in with its interface reads the same bytes with decord, so the rows
# must be the CPU path's bit for bit: the plan (indices, size, display matrix), its trip
# through a pickle, the matrix applied on the rank and the family's steps after it.

class StandInDecoder:
    """PyNvVideoCodec.SimpleDecoder's calls used by `nvdec.decode_frames`, over decord.
    One call at a time: decord reading from memory on several threads at once crashed
    the test process (once in ten runs); the real decoder has no such limit."""

    made = 0
    lock = threading.Lock()

    def __init__(self, path: str, gpu_id: int = 0, use_device_memory: bool = True, output_color_type: object = None) -> None:
        type(self).made += 1
        self.reconfigure_decoder(path)

    def reconfigure_decoder(self, path: str) -> None:
        import decord

        with self.lock:
            self.reader = decord.VideoReader(io.BytesIO(Path(path).read_bytes()))

    def get_stream_metadata(self) -> SimpleNamespace:
        with self.lock:
            height, width = self.reader[0].shape[:2]
            return SimpleNamespace(
                height=height, width=width, num_frames=len(self.reader), average_fps=self.reader.get_avg_fps(), codec_name="h264"
            )

    def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
        with self.lock:
            return [torch.from_numpy(frame) for frame in self.reader.get_batch(indices).asnumpy()]


class StandInDemuxer:
    """PyNvVideoCodec.CreateDemuxer's stream facts: the bit depth (8, or 10 for the bytes
    in `deep`), the size decord decodes and the container's codec."""

    deep: frozenset[bytes] = frozenset()

    def __init__(self, path: str) -> None:
        import decord

        self.data = Path(path).read_bytes()
        with StandInDecoder.lock:
            self.height, self.width = decord.VideoReader(io.BytesIO(self.data))[0].shape[:2]

    def BitDepth(self) -> int:  # noqa: N802 (PyNvVideoCodec's names)
        return 10 if self.data in self.deep else 8

    def Width(self) -> int:  # noqa: N802
        return self.width

    def Height(self) -> int:  # noqa: N802
        return self.height

    def GetNvCodecId(self) -> str:  # noqa: N802
        from embedjob.decode.containers import mp4_facts

        return (mp4_facts(self.data).video_codecs or ["?"])[0]


def stand_in(monkeypatch: pytest.MonkeyPatch, decoder: type = StandInDecoder, nv12: bool = False) -> None:
    """PyNvVideoCodec's sessions replaced by `decoder`. Unless `nv12`, the rank asks its
    sessions for RGB (`nvdec.YUV_HERE` off), which is what decord gives the stand-in: the
    rows can be the CPU path's bit for bit. The NV12 reading is tested on its own below,
    and so is the packet feed (`nvdec.FEED_SAMPLED`, off here)."""
    from embedjob.decode import nvdec

    monkeypatch.setattr(decoder, "made", 0)
    monkeypatch.setattr(nvdec, "YUV_HERE", nv12)
    monkeypatch.setattr(nvdec, "FEED_SAMPLED", False)
    colours = SimpleNamespace(RGB="RGB", NATIVE="NATIVE")
    module = SimpleNamespace(SimpleDecoder=decoder, CreateDemuxer=StandInDemuxer, OutputColorType=colours)
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)


DATA = Path(__file__).parent / "data"
VIDEOS = sorted(p.name for p in DATA.iterdir() if p.suffix in (".mov", ".mp4", ".mkv"))
VIDEO_OPTIONS = dataclasses.replace(IMAGE, modality="auto")


def video_rows() -> list[InputRow]:
    media = [(DATA / name).read_bytes() for name in VIDEOS] + [ALL_JPEGS["gray"]()]
    return [InputRow(k, name, data, None, None) for k, (name, data) in enumerate(zip([*VIDEOS, "gray"], media))]


def cpu_rows_with_av1_refused(window: list[worker.Decoded], rows: list[InputRow], preprocess, said: str) -> list[worker.Decoded]:
    """The CPU path's rows of `rows`, where AV1's error row also says what the GPU's
    decoder said when it refused the clip (an H200's NVDEC has no AV1): the user learns
    that no decoder here reads it."""
    want = [worker.decode_row(row, VIDEO_OPTIONS, preprocess) for row in rows]
    av1 = VIDEOS.index("torchcodec_av1_video.mkv")
    assert want[av1].error.startswith("unsupported_codec: ")
    assert window[av1].error.startswith(want[av1].error + "; the GPU's video decoder refused it too: ")
    assert said in window[av1].error
    want[av1] = dataclasses.replace(want[av1], error=window[av1].error)
    return want


def test_videos_decoded_on_the_device_are_the_cpu_paths_rows(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotated clips (their display matrices applied on the rank), clips the CPU path
    refuses while planning (truncated: its error row, decided in the worker) or while
    reading (corrupt frames: the rank's fallback), a codec decord lacks (AV1: left to
    the rank, whose decoder here lacks it too, so the CPU path's error row) and an
    image beside them."""
    stand_in(monkeypatch)
    rows = video_rows()
    deferring = dataclasses.replace(VIDEO_OPTIONS, defer_video=True)
    window = [pickle.loads(pickle.dumps(worker.decode_row(row, deferring, preprocess), protocol=5)) for row in rows]
    deferred = {d.id for d in window if d.item is not None and "video" in d.item.tensors}
    assert {"decord_video_0.mov", "decord_video_90.mov", "decord_video_180.mov", "decord_video_270.mov"} <= deferred
    # decord_corrupted.mp4's first frame decodes (the plan holds), its others do not: the
    # decoder raises and the row is the CPU path's error row.
    assert "decord_corrupted.mp4" in deferred and "torchcodec_av1_video.mkv" in deferred
    # Clips below nvdec.MIN_SIDE (50 x 50, 66 x 50, 128 x 128) are read by the CPU path too.
    assert SMALL <= deferred
    assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == len(deferred) - 2 - len(SMALL)
    assert_same_rows(window, cpu_rows_with_av1_refused(window, rows, preprocess, "cannot find video stream"))
    # Decoder sessions are kept by their threads and reconfigured per video of the kind
    # they were made for; a session that failed (on the corrupt clip, on AV1) or meets
    # a video of another size is made again.
    assert StandInDecoder.made < len(deferred)


@pytest.mark.parametrize("sessions", [2, 3])
def test_the_gpu_decodes_as_many_videos_at_once_as_video_nvdec_sessions_says(
    preprocess, monkeypatch: pytest.MonkeyPatch, sessions: int
) -> None:
    """`video.nvdec_sessions` decoder sessions read a window's videos at once, each kept
    by its own thread: a window of eight clips of one kind makes exactly that many
    sessions (one engine each on the GPU), and its rows are the CPU path's."""
    threads: set[str] = set()

    class Counted(StandInDecoder):
        def reconfigure_decoder(self, path: str) -> None:
            threads.add(threading.current_thread().name)
            super().reconfigure_decoder(path)

    stand_in(monkeypatch, Counted)
    options = dataclasses.replace(VIDEO_OPTIONS, nvdec_sessions=sessions)
    rows = [row for row in video_rows() if row.id.startswith("decord_video_")] * 2
    window = [worker.decode_row(row, dataclasses.replace(options, defer_video=True), preprocess) for row in rows]
    assert worker.decode_on_device(window, options, preprocess, torch.device("cpu")) == len(rows) == 8
    assert_same_rows(window, [worker.decode_row(row, options, preprocess) for row in rows])
    assert len(threads) == Counted.made == sessions


def test_a_decoded_video_is_handed_on_while_the_threads_decode_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvdec.decode_videos` yields a window's first video as soon as it is decoded: the
    rank finishes it while the decode threads read the rest, not after the whole window
    (a window of 128 clips kept 7 threads idle through its finishing). The last video's
    decode here waits until the caller holds the first, so a list of them all would hang."""
    from embedjob.decode import nvdec
    from embedjob.decode.types import DeferredVideo

    first_taken = threading.Event()

    def decoded(video: DeferredVideo, device: torch.device, options: object) -> tuple[torch.Tensor, DeferredVideo]:
        if video.data == b"last" and not first_taken.wait(timeout=30):
            raise TimeoutError("the caller never got the first video while this one was decoding")
        return torch.zeros(1), video

    monkeypatch.setattr(nvdec, "decode_frames", decoded)
    monkeypatch.setattr(nvdec, "_pool", None)
    videos = [DeferredVideo.unplanned(data) for data in (b"first", b"middle", b"last")]
    results = nvdec.decode_videos(videos, torch.device("cpu"), dataclasses.replace(VIDEO_OPTIONS, nvdec_sessions=3))
    first = next(results)
    first_taken.set()
    rest = list(results)
    nvdec._pool[1].shutdown(wait=True)
    assert [result[1].data for result in [first, *rest]] == [b"first", b"middle", b"last"]


def test_a_video_jobs_auto_split_leaves_the_gpu_nothing_until_the_rank_is_ready_then_starts_even(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the rank sets up its GPU decodes nothing, so the clips the workers start
    then are theirs (`SETUP_SHARE`); once it is ready, before auto has measured a rate
    (two windows of rows are taken by then), a video job leaves every other clip to the
    GPU's decoder, from the next clip on, which would otherwise sit idle through tens of
    seconds of clips; a JPEG job stays on its workers."""
    from embedjob import decode_split

    video, jpeg, neither = DecodeSplit.first("video"), DecodeSplit.first("jpeg"), DecodeSplit.first(None)
    assert not any(video.leave() for _ in range(8))
    for split in (video, jpeg, neither):
        split.ready()
    assert [video.leave() for _ in range(8)] == [True, False] * 4
    assert not any(jpeg.leave() for _ in range(8)) and not any(neither.leave() for _ in range(8))
    monkeypatch.setattr(decode_split, "SETUP_SHARE", 0.5)
    early = DecodeSplit.first("video")
    assert [early.leave() for _ in range(4)] == [True, False] * 2


def test_a_video_jobs_rows_are_split_as_a_worker_starts_them_and_a_jpeg_jobs_as_they_are_taken() -> None:
    """`video.decoder: auto` hands the pool its rows as they are and decides each as it
    is sent to a worker (`assign`), by the share of that moment; `preprocess.decoder:
    auto` decides as the pool takes a row, as its own path for left JPEGs needs."""
    job = job_from_dict(spec(decoder="auto"))
    rank = RankPipeline(job, torch.device("cpu"), 0, 4, lambda: None, lambda *a: None, lambda: None, lambda t: True)
    rows = rows_of(["gray", "gray"])
    rank.decoder, rank.video, rank.split = "cpu", "auto", DecodeSplit.first("video")
    tasks, assign = rank._split_tasks(iter(rows))
    taken = list(tasks)
    assert taken == rows and assign is not None
    assert assign(taken[0]) == (rows[0], False)
    rank.split.ready()
    assert assign(taken[1]) == (rows[1], True)
    rank.decoder, rank.video, rank.split = "auto", "decord", DecodeSplit(share=1.0, credit=0.0)
    tasks, assign = rank._split_tasks(iter(rows))
    assert assign is None and list(tasks) == [(row, True) for row in rows]


def test_the_gpus_share_of_the_videos_starts_once_the_graphs_are_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers start on the first rows while the rank captures its graphs; rows they
    start meanwhile are theirs, and the GPU's share (`FIRST_SHARE`) starts only once
    capture is done, as the rank's GPU decodes from then on."""
    job = job_from_dict(spec(decoder="auto"))
    rank = RankPipeline(job, torch.device("cpu"), 0, 0, lambda: None, lambda *a: None, lambda: None, lambda t: True)
    rank.decoder, rank.video, rank.split = "cpu", "auto", DecodeSplit.first("video")
    rank.options, rank.preprocess = VIDEO_OPTIONS, None
    during: list[float] = []

    class Capturing:
        def capture(self) -> None:
            during.append(rank.split.share)

    rank.encoder = Capturing()
    pool, _ = rank._start_decoding_while_capturing(iter(rows_of(["gray"])))
    pool.close()
    assert during == [0.0] and rank.split.share == 0.5


def test_a_codec_decord_lacks_is_planned_on_the_rank_by_the_cpu_paths_rules(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A video decord cannot open (its codec missing from decord's FFmpeg, as AV1 is)
    is planned by the rank from what its decoder reads of the stream: the same frames,
    size, tokens and pixels as the CPU path gives a clip it can read (these clips' frames
    are evenly spaced in time), and the limits of the job still hold there."""
    from embedjob.decode import video

    stand_in(monkeypatch)
    names = ["decord_video_90.mov", "decord_video_180.mov", "torchcodec_nasa_13013.mp4"]
    rows = [row for row in video_rows() if row.id in names]
    want = [worker.decode_row(row, VIDEO_OPTIONS, preprocess) for row in rows]

    def no_decoder(job: object) -> None:
        raise MediaError("unsupported_codec", "decord's FFmpeg 4.1 has no decoder for the video codec of this MP4 (AV1 is one)")

    monkeypatch.setattr(video, "_decode_video_job", no_decoder)
    deferring = dataclasses.replace(VIDEO_OPTIONS, defer_video=True)
    window = [pickle.loads(pickle.dumps(worker.decode_row(row, deferring, preprocess), protocol=5)) for row in rows]
    assert all(d.item is not None and d.item.tokens == 0 for d in window)
    assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == len(rows)
    assert_same_rows(window, want)

    small = dataclasses.replace(VIDEO_OPTIONS, video_pixel_limit=1_000)
    window = [worker.decode_row(row, dataclasses.replace(small, defer_video=True), preprocess) for row in rows]
    assert worker.decode_on_device(window, small, preprocess, torch.device("cpu")) == 0
    assert all(d.item is None and d.error.startswith("too_large: ") and "video.max_total_pixels" in d.error for d in window)


def test_a_video_the_device_decoder_refuses_takes_the_cpu_path(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(StandInDecoder):
        def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
            raise RuntimeError("HW decoder: unsupported")

    stand_in(monkeypatch, Refusing)
    rows = video_rows()
    window = [worker.decode_row(row, dataclasses.replace(VIDEO_OPTIONS, defer_video=True), preprocess) for row in rows]
    assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == 0
    assert_same_rows(window, cpu_rows_with_av1_refused(window, rows, preprocess, "cannot find video stream"))


def test_frames_the_device_decoder_pads_are_not_taken_for_the_picture(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVDEC returned a small clip padded (66 x 50 as 192 x 96): frames of another size
    than the stream's take the CPU path instead of being embedded from the padding."""

    class Padding(StandInDecoder):
        def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
            return [torch.nn.functional.pad(f, (0, 0, 0, 126, 0, 46)) for f in super().get_batch_frames_by_index(indices)]

    stand_in(monkeypatch, Padding)
    rows = [row for row in video_rows() if row.id == "torchcodec_nasa_13013.mp4"]
    window = [worker.decode_row(row, dataclasses.replace(VIDEO_OPTIONS, defer_video=True), preprocess) for row in rows]
    assert "video" in window[0].item.tensors
    assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == 0
    assert_same_rows(window, [worker.decode_row(row, VIDEO_OPTIONS, preprocess) for row in rows])


SMALL = {"decord_unordered.mov", "hfdatasets_test_video_66x50.mov", "torchcodec_h265_video.mp4"}


def test_clips_below_the_decoders_reliable_size_take_the_cpu_path(
    preprocess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An H200 garbled a 66 x 50 clip at its own size from a reconfigured session: clips
    with a side below nvdec.MIN_SIDE are never read by the GPU's decoder, their rows are
    the CPU path's, and no session is made for them."""
    read: list[int] = []

    class Counting(StandInDecoder):
        def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
            read.append(len(indices))
            return super().get_batch_frames_by_index(indices)

    stand_in(monkeypatch, Counting)
    rows = [row for row in video_rows() if row.id in SMALL | {"decord_video_90.mov"}]
    for row in rows:
        window = [worker.decode_row(row, dataclasses.replace(VIDEO_OPTIONS, defer_video=True), preprocess)]
        assert "video" in window[0].item.tensors
        assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == (row.id not in SMALL)
        assert_same_rows(window, [worker.decode_row(row, VIDEO_OPTIONS, preprocess)])
    # The small clips are refused from what the demuxer says, before any session sees them.
    assert len(read) == 1 and Counting.made == 1


def test_video_auto_tasks_leave_each_video_for_the_gpu_or_decode_it_as_the_rank_decided(preprocess, monkeypatch: pytest.MonkeyPatch) -> None:
    """`video.decoder: auto` hands the workers (row, defer) tasks: a video left for the GPU
    comes back planned and undecoded, the others decoded as decord decodes them, and the
    window of both, once the rank's decoder has read the left ones, is the CPU path's rows."""
    stand_in(monkeypatch)
    names = ["decord_video_0.mov", "decord_video_90.mov", "decord_video_180.mov", "decord_video_270.mov", "torchcodec_nasa_13013.mp4"]
    rows = [row for row in video_rows() if row.id in names]
    leave = [k % 2 == 0 for k in range(len(rows))]
    deferring = dataclasses.replace(VIDEO_OPTIONS, defer_video=True)
    window = [
        pickle.loads(pickle.dumps(worker.decode_task((row, left), VIDEO_OPTIONS, deferring, preprocess), protocol=5))
        for row, left in zip(rows, leave)
    ]
    assert [worker.left_for_device(d) for d in window] == leave
    assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == sum(leave)
    assert_same_rows(window, [worker.decode_row(row, VIDEO_OPTIONS, preprocess) for row in rows])


def test_video_auto_decodes_with_decord_where_the_gpu_cannot_and_says_why(
    cache_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """auto is "auto" only in a video job on a device whose video decoder can run; else
    "decord", in one log line naming why. nvdec where it cannot run stops the job."""
    caplog.set_level("INFO", logger="embedjob.pipeline")
    video = make_job(cache_dir, input={"modality": "video"}, video={"decoder": "auto"})
    assert video_decoder(video, torch.device("cpu")) == "decord"
    assert "video.decoder auto: videos decode in the workers (cpu is not a CUDA device)" in caplog.text
    monkeypatch.setattr("embedjob.pipeline.nvdec_problem", lambda device: None)
    assert video_decoder(video, torch.device("cpu")) == "auto"
    mixed = make_job(cache_dir, input={"modality": "auto"}, video={"decoder": "auto"})
    assert video_decoder(mixed, torch.device("cpu")) == "decord"
    assert "input.modality is 'auto', and auto splits the rows of a video job" in caplog.text
    assert video_decoder(make_job(cache_dir, video={"decoder": "decord"}), torch.device("cpu")) == "decord"
    monkeypatch.setattr("embedjob.pipeline.nvdec_problem", lambda device: "no GPU here")
    with pytest.raises(JobError, match="video.decoder = 'nvdec' cannot run here: no GPU here"):
        video_decoder(make_job(cache_dir, input={"modality": "video"}, video={"decoder": "nvdec"}), torch.device("cpu"))


def test_a_video_job_with_video_decoder_auto_on_a_cpu_gives_decords_rows(tmp_path: Path, cache_dir: str) -> None:
    """`embedjob run --set video.decoder=auto` where no GPU decodes: the decode workers do
    all of it, and the rows are a decord job's."""
    import pyarrow.parquet as pq

    demo = str(REPO / "jobs" / "demo-video.yaml")
    for name, decoder in (("decord", "decord"), ("auto", "auto")):
        code = main(["run", demo, "--set", f"output.path={tmp_path / name}", "--set", f"runtime.cache_dir={cache_dir}",
                     "--set", f"video.decoder={decoder}"])
        assert code == 0
    tables = [pq.read_table(sorted((tmp_path / name).glob("part-*.parquet"))).to_pylist() for name in ("decord", "auto")]
    assert tables[0] == tables[1] and any(row["frames"] for row in tables[0])


def test_nvdec_without_its_package_or_a_gpu_is_one_line_before_any_row(tmp_path: Path, cache_dir: str, capsys) -> None:
    demo = str(REPO / "jobs" / "demo-video.yaml")
    code = main(["run", demo, "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}",
                 "--set", "video.decoder=nvdec"])
    assert code == 2
    assert "video.decoder = 'nvdec' cannot run here: cpu is not a CUDA device; or use video.decoder: decord" in capsys.readouterr().err
    assert not list(tmp_path.glob("part-*.parquet"))


def test_the_nvdec_problem_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedjob.decode.nvdec import nvdec_problem

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)
    problem = nvdec_problem(torch.device("cuda", 0))
    assert problem is not None and "pip install 'embedjob[nvdec]'" in problem
    stand_in(monkeypatch)
    assert nvdec_problem(torch.device("cuda", 0)) is None


def test_a_refusal_of_the_gpus_video_decoder_is_one_line_a_user_can_act_on() -> None:
    """PyNvVideoCodec's error text as an H200 gave it for an AV1 clip, and a plain one."""
    from embedjob.decode.nvdec import refusal

    said = RuntimeError("HandleVideoSequence : \nError code : 801\nError Type : Codec not supported on this GPU\n"
                        "at /project/src/VideoCodecSDKUtils/helper_classes/NvCodec/NvDecoder/NvDecoder.cpp:274\n")
    assert refusal(said) == "Codec not supported on this GPU (error 801)"
    assert refusal(RuntimeError("\nno frames\nmore")) == "no frames"
    assert refusal(ValueError()) == "ValueError"


def sessions_made_over(names: list[str], preprocess) -> list[int]:
    """The stand-in's sessions made so far after each clip of `names`, decoded on the
    device one window each; every row must be the CPU path's."""
    by_name = {row.id: row for row in video_rows()}
    made = []
    for name in names:
        window = [worker.decode_row(by_name[name], dataclasses.replace(VIDEO_OPTIONS, defer_video=True), preprocess)]
        assert worker.decode_on_device(window, VIDEO_OPTIONS, preprocess, torch.device("cpu")) == 1
        assert_same_rows(window, [worker.decode_row(by_name[name], VIDEO_OPTIONS, preprocess)])
        made.append(StandInDecoder.made)
    return made

def test_a_session_is_kept_for_each_kind_and_reconfigured_only_for_videos_of_it(
    preprocess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconfigured for a stream of another codec or size, an H200's decoder returned
    garbled frames (a 66 x 50 H.264 clip), and making a session costs about 0.18 s: one
    thread keeps a session per kind (the four 568 x 320 clips: one; the 320 x 180 clip:
    another) and goes back to the first for the next 568 x 320 clip; every row is the
    CPU path's."""
    stand_in(monkeypatch)
    names = ["decord_video_0.mov", "decord_video_90.mov", "decord_video_180.mov", "decord_video_270.mov",
             "torchcodec_nasa_13013.mp4", "decord_video_0.mov", "torchcodec_nasa_13013.mp4"]
    assert sessions_made_over(names, preprocess) == [1, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("limit, made", [(1, [1, 2, 3, 4]), (2, [1, 2, 2, 2])])
def test_a_thread_keeps_at_most_its_limit_of_sessions_dropping_the_least_recently_used(
    preprocess, monkeypatch: pytest.MonkeyPatch, limit: int, made: list[int]
) -> None:
    """Two kinds in turn: a thread that may keep one session makes one for every clip,
    one that may keep two makes two in all."""
    from embedjob.decode import nvdec

    stand_in(monkeypatch)
    monkeypatch.setattr(nvdec, "SESSIONS_PER_THREAD", limit)
    names = ["decord_video_0.mov", "torchcodec_nasa_13013.mp4", "decord_video_180.mov", "torchcodec_nasa_13013.mp4"]
    assert sessions_made_over(names, preprocess) == made


def test_a_stream_of_more_than_8_bits_gets_a_session_used_once_and_the_kept_one_stays(
    preprocess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An H200's decoder garbled a 200 x 200 10-bit HEVC clip from a session reconfigured
    for it, one of its own kind too, and read it right in a new one: each such clip gets
    a new session that no later clip uses, and the 8-bit clips around it share theirs."""
    deep = "torchcodec_h265_10bits.mp4"
    stand_in(monkeypatch)
    monkeypatch.setattr(StandInDemuxer, "deep", frozenset({(DATA / deep).read_bytes()}))
    names = ["decord_video_0.mov", deep, "decord_video_90.mov", deep, "decord_video_180.mov"]
    assert sessions_made_over(names, preprocess) == [1, 2, 2, 3, 3]


def test_the_gpu_tests_take_only_pictures_that_decode() -> None:
    """tests/test_gpu.py compares nvjpeg with the CPU on every photo it globs; a file
    from ../shared/data/bad among them would be an error row on both sides and hide a
    photo nvjpeg got wrong, or fail a test meant for good pictures."""
    from test_gpu import GPU_JPEGS

    assert GPU_JPEGS and not [p for p in GPU_JPEGS if "bad" in p.parts]
    for path in GPU_JPEGS:
        Image.open(path).convert("RGB")


# NV12 frames turned to RGB on the rank (`nvdec.YUV_HERE`): raw NV12 of a clip's first frame
# (tests/data/*.nv12, dumped by FFmpeg; rows `first` on, `rows` of them) against what decord
# makes of those rows, with the conversion `nvdec.media_colour` reads from the clip.

NV12_FIXTURES = [
    # untagged colour bars: BT.601, limited range
    ("derived_testsrc2_untagged_256x144.mp4", "derived_testsrc2_untagged_256x144.nv12", 0, (144, 256)),
    # BT.709 in its container's colr box and in its stream
    ("torchcodec_nasa_13013.mp4", "derived_nasa_13013_frame0.nv12", 0, (180, 320)),
    # BT.709 in its stream only (PyNvVideoCodec reports no tag): its most saturated rows
    ("decord_video_0.mov", "derived_decord_video_0_frame0_rows96-159.nv12", 96, (64, 568)),
    # BT.470BG, full range, in its stream
    ("colour/derived_h264_bt470bg_full.mp4", "colour/derived_h264_bt470bg_full_frame0.nv12", 0, (72, 128)),
]


def nv12_and_decord_rows(clip: str, raw: str, first: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's NV12 planes and decord's RGB of the same rows, (3, rows, W), from the
    bytes the CPU path gives decord (the first video track only)."""
    import decord

    from embedjob.decode.video import decoder_bytes

    rows, width = shape
    nv12 = torch.frombuffer(bytearray((DATA / raw).read_bytes()), dtype=torch.uint8).reshape(rows * 3 // 2, width)
    frame = decord.VideoReader(io.BytesIO(decoder_bytes((DATA / clip).read_bytes())))[0].asnumpy()[first : first + rows]
    return nv12, torch.from_numpy(frame).permute(2, 0, 1)


@pytest.mark.parametrize("clip, raw, first, shape", NV12_FIXTURES)
def test_nv12_turned_to_rgb_here_is_decords_frame_within_a_level_or_two(clip: str, raw: str, first: int, shape: tuple[int, int]) -> None:
    """With the conversion read from the clip's own bytes, the rank's RGB lands within 2
    levels of decord's pixels everywhere, under a level on average; the other matrix (or
    range) is off by many levels on these colours, which is what a wrong reading of the
    tags gives (a BT.601 reading of decord_video_0.mov: 20 levels)."""
    from embedjob.decode.nvdec import Colour, media_colour, nv12_to_rgb

    nv12, want = nv12_and_decord_rows(clip, raw, first, shape)
    colour = media_colour((DATA / clip).read_bytes())
    assert colour is not None
    got = nv12_to_rgb(nv12, shape, colour)
    diff = (got.to(torch.int16) - want.to(torch.int16)).abs().float()
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert float(diff.mean()) < 0.8 and float(diff.max()) <= 2, (float(diff.mean()), float(diff.max()))
    other = Colour("bt709" if colour.matrix == "bt601" and not colour.full else "bt601", full=False)
    wrong = nv12_to_rgb(nv12, shape, other)
    assert float((wrong.to(torch.int16) - want.to(torch.int16)).abs().float().max()) >= 10


FUSED_CHECK = """
import sys, torch
from embedjob.decode import nv12_kernel, nvdec
from embedjob.decode.nvdec import Colour, nv12_to_rgb
raw, rows, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
frame = torch.frombuffer(bytearray(open(raw, "rb").read()), dtype=torch.uint8).reshape(rows * 3 // 2, width)
padded = torch.cat([frame[:rows], torch.full((8, width), 77, dtype=torch.uint8), frame[rows:],
                    torch.full((4, width), 200, dtype=torch.uint8)])  # a surface 8 rows taller than the stream
batch = torch.stack([frame, frame.flip(-1)])
for colour in (Colour("bt601"), Colour("bt709"), Colour("bt601", full=True), Colour("bt709", full=True)):
    scale = 224 / 255 if colour.full else 1.0
    coefficients = tuple(c / 65536 * scale for c in nvdec.COEFFICIENTS[colour.matrix])
    want = nv12_to_rgb(batch, (rows, width), colour)
    assert torch.equal(nv12_kernel.nv12_to_rgb(batch, rows, width, rows, coefficients, colour.full), want), colour
    got = nv12_kernel.nv12_to_rgb(padded.unsqueeze(0), rows, width, rows + 8, coefficients, colour.full)[0]
    assert torch.equal(got, nv12_to_rgb(padded, (rows, width), colour)) and torch.equal(got, want[0]), colour
print("same")
"""


@pytest.mark.parametrize("raw, shape", [(raw, shape) for _, raw, _, shape in NV12_FIXTURES])
def test_the_fused_nv12_kernel_makes_the_torch_paths_pixels(raw: str, shape: tuple[int, int]) -> None:
    """`nvdec.FUSED_RGB`'s Triton kernel (`nv12_kernel`), run by Triton's interpreter on
    the CPU (the arithmetic in order, no fused multiply-add), gives the torch path's RGB
    of the fixtures' real NV12, pixel for pixel, in both ranges and matrices, for a batch,
    and for a surface taller than its stream (luma rows padded as decoders pad them)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", FUSED_CHECK, str(DATA / raw), str(shape[0]), str(shape[1])],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]


@pytest.mark.parametrize("name, colour", [
    ("derived_testsrc2_untagged_256x144.mp4", ("bt601", False)),
    ("decord_video_0.mov", ("bt709", False)),
    ("torchcodec_nasa_13013.mp4", ("bt709", False)),
    ("torchcodec_h265_video.mp4", ("bt601", False)),
    ("colour/derived_h264_bt470bg_full.mp4", ("bt601", True)),
    ("colour/derived_hevc_bt470bg_full.mp4", ("bt601", True)),
    ("colour/derived_h264_smpte170m.mp4", ("bt601", False)),
    ("colour/derived_hevc_default_scaling_bt709.mp4", ("bt709", False)),
    ("colour/derived_h264_bt2020.mov", None),
    ("colour/derived_h264_bt709.mkv", None),
])
def test_the_conversion_read_from_a_clip_is_decords_or_none(name: str, colour: tuple[str, bool] | None) -> None:
    """The stream's tags, else the container's, else BT.601 limited; None (the session
    then hands RGB) for a matrix the rank has no table for (BT.2020) and outside MP4/MOV,
    where the tags are not read here."""
    from embedjob.decode.nvdec import Colour, media_colour

    assert media_colour((DATA / name).read_bytes()) == (Colour(*colour) if colour else None)


def test_the_streams_colour_tag_wins_over_the_containers() -> None:
    """As in FFmpeg's decoder: nasa's `colr` box rewritten to say SMPTE 170M still reads as
    the BT.709 its stream says."""
    from embedjob.decode.containers import mp4_facts
    from embedjob.decode.nvdec import Colour, media_colour

    data = bytearray((DATA / "torchcodec_nasa_13013.mp4").read_bytes())
    at = data.index(b"colrnclx") + 12
    data[at : at + 2] = (6).to_bytes(2, "big")
    assert mp4_facts(bytes(data)).container_tags.matrix == 6
    assert media_colour(bytes(data)) == Colour("bt709", False)


class NV12StandIn(StandInDecoder):
    """A session that hands NV12 when asked for the decoder's native output: the first
    frame of the clips in `surfaces` (FFmpeg's NV12, from tests/data), in a surface
    padded to 16 rows as NVDEC's are; RGB from decord otherwise."""

    surfaces: dict[bytes, torch.Tensor] = {}
    outputs: list[object] = []

    def __init__(self, path: str, gpu_id: int = 0, use_device_memory: bool = True, output_color_type: object = None) -> None:
        self.output = output_color_type
        type(self).outputs.append(output_color_type)
        super().__init__(path, gpu_id, use_device_memory, output_color_type)

    def reconfigure_decoder(self, path: str) -> None:
        super().reconfigure_decoder(path)
        self.data = Path(path).read_bytes()

    def get_batch_frames_by_index(self, indices: list[int]) -> list[torch.Tensor]:
        if self.output != "NATIVE":
            return super().get_batch_frames_by_index(indices)
        assert indices == [0], "the fixtures hold each clip's first frame only"
        return [self.surfaces[self.data]]


def padded_surface(nv12: torch.Tensor, height: int) -> torch.Tensor:
    """NV12 planes of `height` luma rows in a surface whose luma is padded to 16 rows."""
    rows = -(-height // 16) * 16
    surface = torch.zeros((rows * 3 // 2, nv12.shape[1]), dtype=torch.uint8)
    surface[:height], surface[rows : rows + height // 2] = nv12[:height], nv12[height:]
    return surface


@pytest.mark.parametrize("fixture", [f for f in NV12_FIXTURES if f[2] == 0 and min(f[3]) >= 144], ids=lambda f: f[0])
def test_the_gpu_decoder_hands_nv12_by_default_and_its_frames_are_decords(monkeypatch: pytest.MonkeyPatch, fixture) -> None:
    """`YUV_HERE` is on: an 8-bit clip gets a session asking for NV12, and the frame that
    comes back from `decode_frames` is decord's within 2 levels (untagged BT.601 colour
    bars; BT.709 in both the container and the stream), where the decoder's own RGB was
    down to cosine 0.983 from decord's on SigLIP's vectors."""
    from embedjob.decode import nvdec, video
    from embedjob.decode.types import DeferredVideo

    clip, raw, _, (height, width) = fixture
    nv12, want = nv12_and_decord_rows(*fixture)
    data = (DATA / clip).read_bytes()
    assert nvdec.YUV_HERE
    monkeypatch.setattr(nvdec, "_sessions", threading.local())
    monkeypatch.setattr(NV12StandIn, "outputs", [])
    monkeypatch.setattr(NV12StandIn, "surfaces", {bytes(video.decoder_bytes(data)): padded_surface(nv12, height)})
    stand_in(monkeypatch, NV12StandIn, nv12=True)
    first = DeferredVideo(data, [0], (width, height), ((1, 0), (0, 1)), (height, width), [0.0], 25.0, 1)
    frames, _ = nvdec.decode_frames(first, torch.device("cpu"), VIDEO_OPTIONS)
    assert NV12StandIn.outputs == ["NATIVE"]
    diff = (frames[0].to(torch.int16) - want.to(torch.int16)).abs()
    assert frames.shape == (1, 3, height, width) and int(diff.max()) <= 2 and float(diff.float().mean()) < 0.8


def test_nv12_of_another_layout_is_refused_so_the_cpu_path_reads_the_clip() -> None:
    from embedjob.decode.nvdec import Colour, nv12_to_rgb

    with pytest.raises(RuntimeError, match="NV12 frame of shape"):
        nv12_to_rgb(torch.zeros(144, 256, dtype=torch.uint8), (144, 256), Colour())
    with pytest.raises(RuntimeError, match="for a 255 x 144 stream"):
        nv12_to_rgb(torch.zeros(216, 255, dtype=torch.uint8), (144, 255), Colour())


def test_an_nv12_surface_padded_below_the_picture_gives_the_pictures_rgb() -> None:
    """Decoder surfaces may be taller than the picture (a 1080-row stream in 1088 rows):
    the chroma rows start after the padded luma, and the padding is not shown."""
    from embedjob.decode.nvdec import Colour, nv12_to_rgb

    clip, raw, first, coded = NV12_FIXTURES[0]
    nv12, _ = nv12_and_decord_rows(clip, raw, first, coded)
    height, width = coded
    padded = torch.full(((height + 8) * 3 // 2, width), 77, dtype=torch.uint8)
    padded[:height], padded[height + 8 : height + 8 + height // 2] = nv12[:height], nv12[height:]
    assert torch.equal(nv12_to_rgb(padded, coded, Colour()), nv12_to_rgb(nv12, coded, Colour()))


def test_a_batch_of_nv12_frames_gives_each_frames_own_rgb() -> None:
    """The packet feed turns a clip's frames in batches (`nvdec.BATCH_RGB`): each frame of a
    batch, padded surfaces included, must come out bit for bit as it does alone."""
    from embedjob.decode.nvdec import Colour, nv12_to_rgb

    clip, raw, first, coded = NV12_FIXTURES[0]
    nv12, _ = nv12_and_decord_rows(clip, raw, first, coded)
    height, width = coded
    padded = torch.full(((height + 8) * 3 // 2, width), 77, dtype=torch.uint8)
    padded[:height], padded[height + 8 : height + 8 + height // 2] = nv12[:height], nv12[height:]
    frames = [padded, padded.flip(-1).contiguous(), torch.roll(padded, 7, dims=-1)]
    for colour in (Colour(), Colour("bt709", full=True)):
        batch = nv12_to_rgb(torch.stack(frames), coded, colour)
        assert batch.shape == (3, 3, height, width)
        for k, frame in enumerate(frames):
            assert torch.equal(batch[k], nv12_to_rgb(frame, coded, colour)), (k, colour)
    assert not torch.equal(batch[0], batch[1])


# The packet feed (`nvdec.FEED_SAMPLED`): a stream's packets read once for their pictures,
# then only those its samples need fed to a decoder kept per kind of stream. Here a stand-in
# demuxer hands the packets of a made-up H.264 stream with B-pyramids (Annex B slice headers,
# pts) for a real clip's bytes, which it reads through the rank's callback as PyNvVideoCodec
# does; the stand-in decoder hands each fed picture as an NV12 surface of one grey level (its
# frame index), in display order once the stream ends, as a decoder reorders.

UNIT = {"idr": b"\x65\x88", "p": b"\x41\x9a", "b_ref": b"\x21\x9e", "b": b"\x01\x9e"}


def pyramid_stream(frames: int, gop: int) -> list[tuple[int, bool, bytes]]:
    """(pts, key, Annex B bytes) in decode order: an IDR every `gop` frames, then P B B B
    minis whose middle B is a reference (x264's default pyramid), pts = frame index * 512."""
    packets, shown = [], 0
    while shown < frames:
        packets.append((shown * 512, shown % gop == 0, b"\x00\x00\x00\x01\x67\x64\x00\x00\x00\x01" + UNIT["idr"]))
        start, shown = shown, shown + 1
        while shown < min(start + gop, frames):
            bs = min(3, min(start + gop, frames) - shown - 1)
            packets.append(((shown + bs) * 512, False, b"\x00\x00\x00\x01" + UNIT["p"]))
            for i in (1, 0, 2)[: bs] if bs == 3 else range(bs):
                packets.append(((shown + i) * 512, False, b"\x00\x00\x00\x01" + UNIT["b_ref" if bs == 3 and i == 1 else "b"]))
            shown += bs + 1
    return packets


class FedPacket:
    """A demuxer's packet: `bsl_data` the address of its bytes, `bsl` their length (0: the end)."""

    def __init__(self, pts: int, key: bool, data: bytes) -> None:
        self.buffer = ctypes.create_string_buffer(data, len(data)) if data else None
        self.pts, self.key, self.bsl = pts, int(key), len(data)
        self.bsl_data = ctypes.addressof(self.buffer) if data else 0


class FedDemuxer:
    """PyNvVideoCodec.CreateDemuxer over a read callback: the stream in `streams` for the
    bytes it reads (in chunks of 4096, as the real one asks), then an empty packet."""

    streams: dict[bytes, tuple[int, int, list[tuple[int, bool, bytes]]]] = {}

    def __init__(self, source: object) -> None:
        read, buffer = bytearray(), bytearray(4096)
        while count := source(buffer):
            read += buffer[:count]
        self.width, self.height, self.packets = self.streams[bytes(read)]

    def Width(self) -> int:  # noqa: N802 (PyNvVideoCodec's names)
        return self.width

    def Height(self) -> int:  # noqa: N802
        return self.height

    def BitDepth(self) -> int:  # noqa: N802
        return 8

    def GetNvCodecId(self) -> str:  # noqa: N802
        return "cudaVideoCodec.H264"

    def __iter__(self):
        return iter([FedPacket(*packet) for packet in self.packets] + [FedPacket(0, False, b"")])


class GreyFrame:
    """A decoded NV12 surface of one grey level, with the pts of the packet it came from."""

    def __init__(self, pts: int, size: tuple[int, int], index: int) -> None:
        height, width = size
        self.pts = pts
        self.surface = torch.full((height * 3 // 2, width), 128, dtype=torch.uint8)
        self.surface[:height] = 16 + index % 200

    def getPTS(self) -> int:  # noqa: N802
        return self.pts

    def __dlpack__(self, **kwargs):
        return self.surface.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.surface.__dlpack_device__()


class FedDecoder:
    """PyNvVideoCodec.CreateDecoder's decoder: records the pts of the pictures fed to it and
    hands their frames in display order when the stream ends (`fail_at`: a pts it fails at)."""

    made: list["FedDecoder"] = []
    size = (180, 320)
    fail_at: int | None = None
    step = 512
    """pts per frame index: the grey level of a frame is 16 + its index (modulo 200)."""

    def __init__(self, **kwargs: object) -> None:
        self.fed: list[int] = []
        self.pending: list[int] = []
        type(self).made.append(self)

    def Decode(self, packet: FedPacket) -> list[GreyFrame]:  # noqa: N802
        if not packet.bsl:
            frames, self.pending = sorted(self.pending), []
            return [GreyFrame(pts, self.size, pts // self.step) for pts in frames]
        if packet.pts == self.fail_at:
            raise RuntimeError("HandleVideoSequence : \nError code : 801")
        self.fed.append(packet.pts)
        self.pending.append(packet.pts)
        return []


def fed_stand_in(monkeypatch: pytest.MonkeyPatch, clips: dict[bytes, list[tuple[int, bool, bytes]]]) -> None:
    from embedjob.decode import nvdec

    monkeypatch.setattr(FedDemuxer, "streams", {bytes(video_decoder_bytes(data)): (320, 180, packets) for data, packets in clips.items()})
    monkeypatch.setattr(FedDecoder, "made", [])
    monkeypatch.setattr(nvdec, "_sessions", threading.local())
    module = SimpleNamespace(CreateDemuxer=FedDemuxer, CreateDecoder=FedDecoder, PacketData=CutPacket)
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    assert nvdec.FEED_SAMPLED and nvdec.YUV_HERE


def video_decoder_bytes(data: bytes) -> bytes | bytearray:
    from embedjob.decode.video import decoder_bytes

    return decoder_bytes(data)


def planned(data: bytes, indices: list[int], frames: int):
    from embedjob.decode.types import DeferredVideo

    return DeferredVideo(data, indices, (320, 180), ((1, 0), (0, 1)), (180, 320), [i / 30 for i in indices], 30.0, frames)


def test_the_packet_feed_feeds_only_the_pictures_the_samples_need_and_hands_the_sampled_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling 2 frames a second of a 30 fps stream of 1 s GOPs with B-pyramids: the frames
    come back in sample order (a repeated index repeated), while the decoder saw the pictures
    `gop.needed_pictures` names: every B nothing refers to and every picture after the last
    sample left out, fewer than half of them fed."""
    from embedjob.decode import gop, nvdec

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    packets = pyramid_stream(150, 30)
    fed_stand_in(monkeypatch, {data: packets})
    indices = [0, 15, 30, 45, 60, 60, 75, 90, 105]
    frames, video = nvdec.decode_frames(planned(data, indices, 150), torch.device("cpu"), VIDEO_OPTIONS)
    grey = [int(i * 255 / 219) for i in indices]  # luma 16 + i, limited range
    assert frames.shape == (9, 3, 180, 320) and [int(f[0, 0, 0]) for f in frames] == grey
    assert all(int(f.min()) == int(f.max()) for f in frames)
    (decoder,) = FedDecoder.made
    stream = [gop.Picture(pts, key, reference=unit[-2:] != UNIT["b"]) for pts, key, unit in packets]
    assert decoder.fed == [stream[k].pts for k in gop.needed_pictures(stream, sorted(set(indices)))]
    decode_order = [pts for pts, _, _ in packets]
    assert len(decoder.fed) < len(packets) / 2 and decoder.fed[-1] == 105 * 512
    assert max(decode_order.index(pts) for pts in decoder.fed) == decode_order.index(105 * 512)
    assert all(pts // 512 in indices for pts, _, unit in packets if unit[-2:] == UNIT["b"] and pts in decoder.fed)


def test_the_packet_feed_keeps_a_decoder_per_kind_drops_one_that_failed_and_leaves_odd_streams_to_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two clips of one kind share a decoder; a decoder that failed raises (the caller takes
    the CPU path) and the next clip gets a new one; a stream whose packets do not number the
    frames its plan counted is left to a session (`nvdec.Unfed`), never read by the wrong index."""
    from embedjob.decode import nvdec

    first, second = (DATA / "torchcodec_nasa_13013.mp4").read_bytes(), (DATA / "decord_video_0.mov").read_bytes()
    fed_stand_in(monkeypatch, {first: pyramid_stream(90, 30), second: pyramid_stream(60, 60)})
    cpu = torch.device("cpu")
    nvdec.decode_frames(planned(first, [0, 15, 30], 90), cpu, VIDEO_OPTIONS)
    nvdec.decode_frames(planned(second, [0, 15, 30], 60), cpu, VIDEO_OPTIONS)
    assert len(FedDecoder.made) == 1 and len(FedDecoder.made[0].fed) < 60
    monkeypatch.setattr(FedDecoder, "fail_at", 15 * 512)
    with pytest.raises(RuntimeError, match="801"):
        nvdec.decode_frames(planned(first, [0, 15], 90), cpu, VIDEO_OPTIONS)
    monkeypatch.setattr(FedDecoder, "fail_at", None)
    frames, _ = nvdec.decode_frames(planned(first, [0, 15], 90), cpu, VIDEO_OPTIONS)
    assert len(FedDecoder.made) == 2 and frames.shape[0] == 2
    with pytest.raises(nvdec.Unfed, match="90 packets for 91 frames"):
        nvdec._fed(video_decoder_bytes(first), planned(first, [0, 15], 91), cpu, nvdec.Colour())


class SlowHandedFrame(GreyFrame):
    """A `GreyFrame` whose DLPack handshake takes `pause` seconds, as PyNvVideoCodec's may
    where it waits for the stream that takes the frame."""

    pause = 0.003

    def __dlpack__(self, **kwargs):
        threading.Event().wait(self.pause)
        return super().__dlpack__(**kwargs)


class SlowFedDecoder(FedDecoder):
    """A `FedDecoder` whose every `Decode` call takes `pause` seconds, as NVDEC's do, and
    whose frames are slow to hand over (`SlowHandedFrame`)."""

    pause = 0.004

    def Decode(self, packet: FedPacket) -> list[GreyFrame]:  # noqa: N802
        threading.Event().wait(self.pause)
        return [SlowHandedFrame(frame.pts, self.size, frame.pts // self.step) for frame in super().Decode(packet)]


def test_the_decoder_clock_splits_a_clips_time_into_its_decode_calls_copies_and_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nvdec.CLOCK` counts what the job reports as `device_decode_parts`: the decoder's calls
    at least the time they took, the frames' handshakes (`surface`) theirs and not in the
    copies, the copies and the conversion above nothing, and the clip's whole time no less
    than its parts; a run's share is what it added (`since`)."""
    from embedjob.decode import nvdec

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    fed_stand_in(monkeypatch, {data: pyramid_stream(90, 30)})
    monkeypatch.setitem(sys.modules["PyNvVideoCodec"].__dict__, "CreateDecoder", SlowFedDecoder)
    before = nvdec.CLOCK.seconds()
    nvdec.decode_frames(planned(data, [0, 15, 30, 45], 90), torch.device("cpu"), VIDEO_OPTIONS)
    parts = nvdec.CLOCK.since(before)
    (decoder,) = FedDecoder.made
    calls = len(decoder.fed) + 1  # and the empty packet that ends the stream
    assert parts["Decode"] >= calls * SlowFedDecoder.pause
    assert parts["surface"] >= 4 * SlowHandedFrame.pause > parts["copy"] > 0 and parts["RGB"] > 0
    assert parts["clip"] >= parts["Decode"] + parts["surface"] + parts["copy"] + parts["RGB"]
    assert nvdec.CLOCK.since(nvdec.CLOCK.seconds())["clip"] < parts["clip"]


def test_a_decoder_part_under_a_millisecond_still_shows_in_the_ranks_statistics() -> None:
    """A few clips' fused NV12 conversion takes tens of microseconds in all: the stats must
    not round it away to nothing, or the part reads as never having run."""
    from embedjob.stats import RankStats

    shown = RankStats(rank=0, device="cuda:0", device_decode_parts={"RGB": 4.2e-05, "clip": 1.5}).to_dict()
    assert shown["device_decode_parts"] == {"RGB": 4.2e-05, "clip": 1.5}


class CutPacket:
    """PyNvVideoCodec.PacketData: empty (the end of a stream) until the rank fills it in."""

    def __init__(self) -> None:
        self.bsl_data, self.bsl, self.pts, self.key = 0, 0, 0, 0


class CutDecoder(FedDecoder):
    """A `FedDecoder` handed display indices for pts that also keeps the bytes of each
    packet, read from the address the rank gave it."""

    handed: list[bytes] = []
    step = 1

    def Decode(self, packet: CutPacket) -> list[GreyFrame]:  # noqa: N802
        if packet.bsl:
            type(self).handed.append(ctypes.string_at(packet.bsl_data, packet.bsl))
        return super().Decode(packet)


def test_the_pictures_a_worker_cut_out_are_fed_as_packets_made_on_the_rank_without_a_demuxer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`video.PACKETS_IN_WORKERS`: a worker plans nasa_13013 (2 frames a second) and cuts
    out the pictures its frames need; the rank hands the decoder each as a packet pointing
    into the cut (the bytes the worker cut, with its display index for pts), then the end of
    the stream, and takes the frames by display index, in sample order. The stand-in module
    has no demuxer: the rank opens none."""
    from embedjob.decode import nvdec, video
    from embedjob.decode.sniff import sniff_format

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    monkeypatch.setattr(video, "PACKETS_IN_WORKERS", True)
    planned = video.decode_video(data, dataclasses.replace(VIDEO_OPTIONS, defer_video=True, fps=2.0, max_frames=32), sniff_format(data)[1])
    feed = planned.feed
    assert feed is not None and set(planned.indices) <= set(feed.shown) and len(feed.bounds) < planned.source_frames
    codecs = SimpleNamespace(H264="cudaVideoCodec.H264", HEVC="cudaVideoCodec.HEVC")
    module = SimpleNamespace(PacketData=CutPacket, CreateDecoder=CutDecoder, cudaVideoCodec=codecs)
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    monkeypatch.setattr(nvdec, "_sessions", threading.local())
    monkeypatch.setattr(FedDecoder, "made", [])
    monkeypatch.setattr(CutDecoder, "handed", [])
    frames, plan = nvdec.decode_frames(pickle.loads(pickle.dumps(planned)), torch.device("cpu"), VIDEO_OPTIONS)
    (decoder,) = FedDecoder.made
    assert decoder.fed == list(feed.shown)
    assert CutDecoder.handed == [feed.stream[offset : offset + size] for offset, size in feed.bounds]
    assert [int(f[0, 0, 0]) for f in frames] == [int(i % 200 * 255 / 219) for i in planned.indices] and plan == planned


CUT_VIDEOS = sorted(p.name for p in DATA.iterdir() if p.suffix in (".mp4", ".mov", ".mkv")) + [
    f"gop/{p.name}" for p in sorted((DATA / "gop").glob("*.mp4"))
]


@pytest.mark.parametrize("name", CUT_VIDEOS)
def test_a_worker_that_cuts_the_pictures_plans_every_clip_as_one_that_does_not(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`video.PACKETS_IN_WORKERS` (on): each of the repository's videos (corrupt, 10-bit,
    turned, tiny, AV1 in Matroska, open GOPs) planned for the GPU by a worker that cuts the
    pictures out is the plan, or the error row, of one that does not; a cut is made of
    8-bit H.264 or HEVC MP4/MOV tracks only, and holds every sampled frame."""
    from embedjob.decode import video
    from embedjob.decode.sniff import sniff_format

    data = (DATA / name).read_bytes()
    options = dataclasses.replace(VIDEO_OPTIONS, defer_video=True, fps=2.0, max_frames=32)
    found = sniff_format(data)
    plans = {}
    for cut in (False, True):
        monkeypatch.setattr(video, "PACKETS_IN_WORKERS", cut)
        try:
            plans[cut] = video.decode_video(data, options, found[1] if found else None)
        except MediaError as exc:
            plans[cut] = exc.code
    if isinstance(plans[False], str):
        assert plans[True] == plans[False]
        return
    assert plans[False].feed is None
    assert dataclasses.replace(plans[True], feed=None) == plans[False]
    feed = plans[True].feed
    if feed is not None:
        assert found[1] in ("MP4", "MOV") and feed.codec in ("h264", "hevc")
        assert set(plans[True].indices) <= set(feed.shown)


@pytest.mark.parametrize("cut", [False, True])
def test_a_clip_left_for_the_gpu_by_a_worker_reaches_the_rank_fit_for_the_packet_feed(
    cut: bool, preprocess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's clip, planned by a worker and sent to the rank as an item: the rank feeds its
    decoder packet by packet, from its own demuxer (the stream's frame count, which the feed
    checks the packets against, crossed with the plan) or, with `video.PACKETS_IN_WORKERS`,
    from the pictures the worker cut out (no demuxer); never through a decoder session,
    which decodes every picture from the keyframe before each sample (the stand-in module
    has none: a session would fail, and the clip take the CPU path)."""
    from embedjob.decode import nvdec, video

    data = (DATA / "torchcodec_nasa_13013.mp4").read_bytes()
    monkeypatch.setattr(video, "PACKETS_IN_WORKERS", cut)
    options = dataclasses.replace(VIDEO_OPTIONS, fps=2.0, max_frames=32)
    left = worker.decode_row(InputRow(0, "nasa", data, None, None), dataclasses.replace(options, defer_video=True), preprocess)
    window = [pickle.loads(pickle.dumps(left, protocol=5))]
    sent = video.decode_video(data, dataclasses.replace(options, defer_video=True), "MP4")
    assert worker._planned(window[0].item) == dataclasses.replace(sent, timestamps=[], source_fps=0.0)
    assert (sent.feed is not None) == cut
    fed_stand_in(monkeypatch, {data: pyramid_stream(sent.source_frames, 30)})
    codecs = SimpleNamespace(H264="cudaVideoCodec.H264", HEVC="cudaVideoCodec.HEVC")
    monkeypatch.setattr(sys.modules["PyNvVideoCodec"], "cudaVideoCodec", codecs, raising=False)
    if cut:
        monkeypatch.setattr(sys.modules["PyNvVideoCodec"], "CreateDecoder", CutDecoder)
        monkeypatch.setattr(CutDecoder, "handed", [])
    monkeypatch.setattr(nvdec, "_pool", None)
    assert worker.decode_on_device(window, options, preprocess, torch.device("cpu")) == 1
    (decoder,) = FedDecoder.made
    assert 0 < len(decoder.fed) < sent.source_frames
    assert decoder.fed == list(sent.feed.shown) if cut else all(pts % 512 == 0 for pts in decoder.fed)
    assert window[0].error is None and window[0].item.frames == len(sent.indices)


def test_the_gpu_decodes_switch_interval_holds_inside_and_python_s_comes_back_after() -> None:
    """`pipeline.GPU_DECODE_SWITCH_INTERVAL` (a variant the video benchmark times) is Python's
    switch interval only while the rank's GPU decodes: after the run, even one that raised,
    the process's own is back; None leaves it alone."""
    from embedjob import pipeline

    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), pipeline._switch_interval(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        raise RuntimeError("a run that failed")
    assert sys.getswitchinterval() == before
    with pipeline._switch_interval(None):
        assert sys.getswitchinterval() == before


def test_a_rank_reports_what_the_caching_allocator_added_while_its_gpu_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """`device_allocations` holds what the allocator's counters added inside, under the
    names a rank reports (`pipeline.ALLOCATOR_COUNTS`), also where the run raised; off a
    GPU the allocator is not asked and nothing is reported."""
    from embedjob import pipeline

    readings = iter([{"num_device_alloc": 5, "num_device_free": 1, "num_alloc_retries": 0, "num_sync_all_streams": 2},
                     {"num_device_alloc": 12, "num_device_free": 4, "num_alloc_retries": 3, "num_sync_all_streams": 5}])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: next(readings))
    counts: dict[str, int] = {}
    with pytest.raises(RuntimeError), pipeline._allocations_into(counts, torch.device("cuda", 0)):
        raise RuntimeError("a run that failed")
    assert counts == {"cudaMalloc": 7, "cudaFree": 3, "retries": 3, "syncs": 3}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: pytest.fail("asked off a GPU"))
    on_cpu: dict[str, int] = {}
    with pipeline._allocations_into(on_cpu, torch.device("cpu")):
        pass
    assert on_cpu == {}


def test_the_sm_carveout_holds_through_the_run_and_the_process_gets_every_sm_back_after() -> None:
    """`pipeline.GPU_DECODE_SM_CARVEOUT` (a variant the video benchmark times) leaves SMs to
    the GPU's decoder only through the run that asked: after it, even one that raised, the
    next job in the process gets every SM; None leaves it alone."""
    from embedjob import pipeline

    before = torch._C._get_sm_carveout_experimental()
    with pytest.raises(RuntimeError), pipeline.sm_carveout(8):
        assert torch._C._get_sm_carveout_experimental() == 8
        raise RuntimeError("a run that failed")
    assert torch._C._get_sm_carveout_experimental() == before
    with pipeline.sm_carveout(None):
        assert torch._C._get_sm_carveout_experimental() == before


def test_the_driver_copy_of_a_surface_never_takes_host_memory_and_copies_a_pitched_one_whole() -> None:
    """`nvdec.COPY_ENGINE`'s copy (`engine_copy`) hands the driver device memory only: a
    frame in host memory, or one whose rows are not each contiguous, is copied by torch,
    every byte of the picture and none of the pitch's padding."""
    from embedjob.decode import nvdec

    pitched = torch.arange(12 * 20, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(12, 20)
    for surface in (pitched[:, :16], pitched[:, :16].t().contiguous().t(), pitched[:, :16].contiguous()):
        target = torch.zeros(12, 16, dtype=torch.uint8)
        nvdec.engine_copy(target, surface)
        assert torch.equal(target, pitched[:, :16])
