"""Data parallel over the GPUs of one node: one whole pipeline per GPU, rows handed out
in chunks, results put back in order by the one process that writes.

One process per GPU ("rank"). `embedjob run --gpus N` makes the calling process rank 0
and spawns ranks 1..N-1; under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) torchrun
started every rank. Each rank runs its own pipeline (`pipeline.RankPipeline`): it takes
a chunk of the shard's rows (`reader.Chunk`, a few dozen rows in row order) whenever
it needs more, reads and decodes them with its own decode workers, packs, replays its
own graphs and hands each finished chunk's rows back as a `RowBlock` (embeddings and
per-row errors). Rank 0 also writes: its `Coordinator` hands out the chunks in row
order and gives their results to the one writer in that order, so the output is the
single-GPU output (same rows, parts, manifest and statistics file). No decoded pixel
crosses between processes: a pooled embedding is a few kB.

Balance comes from the hand-out: a rank takes its next chunk when it needs one, so a
rank that draws large images takes fewer chunks. The reorder memory is bounded: rank 0
hands out at most `lookahead` chunks beyond the first one not yet written, and a rank
asking for more waits, whatever the input or the ranks' speeds.

Links. Rank 0 listens on 127.0.0.1 only (an ephemeral port) and each other rank
connects once and proves it belongs to the run with a random token, which spawned
ranks get in their arguments and torchrun's ranks through torchrun's store. The first
frame (HELLO: token, rank, pid) is plain text, read before anything is unpickled, and
must arrive within `HANDSHAKE_TIMEOUT`; each connection's handshake runs on a thread of
its own, so a stray or idle connection delays no rank, and every rank must have joined
within `JOIN_TIMEOUT` of rank 0 listening (then the listener closes). After it a link
carries `wire` frames: TAKE (a rank asks for a chunk), CHUNK (the answer; None when
there are no more), READY (the rank has captured its graphs), GO (rank 0 to every rank:
all are ready), ROWS (a finished chunk), HEARTBEAT (the rank is alive), DONE (the
rank's statistics, its last message) and FAILED (its error). On rank 0 one thread per
link reads and another answers TAKEs, so a rank that waits for a chunk never holds up
the rows it sends; on the other ranks one thread reads, so a wait for GO and a wait for
a chunk can overlap.

Failures. A rank that dies closes its link: rank 0 stops the job with a `RankFailure`
naming the rank and its exit code (or its own error message), never a hang; spawned
ranks end when rank 0 ends, torchrun stops the others under torchrun, and rank 0's
watchdog ends it if its main thread does not notice within `FAILURE_GRACE`. A chunk
that a live rank holds for longer than `TRANSFER_TIMEOUT` stops the job too. Parts are
committed by rank 0 alone, so the checkpoint rules are unchanged: committed parts stay
valid and a rerun resumes. A rank that is alive but sends nothing, not even its
heartbeat, for `SILENCE_LIMIT` (a stopped or hung process) is named in a warning, again
each time its silence doubles, and once more when it is heard from again.
"""

from __future__ import annotations

import collections
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from embedjob.config import JobError
from embedjob.io.reader import Chunk
from embedjob.io.writer import RowBlock
from embedjob.workers import wire

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT = 30 * 60.0
"""The longest a rank may hold a chunk, and the longest rank 0 waits for the others'
statistics. It only bounds a hung peer; a dead one is detected at once."""

HANDSHAKE_TIMEOUT = 1.0
"""Seconds a new connection to rank 0's link gets to present the run's token. A rank
sends it the moment it connects; anything else (a port scanner, a stray client) is
dropped after this, on its own thread, without holding up any other connection."""

HANDSHAKE_BYTES = 256
"""The largest first frame rank 0 reads from a new connection (a HELLO is about 60
bytes): garbage announcing a huge frame is refused before anything is allocated."""

JOIN_TIMEOUT = 5 * 60.0
"""Seconds every other rank gets to join rank 0's link, from when rank 0 listens. A
spawned rank joins once its interpreter and imports are up (seconds; a minute from a
cold shared file system); past this the job stops with one line naming the missing."""

