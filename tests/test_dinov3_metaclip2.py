"""DINOv3 and MetaCLIP 2: user checkpoints (random weights, fixed seed, saved with
save_pretrained beside their processor) run through `embedjob run` give transformers'
vectors on real photos; DINOv3's registers are counted in budgets and left out of
pooling and per-token rows; `model.pool` and its deprecated alias `model.dinov2_pool`;
FP8 blocks; the bench's FLOPs and rows."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import REPO, make_job, random_image
from PIL import Image, ImageOps
from transformers import (
    AutoImageProcessor,
    CLIPImageProcessor,
    DINOv3ViTConfig,
    DINOv3ViTImageProcessor,
    DINOv3ViTModel,
    MetaClip2Config,
    MetaClip2Model,
    MetaClip2VisionConfig,
    MetaClip2VisionModel,
    MetaClip2VisionModelWithProjection,
)

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.encoders import load_adapter
from embedjob.encoders.fp8 import Fp8GatedMlp, Fp8Joint, Fp8Linear
from embedjob.encoders.registry import family_of
from embedjob.io.checkpoint import _model_identity

CPU = torch.device("cpu")
PHOTOS = REPO / "jobs" / "data" / "demo-images.parquet"
# The RGB photos of the demo input (the RGBA one is composited on white, which no
# transformers processor does; the last two rows are broken on purpose).
RGB_PHOTOS = ("img2dataset_123_456", "img2dataset_208_495", "img2dataset_321_421", "img2dataset_389_535",
              "img2dataset_416_264", "img2dataset_456_123", "img2dataset_524_316", "hfdatasets_test_image_rgb",
              "mmaction2_test")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=128,
            max_position_embeddings=16)


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """User checkpoints as save_pretrained writes them, each with its processor config:
    DINOv3 at its published processor (224 x 224, ImageNet statistics) with 4 registers,
    MetaCLIP 2 whole, as a projected vision tower and as a plain one."""
    root = tmp_path_factory.mktemp("checkpoints")
    dinov3 = DINOv3ViTConfig(**TINY, patch_size=16, image_size=224, num_register_tokens=4, layerscale_value=0.5)
    _seeded(lambda: DINOv3ViTModel(dinov3)).save_pretrained(root / "dinov3")
    DINOv3ViTImageProcessor().save_pretrained(root / "dinov3")

    vision = dict(TINY, patch_size=16, image_size=64)
    full = _seeded(lambda: MetaClip2Model(MetaClip2Config(text_config=TEXT, vision_config=vision, projection_dim=48)))
    full.save_pretrained(root / "metaclip2")
    projected = MetaClip2VisionModelWithProjection(MetaClip2VisionConfig(**vision, projection_dim=48))
    projected.vision_model.load_state_dict(full.vision_model.state_dict())
    projected.visual_projection.load_state_dict(full.visual_projection.state_dict())
    projected.save_pretrained(root / "metaclip2-projected")
    plain = MetaClip2VisionModel(MetaClip2VisionConfig(**vision))
    plain.load_state_dict(full.vision_model.state_dict())
    plain.save_pretrained(root / "metaclip2-plain")
    processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    for name in ("metaclip2", "metaclip2-projected", "metaclip2-plain"):
        processor.save_pretrained(root / name)
    return {path.name: path for path in root.iterdir()}


def photos() -> dict[str, Image.Image]:
    """The demo input's RGB photos as a transformers user opens them (upright, RGB)."""
    table = pq.read_table(PHOTOS).to_pylist()
    return {row["id"]: ImageOps.exif_transpose(Image.open(io.BytesIO(row["image"]))).convert("RGB")
            for row in table if row["id"] in RGB_PHOTOS}


