"""Captions beside pictures (issue #55): text embeddings, image-text scores and zero-shot
labels, for CLIP, SigLIP, MetaCLIP 2, SigLIP 2 and OpenCLIP full checkpoints.

Each test builds a tiny full checkpoint (random weights, fixed seed) with a tokenizer
trained here through `tokenizers` (or OpenCLIP's own), saves model, image processor and
tokenizer as a user's checkpoint is saved, and runs a Parquet of photos and captions
through `embedjob run` on the CPU: what a user's checkpoint goes through. The reference
is transformers' `get_text_features` on the tokenizer's own output, or OpenCLIP's
`encode_text` on its tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from caption_helpers import FAMILY_OF, LABELS, LENGTH, ROWS, SENTENCES, SIGLIP2_VISION, VISION, job, read, save_checkpoint

import embedjob
import embedjob.cli
from embedjob.captions import text_plan
from embedjob.config import JobError, job_from_dict
from embedjob.encoders import load_adapter
from embedjob.engine.graphs import GraphManager

CPU = torch.device("cpu")


def reference_text(family: str, model: Path, texts: list[str]) -> np.ndarray:
    """transformers' get_text_features on the tokenizer's output, one caption at a time
    (so unpadded for CLIP), tokenised as each model's documentation says: CLIP with its
    attention mask; SigLIP and SigLIP 2 padded to max_length and, as they were trained,
    without a mask over the padding (a mask would change their vectors). OpenCLIP:
    `encode_text` on its own tokenizer's ids for the checkpoint."""
    if family.startswith("open_clip"):
        return open_clip_reference(model, texts)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    classes = {
        "clip": transformers.CLIPModel, "metaclip2": transformers.MetaClip2Model, "siglip": transformers.SiglipModel,
        "siglip2": transformers.Siglip2Model,
    }
    full = classes[family].from_pretrained(model)
    rows = []
    with torch.no_grad():
        for text in texts:
            if family not in ("siglip", "siglip2"):
                inputs = tokenizer(text, truncation=True, max_length=LENGTH, return_tensors="pt")
            else:
                inputs = {"input_ids": tokenizer(text, padding="max_length", truncation=True, max_length=LENGTH, return_tensors="pt").input_ids}
            rows.append(full.get_text_features(**inputs).pooler_output[0].numpy())
    return np.stack(rows)


def open_clip_reference(model: Path, texts: list[str]) -> np.ndarray:
    """OpenCLIP's own `encode_text` (not normalised) on `get_tokenizer`'s ids, one caption
    at a time, for the checkpoint directory as OpenCLIP loads it."""
    import open_clip

    full = open_clip.create_model(f"local-dir:{model}", require_pretrained=True).eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{model}")
    with torch.no_grad():
        return np.stack([full.encode_text(tokenizer([text]))[0].numpy() for text in texts])


def relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(
    ("family", "workers", "normalize"),
    [
        ("clip", 1, False), ("siglip", 0, True), ("metaclip2", 0, False), ("siglip2", 0, True), ("open_clip", 1, False),
        ("open_clip_hf", 0, True),
    ],
)
def test_each_row_gets_its_captions_vector_score_and_label(tmp_path: Path, cache_dir: str, family: str, workers: int, normalize: bool) -> None:
    model = save_checkpoint(family, tmp_path / "model")
    raw = job(tmp_path, cache_dir, FAMILY_OF.get(family, family), model, output={"normalize": normalize}, runtime={"workers": workers})
    stats = embedjob.run(raw)
    table = read(tmp_path / "out")
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [f"r{k}" for k in range(len(ROWS))]
    assert table.schema.names == [
        "id", "row", "modality", "tokens", "frames", "embedding", "error", "text_embedding", "score", "label", "label_score"
    ]
    assert table.schema.field("text_embedding").type == pa.large_list(pa.float32())
    assert table.schema.field("score").type == pa.float32()
    captioned = [k for k, (_, caption) in enumerate(ROWS) if caption is not None]
    reference = reference_text(family, model, [ROWS[k][1] for k in captioned])
    for k, ref in zip(captioned, reference):
        ours = np.array(rows[k]["text_embedding"], dtype=np.float32)
        expected = ref / np.linalg.norm(ref) if normalize else ref
        assert relative(ours, expected) < 1e-3, f"row {k}"
    for k, row in enumerate(rows):
        if row["error"] is None and row["text_embedding"] is not None:
            assert row["score"] == pytest.approx(cosine(np.array(row["embedding"]), np.array(row["text_embedding"])), abs=1e-5)
    null_caption, broken = rows[1], rows[2]
    assert null_caption["text_embedding"] is None and null_caption["score"] is None
    assert null_caption["embedding"] is not None and null_caption["error"] is None
    assert broken["error"] is not None and broken["embedding"] is None
    assert broken["text_embedding"] is not None and broken["score"] is None
    assert broken["label"] is None and broken["label_score"] is None
    prompts = reference_text(family, model, LABELS)
    for row in rows:
        if row["embedding"] is None:
            continue
        similarities = [cosine(np.array(row["embedding"]), p) for p in prompts]
        assert row["label"] == LABELS[int(np.argmax(similarities))]
        assert row["label_score"] == pytest.approx(max(similarities), abs=1e-5)
    described = json.loads(table.schema.metadata[b"embedjob"])
    assert described["text_column"] == "caption" and described["labels"] == LABELS
    text = stats["text"]
    assert text["graph_hits"] == len(captioned) and text["graph_misses"] == 0
    assert all(budget % LENGTH == 0 for budget in text["token_budgets"])


def test_the_caption_column_is_read_but_copied_only_when_asked(tmp_path: Path, cache_dir: str) -> None:
    model = save_checkpoint("clip", tmp_path / "model")
    embedjob.run(job(tmp_path, cache_dir, "clip", model, output={"labels": []}))
    table = read(tmp_path / "out")
    assert "caption" not in table.schema.names and "label" not in table.schema.names
    assert table.column("score").null_count == 2  # the null caption and the broken image
    # Windows of 2 rows and parts of 4: the caption columns are cut and joined with the rows.
    copied = job(
        tmp_path, cache_dir, "clip", model, output={"labels": [], "columns": ["caption"], "path": str(tmp_path / "copied"), "rows_per_part": 4},
        batching={"window": 2},
    )
    embedjob.run(copied)
    assert len(list((tmp_path / "copied").glob("part-*.parquet"))) == 2
    again = read(tmp_path / "copied")
    assert again.column("caption").to_pylist() == [c for _, c in ROWS]
    for before, after in zip(table.column("text_embedding").to_pylist(), again.column("text_embedding").to_pylist()):
        assert (before is None) == (after is None)
        assert before is None or np.allclose(before, after, rtol=1e-5, atol=1e-6)
    assert again.column("score").null_count == 2


def test_labels_alone_label_every_image_without_a_caption_column(tmp_path: Path, cache_dir: str) -> None:
    model = save_checkpoint("siglip", tmp_path / "model")
    raw = job(tmp_path, cache_dir, "siglip", model)
    raw["input"]["text_column"] = None
    stats = embedjob.run(raw)
    table = read(tmp_path / "out")
    assert "text_embedding" not in table.schema.names and "score" not in table.schema.names
    assert table.column("label").to_pylist()[2] is None
    assert all(label in LABELS for k, label in enumerate(table.column("label").to_pylist()) if k != 2)
    assert "text" not in stats


def test_a_rerun_with_another_caption_setting_is_refused(tmp_path: Path, cache_dir: str) -> None:
    model = save_checkpoint("clip", tmp_path / "model")
    embedjob.run(job(tmp_path, cache_dir, "clip", model))
    with pytest.raises(JobError, match="different job.*labels") as refused:
        embedjob.run(job(tmp_path, cache_dir, "clip", model, output={"labels": LABELS[:2]}))
    assert "\n" not in str(refused.value)


