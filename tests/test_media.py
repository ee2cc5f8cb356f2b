"""Image decoding, sniffing and reading of embedjob.decode, and the worker pool of embedjob.workers.pool.

Repo-local media (tests/data, licences in tests/data/LICENSES.tsv) carry the essential
coverage; the larger real corpus in ../shared/data is used when present and skipped
on a clean clone.
"""

from __future__ import annotations

import functools
import io
import itertools
import mmap
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from embedjob.decode import DecodedImage, DecodedVideo, DecodeOptions, MediaError, decode, read_source, worker_preload
from embedjob.decode import image as image_decode
from embedjob.decode.sniff import sniff_format
from embedjob.encoders import EncoderInput
from embedjob.workers import pool as worker_pool
from embedjob.workers import wire
from embedjob.workers.pool import IDLE, DecodePool

LOCAL = Path(__file__).parent / "data"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not present (clean clone)")

IMAGE = DecodeOptions(modality="image", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)
AUTO = DecodeOptions(modality="auto", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)
VIDEO = DecodeOptions(modality="video", max_image_pixels=50_000_000, fps=2.0, max_frames=32, frame_multiple=2)

LOCAL_IMAGES = ["img2dataset_123_456.jpg", "img2dataset_456_123.jpg", "hfdatasets_test_image_rgba.png"]
LOCAL_VIDEOS = sorted(p.name for p in LOCAL.iterdir() if p.suffix in (".mov", ".mp4", ".mkv"))


def shared_files(folder: str) -> list[Path]:
    return sorted((SHARED / folder).iterdir()) if (SHARED / folder).is_dir() else []


def encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kwargs)
    return out.getvalue()


def reference_rgb(data: bytes) -> np.ndarray:
    """Pillow's own rendering: EXIF transpose, then alpha over white."""
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, img.convert("RGBA")).convert("RGB"))


# ---------------------------------------------------------------- real images

IMAGE_FILES = [LOCAL / name for name in LOCAL_IMAGES] + shared_files("images")


