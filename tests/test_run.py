"""`embedjob run` end to end on the CPU: the demo job, its output contract, and the
failures a user must see as one clear line."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from embedjob.cli import main
from embedjob.io.checkpoint import output_files

DEMO = str(REPO / "jobs" / "demo.yaml")


def run(out: Path, cache_dir: str, *extra: str) -> int:
    return main(["run", DEMO, "--set", f"output.path={out}", "--set", f"runtime.cache_dir={cache_dir}", *extra])


def read(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert run(out, cache_dir, "--set", "runtime.workers=2") == 0
    return out


@pytest.mark.slow
def test_demo_writes_every_row_in_order_with_errors_for_broken_media(demo_out: Path) -> None:
    rows = read(demo_out)
    assert [r["row"] for r in rows] == list(range(12))
    assert rows[0]["id"] == "img2dataset_123_456" and rows[11]["id"] == "text_not_an_image"
    good = [r for r in rows if r["error"] is None]
    assert len(good) == 10
    for r in good:
        vector = np.array(r["embedding"], dtype=np.float32)
        assert vector.shape == (128,) and np.isfinite(vector).all() and np.abs(vector).sum() > 0
        assert r["modality"] == "image" and r["tokens"] > 0 and r["frames"] == 0
    assert rows[10]["error"].startswith("truncated: ")
    assert rows[11]["error"].startswith("unknown_format: ")
    assert all(r["embedding"] is None for r in rows[10:])


def test_demo_parts_manifest_stats_and_success_marker(demo_out: Path) -> None:
    parts = sorted(p.name for p in demo_out.glob("part-*.parquet"))
    assert parts == ["part-00000-00000.parquet", "part-00000-00001.parquet", "part-00000-00002.parquet"]
    assert (demo_out / "_embedjob/_SUCCESS-00000").exists()
    assert not [p for p in output_files(demo_out) if ".tmp-" in p.name]
    manifest = json.loads((demo_out / "_embedjob/manifest-00000.json").read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [(0, 5), (5, 10), (10, 12)]
    stats = json.loads((demo_out / "_embedjob/stats-00000.json").read_text())
    for key in ("rows", "errors", "graph_hits", "graph_misses", "hit_rate", "num_graphs", "token_budgets",
                "padding_waste", "seconds", "items_per_second"):
        assert key in stats, key
    assert (stats["rows"], stats["errors"]) == (12, 2)
    assert stats["graph_hits"] + stats["graph_misses"] == 10


def test_workers_and_inline_decoding_give_identical_output(demo_out: Path, tmp_path: Path, cache_dir: str) -> None:
    assert run(tmp_path, cache_dir, "--set", "runtime.workers=0") == 0
    for a, b in zip(read(tmp_path), read(demo_out), strict=True):
        ea, eb = (np.array(r.pop("embedding"), dtype=np.float32) for r in (a, b))
        assert a == b and np.array_equal(ea, eb, equal_nan=True)


def test_setup_runs_without_collections_and_the_run_keeps_setups_heap_from_the_collector(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load and capture run with the collector paused, the load's objects frozen
    before the collector resumes between them; while rows are encoded the objects of
    setup are frozen, so no collection of the oldest generation walks them between two
    graph launches; after the run the collector is on and has them all back, so a
    process that runs job after job (a loop over shards) still frees what they leave."""
    from embedjob.pipeline import RankPipeline

    seen: dict[str, object] = {}
    prepare, encode = RankPipeline._prepare, RankPipeline._pipeline

    def preparing(self):
        seen["collecting during setup"] = gc.isenabled()
        return prepare(self)

    def encoding(self, *args, **kwargs):
        seen["frozen while encoding"] = gc.get_freeze_count()
        return encode(self, *args, **kwargs)

    def capturing(self, *args, **kwargs):
        seen["collecting during capture"] = gc.isenabled()
        seen["frozen before capture"] = gc.get_freeze_count()
        return capture(self, *args, **kwargs)

    capture = RankPipeline._start_decoding_while_capturing
    monkeypatch.setattr(RankPipeline, "_start_decoding_while_capturing", capturing)
    monkeypatch.setattr(RankPipeline, "_prepare", preparing)
    monkeypatch.setattr(RankPipeline, "_pipeline", encoding)
    before = gc.get_freeze_count()
    assert run(tmp_path / "out", cache_dir) == 0
    assert seen["collecting during setup"] is False and seen["collecting during capture"] is False
    assert seen["frozen before capture"] > before + 10_000  # the load's objects: no young collection walks them
    assert seen["frozen while encoding"] > before + 10_000
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert len(read(tmp_path / "out")) == 12


