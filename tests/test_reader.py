"""Tests of the Parquet reader: real dataset layouts, ordering over several files and
row groups, every input form (file, directory, glob, file:// and memory:// URIs),
media path resolution, resume slicing, shard balance and every job-level error."""

from __future__ import annotations

import functools
import os
import random
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedjob.config import InputConfig, JobError
from embedjob.io.reader import Fragment, InputRow, assign_shards, expand_braces, id_type, list_fragments, read_rows

REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "parquet"
CATS = "hfhub_huggan-few-shot-cat_train-00000-of-00001.parquet"
SPRITES = "hfstyle_pokemon-gba_train-00000-of-00001.parquet"
I2D_OUTPUT = "img2dataset_output_style_synthetic.parquet"
I2D_INPUT = "img2dataset_input_test_1000.parquet"
I2D_SAMPLE = "img2dataset_input_sample_image.parquet"
JPEG_MAGIC = b"\xff\xd8"


@pytest.fixture
def real() -> Path:
    if not REAL.is_dir():
        pytest.skip(f"real Parquet files not present at {REAL}")
    return REAL


def cfg(path, media="image", ident="id", **kw) -> InputConfig:
    return InputConfig(path=str(path), media_column=media, id_column=ident, **kw)


def read_all(config: InputConfig, **kw) -> list[InputRow]:
    return list(read_rows(config, list_fragments(config), **kw))


def write(path: Path, columns: dict, row_group_size: int | None = None, schema: pa.Schema | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=row_group_size)


# Three files of a dataset, written out of name order, with several row groups each.
FILES = {"b.parquet": (5, 2), "a.parquet": (7, 3), "sub/c.parquet": (4, 4)}
ORDER = ["a", "b", "c"]


def media_of(name: str, i: int) -> bytes:
    return f"img-{name}-{i}".encode()


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "ds"
    for rel, (rows, group) in FILES.items():
        name = Path(rel).stem
        write(root / rel, {"id": [f"{name}-{i}" for i in range(rows)], "image": [media_of(name, i) for i in range(rows)]}, group)
    return root


def expected_ids() -> list[str]:
    sizes = {Path(rel).stem: rows for rel, (rows, _) in FILES.items()}
    return [f"{name}-{i}" for name in ORDER for i in range(sizes[name])]


# ---------------------------------------------------------------- real layouts


def test_hf_struct_cats_yield_160_jpeg_rows_indexed_by_row(real):
    config = cfg(real / CATS, ident=None)
    rows = read_all(config)
    assert [r.row for r in rows] == list(range(160))
    assert [r.id for r in rows] == list(range(160))
    assert all(r.error is None and r.uri is None and r.data.startswith(JPEG_MAGIC) for r in rows)
    assert id_type(config) == pa.int64()


def test_hf_struct_with_null_typed_path_reads_bytes_and_string_ids(real):
    config = cfg(real / SPRITES, ident="text")
    rows = read_all(config)
    captions = pq.read_table(real / SPRITES, columns=["text"]).column("text").to_pylist()
    assert len(rows) == 49
    assert [r.id for r in rows] == captions
    assert all(r.error is None and r.data.startswith(JPEG_MAGIC) for r in rows)
    assert id_type(config) == pa.string()


def test_img2dataset_output_failed_download_is_an_empty_error_row(real):
    rows = read_all(cfg(real / I2D_OUTPUT, media="jpg", ident="key"))
    table = pq.read_table(real / I2D_OUTPUT, columns=["key", "status", "jpg"]).to_pylist()
    assert [r.id for r in rows] == [t["key"] for t in table]
    for row, source in zip(rows, table):
        if source["status"] == "success":
            assert row.error is None and row.data == source["jpg"]
        else:
            assert row.data is None and row.uri is None
            assert row.error.startswith("empty: ") and "'jpg'" in row.error
    assert sum(r.error is not None for r in rows) == 1


