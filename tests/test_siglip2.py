"""SigLIP 2 NaFlex (`model.family: siglip2`): `embedjob run` on a user's checkpoint gives
`Siglip2Model.get_image_features` of the processor's output for every real photo;
preprocessing, packing, graph replay, per-token rows, video frames, deferred JPEGs,
vision-only checkpoints and the family read from config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job, random_image, random_video
from engine_helpers import padded_eager
from PIL import Image, ImageOps
from test_qwen import assembly_calls
from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model, Siglip2VisionModel
from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.encoders import load_adapter
from embedjob.encoders.fixed import FAMILIES as FIXED
from embedjob.encoders.fixed import builtin_dir as fixed_builtin_dir
from embedjob.encoders.siglip2 import BUILTIN_TEXT, builtin_dir, naflex_size
from embedjob.engine.graphs import GraphManager
from embedjob.engine.packer import BudgetPlan

CPU = torch.device("cpu")
PHOTOS = ["img2dataset_123_456.jpg", "img2dataset_456_123.jpg", "img2dataset_208_495.jpg",
          "img2dataset_416_264.jpg", "mmaction2_test.jpg"]
"""Real photos of five aspect ratios (tests/data/LICENSES.tsv)."""
SIZES = [(224, 224), (300, 500), (641, 479), (5, 900), (30, 30), (1000, 57), (1, 1)]
USER_VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3, patch_size=16, num_patches=36)
USER_PROCESSOR = dict(patch_size=16, max_num_patches=80, resample=3, image_mean=[0.4, 0.45, 0.5], image_std=[0.25, 0.3, 0.35])
"""A user's checkpoint unlike the builtin: a 6 x 6 table for up to 80 patches, bicubic, its own statistics."""


def job(cache_dir: str, path: str | None = None, **sections: dict):
    model = {"family": "siglip2", "path": path or "builtin:tiny-siglip2", **sections.pop("model", {})}
    return make_job(cache_dir, model=model, **sections)


@pytest.fixture(scope="module")
def adapter(cache_dir: str):
    return load_adapter(job(cache_dir), CPU)


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full Siglip2Model (random weights, seed 3) saved as a user saves one, its image
    processor beside it."""
    directory = tmp_path_factory.mktemp("user-siglip2")
    torch.manual_seed(3)
    Siglip2Model(Siglip2Config(text_config=BUILTIN_TEXT, vision_config=USER_VISION)).save_pretrained(directory)
    Siglip2ImageProcessor(**USER_PROCESSOR).save_pretrained(directory)
    return directory


def _photo(name: str) -> np.ndarray:
    """A photo upright in RGB, decoded by Pillow: the reference's own decode."""
    with Image.open(REPO / "tests" / "data" / name) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


def _reference(directory: Path, images: list[np.ndarray]) -> torch.Tensor:
    """What a transformers user gets: the processor's padded batch through get_image_features."""
    processor = Siglip2ImageProcessor.from_pretrained(directory)
    inputs = processor(images=[torch.from_numpy(i).permute(2, 0, 1) for i in images], return_tensors="pt")
    with torch.no_grad():
        return Siglip2Model.from_pretrained(directory).get_image_features(**inputs).pooler_output


def _embed(adapter, media: list) -> list[torch.Tensor]:
    items = [adapter.preprocessor()(m) for m in media]
    with torch.no_grad():
        return [rows.clone() for rows in adapter.split(adapter.forward(adapter.eager_inputs(items)), items)]


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def _run(tmp_path: Path, cache_dir: str, model: dict, *extra: str) -> list[dict]:
    """`embedjob run` over the photos (an id each) on the CPU in float32; the rows written."""
    parquet = tmp_path / "photos.parquet"
    blobs = [(REPO / "tests" / "data" / name).read_bytes() for name in PHOTOS]
    pq.write_table(pa.table({"id": PHOTOS, "image": pa.array(blobs, type=pa.binary())}), parquet)
    spec = {
        "input": {"path": str(parquet), "media_column": "image", "id_column": "id"},
        "model": {**model, "dtype": "float32"},
        "output": {"path": str(tmp_path / "out"), "dtype": "float32"},
        "runtime": {"device": "cpu", "workers": 0, "progress": False, "cache_dir": cache_dir},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(spec))
    sets = [a for s in extra for a in ("--set", s)]
    assert main(["run", str(tmp_path / "job.yaml"), *sets]) == 0
    return pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()


