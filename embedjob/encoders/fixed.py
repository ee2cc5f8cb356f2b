"""CLIP, MetaCLIP 2, SigLIP, DINOv2 and DINOv3 vision encoders through transformers: a fixed token count per image.

Every image (or video frame, or tile) is resized to the model's input size, so it costs
the same `tokens_per_image` encoder tokens: (side / patch)^2 patches, plus the prefix
tokens before them (`FixedFamily.prefix_tokens`): a CLS token for CLIP, MetaCLIP 2 and
DINOv2, a CLS token and the checkpoint's `num_register_tokens` registers for DINOv3.
A batch of n images is one (n, 3, H, W) tensor; the images never attend
to each other, so pad images (zeros) cannot change a real image's embedding.

What the numbers mean (the contract the packer, the graph manager and the writer rely on):
- `EncoderInput.tokens` is the item's encoder tokens, views x tokens_per_image (views: 1
  for an image, its frames for a video, plus its tiles in the dual-path mode). It is what
  budgets count, what padding waste is measured in and what the `tokens` column reports.
- `split` returns one row per view: a fixed-resolution encoder emits one pooled
  embedding per image. An image gives 1 row; a video one row per frame, which the pipeline
  averages (`output.pooling: mean`).
- Per-token output (`output.pooling: none`, `per_token`): one row per patch token of
  each view instead, row-major over the patch grid, views (frames) one after the other,
  so an item's rows form its `token_grid` (views, patches high, patches wide). The
  prefix tokens are not among them (CLS is the pooled output; registers hold no place in
  the grid). A token is what the family's pooled vector is made from, in the same
  space: CLIP's and MetaCLIP 2's patch states through the post-layernorm and the visual
  projection (as their CLS state is), SigLIP's and DINOv2's and DINOv3's final
  (layer-normed) states. Budgets still count every encoder token, prefix tokens included.
- A budget of B tokens holds B // tokens_per_image images; budgets are multiples of it.

Embeddings: CLIP, MetaCLIP 2 and SigLIP return what `get_image_features` returns (CLIP
and MetaCLIP 2: the post-layernorm CLS through `visual_projection`; SigLIP: its
attention-pooling head). DINOv2 and DINOv3 return their CLS token after the final
layernorm (`pooler_output`) by default, or the mean of their patch tokens (registers
left out) with `model.pool: patch_mean`.

Dual path (`preprocess.tiling: anyres`): each image also yields up to `max_tiles` local
tiles (see tiling.py) under `tile_pixels`; the global view is exactly the single-view
input, so a tiled job's global half equals the untiled job's embedding. `combine` merges
the two paths per view: `concat` -> [global ; mean of tiles] (2 x dim), `mean` -> the
average of those two halves. A view without tiles (a small image, a video frame) uses its
global embedding as its local half, i.e. the image counts as its own single tile, so
tiled and untiled items stay comparable by cosine similarity.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torchvision.transforms.v2.functional as tvF

from embedjob.encoders import base
from embedjob.encoders.attention import register_unmasked
from embedjob.encoders.base import (
    JPEG_KEY,
    JPEG_SIZE_KEY,
    EncoderAdapter,
    EncoderInput,
    PathSpec,
    Placement,
    StaticInputs,
    pad_mlps,
)
from embedjob.encoders.loading import (
    AdapterOptions,
    builtin_model,
    download_snapshot,
    resolve_checkpoint,
    transformers_class,
)
from embedjob.encoders.text import PooledText, TextAdapter, TextPreprocessor, load_tokenizer
from embedjob.encoders.tiling import cut_tiles, select_grid

logger = logging.getLogger(__name__)

GLOBAL_KEY = "pixel_values"
LOCAL_KEY = "tile_pixels"
MAX_IMAGES_PER_BATCH = 256
PATCH_PRODUCTS = True
"""Whether new adapters run the patch embedding's convolution as one matrix product
(`PatchProduct`). Read when an adapter is built; benchmarks switch it off to time cuDNN's."""
MLP_MULTIPLE = 128
"""On CUDA, the blocks' MLP hidden width is padded with zero channels to a multiple of this
(`base.pad_mlps`: the same function), so the products' tiles divide it: SigLIP-so400m's 4,304
columns are 33.6 tiles of 128. Padded to 4,352, its FP8 tower ran 935.8 images/s against
890.7 (its products one cuBLAS kernel, 125 ms of a 256-image batch), 1.30x the padded bf16
tower, which ran 717.9 against 712.6; the vectors the same (an H100, benchmarks/RESULTS.md
section 6). 1: as the checkpoint has it. Read when an adapter is built."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# PIL resample codes as saved in preprocessor configs -> the torchvision modes transformers
# maps them to; box and hamming have no tensor implementation in torchvision.
INTERPOLATIONS = {
    0: tvF.InterpolationMode.NEAREST_EXACT,
    1: tvF.InterpolationMode.LANCZOS,
    2: tvF.InterpolationMode.BILINEAR,
    3: tvF.InterpolationMode.BICUBIC,
}


@dataclass(frozen=True)
class FixedFamily:
    """What differs between the fixed-resolution families.

    `full_class` is the dual-encoder checkpoint (vision + text), `vision_class` the
    vision-only one and `projected_class` a vision-only one that keeps the projection.
    `layers` is the attribute path of the repeated blocks inside the vision tower.
    `cls_token` and `registers` (the config attribute counting register tokens) give the
    prefix tokens the tower puts before its patches (`prefix_tokens`); `any_input_size`:
    the tower takes inputs of any size (interpolated or rotary positions), so the
    processor's size need not be the config's `image_size`.
    """

    name: str
    full_type: str | None
    vision_type: str
    full_class: str | None
    vision_class: str
    projected_class: str | None
    processor_class: str
    cls_token: bool
    layers: str
    # Whether the tower's last_hidden_state still needs its final norm (CLIP applies
    # post_layernorm to the pooled CLS state only, MetaCLIP 2 too; SigLIP, DINOv2 and
    # DINOv3 to every state).
    unnormed_states: bool = False
    registers: str | None = None
    any_input_size: bool = False
    # Where the full model's text tower pools a caption, which says how captions are
    # padded (`encoders.text`): "eos" (CLIP, MetaCLIP 2: causal, at the first EOS), "last" (SigLIP:
    # the last position of a max_length caption); None: no text tower.
    text_pooling: str | None = None

    def prefix_tokens(self, config: Any) -> int:
        """Tokens before the patches in the tower's sequence: CLS, then registers."""
        registers = int(getattr(config, self.registers, 0) or 0) if self.registers else 0
        return int(self.cls_token) + registers


