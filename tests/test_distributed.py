"""Data parallel on CPU ranks (gloo): the load balance, output equal to the
single-process run row for row, and a dying rank that stops the job with a clear line.

Ranks are spawned processes; the inputs are kept small because CI has two cores.
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from embedjob.cli import main
from embedjob.distributed import (
    FAULT_ENV,
    FAULT_EXIT_CODE,
    Layout,
    PackedItems,
    assign_items,
    pack_items,
    resolve_layout,
    share_loads,
)
from embedjob.encoders import EncoderInput
from embedjob.job import JobError

from conftest import REPO

DEMO = str(REPO / "jobs" / "demo.yaml")
DEMO_PARQUET = REPO / "jobs" / "data" / "demo-images.parquet"

sizes_strategy = st.lists(st.integers(min_value=0, max_value=10_000), max_size=60)
ranks_strategy = st.integers(min_value=1, max_value=8)


# --- the assignment -----------------------------------------------------------------


@given(sizes_strategy, ranks_strategy)
def test_every_item_goes_to_exactly_one_rank_in_window_order(sizes: list[int], ranks: int) -> None:
    shares = assign_items(sizes, ranks)
    assert len(shares) == ranks
    assert sorted(itertools.chain.from_iterable(shares)) == list(range(len(sizes)))
    assert all(share == sorted(share) for share in shares)


@given(sizes_strategy, ranks_strategy)
def test_largest_load_is_within_one_item_of_the_mean(sizes: list[int], ranks: int) -> None:
    loads = share_loads(sizes, assign_items(sizes, ranks))
    largest = max(sizes, default=0)
    assert max(loads) <= sum(loads) / ranks + (1 - 1 / ranks) * largest + 1e-9


@settings(max_examples=60)
@given(st.lists(st.integers(min_value=1, max_value=100), max_size=7), st.integers(min_value=1, max_value=3))
def test_largest_load_is_within_grahams_bound_of_the_best_split(sizes: list[int], ranks: int) -> None:
    splits = itertools.product(range(ranks), repeat=len(sizes))
    best = min((max(share_loads(sizes, _shares(choice, ranks))) for choice in splits), default=0)
    assert max(share_loads(sizes, assign_items(sizes, ranks))) <= (4 / 3 - 1 / (3 * ranks)) * best + 1e-9


def _shares(choice: tuple[int, ...], ranks: int) -> list[list[int]]:
    return [[i for i, rank in enumerate(choice) if rank == r] for r in range(ranks)]


@given(st.integers(min_value=1, max_value=50), st.integers(min_value=1, max_value=100), ranks_strategy)
def test_equal_items_are_dealt_evenly(count: int, size: int, ranks: int) -> None:
    counts = [len(share) for share in assign_items([size] * count, ranks)]
    assert max(counts) - min(counts) <= 1


def test_largest_first_to_the_least_loaded_rank_with_ties_to_the_lower_rank() -> None:
    # 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 3 -> r0 (9 < 12), 1 -> r0 (12 = 12: lower rank)
    assert assign_items([5, 9, 3, 7, 1], 2) == [[1, 2, 4], [0, 3]]
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        assign_items([1], 0)


# --- whole runs ---------------------------------------------------------------------


def _photos() -> list[Image.Image]:
    """The demo's readable photos."""
    photos = []
    for value in pq.read_table(DEMO_PARQUET).column("image").to_pylist():
        try:
            photos.append(Image.open(io.BytesIO(value)).convert("RGB"))
        except OSError:
            continue
    return photos


