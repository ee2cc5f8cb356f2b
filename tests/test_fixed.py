"""CLIP, MetaCLIP 2, SigLIP, DINOv2 and DINOv3 adapters: preprocessing and embedding parity with transformers,
user checkpoints (full and vision-only), budgets in whole images, graph replay, and the
two demo jobs end to end on the CPU."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job, random_image, random_video
from engine_helpers import one_path_encoder, padded_eager
from test_qwen import assembly_calls
from transformers import (
    AutoImageProcessor,
    CLIPModel,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionModelWithProjection,
    Dinov2Model,
    DINOv3ViTModel,
    MetaClip2Model,
    SiglipModel,
    SiglipVisionModel,
)

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.encoders import load_adapter
from embedjob.encoders.base import pad_mlps
from embedjob.encoders.fixed import BUILTIN_VISION, FAMILIES, GLOBAL_KEY, PatchProduct, blocks_at, builtin_dir
from embedjob.engine.encode import build_encoder
from embedjob.engine.graphs import GraphManager
from embedjob.engine.packer import BudgetPlan

SIZES = [(224, 224), (300, 500), (641, 479), (5, 900), (30, 30), (64, 65)]
CPU = torch.device("cpu")


def fixed_job(cache_dir: str, family: str, path: str | None = None, **sections: dict):
    model = {"family": family, "path": path or f"builtin:tiny-{family}", **sections.pop("model", {})}
    return make_job(cache_dir, model=model, **sections)


@pytest.fixture(scope="module")
def adapters(cache_dir: str) -> dict:
    return {family: load_adapter(fixed_job(cache_dir, family), CPU) for family in FAMILIES}


def _chw(image) -> torch.Tensor:
    return torch.from_numpy(image.pixels).permute(2, 0, 1)


def _reference_pixels(directory: Path, images: list) -> torch.Tensor:
    processor = AutoImageProcessor.from_pretrained(directory)
    return processor(images=[_chw(i) for i in images], return_tensors="pt")["pixel_values"]


def _reference_features(family: str, directory: Path, pixels: torch.Tensor) -> torch.Tensor:
    """What a transformers user gets: get_image_features (CLIP, MetaCLIP 2, SigLIP), the CLS output (DINOv2, DINOv3)."""
    with torch.no_grad():
        if family == "clip":
            return CLIPModel.from_pretrained(directory).get_image_features(pixel_values=pixels).pooler_output
        if family == "metaclip2":
            return MetaClip2Model.from_pretrained(directory).get_image_features(pixel_values=pixels).pooler_output
        if family == "siglip":
            return SiglipModel.from_pretrained(directory).get_image_features(pixel_values=pixels).pooler_output
        if family == "dinov3":
            return DINOv3ViTModel.from_pretrained(directory)(pixel_values=pixels).pooler_output
        return Dinov2Model.from_pretrained(directory)(pixel_values=pixels).pooler_output


def _embed(adapter, media: list) -> torch.Tensor:
    items = [adapter.preprocessor()(m) for m in media]
    with torch.no_grad():
        return torch.cat(adapter.split(adapter.forward(adapter.eager_inputs(items)), items))


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> list[float]:
    return [float((a - b).norm() / b.norm()) for a, b in zip(ours, ref)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_image_preprocessing_equals_the_transformers_processor(adapters, cache_dir: str, family: str) -> None:
    images = [random_image(h, w, seed=h + w) for h, w in SIZES]
    items = [adapters[family].preprocessor()(i) for i in images]
    ref = _reference_pixels(builtin_dir(FAMILIES[family], cache_dir), images)
    views = torch.cat([i.tensors["pixel_values"] for i in items])
    # Resized, cropped uint8 views; float32 ones where the processor resizes rescaled pixels (DINOv3's).
    assert views.dtype == (torch.float32 if family == "dinov3" else torch.uint8)
    assert torch.equal(adapters[family].processing.normalize(views), ref)
    tokens = adapters[family].tokens_per_image
    assert all(i.tokens == tokens and i.frames == 0 and i.modality == "image" for i in items)


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        ("clip", {"size": {"shortest_edge": 60}, "resample": 2}),  # crop larger than the resize: black padding
        ("dinov2", {"size": {"shortest_edge": 80}, "crop_size": {"height": 70, "width": 70}, "do_normalize": False}),
        ("siglip", {"resample": 0, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.4]}),
        ("metaclip2", {"size": {"shortest_edge": 72}, "resample": 2, "image_mean": [0.5, 0.5, 0.5]}),
        # Bicubic overshoots [0, 1] on float pixels, which the float views keep as they are.
        ("dinov3", {"size": {"height": 48, "width": 96}, "resample": 3, "image_std": [0.3, 0.2, 0.1]}),
        ("dinov3", {"do_rescale": False, "do_normalize": False}),  # uint8 views again
        ("dinov3", {"do_center_crop": True, "size": {"height": 80, "width": 100}, "crop_size": {"height": 64, "width": 48}}),
    ],
)
def test_checkpoint_processor_settings_are_followed(tmp_path: Path, cache_dir: str, family: str, changes: dict) -> None:
    directory = tmp_path / family
    shutil.copytree(builtin_dir(FAMILIES[family], cache_dir), directory)
    config_file = directory / "preprocessor_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))
    adapter = load_adapter(fixed_job(cache_dir, family, str(directory)), CPU)
    images = [random_image(h, w, seed=h) for h, w in SIZES[:4]]
    ours = torch.cat([adapter.preprocessor()(i).tensors["pixel_values"] for i in images])
    assert torch.equal(adapter.processing.normalize(ours), _reference_pixels(directory, images))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_embeddings_equal_transformers_for_the_same_weights(adapters, cache_dir: str, family: str) -> None:
    images = [random_image(h, w, seed=h * 7 + w) for h, w in SIZES]
    directory = builtin_dir(FAMILIES[family], cache_dir)
    ref = _reference_features(family, directory, _reference_pixels(directory, images))
    ours = _embed(adapters[family], images)
    assert ours.shape == ref.shape == (len(images), adapters[family].embed_dim)
    assert max(_relative(ours, ref)) < 1e-5


@pytest.mark.parametrize(("family", "model", "prefix"), [("dinov2", Dinov2Model, 1), ("dinov3", DINOv3ViTModel, 3)])
def test_patch_mean_is_the_mean_of_the_final_patch_tokens_without_cls_and_registers(
    cache_dir: str, family: str, model: type, prefix: int
) -> None:
    adapter = load_adapter(fixed_job(cache_dir, family, model={"pool": "patch_mean"}), CPU)
    images = [random_image(120, 90, 1), random_image(300, 300, 2)]
    directory = builtin_dir(FAMILIES[family], cache_dir)
    with torch.no_grad():
        hidden = model.from_pretrained(directory)(pixel_values=_reference_pixels(directory, images)).last_hidden_state
    assert adapter.prefix == prefix and hidden.shape[1] == adapter.tokens_per_image
    assert max(_relative(_embed(adapter, images), hidden[:, prefix:].mean(dim=1))) < 1e-5


def test_video_gives_one_embedding_per_frame_equal_to_the_frame_as_an_image(adapters) -> None:
    adapter = adapters["siglip"]
    video = random_video(5, 90, 160, seed=3)
    item = adapter.preprocessor()(video)
    assert (item.frames, item.modality, item.tokens) == (5, "video", 5 * adapter.tokens_per_image)
    assert adapter.row_counts([item, adapter.preprocessor()(random_image(40, 40))]) == [5, 1]  # one row per view
    frames = [SimpleNamespace(pixels=np.ascontiguousarray(frame)) for frame in video.frames]
    per_frame = torch.cat([adapter.preprocessor()(f).tensors["pixel_values"] for f in frames])
    assert torch.equal(item.tensors["pixel_values"], per_frame)
    rows = _embed(adapter, [video])
    assert rows.shape == (5, adapter.embed_dim)
    assert torch.allclose(rows, _embed(adapter, frames), rtol=1e-5, atol=1e-6)


def test_vision_only_checkpoints_load_with_and_without_projection(tmp_path: Path, cache_dir: str) -> None:
    directory = builtin_dir(FAMILIES["clip"], cache_dir)
    full = CLIPModel.from_pretrained(directory)
    images = [random_image(100, 140, 5), random_image(64, 64, 6)]
    pixels = _reference_pixels(directory, images)

    projected = CLIPVisionModelWithProjection(CLIPVisionConfig(**BUILTIN_VISION["clip"], projection_dim=48))
    projected.vision_model.load_state_dict(full.vision_model.state_dict())
    projected.visual_projection.load_state_dict(full.visual_projection.state_dict())
    projected.save_pretrained(tmp_path / "projected")
    plain = CLIPVisionModel(CLIPVisionConfig(**BUILTIN_VISION["clip"]))
    plain.load_state_dict(full.vision_model.state_dict())
    plain.save_pretrained(tmp_path / "plain")
    for name in ("projected", "plain"):
        shutil.copy(directory / "preprocessor_config.json", tmp_path / name)

    with torch.no_grad():
        features = full.get_image_features(pixel_values=pixels).pooler_output
        pooled = full.vision_model(pixel_values=pixels).pooler_output
    ours = load_adapter(fixed_job(cache_dir, "clip", str(tmp_path / "projected")), CPU)
    assert ours.embed_dim == 48 and max(_relative(_embed(ours, images), features)) < 1e-5
    tower_only = load_adapter(fixed_job(cache_dir, "clip", str(tmp_path / "plain")), CPU)
    assert tower_only.embed_dim == 64 and max(_relative(_embed(tower_only, images), pooled)) < 1e-5


def test_siglip_vision_only_checkpoint_without_processor_config(tmp_path: Path, cache_dir: str, adapters) -> None:
    """A tower saved alone, without preprocessor_config.json: the family's processor at the model's size."""
    full = SiglipModel.from_pretrained(builtin_dir(FAMILIES["siglip"], cache_dir))
    vision = SiglipVisionModel(full.config.vision_config)
    vision.load_state_dict(full.vision_model.state_dict())
    vision.save_pretrained(tmp_path / "vision")
    adapter = load_adapter(fixed_job(cache_dir, "siglip", str(tmp_path / "vision")), CPU)
    images = [random_image(80, 200, 8), random_image(40, 40, 9)]
    assert torch.allclose(_embed(adapter, images), _embed(adapters["siglip"], images), rtol=1e-5, atol=1e-6)


def test_builtin_model_is_made_once_and_reloaded_identically(adapters, cache_dir: str) -> None:
    directory = builtin_dir(FAMILIES["clip"], cache_dir)
    stamp = (directory / "config.json").stat().st_mtime_ns
    again = load_adapter(fixed_job(cache_dir, "clip"), CPU)
    assert (directory / "config.json").stat().st_mtime_ns == stamp
    for (name, a), b in zip(adapters["clip"].tower.state_dict().items(), again.tower.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(adapters["clip"].projection.weight, again.projection.weight)


def test_wrong_family_or_builtin_is_a_clear_error(cache_dir: str) -> None:
    directory = str(builtin_dir(FAMILIES["dinov2"], cache_dir))
    with pytest.raises(ValueError, match="model_type 'dinov2'.*set model.family to 'dinov2'"):
        load_adapter(fixed_job(cache_dir, "clip", directory), CPU)
    with pytest.raises(ValueError, match="is a siglip model but model.family is 'clip'"):
        load_adapter(fixed_job(cache_dir, "clip", "builtin:tiny-siglip"), CPU)
    with pytest.raises(JobError, match="model.pool applies to model.family 'dinov2' or 'dinov3' only, not 'clip'"):
        fixed_job(cache_dir, "clip", model={"pool": "patch_mean"})


def test_budgets_are_whole_images_and_one_below_an_image_is_refused(adapters, cache_dir: str) -> None:
    adapter = adapters["clip"]
    auto = build_encoder(fixed_job(cache_dir, "clip"), adapter, CPU)
    (path,) = auto.paths
    assert all(b % 17 == 0 for b in path.manager.plan.token_budgets) and path.manager.plan.token_budgets[0] == 17
    user = build_encoder(fixed_job(cache_dir, "clip", batching={"token_budgets": [40, 100], "max_items_per_batch": 2}), adapter, CPU)
    assert user.paths[0].manager.plan.token_budgets == (34, 85)
    with pytest.raises(JobError, match="smaller than one image, which is 17 tokens"):
        build_encoder(fixed_job(cache_dir, "clip", batching={"token_budgets": [16, 64], "max_items_per_batch": 1}), adapter, CPU)


def test_replay_equals_padded_eager_bitwise_and_unpadded_eager_closely(adapters) -> None:
    adapter = adapters["dinov2"]
    t = adapter.tokens_per_image
    manager = GraphManager(adapter, BudgetPlan((t, 4 * t, 16 * t), max_items=8, max_frames=16), "replay")
    manager.capture()
    items = [adapter.preprocessor()(m) for m in (random_image(90, 60, 1), random_video(3, 50, 80, 2), random_image(20, 20, 3))]
    budget = 16 * t
    replayed = torch.cat(manager.run(items, budget))
    padded = padded_eager(manager, items, budget)
    assert replayed.shape == (5, adapter.embed_dim) and padded.shape == (16, adapter.embed_dim)
    assert torch.equal(replayed, padded[:5]) and torch.isfinite(padded).all()
    with torch.no_grad():
        eager = adapter.forward(adapter.eager_inputs(items))
    assert torch.allclose(replayed, eager, rtol=1e-5, atol=1e-6)


def test_batch_assembly_is_one_uint8_tensor_made_with_as_many_torch_calls_for_any_batch(adapters) -> None:
    adapter = adapters["siglip"]
    media = [random_image(90, 60, 1), random_video(3, 50, 80, 2), random_image(20, 20, 3)] * 4
    items = [adapter.preprocessor()(m) for m in media]
    static = adapter.static_inputs(64 * adapter.tokens_per_image, max_items=16, max_frames=16)
    assert assembly_calls(adapter, items[:2], static) == assembly_calls(adapter, items, static)
    values = adapter.batch_values(items, static)[GLOBAL_KEY]
    assert values.dtype == static.tensors[GLOBAL_KEY].dtype == torch.uint8
    assert torch.equal(values, torch.cat([i.tensors[GLOBAL_KEY] for i in items]))


def test_batch_encoder_counts_hits_misses_and_padding_in_tokens(adapters) -> None:
    adapter = adapters["clip"]
    t = adapter.tokens_per_image
    plan = BudgetPlan((t, 2 * t, 4 * t), max_items=4, max_frames=8)
    manager = GraphManager(adapter, plan, "replay")
    manager.capture()
    media = [random_image(50, 50, 1), random_image(70, 30, 2), random_video(3, 40, 40, 3), random_video(6, 40, 40, 4)]
    items = [adapter.preprocessor()(m) for m in media]
    encoded = one_path_encoder(manager, "greedy").encode(items, "mean", torch.float32)
    assert encoded.failures == [None] * 4 and all(encoded.item(i).shape == (1, adapter.embed_dim) for i in range(4))
    stats = manager.stats
    assert (stats.hits, stats.misses) == (3, 1)  # the 6-frame video is 6 images > the 4-image budget
    assert stats.real_tokens == 11 * t and stats.padding_waste % t == 0


def run(job: str, out: Path, cache_dir: str, *extra: str) -> int:
    args = ["run", str(REPO / "jobs" / job), "--set", f"output.path={out}", "--set", f"runtime.cache_dir={cache_dir}"]
    return main([*args, "--set", "runtime.workers=0", "--set", "runtime.progress=false", *extra])


def read(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


def test_clip_demo_job_writes_projected_vectors_for_every_good_row(tmp_path: Path, cache_dir: str) -> None:
    assert run("demo-clip.yaml", tmp_path, cache_dir) == 0
    rows = read(tmp_path)
    assert [r["row"] for r in rows] == list(range(12))
    good = [r for r in rows if r["error"] is None]
    assert len(good) == 10 and all(len(r["embedding"]) == 48 and r["tokens"] == 17 and r["frames"] == 0 for r in good)
    assert rows[10]["error"].startswith("truncated: ") and rows[11]["error"].startswith("unknown_format: ")
    vectors = np.array([r["embedding"] for r in good], dtype=np.float32)
    assert np.isfinite(vectors).all() and len({v.tobytes() for v in vectors}) == 10
    stats = json.loads((tmp_path / "_embedjob/stats-00000.json").read_text())
    assert (stats["graph_hits"], stats["graph_misses"], stats["errors"]) == (10, 0, 2)
    assert all(b % 17 == 0 for b in stats["token_budgets"])


def test_siglip_video_demo_pools_frames_by_mean_or_keeps_every_patch_token(tmp_path: Path, cache_dir: str) -> None:
    assert run("demo-siglip-video.yaml", tmp_path / "mean", cache_dir, "--set", "output.dtype=float32") == 0
    assert run("demo-siglip-video.yaml", tmp_path / "none", cache_dir, "--set", "output.dtype=float32",
               "--set", "output.pooling=none") == 0
    pooled, tokens = read(tmp_path / "mean"), read(tmp_path / "none")
    assert [r["error"] is None for r in pooled] == [True] * 6 + [False] * 3
    assert [r["error"] is None for r in tokens] == [True] * 6 + [False] * 3
    videos = [r for r in tokens if r["modality"] == "video" and r["error"] is None]
    assert len(videos) == 5 and any(r["frames"] > 1 for r in videos)
    for row in tokens[:6]:
        views = max(row["frames"], 1)
        # 64x64 views of 16-pixel patches: a 4 x 4 grid of tokens per frame, no CLS.
        assert row["grid"] == [views, 4, 4] and row["tokens"] == views * 16
        assert np.array(row["embedding"], dtype=np.float32).shape == (views * 16, 64)


def test_embedjob_bench_times_the_fixed_towers_against_plain_transformers(tmp_path: Path) -> None:
    """`embedjob bench`'s fixed-resolution rows: each tower saved like a user's checkpoint,
    timed as plain transformers and through embedjob's graphs, whose embeddings must be
    transformers' own (the note's cosine)."""
    from embedjob.bench import fixed_rows

    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=16, image_size=32)
    towers = {"siglip": ("tiny SigLIP", {**tiny, "vision_use_head": True}), "clip": ("tiny CLIP", {**tiny, "projection_dim": 16})}
    rows = fixed_rows(tmp_path, towers, 3, 2, 1e12, torch.device("cpu"), compiled=False)
    assert [(r.mix, r.variant) for r in rows] == [
        ("tiny SigLIP", "plain_transformers_eager"), ("tiny SigLIP", "ours_graphs"),
        ("tiny CLIP", "plain_transformers_eager"), ("tiny CLIP", "ours_graphs"),
    ]
    assert all(r.items == 3 and r.seconds > 0 and r.flops > 0 for r in rows)
    for ours in rows[1::2]:
        assert float(ours.note.rsplit("min cos to plain ", 1)[1]) > 0.9999, ours.note


@pytest.mark.parametrize(("kernel", "size"), [((14, 14), (56, 56)), ((16, 16), (40, 53)), ((2, 3), (7, 10))])
def test_a_patch_product_computes_the_convolution_and_hands_on_row_major_tokens(kernel: tuple, size: tuple) -> None:
    """The patch embedding as one matrix product: the convolution's output (a partial last
    patch dropped, as the convolution drops it), with and without a bias, laid out so the
    embeddings' flatten-and-transpose gives row-major tokens; a convolution it does not
    compute (overlapping, padded) is left alone."""
    torch.manual_seed(0)
    for bias in (True, False):
        conv = torch.nn.Conv2d(3, 8, kernel_size=kernel, stride=kernel, bias=bias)
        pixels = torch.randn(2, 3, *size)
        got = PatchProduct(conv)(pixels)
        torch.testing.assert_close(got, conv(pixels), rtol=1e-5, atol=1e-5)
        assert got.flatten(2).transpose(1, 2).is_contiguous()
    assert not PatchProduct.fits(torch.nn.Conv2d(3, 8, kernel_size=kernel, stride=1))
    assert not PatchProduct.fits(torch.nn.Conv2d(3, 8, kernel_size=kernel, stride=kernel, padding=1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_embeds_its_patches_by_one_matrix_product(adapters, family: str) -> None:
    """Each tower's patch convolution is a `PatchProduct` (cuDNN's convolution took SigLIP
    ten times as long), its parameters the checkpoint's (the embeddings equal transformers'
    above)."""
    modules = list(adapters[family].tower.embeddings.modules())
    assert sum(isinstance(module, PatchProduct) for module in modules) == 1
    assert not any(isinstance(module, torch.nn.Conv2d) for module in modules)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_block_reads_a_row_major_hidden_state(adapters, family: str) -> None:
    """From a convolution, SigLIP's embeddings come out transposed; left so, every compiled
    block would read (or copy) a strided state. Each block and each of its norms must see
    a contiguous one (the patch product hands on row-major tokens)."""
    adapter = adapters[family]
    seen: list[tuple[str, bool]] = []
    hooks = []
    for index, block in enumerate(adapter.compile_units()):
        for name, module in block.named_modules():
            if name == "" or "norm" in name:
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, key=f"{index}.{name or 'block'}": seen.append((key, args[0].is_contiguous()))
                ))
    try:
        _embed(adapter, [random_image(90, 60, 1), random_image(30, 40, 2)])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) >= 3 * len(adapter.compile_units())
    assert [key for key, contiguous in seen if not contiguous] == []


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlps_padded_to_whole_tiles_embed_as_the_checkpoint_does(adapters, family: str) -> None:
    """`fixed.MLP_MULTIPLE` pads the blocks' MLP widths with zero channels on CUDA (SigLIP's
    4,304 is not a whole number of 128-wide tiles): the vectors must not move."""
    adapter = copy.deepcopy(adapters[family])
    blocks = adapter.compile_units()
    widths = [block.mlp.fc1.out_features for block in blocks if hasattr(block.mlp, "fc1")]
    pad_mlps(blocks_at(adapter.tower, FAMILIES[family].layers), 48)  # the tiny towers' 128 is a whole number of 128-wide tiles
    grown = [block.mlp.fc1.out_features for block in adapter.compile_units() if hasattr(block.mlp, "fc1")]
    assert all(width % 48 == 0 and width > old for width, old in zip(grown, widths))
    if family != "dinov3":  # its MLP is up_proj, down_proj: no layout of base.MLP_LAYOUTS, left as it is
        assert grown, f"{family}'s MLPs were not padded"
    media = [random_image(90, 60, 1), random_image(30, 40, 2)]
    torch.testing.assert_close(_embed(adapter, media), _embed(adapters[family], media), rtol=1e-5, atol=1e-5)


def test_fixed_flops_reads_a_siglip_vision_checkpoint_saved_without_vision_use_head(tmp_path: Path) -> None:
    """`embedjob bench` and the benchmarks read a user's SigLIP tower whose config.json
    has no `vision_use_head` (as transformers 5.17 saves a SiglipVisionModel): it has the
    pooling head, and the FLOPs count it as torch's own counter does."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, SiglipVisionConfig, SiglipVisionModel

    from embedjob.bench import fixed_flops

    values = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=16)
    SiglipVisionModel(SiglipVisionConfig(**values)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("vision_use_head", None)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    model = SiglipVisionModel.from_pretrained(tmp_path, attn_implementation="eager")
    # This transformers' config class has the key as a class default; 5.17's has none.
    config = SimpleNamespace(**AutoConfig.from_pretrained(tmp_path).to_dict())
    del config.vision_use_head
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(pixel_values=torch.zeros(1, 3, 32, 32))
    assert fixed_flops("siglip", config, None) == counter.get_total_flops()


def test_embedjob_bench_keeps_each_row_it_timed_when_cut_short_and_offers_every_tower(tmp_path: Path, caplog) -> None:
    """A bench a device call's time limit cuts short still leaves the rows it timed, in its
    log and in bench.md, each as it was timed; `--fixed-towers` offers every tower the bench
    builds, and a bare `--mixes` (the families only) parses."""
    import logging

    from embedjob.bench import FIXED_TOWERS, Row, Table
    from embedjob.cli import _parser

    table = Table(tmp_path / "bench.md", {"date": "today", "device": "cpu"})
    with caplog.at_level(logging.INFO, logger="embedjob.bench"):
        table.add([Row("tiny SigLIP", "ours_graphs", 3, 0.5, 3e9, 1e12, note="1.200x plain")])
    saved = (tmp_path / "bench.md").read_text()
    assert "| tiny SigLIP | ours_graphs | 3 | 0.500 | 6.0 | 0.6% |" in saved and "- device: cpu" in saved
    assert "tiny SigLIP | ours_graphs | 3 | 0.500 | 6.0" in caplog.text
    table.add([Row("tiny CLIP", "ours_graphs", 2, 0.25, 1e9, 1e12)])
    assert "tiny SigLIP" in (tmp_path / "bench.md").read_text() and "tiny CLIP" in table.text()

    args = _parser().parse_args(["bench", "--mixes", "--fixed-towers", "dinov3", "open_clip"])
    assert args.mixes == [] and args.fixed_towers == ["dinov3", "open_clip"]
    offered = _parser().parse_args(["bench"]).fixed_towers
    assert set(offered) == {*FIXED_TOWERS, "open_clip"}
