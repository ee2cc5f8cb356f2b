"""The job spec: a YAML file of sections, validated before any data is read.

Every key a user may write is a field of one of the dataclasses below; the field's
type hint is the allowed type and its default is the default. Validation is driven by
those hints so that a key added here is validated, documented by `describe()` and
overridable with `--set` without further code.

Invariants: a `Job` returned by `load_job` has only known keys, values of the declared
types (after the few lossless coercions below) and passes the cross-field checks in
`_check`; anything else raises `JobError` whose message names the key and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class JobError(ValueError):
    """A job spec that cannot run; the message says which key and what to change."""


Auto = Literal["auto"]

DEFAULT_MAX_ITEM_BYTES = 512 * 2**20
"""input.max_item_bytes: the largest media item read into a decode worker (512 MiB)."""
DEFAULT_MAX_FRAME_PIXELS = 50_000_000
"""video.max_pixels_per_frame: above 8K (7680x4320 = 33.2 M), far below what exhausts a worker."""
DEFAULT_MAX_VIDEO_PIXELS = 500_000_000
"""video.max_total_pixels: every sampled frame of one video together (1.5 GB as RGB)."""


@dataclass
class InputConfig:
    """Where the rows come from and which columns hold the media and the id."""

    path: str = ""
    media_column: str = ""
    id_column: str | None = None
    modality: Literal["image", "video", "auto"] = "image"
    media_root: str | None = None
    # A path column reads any file this process can read unless media_root confines it;
    # that must be asked for explicitly.
    allow_any_path: bool = False
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    batch_rows: int = 256


@dataclass
class ModelConfig:
    """Which encoder, from where, in which precision."""

    family: Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "clip", "siglip", "dinov2"] = "qwen2_5_vl"
    path: str = "builtin:tiny-qwen2_5_vl"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # DINOv2's image embedding: its CLS token (the model's pooled output) or the mean of
    # its patch tokens; CLIP and SigLIP have one fixed pooled output.
    dinov2_pool: Literal["cls", "patch_mean"] = "cls"


@dataclass
class PreprocessConfig:
    """Image preprocessing knobs; `None` means the model's own processor default."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_image_pixels: int = 178_956_970
    tiling: Literal["none", "anyres"] = "none"
    max_tiles: int = 6
    tile_combine: Literal["concat", "mean"] = "concat"


@dataclass
class VideoConfig:
    """How frames are sampled from a video."""

    fps: float = 2.0
    max_frames: int = 32
    min_pixels: int | None = None
    max_pixels: int | None = None
    # Checked from the stream header (and the first decoded frame) before the sampled
    # frames are decoded: a larger video is one `too_large` error row.
    max_pixels_per_frame: int = DEFAULT_MAX_FRAME_PIXELS
    max_total_pixels: int = DEFAULT_MAX_VIDEO_PIXELS


@dataclass
class BatchingConfig:
    """Budgets and policy of the packer and graph manager."""

    token_budgets: Auto | list[int] = "auto"
    max_items_per_batch: Auto | int = "auto"
    max_frames_per_batch: Auto | int = "auto"
    cuda_graphs: bool = True
    policy: Literal["greedy", "min_padding"] = "min_padding"
    window: int = 256
    compile: bool = False
    min_budget: int | None = None
    max_budget: int | None = None


@dataclass
class OutputConfig:
    """Where and how embeddings are written."""

    path: str = ""
    pooling: Literal["mean", "none"] = "mean"
    dtype: Literal["float16", "float32"] = "float16"
    rows_per_part: int = 10_000


@dataclass
class RuntimeConfig:
    """Process-level settings."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    workers: Auto | int = "auto"
    decode_timeout: float = 60.0
    gpus: Auto | int = "auto"
    cache_dir: str | None = None
    progress: bool = True


@dataclass
class Job:
    """A whole job spec. Sections mirror the YAML top level."""

    input: InputConfig = field(default_factory=InputConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        """The full spec, defaults filled in, as plain data (for logs and manifests)."""
        return dataclasses.asdict(self)


REQUIRED = ("input.path", "input.media_column", "output.path")
FIXED_RESOLUTION = ("clip", "siglip", "dinov2")


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Job:
    """Read a YAML job file, apply `key.sub=value` overrides, validate and return it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobError(f"cannot read job file {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobError(f"job file {path} is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"job file {path} must be a mapping of sections (input, model, ...), got {type(raw).__name__}")
    return job_from_dict(raw, overrides)


