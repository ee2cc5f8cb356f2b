"""Video frames decoded by the GPU's video decoder (`video.decoder: nvdec`), through
PyNvVideoCodec (the optional extra `embedjob[nvdec]`).

The decode workers plan a video as the CPU path does (`video.decode_video` with
`defer_video`: which frames, at which size, under which display matrix) and leave the
frames undecoded (`DeferredVideo`); the rank reads exactly those frames here, from the
bytes in memory, as RGB on its GPU, and applies the rest of the CPU path's steps there
(`frames_as_decoded`). A failure raises, and the caller takes the CPU path for that video.
"""

from __future__ import annotations

import torch
import torchvision.transforms.v2.functional as tvF

from embedjob.decode.types import DeferredVideo
from embedjob.decode.video import decoder_bytes

PACKAGE = "PyNvVideoCodec"


def nvdec_problem(device: torch.device) -> str | None:
    """Why frames cannot be decoded by `device`'s video decoder, or None."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    try:
        import PyNvVideoCodec  # noqa: F401
    except ImportError as exc:
        return f"{PACKAGE} is not installed ({exc}): pip install 'embedjob[nvdec]'"
    return None


def decode_frames(video: DeferredVideo, device: torch.device) -> torch.Tensor:
    """`video`'s sampled frames as (T, 3, H, W) uint8 RGB on `device`, in sample order,
    as the CPU path shows them (see `frames_as_decoded`)."""
    import PyNvVideoCodec as nvc

    decoder = nvc.SimpleDecoder(
        bytes(decoder_bytes(video.data)),
        gpu_id=device.index or 0,
        use_device_memory=True,
        output_color_type=nvc.OutputColorType.RGB,
    )
    unique = sorted(set(video.indices))
    frames = [_chw(torch.from_dlpack(frame), device) for frame in decoder.get_batch_frames_by_index(unique)]
    if len(frames) != len(unique):
        raise RuntimeError(f"the video decoder returned {len(frames)} of {len(unique)} frames")
    position = {index: k for k, index in enumerate(unique)}
    stack = torch.stack(frames)[[position[i] for i in video.indices]]
    return frames_as_decoded(stack, video)


def _chw(frame: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One decoded frame as (3, H, W) uint8 on `device`, copied out of the decoder's
    surface (which it reuses); the decoder hands interleaved RGB (H, W, 3)."""
    if frame.dim() != 3 or frame.shape[-1] != 3 or frame.dtype != torch.uint8:
        raise RuntimeError(f"the video decoder returned a frame of shape {tuple(frame.shape)} and type {frame.dtype}")
    return frame.to(device).permute(2, 0, 1).contiguous()


def frames_as_decoded(frames: torch.Tensor, video: DeferredVideo) -> torch.Tensor:
    """(T, 3, H, W) frames at their coded size -> what the CPU path makes of them: scaled
    to `video.decoded` (its decode-time bound on frame pixels), then shown under the
    display matrix (mirrored and/or turned, as `video._apply_matrix`)."""
    width, height = video.decoded
    if tuple(frames.shape[-2:]) != (height, width):
        frames = tvF.resize(frames, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    (a, b), (c, d) = video.matrix
    if a != 0:
        if a < 0:
            frames = frames.flip(-1)
        if d < 0:
            frames = frames.flip(-2)
        return frames
    frames = frames.transpose(-1, -2)
    if c < 0:
        frames = frames.flip(-1)
    if b < 0:
        frames = frames.flip(-2)
    return frames
