"""Properties of the budget packer: every item once, limits never broken, smallest budget,
misses alone and eager, min_padding never worse than greedy, and the config paths."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedjob.engine.packer import (
    MAX_ADDED_BUDGETS,
    POLICIES,
    Batch,
    BudgetPlan,
    generate_budgets,
    pack,
    padding_waste,
    refined_budgets,
    resolve_budgets,
    resolve_path_budgets,
)


@st.composite
def plans(draw, max_frames=st.integers(0, 64)):
    low = draw(st.integers(1, 256))
    high = draw(st.integers(low, 4096))
    if draw(st.booleans()):
        budgets = generate_budgets(low, high)
    else:
        budgets = sorted(set(draw(st.lists(st.integers(1, 4096), min_size=1, max_size=6))))
    return BudgetPlan(tuple(budgets), draw(st.integers(1, 16)), draw(max_frames))


@st.composite
def items(draw, count=st.integers(0, 60), max_tokens=5000, max_video_frames=40):
    """(tokens, frames): images have 0 frames, videos 1..max_video_frames."""
    n = draw(count)
    tokens = draw(st.lists(st.integers(1, max_tokens), min_size=n, max_size=n))
    frames = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, max_video_frames)), min_size=n, max_size=n
        )
    )
    return tokens, frames


def _smallest_fitting(budgets, total):
    fitting = [b for b in budgets if b >= total]
    return min(fitting) if fitting else None


def _is_miss(tokens, frames, plan, i):
    return tokens[i] > plan.token_budgets[-1] or frames[i] > plan.max_frames


def _check_invariants(batches: list[Batch], tokens, frames, plan: BudgetPlan):
    seen = sorted(i for batch in batches for i in batch.indices)
    assert seen == list(range(len(tokens))), "every item exactly once"
    for batch in batches:
        assert batch.tokens == sum(tokens[i] for i in batch.indices)
        assert batch.frames == sum(frames[i] for i in batch.indices)
        if batch.budget is None:
            assert len(batch.indices) == 1
            assert _is_miss(tokens, frames, plan, batch.indices[0])
            assert batch.padding == 0
        else:
            assert len(batch.indices) <= plan.max_items
            assert batch.tokens <= plan.token_budgets[-1]
            assert batch.frames <= plan.max_frames
            assert batch.budget == _smallest_fitting(plan.token_budgets, batch.tokens)
            assert not any(_is_miss(tokens, frames, plan, i) for i in batch.indices)


# --- generate_budgets -------------------------------------------------------------------


def test_generate_budgets_example():
    assert generate_budgets(64, 1000) == [64, 128, 256, 512, 1000]
    assert generate_budgets(64, 1024) == [64, 128, 256, 512, 1024]
    assert generate_budgets(7, 7) == [7]


@given(st.integers(1, 5000), st.integers(0, 100_000))
def test_generate_budgets_properties(low, extra):
    high = low + extra
    budgets = generate_budgets(low, high)
    assert budgets[0] == low
    assert budgets[-1] == high
    assert budgets == sorted(set(budgets))
    for previous, nxt in zip(budgets[:-2], budgets[1:-1]):
        assert nxt == 2 * previous
    if len(budgets) > 1:
        assert budgets[-2] < budgets[-1] <= 2 * budgets[-2]


@pytest.mark.parametrize("low, high", [(0, 64), (64, 0), (-1, 10), (128, 64)])
def test_generate_budgets_rejects_bad_range(low, high):
    with pytest.raises(ValueError) as error:
        generate_budgets(low, high)
    assert str(low) in str(error.value) and str(high) in str(error.value)


# --- resolve_budgets --------------------------------------------------------------------


def test_resolve_all_auto():
    plan = resolve_budgets(None, None, None, 64, 16384, 32, True)
    assert plan.token_budgets == (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    assert plan.max_items == 64  # min(16384 // 64, 64)
    assert plan.max_frames == 64 * 32


def test_resolve_all_auto_narrow_range_uses_ratio():
    plan = resolve_budgets(None, None, None, 256, 1024, 8, True)
    assert plan.token_budgets == (256, 512, 1024)
    assert plan.max_items == 4  # min(1024 // 256, 256)
    assert plan.max_frames == 32


def test_resolve_only_items_raises_budget_floor():
    plan = resolve_budgets(None, 100, None, 64, 16384, 32, False)
    assert plan.token_budgets == (100, 200, 400, 800, 1600, 3200, 6400, 12800, 16384)
    assert plan.max_items == 100
    assert plan.max_frames == 0


def test_resolve_only_items_below_model_min_keeps_model_budgets():
    plan = resolve_budgets(None, 8, None, 64, 512, 32, True)
    assert plan.token_budgets == (64, 128, 256, 512)
    assert plan.max_items == 8
    assert plan.max_frames == 256


def test_resolve_only_items_above_model_max_is_explained():
    with pytest.raises(ValueError) as error:
        resolve_budgets(None, 2048, None, 64, 1024, 32, True)
    assert "2048" in str(error.value) and "1024" in str(error.value)


def test_resolve_only_budgets_sorted_deduplicated_and_capped():
    plan = resolve_budgets([4096, 1024, 2048, 1024], None, None, 64, 16384, 32, True)
    assert plan.token_budgets == (1024, 2048, 4096)
    assert plan.max_items == 256  # min(16384 // 64, 1024)
    small = resolve_budgets([8, 64], None, None, 64, 16384, 32, True)
    assert small.max_items == 8  # capped by the smallest budget


def test_resolve_both_given():
    plan = resolve_budgets([512, 128], 16, 40, 64, 16384, 32, True)
    assert plan == BudgetPlan((128, 512), 16, 40)


def test_resolve_both_given_items_above_smallest_budget_explains_both_fixes():
    with pytest.raises(ValueError) as error:
        resolve_budgets([64, 32], 48, None, 16, 4096, 4, True)
    message = str(error.value)
    assert "48" in message and "32" in message
    assert "raise the smallest budget to >= 48" in message
    assert "lower max_items_per_batch to <= 32" in message


def test_resolve_frames_paths():
    assert resolve_budgets(None, 4, 10, 64, 1024, 32, False).max_frames == 0
    assert resolve_budgets(None, 4, 10, 64, 1024, 32, True).max_frames == 10
    assert resolve_budgets(None, 4, 0, 64, 1024, 32, True).max_frames == 0
    assert resolve_budgets(None, 4, None, 64, 1024, 32, True).max_frames == 128


@pytest.mark.parametrize(
    "budgets, items, frames, per_video, named",
    [
        ([128, 0], None, None, 8, "0"),
        ([128, -5], None, None, 8, "-5"),
        ([], None, None, 8, "[]"),
        (None, 0, None, 8, "0"),
        (None, None, -3, 8, "-3"),
        (None, None, None, 0, "max_frames_per_video=0"),
    ],
)
def test_resolve_rejects_invalid_values_with_the_number(budgets, items, frames, per_video, named):
    with pytest.raises(ValueError) as error:
        resolve_budgets(budgets, items, frames, 64, 1024, per_video, True)
    assert named in str(error.value)


def test_resolve_rejects_bad_model_range():
    with pytest.raises(ValueError) as error:
        resolve_budgets(None, None, None, 512, 256, 8, True)
    assert "512" in str(error.value) and "256" in str(error.value)


@given(
    st.one_of(st.none(), st.lists(st.integers(1, 20000), min_size=1, max_size=8)),
    st.one_of(st.none(), st.integers(1, 64)),
    st.integers(1, 512),
    st.integers(0, 20000),
)
def test_resolved_plans_keep_the_capture_invariant(budgets, items, model_min, extra):
    model_max = model_min + extra
    try:
        plan = resolve_budgets(budgets, items, None, model_min, model_max, 16, True)
    except ValueError as error:
        smallest = min(budgets) if budgets else model_max
        assert items is not None and items > smallest, str(error)
        return
    assert plan.max_items <= plan.token_budgets[0]
    assert plan.max_frames == plan.max_items * 16


# --- pack: invariants -------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@given(data=st.data())
def test_pack_invariants(policy, data):
    plan = data.draw(plans())
    tokens, frames = data.draw(items())
    batches = pack(tokens, frames, plan, policy)
    _check_invariants(batches, tokens, frames, plan)
    assert pack(tokens, frames, plan, policy) == batches


@pytest.mark.parametrize("policy", POLICIES)
@given(data=st.data())
def test_tiny_frame_budget_is_never_exceeded(policy, data):
    plan = data.draw(plans(max_frames=st.just(4)))
    tokens, frames = data.draw(items(max_video_frames=6))
    batches = pack(tokens, frames, plan, policy)
    _check_invariants(batches, tokens, frames, plan)
    for batch in batches:
        if batch.budget is not None:
            assert batch.frames <= 4
        else:
            assert batch.frames > 4 or batch.tokens > plan.token_budgets[-1]


@given(data=st.data())
def test_greedy_closes_a_batch_only_when_the_next_item_does_not_fit(data):
    plan = data.draw(plans())
    tokens, frames = data.draw(items())
    graph = [b for b in pack(tokens, frames, plan, "greedy") if b.budget is not None]
    for current, following in zip(graph, graph[1:]):
        nxt = following.indices[0]
        assert (
            len(current.indices) == plan.max_items
            or current.tokens + tokens[nxt] > plan.token_budgets[-1]
            or current.frames + frames[nxt] > plan.max_frames
        )
    order = [tokens[i] for b in graph for i in b.indices]
    assert order == sorted(order)


def test_greedy_example_matches_the_seed():
    plan = BudgetPlan((64, 128, 256), 4, 0)
    batches = pack([64] * 5, [0] * 5, plan)
    assert batches == [Batch((0, 1, 2, 3), 256, 256, 0), Batch((4,), 64, 64, 0)]


def test_item_over_largest_budget_runs_alone_and_eager():
    plan = BudgetPlan((64, 128), 8, 0)
    batches = pack([10, 500, 20], [0, 0, 0], plan, "greedy")
    assert Batch((1,), None, 500, 0) in batches
    assert Batch((0, 2), 64, 30, 0) in batches
    assert batches[-1].budget is None  # misses come last


def test_video_over_frame_budget_runs_alone_and_eager():
    plan = BudgetPlan((64, 128), 8, 4)
    batches = pack([10, 20, 30], [0, 5, 2], plan, "min_padding")
    assert Batch((1,), None, 20, 5) in batches
    assert Batch((0, 2), 64, 40, 2) in batches


def test_video_when_video_is_disabled_is_a_miss():
    plan = resolve_budgets(None, None, None, 64, 256, 32, False)
    batches = pack([64, 64], [0, 3], plan)
    assert Batch((1,), None, 64, 3) in batches
    assert Batch((0,), 64, 64, 0) in batches


@pytest.mark.parametrize(
    "tokens, frames, named",
    [([5, 0], [0, 0], "tokens[1]=0"), ([5, -2], [0, 0], "tokens[1]=-2"),
     ([5], [-1], "frames[0]=-1"), ([5, 6], [0], "1 frame counts")],
)
def test_pack_rejects_bad_items(tokens, frames, named):
    with pytest.raises(ValueError) as error:
        pack(tokens, frames, BudgetPlan((64,), 4, 4))
    assert named in str(error.value)


def test_unknown_policy_lists_the_allowed_ones():
    with pytest.raises(ValueError) as error:
        pack([1], [0], BudgetPlan((64,), 4, 4), "best")
    assert "'best'" in str(error.value)
    assert all(policy in str(error.value) for policy in POLICIES)


def test_empty_input_gives_no_batches():
    assert pack([], [], BudgetPlan((64,), 4, 4), "min_padding") == []


# --- min_padding ------------------------------------------------------------------------


@given(data=st.data())
def test_min_padding_never_wastes_more_than_greedy(data):
    plan = data.draw(plans())
    tokens, frames = data.draw(items(count=st.integers(0, 120)))
    greedy = pack(tokens, frames, plan, "greedy")
    best = pack(tokens, frames, plan, "min_padding")
    assert padding_waste(best) <= padding_waste(greedy)
    if padding_waste(best) == padding_waste(greedy):
        assert len(best) <= len(greedy)
    # Each batch beyond greedy's count must have saved >= the smallest budget in padding.
    extra = len(best) - len(greedy)
    saved = padding_waste(greedy) - padding_waste(best)
    assert extra * plan.token_budgets[0] <= saved


def test_min_padding_splits_when_it_saves_padding():
    plan = BudgetPlan((64, 128, 256, 512), 8, 0)
    tokens = [64] * 5
    assert padding_waste(pack(tokens, [0] * 5, plan, "greedy")) == 512 - 320
    best = pack(tokens, [0] * 5, plan, "min_padding")
    assert padding_waste(best) == 0
    assert sorted(b.budget for b in best) == [64, 256]


def test_min_padding_does_not_explode_into_single_items():
    # Singles would waste 0, but 14 extra replays to save 40 tokens is a bad trade.
    plan = BudgetPlan((64, 1000), 16, 0)
    batches = pack([64] * 15, [0] * 15, plan, "min_padding")
    assert batches == [Batch(tuple(range(15)), 1000, 960, 0)]


def _best_split(tokens, frames, plan):
    """(cost, batches) of the cheapest split of the sorted fitting items into consecutive
    batches, cost = padding + smallest budget x batches, ties to fewer batches: every
    split tried, as the definition reads, with none of the packer's shortcuts."""
    order = sorted(range(len(tokens)), key=tokens.__getitem__)
    order = [i for i in order if not _is_miss(tokens, frames, plan, i)]
    best = [(0, 0)] + [None] * len(order)
    for end in range(1, len(order) + 1):
        for start in range(max(0, end - plan.max_items), end):
            group = order[start:end]
            total = sum(tokens[i] for i in group)
            if total > plan.token_budgets[-1] or sum(frames[i] for i in group) > plan.max_frames:
                continue
            padding = _smallest_fitting(plan.token_budgets, total) - total
            candidate = (best[start][0] + padding + plan.token_budgets[0], best[start][1] + 1)
            if best[end] is None or candidate < best[end]:
                best[end] = candidate
    return best[-1]


