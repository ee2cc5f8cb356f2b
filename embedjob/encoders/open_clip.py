"""OpenCLIP image towers (the `open_clip_torch` package, `pip install 'embedjob[open_clip]'`).

A checkpoint is what OpenCLIP's hub repositories hold: `open_clip_config.json` (the
model's `model_cfg` and the image transform's `preprocess_cfg`) beside its weights,
`open_clip_model.safetensors` or else `open_clip_pytorch_model.bin`. `model.path` names
a local directory of that layout, or a hub repository (`hf-hub:org/name`, or plain
`org/name`), of which only those two files are fetched. The whole model is loaded
(`open_clip.create_model`), kept as `adapter.model`; its text tower embeds captions and
label prompts where the job asks (`build_text`, below).

The tower is open_clip's own ViT (`VisionTransformer`): every image is resized to the
model's input size, so it costs `tokens_per_image` = patches + 1 (the class token)
encoder tokens, and a batch of n images is one (n, 3, H, W) tensor whose images never
attend to each other. Its blocks' self-attention runs batch first, as transformers' CLIP
blocks attend (`BatchFirstAttention`, the same values). Budgets, batches, video frames,
tiles and the dual path are the fixed-resolution towers' (see fixed.py, whose adapter
and preprocessing this module extends): only what OpenCLIP does differently is here.

The vector of an image is `model.encode_image(pixels)` (projected, not normalised;
`output.normalize` normalises as for every family). Per-token output
(`output.pooling: none`): one row per patch token, row-major over the patch grid, the
class token left out; a token is the last block's patch state through the tower's
final norm (`ln_post`) and its projection (`proj`), so it lies in the space of the
image vector (which, with `pool_type: avg`, is their mean). A tower that pools by
attention (`attentional_pool`, CoCa) has no such tokens: that job is refused.

Preprocessing matches OpenCLIP's inference transform (`image_transform` with
`is_train=False`) from the checkpoint's `preprocess_cfg`: `resize_mode` shortest (the
shorter side to the input size, then a centre crop), longest (the longer side to it,
then padding with `fill_color` and a centre crop) or squash (straight to the input
size), with `interpolation` bicubic or bilinear, then `mean`/`std`. OpenCLIP resizes PIL
images, whose antialiased filters differ from torchvision's tensor resize by a level or
two in about 7 % of the pixels, so the decode workers resize with PIL as OpenCLIP does,
and an image's vector is OpenCLIP's to float rounding. Views the rank's GPU decodes
(`preprocess.decoder: gpu`) are resized there with torchvision's tensor resize, which
adds that difference. The workers ship the resized, cropped uint8 views; normalising
runs on the device, inside the captured graph (`FixedPreprocessor.normalize`). Decoded
images are RGB, with transparency composited on white by the decode stage, where
OpenCLIP's `convert("RGB")` drops the alpha channel and keeps the hidden colours.

Captions (`input.text_column`, `output.labels`; `encoders.text` has the contract): a
caption's vector is `model.encode_text(ids)` (projected, not normalised), its ids what
OpenCLIP's own tokenizer for the checkpoint gives (`open_clip.get_tokenizer` of the
directory: CLIP's BPE, shipped inside the package, padded with zeros to the text
config's `context_length`; or the Hugging Face tokenizer its `hf_tokenizer_name` names,
read from the checkpoint directory, never fetched). Every caption is that one length,
however the tower pools it (argmax at CLIP's end token, the last position, an EOS id):
the tokenizer pads it as the model was trained, so pad rows cannot move a real row's
pooled position. The text tower must be OpenCLIP's own `TextTransformer` (CLIP keeps its
parts on the model itself); its forward has no host synchronisation (its causal mask a
buffer, its pooling index computed on the device), so it is captured like the others.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision.transforms.functional as pil_functional
import torchvision.transforms.v2.functional as tvF
from PIL import Image

from embedjob.config import JobError
from embedjob.encoders.base import Placement, StaticInputs
from embedjob.encoders.fixed import GLOBAL_KEY, FixedPreprocessor, FixedResAdapter, patch_products
from embedjob.encoders.loading import AdapterOptions, builtin_model, resolve_checkpoint
from embedjob.encoders.registry import OPEN_CLIP_CONFIG, OPEN_CLIP_HUB
from embedjob.encoders.text import TOKENIZER_FILES, TextAdapter, TextPreprocessor, has_tokenizer, load_in_one_line


NAME = "open_clip"
EXTRA = "pip install 'embedjob[open_clip]'"
WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
"""The weights files of a checkpoint, in the order OpenCLIP prefers them."""
INTERPOLATIONS = {"bicubic": tvF.InterpolationMode.BICUBIC, "bilinear": tvF.InterpolationMode.BILINEAR}
"""OpenCLIP's inference interpolations; its 'random' means bicubic at inference."""
RESIZE_MODES = ("shortest", "longest", "squash")


