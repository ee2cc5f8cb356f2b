"""Data parallel on CPU ranks: the chunk hand-out and reorder, the rank links, output
equal to the single-process run row for row (spawned ranks and torchrun), and a dying
rank that stops the job with a clear line.

Ranks are processes; the inputs are kept small because CI has two cores.
"""

from __future__ import annotations

import io
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from PIL import Image

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.io.digest import DIGEST_SIZE
from embedjob.io.reader import Chunk
from embedjob.io.writer import RowBlock
from embedjob.parallel.cluster import (
    FAULT_ENV,
    FAULT_EXIT_CODE,
    HEARTBEAT,
    HELLO,
    TAKE,
    Cluster,
    Coordinator,
    Hub,
    Layout,
    Link,
    RankFailure,
    _Spawned,
    resolve_layout,
    send_hello,
)
from embedjob.parallel import cluster as cluster_module
from embedjob.pipeline import ENCODE_AHEAD, STOP_POLL, RankPipeline
from embedjob.workers import wire

DEMO = str(REPO / "jobs" / "demo.yaml")
DEMO_PARQUET = REPO / "jobs" / "data" / "demo-images.parquet"


# --- hand-out and reorder -----------------------------------------------------------


def _block(chunk: Chunk) -> RowBlock:
    n = chunk.rows
    return RowBlock(chunk.first_row, list(range(chunk.first_row, chunk.end_row)), ["image"] * n, [1] * n, [0] * n,
                    [None] * n, np.ones(n, dtype=np.int64), np.full((n, 2), chunk.index, dtype=np.float32),
                    digests=np.full((n, DIGEST_SIZE), chunk.index, dtype=np.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_ranks_taking_chunks_at_their_own_pace_get_each_once_and_the_writer_gets_them_in_order(seed: int) -> None:
    """Ranks of random speeds take and return chunks; the writer sees every chunk once,
    in order, and never more than `lookahead` chunks are out beyond the first unwritten one."""
    chunks = [Chunk(i, 3 * i, 3 * i + 3, ()) for i in range(40)]
    coordinator = Coordinator(3, lookahead=5)
    coordinator.open(chunks)
    rng = random.Random(seed)
    delays = [[rng.uniform(0, 0.004) for _ in range(len(chunks))] for _ in range(3)]
    taken: list[tuple[int, int]] = []
    outstanding: list[int] = []

    def rank(r: int) -> None:
        first = coordinator.take(r)  # answered at once, before the rank is ready
        time.sleep(0.01 * r)
        coordinator.ready(r)
        for chunk in itertools.chain([first], iter(lambda: coordinator.take(r), None)):
            taken.append((r, chunk.index))
            time.sleep(delays[r][chunk.index])
            coordinator.put(chunk.index, _block(chunk))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    written = []
    for block in coordinator.results(timeout=10):
        outstanding.append(max(i for _, i in taken) - len(written))
        written.append(int(block.vectors[0, 0]))
        time.sleep(rng.uniform(0, 0.002))
    for thread in threads:
        thread.join()
    assert written == list(range(len(chunks)))
    assert sorted(i for _, i in taken) == list(range(len(chunks)))
    assert max(outstanding) < 5
    assert len({r for r, _ in taken}) == 3  # every rank took some


@pytest.mark.parametrize("head_start", [1, 3])
def test_a_rank_setting_up_holds_back_only_its_head_start(head_start: int) -> None:
    """Each rank gets `head_start` chunks at once (decoded while it captures); more only
    once every rank is ready, so a slow starter never holds chunks while the others run
    ahead and then wait for them."""
    coordinator = Coordinator(2, lookahead=8, head_start=head_start)
    coordinator.open([Chunk(i, i, i + 1, ()) for i in range(10)])
    first = [coordinator.take(0).index for _ in range(head_start)]
    second = [coordinator.take(1).index for _ in range(head_start)]
    assert first + second == list(range(2 * head_start))
    coordinator.ready(0)
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(coordinator.take(0).index))
    thread.start()
    time.sleep(0.2)
    assert later == []  # rank 1 is still capturing
    coordinator.ready(1)
    thread.join(timeout=5)
    assert later == [2 * head_start]


def test_rows_returned_before_every_rank_is_ready_are_counted_apart() -> None:
    """A rank ready first encodes its head start while the others set up; counted in the
    rate after setup, those rows overstated two-GPU runs of a few thousand rows by a third."""
    coordinator = Coordinator(2, lookahead=8, head_start=2)
    coordinator.open([Chunk(i, 3 * i, 3 * i + 3, ()) for i in range(6)])
    early = [coordinator.take(0), coordinator.take(0)]
    coordinator.ready(0)
    for chunk in early:
        coordinator.put(chunk.index, _block(chunk))
    assert coordinator.rows_before_ready == 6
    late = coordinator.take(1)
    coordinator.ready(1)
    coordinator.put(late.index, _block(late))
    after = coordinator.take(0)
    coordinator.put(after.index, _block(after))
    assert coordinator.rows_before_ready == 6


def test_head_starts_that_the_lookahead_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="head_start"):
        Coordinator(2, lookahead=5, head_start=3)