@given(data=st.data())
def test_min_padding_costs_no_more_than_the_best_split_of_the_sorted_items(data):
    # The packer's split is the optimum of this cost; when that optimum wastes no more
    # than greedy (so the packer may return it), min_padding must cost no more.
    plan = data.draw(plans(max_frames=st.integers(0, 24)))
    tokens, frames = data.draw(items(count=st.integers(0, 40), max_tokens=600, max_video_frames=12))
    cost, count = _best_split(tokens, frames, plan)
    greedy = pack(tokens, frames, plan, "greedy")
    best = [b for b in pack(tokens, frames, plan, "min_padding") if b.budget is not None]
    if cost - plan.token_budgets[0] * count <= padding_waste(greedy):
        assert padding_waste(best) + plan.token_budgets[0] * len(best) <= cost


def test_min_padding_beats_greedy_on_a_realistic_mix():
    plan = resolve_budgets(None, None, None, 64, 16384, 32, False)
    rng = random.Random(0)
    # Qwen2.5-VL images of 224..1344 px sides: (h / 28) * (w / 28) output tokens.
    tokens = [rng.randrange(8, 49) * rng.randrange(8, 49) for _ in range(500)]
    greedy = pack(tokens, [0] * len(tokens), plan, "greedy")
    best = pack(tokens, [0] * len(tokens), plan, "min_padding")
    assert padding_waste(greedy) * 100 > 4 * sum(tokens)
    assert padding_waste(best) * 100 < 2 * sum(tokens)
    assert len(best) <= len(greedy)