def embedjob_run(tmp_path: Path, cache_dir: str, model: dict, **output: object) -> list[dict]:
    """`embedjob run` over the demo photos with this model section (family left to the
    checkpoint unless given), vectors written in float32; the rows of the output."""
    job = {
        "input": {"path": str(PHOTOS), "media_column": "image", "id_column": "id"},
        "model": model,
        "output": {"path": str(tmp_path / "out"), "dtype": "float32", **output},
        "runtime": {"cache_dir": cache_dir, "workers": 0, "progress": False},
    }
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job))
    assert main(["run", str(spec)]) == 0
    return pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def _reference(name: str, directory: Path, images: list[Image.Image], pool: str) -> torch.Tensor:
    """What transformers gives on its own processor's output of these images."""
    pixels = AutoImageProcessor.from_pretrained(directory)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        if name == "dinov3":
            output = DINOv3ViTModel.from_pretrained(directory)(pixel_values=pixels)
            return output.pooler_output if pool == "cls" else output.last_hidden_state[:, 5:].mean(dim=1)
        if name == "metaclip2":
            return MetaClip2Model.from_pretrained(directory).get_image_features(pixel_values=pixels).pooler_output
        return MetaClip2VisionModelWithProjection.from_pretrained(directory)(pixel_values=pixels).image_embeds


@pytest.mark.parametrize(
    ("name", "pool"), [("dinov3", "cls"), ("dinov3", "patch_mean"), ("metaclip2", None), ("metaclip2-projected", None)]
)
def test_embedjob_run_gives_transformers_vectors_for_every_real_photo(
    tmp_path: Path, cache_dir: str, checkpoints: dict[str, Path], name: str, pool: str | None
) -> None:
    directory = checkpoints[name]
    model = {"path": str(directory), **({"pool": pool} if pool else {})}
    rows = {row["id"]: row for row in embedjob_run(tmp_path, cache_dir, model)}
    images = photos()
    assert set(images) == set(RGB_PHOTOS) and all(rows[i]["error"] is None for i in images)
    ours = torch.tensor([rows[i]["embedding"] for i in images])
    ref = _reference(name, directory, list(images.values()), pool or "cls")
    assert ours.shape == ref.shape and relative(ours, ref) < 1e-3
    tokens = 14 * 14 + 1 + 4 if name == "dinov3" else 4 * 4 + 1
    assert {rows[i]["tokens"] for i in images} == {tokens}, "budgets count CLS and registers"


def test_per_token_rows_are_the_patches_without_cls_and_registers_in_grid_order(
    tmp_path: Path, cache_dir: str, checkpoints: dict[str, Path]
) -> None:
    rows = {row["id"]: row for row in embedjob_run(tmp_path, cache_dir, {"path": str(checkpoints["dinov3"])}, pooling="none")}
    images = photos()
    pixels = AutoImageProcessor.from_pretrained(checkpoints["dinov3"])(images=list(images.values()), return_tensors="pt")
    with torch.no_grad():
        states = DINOv3ViTModel.from_pretrained(checkpoints["dinov3"])(**pixels).last_hidden_state
    for k, name in enumerate(images):
        row = rows[name]
        assert row["grid"] == [1, 14, 14] and row["tokens"] == 201
        ours = torch.tensor(row["embedding"])
        assert ours.shape == (196, 64) and relative(ours, states[k, 5:]) < 1e-3


def test_family_is_read_from_each_checkpoints_config_and_a_wrong_one_is_named(
    cache_dir: str, checkpoints: dict[str, Path]
) -> None:
    assert {name: family_of(str(path)) for name, path in checkpoints.items()} == {
        "dinov3": "dinov3", "metaclip2": "metaclip2", "metaclip2-projected": "metaclip2", "metaclip2-plain": "metaclip2",
    }
    with pytest.raises(ValueError, match="model_type 'dinov3_vit'; model.family 'dinov2' expects 'dinov2'; set model.family to 'dinov3'"):
        load_adapter(make_job(cache_dir, model={"family": "dinov2", "path": str(checkpoints["dinov3"])}), CPU)
    with pytest.raises(ValueError, match="model_type 'metaclip_2'; model.family 'clip' .*set model.family to 'metaclip2'"):
        load_adapter(make_job(cache_dir, model={"family": "clip", "path": str(checkpoints["metaclip2"])}), CPU)