def test_img2dataset_url_list_yields_uri_rows(real):
    rows = read_all(cfg(real / I2D_INPUT, media="URL", ident="__index_level_0__", allow_any_path=True))
    urls = pq.read_table(real / I2D_INPUT, columns=["URL"]).column("URL").to_pylist()
    assert [r.uri for r in rows] == urls
    assert all(r.error is None and r.data is None for r in rows)
    assert [r.row for r in rows] == list(range(1000))


def test_img2dataset_urls_outside_media_root_are_path_escape_rows(real):
    root = "https://cdn.shopify.com"
    rows = read_all(cfg(real / I2D_INPUT, media="URL", ident=None, media_root=root))
    urls = pq.read_table(real / I2D_INPUT, columns=["URL"]).column("URL").to_pylist()
    inside = [u.startswith(root + "/") for u in urls]
    assert 0 < sum(inside) < len(urls)
    for row, url, ok in zip(rows, urls, inside):
        if ok:
            assert row.uri == url and row.error is None
        else:
            assert row.uri is None and row.error.startswith("path_escape: ") and url in row.error


def test_http_urls_with_local_media_root_are_path_escape_rows(real, tmp_path):
    rows = read_all(cfg(real / I2D_SAMPLE, media="url", ident=None, media_root=str(tmp_path)))
    assert len(rows) == 2
    assert all(r.error.startswith("path_escape: ") and "https://" in r.error for r in rows)


# ---------------------------------------------------------------- order and input forms


def test_rows_are_numbered_in_path_order_over_files_and_row_groups(dataset):
    config = cfg(dataset)
    fragments = list_fragments(config)
    rows = list(read_rows(config, fragments))
    assert [r.row for r in rows] == list(range(16))
    assert [r.id for r in rows] == expected_ids()
    assert [r.data for r in rows] == [media_of(name, int(i)) for name, i in (x.split("-") for x in expected_ids())]
    assert [os.path.basename(f.path) for f in fragments] == ["a.parquet"] * 3 + ["b.parquet"] * 3 + ["c.parquet"]
    assert [f.first_row for f in fragments] == [0, 3, 6, 7, 9, 11, 12]
    assert sum(f.num_rows for f in fragments) == 16


def test_small_batches_do_not_change_rows(dataset):
    assert read_all(cfg(dataset, batch_rows=2)) == read_all(cfg(dataset, batch_rows=256))


@pytest.mark.parametrize(
    "spec, names",
    [
        ("{root}", ORDER),
        ("{root}/*.parquet", ["a", "b"]),
        ("{root}/**/*.parquet", ORDER),
        ("{root}/b.parquet", ["b"]),
        ("file://{root}", ORDER),
        ("file://{root}/**/*.parquet", ORDER),
        ("{root}/{{b,sub/c}}.parquet", ["b", "c"]),
        ("file://{root}/{{a,b}}.parquet", ["a", "b"]),
        ("{root}/{{*,sub/*}}.parquet", ORDER),
    ],
)
def test_file_directory_glob_and_file_uri_inputs(dataset, spec, names):
    rows = read_all(cfg(spec.format(root=dataset)))
    assert [r.id.split("-")[0] for r in rows] == [n for n in names for _ in range(dict(a=7, b=5, c=4)[n])]
    assert [r.row for r in rows] == list(range(len(rows)))


@pytest.mark.parametrize(
    ("spec", "paths"),
    [
        ("s3://b/shards/{00008..00011}.tar", [f"s3://b/shards/{n:05d}.tar" for n in range(8, 12)]),
        ("d/{a,b}/{0..1}.tar", ["d/a/0.tar", "d/a/1.tar", "d/b/0.tar", "d/b/1.tar"]),
        ("d/[ab]*.parquet", ["d/[ab]*.parquet"]),
        ("d/{x}.parquet", ["d/{x}.parquet"]),
    ],
)
def test_a_list_of_inputs_is_written_in_braces_as_webdataset_writes_shard_lists(spec: str, paths: list[str]) -> None:
    assert expand_braces(spec) == paths