def test_a_run_whose_capture_fails_leaves_the_collector_as_it_was(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A capture that fails (out of memory, say) after the load froze its objects: the
    job fails with its error and the process's heap is not left frozen."""
    from embedjob.pipeline import RankPipeline

    def failing(self, rows):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(RankPipeline, "_start_decoding_while_capturing", failing)
    assert run(tmp_path / "out", cache_dir) != 0
    assert "capture failed" in capsys.readouterr().err
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_rerun_of_a_finished_shard_does_nothing(demo_out: Path, cache_dir: str, capsys: pytest.CaptureFixture) -> None:
    before = {p: (demo_out / p).stat().st_mtime_ns for p in output_files(demo_out)}
    assert run(demo_out, cache_dir) == 0
    assert "already complete" in capsys.readouterr().err
    assert {p: (demo_out / p).stat().st_mtime_ns for p in output_files(demo_out)} == before


def test_changed_job_refuses_to_resume_unless_overwrite(demo_out: Path, tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "o"
    assert run(out, cache_dir, "--set", "runtime.workers=0") == 0
    assert run(out, cache_dir, "--set", "output.pooling=none") == 2
    err = capsys.readouterr().err
    assert "different job" in err and "pooling" in err and "--overwrite" in err
    assert run(out, cache_dir, "--set", "output.pooling=none", "--set", "runtime.workers=0", "--overwrite") == 0
    rows = read(out)
    assert len(rows) == 12
    first = rows[0]
    assert len(first["embedding"]) == first["tokens"] and len(first["embedding"][0]) == 128
    assert rows[10]["embedding"] is None


def test_eager_float32_output_matches_graph_output(demo_out: Path, tmp_path: Path, cache_dir: str) -> None:
    assert run(tmp_path, cache_dir, "--set", "batching.cuda_graphs=false", "--set", "output.dtype=float32",
               "--set", "runtime.workers=0") == 0
    stats = json.loads((tmp_path / "_embedjob/stats-00000.json").read_text())
    assert stats["graph_hits"] == 0 and stats["graph_misses"] == 10
    eager = read(tmp_path)
    for a, b in zip(eager, read(demo_out)):
        if a["error"] is None:
            x, y = np.array(a["embedding"]), np.array(b["embedding"], dtype=np.float32)
            assert np.allclose(x, y, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--set", "output.pooling=max"], "key 'output.pooling' = 'max' is not allowed"),
        (["--set", "input.path=/nonexistent/*.parquet"], "/nonexistent/*.parquet"),
        (["--set", "input.media_column=jpg"], "jpg"),
        (["--set", "batching.token_budgets=[16, 32]", "--set", "batching.max_items_per_batch=64"], "max_items"),
        (["--shard", "3/2"], "--shard 3/2"),
    ],
)
def test_bad_jobs_stop_before_any_output_with_one_line(tmp_path: Path, cache_dir: str, capsys, overrides, message) -> None:
    out = tmp_path / "never"
    assert run(out, cache_dir, *overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("embedjob: error: ") and message in err and "\n" not in err
    assert not list(out.glob("part-*")) if out.exists() else True


def test_an_empty_shard_finishes_without_loading_the_model(tmp_path: Path, cache_dir: str, monkeypatch) -> None:
    """Under SLURM an empty array task must not hold a GPU to load a model for nothing."""
    import embedjob.pipeline

    def no_model(*args, **kwargs):
        raise AssertionError("an empty shard loaded the model")

    monkeypatch.setattr(embedjob.pipeline, "load_encoder_adapter", no_model)
    assert run(tmp_path, cache_dir, "--shard", "3/4") == 0
    stats = json.loads((tmp_path / "_embedjob/stats-00003.json").read_text())
    assert (stats["rows"], stats["errors"], stats["graph_hits"]) == (0, 0, 0)
    assert (tmp_path / "_embedjob/_SUCCESS-00003").exists() and not list(tmp_path.glob("part-00003-*"))


def test_a_partial_slurm_array_must_name_its_shard(monkeypatch) -> None:
    from embedjob.config import JobError
    from embedjob.slurm import Shard

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MAX", "3")
    with pytest.raises(JobError, match="pass --shard I/N"):
        Shard.parse(None)
    assert Shard.parse("1/4") == Shard(1, 4)


def test_window_sizes_ramp_up_to_the_window() -> None:
    from embedjob.pipeline import window_sizes

    def first(window: int, count: int = 6) -> list[int]:
        sizes = window_sizes(window)
        return [next(sizes) for _ in range(count)]

    assert first(256) == [32, 64, 128, 256, 256, 256]
    assert first(100) == [32, 64, 100, 100, 100, 100]
    assert first(32) == [32] * 6 and first(4) == [4] * 6


@pytest.mark.slow
def test_the_first_windows_are_smaller_and_the_output_does_not_change(tmp_path: Path, cache_dir: str, monkeypatch) -> None:
    """The device starts after 32 decoded rows instead of a whole window; which rows
    share a window must not change any output row."""
    import pyarrow as pa

    import embedjob.pipeline

    demo = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet")
    rows = pa.concat_tables([demo] * 6).slice(0, 72)
    parquet = tmp_path / "rows.parquet"
    pq.write_table(rows, parquet)
    seen: dict[int, list[int]] = {64: [], 8: []}
    enqueue = embedjob.pipeline.WindowEncoder.enqueue
    outputs = {}
    for window in (64, 8):

        def record(self, rows, window=window):
            seen[window].append(len(rows))
            return enqueue(self, rows)

        monkeypatch.setattr(embedjob.pipeline.WindowEncoder, "enqueue", record)
        out = tmp_path / f"w{window}"
        sets = [f"input.path={parquet}", f"batching.window={window}", "runtime.workers=1"]
        assert run(out, cache_dir, *[a for s in sets for a in ("--set", s)]) == 0
        outputs[window] = read(out)
    # At most the ramp's sizes (shorter where decoding stalled), every row once.
    assert seen[64][0] <= 32 and max(seen[64]) <= 64 and max(seen[8]) <= 8
    assert sum(seen[64]) == sum(seen[8]) == 72
    assert len(outputs[64]) == len(outputs[8]) == 72
    for a, b in zip(outputs[64], outputs[8]):
        assert {k: v for k, v in a.items() if k != "embedding"} == {k: v for k, v in b.items() if k != "embedding"}
        assert np.array_equal(np.array(a["embedding"], dtype=np.float32), np.array(b["embedding"], dtype=np.float32), equal_nan=True)


def test_a_process_feeding_a_gpu_uses_a_few_cpu_threads_and_gets_its_setting_back() -> None:
    """Decode workers take every core; a GPU feeder with one spinning OpenMP thread per
    core slowed two-GPU runs by 9 %. A CPU run keeps every thread for its encoder."""
    import torch

    from embedjob.host import HOST_THREADS, host_threads

    before = torch.get_num_threads()
    torch.set_num_threads(HOST_THREADS + 2)
    try:
        with host_threads(torch.device("cuda", 0)):
            assert torch.get_num_threads() == HOST_THREADS
        assert torch.get_num_threads() == HOST_THREADS + 2
        with host_threads(torch.device("cpu")):
            assert torch.get_num_threads() == HOST_THREADS + 2
    finally:
        torch.set_num_threads(before)


def test_a_run_hands_the_gil_over_quickly_and_gives_a_calling_process_its_interval_back() -> None:
    """At CPython's 5 ms default the decode pool's service thread starves behind any
    thread running Python (68 against 492 items/s, measured when the interval was set); a
    notebook that calls the job gets its own setting back."""
    import sys

    import torch

    from embedjob.host import GIL_SWITCH_SECONDS, host_threads

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        with host_threads(torch.device("cpu")):
            assert sys.getswitchinterval() == GIL_SWITCH_SECONDS
        assert sys.getswitchinterval() == 0.004
    finally:
        sys.setswitchinterval(before)


@pytest.mark.slow
def test_photos_of_one_size_get_a_budget_of_their_own_and_the_same_rows(tmp_path: Path, cache_dir: str, capsys) -> None:
    """A dataset of one image size (crops of the demo's photos, 196x224: 56 tokens, which
    budgets of 64..512 fit with 14 % padding) adds a 448 budget in the first window; the
    rows are those of a run that keeps the ladder, and the summary line says why it has
    more graphs."""
    import io

    import pyarrow as pa
    from PIL import Image

    photos = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").column("image").to_pylist()
    crops = []
    for index in range(40):
        try:
            photo = Image.open(io.BytesIO(photos[index % len(photos)])).convert("RGB")
        except OSError:
            continue  # the demo's broken rows
        left, top = (7 * index) % max(1, photo.width - 224), (5 * index) % max(1, photo.height - 196)
        crop = photo.resize((max(224, photo.width), max(196, photo.height))).crop((left, top, left + 224, top + 196))
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=90)
        crops.append(buffer.getvalue())
    parquet = tmp_path / "crops.parquet"
    pq.write_table(pa.table({"id": [f"crop-{i}" for i in range(len(crops))], "image": pa.array(crops, type=pa.binary())}), parquet)
    outputs, stats = {}, {}
    for refine in ("true", "false"):
        out = tmp_path / f"refine-{refine}"
        sets = [f"input.path={parquet}", "batching.max_budget=512", f"batching.refine_budgets={refine}"]
        assert run(out, cache_dir, *[a for s in sets for a in ("--set", s)]) == 0
        outputs[refine] = read(out)
        stats[refine] = json.loads(next(out.glob("_embedjob/stats-*.json")).read_text())
    assert stats["true"]["added_budgets"] == [448] and stats["true"]["num_graphs"] == stats["false"]["num_graphs"] + 1
    assert stats["true"]["padding_waste"] < 0.05 * stats["true"]["real_tokens"] < stats["false"]["padding_waste"]
    assert "added_budgets" not in stats["false"] or stats["false"]["added_budgets"] == []
    assert "1 added for items of one size" in capsys.readouterr().err
    for a, b in zip(outputs["true"], outputs["false"], strict=True):
        assert {k: v for k, v in a.items() if k != "embedding"} == {k: v for k, v in b.items() if k != "embedding"}
        assert np.allclose(np.array(a["embedding"], dtype=np.float32), np.array(b["embedding"], dtype=np.float32), atol=1e-5)


@pytest.mark.parametrize(
    "writes, user_prefix, torch_has_bytecode, kept",
    [(False, None, False, True), (True, None, False, False), (False, "/theirs", False, False), (False, None, True, False)],
    ids=["kept", "python-writes-anyway", "users-own-prefix", "installed-with-bytecode"],
)
def test_a_run_keeps_pythons_bytecode_under_the_cache_only_where_nothing_else_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: bool, user_prefix: str | None, torch_has_bytecode: bool, kept: bool
) -> None:
    """Without it, every rank of every run compiles torch's compiler and transformers from
    source (7-8 s of setup where PYTHONDONTWRITEBYTECODE is set and pip wrote no bytecode);
    where Python keeps bytecode already, or the user chose where, nothing changes."""
    from embedjob import config

    monkeypatch.setattr(sys, "dont_write_bytecode", not writes)
    monkeypatch.setattr(sys, "pycache_prefix", user_prefix)
    monkeypatch.setattr(config, "_torch_has_bytecode", lambda: torch_has_bytecode)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "unset-below")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    config.keep_bytecode(tmp_path)
    prefix = str(tmp_path / "pycache")
    assert (sys.pycache_prefix == prefix) is kept
    assert sys.dont_write_bytecode is (not writes and not kept)
    assert (os.environ.get("PYTHONPYCACHEPREFIX") == prefix) is kept


