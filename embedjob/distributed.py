"""Data parallel across the GPUs of one node: load-balanced items, pipelined windows.

One process per GPU ("rank"), joined in one gloo process group over the loopback.
`embedjob run --gpus N` makes the calling process rank 0 and spawns ranks 1..N-1; under
torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) every rank was started by torchrun and just
joins.

Roles. Rank 0 is the shard's only reader, decoder and writer: it runs the runner's
pipeline unchanged, and the runner's window encoder hands each window to a `Spread`:
1. it assigns the window's items to ranks largest first to the least-loaded rank by
   input size (`assign_items`: the seed's load balance),
2. sends every other rank its items (in the background),
3. encodes its own share like any rank (its own graphs on its own device), and
4. when the runner finalises the window, after it has submitted the next one, takes
   every other rank's reply (per-item shapes and failures) and rows, and puts them
   back in the window's order.
The other ranks (`serve`) receive window k+1 while they encode window k and send k's
rows back while they encode k+1, until rank 0 sends the stop message. Every device thus
holds up to two windows and none waits at a window boundary for another; a rank waits
only when rank 0 has not yet decoded its next window. The output is the
single-process output: the same rows in the same parts, manifest and statistics,
written by one process; only which batch an item is packed into changes, which moves
an embedding by float rounding at most.

Why rank 0 decodes every item and sends it, instead of each rank decoding a disjoint
subset: the balance needs each item's input size, which is known only after decoding and
preprocessing, and rank 0's decode pool already uses every core of the node, so the CPU
decode runs once whichever rank computes on the item. The cost: each item that leaves
rank 0 is copied once into its rank's send buffer (`pack_items`) and crosses the
loopback, on a background thread while rank 0 encodes its own share. That is 588
bytes per Qwen-VL image patch (resized uint8 pixels, one temporal copy; video patches
1176), about 0.6 MB for a 1000-patch image; gloo moved buffers at 1-1.4 GB/s on this
project's 2-core CI machine, i.e. under 1 ms per such image, against the 10-25 ms an
H200 spends per image with a 7B-size tower (benchmarks/RESULTS.md). Results come back
the same way, from pinned host memory: a pooled embedding is a few kB. Gloo rather
than NCCL carries both: rank 0 writes the rows from its host memory anyway, and a gloo
transfer needs no device stream, so it runs on its own thread in no order with the
encode.

Failures. A rank that dies makes the job stop with a `RankFailure` naming the rank and
its exit code (or its own error message), never a hang: gloo fails a transfer with a
dead peer at once and the main thread re-raises it where it waits for that transfer;
rank 0 also watches the processes it spawned and ends itself if its main thread does not
notice within `FAILURE_GRACE` seconds; spawned ranks end when rank 0 ends; transfers
with a live but hung peer time out after `TRANSFER_TIMEOUT`; under torchrun, torchrun
stops the other ranks. Parts are committed by rank 0 alone, so the checkpoint rules are
unchanged: committed parts stay valid and a rerun resumes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import heapq
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from embedjob.encoders import EncoderInput
from embedjob.graphs import BatchEncoder, GraphStats, Reduce, cut_rows, row_count, rows_to_host
from embedjob.job import JobError

logger = logging.getLogger(__name__)
T = TypeVar("T")

TRANSFER_TIMEOUT = timedelta(minutes=30)
"""The longest one transfer may wait. Ranks wait for rank 0's next window while rank 0
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
    """This process's place in the job's process group, and its links to the other ranks.

    Use as a context manager: leaving it normally tells the other ranks to stop (rank
    0) and waits for them; leaving it by an exception stops the spawned ranks at once,
    since they may be inside a transfer that will never complete.

    Transfers run on two single-thread executors, one per direction, so neither the
    device nor the pipeline waits on the loopback, and each gloo group is only ever
    used by one thread of each process: windows go out over the default group
    (`send_window` on rank 0, `receive_window` elsewhere), results come back over
    `self.results` (`send_reply` elsewhere, `receive_replies` on rank 0). Every rank
    submits its transfers in window order, so the n-th message on a link is window n's.
    """

    def __init__(self, layout: Layout, spawned: list[_Spawned], store: dist.TCPStore | None = None) -> None:
        """With a `store` (the ranks of a spawned group) this process joins the process
        group at its first transfer (`join`), after its own setup, so rank 0 starts
        decoding while the others still load and capture; under torchrun it is in it already."""
        self.layout = layout
        self.spawned = spawned
        self.results: dist.ProcessGroup | None = None
        self._store = store
        self._in_group = store is None
        self._stopping = threading.Event()
        self._closed = False
        self._outgoing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedjob-send")
        self._incoming = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="embedjob-receive")
        self._lock = threading.Lock()
        self._seconds: collections.Counter[str] = collections.Counter()
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

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds per kind of transfer or wait so far (every thread's), for the stats."""
        with self._lock:
            return dict(self._seconds)

    @classmethod
    def start(cls, layout: Layout, target: Callable[..., None], args: tuple[Any, ...]) -> "Cluster":
        """Join the group; when not launched by torchrun, first spawn ranks 1.. to run
        `target(cluster, *args)` (a module-level function, as spawning pickles it)."""
        if layout.device.type == "cuda":
            torch.cuda.set_device(layout.device)
        if layout.launched:
            dist.init_process_group(
                "gloo", init_method="env://", rank=layout.rank, world_size=layout.world_size, timeout=TRANSFER_TIMEOUT
            )
            return cls(layout, [])
        store = dist.TCPStore(
            "127.0.0.1", 0, layout.world_size, is_master=True, timeout=TRANSFER_TIMEOUT, wait_for_workers=False
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
        try:
            if ok and self.rank == 0 and self._in_group:
                self.send_window(None).result()
                _join(self.spawned)
        finally:
            _terminate(self.spawned)
            # Once the spawned ranks are gone a transfer waiting on them fails at once;
            # a torchrun peer that failed may never answer, and torchrun ends this process.
            wait = ok or not self.layout.launched
            self._outgoing.shutdown(wait=wait, cancel_futures=True)
            self._incoming.shutdown(wait=wait, cancel_futures=True)
            if self._threads_before is not None:
                torch.set_num_threads(self._threads_before)
            if self._in_group and wait:
                dist.destroy_process_group()

    def join(self) -> None:
        """Join the process group if this rank has not yet (once, before its first
        transfer: see `__init__`). Rank 0 first checks that every spawned rank reached
        the store, failing at once if one ended; the wait is `seconds["joining the group"]`,
        so a short run's start-up is not read as throughput."""
        if self._store is None:
            return
        with self.timed("joining the group"):
            store, self._store = self._store, None
            if self.spawned:
                _wait_until_joined(store, self.spawned, self.world_size)
            dist.init_process_group(
                "gloo", store=store, rank=self.rank, world_size=self.world_size, timeout=TRANSFER_TIMEOUT
            )
            self._in_group = True
            self._make_groups()
        logger.info("data parallel over %d ranks", self.world_size)

    def _make_groups(self) -> None:
        self.results = dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT)

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Add the block's wall seconds to `seconds[what]`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._seconds[what] += time.perf_counter() - start

    def wait(self, what: str, future: "concurrent.futures.Future[T]") -> T:
        """A transfer's result, the wait counted as `what`; a failed transfer is a RankFailure."""
        with self.timed(what):
            try:
                return future.result()
            except RankFailure:
                raise
            except Exception as exc:
                raise RankFailure(self._failure(what, exc)) from exc

    # Transfers, each returning a future. A rank's n-th call of each is window n's.

    def send_window(self, shares: list[list[EncoderInput]] | None) -> "concurrent.futures.Future[None]":
        """Rank 0: ranks 1..'s items of the next window (`shares[r - 1]`), or None to stop them."""
        return self._outgoing.submit(self._send_window, shares)

    def _send_window(self, shares: list[list[EncoderInput]] | None) -> None:
        with self.timed("sending windows"):
            for rank in range(1, self.world_size):
                packed = None if shares is None else pack_items(shares[rank - 1])
                dist.send_object_list([None if packed is None else packed.header()], dst=rank)
                if packed is not None and packed.data.numel():
                    dist.send(packed.data, dst=rank)

    def receive_window(self) -> "concurrent.futures.Future[list[EncoderInput] | None]":
        """Ranks 1..: this rank's items of the next window, or None when the job is done."""
        return self._incoming.submit(self._receive_window)

    def _receive_window(self) -> list[EncoderInput] | None:
        with self.timed("receiving windows"):
            received: list[Any] = [None]
            dist.recv_object_list(received, src=0)
            if received[0] is None:
                return None
            shells, layouts, nbytes = received[0]
            data = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                dist.recv(data, src=0)
            return PackedItems(shells, layouts, data).items()

    def send_reply(self, share: "Share") -> "concurrent.futures.Future[None]":
        """Ranks 1..: one share's results to rank 0, once its device work is done."""
        return self._outgoing.submit(self._send_reply, share)

    def _send_reply(self, share: "Share") -> None:
        share.reply.busy_seconds = share.clock.seconds()  # waits for the rows' copy to the host
        with self.timed("sending results"):
            share.reply.exchange_seconds = self.seconds
            dist.send_object_list([share.reply], dst=0, group=self.results)
            if share.rows.numel():
                dist.send(share.rows, dst=0, group=self.results)

    def receive_replies(
        self, sent: "concurrent.futures.Future[None]", width: int, dtype: torch.dtype
    ) -> "concurrent.futures.Future[list[Share]]":
        """Rank 0: every other rank's results for the window whose `send_window` is `sent`."""
        return self._incoming.submit(self._receive_replies, sent, width, dtype)

    def _receive_replies(self, sent: "concurrent.futures.Future[None]", width: int, dtype: torch.dtype) -> list["Share"]:
        sent.result()  # a window that never left gets no reply
        shares = []
        with self.timed("receiving results"):
            for rank in range(1, self.world_size):
                received: list[Any] = [None]
                dist.recv_object_list(received, src=rank, group=self.results)
                reply: ShareReply = received[0]
                rows = torch.empty((reply.rows, width), dtype=dtype)
                if reply.rows:
                    dist.recv(rows, src=rank, group=self.results)
                shares.append(Share(reply, rows))
        return shares

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
        store = dist.TCPStore(member.host, member.port, member.world_size, is_master=False, timeout=TRANSFER_TIMEOUT)
        store.set(f"embedjob/joined/{member.rank}", "1")
        # Not closed: `target` returns once its last reply is sent and the process ends
        # right below; leaving the group first only delays rank 0, which waits for that.
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
    """What a rank sends rank 0 after encoding its share of a window.

    `shapes[j]` is the result shape of the share's j-th item, or None when it failed
    (then `failures[j]` says why); its rows follow the previous items' rows in the
    rows sent with the reply. `busy_seconds` is how long the share occupied the rank's
    device (`BusyClock`), `stats` the rank's cumulative graph statistics and
    `exchange_seconds` its cumulative wall seconds per kind of transfer or wait up to
    this window (waiting for a window, receiving, sending), which tell a slow run's cause.
    """

    shapes: list[tuple[int, ...] | None]
    failures: list[str | None]
    busy_seconds: float
    stats: GraphStats
    device: str
    exchange_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(row_count(shape) for shape in self.shapes if shape is not None)


class BusyClock:
    """How long one share occupied its device, from construction to `stop`.

    On a GPU it is the time between two events on the stream, so a share whose work
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
        """The measured seconds; on a GPU, waits until the share's work is done."""
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


@dataclass
class Share:
    """A share's reply and its rows on the host, in the output dtype; on the rank that
    encoded it, also the clock whose end says the rows have arrived."""

    reply: ShareReply
    rows: torch.Tensor
    clock: BusyClock | None = None


def encode_share(
    encoder: BatchEncoder, items: list[EncoderInput], reduce: Reduce, width: int, out_dtype: torch.dtype,
    device: torch.device,
) -> Share:
    """Encode one rank's items; their rows concatenated in item order, in the output
    dtype, on their way to the host (the copy is queued behind the encode; the share's
    clock stops after it, so `clock.seconds()` returning means the rows have arrived).

    The rows go through `rows_to_host`, like the single-process runner's, so they are
    the same values, converted on the device (float16 output moves half the bytes).
    """
    clock = BusyClock(device)
    results, failures = encoder.encode(items, reduce)
    host = rows_to_host([r for r in results if r is not None], width, out_dtype)
    clock.stop()
    shapes = [None if r is None else tuple(r.shape) for r in results]
    # A copy: the reply is pickled on the sending thread while the next share updates the counts.
    stats = copy.deepcopy(encoder.graph_stats())
    return Share(ShareReply(shapes, failures, 0.0, stats, str(device)), host, clock)


def serve(cluster: Cluster, encoder: BatchEncoder, reduce: Reduce, width: int, out_dtype: torch.dtype) -> None:
    """Ranks 1..: encode each window's share until rank 0 says stop.

    The next window is received while this one is encoded, and each share's results
    travel back while the next one is encoded, so the device waits only when rank 0
    has not yet sent the next window (`exchange_seconds["waiting for a window"]`).
    """
    cluster.join()
    incoming = cluster.receive_window()
    sending: collections.deque[concurrent.futures.Future[None]] = collections.deque()
    for window in itertools.count():
        items = cluster.wait("waiting for a window", incoming)
        if items is None:
            break
        incoming = cluster.receive_window()
        _maybe_fail(cluster.rank, window)
        sending.append(cluster.send_reply(encode_share(encoder, items, reduce, width, out_dtype, cluster.device)))
        while sending and sending[0].done():
            cluster.wait("sending results", sending.popleft())  # raises if it failed
    while sending:
        cluster.wait("sending the last results", sending.popleft())


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

    def record(self, loads: Sequence[int], counts: Sequence[int], replies: list[ShareReply]) -> None:
        """One window: each rank's load and item count, and its reply (rank 0's own too)."""
        busy = [r.busy_seconds for r in replies]
        for rank, reply in enumerate(replies):
            self.items[rank] += counts[rank]
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


@dataclass
class Spreading:
    """A window rank 0 has spread: the window positions and load of each rank's share,
    the other ranks' results to come, and the clock of rank 0's own share."""

    shares: list[list[int]]
    loads: list[int]
    replies: "concurrent.futures.Future[list[Share]] | None"
    clock: BusyClock


class Spread:
    """Rank 0's side of data parallel: spreads each window over every rank.

    The runner calls `submit` for window k, encodes the positions it returns on its own
    device, then `collect`s window k-1 (so it is pipelined like the single-process
    runner): every rank holds up to two windows, encoding one while the next arrives,
    and no device waits at a window boundary for another rank, only for rank 0's decode.
    """

    def __init__(self, cluster: Cluster, local: BatchEncoder, width: int, out_dtype: torch.dtype) -> None:
        self.cluster = cluster
        self.local = local
        self.width = width
        self.out_dtype = out_dtype
        self.ledger = RankLedger(cluster.world_size)

    def submit(self, items: dict[int, EncoderInput]) -> tuple[list[int], Spreading]:
        """Send the other ranks their shares of a window's items (by window position);
        the positions rank 0 encodes itself, and what `collect` needs. Rank 0's clock
        starts here: stop it once its own share's rows are queued for the host."""
        positions = sorted(items)
        sizes = [items[p].size for p in positions]
        shares = assign_items(sizes, self.cluster.world_size)
        loads = share_loads(sizes, shares)
        shares = [[positions[i] for i in share] for share in shares]
        replies = None
        if self.cluster.world_size > 1:
            self.cluster.join()
            sent = self.cluster.send_window([[items[p] for p in share] for share in shares[1:]])
            replies = self.cluster.receive_replies(sent, self.width, self.out_dtype)
        return shares[0], Spreading(shares, loads, replies, BusyClock(self.cluster.device))

    def collect(self, spreading: Spreading) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """The other ranks' embeddings and failures by window position; the window's
        ledger entry. Call once rank 0's own rows of the window are on the host."""
        remote = [] if spreading.replies is None else self.cluster.wait("waiting for results", spreading.replies)
        own = ShareReply([], [], spreading.clock.seconds(), self.local.graph_stats(), str(self.cluster.device))
        self.ledger.record(spreading.loads, [len(s) for s in spreading.shares], [own, *(s.reply for s in remote)])
        embeddings: dict[int, np.ndarray] = {}
        failures: dict[int, str] = {}
        for share, result in zip(spreading.shares[1:], remote):
            rows = cut_rows(result.rows.numpy(), result.reply.shapes)
            for position, embedding, failure in zip(share, rows, result.reply.failures):
                if failure is not None:
                    failures[position] = failure
                if embedding is not None:
                    embeddings[position] = embedding
        return embeddings, failures

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
