"""A shard's run: one `Runner` per shard, on one GPU or on every rank of a node
(`--gpus N`), and the entry points that start it (`run_job`) and a spawned rank
(`serve_rank`).

The runner checks the job and its input, claims the output and its shard, loads the
model on every rank, builds each rank's `RankPipeline` (pipeline.py) and, on rank 0, the
`Coordinator` and the writer; it ends a shard by committing what is encoded, writing its
statistics and `_SUCCESS`, and stops on SIGTERM/SIGINT with what is encoded committed
(`stopping`). One GPU's pipeline is in pipeline.py; this module is what runs it for a
whole shard (ARCHITECTURE.md, "Stage -> file").
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from embedjob import stopping
from embedjob.captions import caption_fields
from embedjob.config import Job, JobError, RunFailure, cache_root
from embedjob.host import host_threads, main_script_hidden, refuse_starting_process, resolve_device, resolve_workers
from embedjob.io import reader
from embedjob.io.checkpoint import Checkpoint, job_fingerprint, open_checkpoint, shard_finished
from embedjob.io.files import LocalStore
from embedjob.io.sink import ErrorRate, Progress, Writer
from embedjob.io.store import job_store
from embedjob.io.writer import RowBlock, described, output_schema
from embedjob.parallel.cluster import Cluster, Coordinator, resolve_layout
from embedjob.pipeline import CHUNK_ROWS, ENCODE_AHEAD, RankPipeline, vector_description
from embedjob.report.counts import plural, route_warnings
from embedjob.rows import input_digests
from embedjob.slurm import Shard
from embedjob.stats import RankStats, ShardRun, shard_stats
from embedjob.timeline import Timeline

logger = logging.getLogger(__name__)


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
        """Chunks a rank takes before every rank is ready: the windows a rank ready
        first encodes meanwhile and the two its decode workers hold in flight, so every
        rank's first windows are decoded when the last is ready."""
        return (ENCODE_AHEAD + 2) * self._chunks_per_window()

    def _chunks_per_window(self) -> int:
        return -(-self.job.batching.window // self._chunk_rows())

    def _chunk_rows(self) -> int:
        return min(CHUNK_ROWS, self.job.batching.window)

    def _run(self, device: torch.device, coordinator: Coordinator) -> dict[str, Any]:
        start, started = time.perf_counter(), time.time()
        listing = scan_input(self.job)
        fragments = reader.assign_shards(listing.fragments, self.shard.count)[self.shard.index]
        if not shard_finished(job_store(self.job.output), self.shard.index):
            # Before the checkpoint, so a refused shard writes nothing; a finished shard's
            # ids were checked when it ran, and its rerun reads no input.
            reader.check_ids(self.job.input, fragments)
        if not fragments:
            self._warn_empty(listing)
        first_row, end_row = self._row_range(fragments)
        checkpoint = self._open_checkpoint(first_row, end_row, listing, fragments)
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
            schema = output_schema(
                listing.id_type, self.job.output.pooling, self.job.output.dtype, listing.column_types, caption_fields(self.job)
            )
            return self._encode(device, coordinator, checkpoint, chunks, schema, started, start)
        except BaseException:
            # Now, not when the checkpoint is collected: a caller that runs the shard
            # again in this process (a test, a notebook) must find it unlocked.
            if checkpoint.lock is not None:
                checkpoint.lock.release()
            raise

    def _warn_empty(self, listing: reader.InputListing) -> None:
        """A shard gets whole row groups, so with more shards than row groups the last
        shards are empty: say so, and how to spread the input over every shard. An input
        without a row gets no advice about shards: it is the input to look at."""
        if not sum(f.num_rows for f in listing.fragments):
            logger.warning(
                "input.path %r has no rows: nothing to embed, shard %d/%d finishes empty; check input.path "
                "(a glob that matched the wrong files, an empty export)",
                self.job.input.path, self.shard.index, self.shard.count,
            )
            return
        row_groups = len(listing.fragments)
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
            functools.partial(coordinator.take, 0), deliver, ready, coordinator.all_ready,
        )
        pipeline.prepare()
        schema = described(schema, vector_description(self.job, pipeline.model))
        resumed = checkpoint.resume_row
        if resumed > checkpoint.first_row:
            logger.info("resuming shard %d at row %d (%d rows committed)", self.shard.index, resumed, resumed - checkpoint.first_row)
        with self._progress(checkpoint.end_row - resumed) as bar:
            logged = self.job.runtime.progress and bar.disable
            label = f"shard {self.shard.index}/{self.shard.count}" if logged else None
            progress = Progress(bar, pipeline.rows_done, label, checkpoint.end_row - resumed)
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
            if pipeline.stopped:
                self._end_early(writer, checkpoint, progress)
            try:
                writer.join()
            finally:
                progress.close(writer.rows)
            others = self.cluster.hub.wait_done() if self.cluster is not None else []
        run = ShardRun(
            [own_stats, *others], writer.rows, writer.seconds, writer.timeline, started, resumed,
            coordinator.rows_before_ready,
        )
        stats = shard_stats(self.job, self.shard, checkpoint, time.perf_counter() - start, run)
        checkpoint.finish(stats)
        return stats

    def _end_early(self, writer: Writer, checkpoint: Checkpoint, progress: Progress) -> None:
        """A signal stopped rank 0's pipeline: commit every row handed over so far (the
        last part short) and raise `stopping.Stopped`. Other ranks' chunks not yet
        written are recomputed by the next run. Returns only where the writer had
        written the whole shard already (the signal came after the last window)."""
        signum = stopping.requested()
        reason = stopping.Stopped(signum, "")
        writer.end_early(reason)
        if writer.error is not reason:
            return
        progress.close(writer.rows)
        done, total = checkpoint.resume_row - checkpoint.first_row, checkpoint.end_row - checkpoint.first_row
        raise stopping.Stopped(
            signum,
            f"stopped by {stopping.signal_name(signum)}: shard {self.shard.index}/{self.shard.count} has {done} of "
            f"{plural(total, 'row')} committed ({plural(writer.rows, 'row')} by this run); "
            "rerun the same command to resume after them",
        ) from None

    def _finish_without_model(self, checkpoint: Checkpoint, seconds: float) -> dict[str, Any]:
        """An empty shard, or one whose rows are all committed but whose success marker
        was not written or whose statistics were lost: there is nothing to encode, so no model is loaded (under SLURM
        an empty array task would otherwise hold a GPU to load one)."""
        stats = shard_stats(self.job, self.shard, checkpoint, seconds)
        checkpoint.finish(stats)
        return stats

    def _row_range(self, fragments: list[reader.Fragment]) -> tuple[int, int]:
        if fragments:
            return fragments[0].first_row, fragments[-1].first_row + fragments[-1].num_rows
        return 0, 0

    def _open_checkpoint(
        self, first_row: int, end_row: int, listing: reader.InputListing, fragments: list[reader.Fragment]
    ) -> Checkpoint:
        """The shard's checkpoint; the parts it keeps are checked against the media of
        the shard's `fragments` as they are now."""
        store = job_store(self.job.output)
        if isinstance(store, LocalStore) and store.path.exists() and not store.path.is_dir():
            raise JobError(
                f"output.path {self.job.output.path!r} is a file, not a directory: name a directory for the parts "
                "(it is created where it does not exist)"
            )
        return open_checkpoint(
            store,
            self.shard.index,
            self.shard.count,
            first_row,
            end_row,
            self.job.output.rows_per_part,
            job_fingerprint(self.job, listing),
            self.overwrite,
            functools.partial(input_digests, self.job.input, fragments),
        )

    def _progress(self, total: int) -> tqdm:
        """The bar: an average rate (smoothing 0), so what it shows at the end is this
        run's rows over its pipeline seconds, as the summary says; every update shown
        (miniters 1: `Progress` already updates it only every PROGRESS_INTERVAL). Only
        on a terminal: elsewhere (a SLURM log) `Progress` logs a line now and then."""
        return tqdm(
            total=total,
            unit="row",
            desc=f"shard {self.shard.index}/{self.shard.count}",
            disable=not self.job.runtime.progress or not sys.stderr.isatty(),
            dynamic_ncols=True,
            smoothing=0,
            miniters=1,
        )


