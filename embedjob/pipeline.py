"""Wires the stages of one shard: read -> decode -> pack -> encode -> write.

Every GPU runs a whole pipeline (`RankPipeline`), alone or beside others (`--gpus N`,
cluster.py): it takes chunks of the shard's rows in row order as it needs them,
reads them, decodes them in its own worker processes, encodes windows of
`batching.window` decoded items (packed and replayed through its own graphs) and hands
every finished chunk's rows back as a columnar `RowBlock`. The process of rank 0 also
writes: a `Coordinator` hands out the chunks and gives their rows, in chunk order, to
the writer thread, which cuts them into the checkpoint's parts. So the output is in
input order while no process holds more than a bounded number of chunks.

Every input row becomes exactly one output row: decode and preprocess failures become
error rows in the workers, encode failures become error rows here (after retrying the
failed batch one item at a time), and rows already committed by an earlier run are
skipped through the checkpoint.

The main thread of a rank only launches device work and moves whole windows: pooling
is one reduction per batch on the device (`graphs.pool_rows`), a window's results
come to the host in one copy, and output rows are built with array operations; the
per-item work (decode, resize, patching, metadata) is done by the decode workers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import multiprocessing
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from embedjob.config import Job, JobError
from embedjob.decode import DecodedVideo, DecodeOptions, MediaError, decode, read_source, worker_preload
from embedjob.encoders import EncoderAdapter, EncoderInput, load_adapter
from embedjob.encoders.registry import ADAPTER_MODULES
from embedjob.engine.defs import Encoded, Encoder, GraphStats
from embedjob.engine.encode import build_encoder
from embedjob.io import reader
from embedjob.io.checkpoint import Checkpoint, PartRecord, count_codes, job_fingerprint, open_checkpoint
from embedjob.io.writer import ErrorRateExceeded, RowBlock, output_schema, part_name, write_part
from embedjob.parallel.cluster import Cluster, Coordinator, cpu_share, resolve_layout
from embedjob.report.counts import codes_text, count_errors, plural, route_warnings
from embedjob.timeline import Timeline
from embedjob.workers.pool import IDLE, DecodePool, start_worker_server

logger = logging.getLogger(__name__)

CHUNK_ROWS = 64
"""Rows a rank takes at a time (fewer when `batching.window` is smaller). Small, so the
ranks finish close together; a take is one short message, so small costs nothing."""

WORKER_MODULES = worker_preload([__name__, *ADAPTER_MODULES])
"""What decode workers import: the decoders, this module (`decode_row`) and every family's
preprocessing, in the order `worker_preload` gives them."""

LINGER = 0.05
"""Seconds without a decoded item after which a rank encodes what it has: its input
may be held back until rows it holds are written (see `Coordinator`)."""


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


# --- decode (in the workers) --------------------------------------------------------


@dataclass
class Decoded:
    """A row after the decode stage: a preprocessed item or an error, never both, the
    seconds the worker spent on it, and the row's copied input columns (`extra`)."""

    row: int
    id: Any
    modality: str | None
    item: EncoderInput | None
    error: str | None
    seconds: float = 0.0
    extra: tuple[Any, ...] = ()


@functools.cache
def _set_up_worker() -> None:
    """Decode workers run one per core; torch's default of one thread per core inside each
    of them would oversubscribe the machine many times over. A worker's stderr is the
    job's: the libraries' warnings (torch, Pillow, decord) are not for the user there,
    and embedjob itself reports through logging and error rows, never warnings."""
    if multiprocessing.parent_process() is not None:
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")


def decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded:
    """Worker function: bytes (or a path) -> decoded media -> EncoderInput, or an error row."""
    _set_up_worker()
    start = time.perf_counter()
    decoded = _decode_row(row, options, preprocess)
    decoded.seconds = time.perf_counter() - start
    decoded.extra = row.extra
    return decoded


def _decode_row(row: reader.InputRow, options: DecodeOptions, preprocess: Any) -> Decoded:
    fixed = None if options.modality == "auto" else options.modality
    if row.error is not None:
        return Decoded(row.row, row.id, fixed, None, row.error)
    try:
        data = row.data if row.data is not None else read_source(row.uri or "", options.media_root, options.max_item_bytes)
        decoded = decode(data, options)
    except MediaError as err:
        return Decoded(row.row, row.id, fixed, None, str(err))
    modality = "video" if isinstance(decoded, DecodedVideo) else "image"
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


