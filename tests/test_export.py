"""`embedjob export` on the CPU: the npy layout holds the output's vectors in order,
bit for bit in the dtype written, error rows left out, with metadata files that line up
row for row; a faiss index reports its recall@10 (exact below the flat limit, an
inverted file above); an unfinished output is refused unless --partial, and so are a
per-token output, a destination that holds files and a missing faiss."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_shards import DEMO

from embedjob.cli import main
from embedjob.io.export import build_index, recall_at_k



def write_input(path: Path, copies: int) -> Path:
    """The demo's photos and broken rows `copies` times, with a caption column to carry."""
    demo = pq.read_table(REPO / "jobs" / "data" / "demo-images.parquet").to_pylist()
    rows = [{"id": f"{r['id']}#{k}", "image": r["image"], "caption": f"photo {n}"} for k in range(copies) for n, r in enumerate(demo)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    return path


def run(inputs: Path, out: Path, cache_dir: str, *extra: str) -> None:
    settings = {
        "input.path": inputs,
        "preprocess.max_pixels": 112 * 112,
        "output.path": out,
        "output.rows_per_part": 5,
        "output.columns": "[caption]",
        "runtime.workers": 0,
        "runtime.progress": "false",
        "runtime.cache_dir": cache_dir,
    }
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    assert main(["run", DEMO, *args, *extra]) == 0


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory, cache_dir: str) -> Path:
    """A finished float16 output of 24 rows, 4 of them errors, over two shards."""
    base = tmp_path_factory.mktemp("export")
    inputs = write_input(base / "in.parquet", copies=2)
    out = base / "out"
    for shard in ("0/2", "1/2"):
        run(inputs, out, cache_dir, "--shard", shard)
    return out


def output_rows(out: Path) -> list[dict]:
    files = sorted(out.glob("part-*.parquet"))
    return pq.read_table(files).to_pylist()


def test_npy_holds_the_outputs_vectors_in_order_without_error_rows(output: Path, tmp_path: Path) -> None:
    dest = tmp_path / "npy"
    assert main(["export", str(output), str(dest), "--rows-per-file", "7"]) == 0
    rows = output_rows(output)
    kept = [r for r in rows if r["error"] is None]
    assert len(rows) == 24 and len(kept) == 20
    arrays = [np.load(p) for p in sorted((dest / "embeddings").glob("*.npy"))]
    tables = [pq.read_table(p) for p in sorted((dest / "metadata").glob("*.parquet"))]
    assert [len(a) for a in arrays] == [t.num_rows for t in tables] == [7, 7, 6]
    vectors = np.concatenate(arrays)
    assert vectors.dtype == np.float16
    assert np.array_equal(vectors, np.array([r["embedding"] for r in kept], dtype=np.float16))
    metadata = pa.concat_tables(tables)
    assert metadata.column_names == ["row", "id", "caption"]
    assert metadata.to_pylist() == [{"row": r["row"], "id": r["id"], "caption": r["caption"]} for r in kept]


def test_faiss_index_reports_recall_and_lines_up_with_its_metadata(output: Path, tmp_path: Path, capsys) -> None:
    faiss = pytest.importorskip("faiss")
    dest = tmp_path / "index"
    assert main(["export", str(output), str(dest), "--format", "faiss"]) == 0
    assert "recall@10 1.000 on 20 sampled vectors against exact search" in capsys.readouterr().err
    index = faiss.read_index(str(dest / "index.faiss"))
    metadata = pq.read_table(sorted((dest / "metadata").glob("*.parquet"))).to_pylist()
    kept = [r for r in output_rows(output) if r["error"] is None]
    assert index.ntotal == len(metadata) == len(kept) and not (dest / "embeddings").exists()
    query = np.array([kept[3]["embedding"]], dtype=np.float32)
    faiss.normalize_L2(query)
    _, found = index.search(query, 1)
    assert metadata[int(found[0, 0])]["id"] == kept[3]["id"]


def test_an_inverted_file_above_the_flat_limit_finds_most_true_neighbours() -> None:
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(7)
    centres = rng.normal(size=(40, 32))
    vectors = (centres[rng.integers(0, 40, 6000)] + 0.3 * rng.normal(size=(6000, 32))).astype(np.float32)
    index, description = build_index(faiss, vectors, flat_limit=1000)
    assert description.startswith("IVF")
    recall, queries = recall_at_k(faiss, index, vectors)
    assert queries == 1000 and recall >= 0.9


def test_an_unfinished_output_is_refused_unless_partial(output: Path, tmp_path: Path, capsys) -> None:
    unfinished = tmp_path / "out"
    shutil.copytree(output, unfinished)
    (unfinished / "_embedjob" / "_SUCCESS-00001").unlink()
    capsys.readouterr()
    assert main(["export", str(unfinished), str(tmp_path / "refused")]) == 2
    assert "is not finished: 1 shard of 2 (1) have not finished" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main(["export", str(unfinished), str(tmp_path / "partial"), "--partial"]) == 0
    assert np.load(tmp_path / "partial" / "embeddings" / "0000.npy").shape[0] == 20


def test_a_damaged_part_is_refused_naming_it(output: Path, tmp_path: Path, capsys) -> None:
    damaged = tmp_path / "out"
    shutil.copytree(output, damaged)
    part = sorted(damaged.glob("part-*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    capsys.readouterr()
    assert main(["export", str(damaged), str(tmp_path / "dest")]) == 1
    assert f"{part.name} does not match its recorded sha256" in capsys.readouterr().err


def test_bad_destinations_and_a_missing_faiss_are_one_line_each(
    output: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["export", str(output), str(full)]) == 2
    assert "holds files; name a new or empty directory" in capsys.readouterr().err
    assert main(["export", str(output), str(output / "export")]) == 2
    assert "lies inside the output" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "faiss", None)
    assert main(["export", str(output), str(tmp_path / "index"), "--format", "faiss"]) == 2
    assert "pip install 'embedjob[index]'" in capsys.readouterr().err


def test_a_per_token_output_is_refused(tmp_path: Path, cache_dir: str, capsys) -> None:
    out = tmp_path / "tokens"
    run(write_input(tmp_path / "in.parquet", copies=1), out, cache_dir, "--set", "output.pooling=none")
    capsys.readouterr()
    assert main(["export", str(out), str(tmp_path / "dest")]) == 2
    assert "holds a vector per token (output.pooling: none)" in capsys.readouterr().err
    assert not (tmp_path / "dest").exists()
