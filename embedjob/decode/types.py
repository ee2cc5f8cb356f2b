"""The types every decode module shares: the per-item error, the options and the two results.

Kept apart from the decoders so that `source`, `image` and `video` import them without
importing each other (see ARCHITECTURE.md, "decode").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedjob.config import DEFAULT_MAX_FRAME_PIXELS, DEFAULT_MAX_ITEM_BYTES, DEFAULT_MAX_VIDEO_PIXELS, DEFAULT_NVDEC_SESSIONS
from embedjob.decode.gop import PacketFeed


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
    (`video.max_total_pixels`): None means no limit. `media_root` (a real path),
    `max_item_bytes` and `storage_options` (`input.storage_options`, for the stores of
    URIs in media cells) are what the worker hands to `read_source`. `defer_jpeg` leaves
    plain JPEGs undecoded (`DeferredImage`) for the device's decoder;
    `defer_video` plans a video's sampled frames and leaves them undecoded
    (`DeferredVideo`) for the GPU's video decoder, which the rank runs in
    `nvdec_sessions` sessions at once (`video.nvdec_sessions`).
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
    storage_options: dict[str, Any] = field(default_factory=dict)
    defer_jpeg: bool = False
    defer_video: bool = False
    nvdec_sessions: int = DEFAULT_NVDEC_SESSIONS

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
        if self.nvdec_sessions < 1:
            raise ValueError(f"nvdec_sessions must be >= 1, got {self.nvdec_sessions}")


@dataclass
class DecodedImage:
    """`pixels`: (H, W, 3) uint8 RGB, C-contiguous, EXIF orientation applied."""

    pixels: np.ndarray


@dataclass
class DeferredImage:
    """A JPEG left undecoded for the device's decoder: its bytes and its frame header's
    size. Only a JPEG the CPU path would decode without a word gets here (see
    `image.deferred_jpeg`)."""

    data: bytes
    width: int
    height: int


@dataclass
class DeferredVideo:
    """A video whose sampled frames the GPU's video decoder decodes (`video.decoder:
    nvdec`): everything the CPU path decides before it reads the frames. `indices` are
    the frames it would read (in sample order), `decoded` the (width, height) it would
    read them at (scaled down when larger than max_frame_pixels), `matrix` the display
    matrix it would apply after, `shown` the (height, width) of a frame as displayed;
    `timestamps`, `source_fps` and `source_frames` as in `DecodedVideo`; `feed` the
    pictures those frames need, cut out of the samples where the worker could
    (`video.PACKETS_IN_WORKERS`), else None."""

    data: bytes
    indices: list[int]
    decoded: tuple[int, int]
    matrix: tuple[tuple[int, int], tuple[int, int]]
    shown: tuple[int, int]
    timestamps: list[float]
    source_fps: float
    source_frames: int
    feed: PacketFeed | None = None

    @classmethod
    def unplanned(cls, data: bytes, matrix: tuple[tuple[int, int], tuple[int, int]] = ((1, 0), (0, 1))) -> DeferredVideo:
        """A video left to the GPU's decoder without a plan (no indices: a codec decord
        lacks), which the rank makes from the stream (`video.plan_from_stream`)."""
        return cls(data, [], (0, 0), matrix, (0, 0), [], 0.0, 0)


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


def last_line(exc: BaseException) -> str:
    """The last non-blank line of an exception's text, which is where decord and torchvision state the reason."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