SILENCE_LIMIT = 60.0
"""Seconds without a frame from a rank that has joined and not finished before rank 0
warns of it. Ranks send a heartbeat every `heartbeat_interval()`, so only a stopped or
hung process stays silent this long; a test shrinks it, and the ranks' heartbeat with it."""
REAP_WAIT = 1.0
"""Seconds the watchdog waits to reap a rank whose sentinel says it is exiting."""

FAILURE_GRACE = 30.0
"""Seconds rank 0's main thread gets to notice a dead rank itself before the watchdog
ends the process (it may be stuck in a wait that cannot be interrupted)."""

FAULT_ENV = "EMBEDJOB_DIST_FAULT"
"""Fault injection for the failure tests: "R:C" makes rank R exit with code 17 when it
is handed its chunk number C (0-based, counting that rank's chunks)."""

FAULT_EXIT_CODE = 17
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RESUME_HINT = "committed parts are kept; rerun the same command to resume"
HOST = "127.0.0.1"

HELLO, TAKE, CHUNK, ROWS, READY, DONE, FAILED, GO, HEARTBEAT = range(9)


class RankFailure(RuntimeError):
    """A rank died or stopped answering; the job cannot finish this run."""


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
    ranks may be asked for, which is how CI runs this module.
    """
    env = os.environ
    if all(key in env for key in TORCHRUN_ENV):
        world, rank, local = (int(env[key]) for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
        if gpus not in ("auto", world):
            raise JobError(
                f"runtime.gpus = {gpus} but torchrun started {world} processes (WORLD_SIZE); "
                "drop --gpus/runtime.gpus or start torchrun with that many processes"
            )
        if int(env.get("LOCAL_WORLD_SIZE", world)) != world:
            raise JobError(
                f"torchrun started {world} processes over several nodes; one shard runs on the GPUs of one node: "
                "start torchrun on one node and spread nodes over shards (--shard I/N, or embedjob submit)"
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


def cpu_share(world_size: int) -> int:
    """This rank's share of the cores the process may run on (under SLURM, the task's
    allocation): the ranks of one node divide them, at least one each."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


# --- hand-out and reorder (rank 0) --------------------------------------------------


