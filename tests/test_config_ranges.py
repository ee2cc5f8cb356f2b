"""Numeric job keys: each declares its allowed range once, `inspect` and
docs/configuration.md show it, and a value outside it (NaN, an infinity, a negative, zero where a count is needed,
a bool for an integer, a string for a number) or a pair of keys out of order stops the
job with one line and exit 2 before the output directory exists."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Union

import pytest
import yaml
from conftest import REPO

from embedjob.cli import main
from embedjob.config import Job, JobError, Range, job_from_dict, keys, reference_markdown

REFERENCE = REPO / "docs" / "configuration.md"
DEMO = yaml.safe_load((REPO / "jobs" / "demo.yaml").read_text())
MINIMAL = {
    "input": {"path": "data/*.parquet", "media_column": "image"},
    "model": {"path": "builtin:tiny-qwen2_5_vl"},
    "output": {"path": "out"},
}
NAN, INF = float("nan"), float("inf")

POSITIVE_NUMBER = "a finite number > 0"
PIXELS = "an integer >= 1 or null"
BAD_VALUES = [
    ("video.fps", NAN, POSITIVE_NUMBER),
    ("video.fps", INF, POSITIVE_NUMBER),
    ("video.fps", 0, POSITIVE_NUMBER),
    ("video.fps", "2", POSITIVE_NUMBER),
    ("video.fps", True, POSITIVE_NUMBER),
    pytest.param("video.fps", 10**400, POSITIVE_NUMBER, id="video.fps-beyond-any-float"),
    ("runtime.decode_timeout", NAN, POSITIVE_NUMBER),
    ("runtime.decode_timeout", INF, POSITIVE_NUMBER),
    ("runtime.decode_timeout", -INF, POSITIVE_NUMBER),
    ("runtime.decode_timeout", -1.5, POSITIVE_NUMBER),
    ("preprocess.max_pixels", -100, PIXELS),
    ("preprocess.min_pixels", -5, PIXELS),
    ("preprocess.min_pixels", 0, PIXELS),
    ("video.max_pixels", 2.5, PIXELS),
    ("batching.window", True, "an integer >= 1"),
    ("batching.token_budgets", [64, 0], "'auto' or a list of an integer >= 1"),
    ("batching.token_budgets", [64, INF], "'auto' or a list of an integer >= 1"),
    ("batching.max_items_per_batch", 0, "'auto' or an integer >= 1"),
    ("batching.max_frames_per_batch", -1, "'auto' or an integer >= 0"),
    ("batching.min_budget", -64, "an integer >= 1 or null"),
    ("runtime.max_error_rate", NAN, "a finite number >= 0 and < 1 or null"),
    ("runtime.max_error_rate", 1, "a finite number >= 0 and < 1 or null"),
    ("runtime.max_error_rate", -0.1, "a finite number >= 0 and < 1 or null"),
    ("runtime.workers", -1, "'auto' or an integer >= 0"),
    ("runtime.gpus", 0, "'auto' or an integer >= 1"),
    ("input.batch_rows", "256", "an integer >= 1"),
    ("output.rows_per_part", -5, "an integer >= 1"),
]
PAIRS = [
    (["video.min_pixels=5000", "video.max_pixels=4000"], "video.min_pixels = 5000 is larger than video.max_pixels = 4000"),
    (["batching.min_budget=512", "batching.max_budget=64"], "batching.min_budget = 512 is larger than batching.max_budget = 64"),
    (
        ["batching.token_budgets=[256, 64]", "batching.max_items_per_batch=100"],
        "batching.max_items_per_batch = 100 is larger than the smallest of batching.token_budgets, 64",
    ),
    (
        ["batching.max_budget=64", "batching.max_items_per_batch=100"],
        "batching.max_items_per_batch = 100 is larger than batching.max_budget = 64",
    ),
]


def with_value(raw: dict, name: str, value: Any) -> dict:
    section, key = name.split(".")
    return {**raw, section: {**raw.get(section, {}), key: value}}


def demo_job(tmp_path: Path, name: str | None = None, value: Any = None) -> tuple[Path, Path]:
    """The demo job, runnable as it is, written as YAML with `name` set to `value`
    (NaN and the infinities as YAML's .nan and .inf); its output path under tmp_path."""
    out = tmp_path / "out"
    raw = with_value(DEMO, "input.path", str(REPO / DEMO["input"]["path"]))
    raw = with_value(raw, "output.path", str(out))
    if name is not None:
        raw = with_value(raw, name, value)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    return job, out


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedjob: error: "), err
    return lines[0]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_a_value_out_of_range_is_one_line_naming_key_and_range(name: str, value: Any, allowed: str) -> None:
    with pytest.raises(JobError) as info:
        job_from_dict(with_value(MINIMAL, name, value))
    assert str(info.value) == f"key '{name}' = {value!r} is not allowed; expected {allowed}"


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_VALUES)
def test_run_with_a_value_out_of_range_writes_nothing(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, name: str, value: Any, allowed: str
) -> None:
    job, out = demo_job(tmp_path, name, value)
    assert main(["run", str(job), "--set", f"runtime.cache_dir={cache_dir}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"key '{name}' = {value!r} is not allowed; expected {allowed}" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("override", "value"), [("video.fps=.nan", "nan"), ("runtime.decode_timeout=.inf", "inf"), ("video.fps=-.inf", "-inf")]
)
def test_set_with_yaml_nan_or_inf_is_refused(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, override: str, value: str
) -> None:
    job, out = demo_job(tmp_path)
    assert main(["run", str(job), "--set", f"runtime.cache_dir={cache_dir}", "--set", override]) == 2
    name = override.split("=")[0]
    assert f"key '{name}' = {value} is not allowed; expected {POSITIVE_NUMBER}" in one_error_line(capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize(("overrides", "message"), PAIRS)
def test_run_with_a_pair_out_of_order_writes_nothing(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture, overrides: list[str], message: str
) -> None:
    job, out = demo_job(tmp_path)
    sets = [arg for item in overrides for arg in ("--set", item)]
    assert main(["run", str(job), "--set", f"runtime.cache_dir={cache_dir}", *sets]) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_every_problem_is_named_in_one_error(tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture) -> None:
    job, out = demo_job(tmp_path, "video.fps", NAN)
    sets = ["runtime.decode_timeout=.inf", "preprocess.min_pixels=900", "preprocess.max_pixels=800",
            "batching.min_budget=512", "batching.max_budget=64"]
    args = [arg for item in sets for arg in ("--set", item)]
    assert main(["run", str(job), "--set", f"runtime.cache_dir={cache_dir}", *args]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "4 problems in the job spec" in line
    for problem in ("'video.fps' = nan", "'runtime.decode_timeout' = inf", "preprocess.min_pixels = 900 is larger",
                    "batching.min_budget = 512 is larger"):
        assert problem in line, problem
    assert not out.exists()


def numeric_keys() -> list[tuple[str, Any, dataclasses.Field]]:
    """(section.key, type hint, field) of every key whose values are or hold numbers."""
    found = []
    for section in dataclasses.fields(Job):
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if numbers_in(hints[f.name]):
                found.append((f"{section.name}.{f.name}", hints[f.name], f))
    return found


def numbers_in(hint: Any) -> set[type]:
    """The number types (int, float; bool is none) a hint admits, in unions and lists."""
    if typing.get_origin(hint) in (Union, types.UnionType, list):
        return set().union(*(numbers_in(arm) for arm in typing.get_args(hint)))
    return {hint} & {int, float}


def test_every_numeric_key_declares_its_range() -> None:
    """A key added without a range would take NaN, infinities and negatives unchecked."""
    numeric = numeric_keys()
    assert len(numeric) >= 20
    for name, _, f in numeric:
        assert isinstance(f.metadata.get("range"), Range), f"{name} declares no range: key(..., within=Range(...))"


def edge_values(hint: Any, within: Range) -> tuple[list[Any], Any]:
    """Values just outside `within` (NaN and infinities included) and its least value."""
    number = float if float in numbers_in(hint) else int
    step = 0.5 if number is float else 1
    least = number(within.low + step if within.low_open else within.low)
    outside = [NAN, INF, -INF, True, str(least), number(within.low if within.low_open else within.low - step)]
    if within.high is not None:
        outside.append(number(within.high if within.high_open else within.high + step))
    if list in {typing.get_origin(arm) for arm in (hint, *typing.get_args(hint))}:  # a list key: one item
        return [[v] for v in outside], [least]
    return outside, least


@pytest.mark.parametrize(("name", "hint", "f"), numeric_keys(), ids=[n for n, _, _ in numeric_keys()])
def test_validation_follows_each_declared_range(name: str, hint: Any, f: dataclasses.Field) -> None:
    outside, least = edge_values(hint, f.metadata["range"])
    job = job_from_dict(with_value(MINIMAL, name, least))
    section, key = name.split(".")
    assert getattr(getattr(job, section), key) == least
    for value in outside:
        with pytest.raises(JobError, match=f"key '{name}' = .* is not allowed; expected .*{f.metadata['range']}"):
            job_from_dict(with_value(MINIMAL, name, value))


def test_inspect_and_the_configuration_page_show_each_range(capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect"]) == 0
    listed = capsys.readouterr().out
    assert "video.fps: a finite number > 0 (default: 2.0)" in listed
    assert "runtime.decode_timeout: a finite number > 0 (default: 60.0)" in listed
    assert "preprocess.min_pixels: an integer >= 1 or null (default: None)" in listed
    assert "batching.token_budgets: 'auto' or a list of an integer >= 1 (default: 'auto')" in listed
    assert "runtime.max_error_rate: a finite number >= 0 and < 1 or null (default: 0.5)" in listed
    rows = {name: allowed for name, allowed, _, _ in keys()}
    for name, _, f in numeric_keys():
        assert str(f.metadata["range"]) in rows[name] and f"{name}: {rows[name]} (default: " in listed, name
        assert f"| `{name}` | {rows[name]} |" in REFERENCE.read_text().replace("\\|", "|"), f"the page's allowed values of {name}"


def test_the_configuration_page_is_the_one_the_spec_generates(capsys: pytest.CaptureFixture) -> None:
    """docs/configuration.md is what `embedjob inspect --markdown` prints: a key added,
    removed or redescribed in the spec fails here until the page is generated again."""
    assert main(["inspect", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == reference_markdown()
    assert REFERENCE.read_text() == printed, "docs/configuration.md is stale: embedjob inspect --markdown > docs/configuration.md"
    for section in ("input", "model", "preprocess", "video", "batching", "output", "runtime"):
        assert f"\n## {section}\n" in printed
    assert "| `output.path` | a string | required |" in printed and "| `runtime.cache_dir` | a string or null | `null` |" in printed

