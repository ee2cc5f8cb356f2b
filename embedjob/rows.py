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
import logging
import multiprocessing
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedjob.config import InputConfig, Job, JobError
from embedjob.decode import (
    DecodedVideo,
    DecodeOptions,
    DeferredImage,
    DeferredVideo,
    MediaError,
    decode,
    read_source,
    worker_preload,
)
from embedjob.decode.device import decode_jpegs, pixel_groups
from embedjob.decode.gop import PacketFeed
from embedjob.decode.image import deferred_jpeg
from embedjob.decode.nvdec import decode_videos, refusal
from embedjob.encoders import EncoderAdapter, EncoderInput
from embedjob.encoders.base import JPEG_KEY, JPEG_SIZE_KEY, VIDEO_KEY
from embedjob.encoders.registry import ADAPTER_MODULES
from embedjob.io import reader
from embedjob.io.digest import NO_MEDIA, UNREAD, digest_array, media_digest

logger = logging.getLogger(__name__)

WORKER_MODULES = worker_preload([__name__, *ADAPTER_MODULES])
"""What decode workers import: the decoders, this module (`decode_row`) and every family's
preprocessing, in the order `worker_preload` gives them."""


@dataclass
class Decoded:
    """A row after the decode stage: a preprocessed item or an error, never both, the
    seconds the worker spent on it, the row's copied input columns (`extra`) and the
    digest of the media bytes it was made from (`io/digest.py`; UNREAD where no worker
    finished the row). `text` is its caption's item (`input.text_column`), whatever
    became of its media; None without a caption."""

    row: int
    id: Any
    modality: str | None
    item: EncoderInput | None
    error: str | None
    seconds: float = 0.0
    extra: tuple[Any, ...] = ()
    digest: bytes = UNREAD
    text: EncoderInput | None = None


@dataclass(frozen=True)
class Captions:
    """How a worker makes a row's caption item: the caption is `InputRow.extra[index]`
    (read after the copied `output.columns`, `input_columns`), and `tokenize` is the text
    tower's picklable preprocessing (`encoders.text.TextPreprocessor`)."""

    index: int
    tokenize: Any

    def item(self, row: reader.InputRow) -> EncoderInput | None:
        """The row's caption item; None for a null caption, a row whose columns could not
        be read, or a caption its tokenizer refuses (said in the log): the row keeps its
        image embedding, and its text_embedding and score are null."""
        caption = row.extra[self.index] if len(row.extra) > self.index else None
        if not isinstance(caption, str):
            return None
        try:
            return self.tokenize(caption)
        except Exception as exc:  # one caption's failure is that row's null text, never the job's
            logger.warning("row %d: its caption could not be tokenised (%s: %s); its text_embedding is null", row.row, type(exc).__name__, exc)
            return None


def input_columns(job: Job) -> list[str]:
    """The input columns read beside the media and the id, in `InputRow.extra`: those
    copied to the output (`output.columns`), then the caption column where it is not one
    of them, so a copied column's place in `extra` is its place in `output.columns`."""
    text = job.input.text_column
    return [*job.output.columns, *([text] if text is not None and text not in job.output.columns else [])]


def caption_index(job: Job) -> int | None:
    """Where a row's caption is in `InputRow.extra` (None: the job has no text_column)."""
    text = job.input.text_column
    return None if text is None else input_columns(job).index(text)


@functools.cache
def _set_up_worker() -> None:
    """Decode workers run one per core; torch's default of one thread per core inside each
    of them would oversubscribe the machine many times over. A worker's stderr is the
    job's: the libraries' warnings (torch, Pillow, decord) are not for the user there,
    and embedjob itself reports through logging and error rows, never warnings."""
    if multiprocessing.parent_process() is not None:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")


def decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any, captions: Captions | None = None) -> Decoded:
    """Worker function: bytes (or a path) -> decoded media -> EncoderInput, or an error
    row; with `captions`, the row's caption item beside it, whatever became of the media."""
    _set_up_worker()
    start = time.perf_counter()
    decoded = _decode_row(row, options, preprocess)
    if captions is not None:
        decoded.text = captions.item(row)
    decoded.seconds = time.perf_counter() - start
    decoded.extra = row.extra
    return decoded