class Coordinator:
    """Hands out a shard's chunks in row order and gives their results back in that order.

    Any rank `take`s the next chunk when it needs one and `put`s the chunk's rows when
    done; the writer iterates `results`. Invariants: each chunk is handed out once, in
    order; `results` yields every chunk's rows exactly once, in chunk order; at most
    `lookahead` chunks are handed out beyond the first one not yet written, so at most
    that many results wait in memory. A `fail` wakes every waiter with the error.

    Start: a rank's first `head_start` takes are answered at once (it decodes those
    chunks while it loads and captures, so its GPU has work the moment it is ready, and
    learns whether it has anything to do before loading a model); its next ones wait
    until every rank is `ready` (or had nothing to take), which `all_ready` tells.
    Otherwise a rank still setting up would hold its chunks while the others ran ahead
    to the lookahead and then waited for them with nothing decoded, and the fast ranks'
    full-speed decoding would slow the others' setup. A rank ready first encodes only
    part of its head start before every rank is ready (`RankPipeline`), so it waits
    with the rest decoded. `world_size * head_start <= lookahead`, so no head start
    waits on the lookahead.
    """

    def __init__(self, world_size: int, lookahead: int, head_start: int = 1) -> None:
        if not 1 <= head_start or world_size * head_start > lookahead:
            raise ValueError(
                f"need 1 <= head_start and world_size * head_start <= lookahead, got {world_size}, {head_start}, {lookahead}"
            )
        self.world_size = world_size
        self.lookahead = lookahead
        self.head_start = head_start
        self._cond = threading.Condition()
        self._chunks: list[Chunk] | None = None
        self._next = 0
        self._taken: collections.Counter[int] = collections.Counter()
        self._ready: set[int] = set()
        self._written = 0
        self._results: dict[int, RowBlock] = {}
        self._rows_before_ready = 0
        self._holders: dict[int, int] = {}
        self._error: BaseException | None = None

    def open(self, chunks: list[Chunk]) -> None:
        """The shard's chunks, in order; takes wait until this is called."""
        with self._cond:
            self._chunks = list(chunks)
            self._cond.notify_all()

    @property
    def total(self) -> int:
        with self._cond:
            return len(self._chunks or [])

    def ready(self, rank: int) -> None:
        """`rank` has captured its graphs and takes chunks from now on."""
        with self._cond:
            self._ready.add(rank)
            self._cond.notify_all()

    def take(self, rank: int) -> Chunk | None:
        """The next chunk for `rank`, or None when every chunk is handed out."""
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._chunks is not None and (self._taken[rank] < self.head_start or self._all_ready()):
                    if self._next >= len(self._chunks):
                        if not self._taken[rank]:
                            self.ready(rank)  # it will never capture anything: do not wait for it
                        return None
                    if self._next < self._written + self.lookahead:
                        chunk = self._chunks[self._next]
                        self._holders[chunk.index] = rank
                        self._taken[rank] += 1
                        self._next += 1
                        return chunk
                self._cond.wait()

    def _all_ready(self) -> bool:
        return len(self._ready) == self.world_size

    def all_ready(self, timeout: float | None = None) -> bool:
        """Whether every rank is ready, waiting up to `timeout` seconds for it (None:
        until it is). Raises the job's failure instead of waiting on through it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_failed()
                if self._all_ready():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)

    def put(self, index: int, block: RowBlock) -> None:
        with self._cond:
            self._results[index] = block
            if not self._all_ready():
                self._rows_before_ready += len(block)
            self._cond.notify_all()

    @property
    def rows_before_ready(self) -> int:
        """Rows returned before every rank was ready: a rank that is ready first encodes
        its head start while the others still set up, and a rate over the time after
        setup must not count those rows."""
        with self._cond:
            return self._rows_before_ready

    def fail(self, error: BaseException) -> None:
        """Stop every take and the writer with `error` (the first failure wins)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def results(self, timeout: float = TRANSFER_TIMEOUT) -> Iterator[RowBlock]:
        """Every chunk's rows in chunk order; the next chunk is handed out beyond the
        lookahead only once the consumer comes back for the next result."""
        for index in range(self.total):
            block = self._wait_for(index, timeout)
            yield block
            with self._cond:
                self._written = index + 1
                self._cond.notify_all()

    def _wait_for(self, index: int, timeout: float) -> RowBlock:
        deadline = time.monotonic() + timeout
        with self._cond:
            while index not in self._results:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    holder = self._holders.get(index)
                    raise RankFailure(
                        f"rank {holder} has not returned rows {self._chunks[index].first_row}-"
                        f"{self._chunks[index].end_row - 1} for {timeout:g}s; {RESUME_HINT}"
                    )
                self._cond.wait(left)
            return self._results.pop(index)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


# --- the links ----------------------------------------------------------------------


