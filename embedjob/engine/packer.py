"""Budget packing: which items share one encoder call, and which captured graph runs it.

Pure functions over plain integers (no torch, no numpy) so that the graph manager, the
pipeline and the benchmarks share one definition of a batch.

Vocabulary:

- *tokens*: an item's output-token count (what the encoder emits for it).
- *frames*: the video frames an item brings into a graph's per-frame buffers (vLLM
  forgot to check them, its issue #43403); images have 0 frames and are never limited
  by the frame budget.
- *budget*: the token count a CUDA graph was captured for. A batch replays the graph of
  the smallest budget >= its token sum and pays ``budget - tokens`` padded tokens.
- *miss*: an item that no graph can hold (tokens above the largest budget, or frames
  above ``max_frames``). It runs eagerly, alone, with budget ``None``.

Paths: an encoder may run an item through several graph sets (a global view plus local
tiles), each with its own budgets; ``pack`` packs against all of them at once. The first
path is the one every item has (tokens >= 1); a further path may get 0 tokens from an
item (no tiles), so its budgets start with 0 and a batch without input there skips it.

Invariants of every ``pack`` result (tests/test_packer.py checks them):

- every input index appears in exactly one batch;
- a graph batch (no path's budget ``None``) has, on every path, tokens <= the largest
  budget, and at most ``max_items`` items and at most ``max_frames`` frames; each
  path's budget is the smallest one >= that path's tokens;
- a batch with a budget ``None`` on any path holds exactly one item, a miss;
- the output depends only on the input values (deterministic order).

Policies (both see the same sorted order and the same misses, which are set aside
first so that one oversized item does not cut a run of small ones in two):

- ``greedy``, the seed: sort by tokens ascending (stable), fill a batch while every
  limit holds, close it when the next item does not fit, then pick its budget.
- ``min_padding``: builds three groupings, greedy, the optimal split of the sorted order
  into consecutive runs (dynamic programming) and best-fit decreasing, and returns the
  cheapest by ``padding + replay_cost * batches`` among those wasting no more than
  greedy. Because greedy is always a candidate and the others are filtered against it,
  min_padding never wastes more padded tokens than greedy, and any batch it adds over
  greedy's count saved at least ``replay_cost`` (the smallest budget) padded tokens,
  so it cannot dissolve into single-item batches.
"""

from __future__ import annotations

import itertools
import logging
import operator
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POLICIES = ("greedy", "min_padding")


def generate_budgets(min_budget: int, max_budget: int) -> list[int]:
    """Powers-of-two multiples of ``min_budget`` up to ``max_budget``, which is always last.

    Doubling keeps the number of graphs logarithmic in the range while bounding the
    padding of any batch to less than half of its budget (except below ``min_budget``).
    Example: ``generate_budgets(64, 1000) == [64, 128, 256, 512, 1000]``.
    """
    if not _is_int(min_budget) or not _is_int(max_budget):
        raise ValueError(
            f"token budget range must be ints, got min_budget={min_budget!r}, "
            f"max_budget={max_budget!r}"
        )
    if min_budget <= 0 or max_budget <= 0:
        raise ValueError(
            f"invalid token budget range: min_budget={min_budget}, max_budget={max_budget}; "
            "both must be positive"
        )
    if min_budget > max_budget:
        raise ValueError(
            f"invalid token budget range: min_budget={min_budget} > max_budget={max_budget}; "
            "the minimum must not exceed the maximum"
        )
    budgets = []
    budget = min_budget
    while budget <= max_budget:
        budgets.append(budget)
        budget *= 2
    if budgets[-1] < max_budget:
        budgets.append(max_budget)
    return budgets


