"""Bytes to pixels: sniffing, reading, image and video decoding (see ARCHITECTURE.md, "decode").

`decode` is the entry (dispatch.py); `read_source` reads a row's path or URI (source.py).
"""

from embedjob.decode.dispatch import decode
from embedjob.decode.source import read_source
from embedjob.decode.types import DecodedImage, DecodedVideo, DecodeOptions, DeferredImage, DeferredVideo, MediaError
from embedjob.decode.video import sample_frame_indices, worker_preload

__all__ = [
    "DecodeOptions",
    "DecodedImage",
    "DecodedVideo",
    "DeferredImage",
    "DeferredVideo",
    "MediaError",
    "decode",
    "read_source",
    "sample_frame_indices",
    "worker_preload",
]
