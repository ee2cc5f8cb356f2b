"""The graph manager on the CPU replay backend: the same buffer filling, padding and
slicing the CUDA backend uses, checked against eager execution."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_image, random_video
from engine_helpers import one_path_encoder, one_path_encoder_on, padded_eager, same_size_items

from embedjob.engine.graphs import GraphManager
from embedjob.engine.packer import BudgetPlan, pack

PLAN = BudgetPlan(token_budgets=(64, 128, 256, 512), max_items=8, max_frames=16)


@pytest.fixture(scope="module")
def manager(qwen_adapter) -> GraphManager:
    graphs = GraphManager(qwen_adapter, PLAN, "replay")
    graphs.capture()
    return graphs


@pytest.fixture(scope="module")
def items(qwen_adapter):
    media = [
        random_image(224, 224, 1),
        random_image(120, 300, 2),
        random_video(4, 112, 112, 3),
        random_image(56, 56, 4),
        random_image(400, 300, 5),
    ]
    return [qwen_adapter.preprocessor()(m) for m in media]


def test_capture_makes_one_graph_per_budget(manager: GraphManager) -> None:
    assert manager.num_graphs == len(PLAN.token_budgets)
    assert manager.budgets == PLAN.token_budgets


def test_replay_equals_eager_on_the_same_padded_batch_bitwise(manager: GraphManager, items) -> None:
    batch = items[:3]
    budget = 512
    replayed = manager.run(batch, budget)
    padded = padded_eager(manager, batch, budget)
    offset = 0
    for item, out in zip(batch, replayed):
        assert torch.equal(out, padded[offset : offset + item.tokens])
        offset += item.tokens


def test_graph_path_matches_unpadded_eager(qwen_adapter, manager: GraphManager, items) -> None:
    """Padding must not change any real item's embedding (pad rows never attend to real ones)."""
    with torch.no_grad():
        eager = qwen_adapter.split(qwen_adapter.forward(qwen_adapter.eager_inputs(items[:4])), items[:4])
    replayed = manager.run(items[:4], 512)
    for ours, ref in zip(replayed, eager):
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_outputs_survive_the_next_replay(manager: GraphManager, items) -> None:
    first = manager.run(items[:1], 128)
    kept = first[0].clone()
    manager.run(items[3:4], 128)
    assert torch.equal(first[0], kept)


def test_statistics_add_up_over_a_packed_stream(qwen_adapter, items) -> None:
    graphs = GraphManager(qwen_adapter, BudgetPlan(token_budgets=(64, 128), max_items=4, max_frames=8), "replay")
    graphs.capture()
    tokens = [i.tokens for i in items]
    frames = [i.frames for i in items]
    batches = pack(tokens, frames, graphs.plan)
    for batch in batches:
        graphs.run([items[i] for i in batch.indices], batch.budget)
    stats = graphs.stats
    assert stats.hits + stats.misses == len(items)
    oversized = sum(t > 128 for t in tokens)
    assert stats.misses == oversized and oversized > 0
    assert stats.padding_waste == sum(b.budget - b.tokens for b in batches if b.budget is not None)
    assert sum(stats.budget_items.values()) == stats.hits
    assert stats.real_tokens == sum(tokens)
    assert stats.to_dict()["hit_rate"] == pytest.approx(stats.hits / len(items), abs=1e-6)


def test_eager_fallback_gives_the_same_embedding(qwen_adapter, manager: GraphManager, items) -> None:
    eager = manager.run(items[:2], None)
    replayed = manager.run(items[:2], 256)
    for a, b in zip(eager, replayed):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pad_rows_are_finite_and_real_rows_come_first(manager: GraphManager, items) -> None:
    padded = padded_eager(manager, items[3:4], 64)
    assert torch.isfinite(padded).all()
    assert padded.shape[0] == 64 and items[3].tokens < 64


def test_clear_releases_graphs(qwen_adapter) -> None:
    graphs = GraphManager(qwen_adapter, PLAN, "replay")
    graphs.capture()
    graphs.clear()
    assert graphs.num_graphs == 0


def test_unknown_backend_and_cuda_on_cpu_are_refused(qwen_adapter) -> None:
    with pytest.raises(ValueError, match="unknown graph backend"):
        GraphManager(qwen_adapter, PLAN, "magic")
    with pytest.raises(ValueError, match="needs the adapter on a CUDA device"):
        GraphManager(qwen_adapter, PLAN, "cuda")


