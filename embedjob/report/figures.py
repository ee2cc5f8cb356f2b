"""The report's plots: finished shards' statistics in, PNG bytes out (matplotlib, Agg).

Each function takes the statistics of the shards it can plot (`runs`: shard index ->
the `stats-SSSSS.json` of its last run) and returns a `Figure`, or None when nothing in
them can be plotted (e.g. statistics of an earlier embedjob, without a time series);
the caller says what is missing. Figures are drawn on their own Agg canvas, never
through pyplot: no display, no global state, so a report can be made on a cluster's
login node and from any thread.

Times on every x axis are seconds after the start of the shard's run (its statistics'
`started_at`), so setup shows as the stretch before its dotted line.
"""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from embedjob.report.counts import plural
from embedjob.timeline import Timeline

LEGEND_MAX = 12
"""Lines a legend names; beyond that the lines are told apart by the table instead."""

MAIN_THREAD = ("setup", "host", "launch", "waiting for decode", "waiting for the device")
"""What a rank's main thread did, one after the other: these add up to its wall time."""

ELSEWHERE = ("device busy", "decode workers", "writing parts", "reading rows", "waiting for a chunk")
"""Work of other threads, processes and the device, side by side with the main thread."""

STAGE_COLORS = {stage: f"C{k}" for k, stage in enumerate(MAIN_THREAD + ELSEWHERE)}
"""One colour per stage in every figure, so a wait reads the same everywhere."""

DPI = 100


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes, drawn by the Agg backend."""
    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


def timeline(data: dict[str, Any] | None) -> Timeline | None:
    """A statistics' time series, None when they have none (an earlier embedjob's)."""
    return Timeline.from_dict(data) if data and data.get("series") else None


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _color(index: int) -> str:
    return f"C{index % 10}"


def _steps(line: Timeline, since: float, values: list[float]) -> tuple[list[float], list[float]]:
    """x and y of a step plot of per-bucket `values`, the last bucket drawn to its end."""
    times = line.times(since)
    return [*times, times[-1] + line.width], [*values, values[-1]]


def throughput(runs: dict[int, dict[str, Any]]) -> Figure | None:
    """Rows written per second over time, one line per shard, its setup's end dotted."""
    lines = {shard: timeline(stats.get("timeline")) for shard, stats in runs.items()}
    lines = {shard: line for shard, line in lines.items() if line is not None and line.buckets}
    if not lines:
        return None
    figure = _figure(10, 4)
    axes = figure.subplots()
    for k, (shard, line) in enumerate(sorted(lines.items())):
        stats = runs[shard]
        x, y = _steps(line, stats["started_at"], line.rates("rows"))
        axes.step(x, y, where="post", color=_color(k), label=f"shard {shard}")
        axes.axvline(stats.get("setup_seconds", 0.0), color=_color(k), linestyle=":", linewidth=1)
    axes.set_title("rows written per second (dotted: setup ends)")
    axes.set_xlabel("seconds since the shard's run started")
    axes.set_ylabel("rows / s")
    axes.set_ylim(bottom=0)
    if len(lines) <= LEGEND_MAX:
        axes.legend(loc="upper left", fontsize="small")
    return figure


def ranks(shard: int, stats: dict[str, Any]) -> Figure | None:
    """One shard's ranks over time: rows encoded per second, device busy share, what
    the ranks waited on, and the graphs' hit rate and padding share."""
    lines = [(rank, timeline(rank.get("timeline"))) for rank in stats.get("ranks", [])]
    lines = [(rank, line) for rank, line in lines if line is not None and line.buckets]
    if not lines:
        return None
    figure = _figure(12, 7)
    (rows, busy), (waits, graphs) = figure.subplots(2, 2, sharex=True)
    since = stats["started_at"]
    for rank, line in lines:
        label, color = f"rank {rank['rank']}", _color(rank["rank"])
        rows.step(*_steps(line, since, line.rates("rows")), where="post", color=color, label=label)
        busy.step(*_steps(line, since, line.rates("busy_seconds")), where="post", color=color, label=label)
        if rank.get("ready_at"):
            for axes in (rows, busy):
                axes.axvline(rank["ready_at"] - since, color=color, linestyle=":", linewidth=1)
    rows.set_title("rows encoded per second (dotted: setup ends)")
    rows.set_ylabel("rows / s")
    busy.set_title("device busy share")
    busy.set_ylabel("busy seconds / second")
    for axes in (rows, busy):
        axes.set_ylim(bottom=0)
        if len(lines) <= LEGEND_MAX:
            axes.legend(loc="upper left", fontsize="small")
    _waits(waits, lines, since)
    _graphs_over_time(graphs, lines, since)
    for axes in (waits, graphs):
        axes.set_xlabel("seconds since the shard's run started")
    figure.suptitle(f"shard {shard}: {len(lines)} {'rank' if len(lines) == 1 else 'ranks'}")
    return figure


