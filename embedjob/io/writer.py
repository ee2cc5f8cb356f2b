"""Ordered Parquet output: parts written under a temporary name, renamed when complete.

A part is written as it arrives, a row group at a time (`PartFile`), so the rows held
in memory are one row group's, not one part's, and finishing a shard writes only its
last row group: a part of 100,000 rows of 3,584-wide vectors is 700 MB, seconds to
encode.

Output contract (ARCHITECTURE.md): every input row of a shard appears exactly once, in input
order, with an embedding or a non-null `error`. Columns: `id`, `row`, `modality`,
`tokens`, `frames`, `grid` (per-token output only), `embedding`, `error`, the columns
computed beside the embedding (`text_embedding`, `score`, `label`, `label_score` where
the job asks for captions or labels), then the input columns the job copies
(`output.columns`). A part file either exists complete (renamed after fsync, or its
upload completed) or not at all, so a reader never sees half a part.

An error row's `embedding` (and `grid`) is null in every pooling mode, so no tool can
take it for a vector: a null sorts last in a similarity search and is skipped by
aggregates, where an all-NaN vector won them. Vectors are variable-size lists
(`large_list<float16|float32>`, each non-null one of the model's width), not fixed-size
ones: pyarrow before 26 cannot read a fixed-size list column with nulls from Parquet,
and the people reading an output use whatever pyarrow their tools bring. The lists are
"large" (64-bit offsets) so a part of many rows of many tokens cannot overflow them; in
the Parquet file they are plain lists, whatever reads them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedjob.io.store import Store

logger = logging.getLogger(__name__)


class ErrorRateExceeded(RuntimeError):
    """A shard stopped because more of its rows failed than `runtime.max_error_rate`
    allows: the input or the settings are wrong. Its committed parts are kept."""

PARQUET_OPTIONS: dict[str, Any] = {
    "use_dictionary": ["id", "modality", "error", "label"],
    "compression": {"id": "snappy", "row": "snappy", "modality": "snappy", "tokens": "snappy", "frames": "snappy",
                    "grid": "snappy", "embedding": "none", "error": "snappy", "text_embedding": "none"},
}
"""Embeddings neither repeat nor compress (a dictionary or snappy pass over float16
vectors only costs time: writing a 6,144 x 3,584 float16 part took 1.04 s with
pyarrow's defaults and 0.34 s without them, reading it 0.62 s against 0.09 s, for 8 %
more bytes); the small columns keep the defaults. Statistics: see `parquet_options`."""


VECTOR_COLUMNS = ("embedding", "text_embedding")
"""The columns of vectors: no compression, no statistics (`parquet_options`)."""


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """PARQUET_OPTIONS, with min/max statistics for every column but the vectors.

    The vectors' statistics serve no query (no reader skips a row group by the smallest
    element of any embedding), and computing them took a third of the writer's time: a
    row group of 4,096 x 3,584 float16 vectors took 67 us a row with them and 42 without
    (benchmarks/RESULTS.md's git history). On N GPUs one writer thread writes every
    rank's rows. The other columns keep theirs, so readers still skip row groups by
    `row`, `id` or a copied column."""
    kept = [path for path in _leaf_paths(schema) if path.split(".")[0] not in VECTOR_COLUMNS]
    return {**PARQUET_OPTIONS, "write_statistics": kept}


@functools.lru_cache(maxsize=8)
def _leaf_paths(schema: pa.Schema) -> tuple[str, ...]:
    """The Parquet column paths of `schema`'s leaves (`embedding.list.element`), as the
    writer names them: statistics are set per leaf, and a nested column's leaves are
    named by the writer's own conventions, so they are read from an empty file of it."""
    buffer = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), buffer)
    parquet_schema = pq.ParquetFile(pa.BufferReader(buffer.getvalue())).schema
    return tuple(parquet_schema.column(i).path for i in range(len(parquet_schema)))


