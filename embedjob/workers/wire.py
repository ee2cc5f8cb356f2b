"""The one message encoding between embedjob's processes: decode workers to their pool,
data-parallel ranks to and from rank 0 (see ARCHITECTURE.md).

A message is a frame on a stream socket: `FRAME` (seq, payload length, buffer count),
the buffers' byte counts (uint64 each), the payload (a protocol-5 pickle), then each
out-of-band buffer raw, in order. `seq` is the sender's to define (a task number, a
message kind). The receiver reads a frame in three blocking `recvmsg_into` calls (the
prefix, counts + payload, every buffer at once into memory it allocated), each with
the GIL released, so a thread that waits for messages never starves one that feeds a
GPU; `Connection.recv` read a large message in pipe-sized chunks, re-taking the GIL
after each and copying the bytes twice.

Invariants: a frame is delivered whole or not at all (a peer that closes mid-frame is
`EOFError`, one that stalls mid-frame `TimeoutError`), and tensors and NumPy arrays
travel beside the pickle without a copy on either side (`EncoderInput.__reduce_ex__`
and NumPy's own protocol-5 support hand their memory to the pickler).
"""

from __future__ import annotations

import collections
import io
import itertools
import pickle
import socket
import struct
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

FRAME = struct.Struct("<qQI")
MAX_IOV = 512
"""Views per recvmsg: Linux refuses more than 1024 (UIO_MAXIOV)."""


def pickled(obj: Any) -> tuple[bytes, list[memoryview]]:
    """`obj`'s protocol-5 pickle and its out-of-band buffers (views, not copies).

    ForkingPickler, so every type without out-of-band buffers pickles as
    `Connection.send` pickles it. Raises what pickling raises.
    """
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    # Positional: ForkingPickler.__init__ passes on *args only (fix_imports, then buffer_callback).
    ForkingPickler(out, 5, True, buffers.append).dump(obj)
    return out.getvalue(), [b.raw() for b in buffers]


def send_frame(sock: socket.socket, seq: int, payload: bytes, buffers: list[memoryview]) -> None:
    """Send one frame. A send that fails part-way leaves the stream out of step: the
    caller must drop the connection (the receiver sees EOF, never a partial frame)."""
    counts = struct.pack(f"<{len(buffers)}Q", *(b.nbytes for b in buffers))
    sock.sendall(FRAME.pack(seq, len(payload), len(buffers)) + counts + payload)
    for buffer in buffers:
        sock.sendall(buffer)


def send(sock: socket.socket, seq: int, obj: Any) -> None:
    """Pickle `obj` and send it as one frame."""
    send_frame(sock, seq, *pickled(obj))


def receive_frame(
    sock: socket.socket, timeout: float | None, limit: int | None = None
) -> tuple[int, memoryview, list[np.ndarray]]:
    """(seq, payload, buffers) of the next frame; `unpickle` turns the last two into the object.

    Raises EOFError when the peer's end closes before the frame is complete and
    TimeoutError when the frame takes longer than about `timeout` seconds to arrive
    (None: no limit; the socket's own receive timeout, if any, still applies). A frame
    announcing more than `limit` bytes is ValueError before any of it is allocated: a
    peer not yet trusted could otherwise make this process allocate what it claims.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    prefix = bytearray(FRAME.size)
    _fill(sock, [memoryview(prefix)], deadline, timeout)
    seq, length, count = FRAME.unpack(prefix)
    _within(limit, 8 * count + length)
    body = bytearray(8 * count + length)
    _fill(sock, [memoryview(body)], deadline, timeout)
    sizes = struct.unpack_from(f"<{count}Q", body)
    _within(limit, len(body) + sum(sizes))
    # np.empty: no zero-fill under the GIL; the kernel's copy inside recv touches the pages.
    buffers = [np.empty(size, dtype=np.uint8) for size in sizes]
    _fill(sock, [memoryview(b) for b in buffers], deadline, timeout)
    return seq, memoryview(body)[8 * count :], buffers


def _within(limit: int | None, size: int) -> None:
    if limit is not None and size > limit:
        raise ValueError(f"a frame of {size} bytes, over the {limit}-byte limit")


def receive(sock: socket.socket, timeout: float | None = None) -> tuple[int, Any]:
    """(seq, object) of the next frame; an empty payload (a bare signal) is None."""
    seq, payload, buffers = receive_frame(sock, timeout)
    return seq, unpickle(payload, buffers)


def unpickle(payload: memoryview, buffers: list[np.ndarray]) -> Any:
    """The object of a received frame, rebuilt over its received buffers."""
    if not payload.nbytes:
        return None
    return pickle.loads(payload, buffers=buffers)


def _fill(sock: socket.socket, views: list[memoryview], deadline: float | None, timeout: float | None) -> None:
    """Fill the byte views in order from the socket: normally one recvmsg for all of
    them (MSG_WAITALL), more only after a signal or past MAX_IOV views."""
    pending = collections.deque(v for v in views if v.nbytes)
    total = sum(v.nbytes for v in pending)
    got = 0
    while pending:
        try:
            count = sock.recvmsg_into(list(itertools.islice(pending, MAX_IOV)), 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, socket.timeout):
            raise TimeoutError(f"no data for {timeout:g}s after {got} of {total} bytes") from None
        if count == 0:
            raise EOFError(f"the peer closed its end after {got} of {total} bytes")
        got += count
        while count and count >= pending[0].nbytes:
            count -= pending.popleft().nbytes
        if count:
            pending[0] = pending[0][count:]
        if pending and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"only {got} of {total} bytes after {timeout:g}s")


def receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Make blocking reads on `sock` give up after `seconds` (None: never).

    SO_RCVTIMEO, not `settimeout`: that would make a shared file description
    non-blocking, and a multiprocessing Connection on the same socket expects blocking
    I/O. timeval seconds are a C long, hence the clamp.
    """
    value = 0.0 if seconds is None else min(seconds, 2**31 - 1)
    timeval = struct.pack("ll", int(value), int((value % 1) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