def test_a_failure_wakes_every_waiting_rank_and_the_writer() -> None:
    coordinator = Coordinator(1, lookahead=1)
    coordinator.open([Chunk(i, i, i + 1, ()) for i in range(3)])
    assert coordinator.take(0).index == 0
    coordinator.ready(0)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            coordinator.take(0)  # waits: chunk 0 is not written yet
        except RankFailure as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.1)
    coordinator.fail(RankFailure("rank 2 of 3 exited with code 17"))
    thread.join(timeout=5)
    assert [str(e) for e in errors] == ["rank 2 of 3 exited with code 17"]
    with pytest.raises(RankFailure, match="code 17"):
        next(coordinator.results())


def test_a_chunk_held_too_long_names_the_rank_that_holds_it() -> None:
    coordinator = Coordinator(4, lookahead=4)
    coordinator.open([Chunk(0, 10, 20, ())])
    assert coordinator.take(3).index == 0 and coordinator.take(0) is None
    with pytest.raises(RankFailure, match=r"rank 3 has not returned rows 10-19"):
        next(coordinator.results(timeout=0.2))


def test_the_rank_link_listens_on_loopback_only_and_drops_peers_without_the_token() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    hub = Hub(listener, "right-token", world_size=2, spawned=[])
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
        intruder = socket.create_connection(("127.0.0.1", hub.port))
        wire.send(intruder, HELLO, ("wrong-token", 1))
        assert intruder.recv(1) == b""  # dropped
        member = socket.create_connection(("127.0.0.1", hub.port))
        send_hello(member, "right-token", 1)
        coordinator = Coordinator(2, lookahead=2)
        hub.serve(coordinator)
        coordinator.open([Chunk(0, 0, 4, ()), Chunk(1, 4, 8, ())])
        wire.send(member, 1, None)  # TAKE
        kind, chunk = wire.receive(member, timeout=10)
        assert chunk == Chunk(0, 0, 4, ())  # a first take is answered before the rank is ready
    finally:
        hub.close()


def test_every_rank_hears_when_all_are_ready_while_its_take_waits() -> None:
    """GO reaches a rank over its link while its input thread waits for a chunk: the
    rank ready first waits for it before encoding past its first windows."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    hub = Hub(listener, "token", world_size=2, spawned=[])
    try:
        coordinator = Coordinator(2, lookahead=4, head_start=1)
        hub.serve(coordinator)
        coordinator.open([Chunk(i, i, i + 1, ()) for i in range(4)])
        link = Link(hub.port, "token", 1, heartbeat=1.0)
        assert link.take() == Chunk(0, 0, 1, ())
        later: list[Chunk | None] = []
        taker = threading.Thread(target=lambda: later.append(link.take()))
        taker.start()  # beyond its head start: waits until every rank is ready
        assert not link.all_ready(0.2) and not coordinator.all_ready(0)
        link.ready()
        assert not link.all_ready(0.2)  # rank 0 is still setting up
        coordinator.ready(0)
        assert link.all_ready(10) and coordinator.all_ready(0)
        taker.join(timeout=10)
        assert later == [Chunk(1, 1, 2, ())]
    finally:
        hub.close()


def _listening_hub(token: str, world_size: int) -> Hub:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return Hub(listener, token, world_size, spawned=[])


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` (a reset when it left bytes unread)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class _Intrusion:
    """A pickle that makes a directory when it is unpickled: what a peer without the
    token could run in rank 0 if rank 0 unpickled its first frame."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.mkdir, (str(self.path),)