def listen_on_loopback() -> socket.socket:
    """Rank 0's listening socket: loopback only, an ephemeral port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen()
    return listener


def heartbeat_interval() -> float:
    """How often a rank tells rank 0 it is alive: a tenth of `SILENCE_LIMIT`, read where
    rank 0 starts the ranks, so a rank busy for long without a frame to send (loading,
    capturing, one long window) is never taken for a silent one."""
    return SILENCE_LIMIT / 10


def send_hello(sock: socket.socket, token: str, rank: int) -> None:
    """A rank's first frame on its link: the run's token, its rank and its process id,
    as plain text, so that rank 0 unpickles nothing a peer sends before it has proved
    itself (unpickling runs whatever code the pickle names)."""
    wire.send_frame(sock, HELLO, f"{token} {rank} {os.getpid()}".encode(), [])


@dataclass
class _Peer:
    """Rank 0's end of one joined rank's link.

    `heard` (monotonic) is when the rank's last frame arrived, `held` the chunks it took
    and has not returned rows for, `warned` the silence in seconds that rank 0 last
    warned of (0: none since the rank's last frame); the Hub's lock guards all three.
    """

    rank: int
    pid: int
    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    heard: float = field(default_factory=time.monotonic)
    held: dict[int, Chunk] = field(default_factory=dict)
    warned: float = 0.0


class Hub:
    """Rank 0's end of the links: admits the other ranks, answers their TAKEs from the
    coordinator, gives their ROWS to it, keeps their statistics and warns of a rank it
    has not heard from for `SILENCE_LIMIT`.

    The accept thread hands each connection to a handshake thread of its own and ends
    once every rank has joined (closing the listener) or `JOIN_TIMEOUT` has passed
    (failing the job). Per link, a reader thread takes every frame and a taker thread
    answers TAKEs one at a time (a take may wait for the writer), sending under the
    link's lock.
    """

    def __init__(self, listener: socket.socket, token: str, world_size: int, spawned: list["_Spawned"]) -> None:
        self.listener = listener
        self.token = token
        self.world_size = world_size
        self.spawned = spawned
        self.port: int = listener.getsockname()[1]
        self._coordinator: Coordinator | None = None
        self._served = threading.Event()
        self._cond = threading.Condition()
        self._stats: dict[int, Any] = {}
        self._ended: dict[int, str] = {}
        self._peers: dict[int, _Peer] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="embedjob-hub", daemon=True).start()
        threading.Thread(target=self._watch_silence, name="embedjob-silence", daemon=True).start()

    def serve(self, coordinator: Coordinator) -> None:
        """Answer the ranks' TAKEs from `coordinator` (they wait until this is called),
        and send every rank GO once all are ready. A rank that failed before (one that
        never joined) fails `coordinator` at once."""
        with self._cond:
            self._coordinator = coordinator
            why = next(iter(self._ended.values()), None)
        if why is not None:
            coordinator.fail(RankFailure(why))
        self._served.set()
        threading.Thread(target=self._go, name="embedjob-go", daemon=True).start()

    def _go(self) -> None:
        try:
            self._coordinator.all_ready()
        except BaseException:
            return  # the job is failing; the ranks learn it when rank 0 ends
        # Every other rank said READY (or took nothing) over its link, so all have joined.
        with self._cond:
            peers = list(self._peers.values())
        for peer in peers:
            try:
                with peer.lock:
                    wire.send(peer.sock, GO, None)
            except OSError:
                pass  # that rank's reader thread reports it

    def wait_done(self) -> list[Any]:
        """Every other rank's statistics (their DONE), in rank order. Raises RankFailure
        for a rank that ended, or whose link closed, without one."""
        deadline = time.monotonic() + TRANSFER_TIMEOUT
        with self._cond:
            while len(self._stats) < self.world_size - 1:
                failed = self._failed_rank()
                if failed is not None:
                    raise RankFailure(failed)
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks {sorted(set(range(1, self.world_size)) - set(self._stats))} never finished")
                self._cond.wait(0.2)
            return [self._stats[rank] for rank in range(1, self.world_size)]

    def close(self) -> None:
        self._closed.set()
        _shut_down(self.listener)  # wakes the accept thread
        with self._cond:
            socks = [peer.sock for peer in self._peers.values()]
        for sock in [self.listener, *socks]:
            try:
                sock.close()
            except OSError:
                pass

    def _failed_rank(self) -> str | None:
        for rank, why in self._ended.items():
            if rank not in self._stats:
                return why
        for s in self.spawned:
            if s.process.exitcode is not None and s.rank not in self._stats:
                return f"rank {s.rank} of {self.world_size} {s.reason()}; {RESUME_HINT}"
        return None

    def _accept(self) -> None:
        """Take connections until every rank has joined or `JOIN_TIMEOUT` has passed,
        each to a handshake thread of its own, so an idle one holds up no other."""
        deadline = time.monotonic() + JOIN_TIMEOUT
        try:
            while not self._all_joined():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._missed_join()
                    return
                try:
                    self.listener.settimeout(left)
                    sock, _ = self.listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return  # shut down: the last rank joined, or the hub closed
                threading.Thread(target=self._handshake, args=(sock,), name="embedjob-handshake", daemon=True).start()
        finally:
            self.listener.close()

    def _all_joined(self) -> bool:
        with self._cond:
            return len(self._peers) == self.world_size - 1

    def _missed_join(self) -> None:
        with self._cond:
            missing = [rank for rank in range(1, self.world_size) if rank not in self._peers]
        which = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        self._end(missing, f"{which} of {self.world_size} did not join rank 0 within {JOIN_TIMEOUT:g}s; {RESUME_HINT}")

    def _handshake(self, sock: socket.socket) -> None:
        """Admit `sock` as the rank it names if its HELLO proves it in time; else close it."""
        peer = self._hello(sock)
        if peer is None:
            sock.close()
            return
        logger.debug("rank %d of %d (pid %d) joined", peer.rank, self.world_size, peer.pid)
        takes: queue.SimpleQueue[bool] = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(peer, takes), name=f"embedjob-link{peer.rank}", daemon=True).start()
        threading.Thread(target=self._answer, args=(peer, takes), name=f"embedjob-take{peer.rank}", daemon=True).start()
        if self._all_joined():
            _shut_down(self.listener)  # later connections are refused, not left waiting

    def _hello(self, sock: socket.socket) -> _Peer | None:
        """The rank a new connection belongs to, registered, if its first frame comes
        within `HANDSHAKE_TIMEOUT` and carries the token; else None, after one line."""
        try:
            wire.receive_timeout(sock, HANDSHAKE_TIMEOUT)
            kind, payload, buffers = wire.receive_frame(sock, HANDSHAKE_TIMEOUT, HANDSHAKE_BYTES)
            wire.receive_timeout(sock, None)
        except (EOFError, OSError, ValueError) as exc:
            logger.warning(
                "dropped a connection to the rank link that sent no handshake within %gs (%s)", HANDSHAKE_TIMEOUT, exc
            )
            return None
        hello = re.fullmatch(rb"(\S+) (\d+) (\d+)", bytes(payload)) if kind == HELLO and not buffers else None
        if hello is None or not hmac.compare_digest(hello[1], self.token.encode()):
            logger.warning("a connection to the rank link did not present this run's token; dropped")
            return None
        rank, pid = int(hello[2]), int(hello[3])
        with self._cond:
            if self._closed.is_set():
                return None
            if not 0 < rank < self.world_size or rank in self._peers:
                logger.warning("a connection claimed rank %d, which is not free; dropped", rank)
                return None
            peer = self._peers[rank] = _Peer(rank, pid, sock)
        return peer

    def _read(self, peer: _Peer, takes: "queue.SimpleQueue[bool]") -> None:
        rank = peer.rank
        try:
            while True:
                kind, body = wire.receive(peer.sock)
                self._heard(peer)
                if kind == TAKE:
                    takes.put(True)
                elif kind == ROWS:
                    self._served.wait()
                    index, block = body
                    with self._cond:
                        peer.held.pop(index, None)
                    self._coordinator.put(index, block)
                elif kind == READY:
                    self._served.wait()
                    self._coordinator.ready(rank)
                elif kind == DONE:
                    with self._cond:
                        self._stats[rank] = body
                        self._cond.notify_all()
                    return
                elif kind == FAILED:
                    self._end([rank], f"rank {rank} of {self.world_size} failed: {body}; {RESUME_HINT}")
                    return
        except (EOFError, OSError, TimeoutError) as exc:
            if not self._closed.is_set():
                self._end([rank], self._why_ended(rank, exc))
        finally:
            takes.put(False)

    def _heard(self, peer: _Peer) -> None:
        """A frame came from `peer`; of a HEARTBEAT that is all there is to know."""
        now = time.monotonic()
        with self._cond:
            if peer.warned:
                logger.warning(
                    "rank %d of %d (pid %d) is heard from again after %.0fs of silence",
                    peer.rank, self.world_size, peer.pid, now - peer.heard,
                )
                peer.warned = 0.0
            peer.heard = now

    def _answer(self, peer: _Peer, takes: "queue.SimpleQueue[bool]") -> None:
        while takes.get():
            self._served.wait()
            try:
                chunk = self._coordinator.take(peer.rank)
            except BaseException:
                return  # the job is failing; the rank learns it when rank 0 ends
            if chunk is not None:
                with self._cond:
                    peer.held[chunk.index] = chunk
            try:
                with peer.lock:
                    wire.send(peer.sock, CHUNK, chunk)
            except OSError:
                return

    def _watch_silence(self) -> None:
        """Warn of every rank that has joined, not ended, and sent nothing for
        `SILENCE_LIMIT`, and again each time its silence doubles: a stopped or hung
        rank holds the job up to `TRANSFER_TIMEOUT`, and must not do it without a word."""
        while not self._closed.wait(SILENCE_LIMIT / 4):
            now = time.monotonic()
            with self._cond:
                for peer in self._peers.values():
                    silent = now - peer.heard
                    ended = peer.rank in self._stats or peer.rank in self._ended
                    if ended or silent < max(SILENCE_LIMIT, 2 * peer.warned):
                        continue
                    peer.warned = silent
                    logger.warning(
                        "rank %d of %d (pid %d) has sent nothing, not even a heartbeat, for %.0fs "
                        "(stopped or hung?); it holds %s",
                        peer.rank, self.world_size, peer.pid, silent, _rows(peer.held.values()),
                    )

    def _end(self, ranks: list[int], why: str) -> None:
        logger.error("%s", why)
        with self._cond:
            for rank in ranks:
                self._ended[rank] = why
            coordinator = self._coordinator
            self._cond.notify_all()
        if coordinator is not None:
            coordinator.fail(RankFailure(why))

    def _why_ended(self, rank: int, exc: BaseException) -> str:
        """Name the rank's exit, if it was spawned (it may take a moment to be reaped)."""
        spawned = next((s for s in self.spawned if s.rank == rank), None)
        deadline = time.monotonic() + 5.0
        while spawned is not None and spawned.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if spawned is not None and spawned.process.exitcode is not None:
            return f"rank {rank} of {self.world_size} {spawned.reason()}; {RESUME_HINT}"
        return f"rank {rank} of {self.world_size} closed its link ({type(exc).__name__}: {exc}); {RESUME_HINT}"


def _shut_down(listener: socket.socket) -> None:
    """Stop `listener` taking connections; this wakes a thread blocked in its accept,
    which closing it from another thread would not."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


def _rows(chunks: Iterable[Chunk]) -> str:
    """The rows of `chunks` for a log line, in chunk order: "rows 0-3, 8-11" or "no rows"."""
    spans = [f"{c.first_row}-{c.end_row - 1}" for c in sorted(chunks, key=lambda c: c.index)]
    return f"rows {', '.join(spans)}" if spans else "no rows"


class Link:
    """A rank's connection to rank 0: `take` chunks, `put` their rows, `finish`.

    Rows go out on a sender thread through a short queue, so the pipeline does not wait
    for the socket. A reader thread receives: CHUNK answers go to `take`'s caller (the
    thread that reads the rank's input, the only one that takes, one take at a time),
    GO sets the event `all_ready` waits on. A heartbeat thread sends a HEARTBEAT every
    `heartbeat` seconds until the link's last message (DONE or FAILED), which nothing
    follows.
    """

    QUEUE = 8

    def __init__(self, port: int, token: str, rank: int, heartbeat: float) -> None:
        self.rank = rank
        self.sock = _connect(port)
        self._lock = threading.Lock()
        self._said_last = threading.Event()
        send_hello(self.sock, token, rank)
        self._outgoing: queue.Queue[tuple[int, Any] | None] = queue.Queue(self.QUEUE)
        self._error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_queued, name="embedjob-send", daemon=True)
        self._sender.start()
        self._answers: queue.SimpleQueue[Chunk | None | RankFailure] = queue.SimpleQueue()
        self._go = threading.Event()
        self._everyone_ready = False
        self._closed: RankFailure | None = None
        threading.Thread(target=self._receive, name="embedjob-receive", daemon=True).start()
        threading.Thread(target=self._beat, args=(heartbeat,), name="embedjob-heartbeat", daemon=True).start()
        self._taken = 0

    def take(self) -> Chunk | None:
        if self._closed is not None:
            raise self._closed  # its one queued answer went to an earlier take
        with self._lock:
            wire.send(self.sock, TAKE, None)
        chunk = self._answers.get()
        if isinstance(chunk, RankFailure):
            raise chunk
        if chunk is not None:
            _maybe_fail(self.rank, self._taken)
            self._taken += 1
        return chunk

    def all_ready(self, timeout: float | None = None) -> bool:
        """Whether rank 0 said every rank is ready (GO), waiting up to `timeout` seconds
        for it (None: until it does). Raises if the link closed first."""
        self._go.wait(timeout)
        if self._everyone_ready:
            return True
        if self._closed is not None:
            raise self._closed
        return False

    def _receive(self) -> None:
        try:
            while True:
                kind, body = wire.receive(self.sock)
                if kind == CHUNK:
                    self._answers.put(body)
                elif kind == GO:
                    self._everyone_ready = True
                    self._go.set()
                else:
                    raise RankFailure(f"rank {self.rank}: unexpected message {kind} from rank 0")
        except (EOFError, OSError) as exc:
            self._closed = RankFailure(f"rank {self.rank}: rank 0 closed the link ({exc})")
        except RankFailure as exc:
            self._closed = exc
        self._answers.put(self._closed)
        self._go.set()

    def put(self, index: int, block: RowBlock) -> None:
        self._raise_if_failed()
        self._outgoing.put((index, block))

    def ready(self) -> None:
        """This rank has captured its graphs (see `Coordinator.ready`)."""
        self._send(READY, None)

    def finish(self, stats: Any) -> None:
        """Send what is queued, then the statistics; the link is done."""
        self._outgoing.put(None)
        self._sender.join()
        self._raise_if_failed()
        self._send(DONE, stats, last=True)

    def fail(self, message: str) -> None:
        try:
            self._send(FAILED, message, last=True)
        except OSError:
            pass

    def _send(self, kind: int, body: Any, last: bool = False) -> None:
        with self._lock:
            if last:
                self._said_last.set()
            wire.send(self.sock, kind, body)

    def _beat(self, interval: float) -> None:
        """Tell rank 0 this rank is alive, however long the pipeline goes without a
        frame to send: rank 0 warns of a rank silent for SILENCE_LIMIT."""
        while not self._said_last.wait(interval):
            with self._lock:
                if self._said_last.is_set():
                    return
                try:
                    wire.send(self.sock, HEARTBEAT, None)
                except OSError:
                    return  # the reader thread reports the closed link

    def _send_queued(self) -> None:
        while (message := self._outgoing.get()) is not None:
            try:
                self._send(ROWS, message)
            except OSError as exc:
                self._error = RankFailure(f"rank {self.rank}: cannot send rows to rank 0 ({exc})")
                return

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _connect(port: int) -> socket.socket:
    """Connect to rank 0's link, retrying while it starts listening (torchrun's ranks
    start in any order)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while True:
        try:
            sock = socket.create_connection((HOST, port), timeout=10.0)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        sock.settimeout(None)  # rank 0 may rightly hold a take back for long
        return sock


