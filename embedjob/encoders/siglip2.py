"""SigLIP 2 NaFlex vision towers through transformers, packed like the Qwen-VL towers.

NaFlex keeps each image's aspect ratio: the image processor (Siglip2ImageProcessor)
resizes it to the largest size whose patch grid (h, w) holds at most `max_num_patches`
patches, cuts it into h * w rows of p * p * 3 values, and the tower resizes its learned
square position table to (h, w) per image. transformers then pads every image to
`max_num_patches` rows and masks the padding; here the images of a batch are packed into
one sequence instead, each view (an image, or one sampled frame of a video) an attention
segment of its own over `cu_seqlens` (`encoders.attention`'s kernels), so the work is
the real tokens and a captured graph per token budget serves every mix of sizes.

What the numbers mean (the contract the packer, the graph manager and the writer rely on):
- An item's `grid` and `token_grid` are (views, h, w): 1 view for an image, one per
  sampled frame for a video (every frame of a video has the same size, so one grid).
  `tokens` = views * h * w is what it costs in a budget and what `tokens` reports.
- `forward` returns one row per view (the attention-pooling head's output, what
  `Siglip2Model.get_image_features(...).pooler_output` gives), real views first in
  batch order, so `row_counts` is the views of each item; a video's frame rows are
  averaged by the pipeline (`output.pooling: mean`), as SigLIP's are. With per-token
  output (`output.pooling: none`) one row per patch token instead, row-major over each
  view's grid, views in turn: the final layer-normed states, the space the head pools
  (as for SigLIP, `encoders.fixed`).

Padding to a budget (ARCHITECTURE.md, "Invariants across stages"): real patches come
first, pad patches follow as segments of their own of at most `pad_segment` patches,
the cumulative offsets are padded by repeating the last one (zero-length segments), and
every pad token takes the position of the last real one (finite, never read). The head
pools each segment with one probe query over that segment's tokens alone, so a pad
segment's row is its own and is never read.

Capturable position embeddings: transformers resizes the table with bilinear,
antialiased weights (`F.interpolate(mode="bilinear", align_corners=False,
antialias=True)` written out as a product: per output position one weight per source row
and one per source column, their outer product times the flattened table, in float32).
Here each token carries (row, column, h, w) of its view, made in batch assembly with a
few numpy calls per batch, and the forward computes the same weights from them with the
same float32 operations, on the device, inside the graph: fixed shapes (tokens, side)
and (tokens, side^2), no host synchronisation and no table per distinct (h, w) to keep
or look up. The product costs 2 * side^2 * width FLOPs a token (0.6 MFLOP at so400m's
16 x 16 table and width 1,152, under 0.1 % of a block's), and the workers ship 16 bytes a
token instead of a resized table.

The uint8 -> float normalisation runs on the device inside the graph, as in the other
families: workers ship resized uint8 patch rows (a quarter of float32's bytes).

Captions (`input.text_column`, `output.labels`): a full Siglip2Model's text tower is
SigLIP's (Siglip2TextModel: bidirectional, pooled at the last position through its
head), so `fixed.build_text` builds it: the checkpoint's tokenizer (Gemma's, lower-casing)
pads every caption to the text model's length (64), as the processor does and as the
model was trained, and no attention mask is passed, as in training; the vector is
`Siglip2Model.get_text_features(input_ids).pooler_output`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as tvF

from embedjob.encoders.attention import HALF, all_pad_offsets, pad_offsets, segment_offsets, varlen_attention
from embedjob.encoders.attention import register as register_attention
from embedjob.encoders.base import (
    JPEG_KEY,
    JPEG_SIZE_KEY,
    PAD_REPEAT_LAST,
    EncoderInput,
    NamedSpec,
    PackedAdapter,
    Placement,
    StaticInputs,
)
from embedjob.encoders.fixed import INTERPOLATIONS, build_text
from embedjob.encoders.loading import (
    AdapterOptions,
    builtin_model,
    download_snapshot,
    resolve_checkpoint,
    transformers_class,
)
from embedjob.encoders.registry import FAMILIES as REGISTRY

logger = logging.getLogger(__name__)

FAMILY = "siglip2"
FULL_TYPE = "siglip2"
VISION_TYPE = "siglip2_vision_model"
PIXELS_KEY = "pixel_values"
POSITIONS_KEY = "positions"
PAD_SEGMENT = 64
"""The longest pad segment: pad tokens attend only within their own segment, so short
ones keep their quadratic cost small (ARCHITECTURE.md, "Invariants across stages")."""
MAX_BUDGET = 16384
"""The largest automatic budget: 64 so400m images of 256 patches, as Qwen-VL's."""
SEARCH_EPS = 1e-5
"""The processor's precision of the scale it searches (`naflex_size`)."""


