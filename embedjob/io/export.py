"""`embedjob export OUTPUT DEST --format npy|faiss`: an output's vectors in the layout
vector-index tools read (clip-retrieval's, which autofaiss takes as it is).

DEST, new or empty:

- `embeddings/0000.npy, 0001.npy, ...` (`npy`): 2-D arrays of the output's dtype
  (float16 or float32, as written), one row per vector;
- `metadata/0000.parquet, ...` (both formats): `row`, `id` and the carried columns
  (`output.columns`), row for row with the array of the same number;
- `index.faiss` (`faiss`): the vectors, L2-normalised, in a faiss index searched by
  inner product (so by cosine): exact (`IndexFlatIP`) up to `FLAT_LIMIT` vectors, an
  inverted file (`IndexIVFFlat`, `nlist` about 4 x sqrt(n), `nprobe` nlist / 16) above;
  its recall@10 against exact search on a sample of the vectors is measured and reported.
  A vector's faiss id is its place in the metadata files, taken in order.

Invariants: rows come in output order (shards in shard order, parts in part order);
error rows are left out (they have no vector), every other row is in exactly once;
file K of `embeddings/` and of `metadata/` hold the same rows, each file
`rows_per_file` of them but the last. Only a finished output (every shard's `_SUCCESS`)
is exported, unless `partial` (its committed parts, shards not finished included); each
part is checked against the size and sha256 it was committed with before it is read.
An output of `pooling: none` (a vector per token) is refused: an index holds one vector
per row. Memory: `npy` holds one file's rows; `faiss` holds every vector as float32.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from embedjob.config import OUTPUT_COLUMNS, JobError, RunFailure
from embedjob.io.checkpoint import (
    PartRecord,
    load_manifest,
    existing_output,
    part_problem,
    read_output_record,
    shard_finished,
)
from embedjob.io.store import Store, is_url, output_store
from embedjob.report.counts import plural

logger = logging.getLogger(__name__)

Format = Literal["npy", "faiss"]
FORMATS = ("npy", "faiss")
ROWS_PER_FILE = 100_000
"""Rows per exported file by default: 200 MB of float16 vectors 1,024 wide."""
FLAT_LIMIT = 100_000
"""The most vectors indexed exactly; an exact search of 100,000 1,024-wide vectors takes
milliseconds a query on a CPU, and more wants an inverted file."""
RECALL_QUERIES = 1000
RECALL_K = 10
FAISS_MISSING = "--format faiss needs faiss, which is not installed here: pip install 'embedjob[index]'"


@dataclass
class ExportResult:
    """What `export_output` wrote: rows exported and left out, files, the vectors'
    width and dtype and, for `faiss`, the index and its measured recall@10."""

    dest: Path
    rows: int = 0
    errors: int = 0
    files: int = 0
    width: int | None = None
    dtype: str | None = None
    index: str | None = None
    recall: float | None = None
    queries: int = 0


def export_output(
    output: str | Path,
    dest: Path,
    fmt: Format,
    partial: bool = False,
    rows_per_file: int = ROWS_PER_FILE,
    flat_limit: int = FLAT_LIMIT,
) -> ExportResult:
    """Export `output` into `dest` (see the module docstring). JobError (nothing
    written) for an output that is unfinished without `partial`, per-token, or not an
    embedjob output, a `dest` that holds files or lies inside the output, or a missing
    faiss; RunFailure for a damaged part."""
    if fmt not in FORMATS:
        raise JobError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if rows_per_file < 1:
        raise JobError(f"--rows-per-file must be >= 1, got {rows_per_file}")
    faiss = _faiss() if fmt == "faiss" else None
    store = output_store(output)
    parts = committed_parts(store, partial)
    for name in parts:
        where, filesystem = store.arrow(name)
        _refuse_per_token(store, pq.read_schema(where, filesystem=filesystem))
    _check_dest(store, Path(dest))
    result = ExportResult(Path(dest))
    sink = _Sink(Path(dest), rows_per_file, fmt == "npy")
    vectors: list[np.ndarray] = []
    for table in _valid_rows(store, parts, result):
        block = _vectors(table, result)
        sink.add(block, table.drop_columns(["embedding"]))
        if faiss is not None:
            vectors.append(block.astype(np.float32))
    result.files = sink.close()
    if faiss is not None and result.rows:
        result.index, result.recall, result.queries = _write_index(faiss, np.concatenate(vectors), Path(dest), flat_limit)
    return result


def committed_parts(output: Store, partial: bool) -> list[str]:
    """The names of `output`'s committed parts in row order, each checked intact (read
    back whole through its store); JobError where a shard is unfinished and not `partial`."""
    existing_output(output, "export")
    record = read_output_record(output)
    if record is None:
        raise JobError(f"{output} is not an embedjob output (it has no _embedjob/job.json)")
    unfinished = [s for s in range(record.num_shards) if not shard_finished(output, s)]
    if unfinished and not partial:
        raise JobError(
            f"{output} is not finished: {plural(len(unfinished), 'shard')} of {record.num_shards} "
            f"({', '.join(map(str, unfinished[:10]))}{', ...' if len(unfinished) > 10 else ''}) have not finished; "
            "finish the job (run it again, or embedjob submit) or pass --partial to export the committed rows"
        )
    parts = []
    for shard in range(record.num_shards):
        for entry in (load_manifest(output, shard) or {"parts": []})["parts"]:
            part = PartRecord(**entry)
            problem = part_problem(output, part)
            if problem is not None:
                raise RunFailure(f"{part.name} {problem}; run embedjob verify {output}, then rerun the job to recompute it")
            parts.append(part.name)
    return parts


def _faiss() -> ModuleType:
    try:
        return importlib.import_module("faiss")
    except ImportError:
        raise JobError(FAISS_MISSING) from None


def _check_dest(output: Store, dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise JobError(f"export destination {dest} {'is a file' if not dest.is_dir() else 'holds files'}; name a new or empty directory")
    if not is_url(output.location) and dest.resolve().is_relative_to(Path(output.location).resolve()):
        raise JobError(f"export destination {dest} lies inside the output {output}, whose readers would take its files for parts; name another directory")


def _valid_rows(output: Store, parts: list[str], result: ExportResult) -> Iterator[pa.Table]:
    """Each part's rows that have a vector, a row group at a time, with `row`, `id`,
    the carried columns and `embedding`; error rows counted in `result.errors`."""
    for name in parts:
        where, filesystem = output.arrow(name)
        handle = pq.ParquetFile(where, filesystem=filesystem)
        carried = [n for n in handle.schema_arrow.names if n not in OUTPUT_COLUMNS]
        for group in range(handle.num_row_groups):
            table = handle.read_row_group(group).select(["row", "id", *carried, "embedding"])
            valid = pc.is_valid(table.column("embedding"))
            kept = table.filter(valid)
            result.errors += table.num_rows - kept.num_rows
            yield kept


def _refuse_per_token(output: Store, schema: pa.Schema) -> None:
    described = json.loads((schema.metadata or {}).get(b"embedjob", b"{}"))
    nested = pa.types.is_list(schema.field("embedding").type.value_type)
    if described.get("pooling") == "none" or nested:
        raise JobError(
            f"{output} holds a vector per token (output.pooling: none); an index holds one vector per row: "
            "export an output of output.pooling: mean"
        )


def _vectors(table: pa.Table, result: ExportResult) -> np.ndarray:
    """The rows' vectors as one (rows, width) array of the dtype they were written in."""
    column = table.column("embedding").combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    width = int(lengths[0]) if len(lengths) else (result.width or 0)
    if result.width is None and len(lengths):
        result.width, result.dtype = width, str(values.dtype)
    if len(lengths) and (np.any(lengths != result.width) or str(values.dtype) != result.dtype):
        raise RunFailure(f"the output's vectors disagree in width or dtype ({result.width} {result.dtype}, then {width} {values.dtype})")
    result.rows += len(lengths)
    return values.reshape(len(lengths), width)


