"""What `embedjob report` shows of an output, read from its files (no page, no plot).

It reads what `embedjob status` reads (manifests, markers, the lock and SLURM's view:
each shard's state is the one `status` prints), every finished shard's statistics, and
the `id` and `error` columns of the few parts that hold examples of each error code.

Only a finished shard has statistics (a run writes them last, with `_SUCCESS`), so an
unfinished shard (running, failed, pending) is known by what its manifest committed.
Statistics written by an earlier embedjob lack some keys (the time series, the job
spec, the versions): `OutputView.notes` says which shards lack what, so the page can
say what it cannot show instead of failing.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedjob.io.checkpoint import load_manifest, stats_name
from embedjob.io.store import Store, output_store
from embedjob.report.counts import error_code, plural
from embedjob.slurm import OutputStatus, ShardStatus, output_status

logger = logging.getLogger(__name__)

RANK_FIGURES = 6
"""Shards that get their own per-rank figure, the slowest first: more would make the
page of a 64-shard output scroll for ever."""

EXAMPLES = 3
"""Example rows shown per error code."""

MESSAGE_CHARS = 200
"""An example's message is cut to this many characters."""


@dataclass
class ShardView:
    """One shard as the report shows it: `status` (state, rows committed, errors), the
    statistics of its last run when it is done (None otherwise), and the attempts its
    manifest records (every run that worked on it)."""

    status: ShardStatus
    stats: dict[str, Any] | None
    attempts: list[dict[str, Any]]

    @property
    def shard(self) -> int:
        return self.status.shard

    def cells(self) -> dict[str, Any]:
        """The table row's numbers (None: not known). A done shard's are its statistics'
        (`rows`, `errors`, `seconds`, `setup_seconds`, `items_per_second`, the number of
        `attempts`, `world_size`); an unfinished one's come from its manifest: the rows
        committed so far, over the seconds of its runs."""
        if self.stats is not None:
            s = self.stats
            return {
                "rows": s.get("rows"),
                "errors": s.get("errors"),
                "seconds": s.get("seconds"),
                "setup_seconds": s.get("setup_seconds"),
                "rows_per_second": s.get("items_per_second"),
                "runs": len(s.get("attempts") or self.attempts) or None,
                "ranks": s.get("world_size", 1),
            }
        seconds = round(sum(a.get("seconds", 0.0) for a in self.attempts), 3)
        rows = sum(a.get("rows", 0) for a in self.attempts)
        return {
            "rows": self.status.committed,
            "errors": self.status.errors,
            "seconds": seconds if self.attempts else None,
            "setup_seconds": None,
            "rows_per_second": round(rows / seconds, 3) if seconds else None,
            "runs": len(self.attempts) or None,
            "ranks": None,
        }


@dataclass
class OutputView:
    """Every shard of an output, and what the report cannot show, with why."""

    output: Store
    status: OutputStatus
    shards: list[ShardView]
    notes: list[str] = field(default_factory=list)
    rank_shards: list[int] = field(default_factory=list)

    @property
    def runs(self) -> dict[int, dict[str, Any]]:
        """Finished shards' statistics by shard (what the figures plot)."""
        return {view.shard: view.stats for view in self.shards if view.stats is not None}


def read_output(output: Store | Path) -> OutputView:
    """The output's shards, states and statistics. JobError when it is not an
    embedjob output (as `embedjob status` says)."""
    output = output_store(output)
    status = output_status(output)
    shards = [ShardView(s, _stats(output, s), _attempts(output, s.shard)) for s in status.shards]
    view = OutputView(output, status, shards)
    view.rank_shards = _rank_figure_shards(view.runs)
    view.notes = _notes(view)
    return view


def _stats(output: Store, status: ShardStatus) -> dict[str, Any] | None:
    """A done shard's statistics; None for an unfinished shard, whose statistics file,
    if any, is an earlier run's."""
    if status.state != "done":
        return None
    try:
        stats = json.loads(output.read(stats_name(status.shard)))
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s: %s", stats_name(status.shard), exc)
        return None
    return stats if isinstance(stats, dict) else None


def _attempts(output: Store, shard: int) -> list[dict[str, Any]]:
    manifest = load_manifest(output, shard)
    return [a for a in (manifest or {}).get("attempts", []) if isinstance(a, dict)]


