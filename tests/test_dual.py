"""The dual-path mode (global view + anyres local tiles) on the CPU replay backend: tile
grids, packing against both graph sets, partial eager fallback, replay against padded
eager, how the two paths' embeddings are combined, and the job end to end."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torchvision.transforms.v2.functional as tvF
from conftest import REPO, make_job, random_image, random_video
from engine_helpers import batches, paths_encoder, run, run_padded_eager
from hypothesis import given, settings
from hypothesis import strategies as st

from embedjob.cli import main
from embedjob.encoders import EncoderInput, load_adapter
from embedjob.encoders.fixed import GLOBAL_KEY, LOCAL_KEY
from embedjob.encoders.tiling import cut_tiles, select_grid
from embedjob.engine.encode import BatchEncoder, build_encoder
from embedjob.engine.graphs import clone_rows
from embedjob.engine.packer import POLICIES, BudgetPlan

CPU = torch.device("cpu")
BICUBIC = tvF.InterpolationMode.BICUBIC


def tiled_job(cache_dir: str, family: str = "clip", **preprocess):
    return make_job(
        cache_dir,
        model={"family": family, "path": f"builtin:tiny-{family}"},
        preprocess={"tiling": "anyres", "max_tiles": 6, **preprocess},
    )


@pytest.fixture(scope="module")
def adapter(cache_dir: str):
    return load_adapter(tiled_job(cache_dir), CPU)


@pytest.fixture(scope="module")
def plain(cache_dir: str):
    return load_adapter(make_job(cache_dir, model={"family": "clip", "path": "builtin:tiny-clip"}), CPU)


def small_encoder(adapter, policy: str = "greedy", largest: int = 4) -> BatchEncoder:
    """Budgets of 1, 2, 4 (... `largest`) images on both paths, at most 3 items and 6 frames a batch."""
    t = adapter.tokens_per_image
    single = BudgetPlan(tuple(t * 2**k for k in range(largest.bit_length())), max_items=3, max_frames=6)
    return paths_encoder(adapter, single, "replay", policy)


@given(
    height=st.integers(1, 2000),
    width=st.integers(1, 2000),
    tile=st.integers(8, 400),
    max_tiles=st.integers(1, 12),
)
def test_grid_respects_max_tiles_and_follows_the_aspect_ratio(height: int, width: int, tile: int, max_tiles: int) -> None:
    rows, cols = select_grid(height, width, tile, tile, max_tiles)
    assert rows >= 1 and cols >= 1 and rows * cols <= max_tiles
    if height <= tile and width <= tile:
        assert (rows, cols) == (1, 1)  # no tile could add detail
    if width >= 2 * height:
        assert cols >= rows  # a wide image never gets a column of tiles
    if height >= 2 * width:
        assert rows >= cols


def test_grid_examples() -> None:
    assert select_grid(100, 500, 64, 64, 6) == (1, 5)  # 5 tiles already hold it at full height
    assert select_grid(480, 640, 224, 224, 6) == (2, 3)
    assert select_grid(448, 448, 224, 224, 6) == (2, 2)
    assert select_grid(224, 224, 224, 224, 6) == (1, 1)  # one tile adds nothing to the global view


def test_tiles_cover_the_resized_image_centred_on_black() -> None:
    image = torch.full((3, 100, 300), 200, dtype=torch.uint8)
    tiles = cut_tiles(image, (1, 3), (64, 64), BICUBIC)
    assert tiles.shape == (3, 3, 64, 64)
    canvas = torch.cat(list(tiles), dim=-1)  # the 64 x 192 canvas, tiles in row-major order
    fitted = round(100 * 192 / 300)  # 64: the image fills the height exactly
    assert fitted == 64 and (canvas == 200).all()
    tall = cut_tiles(torch.full((3, 100, 100), 9, dtype=torch.uint8), (1, 2), (64, 64), BICUBIC)
    canvas = torch.cat(list(tall), dim=-1)
    assert (canvas[:, :, 32:96] == 9).all() and (canvas[:, :, :32] == 0).all() and (canvas[:, :, 96:] == 0).all()


def test_items_carry_global_views_and_tiles_and_count_both_in_tokens(adapter, plain) -> None:
    t = adapter.tokens_per_image
    big = adapter.preprocessor()(random_image(300, 500, 1))
    small = adapter.preprocessor()(random_image(40, 60, 2))
    video = adapter.preprocessor()(random_video(3, 200, 400, 3))
    assert big.tensors[LOCAL_KEY].shape == (6, 3, 64, 64) and big.tokens == 7 * t
    assert big.tensors[LOCAL_KEY].dtype == big.tensors[GLOBAL_KEY].dtype == torch.uint8  # normalised on the device
    assert small.tensors[LOCAL_KEY].shape[0] == 0 and small.tokens == t
    assert video.tensors[LOCAL_KEY].shape[0] == 0 and video.tokens == 3 * t and video.frames == 3
    for item in (big, small, video):  # decode workers send items and the preprocessor through pipes
        again = pickle.loads(pickle.dumps(item))
        assert again.tokens == item.tokens and all(torch.equal(again.tensors[k], v) for k, v in item.tensors.items())
    assert pickle.loads(pickle.dumps(adapter.preprocessor())) == adapter.preprocessor()
    untiled = plain.preprocessor()(random_image(300, 500, 1))
    assert torch.equal(big.tensors[GLOBAL_KEY], untiled.tensors[GLOBAL_KEY])
    assert adapter.embed_dim == 2 * plain.embed_dim


def _synthetic(adapter, views: int, tiles: int, video: bool, seed: int) -> EncoderInput:
    """An item with the given numbers of global views and tiles (random uint8 pixels, built directly)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (3, *adapter.processing.input_size)
    tensors = {
        key: torch.randint(0, 256, (count, *shape), generator=generator, dtype=torch.uint8)
        for key, count in ((GLOBAL_KEY, views), (LOCAL_KEY, tiles))
    }
    tokens = (views + tiles) * adapter.tokens_per_image
    return EncoderInput(tensors, tokens=tokens, frames=views if video else 0, size=tokens, modality="video" if video else "image")