def test_idle_garbage_and_wrong_token_connections_hold_up_no_rank_and_run_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 handled one connection at a time and gave each 30 s to say hello: four
    idle connections made a 2-rank start take two minutes more. Now each handshake has
    its own thread and a second, so the ranks join at once, the strays are dropped, the
    first frame is never unpickled, and once every rank is in, the port refuses."""
    hub = _listening_hub("right-token", world_size=3)
    strays = [socket.create_connection(("127.0.0.1", hub.port)) for _ in range(4)]  # the first stays idle
    try:
        strays[1].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        send_hello(strays[2], "wrong-token", 1)
        wire.send(strays[3], HELLO, _Intrusion(tmp_path / "intruded"))
        coordinator = Coordinator(3, lookahead=3)
        hub.serve(coordinator)
        coordinator.open([Chunk(0, 0, 4, ()), Chunk(1, 4, 8, ())])
        members = [socket.create_connection(("127.0.0.1", hub.port)) for _ in range(2)]
        for rank, member in enumerate(members, 1):
            send_hello(member, "right-token", rank)
            wire.send(member, TAKE, None)
            wire.receive_timeout(member, 10)  # well under the 30 s one idle connection cost
        answers = [wire.receive(member, 10)[1] for member in members]
        assert sorted(chunk.index for chunk in answers) == [0, 1]
        assert all(_closed_by_peer(stray) for stray in strays)
        assert not (tmp_path / "intruded").exists()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", hub.port), timeout=10)
    finally:
        hub.close()
        for sock in strays:
            sock.close()
    dropped = [r.getMessage() for r in caplog.records if "rank link" in r.getMessage()]
    assert len(dropped) == 4 and sum("this run's token" in m for m in dropped) == 2, dropped


def test_ranks_that_never_join_stop_the_job_with_one_line_naming_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank that never connects (its start hangs) used to leave rank 0 waiting for
    it for good; now the start-up is bounded and the failure names who is missing,
    whether it comes before rank 0 serves chunks or after."""
    monkeypatch.setattr(cluster_module, "JOIN_TIMEOUT", 1.0)
    missing = "ranks 2, 3 of 4 did not join rank 0 within 1s"
    late = _listening_hub("token", world_size=4)
    early = _listening_hub("token", world_size=4)
    joined = [socket.create_connection(("127.0.0.1", hub.port)) for hub in (early, late)]
    try:
        coordinator = Coordinator(4, lookahead=4)
        early.serve(coordinator)
        for sock in joined:
            send_hello(sock, "token", 1)
        with pytest.raises(RankFailure, match=missing):
            coordinator.all_ready(timeout=30)
        with pytest.raises(RankFailure, match=missing):
            early.wait_done()
        deadline = time.monotonic() + 30
        while caplog.text.count(missing) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert caplog.text.count(missing) == 2  # one line per hub, whoever noticed first
        served_late = Coordinator(4, lookahead=4)
        late.serve(served_late)
        with pytest.raises(RankFailure, match=missing):
            served_late.take(0)
    finally:
        early.close()
        late.close()
        for sock in joined:
            sock.close()