def job_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Job:
    """Validate a spec given as nested dicts (as parsed from YAML) plus overrides."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        _apply_override(raw, item)
    job = _build(Job, raw, "")
    for key in REQUIRED:
        section, name = key.split(".")
        if not getattr(getattr(job, section), name):
            raise JobError(f"missing required key '{key}': set it in the job file or with --set {key}=...")
    _check(job)
    return job


def describe() -> str:
    """Every key with its allowed values and default, one per line (for `embedjob inspect`)."""
    lines = []
    for section in dataclasses.fields(Job):
        cls = section.default_factory  # type: ignore[misc]
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            lines.append(f"{section.name}.{f.name}: {_allowed(hint)} (default: {f.default!r})")
    return "\n".join(lines)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise JobError(f"--set expects key.sub=value, got {item!r}")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise JobError(f"--set key must be section.key (e.g. output.path), got {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise JobError(f"section '{parts[0]}' must be a mapping of keys")
    section[parts[1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"'{prefix}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        where = f"in section '{prefix}'" if prefix else "at the top level"
        raise JobError(f"unknown key '{_join(prefix, unknown[0])}' {where}; allowed: {', '.join(names)}")
    values = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        key = _join(prefix, name)
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], key)
        else:
            values[name] = _coerce(raw[name], hint, key)
    return cls(**values)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Return `value` if it fits `hint` (ints accepted for floats); else raise JobError."""
    ok, result = _fits(value, hint)
    if ok:
        return result
    raise JobError(f"key '{key}' = {value!r} is not allowed; expected {_allowed(hint)}")


def _fits(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, result = _fits(value, arm)
            if ok:
                return True, result
        return False, None
    if origin is Literal:
        return (value in typing.get_args(hint)), value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False, None
        out = []
        for v in value:
            ok, r = _fits(v, inner)
            if not ok:
                return False, None
            out.append(r)
        return True, out
    if hint is type(None):
        return value is None, None
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, None
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _allowed(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_allowed(a) for a in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_allowed(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))


def _check(job: Job) -> None:
    """Cross-field and range checks that type hints cannot express."""
    positive = {
        "input.batch_rows": job.input.batch_rows,
        "input.max_item_bytes": job.input.max_item_bytes,
        "video.max_pixels_per_frame": job.video.max_pixels_per_frame,
        "video.max_total_pixels": job.video.max_total_pixels,
        "video.max_frames": job.video.max_frames,
        "batching.window": job.batching.window,
        "output.rows_per_part": job.output.rows_per_part,
        "preprocess.max_image_pixels": job.preprocess.max_image_pixels,
        "preprocess.max_tiles": job.preprocess.max_tiles,
    }
    for key, value in positive.items():
        if value <= 0:
            raise JobError(f"key '{key}' = {value} must be > 0")
    if job.video.fps <= 0:
        raise JobError(f"key 'video.fps' = {job.video.fps} must be > 0")
    if job.runtime.decode_timeout <= 0:
        raise JobError(f"key 'runtime.decode_timeout' = {job.runtime.decode_timeout} must be > 0 seconds")
    for key in ("max_items_per_batch", "max_frames_per_batch"):
        value = getattr(job.batching, key)
        if value != "auto" and value < (0 if key == "max_frames_per_batch" else 1):
            raise JobError(f"key 'batching.{key}' = {value} must be 'auto' or a positive integer")
    budgets = job.batching.token_budgets
    if budgets != "auto":
        if not budgets or any(b <= 0 for b in budgets):
            raise JobError(f"key 'batching.token_budgets' = {budgets} must be 'auto' or a non-empty list of positive integers")
    for key in ("min_budget", "max_budget"):
        value = getattr(job.batching, key)
        if value is not None and value <= 0:
            raise JobError(f"key 'batching.{key}' = {value} must be a positive integer or null")
    if job.runtime.workers != "auto" and job.runtime.workers < 0:
        raise JobError(f"key 'runtime.workers' = {job.runtime.workers} must be 'auto' or >= 0 (0 decodes in the main process)")
    if job.runtime.gpus != "auto" and job.runtime.gpus < 1:
        raise JobError(f"key 'runtime.gpus' = {job.runtime.gpus} must be 'auto' or >= 1")
    pp = job.preprocess
    if pp.tiling == "anyres" and job.model.family not in FIXED_RESOLUTION:
        raise JobError(
            f"preprocess.tiling = 'anyres' needs a fixed-resolution encoder ({', '.join(FIXED_RESOLUTION)}); "
            f"model.family {job.model.family!r} already sees images at their native resolution: use tiling: none"
        )
    if job.model.dinov2_pool != "cls" and job.model.family != "dinov2":
        raise JobError(f"model.dinov2_pool applies to model.family 'dinov2' only, not {job.model.family!r}; remove it")
    if pp.min_pixels is not None and pp.max_pixels is not None and pp.min_pixels > pp.max_pixels:
        raise JobError(
            f"preprocess.min_pixels = {pp.min_pixels} is larger than preprocess.max_pixels = {pp.max_pixels}; "
            "lower min_pixels or raise max_pixels"
        )