def _maybe_fail(rank: int, chunk: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{chunk}":
        logger.error("%s=%s: rank %d exits now", FAULT_ENV, spec, rank)
        os._exit(FAULT_EXIT_CODE)


# --- the ranks' processes -----------------------------------------------------------


@dataclass(frozen=True)
class _Member:
    """What a spawned rank needs to join: rank 0's link, its heartbeat and its place."""

    port: int
    token: str
    world_size: int
    rank: int
    device: str
    log_level: int
    threads: int
    spawned_at: float
    heartbeat: float


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
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return f"{how}: {self.message}" if self.message else how


class Cluster:
    """This process's place among the ranks of one shard: the Hub on rank 0, a Link elsewhere.

    Use as a context manager: leaving it normally waits for the spawned ranks to end
    (rank 0); leaving it by an exception stops them at once, since they may be waiting
    for rows that will never be handed out.
    """

    def __init__(
        self,
        layout: Layout,
        spawned: list[_Spawned],
        hub: Hub | None = None,
        link: Link | None = None,
        started: tuple[float, float] | None = None,
    ) -> None:
        self.layout = layout
        self.spawned = spawned
        self.hub = hub
        self.link = link
        self._stopping = threading.Event()
        self._closed = False
        self.started = started
        """(when rank 0 started this process, when its code began to run), wall-clock:
        given on spawned ranks only, whose statistics then say what their start cost."""
        # Closing the writer ends the watchdog's wait on the reader at once, so `close`
        # can stop the watchdog before it reaps the ranks itself: two threads reaping one
        # process race, and the loser reads no exit code (and warned of a rank that had
        # ended well).
        self._wake_reader, self._wake_writer = multiprocessing.Pipe(duplex=False)
        self._watchdog = threading.Thread(target=self._watch, name="embedjob-rank-watchdog", daemon=True)
        if spawned:
            self._watchdog.start()

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
        """Rank 0 listens, then spawns ranks 1.. to run `target(cluster, *args)` (a
        module-level function, as spawning pickles it) unless torchrun started them;
        under torchrun the other ranks connect to the port rank 0 publishes."""
        if layout.device.type == "cuda":
            torch.cuda.set_device(layout.device)
        if layout.rank == 0:
            listener = listen_on_loopback()
            token = secrets.token_hex(16)
            port = listener.getsockname()[1]
            heartbeat = heartbeat_interval()
            if layout.launched:
                _torchrun_store(layout).set("link", f"{port} {token} {heartbeat}")
                spawned = []
            else:
                spawned = _spawn(layout, port, token, heartbeat, target, args)
            return cls(layout, spawned, hub=Hub(listener, token, layout.world_size, spawned))
        port, token, heartbeat = _torchrun_store(layout).get("link").decode().split()
        return cls(layout, [], link=Link(int(port), token, layout.rank, float(heartbeat)))

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool) -> None:
        """Wait for (ok) or stop the spawned ranks, and close the links (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._wake_writer.close()
        if self._watchdog.is_alive():
            self._watchdog.join()
        self._wake_reader.close()
        try:
            if ok:
                _join(self.spawned)
        finally:
            _terminate(self.spawned)
            if self.hub is not None:
                self.hub.close()
            if self.link is not None:
                self.link.sock.close()

    def _watch(self) -> None:
        """Rank 0's watchdog over the ranks it spawned (see the module docstring).

        It waits on the ranks still running only, and ends when none is: a rank that
        finished (exit code 0, as every other rank does once the chunks run out while
        rank 0 still encodes and writes its last ones) leaves a sentinel that stays
        ready, and waiting on it returned at once, over and over, taking a core and the
        GIL from rank 0's own work (8 CPU ranks: rank 0 encoded 130x slower)."""
        running = list(self.spawned)
        while running and not self._stopping.is_set():
            ready = multiprocessing.connection.wait([s.process.sentinel for s in running] + [self._wake_reader], timeout=0.5)
            for s in running:
                if s.process.sentinel in ready:
                    # Its sentinel is ready as the process exits, a moment before the
                    # kernel lets it be reaped; until then its exit code reads None and
                    # the ready sentinel would wake this loop at once, over and over.
                    s.process.join(REAP_WAIT)
            ended = [s for s in running if s.process.exitcode not in (None, 0)]
            if ended and not self._stopping.is_set():
                if self._stopping.wait(FAILURE_GRACE):
                    return
                message = f"rank {ended[0].rank} of {self.world_size} {ended[0].reason()}; {RESUME_HINT}"
                logger.error("%s; rank 0 is stuck waiting for it and stops now", message)
                _terminate(self.spawned)
                os._exit(1)
            running = [s for s in running if s.process.exitcode is None]