def test_batch_encoder_isolates_an_item_that_fails_to_encode(qwen_adapter, items, monkeypatch) -> None:
    """One item that breaks the encoder costs one error row, not its whole batch."""
    graphs = GraphManager(qwen_adapter, PLAN, "replay")
    graphs.capture()
    poisoned = items[1]
    real_run = graphs.run_batch

    def run_batch(batch, budget):
        if any(item is poisoned for item in batch):
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_run(batch, budget)

    monkeypatch.setattr(graphs, "run_batch", run_batch)
    encoded = one_path_encoder(graphs, "min_padding").encode(items, "mean", torch.float32)
    assert encoded.failures[1] == "encode_failed: RuntimeError: CUDA out of memory (simulated)"
    assert encoded.item(1) is None and encoded.counts[1] == 0
    for i, item in enumerate(items):
        if i != 1:
            assert encoded.failures[i] is None
            (alone,) = graphs.run([item], None, lambda rows: rows.mean(0))
            assert torch.allclose(encoded.item(i)[0], alone, rtol=1e-5, atol=1e-6)


def test_pooling_per_batch_equals_each_item_pooled_alone(qwen_adapter, items) -> None:
    """One reduction per run of equal row counts gives every item's own mean, bit for
    bit, whatever else shares its batch (resumed and data-parallel runs batch differently)."""
    from embedjob.engine.graphs import pool_rows

    rows = torch.randn(3 * 4 + 2 * 7 + 5, 16)
    counts = [4, 4, 4, 7, 7, 5]
    pooled, pooled_counts = pool_rows(rows, counts, "mean")
    assert pooled_counts == [1] * 6 and pooled.shape == (6, 16) and pooled.dtype == torch.float32
    offsets = [0, 4, 8, 12, 19, 26]
    for i, (offset, count) in enumerate(zip(offsets, counts)):
        assert torch.equal(pooled[i], rows[offset : offset + count].mean(0))
    kept, kept_counts = pool_rows(rows, counts, "none")
    assert kept is rows and kept_counts == counts


def test_thumbnails_replay_instead_of_running_eagerly(qwen_adapter) -> None:
    """32x32 images are 4 tokens and one attention window each, so a batch of them holds
    far more windows per token than photos do; budgets must carry a window slot per
    item, or every such batch falls back to eager (a 0 % hit rate was measured)."""
    plan = BudgetPlan(token_budgets=(64, 128, 256), max_items=64, max_frames=128)
    graphs = GraphManager(qwen_adapter, plan, "replay")
    graphs.capture()
    items = [qwen_adapter.preprocessor()(random_image(32, 32, seed)) for seed in range(300)]
    assert {item.tokens for item in items} == {4}
    encoded = one_path_encoder(graphs, "min_padding").encode(items, "mean", torch.float32)
    stats = graphs.stats
    assert all(failure is None for failure in encoded.failures)
    assert stats.capacity_fallbacks == 0
    assert stats.hits == len(items) and stats.hit_rate >= 0.95
    for index in (0, 137, 299):
        (alone,) = graphs.run([items[index]], None, lambda rows: rows.mean(0))
        assert torch.allclose(encoded.item(index)[0], alone, rtol=1e-4, atol=1e-5)


def test_items_of_one_size_get_a_budget_of_their_own_and_the_same_embeddings(qwen_adapter) -> None:
    """A window of equal items that fill the doubling ladder badly (56 tokens: 8 of them
    are 448 in a 512 budget, 14 % padding) adds a 448 budget, replays it without padding,
    and each item's embedding is the one it gets alone; a later window adds nothing."""
    encoder = one_path_encoder_on(qwen_adapter, PLAN, "replay", refine=True)
    graphs = encoder.paths[0].manager
    items = same_size_items(qwen_adapter, 24)
    encoded = encoder.encode(items, "mean", torch.float32)
    assert encoder.added == [448] and 448 in graphs.plan.token_budgets and graphs.num_graphs == 5
    assert graphs.stats.budget_batches == {448: 3} and graphs.stats.padding_waste == 0 and graphs.stats.hits == 24
    for index in (0, 11, 23):
        (alone,) = graphs.run([items[index]], None, lambda rows: rows.mean(0))
        assert torch.allclose(encoded.item(index)[0], alone, rtol=1e-4, atol=1e-5)
    encoder.encode(items[:16], "mean", torch.float32)
    assert encoder.added == [448]
    plan = encoder.plan_stats()
    assert plan["added_budgets"] == [448] and plan["token_budgets"] == list(PLAN.token_budgets)


def test_without_refine_the_budgets_stay_the_ladder(qwen_adapter) -> None:
    encoder = one_path_encoder_on(qwen_adapter, PLAN, "replay", refine=False)
    graphs = encoder.paths[0].manager
    encoder.encode(same_size_items(qwen_adapter, 24), "mean", torch.float32)
    assert encoder.added == [] and graphs.plan == PLAN and graphs.stats.padding_waste > 0.1 * graphs.stats.real_tokens


