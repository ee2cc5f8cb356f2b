"""Qwen-VL adapter: preprocessing parity with transformers, packed eager forward
against the unmodified model, and loading user checkpoints (vision-only and full)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from conftest import make_job, random_image, random_video
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