def test_a_metaclip2_tower_without_projection_gives_its_pooled_features(
    cache_dir: str, checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    images = [random_image(100, 140, 5), random_image(64, 64, 6)]
    directory = checkpoints["metaclip2-plain"]
    with caplog.at_level(logging.WARNING, logger="embedjob.encoders.fixed"):
        adapter = load_adapter(make_job(cache_dir, model={"family": "metaclip2", "path": str(directory)}), CPU)
    assert "has no visual projection" in caplog.text and adapter.embed_dim == 64
    pixels = AutoImageProcessor.from_pretrained(directory)(images=[torch.from_numpy(i.pixels).permute(2, 0, 1) for i in images],
                                                           return_tensors="pt")["pixel_values"]
    items = [adapter.preprocessor()(i) for i in images]
    with torch.no_grad():
        ours = adapter.forward(adapter.eager_inputs(items))
        ref = MetaClip2VisionModel.from_pretrained(directory)(pixel_values=pixels).pooler_output
    assert relative(ours, ref) < 1e-5


def test_a_dinov3_checkpoint_without_processor_config_takes_the_processor_defaults_at_its_size(
    tmp_path: Path, cache_dir: str, checkpoints: dict[str, Path]
) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((checkpoints["dinov3"] / name).read_bytes())
    adapter = load_adapter(make_job(cache_dir, model={"family": "dinov3", "path": str(tmp_path)}), CPU)
    images = [random_image(300, 200, 1), random_image(40, 500, 2)]
    views = torch.cat([adapter.preprocessor()(i).tensors["pixel_values"] for i in images])
    ref = DINOv3ViTImageProcessor(size={"height": 224, "width": 224})(
        images=[torch.from_numpy(i.pixels).permute(2, 0, 1) for i in images], return_tensors="pt"
    )["pixel_values"]
    assert torch.equal(adapter.processing.normalize(views), ref)


# ---------------------------------------------------------------- model.pool and model.dinov2_pool


def test_the_deprecated_dinov2_pool_still_pools_warns_once_and_resumes_as_pool(
    cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = {"family": "dinov3", "path": "builtin:tiny-dinov3"}
    with caplog.at_level(logging.WARNING, logger="embedjob.config"):
        old = make_job(cache_dir, model={**model, "dinov2_pool": "patch_mean"})
    warnings = [r.getMessage() for r in caplog.records if "dinov2_pool" in r.getMessage()]
    assert warnings == ["model.dinov2_pool is deprecated: write model.pool: patch_mean instead"]
    new = make_job(cache_dir, model={**model, "pool": "patch_mean"})
    assert old.model.image_pool == new.model.image_pool == "patch_mean"
    assert _model_identity(old) == _model_identity(new), "one pooling, either spelling: the output resumes"
    assert _model_identity(make_job(cache_dir, model=model)) != _model_identity(new)
    image = [random_image(90, 120, 3)]
    vectors = []
    for job in (old, new, make_job(cache_dir, model=model)):
        adapter = load_adapter(job, CPU)
        with torch.no_grad():
            vectors.append(adapter.forward(adapter.eager_inputs([adapter.preprocessor()(i) for i in image])))
    assert torch.equal(vectors[0], vectors[1]) and not torch.allclose(vectors[0], vectors[2])


def test_an_output_of_the_earlier_dinov2_pool_key_keeps_its_identity(cache_dir: str) -> None:
    """Output written before model.pool existed recorded `dinov2_pool` (default 'cls'):
    the same job today has that identity, so it resumes."""
    job = make_job(cache_dir, model={"family": "clip", "path": "builtin:tiny-clip"})
    assert _model_identity(job) == {"family": "clip", "path": "builtin:tiny-clip", "dtype": "bfloat16", "dinov2_pool": "cls"}


def test_the_old_default_dinov2_pool_cls_on_another_family_still_runs_and_says_to_remove_it(
    cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="embedjob.config"):
        job = make_job(cache_dir, model={"family": "metaclip2", "path": "builtin:tiny-metaclip2", "dinov2_pool": "cls"})
    assert job.model.image_pool == "cls"
    assert "model.dinov2_pool is deprecated and does nothing for model.family 'metaclip2': remove it" in caplog.text


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"family": "dinov2", "pool": "cls", "dinov2_pool": "patch_mean"},
         "model.dinov2_pool = 'patch_mean' and model.pool = 'cls' disagree; model.dinov2_pool is deprecated: remove it and keep model.pool"),
        ({"family": "metaclip2", "pool": "cls"}, "model.pool applies to model.family 'dinov2' or 'dinov3' only, not 'metaclip2'; remove it"),
        ({"family": "siglip", "dinov2_pool": "patch_mean"},
         "model.dinov2_pool applies to model.family 'dinov2' or 'dinov3' only, not 'siglip'; remove it"),
    ],
)
def test_a_pool_the_family_cannot_take_or_two_that_disagree_stop_the_job(cache_dir: str, model: dict, message: str) -> None:
    with pytest.raises(JobError) as error:
        make_job(cache_dir, model={"path": f"builtin:tiny-{model['family']}", **model})
    assert str(error.value) == message


