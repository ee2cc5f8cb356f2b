"""The maintained benchmarks run: `--help` and `--smoke` of each script in `benchmarks/`.

Each script runs in a subprocess from the repository root, as RESULTS.md's commands run
it, and must exit 0 and print its table's header; on a CPU a GPU-only measurement says
what it skipped. The numbers are not checked: benchmarks print them, tests do not time.
The smoke runs start jobs and worker processes, so they are `slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = [
    "attention", "decode_rate", "device_gaps", "encoder_only", "fixed_compile",
    "gpu_decode", "packing", "precision", "scaling", "video_decode",
    "naflex",
    "captions",
    "wds_index",
    "fp8_layers",
    "family_checks",
    "nvdec_scaling",
    "quantize_rows",
    "gemm_epilogue",
    "copy_wait",
]
SMOKE_SECONDS = 600


def run(args: list[str], timeout: float = SMOKE_SECONDS, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A command from the repository root with the repository on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        args, cwd=REPO, env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, f"benchmarks/{name}.py", *args])


def test_every_script_in_benchmarks_is_a_maintained_one_or_a_helper() -> None:
    """A new script comes with its smoke test here (and its table in RESULTS.md)."""
    found = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    assert found == {*SCRIPTS, "common", "mixes"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_names_what_the_script_measures_and_its_results_section(name: str) -> None:
    done = script(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
    assert "RESULTS.md section" in " ".join(done.stdout.split())


SMOKES = {
    "attention": (["--smoke", "--repeats", "1"], ["| case | head dim | tokens | backend |"]),
    "decode_rate": (["--smoke"], ["| job | family | rows |"]),
    "device_gaps": (["--smoke"], ["skipped the device trace", "| gap length | gaps |"]),
    "encoder_only": (["--smoke", "--images", "8"], ["| mix | items | not decoded |"]),
    "fixed_compile": (["--smoke", "--models", "clip", "--variants", "ours_graphs_compiled", "--repeats", "1"], ["variant", "images/s"]),
    "gpu_decode": (["--smoke", "--mixes", "qwen-224", "--images", "8", "--decoders", "cpu", "--repeats", "1"], ["| mix | decoder | workers |"]),
    "naflex": (["--smoke"], ["| tower | max patches | variant |", "ours_graphs"]),
    "packing": (["--smoke"], ["padding, ladder", "min_padding never worse than greedy"]),
    "precision": (
        ["--smoke", "--mixes", "qwen-224", "--images", "qwen-224=8", "--reference", "2", "--repeats", "1",
         "--precisions", "bf16-varlen-attn", "fp8-keep-out", "fp8-calibrated"],
        ["| mix | precision |", "| fp8-keep-out |", "| fp8-calibrated |", "cosines to bf16 over the 16 after the first 8"],
    ),
    "scaling": (["--smoke", "--mixes", "qwen-224", "--images", "8"], ["| mix | run | rows |"]),
    "video_decode": (["--smoke"], ["skipped the nvdec run", "| decoder | workers |"]),
    "captions": (["--smoke", "--models", "clip"], ["| model | run | rows |", "images + captions"]),
    "wds_index": (["--smoke"], ["| scan | ms per tar |", "walk alone: ours", "index, cache hit"]),
    "fp8_layers": (
        ["--smoke", "--mixes", "siglip", "--keep", "0", "4", "--kinds", "--kept", "self_attn.out_proj", "--calibrate", "4"],
        ["| layer (worst first) |", "block 1: mlp.fc2", "| rounded | 0 | 10 |", "| calibrated on 4 items | 0 | 10 |",
         "| mlp.fc1 | 25.0% |", "(--kept): self_attn.out_proj.", "the 4 items after"],
    ),
    "nvdec_scaling": (["--smoke", "--sessions", "1", "2", "--variants", "own-streams", "cut", "--loads", "none", "cpu", "python",
                       "--load-workers", "2", "--load-nice", "0", "10", "--switch-interval", "0.001"],
                      ["| mode | sessions | clips |", "decord standing in for NVDEC", "| processes, own-streams | 2 |",
                       "| threads, cut, beside 2 decord processes at nice 0 | 2 |",
                       "| threads, cut, beside 2 decord processes at nice 10 | 2 |",
                       "| threads, cut, beside a thread running Python 50% of the time | 2 |", "switch interval 1 ms"]),
    "quantize_rows": (["--smoke"], ["| input (tower: the layers reading it) | blocks (lanes) | warps |", "| 4,096 + 128 + 128 |", "SigLIP-so400m: fc2, 4,304 wide after gelu_tanh", "torch path standing in"]),
    "copy_wait": (["--smoke"], ["| copy | alone | beside bf16 products |", "skipped every copy", "| driver 2D | skipped |"]),
    "family_checks": (["--smoke"], ["| check | result |", "DINOv3: embedjob float32, graphs of the uncompiled blocks", "Qwen3.5: all batches", "an image job's graph offsets"]),
    # Triton's interpreter runs every kernel on a 100 x 64 x 128 product; a wrong or failed row exits 1.
    "gemm_epilogue": (["--smoke"], ["| shape | variant | ms | TFLOP/s |", "timings not meaningful",
                                    "| tiny 100x64x128 | persistent, pointers, 32x32x16 w4 s2 g2 |",
                                    "| tiny 100x64x128 | tiles, pointers, 32x32x16 w4 s2 g2 |"]),
}
WORKDIRS = {"family_checks", "encoder_only", "gpu_decode", "precision", "scaling", "video_decode", "captions", "wds_index", "fp8_layers"}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_runs_on_the_cpu_and_prints_the_table(name: str, tmp_path: Path) -> None:
    args, expected = SMOKES[name]
    if name in WORKDIRS:
        args = [*args, "--workdir", str(tmp_path)]
    done = script(name, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, done.stdout[-3000:]


@pytest.mark.slow
def test_the_nvjpeg_contention_mode_makes_its_windows_and_says_it_skipped_the_timings(tmp_path: Path) -> None:
    done = script("gpu_decode", "--contention", "--smoke", "--mixes", "qwen-224", "--window", "8", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped --contention's timings" in done.stdout
    assert "| mix | CUDA_DEVICE_MAX_CONNECTIONS |" in done.stdout


@pytest.mark.slow
def test_video_decode_profiles_the_jobs_it_is_asked_to_and_only_those(tmp_path: Path) -> None:
    """`--profile auto`: the auto job's process runs under cProfile and its functions by own
    time are logged (a missed target's evidence); the decord job runs as before."""
    done = script("video_decode", "--smoke", "--decoders", "decord", "auto", "--profile", "auto", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| auto (7 sessions) |" in done.stdout
    assert done.stderr.count("cProfile of the job's process") == 1, done.stderr[-3000:]
    assert "Ordered by: internal time" in done.stderr
    assert [p.name for p in (tmp_path / "logs").glob("*.prof")] == ["run-2.prof"]


@pytest.mark.slow
def test_video_decode_variants_take_job_settings_beside_constants(tmp_path: Path) -> None:
    """`--variants auto:runtime.workers=1,embedjob...=...`: the variant's job runs with one
    decode worker (its row says so) on a copy of the tree with the constant rewritten, and
    only the constant goes to the copy."""
    done = script("video_decode", "--smoke", "--decoders", "decord", "--variants",
                  "decord:runtime.workers=1,embedjob.decode.video.READ_NEEDED=False", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| decord, runtime.workers=1, embedjob.decode.video.READ_NEEDED=False | 1 |" in done.stdout, done.stdout[-3000:]
    assert "| decord | 2 |" in done.stdout
    assert "READ_NEEDED = False" in (tmp_path / "tree-2" / "embedjob" / "decode" / "video.py").read_text()
    assert "--set runtime.workers=1" in (tmp_path / "logs" / "run-2.log").read_text().splitlines()[0]


def test_video_decodes_repeated_runs_give_the_median_runs_row_and_the_spread() -> None:
    """`video_decode.py --repeats 3`: a variant's row is its median run's (by pipeline
    seconds), its pipeline cell the spread of all three; one failed run fails the row,
    and a single run's cell is its seconds alone."""
    sys.path.insert(0, str(REPO))
    from benchmarks.video_decode import Planned, _pipeline_seconds, repeated

    plan = Planned("nvdec", 7)
    seconds = iter([5.0, 3.0, 4.0])
    stats = repeated(plan, 3, lambda repeat: {"pipeline_seconds": next(seconds), "repeat": repeat})
    assert stats == {"pipeline_seconds": 4.0, "repeat": 2} and plan.seconds == [5.0, 3.0, 4.0]
    assert _pipeline_seconds(stats["pipeline_seconds"], plan.seconds) == "4.00 (3 runs, 3.00-5.00)"
    assert repeated(plan, 3, lambda repeat: None if repeat == 1 else {"pipeline_seconds": 1.0}) is None
    assert _pipeline_seconds(2.5, [2.5]) == "2.50"


@pytest.mark.slow
def test_thumbnails_replay_their_graphs(tmp_path: Path) -> None:
    done = script("packing", "--smoke", "--thumbnails", "16", "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| images | rows | hit rate |" in done.stdout
    assert "| 16 | 16 | 100.0% |" in done.stdout


def test_device_checks_without_a_stage_prints_its_usage_and_exits_2() -> None:
    done = run(["bash", "benchmarks/device_checks.sh"], timeout=60)
    assert done.returncode == 2
    assert "SMOKE=1" in done.stdout


@pytest.mark.slow
def test_device_checks_smoke_runs_a_stage_and_prints_its_summary(tmp_path: Path) -> None:
    env = {
        "SMOKE": "1", "OUT": str(tmp_path / "out"), "DEVICE_CHECKS_WORK": str(tmp_path / "work"),
        "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"])),  # its python3: this one
    }
    done = run(["bash", "benchmarks/device_checks.sh", "attention"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "=== device_checks.sh summary ===" in done.stdout
    assert "attention backends on cpu" in done.stdout


def test_a_decode_bound_jobs_rate_past_the_head_start_leaves_out_the_rows_decoded_during_setup() -> None:
    """A job whose workers held two windows (8 rows) decoded when the rank got ready encodes
    them at once (10 rows in its third second), then 5 a second: the rate counted past the
    head start is the decoders' 5, where rows over pipeline seconds says 5.7; a run that
    ends too soon after its head start has no such rate."""
    sys.path.insert(0, str(REPO))
    from benchmarks.common import past_head_start

    stats = {"job": {"batching": {"window": 4}},
             "ranks": [{"timeline": {"width": 1.0, "end": 9.0, "series": {"rows": [0, 0, 10, 5, 5, 5, 5, 5, 5]}}}]}
    assert past_head_start(stats) == (30, 6.0)
    assert past_head_start(stats, least_seconds=7.0) is None
    assert past_head_start({"job": {"batching": {"window": 4}}, "ranks": [{"timeline": {"width": 1.0, "end": 3.0, "series": {"rows": [0, 0, 7]}}}]}) is None


def test_nvdec_scaling_shows_the_feeds_parts_per_clip_only_where_the_feed_ran() -> None:
    """`nvdec_scaling.feed_per_clip` turns the decoder clock's seconds over a run into
    milliseconds a clip in the table's order (clip, Decode, surface, copy, RGB), and shows
    none for a run that never reached the packet feed (decord's stand-in)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.nvdec_scaling import FEED_PARTS, feed_per_clip

    assert FEED_PARTS == ("clip", "Decode", "surface", "copy", "RGB")
    parts = {"clip": 2.0, "Decode": 1.0, "surface": 0.1, "copy": 0.25, "RGB": 0.5}
    assert feed_per_clip(parts, 10) == ["200.0", "100.0", "10.0", "25.0", "50.0"]
    assert feed_per_clip({"clip": 2.0, "Decode": 0.0, "surface": 0.0, "copy": 0.0, "RGB": 0.0}, 10) is None


def test_gemm_epilogue_calls_an_output_wrong_that_misses_the_bias_the_activation_or_rows() -> None:
    """The check behind `gemm_epilogue.py`'s exit status: a kernel output is "ok" only within
    a row cosine of 0.9999 of float32 quick_gelu(x @ w.T + b) on every row."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.gemm_epilogue import SMOKE_SHAPE, Row, check, inputs, quick_gelu

    x, w, b = inputs(SMOKE_SHAPE, torch.device("cpu"))
    product = x.float() @ w.float().T
    reference = quick_gelu(product + b.float())

    def verdict(out: torch.Tensor) -> str:
        return check(Row(SMOKE_SHAPE, "case"), out.to(torch.bfloat16), reference, None).check

    unwritten = reference.clone()
    unwritten[-4:] = float("nan")
    assert verdict(reference) == "ok"
    assert verdict(quick_gelu(product)).startswith("WRONG")
    assert verdict(product + b.float()).startswith("WRONG")
    assert verdict(unwritten).startswith("WRONG")


def test_video_decodes_tiny_tower_is_embedded_on_the_gpu(tmp_path: Path) -> None:
    """`--tiny-tower`: the job the runs start from loads the tower's tiny checkpoint and still
    runs compiled on the GPU (not on the CPU, as `--smoke` does), so its decoders read with
    next to nothing else on the device."""
    import yaml

    from benchmarks.mixes import TOWERS
    from benchmarks.video_decode import write_job

    tiny = yaml.safe_load(write_job(tmp_path, tmp_path / "clips.parquet", False, "clip", tiny=True).read_text())
    assert tiny["runtime"]["device"] == "cuda" and tiny["batching"]["compile"] is True
    assert Path(tiny["model"]["path"]).name == TOWERS["clip"].key + "-tiny"
    config = yaml.safe_load((Path(tiny["model"]["path"]) / "config.json").read_text())
    assert config["hidden_size"] == TOWERS["clip"].tiny["hidden_size"] < TOWERS["clip"].full["hidden_size"]


def test_the_decoder_sampler_reads_clocks_and_power_over_the_decoders_busy_span() -> None:
    """`common.DecoderBusy` sums up nvidia-smi's samples from the first to the last with
    the decoders busy: the mean busy share, the share full, and the medians of the video
    and SM clocks and the power there (a clock held down beside the encoder shows); a line
    nvidia-smi could not fill is left out, and no busy sample says "-"."""
    sys.path.insert(0, str(REPO))
    from benchmarks.common import DecoderBusy, parse_samples

    out = "\n".join(["0, 1755, 1980, 120.5", "40, 1500, 1755, 690.0", "95, 1400, 1700, 700.0", "[N/A], 1400, 1700, 700.0",
                     "60, 1600, 1800, 650.0", "0, 1755, 1980, 110.0", "12, 17"])
    busy = DecoderBusy()
    busy.samples = parse_samples(out, len(DecoderBusy.QUERY))
    assert len(busy.samples) == 5
    assert busy.summary() == (65.0, 1 / 3, (1500.0, 1755.0, 690.0))
    assert busy.describe() == "65 % (full 33 %); 1,500 / 1,755 MHz, 690 W"
    busy.samples = parse_samples("0, 1755, 1980, 120.5", len(DecoderBusy.QUERY))
    assert busy.summary() is None and busy.describe() == "-"
