"""`embedjob report OUTPUT`: one self-contained HTML page about an output, finished or not.

The page shows what `report.data` reads of the output: the shard table (rows, errors,
seconds, rows/s, state) and the slowest shards; rows per second over time per shard,
and per rank; seconds per stage per shard; batches per budget, hit rate, padding and
the eager fallbacks with their reasons; error codes with example rows; the job spec
and the software and devices the runs used; and what it cannot show (unfinished
shards, statistics of an earlier embedjob). Every figure (`figures`) is embedded as a
PNG (`data:` URI, so the file can be mailed or opened anywhere), and the same PNGs are
written beside the page.
"""

from __future__ import annotations

import base64
import html
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from embedjob.config import JobError
from embedjob.io.checkpoint import META, OutputError, flatten, read_output_record
from embedjob.io.files import LocalStore, own_directory, write_bytes
from embedjob.io.store import Store, output_store
from embedjob.report import figures
from embedjob.report.counts import codes_text, plural
from embedjob.report.data import OutputView, ShardView, error_examples, read_output, shards_text
from embedjob.slurm import STATES, ShardStatus

DEFAULT_NAME = f"{META}/report.html"
"""Where the page goes by default, inside the output: dataset readers skip `_embedjob/`."""

SLOWEST = 5
"""Finished shards listed as the slowest (fewest rows per second)."""


# ---------------------------------------------------------------- the figures


@dataclass
class Plot:
    """One figure of the page: its file name's stem, heading, caption and PNG bytes."""

    name: str
    title: str
    caption: str
    png: bytes


CAPTIONS = {
    "throughput": "Rows written per second over each shard's last run; dotted: the end of its setup (model load, graph "
    "capture).",
    "ranks": "Each rank's rows and device use over time, what the ranks waited on, and how the graphs served.",
    "stages": "Seconds per stage and shard, summed over ranks. Left: a rank's main thread, whose stages add up. Right: "
    "the device, the decode workers, the writer and the reading thread, which run beside it.",
    "graphs": "Batches that replayed each budget's graph; per shard the share of items that replayed a graph and the "
    "share of padding in the tokens the graphs ran.",
    "errors": "Error rows per code in the committed parts of every shard.",
}


def make_plots(view: OutputView) -> list[Plot]:
    """Every figure the output's statistics allow, in page order."""
    runs = view.runs
    made = [
        ("throughput", "Throughput", CAPTIONS["throughput"], figures.throughput(runs)),
        *(
            (f"shard-{shard:05d}", f"Shard {shard}, per rank", CAPTIONS["ranks"], figures.ranks(shard, runs[shard]))
            for shard in view.rank_shards
        ),
        ("stages", "Time per stage", CAPTIONS["stages"], figures.stages(runs)),
        ("graphs", "Budgets, hit rate and padding", CAPTIONS["graphs"], figures.graphs(runs)),
        ("errors", "Errors", CAPTIONS["errors"], figures.errors(view.status.error_codes())),
    ]
    return [Plot(name, title, caption, figures.png(figure)) for name, title, caption, figure in made if figure is not None]


# ---------------------------------------------------------------- the page


@dataclass
class Report:
    """What `write_report` wrote: the page and the PNGs beside it."""

    path: Path | str
    figures: list[Path | str]
    """Local paths, or the URLs of objects where the page went into an object store."""


def write_report(output: Store | Path | str, destination: Path | None = None) -> Report:
    """Write the report of `output` to `destination` (default: DEFAULT_NAME inside
    the output, a directory or an object store), its PNGs beside it as
    `<stem>-<figure>.png`. JobError when `output` is not an embedjob output or
    `destination` is not an .html file name; OutputError when the page cannot be
    written there (exit 1, as for a run's output). JobError too, by default, when the
    output's `_embedjob` is a symbolic link: the page would land in the folder it
    points to."""
    store = output_store(output)
    local = store.path if isinstance(store, LocalStore) else None
    if destination is None and local is not None:
        destination = local / DEFAULT_NAME
    target = Path(destination) if destination is not None else Path(DEFAULT_NAME)
    if target.suffix.lower() not in (".html", ".htm"):
        raise JobError(f"--out {target}: the report is an HTML file; name it *.html")
    view = read_output(store)
    if local is not None and target.parent == local / META:
        own_directory(local / META)
    plots = make_plots(view)
    examples = error_examples(store, [s.shard for s in view.status.shards if s.errors], view.status.error_codes())
    page = render(view, plots, examples).encode()
    try:
        if destination is None:
            return _write_into(store, plots, page)
        return _write(target, plots, page)
    except OSError as exc:
        raise OutputError(f"cannot write the report to {destination}: {exc.strerror or exc}; pass --out to write it elsewhere") from None