def test_a_brace_list_naming_a_missing_file_or_too_many_stops_naming_it(dataset):
    with pytest.raises(JobError, match=r"input.path '.*/z.parquet' does not exist"):
        read_all(cfg(f"{dataset}/{{a,z}}.parquet"))
    with pytest.raises(JobError, match="must go up"):
        expand_braces("{9..1}.tar")
    with pytest.raises(JobError, match="at most 1,000,000 paths"):
        expand_braces("{0..99999999}.tar")


def test_directory_skips_hidden_underscore_and_non_parquet_files(dataset):
    write(dataset / "_tmp.parquet", {"id": ["tmp-0"], "image": [b"x"]})
    write(dataset / ".hidden" / "d.parquet", {"id": ["hidden-0"], "image": [b"x"]})
    (dataset / "_SUCCESS").write_text("")
    (dataset / "notes.txt").write_text("not a table")
    assert [r.id for r in read_all(cfg(dataset))] == expected_ids()


@pytest.fixture
def memory_dataset():
    fs = fsspec.filesystem("memory")
    root = f"/ds-{uuid.uuid4().hex}"
    for rel, rows in (("b.parquet", 3), ("a.parquet", 2)):
        name = rel[0]
        table = pa.table({"id": [f"{name}-{i}" for i in range(rows)], "image": [f"img/{name}{i}.jpg" for i in range(rows)]})
        with fs.open(f"{root}/{rel}", "wb") as f:
            pq.write_table(table, f, row_group_size=1)
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_memory_uri_lists_uris_and_resolves_relative_paths_next_to_the_file(memory_dataset):
    config = cfg(memory_dataset, allow_any_path=True)
    fragments = list_fragments(config)
    assert all(f.path.startswith("memory://") for f in fragments)
    rows = list(read_rows(config, fragments))
    assert [r.id for r in rows] == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    base = fragments[0].path.rsplit("/", 1)[0]
    assert [r.uri for r in rows] == [f"{base}/img/{i.replace('-', '')}.jpg" for i in ["a-0", "a-1", "b-0", "b-1", "b-2"]]


def test_memory_glob(memory_dataset):
    assert [r.id for r in read_all(cfg(memory_dataset + "/b*.parquet", allow_any_path=True))] == ["b-0", "b-1", "b-2"]


def test_empty_files_and_row_groups_take_no_row_index(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("image", pa.binary())])
    write(tmp_path / "a.parquet", {"id": [], "image": []}, schema=schema)
    with pq.ParquetWriter(tmp_path / "b.parquet", schema) as writer:
        for ids in ([1], [], [2]):
            writer.write_table(pa.table({"id": ids, "image": [b"x"] * len(ids)}, schema=schema))
    config = cfg(tmp_path)
    assert [(os.path.basename(f.path), f.row_group, f.first_row) for f in list_fragments(config)] == [
        ("b.parquet", 0, 0),
        ("b.parquet", 2, 1),
    ]
    assert [(r.row, r.id) for r in read_all(config)] == [(0, 1), (1, 2)]


def test_all_null_id_column_in_one_file_takes_the_type_of_the_others(tmp_path):
    write(tmp_path / "a.parquet", {"id": pa.nulls(2), "image": [b"a", b"b"]})
    write(tmp_path / "b.parquet", {"id": [5], "image": [b"c"]})
    config = cfg(tmp_path)
    assert id_type(config) == pa.int64()
    assert [r.id for r in read_all(config)] == [None, None, 5]