def test_a_rank_that_goes_silent_is_named_with_its_pid_and_its_return_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank that sends nothing (stopped, hung) stalled the job for half an hour
    without a word. Now rank 0 names it, its pid, how long and the rows it holds; a
    rank that is merely busy keeps quiet warnings away with its heartbeat."""
    monkeypatch.setattr(cluster_module, "SILENCE_LIMIT", 0.8)
    hub = _listening_hub("token", world_size=3)
    busy = Link(hub.port, "token", 1, heartbeat=cluster_module.heartbeat_interval())
    silent = socket.create_connection(("127.0.0.1", hub.port))
    try:
        coordinator = Coordinator(3, lookahead=3)
        hub.serve(coordinator)
        coordinator.open([Chunk(0, 0, 4, ()), Chunk(1, 4, 8, ())])
        send_hello(silent, "token", 2)
        wire.send(silent, TAKE, None)
        assert busy.take() is not None and wire.receive(silent, timeout=10)[1] is not None
        deadline = time.monotonic() + 30
        while "has sent nothing" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the busy rank has been quiet, but for its heartbeat, as long
        wire.send(silent, HEARTBEAT, None)
        while "heard from again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        hub.close()
        busy.sock.close()
        silent.close()
    lines = [r.getMessage() for r in caplog.records if "rank " in r.getMessage()]
    assert len(lines) >= 2, lines
    assert re.fullmatch(
        rf"rank 2 of 3 \(pid {os.getpid()}\) has sent nothing, not even a heartbeat, for \d+s "
        r"\(stopped or hung\?\); it holds rows [04]-[37]",
        lines[0],
    ), lines[0]
    assert re.fullmatch(rf"rank 2 of 3 \(pid {os.getpid()}\) is heard from again after \d+s of silence", lines[-1])
    assert not any("rank 1 " in line for line in lines)


@pytest.mark.parametrize("others_ready", [False, True])
def test_a_rank_ready_first_encodes_two_windows_then_waits_with_the_rest_decoded(others_ready: bool) -> None:
    """Before every rank is ready a rank encodes at most ENCODE_AHEAD windows' rows; it
    hands over what is on its device (a None), waits, then goes on. When the others are
    ready already it never stops (a single GPU never does)."""
    calls: list[float | None] = []

    def all_ready(timeout: float | None) -> bool:
        calls.append(timeout)
        return others_ready or timeout != 0  # the others are ready by the time the rank waits

    job = SimpleNamespace(batching=SimpleNamespace(window=8))
    pipeline = RankPipeline(job, torch.device("cpu"), 0, 1, lambda: None, lambda *a: None, lambda: None, all_ready)
    windows = [[0] * n for n in (2, 4, 8, 2, 8, 8)]  # 16 rows = ENCODE_AHEAD windows after the fourth
    assert ENCODE_AHEAD == 2
    out = list(pipeline._gated(iter(windows)))
    if others_ready:
        assert out == windows and calls == [0]
    else:
        # It waits in steps of STOP_POLL, so a signal stops it (`stopping`).
        assert out == [*windows[:4], None, *windows[4:]] and calls == [0, STOP_POLL]
        assert "waiting for every rank" in pipeline.clock.seconds


# --- whole runs ---------------------------------------------------------------------


def _photos() -> list[Image.Image]:
    """The demo's readable photos."""
    photos = []
    for value in pq.read_table(DEMO_PARQUET).column("image").to_pylist():
        try:
            photos.append(Image.open(io.BytesIO(value)).convert("RGB"))
        except OSError:
            continue
    return photos