def test_a_checkpoint_without_a_text_tower_or_tokenizer_stops_before_any_row(tmp_path: Path, cache_dir: str) -> None:
    vision_only = tmp_path / "vision"
    torch.manual_seed(0)
    transformers.CLIPVisionModelWithProjection._from_config(transformers.CLIPVisionConfig(**VISION, projection_dim=24)).save_pretrained(vision_only)
    transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(vision_only)
    no_tokenizer = save_checkpoint("siglip", tmp_path / "no-tokenizer", tokenizer=False)
    siglip2_vision = tmp_path / "siglip2-vision"
    transformers.Siglip2VisionModel._from_config(transformers.Siglip2VisionConfig(**SIGLIP2_VISION)).save_pretrained(siglip2_vision)
    transformers.Siglip2ImageProcessor(patch_size=8, max_num_patches=96).save_pretrained(siglip2_vision)
    # OpenCLIP reads a Hugging Face tokenizer its config names from the checkpoint directory.
    open_clip_no_tokenizer = save_checkpoint("open_clip_hf", tmp_path / "open-clip-no-tokenizer", tokenizer=False)
    cases = [
        ("clip", vision_only, "vision-only"), ("siglip", no_tokenizer, "no tokenizer"), ("siglip2", siglip2_vision, "vision-only"),
        ("open_clip", open_clip_no_tokenizer, "no tokenizer (tokenizer.json or tokenizer_config.json) for its text_cfg's hf_tokenizer_name"),
    ]
    for family, model, says in cases:
        raw = job(tmp_path, cache_dir, family, model, output={"path": str(tmp_path / f"out-{family}")})
        with pytest.raises(JobError) as refused:
            embedjob.run(raw)
        message = str(refused.value)
        assert says in message and "\n" not in message
        assert not list((tmp_path / f"out-{family}").glob("part-*.parquet"))


def test_an_open_clip_text_tower_the_tokenizer_overruns_or_of_hugging_faces_is_one_line(tmp_path: Path, cache_dir: str) -> None:
    """OpenCLIP's default tokenizer gives ids up to 49407: a text tower embedding fewer
    would fail on the device mid-run, so it stops at load; a text tower that is not
    OpenCLIP's own transformer (a Hugging Face one) is named."""
    import open_clip
    from caption_helpers import OPEN_CLIP_PREPROCESS, OPEN_CLIP_VISION

    from embedjob.encoders.open_clip import save_checkpoint as save_open_clip_checkpoint
    from embedjob.encoders.open_clip import text_module

    model_cfg = {"embed_dim": 24, "vision_cfg": OPEN_CLIP_VISION, "text_cfg": {"context_length": LENGTH, "vocab_size": 128, "width": 32, "heads": 2, "layers": 1}}
    small = tmp_path / "small-vocabulary"
    small.mkdir()
    save_open_clip_checkpoint(open_clip.CLIP(**model_cfg), model_cfg, OPEN_CLIP_PREPROCESS, small)
    with pytest.raises(JobError, match="its tokenizer has 49408 tokens and its text tower embeds 128") as refused:
        embedjob.run(job(tmp_path, cache_dir, "open_clip", small))
    assert "\n" not in str(refused.value)
    custom = open_clip.create_model(f"local-dir:{save_checkpoint('open_clip_hf', tmp_path / 'custom')}")
    assert text_module(custom, tmp_path) is custom.text
    custom.text = torch.nn.Identity()
    with pytest.raises(ValueError, match="its text tower is a Identity; captions and labels run OpenCLIP's own text transformer"):
        text_module(custom, tmp_path)


def test_the_builtin_open_clip_model_captions_with_open_clips_default_tokenizer(tmp_path: Path, cache_dir: str) -> None:
    """`builtin:tiny-open_clip` has a text tower of OpenCLIP's default tokenizer (77
    tokens), so the demo embeds captions and labels: OpenCLIP's own vectors."""
    raw = job(tmp_path, cache_dir, "open_clip", "builtin:tiny-open_clip")
    stats = embedjob.run(raw)
    rows = read(tmp_path / "out").to_pylist()
    captioned = [k for k, (_, caption) in enumerate(ROWS) if caption is not None]
    reference = open_clip_reference(Path(cache_dir) / "builtin" / "tiny-open_clip-v1", [ROWS[k][1] for k in captioned])
    for k, ref in zip(captioned, reference):
        assert relative(np.array(rows[k]["text_embedding"], dtype=np.float32), ref) < 1e-3, f"row {k}"
    assert rows[0]["score"] == pytest.approx(cosine(np.array(rows[0]["embedding"]), np.array(rows[0]["text_embedding"])), abs=1e-5)
    assert all(row["label"] in LABELS for row in rows if row["error"] is None)
    assert stats["text"]["token_budgets"][0] == 77


