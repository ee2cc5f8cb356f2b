"""Finding and loading an encoder's checkpoint, for every family (see ARCHITECTURE.md).

`load_adapter` reads what an adapter needs from the job into `AdapterOptions` and calls
the `build_adapter` of the family's module (`registry.FAMILIES`). The pieces every
family's loader shares live here: where builtin models and compiled artefacts are kept,
the atomic creation of a builtin model, the dtype on a device, and the resolution of
`model.path` (a builtin name, a local directory or a hub id).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from embedjob.config import Job, cache_root, relative_note
from embedjob.encoders import epilogues
from embedjob.encoders.attention import HALF, resolve_backend
from embedjob.encoders.base import Calibration, EncoderAdapter, Placement
from embedjob.encoders.registry import FAMILIES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterOptions:
    """What of the job an adapter is built with; adapters never read a job."""

    cache_dir: Path
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_max_frames: int = 0
    tiling: str = "none"
    max_tiles: int = 0
    tile_combine: str = "concat"
    pool: str = "cls"
    per_token: bool = False
    # The backend `attention.resolve_backend` chose for the tower (Qwen-VL towers read it).
    attention: str = "varlen"
    # Load the full checkpoint's text tower too (`EncoderAdapter.text`): captions or labels.
    text: bool = False

    def placement(self, device: torch.device, dtype: torch.dtype, source: str) -> Placement:
        return Placement(device, dtype, source, self.video_max_frames, self.cache_dir)

    @classmethod
    def from_job(cls, job: Job, attention: str) -> AdapterOptions:
        """The job's options, with the attention backend resolved for its device."""
        return cls(
            cache_dir=cache_root(job.runtime.cache_dir),
            min_pixels=job.preprocess.min_pixels,
            max_pixels=job.preprocess.max_pixels,
            video_min_pixels=job.video.min_pixels,
            video_max_pixels=job.video.max_pixels,
            video_max_frames=job.video.max_frames,
            tiling=job.preprocess.tiling,
            max_tiles=job.preprocess.max_tiles,
            tile_combine=job.preprocess.tile_combine,
            pool=job.model.image_pool,
            per_token=job.output.pooling == "none",
            attention=attention,
            text=job.input.text_column is not None or bool(job.output.labels),
        )


def load_adapter(job: Job, device: torch.device, calibration: Calibration | None = None) -> EncoderAdapter:
    """Build the adapter the job asks for, on `device`, in the job's dtype (float32 on CPU).

    The attention backend is resolved first (a JobError where `model.attention: fa4`
    cannot run), so such a job stops before any checkpoint is read or fetched. Under
    `model.precision: fp8`, `calibration` (where given) calibrates the FP8 weights
    (`EncoderAdapter.use_fp8`); the caller gives one where `model.fp8_calibrate` asks,
    since the rows it reads are the job's input, which encoders know nothing of.
    """
    family = FAMILIES.get(job.model.family)
    if family is None:
        raise ValueError(f"model.family {job.model.family!r} has no adapter")
    dtype = resolve_dtype(job.model.dtype, device)
    attention = resolve_backend(
        job.model.attention, not family.fixed_resolution, device, dtype, cache_root(job.runtime.cache_dir) / "fa4"
    )
    module = importlib.import_module(family.adapter)
    options = AdapterOptions.from_job(job, attention)
    adapter = module.build_adapter(job.model.family, job.model.path, dtype, device, options)
    if options.text:
        check_text_tower(adapter)
    if job.model.precision == "fp8":
        adapter.use_fp8(job.model.fp8_keep, calibration)
    elif device.type == "cuda" and dtype in HALF and epilogues.EPILOGUES:
        adapter.use_epilogues()
        if adapter.text is not None:
            adapter.text.use_epilogues()
    return adapter


def check_text_tower(adapter: EncoderAdapter) -> None:
    """The text tower a job asked for is there and its vectors are the image vectors'
    width (one space, so a cosine between them means something); else a ValueError.
    Its blocks stay in the model dtype under `model.precision: fp8`: a caption costs a
    tenth of an image, and FP8's error would move every score."""
    if adapter.text is None:
        raise ValueError(f"model.family {adapter.family!r} loaded no text tower for input.text_column or output.labels")
    if adapter.text.embed_dim != adapter.embed_dim:
        raise ValueError(
            f"its text vectors have width {adapter.text.embed_dim} and its image vectors {adapter.embed_dim}: "
            "they are not one space, so captions and labels cannot be scored against the images"
        )