FAMILIES = {
    "clip": FixedFamily(
        "clip", "clip", "clip_vision_model", "CLIPModel", "CLIPVisionModel", "CLIPVisionModelWithProjection",
        "CLIPImageProcessor", True, "encoder.layers", unnormed_states=True, text_pooling="eos",
    ),
    "siglip": FixedFamily(
        "siglip", "siglip", "siglip_vision_model", "SiglipModel", "SiglipVisionModel", None,
        "SiglipImageProcessor", False, "encoder.layers", text_pooling="last",
    ),
    "dinov2": FixedFamily(
        "dinov2", None, "dinov2", None, "Dinov2Model", None, "BitImageProcessor", True, "encoder.layer",
        any_input_size=True,
    ),
    "dinov3": FixedFamily(
        "dinov3", None, "dinov3_vit", None, "DINOv3ViTModel", None, "DINOv3ViTImageProcessor", True, "model.layer",
        registers="num_register_tokens", any_input_size=True,
    ),
    "metaclip2": FixedFamily(
        "metaclip2", "metaclip_2", "metaclip_2_vision_model", "MetaClip2Model", "MetaClip2VisionModel",
        "MetaClip2VisionModelWithProjection", "CLIPImageProcessor", True, "encoder.layers", unnormed_states=True,
        text_pooling="eos",
    ),
}
RESCALE_FIRST = frozenset({"DINOv3ViTImageProcessor"})
"""Image processors that rescale to [0, 1] before they resize (transformers' DINOv3 one),
so the resize runs on float32 pixels: their views are float32 (`FixedPreprocessor.float_views`)."""