@dataclass(frozen=True)
class BudgetPlan:
    """The budgets one graph set is captured for, and the per-batch item and frame limits.

    Invariants (checked on construction): ``token_budgets`` is non-empty, strictly
    increasing, of ints >= 0 with a positive largest one (0 is allowed only so that a
    further path, see ``resolve_path_budgets``, can express "no input here");
    ``max_items >= 1``; ``max_frames >= 0``. ``resolve_budgets`` additionally guarantees
    ``max_items <= token_budgets[0]`` so that each captured dummy item has >= 1 token.
    """

    token_budgets: tuple[int, ...]
    max_items: int
    max_frames: int

    def __post_init__(self) -> None:
        # A list would make a frozen plan mutable and unhashable; store the tuple.
        budgets = tuple(self.token_budgets)
        object.__setattr__(self, "token_budgets", budgets)
        if any(not _is_int(b) for b in budgets) or (budgets and budgets[0] < 0):
            raise ValueError(f"token_budgets={budgets} must be ints >= 0")
        if not budgets or budgets[-1] <= 0:
            raise ValueError(f"token_budgets={budgets} must contain a positive budget")
        if any(a >= b for a, b in zip(budgets, budgets[1:])):
            raise ValueError(f"token_budgets={budgets} must be strictly increasing")
        if not _is_int(self.max_items) or self.max_items < 1:
            raise ValueError(f"max_items={self.max_items} must be an int >= 1")
        if not _is_int(self.max_frames) or self.max_frames < 0:
            raise ValueError(f"max_frames={self.max_frames} must be an int >= 0")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `True` as a budget is a config mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_budgets(
    token_budgets: list[int] | None,
    max_items: int | None,
    max_frames: int | None,
    model_min: int,
    model_max: int,
    max_frames_per_video: int,
    video_enabled: bool,
) -> BudgetPlan:
    """Turn the user's batching config (``None`` = auto) and the adapter's range into a plan.

    The four paths mirror vLLM's EncoderCudaGraphManager, each keeping the capture
    invariant ``max_items <= min(budgets)`` (a captured dummy batch of ``max_items``
    items must give every item >= 1 token):

    - neither budgets nor items: budgets = ``generate_budgets(model_min, model_max)``,
      ``max_items = min(model_max // model_min, min(budgets))``;
    - only items: budgets = ``generate_budgets(max(model_min, max_items), model_max)``;
    - only budgets: sorted and deduplicated,
      ``max_items = min(model_max // model_min, min(budgets))`` (the ratio is the
      adapter's range, as in vLLM: at most that many smallest items fill the largest
      graph);
    - both: sorted and deduplicated; ``max_items > min(budgets)`` is an error.

    Frames: 0 when video is disabled (a user value is then ignored with a warning), the
    user value if given, else ``max_items * max_frames_per_video``.

    Every invalid value raises ``ValueError`` naming the numbers and how to fix them.
    """
    model_budgets = generate_budgets(model_min, model_max)
    if max_items is not None and (not _is_int(max_items) or max_items < 1):
        raise ValueError(f"max_items_per_batch={max_items!r} must be an int >= 1 (or auto)")
    if token_budgets is None:
        budgets, items = _auto_budgets(max_items, model_budgets, model_min, model_max)
    else:
        budgets = _user_budgets(token_budgets)
        items = _items_for_user_budgets(budgets, max_items, model_min, model_max)
    frames = _resolve_frames(max_frames, items, max_frames_per_video, video_enabled)
    return BudgetPlan(tuple(budgets), items, frames)


