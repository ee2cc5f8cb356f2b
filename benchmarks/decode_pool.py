"""How fast the decode pool hands results to a process whose other threads run Python.

The pool's service thread releases the GIL at every send, receive and wait and must get
it back each time. This measures items/s through a `DecodePool` whose workers do no
decoding at all (they return a 336x336 RGB array for a 50 KB task, the size of a CLIP
input and a typical JPEG), so what is measured is the hand-over alone, under three loads
of the parent's other threads (none; Python 2 ms of every 6, as a main thread packing
batches; Python all the time) and for several GIL switch intervals. The pipeline sets
`host.GIL_SWITCH_SECONDS`.

    python benchmarks/decode_pool.py [--workers N] [--items N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

from embedjob.decode import MediaError
from embedjob.host import GIL_SWITCH_SECONDS
from embedjob.workers.pool import DecodePool

LOADS = {"none": 0.0, "python 1/3 of the time": 0.002, "python all the time": None}
"""Seconds of Python per 6 ms the parent's other thread runs (None: without pause)."""


def fake_decode(task: tuple[int, bytes]) -> np.ndarray:
    return np.full((336, 336, 3), task[0] % 251, np.uint8)


def python_load(stop: threading.Event, busy: float | None) -> None:
    total = 0
    while not stop.is_set():
        since = time.perf_counter()
        while busy is None or time.perf_counter() - since < busy:
            total += sum(range(100))
            if stop.is_set():
                return
        time.sleep(0.006 - busy)


def items_per_second(pool: DecodePool, items: int, busy: float | None) -> float:
    payload = bytes(50_000)
    stop = threading.Event()
    if busy != 0.0:
        threading.Thread(target=python_load, args=(stop, busy), daemon=True).start()
    try:
        since = time.perf_counter()
        count = sum(1 for _ in pool.imap((i, payload) for i in range(items)))
        return count / (time.perf_counter() - since)
    finally:
        stop.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    intervals = sorted({0.005, 0.001, GIL_SWITCH_SECONDS}, reverse=True)
    rows = []
    with DecodePool(fake_decode, args.workers, 60.0, 512, error=MediaError) as pool:
        items_per_second(pool, 200, 0.0)  # the workers start
        for load, busy in LOADS.items():
            for interval in intervals:
                sys.setswitchinterval(interval)
                rates = [items_per_second(pool, args.items, busy) for _ in range(args.repeats)]
                rows.append((load, interval, statistics.median(rates), min(rates), max(rates)))
    sys.setswitchinterval(0.005)
    print(f"decode pool hand-over, {args.workers} workers, {args.items} items, median of {args.repeats}, {os.cpu_count()} CPUs\n")
    print("| other threads of the parent | GIL switch interval | items/s | min | max |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for load, interval, median, low, high in rows:
        print(f"| {load} | {interval * 1000:g} ms | {median:.0f} | {low:.0f} | {high:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