def test_the_captions_demo_job_gives_the_parquet_demos_vectors_with_each_tars_caption(tmp_path: Path, cache_dir: str) -> None:
    """`jobs/demo-captions.yaml` reads the demo's photos from a WebDataset tar with their
    captions: each row's image vector is the one the same photo gets from the Parquet
    demo, its caption the tar's `txt` member with OpenCLIP's own text vector, the photo
    without a caption keeps its vector, and the two broken files keep their captions'
    error rows."""
    import tarfile

    from caption_helpers import REPO

    common = ["--set", f"runtime.cache_dir={cache_dir}", "--set", "runtime.workers=0", "--set", "output.dtype=float32"]
    tar_out, parquet_out = tmp_path / "tar", tmp_path / "parquet"
    assert embedjob.cli.main(["run", str(REPO / "jobs" / "demo-captions.yaml"), "--set", f"output.path={tar_out}", *common]) == 0
    parquet = ["--set", "input.format=parquet", "--set", "input.path=" + str(REPO / "jobs" / "data" / "demo-images.parquet"),
               "--set", "input.media_column=image", "--set", "input.id_column=id", "--set", "input.text_column=null",
               "--set", "output.columns=[]", "--set", "output.labels=[]"]
    assert embedjob.cli.main(["run", str(REPO / "jobs" / "demo-captions.yaml"), "--set", f"output.path={parquet_out}", *parquet, *common]) == 0
    tar_rows, parquet_rows = read(tar_out).to_pylist(), read(parquet_out).to_pylist()
    assert [r["id"] for r in tar_rows] == [r["id"] for r in parquet_rows]
    assert [r["embedding"] for r in tar_rows] == [r["embedding"] for r in parquet_rows]
    with tarfile.open(REPO / "jobs" / "data" / "demo-images.tar") as tar:
        captions = {m.name.removesuffix(".txt"): tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")}
    assert [r["txt"] for r in tar_rows] == [captions.get(r["id"]) for r in tar_rows]
    captioned = [r for r in tar_rows if r["txt"] is not None]
    reference = open_clip_reference(Path(cache_dir) / "builtin" / "tiny-open_clip-v1", [r["txt"] for r in captioned])
    for row, ref in zip(captioned, reference):
        assert relative(np.array(row["text_embedding"], dtype=np.float32), ref) < 1e-3, row["id"]
    uncaptioned = [r for r in tar_rows if r["txt"] is None and r["error"] is None]
    assert uncaptioned and all(r["embedding"] is not None and r["text_embedding"] is None for r in uncaptioned)
    broken = [r for r in tar_rows if r["error"] is not None]
    assert len(broken) == 2 and all(r["score"] is None and r["label"] is None for r in broken)


def test_a_caption_column_the_input_lacks_or_that_holds_no_strings_stops_before_any_work(tmp_path: Path, cache_dir: str) -> None:
    model = save_checkpoint("clip", tmp_path / "model")
    raw = job(tmp_path, cache_dir, "clip", model)
    raw["input"]["text_column"] = "title"
    with pytest.raises(JobError, match="input.text_column 'title' is not a column"):
        embedjob.run(raw)
    table = pq.read_table(tmp_path / "in.parquet")
    pq.write_table(table.append_column("likes", pa.array(range(len(ROWS)))), tmp_path / "likes.parquet")
    raw["input"].update(path=str(tmp_path / "likes.parquet"), text_column="likes")
    with pytest.raises(JobError, match="input.text_column 'likes' of .* holds int64, not strings"):
        embedjob.run(raw)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"model": {"family": "dinov2", "path": "builtin:tiny-dinov2"}}, "needs a model with a text tower"),
        ({"output": {"pooling": "none"}}, "output.pooling = 'none'"),
        ({"preprocess": {"tiling": "anyres"}}, "tile_combine = 'concat'"),
        ({"output": {"labels": ["a cat", "a cat"]}}, "more than once"),
        ({"output": {"labels": ["a cat", " "]}}, "empty prompt"),
        ({"input": {"text_column": "image"}}, "is the media or id column"),
    ],
)
def test_a_job_spec_captions_cannot_serve_is_one_line_naming_what_to_change(changes: dict, says: str) -> None:
    raw = {
        "input": {"path": "in.parquet", "media_column": "image", "text_column": "caption"},
        "model": {"family": "clip", "path": "builtin:tiny-clip"},
        "output": {"path": "out", "labels": ["a cat"]},
    }
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(JobError, match=says) as refused:
        job_from_dict(raw)
    assert "\n" not in str(refused.value)


