"""Rank 0's intake: the rows a second it takes in from the other ranks and writes, and
what that costs its own main thread; prints one table.

Usage (from the repository root; a CPU is enough):

    python benchmarks/rank0_intake.py [--senders 1 3 7] [--rows 32768] [--dim 3584]

On N GPUs every rank sends its rows to rank 0, whose link threads, coordinator and
writer thread put them into the parts, in the same process as rank 0's own pipeline,
whose main thread packs and launches every batch of rank 0's GPU. Whatever those
threads spend holding the GIL, rank 0's main thread waits for; if it waits long enough,
rank 0's GPU idles and the job runs at the pace of its slowest rank.

This runs that part alone, with nothing encoded: rank 0 is the real `Hub`,
`Coordinator` and `Writer` into a real checkpoint (in `--workdir`); each sender is a
process with a real `Link`, as another rank's is, which takes chunks of
`pipeline.CHUNK_ROWS` rows and puts a block of that many rows of `--dim` float16
vectors for each as fast as the link lets it. Meanwhile a thread of rank 0 runs pure
Python in steps of 1 ms with a 0.2-ms sleep between them, a stand-in for the main
thread's packing and launching, and counts its steps.

Per sender count (one row each): the rows/s through the writer and their MB/s; rank
0's CPU per 1,000 rows by thread (link readers, take answerers, the writer, the rest of
the process, the stand-in's own excluded), from /proc; and the stand-in's steps per
second against its rate with no intake (`main keeps`): 1.0 means the intake took
nothing from rank 0's main thread. A machine with fewer cores than senders + 2 measures
its own cores' contention too; the CPU per row is the figure to carry to a larger one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
from tqdm import tqdm

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedjob.io.checkpoint import open_checkpoint  # noqa: E402
from embedjob.io.digest import DIGEST_SIZE  # noqa: E402
from embedjob.io.reader import Chunk  # noqa: E402
from embedjob.io.sink import ErrorRate, Progress, Writer  # noqa: E402
from embedjob.io.writer import RowBlock, output_schema  # noqa: E402
from embedjob.parallel.cluster import Coordinator, Hub, Link, heartbeat_interval, listen_on_loopback  # noqa: E402
from embedjob.pipeline import CHUNK_ROWS  # noqa: E402
from embedjob.slurm import Shard  # noqa: E402
from embedjob.timeline import Timeline  # noqa: E402

TOKEN = "rank0-intake"
ROWS_PER_PART = 10_000  # output.rows_per_part's default
STEP_SECONDS = 0.001
PAUSE_SECONDS = 0.0002
TICKS = os.sysconf("SC_CLK_TCK")


def block_for(chunk: Chunk, vectors: np.ndarray) -> RowBlock:
    """The chunk's rows as a rank sends them: one pooled vector each, no errors."""
    rows = chunk.rows
    return RowBlock(
        chunk.first_row,
        [f"img-{row:09d}" for row in range(chunk.first_row, chunk.end_row)],
        ["image"] * rows,
        [64] * rows,
        [0] * rows,
        [None] * rows,
        np.ones(rows, dtype=np.int64),
        vectors[:rows],
        digests=np.full((rows, DIGEST_SIZE), 1, dtype=np.uint8),
    )


def send(port: int, rank: int, dim: int) -> None:
    """One sender: a rank that has its rows ready the moment it takes a chunk."""
    vectors = np.random.default_rng(rank).standard_normal((CHUNK_ROWS, dim)).astype(np.float16)
    link = Link(port, TOKEN, rank, heartbeat_interval())
    link.ready()
    link.all_ready()
    while (chunk := link.take()) is not None:
        link.put(chunk.index, block_for(chunk, vectors))
    link.finish(None)


class StandIn:
    """Rank 0's main thread: Python in 1-ms steps, a short sleep between them, counted
    from its start until `stop`."""

    def __init__(self) -> None:
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._since = time.perf_counter()
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def stop(self) -> float:
        """Its steps per second."""
        self._stop.set()
        self._thread.join()
        return self.steps / (time.perf_counter() - self._since)

    def _run(self) -> None:
        while not self._stop.is_set():
            since = time.perf_counter()
            total = 0
            while time.perf_counter() - since < STEP_SECONDS:
                total += sum(range(50))
            self.steps += 1
            time.sleep(PAUSE_SECONDS)