def scan_input(job: Job) -> reader.InputListing:
    """The job's input listing. A failure the reader did not put in words (a network
    library's own error, an hf:// or s3:// input listed offline) is a RunFailure that
    names input.path, not a traceback."""
    try:
        return reader.scan_input(job.input, job.output.columns, cache_root(job.runtime.cache_dir))
    except JobError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        remote = "://" in job.input.path
        advice = (
            "check the network or the credentials (a hub input already in the local cache is read offline with "
            "HF_HUB_OFFLINE=1)" if remote else "check that it can be read from here"
        )
        raise RunFailure(f"cannot list input.path {job.input.path!r}: {type(exc).__name__}: {first}; {advice}") from exc


def run_job(job: Job, shard: Shard = Shard(), overwrite: bool = False) -> dict[str, Any]:
    """Run one shard of `job` on `runtime.gpus` ranks; the statistics it wrote.

    Ranks other than 0 (under torchrun) return an empty dict: rank 0 writes everything.
    """
    refuse_starting_process()
    with main_script_hidden():
        layout = resolve_layout(job.runtime.gpus, resolve_device(job.runtime.device))
        if layout.world_size == 1:
            return Runner(job, shard, overwrite).run()
        with stopping.held_from_children():
            cluster = Cluster.start(layout, serve_rank, (job,))
        with cluster:
            if cluster.rank == 0:
                return Runner(job, shard, overwrite, cluster).run()
            serve_rank(cluster, job)
            return {}


def serve_rank(cluster: Cluster, job: Job) -> None:
    """A rank other than 0: its own pipeline over the chunks it takes from rank 0."""
    # A rank's stderr is the job's too (a rank started by the command has not been
    # through its logging setup; one under torchrun has, and this changes nothing).
    route_warnings(logger.isEnabledFor(logging.DEBUG))
    # SLURM's SIGTERM reaches every process of the job: rank 0 decides what stops and
    # commits what is encoded (`stopping`); this rank ends when rank 0 does.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link = cluster.link
    with host_threads(cluster.device):
        workers = resolve_workers(job.runtime.workers, cluster.world_size)
        pipeline = RankPipeline(
            job, cluster.device, cluster.rank, workers, link.take, link.put, link.ready, link.all_ready
        )
        try:
            stats = pipeline.run()
        except BaseException as exc:
            link.fail(f"{type(exc).__name__}: {exc}")
            raise
        _add_start(stats, cluster.started)
        link.finish(stats)


def _add_start(stats: RankStats, started: tuple[float, float] | None) -> None:
    """A spawned rank's start in its setup: `spawn` from rank 0 starting the process to
    this code running (interpreter, imports, unpickling the job), `join` from there to
    its first chunk (device, link to rank 0). Neither is in the rank's own
    `setup_seconds`, which begins with its first chunk; the shard's includes them."""
    if started is None or stats.started_at is None:
        return
    spawned_at, entered_at = started
    stats.setup["spawn"] = entered_at - spawned_at
    stats.setup["join"] = stats.started_at - entered_at

