"""Image decode: bytes to `(H, W, 3)` uint8 RGB, C-contiguous, EXIF orientation applied.

- JPEG goes through `torchvision.io.decode_image` (libjpeg-turbo, faster than Pillow),
  everything else through Pillow. PNG is NOT given to torchvision: 0.29.1's libpng error
  path kills the process (SIGSEGV) on a corrupt PNG such as one with an IDAT CRC error,
  where Pillow raises a clean error. A JPEG gives the same pixels on either path (Pillow
  is the fallback for JPEGs torchvision refuses).
- Transparency is composited on WHITE (never dropped): pixels under alpha 0 hold
  undefined colour (often black), and a black-on-transparent logo must not become an
  all-black square.
- 16-bit samples are scaled to 8 bits with rounding (v * 255 / 65535); grayscale,
  palette and CMYK are expanded to RGB.
- The pixel count is checked from the header before any pixel is decoded (`too_large`).
- Memory: Pillow's path holds the decoded image (up to 4 bytes a pixel) and the
  result (3 bytes a pixel) at once, nothing else of full size, EXIF turns included
  (`_pillow_to_rgb`);
  torchvision's holds a copy of the bytes and the result.

See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

import io
import logging
import re
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from embedjob.decode.types import DecodedImage, DecodeOptions, DeferredImage, MediaError, last_line

logger = logging.getLogger(__name__)

_TORCHVISION_FORMATS = {"JPEG", "MPO"}
_TRUNCATION_WORDS = ("truncat", "premature end", "incomplete", "not enough data", "unexpected end")
_EXIF_ORIENTATION = 0x0112
_ORIENTATIONS = {
    1: (False, False, False),
    2: (False, True, False),  # mirrored left to right
    3: (True, True, False),  # turned 180 degrees
    4: (True, False, False),  # mirrored top to bottom
    5: (False, False, True),  # transposed
    6: (True, False, True),  # turned 90 degrees clockwise
    7: (True, True, True),  # transversed
    8: (False, True, True),  # turned 90 degrees counter-clockwise
}
"""EXIF orientation -> (reverse the rows, reverse the columns, then swap rows and
columns): the image as displayed, what Pillow's `ImageOps.exif_transpose` gives."""


def decode_image(data: bytes, options: DecodeOptions, fmt: str | None) -> DecodedImage | DeferredImage:
    """`fmt` is the sniffed format name (None: unknown); it only words the errors, Pillow decides.

    A JPEG whose frame header is plain to read goes straight to torchvision (`_plain_jpeg`);
    anything else, and every JPEG that fails there, takes Pillow's path from the start,
    which words every error. So an error row is Pillow's path's, and a JPEG that decodes
    is its picture; only a file whose markers Pillow's parser refuses but libjpeg-turbo
    decodes whole now gets its picture instead of a corrupt row. With `options.defer_jpeg`
    a plain JPEG is not decoded here at all (`deferred_jpeg`)."""
    if fmt == "JPEG" and options.defer_jpeg and (deferred := deferred_jpeg(data, options)) is not None:
        return deferred
    if fmt == "JPEG" and (pixels := _plain_jpeg(data, options)) is not None:
        return DecodedImage(pixels=np.ascontiguousarray(pixels))
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


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""JPEG frame headers (baseline, progressive, lossless, arithmetic): they carry the size.
0xC4, 0xC8 and 0xCC in that range are tables and a reserved marker."""
_DEVICE_SOF = frozenset({0xC0, 0xC1, 0xC2})
"""Huffman-coded baseline, extended and progressive frames: what nvjpeg decodes."""
_APP1, _APP14 = 0xE1, 0xEE


@dataclass(frozen=True)
class JpegHeader:
    """What a JPEG's segments before its first scan say: the frame header's size, sample
    components and marker, the EXIF orientation (None: no EXIF block, 0: one that could
    not be read) and whether an Adobe segment (colour transform flags) is present."""

    width: int
    height: int
    components: int
    sof: int
    orientation: int | None
    adobe: bool


def jpeg_header(data: bytes) -> JpegHeader | None:
    """The header of a JPEG, read by skipping its marker segments up to the frame header;
    None for anything unexpected before it (no start of image, a scan before the frame
    header, a segment running past the end, a zero size)."""
    if not data.startswith(b"\xff\xd8"):
        return None
    pos, end = 2, len(data)
    orientation: int | None = None
    adobe = False
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a segment
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or a scan: no frame header first
            return None
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2 or pos + 2 + length > end:
            return None
        body = data[pos + 4 : pos + 2 + length]
        if marker in _SOF_MARKERS:
            if length < 8:
                return None
            height = int.from_bytes(body[1:3], "big")
            width = int.from_bytes(body[3:5], "big")
            if not (width and height):
                return None
            return JpegHeader(width, height, body[5], marker, orientation, adobe)
        if marker == _APP1 and body.startswith(b"Exif\x00\x00") and orientation is None:
            orientation = exif_orientation(body[6:])
        adobe = adobe or (marker == _APP14 and body.startswith(b"Adobe"))
        pos += 2 + length
    return None


def jpeg_frame_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG's frame header (see `jpeg_header`)."""
    header = jpeg_header(data)
    return None if header is None else (header.width, header.height)