ITEM = st.one_of(
    st.tuples(st.just(1), st.integers(0, 6), st.just(False)),  # images: 0-6 tiles
    st.tuples(st.integers(1, 6), st.just(0), st.just(True)),  # videos: 1-6 frames, no tiles
)


@settings(max_examples=30, deadline=None)
@given(specs=st.lists(ITEM, min_size=1, max_size=10), policy=st.sampled_from(POLICIES))
def test_dual_packing_holds_both_limits_and_counts_partial_fallbacks(adapter, specs, policy: str) -> None:
    encoder = small_encoder(adapter, policy)
    t, largest = adapter.tokens_per_image, 4 * adapter.tokens_per_image
    items = [_synthetic(adapter, views, tiles, video, k) for k, (views, tiles, video) in enumerate(specs)]
    packed = batches(encoder, items)
    assert sorted(i for b in packed for i in b.indices) == list(range(len(items)))
    for batch in packed:
        chosen = [specs[i] for i in batch.indices]
        global_tokens, local_tokens = sum(v for v, _, _ in chosen) * t, sum(n for _, n, _ in chosen) * t
        frames = sum(v for v, _, video in chosen if video)
        global_budget, local_budget = batch.budgets
        if global_budget is not None and local_budget is not None:
            assert len(chosen) <= 3 and frames <= 6
            assert global_tokens <= global_budget <= largest and local_tokens <= local_budget <= largest
        else:
            assert len(chosen) == 1  # a miss on either path runs alone
        if local_tokens == 0:
            assert local_budget == 0  # no tiles: the local graph set is skipped
    encoded = encoder.encode(items, "none", torch.float32)
    assert encoded.failures == [None] * len(items)
    assert [encoded.item(i).shape for i in range(len(items))] == [(v, adapter.embed_dim) for v, _, _ in specs]
    stats = encoder.stats()
    misses = sum(v * t > largest or n * t > largest or (video and v > 6) for v, n, video in specs)
    partial = sum(n * t > largest and v * t <= largest for v, n, _ in specs)
    assert (stats["graph_hits"], stats["graph_misses"], stats["partial_fallbacks"]) == (len(items) - misses, misses, partial)
    paths = stats["paths"]
    assert paths["global"]["graph_hits"] + paths["global"]["graph_misses"] == len(items)
    assert paths["local"]["graph_hits"] + paths["local"]["graph_misses"] == sum(n > 0 for _, n, _ in specs)
    assert stats["padding_waste"] == sum(b.padding for b in packed)
    merged = encoder.graph_stats()  # what data-parallel ranks add up
    assert (merged.hits, merged.misses) == (stats["graph_hits"], stats["graph_misses"])
    assert merged.real_tokens == sum(item.tokens for item in items)  # both paths' tokens: the `tokens` column