def steps_per_second(seconds: float) -> float:
    """The stand-in's rate with nothing else running."""
    alone = StandIn()
    time.sleep(seconds)
    return alone.stop()


class ThreadCpu:
    """CPU seconds of this process's threads by role, sampled from /proc while they run
    (a thread's entry goes when it ends, so its last sample is what it spent)."""

    ROLES = (("embedjob-link", "links"), ("embedjob-take", "takers"), ("embedjob-writer", "writer"))

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._sample()
        totals = {role: 0.0 for _, role in self.ROLES} | {"other": 0.0}
        for native_id, (role, seconds) in self.last.items():
            if native_id not in self.skip:
                totals[role] += seconds
        return totals

    def _follow(self) -> None:
        self.skip.add(threading.get_native_id())
        while not self._stop.wait(0.05):
            self._sample()

    def _sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for entry in Path("/proc/self/task").iterdir():
            native_id = int(entry.name)
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seconds = (int(fields[11]) + int(fields[12])) / TICKS
            if native_id in self.last:  # an ended thread may stay in /proc after it left threading's list
                role = self.last[native_id][0]
            else:
                name = names.get(native_id, "")
                role = next((r for prefix, r in self.ROLES if name.startswith(prefix)), "other")
            self.last[native_id] = (role, seconds)


def run(senders: int, rows: int, dim: int, workdir: Path, idle_rate: float) -> dict[str, float]:
    """One intake of `rows` rows from `senders` ranks; the table's row."""
    world = senders + 1
    output = Path(tempfile.mkdtemp(dir=workdir))
    checkpoint = open_checkpoint(output, 0, 1, 0, rows, ROWS_PER_PART, {"benchmark": "rank0_intake"}, False)
    chunks = [Chunk(i, first, min(first + CHUNK_ROWS, rows), ()) for i, first in enumerate(range(0, rows, CHUNK_ROWS))]
    coordinator = Coordinator(world, lookahead=world * 10, head_start=4)
    hub = Hub(listen_on_loopback(), TOKEN, world, [])
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=send, args=(hub.port, rank, dim), daemon=True) for rank in range(1, world)]
    for process in processes:
        process.start()
    hub.serve(coordinator)
    coordinator.open(chunks)
    schema = output_schema(pa.string(), "mean", "float16")
    job = SimpleNamespace(runtime=SimpleNamespace(max_error_rate=None, error_rate_min_rows=0))
    cpu = ThreadCpu({threading.get_native_id()})
    coordinator.ready(0)
    coordinator.all_ready()
    main = StandIn()
    since = time.perf_counter()
    with tqdm(total=rows, disable=True) as bar:
        writer = Writer(coordinator, checkpoint, schema, ErrorRate(job, Shard(), checkpoint),
                        Progress(bar, lambda: 0), set(), Timeline(time.time()))
        writer.join()
    seconds = time.perf_counter() - since
    main_rate = main.stop()
    cpu.skip.add(main.native_id)
    hub.wait_done()
    threads = cpu.stop()
    hub.close()
    for process in processes:
        process.join()
    checkpoint.lock.release()
    return {
        "senders": senders,
        "rows": writer.rows,
        "seconds": seconds,
        "rows/s": writer.rows / seconds,
        "MB/s": writer.rows * dim * 2 / seconds / 1e6,
        **{f"{role} ms/1k": 1e6 * spent / writer.rows for role, spent in threads.items()},
        "main keeps": main_rate / idle_rate,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 3, 7], help="ranks sending rows to rank 0")
    parser.add_argument("--rows", type=int, default=32768, help="rows per run")
    parser.add_argument("--dim", type=int, default=3584, help="vector width (3,584: the Qwen2.5-VL-7B tower's)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the outputs go (default: a temporary directory)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    idle_rate = steps_per_second(2.0)
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        for senders in args.senders:
            results.append(run(senders, args.rows, args.dim, Path(workdir), idle_rate))
            print(f"done: {senders} senders", flush=True)
    columns = list(results[0])
    print(f"\ncores: {os.cpu_count()}; rank 0's stand-in main thread alone: {idle_rate:,.0f} steps/s")
    print(" | ".join(columns))
    print(" | ".join("---" for _ in columns))
    for row in results:
        print(" | ".join(f"{row[c]:,.0f}" if c in ("senders", "rows", "rows/s") else f"{row[c]:.2f}" for c in columns))


if __name__ == "__main__":
    main()