def decode_task(
    task: tuple[reader.InputRow, bool], options: DecodeOptions, left: DecodeOptions, preprocess: Any,
    captions: Captions | None = None,
) -> Decoded:
    """`decode_row` of a (row, defer) task: with `preprocess.decoder: auto` or
    `video.decoder: auto` the rank decides as it goes whether the media of the rows it
    submits are left for its GPU (a video's as a worker is sent it, a JPEG's as the pool
    takes it); those decode with `left`, `options` with `defer_jpeg` or `defer_video` set
    (made once by the rank, not per row)."""
    row, defer = task
    return decode_row(row, left if defer else options, preprocess, captions)


def jpeg_on_rank(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded | None:
    """The `DecodePool`'s local path with `preprocess.decoder: gpu`: the row a worker
    would make of `row` with `defer_jpeg` where that is a plain JPEG's header read
    (`deferred_jpeg`), None for every other row (a worker's). Sent to a worker, such a
    row cost the rank's process 0.13 ms (its bytes out and back, in frames the pool's
    threads pickle and read under the GIL the thread feeding the device needs) for
    0.01 ms of work (measured by a one-off benchmark, now in git history)."""
    start = time.perf_counter()
    if row.error is not None or row.data is None or options.modality == "video":
        return None
    deferred = deferred_jpeg(row.data, options)
    if deferred is None:
        return None
    decoded = _preprocessed(row.row, row.id, deferred, preprocess, media_digest(row.data))
    decoded.seconds = time.perf_counter() - start
    decoded.extra = row.extra
    return decoded


def task_on_rank(task: tuple[reader.InputRow, bool], options: DecodeOptions, preprocess: Any) -> Decoded | None:
    """`jpeg_on_rank` of a `decode_task` task: only rows whose JPEGs are left for the GPU."""
    row, defer = task
    return jpeg_on_rank(row, options, preprocess) if defer else None


def _error_modality(options: DecodeOptions) -> str | None:
    """The modality of a row that did not decode: the job's, unless it takes either."""
    return None if options.modality == "auto" else options.modality


def _decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded:
    fixed = _error_modality(options)
    if row.error is not None:
        return Decoded(row.row, row.id, fixed, None, row.error, digest=NO_MEDIA)
    try:
        data = _media_bytes(row, options.media_root, options.max_item_bytes, options.storage_options)
    except MediaError as err:
        return Decoded(row.row, row.id, fixed, None, str(err), digest=NO_MEDIA)
    digest = media_digest(data)
    try:
        decoded = decode(data, options)
    except MediaError as err:
        return Decoded(row.row, row.id, fixed, None, str(err), digest=digest)
    return _preprocessed(row.row, row.id, decoded, preprocess, digest)


def _media_bytes(
    row: reader.InputRow, media_root: str | None, max_item_bytes: int | None, storage_options: dict[str, Any]
) -> bytes:
    """The media bytes of a row the reader gave media: its cell's, or the file its path
    names (a URI opened with `input.storage_options`, as the input files are)."""
    if row.data is not None:
        return row.data
    return read_source(row.uri or "", media_root, max_item_bytes, storage_options)


def input_digests(cfg: InputConfig, fragments: list[reader.Fragment], first_row: int, end_row: int) -> np.ndarray:
    """The media digests (`digest.digest_array`) of global rows [first_row, end_row) as
    the input holds them now, made as `decode_row` makes them: the resume check
    (`checkpoint.open_checkpoint`) compares them with those committed. Runs on the rank,
    one row at a time, reading the media bytes again (a path's file included) without
    decoding them."""
    root = reader.local_media_root(cfg)
    digests = []
    for row in reader.read_rows(cfg, fragments, first_row, end_row):
        try:
            digests.append(NO_MEDIA if row.error is not None else media_digest(_media_bytes(row, root, cfg.max_item_bytes, cfg.storage_options)))
        except MediaError:
            digests.append(NO_MEDIA)
    return digest_array(digests)


def _preprocessed(row: int, id: Any, decoded: Any, preprocess: Any, digest: bytes) -> Decoded:
    """The row of decoded media (whose bytes have `digest`): its item, or a
    preprocess_failed error row."""
    modality = "video" if isinstance(decoded, (DecodedVideo, DeferredVideo)) else "image"
    try:
        if isinstance(decoded, DeferredImage):
            data = torch.frombuffer(bytearray(decoded.data), dtype=torch.uint8)
            item = preprocess.deferred(data, decoded.height, decoded.width)
        elif isinstance(decoded, DeferredVideo):
            # Only carries the plan: the rank makes the item once its GPU has the frames
            # (`_video_finished`), and plans there what the workers could not.
            item = EncoderInput(_video_plan(decoded), tokens=0, frames=0, size=0, modality="video")
        else:
            item = preprocess(decoded)
    except Exception as exc:  # a preprocessing failure is one bad row, not a failed job
        return Decoded(row, id, modality, None, _preprocess_failed(exc), digest=digest)
    return Decoded(row, id, modality, item, None, digest=digest)


def _preprocess_failed(exc: Exception) -> str:
    return f"preprocess_failed: {type(exc).__name__}: {exc}"


_VIDEO_INDICES_KEY = "video_indices"
_VIDEO_PLAN_KEY = "video_plan"
_FEED_KEY, _FEED_BOUNDS_KEY, _FEED_SHOWN_KEY = "video_feed", "video_feed_bounds", "video_feed_shown"
_FEED_CODECS = ("h264", "hevc")
"""A `PacketFeed`'s codec as its index here in `_VIDEO_PLAN_KEY` (-1: no feed)."""


def _video_plan(video: DeferredVideo) -> dict[str, torch.Tensor]:
    """The item tensors that carry a deferred video to the rank: its bytes, the frames
    to read, (decoded width, height, display matrix, shown height, width, the stream's
    frames, the feed's codec and size) and the pictures the worker cut out for the GPU's
    decoder (`DeferredVideo.feed`), each as it is. The stream's frame count is what the
    rank's packet feed checks its demuxer's packets against: without it, every clip went
    through a decoder session that decodes each picture from the keyframe. The sample
    timestamps and frame rate stay behind: the rank makes nothing of them."""
    (a, b), (c, d) = video.matrix
    feed = video.feed
    codec, size = (_FEED_CODECS.index(feed.codec), feed.size) if feed is not None else (-1, (0, 0))
    plan = [*video.decoded, a, b, c, d, *video.shown, video.source_frames, codec, *size]
    tensors = {
        VIDEO_KEY: torch.frombuffer(bytearray(video.data), dtype=torch.uint8),
        _VIDEO_INDICES_KEY: torch.tensor(video.indices, dtype=torch.int64),
        _VIDEO_PLAN_KEY: torch.tensor(plan, dtype=torch.int64),
    }
    if feed is not None:
        tensors[_FEED_KEY] = torch.frombuffer(bytearray(feed.stream), dtype=torch.uint8)
        tensors[_FEED_BOUNDS_KEY] = torch.tensor(feed.bounds, dtype=torch.int64).reshape(-1, 2)
        tensors[_FEED_SHOWN_KEY] = torch.tensor(feed.shown, dtype=torch.int64)
    return tensors


def _planned(item: EncoderInput) -> DeferredVideo:
    """`_video_plan` read back (what `nvdec.decode_videos` needs of it)."""
    width, height, a, b, c, d, shown_h, shown_w, frames, codec, feed_w, feed_h = item.tensors[_VIDEO_PLAN_KEY].tolist()
    data = item.tensors[VIDEO_KEY].numpy().tobytes()
    feed = None
    if codec >= 0:
        bounds = tuple((offset, size) for offset, size in item.tensors[_FEED_BOUNDS_KEY].tolist())
        feed = PacketFeed(_FEED_CODECS[codec], (feed_w, feed_h), item.tensors[_FEED_KEY].numpy().tobytes(), bounds,
                          tuple(item.tensors[_FEED_SHOWN_KEY].tolist()))
    indices = item.tensors[_VIDEO_INDICES_KEY].tolist()
    return DeferredVideo(data, indices, (width, height), ((a, b), (c, d)), (shown_h, shown_w), [], 0.0, frames, feed)


def left_for_device(decoded: Decoded) -> bool:
    """Whether the workers left this row's media undecoded for the GPU (a JPEG's bytes,
    a planned video): `decode_on_device` completes it."""
    return decoded.item is not None and (JPEG_KEY in decoded.item.tensors or VIDEO_KEY in decoded.item.tensors)


@dataclass
class JpegsAhead:
    """A window's deferred JPEGs split for nvjpeg (`groups`: rows, `pixel_groups` of
    their sizes), with the first group's pictures already decoded (`first`, on the
    device; empty when the window left no JPEG for the device)."""

    groups: list[list[int]]
    first: list[torch.Tensor | None]

    def take_first(self) -> list[torch.Tensor | None]:
        """The first group's pictures, which this then lets go of: once resized they
        are freed, whoever still holds this (the nvjpeg thread's future does)."""
        first, self.first = self.first, []
        return first


def decode_ahead(window: list[Decoded], device: torch.device) -> JpegsAhead:
    """The first nvjpeg call of `decode_on_device` for `window`, which a thread of its
    own can make while another finishes the window before: most of that call is a wait
    with the GIL released, for a device busy with the encoder, that the finishing work
    (resizes, Python) can fill. Only the first group is decoded ahead, so at most two
    groups of full-size pictures exist at a time (this one and the one being finished)."""
    waiting = [k for k, d in enumerate(window) if left_for_device(d) and JPEG_KEY in d.item.tensors]
    sizes = torch.stack([window[k].item.tensors[JPEG_SIZE_KEY] for k in waiting]).prod(1).tolist() if waiting else []
    groups = [[waiting[g] for g in group] for group in pixel_groups(sizes)]
    return JpegsAhead(groups, _decoded_group(window, groups[0], device) if groups else [])


def _decoded_group(window: list[Decoded], rows: list[int], device: torch.device) -> list[torch.Tensor | None]:
    return decode_jpegs([window[k].item.tensors[JPEG_KEY] for k in rows], device)


def decode_on_device(
    window: list[Decoded], options: DecodeOptions, preprocess: Any, device: torch.device, ahead: JpegsAhead | None = None
) -> int:
    """Decode, on `device`, the media the workers left undecoded in `window`, in place:
    each such row gets its item with pixels on the device, or, where the GPU's decoder
    refuses the file, what the CPU path makes of it (its item or its error row, as a
    worker would have). Returns how many rows the device decoded.

    Runs on the rank's GPU-decode threads (`RankPipeline._decoded_on_device`), a window
    at a time: JPEGs with a constant number of nvjpeg calls per window (`pixel_groups`
    bounds the full-size pictures held at once), the first of them made ahead when
    `ahead` is given (`decode_ahead` of this window), then the family's resize and
    patching on the device for the pictures of one size together (`finish_pictures`);
    videos several at a time (`nvdec.decode_videos`)."""
    ahead = ahead if ahead is not None else decode_ahead(window, device)
    done = 0
    for n, rows in enumerate(ahead.groups):
        # The pictures are bound to no name here, so a group's are freed before the next is decoded.
        done += finish_pictures(window, rows, ahead.take_first() if n == 0 else _decoded_group(window, rows, device), options, preprocess)
    videos = [k for k, d in enumerate(window) if left_for_device(d) and VIDEO_KEY in d.item.tensors]
    for k, decoded in zip(videos, decode_videos([_planned(window[k].item) for k in videos], device, options)):
        window[k], on_device = _video_finished(window[k], decoded, options, preprocess)
        done += on_device
    return done


def finish_pictures(
    window: list[Decoded], rows: list[int], images: list[torch.Tensor | None], options: DecodeOptions, preprocess: Any
) -> int:
    """Replace the deferred rows `rows` of `window` by their items made from `images`
    (their decoded pictures, None where nvjpeg refused one: the CPU path's row), and
    return how many the device decoded. Pictures of one size are resized and patched in
    one call (`Preprocessor.on_device`): one call per picture made a dozen small torch
    calls each, which cost this thread 0.124 ms a 224 px picture against 0.014 ms a
    picture in groups (an H200, isolated; in the job each call also waits for the GIL)."""
    by_size: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
    for k, image in zip(rows, images, strict=True):
        if image is None:
            window[k] = _on_cpu(window[k], window[k].item.tensors[JPEG_KEY].numpy().tobytes(), options, preprocess)
        else:
            by_size.setdefault(tuple(image.shape), []).append((k, image))
    for same in by_size.values():
        _finish_same_size(window, same, preprocess)
    return sum(map(len, by_size.values()))


def _finish_same_size(window: list[Decoded], same: list[tuple[int, torch.Tensor]], preprocess: Any) -> None:
    """The rows of `same` (row, picture; pictures of one size) finished together, or,
    if that fails, one at a time, so a failure is the error row of its own row alone."""
    try:
        items = preprocess.on_device([window[k].item for k, _ in same], torch.stack([image for _, image in same]))
    except Exception:
        for k, image in same:
            window[k] = _finished_alone(window[k], image, preprocess)
        return
    for (k, _), item in zip(same, items, strict=True):
        window[k] = dataclasses.replace(window[k], item=item)


def _finished_alone(decoded: Decoded, image: torch.Tensor, preprocess: Any) -> Decoded:
    try:
        return dataclasses.replace(decoded, item=preprocess.on_device([decoded.item], image.unsqueeze(0))[0])
    except Exception as exc:
        return dataclasses.replace(decoded, item=None, error=_preprocess_failed(exc))


def _video_finished(
    decoded: Decoded, result: tuple[torch.Tensor, DeferredVideo] | Exception, options: DecodeOptions, preprocess: Any
) -> tuple[Decoded, bool]:
    """A deferred video's row from what the GPU's video decoder made of it (`result`:
    its frames and plan), or where that failed, the row the CPU path makes of it (a
    `MediaError` from planning on the rank is the row's error, as in a worker); and
    whether the GPU decoded it. The item is made here, from the plan."""
    item = decoded.item
    if isinstance(result, MediaError):
        return dataclasses.replace(decoded, modality=_error_modality(options), item=None, error=str(result)), False
    if isinstance(result, Exception):  # any refusal of the GPU's decoder: the CPU path decides
        logger.debug("the GPU's video decoder failed on row %d (%s: %s); decoding it on the CPU", decoded.row, type(result).__name__, result)
        row = _on_cpu(decoded, item.tensors[VIDEO_KEY].numpy().tobytes(), options, preprocess)
        if row.error is not None and not item.tensors[_VIDEO_INDICES_KEY].numel():
            # A video only the GPU could have read (decord lacks its codec): say both refused it.
            row = dataclasses.replace(row, error=f"{row.error}; the GPU's video decoder refused it too: {refusal(result)}")
        return row, False
    frames, plan = result
    try:
        planned = preprocess.deferred_video(len(plan.indices), *plan.shown)
        return dataclasses.replace(decoded, item=preprocess.on_device_video(planned, frames)), True
    except Exception as exc:
        return dataclasses.replace(decoded, item=None, error=_preprocess_failed(exc)), True


def _on_cpu(decoded: Decoded, data: bytes, options: DecodeOptions, preprocess: Any) -> Decoded:
    """The row a worker makes of `data` on the CPU (its item or its error row)."""
    try:
        media = decode(data, dataclasses.replace(options, defer_jpeg=False, defer_video=False))
    except MediaError as err:
        return dataclasses.replace(decoded, modality=_error_modality(options), item=None, error=str(err))
    made = _preprocessed(decoded.row, decoded.id, media, preprocess, decoded.digest)
    return dataclasses.replace(made, seconds=decoded.seconds, extra=decoded.extra, text=decoded.text)


def decode_options(job: Job, adapter: EncoderAdapter) -> DecodeOptions:
    """What the decode workers need from the job and the model's preprocessing (videos
    are left for the rank's GPU with `video.decoder: nvdec`; the rank decides about
    JPEGs, `preprocess.decoder`)."""
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
        storage_options=job.input.storage_options,
        defer_video=job.video.decoder == "nvdec",
        nvdec_sessions=job.video.nvdec_sessions,
    )
