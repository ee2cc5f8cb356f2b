"""Wires the stages of one shard: read -> decode -> pack -> encode -> write.

Rows stream through bounded buffers: the reader yields record batches, the decode pool
keeps a bounded number of items in flight, and the encoder works on windows of
`batching.window` decoded items, each packed on its own. Within a window outputs are
put back in input order, and windows are written in order, so the output is in input
order without holding more than one window and one part in memory.

Every input row becomes exactly one output row: decode and preprocess failures become
error rows in the workers, encode failures become error rows here (after retrying the
failed batch one item at a time), and rows already committed by an earlier run are
skipped through the checkpoint.

With several GPUs (`runtime.gpus`, `distributed.py`) this pipeline runs unchanged in
rank 0, whose encoder spreads each window over the ranks; the other ranks only encode
(`serve_rank`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from embedjob import distributed, media, reader
from embedjob.checkpoint import Checkpoint, PartRecord, job_fingerprint, open_checkpoint
from embedjob.encoders import EncoderAdapter, EncoderInput, load_adapter
from embedjob.graphs import BatchEncoder, Reduce, build_encoder, cut_rows, rows_to_host
from embedjob.job import Job, JobError
from embedjob.writer import OutputRow, output_schema, part_name, write_part

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> "Shard":
        """`I/N` from the CLI, else SLURM's array variables, else the whole input."""
        if text is None:
            task, count = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_ARRAY_TASK_COUNT")
            if task is None or count is None:
                return cls()
            low, high = os.environ.get("SLURM_ARRAY_TASK_MIN", "0"), os.environ.get("SLURM_ARRAY_TASK_MAX")
            if low != "0" or (high is not None and int(high) != int(count) - 1):
                raise JobError(
                    f"this SLURM array ({low}-{high}, {count} tasks) is not 0..N-1, so its task count is not the "
                    "number of shards; pass --shard I/N (embedjob submit does)"
                )
            text = f"{task}/{count}"
        try:
            index, count = (int(p) for p in text.split("/"))
        except ValueError:
            raise JobError(f"--shard expects I/N with integers (e.g. 0/8), got {text!r}") from None
        if count < 1 or not 0 <= index < count:
            raise JobError(f"--shard {text}: need 0 <= I < N and N >= 1")
        return cls(index, count)


@dataclass
class Decoded:
    """A row after the decode stage: a preprocessed item or an error, never both."""

    row: int
    id: Any
    modality: str | None
    item: EncoderInput | None
    error: str | None


@functools.cache
def _one_thread_per_worker() -> None:
    """Decode workers run one per core; torch's default of one thread per core inside each
    of them would oversubscribe the machine many times over."""
    if multiprocessing.parent_process() is not None:
        torch.set_num_threads(1)


def decode_row(row: reader.InputRow, options: media.DecodeOptions, preprocess: Any) -> Decoded:
    """Worker function: bytes (or a path) -> decoded media -> EncoderInput, or an error row."""
    _one_thread_per_worker()
    fixed = None if options.modality == "auto" else options.modality
    if row.error is not None:
        return Decoded(row.row, row.id, fixed, None, row.error)
    try:
        data = row.data if row.data is not None else media.read_source(row.uri or "")
        decoded = media.decode(data, options)
    except media.MediaError as err:
        return Decoded(row.row, row.id, fixed, None, str(err))
    modality = "video" if isinstance(decoded, media.DecodedVideo) else "image"
    try:
        item = preprocess(decoded)
    except Exception as exc:  # a preprocessing failure is one bad row, not a failed job
        return Decoded(row.row, row.id, modality, None, f"preprocess_failed: {type(exc).__name__}: {exc}")
    return Decoded(row.row, row.id, modality, item, None)


FIRST_WINDOW = 32
"""The smallest first window that ramps up (see `window_sizes`)."""


