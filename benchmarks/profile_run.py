"""Where one `embedjob run` spends its time: a sampling profile of its threads (the main
one that feeds the GPU first) and a cProfile of the whole process, then the run's stages.

Usage (from the repository root; one process, one GPU):

    PYTHONPATH=. python3 benchmarks/profile_run.py JOB.yaml [--set KEY=VALUE ...] [--top 30]

The sampler reads every thread's stack every `--interval` seconds while the job runs
and counts, per thread and function, the samples in which it is on the stack
(inclusive) and the ones in which it is the innermost frame (exclusive): wall time,
waits included, with little overhead since nothing traces the threads' calls. cProfile (every thread
from Python 3.12) follows with its own-time table.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedjob.config import load_job  # noqa: E402
from embedjob.pipeline import Runner  # noqa: E402


class ThreadSampler:
    """Counts the functions on every thread's stack at a fixed interval (but its own),
    per thread name: a thread blocked in a call that releases the GIL (a CUDA sync, a
    socket, a hardware decoder) is sampled where it waits."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.exclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def __enter__(self) -> "ThreadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == self._thread.ident:
                    continue
                self._count(names.get(ident, str(ident)), frame)

    def _count(self, thread: str, frame: Any) -> None:
        self.samples[thread] += 1
        stack = []
        while frame is not None:
            code = frame.f_code
            stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
            frame = frame.f_back
        self.exclusive[thread][stack[0]] += 1
        for name in set(stack):
            self.inclusive[thread][name] += 1

    def table(self, top: int, threads: int = 8) -> str:
        """The `threads` most sampled threads (the main thread first), each with its
        `top` functions by inclusive and exclusive share of that thread's samples."""
        order = sorted(self.samples, key=lambda t: (t != "MainThread", -self.samples[t]))[:threads]
        lines = [f"every {self.interval * 1000:.1f} ms, {len(self.samples)} threads seen"]
        for thread in order:
            n = self.samples[thread]
            lines += ["", f"## {thread}: {n} samples", "inclusive (on the stack):"]
            lines += [f"  {100 * c / n:5.1f} %  {name}" for name, c in self.inclusive[thread].most_common(top)]
            lines += ["exclusive (innermost frame):"]
            lines += [f"  {100 * c / n:5.1f} %  {name}" for name, c in self.exclusive[thread].most_common(top // 2)]
        return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--interval", type=float, default=0.002)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    job = load_job(args.job, [*args.set, "runtime.gpus=1", "runtime.progress=false"])
    profile = cProfile.Profile()
    with ThreadSampler(args.interval) as sampler:
        stats = profile.runcall(Runner(job, overwrite=True).run)
    own = io.StringIO()
    pstats.Stats(profile, stream=own).sort_stats("tottime").print_stats(args.top)
    rank = (stats.get("ranks") or [{}])[0]
    summary = {k: stats.get(k) for k in ("rows", "setup_seconds", "pipeline_seconds", "items_per_second", "stage_seconds")}
    report = "\n\n".join([
        f"# profile of {args.job} {' '.join(args.set)} — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        json.dumps(summary),
        json.dumps({k: rank.get(k) for k in ("setup", "waits", "host_seconds", "busy_seconds", "decode_seconds", "device_decode_seconds")}),
        sampler.table(args.top),
        "cProfile, own time (every thread):\n" + own.getvalue(),
    ])
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