class _Sink:
    """Buffers exported rows and writes them as numbered files of `rows_per_file` rows:
    `metadata/K.parquet` always, `embeddings/K.npy` with `arrays`; each written under a
    temporary name and renamed whole."""

    def __init__(self, dest: Path, rows_per_file: int, arrays: bool) -> None:
        self.dest = dest
        self.rows_per_file = rows_per_file
        self.arrays = arrays
        self.vectors: list[np.ndarray] = []
        self.tables: list[pa.Table] = []
        self.pending = 0
        self.written = 0
        for name in ("metadata", *(["embeddings"] if arrays else [])):
            (dest / name).mkdir(parents=True, exist_ok=True)

    def add(self, vectors: np.ndarray, metadata: pa.Table) -> None:
        self.vectors.append(vectors)
        self.tables.append(metadata)
        self.pending += len(vectors)
        while self.pending >= self.rows_per_file:
            self._flush(self.rows_per_file)

    def close(self) -> int:
        """Write what is left; the number of files written (one, empty, for no rows)."""
        if self.pending or not self.written:
            self._flush(self.pending)
        return self.written

    def _flush(self, rows: int) -> None:
        vectors = np.concatenate(self.vectors) if self.vectors else np.empty((0, 0), np.float16)
        table = pa.concat_tables(self.tables) if self.tables else pa.table({"row": pa.array([], pa.int64())})
        name = f"{self.written:04d}"
        _write(self.dest / "metadata" / f"{name}.parquet", lambda f: pq.write_table(table.slice(0, rows), f))
        if self.arrays:
            _write(self.dest / "embeddings" / f"{name}.npy", lambda f: np.save(f, vectors[:rows]))
        self.vectors, self.tables = [vectors[rows:]], [table.slice(rows)]
        self.pending -= rows
        self.written += 1