def _notes(view: OutputView) -> list[str]:
    """What the page cannot show, shard by shard, and why."""
    notes = []
    unfinished = [v for v in view.shards if v.status.state != "done"]
    if unfinished:
        named = ", ".join(f"{v.shard} ({v.status.state})" for v in unfinished)
        notes.append(
            f"not finished, so without statistics yet: {plural(len(unfinished), 'shard')}, {named}; the table shows "
            "what their manifests committed, and the plots leave them out"
        )
    unread = [v.shard for v in view.shards if v.status.state == "done" and v.stats is None]
    if unread:
        notes.append(f"done, but their statistics file cannot be read: shards {shards_text(unread)}")
    runs = view.runs
    missing = {
        # A shard with nothing to encode (empty, or all committed before) has no ranks to time.
        "a time series (throughput over time, per-rank plots)": [
            s for s, st in runs.items() if "timeline" not in st and st.get("ranks")
        ],
        "the job spec": [s for s, st in runs.items() if "job" not in st],
        "software versions and device names": [s for s, st in runs.items() if "versions" not in st],
        "the seconds spent writing parts": [s for s, st in runs.items() if "write_seconds" not in st and st.get("ranks")],
    }
    for what, shards in missing.items():
        if shards:
            notes.append(f"statistics written by an earlier embedjob, without {what}: shards {shards_text(shards)}")
    timed = _timed_shards(runs)
    if len(timed) > len(view.rank_shards):
        notes.append(f"per-rank plots of the {len(view.rank_shards)} slowest shards only ({len(timed)} have a time series)")
    errors = sum(s.errors for s in view.status.shards)
    if errors and not view.status.error_codes():
        notes.append(f"{plural(errors, 'error row')} whose codes the manifests of an earlier embedjob did not record")
    return notes


def _timed_shards(runs: dict[int, dict[str, Any]]) -> list[int]:
    """Finished shards whose ranks recorded a time series."""
    return [s for s, stats in runs.items() if any("timeline" in r for r in stats.get("ranks", []))]


def _rank_figure_shards(runs: dict[int, dict[str, Any]]) -> list[int]:
    """The shards that get a per-rank figure: those with a time series, the slowest
    first, RANK_FIGURES at most."""
    slowest = sorted(_timed_shards(runs), key=lambda s: (runs[s].get("items_per_second") or 0.0, s))
    return slowest[:RANK_FIGURES]


def shards_text(shards: list[int]) -> str:
    return ", ".join(map(str, sorted(shards)))


def error_examples(
    output: Store, shards: list[int], codes: dict[str, int], per_code: int = EXAMPLES
) -> dict[str, list[tuple[str, str]]]:
    """Up to `per_code` example rows (id, message) of each error code, in row order.

    Only the committed parts whose manifest entry counts a code still short of examples
    are read, and only their `id` and `error` columns, error rows only: the examples of
    a large output cost a few small reads. A part that cannot be read is skipped (the
    report is not where damage is judged: `embedjob verify` is).
    """
    examples: dict[str, list[tuple[str, str]]] = defaultdict(list)
    wanted = set(codes)
    for shard in sorted(shards):
        for part in (load_manifest(output, shard) or {}).get("parts", []):
            if not wanted & set(part.get("error_codes") or {}):
                continue
            for identifier, error in _error_rows(output, part["name"]):
                code = error_code(error)
                if code in wanted and len(examples[code]) < per_code:
                    examples[code].append((identifier, _message(error)))
                    if len(examples[code]) == per_code:
                        wanted.discard(code)
            if not wanted:
                return dict(examples)
    return dict(examples)


def _error_rows(output: Store, name: str) -> list[tuple[str, str]]:
    """(id, error) of a part's error rows; none when the part cannot be read."""
    path, filesystem = output.arrow(name)
    try:
        table = pq.read_table(path, columns=["id", "error"], filters=pc.field("error").is_valid(), filesystem=filesystem)
    except (OSError, pa.ArrowException) as exc:
        logger.warning("cannot read the errors of %s: %s", name, exc)
        return []
    return [(str(i), str(e)) for i, e in zip(table.column("id").to_pylist(), table.column("error").to_pylist())]


def _message(error: str) -> str:
    message = error.split(":", 1)[1].strip() if ":" in error else error
    return message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 1] + "…"
