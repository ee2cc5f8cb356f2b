"""What a deferred JPEG costs the rank's process: read on the rank, or sent through the decode pool.

    PYTHONPATH=. python3 benchmarks/jpeg_handover.py JOB.yaml [--rows 2048] [--workers 4] [--repeats 3]

With `preprocess.decoder: gpu` a worker only reads a plain JPEG's header and sends the
bytes back with the item (`rows.decode_row` with `defer_jpeg`): about 0.1 ms of its
time. This asks what the trip costs the process that runs the GPU, where the decode
pool's threads compete for the GIL with the thread feeding the device. For the first
`--rows` rows of the job's input, best of `--repeats`:

- the deferred `decode_row` in this process (what reading the header on the rank
  would cost it), CPU ms per row;
- the same rows through a `DecodePool` of `--workers` processes, with and without
  `defer_jpeg`: rows/s, and this process's CPU ms per row (all its threads, from
  `getrusage`; the workers' own time is not in it).

A CPU is enough; the numbers are of the machine it runs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob import rows as worker  # noqa: E402
from embedjob.config import load_job  # noqa: E402
from embedjob.decode import MediaError  # noqa: E402
from embedjob.encoders import load_adapter  # noqa: E402
from embedjob.encoders.base import JPEG_KEY  # noqa: E402
from embedjob.io import reader  # noqa: E402
from embedjob.workers.pool import DecodePool  # noqa: E402


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def in_process(inputs: list[reader.InputRow], options, preprocess, repeats: int) -> float:
    """Best CPU seconds per row of the deferred `decode_row` on this thread."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for row in inputs:
            worker.decode_row(row, options, preprocess)
        best = min(best, (time.thread_time() - start) / len(inputs))
    return best


def through_pool(inputs: list[reader.InputRow], options, preprocess, workers: int, repeats: int) -> tuple[float, float]:
    """Best rows/s through a decode pool and this process's CPU seconds per row in that pass."""
    fn = functools.partial(worker.decode_row, options=options, preprocess=preprocess)
    best = (0.0, 0.0)
    with DecodePool(fn, workers, 60.0, 2 * 256, worker.WORKER_MODULES, error=MediaError) as pool:
        list(pool.imap(iter(inputs[:64])))
        for _ in range(repeats):
            cpu, wall = process_cpu(), time.perf_counter()
            done = sum(1 for _ in pool.imap(iter(inputs)))
            rate = done / (time.perf_counter() - wall)
            if rate > best[0]:
                best = (rate, (process_cpu() - cpu) / done)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    job = load_job(args.job, ["runtime.device=cpu"])
    adapter = load_adapter(job, torch.device("cpu"))
    options, preprocess = worker.decode_options(job, adapter), adapter.preprocessor()
    listing = reader.scan_input(job.input, [])
    end = min(args.rows, sum(f.num_rows for f in listing.fragments))
    inputs = list(reader.read_rows(job.input, listing.fragments, 0, end, []))
    deferred = dataclasses.replace(options, defer_jpeg=True)
    left = sum(d.item is not None and JPEG_KEY in d.item.tensors for d in (worker.decode_row(r, deferred, preprocess) for r in inputs))
    lines = [
        f"{len(inputs)} rows of {args.job}, {left} of them left for the GPU; {args.workers} workers; best of {args.repeats}",
        "",
        "| path | rows/s | this process's CPU ms per row |",
        "| --- | ---: | ---: |",
        f"| header read here (deferred `decode_row`) | - | {1e3 * in_process(inputs, deferred, preprocess, args.repeats):.3f} |",
    ]
    for label, opts in (("pool, JPEGs left for the GPU", deferred), ("pool, decoded in the workers", options)):
        rate, cpu = through_pool(inputs, opts, preprocess, args.workers, args.repeats)
        lines.append(f"| {label} | {rate:.0f} | {1e3 * cpu:.3f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