def _write(path: Path, write: Any) -> None:
    """Write through `write(file)` to a temporary name beside `path`, then rename: a
    killed export leaves no file that looks whole."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        write(handle)
    os.replace(temporary, path)


def build_index(faiss: ModuleType, vectors: np.ndarray, flat_limit: int = FLAT_LIMIT) -> tuple[Any, str]:
    """An inner-product index of `vectors` (float32, L2-normalised in place) and its
    description: exact up to `flat_limit` vectors, an inverted file above."""
    faiss.normalize_L2(vectors)
    count, width = vectors.shape
    if count <= flat_limit:
        index = faiss.IndexFlatIP(width)
        index.add(vectors)
        return index, "Flat (exact inner product)"
    lists = max(1, min(count // 39, round(4 * math.sqrt(count))))  # faiss wants >= 39 training points a list
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(width), width, lists, faiss.METRIC_INNER_PRODUCT)
    sample = np.random.default_rng(0).choice(count, min(count, 256 * lists), replace=False)
    index.train(vectors[np.sort(sample)])
    index.add(vectors)
    index.nprobe = max(1, lists // 16)
    return index, f"IVF{lists},Flat (inner product, nprobe {index.nprobe})"


def recall_at_k(faiss: ModuleType, index: Any, vectors: np.ndarray, queries: int = RECALL_QUERIES, k: int = RECALL_K) -> tuple[float, int]:
    """The share of each sampled vector's k nearest (by exact inner product) that the
    index finds, over `queries` vectors drawn from `vectors` (seeded), and how many. A
    neighbour tied with the k-th exact one counts as found (duplicates tie)."""
    k = min(k, len(vectors))
    chosen = np.sort(np.random.default_rng(0).choice(len(vectors), min(queries, len(vectors)), replace=False))
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    truth, _ = exact.search(vectors[chosen], k)
    found, _ = index.search(vectors[chosen], k)
    threshold = truth[:, -1:] - 1e-5
    return float(np.mean(found >= threshold)), len(chosen)


def _write_index(faiss: ModuleType, vectors: np.ndarray, dest: Path, flat_limit: int) -> tuple[str, float, int]:
    index, description = build_index(faiss, vectors, flat_limit)
    recall, queries = recall_at_k(faiss, index, vectors)
    temporary = dest / f".index.faiss.tmp-{os.getpid()}"
    faiss.write_index(index, str(temporary))
    os.replace(temporary, dest / "index.faiss")
    logger.info("index %s of %d vectors: recall@%d %.3f on %d queries", description, len(vectors), RECALL_K, recall, queries)
    return description, recall, queries


def summary(result: ExportResult, output: str | Path) -> str:
    """The one line `embedjob export` prints."""
    vectors = f"{plural(result.rows, 'vector')}" + (f" ({result.width} x {result.dtype})" if result.width else "")
    line = (
        f"exported {vectors} of {output} into {result.dest}, {plural(result.files, 'file')} each of metadata"
        f"{'' if result.index else ' and embeddings'}; {plural(result.errors, 'error row')} left out"
    )
    if result.index:
        line += f"; index {result.index}: recall@{RECALL_K} {result.recall:.3f} on {result.queries} sampled vectors against exact search"
    return line
