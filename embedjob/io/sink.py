"""Rank 0's output side: the ordered stream of row blocks into committed parts.

The `Writer` thread takes every rank's row blocks from the `Coordinator` in chunk
order, checks the shard's error rate (`ErrorRate`), and hands the blocks to a
`PartSink`, which cuts them into the checkpoint's parts and commits each as soon as it
is whole; it also keeps the progress bar (`Progress`) and the shard's time series of
rows written. Only rank 0 commits, and only in order, so a killed run leaves a prefix
of parts (ARCHITECTURE.md, "output" and "checkpoint").

Separate from `writer.py`, which is the part format itself (`RowBlock`, the schema, the
atomic write): the checkpoint builds on that module, and this one on the checkpoint.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from embedjob.config import Job
from embedjob.io.checkpoint import Checkpoint, PartRecord, count_codes
from embedjob.io.digest import part_digest, unread_rows
from embedjob.io.writer import ErrorRateExceeded, PartFile, RowBlock, part_name
from embedjob.parallel.cluster import Coordinator
from embedjob.report.counts import codes_text, count_errors, plural
from embedjob.slurm import Shard
from embedjob.timeline import Timeline

logger = logging.getLogger(__name__)

ROW_GROUP_BYTES = 8 << 20
"""Vector bytes per row group of a part: the most rows held before they are written,
and the most left to write when the last row arrives (8 MB: about 0.15 s)."""


class PartSink:
    """Cuts the ordered stream of row blocks into the checkpoint's parts and commits each.

    Blocks must arrive in row order from the checkpoint's resume row on. A part's rows
    are written as row groups of about ROW_GROUP_BYTES as they arrive, and the part is
    committed as soon as its last row is written, so at most one row group's rows are
    held and the end of a shard waits for one row group, not a whole part.
    """

    def __init__(self, checkpoint: Checkpoint, schema: Any) -> None:
        self.checkpoint = checkpoint
        self.schema = schema
        self.buffer: list[RowBlock] = []
        self.held_bytes = 0
        self.errors: list[str | None] = []
        """The `error` of every row of the part being written that arrived (written or
        buffered), for the part's record."""
        self.digests: list[np.ndarray] = []
        """The media digests of those rows, block by block, for the part's record."""
        self._file: PartFile | None = None

    @property
    def rows(self) -> int:
        """Rows of the part being written that arrived."""
        return len(self.errors)

    def add(self, block: RowBlock) -> None:
        while len(block):
            first, end = self.checkpoint.next_bounds()
            if block.first_row != first + self.rows:
                raise RuntimeError(f"row {block.first_row} arrived where part [{first}, {end}) needs row {first + self.rows}")
            take = min(len(block), end - block.first_row)
            self._hold(block.slice(0, take) if take < len(block) else block)
            block = block.slice(take, len(block))
            if first + self.rows == end:
                self._write()
                self._commit(first, end)
            elif self.held_bytes >= ROW_GROUP_BYTES:
                self._write()

    def close(self) -> None:
        """Check that the last part was committed: it ends at the shard's last row."""
        if self.rows:
            first, end = self.checkpoint.next_bounds()
            raise RuntimeError(f"part [{first}, {end}) ends at row {first + self.rows - 1}: rows are missing")

    def commit_short(self) -> None:
        """Commit the rows that arrived as a part shorter than a full one (the run was
        stopped by a signal: what it encoded is kept, and the next run starts after it)."""
        if not self.rows:
            return
        first, _ = self.checkpoint.next_bounds()
        if self.buffer:
            self._write()
        self._commit(first, first + self.rows)

    def abandon(self) -> None:
        """Drop the part being written (the run failed; committed parts stay)."""
        if self._file is not None:
            self._file.abandon()
            self._file = None

    def _hold(self, block: RowBlock) -> None:
        self.buffer.append(block)
        self.held_bytes += block.nbytes
        self.errors += block.errors
        self.digests.append(block.digests)

    def _write(self) -> None:
        if self._file is None:
            name = part_name(self.checkpoint.shard, self.checkpoint.next_part)
            self._file = PartFile(self.checkpoint.store, name, self.schema)
        self._file.write(RowBlock.concat(self.buffer))
        self.buffer, self.held_bytes = [], 0

    def _commit(self, first: int, end: int) -> None:
        sealed = self._file.commit()
        part = self.checkpoint.next_part
        codes = count_errors(self.errors)
        digests = np.concatenate(self.digests)
        record = PartRecord(
            part, sealed.name, first, end, sum(codes.values()), size=sealed.size, sha256=sealed.sha256, error_codes=codes,
            input_digest=part_digest(digests), unread_rows=unread_rows(digests, first),
        )
        self.checkpoint.commit(record)
        self._file, self.errors, self.digests = None, [], []