# ---------------------------------------------------------------- FP8 blocks


def test_dinov3_fp8_blocks_join_qkv_despite_ks_missing_bias_and_apply_norms_and_gelu(cache_dir: str) -> None:
    """q, k and v (k without a bias) share one product that applies norm1; up applies
    norm2 and down the GELU; the layer scales stay; embeddings stay within FP8 rounding."""
    model = {"family": "dinov3", "path": "builtin:tiny-dinov3"}
    full = load_adapter(make_job(cache_dir, model=model), CPU)
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), CPU)
    for block in fp8.compile_units():
        attention = block.attention
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        assert all(isinstance(layer, Fp8Joint) for layer in (q, k, v)) and q.product is k.product is v.product
        assert q.product.norm is not None and isinstance(block.norm1, torch.nn.Identity)
        bias = q.product.bias
        assert torch.equal(bias[k.start : k.start + k.out_features], torch.zeros(k.out_features))
        assert isinstance(block.mlp.up_proj, Fp8Linear) and block.mlp.up_proj.norm is not None
        assert block.mlp.down_proj.activation == "gelu" and isinstance(block.mlp.act_fn, torch.nn.Identity)
        assert isinstance(attention.o_proj, Fp8Linear) and torch.is_tensor(block.layer_scale1.lambda1)
    items = [full.preprocessor()(image) for image in (random_image(120, 90, 1), random_image(64, 80, 2), random_image(300, 200, 3))]
    with torch.inference_mode():
        a, b = full.forward(full.eager_inputs(items)), fp8.forward(fp8.eager_inputs(items))
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.99


def test_a_gated_dinov3_mlp_becomes_one_gated_fp8_mlp(tmp_path: Path, cache_dir: str) -> None:
    config = DINOv3ViTConfig(**TINY, patch_size=16, image_size=64, num_register_tokens=1, use_gated_mlp=True, hidden_act="silu")
    _seeded(lambda: DINOv3ViTModel(config)).save_pretrained(tmp_path)
    DINOv3ViTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(tmp_path)
    model = {"family": "dinov3", "path": str(tmp_path)}
    full = load_adapter(make_job(cache_dir, model=model), CPU)
    fp8 = load_adapter(make_job(cache_dir, model={**model, "precision": "fp8"}), CPU)
    assert all(isinstance(block.mlp, Fp8GatedMlp) for block in fp8.compile_units())
    items = [full.preprocessor()(image) for image in (random_image(120, 90, 1), random_image(64, 64, 2))]
    with torch.inference_mode():
        a, b = full.forward(full.eager_inputs(items)), fp8.forward(fp8.eager_inputs(items))
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.99