def test_padding_waste_sums_graph_batches_only():
    batches = [Batch((0,), 128, 100, 0), Batch((1,), None, 9000, 0), Batch((2, 3), 64, 64, 0)]
    assert padding_waste(batches) == 28


# --- dual path --------------------------------------------------------------------------


@st.composite
def dual_cases(draw, max_frames=st.integers(0, 32)):
    g_low = draw(st.integers(1, 256))
    l_low = draw(st.integers(1, 256))
    items_limit = draw(st.integers(1, 12))
    frame_limit = draw(max_frames)
    global_plan = BudgetPlan(
        tuple(generate_budgets(g_low, draw(st.integers(g_low, 4096)))), items_limit, frame_limit
    )
    local_plan = BudgetPlan(
        tuple(generate_budgets(l_low, draw(st.integers(l_low, 8192)))), items_limit, frame_limit
    )
    n = draw(st.integers(0, 50))
    global_tokens = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    local_tokens = draw(
        st.lists(st.one_of(st.just(0), st.integers(1, 9000)), min_size=n, max_size=n)
    )
    frames = draw(st.lists(st.one_of(st.just(0), st.integers(1, 12)), min_size=n, max_size=n))
    return resolve_dual_budgets(global_plan, local_plan), global_tokens, local_tokens, frames