def test_embedjob_run_gives_get_image_features_of_every_real_photo(tmp_path: Path, cache_dir: str, user_checkpoint: Path) -> None:
    """The contract: a user's checkpoint, its family left out (read from config.json),
    real photos of mixed aspect ratios packed together, float32 on the CPU."""
    rows = _run(tmp_path, cache_dir, {"path": str(user_checkpoint)})
    assert [r["id"] for r in rows] == PHOTOS and all(r["error"] is None for r in rows)
    reference = _reference(user_checkpoint, [_photo(name) for name in PHOTOS])
    processor = Siglip2ImageProcessor.from_pretrained(user_checkpoint)
    for row, ref, name in zip(rows, reference, PHOTOS):
        ours = torch.tensor(row["embedding"])
        assert ours.shape == (48,) and _relative(ours, ref) < 1e-3, name
        height, width = _photo(name).shape[:2]
        h, w = get_image_size_for_max_num_patches(height, width, 16, processor.max_num_patches)
        assert row["tokens"] == (h // 16) * (w // 16) and row["frames"] == 0
    assert len({r["tokens"] for r in rows}) > 1, "the photos' token counts differ: they were packed, not padded"


def test_per_token_rows_of_a_run_are_the_final_states_on_each_photos_grid(tmp_path: Path, cache_dir: str, user_checkpoint: Path) -> None:
    rows = _run(tmp_path, cache_dir, {"path": str(user_checkpoint)}, "output.pooling=none")
    processor = Siglip2ImageProcessor.from_pretrained(user_checkpoint)
    tower = Siglip2Model.from_pretrained(user_checkpoint).vision_model
    for row, name in zip(rows, PHOTOS):
        inputs = processor(images=[torch.from_numpy(_photo(name)).permute(2, 0, 1)], return_tensors="pt")
        h, w = inputs["spatial_shapes"][0].tolist()
        assert row["grid"] == [1, h, w] and row["tokens"] == h * w, name
        with torch.no_grad():
            states = tower(**inputs).last_hidden_state[0, : h * w]
        ours = torch.tensor(row["embedding"])
        assert ours.shape == states.shape and _relative(ours, states) < 1e-3, name


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_preprocessing_is_the_processors_bitwise(adapter, cache_dir: str, height: int, width: int) -> None:
    image = random_image(height, width, seed=height + width)
    item = adapter.preprocessor()(image)
    ref = Siglip2ImageProcessor.from_pretrained(builtin_dir(cache_dir))(
        images=[torch.from_numpy(image.pixels).permute(2, 0, 1)], return_tensors="pt"
    )
    h, w = ref["spatial_shapes"][0].tolist()
    assert item.grid == item.token_grid == (1, h, w) and item.tokens == h * w == int(ref["pixel_attention_mask"].sum())
    assert item.tensors["pixel_values"].dtype == torch.uint8, "workers ship resized uint8 patches"
    assert torch.equal(adapter.processing.normalize(item.tensors["pixel_values"]), ref["pixel_values"][0, : h * w])


def test_the_naflex_size_is_the_processors_for_every_shape_and_patch_count() -> None:
    rng = np.random.default_rng(0)
    shapes = [(int(h), int(w)) for h, w in rng.integers(1, 3000, (300, 2))] + [(1, 1), (1, 4000), (16, 16), (4096, 3)]
    for (height, width), patches in zip(shapes, rng.choice([16, 64, 96, 256, 576, 1024], len(shapes))):
        expected = get_image_size_for_max_num_patches(height, width, 16, int(patches))
        assert naflex_size(height, width, 16, int(patches)) == expected, (height, width, patches)


def test_checkpoint_processor_settings_are_followed(adapter, cache_dir: str, user_checkpoint: Path) -> None:
    user = load_adapter(job(cache_dir, str(user_checkpoint)), CPU)
    assert (user.processing.max_patches, user.processing.patch_size) == (80, 16)
    images = [random_image(h, w, seed=h) for h, w in SIZES[:4]]
    ref = Siglip2ImageProcessor.from_pretrained(user_checkpoint)(
        images=[torch.from_numpy(i.pixels).permute(2, 0, 1) for i in images], return_tensors="pt"
    )
    for k, image in enumerate(images):
        item = user.preprocessor()(image)
        assert torch.equal(user.processing.normalize(item.tensors["pixel_values"]), ref["pixel_values"][k, : item.tokens])
    capped = load_adapter(job(cache_dir, str(user_checkpoint), preprocess={"max_pixels": 40 * 256}), CPU)
    assert capped.processing.max_patches == capped.processing.video_max_patches == 40


def test_a_packed_batch_gives_each_image_its_own_vector(adapter) -> None:
    media = [random_image(h, w, seed=h * 3 + w) for h, w in SIZES]
    together = _embed(adapter, media)
    for image, packed in zip(media, together):
        (alone,) = _embed(adapter, [image])
        assert packed.shape == (1, adapter.embed_dim) and torch.allclose(packed, alone, rtol=1e-5, atol=1e-6)


def test_video_gives_one_row_per_frame_equal_to_the_frame_as_an_image(adapter) -> None:
    video = random_video(3, 90, 160, seed=4)
    item = adapter.preprocessor()(video)
    views, h, w = item.grid
    assert (views, item.frames, item.modality, item.tokens, item.token_grid) == (3, 3, "video", 3 * h * w, (3, h, w))
    frames = [SimpleNamespace(pixels=np.ascontiguousarray(frame)) for frame in video.frames]
    assert adapter.row_counts([item, adapter.preprocessor()(frames[0])]) == [3, 1]
    (rows,) = _embed(adapter, [video])
    assert rows.shape == (3, adapter.embed_dim)
    assert torch.allclose(rows, torch.cat(_embed(adapter, frames)), rtol=1e-5, atol=1e-6)


def test_replay_equals_padded_eager_bitwise_and_pad_rows_leave_real_rows_alone(adapter) -> None:
    manager = GraphManager(adapter, BudgetPlan((96, 384, 1024), max_items=8, max_frames=8), "replay")
    manager.capture()
    media = [random_image(90, 60, 1), random_video(2, 50, 80, 2), random_image(20, 400, 3), random_image(300, 300, 4)]
    items = [adapter.preprocessor()(m) for m in media]
    assert sum(i.tokens for i in items) < 1024
    replayed = torch.cat(manager.run(items, 1024))
    padded = padded_eager(manager, items, 1024)
    assert replayed.shape == (5, adapter.embed_dim) and torch.isfinite(padded).all()
    assert torch.equal(replayed, padded[:5])
    eager = torch.cat(_embed(adapter, media))
    assert torch.allclose(replayed, eager, rtol=1e-5, atol=1e-6)
    static = manager.padded_inputs(items, 1024)
    static.tensors["pixel_values"][sum(i.tokens for i in items) :] = 255  # other pad pixels: the real rows stay
    with torch.inference_mode():
        assert torch.equal(adapter.forward(static)[:5], replayed)


def test_per_token_replay_gives_each_images_final_states_on_its_grid(cache_dir: str) -> None:
    per_token = load_adapter(job(cache_dir, output={"pooling": "none"}), CPU)
    manager = GraphManager(per_token, BudgetPlan((512,), max_items=4, max_frames=0), "replay")
    manager.capture()
    media = [random_image(120, 80, 5), random_image(33, 500, 6)]
    items = [per_token.preprocessor()(m) for m in media]
    rows = manager.run(items, 512)
    tower = Siglip2Model.from_pretrained(builtin_dir(cache_dir)).vision_model
    processor = Siglip2ImageProcessor.from_pretrained(builtin_dir(cache_dir))
    for image, item, ours in zip(media, items, rows):
        inputs = processor(images=[torch.from_numpy(image.pixels).permute(2, 0, 1)], return_tensors="pt")
        with torch.no_grad():
            states = tower(**inputs).last_hidden_state[0, : item.tokens]
        assert ours.shape == (item.tokens, per_token.embed_dim) and _relative(ours, states) < 1e-5


def test_batch_assembly_makes_as_many_torch_calls_for_twelve_items_as_for_two(adapter) -> None:
    items = [adapter.preprocessor()(m) for m in [random_image(90, 60, 1), random_video(3, 50, 80, 2), random_image(20, 20, 3)] * 4]
    static = adapter.static_inputs(4096, max_items=16, max_frames=16)
    assert assembly_calls(adapter, items[:2], static) == assembly_calls(adapter, items, static)


def test_a_deferred_jpeg_gets_the_cpu_items_grid_and_patches(adapter) -> None:
    """`preprocess.decoder: gpu`: the grid from the header alone, the patches from the
    decoded picture (here decoded on the CPU, so they are the CPU path's exactly)."""
    data = (REPO / "tests" / "data" / PHOTOS[2]).read_bytes()
    pixels = _photo(PHOTOS[2])
    cpu = adapter.preprocessor()(SimpleNamespace(pixels=pixels))
    deferred = adapter.preprocessor().deferred(torch.frombuffer(bytearray(data), dtype=torch.uint8), *pixels.shape[:2])
    assert (deferred.grid, deferred.tokens) == (cpu.grid, cpu.tokens)
    (done,) = adapter.preprocessor().on_device([deferred], torch.from_numpy(pixels).permute(2, 0, 1)[None])
    assert done.tensors.keys() == {"pixel_values"} and torch.equal(done.tensors["pixel_values"], cpu.tensors["pixel_values"])


def test_a_vision_only_checkpoint_gives_the_full_models_vectors(tmp_path: Path, cache_dir: str, user_checkpoint: Path) -> None:
    full = Siglip2Model.from_pretrained(user_checkpoint)
    vision = Siglip2VisionModel(full.config.vision_config)
    vision.load_state_dict(full.vision_model.state_dict())
    vision.save_pretrained(tmp_path / "vision")
    shutil.copy(user_checkpoint / "preprocessor_config.json", tmp_path / "vision")
    images = [random_image(80, 200, 8), random_image(40, 40, 9)]
    ours = _embed(load_adapter(job(cache_dir, str(tmp_path / "vision")), CPU), images)
    ref = _reference(user_checkpoint, [i.pixels for i in images])
    assert all(_relative(o[0], r) < 1e-5 for o, r in zip(ours, ref))


def test_the_family_is_read_from_config_json_or_the_builtins_name(tmp_path: Path, cache_dir: str, user_checkpoint: Path) -> None:
    vision = tmp_path / "vision"
    Siglip2VisionModel(Siglip2Config(vision_config=USER_VISION).vision_config).save_pretrained(vision)
    for path in (str(user_checkpoint), str(vision), "builtin:tiny-siglip2"):
        assert make_job(cache_dir, model={"path": path}).model.family == "siglip2", path


def test_a_wrong_family_is_a_clear_error(cache_dir: str, user_checkpoint: Path) -> None:
    siglip = str(fixed_builtin_dir(FIXED["siglip"], cache_dir))
    with pytest.raises(ValueError, match="model_type 'siglip'.*set model.family to 'siglip'"):
        load_adapter(job(cache_dir, siglip), CPU)
    with pytest.raises(ValueError, match="model_type 'siglip2'; model.family 'siglip' expects"):
        load_adapter(make_job(cache_dir, model={"family": "siglip", "path": str(user_checkpoint)}), CPU)
    with pytest.raises(ValueError, match=r"did you mean builtin:tiny-siglip2 \(model.family: siglip2\)"):
        load_adapter(make_job(cache_dir, model={"family": "clip", "path": "builtin:tiny-siglip2"}), CPU)
    with pytest.raises(JobError, match="tiling = 'anyres' needs a fixed-resolution encoder"):
        job(cache_dir, preprocess={"tiling": "anyres"})


def test_builtin_model_is_a_full_siglip2_model_made_once(adapter, cache_dir: str) -> None:
    directory = builtin_dir(cache_dir)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "siglip2"
    stamp = (directory / "config.json").stat().st_mtime_ns
    again = load_adapter(job(cache_dir), CPU)
    assert (directory / "config.json").stat().st_mtime_ns == stamp
    for (name, a), b in zip(adapter.tower.state_dict().items(), again.tower.state_dict().values()):
        assert torch.equal(a, b), name
    assert Siglip2Model.from_pretrained(directory).text_model.config.vocab_size == BUILTIN_TEXT["vocab_size"]


def test_embedjob_bench_times_packed_graphs_against_transformers_padded_batches(tmp_path: Path) -> None:
    """`embedjob bench`'s NaFlex rows on a tiny tower saved as a user's checkpoint: both
    sides embed every image, and ours are transformers' own vectors."""
    from embedjob.bench import naflex_mix, naflex_rows, save_naflex_tower

    tiny = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=16, num_patches=16)
    save_naflex_tower(tiny, 24, tmp_path / "tower")
    rows = naflex_rows(tmp_path / "tower", "tiny", naflex_mix(5), 2, 1, 1e12, CPU, compiled=False)
    assert [r.variant for r in rows] == ["plain_transformers_eager", "ours_graphs"]
    assert all(r.items == 5 and r.seconds > 0 and r.flops > 0 for r in rows)
    assert rows[0].waste > 0, "transformers pads every image to max_num_patches"
    assert float(rows[1].note.rsplit("min cos to plain ", 1)[1]) > 0.9999, rows[1].note