def _torchrun_store(layout: Layout) -> dist.Store:
    """torchrun's own store (its agent's, at MASTER_ADDR:MASTER_PORT), where rank 0
    publishes its link port and token for this run's other ranks."""
    store, _, _ = next(dist.rendezvous("env://", layout.rank, layout.world_size, timeout=timedelta(seconds=TRANSFER_TIMEOUT)))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"embedjob/{run}/{attempt}/", store)


def _spawn(
    layout: Layout, port: int, token: str, heartbeat: float, target: Callable[..., None], args: tuple[Any, ...]
) -> list[_Spawned]:
    """Start ranks 1.. with the spawn method: CUDA cannot be used in forked children."""
    context = multiprocessing.get_context("spawn")
    threads = cpu_share(layout.world_size)
    level = logging.getLogger("embedjob").getEffectiveLevel()
    spawned: list[_Spawned] = []
    try:
        for rank in range(1, layout.world_size):
            device = str(_rank_device(layout.device, rank))
            member = _Member(port, token, layout.world_size, rank, device, level, threads, time.time(), heartbeat)
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
    """Entry point of a spawned rank: connect, run `target`, report any failure to rank 0."""
    entered_at = time.time()
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
        link = Link(member.port, member.token, member.rank, member.heartbeat)
        layout = Layout(member.world_size, member.rank, device)
        target(Cluster(layout, [], link=link, started=(member.spawned_at, entered_at)), *args)
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