def resolve_dual_budgets(global_plan: BudgetPlan, local_plan: BudgetPlan) -> tuple[BudgetPlan, ...]:
    """The plans of a global and a local path."""
    return resolve_path_budgets([global_plan, local_plan])


def pack_dual(gtok, ltok, frames, plans, policy="greedy") -> list[Batch]:
    """`pack` against a global and a local path."""
    return pack([gtok, ltok], frames, plans, policy)


def dual_batch(indices, global_budget, local_budget, global_tokens, local_tokens) -> Batch:
    """A two-path batch of images (no frames)."""
    return Batch(indices, global_budget, global_tokens, 0, ((local_budget, local_tokens),))


def _check_dual(batches: list[Batch], plans: tuple[BudgetPlan, ...], gtok, ltok, frames):
    g_budgets = plans[0].token_budgets
    l_budgets = plans[1].token_budgets
    limits = plans[0]
    seen = sorted(i for batch in batches for i in batch.indices)
    assert seen == list(range(len(gtok)))
    for batch in batches:
        g_sum = sum(gtok[i] for i in batch.indices)
        l_sum = sum(ltok[i] for i in batch.indices)
        f_sum = sum(frames[i] for i in batch.indices)
        global_budget, local_budget = batch.budgets
        assert batch.path_tokens == (g_sum, l_sum)
        if len(batch.indices) > 1:
            assert len(batch.indices) <= limits.max_items
            assert g_sum <= g_budgets[-1] and l_sum <= l_budgets[-1]
            assert f_sum <= limits.max_frames
        if f_sum > limits.max_frames:
            assert len(batch.indices) == 1
            assert global_budget is None and local_budget is None
            continue
        assert global_budget == _smallest_fitting(g_budgets, g_sum)
        assert local_budget == _smallest_fitting(l_budgets, l_sum)
        if global_budget is None or local_budget is None:
            assert len(batch.indices) == 1
        if l_sum == 0:
            assert local_budget == 0