@dataclass
class RowBlock:
    """Output rows `first_row` .. `first_row + len(self) - 1`, column by column.

    Rows are consecutive input rows in order. Row i has `counts[i]` vectors in
    `vectors` (1 for a pooled embedding, one per token with `pooling: none`, 0 for an
    error row, whose `errors[i]` is set); the vectors of the rows follow each other in
    row order. `grids[i]` is row i's (t, h, w) token grid (None for an error row, and
    `grids` None where nobody set them), `extra` the copied input columns by name, and
    `digests[i]` (a (rows, `digest.DIGEST_SIZE`) uint8 array) the digest of the media
    row i was computed from, which the part's record keeps (`io/digest.py`).
    `computed` holds the output columns made beside the embeddings (captions' and
    labels'), each an Arrow array of one value (or null) per row, by name.
    Columns rather than one object per row: a block is built, sent between processes
    and written with a few array operations whatever its length.
    """

    first_row: int
    ids: list[Any]
    modality: list[str | None]
    tokens: list[int | None]
    frames: list[int | None]
    errors: list[str | None]
    counts: np.ndarray
    vectors: np.ndarray
    grids: list[tuple[int, ...] | None] | None = None
    extra: dict[str, list[Any]] = field(default_factory=dict)
    digests: np.ndarray = field(kw_only=True)
    computed: dict[str, pa.Array] = field(default_factory=dict, kw_only=True)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def end_row(self) -> int:
        return self.first_row + len(self.ids)

    def slice(self, start: int, stop: int) -> "RowBlock":
        """Rows [start, stop) of this block, by position in it."""
        offsets = np.concatenate([[0], np.cumsum(self.counts)])
        return RowBlock(
            self.first_row + start,
            self.ids[start:stop],
            self.modality[start:stop],
            self.tokens[start:stop],
            self.frames[start:stop],
            self.errors[start:stop],
            self.counts[start:stop],
            self.vectors[offsets[start] : offsets[stop]],
            None if self.grids is None else self.grids[start:stop],
            {name: values[start:stop] for name, values in self.extra.items()},
            digests=self.digests[start:stop],
            computed={name: values.slice(start, stop - start) for name, values in self.computed.items()},
        )

    @classmethod
    def concat(cls, blocks: list["RowBlock"]) -> "RowBlock":
        """Consecutive blocks as one; each must start where the previous one ends."""
        for before, after in zip(blocks, blocks[1:]):
            if after.first_row != before.end_row:
                raise ValueError(f"blocks are not consecutive: rows up to {before.end_row - 1}, then {after.first_row}")
        if len(blocks) == 1:
            return blocks[0]
        return cls(
            blocks[0].first_row,
            [v for b in blocks for v in b.ids],
            [v for b in blocks for v in b.modality],
            [v for b in blocks for v in b.tokens],
            [v for b in blocks for v in b.frames],
            [v for b in blocks for v in b.errors],
            np.concatenate([b.counts for b in blocks]),
            np.concatenate([b.vectors for b in blocks]),
            None if any(b.grids is None for b in blocks) else [g for b in blocks for g in b.grids],
            {name: [v for b in blocks for v in b.extra[name]] for name in blocks[0].extra},
            digests=np.concatenate([b.digests for b in blocks]),
            computed={name: pa.concat_arrays([b.computed[name] for b in blocks]) for name in blocks[0].computed},
        )

    @property
    def nbytes(self) -> int:
        """The bytes of its vectors, computed columns included (what a row group holds)."""
        return self.vectors.nbytes + sum(values.nbytes for values in self.computed.values())


PANDAS_INTEGERS = {
    "index_columns": [], "column_indexes": [], "pandas_version": "2.0.0", "creator": {"library": "embedjob"},
    "columns": [
        {"name": name, "field_name": name, "pandas_type": "int32", "numpy_type": "Int32", "metadata": None}
        for name in ("tokens", "frames")
    ],
}
"""The schema's `pandas` metadata: `tokens` and `frames` (null on error rows) read as
pandas' nullable Int32, not as float64 (pyarrow's reading of an integer column with
nulls, unless the file says which pandas type the column had)."""

DESCRIPTION_KEY = b"embedjob"
"""The schema metadata key of a part's `described` vectors (JSON)."""


def output_schema(
    id_type: pa.DataType,
    pooling: str,
    dtype: str,
    columns: dict[str, pa.DataType] | None = None,
    computed: dict[str, pa.DataType] | None = None,
) -> pa.Schema:
    """The part schema: pooled rows hold one vector, `none` a list of per-token vectors
    and the tokens' grid; the columns computed beside the vectors (`computed`, by name,
    `RowBlock.computed`) follow `error`; the copied input columns (`columns`, by name)
    come last, in their input types."""
    vector = pa.large_list(pa.float16() if dtype == "float16" else pa.float32())
    fields = [("id", id_type), ("row", pa.int64()), ("modality", pa.string()), ("tokens", pa.int32()), ("frames", pa.int32())]
    if pooling == "none":
        fields.append(("grid", pa.list_(pa.int32())))
    fields += [("embedding", vector if pooling == "mean" else pa.large_list(vector)), ("error", pa.string())]
    fields += list((computed or {}).items())
    return pa.schema(fields + list((columns or {}).items()), metadata={b"pandas": json.dumps(PANDAS_INTEGERS)})


def described(schema: pa.Schema, description: dict[str, Any]) -> pa.Schema:
    """`schema` with `description` (what made the vectors, and their width) under
    DESCRIPTION_KEY, so every part says what its vectors are without the job."""
    return schema.with_metadata({**(schema.metadata or {}), DESCRIPTION_KEY: json.dumps(description)})


def part_name(shard: int, part: int) -> str:
    return f"part-{shard:05d}-{part:05d}.parquet"