class ErrorRate:
    """The shard's error rate as rows are written, against `runtime.max_error_rate`.

    It counts the rows committed by earlier runs too (a rerun after a stop stops again
    unless the job changed), and applies once `runtime.error_rate_min_rows` rows are in
    (a few broken rows at the start say nothing about the input) and, whatever its
    size, to the whole shard before its last rows are written: a shard of 68 rows that
    all failed must not finish as a success because it is small.
    """

    def __init__(self, job: Job, shard: Shard, checkpoint: Checkpoint) -> None:
        self.limit = job.runtime.max_error_rate
        self.min_rows = job.runtime.error_rate_min_rows
        self.shard = shard
        self.rows = checkpoint.resume_row - checkpoint.first_row
        self.total = checkpoint.end_row - checkpoint.first_row
        self.codes: collections.Counter[str] = collections.Counter(count_codes(p.error_codes for p in checkpoint.parts))

    @property
    def errors(self) -> int:
        return sum(self.codes.values())

    def add(self, block: RowBlock) -> None:
        """Count a written block; ErrorRateExceeded once the rate is above the limit."""
        self.rows += len(block)
        self.codes.update(count_errors(block.errors))
        few = self.rows < min(self.min_rows, self.total)
        if self.limit is None or few or self.errors <= self.limit * self.rows:
            return
        raise ErrorRateExceeded(
            f"shard {self.shard.index}/{self.shard.count} stopped: {self.errors} of {self.rows} rows are errors "
            f"({self.errors / self.rows:.1%}), above runtime.max_error_rate = {self.limit:g} "
            f"({codes_text(dict(self.codes))}); committed parts are kept: fix the input or the job "
            "(input.media_root, input.media_column?) and run again, or set runtime.max_error_rate higher (null: no limit)"
        )


PROGRESS_INTERVAL = 0.5
"""Seconds between updates of the progress bar: often enough to follow the batches,
rarely enough to cost nothing."""

PROGRESS_LOG_INTERVAL = 30.0
"""Seconds between progress lines where stderr is no terminal (a SLURM log, a file): a
bar redrawn with carriage returns there is one unreadable line of every update."""


class Progress:
    """The progress bar of a shard: rows done, their rate and the time left.

    Rank 0's own rows count as its batches run (`own`, read every PROGRESS_INTERVAL
    seconds by a thread of the bar's own, so neither the encoding thread nor the writer
    waits for the terminal); other ranks are other processes, whose rows reach this one
    only as written chunks, so they count then (`others_written`). The rate and the ETA
    run from `start`, the moment rank 0 is ready to encode: the statistics' pipeline
    seconds start there too, so the bar's rate is the summary's, setup left out. The
    writer keeps `errors` (the shard's error rows written so far) for the bar to show.

    With `log_as` (a label; the bar is then disabled), the same counts go to the log
    as a line every PROGRESS_LOG_INTERVAL seconds instead: rows, rate and time left.
    """

    def __init__(self, bar: tqdm, own: Callable[[], int], log_as: str | None = None, total: int = 0) -> None:
        self.bar = bar
        self.own = own
        self.log_as = log_as
        self.total = total
        self.others = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> None:
        """Start counting (and timing) from now."""
        if self._thread is not None:
            return
        if not self.bar.disable:
            self.bar.reset(total=self.bar.total)
            follow = self._follow
        elif self.log_as is not None:
            self._started = time.monotonic()
            follow = self._log
        else:
            return
        self._thread = threading.Thread(target=follow, name="embedjob-progress", daemon=True)
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

    def _log(self) -> None:
        while not self._stop.wait(PROGRESS_LOG_INTERVAL):
            done = min(self.own() + self.others, self.total)
            seconds = time.monotonic() - self._started
            rate = done / seconds if seconds > 0 else 0.0
            left = tqdm.format_interval((self.total - done) / rate) if rate > 0 else "unknown"
            logger.info(
                "%s: %d of %s done, %s; %.1f rows/s, %s left",
                self.log_as, done, plural(self.total, "row"), plural(self.errors, "error"), rate, left,
            )


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
        self.error: BaseException | None = None
        self._ending: BaseException | None = None
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

    def end_early(self, reason: BaseException) -> None:
        """Write every row handed over before now, commit them (the last part short),
        and stop: the run was asked to stop and keeps what it did. `error` is `reason`
        unless the writer had already written the whole shard (or failed)."""
        self._ending = reason
        self.coordinator.fail(reason)
        self._thread.join()

    def _run(self) -> None:
        sink = PartSink(self.checkpoint, self.schema)
        try:
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
        except BaseException as exc:
            self.error = exc
            self.coordinator.fail(exc)
            self._close(sink, exc)

    def _close(self, sink: PartSink, exc: BaseException) -> None:
        """After the stream ended with `exc`: keep what arrived when the run was asked to
        stop (`end_early`), drop it when it failed."""
        if exc is self._ending:
            try:
                self._timed(sink.commit_short)
                return
            except BaseException as failed:  # a full disk: that is what the run failed of
                self.error = failed
        sink.abandon()

    def _timed(self, write: Callable[..., None], *args: Any) -> None:
        since = time.perf_counter()
        write(*args)
        self.seconds += time.perf_counter() - since