def test_a_video_job_writes_a_vector_per_row_and_every_frames_tokens_on_its_grid(tmp_path: Path, cache_dir: str) -> None:
    """The video demo (real clips, a photo, three broken rows) with the builtin SigLIP 2:
    `pooling: mean` one vector per good row (a video's frame rows pooled; that the rows
    are the frames' own vectors is checked above), `pooling: none` every frame's patch
    tokens on (frames, h, w), and the same error rows either way."""
    sets = ["model.family=siglip2", "model.path=builtin:tiny-siglip2", "output.dtype=float32", "runtime.workers=0",
            "runtime.progress=false", f"runtime.cache_dir={cache_dir}"]
    outputs = {}
    for pooling in ("mean", "none"):
        out = tmp_path / pooling
        args = [a for s in [*sets, f"output.path={out}", f"output.pooling={pooling}"] for a in ("--set", s)]
        assert main(["run", str(REPO / "jobs" / "demo-siglip-video.yaml"), *args]) == 0
        outputs[pooling] = pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()
    pooled, tokens = outputs["mean"], outputs["none"]
    assert [r["error"] is None for r in pooled] == [r["error"] is None for r in tokens] == [True] * 6 + [False] * 3
    videos = [r for r in tokens if r["modality"] == "video" and r["error"] is None]
    assert len(videos) == 5 and any(r["frames"] > 1 for r in videos)
    for row in tokens[:6]:
        views, h, w = row["grid"]
        assert views == max(row["frames"], 1) and row["tokens"] == views * h * w
        assert np.array(row["embedding"], dtype=np.float32).shape == (views * h * w, 64)
    assert all(len(r["embedding"]) == 64 and np.isfinite(r["embedding"]).all() for r in pooled[:6])
