"""OpenCLIP checkpoints (`model.family: open_clip`): what `embedjob run` writes equals
`model.encode_image(preprocess(image))` from open_clip itself on real photos, the
family is told from `open_clip_config.json`, a missing package stops the job with the
extra to install, hub checkpoints fetch only their config and weights, and the
fixed-resolution machinery (budgets, replay, FP8, per-token rows) holds for the tower."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_job, random_image, random_video
from engine_helpers import padded_eager
from PIL import Image

from embedjob.cli import main
from embedjob.config import JobError
from embedjob.encoders import load_adapter
from embedjob.encoders.registry import family_of
from embedjob.engine.graphs import GraphManager
from embedjob.engine.packer import BudgetPlan

from embedjob.encoders.open_clip import WEIGHTS, save_checkpoint

CPU = torch.device("cpu")
PHOTOS = sorted((REPO / "tests" / "data").glob("img2dataset_*.jpg"))
TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
VISION = {"image_size": 80, "patch_size": 16, "width": 64, "head_width": 16, "layers": 2, "mlp_ratio": 2.0}
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def without_package(test):
    """Marks a test that runs where open_clip_torch is not installed."""
    test.runs_without_open_clip = True
    return test


@pytest.fixture(autouse=True)
def needs_open_clip(request: pytest.FixtureRequest) -> None:
    """Every test but the `without_package` ones needs open_clip_torch (skipped where it is absent)."""
    if not getattr(request.function, "runs_without_open_clip", False):
        pytest.importorskip("open_clip")


def user_checkpoint(directory: Path, vision: dict | None = None, preprocess: dict | None = None, seed: int = 0, **model: object) -> Path:
    """An OpenCLIP model of random weights (fixed seed) saved in the layout of a hub repository."""
    import open_clip

    model_cfg = {"embed_dim": 40, "vision_cfg": {**VISION, **(vision or {})}, "text_cfg": TEXT, **model}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = open_clip.CLIP(**model_cfg)
    directory.mkdir(parents=True)
    save_checkpoint(clip, model_cfg, {**IMAGENET, **(preprocess or {})}, directory)
    return directory


def config_only(directory: Path) -> Path:
    """A directory holding only what tells a checkpoint's family: its open_clip_config.json."""
    directory.mkdir(parents=True)
    model_cfg = {"embed_dim": 40, "vision_cfg": VISION, "text_cfg": TEXT}
    (directory / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": IMAGENET}))
    return directory


def reference(directory: Path) -> tuple[torch.nn.Module, object]:
    """What an OpenCLIP user gets from the same directory: the model and its inference transform."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{directory}")
    return model.eval(), preprocess


def job(cache_dir: str, path: Path | str, **sections: dict):
    return make_job(cache_dir, model={"family": "open_clip", "path": str(path), **sections.pop("model", {})}, **sections)


def decoded(path: Path) -> SimpleNamespace:
    return SimpleNamespace(pixels=np.array(Image.open(path).convert("RGB")))


def relative(ours: torch.Tensor, ref: torch.Tensor) -> list[float]:
    return [float((a - b).norm() / b.norm()) for a, b in zip(ours, ref, strict=True)]


def test_embedjob_run_writes_open_clips_encode_image_for_every_photo(tmp_path: Path, cache_dir: str) -> None:
    """The contract: a user's checkpoint run through `embedjob run` (family left out) in
    float32 on the CPU gives every photo the vector open_clip gives it, and the row of a
    broken file is an error row."""
    checkpoint = user_checkpoint(tmp_path / "ckpt", {"image_size": 96}, {"interpolation": "bicubic"}, quick_gelu=True)
    media = [p.read_bytes() for p in PHOTOS] + [b"not an image"]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(media))], "image": media}), tmp_path / "in.parquet")
    spec = {
        "input": {"path": str(tmp_path / "in.parquet"), "media_column": "image", "id_column": "id"},
        "model": {"path": str(checkpoint)},
        "output": {"path": str(tmp_path / "out"), "dtype": "float32"},
        "runtime": {"cache_dir": cache_dir, "workers": 1, "progress": False},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(spec))
    assert main(["run", str(tmp_path / "job.yaml")]) == 0
    rows = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))).to_pylist()
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(media))]
    assert rows[-1]["error"] is not None and rows[-1]["embedding"] is None
    assert all(r["error"] is None and r["tokens"] == 37 for r in rows[:-1])
    ours = torch.tensor([r["embedding"] for r in rows[:-1]])
    model, preprocess = reference(checkpoint)
    with torch.no_grad():
        want = model.encode_image(torch.stack([preprocess(Image.open(p)) for p in PHOTOS]))
    assert ours.shape == want.shape == (len(PHOTOS), 40)
    assert max(relative(ours, want)) < 1e-3


@pytest.mark.parametrize(
    "preprocess",
    [
        {"resize_mode": "shortest", "interpolation": "bicubic"},
        {"resize_mode": "shortest", "interpolation": "bilinear"},
        {"resize_mode": "longest", "interpolation": "bicubic", "fill_color": 0},
        {"resize_mode": "longest", "interpolation": "bilinear", "fill_color": 200},
        {"resize_mode": "squash", "interpolation": "bicubic"},
    ],
)
@pytest.mark.parametrize("image_size", [80, [64, 96]])
def test_model_input_is_open_clips_transform_of_the_picture(tmp_path: Path, cache_dir: str, preprocess: dict, image_size) -> None:
    """Every resize mode, filter and fill, on square and oblong inputs: the views the
    workers make, normalised as the device does, are open_clip's transform of the same
    picture to float rounding (the resize is PIL's, as open_clip's is). A strip that
    open_clip's longest mode resizes to nothing still gives a view."""
    checkpoint = user_checkpoint(tmp_path / "ckpt", {"image_size": image_size}, preprocess)
    adapter = load_adapter(job(cache_dir, checkpoint), CPU)
    _, transform = reference(checkpoint)
    pictures = [np.array(Image.open(p).convert("RGB")) for p in PHOTOS]
    pictures += [random_image(h, w, seed).pixels for seed, (h, w) in enumerate([(5, 900), (31, 30), (64, 96), (80, 80), (97, 41)])]
    processing = adapter.preprocessor()
    for picture in pictures:
        views = processing(SimpleNamespace(pixels=picture)).tensors["pixel_values"]
        ours = processing.normalize(views)[0]
        try:
            want = transform(Image.fromarray(picture))
        except ValueError:  # PIL: "height and width must be > 0"
            assert preprocess["resize_mode"] == "longest" and picture.shape[:2] == (5, 900)
            assert views.shape == (1, 3, *processing.input_size) and torch.isfinite(ours).all()
            continue
        assert ours.shape == want.shape and torch.allclose(ours, want, atol=1e-5, rtol=0), picture.shape


@without_package
def test_the_family_is_told_from_open_clip_config_json_or_an_hf_hub_id(tmp_path: Path) -> None:
    checkpoint = config_only(tmp_path / "ckpt")
    assert family_of(str(checkpoint)) == "open_clip"
    assert family_of("hf-hub:laion/CLIP-ViT-H-14-laion2B-s32B-b79K") == "open_clip"
    both = tmp_path / "both"
    both.mkdir()
    (both / "open_clip_config.json").write_text((checkpoint / "open_clip_config.json").read_text())
    (both / "config.json").write_text(json.dumps({"model_type": "clip"}))
    assert family_of(str(both)) == "clip"  # a transformers checkpoint beside it is the transformers family


@without_package
def test_a_job_naming_open_clip_without_the_package_stops_with_the_extra_to_install(
    tmp_path: Path, cache_dir: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = config_only(tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "open_clip", None)  # `import open_clip` fails, as where it is not installed
    with pytest.raises(JobError, match=r"pip install 'embedjob\[open_clip\]'"):
        make_job(cache_dir, model={"path": str(checkpoint)})
    pq.write_table(pa.table({"image": [PHOTOS[0].read_bytes()]}), tmp_path / "in.parquet")
    args = ["run", str(REPO / "jobs" / "demo-clip.yaml"), "--set", f"input.path={tmp_path / 'in.parquet'}",
            "--set", "model.family=open_clip", "--set", f"model.path={checkpoint}", "--set", f"output.path={tmp_path / 'out'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'embedjob[open_clip]'" in err
    assert not (tmp_path / "out").exists()


def fake_hub(monkeypatch: pytest.MonkeyPatch, repo: Path, snapshot: Path) -> list[str]:
    """`hf_hub_download` served from `repo` into `snapshot` (a 404 for a file it lacks); the names asked for."""
    import httpx2
    from huggingface_hub.errors import RemoteEntryNotFoundError

    asked: list[str] = []

    def download(repo_id: str, filename: str, **kwargs) -> str:
        assert repo_id == "org/tiny"
        asked.append(filename)
        if not (repo / filename).exists():
            response = httpx2.Response(404, request=httpx2.Request("GET", "http://127.0.0.1/org/tiny"))
            raise RemoteEntryNotFoundError(f"{filename} is not in org/tiny", response=response)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / filename).write_bytes((repo / filename).read_bytes())
        return str(snapshot / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    return asked


def test_a_hub_checkpoint_fetches_its_config_and_one_weights_file_only(tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors where the repository has them, else the .bin; the model loaded from
    either is the one saved."""
    checkpoint = user_checkpoint(tmp_path / "repo")
    (checkpoint / "README.md").write_text("a model card nobody needs")
    asked = fake_hub(monkeypatch, checkpoint, tmp_path / "snapshot-a")
    items = [load_adapter(job(cache_dir, checkpoint), CPU).preprocessor()(decoded(p)) for p in PHOTOS[:2]]
    adapter = load_adapter(make_job(cache_dir, model={"path": "hf-hub:org/tiny"}), CPU)
    assert asked == ["open_clip_config.json", WEIGHTS[0]]
    with torch.no_grad():
        first = adapter.forward(adapter.eager_inputs(items))
    from safetensors.torch import load_file

    torch.save(load_file(str(checkpoint / WEIGHTS[0])), checkpoint / WEIGHTS[1])
    (checkpoint / WEIGHTS[0]).unlink()
    asked = fake_hub(monkeypatch, checkpoint, tmp_path / "snapshot-b")
    adapter = load_adapter(job(cache_dir, "org/tiny"), CPU)
    assert asked == ["open_clip_config.json", WEIGHTS[0], WEIGHTS[1]]
    assert sorted(p.name for p in (tmp_path / "snapshot-b").iterdir()) == ["open_clip_config.json", WEIGHTS[1]]
    with torch.no_grad():
        assert torch.equal(adapter.forward(adapter.eager_inputs(items)), first)


def test_builtin_model_is_a_checkpoint_in_the_hub_layout_loaded_as_one(cache_dir: str) -> None:
    adapter = load_adapter(job(cache_dir, "builtin:tiny-open_clip"), CPU)
    directory = Path(cache_dir) / "builtin" / "tiny-open_clip-v1"
    assert sorted(p.name for p in directory.iterdir()) == ["open_clip_config.json", WEIGHTS[0]]
    model, preprocess = reference(directory)
    with torch.no_grad():
        want = model.encode_image(torch.stack([preprocess(Image.open(p)) for p in PHOTOS]))
        items = [adapter.preprocessor()(decoded(p)) for p in PHOTOS]
        ours = adapter.forward(adapter.eager_inputs(items))
    assert max(relative(ours, want)) < 1e-5 and adapter.model.encode_text is not None


def test_replay_equals_padded_eager_and_a_video_gives_a_vector_per_frame(tmp_path: Path, cache_dir: str) -> None:
    adapter = load_adapter(job(cache_dir, "builtin:tiny-open_clip"), CPU)
    t = adapter.tokens_per_image
    manager = GraphManager(adapter, BudgetPlan((t, 4 * t, 8 * t), max_items=8, max_frames=8), "replay")
    manager.capture()
    assert manager.plan.token_budgets == (17, 68, 136)
    media = [random_image(90, 60, 1), random_video(3, 50, 80, 2), random_image(20, 20, 3)]
    items = [adapter.preprocessor()(m) for m in media]
    replayed = torch.cat(manager.run(items, 8 * t))
    padded = padded_eager(manager, items, 8 * t)
    assert replayed.shape == (5, 48) and torch.equal(replayed, padded[:5]) and torch.isfinite(padded).all()
    with torch.no_grad():
        frames = [adapter.preprocessor()(SimpleNamespace(pixels=frame)) for frame in media[1].frames]
        alone = adapter.forward(adapter.eager_inputs(frames))
    assert torch.allclose(replayed[1:4], alone, rtol=1e-5, atol=1e-6)


def test_per_token_rows_are_open_clips_patch_tokens_projected(tmp_path: Path, cache_dir: str) -> None:
    """With average pooling the image vector is the mean of its token rows; each row is
    open_clip's own patch token output (`output_tokens`) through the projection."""
    checkpoint = user_checkpoint(tmp_path / "ckpt", {"pool_type": "avg"})
    adapter = load_adapter(job(cache_dir, checkpoint, output={"pooling": "none"}), CPU)
    pooled = load_adapter(job(cache_dir, checkpoint), CPU)
    items = [adapter.preprocessor()(decoded(p)) for p in PHOTOS[:2]]
    model, preprocess = reference(checkpoint)
    model.visual.output_tokens = True
    with torch.no_grad():
        rows = adapter.forward(adapter.eager_inputs(items))
        vectors = pooled.forward(pooled.eager_inputs(items))
        _, tokens = model.visual(torch.stack([preprocess(Image.open(p)) for p in PHOTOS[:2]]))
    assert [i.token_grid for i in items] == [(1, 5, 5)] * 2 and rows.shape == (50, 40)
    assert torch.allclose(rows, (tokens @ model.visual.proj).reshape(-1, 40), rtol=1e-4, atol=1e-5)
    assert torch.allclose(rows.reshape(2, 25, 40).mean(dim=1), vectors, rtol=1e-4, atol=1e-5)


def test_per_token_output_of_an_attention_pooled_tower_is_refused(tmp_path: Path, cache_dir: str) -> None:
    checkpoint = user_checkpoint(tmp_path / "ckpt", {"attentional_pool": True, "attn_pooler_queries": 4, "attn_pooler_heads": 2})
    assert load_adapter(job(cache_dir, checkpoint), CPU).embed_dim == 40
    with pytest.raises(JobError, match="pools its tokens by attention.*use output.pooling: mean"):
        load_adapter(job(cache_dir, checkpoint, output={"pooling": "none"}), CPU)


def test_a_tower_other_than_open_clips_vit_is_a_clear_error(tmp_path: Path, cache_dir: str) -> None:
    checkpoint = user_checkpoint(tmp_path / "ckpt", {"layers": [1, 1, 1, 1], "width": 16, "head_width": 8, "image_size": 64})
    with pytest.raises(ValueError, match="image tower is a ModifiedResNet.*VisionTransformer"):
        load_adapter(job(cache_dir, checkpoint), CPU)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "open_clip_config.json").write_text((checkpoint / "open_clip_config.json").read_text())
    with pytest.raises(ValueError, match="holds no weights: open_clip_model.safetensors or open_clip_pytorch_model.bin"):
        load_adapter(job(cache_dir, empty), CPU)


@pytest.mark.parametrize("scale_fc", [False, True])
def test_fp8_converts_the_attention_and_mlp_and_applies_the_norms_and_gelu(tmp_path: Path, cache_dir: str, scale_fc: bool) -> None:
    """The image blocks' attention runs batch first (`BatchFirstAttention`), so FP8
    converts its packed in-projection (applying ln_1) and out_proj as well as the MLP
    (c_fc applying ln_2, c_proj the GELU, except where a norm stands between the GELU
    and c_proj: `scale_fc`, OpenCLIP's custom blocks with their own attention); vectors
    stay within FP8 rounding."""
    from embedjob.encoders.fp8 import Fp8Linear
    from embedjob.encoders.open_clip import BatchFirstAttention

    checkpoint = user_checkpoint(tmp_path / "ckpt", {"scale_fc": scale_fc} if scale_fc else None)
    full = load_adapter(job(cache_dir, checkpoint), CPU)
    fp8 = load_adapter(job(cache_dir, checkpoint, model={"precision": "fp8"}), CPU)
    attention = {"attn.out_proj": 2} if scale_fc else {"attn.qkv": 2, "attn.out_proj": 2}
    assert fp8.fp8_layers == {"mlp.c_fc": 2, "mlp.c_proj": 2, **attention}
    for block in fp8.compile_units():
        assert isinstance(block.mlp.c_fc, Fp8Linear) and isinstance(block.ln_2, torch.nn.Identity)
        assert isinstance(block.mlp.gelu, torch.nn.Identity) != scale_fc
        assert isinstance(block.attn, BatchFirstAttention) != scale_fc
        assert isinstance(block.ln_1, torch.nn.Identity) != scale_fc
    items = [full.preprocessor()(decoded(p)) for p in PHOTOS]
    with torch.no_grad():
        a, b = full.forward(full.eager_inputs(items)), fp8.forward(fp8.eager_inputs(items))
    cosine = torch.nn.functional.cosine_similarity(a, b)
    assert cosine.min() > 0.99 and not torch.equal(a, b)


def test_batch_first_attention_is_multihead_attentions_and_refuses_what_it_does_not_compute() -> None:
    """The replacement shares the module's parameters and gives its output for
    self-attention without a mask; a mask or cross-attention is an error, never ignored."""
    from embedjob.encoders.open_clip import BatchFirstAttention

    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    ours = BatchFirstAttention(module)
    x = torch.randn(3, 17, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x, x, x)[0], module(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-6)
    assert ours.qkv.weight is module.in_proj_weight and ours.out_proj.bias is module.out_proj.bias
    with pytest.raises(ValueError, match="unmasked self-attention"):
        ours(x, x, x, attn_mask=torch.zeros(17, 17))
    with pytest.raises(ValueError, match="unmasked self-attention"):
        ours(x, x.clone(), x)


def test_embedjob_bench_row_times_an_open_clip_tower_against_open_clip(tmp_path: Path) -> None:
    """`embedjob bench`'s OpenCLIP row on the CPU with a tiny config: the plain model and
    embedjob's graphs, whose vectors must be open_clip's (the note's cosine)."""
    from embedjob.bench import open_clip_rows

    config = {"embed_dim": 16, "vision_cfg": {**VISION, "image_size": 32, "layers": 1}, "text_cfg": TEXT}
    rows = open_clip_rows(tmp_path, "tiny OpenCLIP", config, batch=3, repeats=1, peak=1e12, device=CPU, compiled=False)
    assert [r.variant for r in rows] == ["plain_open_clip_eager", "ours_graphs"]
    assert all(r.items == 3 and r.seconds > 0 for r in rows)
    assert float(rows[1].note.rsplit(" ", 1)[1]) > 0.9999