def _jpeg(image: Image.Image, long_side: int) -> bytes:
    scale = long_side / max(image.size)
    resized = image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))), Image.BICUBIC)
    buffer = io.BytesIO()
    resized.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 huge photos (936-960 patches each under the tiny model's pixel cap) on every
    other row at the start, where a round-robin split would put them all on one rank,
    and 30 small ones (16-48 patches)."""
    photos = _photos()
    huge = [_jpeg(photos[i % len(photos)], 1400 - 100 * i) for i in range(6)]
    small = [_jpeg(photos[i % len(photos)], 40 + 2 * i) for i in range(30)]
    rows = list(itertools.chain.from_iterable(zip(huge, small[:6]))) + small[6:]
    path = tmp_path_factory.mktemp("skewed") / "skewed.parquet"
    table = pa.table({"id": [f"item-{i}" for i in range(len(rows))], "image": pa.array(rows, type=pa.binary())})
    pq.write_table(table, path)
    return path


def _run(job_input: Path | None, out: Path, cache_dir: str, *extra: str) -> int:
    """The demo job in windows of 4 items (several windows, some with a rank left idle),
    or the skewed input in one window: a window is the unit that is balanced."""
    args = ["run", DEMO, "--set", f"output.path={out}", "--set", f"runtime.cache_dir={cache_dir}",
            "--set", "runtime.workers=0", "--set", "runtime.progress=false", "--set", "output.dtype=float32"]
    if job_input is None:
        args += ["--set", "batching.window=4"]
    else:
        args += ["--set", f"input.path={job_input}", "--set", "output.rows_per_part=16"]
    return main([*args, *extra])


def _read(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


def _stats(out: Path) -> dict:
    return json.loads((out / "stats-00000.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cache_dir: str, skewed: Path) -> dict[str, Path]:
    """The single-process output of each input, the reference of every data-parallel run."""
    outs = {}
    for name, job_input in (("demo", None), ("skewed", skewed)):
        outs[name] = tmp_path_factory.mktemp(f"single-{name}")
        assert _run(job_input, outs[name], cache_dir) == 0
    return outs


def _assert_same_output(out: Path, reference: Path) -> None:
    """Same parts, rows, ids, errors; embeddings equal to float32 rounding."""
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p.name for p in reference.glob("part-*"))
    manifest = json.loads((out / "manifest-00000.json").read_text())
    expected = json.loads((reference / "manifest-00000.json").read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [
        (p["first_row"], p["end_row"]) for p in expected["parts"]
    ]
    for got, want in zip(_read(out), _read(reference), strict=True):
        a, b = (np.array(r.pop("embedding"), dtype=np.float32) for r in (got, want))
        assert got == want
        if want["error"] is None:
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6), (want["row"], float(np.abs(a - b).max()))


@pytest.mark.parametrize(("name", "ranks"), [("demo", 2), ("demo", 3), ("skewed", 2), ("skewed", 3)])
def test_ranks_give_the_single_process_output_row_for_row(
    name: str, ranks: int, single: dict[str, Path], skewed: Path, tmp_path: Path, cache_dir: str, capsys
) -> None:
    job_input = skewed if name == "skewed" else None
    assert _run(job_input, tmp_path, cache_dir, "--gpus", str(ranks)) == 0
    _assert_same_output(tmp_path, single[name])
    stats, reference = _stats(tmp_path), _stats(single[name])
    assert (stats["rows"], stats["errors"]) == (reference["rows"], reference["errors"])
    assert stats["world_size"] == ranks and [r["rank"] for r in stats["ranks"]] == list(range(ranks))
    encoded = reference["graph_hits"] + reference["graph_misses"]
    assert stats["graph_hits"] + stats["graph_misses"] == encoded == sum(r["items"] for r in stats["ranks"])
    assert all(r["items"] > 0 and r["busy_seconds"] > 0 for r in stats["ranks"])
    # Where a slow run spends its time: rank 0 sends windows and waits for results, the others the other way round.
    assert {"joining the group", "sending windows", "receiving results", "waiting for results"} <= set(stats["ranks"][0]["exchange_seconds"])
    assert all({"waiting for a window", "receiving windows", "sending results"} <= set(r["exchange_seconds"]) for r in stats["ranks"][1:])
    printed = re.search(r"(\d+) ranks, balance ratio ([\d.]+)", capsys.readouterr().err)
    assert printed and int(printed[1]) == ranks and float(printed[2]) == pytest.approx(stats["balance_ratio"], abs=1e-3)
    if name == "skewed":
        assert stats["balance_ratio"] < 1.2, stats["ranks"]


def test_a_dying_rank_stops_the_job_with_one_line_and_a_rerun_resumes(
    single: dict[str, Path], tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:4")  # rank 1 exits on receiving window 4 (rows 8-9)
    start = time.monotonic()
    assert _run(None, tmp_path, cache_dir, "--gpus", "2", "--set", "batching.window=2") == 1
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("embedjob: failed: RankFailure: rank 1 of 2 ")
    assert f"exited with code {FAULT_EXIT_CODE}" in err and "rerun" in err
    manifest = json.loads((tmp_path / "manifest-00000.json").read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [(0, 5)]
    assert not (tmp_path / "_SUCCESS-00000").exists()

    monkeypatch.delenv(FAULT_ENV)
    assert _run(None, tmp_path, cache_dir, "--gpus", "2", "--set", "batching.window=2") == 0
    assert _stats(tmp_path)["resumed_from_row"] == 5
    _assert_same_output(tmp_path, single["demo"])


def test_gpus_beyond_the_visible_ones_or_torchruns_processes_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_layout("auto", torch.device("cuda")) == Layout(2, 0, torch.device("cuda", 0))
    with pytest.raises(JobError, match="runtime.gpus = 4 but only 2 CUDA devices are visible"):
        resolve_layout(4, torch.device("cuda"))
    assert resolve_layout("auto", torch.device("cpu")).world_size == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_layout("auto", torch.device("cuda")) == Layout(4, 3, torch.device("cuda", 1), launched=True)
    with pytest.raises(JobError, match="torchrun started 4 processes"):
        resolve_layout(2, torch.device("cuda"))


def test_items_cross_to_another_rank_unchanged() -> None:
    items = [
        EncoderInput(
            {"pixels": torch.randn(5, 7), "grid": torch.tensor([[1, 2, 3]]), "mask": torch.tensor([True, False, True])},
            tokens=3, frames=0, size=35,
        ),
        EncoderInput(
            {"pixels": torch.arange(24, dtype=torch.float16).reshape(4, 6).t(), "empty": torch.empty(0, 3)},
            tokens=2, frames=4, size=24, modality="video",
        ),
    ]
    packed = pack_items(items)
    shells, layouts, nbytes = pickle.loads(pickle.dumps(packed.header()))
    received = PackedItems(shells, layouts, packed.data.clone()).items()
    assert nbytes == packed.data.numel()
    for got, sent in zip(received, items, strict=True):
        assert (got.tokens, got.frames, got.size, got.modality) == (sent.tokens, sent.frames, sent.size, sent.modality)
        assert got.tensors.keys() == sent.tensors.keys()
        for key, tensor in sent.tensors.items():
            assert got.tensors[key].dtype == tensor.dtype and torch.equal(got.tensors[key], tensor), key