@pytest.mark.parametrize("path", IMAGE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_images_decode_to_rgb_matching_pillow(path: Path) -> None:
    data = path.read_bytes()
    result = decode(data, IMAGE)
    expected = reference_rgb(data)
    assert isinstance(result, DecodedImage)
    assert result.pixels.dtype == np.uint8 and result.pixels.flags.c_contiguous
    assert result.pixels.shape == expected.shape
    # Same libjpeg-turbo/zlib underneath; rounding of the alpha blend may differ by 1.
    assert np.abs(result.pixels.astype(int) - expected).mean() < 1.0


# ---------------------------------------------------------------- synthetic images


def halves(left: tuple[int, ...], right: tuple[int, ...], mode: str, size: tuple[int, int] = (60, 40)) -> Image.Image:
    """An image whose left half is one colour and right half another."""
    img = Image.new(mode, size, left)
    img.paste(Image.new(mode, (size[0] // 2, size[1]), right), (size[0] // 2, 0))
    return img


def exif_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def palette_with_transparency() -> bytes:
    img = Image.fromarray(np.tile(np.array([0] * 30 + [1] * 30, dtype=np.uint8), (40, 1)), "P")
    img.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    return encode(img, "PNG", transparency=1)


def two_frame_gif() -> bytes:
    first = Image.new("RGB", (60, 40), (255, 0, 0)).convert("P")
    second = Image.new("RGB", (60, 40), (0, 0, 255)).convert("P")
    return encode(first, "GIF", save_all=True, append_images=[second])


RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)

# name -> (encoded bytes, expected (H, W), expected colour of the left/top half, of the right/bottom half, tolerance)
SYNTHETIC = {
    "L_png": (lambda: encode(Image.new("L", (60, 40), 77), "PNG"), (40, 60), (77,) * 3, (77,) * 3, 0),
    "L_jpeg": (lambda: encode(Image.new("L", (60, 40), 77), "JPEG"), (40, 60), (77,) * 3, (77,) * 3, 2),
    "LA_png_alpha_on_white": (lambda: encode(halves((100, 0), (100, 255), "LA"), "PNG"), (40, 60), WHITE, (100,) * 3, 0),
    "CMYK_jpeg": (lambda: encode(Image.new("CMYK", (60, 40), (0, 255, 255, 0)), "JPEG"), (40, 60), RED, RED, 8),
    "I16_png": (
        lambda: encode(Image.fromarray(np.full((40, 60), 32896, dtype=np.uint16)), "PNG"),
        (40, 60), (128,) * 3, (128,) * 3, 0,
    ),
    "P_png_transparency": (palette_with_transparency, (40, 60), RED, WHITE, 0),
    "RGBA_png_half_alpha": (lambda: encode(halves((0, 0, 255, 255), (0, 0, 255, 128), "RGBA"), "PNG"), (40, 60), BLUE, (127, 127, 255), 1),
    "GIF_first_frame": (two_frame_gif, (40, 60), RED, RED, 0),
    "TIFF": (lambda: encode(halves(RED, BLUE, "RGB"), "TIFF"), (40, 60), RED, BLUE, 0),
    "TIFF_orientation_6": (lambda: encode(halves(RED, BLUE, "RGB"), "TIFF", exif=exif_orientation(6)), (60, 40), RED, BLUE, 0),
    "BMP": (lambda: encode(halves(RED, BLUE, "RGB"), "BMP"), (40, 60), RED, BLUE, 0),
    "WEBP_lossless_alpha": (lambda: encode(halves((255, 0, 0, 255), (0, 0, 255, 0), "RGBA"), "WEBP", lossless=True), (40, 60), RED, WHITE, 0),
    "JPEG_orientation_6": (lambda: encode(halves(RED, BLUE, "RGB"), "JPEG", quality=95, exif=exif_orientation(6)), (60, 40), RED, BLUE, 12),
    "PNG_orientation_6": (lambda: encode(halves(RED, BLUE, "RGB"), "PNG", exif=exif_orientation(6)), (60, 40), RED, BLUE, 0),
    "PNG_orientation_3": (lambda: encode(halves(RED, BLUE, "RGB"), "PNG", exif=exif_orientation(3)), (40, 60), BLUE, RED, 0),
}


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_images_become_rgb_with_orientation_and_colours(name: str) -> None:
    make, shape, first, second, tolerance = SYNTHETIC[name]
    pixels = decode(make(), IMAGE).pixels
    assert pixels.dtype == np.uint8 and pixels.shape == (*shape, 3)
    height, width = shape
    # Orientation 6 turns the left half into the top half (90 degrees clockwise).
    if height > width:
        first_half, second_half = pixels[: height // 2 - 2], pixels[height // 2 + 2 :]
    else:
        first_half, second_half = pixels[:, : width // 2 - 2], pixels[:, width // 2 + 2 :]
    assert np.abs(first_half.reshape(-1, 3).astype(int) - first).max() <= tolerance
    assert np.abs(second_half.reshape(-1, 3).astype(int) - second).max() <= tolerance


JPEGS = {name: SYNTHETIC[name][0] for name in SYNTHETIC if "jpeg" in name.lower()}
JPEGS.update({name: functools.partial((LOCAL / name).read_bytes) for name in LOCAL_IMAGES if name.endswith(".jpg")})


@pytest.mark.parametrize("name", JPEGS)
def test_torchvision_and_pillow_render_jpegs_alike(name: str) -> None:
    """JPEGs go through torchvision, with Pillow as the fallback for those it refuses:
    both must give the same picture, orientation included."""
    data = JPEGS[name]()
    fast = decode(data, IMAGE).pixels
    pillow = image_decode._decode_with_pillow(Image.open(io.BytesIO(data)))
    assert fast.shape == pillow.shape
    assert np.abs(fast.astype(int) - pillow).max() <= 2


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is one empty row."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\x00")) + png_chunk(b"IEND", b"")


def test_pixel_limit_is_checked_from_the_header_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_decode(*args: object) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(image_decode, "_decode_with_torchvision", must_not_decode)
    monkeypatch.setattr(image_decode, "_decode_with_pillow", must_not_decode)
    small_limit = DecodeOptions("image", max_image_pixels=1000, fps=2.0, max_frames=32, frame_multiple=2)
    for data in (encode(Image.new("RGB", (40, 26)), "PNG"), encode(Image.new("RGB", (40, 26)), "GIF")):
        with pytest.raises(MediaError) as err:
            decode(data, small_limit)
        assert err.value.code == "too_large" and "1040" in err.value.message
    # A 100000 x 100000 header with no pixel data at all: only the header can say so.
    with pytest.raises(MediaError) as err:
        decode(png_header_only(100_000, 100_000), IMAGE)
    assert err.value.code == "too_large"


def test_image_at_the_limit_decodes() -> None:
    exact = DecodeOptions("image", max_image_pixels=40 * 26, fps=2.0, max_frames=32, frame_multiple=2)
    assert decode(encode(Image.new("RGB", (40, 26)), "PNG"), exact).pixels.shape == (26, 40, 3)


def png_with_broken_idat() -> bytes:
    """A PNG whose pixel data starts with a damaged zlib header (CRC left stale)."""
    data = bytearray(encode(halves(RED, BLUE, "RGB"), "PNG"))
    data[data.index(b"IDAT") + 4] ^= 0xFF
    return bytes(data)


def local_jpeg() -> bytes:
    return (LOCAL / "img2dataset_456_123.jpg").read_bytes()


BAD_IMAGES = {
    "half_jpeg": (lambda: local_jpeg()[: len(local_jpeg()) // 2], IMAGE, "truncated"),
    "half_png": (lambda: (LOCAL / "hfdatasets_test_image_rgba.png").read_bytes()[:25_000], IMAGE, "truncated"),
    "half_gif": (lambda: two_frame_gif()[:60], IMAGE, "truncated"),
    "jpeg_magic_then_garbage": (lambda: b"\xff\xd8\xff" + bytes(range(256)) * 4, IMAGE, "corrupt"),
    "png_signature_only": (lambda: b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, IMAGE, "corrupt"),
    # torchvision 0.29.1 segfaults on this one (libpng "IDAT: invalid window size").
    "png_broken_idat": (png_with_broken_idat, IMAGE, "corrupt"),
    "heic_brand": (lambda: b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + b"\x00" * 64, IMAGE, "unsupported_format"),
    "text_auto": (lambda: b"this is not an image\n", AUTO, "unknown_format"),
    "text_image": (lambda: b"this is not an image\n", IMAGE, "unknown_format"),
    "empty": (lambda: b"", AUTO, "empty"),
    "mp4_as_image": (lambda: (LOCAL / "hfdatasets_test_video_66x50.mov").read_bytes(), IMAGE, "not_an_image"),
    "jpeg_as_video": (local_jpeg, VIDEO, "not_a_video"),
}


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_bad_images_are_typed_errors(name: str) -> None:
    make, options, code = BAD_IMAGES[name]
    with pytest.raises(MediaError) as err:
        decode(make(), options)
    assert err.value.code == code, str(err.value)
    assert str(err.value) == f"{code}: {err.value.message}" and err.value.message


def _outcome(data: bytes, options: DecodeOptions) -> tuple:
    try:
        return ("pixels", decode(data, options).pixels.tobytes())
    except MediaError as exc:
        return ("error", str(exc))


PARITY_JPEGS = {
    **{name: make for name, make in JPEGS.items()},
    **{name: make for name, (make, _, _) in BAD_IMAGES.items() if "jpeg" in name},
    "progressive": lambda: encode(halves(RED, BLUE, "RGB"), "JPEG", progressive=True),
    "orientation_8": lambda: encode(halves(RED, BLUE, "RGB"), "JPEG", exif=exif_orientation(8)),
    "frame_header_cut": lambda: local_jpeg()[: local_jpeg().index(b"\xff\xc0") + 6],
    "zero_width": lambda: (lambda d: d[: d.index(b"\xff\xc0") + 7] + b"\x00\x00" + d[d.index(b"\xff\xc0") + 9 :])(local_jpeg()),
    "segment_past_the_end": lambda: b"\xff\xd8\xff\xe0\xff\xff" + b"\x00" * 20,
    "scan_before_frame": lambda: b"\xff\xd8\xff\xda\x00\x08" + b"\x00" * 40,
    **{f"shared/{p.name}": p.read_bytes for p in shared_files("images") + shared_files("bad") if p.suffix == ".jpg"},
}


@pytest.mark.parametrize("name", PARITY_JPEGS)
def test_jpegs_read_without_pillow_give_what_pillows_path_gives(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JPEG goes to torchvision on its frame header's size alone; every picture and
    every error row (code and message) must be the ones of the path through Pillow."""
    data = PARITY_JPEGS[name]()
    small = DecodeOptions(modality="image", max_image_pixels=1000, fps=2.0, max_frames=32, frame_multiple=2)
    fast = [_outcome(data, IMAGE), _outcome(data, small)]
    monkeypatch.setattr(image_decode, "_plain_jpeg", lambda data, options: None)
    assert fast == [_outcome(data, IMAGE), _outcome(data, small)]


def test_the_frame_size_is_pillows_size_for_every_good_jpeg() -> None:
    """Good JPEGs (so the fast path takes them), and none of the bad ones unread by Pillow."""
    good = {**JPEGS, "progressive": PARITY_JPEGS["progressive"], "orientation_8": PARITY_JPEGS["orientation_8"]}
    good.update({f"shared/{p.name}": p.read_bytes for p in shared_files("images") if p.suffix == ".jpg"})
    for name, make in good.items():
        data = make()
        assert image_decode.jpeg_frame_size(data) == Image.open(io.BytesIO(data)).size, name
    for name in ("frame_header_cut", "zero_width", "segment_past_the_end", "scan_before_frame"):
        assert image_decode.jpeg_frame_size(PARITY_JPEGS[name]()) is None, name


# What each file of ../shared/data/bad/ gives, per modality (a DecodedVideo = "video").
SHARED_BAD = {
    "decord_corrupted.mp4": {"auto": "corrupt", "video": "corrupt", "image": "not_an_image"},
    "derived_jpeg_half.jpg": {"auto": "truncated", "video": "not_a_video", "image": "truncated"},
    "derived_mkv_truncated.mkv": {"auto": "truncated", "video": "truncated", "image": "not_an_image"},
    "derived_mp4_as_jpg.jpg": {"auto": "video", "video": "video", "image": "not_an_image"},
    "derived_text_as_mp4.mp4": {"auto": "unknown_format", "video": "unknown_format", "image": "unknown_format"},
    "derived_zero_length.mp4": {"auto": "empty", "video": "empty", "image": "empty"},
}


@needs_shared
def test_shared_bad_files_give_precise_outcomes() -> None:
    assert sorted(p.name for p in shared_files("bad")) == sorted(SHARED_BAD)
    for path in shared_files("bad"):
        for options in (AUTO, VIDEO, IMAGE):
            try:
                result = decode(path.read_bytes(), options)
                outcome = "video" if isinstance(result, DecodedVideo) else "image"
            except MediaError as err:
                outcome = err.code
            assert outcome == SHARED_BAD[path.name][options.modality], (path.name, options.modality)


# ---------------------------------------------------------------- sniff

def sniff(data: bytes) -> str | None:
    """"image", "video" or None, decided from the bytes' magic numbers alone."""
    found = sniff_format(data)
    return found[0] if found else None


SNIFF_EXPECTED = {
    "decord_corrupted.mp4": "video",
    "derived_jpeg_half.jpg": "image",
    "derived_mkv_truncated.mkv": "video",
    "derived_mp4_as_jpg.jpg": "video",
    "derived_text_as_mp4.mp4": None,
    "derived_zero_length.mp4": None,
}


def test_sniff_decides_from_magic_numbers_only() -> None:
    for name in LOCAL_IMAGES:
        assert sniff((LOCAL / name).read_bytes()) == "image", name
    for name in LOCAL_VIDEOS:
        assert sniff((LOCAL / name).read_bytes()) == "video", name
    for fmt in ("GIF", "TIFF", "BMP", "WEBP", "ICO"):
        assert sniff(encode(Image.new("RGB", (16, 16)), fmt)) == "image", fmt
    assert sniff(b"RIFF\x00\x00\x00\x00AVI LIST") == "video"
    assert sniff(b"") is None and sniff(b"hello world") is None


@needs_shared
def test_sniff_on_every_shared_file() -> None:
    for path in shared_files("images"):
        assert sniff(path.read_bytes()) == "image", path.name
    for path in shared_files("videos"):
        assert sniff(path.read_bytes()) == "video", path.name
    for path in shared_files("bad"):
        assert sniff(path.read_bytes()) == SNIFF_EXPECTED[path.name], path.name


# ---------------------------------------------------------------- read_source and options


def test_read_source_paths_uris_and_failures(tmp_path: Path) -> None:
    path = LOCAL / LOCAL_IMAGES[0]
    assert read_source(str(path)) == path.read_bytes()
    assert read_source(path.as_uri()) == path.read_bytes()
    failures = {
        str(tmp_path / "missing.jpg"): "not_found",
        (tmp_path / "missing.jpg").as_uri(): "not_found",
        str(tmp_path): "unreadable",
        "nosuchprotocol://bucket/x.jpg": "unreadable",
    }
    for uri, code in failures.items():
        with pytest.raises(MediaError) as err:
            read_source(uri)
        assert err.value.code == code, uri


def test_mislabelled_file_is_judged_by_its_bytes(tmp_path: Path) -> None:
    named_jpg = tmp_path / "photo.jpg"
    named_jpg.write_bytes((LOCAL / "hfdatasets_test_video_66x50.mov").read_bytes())
    assert isinstance(decode(read_source(str(named_jpg)), AUTO), DecodedVideo)


def test_invalid_options_are_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="frame_multiple"):
        DecodeOptions("video", max_image_pixels=1, fps=2.0, max_frames=1, frame_multiple=2)
    with pytest.raises(ValueError, match="modality"):
        DecodeOptions("audio", max_image_pixels=1, fps=2.0, max_frames=4, frame_multiple=2)
    with pytest.raises(ValueError, match="fps"):
        DecodeOptions("video", max_image_pixels=1, fps=0.0, max_frames=4, frame_multiple=2)


def test_media_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(MediaError("corrupt", "bad NAL unit")))
    assert (err.code, err.message, str(err)) == ("corrupt", "bad NAL unit", "corrupt: bad NAL unit")


# ---------------------------------------------------------------- DecodePool

POOL = {"preload": worker_preload([]), "error": MediaError}
"""What the job's pool is given (pipeline.WORKER_MODULES without the job's own modules)."""

def pool_task(task: tuple[str, object]) -> object:
    """Module level so that worker processes can import it."""
    kind, value = task
    if kind == "sleep":
        time.sleep(float(value))  # type: ignore[arg-type]
        return value
    if kind == "hang":
        time.sleep(3600)
    if kind == "crash":
        os._exit(3)
    if kind == "media":
        raise MediaError("corrupt", str(value))
    if kind == "bug":
        raise ValueError(value)
    if kind == "item":
        return sample_item(int(value))  # type: ignore[call-overload]
    if kind == "cut_item":
        return item_over_a_cut_file(Path(str(value)))
    if kind == "stalling_item":
        return item_that_stalls_in_transfer()
    if kind == "nice":
        return os.nice(0)
    return int(value) ** 2  # type: ignore[call-overload]


def sample_item(rows: int) -> EncoderInput:
    """A deterministic item with the dtypes adapters produce, an empty tensor, a
    non-contiguous one and a layout grid."""
    gen = torch.Generator().manual_seed(rows)
    tensors = {
        "pixels": torch.randn(rows, 8, generator=gen),
        "half": torch.randn(rows, 3, generator=gen).to(torch.bfloat16),
        "bytes": torch.randint(0, 256, (rows,), generator=gen, dtype=torch.uint8),
        "grid": torch.tensor([[1, rows, 2]], dtype=torch.int64),
        "strided": torch.arange(4 * rows, dtype=torch.int64).reshape(rows, 4)[:, ::2],
        "none": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    return EncoderInput(tensors, tokens=rows, frames=0, size=8 * rows, modality="image", grid=(1, rows, 2))


def assert_same_item(got: object, want: EncoderInput) -> None:
    assert isinstance(got, EncoderInput)
    assert (got.tokens, got.frames, got.size, got.modality, got.grid) == (want.tokens, want.frames, want.size, want.modality, want.grid)
    assert list(got.tensors) == list(want.tensors)
    for key, tensor in want.tensors.items():
        assert got.tensors[key].dtype == tensor.dtype and got.tensors[key].shape == tensor.shape, key
        assert torch.equal(got.tensors[key], tensor), key


CUT_ITEM_BYTES = 4 << 20


def item_over_a_cut_file(path: Path) -> EncoderInput:
    """An item whose tensor maps a file cut to a quarter of it after mapping: sending
    it gets through the first megabyte, then fails (EFAULT), which ends the worker
    in the middle of the payload."""
    with open(path, "w+b") as file:
        file.truncate(CUT_ITEM_BYTES)
        mapped = mmap.mmap(file.fileno(), CUT_ITEM_BYTES)
        file.truncate(CUT_ITEM_BYTES // 4)
    return EncoderInput({"pixels": torch.frombuffer(mapped, dtype=torch.uint8)}, tokens=1, frames=0, size=1)


def item_that_stalls_in_transfer() -> EncoderInput:
    """A 128 MB item whose worker stops itself (SIGSTOP) 2 ms after returning it, while
    the item is being sent: far too soon for 128 MB to get through."""
    pixels = torch.zeros(128 << 20, dtype=torch.uint8)
    threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    return EncoderInput({"pixels": pixels}, tokens=1, frames=0, size=1)


MIXED = [
    ("square", 1), ("sleep", 0.3), ("hang", None), ("square", 3), ("crash", None),
    ("media", "broken"), ("bug", "oops"), ("square", 7), ("sleep", 0.1), ("square", 9),
]


def expected_outcome(result: object) -> object:
    return result.code if isinstance(result, MediaError) else result


MIXED_EXPECTED = [1, 0.3, "decode_timeout", 9, "decoder_crashed", "corrupt", "internal_error", 49, 0.1, 81]


@pytest.fixture(scope="module")
def pool():
    with DecodePool(pool_task, workers=2, timeout=1.5, **POOL) as shared_pool:
        yield shared_pool


def test_pool_keeps_order_and_isolates_timeouts_crashes_and_errors(pool: DecodePool) -> None:
    results = list(pool.imap(MIXED))
    assert [expected_outcome(r) for r in results] == MIXED_EXPECTED
    # Replacement workers serve the next run, and nothing of the last run leaks into it.
    assert list(pool.imap([("square", i) for i in range(8)])) == [i * i for i in range(8)]


def test_pool_bounds_in_flight_and_recovers_after_early_exit(pool: DecodePool) -> None:
    pulled: list[int] = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            yield ("square", i)

    results = pool.imap(endless())
    assert [next(results) for _ in range(5)] == [0, 1, 4, 9, 16]
    # yielded + max_in_flight (default 2 * workers) + waiting (workers) + the one the task thread holds
    assert len(pulled) <= 5 + 2 * 2 + 2 + 1
    results.close()
    assert list(pool.imap([("sleep", 0.2), ("square", 5)])) == [0.2, 25]


@pytest.mark.parametrize("workers", [2, 0])
def test_a_stalled_input_still_delivers_what_was_taken_and_reports_idle(workers: int) -> None:
    """A rank whose input waits (rank 0 holds back more rows until this rank's results
    are written) must still get the results of the rows it has: otherwise it waits for
    rows that wait for it."""
    release = threading.Event()

    def stalling():
        yield ("square", 3)
        yield ("square", 4)
        release.wait(10)
        yield ("square", 5)

    with DecodePool(pool_task, workers=workers, timeout=5.0, **POOL) as stalled:
        results = stalled.imap(stalling(), idle=0.2)
        real = (r for r in results if r is not IDLE)  # workers may still be starting
        assert [next(real), next(real)] == [9, 16]
        assert next(results) is IDLE  # nothing more can come while the input waits
        release.set()
        assert [r for r in results if r is not IDLE] == [25]


def pid_of_local(task: tuple[str, object]) -> object:
    """The pool's local path for ("here", n) tasks: the process that ran it, and n; a
    ("bug", ...) task raises here (its worker then takes it); None for the rest."""
    kind, value = task
    if kind == "bug":
        raise RuntimeError("a local path that fails")
    return (os.getpid(), value) if kind == "here" else None


def test_tasks_the_local_path_takes_stay_in_this_process_and_in_order() -> None:
    """A task the local path answers never reaches a worker, and its result keeps its
    place among the workers' (a deferred JPEG's row is the row of its input)."""
    tasks = [("here", 0), ("square", 3), ("sleep", 0.2), ("here", 1), ("bug", "oops"), ("here", 2), ("square", 4)]
    with DecodePool(pool_task, workers=2, timeout=5.0, local=pid_of_local, **POOL) as mixed:
        results = list(mixed.imap(tasks))
    here = os.getpid()
    assert [expected_outcome(r) for r in results] == [(here, 0), 9, 0.2, (here, 1), "internal_error", (here, 2), 16]


def test_a_task_is_assigned_as_it_is_sent_to_a_worker_not_as_it_is_taken() -> None:
    """`assign` runs when a worker is sent the task: all eight are taken at once (the
    in-flight bound allows them), but one worker starts them one after another, so a
    choice changed after the first result reaches every task sent from then on (the
    second may already be on its way), in the workers and inline alike."""
    for workers in (1, 0):
        late = threading.Event()
        with DecodePool(pool_task, workers=workers, timeout=5.0, max_in_flight=8,
                        assign=lambda task: ("sleep", 0.2) if not late.is_set() else ("square", task), **POOL) as pool:
            results = []
            for result in pool.imap(range(2, 10)):
                results.append(result)
                late.set()
        assert results[0] == 0.2 and results[2:] == [k * k for k in range(4, 10)], (workers, results)


def test_a_pool_whose_every_task_is_local_never_waits_for_its_poll() -> None:
    """With nothing in a worker, no worker's result wakes the pool's thread; the
    consumer taking a result must, or each task past the in-flight bound would wait
    for the thread's poll (50 ms: 10 s for these 200)."""
    with DecodePool(pool_task, workers=1, timeout=5.0, max_in_flight=1, local=pid_of_local, **POOL) as local_only:
        start = time.monotonic()
        results = list(local_only.imap([("here", k) for k in range(200)]))
        took = time.monotonic() - start
    assert [value for _, value in results] == list(range(200))
    assert took < 3.0


def test_workers_run_below_the_rank_so_its_threads_get_the_cores_first(pool: DecodePool) -> None:
    """A decode-bound job keeps every core busy with workers; the rank's threads (feeding
    the graphs and NVDEC) must win a core when they wake, or the GPU waits on a worker."""
    assert worker_pool.WORKER_NICE > 0
    expected = min(os.nice(0) + worker_pool.WORKER_NICE, 19)
    assert list(pool.imap([("nice", None)] * 4)) == [expected] * 4
    assert os.nice(0) < expected


def test_decoding_starts_before_the_first_result_is_asked_for(pool: DecodePool) -> None:
    results = pool.imap([("sleep", 0.5), ("sleep", 0.5)])
    time.sleep(0.8)  # what the caller does meanwhile (capturing graphs) overlaps the decode
    start = time.monotonic()
    assert list(results) == [0.5, 0.5]
    assert time.monotonic() - start < 0.3


def test_pool_returns_items_of_every_dtype_unchanged(pool: DecodePool) -> None:
    sizes = [1, 7, 200_000, 3]  # 200_000 rows: a 6 MB tensor, far more than a socket buffer
    results = list(pool.imap([("item", n) for n in sizes]))
    for got, rows in zip(results, sizes):
        assert_same_item(got, sample_item(rows))


def test_encoder_input_pickles_tensors_out_of_band_from_protocol_5() -> None:
    item = sample_item(1000)
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(item, protocol=5, buffer_callback=buffers.append)
    # The tensors' 55 KB travel beside the pickle, which holds only their layout.
    assert len(buffers) == len(item.tensors) and len(header) < 1024
    received = [bytearray(b.raw()) for b in buffers]
    back = pickle.loads(header, buffers=received)
    assert_same_item(back, item)
    # Rebuilt over the received memory itself, not over a copy of it.
    assert back.tensors["pixels"].data_ptr() == torch.frombuffer(received[0], dtype=torch.uint8).data_ptr()


def test_encoder_input_pickles_in_band_below_protocol_5() -> None:
    """torch.distributed's object collectives pickle with the default protocol 4; protocol
    5 without a buffer_callback copies the buffers into the pickle."""
    item = sample_item(50)
    assert_same_item(pickle.loads(pickle.dumps(item, protocol=4)), item)
    assert_same_item(pickle.loads(pickle.dumps(item, protocol=5)), item)


def test_worker_dying_in_the_middle_of_a_result_is_a_crash_and_the_pool_goes_on(pool: DecodePool, tmp_path: Path) -> None:
    tasks = [("item", 5), ("cut_item", str(tmp_path / "cut.bin")), ("item", 200_000), ("square", 6)]
    results = list(pool.imap(tasks))
    assert isinstance(results[1], MediaError) and results[1].code == "decoder_crashed"
    # Exit code 1: the failed send ended the worker after part of the payload had gone
    # out (a fault while pickling would have been a SIGBUS, exit code -7).
    assert "exit code 1)" in results[1].message
    assert_same_item(results[0], sample_item(5))
    assert_same_item(results[2], sample_item(200_000))
    assert results[3] == 36


def test_worker_stalling_in_the_middle_of_a_result_times_out_and_the_pool_goes_on(pool: DecodePool) -> None:
    start = time.monotonic()
    results = list(pool.imap([("square", 2), ("stalling_item", None), ("item", 9)]))
    assert isinstance(results[1], MediaError) and results[1].code == "decode_timeout"
    assert results[0] == 4
    assert_same_item(results[2], sample_item(9))
    assert time.monotonic() - start < 10  # the pool's timeout is 1.5 s


def raw_pair(timeout: float) -> tuple[socket.socket, socket.socket]:
    """The parent's frame socket and a raw handle on the worker's end of a pool pipe."""
    parent, child = multiprocessing.Pipe(duplex=True)
    sock = worker_pool._result_socket(parent, timeout)
    peer = socket.socket(fileno=os.dup(child.fileno()))
    parent.close()
    child.close()
    return sock, peer


def frame_of(seq: int, result: object) -> bytes:
    """The bytes a worker sends for `result` (small enough for a socket buffer)."""
    sender, receiver = socket.socketpair()
    with sender, receiver:
        wire.send_frame(sender, seq, *worker_pool._pickle_result(result, MediaError))
        sender.close()
        return b"".join(iter(lambda: receiver.recv(1 << 16), b""))


def test_a_frame_arrives_whole() -> None:
    item = sample_item(300)
    sock, peer = raw_pair(timeout=5.0)
    with sock, peer:
        peer.sendall(frame_of(4, item) + frame_of(5, MediaError("corrupt", "bad")))
        seq, got = worker_pool._receive_frame(sock, timeout=5.0, error=MediaError)
        assert seq == 4
        assert_same_item(got, item)
        seq, got = worker_pool._receive_frame(sock, timeout=5.0, error=MediaError)
        assert (seq, str(got)) == (5, "corrupt: bad")


@pytest.mark.parametrize("where", ["prefix", "payload", "buffers"])
def test_a_frame_cut_short_is_end_of_file_never_a_partial_item(where: str) -> None:
    frame = frame_of(1, sample_item(300))
    cut = {"prefix": 7, "payload": 60, "buffers": len(frame) - 100}[where]
    sock, peer = raw_pair(timeout=5.0)
    with sock, peer:
        peer.sendall(frame[:cut])
        peer.close()
        with pytest.raises(EOFError, match="closed its end"):
            worker_pool._receive_frame(sock, timeout=5.0, error=MediaError)


def test_a_stalled_frame_gives_up_after_the_timeout() -> None:
    frame = frame_of(1, sample_item(300))
    sock, peer = raw_pair(timeout=0.3)
    with sock, peer:
        peer.sendall(frame[:-100])
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            worker_pool._receive_frame(sock, timeout=0.3, error=MediaError)
        assert 0.25 < time.monotonic() - start < 3.0


def with_chunk_offset_past_the_end(data: bytes) -> bytes:
    """The clip with its first chunk offset (stco) pointing far past the end of the
    file: decord 0.6.0 segfaults on it, a real corrupt-file crash."""
    out = bytearray(data)
    out[out.index(b"stco") + 12] = 227  # high byte of the first entry
    return bytes(out)


def test_pool_decodes_real_media_like_inline_decoding_and_survives_a_decord_crash() -> None:
    paths = [LOCAL / "decord_video_90.mov", LOCAL / "hfdatasets_test_image_rgba.png", LOCAL / "torchcodec_av1_video.mkv"]
    tasks = [p.read_bytes() for p in paths] + [b""]
    fn = functools.partial(decode, options=AUTO)
    crashing = with_chunk_offset_past_the_end((LOCAL / "hfdatasets_test_video_66x50.mov").read_bytes())
    with DecodePool(fn, workers=1, timeout=30, **POOL) as workers, DecodePool(fn, workers=0, timeout=30, **POOL) as inline:
        pooled = list(workers.imap(tasks[:2] + [crashing] + tasks[2:]))
        direct = list(inline.imap(tasks))
    assert isinstance(pooled[2], MediaError) and pooled[2].code == "decoder_crashed"
    del pooled[2]
    assert isinstance(pooled[0], DecodedVideo) and np.array_equal(pooled[0].frames, direct[0].frames)
    assert pooled[0].frames.shape[1:3] == (568, 320)
    # A PNG after a video in the same worker: decord's zlib is loaded (see embedjob.decode.video._decord).
    assert isinstance(pooled[1], DecodedImage) and np.array_equal(pooled[1].pixels, direct[1].pixels)
    assert [str(r) for r in pooled[2:]] == [str(r) for r in direct[2:]]
    assert [r.code for r in pooled[2:]] == ["unsupported_codec", "empty"]


class ExitsWhenUnpickled:
    """A task function whose unpickling kills the worker before it takes a task."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (os._exit, (7,))


def test_pool_stops_when_workers_cannot_start() -> None:
    with DecodePool(ExitsWhenUnpickled(), workers=1, timeout=1.0, **POOL) as broken:
        with pytest.raises(RuntimeError, match="cannot start"):
            list(broken.imap([1, 2]))


def test_inline_pool_maps_failures_to_errors_in_order() -> None:
    tasks = [("square", 2), ("media", "x"), ("bug", "y"), ("square", 4)]
    with DecodePool(pool_task, workers=0, timeout=1.0, **POOL) as inline:
        assert [expected_outcome(r) for r in inline.imap(tasks)] == [4, "corrupt", "internal_error", 16]
