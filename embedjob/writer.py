"""Ordered Parquet output: parts written under a temporary name, renamed when complete.

Output contract (DESIGN.md): every input row of a shard appears exactly once, in input
order, with an embedding or a non-null `error`. Columns: `id`, `row`, `modality`,
`tokens`, `frames`, `embedding`, `error`. A part file either exists complete (renamed
after fsync) or not at all, so a reader never sees half a part.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"


@dataclass
class OutputRow:
    """One output row. Exactly one of `embedding` and `error` is set."""

    row: int
    id: Any
    modality: str | None
    tokens: int | None
    frames: int | None
    embedding: np.ndarray | None
    error: str | None


def output_schema(id_type: pa.DataType, embed_dim: int, pooling: str, dtype: str) -> pa.Schema:
    """The part schema: pooled rows hold one vector, `none` a list of per-token vectors."""
    value = pa.float16() if dtype == "float16" else pa.float32()
    vector = pa.list_(value, embed_dim)
    embedding = vector if pooling == "mean" else pa.list_(vector)
    return pa.schema(
        [
            ("id", id_type),
            ("row", pa.int64()),
            ("modality", pa.string()),
            ("tokens", pa.int32()),
            ("frames", pa.int32()),
            ("embedding", embedding),
            ("error", pa.string()),
        ]
    )


def part_name(shard: int, part: int) -> str:
    return f"part-{shard:05d}-{part:05d}.parquet"


def stats_name(shard: int) -> str:
    return f"stats-{shard:05d}.json"


def rows_to_table(rows: list[OutputRow], schema: pa.Schema) -> pa.Table:
    """Build a table in `rows` order; error rows get a null embedding."""
    embedding_type = schema.field("embedding").type
    columns = [
        pa.array([r.id for r in rows], type=schema.field("id").type),
        pa.array([r.row for r in rows], type=pa.int64()),
        pa.array([r.modality for r in rows], type=pa.string()),
        pa.array([r.tokens for r in rows], type=pa.int32()),
        pa.array([r.frames for r in rows], type=pa.int32()),
        _embedding_array(rows, embedding_type),
        pa.array([r.error for r in rows], type=pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _embedding_array(rows: list[OutputRow], kind: pa.DataType) -> pa.Array:
    per_token = pa.types.is_list(kind) and not pa.types.is_fixed_size_list(kind)
    vector = kind.value_type if per_token else kind
    dim = vector.list_size
    np_dtype = np.float16 if vector.value_type == pa.float16() else np.float32
    blocks = [_as_rows(r.embedding, dim, np_dtype, per_token) for r in rows]
    flat = np.concatenate(blocks).reshape(-1) if blocks else np.zeros(0, dtype=np_dtype)
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=vector.value_type), dim)
    if not per_token:
        return vectors
    counts = np.array([b.shape[0] for b in blocks], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    missing = pa.array([r.embedding is None for r in rows])
    return pa.ListArray.from_arrays(offsets, vectors, mask=missing)


def _as_rows(embedding: np.ndarray | None, dim: int, dtype: type, per_token: bool) -> np.ndarray:
    """The vectors this row contributes to the flat value buffer.

    An error row has no per-token vectors (its list is null). A pooled error row holds
    one all-NaN vector instead of a null: pyarrow before 25 cannot read a Parquet
    column of fixed-size lists that contains nulls, and NaN cannot pass for a real
    embedding in any similarity computation.
    """
    if embedding is None:
        return np.full((0 if per_token else 1, dim), np.nan, dtype=dtype)
    return np.asarray(embedding, dtype=dtype).reshape(-1, dim)


def write_part(directory: Path, name: str, rows: list[OutputRow], schema: pa.Schema) -> Path:
    """Write rows to `directory/name` atomically: temp file, fsync, rename."""
    target = directory / name
    tmp = directory / f".{name}{TMP_MARK}{os.getpid()}"
    pq.write_table(rows_to_table(rows, schema), tmp)
    _fsync(tmp)
    os.replace(tmp, target)
    return target


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace a small JSON file (stats, manifests, markers)."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _fsync(tmp)
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