@pytest.mark.parametrize("policy", POLICIES)
@given(case=dual_cases())
def test_pack_dual_invariants(policy, case):
    plan, gtok, ltok, frames = case
    batches = pack_dual(gtok, ltok, frames, plan, policy)
    _check_dual(batches, plan, gtok, ltok, frames)


@given(case=dual_cases(max_frames=st.just(4)))
def test_pack_dual_min_padding_never_wastes_more_than_greedy(case):
    plan, gtok, ltok, frames = case
    greedy = pack_dual(gtok, ltok, frames, plan, "greedy")
    best = pack_dual(gtok, ltok, frames, plan, "min_padding")
    _check_dual(best, plan, gtok, ltok, frames)
    assert padding_waste(best) <= padding_waste(greedy)


def test_dual_items_without_tiles_use_local_budget_zero():
    plan = resolve_dual_budgets(BudgetPlan((64, 128), 4, 0), BudgetPlan((256, 512), 4, 0))
    assert plan[1].token_budgets == (0, 256, 512)
    batches = pack_dual([64, 64, 64], [0, 0, 300], [0, 0, 0], plan)
    assert dual_batch((0, 1), 128, 0, 128, 0) in batches
    assert dual_batch((2,), 64, 512, 64, 300) in batches


def test_dual_partial_eager_fallback():
    plan = resolve_dual_budgets(BudgetPlan((64, 128), 4, 0), BudgetPlan((256,), 4, 0))
    batches = pack_dual([10, 20, 30], [0, 1000, 0], [0, 0, 0], plan)
    assert dual_batch((1,), 64, None, 20, 1000) in batches  # global replays, local eager
    assert dual_batch((0, 2), 64, 0, 40, 0) in batches
    global_miss = pack_dual([500], [100], [0], plan)
    assert global_miss == [dual_batch((0,), None, 256, 500, 100)]


def test_resolve_dual_budgets_takes_the_stricter_limits():
    plan = resolve_dual_budgets(BudgetPlan((64, 128), 8, 40), BudgetPlan((32, 64), 4, 100))
    assert plan[0] == BudgetPlan((64, 128), 4, 40)
    assert plan[1] == BudgetPlan((0, 32, 64), 4, 40)


