"""Decode stage: media bytes to RGB pixels (images) or sampled RGB frames (videos).

Contract (binding for the runner):

- `decode(data, options)` returns a `DecodedImage` or a `DecodedVideo`, or raises
  `MediaError`; no other exception escapes it. A `MediaError` becomes one error row
  ("code: message"), so a bad item never stops the job.
- Images: `(H, W, 3)` uint8 RGB, C-contiguous, EXIF orientation applied. JPEG goes
  through `torchvision.io.decode_image` (libjpeg-turbo; about 1.5x Pillow's speed
  here), everything else through Pillow. PNG is NOT given to torchvision: 0.29.1's
  libpng error path kills the process (SIGSEGV) on a corrupt PNG such as one with an
  IDAT CRC error, where Pillow raises a clean error. A JPEG gives the same pixels on
  either path (Pillow is the fallback for JPEGs torchvision refuses). Conversions:
  * transparency is composited on WHITE (never dropped): pixels under alpha 0 hold
    undefined colour (often black), and a black-on-transparent logo must not become
    an all-black square;
  * 16-bit samples are scaled to 8 bits with rounding (v * 255 / 65535);
  * grayscale, palette and CMYK are expanded to RGB.
  The pixel count is checked from the header before any pixel is decoded
  (`too_large`).
- Videos: decord 0.6.0 (FFmpeg 4.1 inside) on the bytes; only the sampled frames are
  decoded, at most 8 at a time. Decoded pixels are bounded before the sampled frames
  are decoded (`too_large`): the frame size declared by the container (MP4/MOV `stsd`,
  Matroska `PixelWidth`/`PixelHeight`) is checked before decord opens the stream, and
  the size of the first sampled frame, decoded alone, before the others (which covers
  the formats we do not parse and a header that lies); the frames of the whole sample
  have a total cap too. The frame count follows the Qwen2-VL rule (see
  `sample_frame_indices`); a variable-frame-rate clip is sampled evenly in time.
  MP4/MOV display matrices (rotation, mirroring) are applied here, from our own parse
  of the `mvhd`/`tkhd` boxes: decord's CPU reader turns multiples of 90 degrees itself
  but ignores mirroring, so we reset the matrix in the bytes we hand to decord and
  apply the whole matrix to the decoded frames (same pixels as decord's rotation).
  Matroska/AVI carry no such matrix for FFmpeg 4.1. Files with several video tracks
  decode the first one: the other video tracks are hidden from decord (their `trak`
  box is renamed `free`: same size, so no offset moves).
- A truncated container whose surviving part decord can index decodes to the frames
  that are there (the original frames, bit for bit); one cut before its index is
  `truncated`. A frame that cannot be decoded is an error (`corrupt`), never a
  substituted frame. FFmpeg's own diagnostics are captured from stderr into the
  error message.
- Returned arrays are writable (torch warns on every `from_numpy` of a read-only one).
- `read_source` reads a path or URI for a row without media bytes: its size is
  checked before it is read (`too_large`), and with a media root the file actually
  opened must lie under it (`path_escape`), checked on the open descriptor.
- Error messages never quote the item's bytes (a path row may name any file).
- decord is imported only when a video is decoded (see `_decord`).
- `DecodePool` runs a picklable function over tasks in worker processes (forkserver,
  or spawn where there is none; never fork, since the parent may hold CUDA state),
  with a per-item timeout, crash isolation and results in input order.

Error codes: empty, unknown_format, unsupported_format, not_an_image, not_a_video,
truncated, corrupt, too_large, not_found, unreadable, no_video_stream,
unsupported_codec, no_frames, decode_timeout, decoder_crashed, internal_error,
path_escape.
"""

from __future__ import annotations

import collections
import io
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import queue
import re
import signal
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from PIL import Image, UnidentifiedImageError

