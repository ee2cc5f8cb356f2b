"""Qwen-VL adapter: preprocessing parity with transformers, packed eager forward
against the unmodified model, and loading user checkpoints (vision-only and full)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import REPO, make_job, random_image, random_video
from torch.overrides import TorchFunctionMode
from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

from embedjob.encoders import load_adapter
from embedjob.encoders.qwen import FAMILIES, builtin_dir, load_model, smart_resize

SIZES = [(224, 224), (300, 500), (641, 479), (57, 1000), (1400, 900), (30, 30)]


def _reference_processor(adapter, video: bool = False):
    p = adapter.processing
    common = dict(
        patch_size=p.patch_size,
        temporal_patch_size=p.temporal_patch_size,
        merge_size=p.merge_size,
        image_mean=list(p.mean),
        image_std=list(p.std),
    )
    if video:
        size = {"shortest_edge": p.video_min_pixels, "longest_edge": p.video_max_pixels}
        return Qwen2VLVideoProcessor(size=size, **common)
    return Qwen2VLImageProcessor(size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels}, **common)


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_image_preprocessing_equals_transformers(qwen_adapter, height: int, width: int) -> None:
    image = random_image(height, width, seed=height)
    ours = qwen_adapter.preprocessor()(image)
    ref = _reference_processor(qwen_adapter)(
        images=[torch.from_numpy(image.pixels).permute(2, 0, 1)], return_tensors="pt"
    )
    assert ours.tensors["grid_thw"].tolist() == ref["image_grid_thw"][0].tolist()
    assert ours.tensors["pixel_values"].dtype == torch.uint8, "workers ship resized uint8 patches"
    assert torch.equal(qwen_adapter.processing.model_pixels(ours.tensors["pixel_values"]), ref["pixel_values"])
    t, h, w = ours.tensors["grid_thw"].tolist()
    assert ours.tokens == t * h * w // 4 and ours.frames == 0 and ours.modality == "image"


@pytest.mark.parametrize(("frames", "height", "width"), [(4, 240, 320), (3, 50, 66), (8, 720, 1280)])
def test_video_preprocessing_equals_transformers(qwen_adapter, frames: int, height: int, width: int) -> None:
    video = random_video(frames, height, width)
    ours = qwen_adapter.preprocessor()(video)
    processor = _reference_processor(qwen_adapter, video=True)
    kwargs = {"do_sample_frames": False, "return_tensors": "pt"}
    if "cap_pixels_per_frame" in inspect.signature(processor._preprocess).parameters:
        kwargs["cap_pixels_per_frame"] = False
    ref = processor(videos=[torch.from_numpy(video.frames).permute(0, 3, 1, 2)], **kwargs)
    assert ours.tensors["grid_thw"].tolist() == ref["video_grid_thw"][0].tolist()
    assert torch.equal(qwen_adapter.processing.model_pixels(ours.tensors["pixel_values"]), ref["pixel_values_videos"])
    t, h, w = ours.tensors["grid_thw"].tolist()
    assert t == -(-frames // 2) and ours.frames == frames and ours.tokens == t * h * w // 4


def test_smart_resize_keeps_bounds_and_multiples() -> None:
    for height, width in SIZES:
        h, w = smart_resize(height, width, 28, 56 * 56, 448 * 448)
        assert h % 28 == 0 and w % 28 == 0
        assert 56 * 56 <= h * w <= 448 * 448
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 56 * 56, 448 * 448)


def _reference_embeddings(adapter, items) -> list[torch.Tensor]:
    """The unmodified transformers tower (sdpa attention), one item at a time."""
    model = adapter.model
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            return [
                model(hidden_states=adapter.processing.model_pixels(i.tensors["pixel_values"]), grid_thw=i.tensors["grid_thw"][None]).pooler_output
                for i in items
            ]
    finally:
        model.config._attn_implementation = saved


def _relative_errors(adapter, media) -> list[float]:
    items = [adapter.preprocessor()(m) for m in media]
    with torch.no_grad():
        packed = adapter.split(adapter.forward(adapter.eager_inputs(items)), items)
    refs = _reference_embeddings(adapter, items)
    return [float((ours - ref).norm() / ref.norm()) for ours, ref in zip(packed, refs)]


MIXED_MEDIA = [random_image(224, 224, 1), random_image(300, 500, 2), random_video(4, 112, 168, 3), random_image(640, 480, 4)]


def test_split_cuts_each_items_row_count_in_batch_order_and_drops_pad_rows(qwen_adapter) -> None:
    items = [qwen_adapter.preprocessor()(m) for m in MIXED_MEDIA]
    counts = qwen_adapter.row_counts(items)
    assert counts == [i.tokens for i in items]  # one row per output token
    output = torch.arange(sum(counts) + 7).unsqueeze(1)  # 7 pad rows, as a budget's output has
    views = qwen_adapter.split(output, items)
    assert [v.shape[0] for v in views] == counts
    assert torch.equal(torch.cat(views), output[: sum(counts)])


def _batch_reference(adapter, items) -> dict[str, torch.Tensor]:
    """transformers' own precomputes for the whole batch's grids, and every item's full
    uint8 patch rows (an image's one stored copy repeated over the temporal slots)."""
    from transformers import vision_utils as vu

    p = adapter.processing
    grids = torch.stack([i.tensors["grid_thw"] for i in items])
    pixels = [i.tensors["pixel_values"] for i in items]
    ref = {
        "pixel_values": torch.cat([x.expand(-1, -1, p.temporal_patch_size, -1).reshape(x.shape[0], -1) for x in pixels]),
        "position_ids": vu.get_vision_position_ids(grids, p.merge_size),
        "cu_seqlens": vu.get_vision_cu_seqlens(grids),
    }
    if p.window_size is not None:
        ref["window_index"], ref["cu_window_seqlens"] = vu.get_vision_window_index(
            grids, spatial_merge_size=p.merge_size, window_size=p.window_size, patch_size=p.patch_size
        )
    if p.pos_grid_side is not None:
        ref["interp_indices"], ref["interp_weights"] = vu.get_vision_interpolation_indices_and_weights(
            grids, p.pos_grid_side, mode="bilinear", align_corners=True, spatial_merge_size=p.merge_size
        )
    return ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_assembly_equals_transformers_precomputes_for_the_whole_batch(cache_dir: str, family: str) -> None:
    adapter = load_adapter(make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"}), torch.device("cpu"))
    items = [adapter.preprocessor()(m) for m in MIXED_MEDIA]
    assert [i.tensors["pixel_values"].shape[2] for i in items] == [1, 1, 2, 1]  # an image ships one temporal copy
    assert all(i.grid == tuple(i.tensors["grid_thw"].tolist()) for i in items)
    ref = _batch_reference(adapter, items)
    eager = adapter.eager_inputs(items).tensors
    assert eager.keys() == ref.keys()
    for key, value in eager.items():
        assert value.dtype == ref[key].dtype and torch.equal(value, ref[key]), key
    budget = 1024
    static = adapter.static_inputs(budget, max_items=8, max_frames=8)
    padded = adapter.batch_values(items, static)
    for key, value in padded.items():
        real = ref[key].shape[0]
        assert value.dtype == static.tensors[key].dtype and torch.equal(value[:real], ref[key]), key
        if key in ("cu_seqlens", "cu_window_seqlens"):  # filled to the buffer, ending at the budget's patches
            assert value.shape == static.tensors[key].shape and int(value[-1]) == 4 * budget
    if "window_index" in padded:  # pad merge units map to themselves
        real = ref["window_index"].shape[0]
        assert torch.equal(padded["window_index"][real:], torch.arange(real, budget))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_items_of_one_grid_share_their_metadata_and_batches_of_them_stay_exact(cache_dir: str, family: str) -> None:
    """A worker computes a grid's metadata once; batches of many such items, assembled
    twice, still equal transformers' precomputes, and assembling them writes nothing
    into the shared tensors."""
    adapter = load_adapter(make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"}), torch.device("cpu"))
    items = [adapter.preprocessor()(random_image(224, 168, seed)) for seed in range(3)] + [
        adapter.preprocessor()(random_image(112, 224, 9))
    ]
    shared = [k for k in items[0].tensors if k not in ("pixel_values", "grid_thw")]
    assert shared and all(items[0].tensors[k] is items[2].tensors[k] for k in shared)
    assert all(items[0].tensors[k] is not items[3].tensors[k] for k in shared)  # another grid, its own
    before = {k: items[0].tensors[k].clone() for k in shared}
    ref = _batch_reference(adapter, items)
    static = adapter.static_inputs(1024, max_items=8, max_frames=8)
    for _ in range(2):
        eager, padded = adapter.eager_inputs(items).tensors, adapter.batch_values(items, static)
        for key in ref:
            assert torch.equal(eager[key], ref[key]) and torch.equal(padded[key][: ref[key].shape[0]], ref[key]), key
    assert all(torch.equal(items[0].tensors[k], before[k]) for k in shared)


class TorchCalls(TorchFunctionMode):
    """Counts torch function calls (attribute reads such as `.shape` excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") != "__get__"
        return func(*args, **(kwargs or {}))


def assembly_calls(adapter, items, static) -> tuple[int, int]:
    """Torch calls that `batch_values` and `eager_inputs` make for one batch."""
    counts = []
    for assemble in (lambda: adapter.batch_values(items, static), lambda: adapter.eager_inputs(items)):
        with TorchCalls() as counter:
            assemble()
        counts.append(counter.calls)
    return counts[0], counts[1]


def test_batch_assembly_makes_as_many_torch_calls_for_twelve_items_as_for_two(qwen_adapter) -> None:
    """Each torch call on the main thread costs microseconds and gives up the GIL: a
    batch is assembled with a fixed number of them, not a few per item."""
    items = [qwen_adapter.preprocessor()(m) for m in MIXED_MEDIA * 3]
    static = qwen_adapter.static_inputs(2048, max_items=16, max_frames=16)
    assert assembly_calls(qwen_adapter, items[:2], static) == assembly_calls(qwen_adapter, items, static)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_eager_forward_matches_transformers_per_item(cache_dir: str, family: str) -> None:
    job = make_job(cache_dir, model={"family": family, "path": f"builtin:tiny-{family}"})
    adapter = load_adapter(job, torch.device("cpu"))
    errors = _relative_errors(adapter, MIXED_MEDIA)
    assert max(errors) < 1e-5, errors


def test_builtin_model_is_made_once_and_reloaded_identically(cache_dir: str, qwen_adapter) -> None:
    directory = builtin_dir(FAMILIES["qwen2_5_vl"], cache_dir)
    assert (directory / "config.json").exists() and (directory / "preprocessor_config.json").exists()
    again = load_model(FAMILIES["qwen2_5_vl"], directory, torch.float32)
    for (name, a), (_, b) in zip(qwen_adapter.model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_full_vision_language_checkpoint_loads_only_the_tower(tmp_path: Path, cache_dir: str) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from embedjob.encoders.qwen import BUILTIN_CONFIGS

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=BUILTIN_CONFIGS["qwen2_5_vl"])
    torch.manual_seed(1)
    full = Qwen2_5_VLForConditionalGeneration(config)
    full.save_pretrained(tmp_path / "full")
    job = make_job(cache_dir, model={"path": str(tmp_path / "full")})
    adapter = load_adapter(job, torch.device("cpu"))
    visual = full.model.visual.state_dict()
    loaded = adapter.model.state_dict()
    assert visual.keys() == loaded.keys()
    assert all(torch.equal(visual[k], loaded[k]) for k in visual)


def test_wrong_family_for_checkpoint_is_a_clear_error(tmp_path: Path, cache_dir: str) -> None:
    directory = builtin_dir(FAMILIES["qwen2_vl"], cache_dir)
    job = make_job(cache_dir, model={"family": "qwen2_5_vl", "path": str(directory)})
    with pytest.raises(ValueError, match="model_type 'qwen2_vl_vision'.*set model.family to 'qwen2_vl'"):
        load_adapter(job, torch.device("cpu"))
    # A family given that the builtin does not match stays an error (left out, the builtin's own is taken).
    with pytest.raises(ValueError, match="is a qwen3_vl model but model.family is 'qwen2_5_vl'"):
        load_adapter(make_job(cache_dir, model={"family": "qwen2_5_vl", "path": "builtin:tiny-qwen3_vl"}), torch.device("cpu"))


# --- Qwen3.5 (`model.family: qwen3_5`): its tower from full checkpoints, as transformers runs it.

QWEN35_VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=96, num_position_embeddings=64)
QWEN35_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
)
QWEN35_IMAGE_PIXELS = (64_000, 160_000)  # the demo's photos (40k to 307k pixels) are scaled up, kept and scaled down
QWEN35_VIDEO_PIXELS = (128 * 128, 8 * 160 * 160)  # Qwen3VLVideoProcessor: the bounds of a clip's frames together


def save_qwen3_5_processors(directory: Path, nested: bool = False) -> None:
    """Qwen3.5's image and video processors (Qwen2VLImageProcessor, Qwen3VLVideoProcessor)
    beside a checkpoint: each in its own file, or nested in processor_config.json as a
    transformers 5 processor saves them."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLVideoProcessor

    common = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image = Qwen2VLImageProcessor(size={"shortest_edge": QWEN35_IMAGE_PIXELS[0], "longest_edge": QWEN35_IMAGE_PIXELS[1]}, **common)
    video = Qwen3VLVideoProcessor(size={"shortest_edge": QWEN35_VIDEO_PIXELS[0], "longest_edge": QWEN35_VIDEO_PIXELS[1]}, **common)
    if nested:
        nested_config = {"processor_class": "Qwen3VLProcessor", "image_processor": image.to_dict(), "video_processor": video.to_dict()}
        (directory / "processor_config.json").write_text(json.dumps(nested_config))
    else:
        image.save_pretrained(directory)
        video.save_pretrained(directory)


def make_qwen3_5_checkpoint(directory: Path, vision: dict | None = None) -> Path:
    """A user's Qwen3.5 checkpoint in `directory`: the full `Qwen3_5ForConditionalGeneration`
    (a tiny config, random weights, fixed seed) saved with save_pretrained, its processors beside it."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(35)
    config = Qwen3_5Config(text_config=QWEN35_TEXT, vision_config=vision or QWEN35_VISION)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(directory)
    save_qwen3_5_processors(directory)
    return directory


@pytest.fixture(scope="module")
def qwen35_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5"))


def qwen35_reference(
    directory: Path, images: list | None = None, videos: list | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """What transformers gives: the merged tokens of `get_image_features` (or
    `get_video_features`) of the checkpoint's own model (in `dtype` on `device`) on its
    own processor's output, one (tokens, width) float32 CPU tensor per image or video.
    Images are (H, W, 3) uint8 arrays, videos (T, H, W, 3), taken as they are (no frame sampling)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoVideoProcessor

    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype).to(device).eval()
    with torch.no_grad():
        if images is not None:
            inputs = AutoImageProcessor.from_pretrained(directory)(
                images=[torch.from_numpy(i).permute(2, 0, 1) for i in images], return_tensors="pt"
            )
            features = model.get_image_features(inputs["pixel_values"].to(device), inputs["image_grid_thw"].to(device))
        else:
            inputs = AutoVideoProcessor.from_pretrained(directory)(
                videos=[torch.from_numpy(v).permute(0, 3, 1, 2) for v in videos], do_sample_frames=False,
                cap_pixels_per_frame=False, return_tensors="pt",
            )
            features = model.get_video_features(inputs["pixel_values_videos"].to(device), inputs["video_grid_thw"].to(device))
    return [tokens.float().cpu() for tokens in features.pooler_output]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _photo_pixels(data: bytes) -> np.ndarray:
    """A photo as a user decodes it (Pillow), alpha composited on white as the decode stage does."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(data))
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    return np.array(image.convert("RGB"))


def _run_qwen35(tmp_path: Path, checkpoint: Path, cache_dir: str, data: Path, pooling: str) -> list[dict]:
    """`embedjob run` over `data` with the checkpoint (model.family left out), float32 on the CPU."""
    from embedjob.cli import main

    spec = {
        "input": {"path": str(data), "media_column": "media", "id_column": "id", "modality": "auto"},
        "model": {"path": str(checkpoint)},
        "video": {"fps": 30.0, "max_frames": 6},
        "output": {"path": str(tmp_path / "out"), "pooling": pooling, "dtype": "float32"},
        "runtime": {"cache_dir": cache_dir, "device": "cpu", "workers": 1, "progress": False},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert main(["run", str(tmp_path / "job.yaml")]) == 0
    return pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()


def _demo_photos(video: bytes | None = None) -> list[tuple[str, bytes]]:
    """The demo's real photos (and broken rows), and a real clip where given."""
    table = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    rows = [(r["id"], r["image"]) for r in table]
    return rows + ([("clip", video)] if video is not None else [])


def _write_media(path: Path, rows: list[tuple[str, bytes]]) -> Path:
    pq.write_table(pa.table({"id": [i for i, _ in rows], "media": pa.array([d for _, d in rows], pa.binary())}), path)
    return path


def test_qwen3_5_run_on_a_full_checkpoint_gives_transformers_features_of_every_photo_and_clip(
    tmp_path: Path, cache_dir: str, qwen35_checkpoint: Path
) -> None:
    """`embedjob run` on a user's full Qwen3.5 checkpoint, its family read from its
    config.json: each photo's vector is the mean of transformers' merged tokens of it
    (get_image_features on the checkpoint's own processor's output), and the clip's the
    mean of get_video_features of the frames the run sampled; broken rows are errors."""
    from embedjob.decode.dispatch import decode
    from embedjob.rows import decode_options

    clip = (REPO / "tests" / "data" / "hfdatasets_test_video_66x50.mov").read_bytes()
    rows = _demo_photos(clip)
    out = {r["id"]: r for r in _run_qwen35(tmp_path, qwen35_checkpoint, cache_dir, _write_media(tmp_path / "in.parquet", rows), "mean")}
    assert [r for r in out.values() if r["error"]] and all(out[i]["error"] for i in ("truncated_jpeg", "text_not_an_image"))
    photos = [(i, _photo_pixels(d)) for i, d in rows[:-1] if not out[i]["error"]]
    assert len(photos) == 10
    refs = qwen35_reference(qwen35_checkpoint, images=[p for _, p in photos])
    sizes = {tokens.shape[0] for tokens in refs}
    assert len(sizes) >= 5  # varied grids: scaled up, kept and scaled down
    errors = {i: _relative(torch.tensor(out[i]["embedding"]), ref.mean(dim=0)) for (i, _), ref in zip(photos, refs)}
    assert max(errors.values()) < 1e-3, errors
    job = make_job(cache_dir, model={"path": str(qwen35_checkpoint)}, input={"modality": "auto"}, video={"fps": 30.0, "max_frames": 6})
    assert job.model.family == "qwen3_5"
    frames = decode(clip, decode_options(job, load_adapter(job, torch.device("cpu")))).frames
    assert frames.shape[0] == 6
    (video_ref,) = qwen35_reference(qwen35_checkpoint, videos=[frames])
    assert _relative(torch.tensor(out["clip"]["embedding"]), video_ref.mean(dim=0)) < 1e-3


def test_qwen3_5_per_token_rows_are_transformers_merged_tokens_with_their_grid(
    tmp_path: Path, cache_dir: str, qwen35_checkpoint: Path
) -> None:
    rows = [r for r in _demo_photos() if r[0] in ("img2dataset_123_456", "hfdatasets_test_image_rgb", "mmaction2_test")]
    out = {r["id"]: r for r in _run_qwen35(tmp_path, qwen35_checkpoint, cache_dir, _write_media(tmp_path / "in.parquet", rows), "none")}
    refs = qwen35_reference(qwen35_checkpoint, images=[_photo_pixels(d) for _, d in rows])
    for (name, _), ref in zip(rows, refs):
        tokens = torch.tensor(out[name]["embedding"])
        t, h, w = out[name]["grid"]
        assert tokens.shape == ref.shape and t * h * w == ref.shape[0]
        assert _relative(tokens, ref) < 1e-3, name


@pytest.mark.parametrize(
    ("frames", "height", "width", "cap"),
    [(4, 240, 320, False), (3, 50, 66, False), (6, 720, 1280, False), (2, 20, 90, False), (5, 480, 640, True)],
)
def test_qwen3_5_video_preprocessing_equals_qwen3vl_video_processor(
    tmp_path: Path, qwen35_checkpoint: Path, frames: int, height: int, width: int, cap: bool
) -> None:
    """Qwen3VLVideoProcessor bounds a clip's frames together (and scales a side below 32
    up first; `cap_pixels_per_frame` bounds each frame too): the grid and the model's
    pixel rows are the processor's, bit for bit, for a clip it upscales, keeps and
    downscales, whether a worker or the GPU's decoder (`deferred_video`) sizes it."""
    from transformers import AutoVideoProcessor

    directory = tmp_path / "checkpoint"
    shutil.copytree(qwen35_checkpoint, directory)
    if cap:
        config = json.loads((directory / "video_preprocessor_config.json").read_text())
        (directory / "video_preprocessor_config.json").write_text(json.dumps({**config, "cap_pixels_per_frame": True, "max_video_tokens": 64}))
    processing = load_adapter(make_job(str(tmp_path / "cache"), model={"path": str(directory)}), torch.device("cpu")).processing
    assert processing.clip_pixels and (processing.frame_cap is not None) == cap
    video = random_video(frames, height, width, seed=frames)
    ours = processing(video)
    ref = AutoVideoProcessor.from_pretrained(directory)(
        videos=[torch.from_numpy(video.frames).permute(0, 3, 1, 2)], do_sample_frames=False, return_tensors="pt"
    )
    assert ours.grid == tuple(ref["video_grid_thw"][0].tolist())
    assert processing.deferred_video(frames, height, width).grid == ours.grid
    assert torch.equal(processing.model_pixels(ours.tensors["pixel_values"]), ref["pixel_values_videos"])


def test_qwen3_5_processor_settings_nested_in_processor_config_are_read_as_transformers_reads_them(
    tmp_path: Path, cache_dir: str, qwen35_checkpoint: Path
) -> None:
    """A checkpoint whose processor transformers 5 saved (processor_config.json with its
    image and video processors nested, no file of their own) is preprocessed by those
    settings: the same pixels and grids as transformers' processors read from it."""
    from transformers import AutoImageProcessor

    directory = tmp_path / "nested"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(qwen35_checkpoint / name, directory)
    save_qwen3_5_processors(directory, nested=True)
    assert not (directory / "preprocessor_config.json").exists()
    processing = load_adapter(make_job(cache_dir, model={"path": str(directory)}), torch.device("cpu")).processing
    assert (processing.min_pixels, processing.max_pixels) == QWEN35_IMAGE_PIXELS
    assert (processing.video_min_pixels, processing.video_max_pixels) == QWEN35_VIDEO_PIXELS and processing.clip_pixels
    image = random_image(200, 700, seed=5)
    ours = processing(image)
    ref = AutoImageProcessor.from_pretrained(directory)(images=[torch.from_numpy(image.pixels).permute(2, 0, 1)], return_tensors="pt")
    assert ours.grid == tuple(ref["image_grid_thw"][0].tolist())
    assert torch.equal(processing.model_pixels(ours.tensors["pixel_values"]), ref["pixel_values"])


def test_qwen3_5_moe_checkpoints_full_or_tower_only_load_the_same_tower(tmp_path: Path, cache_dir: str) -> None:
    """Qwen3.5-MoE's vision tower is Qwen3.5's: a full MoE checkpoint and its tower saved
    alone are the `qwen3_5` family (from their config.json), load only the tower's
    weights and embed as transformers' MoE model does."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from embedjob.encoders.registry import family_of

    text = {**QWEN35_TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    torch.manual_seed(36)
    full = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=QWEN35_VISION)).eval()
    full.save_pretrained(tmp_path / "full")
    full.model.visual.save_pretrained(tmp_path / "tower")
    for name in ("full", "tower"):
        save_qwen3_5_processors(tmp_path / name)
    assert json.loads((tmp_path / "tower" / "config.json").read_text())["model_type"] == "qwen3_5_moe_vision"
    image = random_image(300, 500, seed=7)
    visual = full.model.visual.state_dict()
    ref = qwen35_reference(tmp_path / "full", images=[image.pixels])[0]
    for name in ("full", "tower"):
        assert family_of(str(tmp_path / name)) == "qwen3_5"
        adapter = load_adapter(make_job(cache_dir, model={"path": str(tmp_path / name)}), torch.device("cpu"))
        loaded = adapter.model.state_dict()
        assert visual.keys() == loaded.keys() and all(torch.equal(visual[k], loaded[k]) for k in visual), name
        item = adapter.preprocessor()(image)
        with torch.no_grad():
            (ours,) = adapter.split(adapter.forward(adapter.eager_inputs([item])), [item])
        assert _relative(ours, ref) < 1e-5, name


def test_qwen3_5_from_the_hub_fetches_only_the_shards_of_the_tower_and_the_processor_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded hub checkpoint: config.json, the index, the shards holding
    `model.visual.` weights and the processor files are fetched; the language model's
    and the multi-token-prediction head's shards are not."""
    import huggingface_hub

    from embedjob.encoders import qwen

    index = {"weight_map": {
        "model.visual.blocks.0.attn.qkv.weight": "model-00001-of-00003.safetensors",
        "model.visual.merger.linear_fc2.weight": "model-00002-of-00003.safetensors",
        "model.language_model.layers.0.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "model.language_model.embed_tokens.weight": "model-00003-of-00003.safetensors",
        "mtp.layers.0.mlp.gate_proj.weight": "model-00003-of-00003.safetensors",
    }}
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "model.safetensors.index.json").write_text(json.dumps(index))
    fetched: list[str] = []

    def download(repo_id: str, filename: str) -> str:
        fetched.append(filename)
        (hub / filename).touch()
        return str(hub / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert qwen._download("Qwen/Qwen3.5-27B") == hub
    assert sorted(fetched) == sorted([
        "config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors", "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
    ])


def test_qwen3_5_builtin_is_a_qwen3_5_tower_with_the_qwen3_5_video_processor(cache_dir: str) -> None:
    directory = builtin_dir(FAMILIES["qwen3_5"], cache_dir)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen3_5_vision"
    assert json.loads((directory / "video_preprocessor_config.json").read_text())["video_processor_type"] == "Qwen3VLVideoProcessor"
    adapter = load_adapter(make_job(cache_dir, model={"path": "builtin:tiny-qwen3_5"}), torch.device("cpu"))
    assert adapter.family == "qwen3_5" and adapter.processing.clip_pixels and adapter.embed_dim == 128
    assert not hasattr(adapter.model, "deepstack_merger_list")  # Qwen3-VL's extra mergers are not Qwen3.5's


def test_embedjob_bench_times_the_qwen3_5_tower_against_plain_transformers(tmp_path: Path) -> None:
    """`embedjob bench`'s Qwen3.5 rows: the tower saved like a user's checkpoint, timed as
    plain transformers and through embedjob's graphs on the same packed batches, whose
    mean vectors must be transformers' own (the note's cosine)."""
    from embedjob.bench import qwen3_5_rows

    tiny = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, num_position_embeddings=16, out_hidden_size=24)
    rows = qwen3_5_rows(tmp_path, "tiny Qwen3.5", tiny, 3, 2, 1e12, torch.device("cpu"), compiled=False)
    assert [(r.mix, r.variant) for r in rows] == [("tiny Qwen3.5", "plain_transformers_sdpa"), ("tiny Qwen3.5", "ours_graphs")]
    assert all(r.items == 3 and r.seconds > 0 and r.flops > 0 for r in rows) and rows[1].hit_rate == 1.0
    assert float(rows[1].note.rsplit("min cos to plain ", 1)[1]) > 0.9999, rows[1].note


def test_qwen3_5_jpegs_left_for_the_device_decoder_give_the_workers_items(cache_dir: str) -> None:
    """`preprocess.decoder: gpu` with the Qwen3.5 tower: JPEGs deferred by the workers and
    completed by the rank (here on the CPU, the same code path) are the items the workers
    make, bit for bit (pixels, grid, position-table metadata, tokens), and error rows stay error rows."""
    from test_device_decode import CORPUS, DEFER, IMAGE, assert_same_rows, rows_of

    from embedjob import rows as worker
    from embedjob.encoders.base import JPEG_KEY

    preprocess = load_adapter(make_job(cache_dir, model={"path": "builtin:tiny-qwen3_5"}), torch.device("cpu")).preprocessor()
    rows = rows_of(CORPUS)
    want = [worker.decode_row(row, IMAGE, preprocess) for row in rows]
    window = [worker.decode_row(row, DEFER, preprocess) for row in rows]
    waiting = sum(d.item is not None and JPEG_KEY in d.item.tensors for d in window)
    assert waiting >= 6 and "interp_weights" in next(d.item.tensors for d in want if d.item is not None)
    assert worker.decode_on_device(window, IMAGE, preprocess, torch.device("cpu")) == waiting
    assert_same_rows(window, want)
