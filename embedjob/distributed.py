"""Data parallel across the GPUs of one node: load-balanced items, ordered gather.

One process per GPU ("rank"), joined in one `torch.distributed` process group: NCCL
between GPUs, gloo on CPUs (CI), plus a gloo group for Python objects. `embedjob run
--gpus N` makes the calling process rank 0 and spawns ranks 1..N-1; under torchrun
(RANK, WORLD_SIZE, LOCAL_RANK set) every rank was started by torchrun and just joins.

Roles. Rank 0 is the shard's only reader, decoder and writer: it runs the runner's
pipeline unchanged, and the encoder the runner sees is a `DataParallelEncoder`. Per
window of decoded items it
1. assigns items to ranks largest first to the least-loaded rank by input size
   (`assign_items`: the seed's load balance),
2. sends every other rank its items (one gloo scatter),
3. encodes its own share like any rank (its own graphs on its own device),
4. exchanges per-item shapes and failures with every rank (one gloo all-gather of small
   objects), then gathers the embeddings on rank 0 over the device backend, each rank's
   rows padded to the largest rank's row count (a gather needs one shape), and
5. unpads them with the shapes and puts them back in the window's order.
The other ranks (`serve`) loop on 2-4 until rank 0 sends the stop message. The output
is therefore the single-process output: the same rows in the same parts, manifest and
statistics, written by one process; only which batch an item is packed into changes,
which moves an embedding by float rounding at most.

Why rank 0 decodes every item and sends it, instead of each rank decoding a disjoint
subset: the balance needs each item's input size, which is known only after decoding and
preprocessing, and rank 0's decode pool already uses every core of the node, so the CPU
decode runs once whichever rank computes on the item. The cost: each item that leaves
rank 0 is copied once into its rank's send buffer (`pack_items`) and crosses the
loopback interface over gloo, in the background while rank 0 encodes its own share. That
is 588 bytes per Qwen-VL image patch (resized uint8 pixels, one temporal copy; video
patches 1176), about 0.6 MB for a 1000-patch image; gloo moved buffers at 1-1.4 GB/s
on this project's 2-core CI machine, i.e. under 1 ms per such image, against the 25 ms
(eager) or about half that (compiled) an H200 spent per image with a 7B-size tower
(DESIGN.md); rank 0 sends (N-1)/N of the items. Sending
the compressed media instead would need every item's size from its header before
decoding, per encoder family and for video.

Failures. A rank that dies makes the job stop with a `RankFailure` naming the rank and
its exit code (or its own error message), never a hang: gloo fails an exchange with a
dead peer at once; rank 0 watches the processes it spawned and ends itself if its main
thread does not notice within `FAILURE_GRACE` seconds (a NCCL wait cannot be
interrupted); spawned ranks end when rank 0 ends; exchanges with a live but hung peer
time out after `COLLECTIVE_TIMEOUT`; under torchrun, torchrun stops the other ranks.
Parts are committed by rank 0 alone, so the checkpoint rules are unchanged: committed
parts stay valid and a rerun resumes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from embedjob.encoders import EncoderInput
from embedjob.graphs import BatchEncoder, GraphStats, Reduce
from embedjob.job import JobError

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""The longest one exchange may wait. Ranks wait for rank 0's next window while rank 0
decodes it (and at start while it loads and captures), so this must exceed the slowest
window's decode; it only bounds a hung peer, a dead one is detected at once."""

FAILURE_GRACE = 30.0
"""Seconds rank 0's main thread gets to notice a dead rank itself before the watchdog
ends the process (it is then stuck in a wait that cannot be interrupted)."""

FAULT_ENV = "EMBEDJOB_DIST_FAULT"
"""Fault injection for the failure tests: "R:W" makes rank R exit with code 17 when it
receives window W (0-based)."""

FAULT_EXIT_CODE = 17
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RESUME_HINT = "committed parts are kept; rerun the same command to resume"


class RankFailure(RuntimeError):
    """A rank died or stopped answering; the job cannot finish this run."""


# --- load balance -------------------------------------------------------------------


