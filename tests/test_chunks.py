"""Chunks of a shard (what a rank takes at a time) and the columnar row blocks that
carry their results to the writer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedjob.io.digest import digest_array, media_digest
from embedjob.io.reader import Fragment, plan_chunks
from embedjob.io.writer import RowBlock, block_to_table, output_schema


def _fragments(sizes: list[int]) -> list[Fragment]:
    fragments, first = [], 0
    for index, size in enumerate(sizes):
        fragments.append(Fragment(f"file-{index // 3}.parquet", index % 3, first, size, size))
        first += size
    return fragments


layouts = st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=12)


@given(layouts, st.integers(min_value=1, max_value=100), st.data())
def test_chunks_cover_the_range_in_order_within_the_size(sizes: list[int], rows: int, data: st.DataObject) -> None:
    total = sum(sizes)
    start = data.draw(st.integers(min_value=0, max_value=total))
    end = data.draw(st.integers(min_value=start, max_value=total))
    chunks = plan_chunks(_fragments(sizes), start, end, rows)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    bounds = [start] + [c.end_row for c in chunks]
    assert [c.first_row for c in chunks] == bounds[:-1] and bounds[-1] == end
    assert all(0 < c.rows <= rows for c in chunks)
    for chunk in chunks:  # each names exactly the row groups its rows lie in
        expected = [f for f in _fragments(sizes) if f.first_row < chunk.end_row and f.first_row + f.num_rows > chunk.first_row]
        assert list(chunk.fragments) == expected


@given(layouts, st.integers(min_value=1, max_value=100))
def test_small_row_groups_stay_whole_and_large_ones_split_evenly(sizes: list[int], rows: int) -> None:
    """A rank reads a chunk with few reads: a row group that fits is never cut, and the
    pieces of one that does not are alone in their chunks and differ by one row at most."""
    fragments = _fragments(sizes)
    chunks = plan_chunks(fragments, 0, sum(sizes), rows)
    for fragment in fragments:
        inside = [c for c in chunks if c.first_row < fragment.first_row + fragment.num_rows and c.end_row > fragment.first_row]
        if fragment.num_rows <= rows:
            assert len(inside) == 1
        else:
            assert all(c.fragments == (fragment,) for c in inside)
            assert max(c.rows for c in inside) - min(c.rows for c in inside) <= 1


def test_chunks_of_a_resumed_range_start_at_the_resume_row() -> None:
    chunks = plan_chunks(_fragments([100, 100]), 130, 200, 64)
    assert [(c.first_row, c.end_row) for c in chunks] == [(130, 165), (165, 200)]
    assert plan_chunks(_fragments([100]), 100, 100, 64) == []
    with pytest.raises(ValueError, match="rows per chunk"):
        plan_chunks(_fragments([10]), 0, 10, 0)


def _block(first: int, counts: list[int], dim: int = 3) -> RowBlock:
    n = len(counts)
    vectors = np.arange(sum(counts) * dim, dtype=np.float32).reshape(-1, dim) + first
    errors = [None if c else f"corrupt: row {first + i}" for i, c in enumerate(counts)]
    return RowBlock(first, [f"id-{first + i}" for i in range(n)], ["image"] * n, [c or None for c in counts],
                    [0] * n, errors, np.array(counts, dtype=np.int64), vectors,
                    digests=digest_array([media_digest(bytes([first + i])) for i in range(n)]))


def test_block_slices_and_concatenations_keep_each_rows_vectors() -> None:
    block = _block(10, [2, 0, 3, 1])
    pieces = [block.slice(0, 1), block.slice(1, 3), block.slice(3, 4)]
    assert [p.first_row for p in pieces] == [10, 11, 13]
    assert [len(p.vectors) for p in pieces] == [2, 3, 1]
    joined = RowBlock.concat(pieces)
    assert joined.ids == block.ids and joined.errors == block.errors
    assert np.array_equal(joined.vectors, block.vectors) and np.array_equal(joined.counts, block.counts)
    with pytest.raises(ValueError, match="not consecutive"):
        RowBlock.concat([pieces[0], pieces[2]])


def test_error_rows_have_a_null_embedding_pooled_and_per_token() -> None:
    pooled = _block(0, [1, 0, 1])
    table = block_to_table(pooled, output_schema(pa.string(), "mean", "float16"))
    rows = table.to_pylist()
    assert [r["row"] for r in rows] == [0, 1, 2] and rows[1]["error"] == "corrupt: row 1"
    assert rows[0]["embedding"] == [0.0, 1.0, 2.0] and rows[1]["embedding"] is None
    assert rows[2]["embedding"] == [3.0, 4.0, 5.0]
    per_token = _block(5, [2, 0, 1])
    schema = output_schema(pa.string(), "none", "float32")
    rows = block_to_table(per_token, schema).to_pylist()
    assert rows[0]["embedding"] == [[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]] and rows[1]["embedding"] is None
    assert rows[2]["embedding"] == [[11.0, 12.0, 13.0]]
    assert rows[1]["grid"] is None
