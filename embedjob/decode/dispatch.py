"""`decode(data, options)`: the one entry to the decoders, and its contract with the pipeline.

- It returns a `DecodedImage` or a `DecodedVideo` (or, with `options.defer_jpeg`, a
  `DeferredImage` for a plain JPEG the device decodes, and with `options.defer_video` a
  `DeferredVideo` whose sampled frames the GPU decodes), or raises `MediaError`; no other
  exception escapes it. A `MediaError` becomes one error row ("code: message"), so a bad
  item never stops the job.
- The bytes decide the decoder (`sniff.sniff_format`); `options.modality` only refuses
  the other kind. Images: `image.py`; videos: `video.py`.
- Returned arrays are writable (torch warns on every `from_numpy` of a read-only one).
- Error messages never quote the item's bytes (a path row may name any file).

Error codes: empty, unknown_format, unsupported_format, not_an_image, not_a_video,
truncated, corrupt, too_large, not_found, unreadable, no_video_stream,
unsupported_codec, no_frames, decode_timeout, decoder_crashed, internal_error,
path_escape (decode_timeout and decoder_crashed come from the worker pool, not_found,
unreadable and path_escape from `source.read_source`). See ARCHITECTURE.md, "decode".
"""

from __future__ import annotations

import logging

from embedjob.decode.image import decode_image
from embedjob.decode.sniff import sniff_format
from embedjob.decode.types import DecodedImage, DecodedVideo, DecodeOptions, DeferredImage, DeferredVideo, MediaError
from embedjob.decode.video import decode_video

logger = logging.getLogger(__name__)


def decode(data: bytes, options: DecodeOptions) -> DecodedImage | DecodedVideo | DeferredImage | DeferredVideo:
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


def _decode(data: bytes, options: DecodeOptions) -> DecodedImage | DecodedVideo | DeferredImage | DeferredVideo:
    if not data:
        raise MediaError("empty", "0 bytes")
    found = sniff_format(data)
    kind = found[0] if found else None
    fmt = found[1] if found else None
    if options.modality == "image":
        if kind == "video":
            raise MediaError("not_an_image", f"the bytes are a {fmt} video but the modality is image")
        return decode_image(data, options, fmt)
    if options.modality == "video":
        if kind == "image":
            raise MediaError("not_a_video", f"the bytes are a {fmt} image but the modality is video")
        return decode_video(data, options, fmt)
    if kind is None:
        raise MediaError("unknown_format", f"neither a known image nor video format ({len(data)} bytes)")
    if kind == "image":
        return decode_image(data, options, fmt)
    return decode_video(data, options, fmt)