@dataclass(frozen=True)
class OpenClipFamily:
    """The family as `EncoderAdapter` keeps it (`spec`): its name and where the tower's
    repeated blocks are (what `batching.compile` compiles and FP8 converts)."""

    name: str = NAME
    layers: str = "transformer.resblocks"


FAMILIES = {NAME: OpenClipFamily()}


def import_open_clip() -> Any:
    """The `open_clip` package, or a JobError naming the extra to install."""
    try:
        import open_clip
    except ImportError as exc:
        raise JobError(f"model.family 'open_clip' needs the open_clip_torch package ({exc}): {EXTRA}") from None
    return open_clip


@dataclass(frozen=True)
class OpenClipPreprocessor(FixedPreprocessor):
    """Decoded media -> uint8 views of the model's input size by OpenCLIP's inference
    transform (see the module docstring); runs in decode workers.

    `resize_mode` and `fill_color` replace the transformers processor's size and crop
    fields of `FixedPreprocessor` (left unset here); its normalisation, tiles, video
    frames and GPU-decoded items are used as they are. Invariant: on the CPU a view is
    bitwise the uint8 picture OpenCLIP's transform has before `ToTensor`.
    """

    resize_mode: str = "shortest"
    fill_color: int = 0

    def process(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) uint8 -> (N, 3, h, w) uint8 views, h x w = `input_size`: resized
        with PIL on the CPU (OpenCLIP's own resize), with torchvision on a GPU."""
        if images.shape[0] == 0:
            return torch.empty((0, 3, *self.input_size), dtype=torch.uint8, device=images.device)
        if images.device.type != "cpu":
            size, interpolation = self.resized_size(*images.shape[-2:])
            if size != tuple(images.shape[-2:]):
                images = tvF.resize(images, list(size), interpolation=interpolation, antialias=True)
            return self.crop_or_pad(images).contiguous()
        return torch.stack([self.crop_or_pad(self._pil_resized(image)) for image in images])

    def _pil_resized(self, image: torch.Tensor) -> torch.Tensor:
        """(3, H, W) uint8 -> (3, h', w') uint8 resized as a PIL image, as OpenCLIP's
        transform resizes it (torchvision's PIL resize; none where the size is kept)."""
        size, interpolation = self.resized_size(*image.shape[-2:])
        if size == tuple(image.shape[-2:]):
            return image
        picture = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
        resized = pil_functional.resize(picture, list(size), interpolation=interpolation)
        return torch.from_numpy(np.array(resized)).permute(2, 0, 1)

    def resized_size(self, height: int, width: int) -> tuple[tuple[int, int], tvF.InterpolationMode]:
        """The (h, w) OpenCLIP resizes a (height, width) image to, and with which filter.

        shortest, square input: torchvision's `Resize(side)` (the shorter side to `side`,
        the longer truncated); shortest, oblong input, and longest: OpenCLIP's
        `ResizeKeepRatio` (each side divided by the smaller or larger of the two ratios
        to the input size, rounded), which for shortest ignores the configured filter
        and is always bicubic; squash: the input size. A side that rounds to 0 pixels
        (longest, a 1:12 strip) is kept at 1, where OpenCLIP's transform fails.
        """
        target_h, target_w = self.input_size
        if self.resize_mode == "squash":
            return (target_h, target_w), self.interpolation
        if self.resize_mode == "shortest" and target_h == target_w:
            short, long = min(height, width), max(height, width)
            new_short, new_long = target_h, int(target_h * long / short)
            return ((new_long, new_short) if width <= height else (new_short, new_long)), self.interpolation
        ratios = (height / target_h, width / target_w)
        ratio = max(ratios) if self.resize_mode == "longest" else min(ratios)
        interpolation = self.interpolation if self.resize_mode == "longest" else tvF.InterpolationMode.BICUBIC
        return (max(round(height / ratio), 1), max(round(width / ratio), 1)), interpolation

    def crop_or_pad(self, images: torch.Tensor) -> torch.Tensor:
        """OpenCLIP's (and torchvision's) centre crop to `input_size`: a side shorter than
        the crop is first padded (`fill_color` in longest mode, black otherwise), the odd
        pixel at the bottom/right; crop offsets are rounded, half to even."""
        crop_h, crop_w = self.input_size
        height, width = images.shape[-2:]
        if crop_h > height or crop_w > width:
            pad_w, pad_h = max(crop_w - width, 0), max(crop_h - height, 0)
            fill = self.fill_color if self.resize_mode == "longest" else 0
            images = tvF.pad(images, [pad_w // 2, pad_h // 2, (pad_w + 1) // 2, (pad_h + 1) // 2], fill=fill)
            height, width = images.shape[-2:]
        top, left = int(round((height - crop_h) / 2.0)), int(round((width - crop_w) / 2.0))
        return images[..., top : top + crop_h, left : left + crop_w]


def load_processing(visual: torch.nn.Module, max_tiles: int) -> OpenClipPreprocessor:
    """The tower's image transform (`visual.preprocess_cfg`, which `create_model` set from
    the checkpoint's `preprocess_cfg` with the tower's own image size) as a picklable
    `OpenClipPreprocessor`; a ValueError for settings OpenCLIP's transform refuses too."""
    cfg = getattr(visual, "preprocess_cfg", None) or {}
    size = visual.image_size
    height, width = (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
    interpolation = cfg.get("interpolation") or "bicubic"
    resize_mode = cfg.get("resize_mode") or "shortest"
    if interpolation not in (*INTERPOLATIONS, "random"):
        raise ValueError(f"preprocess_cfg interpolation {interpolation!r} is not one OpenCLIP knows: bicubic or bilinear")
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"preprocess_cfg resize_mode {resize_mode!r} is not one OpenCLIP knows: {', '.join(RESIZE_MODES)}")
    grid = tuple(int(g) for g in visual.grid_size)
    return OpenClipPreprocessor(
        family=NAME,
        shortest_edge=None,
        resize_to=None,
        crop=None,
        interpolation=INTERPOLATIONS.get(interpolation, tvF.InterpolationMode.BICUBIC),
        rescale=1 / 255,
        mean=_channels(cfg.get("mean")),
        std=_channels(cfg.get("std")),
        input_size=(height, width),
        tokens_per_image=grid[0] * grid[1] + 1,
        patch_grid=(grid[0], grid[1]),
        max_tiles=max_tiles,
        resize_mode=resize_mode,
        fill_color=int(cfg.get("fill_color") or 0),
    )


def _channels(values: Any) -> tuple[float, float, float]:
    """A mean or std as three floats (OpenCLIP repeats a single number per channel)."""
    if not isinstance(values, (list, tuple)):
        return (float(values),) * 3
    return tuple(float(v) for v in values)  # type: ignore[return-value]


class VisualProjection(torch.nn.Module):
    """The tower's projection (`visual.proj`, a bare (width, embed_dim) matrix that
    OpenCLIP multiplies by) as a layer with `out_features`, sharing the parameter."""

    def __init__(self, proj: torch.nn.Parameter) -> None:
        super().__init__()
        self.proj = proj
        self.in_features, self.out_features = int(proj.shape[0]), int(proj.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj


class BatchFirstAttention(torch.nn.Module):
    """The unmasked self-attention of an image block's `nn.MultiheadAttention`, computed
    in the blocks' (batch, tokens, width) layout: `qkv` (its packed in-projection as a
    linear layer) -> scaled dot-product attention per head -> `out_proj`.

    Why: with `batch_first`, `nn.MultiheadAttention` turns its input to (tokens, batch,
    width), runs `F.multi_head_attention_forward` in that layout (a copy of the whole
    packed projection to split q, k and v, strided heads for the attention kernel, a
    copy back before `out_proj`) and turns the output back, where transformers' CLIP
    blocks attend straight from the projection's output; at ViT-H-14's size the compiled
    blocks ran 0.84x open_clip compiled whole (benchmarks/RESULTS.md). Both layers are
    plain `nn.Linear`s sharing the module's parameters, so FP8 converts them and applies
    `ln_1` in `qkv` as for the other families. Invariant: for an input that is query, key
    and value at once and no mask, the output equals the module's to float rounding."""

    def __init__(self, attention: torch.nn.MultiheadAttention) -> None:
        super().__init__()
        width = attention.embed_dim
        self.heads = attention.num_heads
        self.qkv = torch.nn.Linear(width, 3 * width, bias=attention.in_proj_bias is not None)
        self.qkv.weight = attention.in_proj_weight
        self.qkv.bias = attention.in_proj_bias
        self.out_proj = torch.nn.Linear(width, width, bias=attention.out_proj.bias is not None)
        self.out_proj.weight = attention.out_proj.weight
        self.out_proj.bias = attention.out_proj.bias

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, need_weights: bool = False,
                attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """(batch, tokens, width) -> (output, None), as `nn.MultiheadAttention` returns
        it without weights; anything but unmasked self-attention is a ValueError."""
        if key is not query or value is not query or attn_mask is not None or need_weights:
            raise ValueError("BatchFirstAttention serves an image block's unmasked self-attention only")
        batch, tokens, width = query.shape
        qkv = self.qkv(query).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, width)), None


def attend_batch_first(visual: torch.nn.Module) -> None:
    """Replace the `nn.MultiheadAttention` of every image block whose attention
    `BatchFirstAttention` computes (one packed in-projection, no key or value biases, no
    zero-attention row) by one sharing its parameters. Blocks of other kinds (OpenCLIP's
    custom blocks) keep their own attention."""
    from open_clip.transformer import ResidualAttentionBlock

    for block in visual.transformer.resblocks:
        attention = getattr(block, "attn", None)
        if not isinstance(block, ResidualAttentionBlock) or type(attention) is not torch.nn.MultiheadAttention:
            continue
        if (attention.batch_first and attention._qkv_same_embed_dim and attention.bias_k is None and attention.bias_v is None
                and not attention.add_zero_attn):
            block.attn = BatchFirstAttention(attention)


class OpenClipAdapter(FixedResAdapter):
    """An OpenCLIP model's image tower run on batches of fixed-size images.

    `model` is the whole OpenCLIP model (text tower included), `tower` its
    `VisionTransformer`. Everything but the forward and the description is the
    fixed-resolution adapter's (fixed.py): static inputs, batch
    assembly, row counts, the tile paths and their combination.
    """

    def __init__(self, model: torch.nn.Module, processing: OpenClipPreprocessor, placement: Placement, tile_combine: str, per_token: bool) -> None:
        visual = model.visual
        super().__init__(
            FAMILIES[NAME], visual, VisualProjection(visual.proj), processing, placement, "pooler", tile_combine, per_token=per_token,
        )
        self.model = model

    def forward(self, inputs: StaticInputs) -> torch.Tensor:
        """(N, 3, h, w) uint8 -> (N, embed_dim): `model.encode_image` of the normalised
        views (per token: (N * patches, embed_dim), see the module docstring)."""
        pixels = self.pixels(inputs.tensors[GLOBAL_KEY])
        if not self.per_token:
            return self.model.encode_image(pixels, normalize=False)
        states = self.tower.forward_intermediates(pixels, indices=1, output_fmt="NLC", intermediates_only=True)
        tokens = self.projection(self.tower.ln_post(states["image_intermediates"][-1]))
        return tokens.reshape(-1, tokens.shape[-1])

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info.update(pool=self.tower.pool_type, resize_mode=self.processing.resize_mode)
        return info


def check_tower(visual: torch.nn.Module, directory: Path, per_token: bool) -> None:
    """A ValueError (a JobError for what the job asks) where the tower is not one this
    adapter runs: OpenCLIP's own ViT, pooling to one vector per image."""
    from open_clip.transformer import VisionTransformer

    if not isinstance(visual, VisionTransformer):
        raise ValueError(
            f"{directory}: its image tower is a {type(visual).__name__}; model.family 'open_clip' runs OpenCLIP's own "
            "ViT towers (VisionTransformer), not timm or ResNet towers"
        )
    attention_pooled = getattr(visual, "attn_pool", None) is not None
    if not attention_pooled and visual.pool_type not in ("tok", "avg"):
        raise ValueError(f"{directory}: its ViT pools with pool_type {visual.pool_type!r}, which gives no vector per image")
    if per_token and attention_pooled:
        raise JobError(
            f"output.pooling = 'none': {directory} pools its tokens by attention (attentional_pool), so its image vector "
            "is made of no patch token's state; use output.pooling: mean"
        )


def download_checkpoint(path: str) -> Path:
    """A hub checkpoint's `open_clip_config.json` and its weights (safetensors where the
    repository has them, else the .bin), nothing else, in one local directory."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    repo = path.removeprefix(OPEN_CLIP_HUB)
    config = Path(hf_hub_download(repo, OPEN_CLIP_CONFIG))
    for name in WEIGHTS:
        try:
            weights = Path(hf_hub_download(repo, name))
        except RemoteEntryNotFoundError:
            continue
        if weights.parent != config.parent:
            raise ValueError(f"hub repository {repo} changed while its files were fetched; run again")
        return config.parent
    raise ValueError(f"hub repository {repo} holds no {' or '.join(WEIGHTS)}")


def load_model(open_clip: Any, directory: Path) -> torch.nn.Module:
    """The OpenCLIP model of a checkpoint directory in float32 on the CPU, its weights
    required (OpenCLIP would otherwise go on with random ones)."""
    if not (directory / OPEN_CLIP_CONFIG).is_file():
        hint = "; it holds a config.json: leave model.family out to use the family it names" if (directory / "config.json").is_file() else ""
        raise ValueError(f"model.path {directory} holds no {OPEN_CLIP_CONFIG}, which an OpenCLIP checkpoint has{hint}")
    if not any((directory / name).is_file() for name in WEIGHTS):
        raise ValueError(f"model.path {directory} holds no weights: {' or '.join(WEIGHTS)}")
    return open_clip.create_model(f"local-dir:{directory}", precision="fp32", device="cpu", require_pretrained=True)


BUILTIN_VERSION = 1
BUILTIN_MODEL_CFG: dict[str, Any] = {
    "embed_dim": 48,
    "vision_cfg": {"image_size": 64, "patch_size": 16, "width": 64, "head_width": 16, "layers": 2, "mlp_ratio": 2.0},
    # The text tower takes OpenCLIP's default tokenizer (its vocabulary and context length).
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def save_checkpoint(model: torch.nn.Module, model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any], directory: Path) -> None:
    """Save an OpenCLIP model as its hub repositories hold one: `open_clip_config.json`
    (`model_cfg`, `preprocess_cfg`) and `open_clip_model.safetensors`."""
    from safetensors.torch import save_file

    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
    (directory / OPEN_CLIP_CONFIG).write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / WEIGHTS[0]))


def builtin_dir(cache_dir: Path | str) -> Path:
    """The tiny builtin model (a two-block ViT, fixed seed), saved as a user's checkpoint is."""

    def build(tmp: Path) -> None:
        open_clip = import_open_clip()
        from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = open_clip.CLIP(**BUILTIN_MODEL_CFG)
        preprocess = {"mean": list(OPENAI_DATASET_MEAN), "std": list(OPENAI_DATASET_STD), "interpolation": "bicubic", "resize_mode": "shortest"}
        save_checkpoint(model, BUILTIN_MODEL_CFG, preprocess, tmp)

    return builtin_model(cache_dir, NAME, BUILTIN_VERSION, build)


def build_adapter(family: str, path: str, dtype: torch.dtype, device: torch.device, options: AdapterOptions) -> OpenClipAdapter:
    """Load an OpenCLIP checkpoint on `device` in `dtype` (all of it: OpenCLIP's pure
    low precision, norms included), with the job's tiling and pooling."""
    open_clip = import_open_clip()
    directory = resolve_checkpoint(path, NAME, FAMILIES, lambda: builtin_dir(options.cache_dir), download_checkpoint)
    model = load_model(open_clip, directory)
    check_tower(model.visual, directory, options.per_token)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    attend_batch_first(model.visual)
    patch_products(model.visual)
    max_tiles = options.max_tiles if options.tiling == "anyres" else 0
    processing = load_processing(model.visual, max_tiles)
    placement = options.placement(device, dtype, path)
    adapter = OpenClipAdapter(model, processing, placement, options.tile_combine, options.per_token)
    if options.text:
        adapter.text = build_text(model, directory, placement)
    return adapter


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str, length: int) -> Any:
    """OpenCLIP's tokenizer for the checkpoint in `directory` (`open_clip.get_tokenizer`
    of its `open_clip_config.json`), making `length` ids a caption; loaded once per
    process (a decode worker loads it at its first caption). A ValueError in one line
    where the config names a Hugging Face tokenizer (`hf_tokenizer_name`) whose files
    the directory lacks: OpenCLIP reads them from there, and a job fetches nothing."""
    config = json.loads((Path(directory) / OPEN_CLIP_CONFIG).read_text())
    hub_name = ((config.get("model_cfg") or {}).get("text_cfg") or {}).get("hf_tokenizer_name")
    if hub_name and not has_tokenizer(directory):
        raise ValueError(
            f"checkpoint {directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}) for its text_cfg's "
            f"hf_tokenizer_name {hub_name!r}, which captions and labels need; save it beside the weights "
            f"(AutoTokenizer.from_pretrained({hub_name!r}).save_pretrained(directory)) and name that directory"
        )
    open_clip = import_open_clip()
    return load_in_one_line(directory, lambda: open_clip.get_tokenizer(f"local-dir:{directory}", context_length=length), "a tokenizer library")


@dataclass(frozen=True)
class OpenClipTextPreprocessor(TextPreprocessor):
    """A caption -> its item of `length` token ids by OpenCLIP's tokenizer for the
    checkpoint (which truncates and pads itself); picklable, run in decode workers."""

    pad_with: int | None = None

    def ids(self, text: str) -> list[int]:
        return load_tokenizer(self.directory, self.length)([text])[0].tolist()


class EncodedText(torch.nn.Module):
    """`model.encode_text` as the text adapter's tower: (n, length) ids -> (n, width),
    projected and not normalised (`output.normalize` normalises, as for images)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(ids, normalize=False)


def text_module(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """The module that holds the text transformer (`transformer`, `token_embedding`,
    `text_projection`): a `CustomTextCLIP`'s or CoCa's `text`, or the `CLIP` model
    itself, which keeps its text tower's parts as its own. A ValueError for a text tower
    of Hugging Face's (`hf_model_name`)."""
    from open_clip.transformer import TextTransformer

    text = getattr(model, "text", None)
    if isinstance(text, TextTransformer):
        return text
    if text is None and hasattr(model, "token_embedding"):
        return model
    raise ValueError(
        f"{directory}: its text tower is a {type(text).__name__}; captions and labels run OpenCLIP's own text "
        "transformer (TextTransformer), not Hugging Face text towers (text_cfg hf_model_name)"
    )


def _projected_width(projection: Any, width: int) -> int:
    """The width of a caption's vector: the projection's output (a layer, or a bare
    (width, embed_dim) matrix OpenCLIP multiplies by), or the tower's own without one."""
    if projection is None:
        return width
    return int(projection.out_features) if isinstance(projection, torch.nn.Linear) else int(projection.shape[-1])


def build_text(model: torch.nn.Module, directory: Path, placement: Placement) -> TextAdapter:
    """The loaded model's text tower as a `TextAdapter` on its device: captions of the
    model's `context_length` by OpenCLIP's tokenizer, loaded here once so a missing or
    unfit tokenizer stops the job before any row (a ValueError: ids past the model's
    vocabulary would fail on the device mid-run)."""
    text = text_module(model, directory)
    length = int(model.context_length)
    tokenizer = load_tokenizer(str(directory), length)
    vocabulary, embeddings = getattr(tokenizer, "vocab_size", None), int(text.token_embedding.num_embeddings)
    if vocabulary is not None and vocabulary > embeddings:
        raise ValueError(
            f"{directory}: its tokenizer has {vocabulary} tokens and its text tower embeds {embeddings}; "
            "set text_cfg's vocab_size or hf_tokenizer_name to the tokenizer the model was trained with"
        )
    width = _projected_width(text.text_projection, int(text.transformer.width))
    processing = OpenClipTextPreprocessor(str(directory), length)
    return TextAdapter(NAME, EncodedText(model), list(text.transformer.resblocks), width, processing, placement)