def window_sizes(window: int) -> Iterator[int]:
    """Window sizes for a run: a short ramp, then `window` for ever.

    The device has nothing to do until the first window is decoded, so the first windows
    are an eighth, a quarter and a half of `window` (never below FIRST_WINDOW items):
    the device starts after a few dozen items, and each window takes about as long to
    encode as the next, twice as large, takes to decode while the pool is filling up.
    A window of FIRST_WINDOW items or fewer does not ramp.
    """
    size = min(window, max(FIRST_WINDOW, window // 8))
    while size < window:
        yield size
        size *= 2
    while True:
        yield window


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("runtime.device is 'cuda' but no CUDA device is visible; use runtime.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_workers(value: str | int) -> int:
    """"auto": one decode worker per core this process may run on (under SLURM, the
    task's allocation, not the whole node)."""
    return len(os.sched_getaffinity(0)) if value == "auto" else int(value)


def load_encoder_adapter(job: Job, device: torch.device) -> EncoderAdapter:
    """The job's adapter on `device`, compiled when the job asks for it (CUDA only).

    A checkpoint that cannot serve the job (not a checkpoint, another family) is a job
    error: the user must change model.path or model.family.
    """
    try:
        adapter = load_adapter(job, device)
    except (ValueError, OSError) as exc:
        raise JobError(f"model.path {job.model.path!r} (model.family {job.model.family!r}): {exc}") from None
    if job.batching.compile:
        if device.type == "cuda":
            adapter.compile(dynamic=True)
        else:
            logger.info("batching.compile applies to CUDA only; running uncompiled on %s", device)
    return adapter


def reducer(pooling: str) -> Reduce:
    """Pooling, applied to an item's rows before the next replay overwrites them."""
    if pooling == "mean":
        return _mean_rows
    return _clone_rows


def _mean_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().mean(dim=0)


def _clone_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.clone()


def output_dtype(job: Job) -> torch.dtype:
    return torch.float16 if job.output.dtype == "float16" else torch.float32


HOST_THREADS = 4
"""The most torch CPU threads a process that feeds a GPU uses (see `host_threads`)."""


@contextlib.contextmanager
def host_threads(device: torch.device) -> Iterator[None]:
    """Limit torch's CPU threads while this process feeds a GPU.

    Its own CPU work is copying items into batches and send buffers. The decode workers
    already run one per core, and torch's default of one OpenMP thread per core, which
    spin between parallel regions, takes cores from them and from the other ranks: on
    2 x H200 with 32 cores, `--gpus 2` ran at 167.5 images/s with the default and 183.6
    with 4 threads (benchmarks/RESULTS.md). On a CPU the encoder itself needs the threads.
    """
    before = torch.get_num_threads()
    if device.type == "cuda":
        torch.set_num_threads(min(before, HOST_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class StageClock:
    """Seconds spent per stage, so the progress bar and stats can name the bottleneck."""

    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[stage] += now - since
        return now

    def bottleneck(self) -> str:
        return max(self.seconds, key=self.seconds.__getitem__) if self.seconds else "-"


@dataclass
class PendingWindow:
    """A window whose batches are enqueued on the device; its results arrive by `ready`
    (and, data parallel, from the other ranks by `spreading`)."""

    window: list[Decoded]
    positions: list[int]
    shapes: list[tuple[int, ...]]
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    failures: dict[int, str]
    spreading: distributed.Spreading | None = None


class WindowEncoder:
    """Encodes a window and brings the embeddings back to the host.

    Split in two so the device never waits for the host: `enqueue` launches every batch
    of window k and an asynchronous device-to-host copy of its results; the caller then
    finalises window k-1 (waits for its copy, builds rows) while the device works on k.
    With a `spread` (data parallel, rank 0) enqueue first sends the other ranks their
    shares of window k and encodes only its own; finalize adds the other ranks' results.
    """

    def __init__(self, encoder: BatchEncoder, job: Job, spread: distributed.Spread | None = None) -> None:
        self.encoder = encoder
        self.spread = spread
        self.reduce = reducer(job.output.pooling)
        self.out_dtype = output_dtype(job)

    @property
    def hit_rate(self) -> float:
        return (self.spread or self.encoder).hit_rate

    def stats(self) -> dict[str, Any]:
        return (self.spread or self.encoder).stats()

    def enqueue(self, window: list[Decoded]) -> PendingWindow:
        items = {p: d.item for p, d in enumerate(window) if d.item is not None}
        own, spreading = (sorted(items), None) if self.spread is None else self.spread.submit(items)
        outputs, reasons = self.encoder.encode([items[p] for p in own], self.reduce)
        results = {p: r for p, r in zip(own, outputs) if r is not None}
        failures = {p: f for p, f in zip(own, reasons) if f is not None}
        positions = sorted(results)
        shapes = [tuple(results[p].shape) for p in positions]
        host, event = self._to_host([results[p] for p in positions])
        if spreading is not None:
            spreading.clock.stop()
        return PendingWindow(window, positions, shapes, host, event, failures, spreading)

    def finalize(self, pending: PendingWindow) -> dict[int, np.ndarray]:
        """Wait for the window's copy (and the other ranks' results); embeddings by window position."""
        if pending.ready is not None:
            pending.ready.synchronize()
        out: dict[int, np.ndarray] = {}
        if pending.host is not None:
            out.update(zip(pending.positions, cut_rows(pending.host.numpy(), pending.shapes)))
        if pending.spreading is not None and self.spread is not None:
            embeddings, failures = self.spread.collect(pending.spreading)
            out.update(embeddings)
            pending.failures.update(failures)
        return out

    def _to_host(self, results: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        if not results:
            return None, None
        host = rows_to_host(results, results[0].shape[-1], self.out_dtype)
        if results[0].device.type != "cuda":
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event


class Runner:
    """Runs one shard of a job end to end.

    With a `cluster` (data parallel, this process is its rank 0) the pipeline is the
    same; only the encoder spreads each window over the ranks.
    """

    def __init__(
        self, job: Job, shard: Shard = Shard(), overwrite: bool = False, cluster: distributed.Cluster | None = None
    ) -> None:
        self.job = job
        self.shard = shard
        self.overwrite = overwrite
        self.cluster = cluster
        self.clock = StageClock()
        self.errors = 0
        self.rows_done = 0

    def run(self) -> dict[str, Any]:
        """Run (or resume) the shard; returns its statistics. Raises JobError if it cannot run."""
        device = self.cluster.device if self.cluster else resolve_device(self.job.runtime.device)
        with host_threads(device):
            return self._run(device)

    def _run(self, device: torch.device) -> dict[str, Any]:
        start = time.perf_counter()
        listing = reader.scan_input(self.job.input)
        fragments = reader.assign_shards(listing.fragments, self.shard.count)[self.shard.index]
        first_row, end_row = self._row_range(fragments)
        checkpoint = self._open_checkpoint(first_row, end_row)
        if checkpoint.is_done():
            logger.info("shard %d/%d is already complete in %s", self.shard.index, self.shard.count, self.job.output.path)
            return checkpoint.finished_stats()
        if checkpoint.resume_row == end_row:
            return self._finish_without_model(checkpoint, time.perf_counter() - start)
        adapter = load_encoder_adapter(self.job, device)
        options = self._decode_options(adapter)
        batches = build_encoder(self.job, adapter, device)
        batches.capture()
        resumed = checkpoint.resume_row
        if resumed > first_row:
            logger.info("resuming shard %d at row %d (%d rows committed)", self.shard.index, resumed, resumed - first_row)
        schema = output_schema(listing.id_type, adapter.embed_dim, self.job.output.pooling, self.job.output.dtype)
        rows = reader.read_rows(self.job.input, fragments, start_row=resumed, stop_row=end_row)
        preprocess = adapter.preprocessor()
        fn = functools.partial(decode_row, options=options, preprocess=preprocess)
        encoder = WindowEncoder(batches, self.job, self._spread(batches, adapter))
        workers = resolve_workers(self.job.runtime.workers)
        in_flight = 2 * self.job.batching.window
        preload = (__name__, type(preprocess).__module__)
        with media.DecodePool(fn, workers, self.job.runtime.decode_timeout, in_flight, preload) as pool:
            setup = time.perf_counter() - start
            with self._progress(end_row - resumed) as bar, PartSink(checkpoint, schema) as parts:
                self._pipeline(pool, rows, encoder, parts, bar)
        seconds = time.perf_counter() - start
        stats = self._stats(checkpoint, encoder, device, seconds, resumed)
        stats["setup_seconds"] = round(setup, 3)
        stats["pipeline_seconds"] = round(seconds - setup, 3)
        checkpoint.finish(stats)
        batches.clear()
        return stats

    def _pipeline(
        self, pool: media.DecodePool, rows: Iterable[reader.InputRow], encoder: WindowEncoder, parts: "PartSink", bar: tqdm
    ) -> None:
        """decode (workers) | enqueue window k (device) | finalise window k-1 | write (thread)."""
        pending: PendingWindow | None = None
        for window in self._windows(pool, rows):
            since = time.perf_counter()
            current = encoder.enqueue(window)
            self.clock.add("host", since)
            if pending is not None:
                self._emit(pending, encoder, parts, bar)
            pending = current
        if pending is not None:
            self._emit(pending, encoder, parts, bar)

    def _emit(self, pending: PendingWindow, encoder: WindowEncoder, parts: "PartSink", bar: tqdm) -> None:
        since = time.perf_counter()
        embeddings = encoder.finalize(pending)
        since = self.clock.add("device", since)
        out = [
            self._output_row(d, embeddings.get(pos), pending.failures.get(pos)) for pos, d in enumerate(pending.window)
        ]
        parts.add(out)
        self.clock.add("write", since)
        self._report(bar, len(out), encoder)

    def _finish_without_model(self, checkpoint: Checkpoint, seconds: float) -> dict[str, Any]:
        """An empty shard, or one whose rows are all committed but whose success marker
        was not written: there is nothing to encode, so no model is loaded (under SLURM
        an empty array task would otherwise hold a GPU to load one)."""
        stats = {
            "shard": self.shard.index,
            "num_shards": self.shard.count,
            "rows": checkpoint.end_row - checkpoint.first_row,
            "rows_this_run": 0,
            "errors": sum(p.errors for p in checkpoint.parts),
            "seconds": round(seconds, 3),
            "items_per_second": 0.0,
            "graph_hits": 0,
            "graph_misses": 0,
            "hit_rate": 0.0,
            "num_graphs": 0,
            "token_budgets": [],
            "padding_waste": 0,
        }
        checkpoint.finish(stats)
        return stats

    def _row_range(self, fragments: list[reader.Fragment]) -> tuple[int, int]:
        if fragments:
            return fragments[0].first_row, fragments[-1].first_row + fragments[-1].num_rows
        return 0, 0

    def _open_checkpoint(self, first_row: int, end_row: int) -> Checkpoint:
        directory = Path(self.job.output.path)
        if "://" in self.job.output.path:
            raise JobError(f"output.path {self.job.output.path!r} must be a local or mounted directory")
        try:
            return open_checkpoint(
                directory,
                self.shard.index,
                self.shard.count,
                first_row,
                end_row,
                self.job.output.rows_per_part,
                job_fingerprint(self.job),
                self.overwrite,
            )
        except OSError as exc:
            raise JobError(f"cannot write to output.path {directory}: {exc.strerror or exc}") from None

    def _spread(self, batches: BatchEncoder, adapter: EncoderAdapter) -> distributed.Spread | None:
        if self.cluster is None:
            return None
        return distributed.Spread(self.cluster, batches, adapter.embed_dim, output_dtype(self.job))

    def _decode_options(self, adapter: EncoderAdapter) -> media.DecodeOptions:
        preprocess = adapter.preprocessor()
        if self.job.video.max_frames < preprocess.frame_multiple:
            raise JobError(
                f"video.max_frames = {self.job.video.max_frames} is below the model's temporal patch size "
                f"{preprocess.frame_multiple}; set video.max_frames to at least {preprocess.frame_multiple}"
            )
        frame_pixels = getattr(preprocess, "video_max_pixels", None)
        return media.DecodeOptions(
            modality=self.job.input.modality,
            max_image_pixels=self.job.preprocess.max_image_pixels,
            fps=self.job.video.fps,
            max_frames=self.job.video.max_frames,
            frame_multiple=preprocess.frame_multiple,
            max_frame_pixels=4 * frame_pixels if frame_pixels else None,
        )

    def _windows(self, pool: media.DecodePool, rows: Iterable[reader.InputRow]) -> Iterator[list[Decoded]]:
        """Decoded rows in input order, in windows of `window_sizes(batching.window)`.

        The pool returns a bare MediaError for an item it had to cut off (timeout, crash);
        the queue of submitted rows tells which row that was.
        """
        sizes = window_sizes(self.job.batching.window)
        size = next(sizes)
        submitted: collections.deque[reader.InputRow] = collections.deque()

        def track() -> Iterator[reader.InputRow]:
            for row in rows:
                submitted.append(row)
                yield row

        window: list[Decoded] = []
        since = time.perf_counter()
        for result in pool.imap(track()):
            row = submitted.popleft()
            if isinstance(result, media.MediaError):
                result = Decoded(row.row, row.id, None, None, str(result))
            window.append(result)
            if len(window) >= size:
                self.clock.add("decode", since)
                yield window
                window, size = [], next(sizes)
                since = time.perf_counter()
        if window:
            self.clock.add("decode", since)
            yield window

    def _output_row(self, d: Decoded, embedding: np.ndarray | None, failure: str | None) -> OutputRow:
        error = d.error or failure
        if error is not None:
            self.errors += 1
        item = d.item
        return OutputRow(
            row=d.row,
            id=d.id,
            modality=d.modality,
            tokens=item.tokens if item else None,
            frames=item.frames if item else None,
            embedding=None if error else embedding,
            error=error,
        )

    def _progress(self, total: int) -> tqdm:
        return tqdm(
            total=total,
            unit="row",
            desc=f"shard {self.shard.index}/{self.shard.count}",
            disable=not self.job.runtime.progress,
            dynamic_ncols=True,
        )

    def _report(self, bar: tqdm, count: int, encoder: WindowEncoder) -> None:
        self.rows_done += count
        bar.update(count)
        bar.set_postfix(
            errors=self.errors, hit=f"{encoder.hit_rate:.0%}", slowest=self.clock.bottleneck(), refresh=False
        )

    def _stats(
        self, checkpoint: Checkpoint, encoder: WindowEncoder, device: torch.device, seconds: float, resumed: int
    ) -> dict[str, Any]:
        stats = {
            "shard": self.shard.index,
            "num_shards": self.shard.count,
            "rows": checkpoint.end_row - checkpoint.first_row,
            "rows_this_run": self.rows_done,
            "resumed_from_row": resumed,
            "errors": sum(p.errors for p in checkpoint.parts),
            "device": str(device),
            "model": self.job.model.path,
            "seconds": round(seconds, 3),
            "items_per_second": round(self.rows_done / seconds, 3) if seconds > 0 else 0.0,
            "stage_seconds": {k: round(v, 3) for k, v in self.clock.seconds.items()},
        }
        stats.update(encoder.stats())
        return stats


class PartSink:
    """Cuts the ordered row stream into the checkpoint's parts and commits each one.

    Parts are encoded and written on one writer thread, so Parquet encoding overlaps the
    next window's work; one thread keeps the order, and at most one window is in flight
    (`add` first waits for the previous one, re-raising its failure).
    """

    def __init__(self, checkpoint: Checkpoint, schema: Any) -> None:
        self.checkpoint = checkpoint
        self.schema = schema
        self.buffer: list[OutputRow] = []
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedjob-writer")
        self._last: concurrent.futures.Future | None = None

    def __enter__(self) -> "PartSink":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type is None:
                self._submit(self._close)
            if self._last is not None and exc_type is None:
                self._last.result()
        finally:
            self._thread.shutdown(wait=True)

    def add(self, rows: list[OutputRow]) -> None:
        self._submit(lambda: self._add(rows))

    def _submit(self, work: Any) -> None:
        if self._last is not None:
            self._last.result()
        self._last = self._thread.submit(work)

    def _add(self, rows: list[OutputRow]) -> None:
        self.buffer.extend(rows)
        while self.buffer:
            first, end = self.checkpoint.part_bounds(self.checkpoint.next_part)
            if len(self.buffer) < end - first:
                return
            self._commit(self.buffer[: end - first], first, end)
            self.buffer = self.buffer[end - first :]

    def _close(self) -> None:
        """Write the last, shorter part; it must end at the shard's last row."""
        if self.buffer:
            first, end = self.checkpoint.part_bounds(self.checkpoint.next_part)
            self._commit(self.buffer, first, end)
            self.buffer = []

    def _commit(self, rows: list[OutputRow], first: int, end: int) -> None:
        if rows[0].row != first or rows[-1].row != end - 1 or len(rows) != end - first:
            raise RuntimeError(f"part rows {rows[0].row}..{rows[-1].row} do not match [{first}, {end})")
        part = self.checkpoint.next_part
        name = part_name(self.checkpoint.shard, part)
        write_part(self.checkpoint.directory, name, rows, self.schema)
        self.checkpoint.commit(PartRecord(part, name, first, end, sum(r.error is not None for r in rows)))


def run_job(job: Job, shard: Shard = Shard(), overwrite: bool = False) -> dict[str, Any]:
    """Run one shard of `job` on `runtime.gpus` ranks; the statistics it wrote.

    Ranks other than 0 (under torchrun) return an empty dict: rank 0 writes everything.
    """
    layout = distributed.resolve_layout(job.runtime.gpus, resolve_device(job.runtime.device))
    if layout.world_size == 1:
        return Runner(job, shard, overwrite).run()
    with distributed.Cluster.start(layout, serve_rank, (job,)) as cluster:
        if cluster.rank == 0:
            return Runner(job, shard, overwrite, cluster).run()
        serve_rank(cluster, job)
        return {}


def serve_rank(cluster: distributed.Cluster, job: Job) -> None:
    """A rank other than 0: the same adapter, plan and graphs on its own device, serving
    rank 0's windows until it says stop."""
    with host_threads(cluster.device):
        adapter = load_encoder_adapter(job, cluster.device)
        encoder = build_encoder(job, adapter, cluster.device)
        encoder.capture()
        distributed.serve(cluster, encoder, reducer(job.output.pooling), adapter.embed_dim, output_dtype(job))
        encoder.clear()
