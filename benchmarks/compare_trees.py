"""Two or more source trees of embedjob, the same jobs, runs interleaved: is a change a speed-up?

On the GPU machine, from the repository root, with the trees to compare beside it (make
one from a commit with `git archive COMMIT embedjob benchmarks | tar -x -C DIR`):

    PYTHONPATH=. python3 benchmarks/compare_trees.py --trees BEFORE_DIR . --photos bench-data \
        [--mixes qwen-224 siglip clip qwen-mixed] [--repeats 2] [--set KEY=VALUE ...] [--seconds 540]

One GPU's run of one tree on one machine spreads by 10 % and more from run to run (the
`gpu` decoder's runs of one tree on the 224 px mix gave 0.82 to 0.92 of the encoder
alone), so runs of the trees alternate: per repeat and mix each tree once, the order of
the trees reversed every other repeat, so neither always runs first on a warm machine.
Each run is `embedjob run JOB.yaml --gpus 1` as a user types it (`scaling.run_cli`), with
`--set` overrides, on the scaling benchmark's mixes (`benchmarks/mixes.py`: distinct JPEGs
cut from real photos, towers of the published sizes, one compile cache for all trees).
`--seconds` stops starting runs after that long, so a command limit still ends with the
table (the first tree's run of a pair that was cut is then unpaired). `--smoke` runs it
on the CPU with tiny towers and 24 images per mix, to check the script without a GPU.

The table, per mix and tree: every run's images/s after setup, their median, that over
the first tree's median, and per run the pipeline seconds, rank 0's device-busy seconds
(a device busy for nearly the whole pipeline is what bounds it, whatever the threads
wait for), its main-thread seconds of its own work, its GPU-decode thread's seconds and
the main thread's wait for that thread; and per mix and tree against the
first, how many rows have bitwise-equal embeddings in their last runs and the largest
relative difference. Also written to `<workdir>/compare_trees.md`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.mixes import MIXES, SMOKE_IMAGES, builtin_sources, collect_photos, jpeg_dataset, save_tower  # noqa: E402
from benchmarks.scaling import NO_MULTICAST, compare, fmt, log, rank0, read_output, run_cli, timed_rows, write_job  # noqa: E402
from embedjob.pipeline import GPU_DECODE_WAIT  # noqa: E402


@dataclass
class TreeRuns:
    """One tree's runs of one mix: each run's statistics (None: it failed) and where its last output is."""

    tree: Path
    stats: list[dict[str, Any] | None] = field(default_factory=list)
    output: Path | None = None

    def rates(self) -> list[float | None]:
        return [timed_rows(s) / s["pipeline_seconds"] if s and s["pipeline_seconds"] else None for s in self.stats]

    def median(self) -> float | None:
        done = [r for r in self.rates() if r]
        return statistics.median(done) if done else None


def main() -> int:
    args = parse_args()
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    deadline = time.monotonic() + args.seconds
    workdir = Path(args.workdir).resolve()
    trees = [Path(t).resolve() for t in args.trees]
    for tree in trees:
        if not (tree / "embedjob" / "cli.py").is_file():
            raise SystemExit(f"--trees: {tree} holds no embedjob/cli.py; make it with git archive COMMIT embedjob benchmarks")
    photos = collect_photos([*builtin_sources(), *args.photos])
    cores = len(os.sched_getaffinity(0))
    jobs = {}
    for name in args.mixes:
        mix = MIXES[name]
        dataset = jpeg_dataset(mix, SMOKE_IMAGES if args.smoke else mix.images, 0, photos, workdir / "data", cores)
        tower = save_tower(mix.tower, workdir / "towers", args.smoke)
        jobs[name] = write_job(workdir / name, mix, tower, dataset.path, workdir / "cache", args.smoke)
    runs = {(name, k): TreeRuns(tree) for name in args.mixes for k, tree in enumerate(trees)}
    for repeat in range(args.repeats):
        order = list(enumerate(trees)) if repeat % 2 == 0 else list(enumerate(trees))[::-1]
        for name in args.mixes:
            for k, tree in order:
                if time.monotonic() > deadline:
                    break
                output = workdir / name / f"out-{k}"
                logfile = workdir / name / "logs" / f"tree{k}-{repeat}.log"
                stats = run_cli(jobs[name], output, 1, args.set, logfile, tree)
                runs[name, k].stats.append(stats)
                runs[name, k].output = output if stats else runs[name, k].output
                log(f"[{name}] tree {k} ({tree}), repeat {repeat + 1}/{args.repeats}: {fmt(runs[name, k].rates()[-1], '.1f')} images/s")
    text = render(runs, args, trees)
    (workdir / "compare_trees.md").write_text(text + "\n")
    print(text)
    return 0


def render(runs: dict[tuple[str, int], TreeRuns], args: argparse.Namespace, trees: list[Path]) -> str:
    head = ["mix", "tree", "images/s per run", "median", "/ first tree", "pipeline s", "device busy s", "main host s",
            "GPU-decode thread s", "main waits for it s", "bitwise rows vs first", "max rel. diff"]
    lines = [
        f"# trees compared ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"command: {' '.join(sys.argv)}",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join("---" if k < 2 else "---:" for k in range(len(head))) + " |",
    ]
    for name in args.mixes:
        first = runs[name, 0]
        for k, tree in enumerate(trees):
            mine = runs[name, k]
            done = [s for s in mine.stats if s]
            ratio = mine.median() / first.median() if mine.median() and first.median() else None
            same = None
            if k and mine.output and first.output:
                same = compare(read_output(first.output), read_output(mine.output), 0)
            lines.append("| " + " | ".join([
                name, f"{k}: {tree.name}", ", ".join(fmt(r, ".1f") for r in mine.rates()), fmt(mine.median(), ".1f"),
                fmt(ratio, ".3f"), ", ".join(fmt(s["pipeline_seconds"], ".2f") for s in done),
                ", ".join(fmt(rank0(s).get("busy_seconds"), ".2f") for s in done),
                ", ".join(fmt(rank0(s).get("host_seconds"), ".2f") for s in done),
                ", ".join(fmt(rank0(s).get("device_decode_seconds"), ".2f") for s in done),
                ", ".join(fmt(rank0(s).get("waits", {}).get(GPU_DECODE_WAIT), ".2f") for s in done),
                "-" if same is None else f"{same.bitwise}/{same.rows}", "-" if same is None else fmt(same.worst, ".2e"),
            ]) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", required=True, help="source trees; the first is the reference")
    parser.add_argument("--mixes", nargs="+", default=["qwen-224", "siglip"], choices=list(MIXES))
    parser.add_argument("--repeats", type=int, default=2, help="runs per tree and mix")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override for every run")
    parser.add_argument("--photos", nargs="+", action="extend", type=Path, default=[], help="directories or files of photos")
    parser.add_argument("--workdir", default="compare-work")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="start no run after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU only: tiny towers, 24 images per mix, to check the script")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