@dataclass(frozen=True)
class FixedPreprocessor:
    """Decoded media -> uint8 views (and tiles) of the model's input size; runs in decode workers.

    Matches the transformers image processor of the checkpoint (torchvision backend):
    antialiased resize of uint8 pixels (shortest edge to `shortest_edge`, or straight to
    `resize_to`), center crop to `crop` (padding with black when the crop is larger, as
    transformers does), then the fused rescale + normalise in float32. A video is the
    same per frame. `max_tiles` > 0 adds the anyres tiles of an image.

    The workers stop before the normalisation: items carry the resized, cropped uint8
    views, half the bytes of bfloat16 (a quarter of float32) through the pipes, the host
    copies and PCIe. `normalize` runs on the device, in the adapter's forward (so inside
    a captured graph), with the processor's float32 operations, so the model input is
    bitwise what the processor gives (`normalize` on the CPU is the processor's output).

    A processor that rescales before it resizes (`rescale_first`, `RESCALE_FIRST`:
    DINOv3's) resizes float32 pixels in [0, 1], whose resized values no uint8 holds: its
    views are the rescaled, resized float32 pixels (`float_views`, four times the bytes),
    and only the normalisation is left for the device, again bitwise the processor's.
    """

    family: str
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    crop: tuple[int, int] | None
    interpolation: tvF.InterpolationMode
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    input_size: tuple[int, int]
    tokens_per_image: int
    patch_grid: tuple[int, int]
    max_tiles: int = 0
    rescale_first: bool = False

    @property
    def float_views(self) -> bool:
        """Whether views are float32 (rescaled before the resize) rather than uint8."""
        return self.rescale_first and self.rescale is not None

    @property
    def view_dtype(self) -> torch.dtype:
        return torch.float32 if self.float_views else torch.uint8

    @property
    def frame_multiple(self) -> int:
        """Every frame is encoded on its own, so any frame count works."""
        return 1

    @property
    def video_max_pixels(self) -> int:
        """Frame pixels the decoder needs: the model input with room for a 4:1 aspect
        ratio. The pipeline lets decode shrink frames to 4x this, far above what the
        resize keeps, so decoding full-size 4K frames is not paid for nothing."""
        return 4 * self.input_size[0] * self.input_size[1]

    def __call__(self, media: Any) -> EncoderInput:
        frames = getattr(media, "frames", None)
        if frames is None:
            stack = torch.from_numpy(media.pixels).permute(2, 0, 1).unsqueeze(0)
            modality, num_frames = "image", 0
        else:
            stack = torch.from_numpy(frames).permute(0, 3, 1, 2)
            modality, num_frames = "video", int(frames.shape[0])
        views = self.process(stack)
        tensors = {GLOBAL_KEY: views}
        count = views.shape[0]
        if self.max_tiles:
            tiles = self.tiles(stack[0]) if frames is None else self._no_tiles()
            tensors[LOCAL_KEY] = tiles
            count += tiles.shape[0]
        tokens = count * self.tokens_per_image
        token_grid = (views.shape[0], *self.patch_grid)
        return EncoderInput(tensors, tokens=tokens, frames=num_frames, size=tokens, modality=modality, token_grid=token_grid)

    def deferred(self, data: torch.Tensor, height: int, width: int) -> EncoderInput:
        """A JPEG the rank decodes on its GPU: every image costs `tokens_per_image`,
        whatever its size. Tiles are cut from the decoded picture on the CPU, so a tiled
        job never defers (the job spec refuses `decoder: gpu` with tiles)."""
        if self.max_tiles:
            raise ValueError("anyres tiles are cut on the CPU; a tiled job decodes its JPEGs there")
        tokens = self.tokens_per_image
        tensors = {JPEG_KEY: data, JPEG_SIZE_KEY: torch.tensor([height, width])}
        return EncoderInput(tensors, tokens=tokens, frames=0, size=tokens, modality="image", token_grid=(1, *self.patch_grid))

    def on_device(self, items: list[EncoderInput], images: torch.Tensor) -> list[EncoderInput]:
        """`deferred`'s items with their views made from their decoded (N, 3, H, W) uint8
        pictures (one size), processed together; each view is a (1, 3, h, w) slice of the batch's."""
        views = self.process(images).split(1)
        return [replace(item, tensors={GLOBAL_KEY: view}) for item, view in zip(items, views, strict=True)]

    def deferred_video(self, frames: int, height: int, width: int) -> EncoderInput:
        """A video whose `frames` sampled frames the rank's GPU decodes: one view per
        frame (no tiles: a video frame has none), whatever their size."""
        tensors = {LOCAL_KEY: self._no_tiles()} if self.max_tiles else {}
        tokens = frames * self.tokens_per_image
        return EncoderInput(tensors, tokens=tokens, frames=frames, size=tokens, modality="video", token_grid=(frames, *self.patch_grid))

    def on_device_video(self, item: EncoderInput, frames: torch.Tensor) -> EncoderInput:
        """`deferred_video`'s item with its views made from the decoded (T, 3, H, W) uint8 frames."""
        return replace(item, tensors={GLOBAL_KEY: self.process(frames), **item.tensors})

    def process(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 -> (N, 3, h, w) views of `view_dtype`, h x w = `input_size`.

        Contiguous and of their own: a crop is a view of the larger resize, which the
        item would otherwise keep alive and copy again when it is pickled.
        """
        images = self._rescaled(images)
        if self.shortest_edge is not None:
            images = self._resize(images, shortest_edge_size(*images.shape[-2:], self.shortest_edge))
        elif self.resize_to is not None:
            images = self._resize(images, self.resize_to)
        if self.crop is not None:
            images = center_crop(images, *self.crop)
        return images.contiguous()

    def tiles(self, image: torch.Tensor) -> torch.Tensor:
        """(3, H, W) uint8 -> (tiles, 3, h, w) local tiles of `view_dtype`; none when the best grid is 1 x 1."""
        grid = select_grid(image.shape[-2], image.shape[-1], *self.input_size, self.max_tiles)
        if grid == (1, 1):
            return self._no_tiles()
        return cut_tiles(self._rescaled(image), grid, self.input_size, self.interpolation)

    def _no_tiles(self) -> torch.Tensor:
        """Video frames and images no larger than a tile get an empty tile tensor (0 local tokens)."""
        return torch.empty((0, 3, *self.input_size), dtype=self.view_dtype)

    def _rescaled(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 pixels as the resize takes them: as they are, or with `float_views`
        times the rescale factor in float32 (the processor's `image * scale`)."""
        return images * self.rescale if self.float_views else images

    def pixel_scale(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and std scaled by 1/rescale, computed in float32 on the CPU as transformers
        does, shaped (3, 1, 1) and moved to `device`; None without normalisation. The
        adapter makes them once: a captured graph cannot copy constants from host memory.
        Float views are rescaled already: their mean and std are the processor's own."""
        if self.mean is None or self.std is None:
            return None
        factor = 1.0 / self.rescale if self.rescale is not None and not self.float_views else 1.0
        mean = torch.tensor(self.mean) * factor
        std = torch.tensor(self.std) * factor
        return mean.view(3, 1, 1).to(device), std.view(3, 1, 1).to(device)

    def normalize(self, images: torch.Tensor, scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(N, 3, h, w) views -> float32: rescale and normalise fused into one subtract and
        one divide (float views: the normalisation alone), the processor's operations in
        its order (torchvision's `normalize` minus its host-side checks, which a captured
        graph cannot run), so CPU and GPU give its bits. `scale` is
        `pixel_scale(images.device)`, made once by the caller."""
        pixels = images.to(torch.float32)
        if self.mean is None or self.std is None:
            return pixels * self.rescale if self.rescale is not None and not self.float_views else pixels
        mean, std = scale if scale is not None else self.pixel_scale(images.device)
        return (pixels - mean) / std

    def _resize(self, images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return tvF.resize(images, list(size), interpolation=self.interpolation, antialias=True)


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(h, w) with the shorter side `edge` and the longer truncated to keep the aspect ratio
    (transformers' `default_to_square=False` rule, which truncates rather than rounds)."""
    if width <= height:
        return int(edge * height / width), edge
    return edge, int(edge * width / height)


def center_crop(images: torch.Tensor, crop_h: int, crop_w: int) -> torch.Tensor:
    """Crop the centre, offsets truncated towards the top-left; a side shorter than the
    crop is first padded with black, split evenly with the odd pixel at the bottom/right."""
    height, width = images.shape[-2:]
    if crop_h > height or crop_w > width:
        pad_w, pad_h = max(crop_w - width, 0), max(crop_h - height, 0)
        images = tvF.pad(images, [pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2], fill=0)
        height, width = images.shape[-2:]
    top, left = int((height - crop_h) / 2.0), int((width - crop_w) / 2.0)
    return images[..., top : top + crop_h, left : left + crop_w]


class FixedResAdapter(EncoderAdapter):
    """A CLIP, MetaCLIP 2, SigLIP, DINOv2 or DINOv3 vision tower run on batches of fixed-size images.

    `views` lists the item tensors this adapter produces: the global views, plus the
    local tiles with `tiling: anyres`, where `paths` declares a global and a local path
    (the batch encoder runs one graph set per path's key through `path_input` and
    merges them with `combine`). `per_token` makes `forward` return every view's patch
    tokens instead of its pooled vector (not with tiles, which have no place in a view's
    token grid: the job refuses that combination). `prefix` is the count of tokens before
    the patches (CLS and registers), which patch means and per-token rows leave out.
    """

    def __init__(
        self,
        spec: FixedFamily,
        tower: torch.nn.Module,
        projection: torch.nn.Module | None,
        processing: FixedPreprocessor,
        placement: Placement,
        pool: str,
        tile_combine: str,
        per_token: bool = False,
    ) -> None:
        super().__init__(spec, processing, placement)
        self.tower = tower
        self.projection = projection
        self.pool = pool
        self.tile_combine = tile_combine
        self.per_token = per_token
        # The tokens an image costs beyond its patches (`FixedFamily.prefix_tokens` where
        # the processing was loaded), so an adapter of any spec knows them.
        self.prefix = processing.tokens_per_image - processing.patch_grid[0] * processing.patch_grid[1]
        self.rows_per_view = processing.patch_grid[0] * processing.patch_grid[1] if per_token else 1
        self.tokens_per_image = self.budget_unit = processing.tokens_per_image
        self.feature_dim = int(projection.out_features if projection is not None else tower.config.hidden_size)
        tiled = processing.max_tiles > 0
        self.views = (GLOBAL_KEY, LOCAL_KEY) if tiled else (GLOBAL_KEY,)
        if tiled:
            self.paths = (PathSpec("global", GLOBAL_KEY), PathSpec("local", LOCAL_KEY))
        self.embed_dim = self.feature_dim * (2 if tiled and tile_combine == "concat" else 1)
        self.min_budget = self.tokens_per_image
        self.max_budget = self.tokens_per_image * MAX_IMAGES_PER_BATCH
        self.pixel_scale = processing.pixel_scale(placement.device)
        self.pixels = self._normalized  # compiled by `compile`

    def preprocessor(self) -> FixedPreprocessor:
        return self.processing

    def compile_units(self) -> list[torch.nn.Module]:
        return blocks_at(self.tower, self.spec.layers)

    def compile(self, dynamic: bool) -> None:
        """The blocks as every adapter compiles them, and `pixels`: run eagerly, the views'
        conversion to float32, subtraction, division and cast were kernels of their own
        over the whole batch (on an H100, 7.8 ms of SigLIP-so400m-384's 256-image batch of
        358, benchmarks/RESULTS.md section 7); compiled, they are one."""
        super().compile(dynamic)
        self.pixels = torch.compile(self._normalized, dynamic=dynamic, options=base.COMPILE_OPTIONS)

    def _normalized(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, h, w) views -> the tower's pixels: normalised (`FixedPreprocessor.normalize`)
        and in the model's dtype."""
        return self.processing.normalize(images, self.pixel_scale).to(self.dtype)

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        p = self.processing
        info.update(
            source=self.source,
            input_size=list(p.input_size),
            tokens_per_image=self.tokens_per_image,
            pool=self.pool,
            per_token=self.per_token,
            max_tiles=p.max_tiles,
            tile_combine=self.tile_combine if p.max_tiles else None,
        )
        return info

    def images_for(self, budget: int) -> int:
        """How many images a budget's buffers hold; a budget below one image holds none."""
        count = budget // self.tokens_per_image
        if count < 1:
            raise ValueError(
                f"token budget {budget} is smaller than one image ({self.tokens_per_image} tokens for "
                f"{self.family} at {self.processing.input_size[0]}x{self.processing.input_size[1]}); "
                f"use budgets that are multiples of {self.tokens_per_image}"
            )
        return count

    def static_inputs(self, budget: int, max_items: int, max_frames: int) -> StaticInputs:
        """budget // tokens_per_image black images, views of the processor's dtype (a
        valid dummy batch: every normalised pixel is finite)."""
        height, width = self.processing.input_size
        dtype = self.processing.view_dtype
        pixels = torch.zeros(self.images_for(budget), 3, height, width, dtype=dtype, device=self.device)
        return StaticInputs({GLOBAL_KEY: pixels}, constants={"budget": budget})

    def batch_values(self, items: list[EncoderInput], static: StaticInputs) -> dict[str, torch.Tensor]:
        return {GLOBAL_KEY: self._joined(items)}

    def eager_inputs(self, items: list[EncoderInput]) -> StaticInputs:
        return StaticInputs({GLOBAL_KEY: self._joined(items).to(self.device, non_blocking=True)})

    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        """(N, 3, h, w) views -> (N, feature_dim): one embedding per image, in input order
        (per token: (N * patches, feature_dim), each image's patch tokens in turn).
        Normalising here puts it on the device, inside a captured graph."""
        output = self.tower(pixel_values=self.pixels(inputs.tensors[GLOBAL_KEY]))
        if self.per_token:
            return self._patch_tokens(output.last_hidden_state)
        if self.pool == "patch_mean":
            pooled = output.last_hidden_state[:, self.prefix :].mean(dim=1)
        else:
            pooled = output.pooler_output
        return pooled if self.projection is None else self.projection(pooled)

    def _patch_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """(N, tokens, hidden) final states -> (N * patches, feature_dim): the patch
        tokens in the space of the family's pooled vector (see the module docstring)."""
        tokens = states[:, self.prefix :]
        if self.spec.unnormed_states:
            tokens = self.tower.post_layernorm(tokens)
        if self.projection is not None:
            tokens = self.projection(tokens)
        return tokens.reshape(-1, tokens.shape[-1])

    def row_counts(self, items: list[EncoderInput]) -> list[int]:
        """One row per global view of each item (1 for an image, one per frame for a
        video; for a local path's input, one per tile: `path_input` puts them there), or
        with `per_token` one per patch token of each view."""
        return [views * self.rows_per_view for views in self._views(items)]

    @staticmethod
    def _views(items: list[EncoderInput]) -> list[int]:
        return [item.tensors[GLOBAL_KEY].shape[0] for item in items]

    def path_input(self, item: EncoderInput, key: str) -> EncoderInput | None:
        """The part of `item` one path encodes (its views under `key`) as an ordinary item,
        or None when it has none (an image without tiles). Only the global views are the
        video's frames; tiles count no frames."""
        views = item.tensors.get(key)
        if views is None or views.shape[0] == 0:
            return None
        tokens = views.shape[0] * self.tokens_per_image
        frames = item.frames if key == GLOBAL_KEY else 0
        return EncoderInput({GLOBAL_KEY: views}, tokens=tokens, frames=frames, size=tokens, modality=item.modality)

    def combine(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-view rows of both paths -> (views, embed_dim) float32 (see the module docstring)."""
        global_rows = parts[GLOBAL_KEY].float()
        tiles = parts.get(LOCAL_KEY)
        local = global_rows if tiles is None else tiles.float().mean(dim=0, keepdim=True).expand_as(global_rows)
        if self.tile_combine == "concat":
            return torch.cat([global_rows, local], dim=-1)
        return (global_rows + local) / 2

    def _joined(self, items: list[EncoderInput]) -> torch.Tensor:
        """All items' views in one new tensor (of `view_dtype`), joined by one `cat`, page-locked
        when it feeds a GPU so the copy to the device is asynchronous. Views the GPU
        decoded are already there: then the batch is joined on the device."""
        parts = [item.tensors[GLOBAL_KEY] for item in items]
        views = sum(self._views(items))
        if any(part.device.type != "cpu" for part in parts):
            return torch.cat([part.to(self.device, non_blocking=True) for part in parts])
        shape = (views, 3, *self.processing.input_size)
        out = torch.empty(shape, dtype=self.processing.view_dtype, pin_memory=self.pin_memory)
        return torch.cat(parts, out=out)


BUILTIN_VERSION = 1
BUILTIN_VISION: dict[str, dict[str, Any]] = {
    "clip": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16),
    "siglip": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16),
    # image_size 70 (5x5 positions) against a 56-pixel crop exercises the position
    # interpolation every real DINOv2 checkpoint runs (518 pretraining size, 224 crop).
    "dinov2": dict(hidden_size=64, mlp_ratio=2, num_hidden_layers=2, num_attention_heads=4, image_size=70, patch_size=14),
    # Two registers between CLS and the patches, which pooling and per-token rows skip.
    "dinov3": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16,
        num_register_tokens=2,
    ),
    "metaclip2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16),
}
BUILTIN_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128,
    max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
BUILTIN_PROCESSORS: dict[str, dict[str, Any]] = {
    "clip": dict(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
    "siglip": dict(size={"height": 64, "width": 64}),
    "dinov2": dict(
        size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56}, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD)
    ),
    # 64 x 80 against the config's 64: rotary positions take any size, and a 4 x 5 grid
    # keeps rows and columns of per-token output apart.
    "dinov3": dict(size={"height": 64, "width": 80}),
    "metaclip2": dict(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
}


def _build_builtin(spec: FixedFamily) -> torch.nn.Module:
    """The tiny model: the full dual encoder where the family has one, so the demo loads
    through the same path as a user's CLIP, MetaCLIP 2 or SigLIP checkpoint."""
    vision = BUILTIN_VISION[spec.name]
    if spec.name == "clip":
        config = transformers_class("CLIPConfig")(text_config=BUILTIN_TEXT, vision_config=vision, projection_dim=48)
    elif spec.name == "siglip":
        config = transformers_class("SiglipConfig")(text_config=BUILTIN_TEXT, vision_config=vision)
    elif spec.name == "metaclip2":
        config = transformers_class("MetaClip2Config")(text_config=BUILTIN_TEXT, vision_config=vision, projection_dim=48)
    elif spec.name == "dinov3":
        config = transformers_class("DINOv3ViTConfig")(**vision)
    else:
        config = transformers_class("Dinov2Config")(**vision)
    cls = transformers_class(spec.full_class or spec.vision_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls._from_config(config, dtype=torch.float32)


def builtin_dir(spec: FixedFamily, cache_dir: Path | str) -> Path:
    """The tiny builtin model of `spec` with its image processor config."""

    def build(tmp: Path) -> None:
        _build_builtin(spec).save_pretrained(tmp)
        transformers_class(spec.processor_class)(**BUILTIN_PROCESSORS[spec.name]).save_pretrained(tmp)

    return builtin_model(cache_dir, spec.name, BUILTIN_VERSION, build)


def load_model(
    spec: FixedFamily, directory: Path, dtype: torch.dtype, text: bool = False
) -> tuple[torch.nn.Module, torch.nn.Module | None, torch.nn.Module | None]:
    """The vision tower, its projection (None where the checkpoint has none) and, with
    `text`, the full model the text tower is taken from (else None).

    A full dual encoder is loaded whole (once, whether or not its text tower is kept,
    which works across transformers versions whatever their weight-name layout); without
    `text` its text tower is dropped. A vision-only checkpoint is loaded as the class it
    was saved from, and refused with `text` (ValueError: it has no text tower).
    """
    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    if spec.full_class is not None and model_type == spec.full_type:
        full = transformers_class(spec.full_class).from_pretrained(directory, dtype=dtype)
        return full.vision_model, getattr(full, "visual_projection", None), full if text else None
    if text and model_type == spec.vision_type:
        full_type = f"model_type {spec.full_type!r}, vision and text" if spec.full_type else "a family with text"
        raise ValueError(
            f"checkpoint {directory} is a vision-only {spec.name} model ({model_type!r}) with no text tower for "
            f"input.text_column or output.labels; name the full checkpoint ({full_type}) or remove those keys"
        )
    if model_type == spec.vision_type:
        if spec.projected_class is not None and spec.projected_class in (config.get("architectures") or []):
            model = transformers_class(spec.projected_class).from_pretrained(directory, dtype=dtype)
            return model.vision_model, model.visual_projection, None
        if spec.projected_class is not None:
            logger.warning("%s has no visual projection: embeddings are the tower's pooled features", directory)
        return transformers_class(spec.vision_class).from_pretrained(directory, dtype=dtype), None, None
    expected = " or ".join(repr(t) for t in (spec.full_type, spec.vision_type) if t)
    hint = next((f"; set model.family to {f.name!r}" for f in FAMILIES.values() if model_type in (f.full_type, f.vision_type)), "")
    raise ValueError(f"checkpoint {directory} has model_type {model_type!r}; model.family {spec.name!r} expects {expected}{hint}")


def _field(size: Any, name: str) -> Any:
    """A key of a size spec, which transformers gives as a SizeDict or a plain dict."""
    if size is None:
        return None
    return size.get(name) if isinstance(size, dict) else getattr(size, name, None)


def _default_processor(spec: FixedFamily, image_size: int) -> Any:
    """The family's processor for a checkpoint saved without one: the model's own input
    size, for DINOv2 its published 256 -> 224 crop with ImageNet statistics, and for
    DINOv3 its processor's own defaults (ImageNet statistics) at the model's size."""
    cls = transformers_class(spec.processor_class)
    if spec.name in ("siglip", "dinov3"):
        return cls(size={"height": image_size, "width": image_size})
    if spec.name == "dinov2":
        return cls(
            size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD)
        )
    return cls(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


def load_processing(spec: FixedFamily, directory: Path, vision_config: Any, max_tiles: int) -> FixedPreprocessor:
    """The checkpoint's image processor settings as a picklable `FixedPreprocessor`.

    Raises ValueError for settings that give no fixed input size (a resize without a
    crop to a shortest edge) or that the model cannot take (CLIP, MetaCLIP 2 and SigLIP
    need their configured image size).
    """
    if (directory / "preprocessor_config.json").exists():
        processor = transformers_class("AutoImageProcessor").from_pretrained(directory)
    else:
        logger.warning("%s has no preprocessor_config.json; using %s defaults", directory, spec.processor_class)
        processor = _default_processor(spec, int(vision_config.image_size))
    size = processor.size if processor.do_resize else None
    for unsupported in ("longest_edge", "max_height", "max_width"):
        if _field(size, unsupported):
            raise ValueError(f"{directory}: image processor size {unsupported!r} is not supported for {spec.name}")
    shortest = _field(size, "shortest_edge")
    resize_to = (int(_field(size, "height")), int(_field(size, "width"))) if _field(size, "height") else None
    crop_size = processor.crop_size if getattr(processor, "do_center_crop", False) else None
    crop = (int(_field(crop_size, "height")), int(_field(crop_size, "width"))) if crop_size is not None else None
    input_size = crop or resize_to
    if input_size is None:
        raise ValueError(f"{directory}: the image processor gives no fixed input size (no crop and no height/width resize)")
    patch = int(vision_config.patch_size)
    if not spec.any_input_size and input_size != (int(vision_config.image_size),) * 2:
        raise ValueError(f"{directory}: the processor makes {input_size} images but the model takes {vision_config.image_size}")
    resample = int(processor.resample)
    if resample not in INTERPOLATIONS:
        raise ValueError(f"{directory}: resample={resample} has no torchvision tensor implementation; use 0, 1, 2 or 3")
    return FixedPreprocessor(
        family=spec.name,
        shortest_edge=int(shortest) if shortest else None,
        resize_to=resize_to,
        crop=crop,
        interpolation=INTERPOLATIONS[resample],
        rescale=float(processor.rescale_factor) if processor.do_rescale else None,
        mean=tuple(float(v) for v in processor.image_mean) if processor.do_normalize else None,
        std=tuple(float(v) for v in processor.image_std) if processor.do_normalize else None,
        input_size=input_size,
        tokens_per_image=(input_size[0] // patch) * (input_size[1] // patch) + spec.prefix_tokens(vision_config),
        patch_grid=(input_size[0] // patch, input_size[1] // patch),
        max_tiles=max_tiles,
        rescale_first=any(cls.__name__ in RESCALE_FIRST for cls in type(processor).__mro__),
    )


class PatchProduct(torch.nn.Module):
    """A patch embedding's convolution whose kernel is its stride (no padding, dilation or
    groups) as one matrix product of each patch's pixels with the flattened kernel.

    On an H100 cuDNN ran SigLIP-so400m-384's bf16 patch convolution over a batch of 256
    images in 8.2 ms (`precomputed_convolve_sgemm`), a product that cuBLAS runs in 1.5
    (benchmarks/RESULTS.md section 7). The output is the convolution's (N, out, h,
    w) seen through a permute of a row-major (N, h, w, out) tensor, so the
    `flatten(2).transpose(1, 2)` by which every family's embeddings turn it into tokens
    is row-major: the hidden state enters the first block contiguous. (A convolution's
    own output is laid out by channel, and SigLIP's state, added to its position
    embeddings, kept that transpose: each compiled block's norms then read rows at a
    stride of `tokens` elements, bf16 1 % and FP8 4 % slower, RESULTS.md's git history.)

    Invariants: the output equals the convolution's up to the products' summation order;
    pixels past the last whole patch are dropped, as the convolution drops them; the
    weight and bias are the convolution's own parameters (names and shapes unchanged).
    """

    def __init__(self, conv: torch.nn.Conv2d) -> None:
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = conv.kernel_size

    @staticmethod
    def fits(module: torch.nn.Module) -> bool:
        """Whether `module` is a convolution this product computes."""
        return (
            type(module) is torch.nn.Conv2d and module.kernel_size == module.stride and module.groups == 1
            and module.dilation == (1, 1) and module.padding in ((0, 0), "valid")
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        count, channels, height, width = pixels.shape
        patch_h, patch_w = self.kernel_size
        rows, cols = height // patch_h, width // patch_w
        patches = pixels[:, :, : rows * patch_h, : cols * patch_w].reshape(count, channels, rows, patch_h, cols, patch_w)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(count * rows * cols, channels * patch_h * patch_w)
        out = torch.nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.view(count, rows, cols, self.out_channels).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size=stride={self.kernel_size}, as one matrix product"


def patch_products(module: torch.nn.Module) -> int:
    """Replace every convolution under `module` that `PatchProduct` computes by one, where
    `PATCH_PRODUCTS` is on; how many."""
    replaced = 0
    if not PATCH_PRODUCTS:
        return replaced
    for name, child in list(module.named_modules()):
        if name and PatchProduct.fits(child):
            parent, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attribute, PatchProduct(child))
            replaced += 1
    return replaced


def blocks_at(tower: torch.nn.Module, layers: str) -> list[torch.nn.Module]:
    """The blocks of `tower` at attribute path `layers` (`FixedFamily.layers`)."""
    return list(functools.reduce(getattr, layers.split("."), tower))


def build_adapter(family: str, path: str, dtype: torch.dtype, device: torch.device, options: AdapterOptions) -> FixedResAdapter:
    """Load a fixed-resolution tower on `device` in `dtype`, with the job's pooling and tiling."""
    spec = FAMILIES[family]
    directory = resolve_checkpoint(
        path, spec.name, FAMILIES, lambda: builtin_dir(spec, options.cache_dir), download_snapshot
    )
    tower, projection, full = load_model(spec, directory, dtype, text=options.text)
    tower = tower.to(device).eval().requires_grad_(False)
    patch_products(tower.embeddings)
    if device.type == "cuda":
        pad_mlps(blocks_at(tower, spec.layers), MLP_MULTIPLE)
    if projection is not None:
        projection = projection.to(device).eval().requires_grad_(False)
    pool = "patch_mean" if options.pool == "patch_mean" else "pooler"
    if spec.name == "siglip" and not getattr(tower.config, "vision_use_head", True):
        raise ValueError(f"checkpoint {directory} has no SigLIP pooling head (vision_use_head=false), so no image embedding")
    max_tiles = options.max_tiles if options.tiling == "anyres" else 0
    processing = load_processing(spec, directory, tower.config, max_tiles)
    placement = options.placement(device, dtype, path)
    adapter = FixedResAdapter(spec, tower, projection, processing, placement, pool, options.tile_combine, per_token=options.per_token)
    if full is not None:
        adapter.text = build_text(spec.name, spec.text_pooling, full, directory, placement)
    return adapter


def build_text(family: str, pooling: str | None, full: torch.nn.Module, directory: Path, placement: Placement) -> TextAdapter:
    """The text tower of a loaded transformers dual encoder (CLIP, MetaCLIP 2, SigLIP,
    SigLIP 2: `text_model`, its blocks at `encoder.layers`, a `text_projection` beside it
    or a head inside it) on the placement's device, with the checkpoint's tokenizer:
    captions of the text model's length, padded as its `pooling` needs (`encoders.text`:
    "eos" on the right with the pad id, "last" by the tokenizer to max_length, every
    position attended: `attention.register_unmasked`, and then its blocks compile with
    the image tower's). A tokenizer with nothing to pad a
    caption with is a ValueError."""
    tokenizer = load_tokenizer(str(directory))
    model = full.text_model.to(placement.device).eval().requires_grad_(False)
    projection = getattr(full, "text_projection", None)
    if projection is not None:
        projection = projection.to(placement.device).eval().requires_grad_(False)
    pad_with = None
    if pooling == "eos":
        pad_with = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_with is None:
            raise ValueError(f"the tokenizer of {directory} has neither a pad nor an EOS token to pad captions with")
    elif tokenizer.pad_token_id is None:
        raise ValueError(f"the tokenizer of {directory} has no pad token, and {family} pools captions padded to their length")
    if pooling == "last":
        # Every position attended, pads included: no mask, so graphs and eager runs agree.
        model.config._attn_implementation = register_unmasked()
    length = int(model.config.max_position_embeddings)
    width = int(projection.out_features if projection is not None else model.config.projection_size)
    processing = TextPreprocessor(str(directory), length, pad_with)
    return TextAdapter(family, PooledText(model, projection), model.encoder.layers, width, processing, placement, compiles=pooling == "last")