def _write_into(store: Store, plots: list[Plot], page: bytes) -> Report:
    """The PNGs, then the page, as objects of the output's store (each written whole)."""
    stem = PurePosixPath(DEFAULT_NAME)
    written: list[Path | str] = []
    for plot in plots:
        name = str(stem.with_name(f"{stem.stem}-{plot.name}.png"))
        store.replace(name, plot.png)
        written.append(store.where(name))
    store.replace(DEFAULT_NAME, page)
    return Report(store.where(DEFAULT_NAME), written)


def _write(destination: Path, plots: list[Plot], page: bytes) -> Report:
    """The PNGs, then the page (each replaced whole: a planted link is not written through)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    written: list[Path | str] = []
    for plot in plots:
        path = destination.with_name(f"{destination.stem}-{plot.name}.png")
        write_bytes(path, plot.png)
        written.append(path)
    write_bytes(destination, page)
    return Report(destination, written)


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1280px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; vertical-align: top; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
.state-done { color: #1a7f37; } .state-failed { color: #c62828; font-weight: bold; }
.state-running, .state-pending { color: #9a6700; } .state-unfinished { color: #666; }
.notes { background: #fff8e1; border: 1px solid #f0d890; padding: 0.5em 1em; }
.warnings { background: #fdecea; border: 1px solid #e6a5a0; padding: 0.5em 1em; } .state-warned { color: #c62828; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; } pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; }
.muted { color: #666; }
"""


def render(view: OutputView, plots: list[Plot], examples: dict[str, list[tuple[str, str]]]) -> str:
    """The whole page: every section in order, figures embedded as data: URIs."""
    title = f"embedjob report: {view.output}"
    sections = [
        f"<h1>{_e(title)}</h1>",
        _overview(view),
        _warnings_html(view.status.warnings()),
        _notes_html(view.notes),
        _shard_table(view),
        _slowest(view),
        *(_figure(plot) for plot in plots if plot.name != "errors"),
        _eager(view),
        _errors(view, [p for p in plots if p.name == "errors"], examples),
        _provenance(view),
    ]
    body = "\n".join(s for s in sections if s)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_e(title)}</title>\n'
        f"<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


def _e(value: Any) -> str:
    return html.escape(str(value))


def _overview(view: OutputView) -> str:
    counts = view.status.counts()
    shards = view.status.shards
    total = sum(s.rows or 0 for s in shards)
    committed = sum(s.committed for s in shards)
    states = ", ".join(f"{counts[state]} {state}" for state in STATES if counts[state])
    made = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return (
        f"<p>{plural(view.status.num_shards, 'shard')}: {_e(states)}; {committed} of {plural(total, 'row')} "
        f"committed, {plural(sum(s.errors for s in shards), 'error row')}. States from {_e(view.status.scheduler)}, "
        f"as <code>embedjob status</code> reports them. Made {_e(made)}.</p>"
    )


def _warnings_html(warnings: list[str]) -> str:
    """Finished shards with many error rows (`counts.error_share_warning`), above all
    else: a page of done shards must not read as a success when their input was wrong."""
    if not warnings:
        return ""
    items = "".join(f"<li>{_e(warning)}</li>" for warning in warnings)
    return f'<div class="warnings" id="warnings"><b>Look at these shards</b><ul>{items}</ul></div>'