def block_to_table(block: RowBlock, schema: pa.Schema) -> pa.Table:
    """The block as a table of the part schema, rows in order."""
    columns = {
        "id": pa.array(block.ids, type=schema.field("id").type),
        "row": pa.array(np.arange(block.first_row, block.end_row, dtype=np.int64)),
        "modality": pa.array(block.modality, type=pa.string()),
        "tokens": pa.array(block.tokens, type=pa.int32()),
        "frames": pa.array(block.frames, type=pa.int32()),
        "embedding": _embedding_array(block, schema.field("embedding").type),
        "error": pa.array(block.errors, type=pa.string()),
    }
    if "grid" in schema.names:
        columns["grid"] = _grid_array(block)
    columns.update(block.computed)
    for name in schema.names:
        if name not in columns:
            columns[name] = pa.array(block.extra[name], type=schema.field(name).type)
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


def _embedding_array(block: RowBlock, kind: pa.DataType) -> pa.Array:
    """Pooled: a vector per row; per token: a list of vectors per row; null on an error
    row either way (`counts` 0)."""
    per_token = pa.types.is_large_list(kind.value_type)
    value_type = kind.value_type.value_type if per_token else kind.value_type
    np_dtype = np.float16 if value_type == pa.float16() else np.float32
    vectors = np.asarray(block.vectors, dtype=np_dtype)
    if not per_token:
        return vector_array(vectors, block.counts > 0, value_type)
    dim = vectors.shape[1] if vectors.ndim == 2 else 0
    values = pa.array(vectors.reshape(-1), type=value_type)
    values = pa.LargeListArray.from_arrays(pa.array(np.arange(len(vectors) + 1, dtype=np.int64) * dim), values)
    offsets = np.concatenate([[0], np.cumsum(block.counts, dtype=np.int64)])
    return pa.LargeListArray.from_arrays(pa.array(offsets), values, mask=pa.array(block.counts == 0))


def vector_array(vectors: np.ndarray, present: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A large-list column of one vector per present row (`vectors`, in row order), null
    elsewhere: the pooled `embedding` column, and captions' `text_embedding`."""
    width = vectors.shape[1] if vectors.ndim == 2 else 0
    offsets = np.concatenate([[0], np.cumsum(present, dtype=np.int64) * width])
    flat = pa.array(vectors.reshape(-1), type=value_type)
    return pa.LargeListArray.from_arrays(pa.array(offsets), flat, mask=pa.array(~present))


def _grid_array(block: RowBlock) -> pa.Array:
    """Each row's (t, h, w) token grid, null on error rows (and where none was set)."""
    grids = block.grids if block.grids is not None else [None] * len(block)
    return pa.array([g if c else None for g, c in zip(grids, block.counts)], type=pa.list_(pa.int32()))


class _DigestingStream(io.RawIOBase):
    """A write-only stream into `sink` (a part's file or upload) that keeps the sha256
    and size of what went into it.

    The Parquet writer only appends, so these are the file's own digest and size when
    it is closed: the part is sealed without reading it back, which at the end of a
    shard was a read of the whole part after the last row group."""

    def __init__(self, sink: Any) -> None:
        super().__init__()
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data: Any) -> int:
        """All of `data` (a raw file may take part of it per call; the Parquet writer
        does not come back for the rest)."""
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += self.sink.write(view[written:])
        self.sha256.update(view)
        self.size += written
        return written


@dataclass(frozen=True)
class Sealed:
    """A committed part file: its name in the output, its size in bytes and its sha256."""

    name: str
    size: int
    sha256: str


class PartFile:
    """One part being written: row groups appended to what the output's store gives
    for it (`Store.open_part`), which appears under `name` only at `commit`, so a part
    under its name is always whole: in a directory a hidden temporary file, created by
    this call under a name nobody can guess (a link planted at a name we would use
    cannot make the job overwrite the file it points to), closed, fsynced and renamed;
    in an object store an upload to the final key, completed. A run killed before
    leaves a temporary file or an incomplete upload, which the checkpoint removes when
    the shard is run again."""

    def __init__(self, store: Store, name: str, schema: pa.Schema) -> None:
        self.name = name
        self.schema = schema
        self._upload = store.open_part(name)
        self._file = _DigestingStream(self._upload.stream)
        self._writer = pq.ParquetWriter(self._file, schema, **parquet_options(schema))

    def write(self, block: RowBlock) -> None:
        """Append the block's rows as one row group."""
        self._writer.write_table(block_to_table(block, self.schema))

    def commit(self) -> Sealed:
        self._writer.close()
        self._upload.commit()
        return Sealed(self.name, self._file.size, self._file.sha256.hexdigest())

    def abandon(self) -> None:
        """Drop the unfinished part (a failing run; nothing is committed)."""
        self._writer.close()
        self._upload.abandon()