def builtin_model(cache_dir: Path | str, family: str, version: int, build: Callable[[Path], None]) -> Path:
    """The directory of the tiny builtin model of `family`, made once by `build(tmpdir)`
    (a fixed seed, `save_pretrained`): a user's checkpoint takes the same loading path."""
    target = Path(cache_dir) / "builtin" / f"tiny-{family}-v{version}"

    def made(tmp: Path) -> None:
        build(tmp)
        logger.info("created builtin model %s in %s", family, target)

    save_atomically(made, target)
    return target


def download_snapshot(repo_id: str) -> Path:
    """A hub checkpoint's configs, safetensors weights and tokenizer files (BPE merges,
    SentencePiece models: captions and labels need them), nothing else it may hold."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "merges.txt", "vocab.txt", "*.model"]))


def transformers_class(name: str) -> Any:
    """A transformers class by name, imported when a model is loaded, not before."""
    import transformers

    return getattr(transformers, name)


def save_atomically(build: Any, target: Path) -> None:
    """Run `build(tmpdir)` and rename the result to `target`.

    Several SLURM tasks may create the same builtin model at once; the rename makes
    exactly one of them win and the others find a complete directory. The cache may
    be shared: the temporary directory is created fresh by this call under a name
    nobody can guess (`mkdtemp`), so a link planted at a name we would use cannot make
    the build write into the directory it points to. `mkdtemp` makes it private; it is
    made readable by every user (writable by its owner only) before `build`, as a
    cache other users' jobs read needs.
    """
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    build(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype: the job's choice on CUDA, float32 on CPU.

    bfloat16/float16 matmuls on CPU are slow and not what anyone benchmarks, and CPU runs
    exist for CI and small jobs, so CPU always computes in float32.
    """
    if device.type != "cuda":
        if name != "float32":
            logger.info("running on CPU: computing in float32 instead of %s", name)
        return torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _nearest_builtin(named: str, families: list[str]) -> str:
    """`; did you mean builtin:tiny-F (model.family: F)?` for the family (of every
    family's builtins) nearest to a mistyped builtin name (`clip-vit`, `qwen2.5-vl`) or
    to another family's builtin, or nothing when none is near."""
    spelled = named.lower().replace("-", "_").replace(".", "_")
    near = difflib.get_close_matches(spelled, families, n=1, cutoff=0.5)
    near = near or [f for f in families if spelled.startswith(f) or f.startswith(spelled)][:1]
    return f"; did you mean builtin:tiny-{near[0]} (model.family: {near[0]})?" if near else ""


def resolve_checkpoint(
    path: str,
    family: str,
    families: Iterable[str],
    builtin: Callable[[], Path],
    download: Callable[[str], Path],
) -> Path:
    """A local directory holding the checkpoint named by `model.path`.

    `builtin:tiny-<family>` is made locally (`builtin`), an existing directory is used as
    it is, anything else that does not look like a local path is a hub id (`download`).
    A builtin model has random weights, which the log says: its vectors mean nothing.
    """
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        named = name.removeprefix("tiny-")
        known = list(families)
        if not name.startswith("tiny-") or named not in known:
            raise ValueError(f"unknown builtin model {path!r}{_nearest_builtin(named, list(FAMILIES))}; "
                             f"available: builtin:tiny-{', builtin:tiny-'.join(known)}")
        if named != family:
            raise ValueError(f"model.path {path!r} is a {named} model but model.family is {family!r}")
        logger.warning(
            "model.path %s is a tiny demo model with random weights (fixed seed), for demos and tests: "
            "its vectors mean nothing; name a real checkpoint for real embeddings", path,
        )
        return builtin()
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or path.startswith(("/", "./", "../")):
        raise ValueError(f"model.path {path!r} is not a checkpoint directory{relative_note(path)}")
    try:
        return download(path)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(
            f"model.path {path!r} is neither a directory{relative_note(path)} nor a model the hub gives ({first})"
        ) from None