# ---------------------------------------------------------------- embedjob bench


@pytest.mark.parametrize(
    ("family", "config", "projection"),
    [
        ("dinov3", DINOv3ViTConfig(**TINY, patch_size=16, image_size=64, num_register_tokens=4), None),
        ("dinov3", DINOv3ViTConfig(**TINY, patch_size=16, image_size=64, use_gated_mlp=True, hidden_act="silu"), None),
        ("metaclip2", MetaClip2VisionConfig(**TINY, patch_size=16, image_size=64, projection_dim=48), 48),
    ],
)
def test_fixed_flops_count_what_the_tower_multiplies_registers_included(family: str, config, projection: int | None) -> None:
    """The bench's FLOPs are torch's own count of the tower's products on one image."""
    from torch.utils.flop_counter import FlopCounterMode

    from embedjob.bench import fixed_flops

    model = MetaClip2VisionModelWithProjection(config) if family == "metaclip2" else DINOv3ViTModel(config)
    model.config._attn_implementation = "eager"  # its matmuls are what the counter sees
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(pixel_values=torch.zeros(1, 3, 64, 64))
    assert fixed_flops(family, config, projection) == counter.get_total_flops()


def test_embedjob_bench_rows_for_dinov3_and_metaclip2_match_plain_transformers(tmp_path: Path) -> None:
    from embedjob.bench import fixed_rows

    towers = {
        "dinov3": ("tiny DINOv3", dict(TINY, patch_size=16, image_size=32, num_register_tokens=4)),
        "metaclip2": ("tiny MetaCLIP 2", dict(TINY, patch_size=16, image_size=32, projection_dim=16)),
    }
    rows = fixed_rows(tmp_path, towers, 3, 2, 1e12, CPU, compiled=False)
    assert [(r.mix, r.variant) for r in rows] == [
        ("tiny DINOv3", "plain_transformers_eager"), ("tiny DINOv3", "ours_graphs"),
        ("tiny MetaCLIP 2", "plain_transformers_eager"), ("tiny MetaCLIP 2", "ours_graphs"),
    ]
    assert all(r.items == 3 and r.seconds > 0 and r.flops > 0 for r in rows)
    for ours in rows[1::2]:
        assert float(ours.note.rsplit("min cos to plain ", 1)[1]) > 0.999, ours.note
    config = json.loads((tmp_path / "dinov3-tower" / "config.json").read_text())
    assert config["model_type"] == "dinov3_vit" and config["num_register_tokens"] == 4


def test_dinov3_tiles_are_float_views_and_a_tiled_jobs_global_half_is_the_untiled_vector(cache_dir: str) -> None:
    model = {"family": "dinov3", "path": "builtin:tiny-dinov3"}
    plain = load_adapter(make_job(cache_dir, model=model), CPU)
    tiled = load_adapter(make_job(cache_dir, model=model, preprocess={"tiling": "anyres", "max_tiles": 4}), CPU)
    image = random_image(300, 500, 4)
    item = tiled.preprocessor()(image)
    tiles = item.tensors["tile_pixels"]
    assert tiles.dtype == torch.float32 and tiles.shape[0] > 1 and item.tokens == (1 + tiles.shape[0]) * 23
    assert float(tiles.min()) >= -0.01 and float(tiles.max()) <= 1.01, "rescaled to [0, 1] before the tiles' resize"
    with torch.no_grad():
        whole = plain.forward(plain.eager_inputs([plain.preprocessor()(image)]))
        local = tiled.forward(tiled.eager_inputs([tiled.path_input(item, "tile_pixels")]))
        combined = tiled.combine({"pixel_values": tiled.forward(tiled.eager_inputs([item])), "tile_pixels": local})
    assert combined.shape == (1, 128) and torch.allclose(combined[:, :64], whole, rtol=1e-5, atol=1e-6)
    assert torch.allclose(combined[:, 64:], local.mean(dim=0, keepdim=True), rtol=1e-5, atol=1e-6)
