"""JPEG decode on the GPU (`preprocess.decoder: gpu`): compressed bytes in, pixels on the device.

The decode workers leave plain JPEGs undecoded (`image.deferred_jpeg`); the rank decodes
them here in batches with nvjpeg (torchvision's `decode_jpeg` on a CUDA device), so the
decoded pixels never exist in host memory. nvjpeg and libjpeg-turbo round the inverse
DCT and the chroma upsampling differently: the pixels differ by a few levels, not in
what they show. Any JPEG nvjpeg refuses gets None here and the caller's CPU path.

Decoded images are full size until the caller resizes them, so a batch is cut into
groups of at most `GROUP_PIXELS` (`pixel_groups`): whatever the window holds, at most
two groups of full-size pictures are on the device at a time (the rank's nvjpeg thread
decodes a window's first group while its decode thread finishes a group of the window
before, `rows.decode_ahead`).

nvjpeg writes the pictures on a stream of torchvision's own, which waits for nothing the
caller queued: memory the caller's stream freed while still reading it (the last group's
pictures, a resize's scratch) would be handed to the new pictures and overwritten under
the reading kernels. So the pictures are allocated from a stream that nothing else
allocates on (`_picture_stream`), and each is recorded as used by the caller's stream,
so that its memory is given out again only once the caller's stream has read it.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from embedjob.decode.types import last_line

logger = logging.getLogger(__name__)

GROUP_PIXELS = 64 * 2**20
"""Decoded pixels of one nvjpeg call: 192 MiB of RGB, a few milliseconds of decode."""


def pixel_groups(pixels: list[int], limit: int = GROUP_PIXELS) -> list[range]:
    """Consecutive runs of `pixels` (indices) each holding at most `limit` pixels, or
    one item where that item alone is larger; together they cover every index in order."""
    groups: list[range] = []
    start, held = 0, 0
    for index, count in enumerate(pixels):
        if index > start and held + count > limit:
            groups.append(range(start, index))
            start, held = index, 0
        held += count
    if start < len(pixels):
        groups.append(range(start, len(pixels)))
    return groups


def decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """(3, H, W) uint8 RGB on `device` for each JPEG (1-d uint8 CPU tensors of its
    bytes), in one nvjpeg call, ready for the caller's current stream; None for each one
    nvjpeg refuses. nvjpeg gives no partial result when one of a batch fails, so then
    each is decoded on its own."""
    if device.type != "cuda":
        return _decoded(data, device)
    caller = torch.cuda.current_stream(device)
    pictures = _picture_stream(device)
    with torch.cuda.stream(pictures):
        images = _decoded(data, device)
    caller.wait_stream(pictures)
    for image in images:
        if image is not None:
            image.record_stream(caller)
    return images


@functools.cache
def _picture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the decoded pictures of `device` are allocated on (see the module docstring)."""
    return torch.cuda.Stream(device)


def _decoded(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        # torchvision's decoders are deprecated in favour of another package; they work.
        warnings.simplefilter("ignore")
        try:
            return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if len(data) == 1:
                logger.debug("nvjpeg refused a JPEG (%s); decoding it on the CPU", last_line(exc))
                return [None]
        return [image for one in data for image in _decoded([one], device)]


def nvjpeg_problem(device: torch.device) -> str | None:
    """Why JPEGs cannot be decoded on `device` (a CPU device, or a torchvision built
    without nvjpeg), or None when a small JPEG decodes there."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    from torchvision.io import encode_jpeg

    probe = encode_jpeg(torch.zeros(3, 16, 16, dtype=torch.uint8))
    try:
        decoded = decode_jpegs([probe], device)[0]
    except Exception as exc:  # the op missing from the build raises NotImplementedError or RuntimeError
        return f"torchvision cannot decode JPEGs on {device} ({type(exc).__name__}: {last_line(exc)})"
    return None if decoded is not None else f"nvjpeg on {device} refused a plain JPEG"