@pytest.mark.parametrize("entry", ["command", "python"])
@pytest.mark.parametrize("chosen, queues", [(None, "32"), ("4", "4")], ids=["default", "users-own"])
@pytest.mark.slow
def test_a_run_spreads_its_streams_over_more_hardware_queues_unless_the_user_chose(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch, chosen: str | None, queues: str, entry: str
) -> None:
    """With CUDA's 8 queues nvjpeg's stream shares one with the encoder's graphs and each
    picture waits for the GEMMs queued ahead of it (the GPU decoder ran a window 28x slower
    beside them); a run, from the command or from Python, sets 32 before anything uses
    CUDA, and a user's own number stays."""
    import embedjob

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", chosen or "unset-below")
    if chosen is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    sets = [f"output.path={tmp_path}", f"runtime.cache_dir={cache_dir}"]
    if entry == "command":
        assert main(["run", DEMO, *[arg for s in sets for arg in ("--set", s)]]) == 0
    else:
        assert embedjob.run(DEMO, overrides=sets)["rows"] > 0
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == queues
    assert list(tmp_path.glob("part-*.parquet"))


def test_a_python_caller_that_used_cuda_first_is_told_its_own_streams_keep_eight_queues(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver reads the variable once, when the process first uses CUDA: a script that
    did before `embedjob.run` gets the wider queues only in the ranks it starts, and the
    log says how to get them everywhere."""
    import torch

    from embedjob import config

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "unset-below")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level("INFO", logger="embedjob.config"):
        config.spread_device_queues()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert "set CUDA_DEVICE_MAX_CONNECTIONS=32 before the process first uses CUDA" in caplog.text


@pytest.mark.slow
def test_the_command_keeps_the_bytecode_of_what_it_imports_and_leaves_the_installed_packages_as_they_were(
    tmp_path: Path, cache_dir: str
) -> None:
    """`embedjob run --gpus 2` in a process of its own, as a cluster's container starts it
    (PYTHONDONTWRITEBYTECODE set), taken for one whose torch has no bytecode (whether
    this machine's has is the installer's choice): both ranks run with the bytecode
    kept, torch's goes to the cache's mirror tree, and nothing new appears beside
    torch's sources."""
    import torch

    torch_dir = Path(torch.__file__).parent
    beside_before = sorted(torch_dir.glob("**/__pycache__/*.pyc"))
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"} | {"PYTHONDONTWRITEBYTECODE": "1"}
    sets = [f"output.path={tmp_path / 'out'}", f"runtime.cache_dir={cache}", "runtime.workers=0", "runtime.progress=false"]
    command = (
        "import sys, embedjob.cli as cli, embedjob.config as config; config._torch_has_bytecode = lambda: False; "
        f"sys.exit(cli.main({['run', DEMO, '--gpus', '2', *(a for k in sets for a in ('--set', k))]!r}))"
    )
    done = subprocess.run([sys.executable, "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "2 ranks" in done.stderr
    mirrored = cache / "pycache" / torch_dir.relative_to(torch_dir.anchor)
    assert any(mirrored.glob("__init__.*.pyc")), f"no bytecode of torch under {mirrored}"
    assert sorted(torch_dir.glob("**/__pycache__/*.pyc")) == beside_before