def test_a_budget_whose_graph_cannot_be_captured_leaves_the_ladder_serving(qwen_adapter, caplog) -> None:
    """Capturing mid-run may fail (e.g. out of memory): the window still encodes on the
    ladder, with a warning, and the encoder stops adding budgets."""
    encoder = one_path_encoder_on(qwen_adapter, PLAN, "replay", refine=True)
    graphs = encoder.paths[0].manager

    def no_memory(budgets):
        raise RuntimeError("CUDA out of memory")

    graphs.add_budgets = no_memory
    items = same_size_items(qwen_adapter, 24)
    encoded = encoder.encode(items, "mean", torch.float32)
    assert all(failure is None for failure in encoded.failures) and graphs.stats.hits == 24
    assert encoder.added == [] and not encoder.refine and graphs.plan == PLAN
    assert "could not capture the graphs of added budgets [448] (CUDA out of memory)" in caplog.text


def test_a_mid_run_capture_waits_for_the_decode_threads_which_never_wait_for_each_other(qwen_adapter) -> None:
    """The two GPU-decode threads work on the device at once (one inside nvjpeg while
    the other finishes a window); a capture of added budgets starts only once neither
    does, and neither starts while it runs: capture forbids other threads' CUDA work."""
    encoder = one_path_encoder_on(qwen_adapter, PLAN, "replay", refine=True)
    lock, events = encoder.capture_lock, []
    second_in, capture_done = threading.Event(), threading.Event()

    def capture() -> None:
        with lock.exclusive():
            events.append("capture")
        capture_done.set()

    def nvjpeg() -> None:
        with lock.shared():
            second_in.set()
            events.append("nvjpeg")

    with lock.shared():
        threading.Thread(target=nvjpeg).start()
        assert second_in.wait(5)
        capturer = threading.Thread(target=capture)
        capturer.start()
        assert not capture_done.wait(0.2)
        events.append("finish")
    assert capture_done.wait(5)
    capturer.join()
    def next_window() -> None:
        with lock.shared():
            events.append("next window")

    with lock.exclusive():
        late = threading.Thread(target=next_window)
        late.start()
        late.join(0.2)
        assert late.is_alive()
        events.append("second capture")
    late.join(5)
    assert events == ["nvjpeg", "finish", "capture", "second capture", "next window"]


def test_a_green_stream_without_a_cuda_driver_says_why_and_the_job_keeps_every_sm(monkeypatch: pytest.MonkeyPatch,
                                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """`pipeline.GPU_DECODE_FREE_SMS` asks for a green context (`engine.green`); where the
    driver makes none the encoder runs on a stream of its own with every SM, and the log
    says why, instead of the job failing."""
    import ctypes
    import logging

    from embedjob import pipeline
    from embedjob.engine import green

    def no_driver(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    green._driver.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    try:
        with pytest.raises(green.GreenUnavailable, match="no CUDA driver library"):
            green.green_stream(torch.device("cuda", 0), 16)
        rank = pipeline.RankPipeline.__new__(pipeline.RankPipeline)
        rank.device, rank.video = torch.device("cuda", 0), "nvdec"
        monkeypatch.setattr(pipeline, "GPU_DECODE_FREE_SMS", 16)
        with caplog.at_level(logging.WARNING, logger=pipeline.logger.name):
            assert rank._encoder_green() is None
        assert "keeps every SM" in caplog.text and "no CUDA driver library" in caplog.text
        rank.video = "decord"
        assert rank._encoder_green() is None
    finally:
        green._driver.cache_clear()


def test_a_green_context_leaves_at_least_the_sms_asked_where_the_driver_rounds_its_groups_up() -> None:
    """The driver sizes an SM group in steps (8 SMs on Hopper), rounding up: asked to leave
    16 of 132 SMs, a group of 116 would come back as 120, leaving 12. `engine.green` asks
    for less until the group leaves what the job asked (112 SMs, 20 free), and says so
    where the driver splits none."""
    import ctypes

    from embedjob.engine import green

    def stepped(part: ctypes.Array, groups: object, whole: ctypes.Array, rest: ctypes.Array, flags: int, asked: int) -> int:
        part[green._SM_COUNT_AT : green._SM_COUNT_AT + 4] = (-(-asked // 8) * 8).to_bytes(4, "little")
        groups._obj.value = 1  # type: ignore[attr-defined]
        return 0

    class Driver:
        cuDevSmResourceSplitByCount = staticmethod(stepped)

    whole = ctypes.create_string_buffer(green._RESOURCE_BYTES)
    part = green._split(Driver(), whole, 132 - 16)  # type: ignore[arg-type]
    assert green._sm_count(part) == 112

    class Refusing:
        cuDevSmResourceSplitByCount = staticmethod(lambda *args: 801)  # CUDA_ERROR_NOT_SUPPORTED

    with pytest.raises(green.GreenUnavailable, match="no group of at most 116 SMs"):
        green._split(Refusing(), whole, 116)  # type: ignore[arg-type]