def test_one_path_replays_while_the_other_runs_eagerly_with_the_same_result(adapter) -> None:
    encoder = small_encoder(adapter)
    item = adapter.preprocessor()(random_image(300, 500, 4))  # 6 tiles: above the 4-image local budgets
    (batch,) = batches(encoder, [item])
    assert batch.budgets == (adapter.tokens_per_image, None)
    partial = encoder.encode([item], "none", torch.float32).item(0)
    stats = encoder.stats()
    assert (stats["graph_hits"], stats["graph_misses"], stats["partial_fallbacks"]) == (0, 1, 1)
    assert stats["paths"]["global"]["graph_hits"] == 1 and stats["paths"]["local"]["graph_misses"] == 1
    (eager,) = run(encoder, [item], (None, None))
    assert torch.allclose(partial, eager, rtol=1e-5, atol=1e-6)


def test_dual_replay_equals_eager_on_the_same_padded_batch(adapter) -> None:
    encoder = small_encoder(adapter, largest=16)
    t = adapter.tokens_per_image
    items = [adapter.preprocessor()(m) for m in (random_image(150, 200, 5), random_image(30, 30, 6), random_image(200, 90, 7))]
    budgets = (4 * t, 16 * t)
    assert sum(i.tensors[LOCAL_KEY].shape[0] for i in items) == 12  # both paths pad: 3 of 4 and 12 of 16 images
    replayed = run(encoder, items, budgets)
    padded = run_padded_eager(encoder, items, budgets)
    assert all(torch.equal(a, b) for a, b in zip(replayed, padded))
    eager = run(encoder, items, (None, None))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(replayed, eager))
    assert encoder.stats()["graph_hits"] == 3


def test_combine_concatenates_global_and_mean_of_tiles(adapter, cache_dir: str) -> None:
    images = [random_image(300, 500, 8), random_image(40, 40, 9)]
    items = [adapter.preprocessor()(m) for m in images]
    with torch.no_grad():
        views = [adapter.forward(adapter.eager_inputs([adapter.path_input(i, GLOBAL_KEY)])) for i in items]
        tiles = adapter.forward(adapter.eager_inputs([adapter.path_input(items[0], LOCAL_KEY)]))
    assert adapter.path_input(items[1], LOCAL_KEY) is None
    concat = run(small_encoder(adapter), items, (None, None))
    expected = [torch.cat([views[0], tiles.mean(0, keepdim=True)], dim=-1), torch.cat([views[1], views[1]], dim=-1)]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(concat, expected))
    averaged = load_adapter(tiled_job(cache_dir, tile_combine="mean"), CPU)
    assert averaged.embed_dim == adapter.embed_dim // 2
    mean = run(small_encoder(averaged), items, (None, None))
    d = averaged.embed_dim
    assert all(torch.allclose(m, (c[:, :d] + c[:, d:]) / 2, rtol=1e-5, atol=1e-6) for m, c in zip(mean, concat))