# --- per process settings -----------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """The job's device, with its index on CUDA (statistics name the GPU each rank used)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("runtime.device is 'cuda' but no CUDA device is visible; use runtime.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def device_name(device: torch.device) -> str:
    """The device as a report names it: the GPU's model, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({_cpu_model() or platform.machine() or 'unknown'})"


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux); None elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


VERSIONED = ("torch", "torchvision", "transformers", "pyarrow", "numpy")
"""The libraries whose versions the statistics record: what the embeddings depend on."""


def software_versions() -> dict[str, str]:
    """embedjob's, Python's and VERSIONED's versions, so a report says what made an output."""
    from embedjob import __version__

    versions = {"embedjob": __version__, "python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def resolve_workers(value: str | int, world_size: int = 1) -> int:
    """Decode workers of one rank. "auto": this rank's share of the cores the process
    may run on (under SLURM, the task's allocation, not the whole node)."""
    return cpu_share(world_size) if value == "auto" else int(value)


def load_encoder_adapter(job: Job, device: torch.device) -> EncoderAdapter:
    """The job's adapter on `device`.

    A checkpoint that cannot serve the job (not a checkpoint, another family) is a job
    error: the user must change model.path or model.family.
    """
    try:
        return load_adapter(job, device)
    except (ValueError, OSError) as exc:
        raise JobError(f"model.path {job.model.path!r} (model.family {job.model.family!r}): {exc}") from None


def compile_if_asked(job: Job, adapter: EncoderAdapter) -> None:
    """Compile the adapter's blocks when the job asks for it (CUDA only); the work
    happens at the first forward, i.e. when the graphs are captured."""
    if not job.batching.compile:
        return
    if adapter.device.type == "cuda":
        adapter.compile(dynamic=True)
    else:
        logger.info("batching.compile applies to CUDA only; running uncompiled on %s", adapter.device)


def _import_compiler() -> None:
    """Import torch's compiler (seconds of Python) beside the model load, which mostly
    waits on file reads and copies to the GPU, instead of after it."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401


def output_dtype(job: Job) -> torch.dtype:
    return torch.float16 if job.output.dtype == "float16" else torch.float32


def decode_options(job: Job, adapter: EncoderAdapter) -> DecodeOptions:
    """What the decode workers need from the job and the model's preprocessing."""
    preprocess = adapter.preprocessor()
    if job.video.max_frames < preprocess.frame_multiple:
        raise JobError(
            f"video.max_frames = {job.video.max_frames} is below the model's temporal patch size "
            f"{preprocess.frame_multiple}; set video.max_frames to at least {preprocess.frame_multiple}"
        )
    frame_pixels = getattr(preprocess, "video_max_pixels", None)
    return DecodeOptions(
        modality=job.input.modality,
        max_image_pixels=job.preprocess.max_image_pixels,
        fps=job.video.fps,
        max_frames=job.video.max_frames,
        frame_multiple=preprocess.frame_multiple,
        max_frame_pixels=4 * frame_pixels if frame_pixels else None,
        frame_pixel_limit=job.video.max_pixels_per_frame,
        video_pixel_limit=job.video.max_total_pixels,
        media_root=reader.local_media_root(job.input),
        max_item_bytes=job.input.max_item_bytes,
    )


HOST_THREADS = 4
"""The most torch CPU threads a process that feeds a GPU uses (see `host_threads`)."""


GIL_SWITCH_SECONDS = 0.0005
"""CPython's GIL switch interval while a pipeline runs (its default is 0.005 s)."""


@contextlib.contextmanager
def host_threads(device: torch.device) -> Iterator[None]:
    """Settle this process's threads for the pipeline, and restore them after.

    - torch's CPU threads are limited while it feeds a GPU: its own CPU work is copying
      items into batches. The decode workers already run one per core, and torch's
      default of one OpenMP thread per core, which spin between parallel regions, takes
      cores from them and from the other ranks (benchmarks/RESULTS.md measured it). On
      a CPU the encoder itself needs the threads.
    - The GIL is handed over sooner. The decode pool's service thread releases it at
      every send, receive and wait, several times per item, and each time must get it
      back from whichever thread runs Python meanwhile (the main thread packing, the
      writer, the chunk reader): at the default interval that is up to 5 ms per
      hand-over, which bounds the whole pipeline's decode rate
      (`benchmarks/decode_pool.py`).
    """
    before, interval = torch.get_num_threads(), sys.getswitchinterval()
    if device.type == "cuda":
        torch.set_num_threads(min(before, HOST_THREADS))
    sys.setswitchinterval(min(interval, GIL_SWITCH_SECONDS))
    try:
        yield
    finally:
        torch.set_num_threads(before)
        sys.setswitchinterval(interval)


# --- timing -------------------------------------------------------------------------


@dataclass
class StageClock:
    """Seconds per stage of one thread, so the statistics say where its time went."""

    seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))

    def add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[stage] += now - since
        return now



class BusyClock:
    """How long one window occupied its device, from construction to `stop`.

    On a GPU it is the time between two events on the stream, so a window whose work
    queued behind the previous window's is not counted twice and the host never waits
    to measure it; on a CPU the encode is synchronous and wall seconds are the same.
    """

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._start = time.perf_counter()
        self._seconds = 0.0
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start

    def seconds(self) -> float:
        """The measured seconds; on a GPU, waits until the window's work is done."""
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


# --- one window on the device -------------------------------------------------------


@dataclass
class PendingWindow:
    """A window whose batches are enqueued on the device; `host` holds its rows once
    `busy` has stopped on the device. `started_at`: when its first batch was launched
    (wall clock, for the time series)."""

    window: list[Decoded]
    encoded: Encoded
    host: torch.Tensor
    busy: BusyClock
    started_at: float


class WindowEncoder:
    """Encodes a window and brings its rows back to the host as row blocks.

    Split in two so the device never waits for the host: `enqueue` launches every batch
    of window k and one asynchronous device-to-host copy of all its rows; the caller
    then finalises window k-1 (waits for its copy, builds its rows) while the device
    works on k.
    """

    def __init__(self, encoder: Encoder, job: Job, device: torch.device) -> None:
        self.encoder = encoder
        self.pooling = job.output.pooling
        self.normalize = job.output.normalize
        self.columns = job.output.columns
        self.dtype = output_dtype(job)
        self.device = device

    def enqueue(self, window: list[Decoded]) -> PendingWindow:
        started = time.time()
        busy = BusyClock(self.device)
        items = [d.item for d in window if d.item is not None]
        encoded = self.encoder.encode(items, self.pooling, self.dtype)
        if self.normalize:
            encoded.rows = l2_normalize(encoded.rows)
        host = _to_host(encoded.rows)
        busy.stop()
        return PendingWindow(window, encoded, host, busy, started)

    def finalize(self, pending: PendingWindow) -> tuple[list[RowBlock], float]:
        """The window's rows as blocks of consecutive rows, and its device seconds."""
        seconds = pending.busy.seconds()
        return _row_blocks(pending.window, pending.encoded, pending.host.numpy(), self.columns), seconds


def l2_normalize(rows: torch.Tensor) -> torch.Tensor:
    """Each row divided by its L2 norm (a zero row stays zero), on the rows' device, in
    one call per window: computed in float32, whatever the output dtype, so float16
    rows do not lose the precision their norm needs."""
    return torch.nn.functional.normalize(rows.float(), dim=-1).to(rows.dtype)


