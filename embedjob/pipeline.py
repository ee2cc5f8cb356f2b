"""One GPU's pipeline: read -> decode -> pack -> encode, its rows handed on to be written.

Every GPU runs a whole pipeline (`RankPipeline`), alone or beside others (`--gpus N`,
cluster.py): it takes chunks of the shard's rows in row order as it needs them,
reads them, decodes them in its own worker processes, encodes windows of
`batching.window` decoded items (packed and replayed through its own graphs) and hands
every finished chunk's rows back as a columnar `RowBlock`. The process of rank 0 also
writes: a `Coordinator` hands out the chunks and gives their rows, in chunk order, to
the writer thread (`io/sink.py`), which cuts them into the checkpoint's parts. So the output is in
input order while no process holds more than a bounded number of chunks.

Every input row becomes exactly one output row: decode and preprocess failures become
error rows in the workers (`rows.py`), encode failures become error rows here (after retrying the
failed batch one item at a time), and rows already committed by an earlier run are
skipped through the checkpoint.

The main thread of a rank only launches device work and moves whole windows: pooling
is one reduction per batch on the device (`graphs.pool_rows`), a window's results
come to the host in one copy, and output rows are built with array operations; the
per-item work (decode, resize, patching, metadata) is done by the decode workers (with
`preprocess.decoder: gpu`, a JPEG's decode, resize and patching by the GPU-decode thread).

What runs a whole shard on one or every rank (`Runner`, `run_job`) is in `runner.py`,
the statistics a rank keeps and the shard's statistics in `stats.py`, the process
settings in `host.py` (ARCHITECTURE.md, "Stage -> file").
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embedjob import stopping
from embedjob.calibration import calibration_for
from embedjob.captions import CaptionEncoder, PendingCaptions, caption_encoder, caption_task
from embedjob.config import Job, JobError
from embedjob.decode import DecodeOptions, MediaError, nvdec
from embedjob.decode.device import nvjpeg_problem
from embedjob.decode.nvdec import nvdec_problem
from embedjob.encoders import EncoderAdapter, load_adapter
from embedjob.engine.defs import Encoded, Encoder, output_dtype, to_host
from embedjob.engine.encode import build_encoder
from embedjob.engine.green import GreenStream, GreenUnavailable, green_stream
from embedjob.host import device_name
from embedjob.io import reader
from embedjob.io.checkpoint import caption_keys, fp8_keys
from embedjob.io.digest import UNREAD, digest_array
from embedjob.io.writer import RowBlock
from embedjob.decode_split import DecodeSplit, gpu_share
from embedjob.rows import (
    WORKER_MODULES,
    Captions,
    Decoded,
    JpegsAhead,
    decode_ahead,
    decode_on_device,
    decode_options,
    decode_row,
    decode_task,
    input_columns,
    jpeg_on_rank,
    task_on_rank,
)
from embedjob.stats import BusyClock, RankStats, StageClock
from embedjob.version import __version__
from embedjob.workers.pool import IDLE, DecodePool, start_worker_server

logger = logging.getLogger(__name__)

GPU_DECODE_WAIT = "waiting for the GPU decode"
"""The main thread's wait for a window's media decoded on the GPU, as `RankStats.waits` names it."""

CHUNK_ROWS = 64
"""Rows a rank takes at a time (fewer when `batching.window` is smaller). Small, so the
ranks finish close together; a take is one short message, so small costs nothing."""

LINGER = 0.05
"""Seconds without a decoded item after which a rank encodes what it has: its input
may be held back until rows it holds are written (see `Coordinator`)."""

ENCODE_AHEAD = 2
"""Windows of rows a rank ready first encodes while the others set up. Its head start
(`runner.Runner._head_start`) is that and the two windows its workers hold in flight, so it
waits for the others with those decoded."""

STOP_POLL = 0.1
"""Seconds between looks at `stopping.requested` while a rank waits for the others."""

FIRST_WINDOW = 32
"""The smallest first window that ramps up (see `window_sizes`)."""


GPU_DECODE_SWITCH_INTERVAL: float | None = None
"""Python's thread switch interval (`sys.setswitchinterval`, seconds) while this rank's GPU
decodes videos, or None for Python's own (5 ms). The decode threads take the GIL back after
each decoder call; a thread that asks for it while the main thread runs Python waits up to
an interval for it, once per call. Beside a thread running Python half the time, NVDEC alone
read 45.1 clips a second at 5 ms and 54.8, its rate alone, at 0.5 ms; but an `auto` job on
128 clips read 36.2 at 0.5 ms against 36.9 at Python's own (SigLIP-so400m, an H100,
benchmarks/RESULTS.md section 11): in the job something else holds the decoder, so None."""

GPU_DECODE_SM_CARVEOUT: int | None = None
"""SMs the encoder's products leave free while this rank's GPU decodes videos (torch's
experimental SM carveout, which cuBLAS and cuDNN take and `gemm_kernel`'s persistent GEMM
too, set before the graphs are captured, which keep the kernels' grids chosen then), or
None for all of them. The guess it tests: the decoder's work queued behind the encoder's
(its frames' copies and conversion, and through their streams its own calls) waits for
SMs, and a persistent GEMM holds every SM until its last tile, which no stream priority
preempts (decode streams at a higher priority lost; benchmarks/RESULTS.md section 11). 16
SMs took a `video.decoder: nvdec` job on SigLIP-so400m, whose products are all cuBLAS's,
from 29.6 clips a second to 31.0 (one run each, 128 clips, an H100); None until a CLIP
tower's (its fc1 is the Triton GEMM) and more clips are timed
(`benchmarks/video_decode.py --tower clip --variants nvdec:embedjob.pipeline.GPU_DECODE_SM_CARVEOUT=16`)."""

GPU_DECODE_FREE_SMS: int | None = None
"""SMs the encoder leaves to this rank's GPU decode of videos, or None for none: its graphs
are captured and replayed, and its other kernels queued, on the stream of a green context
(`engine.green`) holding them to the other SMs, where the carveout holds cuBLAS's alone.
Every copy out of the decoder's surfaces, by torch or by the driver, and every kernel of the
decode otherwise waits for the encoder's kernel in flight to end (0.32 ms beside bf16
products against 0.02 alone, with CUDA's 8 hardware queues: `benchmarks/copy_wait.py`,
which now takes the job's 32, says whether that holds there), and PyNvVideoCodec waits for its
stream before each picture it shows: NVDEC read 29.6 clips a second beside SigLIP-so400m
where alone it read 55 (benchmarks/RESULTS.md section 11). Untimed on a GPU, so off. A
driver without green contexts (before CUDA 12.5) leaves the encoder every SM, and says so."""

AUTO_ROWS = 64
"""Items a rank encodes before `preprocess.decoder: auto` first compares decode and device rates."""
AUTO_LOGGED_CHANGE = 0.1
"""A change of auto's GPU share logged at info (smaller ones at debug)."""


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


# --- the model --------------------------------------------------------------------


def load_encoder_adapter(job: Job, device: torch.device, workers: int = 0) -> EncoderAdapter:
    """The job's adapter on `device`, its FP8 weights calibrated on the input's first
    rows where the job asks (`calibration`, decoded by `workers` processes).

    A checkpoint that cannot serve the job (not a checkpoint, another family) is a job
    error: the user must change model.path or model.family. A JobError raised while
    loading already names its key (model.attention, model.precision) and passes as it is.
    """
    try:
        return load_adapter(job, device, calibration_for(job, workers))
    except JobError:
        raise
    except (ValueError, OSError) as exc:
        raise JobError(f"model.path {job.model.path!r} (model.family {job.model.family!r}): {exc}") from None


def compile_if_asked(job: Job, adapter: EncoderAdapter) -> None:
    """Compile the adapter's blocks when the job asks for it (CUDA only); the work
    happens at the first forward, i.e. when the graphs are captured.

    A text tower (captions, labels) compiles with them only where its attention takes no
    mask (`TextAdapter.compiles`: SigLIP, SigLIP 2); the others (CLIP's and MetaCLIP 2's
    causal towers, OpenCLIP's) replay their graphs uncompiled, as they should: CLIP's
    compiled text blocks invalidated the capture on an H100 (tests/test_gpu.py's compiled
    captions jobs)."""
    if not job.batching.compile:
        return
    if adapter.device.type != "cuda":
        logger.info("batching.compile applies to CUDA only; running uncompiled on %s", adapter.device)
        return
    adapter.compile(dynamic=True)
    if adapter.text is None:
        return
    if adapter.text.compiles:
        adapter.text.compile(dynamic=True)
    else:
        logger.info("batching.compile: the image tower is compiled; the %s text tower runs its graphs uncompiled", adapter.text.spec.name)


def _warm_imports(compiler: bool) -> None:
    """Import now, beside the model load (which mostly waits on file reads and copies to
    the GPU), what would otherwise be imported later on the critical path: torch's
    compiler (seconds of Python) when the blocks are compiled, and what pyarrow imports
    at its first conversion (pandas, where installed: a quarter to half a second). The
    writer's first row group is that conversion; mid-run, its import held the GIL away
    from the thread that feeds the GPU and cost the 224 px mix 0.13 s of its 4.6."""
    if compiler:
        import torch._dynamo  # noqa: F401
        import torch._inductor.codecache  # noqa: F401
    pa.array([0])


def jpeg_decoder(job: Job, device: torch.device) -> str:
    """Where this rank decodes JPEGs: "cpu", "gpu", or "auto" (both, in the shares
    `RankPipeline._split_decoding` sets). `gpu` on a device that cannot is a job error before
    any work; `auto` there (or in a job with nothing for it: tiles, video only) is "cpu"."""
    setting = job.preprocess.decoder
    if setting == "cpu":
        return "cpu"
    if setting == "auto" and (job.preprocess.tiling == "anyres" or job.input.modality == "video"):
        return "cpu"
    problem = nvjpeg_problem(device)
    if problem is None:
        return setting
    if setting == "gpu":
        raise JobError(f"preprocess.decoder = 'gpu' cannot run here: {problem}; use decoder: cpu, or a CUDA build of torchvision")
    logger.info("preprocess.decoder auto: JPEGs decode in the workers (%s)", problem)
    return "cpu"


def video_decoder(job: Job, device: torch.device) -> str:
    """Where this rank decodes videos: "decord" (the workers), "nvdec" (the GPU's video
    decoder) or "auto" (both, in the shares `RankPipeline._split_decoding` sets).
    `nvdec` where it cannot run is a job error before any work; `auto` there, or in a job
    whose rows are not all videos (the split counts rows of one kind), is "decord"."""
    setting = job.video.decoder
    if setting == "decord":
        return setting
    if setting == "auto" and job.input.modality != "video":
        problem: str | None = f"input.modality is {job.input.modality!r}, and auto splits the rows of a video job"
    else:
        problem = nvdec_problem(device)
    if problem is None:
        return setting
    if setting == "nvdec":
        raise JobError(f"video.decoder = 'nvdec' cannot run here: {problem}; or use video.decoder: decord")
    logger.info("video.decoder auto: videos decode in the workers (%s)", problem)
    return "decord"


def vector_description(job: Job, model: dict[str, Any]) -> dict[str, Any]:
    """What every part says of its vectors (its schema's `embedjob` metadata): which
    model made them, how, and their width, so a reader needs neither the job nor the
    width of the model (`model`: the loaded adapter's `describe()`). An fp8 job's layers
    kept in bf16 and calibration rows are named where it has them: vectors of two FP8
    settings differ (`fp8_keys`)."""
    return {
        "model_path": job.model.path,
        "family": model["family"],
        "precision": job.model.precision,
        "model_dtype": model["dtype"],
        "pooling": job.output.pooling,
        "normalize": job.output.normalize,
        "dtype": job.output.dtype,
        "width": model["embed_dim"],
        "embedjob_version": __version__,
        **fp8_keys(job),
        **caption_keys(job),
    }


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
    captions: PendingCaptions | None = None


class WindowEncoder:
    """Encodes a window and brings its rows back to the host as row blocks.

    Split in two so the device never waits for the host: `enqueue` launches every batch
    of window k and one asynchronous device-to-host copy of all its rows; the caller
    then finalises window k-1 (waits for its copy, builds its rows) while the device
    works on k.
    """

    def __init__(self, encoder: Any, job: Job, device: torch.device, captions: CaptionEncoder | None = None) -> None:
        self.encoder = encoder
        self.captions = captions
        self.pooling = job.output.pooling
        self.normalize = job.output.normalize
        self.columns = job.output.columns
        self.dtype = output_dtype(job)
        self.device = device

    def enqueue(self, window: list[Decoded]) -> PendingWindow:
        """With captions or labels the image rows are pooled in float32, scored against
        the text in float32 (`CaptionEncoder.enqueue`), and only then normalised and cast
        to the output dtype."""
        started = time.time()
        busy = BusyClock(self.device)
        items = [d.item for d in window if d.item is not None]
        encoded = self.encoder.encode(items, self.pooling, self.dtype if self.captions is None else torch.float32)
        captions = self.captions.enqueue(window, encoded) if self.captions is not None else None
        if self.normalize:
            encoded.rows = l2_normalize(encoded.rows)
        host = to_host(encoded.rows.to(self.dtype))
        busy.stop()
        return PendingWindow(window, encoded, host, busy, started, captions)

    def finalize(self, pending: PendingWindow) -> tuple[list[RowBlock], float]:
        """The window's rows as blocks of consecutive rows, and its device seconds."""
        seconds = pending.busy.seconds()
        computed = self.captions.columns(pending.captions) if pending.captions is not None else {}
        return _row_blocks(pending.window, pending.encoded, pending.host.numpy(), self.columns, computed), seconds


def l2_normalize(rows: torch.Tensor) -> torch.Tensor:
    """Each row divided by its L2 norm (a zero row stays zero), on the rows' device, in
    one call per window: computed in float32, whatever the output dtype, so float16
    rows do not lose the precision their norm needs."""
    return torch.nn.functional.normalize(rows.float(), dim=-1).to(rows.dtype)


def _row_blocks(
    window: list[Decoded], encoded: Encoded, rows: np.ndarray, columns: list[str], computed: dict[str, pa.Array]
) -> list[RowBlock]:
    """The window's output rows, with the copied input `columns` and the `computed`
    ones (one value per window row), cut where its row numbers jump (a rank's window
    may span chunks that other ranks' chunks separate)."""
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
        digests=digest_array([d.digest for d in window]),
        computed=computed,
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
                self.flush()

    def flush(self) -> None:
        """Hand on the rows of the chunk in hand: all of them, or, when the run stops
        (`stopping`), the first ones, so rank 0 commits them as a short part."""
        if self._parts:
            self.deliver(self._chunk.index, RowBlock.concat(self._parts))
            self._chunk, self._parts, self._have = None, [], 0


# --- one rank's pipeline ------------------------------------------------------------


class RankPipeline:
    """One rank's whole pipeline over the chunks it takes (see the module docstring).

    `take` gives the next chunk (None: no more), `deliver(index, block)` takes a
    finished chunk's rows, `ready()` says this rank has captured its graphs and
    `all_ready(timeout)` whether every rank has (waiting up to `timeout`, None: until
    they have). The model is loaded only once a first chunk is in hand, so a rank with
    nothing to do (a finished or empty shard) never loads one. The decode workers start
    reading and decoding before the graphs are captured, so capture and the first
    decode overlap.

    A rank ready before the others encodes at most ENCODE_AHEAD windows' rows, then
    waits for them with the next windows decoded: had it encoded everything it may
    take, its device would start the run after setup with nothing decoded.

    Asked to stop (`stopping.requested`, checked between windows), it takes no more
    rows, finishes the windows on the device, hands on what they encoded (the last
    chunk short) and returns with `stopped` set.
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
        all_ready: Callable[[float | None], bool],
    ) -> None:
        self.job = job
        self.ready = ready
        self.all_ready = all_ready
        self.device = device
        self.workers = workers
        self.take = take
        self.deliver = deliver
        self.stats = RankStats(rank, str(device), device_name(device))
        self.clock = StageClock()
        self.reading = StageClock()
        self.encoder: Any = None
        self.model: dict[str, Any] = {}
        """The loaded encoder's `describe()` (family, dtype, embed_dim), once prepared."""
        self.options: DecodeOptions | None = None
        self.preprocess: Any = None
        self.captions: CaptionEncoder | None = None
        self.caption_task: Captions | None = None
        self._unencoded = 0
        self._device_free = 0.0
        self.decoder = "cpu"
        self.video = "decord"
        self.defer = False
        self.split = DecodeSplit()
        self._green: GreenStream | None = None
        self.stopped = False

    def prepare(self) -> None:
        """Load the model and build the encoder; a job the model cannot serve (a bad
        checkpoint, budgets the model cannot take) stops here, before any row is read.

        What setup allocates stays alive for the run, so the garbage collector is
        paused meanwhile (`collector_paused`), and what it made is frozen before the
        collector resumes: unfrozen, it would all sit in the youngest generation, whose
        next collection (before capture) would walk every object of the load.
        `run` collects once (`settle_heap`) and hands it back."""
        with collector_paused():
            self._prepare()
            gc.freeze()

    def _prepare(self) -> None:
        since = time.perf_counter()
        self.stats.started_at = time.time()
        with stopping.held_from_children():
            start_worker_server(WORKER_MODULES)
        compiler = self.job.batching.compile and self.device.type == "cuda"
        threading.Thread(target=_warm_imports, args=(compiler,), name="embedjob-import", daemon=True).start()
        adapter = load_encoder_adapter(self.job, self.device, self.workers)
        since = self._setup("load", since)
        compile_if_asked(self.job, adapter)
        self.options = decode_options(self.job, adapter)
        self.decoder = jpeg_decoder(self.job, self.device)
        self.video = video_decoder(self.job, self.device)
        self.split = DecodeSplit.first(self.splitting)
        self.defer = self.decoder == "gpu"
        self.stats.decoder = self.decoder
        self.preprocess = adapter.preprocessor()
        self.encoder = build_encoder(self.job, adapter, self.device)
        self.captions = caption_encoder(self.job, adapter, self.encoder, self.device)
        self.caption_task = caption_task(self.job, adapter)
        self.model = adapter.describe()
        self._setup("plan", since)

    def run(self) -> RankStats:
        """Take chunks until there are none; `prepare`s first if the caller did not.

        However it ends, the heap that setup froze (`prepare`, `settle_heap`) is handed
        back to the collector, so a process that runs many jobs (a test session, a loop
        over shards) still frees what each leaves behind."""
        try:
            return self._run()
        finally:
            gc.unfreeze()

    def _run(self) -> RankStats:
        first = self.take()
        if first is None or self._stop_requested():
            return self.stats
        if self.encoder is None:
            self.prepare()
        taken: collections.deque[reader.Chunk] = collections.deque()
        submitted: collections.deque[reader.InputRow] = collections.deque()
        carveout = GPU_DECODE_SM_CARVEOUT if self.device.type == "cuda" and self.video != "decord" else None
        self._green = self._encoder_green()
        self.encoder.capture_on(self._green.stream if self._green is not None else None)
        if self._green is not None:
            # Persistent kernels (cuBLAS's, `gemm_kernel`'s) size their grids to the SMs the
            # carveout leaves: as many programs as the green context has SMs, no second wave.
            carveout = self._green.total - self._green.sms
        with sm_carveout(carveout):
            with collector_paused():
                pool, stream = self._start_decoding_while_capturing(self._rows(first, taken, submitted))
            since = time.perf_counter()
            with pool:
                settle_heap()
                self._setup("heap", since)
                self.stats.ready_at = time.time()
                self.stats.timeline.skip_to(self.stats.ready_at)
                self.ready()
                windows = WindowEncoder(self.encoder, self.job, self.device, self.captions)
                decoded = self._decoded_on_device(self._gated(self._windows(stream, submitted)))
                with self._encode_stream():
                    self._pipeline(decoded, windows, ChunkAssembler(taken, self.deliver))
        self._finish()
        self.encoder.clear()
        if self.captions is not None:
            self.captions.clear()
        return self.stats

    def _start_decoding_while_capturing(self, rows: Iterator[reader.InputRow]) -> tuple[DecodePool, Iterator[Any]]:
        """Start the decode workers (and their first rows) on a thread while this one
        compiles and captures the graphs: the two take seconds each and need nothing of
        each other (the workers' thread makes no CUDA call, which capture forbids). With
        the decoder set to auto the GPU's share starts once they are captured
        (`DecodeSplit.ready`): until then the workers keep what they start.

        A JPEG left for the GPU needs only its header read, which the pool does on this
        process (`rows.jpeg_on_rank`) rather than send it to a worker and back, unless
        the row has a caption to tokenise: that is per-item work, for the workers."""
        local: Callable[[Any], Decoded | None] | None = None
        assign: Callable[[Any], Any] | None = None
        captions = self.caption_task
        if self.splitting is not None:
            flag = "defer_jpeg" if self.splitting == "jpeg" else "defer_video"
            fn: Callable[[Any], Decoded] = functools.partial(
                decode_task, options=self.options, left=dataclasses.replace(self.options, **{flag: True}),
                preprocess=self.preprocess, captions=captions,
            )
            if captions is None and self.splitting == "jpeg":
                local = functools.partial(task_on_rank, options=self.options, preprocess=self.preprocess)
            rows, assign = self._split_tasks(rows)
        else:
            options = dataclasses.replace(self.options, defer_jpeg=self.defer)
            fn = functools.partial(decode_row, options=options, preprocess=self.preprocess, captions=captions)
            if self.defer and captions is None:
                local = functools.partial(jpeg_on_rank, options=options, preprocess=self.preprocess)
        in_flight = 2 * self.job.batching.window

        def start() -> tuple[DecodePool, Iterator[Any]]:
            since = time.perf_counter()
            timeout = self.job.runtime.decode_timeout
            pool = DecodePool(fn, self.workers, timeout, in_flight, WORKER_MODULES, error=MediaError, local=local, assign=assign)
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
                if self.captions is not None:
                    self.captions.capture()
            except BaseException:
                starting.result()[0].close()
                raise
            self.split.ready()
            self._setup("capture", since)
            return starting.result()

    def _split_tasks(self, rows: Iterator[reader.InputRow]) -> tuple[Iterator[Any], Callable[[Any], Any] | None]:
        """The pool's tasks with the decoder set to auto, and its `assign`: a video's row is
        given its (row, defer) as a worker starts it (`DecodeSplit.leave` then), so rows
        the workers start while this rank sets up are theirs; a JPEG's as the pool takes
        it, as the pool's own path for JPEGs left to the GPU must know."""
        if self.splitting == "video":
            return rows, lambda row: (row, self.split.leave())
        return ((row, self.split.leave()) for row in rows), None

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
            rows = reader.read_rows(self.job.input, chunk.fragments, chunk.first_row, chunk.end_row, input_columns(self.job))
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
        crash); the queue of submitted rows tells which row that was. No worker
        finished reading that row's media, so its digest is UNREAD (`io/digest.py`);
        its caption (a rare row) is tokenised here, as an image error keeps its text.
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
                text = self.caption_task.item(row) if self.caption_task is not None else None
                result = Decoded(row.row, row.id, None, None, str(result), extra=row.extra, digest=UNREAD, text=text)
            window.append(result)
            if len(window) >= size:
                self.clock.add("waiting for decode", since)
                yield window
                window, size = [], next(sizes)
                since = time.perf_counter()
        self.clock.add("waiting for decode", since)
        if window:
            yield window

    def _gated(self, windows: Iterator[list[Decoded] | None]) -> Iterator[list[Decoded] | None]:
        """`windows`, holding back the first that would take this rank past
        ENCODE_AHEAD windows' rows until every rank is ready (a None first, so what is
        on the device is handed over while it waits)."""
        ahead = ENCODE_AHEAD * self.job.batching.window
        rows = 0
        for window in windows:
            if window is not None and rows + len(window) > ahead:
                if not self.all_ready(0):
                    yield None
                    since = time.perf_counter()
                    # In steps, so a signal (`stopping`) stops a rank waiting for slower ones.
                    while not self.all_ready(STOP_POLL) and not self._stop_requested():
                        pass
                    self.clock.add("waiting for every rank", since)
                ahead = math.inf
            rows += len(window or ())
            yield window

    def _decoded_on_device(self, windows: Iterator[list[Decoded] | None]) -> Iterator[list[Decoded] | None]:
        """`windows`, with the media the workers left undecoded (`preprocess.decoder`,
        `video.decoder`) decoded on the GPU by two threads of their own, on a stream of
        their own, one window ahead: while the main thread launches window k and waits
        for it, one thread finishes window k + 1 (`decode_on_device`) and the other
        makes window k + 2's first nvjpeg call (`decode_ahead`), so their host work (the
        decoders', the resizes' launches) stays off the thread that feeds the device, and
        nvjpeg's wait for a busy device overlaps the finishing. Both threads queue on the
        one stream, so a picture is ready, and recorded as used, where it is resized.
        The device's stream waits for a window's pixels before its batches are assembled.
        A mid-run capture (added budgets) and the threads' work never overlap
        (`capture_lock`): capture forbids other CUDA work."""
        if not self._gpu_decodes:
            yield from windows
            return
        stream = torch.cuda.Stream(self.device)
        videos = self.video != "decord"
        with (
            _switch_interval(GPU_DECODE_SWITCH_INTERVAL if videos else None),
            _counted_into(self.stats.device_decode_parts) if videos else contextlib.nullcontext(),
            _allocations_into(self.stats.device_allocations, self.device),
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedjob-gpu-decode") as thread,
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedjob-nvjpeg") as nvjpeg,
        ):
            ahead: tuple[list[Decoded], concurrent.futures.Future] | None = None
            for window in windows:
                if window is None:
                    if ahead is not None:
                        yield self._decoded(*ahead)
                        ahead = None
                    yield None
                    continue
                if self.splitting is not None:
                    self.split.count(window)
                first = nvjpeg.submit(self._decode_ahead, window, stream)
                future = thread.submit(self._decode_window, window, stream, first)
                if ahead is not None:
                    yield self._decoded(*ahead)
                ahead = (window, future)
            if ahead is not None:
                yield self._decoded(*ahead)

    @property
    def splitting(self) -> str | None:
        """The media the GPU decodes a share of ("jpeg" or "video": the decoder set to
        auto), or None. Never both: `jpeg_decoder` makes auto "cpu" in a video job, and
        `video_decoder` makes it "decord" in any other."""
        return "jpeg" if self.decoder == "auto" else "video" if self.video == "auto" else None

    @property
    def _gpu_decodes(self) -> bool:
        """Whether this rank's GPU decodes media the workers leave it (JPEGs with
        `preprocess.decoder` gpu or auto, videos with `video.decoder` nvdec or auto)."""
        return self.decoder != "cpu" or self.video != "decord"

    def _encode_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Where the encoder's work queues while media decode on the GPU beside it: a
        stream of its own, so that no synchronous copy the decoders make on the legacy
        default stream waits for the encoder's queued work. On the 224 px mix it changed
        nothing measurable: there the decode thread is bounded by nvjpeg's synchronised
        calls and its own time per window (benchmarks/RESULTS.md)."""
        if not self._gpu_decodes:
            return contextlib.nullcontext()
        if self._green is not None:
            return torch.cuda.stream(self._green.stream)
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def _encoder_green(self) -> GreenStream | None:
        """The green context's stream the encoder runs on while this rank's GPU decodes
        videos (`GPU_DECODE_FREE_SMS`), or None: not asked for, no video decoded on the
        GPU, or a driver that makes none (logged)."""
        if GPU_DECODE_FREE_SMS is None or self.device.type != "cuda" or self.video == "decord":
            return None
        try:
            green = green_stream(self.device, GPU_DECODE_FREE_SMS)
        except GreenUnavailable as exc:
            logger.warning("the encoder keeps every SM beside the GPU's video decoder: %s", exc)
            return None
        logger.info("the encoder runs on %d of the GPU's %d SMs, the rest left to its video decoder", green.sms, green.total)
        return green

    def _decode_ahead(self, window: list[Decoded], stream: torch.cuda.Stream) -> JpegsAhead:
        """On the nvjpeg thread: `window`'s first nvjpeg call."""
        with self.encoder.capture_lock.shared(), torch.cuda.stream(stream):
            return decode_ahead(window, self.device)

    def _decode_window(
        self, window: list[Decoded], stream: torch.cuda.Stream, first: concurrent.futures.Future
    ) -> tuple[int, torch.cuda.Event, float]:
        """On the decode thread: `window`'s deferred media decoded in place; how many,
        the event after the last of its kernels, and the thread's seconds (the wait
        for the nvjpeg thread's call included). That call is awaited before the lock
        is shared, so a capture is not held off by a thread that only waits."""
        since = time.perf_counter()
        ahead = first.result()
        with self.encoder.capture_lock.shared(), torch.cuda.stream(stream):
            done = decode_on_device(window, self.options, self.preprocess, self.device, ahead)
            event = torch.cuda.Event()
            event.record(stream)
        return done, event, time.perf_counter() - since

    def _decoded(self, window: list[Decoded], future: concurrent.futures.Future) -> list[Decoded]:
        since = time.perf_counter()
        done, event, seconds = future.result()
        self.clock.add(GPU_DECODE_WAIT, since)
        torch.cuda.current_stream(self.device).wait_event(event)
        self.stats.device_decoded += done
        self.stats.device_decode_seconds += seconds
        return window

    def _pipeline(self, windows: Iterator[list[Decoded] | None], encoder: WindowEncoder, chunks: ChunkAssembler) -> None:
        """decode (workers) | enqueue window k (device) | finalise window k-1 | hand over."""
        pending: PendingWindow | None = None
        for window in windows:
            if self._stop_requested():
                break
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
        if self.stopped:
            chunks.flush()

    def _stop_requested(self) -> bool:
        """Whether a signal asked the run to stop (`stopping`); `stopped` says so from then on."""
        signum = stopping.requested()
        if signum is not None and not self.stopped:
            self.stopped = True
            logger.warning(
                "%s: taking no more rows; the windows on the device finish and what is encoded is committed "
                "(a second signal stops at once)", stopping.signal_name(signum),
            )
        return self.stopped

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
        if self.splitting is not None:
            self._split_decoding()

    def _split_decoding(self) -> None:
        """`preprocess.decoder: auto` (JPEGs) or `video.decoder: auto` (videos), after
        every window once AUTO_ROWS items are encoded: the share of the rows submitted
        from now on that leave their media for the GPU (`gpu_share`), from the rates so
        far: the workers' (workers / their mean seconds per row they decoded), the
        device's (items per busy second) and the GPU-decode thread's (rows per second of
        its time). Rows already submitted keep their decoder, so a window may hold both."""
        stats, split = self.stats, self.split
        if stats.items < AUTO_ROWS or stats.busy_seconds <= 0:
            return
        worker_rate = max(self.workers, 1) * split.worker_rows / split.worker_seconds if split.worker_seconds > 0 else math.inf
        gpu_rate = stats.device_decoded / stats.device_decode_seconds if stats.device_decoded else math.inf
        device_rate = stats.items / stats.busy_seconds
        share = gpu_share(worker_rate, device_rate, gpu_rate)
        first = stats.gpu_share is None
        level = logging.INFO if first or abs(share - split.share) >= AUTO_LOGGED_CHANGE else logging.DEBUG
        setting, media = ("preprocess.decoder", "JPEGs") if self.splitting == "jpeg" else ("video.decoder", "videos")
        logger.log(
            level,
            "%s auto: %d decode workers make %.0f rows/s, the GPU's decoder %.0f, the device encodes %.0f items/s: "
            "%.0f%% of the %s from here on decode on the GPU",
            setting, self.workers, worker_rate, gpu_rate, device_rate, 100 * share, media,
        )
        split.share = stats.gpu_share = share

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
        if self.captions is not None and self.captions.text is not None:
            self.stats.plan["text"] = self.captions.stats()
        self._sample()


@contextlib.contextmanager
def _process_setting(read: Callable[[], Any], write: Callable[[Any], None], value: Any) -> Iterator[None]:
    """A process-wide setting (`read` and `write` it) at `value` inside, unchanged where
    None, and as it was after, even where the block raised: it is the process's, and a
    later job in it must find it as it was."""
    if value is None:
        yield
        return
    before = read()
    write(value)
    try:
        yield
    finally:
        write(before)


def _switch_interval(seconds: float | None) -> contextlib.AbstractContextManager[None]:
    """Python's thread switch interval at `seconds` inside (`_process_setting`)."""
    return _process_setting(sys.getswitchinterval, sys.setswitchinterval, seconds)


def sm_carveout(sms: int | None) -> contextlib.AbstractContextManager[None]:
    """torch's SM carveout at `sms` inside (`_process_setting`): a later job in the process
    must get every SM."""
    return _process_setting(torch._C._get_sm_carveout_experimental, torch._C._set_sm_carveout_experimental, sms)


@contextlib.contextmanager
def _added_into(into: dict[str, Any], read: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """On leaving, even where the block raised, `into` holds what each of `read`'s counts
    (this process's: this rank's, as its process serves it alone) added inside."""
    before = read()
    try:
        yield
    finally:
        into.update({name: value - before.get(name, 0) for name, value in read().items()})


def _counted_into(parts: dict[str, float]) -> contextlib.AbstractContextManager[None]:
    """`parts` gets the seconds the GPU decoder's parts (`nvdec.CLOCK`) took inside."""
    return _added_into(parts, nvdec.CLOCK.seconds)


ALLOCATOR_COUNTS = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree",
                    "num_alloc_retries": "retries", "num_sync_all_streams": "syncs"}
"""The CUDA caching allocator's counters (`torch.cuda.memory_stats`) a rank reports, by the
names it reports them under: calls to the driver's allocation and free, allocations retried
after freeing its cache, and the frees of every stream's pending blocks; each stalls the
thread that allocates, the last two the whole device."""


def _allocations_into(counts: dict[str, int], device: torch.device) -> contextlib.AbstractContextManager[None]:
    """`counts` gets what the caching allocator's `ALLOCATOR_COUNTS` on `device` added
    inside; nothing off a GPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    def read() -> dict[str, int]:
        stats = torch.cuda.memory_stats(device)
        return {name: stats.get(key, 0) for key, name in ALLOCATOR_COUNTS.items()}

    return _added_into(counts, read)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside; the collector's state is restored on exit.

    Setup (imports, the load, compile and capture) allocates millions of objects that
    stay alive, so the oldest generation's collections it triggers walk an ever larger
    heap and free little: five of them took 1.0-1.5 s of a Qwen2.5-VL-7B-size tower's
    setup on an H200 (benchmarks/RESULTS.md, "Where the device sits idle").
    `settle_heap` collects once after it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def settle_heap() -> None:
    """Collect once, then put every object alive out of the garbage collector's reach
    (`gc.freeze`) until `RankPipeline.run` hands them back.

    After setup the process holds millions of long-lived objects (torch, transformers,
    the tower, the compiler's code); a collection of the oldest generation walks every
    one of them with the GIL held (0.3 s on an H200, the `heap` step of setup), time in
    which the thread that launches the graphs cannot run. Frozen objects are never
    scanned, so the run's collections see only what it allocates. The collection covers
    what `prepare` froze too, so freezing keeps nothing alive that was dead.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _items_encoded(encoder: Encoder) -> int:
    """Items an encoder has run so far (hits and misses are counted per item)."""
    counts = encoder.graph_stats()
    return counts.hits + counts.misses