def test_a_failing_item_costs_one_error_row_in_dual_mode(adapter, monkeypatch) -> None:
    encoder = small_encoder(adapter)
    items = [adapter.preprocessor()(random_image(100 + 40 * k, 120, k)) for k in range(3)]
    poisoned = items[1].tensors[LOCAL_KEY]
    local = encoder.paths[1].manager
    real_run = local.run

    def run(batch, budget, reduce=clone_rows):
        if any(item.tensors[GLOBAL_KEY] is poisoned for item in batch):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_run(batch, budget, reduce)

    monkeypatch.setattr(local, "run", run)
    encoded = encoder.encode(items, "mean", torch.float32)
    assert encoded.failures[1] == "encode_failed: RuntimeError: CUDA out of memory (simulated)" and encoded.item(1) is None
    assert all(encoded.item(k) is not None and encoded.failures[k] is None for k in (0, 2))
    assert encoder.stats()["graph_hits"] + encoder.stats()["graph_misses"] == 2


def test_build_encoder_picks_the_dual_path_for_tiled_jobs(adapter, plain, cache_dir: str) -> None:
    encoder = build_encoder(tiled_job(cache_dir), adapter, CPU)
    assert isinstance(encoder, BatchEncoder)
    assert [p.name for p in encoder.paths] == ["global", "local"]
    assert encoder.paths[1].plan.token_budgets[0] == 0 and 0 not in encoder.paths[1].manager.plan.token_budgets
    encoder.capture()
    assert encoder.stats()["num_graphs"] == 2 * len(encoder.paths[0].plan.token_budgets)
    media = [random_image(300, 500, 1), random_image(50, 50, 2), random_video(2, 80, 80, 3)]
    encoded = encoder.encode([adapter.preprocessor()(m) for m in media], "mean", torch.float32)
    tiled = [encoded.item(i)[0] for i in range(len(media))]
    single = build_encoder(make_job(cache_dir, model={"family": "clip", "path": "builtin:tiny-clip"}), plain, CPU)
    encoded = single.encode([plain.preprocessor()(m) for m in media], "mean", torch.float32)
    untiled = [encoded.item(i)[0] for i in range(len(media))]
    d = plain.embed_dim
    for a, b in zip(tiled, untiled):
        assert a.shape == (2 * d,) and torch.allclose(a[:d], b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(tiled[1][d:], untiled[1], rtol=1e-5, atol=1e-6)  # no tiles: the global vector
    assert not torch.allclose(tiled[0][d:], untiled[0], rtol=1e-2, atol=1e-3)  # tiles see more than the global view


def test_tiling_with_a_native_resolution_family_is_refused(cache_dir: str) -> None:
    from embedjob.config import JobError

    with pytest.raises(JobError, match="tiling = 'anyres' needs a fixed-resolution encoder"):
        make_job(cache_dir, preprocess={"tiling": "anyres"})


def test_tiled_clip_demo_writes_double_width_vectors(tmp_path: Path, cache_dir: str) -> None:
    args = ["run", str(REPO / "jobs" / "demo-clip.yaml"), "--set", f"output.path={tmp_path}", "--set", f"runtime.cache_dir={cache_dir}"]
    assert main([*args, "--set", "runtime.workers=0", "--set", "preprocess.tiling=anyres", "--set", "runtime.progress=false"]) == 0
    rows = pq.read_table(sorted(tmp_path.glob("part-*.parquet"))).to_pylist()
    good = [r for r in rows if r["error"] is None]
    assert len(good) == 10 and all(len(r["embedding"]) == 96 for r in good)
    assert all(r["tokens"] % 17 == 0 and r["tokens"] >= 17 for r in good)
    assert any(r["tokens"] > 17 for r in good)
    assert np.isfinite(np.array([r["embedding"] for r in good], dtype=np.float32)).all()
    stats = json.loads((tmp_path / "_embedjob/stats-00000.json").read_text())
    assert stats["graph_hits"] + stats["graph_misses"] == 10 and set(stats["paths"]) == {"global", "local"}
    assert stats["num_graphs"] == len(stats["paths"]["global"]["token_budgets"]) * 2
