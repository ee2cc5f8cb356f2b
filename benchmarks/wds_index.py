"""Indexing WebDataset tars: tarfile's header walk, ours, and an index kept in the cache (RESULTS.md section 15).

Usage (from the repository root): ``python benchmarks/wds_index.py [--smoke]``;
``python benchmarks/wds_index.py --tars 4 --samples 10000 --member-bytes 20000``.

Every process that plans a webdataset job (`embedjob submit`, each shard's run) scans
the whole input, so the cost of indexing one tar is paid by every shard for every tar.
This builds `--tars` tars of `--samples` samples in the img2dataset layout (a `.jpg` of
`--member-bytes`, a `.txt` and a `.json` per sample: three members each), waits until
they count as settled (`webdataset.SETTLED_NS`), and times, per tar:

- `index, tarfile's walk, no cache (before)`: `index_tar` with every tar left to
  tarfile, as every scan indexed every tar before this cache and walk;
- `index, our walk, no cache`: `index_tar` without a cache (`tar_headers`' walk,
  samples, digest);
- `index, first scan (writes the cache)`: `index_tar` with an empty cache;
- `index, cache hit`: `index_tar` reading the entry a first scan wrote;
- `walk alone: tarfile` and `walk alone: ours`: the two header walks by themselves.

Each figure is the median of `--repeats` passes over every tar, divided by the tar
count, and scaled to 1,000 tars. The tars are in the page cache (just written): these
are the walk's CPU costs, not the disk's. `--smoke` builds 2 tars of 300 samples and
times one pass.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The script runs without installing the package, so the repository root goes first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt, log, table  # noqa: E402
from embedjob.io import tar_headers, webdataset  # noqa: E402
from embedjob.io.index_cache import IndexCache  # noqa: E402

SCRIPT = "wds_index"


def build_tars(directory: Path, tars: int, samples: int, member_bytes: int) -> list[Path]:
    """`tars` tars of `samples` samples (jpg, txt, json), keys numbered across tars."""
    image = b"\xff" * member_bytes
    paths = []
    for number in range(tars):
        path = directory / f"{number:05d}.tar"
        with tarfile.open(path, "w") as tar:
            for sample in range(samples):
                key = f"{number * samples + sample:09d}"
                for extension, data in (("jpg", image), ("txt", b"a caption " * 6), ("json", b'{"status": "success"}' * 14)):
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def walk(walker: Callable[[object, str, int], object], paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            walker(handle, str(path), path.stat().st_size)


def per_tar(run: Callable[[], None], tars: int, repeats: int, before: Callable[[], None] = lambda: None) -> float:
    """Median seconds of `run` over `repeats` passes, per tar (`before` untimed, each pass)."""
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / tars


def measure(paths: list[Path], work: Path, repeats: int) -> list[tuple[str, float]]:
    tars = len(paths)
    caches: list[IndexCache] = []

    def fresh_cache() -> None:
        caches.append(IndexCache(work / f"cache-{len(caches)}"))

    def index(cache: Callable[[], IndexCache | None]) -> Callable[[], None]:
        def run() -> None:
            for path in paths:
                webdataset.index_tar(str(path), {}, cache())

        return run

    rows = [
        ("index, tarfile's walk, no cache (before)", per_tar(with_tarfile_only(index(lambda: None)), tars, repeats)),
        ("index, our walk, no cache", per_tar(index(lambda: None), tars, repeats)),
        ("index, first scan (writes the cache)", per_tar(index(lambda: caches[-1]), tars, repeats, fresh_cache)),
    ]
    if caches[-1].writes != tars:
        raise SystemExit(f"{SCRIPT}: the first scan kept {caches[-1].writes} of {tars} indexes")
    warm = IndexCache(caches[-1].root)
    rows.append(("index, cache hit", per_tar(index(lambda: warm), tars, repeats)))
    if warm.hits != tars * repeats:
        raise SystemExit(f"{SCRIPT}: {warm.hits} cache hits in {tars * repeats} look-ups")
    rows.append(("walk alone: tarfile", per_tar(lambda: walk(webdataset.tarfile_members, paths), tars, repeats)))
    rows.append(("walk alone: ours", per_tar(lambda: walk(lambda h, _, size: tar_headers.members(h, size), paths), tars, repeats)))
    return rows


def with_tarfile_only(run: Callable[[], None]) -> Callable[[], None]:
    """`run` with every tar left to tarfile, as `index_tar` indexed before our walk
    (the walk `tar_headers` falls back to)."""

    def patched() -> None:
        ours = tar_headers.members
        tar_headers.members = lambda handle, size: None
        try:
            run()
        finally:
            tar_headers.members = ours

    return patched


def main() -> int:
    args = parse_args()
    tars, samples, repeats = (2, 300, 1) if args.smoke else (args.tars, args.samples, args.repeats)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        log(SCRIPT, f"building {tars} tars of {samples} samples ({3 * samples} members) in {work}")
        paths = build_tars(work, tars, samples, args.member_bytes)
        time.sleep(webdataset.SETTLED_NS / 1e9)  # else no index is kept: the tars changed moments ago
        rows = measure(paths, work, repeats)
        size = paths[0].stat().st_size
    baseline = rows[0][1]
    print(f"{tars} tars of {samples} samples ({3 * samples} members, {size / 1e6:.0f} MB each), median of {repeats}:")
    print("\n".join(table(
        ["scan", "ms per tar", "per 1,000 tars (s)", "faster than before"],
        [(name, fmt(seconds * 1e3, ".1f"), fmt(seconds * 1e3, ".0f"), fmt(baseline / seconds, ".1f") + "x") for name, seconds in rows],
    )))
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tars", type=int, default=4, help="tars to build (default 4)")
    parser.add_argument("--samples", type=int, default=10000, help="samples per tar, three members each (default 10000)")
    parser.add_argument("--member-bytes", type=int, default=20000, help="bytes of each sample's .jpg (default 20000)")
    parser.add_argument("--repeats", type=int, default=3, help="passes over every tar per figure; the median is shown (default 3)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the tars are built (default: the system's temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="2 tars of 300 samples, one pass")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
