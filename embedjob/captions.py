"""Captions beside pictures: text embeddings, image-text scores and zero-shot labels.

With `input.text_column` every row's caption is tokenised in the decode workers beside
its media (`rows.Captions`), and each window's captions run through the text tower in
graphs of their own (`TextAdapter`, one per batch size at the fixed length), on the
encoder's stream right after the window's images, so they never wait for decode and
decode never waits for them. With `output.labels` the prompts are embedded once, at
setup, through the same tower. Per window, on the device and in float32:

- `text_embedding`: the caption's vector (as `get_text_features`), in `output.dtype`,
  L2-normalised with `output.normalize`; null where the row has no caption (null, not a
  string, or refused by the tokenizer) or its caption failed to encode.
- `score`: the cosine of the row's image vector and its caption's; null unless both are there.
- `label`, `label_score`: the prompt nearest the image vector by cosine and that cosine;
  null where the row has no image vector (an error row).

An image error keeps the row's text embedding; a null caption keeps its image
embedding. See ARCHITECTURE.md, row "captions".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embedjob.config import Job
from embedjob.encoders.base import EncoderAdapter
from embedjob.encoders.text import MAX_TEXTS_PER_BATCH
from embedjob.engine.defs import Encoded, output_dtype, to_host
from embedjob.engine.encode import BatchEncoder, build_encoder
from embedjob.engine.packer import BudgetPlan, generate_budgets
from embedjob.io.writer import vector_array
from embedjob.rows import Captions, Decoded, caption_index

TEXT_EMBEDDING = "text_embedding"
SCORE = "score"
LABEL = "label"
LABEL_SCORE = "label_score"


def caption_fields(job: Job) -> dict[str, pa.DataType]:
    """The output columns a job's captions and labels add, in their order (none without)."""
    fields: dict[str, pa.DataType] = {}
    if job.input.text_column is not None:
        value = pa.float16() if job.output.dtype == "float16" else pa.float32()
        fields.update({TEXT_EMBEDDING: pa.large_list(value), SCORE: pa.float32()})
    if job.output.labels:
        fields.update({LABEL: pa.string(), LABEL_SCORE: pa.float32()})
    return fields


def text_plan(adapter: EncoderAdapter) -> BudgetPlan:
    """A text tower's budgets: one per batch size, powers of two from one caption to
    MAX_TEXTS_PER_BATCH, at the fixed length (`budget_unit`). Not the job's
    `batching.token_budgets`, which count image tokens."""
    budgets = generate_budgets(adapter.budget_unit, adapter.budget_unit * MAX_TEXTS_PER_BATCH)
    return BudgetPlan(tuple(budgets), MAX_TEXTS_PER_BATCH, 0)


@dataclass
class PendingCaptions:
    """A window's caption outputs, queued for the host (read once the window's work is
    done): per window position, whether it has a text vector (`has_text`), a score
    (`scored`) and an image vector to label (`labelled`); the values of those
    positions in window order."""

    has_text: np.ndarray
    scored: np.ndarray
    labelled: np.ndarray
    texts: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    best: torch.Tensor | None = None
    best_scores: torch.Tensor | None = None


