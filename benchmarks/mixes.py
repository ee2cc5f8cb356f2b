"""What `benchmarks/scaling.py` measures: the four mixes, their towers, their JPEGs, their FLOPs.

- Towers: random weights (fixed seed) of the size of a published checkpoint, saved with
  `save_pretrained` like a user's checkpoint (each family's image processor config
  beside it), built once into the work directory and reused. `--smoke` builds tiny
  towers of the same architectures instead (a few layers, width 64, small inputs).
- JPEGs: every row is its own JPEG made from a real photo (the sources are cycled): a
  random crop of 35-100 % of the photo's area with a random aspect ratio that fits
  inside the photo, resized to the row's random target size, encoded at a random JPEG
  quality of 80-95. Each row draws from its own generator seeded by (seed, mix, row),
  so the file depends only on the photos, the mix, the row count and the seed, not on
  how the rows were spread over the worker processes. The Parquet file (row groups of
  128 rows) is cached in the work directory under a name keyed by mix, count, seed and
  a digest of the photos, with a JSON sidecar describing it.
- FLOPs: `embedjob.bench.encoder_flops` for Qwen, `embedjob.bench.fixed_flops` for CLIP and SigLIP.

Benchmarks import from `embedjob`; `embedjob` never imports from here.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import math
import multiprocessing
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
ROW_GROUP = 128
GENERATOR_VERSION = 1
"""Bumped whenever the JPEG recipe changes, so cached files made the old way are not reused."""


# --- towers --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tower:
    """A vision tower: its embedjob family, a label, and the transformers configs of the
    full-size and the tiny (smoke) version."""

    key: str
    family: str
    label: str
    full: dict[str, Any]
    tiny: dict[str, Any]

    def describe(self, smoke: bool) -> str:
        if not smoke:
            return self.label
        layers = self.tiny.get("depth", self.tiny.get("num_hidden_layers"))
        return f"tiny {self.family} tower for --smoke ({layers} layers, width {self.tiny['hidden_size']})"


QWEN_TINY = dict(
    depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=64, window_size=112, fullatt_block_indexes=[1]
)
QWEN_TINY_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 448 * 448}

TOWERS = {
    "qwen": Tower("qwen2_5_vl-7b", "qwen2_5_vl", "Qwen2.5-VL-7B-size vision tower", {}, QWEN_TINY),
    "siglip": Tower(
        "siglip-so400m-patch14-384",
        "siglip",
        "SigLIP-so400m/14-384-size vision tower with its attention-pooling head",
        dict(
            hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304,
            patch_size=14, image_size=384, vision_use_head=True,
        ),
        dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            patch_size=14, image_size=56, vision_use_head=True,
        ),
    ),
    "clip": Tower(
        "clip-vit-l14-336",
        "clip",
        "CLIP-ViT-L/14-336-size vision tower with its 768-wide projection",
        dict(
            hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
            patch_size=14, image_size=336, projection_dim=768,
        ),
        dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            patch_size=14, image_size=56, projection_dim=32,
        ),
    ),
}


def save_tower(tower: Tower, root: Path, smoke: bool) -> Path:
    """The tower's checkpoint directory under `root`, built on the first call (atomically:
    a killed build leaves no half checkpoint behind)."""
    from embedjob.encoders.loading import save_atomically

    target = root / (f"{tower.key}-tiny" if smoke else tower.key)
    builders = {"qwen2_5_vl": _save_qwen, "siglip": _save_fixed, "clip": _save_fixed}
    save_atomically(lambda tmp: builders[tower.family](tower, tmp, smoke), target)
    return target


def _save_qwen(tower: Tower, directory: Path, smoke: bool) -> None:
    """Full size: `embedjob bench`'s own tower (`build_tower`, `save_checkpoint`), so both
    benchmarks measure the same weights. Tiny: the same recipe with `QWEN_TINY`."""
    import torch

    if not smoke:
        from embedjob.bench import build_tower, save_checkpoint

        scratch = directory.with_name(directory.name + ".build")
        save_checkpoint(build_tower(torch.device("cpu")), scratch)
        os.rename(scratch / "tower", directory)
        scratch.rmdir()
        return
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
        Qwen2_5_VLVisionConfig,
    )

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(**tower.tiny)
    Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN_TINY_PIXELS))


def _save_fixed(tower: Tower, directory: Path, smoke: bool) -> None:
    """`embedjob bench`'s recipe (`save_fixed_tower`), so both benchmarks build the same towers."""
    from embedjob.bench import save_fixed_tower

    save_fixed_tower(tower.family, tower.tiny if smoke else tower.full, directory)