from embedjob.config import DEFAULT_MAX_FRAME_PIXELS, DEFAULT_MAX_ITEM_BYTES, DEFAULT_MAX_VIDEO_PIXELS
from embedjob.workers import wire

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class MediaError(Exception):
    """A per-item failure. `str(err) == f"{code}: {message}"`; it becomes one error row.

    Picklable (it crosses the worker-process boundary): `__reduce__` rebuilds it from
    `(code, message)`.
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.code, self.message))


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode one item. Invalid values raise `ValueError` at construction,
    because they are configuration mistakes, not per-item failures.

    `decoder_threads` is FFmpeg's thread count per video: 1 suits a pool with one
    worker per core; 0 lets FFmpeg pick (best when decoding inline).

    `max_frame_pixels` scales frames down at decode time; `frame_pixel_limit` refuses a
    video whose frames are larger (`video.max_pixels_per_frame`), and
    `video_pixel_limit` one whose sampled frames hold more pixels together
    (`video.max_total_pixels`): None means no limit. `media_root` (a real path) and
    `max_item_bytes` are what the worker hands to `read_source`.
    """

    modality: str
    max_image_pixels: int
    fps: float
    max_frames: int
    frame_multiple: int
    max_frame_pixels: int | None = None
    decoder_threads: int = 1
    frame_pixel_limit: int | None = DEFAULT_MAX_FRAME_PIXELS
    video_pixel_limit: int | None = DEFAULT_MAX_VIDEO_PIXELS
    media_root: str | None = None
    max_item_bytes: int | None = DEFAULT_MAX_ITEM_BYTES

    def __post_init__(self) -> None:
        if self.modality not in ("image", "video", "auto"):
            raise ValueError(f"modality must be 'image', 'video' or 'auto', got {self.modality!r}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"fps must be a positive number, got {self.fps}")
        if self.frame_multiple < 1:
            raise ValueError(f"frame_multiple must be >= 1, got {self.frame_multiple}")
        if self.max_frames < self.frame_multiple:
            raise ValueError(
                f"max_frames ({self.max_frames}) must be >= frame_multiple ({self.frame_multiple}): "
                "every video yields at least frame_multiple frames"
            )
        for name in ("max_frame_pixels", "frame_pixel_limit", "video_pixel_limit", "max_item_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.decoder_threads < 0:
            raise ValueError(f"decoder_threads must be >= 0, got {self.decoder_threads}")


@dataclass
class DecodedImage:
    """`pixels`: (H, W, 3) uint8 RGB, C-contiguous, EXIF orientation applied."""

    pixels: np.ndarray


@dataclass
class DecodedVideo:
    """Sampled frames of one video.

    `frames`: (T, H, W, 3) uint8 RGB, C-contiguous, display matrix applied;
    T >= frame_multiple, T % frame_multiple == 0, T <= max_frames.
    `timestamps`: presentation time of each frame in seconds from the first frame.
    `source_fps`, `source_frames`: of the decoded stream, as decord reports them.
    """

    frames: np.ndarray
    timestamps: list[float]
    source_fps: float
    source_frames: int


# ---------------------------------------------------------------- sniffing

# ISO-BMFF major brands of still images (Pillow's format names): the rest is video.
_IMAGE_BRANDS = {
    b"avif": "AVIF", b"avis": "AVIF",
    b"heic": "HEIF", b"heix": "HEIF", b"heim": "HEIF", b"heis": "HEIF", b"mif1": "HEIF", b"msf1": "HEIF",
}
_QUICKTIME_FIRST_BOXES = {b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"}


def _sniff_format(data: bytes) -> tuple[str, str] | None:
    """(modality, format name) from magic numbers, or None. File names are never used:
    datasets mislabel them."""
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "GIF"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "image", "TIFF"
    if head[:2] == b"BM" and len(data) >= 26 and data[6:10] == b"\x00\x00\x00\x00":
        return "image", "BMP"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "WEBP"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "AVI"
    if head[:4] == b"\x00\x00\x01\x00" and len(data) >= 22 and data[4:6] != b"\x00\x00":
        return "image", "ICO"
    if head.startswith(b"\x00\x00\x00\x0cjP  \r\n\x87\n") or head[:4] == b"\xff\x4f\xff\x51":
        return "image", "JPEG2000"
    if head[4:8] == b"ftyp":
        if head[8:12] in _IMAGE_BRANDS:
            return "image", _IMAGE_BRANDS[head[8:12]]
        return "video", "MP4"
    if head[4:8] in _QUICKTIME_FIRST_BOXES:
        return "video", "MOV"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "video", "MATROSKA"
    if head[:3] == b"FLV":
        return "video", "FLV"
    if head[:4] == b"OggS":
        return "video", "OGG"
    if head[:4] == b"\x00\x00\x01\xba":
        return "video", "MPEG-PS"
    if head[:8] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11":
        return "video", "ASF"
    if len(data) > 376 and data[0] == data[188] == data[376] == 0x47:  # three 188-byte packets
        return "video", "MPEG-TS"
    return None


def sniff(data: bytes) -> str | None:
    """"image", "video" or None, decided from the bytes' magic numbers alone."""
    found = _sniff_format(data)
    return found[0] if found else None


# ---------------------------------------------------------------- reading

def read_source(uri: str, root: str | None = None, max_bytes: int | None = DEFAULT_MAX_ITEM_BYTES) -> bytes:
    """All bytes of a local path or an fsspec URI (s3://, gs://, file://, ...), checked
    before they are read.

    - An item of more than `max_bytes` bytes is "too_large", known from its size before
      any byte is read (the file's fstat, the store's size), and the read stops one byte
      past the limit in case the file grows meanwhile: a worker never holds more.
    - With `root` (the real path of the media root, `reader.local_media_root`), the file
      actually opened must lie under it ("path_escape"). The check is made on the open
      descriptor, so a path swapped for a symlink after the reader checked it cannot
      lead out, and a swap after the check changes nothing we read.

    Raises MediaError "not_found" for a missing file and "unreadable" for everything
    else that stops the read (directory, permissions, no fsspec backend installed).
    """
    try:
        if "://" not in uri:
            return _read_local(uri, root, max_bytes)
        import fsspec  # only URIs need it; plain paths skip the import
        from fsspec.implementations.local import LocalFileSystem

        fs, path = fsspec.core.url_to_fs(uri)
        if isinstance(fs, LocalFileSystem):
            return _read_local(path, root, max_bytes)
        with fs.open(path, "rb") as handle:
            _check_size(uri, getattr(handle, "size", None), max_bytes)
            return _bounded_read(uri, handle, max_bytes)
    except FileNotFoundError:
        raise MediaError("not_found", f"{uri}: no such file") from None
    except IsADirectoryError:
        raise MediaError("unreadable", f"{uri}: is a directory") from None
    except PermissionError:
        raise MediaError("unreadable", f"{uri}: permission denied") from None
    except ImportError as exc:
        raise MediaError("unreadable", f"{uri}: no fsspec backend for this protocol ({exc})") from None
    except (OSError, ValueError) as exc:
        raise MediaError("unreadable", f"{uri}: {exc}") from None


def _read_local(path: str, root: str | None, max_bytes: int | None) -> bytes:
    # O_NONBLOCK: a FIFO planted under a media name must not hang the worker in open().
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if root is not None:
            _check_opened_within(fd, path, root)
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise MediaError("unreadable", f"{path}: is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("unreadable", f"{path}: not a regular file")
        _check_size(path, info.st_size, max_bytes)
        with open(fd, "rb", closefd=False) as handle:
            return _bounded_read(path, handle, max_bytes)
    finally:
        os.close(fd)


def _check_opened_within(fd: int, path: str, root: str) -> None:
    """The file open on `fd` lies under `root`, whatever symlinks led to it (the kernel
    names the opened file in /proc/self/fd; a later swap of `path` cannot change it)."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        raise MediaError("unreadable", f"{path}: cannot check that it lies under media_root (/proc is not mounted)") from None
    if os.path.commonpath([real, root]) != root:
        raise MediaError("path_escape", f"{path} leads to {real}, outside media_root {root}")


def _check_size(what: str, size: int | None, max_bytes: int | None) -> None:
    if size is not None and max_bytes is not None and size > max_bytes:
        raise MediaError("too_large", f"{what}: {size} bytes, more than input.max_item_bytes = {max_bytes}")


def _bounded_read(what: str, handle: Any, max_bytes: int | None) -> bytes:
    """At most `max_bytes` bytes; a source that turns out longer than its size said is
    "too_large" (read one byte past the limit to know, never more)."""
    data = handle.read(-1 if max_bytes is None else max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise MediaError("too_large", f"{what}: more than input.max_item_bytes = {max_bytes} bytes")
    return data


# ---------------------------------------------------------------- decode entry

def decode(data: bytes, options: DecodeOptions) -> DecodedImage | DecodedVideo:
    """Decode one item; raises only MediaError (unexpected failures: "internal_error",
    with the traceback logged, so a decoder bug costs one row, not the job)."""
    try:
        return _decode(data, options)
    except MediaError:
        raise
    except MemoryError:
        raise MediaError("too_large", "ran out of memory while decoding") from None
    except Exception as exc:
        logger.exception("unexpected failure while decoding an item")
        raise MediaError("internal_error", f"{type(exc).__name__}: {exc}") from None


def _decode(data: bytes, options: DecodeOptions) -> DecodedImage | DecodedVideo:
    if not data:
        raise MediaError("empty", "0 bytes")
    found = _sniff_format(data)
    kind = found[0] if found else None
    fmt = found[1] if found else None
    if options.modality == "image":
        if kind == "video":
            raise MediaError("not_an_image", f"the bytes are a {fmt} video but the modality is image")
        return _decode_image(data, options, fmt)
    if options.modality == "video":
        if kind == "image":
            raise MediaError("not_a_video", f"the bytes are a {fmt} image but the modality is video")
        return _decode_video(data, options, fmt)
    if kind is None:
        raise MediaError("unknown_format", f"neither a known image nor video format ({len(data)} bytes)")
    if kind == "image":
        return _decode_image(data, options, fmt)
    return _decode_video(data, options, fmt)


# ---------------------------------------------------------------- images

_TORCHVISION_FORMATS = {"JPEG", "MPO"}
_TRUNCATION_WORDS = ("truncat", "premature end", "incomplete", "not enough data", "unexpected end")
_EXIF_ORIENTATION = 0x0112
_EXIF_TRANSPOSE = {
    2: [Image.Transpose.FLIP_LEFT_RIGHT],
    3: [Image.Transpose.ROTATE_180],
    4: [Image.Transpose.FLIP_TOP_BOTTOM],
    5: [Image.Transpose.TRANSPOSE],
    6: [Image.Transpose.ROTATE_270],
    7: [Image.Transpose.TRANSVERSE],
    8: [Image.Transpose.ROTATE_90],
}


def _decode_image(data: bytes, options: DecodeOptions, fmt: str | None) -> DecodedImage:
    img = _open_image(data, fmt)
    width, height = img.size
    if width * height > options.max_image_pixels:
        raise MediaError(
            "too_large",
            f"{img.format} image of {width}x{height} = {width * height} pixels exceeds max_image_pixels={options.max_image_pixels}",
        )
    if img.format in _TORCHVISION_FORMATS:
        pixels = _decode_with_torchvision(data, img)
    else:
        pixels = _decode_with_pillow(img)
    return DecodedImage(pixels=np.ascontiguousarray(pixels))


def _open_image(data: bytes, fmt: str | None) -> Image.Image:
    """Pillow's lazy open: reads the header only (format, size, mode), no pixels."""
    try:
        with warnings.catch_warnings():
            # Our own limit (max_image_pixels) decides; Pillow's warning would only add noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise MediaError("too_large", str(exc)) from None
    except UnidentifiedImageError:
        if fmt is None:
            raise MediaError("unknown_format", f"not a recognised image format ({len(data)} bytes)") from None
        Image.init()
        if fmt not in Image.OPEN:
            raise MediaError("unsupported_format", f"{fmt} images cannot be decoded (no Pillow plugin installed)") from None
        raise MediaError("corrupt", f"{fmt} signature but the header cannot be read") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise MediaError(_image_error_code(exc), f"{fmt or 'image'} header: {exc}") from None


def _image_error_code(exc: BaseException) -> str:
    text = str(exc).lower()
    if isinstance(exc, EOFError) or any(word in text for word in _TRUNCATION_WORDS):
        return "truncated"
    if "not supported" in text or "unsupported" in text:
        return "unsupported_format"
    return "corrupt"


def _has_alpha(img: Image.Image) -> bool:
    return any(band in ("A", "a") for band in img.getbands()) or "transparency" in img.info


def _decode_with_torchvision(data: bytes, img: Image.Image) -> np.ndarray:
    """A JPEG through libjpeg-turbo via torchvision (grayscale and CMYK converted to
    RGB, EXIF orientation applied by torchvision; JPEG has no alpha).

    A failure other than truncation falls back to Pillow (which reads some JPEG
    variants torchvision refuses); a truncated file is an error on either path,
    never a half-grey image.
    """
    import torch  # imported here: video-only workers need no torch
    from torchvision.io import ImageReadMode, decode_image

    try:
        tensor = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as exc:
        if _image_error_code(exc) == "truncated":
            raise MediaError("truncated", f"{img.format}: {_torchvision_message(exc)}") from None
        logger.debug("torchvision could not decode a %s (%s); trying Pillow", img.format, _torchvision_message(exc))
        return _decode_with_pillow(img)
    return tensor.permute(1, 2, 0).numpy()


def _decode_with_pillow(img: Image.Image) -> np.ndarray:
    try:
        img.load()
        img = _exif_transposed(img)
        return _pillow_to_rgb(img)
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise MediaError(_image_error_code(exc), f"{img.format or 'image'}: {exc}") from None


def _exif_transposed(img: Image.Image) -> Image.Image:
    """The image as displayed. An unreadable EXIF block is ignored (the pixels are fine)."""
    try:
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception as exc:  # Pillow raises many types on malformed EXIF
        logger.debug("ignoring unreadable EXIF: %s", exc)
        return img
    for method in _EXIF_TRANSPOSE.get(orientation, []):
        img = img.transpose(method)
    return img


def _pillow_to_rgb(img: Image.Image) -> np.ndarray:
    if img.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N"):
        gray = _scale_16bit(np.clip(np.asarray(img, dtype=np.int64), 0, 65535))
        return np.repeat(gray[:, :, None], 3, axis=2)
    if _has_alpha(img):
        return _composite_on_white(np.asarray(img.convert("RGBA")))
    # np.array, not asarray: Pillow hands numpy read-only memory, and the encoder's
    # torch.from_numpy would warn about it for every image.
    return np.array(img.convert("RGB"))


def _scale_16bit(values: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255 with rounding (Pillow itself would clip at 255)."""
    return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
    """(H, W, 4) uint8 -> (H, W, 3) uint8 over a white background, rounded."""
    rgb = rgba[:, :, :3].astype(np.uint32)
    alpha = rgba[:, :, 3:].astype(np.uint32)
    return ((rgb * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)


def _torchvision_message(exc: BaseException) -> str:
    """torchvision's message without its 'decode_jpeg, /path/file.cpp:171, ' prefix."""
    return re.sub(r"^\w+, \S+:\d+, ", "", _last_line(exc))


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


# ---------------------------------------------------------------- MP4/MOV boxes

Matrix = tuple[tuple[int, int], tuple[int, int]]
_IDENTITY: Matrix = ((1, 0), (0, 1))
_IDENTITY_MATRIX_BYTES = struct.pack(">9i", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)


@dataclass
class _Mp4Facts:
    """What we need from an MP4/MOV before decord sees it.

    `matrix`: the 2x2 display transform of the first video track composed with the
    movie's, in ISO 14496-12's row-vector convention (displayed [x y] = [x y] @ matrix),
    entries in {-1, 0, 1}; identity when absent or not a multiple of 90 degrees.
    `patches`: (offset, bytes) writes that leave decord only the first video track,
    with an identity display matrix. `truncated`: a top-level box runs past the end.
    `frame_size`: (width, height) of the first video track's sample entry, None if absent.
    """

    video_codecs: list[str] = field(default_factory=list)
    matrix: Matrix = _IDENTITY
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    truncated: bool = False
    frame_size: tuple[int, int] | None = None


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


def _mp4_facts(data: bytes) -> _Mp4Facts:
    facts = _Mp4Facts()
    for kind, start, end in _boxes(data, 0, len(data)):
        facts.truncated = facts.truncated or end > len(data)
        if kind == b"moov":
            _read_moov(data, start, end, facts)
    return facts


def _read_moov(data: bytes, start: int, end: int, facts: _Mp4Facts) -> None:
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


def _read_trak(data: bytes, start: int, end: int, box_offset: int, facts: _Mp4Facts) -> None:
    tkhd = _child(data, start, end, b"tkhd")
    mdia = _child(data, start, end, b"mdia")
    # Only mdia's own hdlr names the track type; QuickTime also puts a data-handler
    # hdlr inside minf.
    hdlr = _child(data, *mdia, b"hdlr") if mdia else None
    if not hdlr or data[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
        return
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
    if tkhd and tkhd[0] < len(data):
        offset = tkhd[0] + (52 if data[tkhd[0]] == 1 else 40)
        facts.matrix = _read_matrix(data, offset)
        if facts.matrix != _IDENTITY:
            facts.patches.append((offset, _IDENTITY_MATRIX_BYTES))


def _sample_entry_size(data: bytes, stsd: int) -> tuple[int, int] | None:
    """(width, height) of the first VisualSampleEntry of an `stsd` payload (ISO 14496-12:
    version/flags, entry count, then the entry's 8-byte header and 24 bytes before them)."""
    offset = stsd + 8 + 32
    if offset + 4 > len(data):
        return None
    width, height = struct.unpack_from(">HH", data, offset)
    return (width, height) if width and height else None


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


# ---------------------------------------------------------------- video

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
    container, and FFmpeg's captured diagnostics."""

    source: bytes | bytearray
    fmt: str | None
    facts: _Mp4Facts
    options: DecodeOptions
    log: _StderrCapture


def _decode_video(data: bytes, options: DecodeOptions, fmt: str | None) -> DecodedVideo:
    facts = _mp4_facts(data) if fmt in ("MP4", "MOV") else _Mp4Facts()
    if facts.truncated:
        raise MediaError("truncated", f"{fmt}: a box runs past the end of the file ({len(data)} bytes)")
    declared = facts.frame_size if fmt != "MATROSKA" else _matroska_frame_size(data[:_EBML_HEAD])
    if declared is not None:
        # Before decord opens the stream: opening alone may decode a frame at full size.
        _check_frame_pixels(*declared, options, "declared by the container")
    with _StderrCapture() as log:
        job = _VideoJob(_patched(data, facts.patches), fmt, facts, options, log)
        video = _decode_video_job(job)
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
        _check_matroska_complete(bytes(job.source[:_EBML_HEAD]), times, num_frames, source_fps)
    if times is not None:
        indices = _time_uniform(indices, times)
    # One frame, decoded alone, tells the real size (decord exposes none before decoding).
    height, width = _to_numpy(_get_batch(job, reader, [indices[0]])).shape[1:3]
    _check_frame_pixels(width, height, options, "decoded")
    reader, (out_width, out_height) = _bounded_reader(job, reader, width, height)
    _check_video_pixels(len(indices), out_width, out_height, options)
    frames = _apply_matrix(_read_frames(job, reader, indices), job.facts.matrix)
    if times is not None:
        timestamps = [float(times[i, 0] - times[0, 0]) for i in indices]
    else:
        timestamps = [i / source_fps if source_fps > 0 else 0.0 for i in indices]
    return DecodedVideo(np.ascontiguousarray(frames), timestamps, source_fps, num_frames)


_EBML_HEAD = 1 << 16
_EBML_SEGMENT, _EBML_INFO, _EBML_SCALE, _EBML_DURATION = 0x18538067, 0x1549A966, 0x2AD7B1, 0x4489


def _check_matroska_complete(head: bytes, times: np.ndarray | None, num_frames: int, fps: float) -> None:
    """A Matroska file cut short still opens and decodes the frames before the cut, so
    compare the duration its header declares with the frames actually present: a file
    missing more than a tenth of it is `truncated` (an embedding of half a clip must not
    pass for the clip)."""
    declared = _matroska_duration(head)
    if declared is None or declared <= 0:
        return
    if times is not None:
        present = float(times[-1, 1] - times[0, 0])
    else:
        present = num_frames / fps if fps > 0 else 0.0
    if present < 0.9 * declared:
        raise MediaError("truncated", f"Matroska declares {declared:.2f}s but only {present:.2f}s of frames are present")


_EBML_TRACKS, _EBML_TRACK_ENTRY, _EBML_TRACK_TYPE, _EBML_VIDEO = 0x1654AE6B, 0xAE, 0x83, 0xE0
_EBML_PIXEL_WIDTH, _EBML_PIXEL_HEIGHT = 0xB0, 0xBA
_MATROSKA_VIDEO_TRACK = 1


def _matroska_frame_size(head: bytes) -> tuple[int, int] | None:
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


def _matroska_duration(head: bytes) -> float | None:
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


def _patched(data: bytes, patches: list[tuple[int, bytes]]) -> bytes | bytearray:
    if not patches:
        return data
    out = bytearray(data)
    for offset, value in patches:
        out[offset : offset + len(value)] = value
    return out


def _decord() -> Any:
    """decord, imported only where a video is decoded.

    decord loads its bundled zlib 1.2.3 with RTLD_GLOBAL: for the rest of the process
    Python's zlib module and a torchvision loaded afterwards bind to it, and
    torchvision's PNG decoder then fails ("libpng error: bad parameters to zlib") or
    crashes. Keeping the import out of module import time confines that to processes
    that decode video (this module never decodes PNG with torchvision).
    """
    import decord

    return decord


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
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", _last_line(exc))[:400]


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


def _bounded_reader(job: _VideoJob, reader: Any, width: int, height: int) -> tuple[Any, tuple[int, int]]:
    """The same reader, or one that scales at decode time when frames of `width` x
    `height` exceed max_frame_pixels (aspect kept); with the (width, height) it yields."""
    limit = job.options.max_frame_pixels
    if limit is None or width * height <= limit:
        return reader, (width, height)
    scale = math.sqrt(limit / (width * height))
    size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    logger.debug("decoding %dx%d frames at %dx%d (max_frame_pixels=%d)", width, height, size[0], size[1], limit)
    return _open_reader(job, size), size


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


# ---------------------------------------------------------------- worker pool

def _start_method() -> str:
    # forkserver: children fork from a clean server (no CUDA state), cheaply, which
    # matters when a timed-out worker is replaced. spawn where forkserver is missing.
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _context(preload: Iterable[str]) -> Any:
    """The workers' start context. With forkserver, workers fork from a server that has
    `preload` (the modules the task function needs) and the decoders loaded, so a new
    or replacement worker starts in milliseconds instead of importing torch. decord
    comes after `preload`: its bundled zlib must not be the first one loaded (see
    `_decord`). The server keeps the list it started with."""
    context = multiprocessing.get_context(_start_method())
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(["torchvision.io", *preload, "decord", __name__])
    return context


def start_worker_server(preload: Iterable[str]) -> None:
    """Start the server that decode workers fork from now, without waiting for it.

    Its imports (torch, transformers, the decoders: seconds) then run in their own
    process while the caller loads its model, instead of when the first pool starts.
    """
    if _start_method() == "forkserver":
        _context(preload)
        multiprocessing.forkserver.ensure_running()


_MAX_FAILED_STARTS = 3


def _run_task(fn: Callable[[Any], Any], task: Any) -> Any:
    """fn(task), with failures as MediaError values: "internal_error" for anything that
    is not a MediaError (a bug in fn), its traceback logged where it happened."""
    try:
        return fn(task)
    except MediaError as exc:
        return exc
    except Exception as exc:
        logger.exception("task failed with an unexpected exception")
        return MediaError("internal_error", f"{type(exc).__name__}: {exc}")


# Worker -> parent results travel on the pool's socketpair (the duplex Pipe of a
# forkserver/spawn context on Unix) as `wire` frames whose seq is the task's number, or
# _READY_SEQ for the READY handshake (empty payload); parent -> worker tasks stay on the
# Connection (small, rare).
_READY_SEQ = -1


def _worker_main(fn: Callable[[Any], Any], conn: multiprocessing.connection.Connection) -> None:
    # Ctrl-C reaches the whole process group; the parent decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    wire.send_frame(sock, _READY_SEQ, b"", [])
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        seq, task = message
        payload, buffers = _pickle_result(_run_task(fn, task))
        wire.send_frame(sock, seq, payload, buffers)


def _pickle_result(result: Any) -> tuple[bytes, list[memoryview]]:
    """The result as a wire payload; one that cannot be pickled becomes an
    "internal_error" MediaError, since the parent must get one result per task."""
    try:
        return wire.pickled(result)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, BufferError) as exc:
        return pickle.dumps(MediaError("internal_error", f"result cannot be pickled: {exc}"), protocol=5), []


def _result_socket(conn: multiprocessing.connection.Connection, timeout: float) -> socket.socket:
    """A second handle on the parent's end of a worker's socketpair, to read frames;
    reads block at most `timeout` seconds, so a stalled worker cannot hold the service
    thread forever."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    wire.receive_timeout(sock, timeout)
    return sock


def _receive_frame(sock: socket.socket, timeout: float) -> tuple[int, Any]:
    """(seq, result) of the next frame; the result is None for READY. Raises EOFError
    when the worker died mid-frame and TimeoutError when it stalled (see `wire`)."""
    seq, payload, buffers = wire.receive_frame(sock, timeout)
    if seq == _READY_SEQ:
        return seq, None
    return seq, _load_result(payload, buffers)


def _load_result(payload: memoryview, buffers: list[np.ndarray]) -> Any:
    """Unpickle a result over its received buffers; a result that cannot be rebuilt
    here (a class missing in the parent, ...) is that task's "internal_error"."""
    try:
        return wire.unpickle(payload, buffers)
    except Exception as exc:
        logger.exception("a decode result cannot be unpickled")
        return MediaError("internal_error", f"result cannot be unpickled: {type(exc).__name__}: {exc}")


@dataclass
class _Worker:
    """One worker process and the parent's two handles on its socketpair: `conn` sends
    tasks (and is what `wait` watches), `sock` reads the worker's frames."""

    process: Any
    conn: multiprocessing.connection.Connection
    sock: socket.socket
    ready: bool = False
    seq: int | None = None
    deadline: float = 0.0

    def close_channel(self) -> None:
        self.conn.close()
        self.sock.close()


_POLL_SECONDS = 0.05
_END = object()
_NOTHING = object()


class Idle:
    """What `DecodePool.imap` yields when no result has arrived for its `idle` seconds."""

    def __repr__(self) -> str:
        return "IDLE"


IDLE = Idle()


@dataclass
class _Failed:
    """The task iterable raised: re-raised where the results are consumed."""

    error: BaseException


class _Tasks:
    """The tasks of one `imap`, taken from their iterable on a thread of their own.

    Taking a task may block for long (reading the next row group, waiting for rank 0
    to hand out more rows); on its own thread that wait never stops the pool from
    dispatching and receiving the tasks it already holds. At most `capacity` taken
    tasks wait here; after each one (and after the end) a byte on `wake` wakes the
    service thread, which sleeps on the workers' sockets.
    """

    def __init__(self, tasks: Iterable[Any], capacity: int, wake: socket.socket | None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(capacity)
        self._wake = wake
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._take, args=(iter(tasks),), name="embedjob-decode-tasks", daemon=True)
        self._thread.start()

    def _take(self, tasks: Iterator[Any]) -> None:
        try:
            for task in tasks:
                if not self._put(task):
                    return
            self._put(_END)
        except BaseException as exc:
            self._put(_Failed(exc))

    def _put(self, value: Any) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(value, timeout=_POLL_SECONDS)
            except queue.Full:
                continue
            if self._wake is not None:
                try:
                    self._wake.send(b"\0")
                except OSError:
                    pass
            return True
        return False

    def get(self, timeout: float | None) -> Any:
        """The next task, _END, a _Failed, or _NOTHING when none came within `timeout`
        seconds (0: do not wait)."""
        try:
            return self._queue.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return _NOTHING

    def stop(self) -> None:
        """Stop taking tasks; the iterable is left where it is (a generator blocked in
        it finishes its wait, then ends)."""
        self._stopped.set()
        while self.get(0) is not _NOTHING:
            pass


class _Feed:
    """Hand-over between the pool's service thread and the consuming generator.

    The service thread publishes finished results; the generator takes them in input
    order. `has_room` bounds tasks taken but not yet handed over (memory stays bounded).
    A failure in the service thread is re-raised in the generator.
    """

    def __init__(self, max_in_flight: int) -> None:
        self._cond = threading.Condition()
        self._results: dict[int, Any] = {}
        self._next = 0
        self._max_in_flight = max_in_flight
        self._finished = False
        self._error: BaseException | None = None
        self.stopped = False

    def has_room(self, taken: int) -> bool:
        with self._cond:
            return taken - self._next < self._max_in_flight

    def delivered(self, taken: int) -> bool:
        with self._cond:
            return self._next + len(self._results) >= taken

    def publish(self, done: dict[int, Any]) -> None:
        if not done:
            return
        with self._cond:
            self._results.update(done)
            self._cond.notify_all()
        done.clear()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def next_result(self, idle: float | None) -> Any:
        """The next result in order, _END, or IDLE when none came within `idle` seconds."""
        deadline = None if idle is None else time.monotonic() + idle
        with self._cond:
            while True:
                if self._next in self._results:
                    self._next += 1
                    self._cond.notify_all()
                    return self._results.pop(self._next - 1)
                if self._error is not None:
                    raise self._error
                if self._finished:
                    return _END
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return IDLE
                self._cond.wait(left)


class DecodePool(Generic[T, R]):
    """Runs fn(task) in worker processes with a per-item timeout.

    - Results come back in input order; every task yields exactly one result: its
      value, or a MediaError (raised by fn, "decode_timeout" when it ran longer than
      `timeout` seconds — the worker is killed and replaced — or "decoder_crashed"
      when its worker died). Other in-flight tasks are not affected: each worker
      holds one task at a time.
    - At most `max_in_flight` tasks (default 2 * workers) are dispatched or done and
      not yet yielded, and at most `workers` more (one for `workers=0`) are taken from
      the input and waiting, so memory stays bounded on unbounded input. Tasks are
      taken on a thread of their own: an input that blocks does not stop the workers.
    - `imap(tasks, idle)` starts at once (the workers decode while the caller does
      other work) and yields IDLE whenever `idle` seconds pass without a result, so a
      caller that batches results can flush what it has while the input is stalled.
    - fn and tasks must be picklable (module-level functions); results come back
      as protocol-5 `wire` frames whose out-of-band buffers (numpy arrays,
      `EncoderInput` tensors) the parent receives straight into their final memory,
      one blocking recv for all of them, so a busy consumer thread is not starved of
      the GIL. A result that stops arriving part-way for `timeout` seconds is a
      "decode_timeout" (its worker is killed); a worker that dies part-way is a
      "decoder_crashed". No partly received result is ever delivered.
    - workers=0 runs fn inline in the caller: same results, but no timeout and no
      crash isolation (a hang hangs the caller, a crash kills it; decord 0.6.0
      segfaults on some corrupt videos, so use workers for untrusted video).
    - One `imap` at a time. Leaving an `imap` early kills the workers that are still
      busy (their results could not be matched any more) and replaces them.
    """

    def __init__(
        self,
        fn: Callable[[T], R],
        workers: int,
        timeout: float,
        max_in_flight: int | None = None,
        preload: Iterable[str] = (),
    ):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._fn = fn
        self._timeout = timeout
        self._max_in_flight = max_in_flight or max(1, 2 * workers)
        self._ctx = _context(preload)
        self._count = workers
        self._workers: list[_Worker] = []
        self._failed_starts = 0
        self._start_error: BaseException | None = None
        self._active: Callable[[], None] | None = None
        self._closed = False
        self._starter = threading.Thread(target=self._start_workers, name="embedjob-decode-start", daemon=True)
        self._starter.start()

    def __enter__(self) -> DecodePool[T, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def imap(self, tasks: Iterable[T], idle: float | None = None) -> Iterator[R | MediaError | Idle]:
        """Results of fn over tasks, in input order; IDLE after `idle` quiet seconds
        (None: never). Taking tasks and decoding start before the first result is asked for."""
        if self._closed:
            raise RuntimeError("DecodePool is closed")
        if self._active is not None:
            raise RuntimeError("DecodePool.imap is already running; consume or close it first")
        if not self._count:
            source = _Tasks(tasks, 1, None)
            self._active = source.stop
            return self._inline(source, idle)
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        source = _Tasks(tasks, self._count, wake_write)
        feed = _Feed(self._max_in_flight)
        service = threading.Thread(
            target=self._serve, args=(source, feed, wake_read), name="embedjob-decode-pool", daemon=True
        )
        service.start()

        def stop() -> None:
            feed.stop()
            source.stop()
            service.join()
            wake_read.close()
            wake_write.close()
            self._abandon_busy()

        self._active = stop
        return self._results(feed, idle)

    def close(self) -> None:
        """Stop the workers (idempotent): ask each to exit, kill those that do not."""
        if self._closed:
            return
        self._closed = True
        self._end_imap()
        self._starter.join()
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.close_channel()
        self._workers = []

    def _end_imap(self) -> None:
        stop, self._active = self._active, None
        if stop is not None:
            stop()

    def _start_workers(self) -> None:
        """Start the workers one after another on this thread; each serves as soon as it
        exists. A start forks the server that holds torch: tens of milliseconds each, more
        on a sandboxed kernel, which would otherwise all come before the first decode."""
        try:
            for _ in range(self._count):
                if self._closed:
                    return
                self._workers.append(self._start_worker())
        except BaseException as exc:
            logger.exception("a decode worker could not start")
            self._start_error = exc

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(self._fn, child), daemon=True, name="embedjob-decode")
        process.start()
        child.close()
        return _Worker(process=process, conn=parent, sock=_result_socket(parent, self._timeout))

    def _inline(self, source: _Tasks, idle: float | None) -> Iterator[R | MediaError | Idle]:
        try:
            while True:
                task = source.get(idle)
                if task is _NOTHING:
                    yield IDLE
                elif task is _END:
                    return
                elif isinstance(task, _Failed):
                    raise task.error
                else:
                    yield _run_task(self._fn, task)
        finally:
            self._end_imap()

    def _results(self, feed: _Feed, idle: float | None) -> Iterator[R | MediaError | Idle]:
        """Yield results in order while the service thread keeps the workers busy.

        The caller may spend long stretches between results (encoding a window); if the
        workers were fed and drained only from here they would sit idle, blocked on
        sending, all that time. The service thread dispatches, receives and enforces
        timeouts; this generator only waits for the next result in order.
        """
        try:
            while True:
                result = feed.next_result(idle)
                if result is _END:
                    return
                yield result
        finally:
            self._end_imap()

    def _serve(self, source: _Tasks, feed: _Feed, wake: socket.socket) -> None:
        waiting: collections.deque[tuple[int, T]] = collections.deque()
        done: dict[int, R | MediaError] = {}
        taken = 0
        exhausted = False
        try:
            while not feed.stopped:
                while not exhausted and feed.has_room(taken):
                    task = source.get(0)
                    if task is _NOTHING:
                        break
                    if task is _END:
                        exhausted = True
                        break
                    if isinstance(task, _Failed):
                        raise task.error
                    waiting.append((taken, task))
                    taken += 1
                if self._start_error is not None and not self._workers:
                    raise RuntimeError(f"decode workers cannot start: {self._start_error}")
                self._dispatch(waiting)
                feed.publish(done)
                if exhausted and feed.delivered(taken):
                    feed.finish()
                    return
                self._wait(done, wake, poll=_POLL_SECONDS)
        except BaseException as exc:
            feed.fail(exc)

    def _dispatch(self, waiting: collections.deque[tuple[int, T]]) -> None:
        for worker in self._workers:
            if not waiting:
                return
            if not worker.ready or worker.seq is not None:
                continue
            seq, task = waiting.popleft()
            try:
                worker.conn.send((seq, task))
            except OSError:
                # The worker died while idle; the task goes back first in line.
                waiting.appendleft((seq, task))
                continue
            worker.seq = seq
            worker.deadline = time.monotonic() + self._timeout

    def _wait(self, done: dict[int, R | MediaError], wake: socket.socket, poll: float) -> None:
        busy = [w for w in self._workers if w.seq is not None]
        timeout = max(0.0, min([w.deadline for w in busy] + [time.monotonic() + poll]) - time.monotonic())
        handles: list[Any] = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers] + [wake]
        ready = set(multiprocessing.connection.wait(handles, timeout))
        if wake in ready:
            _drain(wake)
        for index, worker in enumerate(list(self._workers)):
            if worker.conn in ready:
                self._service(index, worker, done)
            elif worker.process.sentinel in ready:
                # Dead with nothing to read, its end kept open by a process it left
                # behind: reading would only wait for the timeout.
                self._lost(index, worker, done)
        now = time.monotonic()
        for index, worker in enumerate(list(self._workers)):
            # A result already waiting (unread while another worker's result was being
            # read) is taken on the next pass, not thrown away as a timeout.
            if worker.seq is not None and worker.deadline <= now and not worker.conn.poll():
                logger.warning("task %d ran past %gs; killing its worker", worker.seq, self._timeout)
                done[worker.seq] = MediaError("decode_timeout", f"no result after {self._timeout:g}s; the decoder was killed")
                self._replace(index, worker)

    def _service(self, index: int, worker: _Worker, done: dict[int, R | MediaError]) -> None:
        """Take the worker's next frame; if it died, or stalled in the middle of a
        frame, fail its task and replace it.

        One frame per call: a worker holds one task at a time, so nothing else can be
        waiting behind a result (another look would only cost a syscall).
        """
        try:
            seq, result = _receive_frame(worker.sock, self._timeout)
        except (BlockingIOError, TimeoutError) as exc:
            # Alive but stuck mid-frame: the stream cannot be put back in step.
            logger.warning("a result stopped arriving (%s); killing its worker", exc)
            if worker.seq is not None:
                done[worker.seq] = MediaError("decode_timeout", f"the result stopped arriving for {self._timeout:g}s; the decoder was killed")
            self._replace(index, worker)
            return
        except (EOFError, OSError):
            self._lost(index, worker, done)
            return
        if seq == _READY_SEQ:
            worker.ready = True
            self._failed_starts = 0
        else:
            done[seq] = result
            worker.seq = None

    def _lost(self, index: int, worker: _Worker, done: dict[int, R | MediaError]) -> None:
        """The worker died: fail its task, if any, and replace it."""
        # Its end of the socket closes a moment before its exit status is known.
        worker.process.join(timeout=1.0)
        code = worker.process.exitcode
        if not worker.ready:
            # No task is involved: fn cannot be loaded in a fresh process. Replacing
            # it forever would hang the job, so after a few tries the job stops.
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                raise RuntimeError(f"decode workers cannot start: {_MAX_FAILED_STARTS} exited (last exit code {code}) before taking a task")
        if worker.seq is not None:
            logger.warning("worker died (exit code %s) on task %d", code, worker.seq)
            done[worker.seq] = MediaError("decoder_crashed", f"the decoding process died (exit code {code})")
        self._replace(index, worker)

    def _replace(self, index: int, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        worker.close_channel()
        self._workers[index] = self._start_worker()

    def _abandon_busy(self) -> None:
        for index, worker in enumerate(list(self._workers)):
            if worker.seq is not None:
                self._replace(index, worker)


def _drain(sock: socket.socket) -> None:
    """Read every wake-up byte waiting on a non-blocking socket."""
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass
