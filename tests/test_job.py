"""The job spec: defaults, overrides and the messages a user sees for a bad spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedjob.config import JobError, describe, job_from_dict, load_job

MINIMAL = {
    "input": {"path": "data/*.parquet", "media_column": "image"},
    "model": {"path": "builtin:tiny-qwen2_5_vl"},
    "output": {"path": "out"},
}


def test_defaults_follow_the_design_contract() -> None:
    job = job_from_dict(MINIMAL)
    assert job.model.family == "qwen2_5_vl"
    assert job.input.modality == "image"
    assert job.batching.token_budgets == "auto"
    assert job.batching.cuda_graphs is True
    assert (job.output.pooling, job.output.dtype) == ("mean", "float16")
    assert job.runtime.device == "auto"


def test_overrides_parse_yaml_values() -> None:
    job = job_from_dict(
        MINIMAL,
        ["batching.token_budgets=[64, 256]", "video.fps=1", "output.path=elsewhere", "batching.cuda_graphs=false"],
    )
    assert job.batching.token_budgets == [64, 256]
    assert job.video.fps == 1.0 and isinstance(job.video.fps, float)
    assert job.output.path == "elsewhere"
    assert job.batching.cuda_graphs is False


def test_override_can_supply_a_missing_required_key() -> None:
    job = job_from_dict({"input": {"path": "x.parquet"}}, ["input.media_column=jpg", "output.path=o", "model.path=m"])
    assert job.input.media_column == "jpg"


@pytest.mark.parametrize(
    ("raw", "overrides", "expected"),
    [
        ({**MINIMAL, "inptu": {}}, [], "unknown key 'inptu' at the top level; allowed: input, model"),
        ({**MINIMAL, "output": {"path": "o", "pool": "mean"}}, [], "unknown key 'output.pool'"),
        (MINIMAL, ["output.pooling=max"], "key 'output.pooling' = 'max' is not allowed; expected 'mean' | 'none'"),
        (MINIMAL, ["batching.window=many"], "key 'batching.window' = 'many' is not allowed; expected an integer"),
        (MINIMAL, ["batching.token_budgets=[64, x]"], "key 'batching.token_budgets'"),
        ({**MINIMAL, "input": {"path": "p"}}, [], "input.media_column is required"),
        ({**MINIMAL, "input": {"media_column": "c"}}, [], "input.path is required"),
        (MINIMAL, ["video.fps=0"], "key 'video.fps' = 0 is not allowed; expected a finite number > 0"),
        (MINIMAL, ["batching.token_budgets=[]"], "expected 'auto' or at least one budget"),
        (MINIMAL, ["runtime.workers=-1"], "'runtime.workers' = -1 is not allowed; expected 'auto' or an integer >= 0"),
        (MINIMAL, ["preprocess.min_pixels=100", "preprocess.max_pixels=10"], "lower min_pixels or raise max_pixels"),
        (MINIMAL, ["outputpath=x"], "--set key must be section.key"),
        (MINIMAL, ["output.path"], "--set expects key.sub=value"),
        ({**MINIMAL, "model": "qwen"}, [], "'model' must be a mapping"),
    ],
)
def test_bad_specs_name_the_key_and_what_is_allowed(raw: dict, overrides: list[str], expected: str) -> None:
    with pytest.raises(JobError) as info:
        job_from_dict(raw, overrides)
    assert expected in str(info.value)


def test_bool_is_not_accepted_as_an_integer() -> None:
    with pytest.raises(JobError, match="batching.window"):
        job_from_dict(MINIMAL, ["batching.window=true"])


def test_load_job_reports_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(JobError, match="must be a mapping of sections"):
        load_job(listy)


def test_every_shipped_job_file_is_valid() -> None:
    jobs = sorted(Path(__file__).parent.parent.joinpath("jobs").glob("*.yaml"))
    assert jobs, "jobs/ should ship at least the demo job"
    for path in jobs:
        load_job(path)


def test_describe_lists_every_key_with_its_default() -> None:
    text = describe()
    assert "output.pooling: 'mean' | 'none' (default: 'mean')" in text
    assert "batching.token_budgets: 'auto' or a list of an integer >= 1 (default: 'auto')" in text
