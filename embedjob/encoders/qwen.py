"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 vision towers through transformers.

The towers share native-resolution patching (images are one temporal patch,
videos `frames / temporal_patch_size`), a 2x2 spatial merger (4 consecutive patches
become one output token) and packed attention over `cu_seqlens`. They differ in what
they precompute from the grid: Qwen2.5-VL adds window attention (`window_index`,
`cu_window_seqlens`), Qwen3-VL and Qwen3.5 an interpolated learned position table.
Qwen3.5's tower (`Qwen3_5VisionModel`) is Qwen3-VL's without the deepstack mergers:
the same patch embedding, position table, axial rotary positions, blocks (layer norms,
fused qkv, a tanh-GELU MLP of `linear_fc1`/`linear_fc2`) and final merger; its MoE
variant (`qwen3_5_moe`) has the very same tower (`Qwen3_5MoeVisionModel` subclasses it
unchanged, with the same config fields), so both are the `qwen3_5` family. transformers
(>= 5.17) accepts every such value as a keyword argument, so the data-dependent work
is done on the CPU, per item, in the decode workers, and the device forward has no host
synchronisation — which is what makes it capturable.

Padding to a budget (ARCHITECTURE.md, "Invariants across stages"): real patches come first,
pad patches follow as their own attention segments of at most PAD_SEGMENT patches,
cumulative offsets are padded by repeating the last one, pad merge units map to
themselves in the window permutation, and the length bounds are constants per budget.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as tvF

from embedjob.encoders.attention import VARLEN, all_pad_offsets, pad_offsets, segment_offsets
from embedjob.encoders.attention import register as register_attention
from embedjob.encoders.base import (
    JPEG_KEY,
    JPEG_SIZE_KEY,
    PAD_REPEAT_LAST,
    EncoderInput,
    PackedAdapter,
    Placement,
    StaticInputs,
    pad_mlps,
)
from embedjob.encoders.loading import AdapterOptions, builtin_model, download_snapshot, resolve_checkpoint

logger = logging.getLogger(__name__)

PAD_SEGMENT = 64
FULL_PAD_SEGMENT = 1024
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


PER_FRAME = "Qwen2VLVideoProcessor"
PER_CLIP = "Qwen3VLVideoProcessor"
"""The video processors of the towers' checkpoints: Qwen2VLVideoProcessor bounds each
frame's pixels by its `size`, Qwen3VLVideoProcessor a clip's sampled frames together."""


@dataclass(frozen=True)
class QwenFamily:
    """What differs between the Qwen-VL generations. `vision_model_types` and
    `full_model_types` are the config.json `model_type`s of its vision-only and full
    checkpoints (the same tower class reads them all); `video_processor` is the video
    processor transformers picks for a checkpoint that names none."""

    name: str
    vision_model_types: tuple[str, ...]
    full_model_types: tuple[str, ...]
    class_name: str
    patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    windowed: bool
    interpolated_positions: bool
    video_processor: str = PER_FRAME


HALF_GRAY = (0.5, 0.5, 0.5)
FAMILIES = {
    "qwen2_vl": QwenFamily(
        "qwen2_vl", ("qwen2_vl_vision",), ("qwen2_vl",), "Qwen2VisionTransformerPretrainedModel", 14, CLIP_MEAN, CLIP_STD, False, False
    ),
    "qwen2_5_vl": QwenFamily(
        "qwen2_5_vl",
        ("qwen2_5_vl_vision",),
        ("qwen2_5_vl",),
        "Qwen2_5_VisionTransformerPretrainedModel",
        14,
        CLIP_MEAN,
        CLIP_STD,
        True,
        False,
    ),
    "qwen3_vl": QwenFamily(
        "qwen3_vl", ("qwen3_vl_vision",), ("qwen3_vl",), "Qwen3VLVisionModel", 16, HALF_GRAY, HALF_GRAY, False, True, PER_CLIP
    ),
    "qwen3_5": QwenFamily(
        "qwen3_5",
        ("qwen3_5_vision", "qwen3_5_moe_vision"),
        ("qwen3_5", "qwen3_5_moe"),
        "Qwen3_5VisionModel",
        16,
        HALF_GRAY,
        HALF_GRAY,
        False,
        True,
        PER_CLIP,
    ),
}


GRID_CACHE = 64
"""Grids whose metadata a worker keeps (`QwenPreprocessor.item_metadata`): a 1344 px
image's is about 200 KB, so at most ~13 MB a worker."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size: both sides multiples of `factor`, area within [min, max], aspect kept.

    Raises ValueError for aspect ratios above 200, which the model family rejects too.
    """
    return _fit(height, width, factor, min_pixels, max_pixels, 1, 1)