def test_text_graphs_replay_what_the_tower_computes_eagerly(tmp_path: Path, cache_dir: str) -> None:
    model = save_checkpoint("clip", tmp_path / "model")
    raw = job(tmp_path, cache_dir, "clip", model)
    text = load_adapter(job_from_dict(raw), CPU).text
    plan = text_plan(text)
    assert plan.token_budgets[0] == LENGTH and plan.token_budgets[-1] == LENGTH * 256
    manager = GraphManager(text, plan, "replay")
    manager.capture()
    items = [text.preprocessor()(caption) for caption in SENTENCES[:3]]
    replayed = torch.cat(manager.run(items, 4 * LENGTH))
    padded = text.forward(manager.padded_inputs(items, 4 * LENGTH))[:3]
    eager = text.forward(text.eager_inputs(items))
    assert torch.equal(replayed, padded)
    assert torch.allclose(replayed, eager, rtol=1e-5, atol=1e-6)
    assert replayed.shape == (3, text.embed_dim) == (3, 24)


def test_caption_columns_cross_to_rank_0_and_are_cut_and_joined_with_their_rows() -> None:
    """A rank's row block, caption columns included, pickled as the rank link sends it,
    then cut at a part's end and joined again, writes the table it started as."""
    from embedjob.io.writer import RowBlock, block_to_table, output_schema
    from embedjob.workers import wire

    vectors = pa.LargeListArray.from_arrays(pa.array([0, 2, 2, 4]), pa.array([1.0, 2.0, 3.0, 4.0], type=pa.float32()), mask=pa.array([False, True, False]))
    block = RowBlock(
        10, ["a", "b", "c"], ["image"] * 3, [4] * 3, [0] * 3, [None] * 3, np.ones(3, dtype=np.int64), np.ones((3, 2), dtype=np.float32),
        digests=np.zeros((3, 16), dtype=np.uint8),
        computed={"text_embedding": vectors, "score": pa.array([0.5, None, -0.25], type=pa.float32())},
    )
    payload, buffers = wire.pickled(block)
    received = wire.unpickle(memoryview(payload), [np.frombuffer(b, dtype=np.uint8) for b in buffers])
    joined = RowBlock.concat([received.slice(0, 1), received.slice(1, 3)])
    schema = output_schema(pa.string(), "mean", "float32", computed={"text_embedding": pa.large_list(pa.float32()), "score": pa.float32()})
    table = block_to_table(joined, schema)
    assert table.column("text_embedding").to_pylist() == [[1.0, 2.0], None, [3.0, 4.0]]
    assert table.column("score").to_pylist() == [0.5, None, -0.25]
    assert joined.nbytes == block.vectors.nbytes + vectors.nbytes + block.computed["score"].nbytes


def test_a_webdataset_samples_txt_member_is_its_caption(tmp_path: Path, cache_dir: str) -> None:
    """`input.format: webdataset` with `text_column: txt`: a sample's caption is its txt
    member (a sample without one has a null text_embedding), embedded as from Parquet;
    a member extension no sample has stops the job naming input.text_column."""
    import io
    import tarfile

    model = save_checkpoint("clip", tmp_path / "model")
    photo = (Path(__file__).parent / "data" / "img2dataset_123_456.jpg").read_bytes()
    samples = [("00000", "a photo of a cat"), ("00001", None), ("00002", " ".join(SENTENCES))]
    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "00000.tar", "w") as tar:
        for key, text in samples:
            for name, data in [(f"{key}.jpg", photo), *([(f"{key}.txt", text.encode())] if text is not None else [])]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    raw = job(tmp_path, cache_dir, "clip", model, output={"labels": []})
    raw["input"] = {"path": str(tmp_path / "tars"), "format": "webdataset", "media_column": "jpg", "text_column": "txt"}
    embedjob.run(raw)
    rows = read(tmp_path / "out").to_pylist()
    assert [r["id"] for r in rows] == [key for key, _ in samples] and all(r["error"] is None for r in rows)
    assert rows[1]["text_embedding"] is None and rows[1]["score"] is None
    reference = reference_text("clip", model, [samples[0][1], samples[2][1]])
    for row, ref in zip([rows[0], rows[2]], reference):
        assert relative(np.array(row["text_embedding"], dtype=np.float32), ref) < 1e-3
    raw["input"]["text_column"] = "caption"
    raw["output"]["path"] = str(tmp_path / "refused")
    with pytest.raises(JobError, match="input.text_column 'caption' is no member extension"):
        embedjob.run(raw)


