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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from benchmarks.common import Photo, open_photo, readable

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
        usable = [p for p, ok in zip(candidates, pool.map(readable, [p.data for p in candidates], chunksize=4)) if ok]
        if not usable:
            raise SystemExit("no readable photo in the sources")
        blobs = _make_jpegs(pool, mix, count, seed, usable)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table({"image": pa.array(blobs, type=pa.binary())}), tmp, row_group_size=ROW_GROUP)
    os.rename(tmp, path)
    info = {
        "mix": mix.name,
        "rows": count,
        "seed": seed,
        "sides": list(mix.sides),
        "photos": len(usable),
        "unreadable_photos": len(candidates) - len(usable),
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
    photo = open_photo(data)
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


# --- jobs ----------------------------------------------------------------------------


def write_job(mixdir: Path, mix: Mix, tower: Path, parquet: Path, cache: Path, smoke: bool) -> Path:
    """The mix's job file: what a user would write for this checkpoint and dataset."""
    job = {
        "input": {"path": str(parquet), "media_column": "image"},
        "model": {"family": mix.tower.family, "path": str(tower), "dtype": "bfloat16"},
        "output": {"path": str(mixdir / "out"), "rows_per_part": 100_000},
        "batching": {"compile": not smoke},
        "runtime": {"device": "cpu" if smoke else "cuda", "progress": False, "cache_dir": str(cache)},
    }
    mixdir.mkdir(parents=True, exist_ok=True)
    path = mixdir / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