class CaptionEncoder:
    """A rank's captions and labels: the text tower's own `BatchEncoder` (None without
    `input.text_column`), the label prompts' unit vectors (None without `output.labels`)
    and what a window's image vectors are scored against."""

    def __init__(self, job: Job, text: BatchEncoder | None, labels: torch.Tensor | None, device: torch.device) -> None:
        self.text = text
        self.labels = labels
        self.label_names = pa.array(job.output.labels, type=pa.string())
        self.normalize = job.output.normalize
        self.dtype = output_dtype(job)
        self.vector_type = caption_fields(job).get(TEXT_EMBEDDING)
        self.device = device
        self.failed = 0

    def capture(self) -> None:
        if self.text is not None:
            self.text.capture()

    def clear(self) -> None:
        if self.text is not None:
            self.text.clear()

    def stats(self) -> dict[str, Any]:
        """The text tower's plan and graph counts (stats-*.json `text`), and the captions
        that failed to encode (their rows' text_embedding is null)."""
        return {} if self.text is None else {**self.text.stats(), "failed_captions": self.failed}

    def enqueue(self, window: list[Decoded], images: Encoded) -> PendingCaptions:
        """Launch the window's captions and their scores and labels against `images`
        (the window's image items, encoded and pooled to one float32 row each), and
        their copies to the host. A handful of device calls per window, none per row."""
        image_at = _image_rows(window, images)
        labelled = image_at >= 0
        pending = PendingCaptions(np.zeros(len(window), dtype=bool), np.zeros(len(window), dtype=bool), labelled)
        if self.text is not None:
            self._captions(window, images.rows, image_at, pending)
        if self.labels is not None:
            with torch.inference_mode():
                rows = images.rows[self._index(image_at[labelled])]
                best_scores, best = (torch.nn.functional.normalize(rows, dim=-1) @ self.labels.T).max(dim=-1)
            pending.best, pending.best_scores = to_host(best), to_host(best_scores)
        return pending

    def _captions(self, window: list[Decoded], image_rows: torch.Tensor, image_at: np.ndarray, pending: PendingCaptions) -> None:
        """The window's caption vectors in window order, and the scores of the rows that
        have both vectors, into `pending`."""
        texts = [d.text for d in window if d.text is not None]
        encoded = self.text.encode(texts, "mean", torch.float32)
        text_at = np.full(len(window), -1, dtype=np.int64)
        with_text = np.flatnonzero([d.text is not None for d in window])
        for position, offset, failure in zip(with_text, encoded.offsets, encoded.failures):
            if failure is None:
                text_at[position] = offset
            else:
                self.failed += 1
        pending.has_text = text_at >= 0
        pending.scored = pending.has_text & (image_at >= 0)
        with torch.inference_mode():
            rows = encoded.rows[self._index(text_at[pending.has_text])]
            scores = torch.nn.functional.cosine_similarity(
                image_rows[self._index(image_at[pending.scored])], encoded.rows[self._index(text_at[pending.scored])], dim=-1
            )
            if self.normalize:
                rows = torch.nn.functional.normalize(rows, dim=-1)
            pending.texts, pending.scores = to_host(rows.to(self.dtype)), to_host(scores)

    def _index(self, positions: np.ndarray) -> torch.Tensor:
        """Row numbers as an index tensor on the device. A GPU's copy is made from
        page-locked memory: from pageable memory CUDA first waits for every kernel queued
        on the stream, so the main thread would wait for the window's images here."""
        index = torch.from_numpy(positions)
        if self.device.type == "cuda":
            index = index.pin_memory()
        return index.to(self.device, non_blocking=True)

    def columns(self, pending: PendingCaptions) -> dict[str, pa.Array]:
        """The window's caption and label columns, one value (or null) per row, once the
        window's work is done."""
        columns: dict[str, pa.Array] = {}
        if self.text is not None:
            columns[TEXT_EMBEDDING] = vector_array(pending.texts.numpy(), pending.has_text, self.vector_type.value_type)
            columns[SCORE] = _scalars(pending.scores.numpy(), pending.scored)
        if self.labels is not None:
            which = np.zeros(len(pending.labelled), dtype=np.int64)
            which[pending.labelled] = pending.best.numpy()
            columns[LABEL] = self.label_names.take(pa.array(which, mask=~pending.labelled))
            columns[LABEL_SCORE] = _scalars(pending.best_scores.numpy(), pending.labelled)
        return columns


def _image_rows(window: list[Decoded], images: Encoded) -> np.ndarray:
    """Each window position's row in `images.rows` (-1: no image vector: a decode error
    or an item that failed to encode)."""
    at = np.full(len(window), -1, dtype=np.int64)
    with_item = np.flatnonzero([d.item is not None for d in window])
    for position, offset, failure in zip(with_item, images.offsets, images.failures):
        if failure is None:
            at[position] = offset
    return at


def _scalars(values: np.ndarray, present: np.ndarray) -> pa.Array:
    """One float32 per present row (`values`, in row order), null elsewhere."""
    full = np.zeros(len(present), dtype=np.float32)
    full[present] = values
    return pa.array(full, mask=~present)


def caption_encoder(job: Job, adapter: EncoderAdapter, images: BatchEncoder, device: torch.device) -> CaptionEncoder | None:
    """The rank's captions and labels for `adapter` (its `text` tower loaded), or None
    where the job asks for neither. Label prompts are embedded here, once.

    The text encoder shares the image encoder's `capture_lock`: the GPU-decode threads
    hold that one, and a text budget added mid-run must not be captured beside them."""
    text = adapter.text
    if text is None:
        return None
    encoder = None
    if job.input.text_column is not None:
        encoder = build_encoder(job, text, device, text_plan(text))
        encoder.capture_lock = images.capture_lock
    labels = torch.nn.functional.normalize(text.embed(job.output.labels), dim=-1) if job.output.labels else None
    return CaptionEncoder(job, encoder, labels, device)


def caption_task(job: Job, adapter: EncoderAdapter) -> Captions | None:
    """What the decode workers need to make each row's caption item (None without
    `input.text_column`)."""
    index = caption_index(job)
    if index is None or adapter.text is None:
        return None
    return Captions(index, adapter.text.preprocessor())
