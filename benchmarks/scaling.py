"""Data-parallel scaling of `embedjob run --gpus N` on one node; prints one table.

Usage (from the repository root, on a machine with several CUDA GPUs):

    python benchmarks/scaling.py [--runs 1 2 2:runtime.workers=24] [--images 1536] [--repeats 2]

Each run is a GPU count, optionally followed by `:` and comma-separated settings: a
job override (`runtime.workers=24`, passed as `--set`) or an environment variable
(`OMP_NUM_THREADS=4`, upper case), so one call can compare ways of running.

Saves the Qwen2.5-VL-7B-size vision tower of `embedjob bench` (random bf16 weights) as a
user's checkpoint, writes a Parquet file of real JPEGs re-encoded at 224-1344 px (the
mixed-size mix), and runs the same job through the CLI, as a user would, once per GPU
count and setting (compiled blocks, CUDA graphs). Throughput is rows over the run's
`pipeline_seconds` (decode, encode and write; model load, compile and capture are
excluded since they do not grow with the dataset, and so is the wait of rank 0 for the
other ranks' setup), median over the repeats. Scaling
efficiency is throughput(N) / (N * throughput(1)), against the first run, which must be
one GPU without settings. The balance ratio is the
data-parallel ledger's max/mean rank load summed over windows; the busy ratio the same
for the ranks' measured encode seconds. Below the table, each run's stage seconds and
every rank's exchange seconds say where a run that does not scale waits. The last
columns compare each run's rows with the first run's: ids, order and errors must be
identical; embeddings are compared bitwise and by the largest relative difference,
since a different share of a window packs items into different batches, which can move
bf16 results by rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

# The script runs without installing the package, so the repository root goes first.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedjob.bench import build_tower, make_jpeg_parquet, save_checkpoint  # noqa: E402


def prepare(workdir: Path, images: int, distinct: int) -> tuple[Path, Path]:
    """The tower checkpoint and the JPEG Parquet file; the GPU is freed afterwards.

    `distinct` JPEGs are made (re-encoding is slow and single-threaded) and repeated to
    `images` rows; every row is still read, decoded and encoded on its own."""
    adapter = build_tower(torch.device("cuda", 0))
    checkpoint = save_checkpoint(adapter, workdir)
    del adapter
    torch.cuda.empty_cache()
    parquet = workdir / "jpegs.parquet"
    make_jpeg_parquet(parquet, min(distinct, images))
    table = pq.read_table(parquet)
    rows = pa.concat_tables([table] * -(-images // table.num_rows)).slice(0, images)
    pq.write_table(rows, parquet, row_group_size=128)
    return checkpoint, parquet


def write_job(workdir: Path, checkpoint: Path, parquet: Path) -> Path:
    job = {
        "input": {"path": str(parquet), "media_column": "image"},
        "model": {"path": str(checkpoint), "dtype": "bfloat16"},
        "output": {"path": str(workdir / "out"), "rows_per_part": 100_000},
        "batching": {"compile": True},
        "runtime": {"device": "cuda", "progress": False, "cache_dir": str(workdir / "cache")},
    }
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def parse_run(text: str) -> tuple[int, list[str], dict[str, str]]:
    """`GPUS[:SETTING,...]` -> (GPUs, job overrides, environment variables)."""
    gpus, _, rest = text.partition(":")
    settings = [item for item in rest.split(",") if item]
    if not gpus.isdigit() or any("=" not in item for item in settings):
        raise SystemExit(f"--runs: expected GPUS[:KEY=VALUE,...], got {text!r}")
    env = dict(item.split("=", 1) for item in settings if item.split("=", 1)[0].isupper())
    return int(gpus), [item for item in settings if not item.split("=", 1)[0].isupper()], env


def run_once(job: Path, output: Path, run: str) -> dict[str, Any]:
    """One `embedjob run` through the CLI; its statistics."""
    gpus, overrides, extra_env = parse_run(run)
    command = [sys.executable, "-m", "embedjob.cli", "run", str(job), "--gpus", str(gpus), "--overwrite"]
    for override in [f"output.path={output}", *overrides]:
        command += ["--set", override]
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO)
    stats = json.loads(next(output.glob("stats-*.json")).read_text())
    stats["wall_seconds"] = time.perf_counter() - start
    return stats


def read_rows(output: Path) -> list[dict[str, Any]]:
    return pq.read_table(sorted(output.glob("part-*.parquet"))).to_pylist()


def compare(reference: list[dict[str, Any]], rows: list[dict[str, Any]]) -> tuple[bool, int, float]:
    """(ids, order and errors identical; rows with bitwise-equal embeddings; largest relative difference)."""
    same_rows = len(reference) == len(rows)
    bitwise, worst = 0, 0.0
    for a, b in zip(reference, rows):
        same_rows &= {k: v for k, v in a.items() if k != "embedding"} == {k: v for k, v in b.items() if k != "embedding"}
        if a["embedding"] is None or b["embedding"] is None:
            bitwise += a["embedding"] == b["embedding"]
            continue
        ea, eb = torch.tensor(a["embedding"]), torch.tensor(b["embedding"])
        bitwise += bool(torch.equal(ea, eb))
        worst = max(worst, float((ea - eb).norm() / ea.norm().clamp_min(1e-12)))
    return same_rows, bitwise, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["1", "2"], help="GPUS[:KEY=VALUE,...] per run; the first is the baseline")
    parser.add_argument("--images", type=int, default=1536)
    parser.add_argument("--distinct", type=int, default=512, help="distinct JPEGs, repeated to --images rows")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="scaling-work")
    args = parser.parse_args()
    available = torch.cuda.device_count()
    counts = [parse_run(run)[0] for run in args.runs]
    if max(counts) > available:
        raise SystemExit(f"asked for {max(counts)} GPUs but this machine has {available}")
    if args.runs[0] != "1":
        raise SystemExit("the first of --runs is the baseline of the scaling efficiency and must be 1")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint, parquet = prepare(workdir, args.images, args.distinct)
    job = write_job(workdir, checkpoint, parquet)
    results = []
    reference: list[dict[str, Any]] | None = None
    for number, run in enumerate(args.runs):
        output = workdir / f"out-{number}"
        runs = [run_once(job, output, run) for _ in range(args.repeats)]
        rows = read_rows(output)
        reference = rows if reference is None else reference
        results.append((run, runs, compare(reference, rows)))
    print(render(args, results))
    return 0


def _joining(stats: dict[str, Any]) -> float:
    """Seconds rank 0's pipeline waited for the other ranks to finish their setup (load,
    compile, capture) before its first exchange: start-up, not throughput."""
    ranks = stats.get("ranks") or [{}]
    return ranks[0].get("exchange_seconds", {}).get("joining the group", 0.0)


def render(args: argparse.Namespace, results: list[tuple[str, list[dict[str, Any]], tuple[bool, int, float]]]) -> str:
    base = None
    lines = [
        f"# embedjob data-parallel scaling — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- device: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs; "
        f"torch {torch.__version__}; {args.images} rows ({args.distinct} distinct JPEGs, 224-1344 px); Qwen2.5-VL-7B-size tower, bf16, compiled, CUDA graphs",
        f"- seconds: pipeline (decode + encode + write), median of {args.repeats}; setup excluded, and so is the "
        "time rank 0 waited for the other ranks' setup at its first exchange (shown below as 'joining the group')",
        "",
        "| run | seconds | images/s | images/s per GPU | scaling efficiency | balance ratio | busy ratio | hit rate "
        "| setup s | rows identical | bitwise-equal embeddings | max rel. diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for run, runs, (same, bitwise, worst) in results:
        gpus = parse_run(run)[0]
        seconds = statistics.median(r["pipeline_seconds"] - _joining(r) for r in runs)
        rate = runs[0]["rows"] / seconds
        base = rate if base is None else base
        efficiency = rate / (gpus * base)
        last = runs[-1]
        balance = last.get("balance_ratio", 1.0)
        busy = last.get("busy_ratio", 1.0)
        setup = statistics.median(r["setup_seconds"] for r in runs)
        lines.append(
            f"| {run} | {seconds:.2f} | {rate:.1f} | {rate / gpus:.1f} | {efficiency:.2f} | {balance} | {busy} "
            f"| {last['hit_rate']:.0%} | {setup:.1f} | {'yes' if same else 'NO'} | {bitwise}/{last['rows']} | {worst:.2e} |"
        )
    lines += ["", "Where the time went (last run of each): rank 0's pipeline stages, and each rank's exchange wall seconds"]
    for run, runs, _ in results:
        last = runs[-1]
        lines.append(f"- {run}: stages {last.get('stage_seconds')}")
        for rank in last.get("ranks", []):
            lines.append(f"  - rank {rank['rank']}: busy {rank['busy_seconds']} s, exchanges {rank.get('exchange_seconds')}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