def assign_items(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Item indices per rank: largest item first, each to the least-loaded rank so far.

    Invariants: every index appears in exactly one share, each share is in ascending
    index order (the window's order), and the result depends only on `sizes`: ties go
    to the earlier item and the lower rank. The largest load is at most the mean load
    plus (1 - 1/ranks) times the largest size, and at most 4/3 of the best possible
    (Graham's bound for largest-first).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [(0, rank) for rank in range(ranks)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(index)
        heapq.heappush(loads, (load + sizes[index], rank))
    return [sorted(share) for share in shares]


def share_loads(sizes: Sequence[int], shares: Sequence[Sequence[int]]) -> list[int]:
    """The summed input size of each rank's share."""
    return [sum(sizes[i] for i in share) for share in shares]


# --- where this process sits --------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """This process is rank `rank` of `world_size`, computing on `device`.

    `launched` is true when an outside launcher (torchrun) started every rank and set
    the rendezvous variables; otherwise rank 0 spawns the others.
    """

    world_size: int
    rank: int
    device: torch.device
    launched: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def resolve_layout(gpus: str | int, device: torch.device) -> Layout:
    """The ranks this run uses: torchrun's variables when set, else `runtime.gpus`.

    `auto` means every visible GPU on CUDA and one process on a CPU; a number of CPU
    ranks may be asked for (gloo), which is how CI runs this module.
    """
    env = os.environ
    if all(key in env for key in TORCHRUN_ENV):
        world, rank, local = (int(env[key]) for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        if gpus not in ("auto", world):
            raise JobError(
                f"runtime.gpus = {gpus} but torchrun started {world} processes (WORLD_SIZE); "
                "drop --gpus/runtime.gpus or start torchrun with that many processes"
            )
        return Layout(world, rank, _rank_device(device, local), launched=True)
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        world = visible if gpus == "auto" else int(gpus)
        if world > visible:
            raise JobError(
                f"runtime.gpus = {gpus} but only {visible} CUDA devices are visible; "
                f"use --gpus {visible} or fewer (or set CUDA_VISIBLE_DEVICES)"
            )
    else:
        world = 1 if gpus == "auto" else int(gpus)
    return Layout(world, 0, _rank_device(device, 0))


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


# --- the process group --------------------------------------------------------------


@dataclass(frozen=True)
class _Member:
    """What a spawned rank needs to join: the rendezvous store and its place."""

    host: str
    port: int
    world_size: int
    rank: int
    device: str
    log_level: int
    threads: int


@dataclass
class _Spawned:
    rank: int
    process: multiprocessing.process.BaseProcess
    report: multiprocessing.connection.Connection
    message: str = ""

    def reason(self) -> str:
        """Why this rank ended: its own error message if it sent one, and its exit code."""
        try:
            if not self.message and self.report.poll():
                self.message = self.report.recv()
        except (EOFError, OSError):
            pass
        message = self.message
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"{how}: {message}" if message else how


class Cluster:
    """This process's place in the job's process group, and the exchanges of a window.

    Use as a context manager: leaving it normally tells the other ranks to stop (rank
    0) and waits for them; leaving it by an exception stops the spawned ranks at once,
    since they may be inside an exchange that will never complete.
    """

    def __init__(self, layout: Layout, spawned: list[_Spawned], store: dist.TCPStore | None = None) -> None:
        """With a `store` (the ranks of a spawned group) this process joins the process
        group at its first exchange, after its own setup; under torchrun it is in it already.

        Late joining matters on CUDA beyond overlapping setup: a NCCL group that exists
        while a rank captures its CUDA graphs has a watchdog thread querying the device,
        which a capture does not allow, so every rank captures before it joins."""
        self.layout = layout
        self.spawned = spawned
        self.objects: dist.ProcessGroup | None = None
        self._store = store
        self._in_group = store is None
        self._stopping = threading.Event()
        self._closed = False
        self._sending: list[tuple[Any, torch.Tensor]] = []  # each send and the buffer it reads
        self.seconds: collections.Counter[str] = collections.Counter()  # wall seconds per exchange, for the stats
        self._threads_before: int | None = None
        if spawned and layout.device.type == "cpu":
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(_cpu_threads(layout.world_size))
        if self._in_group:
            self._make_groups()
        if spawned:
            threading.Thread(target=self._watch, name="embedjob-rank-watchdog", daemon=True).start()

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @classmethod
    def start(cls, layout: Layout, target: Callable[..., None], args: tuple[Any, ...]) -> "Cluster":
        """Join the group; when not launched by torchrun, first spawn ranks 1.. to run
        `target(cluster, *args)` (a module-level function, as spawning pickles it)."""
        if layout.device.type == "cuda":
            torch.cuda.set_device(layout.device)
        if layout.launched:
            dist.init_process_group(
                layout.backend, init_method="env://", rank=layout.rank, world_size=layout.world_size,
                timeout=COLLECTIVE_TIMEOUT, device_id=_nccl_device(layout),
            )
            return cls(layout, [])
        store = dist.TCPStore(
            "127.0.0.1", 0, layout.world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        return cls(layout, _spawn(layout, store.port, target, args), store)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool) -> None:
        """Stop the other ranks (rank 0) and leave the group (idempotent).

        Spawned ranks that rank 0 never needed (a finished shard, no rows) are ended
        without a rendezvous: they may still be starting, and have nothing to lose.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        clean = False
        try:
            if ok and self.rank == 0 and self._in_group:
                self.send_items(None)
                _join(self.spawned)
            clean = ok
        finally:
            _terminate(self.spawned)
            if self._threads_before is not None:
                torch.set_num_threads(self._threads_before)
            if self._in_group and (clean or self.layout.backend == "gloo"):
                # A NCCL group that failed mid-exchange may block in its destruction;
                # the process is about to end anyway.
                dist.destroy_process_group()

    def _make_groups(self) -> None:
        if self.layout.backend == "nccl":
            self.objects = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)

    def _connect(self) -> None:
        """Join the process group (once, at the first exchange: see `__init__`): rank 0
        first checks that every spawned rank reached the store, failing at once if one ended."""
        store, self._store = self._store, None
        if self.spawned:
            _wait_until_joined(store, self.spawned, self.world_size)
        dist.init_process_group(
            self.layout.backend, store=store, rank=self.rank, world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT,
            device_id=_nccl_device(self.layout),
        )
        self._in_group = True
        self._make_groups()
        logger.info("data parallel over %d ranks (%s)", self.world_size, self.layout.backend)

    # Exchanges. Every rank calls them in the same order; each raises RankFailure when
    # a peer is gone.

    def send_items(self, shares: list[list[EncoderInput]] | None) -> None:
        """Rank 0: every other rank's items of this window, or None to stop them.

        The item descriptions go out in one scatter; each rank's tensor bytes follow in
        one buffer, sent in the background while rank 0 encodes its own share
        (`exchange` waits for them).
        """
        packed = [None if shares is None or rank == 0 else pack_items(shares[rank]) for rank in range(self.world_size)]
        headers = [None if items is None else items.header() for items in packed]
        scatter = functools.partial(dist.scatter_object_list, [None], headers, src=0, group=self.objects)
        self._collective("sending a window", scatter)
        for rank, items in enumerate(packed):
            if items is not None and items.data.numel():
                send = functools.partial(dist.isend, items.data, rank, group=self.objects)
                self._sending.append((self._collective("sending a window", send), items.data))

    def receive_items(self) -> list[EncoderInput] | None:
        """Ranks 1..: this rank's items of the next window, or None when the job is done."""
        received: list[Any] = [None]
        scatter = functools.partial(dist.scatter_object_list, received, None, src=0, group=self.objects)
        self._collective("waiting for a window", scatter)
        if received[0] is None:
            return None
        shells, layouts, nbytes = received[0]
        data = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._collective("receiving a window", lambda: dist.recv(data, 0, group=self.objects))
        return PackedItems(shells, layouts, data).items()

    def exchange(self, reply: "ShareReply") -> list["ShareReply"]:
        """Every rank's reply, in rank order (to every rank, so each knows the gather's shape)."""
        sending, self._sending = self._sending, []
        for work, _buffer in sending:
            self._collective("sending a window", work.wait)
        replies: list[Any] = [None] * self.world_size
        self._collective("exchanging results", lambda: dist.all_gather_object(replies, reply, group=self.objects))
        return replies

    def gather_rows(self, rows: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
        """Every rank's rows on rank 0 (in rank order, each padded to `max_rows`); [] elsewhere."""
        if max_rows == 0:
            return []
        padded = torch.zeros((max_rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        padded[: rows.shape[0]] = rows
        blocks = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        self._collective("gathering embeddings", lambda: dist.gather(padded, blocks, dst=0))
        return blocks or []

    def _collective(self, what: str, call: Callable[[], Any]) -> Any:
        """Run one exchange, joining the group first if this rank has not yet; its wall
        seconds go to `seconds[what]`, the join's (waiting for the other ranks' setup) to
        `seconds["joining the group"]`, so a short run's start-up is not read as throughput."""
        start = time.perf_counter()
        try:
            if self._store is not None:
                self._connect()
                start = self._count("joining the group", start)
            return call()
        except RankFailure:
            raise
        except Exception as exc:
            raise RankFailure(self._failure(what, exc)) from exc
        finally:
            self._count(what, start)

    def _count(self, what: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[what] += now - since
        return now

    def _failure(self, what: str, exc: BaseException) -> str:
        """Name the rank that ended, if a spawned one did (it may take a moment to be reaped)."""
        deadline = time.monotonic() + 5.0
        while self.spawned and time.monotonic() < deadline:
            ended = [s for s in self.spawned if s.process.exitcode is not None]
            if ended:
                return f"rank {ended[0].rank} of {self.world_size} {ended[0].reason()} (while {what}); {RESUME_HINT}"
            time.sleep(0.05)
        return (
            f"rank {self.rank} of {self.world_size}: {what} failed, a peer rank died or stopped answering "
            f"({type(exc).__name__}: {exc}); {RESUME_HINT}"
        )

    def _watch(self) -> None:
        """Rank 0's watchdog over the ranks it spawned (see the module docstring)."""
        sentinels = [s.process.sentinel for s in self.spawned]
        while not self._stopping.is_set():
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            ended = [s for s in self.spawned if s.process.exitcode is not None]
            if ended and not self._stopping.is_set():
                if self._stopping.wait(FAILURE_GRACE):
                    return
                message = f"rank {ended[0].rank} of {self.world_size} {ended[0].reason()}; {RESUME_HINT}"
                logger.error("%s; rank 0 is stuck waiting for it and stops now", message)
                _terminate(self.spawned)
                os._exit(1)


def _spawn(layout: Layout, port: int, target: Callable[..., None], args: tuple[Any, ...]) -> list[_Spawned]:
    """Start ranks 1.. with the spawn method: CUDA cannot be used in forked children."""
    context = multiprocessing.get_context("spawn")
    threads = _cpu_threads(layout.world_size)
    level = logging.getLogger("embedjob").getEffectiveLevel()
    spawned: list[_Spawned] = []
    try:
        for rank in range(1, layout.world_size):
            device = str(_rank_device(layout.device, rank))
            member = _Member("127.0.0.1", port, layout.world_size, rank, device, level, threads)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_member_main, args=(member, target, args, send), name=f"embedjob-rank{rank}"
            )
            process.start()
            send.close()
            spawned.append(_Spawned(rank, process, receive))
    except BaseException:
        _terminate(spawned)
        raise
    return spawned


def _nccl_device(layout: Layout) -> torch.device | None:
    """The GPU a NCCL group binds to at once (rather than guessing from the current
    device at its first collective)."""
    return layout.device if layout.backend == "nccl" else None


def _cpu_threads(world_size: int) -> int:
    """CPU ranks share the machine's cores; more threads than cores makes every rank's
    thread pool wait on the others'."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _wait_until_joined(store: dist.TCPStore, spawned: list[_Spawned], world_size: int) -> None:
    """Wait for every spawned rank to reach the store, failing at once if one ends first
    (the group's own rendezvous would wait the whole timeout for it)."""
    keys = [f"embedjob/joined/{rank}" for rank in range(1, world_size)]
    while not store.check(keys):
        ended = [s for s in spawned if s.process.exitcode is not None]
        if ended:
            raise RankFailure(f"rank {ended[0].rank} of {world_size} {ended[0].reason()} before joining the group")
        time.sleep(0.05)


def _join(spawned: list[_Spawned]) -> None:
    for s in spawned:
        s.process.join(timeout=FAILURE_GRACE)
        if s.process.exitcode != 0:
            logger.warning("rank %d %s after the job finished", s.rank, s.reason())
    _terminate(spawned)


def _terminate(spawned: list[_Spawned]) -> None:
    """SIGTERM, then SIGKILL whatever is left after a few seconds."""
    for s in spawned:
        if s.process.is_alive():
            s.process.terminate()
    for s in spawned:
        s.process.join(timeout=5.0)
        if s.process.is_alive():
            s.process.kill()
            s.process.join()


def _member_main(
    member: _Member, target: Callable[..., None], args: tuple[Any, ...], report: multiprocessing.connection.Connection
) -> None:
    """Entry point of a spawned rank: join, run `target`, report any failure to rank 0."""
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s %(name)s [rank {member.rank}]: %(message)s"
    )
    logging.getLogger("embedjob").setLevel(member.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank; rank 0 decides
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # rank 0's bar is the job's
    _end_with_parent()
    device = torch.device(member.device)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(member.threads)
        store = dist.TCPStore(member.host, member.port, member.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        store.set(f"embedjob/joined/{member.rank}", "1")
        # Not closed: the process ends right below. Destroying a NCCL group here waits
        # for rank 0's, while rank 0 waits for this process to end before destroying its
        # own (seen on two H200s: every run ended 30 s late, after FAILURE_GRACE).
        target(Cluster(Layout(member.world_size, member.rank, device), [], store), *args)
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        logger.error("rank %d failed: %s", member.rank, message)
        report.send(message)
        raise SystemExit(1) from None
    # Skip the interpreter's teardown of torch and the model: it takes seconds, rank 0
    # waits for this process to end, and there is nothing left to save.
    logging.shutdown()
    os._exit(0)


def _end_with_parent() -> None:
    """A spawned rank has nothing to do once rank 0 is gone, and may be stuck waiting for it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="embedjob-parent-watch", daemon=True).start()


def _maybe_fail(rank: int, window: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{window}":
        logger.error("%s=%s: rank %d exits now", FAULT_ENV, spec, rank)
        os._exit(FAULT_EXIT_CODE)


# --- one window on one rank ---------------------------------------------------------

ALIGN = 64
"""Byte alignment of each tensor in a packed buffer, so every dtype can view its slice."""

TensorPlace = tuple[str, str, tuple[int, ...], int]
"""Where one tensor of an item lies in a packed buffer: key, dtype name, shape, byte offset."""


@dataclass
class PackedItems:
    """Items as small shells (every field but the tensors, pickled) plus one byte
    buffer holding every tensor, `layouts[i]` saying where item i's tensors are.

    Sending the tensors as one buffer instead of pickling them measured 3-4x faster
    (96 MB: 0.07-0.10 s against 0.26 s through gloo on the loopback of a 2-core VM).
    """

    shells: list[EncoderInput]
    layouts: list[list[TensorPlace]]
    data: torch.Tensor

    def header(self) -> tuple[list[EncoderInput], list[list[TensorPlace]], int]:
        return self.shells, self.layouts, self.data.numel()

    def items(self) -> list[EncoderInput]:
        """The items, their tensors viewing the buffer (read only, like decoded items)."""
        out = []
        for shell, layout in zip(self.shells, self.layouts):
            tensors = {}
            for key, dtype_name, shape, offset in layout:
                dtype = getattr(torch, dtype_name)
                count = math.prod(shape) * dtype.itemsize
                tensors[key] = self.data[offset : offset + count].view(dtype).reshape(shape)
            out.append(dataclasses.replace(shell, tensors=tensors))
        return out


def pack_items(items: list[EncoderInput]) -> PackedItems:
    """Copy every tensor of `items` into one aligned byte buffer."""
    layouts, sources, offset = [], [], 0
    for item in items:
        layout = []
        for key, tensor in item.tensors.items():
            raw = tensor.contiguous().reshape(-1).view(torch.uint8)
            layout.append((key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
            sources.append((offset, raw))
            offset += raw.numel() + (-raw.numel() % ALIGN)
        layouts.append(layout)
    data = torch.empty(offset, dtype=torch.uint8)
    for start, raw in sources:
        data[start : start + raw.numel()] = raw
    shells = [dataclasses.replace(item, tensors={}) for item in items]
    return PackedItems(shells, layouts, data)


@dataclass
class ShareReply:
    """What a rank tells the others after encoding its share of a window.

    `shapes[j]` is the result shape of the share's j-th item, or None when it failed
    (then `failures[j]` says why); its rows follow the previous items' rows in the
    rank's gathered block. `stats` are the rank's cumulative graph statistics and
    `exchange_seconds` its cumulative wall seconds per kind of exchange up to this
    window (waiting for rank 0, receiving items, ...), which tell a slow run's cause.
    """

    shapes: list[tuple[int, ...] | None]
    failures: list[str | None]
    busy_seconds: float
    stats: GraphStats
    device: str
    exchange_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(_row_count(shape) for shape in self.shapes if shape is not None)


def _row_count(shape: tuple[int, ...]) -> int:
    return 1 if len(shape) == 1 else shape[0]


@dataclass
class Share:
    reply: ShareReply
    rows: torch.Tensor


def encode_share(
    encoder: BatchEncoder, items: list[EncoderInput], reduce: Reduce, width: int, out_dtype: torch.dtype,
    device: torch.device,
) -> Share:
    """Encode one rank's items; their rows concatenated in item order, in the output dtype.

    Converting before the gather halves what float16 output sends and changes nothing:
    the single-process runner converts the same values the same way. The device is
    synchronised so `busy_seconds` is the rank's real encode time.
    """
    start = time.perf_counter()
    results, failures = encoder.encode(items, reduce)
    rows = [r.reshape(-1, width).to(out_dtype) for r in results if r is not None]
    flat = torch.cat(rows) if rows else torch.empty((0, width), dtype=out_dtype, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    shapes = [None if r is None else tuple(r.shape) for r in results]
    reply = ShareReply(shapes, failures, time.perf_counter() - start, encoder.graph_stats(), str(device))
    return Share(reply, flat)


def serve(cluster: Cluster, encoder: BatchEncoder, reduce: Reduce, width: int, out_dtype: torch.dtype) -> None:
    """Ranks 1..: encode each window's share until rank 0 says stop."""
    window = 0
    while (items := cluster.receive_items()) is not None:
        _maybe_fail(cluster.rank, window)
        share = encode_share(encoder, items, reduce, width, out_dtype, cluster.device)
        share.reply.exchange_seconds = dict(cluster.seconds)
        replies = cluster.exchange(share.reply)
        cluster.gather_rows(share.rows, max(r.rows for r in replies))
        window += 1


# --- rank 0 -------------------------------------------------------------------------


@dataclass
class RankLedger:
    """Per-rank totals over the run, and how evenly the windows were spread.

    The slowest rank sets each window's time, so the balance ratio is the sum over
    windows of the largest rank load over the sum of the mean rank loads: the run's
    time over a perfectly balanced run's, if time is proportional to input size.
    """

    world_size: int
    items: list[int] = field(init=False)
    loads: list[int] = field(init=False)
    busy: list[float] = field(init=False)
    stats: list[GraphStats] = field(init=False)
    devices: list[str] = field(init=False)
    exchanges: list[dict[str, float]] = field(init=False)
    max_load: float = 0.0
    mean_load: float = 0.0
    max_busy: float = 0.0
    mean_busy: float = 0.0

    def __post_init__(self) -> None:
        n = self.world_size
        self.items, self.loads, self.busy = [0] * n, [0] * n, [0.0] * n
        self.stats, self.devices = [GraphStats() for _ in range(n)], [""] * n
        self.exchanges = [{} for _ in range(n)]

    def record(self, sizes: Sequence[int], shares: list[list[int]], replies: list[ShareReply]) -> None:
        loads = share_loads(sizes, shares)
        busy = [r.busy_seconds for r in replies]
        for rank, reply in enumerate(replies):
            self.items[rank] += len(shares[rank])
            self.loads[rank] += loads[rank]
            self.busy[rank] += reply.busy_seconds
            self.stats[rank] = reply.stats
            self.devices[rank] = reply.device
            self.exchanges[rank] = reply.exchange_seconds
        self.max_load += max(loads)
        self.mean_load += sum(loads) / self.world_size
        self.max_busy += max(busy)
        self.mean_busy += sum(busy) / self.world_size

    @property
    def balance_ratio(self) -> float | None:
        return self.max_load / self.mean_load if self.mean_load else None

    def merged(self) -> GraphStats:
        """Every rank's graph statistics summed; ranks capture at once, so capture time is the longest."""
        total = GraphStats()
        for stats in self.stats:
            total.merge(stats)
        total.capture_seconds = max(s.capture_seconds for s in self.stats)
        total.pool_bytes = sum(s.pool_bytes for s in self.stats)
        return total

    def to_dict(self) -> dict[str, Any]:
        ranks = [
            {
                "rank": rank,
                "device": self.devices[rank],
                "items": self.items[rank],
                "load": self.loads[rank],
                "busy_seconds": round(self.busy[rank], 3),
                "graph_hits": self.stats[rank].hits,
                "graph_misses": self.stats[rank].misses,
                "hit_rate": round(self.stats[rank].hit_rate, 6),
                "padding_waste": self.stats[rank].padding_waste,
                "exchange_seconds": {k: round(v, 3) for k, v in self.exchanges[rank].items()},
            }
            for rank in range(self.world_size)
        ]
        ratio = self.balance_ratio
        return {
            "world_size": self.world_size,
            "balance_ratio": None if ratio is None else round(ratio, 4),
            "busy_ratio": round(self.max_busy / self.mean_busy, 4) if self.mean_busy else None,
            "ranks": ranks,
        }


class DataParallelEncoder:
    """Rank 0's encoder: the runner's BatchEncoder interface over every rank of a Cluster.

    `encode` returns what a single BatchEncoder would, in item order: each item's
    result (already in `out_dtype`, on rank 0's device) or None and a failure reason.
    """

    def __init__(self, cluster: Cluster, local: BatchEncoder, width: int, out_dtype: torch.dtype) -> None:
        self.cluster = cluster
        self.local = local
        self.width = width
        self.out_dtype = out_dtype
        self.ledger = RankLedger(cluster.world_size)

    def capture(self) -> None:
        self.local.capture()

    def clear(self) -> None:
        self.local.clear()

    @property
    def hit_rate(self) -> float:
        return self.ledger.merged().hit_rate

    def graph_stats(self) -> GraphStats:
        return self.ledger.merged()

    def stats(self) -> dict[str, Any]:
        """Rank 0's plan, every rank's graph statistics summed, and the per-rank ledger."""
        out = self.local.stats()
        out.update(self.graph_stats().to_dict())
        out.update(self.ledger.to_dict())
        out["ranks"][0]["exchange_seconds"] = {k: round(v, 3) for k, v in self.cluster.seconds.items()}
        return out

    def encode(self, items: list[EncoderInput], reduce: Reduce) -> tuple[list[torch.Tensor | None], list[str | None]]:
        sizes = [item.size for item in items]
        shares = assign_items(sizes, self.cluster.world_size)
        self.cluster.send_items([[items[i] for i in share] for share in shares])
        own_items = [items[i] for i in shares[0]]
        own = encode_share(self.local, own_items, reduce, self.width, self.out_dtype, self.cluster.device)
        replies = self.cluster.exchange(own.reply)
        blocks = self.cluster.gather_rows(own.rows, max(r.rows for r in replies))
        self.ledger.record(sizes, shares, replies)
        return _unpack(len(items), shares, replies, blocks)


def _unpack(
    count: int, shares: list[list[int]], replies: list[ShareReply], blocks: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[str | None]]:
    """Each rank's rows cut back into items (padding never read), in window order."""
    results: list[torch.Tensor | None] = [None] * count
    failures: list[str | None] = [None] * count
    for rank, (share, reply) in enumerate(zip(shares, replies)):
        offset = 0
        for index, shape, failure in zip(share, reply.shapes, reply.failures):
            failures[index] = failure
            if shape is None:
                continue
            rows = _row_count(shape)
            results[index] = blocks[rank][offset : offset + rows].reshape(shape)
            offset += rows
    return results, failures