@functools.lru_cache(maxsize=4096)
def naflex_size(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    """The (height, width) in pixels the processor resizes an image to: both multiples
    of `patch`, at least one patch each, the aspect ratio kept as closely as rounding up
    to whole patches allows, and at most `max_patches` patches.

    The processor finds its scale by bisection over (SEARCH_EPS / 10, 100) down to
    SEARCH_EPS, each side rounded up to whole patches; the same bisection here, step for
    step, so every size agrees with it (the largest feasible scale lies on a rounding
    step, where any other search could land a patch apart). Pure; cached per size, as
    the rank reads deferred JPEGs' sizes on its own thread."""
    low, high = SEARCH_EPS / 10, 100.0
    while high - low >= SEARCH_EPS:
        scale = (low + high) / 2
        if _scaled(height, scale, patch) * _scaled(width, scale, patch) <= max_patches * patch * patch:
            low = scale
        else:
            high = scale
    return _scaled(height, low, patch), _scaled(width, low, patch)


def _scaled(size: int, scale: float, patch: int) -> int:
    """`size` times `scale`, rounded up to whole patches, at least one."""
    return max(patch, math.ceil(size * scale / patch) * patch)


@dataclass(frozen=True)
class NaflexPreprocessor:
    """Decoded media -> uint8 patch rows at the NaFlex size; runs in decode workers.

    Matches Siglip2ImageProcessor (torchvision backend): antialiased resize of the uint8
    pixels to `naflex_size` (bilinear unless the checkpoint says otherwise), patches of
    p x p pixels in row-major order, each flattened (row, column, channel), then the
    fused rescale + normalise in float32. The workers stop before the normalisation;
    `normalize` runs on the device (the adapter's forward) with the processor's float32
    operations, so the model's input is bitwise the processor's. A video's frames are
    each an image at the frame's NaFlex size (`video_max_patches`).
    """

    patch_size: int
    max_patches: int
    video_max_patches: int
    interpolation: tvF.InterpolationMode
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @property
    def frame_multiple(self) -> int:
        """Every frame is a view of its own, so any frame count works."""
        return 1

    @property
    def video_max_pixels(self) -> int:
        """Frame pixels the decoder needs: a frame of at most this many is resized to at
        most `video_max_patches` patches anyway (the pipeline lets decode shrink frames
        to 4x this, so full-size 4K frames are not decoded for nothing)."""
        return self.video_max_patches * self.patch_size**2

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    def __call__(self, media: Any) -> EncoderInput:
        frames = getattr(media, "frames", None)
        if frames is None:
            stack = torch.from_numpy(media.pixels).permute(2, 0, 1).unsqueeze(0)
            return self._item(self.patchify(self.resize(stack, self.max_patches)), "image", 0)
        stack = torch.from_numpy(frames).permute(0, 3, 1, 2)
        return self._item(self.patchify(self.resize(stack, self.video_max_patches)), "video", int(frames.shape[0]))

    def deferred(self, data: torch.Tensor, height: int, width: int) -> EncoderInput:
        """A JPEG the rank decodes on its GPU: its grid (so its tokens) follows from its
        header's size alone."""
        h, w = (side // self.patch_size for side in naflex_size(height, width, self.patch_size, self.max_patches))
        tensors = {JPEG_KEY: data, JPEG_SIZE_KEY: torch.tensor([height, width])}
        return _item(tensors, (1, h, w), "image", 0)

    def on_device(self, items: list[EncoderInput], images: torch.Tensor) -> list[EncoderInput]:
        """`deferred`'s items with their patches made from their decoded (N, 3, H, W)
        uint8 pictures (one size), resized and patched together on the device."""
        patches, (views, h, w) = self.patchify(self.resize(images, self.max_patches))
        finished = []
        for item, rows in zip(items, patches.split(h * w), strict=True):
            if item.grid != (1, h, w):
                raise ValueError(f"the decoded picture gives the grid {(1, h, w)}, its header {item.grid}")
            finished.append(replace(item, tensors={PIXELS_KEY: rows}))
        return finished

    def deferred_video(self, frames: int, height: int, width: int) -> EncoderInput:
        """A video whose `frames` sampled frames (shown at `height` x `width`) the rank's
        GPU decodes: its grid follows from those alone."""
        h, w = (side // self.patch_size for side in naflex_size(height, width, self.patch_size, self.video_max_patches))
        return _item({}, (frames, h, w), "video", frames)

    def on_device_video(self, item: EncoderInput, frames: torch.Tensor) -> EncoderInput:
        """`deferred_video`'s item with its patches made from the decoded (T, 3, H, W) uint8 frames."""
        patches, grid = self.patchify(self.resize(frames, self.video_max_patches))
        if grid != item.grid:
            raise ValueError(f"the decoded frames give the grid {grid}, the plan {item.grid}")
        return replace(item, tensors={PIXELS_KEY: patches, **item.tensors})

    def _item(self, patched: tuple[torch.Tensor, tuple[int, int, int]], modality: str, frames: int) -> EncoderInput:
        patches, grid = patched
        return _item({PIXELS_KEY: patches}, grid, modality, frames)

    def resize(self, images: torch.Tensor, max_patches: int) -> torch.Tensor:
        """(T, 3, H, W) uint8 -> (T, 3, H', W') uint8 at the NaFlex size for `max_patches`."""
        size = naflex_size(*images.shape[-2:], self.patch_size, max_patches)
        return tvF.resize(images, list(size), interpolation=self.interpolation, antialias=True)

    def patchify(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(T, 3, h * p, w * p) -> (T * h * w, p * p * 3) rows in the processor's order
        (views, patch rows, patch columns; within a patch: pixel row, pixel column,
        channel), and the grid (T, h, w)."""
        p = self.patch_size
        views, channels, height, width = images.shape
        h, w = height // p, width // p
        rows = images.reshape(views, channels, h, p, w, p).permute(0, 2, 4, 3, 5, 1)
        return rows.reshape(views * h * w, p * p * channels).contiguous(), (views, h, w)

    def pixel_scale(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and std scaled by 1/rescale, computed in float32 on the CPU as transformers
        fuses them, moved to `device` once (a captured graph cannot copy constants from
        host memory); None without normalisation."""
        if self.mean is None or self.std is None:
            return None
        factor = 1.0 / self.rescale if self.rescale is not None else 1.0
        return (torch.tensor(self.mean) * factor).to(device), (torch.tensor(self.std) * factor).to(device)

    def normalize(self, pixels: torch.Tensor, scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(rows, p * p * 3) uint8 -> float32, rescaled and normalised per channel (the
        innermost index of a row): one subtract and one divide, the processor's
        operations, so CPU and GPU give its bits. `scale` is `pixel_scale(device)`."""
        values = pixels.to(torch.float32)
        if self.mean is None or self.std is None:
            return values * self.rescale if self.rescale is not None else values
        mean, std = scale if scale is not None else self.pixel_scale(pixels.device)
        rows = values.shape[0]
        return ((values.view(rows, -1, 3) - mean) / std).view(rows, -1)


def _item(tensors: dict[str, torch.Tensor], grid: tuple[int, int, int], modality: str, frames: int) -> EncoderInput:
    """The item of `grid` (views, h, w): one token per patch of every view."""
    tokens = grid[0] * grid[1] * grid[2]
    return EncoderInput(tensors, tokens=tokens, frames=frames, size=tokens, modality=modality, grid=grid, token_grid=grid)


def resized_positions(table: torch.Tensor, side: int, positions: torch.Tensor) -> torch.Tensor:
    """The learned (side * side, width) position table resized to each token's view:
    `positions` (tokens, 4) float32 holds each token's (row, column) in its view and the
    view's (h, w). Per token, transformers' bilinear antialiased weights along each axis
    (its float32 operations in its order), their outer product, times the table in
    float32; the result in the table's dtype. Fixed shapes, no host synchronisation."""
    index, sizes = positions[:, :2], positions[:, 2:]
    scale = side / sizes
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5
    source = torch.arange(side, device=positions.device, dtype=torch.float32)
    weights = (1 - (source - center[..., None]).abs_().div_(support[..., None])).clamp_(min=0)
    weights = weights / weights.sum(-1, keepdim=True)
    outer = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(-2)
    return (outer @ table.float()).to(table.dtype)


class PackedSelfAttention(torch.nn.Module):
    """A Siglip2Attention run over packed segments: its own q, k, v and output
    projections (the same modules, under the same names, so FP8 conversion and the
    compiler see the block they know), the attention within each segment of
    `cu_seq_lens_q` by `encoders.attention` (transformers' attention call passes no
    segment offsets on, so the module is replaced rather than configured)."""

    def __init__(self, attention: torch.nn.Module, backend: str) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = attention.q_proj, attention.k_proj, attention.v_proj
        self.out_proj = attention.out_proj
        self.head_dim = int(attention.head_dim)
        self.scale = float(attention.scale)
        self.backend = backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        max_length_q: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """(1, tokens, width) -> (1, tokens, width); `attention_mask` is unused (segments replace it)."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out, _ = varlen_attention(
            self, q, k, v, None, self.scale, cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, backend=self.backend
        )
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def pool_segments(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu: torch.Tensor, max_len: int
) -> torch.Tensor:
    """One query per segment attending over that segment's keys alone: (segments, heads,
    dim) queries, (tokens, heads, dim) keys and values, `cu` the segments' cumulative
    offsets (segments + 1). On CUDA in half precision torch's varlen_attn (capturable;
    a zero-length segment's row is zeros), elsewhere scaled-dot-product attention per
    segment, exact but read on the host (`NaflexAdapter.capturable`)."""
    if queries.is_cuda and queries.dtype in HALF:
        from torch.nn.attention.varlen import varlen_attn

        one = torch.arange(queries.shape[0] + 1, device=queries.device, dtype=torch.int32)
        return varlen_attn(queries.contiguous(), keys.contiguous(), values.contiguous(), one, cu.to(torch.int32), 1, max_len)
    out = torch.zeros_like(queries)
    bounds = cu.tolist()
    for segment, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            q = queries[segment : segment + 1].transpose(0, 1).unsqueeze(0)
            k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (keys, values))
            out[segment] = F.scaled_dot_product_attention(q, k, v)[0, :, 0]
    return out


class NaflexAdapter(PackedAdapter):
    """A SigLIP 2 NaFlex vision tower (transformers' Siglip2VisionModel) run on packed
    batches; see the module docstring for the rows it returns and the padding rules."""

    def __init__(
        self, tower: torch.nn.Module, processing: NaflexPreprocessor, placement: Placement, attention: str, per_token: bool
    ) -> None:
        super().__init__(NamedSpec(FAMILY), processing, placement, tower.encoder.layers, attention)
        self.tower = tower
        self.per_token = per_token
        self.embed_dim = int(tower.config.hidden_size)
        self.side = int(tower.embeddings.position_embedding_size)
        self.max_view = max(processing.max_patches, processing.video_max_patches)
        self.pad_segment = min(PAD_SEGMENT, self.max_view)
        self.min_budget = self.max_view
        self.max_budget = max(MAX_BUDGET, self.max_view)
        self.pixel_scale = processing.pixel_scale(placement.device)
        for layer in tower.encoder.layers:
            layer.self_attn = PackedSelfAttention(layer.self_attn, attention)

    def preprocessor(self) -> NaflexPreprocessor:
        return self.processing

    def limits(self) -> dict[str, Any]:
        p = self.processing
        return dict(max_num_patches=p.max_patches, video_max_num_patches=p.video_max_patches, per_token=self.per_token)

    def static_inputs(self, budget: int, max_items: int, max_frames: int) -> StaticInputs:
        """Buffers for `budget` patches and a dummy all-pad batch (black pixels at
        position (0, 0) of a 1 x 1 view: finite everywhere). Segment slots hold every
        view a batch can have (an image, or a video frame: at most max_items +
        max_frames, and never more than the budget's tokens) plus the pad segments; a
        batch that needs more runs eagerly (`fits`)."""
        views = min(max_items + max_frames, budget)
        slots = views + math.ceil(budget / self.pad_segment) + 1
        positions = torch.tensor([[0.0, 0.0, 1.0, 1.0]]).expand(budget, 4).contiguous()
        tensors = {
            PIXELS_KEY: torch.zeros(budget, self.processing.patch_dim, dtype=torch.uint8),
            POSITIONS_KEY: positions,
            "cu_seqlens": torch.from_numpy(all_pad_offsets(budget, slots, self.pad_segment)),
        }
        pad = {POSITIONS_KEY: PAD_REPEAT_LAST, "cu_seqlens": PAD_REPEAT_LAST}
        constants = {"max_seqlen": min(budget, self.max_view), "budget": budget}
        return StaticInputs({k: v.to(self.device) for k, v in tensors.items()}, pad, constants)

    def fits(self, items: list[EncoderInput], static: StaticInputs) -> bool:
        budget = static.tensors[PIXELS_KEY].shape[0]
        views = sum(item.grid[0] for item in items)
        pads = math.ceil((budget - sum(item.tokens for item in items)) / self.pad_segment)
        return views + pads + 1 <= static.tensors["cu_seqlens"].shape[0]

    def batch_values(self, items: list[EncoderInput], static: StaticInputs) -> dict[str, torch.Tensor]:
        """The batch with its offsets padded to the budget's buffer; per-token rows stay
        at their real length (the manager zeroes the pixels' tail and repeats the last
        position)."""
        budget = static.tensors[PIXELS_KEY].shape[0]
        values, offsets = self._token_rows(items)
        padded = pad_offsets(offsets, budget, static.tensors["cu_seqlens"].shape[0], self.pad_segment)
        values["cu_seqlens"] = self._host(padded)
        return values

    def eager_inputs(self, items: list[EncoderInput]) -> StaticInputs:
        values, offsets = self._token_rows(items)
        values["cu_seqlens"] = self._host(offsets)
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in values.items()}
        return StaticInputs(tensors, {}, {"max_seqlen": int(np.diff(offsets).max())})

    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        """Packed uint8 patch rows -> one pooled row per segment (real views first), or
        with `per_token` one final state per token. Normalising and resizing the
        position table here puts both on the device, inside a captured graph."""
        t = inputs.tensors
        cu, max_len = t["cu_seqlens"], int(inputs.constants["max_seqlen"])
        embeddings = self.tower.embeddings
        weight = embeddings.patch_embedding.weight
        pixels = self.processing.normalize(t[PIXELS_KEY], self.pixel_scale).to(weight.dtype)
        positions = resized_positions(embeddings.position_embedding.weight, self.side, t[POSITIONS_KEY])
        hidden = (embeddings.patch_embedding(pixels) + positions).unsqueeze(0)
        for layer in self.tower.encoder.layers:
            hidden = layer(hidden, None, cu_seq_lens_q=cu, max_length_q=max_len)
        states = self.tower.post_layernorm(hidden[0])
        return states if self.per_token else self.pool(states, cu, max_len)

    def pool(self, states: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
        """The attention-pooling head per segment: the probe's query attends over the
        segment's own tokens (its keys and values one joined product), then the head's
        output projection, layer norm and MLP with their residual, row by row."""
        head = self.tower.head
        mha = head.attention
        width, heads = self.embed_dim, mha.num_heads
        w_q, w_kv = mha.in_proj_weight.split([width, 2 * width])
        b_q, b_kv = mha.in_proj_bias.split([width, 2 * width])
        query = F.linear(head.probe.reshape(1, width), w_q, b_q).view(1, heads, -1)
        keys, values = F.linear(states, w_kv, b_kv).view(states.shape[0], 2, heads, -1).unbind(1)
        segments = cu.shape[0] - 1
        attended = pool_segments(query.expand(segments, -1, -1), keys, values, cu, max_len)
        pooled = mha.out_proj(attended.reshape(segments, width))
        return pooled + head.mlp(head.layernorm(pooled))

    def row_counts(self, items: list[EncoderInput]) -> list[int]:
        """One row per view (1 for an image, one per frame for a video), or with
        `per_token` one per patch token of each view."""
        return [item.tokens for item in items] if self.per_token else [item.grid[0] for item in items]

    def _token_rows(self, items: list[EncoderInput]) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Every item's uint8 patch rows joined in batch order, each token's (row,
        column, h, w) in its view (float32, as the resize reads them), and the views'
        cumulative offsets from 0 — with a constant number of torch calls per batch."""
        grids = self._grids(items)
        heights, widths = np.repeat(grids[:, 1], grids[:, 0]), np.repeat(grids[:, 2], grids[:, 0])
        lengths = heights * widths
        offsets = segment_offsets(lengths)
        local = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1].astype(np.int64), lengths)
        tall, wide = np.repeat(heights, lengths), np.repeat(widths, lengths)
        positions = np.stack([local // wide, local % wide, tall, wide], axis=1).astype(np.float32)
        return {PIXELS_KEY: self._pixel_rows(items, int(offsets[-1])), POSITIONS_KEY: self._host(positions)}, offsets

    def _pixel_rows(self, items: list[EncoderInput], rows: int) -> torch.Tensor:
        """(rows, p * p * 3) uint8, page-locked when it feeds a GPU; patches the GPU
        decoded are already there, and then the batch is joined on the device."""
        parts = [item.tensors[PIXELS_KEY] for item in items]
        if any(part.device.type != "cpu" for part in parts):
            return torch.cat([part.to(self.device, non_blocking=True) for part in parts])
        out = torch.empty((rows, self.processing.patch_dim), dtype=torch.uint8, pin_memory=self.pin_memory)
        return torch.cat(parts, out=out)

BUILTIN_VERSION = 1
BUILTIN_VISION = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=8, num_patches=64
)
"""An 8 x 8 position table against up to 96 patches a view: every builtin image's table is
resized, shrunk along one side (antialiased) and stretched along the other."""
BUILTIN_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128,
    max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
BUILTIN_PROCESSOR = dict(patch_size=8, max_num_patches=96)


def builtin_dir(cache_dir: Path | str) -> Path:
    """The tiny builtin model: a full Siglip2Model (vision and text, fixed seed) with its
    image processor config, so the demo loads through a user's checkpoint's path."""

    def build(tmp: Path) -> None:
        config = transformers_class("Siglip2Config")(text_config=BUILTIN_TEXT, vision_config=BUILTIN_VISION)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers_class("Siglip2Model")._from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        transformers_class("Siglip2ImageProcessor")(**BUILTIN_PROCESSOR).save_pretrained(tmp)

    return builtin_model(cache_dir, FAMILY, BUILTIN_VERSION, build)


def load_model(directory: Path, dtype: torch.dtype, text: bool = False) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The vision tower (Siglip2VisionModel) and, with `text`, the full Siglip2Model its
    text tower is taken from (else None). A full checkpoint is loaded whole (its text
    tower dropped without `text`), a vision-only one as the class it was saved from, and
    refused with `text` (ValueError: it has no text tower)."""
    model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    if model_type == FULL_TYPE:
        full = transformers_class("Siglip2Model").from_pretrained(directory, dtype=dtype)
        return full.vision_model, full if text else None
    if model_type == VISION_TYPE and text:
        raise ValueError(
            f"checkpoint {directory} is a vision-only {FAMILY} model ({model_type!r}) with no text tower for "
            f"input.text_column or output.labels; name the full checkpoint (model_type {FULL_TYPE!r}, vision and text) "
            "or remove those keys"
        )
    if model_type == VISION_TYPE:
        return transformers_class("Siglip2VisionModel").from_pretrained(directory, dtype=dtype), None
    hint = next((f"; set model.family to {name!r}" for name, f in REGISTRY.items() if model_type in f.model_types), "")
    raise ValueError(
        f"checkpoint {directory} has model_type {model_type!r}; model.family {FAMILY!r} expects {FULL_TYPE!r} or "
        f"{VISION_TYPE!r} (SigLIP 2 NaFlex; the fixed-resolution SigLIP 2 checkpoints are model.family 'siglip'){hint}"
    )


def load_processing(directory: Path, vision_config: Any, options: AdapterOptions) -> NaflexPreprocessor:
    """The checkpoint's Siglip2ImageProcessor settings (its defaults where the checkpoint
    has none), `max_num_patches` replaced by the job's `preprocess.max_pixels` (and
    `video.max_pixels` for frames) divided by the patch area where given.

    Raises ValueError where the processor cuts patches of another size than the model's
    or resamples in a way torchvision's tensors cannot."""
    if (directory / "preprocessor_config.json").exists():
        processor = transformers_class("AutoImageProcessor").from_pretrained(directory)
    else:
        logger.warning("%s has no preprocessor_config.json; using Siglip2ImageProcessor's defaults", directory)
        processor = transformers_class("Siglip2ImageProcessor")(patch_size=int(vision_config.patch_size))
    patch = int(processor.patch_size)
    if patch != int(vision_config.patch_size):
        raise ValueError(f"{directory}: the processor cuts {patch}-pixel patches but the model takes {vision_config.patch_size}")
    resample = int(processor.resample)
    if resample not in INTERPOLATIONS:
        raise ValueError(f"{directory}: resample={resample} has no torchvision tensor implementation; use 0, 1, 2 or 3")
    max_patches = _patches(options.max_pixels, patch) or int(processor.max_num_patches)
    return NaflexPreprocessor(
        patch_size=patch,
        max_patches=max_patches,
        video_max_patches=_patches(options.video_max_pixels, patch) or max_patches,
        interpolation=INTERPOLATIONS[resample],
        rescale=float(processor.rescale_factor) if processor.do_rescale else None,
        mean=tuple(float(v) for v in processor.image_mean) if processor.do_normalize else None,
        std=tuple(float(v) for v in processor.image_std) if processor.do_normalize else None,
    )


def _patches(pixels: int | None, patch: int) -> int | None:
    """The patches of `pixels` (a job's pixel bound), at least one; None where unset."""
    return max(1, pixels // (patch * patch)) if pixels else None


def build_adapter(family: str, path: str, dtype: torch.dtype, device: torch.device, options: AdapterOptions) -> NaflexAdapter:
    """Load a SigLIP 2 NaFlex tower ready for packed, capturable execution on `device`,
    and with `options.text` its text tower beside it (`fixed.build_text`: SigLIP's
    structure, pooled at the last position of a caption padded to max_length)."""
    directory = resolve_checkpoint(path, FAMILY, [FAMILY], lambda: builtin_dir(options.cache_dir), download_snapshot)
    tower, full = load_model(directory, dtype, text=options.text)
    if not getattr(tower.config, "vision_use_head", True) and not options.per_token:
        raise ValueError(
            f"checkpoint {directory} has no attention-pooling head (vision_use_head=false), so no image vector; "
            "output.pooling: none gives its per-token states"
        )
    tower = tower.to(device).eval().requires_grad_(False)
    processing = load_processing(directory, tower.config, options)
    register_attention(options.attention)
    placement = options.placement(device, dtype, path)
    adapter = NaflexAdapter(tower, processing, placement, options.attention, options.per_token)
    if full is not None:
        adapter.text = build_text(FAMILY, "last", full, directory, placement)
    return adapter