@pytest.mark.parametrize("family", ["siglip", "siglip2"])
def test_siglip_text_towers_attend_without_a_mask_whatever_transformers_decides_about_one(
    tmp_path: Path, cache_dir: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some transformers versions build SigLIP's all-True text mask while a CUDA graph is
    captured but not in an eager run, so the graph held another attention kernel than the
    eager run took and the two differed in their last bits. Made to build it here (as under
    capture), transformers' own model gets the mask; our text tower's attention gets none,
    and its vectors stay transformers' eager ones, bit for bit."""
    import transformers.masking_utils as masking

    from embedjob.encoders.text import IDS_KEY

    model = save_checkpoint(family, tmp_path / "model")
    text = load_adapter(job_from_dict(job(tmp_path, cache_dir, family, model)), CPU).text
    inputs = text.eager_inputs([text.preprocessor()(caption) for caption in SENTENCES[:3]])
    classes = {"siglip": transformers.SiglipModel, "siglip2": transformers.Siglip2Model}
    full = classes[family].from_pretrained(model)
    with torch.no_grad():
        reference = full.get_text_features(input_ids=inputs.tensors[IDS_KEY].long()).pooler_output

    def masks_seen(tower: torch.nn.Module, run) -> list:
        seen: list = []
        hooks = [
            layer.self_attn.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
            for layer in tower.encoder.layers
        ]
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    monkeypatch.setattr(masking, "_ignore_bidirectional_mask_sdpa", lambda *args, **kwargs: False)
    with torch.no_grad():
        theirs = masks_seen(full.text_model, lambda: full.get_text_features(input_ids=inputs.tensors[IDS_KEY].long()))
        ours: list[torch.Tensor] = []
        mine = masks_seen(text.tower.model, lambda: ours.append(text.forward(inputs)))
    assert len(theirs) == 2 and all(mask is not None for mask in theirs), "the test no longer makes transformers build the mask"
    assert mine == [None, None]
    assert torch.equal(ours[0], reference)


@pytest.mark.parametrize(("kind", "compiled"), [("clip", False), ("siglip", True), ("siglip2", True), ("open_clip", False)])
def test_batching_compile_compiles_the_text_towers_that_attend_without_a_mask(
    tmp_path: Path, cache_dir: str, kind: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """batching.compile on a GPU compiles the image tower, and the text tower too where its
    attention takes no mask (SigLIP, SigLIP 2): its captions then run compiled blocks as the
    images do. CLIP's causal and OpenCLIP's text towers stay uncompiled, since their
    compiled blocks invalidated the capture of their graphs."""
    if kind == "open_clip":
        pytest.importorskip("open_clip")
    from embedjob.encoders.base import EncoderAdapter
    from embedjob.pipeline import compile_if_asked

    model = save_checkpoint(kind, tmp_path / "model")
    spec = job_from_dict(job(tmp_path, cache_dir, FAMILY_OF.get(kind, kind), model, batching={"compile": True}))
    adapter = load_adapter(spec, CPU)
    compiled_towers: list[EncoderAdapter] = []
    monkeypatch.setattr(EncoderAdapter, "compile", lambda self, dynamic: compiled_towers.append(self))
    adapter.device = torch.device("cuda")  # compile_if_asked compiles for CUDA only; nothing runs here
    compile_if_asked(spec, adapter)
    assert compiled_towers == ([adapter, adapter.text] if compiled else [adapter])
