"""Parquet input: find the files, map the media and id columns, cut the input into
fragments, assign fragments to shards and stream rows.

Invariants the rest of the job relies on:

- The global row index is deterministic: files sorted by their path string, row groups
  in file order, rows in order. `list_fragments` numbers fragments on that order, so a
  fragment's `first_row` is the index of its first row and fragments tile 0..N-1.
- Every row of a fragment comes out of `read_rows` exactly once, either with media
  (`data` or `uri`) or with a typed `error` ("code: message"); a bad cell or a row group
  that cannot be decoded never stops the job and never drops a row.
- Job-level problems (no input, a file that is not Parquet, a missing column, a media
  column of an unsupported type, files that disagree) raise `JobError` before any row
  is yielded.
- Nothing reads a whole file: rows are streamed per row group in batches of
  `input.batch_rows`, and only the media and id columns are read, plus the columns the
  job copies into its output (`output.columns`, each row's values in `InputRow.extra`).

Input forms (`input.path`): a file; a directory (every *.parquet file below it,
skipping names that start with '.' or '_', as pyarrow.dataset and Spark do for temp and
metadata files); a glob (`*`, `?`, `[...]`, `**` for any depth, taken as written, so
matched files are read whatever their name); or any of these as an fsspec URI
(`file://`, `s3://`, `gs://`, `memory://`; the protocol's package must be installed);
or a list of these in braces, as webdataset writes shard lists
(`shards/{00000..00099}.tar`, `{a,b}/*.parquet`: `expand_braces`).
Local paths are relative to the working directory; a message about a relative path
that does not exist names that directory.

Memory: per open file, the footer, plus one row group's media and id column chunks
(pyarrow pre-buffers them) and one decoded batch of `input.batch_rows` rows. A row group
whose media column holds more than `input.max_item_bytes` bytes uncompressed (its footer
says so; a cell cannot be longer than the column chunk holding it) may hold a cell over
the limit, so it is streamed instead: a page at a time, one row per batch, so the reader
holds the page being read (compressed and decompressed) and one row's Arrow values on
top of the footer: 3.4 x a cell over the limit alone in its page (measured), where the
pre-buffered path held 6.5 x, more when its page holds other large cells too.

Paths in string media cells (and in the `path` field of Hugging Face image structs):

- A path reads whatever file it names, so a string media column needs
  `input.media_root` (the directory every path must stay in) unless the job sets
  `input.allow_any_path: true`; without either it is a JobError, and a struct row that
  falls back to its path is an error row `no_media_root: ...`.
- `scheme://...` URIs are kept as they are; with `input.media_root` set they must lie
  under it (after removing `.`/`..` segments, and the normalised URI is what is returned,
  so the location checked is the location read).
- `file://` URIs are treated as local paths.
- Relative paths resolve against `input.media_root`, or, when it is null, against the
  directory of the Parquet file that holds them (the layout of datasets that keep a
  Parquet index next to their media). Without a media_root there is no root to escape.
- With a media_root, a path that leaves it after normalisation (`..`, an absolute path
  elsewhere, a symlink pointing out, a URI under another prefix) becomes an error row
  `path_escape: ...`. A symlink swapped in after this check is caught where the file is
  opened (`embedjob.decode.read_source` checks the opened file against `local_media_root`).

A media cell of more than `input.max_item_bytes` bytes becomes an error row
`too_large: ...` here, known from its Arrow length before it is turned into Python bytes,
so it is never copied out of Arrow and never reaches a decode worker.

Ids: `check_ids` reads a shard's id column (and nothing else) before the shard starts;
a null id, or a string id that is not valid UTF-8, is a JobError naming the file and
row, and repeated ids are one warning with their count (some datasets have them).

WebDataset input (`input.format: webdataset`): `.tar` shards instead of Parquet files,
found the same way (*.tar below a directory), indexed by `io/webdataset.py`; a tar's
samples (one row each, id the key) are cut into fragments of `TAR_GROUP_SAMPLES` that
carry their members' offsets, so a rank reads its rows by offset without indexing
again. Media come from the member `input.media_column` names (else the sample's first
image or video member); `output.columns` name members too (`txt`, `json`), carried as
their text, null where a sample lacks one. A sample without media is a `no_media` row.

Input identity: `scan_input` also records each file's size and a hash of its Parquet
footer (and the store's ETag where fsspec reports one). The footer holds every row
group's byte ranges and sizes, so a file rewritten with other content almost always
changes it; the job fingerprint carries these, so a resume over changed input is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from pyarrow.fs import FSSpecHandler, PyFileSystem

from embedjob.config import InputConfig, JobError, relative_note
from embedjob.io import webdataset
from embedjob.io.index_cache import IndexCache
from embedjob.io.object_store import SCHEME, etag_of
from embedjob.io.webdataset import Sample
from embedjob.report.counts import plural

logger = logging.getLogger(__name__)

SUPPORTED_MEDIA_TYPES = (
    "binary, large_binary or binary_view (media bytes); "
    "string, large_string or string_view (a path or URI); "
    "struct<bytes: binary, path: string> (Hugging Face Image/Video)"
)

# Errors pyarrow raises while decoding pages: corrupt data (ArrowInvalid, OSError for
# undecodable page headers) or a failed read of a remote file (OSError).
_DECODE_ERRORS = (pa.ArrowException, OSError)

_STREAM_BUFFER = 1 << 20
"""Bytes read at a time from a streamed row group (`_Source.streaming`): pyarrow grows
it to the page being read, so a huge cell's page is read whole, but never more."""

_GLOB_CHARS = ("*", "?", "[")

TAR_GROUP_SAMPLES = 128
"""Samples of a tar per fragment (the unit of sharding, like a row group): small enough
to balance shards over few tars, large enough that a chunk's rows need few fragments."""


@dataclass(frozen=True)
class Fragment:
    """One row group of one file: the unit of sharding and resume.

    `path` is a plain absolute path for local files and a full URI otherwise, so it can
    be opened again in another process without the job spec's filesystem. A tar's
    fragment (webdataset input) is its `row_group`-th run of samples, which `samples`
    holds (one per row, with their members' offsets); a Parquet one holds none.
    """

    path: str
    row_group: int
    first_row: int
    num_rows: int
    cost: int
    samples: tuple[Sample, ...] = ()