def test_large_binary_and_large_string_columns(tmp_path):
    schema = pa.schema([("id", pa.int32()), ("image", pa.large_binary()), ("path", pa.large_string())])
    write(tmp_path / "t.parquet", {"id": [7, 8], "image": [b"ab", b"cd"], "path": ["x.jpg", "y.jpg"]}, schema=schema)
    assert [r.data for r in read_all(cfg(tmp_path))] == [b"ab", b"cd"]
    assert [r.uri for r in read_all(cfg(tmp_path, media="path", allow_any_path=True))] == [str(tmp_path / "x.jpg"), str(tmp_path / "y.jpg")]
    assert id_type(cfg(tmp_path)) == pa.int32()


def test_null_id_keeps_the_row_and_empty_bytes_are_errors(tmp_path):
    write(tmp_path / "t.parquet", {"id": ["x", None, "z"], "image": [b"a", b"b", b""]})
    rows = read_all(cfg(tmp_path))
    assert [(r.row, r.id, r.data) for r in rows[:2]] == [(0, "x", b"a"), (1, None, b"b")]
    assert rows[2].error.startswith("empty: ") and rows[2].data is None


def test_hf_struct_uses_bytes_then_path_then_reports_empty(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    cells = [
        {"bytes": b"jpeg", "path": "ignored.jpg"},
        {"bytes": None, "path": "cat.jpg"},
        {"bytes": None, "path": None},
        None,
    ]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    write(tmp_path / "t.parquet", {"image": pa.array(cells, type=struct)})
    rows = read_all(cfg(tmp_path / "t.parquet", ident=None, media_root=str(media)))
    assert rows[0].data == b"jpeg" and rows[0].uri is None
    assert rows[1].uri == str(media / "cat.jpg") and rows[1].data is None
    assert rows[2].error == "empty: column 'image' has neither bytes nor a path"
    assert rows[3].error == "empty: column 'image' is null"


# ---------------------------------------------------------------- path resolution


@pytest.fixture
def media_tree(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (media / "out").symlink_to(tmp_path / "secret")
    (media / "in").symlink_to(media / "sub")
    return media


def path_rows(tmp_path: Path, cells: list, media_root: str | None) -> list[InputRow]:
    write(tmp_path / "list" / "paths.parquet", {"p": pa.array(cells, type=pa.string())})
    return read_all(cfg(tmp_path / "list", media="p", ident=None, media_root=media_root, allow_any_path=media_root is None))


def test_paths_resolve_under_media_root_and_escapes_are_error_rows(tmp_path, media_tree):
    media = media_tree
    cells = {
        "sub/a.jpg": str(media / "sub/a.jpg"),
        "./sub/../sub/a.jpg": str(media / "sub/a.jpg"),
        str(media / "sub/a.jpg"): str(media / "sub/a.jpg"),
        f"file://{media}/sub/a.jpg": str(media / "sub/a.jpg"),
        "in/a.jpg": str(media / "in/a.jpg"),
        "../secret/x.jpg": None,
        str(tmp_path / "secret/x.jpg"): None,
        "out/x.jpg": None,
        "https://example.com/a.jpg": None,
    }
    rows = path_rows(tmp_path, list(cells), str(media))
    for row, (cell, uri) in zip(rows, cells.items()):
        assert row.uri == uri, cell
        if uri is None:
            assert row.error.startswith("path_escape: ") and repr(cell) in row.error, cell
        else:
            assert row.error is None, cell


def test_null_and_empty_paths_are_empty_error_rows(tmp_path, media_tree):
    rows = path_rows(tmp_path, [None, "", "ok.jpg"], str(media_tree))
    assert [r.error for r in rows[:2]] == ["empty: column 'p' holds no path"] * 2
    assert rows[2].uri == str(media_tree / "ok.jpg")


def test_without_media_root_paths_resolve_next_to_the_parquet_file(tmp_path):
    rows = path_rows(tmp_path, ["a.jpg", "../images/b.jpg", "https://example.com/x/../c.jpg", "/abs/d.jpg"], None)
    assert [r.uri for r in rows] == [
        str(tmp_path / "list" / "a.jpg"),
        str(tmp_path / "images" / "b.jpg"),
        "https://example.com/x/../c.jpg",
        "/abs/d.jpg",
    ]
    assert all(r.error is None for r in rows)


def test_remote_media_root_checks_normalised_uris(tmp_path):
    cells = [
        "s3://bucket/media/a/../b.jpg",
        "x.jpg",
        "s3://bucket/media/../other.jpg",
        "s3://bucket/mediaX/y.jpg",
        "/abs/local.jpg",
    ]
    rows = path_rows(tmp_path, cells, "s3://bucket/media/")
    assert [r.uri for r in rows[:2]] == ["s3://bucket/media/b.jpg", "s3://bucket/media/x.jpg"]
    assert all(r.error.startswith("path_escape: ") for r in rows[2:])


# ---------------------------------------------------------------- resume slicing


@pytest.mark.parametrize("start, stop", [(5, 13), (0, 1), (15, None), (None, 7), (3, 3), (16, None)])
def test_start_stop_slice_the_global_rows(dataset, start, stop):
    config = cfg(dataset, batch_rows=2)
    rows = list(read_rows(config, list_fragments(config), start_row=start, stop_row=stop))
    want = list(range(16))[start:stop]
    assert [r.row for r in rows] == want
    assert [r.id for r in rows] == [expected_ids()[i] for i in want]


def test_fragments_before_the_resume_point_are_not_opened(dataset):
    config = cfg(dataset)
    fragments = list_fragments(config)
    (dataset / "a.parquet").write_bytes(b"overwritten after the first rows were committed")
    rows = list(read_rows(config, fragments, start_row=7))
    assert [r.row for r in rows] == list(range(7, 16))
    with pytest.raises(JobError, match="a.parquet"):
        next(read_rows(config, fragments, start_row=6))


def test_file_rewritten_since_listing_is_a_job_error(dataset):
    config = cfg(dataset)
    fragments = list_fragments(config)
    write(dataset / "b.parquet", {"id": ["b-0"], "image": [b"x"]})
    with pytest.raises(JobError, match="changed since it was listed"):
        list(read_rows(config, fragments))


def test_shards_read_in_order_give_the_whole_input(dataset):
    config = cfg(dataset)
    fragments = list_fragments(config)
    whole = list(read_rows(config, fragments))
    pieces = [row for shard in assign_shards(fragments, 3) for row in read_rows(config, shard)]
    assert pieces == whole


# ---------------------------------------------------------------- corrupt data


def corrupt_row_group(path: Path, row_group: int, column: int) -> None:
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(column)
    offset = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 32] = b"\xff" * 32
    path.write_bytes(bytes(data))


def test_undecodable_row_group_becomes_read_error_rows_and_the_rest_is_read(tmp_path, caplog):
    write(tmp_path / "a.parquet", {"id": [f"a-{i}" for i in range(6)], "image": [bytes([i]) * 50 for i in range(6)]}, 3)
    write(tmp_path / "b.parquet", {"id": ["b-0"], "image": [b"fine"]})
    corrupt_row_group(tmp_path / "a.parquet", row_group=1, column=1)
    rows = read_all(cfg(tmp_path))
    assert [r.row for r in rows] == list(range(7))
    assert [r.id for r in rows] == ["a-0", "a-1", "a-2", None, None, None, "b-0"]
    assert all(r.error is None for r in rows[:3] + rows[6:])
    assert all(r.error.startswith("read_error: row group 1 of ") and "a.parquet" in r.error for r in rows[3:6])
    assert "failed to decode" in caplog.text


def test_transient_read_failure_is_retried_on_a_fresh_handle_without_losing_rows(dataset, monkeypatch, caplog):
    """The first handle breaks after one batch (a dropped connection): every later read
    on it fails too, so only reopening the file recovers the rest of the row group."""
    real_iter = pq.ParquetFile.iter_batches
    broken: list[pq.ParquetFile] = []

    def flaky(self, *args, **kwargs):
        if any(self is b for b in broken):
            raise OSError("connection reset")
        for index, batch in enumerate(real_iter(self, *args, **kwargs)):
            if index == 1 and not broken:
                broken.append(self)
                raise OSError("connection reset")
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", flaky)
    rows = read_all(cfg(dataset, batch_rows=1))
    assert broken
    assert [r.row for r in rows] == list(range(16))
    assert [r.id for r in rows] == expected_ids()
    assert all(r.error is None for r in rows)
    assert "attempt 1" in caplog.text


# ---------------------------------------------------------------- costs and shards


def test_cost_follows_media_bytes_so_a_heavy_row_group_gets_its_own_shard(tmp_path):
    rng = random.Random(0)
    heavy = [rng.randbytes(4000) for _ in range(10)]
    light = [b"x" * 10 for _ in range(40)]
    # Big captions in the light row groups: balancing on total bytes would be fooled.
    captions = ["" for _ in range(10)] + [rng.randbytes(3000).hex() for _ in range(40)]
    write(tmp_path / "t.parquet", {"id": list(range(50)), "image": heavy + light, "caption": captions}, 10)
    fragments = list_fragments(cfg(tmp_path))
    assert fragments[0].cost > 40_000 > sum(f.cost for f in fragments[1:])
    assert assign_shards(fragments, 2) == [fragments[:1], fragments[1:]]


def frags(costs: list[int]) -> list[Fragment]:
    return [Fragment("f.parquet", i, i, 1, c) for i, c in enumerate(costs)]


def test_shards_minimise_the_largest_cost_not_the_count():
    fragments = frags([10, 1, 1, 1, 1, 10])
    assert assign_shards(fragments, 3) == [fragments[:1], fragments[1:5], fragments[5:]]


def test_more_shards_than_fragments_leaves_trailing_shards_empty():
    fragments = frags([3, 4])
    assert assign_shards(fragments, 4) == [[fragments[0]], [fragments[1]], [], []]
    assert assign_shards([], 2) == [[], []]


def test_zero_shards_is_a_value_error():
    with pytest.raises(ValueError, match="num_shards"):
        assign_shards(frags([1]), 0)


def best_max_cost(costs: tuple[int, ...], parts: int) -> int:
    """Brute force: the smallest largest-run cost over all splits into <= parts runs."""

    @functools.lru_cache(maxsize=None)
    def best(start: int, left: int) -> float:
        if start == len(costs):
            return 0
        if left == 0:
            return float("inf")
        return min(max(sum(costs[start:end]), best(end, left - 1)) for end in range(start + 1, len(costs) + 1))

    return best(0, parts)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=60), max_size=9), st.integers(min_value=1, max_value=6))