def _notes_html(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{_e(note)}</li>" for note in notes)
    return f'<div class="notes"><b>What this report cannot show</b><ul>{items}</ul></div>'


COLUMNS = (
    ("rows", "rows"),
    ("errors", "errors"),
    ("seconds", "seconds"),
    ("setup_seconds", "setup s"),
    ("rows_per_second", "rows/s"),
    ("ranks", "ranks"),
    ("runs", "runs"),
)
"""The shard table's numeric columns: (key of `ShardView.cells`, heading)."""


def _shard_table(view: OutputView) -> str:
    """One row per shard; each number's exact value in `data-value` (its text may be
    rounded), so a script can read the table back."""
    head = '<th>shard</th><th class="text">state</th>' + "".join(f"<th>{_e(h)}</th>" for _, h in COLUMNS)
    rows = []
    for v in view.shards:
        cells = v.cells()
        numbers = "".join(_number_cell(key, cells[key], _shown(key, cells[key], v)) for key, _ in COLUMNS)
        state = v.status.state
        # A done shard with many error rows is not shown as a green success.
        look = "warned" if v.status.warning() is not None else state
        rows.append(
            f'<tr data-shard="{v.shard}"><td>{v.shard}</td><td class="text state-{look}" data-key="state">{_e(state)}'
            f"{_state_detail(v.status)}</td>{numbers}</tr>"
        )
    return (
        '<h2>Shards</h2>\n<table id="shards">\n<tr>' + head + "</tr>\n" + "\n".join(rows) + "\n</table>\n"
        '<p class="muted">Done shards: their statistics (seconds and rows/s of the last run, after setup). '
        "Unfinished shards: the rows their manifest committed, over the seconds of their runs.</p>"
    )


def _number_cell(key: str, value: Any, text: str) -> str:
    exact = "" if value is None else f' data-value="{_e(value)}"'
    return f'<td data-key="{key}"{exact}>{_e(text)}</td>'


def _shown(key: str, value: Any, view: ShardView) -> str:
    if value is None:
        return "–"
    if key == "rows" and view.stats is None:
        return f"{value} of {'?' if view.status.rows is None else view.status.rows}"
    if isinstance(value, float):
        return f"{value:,.1f}" if key == "rows_per_second" else f"{value:,.2f}"
    return f"{value:,}"


def _state_detail(status: ShardStatus) -> str:
    if status.holder:
        return f'<br><span class="muted">{_e(status.holder)}</span>'
    if status.slurm_task:
        return f'<br><span class="muted">{_e(status.slurm_task)} {_e(status.slurm_state or "")}</span>'
    return ""


def _slowest(view: OutputView) -> str:
    """The finished shards with the fewest rows per second, and where their time went."""
    runs = {s: st for s, st in view.runs.items() if st.get("rows_this_run")}
    if len(runs) < 2:
        return ""
    chosen = sorted(runs, key=lambda s: (runs[s].get("items_per_second", 0.0), s))[:SLOWEST]
    rows = "".join(
        f"<tr><td>{s}</td><td>{runs[s].get('items_per_second', 0.0):,.1f}</td><td>{runs[s].get('seconds', 0.0):,.2f}</td>"
        f"<td>{runs[s].get('setup_seconds', 0.0):,.2f}</td><td class=\"text\">{_e(_main_wait(runs[s]))}</td></tr>"
        for s in chosen
    )
    return (
        "<h2>Slowest shards</h2>\n<table>\n<tr><th>shard</th><th>rows/s</th><th>seconds</th><th>setup s</th>"
        f'<th class="text">its ranks waited most on</th></tr>\n{rows}\n</table>'
    )


def _main_wait(stats: dict[str, Any]) -> str:
    waits: dict[str, float] = defaultdict(float)
    for rank in stats.get("ranks", []):
        for stage, seconds in rank.get("waits", {}).items():
            waits[stage] += seconds
    if not waits:
        return "not recorded"
    stage = max(waits, key=lambda k: waits[k])
    return f"{stage} ({waits[stage]:,.2f} s over {plural(len(stats.get('ranks', [])), 'rank')})"


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (
        f"<h2>{_e(plot.title)}</h2>\n<figure><img src=\"data:image/png;base64,{data}\" alt=\"{_e(plot.title)}\" "
        f'data-figure="{_e(plot.name)}"><figcaption>{_e(plot.caption)}</figcaption></figure>'
    )


def _eager(view: OutputView) -> str:
    """Batches that ran without a graph, per shard, and why."""
    rows = []
    for shard, stats in sorted(view.runs.items()):
        reasons = eager_reasons(stats)
        if reasons:
            rows.append(
                f"<tr><td>{shard}</td><td>{stats.get('eager_batches', 0)}</td><td>{stats.get('graph_misses', 0)}</td>"
                f'<td class="text">{_e("; ".join(reasons))}</td></tr>'
            )
    if not rows:
        text = "Every batch of the finished shards replayed a captured graph." if view.runs else ""
        return f"<h2>Eager fallbacks</h2>\n<p>{text}</p>" if text else ""
    return (
        "<h2>Eager fallbacks</h2>\n<table>\n<tr><th>shard</th><th>eager batches</th><th>items run eagerly</th>"
        '<th class="text">why</th></tr>\n' + "\n".join(rows) + "\n</table>"
    )


def eager_reasons(stats: dict[str, Any]) -> list[str]:
    """Why a shard's batches ran eagerly, from its statistics (empty: none did)."""
    eager = stats.get("eager_batches", 0)
    if "graph_backend" in stats and stats["graph_backend"] is None and eager:
        return ["graphs are off (batching.cuda_graphs: false): every batch ran eagerly at its exact size"]
    reasons = []
    capacity = stats.get("capacity_fallbacks", 0)
    if capacity:
        reasons.append(f"{plural(capacity, 'batch', 'batches')} did not fit the buffers of the budget chosen for it")
    over = eager - capacity
    if over > 0:
        largest = max(stats.get("token_budgets") or [0])
        reasons.append(
            f"{plural(over, 'batch', 'batches')} of items over the largest budget ({largest} tokens), or retried one "
            "item at a time after a batch failed"
        )
    failed = (stats.get("error_codes") or {}).get("encode_failed", 0)
    if failed:
        reasons.append(f"{plural(failed, 'item')} failed to encode even alone (encode_failed rows)")
    partial = stats.get("partial_fallbacks", 0)
    if partial:
        reasons.append(f"{plural(partial, 'item')} replayed one path's graph and ran the other path eagerly")
    return reasons


def _errors(view: OutputView, plots: list[Plot], examples: dict[str, list[tuple[str, str]]]) -> str:
    codes = view.status.error_codes()
    if not codes:
        return "<h2>Errors</h2>\n<p>No error rows in the committed parts.</p>"
    rows = []
    for code, count in codes.items():
        shown = "".join(f"<li><code>{_e(i)}</code>: {_e(m)}</li>" for i, m in examples.get(code, []))
        rows.append(
            f'<tr data-code="{_e(code)}"><td class="text"><code>{_e(code)}</code></td><td>{count}</td>'
            f'<td class="text"><ul>{shown}</ul></td></tr>'
        )
    figure = _figure(plots[0]) if plots else "<h2>Errors</h2>"
    return (
        f"{figure}\n<p>{_e(codes_text(codes))}.</p>\n<table id=\"errors\">\n<tr><th class=\"text\">code</th><th>rows</th>"
        f'<th class="text">examples (id: message)</th></tr>\n' + "\n".join(rows) + "\n</table>"
    )


def _provenance(view: OutputView) -> str:
    """The job spec the runs used and the software and devices they ran on."""
    return "<h2>Job and versions</h2>\n" + _spec(view) + "\n" + _versions(view)


def _spec(view: OutputView) -> str:
    specs = {s: st["job"] for s, st in view.runs.items() if isinstance(st.get("job"), dict)}
    if not specs:
        record = read_output_record(view.output)
        if record is None:
            return "<p>The job spec is not recorded.</p>"
        fingerprint = dict(record.fingerprint)
        if isinstance(fingerprint.get("input"), dict):
            files = fingerprint["input"].get("files") or []
            fingerprint["input"] = {**fingerprint["input"], "files": plural(len(files), "file")}
        return (
            "<p>The statistics hold no job spec; what the output's record (job.json) keeps of the job:</p>"
            f"<pre>{_e(yaml.safe_dump(fingerprint, sort_keys=False))}</pre>"
        )
    first = min(specs)
    differences = spec_differences(specs)
    listed = "".join(f"<li>{_e(d)}</li>" for d in differences)
    return (
        f"<p>The job as shard {first}'s run read it (every default filled in)"
        + (":</p>" if not differences else f"; other shards' runs differ in:</p><ul>{listed}</ul>")
        + f"<pre>{_e(yaml.safe_dump(specs[first], sort_keys=False))}</pre>"
    )


def spec_differences(specs: dict[int, dict[str, Any]]) -> list[str]:
    """`key: value (shards 0, 1); other (shard 2)` for each key on which the shards'
    job specs disagree (e.g. a runtime setting changed between runs)."""
    flat = {shard: flatten(spec) for shard, spec in specs.items()}
    keys = sorted({key for values in flat.values() for key in values})
    lines = []
    for key in keys:
        by_value: dict[str, list[int]] = defaultdict(list)
        for shard in sorted(flat):
            by_value[json.dumps(flat[shard].get(key))].append(shard)
        if len(by_value) > 1:
            lines.append(f"{key}: " + "; ".join(f"{v} (shards {shards_text(s)})" for v, s in by_value.items()))
    return lines


def _versions(view: OutputView) -> str:
    """Each library's version, and the devices, with the shards that used them when
    the shards disagree."""
    seen: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for shard, stats in sorted(view.runs.items()):
        for name, version in (stats.get("versions") or {}).items():
            seen[name][str(version)].append(shard)
        devices = sorted({r.get("device_name") or r.get("device", "?") for r in stats.get("ranks", [])})
        if devices:
            seen["devices"][", ".join(devices)].append(shard)
    if not seen:
        return "<p>No versions recorded.</p>"
    rows = []
    for name, values in seen.items():
        text = "; ".join(v if len(values) == 1 else f"{v} (shards {shards_text(s)})" for v, s in values.items())
        rows.append(f'<tr><th class="text">{_e(name)}</th><td class="text">{_e(text)}</td></tr>')
    return '<table id="versions">\n' + "\n".join(rows) + "\n</table>"
