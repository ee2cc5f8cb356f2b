"""An ordered process pool: fn(task) in worker processes, one result per task, in input order.

Workers start from a forkserver (or spawn where there is none; never fork, since the
parent may hold CUDA state), each holds one task at a time, a task that runs past the
timeout has its worker killed and replaced, and a worker that dies costs its task only.
Results come back as `wire` frames. The pool knows nothing of what fn does: the error
class it builds per-task failures from, and the modules its workers preload, come from
the caller. See ARCHITECTURE.md, "decode" and "process messages".
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from embedjob.workers import wire

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def _start_method() -> str:
    # forkserver: children fork from a clean server (no CUDA state), cheaply, which
    # matters when a timed-out worker is replaced. spawn where forkserver is missing.
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _context(preload: Iterable[str]) -> Any:
    """The workers' start context. With forkserver, workers fork from a server that has
    `preload` (the modules the task function needs, in the caller's order) and this
    module loaded, so a new or replacement worker starts in milliseconds instead of
    importing torch. The server keeps the list it started with."""
    context = multiprocessing.get_context(_start_method())
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload([*preload, __name__])
    return context


def start_worker_server(preload: Iterable[str]) -> None:
    """Start the server that workers fork from now, without waiting for it.

    Its imports (`preload`: torch, transformers and decoders take seconds) then run in
    their own process while the caller loads its model, instead of when the first pool
    starts. `preload` is imported in the order given: the caller knows which of its
    libraries must load before which.
    """
    if _start_method() == "forkserver":
        _context(preload)
        multiprocessing.forkserver.ensure_running()


_MAX_FAILED_STARTS = 3


def _run_task(fn: Callable[[Any], Any], task: Any, error: type[Exception]) -> Any:
    """fn(task), with failures as `error` values: "internal_error" for anything that
    is not an `error` (a bug in fn), its traceback logged where it happened."""
    try:
        return fn(task)
    except error as exc:
        return exc
    except Exception as exc:
        logger.exception("task failed with an unexpected exception")
        return error("internal_error", f"{type(exc).__name__}: {exc}")


# Worker -> parent results travel on the pool's socketpair (the duplex Pipe of a
# forkserver/spawn context on Unix) as `wire` frames whose seq is the task's number, or
# _READY_SEQ for the READY handshake (empty payload); parent -> worker tasks stay on the
# Connection (small, rare).
_READY_SEQ = -1


WORKER_NICE = 10
"""Niceness a worker adds to its own on start (`os.nice`, capped by the system at 19). The
rank's own threads (the main loop feeding the graphs, the GPU-decode threads feeding
NVDEC) are the job's critical path, and a decode-bound job keeps every core busy with
workers: at equal priority the scheduler shares a core between a worker and a rank
thread that woke to hand the GPU its next packet, so the GPU waits on a decode worker.
Niced, a worker gets what the rank leaves: beside 16 decord processes NVDEC read 67 clips
a second with them at +10, 56 at +0, and they read 44.1 and 45.6 (an H100, 16 cores,
benchmarks/RESULTS.md section 11). Read when a worker starts."""


def _worker_main(
    fn: Callable[[Any], Any], error: type[Exception], conn: multiprocessing.connection.Connection, nice: int
) -> None:
    if nice:
        os.nice(nice)
    # Ctrl-C reaches the whole process group, and SLURM's SIGTERM every process of the
    # job: the parent decides what stops (a worker dead of it would turn the rows in
    # flight into decoder_crashed rows); the pool ends its workers with SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    wire.send_frame(sock, _READY_SEQ, b"", [])
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        seq, task = message
        payload, buffers = _pickle_result(_run_task(fn, task, error), error)
        wire.send_frame(sock, seq, payload, buffers)


def _pickle_result(result: Any, error: type[Exception]) -> tuple[bytes, list[memoryview]]:
    """The result as a wire payload; one that cannot be pickled becomes an
    "internal_error" `error`, since the parent must get one result per task."""
    try:
        return wire.pickled(result)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, BufferError) as exc:
        return pickle.dumps(error("internal_error", f"result cannot be pickled: {exc}"), protocol=5), []


def _result_socket(conn: multiprocessing.connection.Connection, timeout: float) -> socket.socket:
    """A second handle on the parent's end of a worker's socketpair, to read frames;
    reads block at most `timeout` seconds, so a stalled worker cannot hold the service
    thread forever."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    wire.receive_timeout(sock, timeout)
    return sock