# --- mixes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """One benchmark mix: a tower, and JPEGs whose height and width are each drawn
    uniformly from `sides` (inclusive)."""

    name: str
    tower: Tower
    sides: tuple[int, int]
    images: int

    def describe(self, smoke: bool) -> str:
        lo, hi = self.sides
        size = f"{lo}x{lo} px" if lo == hi else f"{lo}-{hi} px (height and width drawn independently)"
        return f"{self.tower.describe(smoke)}; distinct JPEGs of {size}"


MIXES = {
    m.name: m
    for m in (
        Mix("qwen-mixed", TOWERS["qwen"], (224, 1344), 1536),
        Mix("qwen-224", TOWERS["qwen"], (224, 224), 6144),
        Mix("siglip", TOWERS["siglip"], (256, 1024), 8192),
        Mix("clip", TOWERS["clip"], (256, 1024), 8192),
    )
}
SMOKE_IMAGES = 24


# --- photos --------------------------------------------------------------------------


@dataclass(frozen=True)
class Photo:
    """A real photo's encoded bytes and where they came from."""

    name: str
    data: bytes


def builtin_sources() -> list[Path]:
    """The repository's real photos: the demo dataset (whose two broken rows are dropped
    as unreadable) and the test images."""
    tests = sorted(p for p in (REPO / "tests" / "data").iterdir() if p.suffix.lower() in (".jpg", ".png"))
    return [REPO / "jobs" / "data" / "demo-images.parquet", *tests]


def collect_photos(sources: Sequence[Path]) -> list[Photo]:
    """Every candidate photo in `sources` (image files, Parquet files, directories of
    either, searched recursively), in a fixed order; unreadable ones are not yet removed."""
    photos: list[Photo] = []
    for source in sources:
        if source.is_dir():
            files = sorted(p for p in source.rglob("*") if p.is_file())
        elif source.exists():
            files = [source]
        else:
            raise SystemExit(f"--photos: {source} does not exist")
        for path in files:
            if path.suffix.lower() == ".parquet":
                photos += _parquet_photos(path)
            elif path.suffix.lower() in IMAGE_SUFFIXES:
                photos.append(Photo(str(path), path.read_bytes()))
    return photos


def _parquet_photos(path: Path) -> list[Photo]:
    """The image bytes of a Parquet file: its binary column, or the `bytes` of an HF
    image struct<bytes, path> (a column named like an image column wins if several)."""
    schema = pq.read_schema(path)
    found = [f for f in schema if _image_field(f.type) is not None]
    if not found:
        raise SystemExit(f"--photos: {path} has no binary or struct<bytes, path> column")
    named = [f for f in found if f.name.lower() in ("image", "img", "jpg", "jpeg", "png", "photo")]
    column = (named or found)[0]
    values = pq.read_table(path, columns=[column.name]).column(column.name).combine_chunks()
    if pa.types.is_struct(column.type):
        values = values.field("bytes")
    return [Photo(f"{path}#{i}", blob) for i, blob in enumerate(values.to_pylist()) if blob]


def _image_field(kind: pa.DataType) -> str | None:
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return "binary"
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        if index >= 0 and (pa.types.is_binary(kind.field(index).type) or pa.types.is_large_binary(kind.field(index).type)):
            return "struct"
    return None