def _auto_budgets(
    max_items: int | None, model_budgets: list[int], model_min: int, model_max: int
) -> tuple[list[int], int]:
    if max_items is None:
        return model_budgets, min(model_max // model_min, model_budgets[0])
    if max_items > model_max:
        raise ValueError(
            f"max_items_per_batch={max_items} exceeds the model's largest token budget "
            f"{model_max}, so no graph could give each item >= 1 token; lower "
            f"max_items_per_batch to <= {model_max}"
        )
    return generate_budgets(max(model_min, max_items), model_max), max_items


def _user_budgets(token_budgets: list[int]) -> list[int]:
    if isinstance(token_budgets, (str, bytes)) or not isinstance(token_budgets, Iterable):
        raise ValueError(f"token_budgets={token_budgets!r} must be a list of positive ints")
    values = list(token_budgets)
    if not values:
        raise ValueError("token_budgets=[] is empty; give at least one positive budget or use auto")
    bad = [b for b in values if not _is_int(b) or b <= 0]
    if bad:
        raise ValueError(
            f"token_budgets={values} has invalid entries {bad}; every budget must be a positive int"
        )
    return sorted(set(values))


def _items_for_user_budgets(
    budgets: list[int], max_items: int | None, model_min: int, model_max: int
) -> int:
    smallest = budgets[0]
    if max_items is None:
        return min(model_max // model_min, smallest)
    if max_items > smallest:
        raise ValueError(
            f"max_items_per_batch={max_items} is larger than the smallest token budget "
            f"{smallest} (budgets {budgets}), so a captured batch of {max_items} items "
            f"cannot give each item >= 1 token; either raise the smallest budget to "
            f">= {max_items} or lower max_items_per_batch to <= {smallest}"
        )
    return max_items


def _resolve_frames(
    max_frames: int | None, max_items: int, max_frames_per_video: int, video_enabled: bool
) -> int:
    if max_frames is not None and (not _is_int(max_frames) or max_frames < 0):
        raise ValueError(f"max_frames_per_batch={max_frames!r} must be an int >= 0 (or auto)")
    if not video_enabled:
        if max_frames:
            logger.warning("max_frames_per_batch=%d ignored: video is disabled", max_frames)
        return 0
    if max_frames is not None:
        return max_frames
    if not _is_int(max_frames_per_video) or max_frames_per_video < 1:
        raise ValueError(
            f"max_frames_per_video={max_frames_per_video!r} must be an int >= 1 when video "
            "is enabled; fix the adapter's value or set max_frames_per_batch explicitly"
        )
    return max_items * max_frames_per_video


@dataclass(frozen=True)
class Batch:
    """Items that run together: graph replay of ``budget``, or eager when ``budget`` is None.

    ``indices`` are original item positions, in packing order (ascending total tokens).
    ``budget`` and ``tokens`` are the first path's; ``others`` holds ``(budget, tokens)``
    of every further path (empty for a one-path plan), where budget 0 means the batch
    has no input on that path and ``None`` that the path runs this single item eagerly.
    """

    indices: tuple[int, ...]
    budget: int | None
    tokens: int
    frames: int
    others: tuple[tuple[int | None, int], ...] = ()

    @property
    def budgets(self) -> tuple[int | None, ...]:
        """Every path's budget, in path order."""
        return (self.budget, *(budget for budget, _ in self.others))

    @property
    def path_tokens(self) -> tuple[int, ...]:
        """Every path's real tokens, in path order."""
        return (self.tokens, *(tokens for _, tokens in self.others))

    @property
    def padding(self) -> int:
        """Padded tokens over the paths that replay a graph (0 for an eager path)."""
        return sum(b - t for b, t in zip(self.budgets, self.path_tokens) if b is not None)


def resolve_path_budgets(plans: Sequence[BudgetPlan]) -> tuple[BudgetPlan, ...]:
    """The plans of a several-path encoder from each path's resolved plan.

    Every path after the first gets a 0 budget (a batch without input there skips its
    graph set), and all paths take the smallest item and frame limits, since one batch
    must fit the captured buffers of every path. One plan comes back unchanged.
    """
    if len(plans) == 1:
        return (plans[0],)
    items = min(plan.max_items for plan in plans)
    frames = min(plan.max_frames for plan in plans)
    first = BudgetPlan(plans[0].token_budgets, items, frames)
    return (first, *(BudgetPlan(tuple(sorted({0, *p.token_budgets})), items, frames) for p in plans[1:]))


def _check_plans(plans: Sequence[BudgetPlan]) -> None:
    """The invariants ``resolve_path_budgets`` gives several plans (one plan has none to keep)."""
    if len(plans) == 1:
        return
    first = plans[0]
    if first.token_budgets[0] <= 0:
        raise ValueError(f"first path budgets {first.token_budgets} must all be positive")
    for path, plan in enumerate(plans[1:], start=1):
        if plan.token_budgets[0] != 0:
            raise ValueError(
                f"path {path} budgets {plan.token_budgets} must start with 0 (batches without "
                "input on that path); build the plans with resolve_path_budgets"
            )
        if (plan.max_items, plan.max_frames) != (first.max_items, first.max_frames):
            raise ValueError(
                f"path 0 (max_items={first.max_items}, max_frames={first.max_frames}) and path "
                f"{path} (max_items={plan.max_items}, max_frames={plan.max_frames}) limits differ; "
                "build the plans with resolve_path_budgets"
            )


def padding_waste(batches: Iterable[Batch]) -> int:
    """Total padded tokens over graph batches (eager batches pay no padding)."""
    return sum(batch.padding for batch in batches)


def padding_share(batches: Iterable[Batch]) -> float:
    """Padded over real tokens of the graph batches of a one-path plan (0 with none)."""
    graph = [batch for batch in batches if batch.budget is not None]
    real = sum(batch.tokens for batch in graph)
    return padding_waste(graph) / real if real else 0.0


REFINE_PADDING = 0.05
"""The share of a window's real tokens above which its padding earns budgets of its own."""

MAX_ADDED_BUDGETS = 16
"""Budgets `refined_budgets` may add to a plan over a run: each is a graph to capture
and buffers to hold."""


def refined_budgets(
    batches: Sequence[Batch], budgets: Sequence[int], room: int, threshold: float = REFINE_PADDING
) -> list[int]:
    """Budgets to add to a one-path plan so that batches like these replay with little padding.

    Doubling budgets bounds padding below half a budget, but items of one size (the
    clips of one video, crops of one shape) fill a ladder the same way every time: 256
    clips of 4,320 tokens pay 26 % in budgets of 16,384. When a window's graph batches
    pay more than `threshold` of their real tokens, each batch that does gets a
    candidate: its tokens rounded up to a multiple of the smallest budget (budgets stay
    multiples of it, e.g. whole images for a fixed-resolution tower), kept if it is
    below the batch's budget and new. The candidates that save the most padding over the
    window come first. A window with fewer real tokens than the largest budget (the
    short first windows, a shard's last) proposes nothing: it says little about the
    batches to come.

    Invariants: at most `room` budgets, ascending, each new, a multiple of
    `budgets[0]` and strictly between `budgets[0]` and `budgets[-1]`.
    """
    graph = [batch for batch in batches if batch.budget is not None]
    real = sum(batch.tokens for batch in graph)
    if room <= 0 or not graph or real < budgets[-1] or padding_waste(graph) <= threshold * real:
        return []
    unit, existing = budgets[0], set(budgets)
    saved: Counter[int] = Counter()
    for batch in graph:
        if batch.budget - batch.tokens > threshold * batch.tokens:
            candidate = -(-batch.tokens // unit) * unit
            if candidate < batch.budget and candidate not in existing:
                saved[candidate] += batch.budget - candidate
    return sorted(sorted(saved, key=lambda c: (-saved[c], c))[:room])


@dataclass(frozen=True)
class _Problem:
    """The path-generic packing input: tokens per path per item, frames per item.

    One-path and several-path plans run the same algorithms, so their limits cannot
    drift apart.
    """

    tokens: tuple[list[int], ...]
    frames: list[int]
    budgets: tuple[tuple[int, ...], ...]
    max_items: int
    max_frames: int

    def is_miss(self, item: int) -> bool:
        """True when no graph can hold the item, even alone."""
        if self.frames[item] > self.max_frames:
            return True
        return any(toks[item] > b[-1] for toks, b in zip(self.tokens, self.budgets))


Segments = list[tuple[int, int]]
Group = list[int]


def pack(
    tokens: Sequence[int] | Sequence[Sequence[int]],
    frames: Sequence[int],
    plan: BudgetPlan | Sequence[BudgetPlan],
    policy: str = "greedy",
) -> list[Batch]:
    """Split items into batches under ``plan``; see the module docstring for invariants.

    ``plan`` is one path's plan with ``tokens`` one count per item, or one plan per path
    (from ``resolve_path_budgets``) with ``tokens`` one sequence of counts per path.
    First-path tokens must be >= 1 (an item that yields no tokens is a preprocessing
    bug; it raises ``ValueError`` naming the index rather than silently occupying a
    slot), further paths' >= 0. Several paths sort by the item's total tokens, as in
    vLLM: the work it brings, whichever path carries it.

    A miss on one path (its tokens above that path's largest budget) is placed alone and
    gets ``None`` on that path only; a frame miss gets ``None`` on every path, since no
    graph's per-frame buffers can hold it. Returned order: graph batches ordered by
    their first item, items inside a batch in ascending tokens (ties by index); then
    the misses, each alone, in the same order.
    """
    plans = (plan,) if isinstance(plan, BudgetPlan) else tuple(plan)
    columns = (tokens,) if isinstance(plan, BudgetPlan) else tuple(tokens)
    _check_plans(plans)
    if len(columns) != len(plans):
        raise ValueError(f"got token counts for {len(columns)} paths but plans for {len(plans)}")
    count = len(columns[0])
    for path, column in enumerate(columns[1:], start=1):
        if len(column) != count:
            raise ValueError(f"path 0 has {count} token counts but path {path} has {len(column)}")
    problem = _Problem(
        tuple(
            _check_tokens(column, _tokens_name(path), minimum=0 if path else 1)
            for path, column in enumerate(columns)
        ),
        _check_frames(frames, count),
        tuple(p.token_budgets for p in plans),
        plans[0].max_items,
        plans[0].max_frames,
    )
    return [_make_batch(group, problem) for group in _pack_groups(problem, policy)]


def _tokens_name(path: int) -> str:
    return "tokens" if path == 0 else f"path {path} tokens"


def _check_tokens(values: Sequence[int], name: str, minimum: int) -> list[int]:
    ints = [operator.index(v) for v in values]
    for position, value in enumerate(ints):
        if value < minimum:
            raise ValueError(
                f"{name}[{position}]={value} is below {minimum}; an item must produce at "
                "least one output token: drop or report it before packing"
            )
    return ints


def _check_frames(frames: Sequence[int], count: int) -> list[int]:
    if len(frames) != count:
        raise ValueError(f"got {count} token counts but {len(frames)} frame counts")
    ints = [operator.index(v) for v in frames]
    for position, value in enumerate(ints):
        if value < 0:
            raise ValueError(f"frames[{position}]={value} is negative")
    return ints


def _pack_groups(problem: _Problem, policy: str) -> list[Group]:
    """Original-index groups: graph batches first, then one group per miss.

    Every policy sees the same sorted order (ascending total tokens, stable) and the
    same misses, so the policies differ only in how the fitting items are grouped.
    Groups list their items in that order and are ordered by their first item.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown packing policy {policy!r}; allowed: {', '.join(POLICIES)}")
    totals = [sum(column) for column in zip(*problem.tokens)]
    order = sorted(range(len(totals)), key=totals.__getitem__)
    missed = [problem.is_miss(i) for i in range(len(totals))]
    fitting = [i for i in order if not missed[i]]
    misses = [[i] for i in order if missed[i]]
    greedy = _segment_groups(_greedy_segments(fitting, problem), fitting)
    if policy == "greedy":
        return greedy + misses
    candidates = [
        greedy,
        _segment_groups(_min_padding_segments(fitting, problem), fitting),
        _best_fit_groups(fitting, problem),
    ]
    return _cheapest(candidates, problem) + misses


def _segment_groups(segments: Segments, order: list[int]) -> list[Group]:
    return [order[start:end] for start, end in segments]


def _greedy_segments(order: list[int], problem: _Problem) -> Segments:
    """The seed's greedy fill: close a batch when the next item breaks any limit."""
    segments: Segments = []
    start = 0
    sums = [0] * len(problem.tokens)
    frames = 0
    limits = [b[-1] for b in problem.budgets]
    for position, item in enumerate(order):
        item_frames = problem.frames[item]
        fits = (
            position - start < problem.max_items
            and frames + item_frames <= problem.max_frames
            and all(s + t[item] <= m for s, t, m in zip(sums, problem.tokens, limits))
        )
        if position > start and not fits:
            segments.append((start, position))
            start, sums, frames = position, [0] * len(sums), 0
        frames += item_frames
        sums = [s + t[item] for s, t in zip(sums, problem.tokens)]
    if order:
        segments.append((start, len(order)))
    return segments


def _replay_cost(problem: _Problem) -> int:
    """Padded tokens one extra replay must save to be worth it: the smallest budget.

    A replay of the smallest graph is the cheapest call there is; splitting a batch
    costs at least one such call, so it must save at least that much padded work.
    """
    return min(b for budgets in problem.budgets for b in budgets if b > 0)


def _groups_waste(groups: list[Group], problem: _Problem) -> int:
    waste = 0
    for group in groups:
        for toks, budgets in zip(problem.tokens, problem.budgets):
            total = sum(toks[i] for i in group)
            waste += budgets[bisect_left(budgets, total)] - total
    return waste


def _cheapest(candidates: list[list[Group]], problem: _Problem) -> list[Group]:
    """The min_padding choice among candidate groupings, ``candidates[0]`` being greedy.

    Only candidates wasting no more padded tokens than greedy are eligible, which is
    what guarantees min_padding never wastes more than greedy however the candidates
    were found. Among those the smallest ``padding + replay_cost * batches`` wins (ties:
    fewer batches, then the earlier candidate, so greedy on a full tie). Since greedy is
    eligible, the winner's extra batches over greedy each saved >= ``replay_cost``.
    """
    replay_cost = _replay_cost(problem)
    wastes = [_groups_waste(groups, problem) for groups in candidates]
    eligible = [k for k, waste in enumerate(wastes) if waste <= wastes[0]]
    best = min(
        eligible,
        key=lambda k: (wastes[k] + replay_cost * len(candidates[k]), len(candidates[k])),
    )
    return candidates[best]


def _best_fit_groups(order: list[int], problem: _Problem) -> list[Group]:
    """Best-fit decreasing into bins as large as each path's largest budget.

    Largest items first, each into the open bin with the least first-path room that
    still holds it under every limit, else a new bin; a finished bin later gets its
    smallest fitting budget like any batch. Big items leave gaps that the small items
    arriving last fill, which the sorted-order split cannot do: when items are close to
    the budget sizes, consecutive runs cannot land near a budget. Cost: O(items x open
    bins) at worst, when the frame limit rejects many bins (`benchmarks/packing.py`
    times it).
    """
    limits = [b[-1] for b in problem.budgets]
    position = {item: k for k, item in enumerate(order)}
    members: list[list[int]] = []
    sums: list[list[int]] = []
    frames: list[int] = []
    room: list[tuple[int, int]] = []  # (first-path room, bin) of bins below max_items
    for item in reversed(order):
        tokens = [toks[item] for toks in problem.tokens]
        slot = _best_fitting_slot(room, tokens, problem.frames[item], sums, frames, limits, problem)
        if slot is None:
            target = len(members)
            members.append([])
            sums.append([0] * len(tokens))
            frames.append(0)
        else:
            target = room.pop(slot)[1]
        members[target].append(item)
        sums[target] = [s + t for s, t in zip(sums[target], tokens)]
        frames[target] += problem.frames[item]
        left = limits[0] - sums[target][0]
        if left > 0 and len(members[target]) < problem.max_items:
            insort(room, (left, target))
    groups = [group[::-1] for group in members]
    groups.sort(key=lambda group: position[group[0]])
    return groups


def _best_fitting_slot(
    room: list[tuple[int, int]], tokens: list[int], item_frames: int,
    sums: list[list[int]], frames: list[int], limits: list[int], problem: _Problem,
) -> int | None:
    """Position in ``room`` of the tightest bin that takes the item, or None."""
    for slot in range(bisect_left(room, (tokens[0], -1)), len(room)):
        target = room[slot][1]
        if frames[target] + item_frames > problem.max_frames:
            continue
        if all(s + t <= m for s, t, m in zip(sums[target][1:], tokens[1:], limits[1:])):
            return slot
    return None


def _prefix(values: Iterable[int]) -> list[int]:
    return [0, *itertools.accumulate(values)]


def _min_padding_segments(order: list[int], problem: _Problem) -> Segments:
    """Optimal split of the sorted order into contiguous batches (dynamic programming).

    Minimises ``padding + replay_cost * batches`` over every split of ``order`` into
    consecutive runs that respect all limits (``_replay_cost`` keeps it from splitting
    into single items to save a few padded tokens). Greedy's batches are such a split,
    so the optimum never costs more than greedy. Ties go to fewer batches.

    Speed: with ``key[i] = cost[i] + sum_p prefix_p[i]``, batch ``(i, j]`` priced at
    budget levels ``L`` (one per path) costs ``key[i] + sum(L) + replay_cost`` minus a
    term of ``j`` alone. Pricing a batch at levels above its own only overestimates it,
    and its own levels are tried too, so each level combination may take the smallest
    key over every start it can hold: a suffix of the starts, ending at ``j``. Those
    suffix minima are one increasing stack shared by all combinations, searched by
    bisection; a level whose suffix equals a smaller level's is never cheaper and is
    skipped. Cost: O(items x live level combinations x log items), in C-level bisects.
    """
    count = len(order)
    prefixes = [_prefix(toks[i] for i in order) for toks in problem.tokens]
    frame_prefix = _prefix(problem.frames[i] for i in order)
    replay_cost = _replay_cost(problem)
    keys: list[tuple[int, int]] = [(0, 0)]
    parent: list[int] = [0]
    minima: list[int] = [0]  # the suffix minima of keys: ascending starts, ascending keys
    frame_low = 0
    for j in range(1, count + 1):
        while frame_prefix[j] - frame_prefix[frame_low] > problem.max_frames:
            frame_low += 1
        floor = max(j - problem.max_items, frame_low)
        combos = _level_starts(prefixes[0], problem.budgets[0], j, floor)
        for prefix, budgets in zip(prefixes[1:], problem.budgets[1:]):
            levels = _level_starts(prefix, budgets, j, floor)
            combos = [(max(a, b), x + y) for a, x in combos for b, y in levels]
        best: tuple[int, int] | None = None
        best_parent = j - 1
        for first, budget in combos:
            start = minima[bisect_left(minima, first)]
            candidate = (keys[start][0] + budget, keys[start][1])
            if best is None or candidate < best:
                best, best_parent = candidate, start
        if best is None:
            raise AssertionError(f"no feasible batch ends at item {j}; singletons always fit")
        key = (best[0] + replay_cost, best[1] + 1)
        keys.append(key)
        parent.append(best_parent)
        while minima and keys[minima[-1]] >= key:
            minima.pop()
        minima.append(j)
    return _backtrack(parent, count)


def _level_starts(prefix: list[int], budgets: tuple[int, ...], j: int, floor: int) -> list[tuple[int, int]]:
    """``(first start, budget)`` per budget level usable by batches ending at ``j``.

    Batch ``(i, j]`` fits level ``k`` on this path iff ``i >= first``, its token sum
    being <= ``budgets[k]``; no start lies below ``floor`` (the item and frame limits).
    Ascending budgets, strictly descending first starts: a level whose first start
    equals a smaller level's holds no further batch, so it is left out.
    """
    levels = []
    bound = j
    for budget in budgets:
        first = bisect_left(prefix, prefix[j] - budget, floor, j)
        if first < bound:
            levels.append((first, budget))
            bound = first
        if first == floor:
            break
    return levels


def _backtrack(parent: list[int], count: int) -> Segments:
    segments: Segments = []
    end = count
    while end > 0:
        segments.append((parent[end], end))
        end = parent[end]
    segments.reverse()
    return segments


def _path_budget(budgets: tuple[int, ...], total: int) -> int | None:
    position = bisect_left(budgets, total)
    return budgets[position] if position < len(budgets) else None


def _make_batch(group: list[int], problem: _Problem) -> Batch:
    tokens = [sum(column[i] for i in group) for column in problem.tokens]
    frames = sum(problem.frames[i] for i in group)
    if frames > problem.max_frames:
        budgets: list[int | None] = [None] * len(tokens)
    else:
        budgets = [_path_budget(b, t) for b, t in zip(problem.budgets, tokens)]
    others = tuple(zip(budgets[1:], tokens[1:]))
    return Batch(tuple(group), budgets[0], tokens[0], frames, others)