@dataclass
class InputRow:
    """One input row: either media (`data` or `uri`) or an `error`, never neither, and
    the values of the columns copied into the output (`extra`, in `output.columns`
    order; None where the row could not be read)."""

    row: int
    id: object
    data: bytes | None
    uri: str | None
    error: str | None
    extra: tuple[Any, ...] = ()


@dataclass(frozen=True)
class InputFile:
    """What identifies one input file's content, cheaply: its size, a hash of its Parquet
    footer and, where the store reports one, its ETag."""

    path: str
    size: int
    footer_sha256: str
    etag: str | None = None


@dataclass(frozen=True)
class _FileInfo:
    """What a file's footer says about the configured columns."""

    path: str
    metadata: pq.FileMetaData
    media_type: pa.DataType
    media_kind: str
    id_type: pa.DataType
    identity: InputFile | None = None
    column_types: dict[str, pa.DataType] = field(default_factory=dict)


@dataclass(frozen=True)
class _Root:
    """A normalised media_root: an absolute local path (with its realpath) or a URI."""

    location: str
    real: str | None


# ---------------------------------------------------------------- public API


@dataclass(frozen=True)
class InputListing:
    """What the file listing and footers say: the fragments, the output id type, each
    file's identity (in path order) and the types of the columns copied to the output."""

    fragments: list[Fragment]
    id_type: pa.DataType
    files: list[InputFile] = field(default_factory=list)
    column_types: dict[str, pa.DataType] = field(default_factory=dict)


def scan_input(cfg: InputConfig, columns: Sequence[str] = (), cache_root: Path | None = None) -> InputListing:
    """Read every footer once and describe the input (see `list_fragments`, `id_type`).

    Footers of thousands of remote files are the expensive part of starting a shard,
    so the pipeline asks for both answers from one scan. `columns` are the input columns
    the job copies into its output: each must exist in every file (JobError listing
    the available ones) with one type across files (webdataset input: in some sample).
    `cache_root` (`config.cache_root`) is where webdataset input's tar indexes are kept
    between scans; None: none kept.
    """
    if cfg.format == "webdataset":
        return _scan_tars(cfg, columns, cache_root)
    _media_root(cfg.media_root)  # a missing media_root is a job error, found before any row is read
    infos = _scan(cfg, columns)
    _check_paths_allowed(infos[0], cfg)
    fragments = []
    first_row = 0
    for info in infos:
        fragments += _fragments_of(info, cfg, first_row)
        first_row += info.metadata.num_rows
    logger.info(
        "input %s: %s, %s, %s", cfg.path, plural(len(infos), "file"), plural(len(fragments), "row group"), plural(first_row, "row")
    )
    typed = [info.id_type for info in infos if not pa.types.is_null(info.id_type)]
    files = [info.identity for info in infos if info.identity is not None]
    return InputListing(fragments, typed[0] if typed else infos[0].id_type, files, _column_types(infos, columns))


def _fragments_of(info: _FileInfo, cfg: InputConfig, first_row: int) -> list[Fragment]:
    """The non-empty row groups of one file whose first row is global row `first_row`."""
    fragments = []
    for index in range(info.metadata.num_row_groups):
        group = info.metadata.row_group(index)
        if group.num_rows == 0:
            continue
        cost = _media_bytes(group, cfg.media_column) or group.total_byte_size
        fragments.append(Fragment(info.path, index, first_row, group.num_rows, cost))
        first_row += group.num_rows
    return fragments


def leading_rows(cfg: InputConfig, cache_root: Path | None = None) -> Iterator[InputRow]:
    """The input's rows from its first in row order (every shard's, not one shard's),
    reading the footers of only the Parquet files it gets to, one at a time, so a caller
    that wants a few rows of an input of thousands of remote files reads one or two
    footers; webdataset input is scanned whole (its tar indexes are kept, `scan_input`)."""
    if cfg.format == "webdataset":
        yield from read_rows(cfg, scan_input(cfg, (), cache_root).fragments)
        return
    first_row = 0
    for location in _find_files(cfg.path, cfg.storage_options):
        with _open(location, cfg.storage_options) as pf:
            info = _file_info(location, pf, cfg)
        yield from read_rows(cfg, _fragments_of(info, cfg, first_row))
        first_row += info.metadata.num_rows


def list_fragments(cfg: InputConfig) -> list[Fragment]:
    """All non-empty row groups of the input, in global row order.

    Reads only file listings and Parquet footers. Raises JobError for any job-level
    problem of the input (see the module docstring).
    """
    return scan_input(cfg).fragments


def id_type(cfg: InputConfig) -> pa.DataType:
    """Arrow type of the output `id` column: the id column's type, or int64 (row index).

    A file whose id column holds only nulls may store it with Arrow type `null`; the
    type of the other files wins then.
    """
    return scan_input(cfg).id_type


def assign_shards(fragments: list[Fragment], num_shards: int) -> list[list[Fragment]]:
    """Cut `fragments` into `num_shards` contiguous runs with the smallest possible
    largest total `cost` (linear partition by binary search over that maximum).

    Contiguity keeps the output contract simple: concatenating the shards in shard
    order gives back `fragments` in order. The result is deterministic. When there are
    more shards than fragments each fragment gets its own shard and the trailing
    shards are empty; otherwise no shard is empty.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    cap = _smallest_cap([f.cost for f in fragments], num_shards)
    shards: list[list[Fragment]] = [[]]
    load = 0
    for index, fragment in enumerate(fragments):
        left_including_this = len(fragments) - index
        unstarted = num_shards - len(shards)
        # Close early when the remaining fragments are just enough to give every
        # unstarted shard one, so no shard stays empty while another holds several.
        if shards[-1] and (load + fragment.cost > cap or left_including_this <= unstarted):
            shards.append([])
            load = 0
        shards[-1].append(fragment)
        load += fragment.cost
    shards.extend([] for _ in range(num_shards - len(shards)))
    return shards


@dataclass(frozen=True)
class Chunk:
    """Rows [first_row, end_row) of a shard: what one rank takes and hands back at once.

    `index` is the chunk's place in the shard (chunks are numbered in row order) and
    `fragments` the row groups its rows lie in, so a rank can read it without the
    listing.
    """

    index: int
    first_row: int
    end_row: int
    fragments: tuple[Fragment, ...]

    @property
    def rows(self) -> int:
        return self.end_row - self.first_row


def plan_chunks(fragments: list[Fragment], start_row: int, end_row: int, rows: int) -> list[Chunk]:
    """[start_row, end_row) of `fragments` cut into chunks of at most `rows` rows.

    Invariants: the chunks cover the range exactly, in order, with no gap or overlap;
    none is empty; row groups are kept whole where they fit (consecutive small row
    groups share a chunk, so a chunk needs few reads), and a row group larger than
    `rows` is cut into near-equal pieces that hold no other row group's rows.
    """
    if rows < 1:
        raise ValueError(f"rows per chunk must be >= 1, got {rows}")
    pieces: list[tuple[int, int, bool]] = []
    for fragment in fragments:
        first = max(start_row, fragment.first_row)
        end = min(end_row, fragment.first_row + fragment.num_rows)
        if end - first > rows:
            pieces.extend((a, b, False) for a, b in _even_pieces(first, end, rows))
        elif first < end:
            pieces.append((first, end, True))
    spans: list[tuple[int, int, bool]] = []
    for first, end, whole in pieces:
        if spans and whole and spans[-1][2] and end - spans[-1][0] <= rows:
            spans[-1] = (spans[-1][0], end, True)
        else:
            spans.append((first, end, whole))
    return [
        Chunk(index, first, end, tuple(f for f in fragments if f.first_row < end and f.first_row + f.num_rows > first))
        for index, (first, end, _) in enumerate(spans)
    ]


def _even_pieces(first: int, end: int, rows: int) -> list[tuple[int, int]]:
    """[first, end) in ceil(n / rows) pieces whose sizes differ by at most one."""
    count = -(-(end - first) // rows)
    bounds = [first + (end - first) * k // count for k in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def read_rows(
    cfg: InputConfig,
    fragments: Iterable[Fragment],
    start_row: int | None = None,
    stop_row: int | None = None,
    columns: Sequence[str] = (),
) -> Iterator[InputRow]:
    """Stream the rows of `fragments` (as made by `list_fragments`) in the given order,
    limited to the global row range [start_row, stop_row) (None: unbounded), with the
    values of `columns` in each row's `extra`.

    Fragments entirely outside the range are not opened; fragments cut by it are
    sliced. Consecutive fragments of one file share one open handle. A row group that
    fails to decode is retried once with a fresh handle (remote reads can fail
    transiently); if it fails again its remaining rows become `read_error` rows.
    """
    lo = 0 if start_row is None else start_row
    hi = stop_row
    root = _media_root(cfg.media_root) if cfg.format != "webdataset" else None
    for path, group in itertools.groupby(fragments, key=lambda f: f.path):
        wanted = [f for f in group if f.first_row + f.num_rows > lo and (hi is None or f.first_row < hi)]
        if not wanted:
            continue
        if cfg.format == "webdataset":
            yield from _read_tar(cfg, path, wanted, lo, hi, tuple(columns))
        else:
            yield from _read_file(cfg, path, wanted, lo, hi, root, tuple(columns))


def check_ids(cfg: InputConfig, fragments: Sequence[Fragment]) -> None:
    """Refuse a shard whose ids cannot identify its rows, before it starts: JobError for
    a null id or a string id that is not valid UTF-8 (naming the first such row, which
    no output row could carry); one warning with the count of rows whose id an earlier
    row of the shard has (some datasets have them; every row is still written).

    Reads only the id column of `fragments` (contiguous, as `assign_shards` makes
    them), a row group at a time, and keeps 8 bytes a row (each id's hash) to count
    repeats: holding the ids themselves took 1.7 GB for 10 M ids of 30 bytes. Binary
    ids are bytes by type: any bytes do.
    """
    if cfg.format == "webdataset":
        _check_keys(fragments)
        return
    if cfg.id_column is None:
        return
    hashes: list[np.ndarray] = []
    for path, group in itertools.groupby(fragments, key=lambda f: f.path):
        with _open(path, cfg.storage_options) as pf:
            for fragment in group:
                ids = _ids(pf, fragment, cfg.id_column)
                _check_id_values(ids, fragment, cfg.id_column)
                hashes.append(_hashes(ids))
    if hashes:
        _warn_repeats(cfg, list(fragments), np.concatenate(hashes))


def _ids(pf: pq.ParquetFile, fragment: Fragment, column: str) -> pa.Array:
    return pf.read_row_group(fragment.row_group, columns=[column]).column(0).combine_chunks()


def _hashes(ids: pa.Array) -> np.ndarray:
    """One int64 a row that equal ids share: integers themselves (an unchecked cast maps
    distinct ones to distinct int64s), anything else its Python hash (salted per process,
    which is all a count within one needs)."""
    if pa.types.is_integer(ids.type):
        return ids.cast(pa.int64(), safe=False).to_numpy()
    return np.fromiter(map(hash, ids.to_pylist()), np.int64, len(ids))


def _check_id_values(ids: pa.Array, fragment: Fragment, column: str) -> None:
    where = f"input.id_column '{column}' of {fragment.path}"
    if ids.null_count:
        row = fragment.first_row + int(np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))[0])
        raise JobError(
            f"{where} is null at row {row} ({plural(ids.null_count, 'null id')} in row group {fragment.row_group}); "
            "every row needs an id: fill them in, or set input.id_column: null to use the row index"
        )
    if _is_string(ids.type):
        try:
            ids.validate(full=True)
        except pa.ArrowInvalid:
            row = fragment.first_row + _first_invalid_utf8(ids)
            raise JobError(f"{where} holds invalid UTF-8 at row {row}; rewrite the column as valid UTF-8 or as binary") from None


def _first_invalid_utf8(ids: pa.Array) -> int:
    """The offset of the first string of `ids` that is not valid UTF-8, given that one
    is: a bisection over slices, so the strings are checked by Arrow, not one by one."""
    lo, hi = 0, len(ids)  # the first invalid string lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            ids.slice(lo, mid - lo).validate(full=True)
            lo = mid
        except pa.ArrowInvalid:
            hi = mid
    return lo


def _warn_repeats(cfg: InputConfig, fragments: list[Fragment], hashes: np.ndarray) -> None:
    """One warning for the rows of `fragments` whose id's hash (`hashes`, one a row in
    order) an earlier row has, naming the first such row and its id (read back). A
    64-bit hash makes a false repeat among 10 M distinct ids about a one-in-400,000 event."""
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    repeats = order[1:][ordered[1:] == ordered[:-1]]  # stable: a hash's first row is never among them
    if not len(repeats):
        return
    offset = int(repeats.min())
    for fragment in fragments:
        if offset < fragment.num_rows:
            break
        offset -= fragment.num_rows
    with _open(fragment.path, cfg.storage_options) as pf:
        example = _ids(pf, fragment, str(cfg.id_column))[offset].as_py()
    logger.warning(
        "input.id_column '%s' repeats ids in %s of this shard's %d (the first is row %d, id %r), each the id of an earlier row; "
        "every row is still written, with its id",
        cfg.id_column, plural(len(repeats), "row"), len(hashes), fragment.first_row + offset, example,
    )


# ---------------------------------------------------------------- finding files


def _scan(cfg: InputConfig, columns: Sequence[str]) -> list[_FileInfo]:
    """Footers of all input files, checked for the configured columns and agreement."""
    infos = [_describe(path, cfg, columns) for path in _find_files(cfg.path, cfg.storage_options)]
    _check_agreement(infos, cfg)
    return infos


def _column_types(infos: list[_FileInfo], columns: Sequence[str]) -> dict[str, pa.DataType]:
    """Each copied column's type; a column that is null-typed in some files (all its
    values null) takes the type the other files give it. Files must agree otherwise."""
    types: dict[str, pa.DataType] = {}
    for name in columns:
        typed = [info for info in infos if not pa.types.is_null(info.column_types[name])]
        for info in typed[1:]:
            if info.column_types[name] != typed[0].column_types[name]:
                raise JobError(
                    f"input files disagree on output.columns '{name}': {typed[0].path} has "
                    f"{typed[0].column_types[name]}, {info.path} has {info.column_types[name]}"
                )
        types[name] = (typed[0] if typed else infos[0]).column_types[name]
    return types


def _find_files(spec: str, options: dict[str, Any], suffix: str = ".parquet") -> list[str]:
    """Input files (Parquet, or `suffix`) named by a file, directory, glob or fsspec
    URI (with fsspec's storage `options`), or by a list of these written with braces
    (`expand_braces`), sorted by path; a file named twice is read once."""
    files: set[str] = set()
    for one in expand_braces(spec):
        files.update(_files_of(one, options, suffix))
    return sorted(files)


def _files_of(spec: str, options: dict[str, Any], suffix: str) -> list[str]:
    """The files one file, directory, glob or URI names; a JobError where none."""
    try:
        fs, target = fsspec.core.url_to_fs(os.path.expanduser(spec), **(options if SCHEME.match(spec) else {}))
    except (ImportError, ValueError) as exc:
        # ImportError: the protocol's package (s3fs, gcsfs, ...) is not installed.
        raise JobError(f"cannot access input.path {spec!r}: {exc}") from None
    try:
        files = _list_files(fs, target, spec, suffix)
    except OSError as exc:
        raise JobError(f"cannot list input.path {spec!r}: {exc}") from None
    if not files:
        raise JobError(f"no *{suffix} file under input.path {spec!r}")
    return [_location(fs, p) for p in files]


_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
MAX_EXPANDED = 1_000_000
"""The most paths one input.path may expand to (a typo such as {0..99999999} stops at once)."""


def expand_braces(spec: str) -> list[str]:
    """The paths a brace pattern lists, in order, as webdataset and the shell write them:
    `{a,b}` alternatives and `{000..099}` numeric ranges (zero-padded to the first
    bound's width), any number of groups, each group expanded in turn (no nesting). A
    path without such a group is itself; a group without `,` or `..` is kept as written
    (a glob's `[...]` and `*` pass through to the glob)."""
    match = next((m for m in _BRACES.finditer(spec) if "," in m.group(1) or _RANGE.fullmatch(m.group(1))), None)
    if match is None:
        return [spec]
    head, tail = spec[: match.start()], spec[match.end() :]
    body = match.group(1)
    bounds = _RANGE.fullmatch(body)
    if bounds is not None:
        first, last = bounds.groups()
        low, high = int(first), int(last)
        if high < low or high - low >= MAX_EXPANDED:
            raise JobError(f"input.path {spec!r}: the range {{{body}}} must go up and name at most {MAX_EXPANDED:,} paths")
        choices = [str(n).zfill(len(first)) for n in range(low, high + 1)]
    else:
        choices = body.split(",")
    rests = expand_braces(tail)
    if len(choices) * len(rests) > MAX_EXPANDED:
        raise JobError(f"input.path {spec!r} names more than {MAX_EXPANDED:,} paths")
    return [head + choice + rest for choice in choices for rest in rests]


def _list_files(fs: fsspec.AbstractFileSystem, target: str, spec: str, suffix: str) -> list[str]:
    """Matched files, plus the *`suffix` files below matched directories."""
    if any(c in target for c in _GLOB_CHARS):
        try:
            matches = fs.glob(target, detail=True)
        except ValueError as exc:
            raise JobError(f"input.path {spec!r} is not a valid glob: {exc}") from None
        if not matches:
            raise JobError(f"no file matches input.path {spec!r}{relative_note(spec)}")
    else:
        try:
            matches = {target: fs.info(target)}
        except FileNotFoundError:
            raise JobError(f"input.path {spec!r} does not exist{relative_note(spec)}") from None
    files = []
    for name, info in matches.items():
        if info["type"] == "directory":
            files.extend(p for p in fs.find(name) if _is_data_file(p, name, suffix))
        else:
            files.append(name)
    return files


def _is_data_file(path: str, directory: str, suffix: str) -> bool:
    """A *`suffix` file below `directory`, skipping names starting with '.' or '_'
    (the convention of pyarrow.dataset and Spark for temp files and metadata)."""
    parts = path[len(directory) :].strip("/").split("/")
    return parts[-1].endswith(suffix) and not any(p.startswith((".", "_")) for p in parts)


def _location(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _open(location: str, options: dict[str, Any], streaming: bool = False) -> pq.ParquetFile:
    """Open a Parquet file by local path or URI (with fsspec's storage `options`); a bad
    footer is a JobError naming it.

    `streaming` reads column chunks a page at a time instead of pre-buffering each row
    group's chunks whole (what `_decode` needs for a row group that may hold a huge cell)."""
    reading: dict[str, Any] = {"pre_buffer": False, "buffer_size": _STREAM_BUFFER} if streaming else {}
    try:
        if SCHEME.match(location):
            fs, path = fsspec.core.url_to_fs(location, **options)
            return pq.ParquetFile(path, filesystem=PyFileSystem(FSSpecHandler(fs)), **reading)
        return pq.ParquetFile(location, **reading)
    except pa.ArrowInvalid as exc:
        raise JobError(f"{location} is not a Parquet file: {exc}") from None
    except OSError as exc:
        raise JobError(f"cannot open input file {location}: {exc}") from None


def _describe(location: str, cfg: InputConfig, columns: Sequence[str]) -> _FileInfo:
    with _open(location, cfg.storage_options) as pf:
        info = _file_info(location, pf, cfg, columns)
    return replace(info, identity=_identity(location, info.metadata, cfg.storage_options))


def _identity(location: str, metadata: pq.FileMetaData, options: dict[str, Any]) -> InputFile:
    """Size, footer hash and ETag of one input file: one metadata call and one read of
    the footer (its length is known from the footer pyarrow already parsed)."""
    try:
        fs, path = fsspec.core.url_to_fs(location, **(options if SCHEME.match(location) else {}))
        info = fs.info(path)
        size = int(info["size"])
        footer = fs.cat_file(path, start=max(0, size - metadata.serialized_size - 8), end=size)
    except OSError as exc:
        raise JobError(f"cannot read input file {location}: {exc}") from None
    return InputFile(location, size, hashlib.sha256(footer).hexdigest(), etag_of(info))


def _file_info(location: str, pf: pq.ParquetFile, cfg: InputConfig, columns: Sequence[str] = ()) -> _FileInfo:
    schema = pf.schema_arrow
    named = [("input.media_column", cfg.media_column), ("input.id_column", cfg.id_column), ("input.text_column", cfg.text_column)]
    for key, column in [*named, *(("output.columns", c) for c in columns)]:
        if column is not None and column not in schema.names:
            raise JobError(
                f"{key} '{column}' is not a column of {location}; available columns: {', '.join(schema.names)}"
            )
    media_type = schema.field(cfg.media_column).type
    kind = _media_kind(media_type)
    if kind is None:
        raise JobError(
            f"input.media_column '{cfg.media_column}' of {location} has unsupported Arrow type {media_type}; "
            f"supported: {SUPPORTED_MEDIA_TYPES}"
        )
    ids = schema.field(cfg.id_column).type if cfg.id_column is not None else pa.int64()
    text = schema.field(cfg.text_column).type if cfg.text_column is not None else pa.string()
    if not (_is_string(text) or pa.types.is_null(text)):
        raise JobError(f"input.text_column '{cfg.text_column}' of {location} holds {text}, not strings; name the column of captions")
    types = {c: schema.field(c).type for c in columns}
    return _FileInfo(location, pf.metadata, media_type, kind, ids, column_types=types)


def _check_paths_allowed(info: _FileInfo, cfg: InputConfig) -> None:
    """A path column reads whatever file each cell names (/etc/passwd, another user's
    data): it needs a root to stay in, or the user's explicit consent to read anything.
    (All files agree on the kind: `_check_agreement`.)"""
    if info.media_kind == "path" and cfg.media_root is None and not cfg.allow_any_path:
        raise JobError(
            f"input.media_column '{cfg.media_column}' of {info.path} holds file paths, which may name any file: "
            "set input.media_root to the directory they must stay in, or input.allow_any_path: true"
        )


def _media_kind(t: pa.DataType) -> str | None:
    """'bytes', 'path' or 'struct' from the Arrow type alone (HF files often lack the
    schema metadata that would name the feature)."""
    if _is_binary(t):
        return "bytes"
    if _is_string(t):
        return "path"
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" not in names or not _is_binary(t.field("bytes").type):
            return None
        if "path" in names and not (_is_string(t.field("path").type) or pa.types.is_null(t.field("path").type)):
            return None
        return "struct"
    return None


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _check_agreement(infos: list[_FileInfo], cfg: InputConfig) -> None:
    """All files must hold the same kind of media and the same id type; otherwise the
    output `id` column would have no single type and rows would mean different things."""
    first = infos[0]
    for info in infos[1:]:
        if info.media_kind != first.media_kind:
            raise JobError(
                f"input files disagree on input.media_column '{cfg.media_column}': "
                f"{first.path} has {first.media_type}, {info.path} has {info.media_type}"
            )
    typed = [info for info in infos if not pa.types.is_null(info.id_type)]
    for info in typed[1:]:
        if info.id_type != typed[0].id_type:
            raise JobError(
                f"input files disagree on input.id_column '{cfg.id_column}': "
                f"{typed[0].path} has {typed[0].id_type}, {info.path} has {info.id_type}"
            )


def _media_bytes(group: pq.RowGroupMetaData, column: str) -> int:
    """Compressed bytes of `column` (all leaves of a struct) in one row group."""
    total = 0
    for index in range(group.num_columns):
        chunk = group.column(index)
        if chunk.path_in_schema == column or chunk.path_in_schema.startswith(column + "."):
            total += chunk.total_compressed_size
    return total


def _largest_cell_bound(group: pq.RowGroupMetaData, column: str, kind: str) -> int:
    """An upper bound on the bytes of any one media cell of a row group, from its footer:
    the uncompressed size of the chunk holding the bytes (every value lies whole in its
    pages, plain or dictionary-encoded). Path cells hold no media: 0."""
    leaf = {"bytes": column, "struct": f"{column}.bytes"}.get(kind)
    sizes = [group.column(i).total_uncompressed_size for i in range(group.num_columns) if group.column(i).path_in_schema == leaf]
    return sum(sizes)


# ---------------------------------------------------------------- shard balance


def _smallest_cap(costs: list[int], parts: int) -> int:
    """The smallest maximum part cost over all splits of `costs` into <= `parts`
    contiguous runs (feasibility is monotone in the cap, so binary search is exact)."""
    if not costs:
        return 0
    lo = max(max(costs), -(-sum(costs) // parts))
    hi = sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(costs, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _parts_needed(costs: list[int], cap: int) -> int:
    """Greedy fill is optimal for a fixed cap: fewest contiguous runs of cost <= cap."""
    parts, load = 1, 0
    for cost in costs:
        if load and load + cost > cap:
            parts += 1
            load = 0
        load += cost
    return parts


# ---------------------------------------------------------------- reading rows


class _Source:
    """An open input file plus how to turn its cells into rows (and which columns to
    copy); reopenable after a failed read."""

    def __init__(self, location: str, cfg: InputConfig, columns: tuple[str, ...] = ()):
        self.location = location
        self.columns = columns
        self.base = os.path.dirname(location) if not SCHEME.match(location) else location.rsplit("/", 1)[0]
        self.options = cfg.storage_options
        self.pf = _open(location, self.options)
        self._streamed: pq.ParquetFile | None = None
        try:
            self.kind = _file_info(location, self.pf, cfg).media_kind
        except JobError:
            self.pf.close()
            raise

    def streaming(self) -> pq.ParquetFile:
        """The file opened to stream its row groups (`_open(streaming=True)`), opened
        on first use: most inputs never need it."""
        if self._streamed is None:
            self._streamed = _open(self.location, self.options, streaming=True)
        return self._streamed

    def reopen(self) -> None:
        self.close()
        self.pf = _open(self.location, self.options)

    def close(self) -> None:
        self.pf.close()
        if self._streamed is not None:
            self._streamed.close()
            self._streamed = None


def _read_file(
    cfg: InputConfig,
    location: str,
    fragments: list[Fragment],
    lo: int,
    hi: int | None,
    root: _Root | None,
    columns: tuple[str, ...],
) -> Iterator[InputRow]:
    source = _Source(location, cfg, columns)
    try:
        for fragment in fragments:
            _check_unchanged(source, fragment)
            end = fragment.first_row + fragment.num_rows
            start = max(lo, fragment.first_row)
            stop = end if hi is None else min(hi, end)
            yield from _read_fragment(cfg, source, fragment, start, stop, root)
    finally:
        source.close()


def _check_unchanged(source: _Source, fragment: Fragment) -> None:
    """Row indices come from the listing; a file rewritten since would shift them."""
    metadata = source.pf.metadata
    actual = metadata.row_group(fragment.row_group).num_rows if fragment.row_group < metadata.num_row_groups else None
    if actual != fragment.num_rows:
        raise JobError(
            f"input file {source.location} changed since it was listed: row group {fragment.row_group} "
            f"has {actual} rows, expected {fragment.num_rows}; restart the job on the current input"
        )


def _read_fragment(
    cfg: InputConfig, source: _Source, fragment: Fragment, start: int, stop: int, root: _Root | None
) -> Iterator[InputRow]:
    """Rows start..stop-1 of one fragment, each exactly once even if decoding fails."""
    done = start
    failure: BaseException | None = None
    for attempt in (1, 2):
        if failure is not None:
            source.reopen()
        try:
            for row in _decode(cfg, source, fragment, done, stop, root):
                yield row
                done = row.row + 1
            return
        except _DECODE_ERRORS as exc:
            failure = exc
            logger.warning(
                "row group %d of %s failed to decode at row %d (attempt %d): %s",
                fragment.row_group, source.location, done, attempt, exc,
            )
    message = f"read_error: row group {fragment.row_group} of {source.location} cannot be decoded: {failure}"
    unread = (None,) * len(source.columns)
    for row in range(done, stop):
        yield InputRow(row, None if cfg.id_column is not None else row, None, None, message, unread)


def _decode(
    cfg: InputConfig, source: _Source, fragment: Fragment, start: int, stop: int, root: _Root | None
) -> Iterator[InputRow]:
    columns = list(dict.fromkeys(c for c in (cfg.media_column, cfg.id_column, *source.columns) if c is not None))
    bound = _largest_cell_bound(source.pf.metadata.row_group(fragment.row_group), cfg.media_column, source.kind)
    if bound > cfg.max_item_bytes:
        # A cell over the limit may be here: pre-buffering would hold the whole chunk and
        # a batch of rows every cell of it; one row at a time, one thread, holds one cell.
        logger.info(
            "row group %d of %s holds up to %d bytes of media, more than input.max_item_bytes = %d: reading it row by row",
            fragment.row_group, source.location, bound, cfg.max_item_bytes,
        )
        batches = source.streaming().iter_batches(batch_size=1, row_groups=[fragment.row_group], columns=columns, use_threads=False)
    else:
        batches = source.pf.iter_batches(batch_size=cfg.batch_rows, row_groups=[fragment.row_group], columns=columns)
    first = fragment.first_row
    for batch in batches:
        if first >= stop:
            return
        end = first + batch.num_rows
        if end > start:
            skip = max(start - first, 0)
            kept = batch.slice(skip, min(stop, end) - first - skip)
            yield from _batch_rows(cfg, source, kept, first + skip, root)
        first = end


def _batch_rows(
    cfg: InputConfig, source: _Source, batch: pa.RecordBatch, first: int, root: _Root | None
) -> Iterator[InputRow]:
    media = batch.column(cfg.media_column)
    oversized = _oversized(media, source.kind, cfg.max_item_bytes)
    cells = _cells(media, oversized)
    ids = batch.column(cfg.id_column).to_pylist() if cfg.id_column is not None else range(first, first + len(cells))
    copied = list(zip(*(batch.column(c).to_pylist() for c in source.columns))) or itertools.repeat(())
    for offset, (cell, row_id, extra) in enumerate(zip(cells, ids, copied)):
        if offset in oversized:
            row = InputRow(first + offset, row_id, None, None, _too_large(oversized[offset], cfg))
        else:
            row = _make_row(first + offset, row_id, cell, source, cfg, root)
        row.extra = extra
        yield row


def _oversized(media: pa.Array, kind: str, limit: int) -> dict[int, int]:
    """{offset: bytes} of the cells of `media` holding more than `limit` media bytes,
    read from Arrow's lengths (no value is copied). Path cells hold none."""
    if kind == "path":
        return {}
    values = pc.struct_field(media, "bytes") if kind == "struct" else media
    lengths = _lengths(values)
    over = np.flatnonzero((lengths > limit) & values.is_valid().to_numpy(zero_copy_only=False))
    return {int(k): int(lengths[k]) for k in over}


def _lengths(values: pa.Array) -> np.ndarray:
    """Each value's byte count (anything where null). Binary views have no length kernel
    in pyarrow, but each 16-byte view starts with its value's length (int32)."""
    if pa.types.is_binary_view(values.type):
        views = np.frombuffer(values.buffers()[1], dtype=np.int32).reshape(-1, 4)
        return views[values.offset : values.offset + len(values), 0].astype(np.int64)
    return pc.binary_length(values).fill_null(0).to_numpy().astype(np.int64)


def _cells(media: pa.Array, oversized: dict[int, int]) -> list[object]:
    """The cells as Python values, None in place of each oversized one, which is never
    copied out of Arrow (as bytes it would be one more copy of the largest cell)."""
    if not oversized:
        return media.to_pylist()
    return [None if k in oversized else media[k].as_py() for k in range(len(media))]


def _too_large(size: int, cfg: InputConfig) -> str:
    return f"too_large: the media cell holds {size} bytes, more than input.max_item_bytes = {cfg.max_item_bytes}"


def _make_row(row: int, row_id: object, cell: object, source: _Source, cfg: InputConfig, root: _Root | None) -> InputRow:
    column = cfg.media_column
    if source.kind == "struct":
        if cell is None:
            return InputRow(row, row_id, None, None, f"empty: column '{column}' is null")
        if cell.get("bytes"):
            return InputRow(row, row_id, cell["bytes"], None, None)
        if not cell.get("path"):
            return InputRow(row, row_id, None, None, f"empty: column '{column}' has neither bytes nor a path")
        if root is None and not cfg.allow_any_path:
            # The struct's kind is not refused as a whole (most rows carry bytes).
            return InputRow(row, row_id, None, None, _NO_ROOT)
        cell = cell["path"]
    elif source.kind == "bytes":
        if cell is None:
            return InputRow(row, row_id, None, None, f"empty: column '{column}' is null")
        if not cell:
            return InputRow(row, row_id, None, None, f"empty: column '{column}' holds 0 bytes")
        return InputRow(row, row_id, cell, None, None)
    if cell is None or not cell.strip():
        return InputRow(row, row_id, None, None, f"empty: column '{column}' holds no path")
    uri, error = _resolve(cell, source.base, root)
    return InputRow(row, row_id, None, uri, error)


_NO_ROOT = (
    "no_media_root: the row has a path but no bytes, and paths are read only under input.media_root "
    "(or with input.allow_any_path: true)"
)


# ---------------------------------------------------------------- path resolution


def _media_root(media_root: str | None) -> _Root | None:
    if media_root is None:
        return None
    location = _strip_file_scheme(os.path.expanduser(media_root))
    if SCHEME.match(location):
        return _Root(_normalise_uri(location).rstrip("/"), None)
    absolute = os.path.abspath(location)
    if not os.path.isdir(absolute):
        raise JobError(f"input.media_root {media_root!r} is not a directory{relative_note(location)}")
    return _Root(absolute, os.path.realpath(absolute))


def local_media_root(cfg: InputConfig) -> str | None:
    """The real path of a local `input.media_root` (None without one, or for a URI root):
    what a decode worker checks each opened file against, so a path swapped for a
    symlink after `read_rows` checked it still cannot lead out."""
    root = _media_root(cfg.media_root)
    return root.real if root is not None else None


def _resolve(value: str, base: str, root: _Root | None) -> tuple[str | None, str | None]:
    """(uri, None) for a path that may be read, (None, "path_escape: ...") otherwise."""
    location = _strip_file_scheme(value)
    if SCHEME.match(location):
        if root is None:
            return location, None
        target = _normalise_uri(location)
    else:
        target = _join(root.location if root is not None else base, location)
    if root is not None and not _within(target, root):
        return None, f"path_escape: {value!r} resolves to {target}, outside media_root {root.location}"
    return target, None


def _strip_file_scheme(value: str) -> str:
    return value[len("file://") :] if value.startswith("file://") else value


def _join(anchor: str, path: str) -> str:
    if os.path.isabs(path) or not SCHEME.match(anchor):
        return os.path.normpath(os.path.join(anchor, path))
    return _normalise_uri(anchor.rstrip("/") + "/" + path)


def _normalise_uri(uri: str) -> str:
    """Remove '.' and '..' path segments (RFC 3986); '..' never climbs above the host."""
    scheme, rest = uri.split("://", 1)
    host, _, path = rest.partition("/")
    segments: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment != ".":
            segments.append(segment)
    return f"{scheme}://{host}/" + "/".join(segments)


def _within(target: str, root: _Root) -> bool:
    if root.real is None:
        return target == root.location or target.startswith(root.location + "/")
    if SCHEME.match(target):
        return False
    real = os.path.realpath(target)
    return os.path.commonpath([real, root.real]) == root.real


# ---------------------------------------------------------------- webdataset


def _scan_tars(cfg: InputConfig, columns: Sequence[str], cache_root: Path | None) -> InputListing:
    """The tars' index as a listing: per tar, fragments of `TAR_GROUP_SAMPLES` samples in
    tar order (each costing its members' bytes), string ids (the keys) and string
    carried columns (members' text)."""
    cache = IndexCache(cache_root) if cache_root is not None else None
    paths = _find_files(cfg.path, cfg.storage_options, ".tar")
    indexes = [webdataset.index_tar(path, cfg.storage_options, cache) for path in paths]
    _check_members(cfg, indexes, columns)
    fragments = []
    first_row = 0
    for index in indexes:
        for group, start in enumerate(range(0, len(index.samples), TAR_GROUP_SAMPLES)):
            samples = tuple(index.samples[start : start + TAR_GROUP_SAMPLES])
            cost = sum(size for sample in samples for _, _, size in sample.members) + len(samples)
            fragments.append(Fragment(index.location, group, first_row, len(samples), cost, samples))
            first_row += len(samples)
    kept = f" ({cache.hits} indexed earlier, kept in {cache.folder})" if cache is not None and cache.hits else ""
    logger.info("input %s: %s%s, %s", cfg.path, plural(len(indexes), "tar"), kept, plural(first_row, "sample"))
    files = [InputFile(i.location, i.size, i.digest, i.etag) for i in indexes]
    return InputListing(fragments, pa.string(), files, {c: pa.string() for c in columns})


def _check_members(cfg: InputConfig, indexes: list[webdataset.TarIndex], columns: Sequence[str]) -> None:
    """A carried column must be the extension of some sample's member (a sample that
    lacks it gets a null); one no sample has is a misspelt name."""
    found = {e for index in indexes for sample in index.samples for e in sample.extensions()}
    named = [("output.columns", c) for c in columns] + ([("input.text_column", cfg.text_column)] if cfg.text_column else [])
    for key, column in named:
        if column.lower() not in found:
            raise JobError(
                f"{key} '{column}' is no member extension in the tars of input.path {cfg.path!r}; "
                f"extensions there: {', '.join(sorted(found)) or 'none'}"
            )


def _read_tar(
    cfg: InputConfig, path: str, fragments: list[Fragment], lo: int, hi: int | None, columns: tuple[str, ...]
) -> Iterator[InputRow]:
    """`read_rows` of one tar: rows [lo, hi) of its `fragments`, through one open
    handle, every member read by its offset."""
    try:
        handle = webdataset.open_tar(path, cfg.storage_options)
    except OSError as exc:
        raise JobError(f"cannot open input file {path}: {exc}") from None
    with handle:
        for fragment in fragments:
            for offset, sample in enumerate(fragment.samples):
                row = fragment.first_row + offset
                if row >= lo and (hi is None or row < hi):
                    yield _tar_row(cfg, handle, path, row, sample, columns)


def _tar_row(cfg: InputConfig, handle: Any, location: str, row: int, sample: Sample, columns: tuple[str, ...]) -> InputRow:
    """One sample's row: its media member's bytes or an error, and its carried members."""
    extra = tuple(_carried(cfg, handle, sample, column) for column in columns)
    member = webdataset.media_member(sample, cfg.media_column, cfg.modality)
    if member is None:
        return InputRow(row, sample.key, None, None, webdataset.no_media(sample, location, cfg.media_column, cfg.modality), extra)
    extension, offset, size = member
    name = f"{sample.key}.{extension}"
    if size > cfg.max_item_bytes:
        error = f"too_large: member {name} holds {size} bytes, more than input.max_item_bytes = {cfg.max_item_bytes}"
        return InputRow(row, sample.key, None, None, error, extra)
    if size == 0:
        return InputRow(row, sample.key, None, None, f"empty: member {name} of {location} holds 0 bytes", extra)
    try:
        data = webdataset.read_member(handle, offset, size)
    except OSError as exc:
        return InputRow(row, sample.key, None, None, f"read_error: cannot read {name} from {location}: {exc}", extra)
    return InputRow(row, sample.key, data, None, None, extra)


def _carried(cfg: InputConfig, handle: Any, sample: Sample, column: str) -> str | None:
    """A carried member's text; None where the sample lacks it, or it is larger than
    input.max_item_bytes or cannot be read (the row's media decide its error)."""
    member = sample.member(column)
    if member is None or member[2] > cfg.max_item_bytes:
        return None
    try:
        return webdataset.member_text(webdataset.read_member(handle, member[1], member[2]))
    except OSError:
        return None


def _check_keys(fragments: Sequence[Fragment]) -> None:
    """`check_ids` of webdataset input, whose ids are the keys the index holds: a key
    that is not valid UTF-8 (tarfile hands such names over as lone surrogates) is a
    JobError naming it; repeated keys are one warning, as repeated ids are."""
    seen: set[str] = set()
    repeats = 0
    first: tuple[int, str] | None = None
    for fragment in fragments:
        for offset, sample in enumerate(fragment.samples):
            row = fragment.first_row + offset
            try:
                sample.key.encode("utf-8")
            except UnicodeEncodeError:
                raise JobError(
                    f"sample key {sample.key!r} of {fragment.path} (row {row}) is not valid UTF-8; "
                    "rename its members in the tar as valid UTF-8"
                ) from None
            if sample.key in seen:
                repeats += 1
                first = first or (row, sample.key)
            seen.add(sample.key)
    if first is not None:
        logger.warning(
            "sample keys repeat in %s of this shard's %d (the first is row %d, key %r), each the key of an earlier "
            "sample; every row is still written, with its key",
            plural(repeats, "row"), len(seen) + repeats, first[0], first[1],
        )
