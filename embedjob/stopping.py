"""SIGTERM and SIGINT while a job runs: stop soon, keep what is done.

SLURM sends SIGTERM when a job is pre-empted or reaches its time limit, then SIGKILL
`KillWait` seconds later (30 by default); Ctrl-C sends SIGINT. Either one, while a run
is inside `on_signals`, only sets a flag (`requested`): the pipeline checks it between
windows, stops taking rows, finishes the windows already on the device, and rank 0
commits what is encoded as a short part before the run raises `Stopped` (exit 143 for
SIGTERM, 130 for SIGINT). A second signal stops at once (committed parts are kept).

`held_from_children` keeps both away from the processes a run starts while they
start. Handlers are process-wide and Python runs them on the main thread only, so `on_signals`
installs them only there (the command, `embedjob.run` called from a script's main
thread) and gives the previous ones back after; elsewhere (a Ray task's thread, a rank
other than 0) the flag is never set and a run ends as it would have. No torch here:
the command imports this before it knows whether a job will run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """A run stopped by SIGTERM or SIGINT after committing what it had encoded.

    A KeyboardInterrupt, as Ctrl-C is in Python, so no `except Exception` in a caller's
    code takes it for a failure of the job and carries on. `exit_code` is the shell's
    for the signal (128 + its number: 143, 130)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class _State:
    """The signal received during the current run (None: none yet)."""

    signum: int | None = None


_STATE = _State()


def requested() -> int | None:
    """The signal that asked the current run to stop, None when none did."""
    return _STATE.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _handle(signum: int, frame: FrameType | None) -> None:
    if _STATE.signum is not None:
        raise Stopped(signum, f"stopped at once by a second {signal_name(signum)}; committed parts are kept and a rerun resumes")
    _STATE.signum = signum


@contextlib.contextmanager
def on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGINT set `requested` instead of ending the process (main
    thread only; elsewhere nothing changes). The flag starts clear."""
    _STATE.signum = None
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    try:
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, _handle)
        yield
    finally:
        for signum, handler in previous.items():
            # None: a handler set from C, which Python cannot put back; the default is nearest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        _STATE.signum = None


@contextlib.contextmanager
def held_from_children() -> Iterator[None]:
    """SIGINT and SIGTERM ignored by the processes started inside, and held back
    (blocked) for this one meanwhile.

    A child started through an exec keeps the signals its parent ignores (not the mask),
    so the decode workers' server and spawned ranks are never interrupted half-way
    through their imports (Ctrl-C reaches the whole process group: each printed a
    traceback); they ignore both from then on anyway, rank 0 decides. A signal that
    came meanwhile is pending, not lost (a blocked signal is never discarded as
    ignored), and this process receives it when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
