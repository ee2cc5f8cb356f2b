"""FP8 weights calibrated on the job's own rows (`model.fp8_calibrate`).

Rounded to nearest, every FP8 product is about 3.7 % off and the errors add up through
the blocks; rounded so that each layer's output on real inputs moves least
(`fp8.calibrated_rows`), the vectors come much closer to bf16's at no cost per row.
What that takes is each layer's input product (x^T x) over some real rows, collected
here before the blocks are converted: the tower as loaded runs eagerly over the
calibration rows with `fp8.input_products` reading every linear layer's inputs.

The rows are the input's first ones in row order whose media decode (`reader.
leading_rows`), whichever shard runs: every shard and rank of a job, and every resume,
calibrates on the same rows and so rounds the same weights (the input is in the job's
fingerprint, and so is `fp8_calibrate`). They are decoded as the job decodes, by a
`DecodePool` of the job's worker count, so a file that crashes or hangs its decoder is
one error row skipped, never the rank's end. See ARCHITECTURE.md, row "fp8 calibration".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterator

import torch

from embedjob.config import Job, JobError, cache_root
from embedjob.decode import MediaError
from embedjob.encoders.base import Calibration, EncoderAdapter, EncoderInput
from embedjob.encoders.fp8 import input_products
from embedjob.engine.encode import BatchEncoder, budget_plan, graph_paths
from embedjob.io import reader
from embedjob.report.counts import codes_text, count_errors, plural
from embedjob.rows import WORKER_MODULES, Decoded, decode_options, decode_row
from embedjob.workers.pool import DecodePool

logger = logging.getLogger(__name__)

READ_LIMIT = 4
"""Rows read at most per calibration row asked for: an input whose first rows are mostly
errors stops the search there, with what it found."""


def calibration_for(job: Job, workers: int) -> Calibration | None:
    """What `load_adapter` calls to calibrate this job's FP8 weights, or None where the
    job asks for none."""
    if job.model.precision != "fp8" or not job.model.fp8_calibrate:
        return None
    return functools.partial(fp8_input_products, job, workers)


def fp8_input_products(job: Job, workers: int, adapter: EncoderAdapter) -> dict[torch.nn.Module, torch.Tensor]:
    """The input product of every linear layer of the adapter's blocks over the calibration
    rows (`calibration_items`), by layer: the tower as loaded runs them eagerly, packed in
    the job's batches, with no graph captured (a capture now would be of bf16 blocks)."""
    since = time.perf_counter()
    items, read = calibration_items(job, adapter, workers)
    plan = budget_plan(job, adapter)
    encoder = BatchEncoder(adapter, graph_paths(adapter, plan, None), job.batching.policy)
    with input_products(adapter.compile_units(), job.model.fp8_keep) as products:
        encoder.encode(items, "mean", adapter.dtype)
    logger.info(
        "model.fp8_calibrate: the inputs of %s read over %s (of the input's first %d) in %.1f s",
        plural(len(products), "linear layer"), plural(len(items), "row"), read, time.perf_counter() - since,
    )
    return products


def calibration_items(job: Job, adapter: EncoderAdapter, workers: int) -> tuple[list[EncoderInput], int]:
    """The preprocessed items of the input's first `model.fp8_calibrate` rows whose media
    decode, and how many rows were read for them: at most `READ_LIMIT` times as many
    rows, fewer items than asked (with a warning) where not enough of those decode, and a
    JobError where none does."""
    wanted = job.model.fp8_calibrate
    options = dataclasses.replace(decode_options(job, adapter), defer_video=False, defer_jpeg=False)
    fn = functools.partial(decode_row, options=options, preprocess=adapter.preprocessor())
    rows = itertools.islice(reader.leading_rows(job.input, cache_root(job.runtime.cache_dir)), READ_LIMIT * wanted)
    items: list[EncoderInput] = []
    errors: list[str] = []
    read = 0
    with DecodePool(fn, workers, job.runtime.decode_timeout, None, WORKER_MODULES, error=MediaError) as pool:
        for decoded in _decoded(pool.imap(rows)):
            read += 1
            if decoded.item is not None:
                items.append(decoded.item)
            else:
                errors.append(decoded.error or "")
            if len(items) == wanted:
                break
    if not items:
        raise JobError(
            f"model.fp8_calibrate: none of the input's first {plural(read, 'row')} decoded ({_named(errors)}), so there is "
            "nothing to calibrate the FP8 weights on; set model.fp8_calibrate: 0, or put rows that decode first in the input"
        )
    if len(items) < wanted:
        logger.warning(
            "model.fp8_calibrate asks for %d rows; only %d of the input's first %s decoded (%s): calibrating on those",
            wanted, len(items), plural(read, "row"), _named(errors),
        )
    return items, read


def _decoded(results: Iterator[object]) -> Iterator[Decoded]:
    """The pool's results as rows: a task it cut off (a timeout, a crash) as an error row."""
    for result in results:
        if isinstance(result, MediaError):
            yield Decoded(-1, None, None, None, str(result))
        elif isinstance(result, Decoded):
            yield result


def _named(errors: list[str]) -> str:
    return codes_text(count_errors(errors)) if errors else "no rows"