def exif_orientation(tiff: bytes) -> int:
    """The orientation tag (1-8) of IFD0 of an EXIF block's TIFF structure; 1 where the
    tag is absent, 0 where the structure cannot be read."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 0
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 0
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for entry in range(ifd + 2, ifd + 2 + 12 * count, 12):
        if entry + 12 > len(tiff):
            return 0
        if int.from_bytes(tiff[entry : entry + 2], order) == _EXIF_ORIENTATION:
            value = int.from_bytes(tiff[entry + 8 : entry + 10], order)
            return value if 1 <= value <= 8 else 0
    return 1


def deferred_jpeg(data: bytes, options: DecodeOptions) -> DeferredImage | None:
    """A JPEG left for the device's decoder (`preprocess.decoder: gpu`): one whose header
    is plain (Huffman frame, gray or three components without an Adobe colour transform,
    no EXIF rotation to apply, whole up to its end-of-image marker) and within the pixel
    limits. None sends it down the CPU path, which words every error, so a file that is
    an error row there stays one; the device's decoder gets only what it can decode as
    the CPU would, and the rank falls back to the CPU path for any it refuses."""
    header = jpeg_header(data)
    if header is None or header.sof not in _DEVICE_SOF or header.components not in (1, 3) or header.adobe:
        return None
    if header.orientation not in (None, 1) or not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        return None
    if not _within_limits(header.width * header.height, options):
        return None
    return DeferredImage(data, header.width, header.height)


def _within_limits(pixels: int, options: DecodeOptions) -> bool:
    """Whether Pillow's path would open an image of `pixels` without an error."""
    return pixels <= options.max_image_pixels and (Image.MAX_IMAGE_PIXELS is None or pixels <= 2 * Image.MAX_IMAGE_PIXELS)


def _plain_jpeg(data: bytes, options: DecodeOptions) -> np.ndarray | None:
    """The pixels of a JPEG read without Pillow: its size from the frame header (the
    limits checked as Pillow's path checks them), then torchvision, as that path decodes
    a JPEG. None when either step has anything to say: Pillow's path then runs and words it.
    Pillow's header parse was a tenth of a 224 px image's decode and preprocessing."""
    size = jpeg_frame_size(data)
    if size is None or not _within_limits(size[0] * size[1], options):
        return None
    import torch
    from torchvision.io import ImageReadMode, decode_image

    try:
        tensor = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError:
        return None
    return tensor.permute(1, 2, 0).numpy()


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
        return _pillow_to_rgb(img, _orientation(img))
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise MediaError(_image_error_code(exc), f"{img.format or 'image'}: {exc}") from None


def _orientation(img: Image.Image) -> int:
    """The image's EXIF orientation, 1 where it has none or an unreadable or unknown one
    (the pixels are fine)."""
    try:
        orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception as exc:  # Pillow raises many types on malformed EXIF
        logger.debug("ignoring unreadable EXIF: %s", exc)
        return 1
    return orientation if orientation in _ORIENTATIONS else 1


_STRIP_PIXELS = 1 << 18
"""Pixels converted at a time by `_pillow_to_rgb`: a few MB of temporaries per strip."""


def _pillow_to_rgb(img: Image.Image, orientation: int = 1) -> np.ndarray:
    """A decoded image as displayed (`orientation`, EXIF's) in (H, W, 3) uint8, converted
    a strip of rows at a time into one array, each strip turned as it is placed. Beside
    Pillow's own pixels (4 bytes a pixel for RGB and RGBA) the only full-size buffer is
    the result (3 bytes a pixel): converting the whole image at once held two or three
    more copies (14 bytes a pixel for RGB, 52 for RGBA, whose compositing works in
    uint32, and 4 more for a turned image), and every conversion is per pixel, so strips
    give the same pixels."""
    width, height = img.size
    reverse_rows, reverse_columns, swap = _ORIENTATIONS[orientation]
    out = np.empty((width, height, 3) if swap else (height, width, 3), np.uint8)
    rows = max(1, _STRIP_PIXELS // width)
    for top in range(0, height, rows):
        bottom = min(top + rows, height)
        strip = _strip_to_rgb(img.crop((0, top, width, bottom)))
        first, last = (height - bottom, height - top) if reverse_rows else (top, bottom)
        strip = strip[::-1 if reverse_rows else 1, ::-1 if reverse_columns else 1]
        if swap:
            out[:, first:last] = strip.transpose(1, 0, 2)
        else:
            out[first:last] = strip
    return out


def _strip_to_rgb(img: Image.Image) -> np.ndarray:
    if img.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N"):
        gray = _scale_16bit(np.clip(np.asarray(img, dtype=np.int64), 0, 65535))
        return np.repeat(gray[:, :, None], 3, axis=2)
    if _has_alpha(img):
        return _composite_on_white(np.asarray(img.convert("RGBA")))
    return np.asarray(img.convert("RGB"))


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
    return re.sub(r"^\w+, \S+:\d+, ", "", last_line(exc))
