"""Time series for the statistics: sums per time bucket, a bounded number of buckets.

A run adds samples as it goes (a written block, a finished window): what its running
totals gained since the previous sample, spread evenly over the time between the two
(a window's rows and device seconds accrue while it runs, not at the instant it is
handed over, so a rate per bucket reads as a rate, not as spikes). The buckets start
BUCKET_SECONDS wide; when a sample falls beyond MAX_BUCKETS of them,
neighbours are merged pairwise and the width doubles. So a series never holds more
than MAX_BUCKETS numbers, whatever the run's length or row count: the statistics of a
10-million-row shard are as small as a ten-row one's (`tests/test_report.py` checks
the bound).

Invariant: every value is a sum (rows, seconds, tokens), so merging buckets loses only
resolution, and a series sums to the total its run counted (the statistics' totals and
the time series agree). A rate is a bucket's sum over the bucket's width.

Bucket times are wall-clock seconds after `origin` (epoch seconds), so the timelines of
a shard's ranks, which are processes of one host, line up with the shard's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MAX_BUCKETS = 240
"""The most buckets a series holds: a plot's worth of points."""

BUCKET_SECONDS = 1.0
"""The first width of a bucket; a run longer than MAX_BUCKETS of them doubles it."""


@dataclass
class Timeline:
    """Sums per bucket of `width` seconds from `origin`, one list per named series.

    `end` is the time (after `origin`) of the latest sample, so a reader knows how much
    of the last bucket the run covered. `totals` and `last` (wall-clock seconds) are
    the running totals and the time of the previous `advance` without a span of its own.
    """

    origin: float = field(default_factory=time.time)
    width: float = BUCKET_SECONDS
    end: float = 0.0
    series: dict[str, list[float]] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict, repr=False)
    last: float | None = field(default=None, repr=False)

    def skip_to(self, at: float) -> None:
        """Nothing the series count happened before wall-clock `at` (e.g. setup): the
        next `advance` spreads its gains from there on, not from `origin`."""
        self.last = at

    def advance(self, at: float, totals: dict[str, float], since: float | None = None) -> None:
        """Add what each running total gained since its previous call (the first call:
        all of it), so a caller that keeps totals need not keep differences.

        The gain is spread over the time since the previous call without `since`
        (what accrues as it happens: waits, launches), or over [since, at] (work whose
        own span is known, e.g. a window's time on the device), which leaves the time
        of the previous call as it was."""
        gained = {name: value - self.totals.get(name, 0.0) for name, value in totals.items()}
        self.totals.update(totals)
        if since is not None:
            self.spread(since, at, gained)
            return
        self.spread(self.origin if self.last is None else self.last, at, gained)
        self.last = at

    def spread(self, start: float, end: float, values: dict[str, float]) -> None:
        """Add `values` spread evenly over wall-clock [start, end], all into the bucket
        of `end` when the span is empty (times before `origin` count as `origin`)."""
        first, last = max(start - self.origin, 0.0), max(end - self.origin, 0.0)
        while last >= MAX_BUCKETS * self.width:
            self._coarsen()
        self.end = max(self.end, last)
        if last <= first:
            self._add(int(last // self.width), values)
            return
        index = int(first // self.width)
        while index * self.width < last:
            overlap = min(last, (index + 1) * self.width) - max(first, index * self.width)
            share = overlap / (last - first)
            self._add(index, {name: value * share for name, value in values.items()})
            index += 1

    def _add(self, index: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            column = self.series.setdefault(name, [])
            if len(column) <= index:
                column.extend([0.0] * (index + 1 - len(column)))
            column[index] += value

    def _coarsen(self) -> None:
        """Merge neighbouring buckets: half as many, twice as wide."""
        self.width *= 2
        for name, column in self.series.items():
            self.series[name] = [sum(column[i : i + 2]) for i in range(0, len(column), 2)]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the statistics: every series as long as the run's buckets,
        whole numbers as integers and the rest to the millisecond (smaller JSON)."""
        buckets = int(self.end // self.width) + 1 if self.series else 0
        return {
            "origin": round(self.origin, 3),
            "width": self.width,
            "end": round(self.end, 3),
            "series": {name: [_compact(v) for v in _padded(column, buckets)] for name, column in sorted(self.series.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """A timeline as `to_dict` wrote it (read back by `embedjob report`)."""
        series = {str(name): [float(v) for v in values] for name, values in (data.get("series") or {}).items()}
        return cls(float(data["origin"]), float(data["width"]), float(data.get("end", 0.0)), series)

    def rates(self, name: str) -> list[float]:
        """A series per second of its bucket (zeros where it has no samples)."""
        return [value / self.width for value in self.values(name)]

    def values(self, name: str) -> list[float]:
        """A series, as long as the run's buckets (zeros where it has no samples)."""
        return _padded(self.series.get(name, []), self.buckets)

    def times(self, since: float) -> list[float]:
        """The start of every bucket in seconds after epoch time `since`."""
        start = self.origin - since
        return [start + k * self.width for k in range(self.buckets)]

    @property
    def buckets(self) -> int:
        return max((len(c) for c in self.series.values()), default=0)


def _padded(column: list[float], length: int) -> list[float]:
    return column + [0.0] * (length - len(column))


def _compact(value: float) -> float | int:
    rounded = round(value, 3)
    return int(rounded) if rounded.is_integer() else rounded