def _to_host(rows: torch.Tensor) -> torch.Tensor:
    """`rows` on the host: from a GPU, one copy into page-locked memory queued behind
    the work that makes them (read it once that work is done)."""
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    return host


def _row_blocks(window: list[Decoded], encoded: Encoded, rows: np.ndarray, columns: list[str]) -> list[RowBlock]:
    """The window's output rows, with the copied input `columns`, cut where its row
    numbers jump (a rank's window may span chunks that other ranks' chunks separate)."""
    errors = [d.error for d in window]
    counts = np.zeros(len(window), dtype=np.int64)
    starts: list[int] = []
    item = 0
    for position, d in enumerate(window):
        if d.item is None:
            continue
        failure = encoded.failures[item]
        if failure is None:
            counts[position] = encoded.counts[item]
            starts.append(encoded.offsets[item])
        else:
            errors[position] = failure
        item += 1
    lengths = counts[counts > 0]
    first = np.asarray(starts, dtype=np.int64)
    order = np.repeat(first - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
    vectors = rows[order] if len(order) else np.zeros((0, rows.shape[1]), dtype=rows.dtype)
    whole = RowBlock(
        window[0].row,
        [d.id for d in window],
        [d.modality for d in window],
        [d.item.tokens if d.item is not None else None for d in window],
        [d.item.frames if d.item is not None else None for d in window],
        errors,
        counts,
        vectors,
        [d.item.token_grid if d.item is not None else None for d in window],
        {name: [d.extra[k] for d in window] for k, name in enumerate(columns)},
    )
    numbers = np.fromiter((d.row for d in window), dtype=np.int64, count=len(window))
    cuts = [0, *(np.flatnonzero(np.diff(numbers) != 1) + 1).tolist(), len(window)]
    if len(cuts) == 2:
        return [whole]
    return [dataclasses.replace(whole.slice(a, b), first_row=int(numbers[a])) for a, b in zip(cuts, cuts[1:])]


class ChunkAssembler:
    """Puts a rank's finished rows back into the chunks it took and hands each chunk on
    once all its rows are there.

    A rank takes chunks in row order and its windows keep that order, so rows arrive
    in order: the assembler only cuts at chunk ends. `taken` is filled by the thread
    that reads the chunks, always before their rows can be decoded.
    """

    def __init__(self, taken: collections.deque[reader.Chunk], deliver: Callable[[int, RowBlock], None]) -> None:
        self.taken = taken
        self.deliver = deliver
        self._chunk: reader.Chunk | None = None
        self._parts: list[RowBlock] = []
        self._have = 0

    def add(self, block: RowBlock) -> None:
        while len(block):
            if self._chunk is None:
                self._chunk = self.taken.popleft()
            chunk = self._chunk
            if block.first_row != chunk.first_row + self._have:
                raise RuntimeError(f"row {block.first_row} arrived for chunk {chunk.index} at row {chunk.first_row + self._have}")
            take = min(len(block), chunk.end_row - block.first_row)
            self._parts.append(block.slice(0, take) if take < len(block) else block)
            self._have += take
            block = block.slice(take, len(block))
            if self._have == chunk.rows:
                self.deliver(chunk.index, RowBlock.concat(self._parts))
                self._chunk, self._parts, self._have = None, [], 0


# --- one rank's pipeline ------------------------------------------------------------


@dataclass
class RankStats:
    """What one rank did, for the shard's statistics (sent to rank 0 by the others)."""

    rank: int
    device: str
    device_name: str = ""
    rows: int = 0
    items: int = 0
    load: int = 0
    chunks: int = 0
    busy_seconds: float = 0.0
    decode_seconds: float = 0.0
    setup: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None
    ready_at: float | None = None
    graphs: GraphStats | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def launch_seconds(self) -> float:
        """Main-thread seconds inside graph replays and eager forwards: a launch blocks
        once the GPU's queue is full, so on a GPU this is mostly the device's time; on a
        CPU it is the encoder's compute."""
        return (self.graphs or GraphStats()).host_seconds.get("launch", 0.0)

    def to_dict(self) -> dict[str, Any]:
        graphs = self.graphs or GraphStats()
        return {
            "rank": self.rank,
            "device": self.device,
            "device_name": self.device_name,
            "rows": self.rows,
            "items": self.items,
            "load": self.load,
            "chunks": self.chunks,
            "busy_seconds": round(self.busy_seconds, 3),
            "decode_seconds": round(self.decode_seconds, 3),
            "host_seconds": round(self.stages.get("host", 0.0) - self.launch_seconds, 3),
            "launch_seconds": round(self.launch_seconds, 3),
            "host_cpu_seconds": round(self.stages.get("host cpu", 0.0), 3),
            "encode_host_seconds": {k: round(v, 3) for k, v in sorted(graphs.host_seconds.items())},
            "setup_seconds": round(self.ready_at - self.started_at, 3) if self.ready_at and self.started_at else 0.0,
            "setup": {k: round(v, 3) for k, v in self.setup.items()},
            "waits": {k: round(v, 3) for k, v in self.waits.items()},
            "graph_hits": graphs.hits,
            "graph_misses": graphs.misses,
            "hit_rate": round(graphs.hit_rate, 6),
            "padding_waste": graphs.padding_waste,
            "started_at": round(self.started_at, 3) if self.started_at else None,
            "ready_at": round(self.ready_at, 3) if self.ready_at else None,
            "timeline": self.timeline.to_dict(),
        }


class RankPipeline:
    """One rank's whole pipeline over the chunks it takes (see the module docstring).

    `take` gives the next chunk (None: no more), `deliver(index, block)` takes a
    finished chunk's rows. The model is loaded only once a first chunk is in hand, so a
    rank with nothing to do (a finished or empty shard) never loads one. The decode
    workers start reading and decoding before the graphs are captured, so capture and
    the first decode overlap.
    """

    def __init__(
        self,
        job: Job,
        device: torch.device,
        rank: int,
        workers: int,
        take: Callable[[], reader.Chunk | None],
        deliver: Callable[[int, RowBlock], None],
        ready: Callable[[], None],
    ) -> None:
        self.job = job
        self.ready = ready
        self.device = device
        self.workers = workers
        self.take = take
        self.deliver = deliver
        self.stats = RankStats(rank, str(device), device_name(device))
        self.clock = StageClock()
        self.reading = StageClock()
        self.encoder: Any = None
        self.options: DecodeOptions | None = None
        self.preprocess: Any = None
        self._unencoded = 0
        self._device_free = 0.0

    def prepare(self) -> None:
        """Load the model and build the encoder; a job the model cannot serve (a bad
        checkpoint, budgets the model cannot take) stops here, before any row is read."""
        since = time.perf_counter()
        self.stats.started_at = time.time()
        start_worker_server(WORKER_MODULES)
        if self.job.batching.compile and self.device.type == "cuda":
            threading.Thread(target=_import_compiler, name="embedjob-import", daemon=True).start()
        adapter = load_encoder_adapter(self.job, self.device)
        since = self._setup("load", since)
        compile_if_asked(self.job, adapter)
        self.options = decode_options(self.job, adapter)
        self.preprocess = adapter.preprocessor()
        self.encoder = build_encoder(self.job, adapter, self.device)
        self._setup("plan", since)

    def run(self) -> RankStats:
        """Take chunks until there are none; `prepare`s first if the caller did not."""
        first = self.take()
        if first is None:
            return self.stats
        if self.encoder is None:
            self.prepare()
        taken: collections.deque[reader.Chunk] = collections.deque()
        submitted: collections.deque[reader.InputRow] = collections.deque()
        pool, stream = self._start_decoding_while_capturing(self._rows(first, taken, submitted))
        with pool:
            self.stats.ready_at = time.time()
            self.stats.timeline.skip_to(self.stats.ready_at)
            self.ready()
            windows = WindowEncoder(self.encoder, self.job, self.device)
            self._pipeline(self._windows(stream, submitted), windows, ChunkAssembler(taken, self.deliver))
        self._finish()
        self.encoder.clear()
        return self.stats

    def _start_decoding_while_capturing(self, rows: Iterator[reader.InputRow]) -> tuple[DecodePool, Iterator[Any]]:
        """Start the decode workers (and their first rows) on a thread while this one
        compiles and captures the graphs: the two take seconds each and need nothing of
        each other (the workers' thread makes no CUDA call, which capture forbids)."""
        fn = functools.partial(decode_row, options=self.options, preprocess=self.preprocess)
        in_flight = 2 * self.job.batching.window

        def start() -> tuple[DecodePool, Iterator[Any]]:
            since = time.perf_counter()
            pool = DecodePool(fn, self.workers, self.job.runtime.decode_timeout, in_flight, WORKER_MODULES, error=MediaError)
            try:
                stream = pool.imap(rows, idle=LINGER)
            except BaseException:
                pool.close()
                raise
            self._setup("workers", since)
            return pool, stream

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedjob-start") as starter:
            starting = starter.submit(start)
            since = time.perf_counter()
            try:
                self.encoder.capture()
            except BaseException:
                starting.result()[0].close()
                raise
            self._setup("capture", since)
            return starting.result()

    def rows_done(self) -> int:
        """Rows whose outcome is known: those without an item (decode errors) in the
        windows sent to the device, and every item encoded so far (a batch's items once
        it has run on a CPU, once it is launched on a GPU, whose queue holds a few
        batches). Read from the progress thread: plain integers, no lock needed."""
        encoder = self.encoder
        return self._unencoded + (_items_encoded(encoder) if encoder is not None else 0)

    def _setup(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.stats.setup[stage] = now - since
        return now

    def _rows(
        self, first: reader.Chunk, taken: collections.deque[reader.Chunk], submitted: collections.deque[reader.InputRow]
    ) -> Iterator[reader.InputRow]:
        """The rows of every chunk this rank takes, in order (runs on the decode pool's
        task thread, so waiting for a chunk never stops the decoding of rows in hand)."""
        chunk: reader.Chunk | None = first
        while chunk is not None:
            taken.append(chunk)
            self.stats.chunks += 1
            since = time.perf_counter()
            rows = reader.read_rows(self.job.input, chunk.fragments, chunk.first_row, chunk.end_row, self.job.output.columns)
            for row in rows:
                since = self.reading.add("reading rows", since)
                submitted.append(row)
                yield row
                since = time.perf_counter()
            chunk = self.take()
            self.reading.add("waiting for a chunk", since)

    def _windows(self, stream: Iterator[Any], submitted: collections.deque[reader.InputRow]) -> Iterator[list[Decoded] | None]:
        """Decoded rows in order, in windows of `window_sizes(batching.window)`; a short
        window when decoding stalls for LINGER seconds, and None when it stalls with
        nothing in hand (the caller then finishes what it holds).

        The pool returns a bare MediaError for an item it had to cut off (timeout,
        crash); the queue of submitted rows tells which row that was.
        """
        sizes = window_sizes(self.job.batching.window)
        size = next(sizes)
        window: list[Decoded] = []
        since = time.perf_counter()
        for result in stream:
            if result is IDLE:
                self.clock.add("waiting for decode", since)
                if window:
                    yield window
                    window, size = [], next(sizes)
                else:
                    yield None
                since = time.perf_counter()
                continue
            row = submitted.popleft()
            if isinstance(result, MediaError):
                result = Decoded(row.row, row.id, None, None, str(result), extra=row.extra)
            window.append(result)
            if len(window) >= size:
                self.clock.add("waiting for decode", since)
                yield window
                window, size = [], next(sizes)
                since = time.perf_counter()
        self.clock.add("waiting for decode", since)
        if window:
            yield window

    def _pipeline(self, windows: Iterator[list[Decoded] | None], encoder: WindowEncoder, chunks: ChunkAssembler) -> None:
        """decode (workers) | enqueue window k (device) | finalise window k-1 | hand over."""
        pending: PendingWindow | None = None
        for window in windows:
            current = None
            if window is not None:
                since, cpu = time.perf_counter(), time.thread_time()
                self._unencoded += sum(d.item is None for d in window)
                current = encoder.enqueue(window)
                self.clock.add("host", since)
                self.clock.seconds["host cpu"] += time.thread_time() - cpu
            if pending is not None:
                self._emit(pending, encoder, chunks)
            pending = current
        if pending is not None:
            self._emit(pending, encoder, chunks)

    def _emit(self, pending: PendingWindow, encoder: WindowEncoder, chunks: ChunkAssembler) -> None:
        since = time.perf_counter()
        pending.busy.seconds()
        since, cpu = self.clock.add("waiting for the device", since), time.thread_time()
        blocks, busy = encoder.finalize(pending)
        for block in blocks:
            chunks.add(block)
        self.clock.add("host", since)
        self.clock.seconds["host cpu"] += time.thread_time() - cpu
        window = pending.window
        self.stats.busy_seconds += busy
        self.stats.rows += len(window)
        self.stats.decode_seconds += sum(d.seconds for d in window)
        self.stats.items += sum(d.item is not None for d in window)
        self.stats.load += sum(d.item.size for d in window if d.item is not None)
        self._sample(self._device_span(pending.started_at, busy))

    def _device_span(self, launched: float, busy: float) -> tuple[float, float]:
        """When (wall clock) a window ran on the device, as the time series counts it:
        `busy` seconds from its launch or from the end of the window before, whichever
        is later (a device runs one window's work after the other's), ending by now.
        Exact on a CPU, where a window runs while it is launched."""
        end = min(max(launched, self._device_free) + busy, time.time())
        self._device_free = end
        return end - busy, end

    def _sample(self, window: tuple[float, float] | None = None) -> None:
        """Add what this rank did since the last sample to its time series (once per
        window, and once at the end for the last waits): the running totals of its
        statistics, so each series sums to the total `to_dict` reports.

        Launches, graph counts and waits accrue as they happen, so they spread over
        the time since the last sample; a window's rows, device and decode seconds are
        counted when it is handed over, a window later, so they spread over `window`,
        its span on the device (`_device_span`)."""
        now = time.time()
        graphs = self.encoder.graph_stats()
        # The reading thread adds to its clock while this one reads it: a copy first.
        waits = {k: v for k, v in {**self.clock.seconds, **dict(self.reading.seconds)}.items() if not k.startswith("host")}
        launch = graphs.host_seconds.get("launch", 0.0)
        stats = self.stats
        as_they_happen = {
            "host_seconds": self.clock.seconds.get("host", 0.0) - launch,
            "launch_seconds": launch,
            "graph_hits": graphs.hits,
            "graph_misses": graphs.misses,
            "padding_waste": graphs.padding_waste,
            "real_tokens": graphs.real_tokens,
            **waits,
        }
        stats.timeline.advance(now, as_they_happen)
        if window is not None:
            per_window = {"rows": stats.rows, "items": stats.items, "busy_seconds": stats.busy_seconds,
                          "decode_seconds": stats.decode_seconds}
            stats.timeline.advance(window[1], per_window, since=window[0])

    def _finish(self) -> None:
        self.stats.stages = dict(self.clock.seconds)
        self.stats.waits = {k: v for k, v in {**self.clock.seconds, **self.reading.seconds}.items() if not k.startswith("host")}
        self.stats.graphs = self.encoder.graph_stats()
        self.stats.plan = self.encoder.plan_stats()
        self._sample()


def _items_encoded(encoder: Encoder) -> int:
    """Items an encoder has run so far (hits and misses are counted per item)."""
    counts = encoder.graph_stats()
    return counts.hits + counts.misses


# --- the writer (rank 0) ------------------------------------------------------------


class PartSink:
    """Cuts the ordered stream of row blocks into the checkpoint's parts and commits each.

    Blocks must arrive in row order from the checkpoint's resume row on; a part is
    written as soon as its last row has arrived, so at most one part's rows are held.
    """

    def __init__(self, checkpoint: Checkpoint, schema: Any) -> None:
        self.checkpoint = checkpoint
        self.schema = schema
        self.buffer: list[RowBlock] = []
        self.held = 0

    def add(self, block: RowBlock) -> None:
        self.buffer.append(block)
        self.held += len(block)
        while self.buffer:
            first, end = self.checkpoint.part_bounds(self.checkpoint.next_part)
            if self.held < end - first:
                return
            joined = RowBlock.concat(self.buffer)
            self._commit(joined.slice(0, end - first), first, end)
            rest = joined.slice(end - first, len(joined))
            self.buffer, self.held = ([rest] if len(rest) else []), len(rest)

    def close(self) -> None:
        """Write the last, shorter part; it must end at the shard's last row."""
        if self.buffer:
            first, end = self.checkpoint.part_bounds(self.checkpoint.next_part)
            self._commit(RowBlock.concat(self.buffer), first, end)
            self.buffer, self.held = [], 0

    def _commit(self, block: RowBlock, first: int, end: int) -> None:
        if block.first_row != first or block.end_row != end:
            raise RuntimeError(f"part rows {block.first_row}..{block.end_row - 1} do not match [{first}, {end})")
        part = self.checkpoint.next_part
        name = part_name(self.checkpoint.shard, part)
        write_part(self.checkpoint.directory, name, block, self.schema)
        codes = count_errors(block.errors)
        self.checkpoint.commit(PartRecord(part, name, first, end, sum(codes.values()), error_codes=codes))


class ErrorRate:
    """The shard's error rate as rows are written, against `runtime.max_error_rate`.

    It counts the rows committed by earlier runs too (a rerun after a stop stops again
    unless the job changed), and applies once `runtime.error_rate_min_rows` rows are in:
    a few broken rows at the start say nothing about the input.
    """

    def __init__(self, job: Job, shard: Shard, checkpoint: Checkpoint) -> None:
        self.limit = job.runtime.max_error_rate
        self.min_rows = job.runtime.error_rate_min_rows
        self.shard = shard
        self.rows = checkpoint.resume_row - checkpoint.first_row
        self.codes: collections.Counter[str] = collections.Counter(count_codes(p.error_codes for p in checkpoint.parts))

    @property
    def errors(self) -> int:
        return sum(self.codes.values())

    def add(self, block: RowBlock) -> None:
        """Count a written block; ErrorRateExceeded once the rate is above the limit."""
        self.rows += len(block)
        self.codes.update(count_errors(block.errors))
        if self.limit is None or self.rows < self.min_rows or self.errors <= self.limit * self.rows:
            return
        raise ErrorRateExceeded(
            f"shard {self.shard.index}/{self.shard.count} stopped: {self.errors} of {self.rows} rows are errors "
            f"({self.errors / self.rows:.1%}), above runtime.max_error_rate = {self.limit:g} "
            f"(most frequent: {codes_text(dict(self.codes))}); committed parts are kept: fix the input or the job "
            "and run again (it resumes), or raise runtime.max_error_rate"
        )


PROGRESS_INTERVAL = 0.5
"""Seconds between updates of the progress bar: often enough to follow the batches,
rarely enough to cost nothing."""


class Progress:
    """The progress bar of a shard: rows done, their rate and the time left.

    Rank 0's own rows count as its batches run (`own`, read every PROGRESS_INTERVAL
    seconds by a thread of the bar's own, so neither the encoding thread nor the writer
    waits for the terminal); other ranks are other processes, whose rows reach this one
    only as written chunks, so they count then (`others_written`). The rate and the ETA
    run from `start`, the moment rank 0 is ready to encode: the statistics' pipeline
    seconds start there too, so the bar's rate is the summary's, setup left out. The
    writer keeps `errors` (the shard's error rows written so far) for the bar to show.
    """

    def __init__(self, bar: tqdm, own: Callable[[], int]) -> None:
        self.bar = bar
        self.own = own
        self.others = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start counting (and timing) from now."""
        if self.bar.disable or self._thread is not None:
            return
        self.bar.reset(total=self.bar.total)
        self._thread = threading.Thread(target=self._follow, name="embedjob-progress", daemon=True)
        self._thread.start()

    def others_written(self, rows: int) -> None:
        self.others += rows

    def close(self, rows: int) -> None:
        """Stop following, showing `rows` done (every row this run wrote)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(max(0, rows - self.bar.n))
        self.bar.refresh()

    def _follow(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL):
            done = min(self.own() + self.others, self.bar.total)
            if done > self.bar.n:  # drawn only when it moved: a batch log gets no idle lines
                self.bar.set_postfix(errors=self.errors, refresh=False)
                self.bar.update(done - self.bar.n)


class Writer:
    """Rank 0's writer thread: the coordinator's results, in order, into the parts.

    The schema comes from the job and the input listing, so the writer needs no model.
    `own` holds the first rows of the chunks rank 0 encoded (their rows are already on
    the progress bar). A failure (a full disk, the error rate above its limit) stops the
    coordinator, so no rank waits for rows that will never be written, and is re-raised
    by `join`. The writer sees every row of the shard as it is written, whichever rank
    encoded it, so the shard's time series (rows and errors written) is kept here, with
    the seconds spent writing parts.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        checkpoint: Checkpoint,
        schema: Any,
        rate: ErrorRate,
        progress: Progress,
        own: set[int],
        timeline: Timeline,
    ) -> None:
        self.coordinator = coordinator
        self.checkpoint = checkpoint
        self.schema = schema
        self.rate = rate
        self.progress = progress
        self.own = own
        self.timeline = timeline
        self.rows = 0
        self.error_rows = 0
        self.seconds = 0.0
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="embedjob-writer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    def stop(self, error: BaseException) -> None:
        """Stop writing because the job failed; a part being written is finished first."""
        self.coordinator.fail(error)
        self._thread.join()

    def _run(self) -> None:
        try:
            sink = PartSink(self.checkpoint, self.schema)
            for block in self.coordinator.results():
                # Before the block is written: a shard whose rows fail too often stops
                # without committing more of them.
                self.rate.add(block)
                self._timed(sink.add, block)
                self.rows += len(block)
                self.error_rows += sum(e is not None for e in block.errors)
                self.timeline.advance(time.time(), {"rows": self.rows, "errors": self.error_rows})
                self.progress.errors = self.rate.errors
                if block.first_row not in self.own:
                    self.progress.others_written(len(block))
            self._timed(sink.close)
            self.finished_at = time.time()
        except BaseException as exc:
            self.error = exc
            self.coordinator.fail(exc)

    def _timed(self, write: Callable[..., None], *args: Any) -> None:
        since = time.perf_counter()
        write(*args)
        self.seconds += time.perf_counter() - since


# --- a shard ------------------------------------------------------------------------


class Runner:
    """Runs one shard of a job end to end, on one GPU or, with a `cluster` (this
    process is its rank 0), on every rank of it."""

    def __init__(
        self, job: Job, shard: Shard = Shard(), overwrite: bool = False, cluster: Cluster | None = None
    ) -> None:
        self.job = job
        self.shard = shard
        self.overwrite = overwrite
        self.cluster = cluster
        self.world_size = cluster.world_size if cluster else 1

    def run(self) -> dict[str, Any]:
        """Run (or resume) the shard; returns its statistics. Raises JobError if it cannot run."""
        device = self.cluster.device if self.cluster else resolve_device(self.job.runtime.device)
        coordinator = Coordinator(self.world_size, self._lookahead(), self._head_start())
        if self.cluster is not None:
            self.cluster.hub.serve(coordinator)
        try:
            with host_threads(device):
                return self._run(device, coordinator)
        except BaseException as exc:
            coordinator.fail(exc)
            raise

    def _lookahead(self) -> int:
        """Chunks out beyond the first unwritten one: what every rank holds in its
        pipeline (two windows decoding, two on the device) and one more to take."""
        return self.world_size * (4 * self._chunks_per_window() + 2)

    def _head_start(self) -> int:
        """Chunks a rank takes before every rank is ready: what its decode workers hold
        in flight (two windows), so its first windows are decoded when capture ends."""
        return 2 * self._chunks_per_window()

    def _chunks_per_window(self) -> int:
        return -(-self.job.batching.window // self._chunk_rows())

    def _chunk_rows(self) -> int:
        return min(CHUNK_ROWS, self.job.batching.window)

    def _run(self, device: torch.device, coordinator: Coordinator) -> dict[str, Any]:
        start, started = time.perf_counter(), time.time()
        listing = reader.scan_input(self.job.input, self.job.output.columns)
        fragments = reader.assign_shards(listing.fragments, self.shard.count)[self.shard.index]
        if not fragments:
            self._warn_empty(len(listing.fragments))
        first_row, end_row = self._row_range(fragments)
        checkpoint = self._open_checkpoint(first_row, end_row, listing)
        if checkpoint.is_done():
            coordinator.open([])
            logger.info("shard %d/%d is already complete in %s", self.shard.index, self.shard.count, self.job.output.path)
            return checkpoint.finished_stats()
        resumed = checkpoint.resume_row
        chunks = reader.plan_chunks(fragments, resumed, end_row, self._chunk_rows())
        if not chunks:
            coordinator.open([])
            return self._finish_without_model(checkpoint, time.perf_counter() - start)
        try:
            schema = output_schema(listing.id_type, self.job.output.pooling, self.job.output.dtype, listing.column_types)
            return self._encode(device, coordinator, checkpoint, chunks, schema, started, start)
        except BaseException:
            # Now, not when the checkpoint is collected: a caller that runs the shard
            # again in this process (a test, a notebook) must find it unlocked.
            if checkpoint.lock is not None:
                checkpoint.lock.release()
            raise

    def _warn_empty(self, row_groups: int) -> None:
        """A shard gets whole row groups, so with more shards than row groups the last
        shards are empty: say so, and how to spread the input over every shard."""
        most = max(row_groups, 1)
        logger.warning(
            "shard %d/%d has no rows: the input has %s for %s, and a shard is made of whole row groups; "
            "run at most %s (--shard I/N with N <= %d), or write the input with smaller row groups "
            "(e.g. pyarrow.parquet.write_table(..., row_group_size=1000))",
            self.shard.index, self.shard.count, plural(row_groups, "row group"), plural(self.shard.count, "shard"),
            plural(most, "shard"), most,
        )

    def _encode(
        self,
        device: torch.device,
        coordinator: Coordinator,
        checkpoint: Checkpoint,
        chunks: list[reader.Chunk],
        schema: Any,
        started: float,
        start: float,
    ) -> dict[str, Any]:
        """Hand out `chunks` to every rank, encode rank 0's, write them all in order."""
        coordinator.open(chunks)
        own: set[int] = set()

        def deliver(index: int, block: RowBlock) -> None:
            own.add(block.first_row)
            coordinator.put(index, block)

        def ready() -> None:
            coordinator.ready(0)
            # Both defined by then: the pipeline calls `ready` from `run`, inside the bar's block.
            progress.start()
            writer.timeline.skip_to(time.time())

        pipeline = RankPipeline(
            self.job, device, 0, resolve_workers(self.job.runtime.workers, self.world_size),
            functools.partial(coordinator.take, 0), deliver, ready,
        )
        pipeline.prepare()
        resumed = checkpoint.resume_row
        if resumed > checkpoint.first_row:
            logger.info("resuming shard %d at row %d (%d rows committed)", self.shard.index, resumed, resumed - checkpoint.first_row)
        with self._progress(checkpoint.end_row - resumed) as bar:
            progress = Progress(bar, pipeline.rows_done)
            rate = ErrorRate(self.job, self.shard, checkpoint)
            writer = Writer(coordinator, checkpoint, schema, rate, progress, own, Timeline(started))
            try:
                own_stats = pipeline.run()
            except BaseException as exc:
                writer.stop(exc)
                progress.close(writer.rows)
                # The writer's failure (e.g. the error rate) is the cause; the pipeline's
                # is its echo through the coordinator.
                raise writer.error or exc from None
            try:
                writer.join()
            finally:
                progress.close(writer.rows)
            others = self.cluster.hub.wait_done() if self.cluster is not None else []
        stats = self._stats(checkpoint, [own_stats, *others], writer, started, time.perf_counter() - start, resumed)
        checkpoint.finish(stats)
        return stats

    def _finish_without_model(self, checkpoint: Checkpoint, seconds: float) -> dict[str, Any]:
        """An empty shard, or one whose rows are all committed but whose success marker
        was not written: there is nothing to encode, so no model is loaded (under SLURM
        an empty array task would otherwise hold a GPU to load one)."""
        codes = count_codes(p.error_codes for p in checkpoint.parts)
        stats = {
            "shard": self.shard.index,
            "num_shards": self.shard.count,
            "rows": checkpoint.end_row - checkpoint.first_row,
            "rows_this_run": 0,
            "errors": sum(p.errors for p in checkpoint.parts),
            "error_codes": codes,
            "seconds": round(seconds, 3),
            "setup_seconds": round(seconds, 3),
            "pipeline_seconds": 0.0,
            "items_per_second": 0.0,
            "graph_hits": 0,
            "graph_misses": 0,
            "hit_rate": 0.0,
            "num_graphs": 0,
            "token_budgets": [],
            "padding_waste": 0,
            **self._provenance(),
        }
        checkpoint.finish(stats)
        return stats

    def _provenance(self) -> dict[str, Any]:
        """What made the output: the job as this run read it (defaults filled in) and
        the software versions; the report shows them."""
        return {"job": self.job.to_dict(), "versions": software_versions()}

    def _row_range(self, fragments: list[reader.Fragment]) -> tuple[int, int]:
        if fragments:
            return fragments[0].first_row, fragments[-1].first_row + fragments[-1].num_rows
        return 0, 0

    def _open_checkpoint(self, first_row: int, end_row: int, listing: reader.InputListing) -> Checkpoint:
        directory = Path(self.job.output.path)
        if "://" in self.job.output.path:
            raise JobError(f"output.path {self.job.output.path!r} must be a local or mounted directory")
        return open_checkpoint(
            directory,
            self.shard.index,
            self.shard.count,
            first_row,
            end_row,
            self.job.output.rows_per_part,
            job_fingerprint(self.job, listing),
            self.overwrite,
        )

    def _progress(self, total: int) -> tqdm:
        """The bar: an average rate (smoothing 0), so what it shows at the end is this
        run's rows over its pipeline seconds, as the summary says; every update shown
        (miniters 1: `Progress` already updates it only every PROGRESS_INTERVAL)."""
        return tqdm(
            total=total,
            unit="row",
            desc=f"shard {self.shard.index}/{self.shard.count}",
            disable=not self.job.runtime.progress,
            dynamic_ncols=True,
            smoothing=0,
            miniters=1,
        )

    def _stats(
        self, checkpoint: Checkpoint, ranks: list[RankStats], writer: Writer, started: float, seconds: float, resumed: int
    ) -> dict[str, Any]:
        ready = [r.ready_at for r in ranks if r.ready_at is not None]
        setup = max(ready) - started if ready else seconds
        pipeline = max(seconds - setup, 1e-9)
        stats: dict[str, Any] = {
            "shard": self.shard.index,
            "num_shards": self.shard.count,
            "rows": checkpoint.end_row - checkpoint.first_row,
            "rows_this_run": writer.rows,
            "resumed_from_row": resumed,
            "errors": sum(p.errors for p in checkpoint.parts),
            "error_codes": count_codes(p.error_codes for p in checkpoint.parts),
            "device": ranks[0].device,
            "model": self.job.model.path,
            "seconds": round(seconds, 3),
            "setup_seconds": round(setup, 3),
            "pipeline_seconds": round(pipeline, 3),
            "items_per_second": round(writer.rows / pipeline, 3),
            "stage_seconds": {k: round(v, 3) for k, v in ranks[0].stages.items()},
            "write_seconds": round(writer.seconds, 3),
            "started_at": round(started, 3),
            "timeline": writer.timeline.to_dict(),
            "device_name": ranks[0].device_name,
            **self._provenance(),
        }
        stats.update(_plan(ranks))
        stats.update(_merged_graphs(ranks).to_dict())
        stats.update(_ledger(ranks))
        return stats


def _plan(ranks: list[RankStats]) -> dict[str, Any]:
    """The budgets and limits every rank captured (the same plan on each)."""
    return next((r.plan for r in ranks if r.plan), {"num_graphs": 0, "token_budgets": []})


def _merged_graphs(ranks: list[RankStats]) -> GraphStats:
    """Every rank's graph statistics summed; ranks capture at once, so capture time is the longest."""
    total = GraphStats()
    graphs = [r.graphs for r in ranks if r.graphs is not None]
    for stats in graphs:
        total.merge(stats)
    total.capture_seconds = max((s.capture_seconds for s in graphs), default=0.0)
    total.pool_bytes = sum(s.pool_bytes for s in graphs)
    return total


def _ledger(ranks: list[RankStats]) -> dict[str, Any]:
    """Per-rank statistics and how evenly the work was spread: the largest rank's input
    size (and device seconds) over the mean, 1.0 for a perfect spread."""

    def ratio(values: list[float]) -> float | None:
        mean = sum(values) / len(values)
        return round(max(values) / mean, 4) if mean else None

    return {
        "world_size": len(ranks),
        "balance_ratio": ratio([r.load for r in ranks]),
        "busy_ratio": ratio([r.busy_seconds for r in ranks]),
        "ranks": [r.to_dict() for r in ranks],
    }


def run_job(job: Job, shard: Shard = Shard(), overwrite: bool = False) -> dict[str, Any]:
    """Run one shard of `job` on `runtime.gpus` ranks; the statistics it wrote.

    Ranks other than 0 (under torchrun) return an empty dict: rank 0 writes everything.
    """
    layout = resolve_layout(job.runtime.gpus, resolve_device(job.runtime.device))
    if layout.world_size == 1:
        return Runner(job, shard, overwrite).run()
    with Cluster.start(layout, serve_rank, (job,)) as cluster:
        if cluster.rank == 0:
            return Runner(job, shard, overwrite, cluster).run()
        serve_rank(cluster, job)
        return {}


def serve_rank(cluster: Cluster, job: Job) -> None:
    """A rank other than 0: its own pipeline over the chunks it takes from rank 0."""
    # A rank's stderr is the job's too (a rank started by the command has not been
    # through its logging setup; one under torchrun has, and this changes nothing).
    route_warnings(logger.isEnabledFor(logging.DEBUG))
    link = cluster.link
    with host_threads(cluster.device):
        workers = resolve_workers(job.runtime.workers, cluster.world_size)
        pipeline = RankPipeline(job, cluster.device, cluster.rank, workers, link.take, link.put, link.ready)
        try:
            stats = pipeline.run()
        except BaseException as exc:
            link.fail(f"{type(exc).__name__}: {exc}")
            raise
        link.finish(stats)