def test_dual_plan_without_zero_local_budget_is_rejected():
    with pytest.raises(ValueError) as error:
        pack_dual([1], [0], [0], (BudgetPlan((64,), 4, 0), BudgetPlan((32, 64), 4, 0)))
    assert "(32, 64)" in str(error.value) and "resolve_path_budgets" in str(error.value)


def test_pack_dual_rejects_mismatched_lengths():
    plan = resolve_dual_budgets(BudgetPlan((64,), 4, 0), BudgetPlan((64,), 4, 0))
    with pytest.raises(ValueError) as error:
        pack_dual([1, 2], [0], [0, 0], plan)
    assert "path 0 has 2" in str(error.value) and "path 1 has 1" in str(error.value)


@pytest.mark.parametrize(
    "budgets, items, frames, named",
    [((), 1, 0, "()"), ((128, 64), 1, 0, "(128, 64)"), ((64,), 0, 0, "max_items=0"),
     ((64,), 1, -1, "max_frames=-1"), ((-64, 64), 1, 0, "(-64, 64)")],
)
def test_budget_plan_rejects_broken_invariants(budgets, items, frames, named):
    with pytest.raises(ValueError) as error:
        BudgetPlan(budgets, items, frames)
    assert named in str(error.value)


# --- budgets added for repeated sizes -------------------------------------------------


@given(plans(max_frames=st.just(64)), items(count=st.integers(0, 80)), st.integers(0, 20), st.sampled_from([0.0, 0.05, 0.3]))
def test_refined_budgets_are_new_whole_multiples_inside_the_ladder(plan, data, room, threshold) -> None:
    tokens, frames = data
    batches = pack(tokens, frames, plan, "min_padding")
    added = refined_budgets(batches, plan.token_budgets, room, threshold)
    budgets = plan.token_budgets
    assert added == sorted(set(added)) and len(added) <= room
    assert all(b not in budgets and b % budgets[0] == 0 and budgets[0] < b < budgets[-1] for b in added)
    graph = [b for b in batches if b.budget is not None]
    if sum(b.tokens for b in graph) < budgets[-1] or padding_waste(graph) <= threshold * sum(b.tokens for b in graph):
        assert added == []  # a short window, or one that pays little, adds nothing
    if added:
        # The same batches fit smaller budgets now; greedy, whose batches do not depend on
        # the budgets, pays less; min_padding may trade padding for fewer batches.
        refined = BudgetPlan(tuple(sorted({*budgets, *added})), plan.max_items, plan.max_frames)
        assert sum(_smallest_fitting(refined.token_budgets, b.tokens) - b.tokens for b in graph) < padding_waste(graph)
        for policy in POLICIES:
            _check_invariants(pack(tokens, frames, refined, policy), tokens, frames, refined)
        greedy = [pack(tokens, frames, p, "greedy") for p in (plan, refined)]
        assert padding_waste(greedy[1]) <= padding_waste(greedy[0])


def test_clips_of_one_video_pay_little_padding_once_their_budget_is_added() -> None:
    """256 clips of one 7-s 1080p video (4,320 tokens each) paid 26 % of their tokens in
    padding in the doubling ladder; one added budget fits three of them."""
    plan = resolve_budgets(None, None, None, 64, 16384, 32, True)
    tokens, frames = [4320] * 256, [14] * 256
    before = pack(tokens, frames, plan, "min_padding")
    assert padding_waste(before) / sum(tokens) > 0.25
    added = refined_budgets(before, plan.token_budgets, MAX_ADDED_BUDGETS)
    assert 12992 in added  # three clips, 12,960 tokens, rounded up to a multiple of 64
    refined = BudgetPlan(tuple(sorted({*plan.token_budgets, *added})), plan.max_items, plan.max_frames)
    after = pack(tokens, frames, refined, "min_padding")
    assert padding_waste(after) / sum(tokens) <= 0.08
    assert refined_budgets(after, refined.token_budgets, MAX_ADDED_BUDGETS) == []  # settled: nothing more to add


def test_a_ladder_that_fits_its_items_adds_nothing() -> None:
    plan = resolve_budgets(None, None, None, 64, 16384, 32, False)
    tokens = [64] * 256  # 224 px images in the Qwen tower: 64 tokens, batches fill the budgets exactly
    assert refined_budgets(pack(tokens, [0] * 256, plan, "min_padding"), plan.token_budgets, MAX_ADDED_BUDGETS) == []
