"""What a decode worker makes of an input row: a preprocessed item or an error row.

ARCHITECTURE.md, "worker rows": `decode_row` is the function a `DecodePool`
calls in its workers once per row, so every per-item cost (reading, decoding, resizing,
the model's preprocessing) is paid there and never on a rank's main thread; a failure
of one row is that row's error, never the job's. `decode_options`, on the rank, is what
the workers are given; the workers import `WORKER_MODULES` before their first row.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from embedjob.config import Job, JobError
from embedjob.decode import DecodedVideo, DecodeOptions, DeferredImage, MediaError, decode, read_source, worker_preload
from embedjob.decode.device import decode_jpegs, pixel_groups
from embedjob.encoders import EncoderAdapter, EncoderInput
from embedjob.encoders.base import JPEG_KEY, JPEG_SIZE_KEY
from embedjob.encoders.registry import ADAPTER_MODULES
from embedjob.io import reader

WORKER_MODULES = worker_preload([__name__, *ADAPTER_MODULES])
"""What decode workers import: the decoders, this module (`decode_row`) and every family's
preprocessing, in the order `worker_preload` gives them."""


@dataclass
class Decoded:
    """A row after the decode stage: a preprocessed item or an error, never both, the
    seconds the worker spent on it, and the row's copied input columns (`extra`)."""

    row: int
    id: Any
    modality: str | None
    item: EncoderInput | None
    error: str | None
    seconds: float = 0.0
    extra: tuple[Any, ...] = ()


@functools.cache
def _set_up_worker() -> None:
    """Decode workers run one per core; torch's default of one thread per core inside each
    of them would oversubscribe the machine many times over. A worker's stderr is the
    job's: the libraries' warnings (torch, Pillow, decord) are not for the user there,
    and embedjob itself reports through logging and error rows, never warnings."""
    if multiprocessing.parent_process() is not None:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")


def decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded:
    """Worker function: bytes (or a path) -> decoded media -> EncoderInput, or an error row."""
    _set_up_worker()
    start = time.perf_counter()
    decoded = _decode_row(row, options, preprocess)
    decoded.seconds = time.perf_counter() - start
    decoded.extra = row.extra
    return decoded


def decode_task(task: tuple[reader.InputRow, bool], options: DecodeOptions, preprocess: Any) -> Decoded:
    """`decode_row` of a (row, defer) task: with `preprocess.decoder: auto` the rank
    decides as it goes whether the JPEGs of the rows it submits are left for its GPU."""
    row, defer = task
    return decode_row(row, dataclasses.replace(options, defer_jpeg=True) if defer else options, preprocess)


def _error_modality(options: DecodeOptions) -> str | None:
    """The modality of a row that did not decode: the job's, unless it takes either."""
    return None if options.modality == "auto" else options.modality


def _decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded:
    fixed = _error_modality(options)
    if row.error is not None:
        return Decoded(row.row, row.id, fixed, None, row.error)
    try:
        data = row.data if row.data is not None else read_source(row.uri or "", options.media_root, options.max_item_bytes)
        decoded = decode(data, options)
    except MediaError as err:
        return Decoded(row.row, row.id, fixed, None, str(err))
    return _preprocessed(row.row, row.id, decoded, preprocess)


def _preprocessed(row: int, id: Any, decoded: Any, preprocess: Any) -> Decoded:
    """The row of decoded media: its item, or a preprocess_failed error row."""
    modality = "video" if isinstance(decoded, DecodedVideo) else "image"
    try:
        if isinstance(decoded, DeferredImage):
            data = torch.frombuffer(bytearray(decoded.data), dtype=torch.uint8)
            item = preprocess.deferred(data, decoded.height, decoded.width)
        else:
            item = preprocess(decoded)
    except Exception as exc:  # a preprocessing failure is one bad row, not a failed job
        return Decoded(row, id, modality, None, f"preprocess_failed: {type(exc).__name__}: {exc}")
    return Decoded(row, id, modality, item, None)


def decode_on_device(window: list[Decoded], options: DecodeOptions, preprocess: Any, device: torch.device) -> int:
    """Decode, on `device`, the JPEGs the workers left undecoded in `window`, in place:
    each such row gets its item with pixels on the device, or, for a JPEG nvjpeg
    refuses, what the CPU path makes of it (its item or its error row, as a worker would
    have). Returns how many rows the device decoded.

    Runs on the rank's GPU-decode thread (`RankPipeline._decoded_on_device`), a window
    at a time: a constant number of nvjpeg calls per window (`pixel_groups` bounds the
    full-size pictures held at once), then the family's resize and patching per picture
    on the device."""
    waiting = [k for k, d in enumerate(window) if d.item is not None and JPEG_KEY in d.item.tensors]
    pixels = [int(window[k].item.tensors[JPEG_SIZE_KEY].prod()) for k in waiting]
    done = 0
    for group in pixel_groups(pixels):
        rows = [waiting[g] for g in group]
        images = decode_jpegs([window[k].item.tensors[JPEG_KEY] for k in rows], device)
        for k, image in zip(rows, images):
            window[k] = _finished(window[k], image, options, preprocess)
            done += image is not None
    return done


def _finished(decoded: Decoded, image: torch.Tensor | None, options: DecodeOptions, preprocess: Any) -> Decoded:
    """A deferred row once its picture is decoded (`image`), or through the CPU path
    where nvjpeg refused it (`image` None)."""
    item = decoded.item
    if image is None:
        data = item.tensors[JPEG_KEY].numpy().tobytes()
        try:
            media = decode(data, dataclasses.replace(options, defer_jpeg=False))
        except MediaError as err:
            return dataclasses.replace(decoded, modality=_error_modality(options), item=None, error=str(err))
        return dataclasses.replace(_preprocessed(decoded.row, decoded.id, media, preprocess), seconds=decoded.seconds, extra=decoded.extra)
    try:
        return dataclasses.replace(decoded, item=preprocess.on_device(item, image))
    except Exception as exc:
        return dataclasses.replace(decoded, item=None, error=f"preprocess_failed: {type(exc).__name__}: {exc}")


def decode_options(job: Job, adapter: EncoderAdapter, defer_jpeg: bool = False) -> DecodeOptions:
    """What the decode workers need from the job and the model's preprocessing;
    `defer_jpeg` leaves plain JPEGs for the rank's GPU (`preprocess.decoder`)."""
    preprocess = adapter.preprocessor()
    if job.video.max_frames < preprocess.frame_multiple:
        raise JobError(
            f"video.max_frames = {job.video.max_frames} is below the model's temporal patch size "
            f"{preprocess.frame_multiple}; set video.max_frames to at least {preprocess.frame_multiple}"
        )
    frame_pixels = getattr(preprocess, "video_max_pixels", None)
    return DecodeOptions(
        modality=job.input.modality,
        max_image_pixels=job.preprocess.max_image_pixels,
        fps=job.video.fps,
        max_frames=job.video.max_frames,
        frame_multiple=preprocess.frame_multiple,
        max_frame_pixels=4 * frame_pixels if frame_pixels else None,
        frame_pixel_limit=job.video.max_pixels_per_frame,
        video_pixel_limit=job.video.max_total_pixels,
        media_root=reader.local_media_root(job.input),
        max_item_bytes=job.input.max_item_bytes,
        defer_jpeg=defer_jpeg,
    )