def _summed(lines: list[tuple[dict[str, Any], Timeline]], name: str, since: float) -> tuple[list[float], list[float]]:
    """A series summed over ranks on a common grid (the widest rank's buckets), per
    second, as a step plot's x and y (the last bucket drawn to its end)."""
    width = max(line.width for _, line in lines)
    start = min(line.origin for _, line in lines)
    count = max(int((line.origin - start) // width) + line.buckets for _, line in lines)
    totals = [0.0] * count
    for _, line in lines:
        for t, value in zip(line.times(start), line.values(name)):
            totals[int(t // width)] += value / width
    return [start - since + k * width for k in range(count + 1)], [*totals, totals[-1]]


def _waits(axes: Any, lines: list[tuple[dict[str, Any], Timeline]], since: float) -> None:
    """Seconds waited per second, stacked by what was waited on, summed over ranks."""
    stages = sorted({name for rank, _ in lines for name in rank.get("waits", {})})
    curves = [(stage, *_summed(lines, stage, since)) for stage in stages]
    curves = [(stage, x, y) for stage, x, y in curves if any(y)]
    if curves:
        x = curves[0][1]
        stages = [stage for stage, _, _ in curves]
        colors = [STAGE_COLORS.get(stage, "grey") for stage in stages]
        axes.stackplot(x, *[y for _, _, y in curves], labels=stages, colors=colors, step="post")
        axes.legend(loc="upper left", fontsize="small")
    axes.set_title("what the ranks waited on (seconds per second, all ranks)")
    axes.set_ylabel("seconds / s")


def _graphs_over_time(axes: Any, lines: list[tuple[dict[str, Any], Timeline]], since: float) -> None:
    """Per bucket, over all ranks: the share of items that replayed a graph, and the
    share of the tokens they ran that were padding."""
    x, hits = _summed(lines, "graph_hits", since)
    _, misses = _summed(lines, "graph_misses", since)
    _, padding = _summed(lines, "padding_waste", since)
    _, real = _summed(lines, "real_tokens", since)
    hit_rate = [100 * h / (h + m) if h + m else float("nan") for h, m in zip(hits, misses)]
    padded = [100 * p / (p + r) if p + r else float("nan") for p, r in zip(padding, real)]
    axes.step(x, hit_rate, where="post", marker=".", label="graph hit rate")
    axes.step(x, padded, where="post", marker=".", label="padding share of tokens")
    axes.set_ylim(-2, 102)
    axes.set_ylabel("%")
    axes.set_title("graphs: hit rate and padding per bucket")
    axes.legend(loc="center left", fontsize="small")


def stages(runs: dict[int, dict[str, Any]]) -> Figure | None:
    """Seconds per stage per shard, summed over its ranks: the main threads' time
    stacked (it adds up), the other threads' and the device's beside it."""
    if not runs:
        return None
    shards = sorted(runs)
    figure = _figure(13, 2.0 + 0.45 * len(shards))
    main, other = figure.subplots(1, 2, sharey=True)
    labels = [f"shard {s}" for s in shards]
    left = [0.0] * len(shards)
    for stage in MAIN_THREAD:
        values = [main_thread_seconds(runs[s]).get(stage, 0.0) for s in shards]
        main.barh(labels, values, left=left, color=STAGE_COLORS[stage], label=stage)
        left = [a + b for a, b in zip(left, values)]
    main.set_title("main thread of each rank (adds up to its time)")
    main.set_xlabel("seconds, summed over ranks")
    main.invert_yaxis()
    figure.legend(*main.get_legend_handles_labels(), loc="outside lower left", ncols=3, fontsize="small")
    height = 0.8 / len(ELSEWHERE)
    for k, stage in enumerate(ELSEWHERE):
        values = [other_seconds(runs[s]).get(stage, 0.0) for s in shards]
        positions = [i - 0.4 + (k + 0.5) * height for i in range(len(shards))]
        other.barh(positions, values, height=height, color=STAGE_COLORS[stage], label=stage)
    other.set_title("other threads and the device (side by side)")
    other.set_xlabel("seconds, summed over ranks")
    figure.legend(*other.get_legend_handles_labels(), loc="outside lower right", ncols=3, fontsize="small")
    return figure


def main_thread_seconds(stats: dict[str, Any]) -> dict[str, float]:
    """Seconds of the ranks' main threads per MAIN_THREAD stage, summed over ranks."""
    total: Counter[str] = Counter()
    for rank in stats.get("ranks", []):
        waits = rank.get("waits", {})
        total["setup"] += rank.get("setup_seconds", 0.0)
        total["host"] += rank.get("host_seconds", 0.0)
        total["launch"] += rank.get("launch_seconds", 0.0)
        for stage in ("waiting for decode", "waiting for the device"):
            total[stage] += waits.get(stage, 0.0)
    return dict(total)


def other_seconds(stats: dict[str, Any]) -> dict[str, float]:
    """Seconds per ELSEWHERE stage: the device, the decode workers (all of them), the
    writer thread and each rank's reading thread, summed over ranks."""
    total: Counter[str] = Counter({"writing parts": stats.get("write_seconds", 0.0)})
    for rank in stats.get("ranks", []):
        waits = rank.get("waits", {})
        total["device busy"] += rank.get("busy_seconds", 0.0)
        total["decode workers"] += rank.get("decode_seconds", 0.0)
        for stage in ("reading rows", "waiting for a chunk"):
            total[stage] += waits.get(stage, 0.0)
    return dict(total)


def graphs(runs: dict[int, dict[str, Any]]) -> Figure | None:
    """Batches per budget over every shard (items they held on top), and per shard the
    graphs' hit rate and the share of padding in the tokens run through them."""
    budgets = Counter[int]()
    items = Counter[int]()
    for stats in runs.values():
        budgets.update({int(b): n for b, n in stats.get("budget_batches", {}).items()})
        items.update({int(b): n for b, n in stats.get("budget_items", {}).items()})
    if not runs:
        return None
    figure = _figure(14, 4)
    per_budget, hit_rate, padding = figure.subplots(1, 3, width_ratios=[2, 1, 1])
    ordered = sorted(budgets)
    bars = per_budget.bar([str(b) for b in ordered], [budgets[b] for b in ordered], color="C0")
    per_budget.bar_label(bars, labels=[plural(items[b], "item") for b in ordered], fontsize="x-small")
    per_budget.set_title("batches per token budget (graph replays, all shards)")
    per_budget.set_xlabel("token budget")
    per_budget.set_ylabel("batches")
    shards = sorted(runs)
    labels = [str(s) for s in shards]
    hit_rate.bar(labels, [100 * runs[s].get("hit_rate", 0.0) for s in shards], color="C2")
    hit_rate.set_ylim(0, 100)
    hit_rate.set_title("graph hit rate per shard (%)")
    hit_rate.set_xlabel("shard")
    padding.bar(labels, [padding_share(runs[s]) for s in shards], color="C3")
    padding.set_title("padding share of graph tokens (%)")
    padding.set_xlabel("shard")
    for axes in (hit_rate, padding):
        axes.tick_params(axis="x", labelsize="small", labelrotation=90 if len(shards) > 16 else 0)
    return figure


def padding_share(stats: dict[str, Any]) -> float:
    """Padded tokens as a percentage of the tokens graph batches ran (real + padding)."""
    padded, real = stats.get("padding_waste", 0), stats.get("real_tokens", 0)
    return 100 * padded / (padded + real) if padded + real else 0.0


def errors(codes: dict[str, int], shown: int = 15) -> Figure | None:
    """Error rows per code, most frequent on top (`shown` codes at most)."""
    if not codes:
        return None
    ordered = sorted(codes.items(), key=lambda item: (-item[1], item[0]))[:shown]
    figure = _figure(8, 0.8 + 0.35 * len(ordered))
    axes = figure.subplots()
    bars = axes.barh([code for code, _ in ordered], [count for _, count in ordered], color="C3")
    axes.bar_label(bars, fontsize="small")
    axes.invert_yaxis()
    axes.set_title("error rows per code (committed parts)")
    axes.set_xlabel("rows")
    return figure
