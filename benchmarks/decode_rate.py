"""Decode and preprocessing per core: what one decode worker does per row of a job (RESULTS.md section 8).

    PYTHONPATH=. python3 benchmarks/decode_rate.py JOB.yaml [JOB.yaml ...] [--rows 1000] [--repeats 3] [--set KEY=VALUE ...]
    PYTHONPATH=. python3 benchmarks/decode_rate.py --smoke      (jobs/demo.yaml, its 12 rows, one pass)

For each job, the first `--rows` rows of its input go through `rows.decode_row` (read,
decode, the model's preprocessing: exactly a worker's work, without the hand-over to
the rank) in this one process with one torch thread, after a warm-up of 20 rows; the
best of `--repeats` passes is reported as items/s per core and ms per item, with the
share of the time spent in the decode step (`embedjob.decode.decode`). Cores a GPU
needs for a mix = its encoder-only rate / the per-core rate printed here. `--set`
overrides the jobs' keys, as `embedjob run --set` does (`video.decoder=nvdec`: what a
worker does for a clip it leaves to the GPU, planning it without decoding its frames).
`--read-all` has decord read every picture of a clip up to its samples
(`video.READ_NEEDED` off), as before the copy of the needed pictures alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedjob import rows as worker  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.decode import video  # noqa: E402
from embedjob.encoders import load_adapter  # noqa: E402
from embedjob.io import reader  # noqa: E402

WARMUP = 20


class DecodeClock:
    """Wraps `rows.decode` to add up the seconds spent decoding."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._decode = worker.decode

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._decode(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def measure(job_path: str, rows: int, repeats: int, overrides: list[str]) -> str:
    job = load_job(job_path, ["runtime.device=cpu", *overrides])
    adapter = load_adapter(job, torch.device("cpu"))
    options, preprocess = worker.decode_options(job, adapter), adapter.preprocessor()
    listing = reader.scan_input(job.input, [])
    end = min(rows, sum(f.num_rows for f in listing.fragments))
    inputs = list(reader.read_rows(job.input, listing.fragments, 0, end, []))
    for row in inputs[:WARMUP]:
        worker.decode_row(row, options, preprocess)
    clock = DecodeClock()
    worker.decode = clock
    best, errors, decode_share = float("inf"), 0, 0.0
    try:
        for _ in range(repeats):
            clock.seconds = 0.0
            start = time.perf_counter()
            errors = sum(worker.decode_row(row, options, preprocess).error is not None for row in inputs)
            seconds = time.perf_counter() - start
            if seconds < best:
                best, decode_share = seconds, clock.seconds / seconds
    finally:
        worker.decode = clock._decode
    return (
        f"| {Path(job_path).parent.name}/{Path(job_path).name} | {job.model.family} | {len(inputs)} | {errors} "
        f"| {len(inputs) / best:.0f} | {1000 * best / len(inputs):.3f} | {100 * decode_share:.0f}% |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", help="job files (with --smoke, default jobs/demo.yaml)")
    parser.add_argument("--rows", type=int, default=1000, help="rows of each job's input")
    parser.add_argument("--repeats", type=int, default=3, help="passes; the best is reported")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of every job (repeatable)")
    parser.add_argument("--smoke", action="store_true", help="one pass over the demo job's rows")
    parser.add_argument("--read-all", action="store_true", help="decord reads the whole clip (video.READ_NEEDED off)")
    args = parser.parse_args()
    video.READ_NEEDED = not args.read_all
    if args.smoke:
        args.jobs = args.jobs or [str(REPO / "jobs" / "demo.yaml")]
        args.repeats = 1
    if not args.jobs:
        parser.error("name at least one job file (or --smoke)")
    torch.set_num_threads(1)
    lines = [measure(job, args.rows, args.repeats, args.overrides) for job in args.jobs]
    print("| job | family | rows | error rows | items/s per core | ms per item | decode share |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