def _receive_frame(sock: socket.socket, timeout: float, error: type[Exception]) -> tuple[int, Any]:
    """(seq, result) of the next frame; the result is None for READY. Raises EOFError
    when the worker died mid-frame and TimeoutError when it stalled (see `wire`)."""
    seq, payload, buffers = wire.receive_frame(sock, timeout)
    if seq == _READY_SEQ:
        return seq, None
    return seq, _load_result(payload, buffers, error)


def _load_result(payload: memoryview, buffers: list[np.ndarray], error: type[Exception]) -> Any:
    """Unpickle a result over its received buffers; a result that cannot be rebuilt
    here (a class missing in the parent, ...) is that task's "internal_error"."""
    try:
        return wire.unpickle(payload, buffers)
    except Exception as exc:
        logger.exception("a decode result cannot be unpickled")
        return error("internal_error", f"result cannot be unpickled: {type(exc).__name__}: {exc}")


@dataclass
class _Worker:
    """One worker process and the parent's two handles on its socketpair: `conn` sends
    tasks (and is what `wait` watches), `sock` reads the worker's frames."""

    process: Any
    conn: multiprocessing.connection.Connection
    sock: socket.socket
    ready: bool = False
    seq: int | None = None
    deadline: float = 0.0

    def close_channel(self) -> None:
        self.conn.close()
        self.sock.close()


_POLL_SECONDS = 0.05
_END = object()
_NOTHING = object()


class Idle:
    """What `DecodePool.imap` yields when no result has arrived for its `idle` seconds."""

    def __repr__(self) -> str:
        return "IDLE"


IDLE = Idle()


@dataclass
class _Failed:
    """The task iterable raised: re-raised where the results are consumed."""

    error: BaseException


class _Tasks:
    """The tasks of one `imap`, taken from their iterable on a thread of their own.

    Taking a task may block for long (reading the next row group, waiting for rank 0
    to hand out more rows); on its own thread that wait never stops the pool from
    dispatching and receiving the tasks it already holds. At most `capacity` taken
    tasks wait here; after each one (and after the end) a byte on `wake` wakes the
    service thread, which sleeps on the workers' sockets.
    """

    def __init__(self, tasks: Iterable[Any], capacity: int, wake: socket.socket | None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(capacity)
        self._wake = wake
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._take, args=(iter(tasks),), name="embedjob-decode-tasks", daemon=True)
        self._thread.start()

    def _take(self, tasks: Iterator[Any]) -> None:
        try:
            for task in tasks:
                if not self._put(task):
                    return
            self._put(_END)
        except BaseException as exc:
            self._put(_Failed(exc))

    def _put(self, value: Any) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(value, timeout=_POLL_SECONDS)
            except queue.Full:
                continue
            if self._wake is not None:
                _wake_up(self._wake)
            return True
        return False

    def get(self, timeout: float | None) -> Any:
        """The next task, _END, a _Failed, or _NOTHING when none came within `timeout`
        seconds (0: do not wait)."""
        try:
            return self._queue.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return _NOTHING

    def stop(self) -> None:
        """Stop taking tasks; the iterable is left where it is (a generator blocked in
        it finishes its wait, then ends)."""
        self._stopped.set()
        while self.get(0) is not _NOTHING:
            pass


class _Feed:
    """Hand-over between the pool's service thread and the consuming generator.

    The service thread publishes finished results; the generator takes them in input
    order. `has_room` bounds tasks taken but not yet handed over (memory stays bounded);
    once it has said no, the next result taken sends a byte on `wake`, so a service
    thread with no worker busy (every task done by `local`) learns of the room at once.
    A failure in the service thread is re-raised in the generator.
    """

    def __init__(self, max_in_flight: int, wake: socket.socket) -> None:
        self._cond = threading.Condition()
        self._results: dict[int, Any] = {}
        self._next = 0
        self._max_in_flight = max_in_flight
        self._wake = wake
        self._full = False
        self._finished = False
        self._error: BaseException | None = None
        self.stopped = False

    def has_room(self, taken: int) -> bool:
        with self._cond:
            self._full = taken - self._next >= self._max_in_flight
            return not self._full

    def delivered(self, taken: int) -> bool:
        with self._cond:
            return self._next + len(self._results) >= taken

    def publish(self, done: dict[int, Any]) -> None:
        if not done:
            return
        with self._cond:
            self._results.update(done)
            self._cond.notify_all()
        done.clear()

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def next_result(self, idle: float | None) -> Any:
        """The next result in order, _END, or IDLE when none came within `idle` seconds."""
        deadline = None if idle is None else time.monotonic() + idle
        with self._cond:
            while True:
                if self._next in self._results:
                    self._next += 1
                    self._cond.notify_all()
                    if self._full:
                        self._full = False
                        _wake_up(self._wake)
                    return self._results.pop(self._next - 1)
                if self._error is not None:
                    raise self._error
                if self._finished:
                    return _END
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return IDLE
                self._cond.wait(left)