def clip_resize(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3VLVideoProcessor's target frame size for a clip of `frames` frames: the
    bounds hold for the frames together (their count rounded to a multiple of
    `temporal`, times the frame's area), and a frame with a side below `factor` is first
    scaled up (truncated) until both sides reach it."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    return _fit(height, width, factor, min_pixels, max_pixels, frames, round(frames / temporal) * temporal)


def _fit(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int, counted: int) -> tuple[int, int]:
    """Both sides multiples of `factor`, `counted` frames of that size within [min, max]
    (rescaled by the area of `frames` frames of the original size), aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if counted * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif counted * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenPreprocessor:
    """Decoded media -> patches and per-item attention metadata; runs in decode workers.

    Matches transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor: bicubic
    antialiased resize of uint8 pixels to `smart_resize`, the patch order (merge blocks,
    channel, time, row, column), then fused rescale+normalise in float32. The workers
    stop before the normalisation: items carry the resized uint8 patches (an image's
    rows once, not once per temporal copy), a quarter of the float32 bytes through the
    pipes, the host copies and PCIe; `normalize` runs on the device (the adapter's
    forward), with the same float32 operations, so the values are bitwise those of
    transformers' processor.

    An item's `pixel_values` are (patches, 3, copies, values) uint8: `copies` is 1 for
    an image (its one frame; the model repeats it `temporal_patch_size` times) and
    `temporal_patch_size` for a video, so one broadcasting copy per batch writes both
    kinds into the model's (patches, 3 * temporal_patch_size * values) rows. `grid` is
    the item's (t, h, w) patch grid, as Python ints, for batch assembly.

    `clip_pixels`: the video bounds hold for a clip's sampled frames together, as
    Qwen3VLVideoProcessor sizes them (`clip_resize`; else for each frame, as
    Qwen2VLVideoProcessor does), with `frame_cap` its `cap_pixels_per_frame` bound on a
    frame's pixels (None: off). A clip of fewer frames than `temporal_patch_size`,
    which that processor refuses, is sized as the clip of `temporal_patch_size` frames
    the model sees (its last frame repeated).
    """

    family: str
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    window_size: int | None
    pos_grid_side: int | None
    clip_pixels: bool = False
    frame_cap: int | None = None

    @property
    def frame_multiple(self) -> int:
        return self.temporal_patch_size

    def __call__(self, media: Any) -> EncoderInput:
        frames = getattr(media, "frames", None)
        if frames is None:
            image = torch.from_numpy(media.pixels).permute(2, 0, 1).unsqueeze(0)
            pixels, grid = self.patchify(self.resize(image, self.min_pixels, self.max_pixels), image=True)
            return self._item({"pixel_values": pixels}, grid, "image", 0)
        pixels, grid = self.patchify(self.resize_video(torch.from_numpy(frames).permute(0, 3, 1, 2)), image=False)
        return self._item({"pixel_values": pixels}, grid, "video", int(frames.shape[0]))

    def deferred(self, data: torch.Tensor, height: int, width: int) -> EncoderInput:
        """A JPEG the rank decodes on its GPU: its grid (so its tokens and metadata)
        follows from its header's size alone."""
        resized = self._resized(height, width, self.min_pixels, self.max_pixels)
        grid = (1, resized[0] // self.patch_size, resized[1] // self.patch_size)
        tensors = {JPEG_KEY: data, JPEG_SIZE_KEY: torch.tensor([height, width])}
        return self._item(tensors, grid, "image", 0)

    def on_device(self, items: list[EncoderInput], images: torch.Tensor) -> list[EncoderInput]:
        """`deferred`'s items with their patches made from their decoded (N, 3, H, W)
        uint8 pictures (one size), resized and patched together: patching N pictures as
        the N frames of one image grid puts each picture's patches in a block of its own,
        in order, so each item's are a view of the batch's."""
        pixels, (_, h, w) = self.patchify(self.resize(images, self.min_pixels, self.max_pixels), image=True)
        finished = []
        for item, patches in zip(items, pixels.split(h * w), strict=True):
            if item.grid != (1, h, w):
                raise ValueError(f"the decoded picture gives the grid {(1, h, w)}, its header {item.grid}")
            tensors = {k: v for k, v in item.tensors.items() if k not in (JPEG_KEY, JPEG_SIZE_KEY)}
            finished.append(replace(item, tensors={"pixel_values": patches, **tensors}))
        return finished

    def deferred_video(self, frames: int, height: int, width: int) -> EncoderInput:
        """A video whose `frames` sampled frames (shown at `height` x `width`) the rank's
        GPU decodes: its grid follows from those alone, as `patchify` would make it."""
        resized = self._video_size(frames, height, width)
        grid = (-(-frames // self.temporal_patch_size), resized[0] // self.patch_size, resized[1] // self.patch_size)
        return self._item({}, grid, "video", frames)

    def on_device_video(self, item: EncoderInput, frames: torch.Tensor) -> EncoderInput:
        """`deferred_video`'s item with its patches made from the decoded (T, 3, H, W) uint8 frames."""
        pixels, grid = self.patchify(self.resize_video(frames), image=False)
        if grid != item.grid:
            raise ValueError(f"the decoded frames give the grid {grid}, the plan {item.grid}")
        return replace(item, tensors={"pixel_values": pixels, **item.tensors})

    def _item(self, tensors: dict[str, torch.Tensor], grid: tuple[int, int, int], modality: str, frames: int) -> EncoderInput:
        """The item of `grid` with `tensors` and the grid's metadata."""
        tensors = {**tensors, "grid_thw": torch.tensor(grid, dtype=torch.int64), **self.item_metadata(grid)}
        t, h, w = grid
        tokens = t * h * w // (self.merge_size**2)
        merged = (t, h // self.merge_size, w // self.merge_size)
        return EncoderInput(tensors, tokens=tokens, frames=frames, size=t * h * w, modality=modality, grid=grid, token_grid=merged)

    def resize(self, frames: torch.Tensor, min_pixels: int, max_pixels: int) -> torch.Tensor:
        """(T, 3, H, W) uint8 -> (T, 3, H', W') uint8 at the `smart_resize` size."""
        return _resized_to(frames, self._resized(*frames.shape[-2:], min_pixels, max_pixels))

    def resize_video(self, frames: torch.Tensor) -> torch.Tensor:
        """A clip's (T, 3, H, W) uint8 frames -> (T, 3, H', W') uint8 at its video size (`_video_size`)."""
        return _resized_to(frames, self._video_size(frames.shape[0], *frames.shape[-2:]))

    def _resized(self, height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, min_pixels, max_pixels)

    def _video_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The frame size of a clip of `frames` sampled frames shown at `height` x `width`."""
        if not self.clip_pixels:
            return self._resized(height, width, self.video_min_pixels, self.video_max_pixels)
        factor, frames = self.patch_size * self.merge_size, max(frames, self.temporal_patch_size)
        max_pixels = self.video_max_pixels
        if self.frame_cap is not None:
            per_frame = max(min(self.frame_cap, max_pixels // frames), int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * frames
        return clip_resize(frames, height, width, self.temporal_patch_size, factor, self.video_min_pixels, max_pixels)

    def pixel_scale(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std times 255 (float32, computed on the CPU), shaped to broadcast over
        (rows, channel, values). The adapter keeps them on its device: a captured graph
        cannot copy constants from host memory."""
        mean = torch.tensor(self.mean, dtype=torch.float32) * 255.0
        std = torch.tensor(self.std, dtype=torch.float32) * 255.0
        return mean.view(1, 3, 1).to(device), std.view(1, 3, 1).to(device)

    def normalize(self, pixels: torch.Tensor, scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """uint8 patch rows (rows, 3 * k) -> float32 rows, rescaled and normalised per channel.

        The channel is the outermost index of a patch row in the model's order, so each
        third of a row shares one mean and std. Subtract then divide, in float32: the
        processor's fused rescale+normalise, operation for operation, so CPU and GPU give
        the same bits. `scale` is `pixel_scale(pixels.device)`, made once by the caller.
        """
        mean, std = scale if scale is not None else self.pixel_scale(pixels.device)
        rows, width = pixels.shape
        channels = pixels.view(rows, 3, width // 3).to(torch.float32)
        return ((channels - mean) / std).view(rows, width)

    def model_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """An item's stored pixels as the tower's float32 `hidden_states` (full rows, normalised)."""
        rows, channels, _, values = pixels.shape
        full = pixels.expand(rows, channels, self.temporal_patch_size, values)
        return self.normalize(full.reshape(rows, channels * self.temporal_patch_size * values))

    def patchify(self, frames: torch.Tensor, image: bool) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(T, C, H, W) -> (t*h*w, C, copies, p*p) in the model's patch order, and the grid (t, h, w).

        An image is one frame that the model sees `temporal_patch_size` times: it keeps
        one copy (halving what crosses processes; batch assembly repeats it). A video's
        frame count is padded to a multiple of `temporal_patch_size` with its last
        frame, as transformers does, and each temporal group keeps all its frames.
        """
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        copies = 1 if image else tp
        if pad := -frames.shape[0] % copies:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        num, channels, height, width = frames.shape
        t, h, w = num // copies, height // p, width // p
        blocks = (t, copies, channels, h // m, m, p, w // m, m, p)
        order = (0, 3, 6, 4, 7, 2, 1, 5, 8)
        if frames.device.type != "cpu":  # decoded on the GPU (`on_device`): the pixels stay there
            patches = frames.reshape(blocks).permute(order).contiguous()
            return patches.reshape(t * h * w, channels, copies, p * p), (t, h, w)
        # numpy's strided copy moves these 9-d blocks (rows of 14 bytes) in two thirds
        # of torch's time; the bytes are the same.
        patches = np.ascontiguousarray(frames.numpy().reshape(blocks).transpose(order))
        return torch.from_numpy(patches.reshape(t * h * w, channels, copies, p * p)), (t, h, w)

    def item_metadata(self, grid: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        """Per-item precomputes, offsets starting at 0; batch assembly shifts them (into
        buffers of its own: an item's tensors are read, never written).

        They depend on the grid alone, so items of one grid share them: a worker computes
        a grid's once (`_grid_metadata`), which was a quarter of a 224 px image's
        decode-and-preprocess time."""
        return dict(_grid_metadata(self, grid))


def _resized_to(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(T, 3, H, W) uint8 resized to `size` as the processors resize: bicubic, antialiased."""
    return tvF.resize(frames, list(size), interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)


@functools.lru_cache(maxsize=GRID_CACHE)
def _grid_metadata(processor: QwenPreprocessor, grid: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """`QwenPreprocessor.item_metadata`, computed (transformers' own helpers)."""
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
        get_vision_window_index,
    )

    merge = processor.merge_size
    grid_thw = torch.tensor([grid], dtype=torch.int64)
    out = {"position_ids": get_vision_position_ids(grid_thw, merge)}
    if processor.window_size is not None:
        window_index, cu_window = get_vision_window_index(
            grid_thw, spatial_merge_size=merge, window_size=processor.window_size, patch_size=processor.patch_size
        )
        out["window_index"] = window_index
        out["cu_window_seqlens"] = cu_window
    if processor.pos_grid_side is not None:
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, processor.pos_grid_side, mode="bilinear", align_corners=True, spatial_merge_size=merge
        )
        out["interp_indices"] = indices
        out["interp_weights"] = weights
    return out


class QwenAdapter(PackedAdapter):
    """A Qwen-VL vision tower run on packed batches with precomputed metadata."""

    def __init__(
        self,
        family: QwenFamily,
        model: torch.nn.Module,
        processing: QwenPreprocessor,
        placement: Placement,
        attention: str = VARLEN,
    ) -> None:
        super().__init__(family, processing, placement, model.blocks, attention)
        self.model = model
        config = model.config
        self.embed_dim = int(getattr(config, "out_hidden_size", None) or config.hidden_size)
        self.merge_unit = processing.merge_size**2
        self.patch_dim = 3 * processing.temporal_patch_size * processing.patch_size**2
        self.min_budget = 64
        self.max_budget = 16384
        self.max_frame_patches = max(processing.max_pixels, processing.video_max_pixels) // processing.patch_size**2
        self.pixel_scale = processing.pixel_scale(placement.device)
        if family.windowed:
            self.window_patches = (processing.window_size // processing.patch_size) ** 2

    def preprocessor(self) -> QwenPreprocessor:
        return self.processing

    def limits(self) -> dict[str, Any]:
        p = self.processing
        return dict(min_pixels=p.min_pixels, max_pixels=p.max_pixels, video_min_pixels=p.video_min_pixels, video_max_pixels=p.video_max_pixels)

    def static_inputs(self, budget: int, max_items: int, max_frames: int) -> StaticInputs:
        """Buffers for `budget` output tokens (4 patches each) and a dummy all-pad batch.

        Segment slots are bounded so the attention kernel's grid (slots x blocks of the
        length bound x heads) stays close to the real work: full-attention slots hold
        every image plus the temporal groups of videos up to budget/32, and pad rows in
        segments of FULL_PAD_SEGMENT; window slots hold one window per item (an image
        smaller than a window, a thumbnail, is a window of its own, so `max_items` of them
        fill the smallest budgets) plus budget/8 (large images average 1/16 of a window
        per token) plus pad windows of PAD_SEGMENT. A batch that needs more slots runs
        eagerly (`fits`), so a bound costs speed, never correctness.
        """
        patches = budget * self.merge_unit
        groups = min(max_frames // self.processing.temporal_patch_size, budget // 32)
        full_slots = max_items + groups + math.ceil(patches / FULL_PAD_SEGMENT) + 1
        tensors = {
            "pixel_values": torch.zeros(patches, self.patch_dim, dtype=torch.uint8),
            "position_ids": torch.zeros(patches, 2, dtype=torch.int64),
            "cu_seqlens": torch.from_numpy(all_pad_offsets(patches, full_slots, FULL_PAD_SEGMENT)),
        }
        pad = {"cu_seqlens": PAD_REPEAT_LAST}
        constants = {"max_seqlen": min(patches, self.max_frame_patches), "budget": budget}
        if self.spec.windowed:
            window_slots = max_items + budget // 8 + math.ceil(patches / PAD_SEGMENT) + 1
            tensors["window_index"] = torch.arange(budget, dtype=torch.int64)
            tensors["cu_window_seqlens"] = torch.from_numpy(all_pad_offsets(patches, window_slots, PAD_SEGMENT))
            pad["cu_window_seqlens"] = PAD_REPEAT_LAST
            constants["max_window_seqlen"] = min(patches, self.window_patches)
        if self.spec.interpolated_positions:
            tensors["interp_indices"] = torch.zeros(patches, 4, dtype=torch.int64)
            tensors["interp_weights"] = torch.zeros(patches, 4, dtype=torch.float32)
        tensors = {k: v.to(self.device) for k, v in tensors.items()}
        return StaticInputs(tensors, pad, constants)

    def fits(self, items: list[EncoderInput], static: StaticInputs) -> bool:
        patches = static.tensors["pixel_values"].shape[0]
        real = sum(i.size for i in items)
        full = sum(i.grid[0] for i in items)
        if full + math.ceil((patches - real) / FULL_PAD_SEGMENT) + 1 > static.tensors["cu_seqlens"].shape[0]:
            return False
        if not self.spec.windowed:
            return True
        windows = sum(i.tensors["cu_window_seqlens"].shape[0] - 1 for i in items)
        return windows + math.ceil((patches - real) / PAD_SEGMENT) + 1 <= static.tensors["cu_window_seqlens"].shape[0]

    def batch_values(self, items: list[EncoderInput], static: StaticInputs) -> dict[str, torch.Tensor]:
        """The batch with its offsets padded to the budget's buffers; per-patch rows stay
        at their real length (the manager zeroes the tail)."""
        patches = static.tensors["pixel_values"].shape[0]
        grids = self._grids(items)
        values = self._patch_rows(items, grids)
        offsets = pad_offsets(segment_offsets(self._view_patches(grids)), patches, static.tensors["cu_seqlens"].shape[0], FULL_PAD_SEGMENT)
        values["cu_seqlens"] = self._host(offsets)
        if self.spec.windowed:
            values["window_index"] = self._window_index(items, patches // self.merge_unit)
            length = static.tensors["cu_window_seqlens"].shape[0]
            values["cu_window_seqlens"] = self._host(pad_offsets(_window_offsets(items, grids), patches, length, PAD_SEGMENT))
        return values

    def eager_inputs(self, items: list[EncoderInput]) -> StaticInputs:
        grids = self._grids(items)
        values = self._patch_rows(items, grids)
        offsets = segment_offsets(self._view_patches(grids))
        values["cu_seqlens"] = self._host(offsets)
        constants = {"max_seqlen": _max_gap(offsets)}
        if self.spec.windowed:
            values["window_index"] = self._window_index(items, sum(i.tokens for i in items))
            windows = _window_offsets(items, grids)
            values["cu_window_seqlens"] = self._host(windows)
            constants["max_window_seqlen"] = _max_gap(windows)
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in values.items()}
        return StaticInputs(tensors, {}, constants)

    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        t = inputs.tensors
        kwargs = {k: v for k, v in t.items() if k != "pixel_values"}
        kwargs.update((k, v) for k, v in inputs.constants.items() if k != "budget")
        pixels = self.processing.normalize(t["pixel_values"], self.pixel_scale).to(self.dtype)
        return self.model(hidden_states=pixels, grid_thw=self._grid_placeholder, **kwargs).pooler_output

    @property
    def _grid_placeholder(self) -> torch.Tensor:
        """grid_thw is a required argument but unused once every value is precomputed."""
        cached = getattr(self, "_grid", None)
        if cached is None:
            cached = self._grid = torch.ones(1, 3, dtype=torch.int64, device=self.device)
        return cached

    def _patch_rows(self, items: list[EncoderInput], grids: np.ndarray) -> dict[str, torch.Tensor]:
        """The values with one row per patch, every item's rows in batch order in one new
        host tensor per key. Per-item offsets do not occur in these, so they join as is."""
        rows = grids.prod(axis=1).tolist()
        values = {"pixel_values": self._pixel_rows(items, rows)}
        keys = ["position_ids"] + (["interp_indices", "interp_weights"] if self.spec.interpolated_positions else [])
        for key in keys:
            values[key] = _joined([i.tensors[key] for i in items], sum(rows), self.pin_memory)
        return values

    def _pixel_rows(self, items: list[EncoderInput], rows: list[int]) -> torch.Tensor:
        """(patches, patch_dim) uint8 in the model's layout. One broadcasting copy per
        item, all in one call (`_foreach_copy_`, the list form of `copy_` that torch's
        optimizers use; on the CPU it loops in C++): an image's one temporal copy fills
        every temporal slot of its rows, a video's rows copy as they are, and each byte
        is written once. Patches the GPU decoded are already there: then the batch is
        assembled on the device (a CPU item among them is copied up by its `copy_`)."""
        tp = self.processing.temporal_patch_size
        parts = [i.tensors["pixel_values"] for i in items]
        shape = (sum(rows), 3, tp, self.patch_dim // (3 * tp))
        if any(part.device.type != "cpu" for part in parts):
            out = torch.empty(shape, dtype=torch.uint8, device=self.device)
        else:
            out = torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin_memory)
        torch._foreach_copy_(out.split(rows), parts)
        return out.view(-1, self.patch_dim)

    def _window_index(self, items: list[EncoderInput], length: int) -> torch.Tensor:
        """The batch's merge-unit permutation: each item's, shifted by the units before
        it, then `length - real` pad units that map to themselves."""
        units = np.array([i.tokens for i in items], dtype=np.int64)
        real = int(units.sum())
        out = torch.empty(length, dtype=torch.int64, pin_memory=self.pin_memory)
        joined = torch.cat([i.tensors["window_index"] for i in items], out=out[:real])
        joined.add_(torch.from_numpy(np.repeat(_starts(units), units)))
        if length > real:
            torch.arange(real, length, out=out[real:])
        return out


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of `counts` elements starts."""
    return np.cumsum(counts) - counts


def _window_offsets(items: list[EncoderInput], grids: np.ndarray) -> np.ndarray:
    """Cumulative patch offsets of the attention windows: every item's own offsets
    (each starting at 0) shifted by the patches before the item, the leading 0 kept
    once."""
    parts = [i.tensors["cu_window_seqlens"] for i in items]
    lengths = np.array([part.shape[0] for part in parts], dtype=np.int64)
    shifted = torch.cat(parts).numpy() + np.repeat(_starts(grids.prod(axis=1)), lengths)
    return np.delete(shifted, _starts(lengths)[1:]).astype(np.int32)


def _joined(parts: list[torch.Tensor], rows: int, pin: bool) -> torch.Tensor:
    """Concatenate along rows into one new tensor, page-locked when it feeds a GPU so the
    host-to-device copy is asynchronous (torch keeps the block alive until it is done)."""
    out = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=pin)
    return torch.cat(parts, out=out)


def _max_gap(offsets: np.ndarray) -> int:
    return int(np.diff(offsets).max()) if offsets.shape[0] > 1 else 0


_TINY = dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=256, out_hidden_size=128)
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(depth=4, embed_dim=128, hidden_size=128, num_heads=4, mlp_ratio=2),
    "qwen2_5_vl": {**_TINY, "window_size": 112, "fullatt_block_indexes": [1, 3]},
    "qwen3_vl": {**_TINY, "num_position_embeddings": 64, "deepstack_visual_indexes": [1, 2]},
    "qwen3_5": {**_TINY, "num_position_embeddings": 64},
}
BUILTIN_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 448 * 448, "video_min_pixels": 56 * 56, "video_max_pixels": 224 * 224}
BUILTIN_CLIP_PIXELS = {"video_min_pixels": 64 * 64, "video_max_pixels": 8 * 224 * 224}
"""A builtin whose video processor bounds a clip (`PER_CLIP`): 8 frames of 224 x 224 at most."""
BUILTIN_VERSION = 1


def _transformers_class(spec: QwenFamily) -> type:
    module = importlib.import_module(f"transformers.models.{spec.name}.modeling_{spec.name}")
    return getattr(module, spec.class_name)


def _config_class(spec: QwenFamily) -> type:
    return _transformers_class(spec).config_class


def builtin_dir(spec: QwenFamily, cache_dir: Path | str) -> Path:
    """The tiny builtin tower of `spec` with its image and video processor configs."""

    def build(tmp: Path) -> None:
        import transformers

        config = _config_class(spec)(**BUILTIN_CONFIGS[spec.name])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _transformers_class(spec)._from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        common = dict(patch_size=spec.patch_size, temporal_patch_size=2, merge_size=2, image_mean=list(spec.mean), image_std=list(spec.std))
        transformers.Qwen2VLImageProcessor(
            size={"shortest_edge": BUILTIN_PIXELS["min_pixels"], "longest_edge": BUILTIN_PIXELS["max_pixels"]}, **common
        ).save_pretrained(tmp)
        # qwen2_vl..qwen3_vl builtins were made with Qwen2VLVideoProcessor; kept, so their vectors stay as they were.
        video = spec.video_processor if spec.name == "qwen3_5" else PER_FRAME
        bounds = {**BUILTIN_PIXELS, **BUILTIN_CLIP_PIXELS} if video == PER_CLIP else BUILTIN_PIXELS
        getattr(transformers, video)(
            size={"shortest_edge": bounds["video_min_pixels"], "longest_edge": bounds["video_max_pixels"]}, **common
        ).save_pretrained(tmp)

    return builtin_model(cache_dir, spec.name, BUILTIN_VERSION, build)


def _download(repo_id: str) -> Path:
    """Fetch only what the vision tower needs from the hub (config, processor, visual shards)."""
    from huggingface_hub import hf_hub_download

    config_file = Path(hf_hub_download(repo_id, "config.json"))
    root = config_file.parent
    try:
        index = Path(hf_hub_download(repo_id, "model.safetensors.index.json"))
    except Exception:
        return download_snapshot(repo_id)
    shards = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if _visual_prefix(k) is not None})
    for name in shards + list(PROCESSOR_FILES):
        try:
            hf_hub_download(repo_id, name)
        except Exception:
            logger.debug("%s has no %s", repo_id, name)
    return root


def load_model(spec: QwenFamily, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Load the vision tower from a vision-only or a full vision-language checkpoint."""
    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    cls = _transformers_class(spec)
    if model_type == cls.config_class.model_type:
        return cls.from_pretrained(directory, dtype=dtype)
    if model_type in spec.vision_model_types:  # a variant's tower: the same fields, read by the family's config class
        return cls.from_pretrained(directory, config=cls.config_class.from_dict(config), dtype=dtype)
    if model_type in spec.full_model_types:
        return _load_from_full(spec, directory, config, dtype)
    hint = next(
        (f"; set model.family to {f.name!r}" for f in FAMILIES.values() if model_type in f.vision_model_types + f.full_model_types),
        "",
    )
    raise ValueError(
        f"checkpoint {directory} has model_type {model_type!r}; model.family {spec.name!r} expects "
        f"{' or '.join(map(repr, spec.vision_model_types))} (vision tower) or "
        f"{' or '.join(map(repr, spec.full_model_types))} (full model){hint}"
    )


def _load_from_full(spec: QwenFamily, directory: Path, config: dict[str, Any], dtype: torch.dtype) -> torch.nn.Module:
    """Build the tower from `vision_config` and load only the `visual.` weights."""
    from safetensors import safe_open

    vision_config = _config_class(spec)(**config["vision_config"])
    model = _transformers_class(spec)._from_config(vision_config, dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                prefix = _visual_prefix(key)
                if prefix is not None:
                    state[key[len(prefix) :]] = handle.get_tensor(key)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory}: vision weights do not match the config "
            f"(missing {missing[:3]}..., unexpected {unexpected[:3]}...)"
        )
    return model.to(dtype)


def _visual_prefix(key: str) -> str | None:
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return prefix
    return None


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
"""The files a checkpoint's processor settings may be in: transformers 5 saves a processor's
image and video processors nested in processor_config.json, earlier releases each in a
file of its own."""
VIDEO_DEFAULT_PIXELS = {PER_FRAME: (128 * 28 * 28, 28 * 28 * 768), PER_CLIP: (128 * 32 * 32, 32 * 32 * 768)}
"""A video processor's default (min, max) pixels (its class's `size`), where the checkpoint gives none."""


def load_processing(spec: QwenFamily, directory: Path, model_config: Any, options: AdapterOptions) -> QwenPreprocessor:
    """Preprocessing parameters: the checkpoint's processor configs, then the job's overrides.

    A video bound the job sets (`video.min_pixels`, `video.max_pixels`) bounds each
    frame, whatever the checkpoint's video processor does."""
    image, video = processor_configs(directory)
    kind = str(video.get("video_processor_type", spec.video_processor)).removesuffix("Fast")
    if kind not in VIDEO_DEFAULT_PIXELS:
        logger.warning("%s names the video processor %s; its videos are resized as %s resizes them", directory, kind, PER_FRAME)
        kind = PER_FRAME
    clip = kind == PER_CLIP and not (options.video_min_pixels or options.video_max_pixels)
    factor = int(model_config.patch_size) * int(model_config.spatial_merge_size)
    min_px, max_px = _pixel_bounds(image, 56 * 56, 28 * 28 * 1280)
    vmin_px, vmax_px = _pixel_bounds(video, *VIDEO_DEFAULT_PIXELS[kind])
    values = dict(
        min_pixels=options.min_pixels or min_px,
        max_pixels=options.max_pixels or max_px,
        video_min_pixels=options.video_min_pixels or vmin_px,
        video_max_pixels=options.video_max_pixels or vmax_px,
    )
    return QwenPreprocessor(
        family=spec.name,
        patch_size=int(model_config.patch_size),
        temporal_patch_size=int(model_config.temporal_patch_size),
        merge_size=int(model_config.spatial_merge_size),
        mean=tuple(image.get("image_mean", spec.mean)),
        std=tuple(image.get("image_std", spec.std)),
        window_size=int(model_config.window_size) if spec.windowed else None,
        pos_grid_side=int(model_config.num_position_embeddings**0.5) if spec.interpolated_positions else None,
        clip_pixels=clip,
        frame_cap=int(video.get("max_video_tokens") or 768) * factor**2 if clip and video.get("cap_pixels_per_frame") else None,
        **values,
    )


def processor_configs(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's image and video processor settings, each as transformers reads it:
    nested in processor_config.json first, else its own file (empty where there is none)."""
    nested = _read_json(directory / PROCESSOR_FILES[0])
    image = nested.get("image_processor") or _read_json(directory / PROCESSOR_FILES[1])
    video = nested.get("video_processor") or _read_json(directory / PROCESSOR_FILES[2])
    return image, video


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _pixel_bounds(config: dict[str, Any], default_min: int, default_max: int) -> tuple[int, int]:
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or default_min
    high = config.get("max_pixels") or size.get("longest_edge") or default_max
    return int(low), int(high)


class LinearPatchEmbed(torch.nn.Module):
    """The patch embedding as one matrix product.

    The tower's Conv3d has kernel == stride over exactly one patch, so it is a matmul
    of each flattened patch (C, T, P, P order, as the processor flattens it) with the
    reshaped kernel; cuDNN runs that Conv3d as a slow implicit GEMM, cuBLAS runs the
    matmul at full rate (the kernel table in benchmarks/RESULTS.md's git history).
    """

    def __init__(self, conv: torch.nn.Conv3d) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1), requires_grad=False)
        self.bias = None if conv.bias is None else torch.nn.Parameter(conv.bias.detach(), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        rows = pixels.reshape(-1, self.weight.shape[1]).to(self.weight.dtype)
        return torch.nn.functional.linear(rows, self.weight, self.bias)


def tune_for_cuda(model: torch.nn.Module) -> None:
    """Lossless rewrites that let cuBLAS use its Hopper kernels (see the two helpers)."""
    with torch.no_grad():
        model.patch_embed.proj = LinearPatchEmbed(model.patch_embed.proj)
        model.patch_embed.forward = model.patch_embed.proj.forward
        pad_mlps(model.blocks, 64)


def build_adapter(family: str, path: str, dtype: torch.dtype, device: torch.device, options: AdapterOptions) -> QwenAdapter:
    """Load a Qwen-VL tower ready for packed, capturable execution on `device`."""
    spec = FAMILIES[family]
    directory = resolve_checkpoint(path, spec.name, FAMILIES, lambda: builtin_dir(spec, options.cache_dir), _download)
    model = load_model(spec, directory, dtype).to(device).eval()
    if device.type == "cuda":
        tune_for_cuda(model)
    model.config._attn_implementation = register_attention(options.attention)
    model.requires_grad_(False)
    processing = load_processing(spec, directory, model.config, options)
    return QwenAdapter(spec, model, processing, options.placement(device, dtype, path), options.attention)