def test_shards_are_contiguous_complete_and_optimally_balanced(costs, num_shards):
    fragments = frags(costs)
    shards = assign_shards(fragments, num_shards)
    assert len(shards) == num_shards
    assert [f for shard in shards for f in shard] == fragments
    assert max(sum(f.cost for f in s) for s in shards) == best_max_cost(tuple(costs), num_shards)
    empty = [i for i, s in enumerate(shards) if not s]
    assert empty == list(range(min(len(costs), num_shards), num_shards))
    assert assign_shards(fragments, num_shards) == shards


# ---------------------------------------------------------------- job errors


def test_missing_path_and_empty_glob_name_the_path(tmp_path):
    with pytest.raises(JobError, match="does not exist") as err:
        list_fragments(cfg(tmp_path / "nope.parquet"))
    assert "nope.parquet" in str(err.value)
    with pytest.raises(JobError, match=r"no file matches input.path .*\*\.parquet"):
        list_fragments(cfg(tmp_path / "*.parquet"))


def test_unknown_filesystem_protocol_is_a_job_error():
    with pytest.raises(JobError, match=r"cannot access input.path 'nosuch://bucket/data.parquet': .*nosuch"):
        list_fragments(cfg("nosuch://bucket/data.parquet"))


def test_invalid_glob_is_a_job_error(tmp_path):
    with pytest.raises(JobError, match=r"is not a valid glob"):
        list_fragments(cfg(f"{tmp_path}/data**/*.parquet"))