class DecodePool(Generic[T, R]):
    """Runs fn(task) in worker processes with a per-item timeout.

    - Results come back in input order; every task yields exactly one result: its
      value, or an `error` (raised by fn, "decode_timeout" when it ran longer than
      `timeout` seconds — the worker is killed and replaced — or "decoder_crashed"
      when its worker died). Other in-flight tasks are not affected: each worker
      holds one task at a time.
    - At most `max_in_flight` tasks (default 2 * workers) are dispatched or done and
      not yet yielded, and at most `workers` more (one for `workers=0`) are taken from
      the input and waiting, so memory stays bounded on unbounded input. Tasks are
      taken on a thread of their own: an input that blocks does not stop the workers.
    - `imap(tasks, idle)` starts at once (the workers decode while the caller does
      other work) and yields IDLE whenever `idle` seconds pass without a result, so a
      caller that batches results can flush what it has while the input is stalled.
    - fn and tasks must be picklable (module-level functions); results come back
      as protocol-5 `wire` frames whose out-of-band buffers (numpy arrays,
      `EncoderInput` tensors) the parent receives straight into their final memory,
      one blocking recv for all of them, so a busy consumer thread is not starved of
      the GIL. A result that stops arriving part-way for `timeout` seconds is a
      "decode_timeout" (its worker is killed); a worker that dies part-way is a
      "decoder_crashed". No partly received result is ever delivered.
    - `local(task)`, where given, is tried first on the pool's service thread: its
      result, or None to send the task to a worker. It is for tasks whose result costs
      the parent less to make than to send and receive (a JPEG left for the rank's GPU
      needs only its header read: 0.01 ms here against 0.13 ms of the parent's time
      through a worker); it must be quick, never crash the process, and give what fn
      would. One that raises sends its task to a worker.
    - `assign(task)`, where given, is what a worker is sent for a task: made on the
      pool's service thread as the task is sent (inline: as it runs), for a choice best
      made as late as possible. Which decoder takes a video is one: by the rank's share
      when a worker starts the row, not when it was taken, up to `max_in_flight` rows
      earlier (a rank still setting up leaves its GPU none). A task whose send fails is
      assigned again when it is sent again.
    - workers=0 runs fn inline in the caller: same results, but no timeout and no
      crash isolation (a hang hangs the caller, a crash kills it: native decoders
      segfault on some corrupt files, so use workers for untrusted input).
    - One `imap` at a time. Leaving an `imap` early kills the workers that are still
      busy (their results could not be matched any more) and replaces them.
    """

    def __init__(
        self,
        fn: Callable[[T], R],
        workers: int,
        timeout: float,
        max_in_flight: int | None = None,
        preload: Iterable[str] = (),
        *,
        error: type[Exception],
        local: Callable[[T], R | None] | None = None,
        assign: Callable[[T], Any] | None = None,
    ):
        """`error` is the per-task error class: built as `error(code, message)` for a
        timeout, a crash, a bug in fn or a result that cannot cross to the parent, and
        an instance raised by fn is that task's result as is. It must pickle by its
        arguments (it crosses from the workers). `preload`: see `start_worker_server`."""
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._fn = fn
        self._local = local
        self._assign = assign
        self._error = error
        self._timeout = timeout
        self._max_in_flight = max_in_flight or max(1, 2 * workers)
        self._ctx = _context(preload)
        self._count = workers
        self._workers: list[_Worker] = []
        self._failed_starts = 0
        self._start_error: BaseException | None = None
        self._active: Callable[[], None] | None = None
        self._closed = False
        self._starter = threading.Thread(target=self._start_workers, name="embedjob-decode-start", daemon=True)
        self._starter.start()

    def __enter__(self) -> DecodePool[T, R]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def imap(self, tasks: Iterable[T], idle: float | None = None) -> Iterator[R | Exception | Idle]:
        """Results of fn over tasks, in input order; IDLE after `idle` quiet seconds
        (None: never). Taking tasks and decoding start before the first result is asked for."""
        if self._closed:
            raise RuntimeError("DecodePool is closed")
        if self._active is not None:
            raise RuntimeError("DecodePool.imap is already running; consume or close it first")
        if not self._count:
            source = _Tasks(tasks, 1, None)
            self._active = source.stop
            return self._inline(source, idle)
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        source = _Tasks(tasks, self._count, wake_write)
        feed = _Feed(self._max_in_flight, wake_write)
        service = threading.Thread(
            target=self._serve, args=(source, feed, wake_read), name="embedjob-decode-pool", daemon=True
        )
        service.start()

        def stop() -> None:
            feed.stop()
            source.stop()
            service.join()
            wake_read.close()
            wake_write.close()
            self._abandon_busy()

        self._active = stop
        return self._results(feed, idle)

    def close(self) -> None:
        """Stop the workers (idempotent): ask each to exit, kill those that do not."""
        if self._closed:
            return
        self._closed = True
        self._end_imap()
        self._starter.join()
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.close_channel()
        self._workers = []

    def _end_imap(self) -> None:
        stop, self._active = self._active, None
        if stop is not None:
            stop()

    def _start_workers(self) -> None:
        """Start the workers one after another on this thread; each serves as soon as it
        exists. A start forks the server that holds torch: tens of milliseconds each, more
        on a sandboxed kernel, which would otherwise all come before the first decode."""
        try:
            for _ in range(self._count):
                if self._closed:
                    return
                self._workers.append(self._start_worker())
        except BaseException as exc:
            logger.exception("a decode worker could not start")
            self._start_error = exc

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(self._fn, self._error, child, WORKER_NICE), daemon=True, name="embedjob-decode")
        process.start()
        child.close()
        return _Worker(process=process, conn=parent, sock=_result_socket(parent, self._timeout))

    def _inline(self, source: _Tasks, idle: float | None) -> Iterator[R | Exception | Idle]:
        try:
            while True:
                task = source.get(idle)
                if task is _NOTHING:
                    yield IDLE
                elif task is _END:
                    return
                elif isinstance(task, _Failed):
                    raise task.error
                else:
                    yield _run_task(self._fn, self._assigned(task), self._error)
        finally:
            self._end_imap()

    def _results(self, feed: _Feed, idle: float | None) -> Iterator[R | Exception | Idle]:
        """Yield results in order while the service thread keeps the workers busy.

        The caller may spend long stretches between results (encoding a window); if the
        workers were fed and drained only from here they would sit idle, blocked on
        sending, all that time. The service thread dispatches, receives and enforces
        timeouts; this generator only waits for the next result in order.
        """
        try:
            while True:
                result = feed.next_result(idle)
                if result is _END:
                    return
                yield result
        finally:
            self._end_imap()

    def _serve(self, source: _Tasks, feed: _Feed, wake: socket.socket) -> None:
        waiting: collections.deque[tuple[int, T]] = collections.deque()
        done: dict[int, R | Exception] = {}
        taken = 0
        exhausted = False
        try:
            while not feed.stopped:
                while not exhausted and feed.has_room(taken):
                    task = source.get(0)
                    if task is _NOTHING:
                        break
                    if task is _END:
                        exhausted = True
                        break
                    if isinstance(task, _Failed):
                        raise task.error
                    result = self._run_local(task)
                    if result is None:
                        waiting.append((taken, task))
                    else:
                        done[taken] = result
                    taken += 1
                if self._start_error is not None and not self._workers:
                    raise RuntimeError(f"decode workers cannot start: {self._start_error}")
                self._dispatch(waiting)
                feed.publish(done)
                if exhausted and feed.delivered(taken):
                    feed.finish()
                    return
                self._wait(done, wake, poll=_POLL_SECONDS)
        except BaseException as exc:
            feed.fail(exc)

    def _run_local(self, task: T) -> R | None:
        """`local(task)`, or None (a worker's task) where there is none or it raised."""
        if self._local is None:
            return None
        try:
            return self._local(task)
        except Exception:
            logger.exception("the pool's local path failed; a worker takes the task")
            return None

    def _assigned(self, task: T) -> Any:
        """What a worker is given for `task`: `assign(task)`, or the task where there is none."""
        return task if self._assign is None else self._assign(task)

    def _dispatch(self, waiting: collections.deque[tuple[int, T]]) -> None:
        for worker in self._workers:
            if not waiting:
                return
            if not worker.ready or worker.seq is not None:
                continue
            seq, task = waiting.popleft()
            try:
                worker.conn.send((seq, self._assigned(task)))
            except OSError:
                # The worker died while idle; the task goes back first in line.
                waiting.appendleft((seq, task))
                continue
            worker.seq = seq
            worker.deadline = time.monotonic() + self._timeout

    def _wait(self, done: dict[int, R | Exception], wake: socket.socket, poll: float) -> None:
        busy = [w for w in self._workers if w.seq is not None]
        timeout = max(0.0, min([w.deadline for w in busy] + [time.monotonic() + poll]) - time.monotonic())
        handles: list[Any] = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers] + [wake]
        ready = set(multiprocessing.connection.wait(handles, timeout))
        if wake in ready:
            _drain(wake)
        for index, worker in enumerate(list(self._workers)):
            if worker.conn in ready:
                self._service(index, worker, done)
            elif worker.process.sentinel in ready:
                # Dead with nothing to read, its end kept open by a process it left
                # behind: reading would only wait for the timeout.
                self._lost(index, worker, done)
        now = time.monotonic()
        for index, worker in enumerate(list(self._workers)):
            # A result already waiting (unread while another worker's result was being
            # read) is taken on the next pass, not thrown away as a timeout.
            if worker.seq is not None and worker.deadline <= now and not worker.conn.poll():
                logger.warning("task %d ran past %gs; killing its worker", worker.seq, self._timeout)
                done[worker.seq] = self._error("decode_timeout", f"no result after {self._timeout:g}s; the decoder was killed")
                self._replace(index, worker)

    def _service(self, index: int, worker: _Worker, done: dict[int, R | Exception]) -> None:
        """Take the worker's next frame; if it died, or stalled in the middle of a
        frame, fail its task and replace it.

        One frame per call: a worker holds one task at a time, so nothing else can be
        waiting behind a result (another look would only cost a syscall).
        """
        try:
            seq, result = _receive_frame(worker.sock, self._timeout, self._error)
        except (BlockingIOError, TimeoutError) as exc:
            # Alive but stuck mid-frame: the stream cannot be put back in step.
            logger.warning("a result stopped arriving (%s); killing its worker", exc)
            if worker.seq is not None:
                done[worker.seq] = self._error("decode_timeout", f"the result stopped arriving for {self._timeout:g}s; the decoder was killed")
            self._replace(index, worker)
            return
        except (EOFError, OSError):
            self._lost(index, worker, done)
            return
        if seq == _READY_SEQ:
            worker.ready = True
            self._failed_starts = 0
        else:
            done[seq] = result
            worker.seq = None

    def _lost(self, index: int, worker: _Worker, done: dict[int, R | Exception]) -> None:
        """The worker died: fail its task, if any, and replace it."""
        # Its end of the socket closes a moment before its exit status is known.
        worker.process.join(timeout=1.0)
        code = worker.process.exitcode
        if not worker.ready:
            # No task is involved: fn cannot be loaded in a fresh process. Replacing
            # it forever would hang the job, so after a few tries the job stops.
            self._failed_starts += 1
            if self._failed_starts >= _MAX_FAILED_STARTS:
                raise RuntimeError(
                    f"decode workers cannot start: {_MAX_FAILED_STARTS} exited (last exit code {code}) before taking a task "
                    "(what they printed, if anything, is above)"
                )
        if worker.seq is not None:
            logger.warning("worker died (exit code %s) on task %d", code, worker.seq)
            done[worker.seq] = self._error("decoder_crashed", f"the decoding process died (exit code {code})")
        self._replace(index, worker)

    def _replace(self, index: int, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join()
        worker.close_channel()
        self._workers[index] = self._start_worker()

    def _abandon_busy(self) -> None:
        for index, worker in enumerate(list(self._workers)):
            if worker.seq is not None:
                self._replace(index, worker)


def _wake_up(sock: socket.socket) -> None:
    """A byte on the service thread's wake-up socket (closed: it has stopped)."""
    try:
        sock.send(b"\0")
    except OSError:
        pass


def _drain(sock: socket.socket) -> None:
    """Read every wake-up byte waiting on a non-blocking socket."""
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass
