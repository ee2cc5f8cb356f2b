"""Tar indexes of webdataset input: our header walk (`tar_headers`) finds exactly the
members tarfile finds in ustar, GNU and pax tars (long names, links, directories,
base-256 numbers) and leaves damaged or unusual tars to tarfile; an index kept under the
cache root (`index_cache`) gives exactly the rows of a fresh one, a rewritten tar is
indexed again, and a corrupt, foreign or planted cache entry is ignored."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import tarfile
import zlib
from pathlib import Path

import fsspec
import pytest
from conftest import make_job
from fsspec.implementations.memory import MemoryFileSystem
from test_webdataset import add, media, write_tars

from embedjob import runner
from embedjob.config import InputConfig
from embedjob.io import index_cache, reader, tar_headers, webdataset

LONG_DIR = "a-directory-name-long-enough/" * 4  # 116 characters: past the 100 of a ustar name field


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tars written by a test count as settled, so their indexes are kept at once."""
    monkeypatch.setattr(webdataset, "SETTLED_NS", 0)


def build_tar(path: Path, fmt: int) -> Path:
    """A tar of `fmt` with samples under a long directory (a ustar prefix, a GNU 'L'
    header, a pax path), a non-ASCII key, a directory (and an old V7 one), a symlink, a
    hard link, a fifo and an empty member; past ustar, a uid more than 7 octal digits hold (base-256 in
    GNU, a pax record in pax) and link targets past 100 characters (GNU: 'K' headers)."""
    beyond_ustar = fmt != tarfile.USTAR_FORMAT
    target = (LONG_DIR if beyond_ustar else "") + "00000.jpg"
    with tarfile.open(path, "w", format=fmt) as tar:
        for key in ("00000", "00001"):
            add(tar, f"{LONG_DIR}{key}.jpg", b"j" * 700)
            add(tar, f"{LONG_DIR}{key}.txt", f"caption {key}".encode())
        for kind, name in ((tarfile.DIRTYPE, "dir"), (tarfile.SYMTYPE, "link.jpg"), (tarfile.LNKTYPE, "hard.jpg"), (tarfile.FIFOTYPE, "fifo.jpg")):
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = target if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            tar.addfile(info)
        big_uid = tarfile.TarInfo("\N{SNOWMAN}-00002.jpg")
        big_uid.uid, big_uid.size = 3_000_000 if beyond_ustar else 1000, 1500
        tar.addfile(big_uid, io.BytesIO(b"s" * 1500))
        add(tar, "00003.json", b"")
        v7_directory = tarfile.TarInfo("old.dir/")  # type '\0' and a trailing slash: a directory to tarfile
        v7_directory.type = tarfile.AREGTYPE
        tar.addfile(v7_directory)
        if fmt == tarfile.PAX_FORMAT:
            sized = tarfile.TarInfo("00004.jpg")
            sized.size, sized.pax_headers = 9, {"size": "9"}
            tar.addfile(sized, io.BytesIO(b"p" * 9))
    return path


def walks(path: Path) -> tuple[list | None, tuple[list, str | None]]:
    """(our walk, tarfile's walk) of one local tar."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        ours = tar_headers.members(handle, size)
        theirs = webdataset.tarfile_members(handle, str(path), size)
    return ours, theirs


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["ustar", "gnu", "pax"])
def test_our_header_walk_finds_what_tarfile_finds(tmp_path: Path, fmt: int) -> None:
    path = build_tar(tmp_path / "shard.tar", fmt)
    ours, (theirs, damage) = walks(path)
    assert damage is None and ours is not None, "a well-formed tar was left to tarfile"
    assert ours == theirs
    names = [name for name, _, _ in ours]
    assert f"{LONG_DIR}00001.txt" in names and "\N{SNOWMAN}-00002.jpg" in names, "a long or non-ASCII name was cut"
    assert not {"dir", "link.jpg", "hard.jpg", "fifo.jpg", "old.dir/"} & set(names), "a non-regular member became a sample's"


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_our_walk_never_reads_a_garbled_header_otherwise_than_tarfile(tmp_path: Path, fmt: int) -> None:
    """Random bytes written into the header blocks (long names and pax records
    included), half the time with the checksum made right again: our walk either
    leaves the tar to tarfile or finds exactly tarfile's members."""
    whole = build_tar(tmp_path / "shard.tar", fmt).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        blocks = [b for info in tar.getmembers() for b in range(info.offset, info.offset_data, 512)]
    rng = random.Random(20261205)
    read_by_us = 0
    for _ in range(1500):
        data = bytearray(whole)
        block = rng.choice(blocks)
        for _ in range(rng.randint(1, 3)):
            data[block + rng.randrange(512)] = rng.choice([0, 32, 47, 48, 55, 56, 61, 10, rng.randrange(256)])
        if rng.random() < 0.5:
            data[block + 148 : block + 156] = b"%06o\0 " % (256 + sum(data[block : block + 148]) + sum(data[block + 156 : block + 512]))
        ours = tar_headers.members(io.BytesIO(data), len(data))
        if ours is not None:
            read_by_us += 1
            assert (ours, None) == webdataset.tarfile_members(io.BytesIO(data), "garbled.tar", len(data))
    assert read_by_us > 100, "the garbled tars all went to tarfile: this test compared nothing"


def test_a_damaged_or_unusual_tar_is_left_to_tarfile_and_indexed_as_before(tmp_path: Path) -> None:
    path = build_tar(tmp_path / "whole.tar", tarfile.GNU_FORMAT)
    whole = path.read_bytes()
    members = walks(path)[0] or []
    second, last = members[1][1], members[-1][1]  # data offsets
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: second + 5])
    no_end = tmp_path / "no-end.tar"
    no_end.write_bytes(whole[:last])  # the last member is empty: every member whole, no end-of-archive blocks
    garbled = tmp_path / "garbled.tar"
    garbled.write_bytes(whole[: second - 512] + b"\x01" * 512 + whole[second:])
    global_pax = tmp_path / "global.tar"
    with tarfile.open(global_pax, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "a global header"}) as tar:
        add(tar, "00000.jpg", b"j" * 10)
    for damaged in (cut, no_end, garbled):
        ours, (theirs, damage) = walks(damaged)
        assert ours is None, f"{damaged.name} was read by our walk"
        assert theirs == members[: len(theirs)] and damage is not None
        index = webdataset.index_tar(str(damaged), {})
        assert index.damage == damage and index.digest == webdataset._digest(theirs, damage)
    assert walks(global_pax)[0] is None
    assert [s.key for s in webdataset.index_tar(str(global_pax), {}).samples] == ["00000"]
    assert "cut short" in (webdataset.index_tar(str(cut), {}).damage or "")
    assert webdataset.index_tar(str(no_end), {}).damage.endswith("its members are read")


def rows(cfg: InputConfig, listing: reader.InputListing) -> list[tuple]:
    return [(r.row, r.id, r.data, r.error, r.extra) for r in reader.read_rows(cfg, listing.fragments, columns=["txt"])]


def test_a_kept_index_gives_exactly_the_rows_of_a_fresh_one_without_walking_the_tars(tmp_path: Path, monkeypatch, caplog) -> None:
    tars = write_tars(tmp_path / "tars", media()[:7], (3, 4))
    damaged = tars / "00001.tar"
    _, media_offset, media_size = webdataset.index_tar(str(damaged), {}).samples[-1].members[0]
    damaged.write_bytes(damaged.read_bytes()[: media_offset + media_size // 2])  # the last sample's media cut short
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset")
    fresh = reader.scan_input(cfg, ["txt"])
    cache = tmp_path / "cache"
    reader.scan_input(cfg, ["txt"], cache)
    assert len(list((cache / index_cache.FOLDER).iterdir())) == 2, "an index was not kept (the damaged tar's included)"

    def no_walk(*args: object) -> None:
        raise AssertionError("a tar was walked although its index was kept")

    monkeypatch.setattr(webdataset, "_members", no_walk)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        kept = reader.scan_input(cfg, ["txt"], cache)
    assert kept.files == fresh.files and kept.fragments == fresh.fragments
    assert rows(cfg, kept) == rows(cfg, fresh)
    assert "00001.tar is damaged at byte" in caplog.text, "the damaged tar's warning is lost when its index is kept"
    assert "2 indexed earlier" in caplog.text


def test_a_tar_rewritten_with_its_size_and_modification_time_is_indexed_again(tmp_path: Path) -> None:
    items = media()[:3]
    tars = write_tars(tmp_path / "tars", items, (3,))
    path = tars / "00000.tar"
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset")
    cache = tmp_path / "cache"
    before = reader.scan_input(cfg, [], cache)
    was = path.stat()
    renamed = [(f"9{k[1:]}", e, d) for k, e, d in items]  # other keys of the same length: the same size
    write_tars(tmp_path / "tars", renamed, (3,))
    os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert path.stat().st_size == was.st_size and path.stat().st_mtime_ns == was.st_mtime_ns
    after = reader.scan_input(cfg, [], cache)
    assert [r.id for r in reader.read_rows(cfg, after.fragments)] == [k for k, _, _ in renamed]
    assert after.files[0].footer_sha256 != before.files[0].footer_sha256
    again = reader.scan_input(cfg, [], cache)
    assert again.files == after.files, "the stale entry was not replaced"


def entry_path(cache: Path, location: str) -> Path:
    return cache / index_cache.FOLDER / f"{hashlib.sha256(location.encode()).hexdigest()[:40]}.idx"


def forged(entry: bytes, change: dict) -> bytes:
    """A well-formed entry with `change` applied to its fields."""
    body = json.loads(zlib.decompress(entry[len(index_cache.MAGIC) :]))
    return index_cache.MAGIC + zlib.compress(json.dumps({**body, **change}).encode())


CORRUPTIONS = {
    "truncated": lambda entry, other: entry[: len(entry) // 2],
    "garbage": lambda entry, other: index_cache.MAGIC + os.urandom(200),
    "another version": lambda entry, other: b"embedjob tar index 0\n" + entry[len(index_cache.MAGIC) :],
    "another tar's entry": lambda entry, other: other,
    "offsets past the tar": lambda entry, other: forged(entry, {"offsets": [1 << 40] * len(forged_offsets(entry))}),
    "members without their digest": lambda entry, other: forged(entry, {"sizes": [1] * len(forged_offsets(entry))}),
    "not an object": lambda entry, other: index_cache.MAGIC + zlib.compress(b"[1, 2]"),
}


def forged_offsets(entry: bytes) -> list:
    return json.loads(zlib.decompress(entry[len(index_cache.MAGIC) :]))["offsets"]


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_or_foreign_entry_is_ignored_and_replaced(tmp_path: Path, corruption: str, caplog) -> None:
    tars = write_tars(tmp_path / "tars", media()[:5], (3, 2))
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset")
    cache = tmp_path / "cache"
    fresh = reader.scan_input(cfg, ["txt"], cache)
    mine, other = entry_path(cache, str(tars / "00000.tar")), entry_path(cache, str(tars / "00001.tar"))
    mine.write_bytes(CORRUPTIONS[corruption](mine.read_bytes(), other.read_bytes()))
    with caplog.at_level(logging.DEBUG, logger="embedjob.io.index_cache"):
        listing = reader.scan_input(cfg, ["txt"], cache)
    assert rows(cfg, listing) == rows(cfg, fresh) and listing.files == fresh.files
    assert "00000.tar ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="embedjob.io.index_cache"):
        reader.scan_input(cfg, ["txt"], cache)
    assert "ignored" not in caplog.text, "the corrupt entry was not replaced"


def test_planted_links_are_neither_read_nor_written_through(tmp_path: Path, caplog) -> None:
    tars = write_tars(tmp_path / "tars", media()[:2], (2,))
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset")
    cache = tmp_path / "cache"
    fresh = reader.scan_input(cfg, [], cache)
    elsewhere = tmp_path / "elsewhere.idx"
    entry = entry_path(cache, str(tars / "00000.tar"))
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    assert reader.scan_input(cfg, [], cache).files == fresh.files
    assert not entry.is_symlink(), "the planted link was not replaced by an entry"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    linked = tmp_path / "linked-cache"
    linked.mkdir()
    (linked / index_cache.FOLDER).symlink_to(theirs)
    with caplog.at_level(logging.WARNING):
        assert reader.scan_input(cfg, [], linked).files == fresh.files
    assert list(theirs.iterdir()) == [], "an index was written through a planted folder link"
    assert caplog.text.count("not kept") == 1 and "symbolic link" in caplog.text


class EtagMemory(MemoryFileSystem):
    """The memory store with an ETag (its content's MD5, as S3 gives for a plain upload)."""

    protocol = "etagmemory"

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return super()._strip_protocol(path.replace("etagmemory://", "memory://", 1))

    def info(self, path: str, **kwargs: object) -> dict:
        info = super().info(path, **kwargs)
        return {**info, "ETag": hashlib.md5(self.cat_file(path)).hexdigest()} if info["type"] == "file" else info


def test_a_remote_tar_is_kept_by_its_etag_and_one_without_an_etag_is_never_kept(tmp_path: Path) -> None:
    fsspec.register_implementation("etagmemory", EtagMemory, clobber=True)
    items = media()[:3]
    local = write_tars(tmp_path / "tars", items, (3,))
    data = (local / "00000.tar").read_bytes()
    store = fsspec.filesystem("etagmemory")
    store.pipe("/wds-etag/00000.tar", data)
    cache = tmp_path / "cache"
    for protocol in ("memory", "etagmemory"):
        cfg = InputConfig(path=f"{protocol}://wds-etag", media_column="jpg", format="webdataset")
        listing = reader.scan_input(cfg, [], cache)
        assert [r.id for r in reader.read_rows(cfg, listing.fragments)] == [k for k, _, _ in items]
    assert [p.name for p in (cache / index_cache.FOLDER).iterdir()] == [entry_path(cache, listing.files[0].path).name]
    renamed = [(f"9{k[1:]}", e, d) for k, e, d in items]
    write_tars(tmp_path / "other", renamed, (3,))
    store.pipe("/wds-etag/00000.tar", (tmp_path / "other" / "00000.tar").read_bytes())
    cfg = InputConfig(path="etagmemory://wds-etag", media_column="jpg", format="webdataset")
    assert [r.id for r in reader.read_rows(cfg, reader.scan_input(cfg, [], cache).fragments)] == [k for k, _, _ in renamed]


def test_a_run_keeps_its_indexes_under_the_jobs_cache_dir(tmp_path: Path) -> None:
    tars = write_tars(tmp_path / "tars", media()[:2], (2,))
    cache = tmp_path / "cache"
    job = make_job(str(cache), input={"path": str(tars), "format": "webdataset", "media_column": "jpg", "id_column": None})
    runner.scan_input(job)
    assert [p.suffix for p in (cache / index_cache.FOLDER).iterdir()] == [".idx"]


def test_a_tar_changed_moments_ago_is_indexed_but_its_index_not_kept(tmp_path: Path, monkeypatch) -> None:
    """A rewrite within the file system's time step could keep the stamp: such a tar's
    index is not kept until it has settled."""
    monkeypatch.setattr(webdataset, "SETTLED_NS", 3600 * 10**9)
    tars = write_tars(tmp_path / "tars", media()[:2], (2,))
    cfg = InputConfig(path=str(tars), media_column="jpg", format="webdataset")
    assert len(reader.scan_input(cfg, [], tmp_path / "cache").fragments) == 1
    assert not (tmp_path / "cache" / index_cache.FOLDER).exists()