def test_directory_without_parquet_files(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(JobError, match=r"no \*\.parquet file under input.path"):
        list_fragments(cfg(tmp_path))


def test_a_file_that_is_not_parquet_is_named(dataset):
    (dataset / "z.parquet").write_text("id,image\n1,abc\n")
    with pytest.raises(JobError, match=r"z\.parquet is not a Parquet file"):
        list_fragments(cfg(dataset))


def test_missing_columns_are_named_with_the_available_ones(dataset):
    with pytest.raises(JobError, match=r"input.media_column 'jpg' is not a column of .*available columns: id, image"):
        list_fragments(cfg(dataset, media="jpg"))
    with pytest.raises(JobError, match=r"input.id_column 'key' is not a column of .*available columns: id, image"):
        id_type(cfg(dataset, ident="key"))


def test_unsupported_media_type_names_the_type_and_supported_ones(tmp_path):
    numbered = pa.array([{"bytes": b"x", "path": 3}], pa.struct([("bytes", pa.binary()), ("path", pa.int64())]))
    write(tmp_path / "t.parquet", {"image": [1], "other": pa.array([{"b": b"x"}]), "numbered": numbered})
    with pytest.raises(JobError, match=r"unsupported Arrow type int64; supported: binary.*string.*struct<bytes"):
        list_fragments(cfg(tmp_path, ident=None))
    with pytest.raises(JobError, match=r"unsupported Arrow type struct<b: binary>"):
        list_fragments(cfg(tmp_path, media="other", ident=None))
    with pytest.raises(JobError, match=r"unsupported Arrow type struct<bytes: binary, path: int64>"):
        list_fragments(cfg(tmp_path, media="numbered", ident=None))


def test_files_that_disagree_on_the_columns(tmp_path):
    write(tmp_path / "a.parquet", {"id": [1], "image": [b"x"]})
    write(tmp_path / "b.parquet", {"id": [2], "image": ["x.jpg"]})
    with pytest.raises(JobError, match=r"disagree on input.media_column 'image': .*a\.parquet has binary, .*b\.parquet has string"):
        list_fragments(cfg(tmp_path))
    write(tmp_path / "b.parquet", {"id": ["2"], "image": [b"y"]})
    with pytest.raises(JobError, match=r"disagree on input.id_column 'id': .*int64.*string"):
        id_type(cfg(tmp_path))


def test_missing_local_media_root(dataset, tmp_path):
    with pytest.raises(JobError, match="input.media_root .* is not a directory"):
        list_fragments(cfg(dataset, media_root=str(tmp_path / "absent")))


def test_leading_rows_are_the_inputs_first_rows_and_read_only_the_footers_they_reach(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What model.fp8_calibrate reads: the input's rows from its first, across files in
    order with global row numbers, as `read_rows` gives them; taking the first 9 opens
    a.parquet and b.parquet only, never the last file's footer."""
    import itertools

    from embedjob.io import reader

    opened: list[str] = []
    original = reader._open

    def counting(location: str, *args, **kwargs):
        opened.append(Path(location).name)
        return original(location, *args, **kwargs)

    monkeypatch.setattr(reader, "_open", counting)
    config = cfg(dataset)
    first = list(itertools.islice(reader.leading_rows(config), 9))
    assert "c.parquet" not in opened
    assert [(r.row, r.id) for r in first] == list(enumerate(expected_ids()[:9]))
    assert [(r.row, r.id, r.data) for r in first] == [(r.row, r.id, r.data) for r in read_all(config)[:9]]
    assert [r.id for r in reader.leading_rows(config)] == expected_ids()