def _jpeg(image: Image.Image, long_side: int) -> bytes:
    scale = long_side / max(image.size)
    resized = image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))), Image.BICUBIC)
    buffer = io.BytesIO()
    resized.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 huge photos (936-960 patches each under the tiny model's pixel cap) on every
    other row at the start, where a round-robin split would put them all on one rank,
    and 30 small ones (16-48 patches)."""
    photos = _photos()
    huge = [_jpeg(photos[i % len(photos)], 1400 - 100 * i) for i in range(6)]
    small = [_jpeg(photos[i % len(photos)], 40 + 2 * i) for i in range(30)]
    rows = list(itertools.chain.from_iterable(zip(huge, small[:6]))) + small[6:]
    path = tmp_path_factory.mktemp("skewed") / "skewed.parquet"
    table = pa.table({"id": [f"item-{i}" for i in range(len(rows))], "image": pa.array(rows, type=pa.binary())})
    pq.write_table(table, path)
    return path


def _run(job_input: Path | None, out: Path, cache_dir: str, *extra: str) -> int:
    """The demo job (12 rows) or the skewed input (36), in windows and chunks of 2 rows,
    so that every rank takes several chunks."""
    args = ["run", DEMO, *_sets(out, cache_dir)]
    if job_input is not None:
        args += ["--set", f"input.path={job_input}", "--set", "output.rows_per_part=16"]
    return main([*args, *extra])


def _sets(out: Path, cache_dir: str) -> list[str]:
    sets = [f"output.path={out}", f"runtime.cache_dir={cache_dir}", "runtime.workers=0", "runtime.progress=false",
            "output.dtype=float32", "batching.window=2"]
    return [arg for key in sets for arg in ("--set", key)]


def _read(out: Path) -> list[dict]:
    return pq.read_table(sorted(out.glob("part-*.parquet"))).to_pylist()


def _stats(out: Path) -> dict:
    return json.loads((out / "_embedjob/stats-00000.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cache_dir: str, skewed: Path) -> dict[str, Path]:
    """The single-process output of each input, the reference of every data-parallel run."""
    outs = {}
    for name, job_input in (("demo", None), ("skewed", skewed)):
        outs[name] = tmp_path_factory.mktemp(f"single-{name}")
        assert _run(job_input, outs[name], cache_dir) == 0
    return outs


def _assert_same_output(out: Path, reference: Path) -> None:
    """Same parts, rows, ids, errors; embeddings equal bit for bit (a CPU rank's item
    does not depend on what shares its batch)."""
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p.name for p in reference.glob("part-*"))
    manifest = json.loads((out / "_embedjob/manifest-00000.json").read_text())
    expected = json.loads((reference / "_embedjob/manifest-00000.json").read_text())
    assert [(p["first_row"], p["end_row"]) for p in manifest["parts"]] == [
        (p["first_row"], p["end_row"]) for p in expected["parts"]
    ]
    for got, want in zip(_read(out), _read(reference), strict=True):
        a, b = (np.array(r.pop("embedding"), dtype=np.float32) for r in (got, want))
        assert got == want
        assert np.array_equal(a, b, equal_nan=True), (want["row"], float(np.nanmax(np.abs(a - b))))


@pytest.mark.parametrize(("name", "ranks"), [("demo", 2), ("demo", 3), ("skewed", 2), ("skewed", 3)])
@pytest.mark.slow
def test_ranks_give_the_single_process_output_row_for_row(
    name: str, ranks: int, single: dict[str, Path], skewed: Path, tmp_path: Path, cache_dir: str, capsys
) -> None:
    job_input = skewed if name == "skewed" else None
    assert _run(job_input, tmp_path, cache_dir, "--gpus", str(ranks)) == 0
    _assert_same_output(tmp_path, single[name])
    stats, reference = _stats(tmp_path), _stats(single[name])
    assert (stats["rows"], stats["errors"]) == (reference["rows"], reference["errors"])
    assert stats["world_size"] == ranks and [r["rank"] for r in stats["ranks"]] == list(range(ranks))
    encoded = reference["graph_hits"] + reference["graph_misses"]
    assert stats["graph_hits"] + stats["graph_misses"] == encoded == sum(r["items"] for r in stats["ranks"])
    assert sum(r["rows"] for r in stats["ranks"]) == stats["rows"]
    # Each rank read and decoded its own rows: what it waited on says why a run is slow.
    busy = [r for r in stats["ranks"] if r["items"]]
    assert len(busy) >= 2 and all(r["decode_seconds"] > 0 and r["busy_seconds"] > 0 for r in busy)
    assert all({"waiting for decode", "waiting for a chunk"} <= set(r["waits"]) for r in busy)
    # A spawned rank's start (process and imports, then link and first chunk) is in its
    # setup, and inside the shard's setup, which runs until the last rank is ready.
    for r in (r for r in busy if r["rank"] > 0):
        assert r["setup"]["spawn"] > 0 and r["setup"]["join"] >= 0
        assert r["ready_at"] - stats["started_at"] <= stats["setup_seconds"] + 2e-3  # three values rounded to ms
    printed = re.search(r"(\d+) ranks, balance ratio ([\d.]+)", capsys.readouterr().err)
    assert printed and int(printed[1]) == ranks and float(printed[2]) == pytest.approx(stats["balance_ratio"], abs=1e-3)
    # The rate after setup leaves out what ranks ready first encoded during the others' setup.
    early = stats["rows_during_setup"]
    assert 0 <= early <= stats["rows_this_run"]
    # pipeline_seconds is rounded to the millisecond, the rate from the exact seconds.
    pipeline = stats["pipeline_seconds"]
    rates = [(stats["rows_this_run"] - early) / (pipeline + d) for d in (5e-4, -5e-4)]
    assert rates[0] - 1e-3 <= stats["items_per_second"] <= rates[1] + 1e-3


@pytest.mark.slow
def test_a_dying_rank_stops_the_job_with_one_line_and_a_rerun_resumes(
    single: dict[str, Path], tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:0")  # rank 1 exits when it is handed its first chunk
    start = time.monotonic()
    assert _run(None, tmp_path, cache_dir, "--gpus", "2", "--set", "output.rows_per_part=2") == 1
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("embedjob: failed: RankFailure: rank 1 of 2 ")
    assert f"exited with code {FAULT_EXIT_CODE}" in err and "rerun" in err
    manifest = json.loads((tmp_path / "_embedjob/manifest-00000.json").read_text())
    committed = [(p["first_row"], p["end_row"]) for p in manifest["parts"]]
    resumed = committed[-1][1] if committed else 0
    # Rows after the lost chunk wait for it and are not written: a gapless prefix. Which
    # chunk rank 1 drew depends on how many rank 0 took while rank 1 was starting.
    assert committed == [(row, row + 2) for row in range(0, resumed, 2)] and resumed < 12
    assert not (tmp_path / "_embedjob/_SUCCESS-00000").exists()

    monkeypatch.delenv(FAULT_ENV)
    assert _run(None, tmp_path, cache_dir, "--gpus", "2", "--set", "output.rows_per_part=2") == 0
    assert _stats(tmp_path)["resumed_from_row"] == resumed
    reference = tmp_path.parent / "reference"
    assert _run(None, reference, cache_dir, "--set", "output.rows_per_part=2") == 0
    _assert_same_output(tmp_path, reference)


@pytest.mark.slow
def test_idle_connections_to_rank_zero_during_start_up_hold_up_no_rank(
    single: dict[str, Path], tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Four idle connections to rank 0's port as the ranks started made a 2-rank run of
    6.7 s take 126 s: each held the rendezvous for 30 s, one after the other. Now rank 1
    joins as soon as it connects, and the output is whole."""
    strays: list[socket.socket] = []
    listen = cluster_module.listen_on_loopback

    def listen_and_crowd() -> socket.socket:
        listener = listen()
        strays.extend(socket.create_connection(listener.getsockname()) for _ in range(4))
        return listener

    monkeypatch.setattr(cluster_module, "listen_on_loopback", listen_and_crowd)
    try:
        assert _run(None, tmp_path, cache_dir, "--gpus", "2") == 0
    finally:
        for sock in strays:
            sock.close()
    assert len(strays) == 4
    _assert_same_output(tmp_path, single["demo"])
    join = _stats(tmp_path)["ranks"][1]["setup"]["join"]
    assert join < 20, join  # from its imports to its first chunk; 120 s and more before
    assert caplog.text.count("sent no handshake within 1s") == 4


@pytest.mark.slow
def test_a_stopped_rank_is_named_while_the_job_waits_and_the_job_ends_well_once_it_goes_on(
    single: dict[str, Path], tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank stopped (SIGSTOP) with a chunk in hand stalled the job for 30 minutes with
    no word. Now rank 0 names it, its pid, how long and the rows it holds; after SIGCONT
    it says the rank is back and the job finishes with every row."""
    monkeypatch.setattr(cluster_module, "SILENCE_LIMIT", 3.0)
    stopped: list[int] = []
    stop = threading.Event()
    take = Coordinator.take

    def take_then_stop(self: Coordinator, rank: int) -> Chunk | None:
        chunk = take(self, rank)
        if rank == 1 and chunk is not None and not stop.is_set():
            pid = next(p.pid for p in multiprocessing.active_children() if p.name == "embedjob-rank1")
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            stop.set()
        return chunk

    def go_on_once_named() -> None:
        if not stop.wait(120) or not stopped:
            return  # the run ended before rank 1 took a chunk
        deadline = time.monotonic() + 60
        while "has sent nothing" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(stopped[0], signal.SIGCONT)

    monkeypatch.setattr(Coordinator, "take", take_then_stop)
    waker = threading.Thread(target=go_on_once_named)
    waker.start()
    try:
        assert _run(None, tmp_path, cache_dir, "--gpus", "2") == 0
    finally:
        stop.set()
        waker.join()
    _assert_same_output(tmp_path, single["demo"])
    pid = stopped[0]
    named = re.search(
        rf"rank 1 of 2 \(pid {pid}\) has sent nothing, not even a heartbeat, for (\d+)s .*; it holds rows \d+-\d+",
        caplog.text,
    )
    assert named and int(named[1]) >= 3, caplog.text
    assert f"rank 1 of 2 (pid {pid}) is heard from again after" in caplog.text


def _sleeping_ranks(count: int, seconds: float) -> list[_Spawned]:
    """Ranks 1..count as rank 0 holds them, each a spawned process that sleeps and ends well."""
    context = multiprocessing.get_context("spawn")
    spawned = []
    for rank in range(1, count + 1):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=time.sleep, args=(seconds,))
        process.start()
        send.close()
        spawned.append(_Spawned(rank, process, receive))
    return spawned


def test_rank_zero_stops_watching_ranks_that_finished_instead_of_waking_on_them_over_and_over(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Other ranks end (exit 0) once the chunks run out, while rank 0 still encodes and
    writes its last ones; its watchdog had kept waiting on their sentinels, which stay
    ready, and woke at once over and over: a core and the GIL taken from rank 0 (with 8
    CPU ranks it encoded 130x slower). Now it stops watching ranks that finished, and
    the end of the job, which reaps them, says nothing of ranks that ended well."""
    wakes = []
    wait = multiprocessing.connection.wait

    def counted(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "embedjob-rank-watchdog":
            wakes.append(time.monotonic())
        return wait(*args, **kwargs)

    monkeypatch.setattr(multiprocessing.connection, "wait", counted)
    spawned = _sleeping_ranks(2, seconds=0.0)
    cluster = Cluster(Layout(3, 0, torch.device("cpu")), spawned)
    try:
        for s in spawned:  # without reaping them: that is the watchdog's, then close's
            assert multiprocessing.connection.wait([s.process.sentinel], timeout=60)
        ended = time.monotonic()
        time.sleep(1.5)
        assert len([t for t in wakes if t > ended]) <= 2  # one wake for the last exit, at most
    finally:
        cluster.close(ok=True)
    assert [s.process.exitcode for s in spawned] == [0, 0]
    assert "exited" not in caplog.text


def test_rank_zero_stops_its_watchdog_before_it_reaps_the_ranks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0's close reaps the ranks; a watchdog still waking on the same exits reaped
    them too, and whichever thread came second read no exit code: the job warned that a
    rank "exited with code 0 after the job finished". Close now stops the watchdog
    before it reaps, while the ranks still run."""
    from embedjob.parallel import cluster as cluster_module

    alive_at_reaping = []
    join = cluster_module._join

    def reap(spawned: list[_Spawned]) -> None:
        alive_at_reaping.extend(t.is_alive() for t in threading.enumerate() if t.name == "embedjob-rank-watchdog")
        assert all(s.process.exitcode is None for s in spawned)  # still running: the watchdog had work
        join(spawned)

    monkeypatch.setattr(cluster_module, "_join", reap)
    spawned = _sleeping_ranks(2, seconds=2.0)
    Cluster(Layout(3, 0, torch.device("cpu")), spawned).close(ok=True)
    assert alive_at_reaping == []
    assert [s.process.exitcode for s in spawned] == [0, 0]
    assert "exited" not in caplog.text


@pytest.mark.slow
def test_every_socket_the_ranks_listen_on_is_bound_to_loopback(tmp_path: Path, cache_dir: str) -> None:
    """Read from the kernel's socket table while a two-rank job runs: nothing of the
    job may be reachable from another machine."""
    command = [sys.executable, "-m", "embedjob.cli", "run", DEMO, *_sets(tmp_path / "out", cache_dir), "--gpus", "2"]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: set[str] = set()
    while job.poll() is None:
        seen |= _listening_addresses(_process_tree(job.pid))
        time.sleep(0.02)
    assert job.returncode == 0, job.stderr.read()
    assert seen, "the job was never seen listening"
    assert seen == {"127.0.0.1"}, seen


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets in state LISTEN that these processes hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                addresses.add(_address(fields[1].split(":")[0], width))
    return addresses


def _address(hexed: str, width: int) -> str:
    raw = bytes.fromhex(hexed)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    mapped = socket.inet_ntop(socket.AF_INET6, words)
    return mapped.removeprefix("::ffff:")


@pytest.mark.slow
def test_torchrun_ranks_give_the_single_process_output(single: dict[str, Path], tmp_path: Path, cache_dir: str) -> None:
    """Under torchrun every rank is started by it; rank 0 publishes its link through
    torchrun's store and the output is the single-process one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "embedjob.cli", "run", DEMO, *_sets(tmp_path, cache_dir)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_output(tmp_path, single["demo"])
    assert _stats(tmp_path)["world_size"] == 2


def test_gpus_beyond_the_visible_ones_or_torchruns_processes_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_layout("auto", torch.device("cuda")) == Layout(2, 0, torch.device("cuda", 0))
    with pytest.raises(JobError, match="runtime.gpus = 4 but only 2 CUDA devices are visible"):
        resolve_layout(4, torch.device("cuda"))
    assert resolve_layout("auto", torch.device("cpu")).world_size == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_layout("auto", torch.device("cuda")) == Layout(4, 3, torch.device("cuda", 1), launched=True)
    with pytest.raises(JobError, match="torchrun started 4 processes"):
        resolve_layout(2, torch.device("cuda"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(JobError, match="one node"):
        resolve_layout("auto", torch.device("cuda"))