def _open_photo(data: bytes) -> Any:
    """The photo upright (EXIF orientation applied) in RGB; raises on anything unreadable."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image).convert("RGB")


def _readable(data: bytes) -> bool:
    try:
        _open_photo(data)
    except Exception:
        return False
    return True


# --- JPEGs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    """A generated Parquet file and what went into it (the sidecar JSON)."""

    path: Path
    info: dict[str, Any]


def jpeg_dataset(mix: Mix, count: int, seed: int, candidates: list[Photo], directory: Path, workers: int) -> Dataset:
    """The mix's Parquet file of `count` distinct JPEGs: from the cache when it is there,
    else made by `workers` processes and cached."""
    digest = hashlib.sha256(f"v{GENERATOR_VERSION} {mix.sides}".encode())
    for photo in candidates:
        digest.update(hashlib.sha256(photo.data).digest())
    path = directory / f"{mix.name}-{count}-seed{seed}-{digest.hexdigest()[:12]}.parquet"
    sidecar = path.with_suffix(".json")
    if path.exists() and sidecar.exists():
        return Dataset(path, json.loads(sidecar.read_text()))
    directory.mkdir(parents=True, exist_ok=True)
    with _pool(workers) as pool:
        readable = [p for p, ok in zip(candidates, pool.map(_readable, [p.data for p in candidates], chunksize=4)) if ok]
        if not readable:
            raise SystemExit("no readable photo in the sources")
        blobs = _make_jpegs(pool, mix, count, seed, readable)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table({"image": pa.array(blobs, type=pa.binary())}), tmp, row_group_size=ROW_GROUP)
    os.rename(tmp, path)
    info = {
        "mix": mix.name,
        "rows": count,
        "seed": seed,
        "sides": list(mix.sides),
        "photos": len(readable),
        "unreadable_photos": len(candidates) - len(readable),
        "distinct_jpegs": len({hashlib.sha256(b).digest() for b in blobs}),
        "megabytes": round(sum(map(len, blobs)) / 1e6, 1),
    }
    sidecar.write_text(json.dumps(info, indent=1))
    return Dataset(path, info)


def _pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """Worker processes started by a fork server: never forked from this process, which
    may hold CUDA state."""
    return concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("forkserver"))


def _make_jpegs(pool: concurrent.futures.Executor, mix: Mix, count: int, seed: int, photos: list[Photo]) -> list[bytes]:
    """Row i comes from photo i mod len(photos); one task per photo, so each photo is
    decoded once, and the rows are put back in order."""
    salt = zlib.crc32(mix.name.encode())
    tasks = [(photos[k].data, list(range(k, count, len(photos))), mix.sides, seed, salt) for k in range(min(count, len(photos)))]
    blobs: list[bytes] = [b""] * count
    for made in pool.map(_jpeg_rows, tasks):
        for row, blob in made:
            blobs[row] = blob
    return blobs


def _jpeg_rows(task: tuple[bytes, list[int], tuple[int, int], int, int]) -> list[tuple[int, bytes]]:
    """Worker: the JPEGs of some rows, all cut from one photo."""
    data, rows, sides, seed, salt = task
    photo = _open_photo(data)
    return [(row, _jpeg(photo, np.random.default_rng([seed, salt, row]), sides)) for row in rows]


def _jpeg(photo: Any, rng: np.random.Generator, sides: tuple[int, int]) -> bytes:
    """One row: random crop box -> the row's size -> JPEG at a random quality."""
    from PIL import Image

    height, width = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
    box = crop_box(photo.width, photo.height, rng)
    image = photo.resize((width, height), Image.Resampling.BICUBIC, box=box, reducing_gap=2.0)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=int(rng.integers(80, 96)))
    return out.getvalue()


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[float, float, float, float]:
    """A box of a random 35-100 % of the photo's area whose aspect ratio (w/h) is drawn
    log-uniformly from the ratios that fit inside the photo at that area, at a random place.

    With area a*W*H and ratio r the box is sqrt(a*W*H*r) x sqrt(a*W*H/r); it fits when
    a*W/H <= r <= W/(a*H), a range that is never empty for a <= 1.
    """
    area = rng.uniform(0.35, 1.0)
    low, high = area * width / height, width / (area * height)
    ratio = math.exp(rng.uniform(math.log(low), math.log(high)))
    box_w = min(width, math.sqrt(area * width * height * ratio))
    box_h = min(height, math.sqrt(area * width * height / ratio))
    left, top = rng.uniform(0, width - box_w), rng.uniform(0, height - box_h)
    return left, top, left + box_w, top + box_h


# --- FLOPs ---------------------------------------------------------------------------


def items_flops(adapter: Any, items: list[Any]) -> float:
    """Useful FLOPs of the adapter's tower on these preprocessed items (padding excluded)."""
    from embedjob.bench import encoder_flops, fixed_flops
    from embedjob.encoders.fixed import FixedResAdapter

    if not isinstance(adapter, FixedResAdapter):
        return encoder_flops(items, adapter.model.config)
    projection = adapter.projection.out_features if adapter.projection is not None else None
    per_image = fixed_flops(adapter.family, adapter.tower.config, projection)
    return per_image * sum(item.tokens // adapter.tokens_per_image for item in items)
