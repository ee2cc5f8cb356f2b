"""The job spec: a YAML file of sections, validated before any data is read.

Every key a user may write is a field of one of the dataclasses below, declared with
`key(default, description, within)`; the field's type hint is the allowed type and a
numeric key's `within` (a `Range`) its allowed numbers (each item's, for a list).
Validation is driven by those declarations so that a key added here is validated,
documented by `describe()` (and so by `embedjob inspect`) and overridable with `--set`
without further code.

Invariants: a `Job` returned by `load_job` has only known keys, values of the declared
types (after the few lossless coercions below) within their declared ranges (so never
NaN or infinite), and passes the cross-field checks in `_check`; anything else raises
one `JobError` that lists every problem, each naming the key and what is allowed.
Relative paths in a job (input.path, input.media_root, model.path, output.path,
runtime.cache_dir) resolve against the working directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from embedjob.encoders.registry import FAMILIES, FIXED_RESOLUTION, POOLABLE, TEXT_FAMILIES, family_of

logger = logging.getLogger(__name__)


class JobError(ValueError):
    """A job spec that cannot run; the message says which key and what to change."""


class RunFailure(RuntimeError):
    """A job that could not run for a reason its message already names, with what to
    do (exit 1, the message printed as it is)."""


Auto = Literal["auto"]

DEFAULT_MAX_ITEM_BYTES = 512 * 2**20
"""input.max_item_bytes: the largest media item read into a decode worker (512 MiB)."""
DEFAULT_MAX_FRAME_PIXELS = 50_000_000
"""video.max_pixels_per_frame: above 8K (7680x4320 = 33.2 M), far below what exhausts a worker."""
DEFAULT_MAX_VIDEO_PIXELS = 500_000_000
"""video.max_total_pixels: every sampled frame of one video together (1.5 GB as RGB)."""
DEFAULT_NVDEC_SESSIONS = 7
"""video.nvdec_sessions: videos the GPU's decoder reads at once (the decode stage's default too)."""


@dataclass(frozen=True)
class Range:
    """The numbers a numeric key allows: `low` to `high` (None: unbounded on that side),
    each bound inclusive unless `low_open`/`high_open`.

    NaN and the infinities are never in a range: no key reads infinity as "no limit"
    (null is that, where a key has one), and NaN passes every comparison a later check
    could make, so it would reach the pipeline and fail there, after the output exists.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        """Whether `value` (an int, or a float) is finite and within the bounds."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        """The plain form `inspect` and the messages show: `>= 1`, `> 0`, `>= 0 and < 1`."""
        low = [] if self.low is None else [f"{'>' if self.low_open else '>='} {self.low:g}"]
        high = [] if self.high is None else [f"{'<' if self.high_open else '<='} {self.high:g}"]
        return " and ".join(low + high)


def key(default: Any, doc: str, within: Range | None = None) -> Any:
    """A job key: its default, its one-line description (`embedjob inspect`, README) and,
    for a numeric key, the range its numbers must lie in (`Range`; every numeric key has one).

    A list or mapping default is copied for each job, so no two jobs share one.
    """
    metadata = {"doc": doc, "range": within}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
ABOVE_0 = Range(0, low_open=True)


@dataclass
class InputConfig:
    """Where the rows come from and which columns hold the media and the id."""

    path: str = key(
        "", "the input files (Parquet, or .tar shards with format: webdataset): a file, a directory, a glob, an fsspec URI "
        "(s3://, gs://, ...), or a list of these in braces (shards/{00000..00099}.tar, {a,b}/*.parquet)"
    )
    media_column: str = key("", "the column of media: bytes, a Hugging Face image struct, or a path/URI string")
    id_column: str | None = key(None, "the column copied into the output's `id`; null: the row index")
    modality: Literal["image", "video", "auto"] = key("image", "what the media are; auto decides per row from the bytes")
    media_root: str | None = key(None, "the directory (or URI prefix) every media path must stay in")
    # A path column reads any file this process can read unless media_root confines it;
    # that must be asked for explicitly.
    allow_any_path: bool = key(False, "read media paths without a media_root (they may name any readable file)")
    max_item_bytes: int = key(DEFAULT_MAX_ITEM_BYTES, "the largest media item read, in bytes; larger ones are too_large rows", AT_LEAST_1)
    batch_rows: int = key(256, "rows decoded from Parquet at a time", AT_LEAST_1)
    format: Literal["parquet", "webdataset"] = key(
        "parquet",
        "parquet, or webdataset: .tar shards, one row per key, media from the member input.media_column names (e.g. jpg), id the key",
    )
    storage_options: dict[str, Any] = key(
        {}, "fsspec options for input.path URLs and the URIs in media cells (e.g. {endpoint_url: ..., profile: ...}); "
        "credentials also come from the store's usual places"
    )
    text_column: str | None = key(
        None, "a string column of captions (webdataset: a member, e.g. txt): each row also gets its text_embedding and score (clip, siglip, metaclip2, siglip2, open_clip); null: none"
    )


@dataclass
class ModelConfig:
    """Which encoder, from where, in which precision."""

    family: Literal[tuple(FAMILIES)] = key(  # type: ignore[valid-type]
        "qwen2_5_vl", "the encoder family of model.path; left out: the one its config.json (or builtin name) names"
    )
    # Required: a job without a model must not embed with random weights.
    path: str = key("", "the checkpoint: a local directory or a hub id; builtin:tiny-<family> is a random-weight demo model")
    dtype: Literal["bfloat16", "float16", "float32"] = key("bfloat16", "the compute precision on a GPU (a CPU computes in float32)")
    precision: Literal["bf16", "fp8"] = key(
        "bf16",
        "the transformer blocks' linear layers: bf16 (in model.dtype) or fp8 (row-wise FP8; GPUs of compute "
        "capability 9.0 or newer, model.dtype bfloat16; docs/performance.md says when it pays)",
    )
    fp8_keep: list[str] = key(
        [],
        "model.precision fp8: the blocks' linear layers that stay in model.dtype, by their path in a block as an fp8 job's "
        "log names them (attn.proj in Qwen-VL, self_attn.out_proj in SigLIP/CLIP): each brings the vectors closer to bf16's "
        "and gives back its share of FP8's speed-up (docs/performance.md)",
    )
    fp8_calibrate: int = key(
        0,
        "model.precision fp8: rows whose layer inputs calibrate the FP8 weights (the input's first ones in row order whose "
        "media decode, the same for every shard); each weight is rounded so its layer's output on such inputs moves least, "
        "closer to bf16 at no cost per row (docs/performance.md); 0: rounded to nearest",
        AT_LEAST_0,
    )
    attention: Literal["auto", "varlen", "fa4"] = key(
        "auto",
        "Qwen-VL, SigLIP 2: the packed attention kernel: fa4 (FlashAttention-4 on segments over 128 tokens, the varlen kernels "
        "on shorter ones; pip install 'embedjob[fast]'), varlen (torch's varlen_attn, and embedjob's Triton kernel on "
        "64-token windows), auto (fa4 where it runs, else varlen)",
    )
    # DINOv2's and DINOv3's image embedding: their CLS token (the model's pooled output)
    # or the mean of their patch tokens; the other families have one fixed pooled output.
    # Null rather than 'cls' by default, so a job that sets it for another family, or
    # sets it and the deprecated dinov2_pool apart, can be told from one that does not.
    pool: Literal["cls", "patch_mean"] | None = key(
        None, "DINOv2/DINOv3: the image vector, the CLS token (cls) or the mean of the patch tokens (patch_mean); null: cls"
    )
    dinov2_pool: Literal["cls", "patch_mean"] | None = key(None, "deprecated: model.pool under its earlier name")

    @property
    def image_pool(self) -> str:
        """The pooling a DINO tower's image vector takes: `pool`, else its deprecated alias, else cls."""
        return self.pool or self.dinov2_pool or "cls"


@dataclass
class PreprocessConfig:
    """Image preprocessing knobs; `None` means the model's own processor default."""

    # Pixel counts start at 1: the adapter reads 0 as unset, the model's default.
    min_pixels: int | None = key(None, "Qwen-VL: the fewest pixels an image is resized to; null: the model's default", AT_LEAST_1)
    max_pixels: int | None = key(None, "Qwen-VL, SigLIP 2: the most pixels an image is resized to; null: the model's default", AT_LEAST_1)
    max_image_pixels: int = key(178_956_970, "images larger than this (from their header) are too_large rows", AT_LEAST_1)
    tiling: Literal["none", "anyres"] = key("none", "CLIP/SigLIP/DINOv2: anyres adds local tiles to the global view")
    max_tiles: int = key(6, "the most local tiles per image with tiling: anyres", AT_LEAST_1)
    tile_combine: Literal["concat", "mean"] = key("concat", "how the global and tile vectors merge: [global ; tiles] or their mean")
    decoder: Literal["cpu", "gpu", "auto"] = key(
        "cpu", "where JPEGs are decoded: cpu (the decode workers), gpu (nvjpeg on the rank's GPU), auto (both: the GPU takes the share the workers cannot keep up with)"
    )


@dataclass
class VideoConfig:
    """How frames are sampled from a video."""

    fps: float = key(2.0, "frames sampled per second of video", ABOVE_0)
    max_frames: int = key(32, "the most frames sampled from one video", AT_LEAST_1)
    min_pixels: int | None = key(None, "Qwen-VL: the fewest pixels a frame is resized to; null: the model's default", AT_LEAST_1)
    max_pixels: int | None = key(None, "Qwen-VL, SigLIP 2: the most pixels a frame is resized to; null: the model's default", AT_LEAST_1)
    # Checked from the stream header (and the first decoded frame) before the sampled
    # frames are decoded: a larger video is one `too_large` error row.
    max_pixels_per_frame: int = key(DEFAULT_MAX_FRAME_PIXELS, "videos with larger frames are too_large rows", AT_LEAST_1)
    max_total_pixels: int = key(DEFAULT_MAX_VIDEO_PIXELS, "videos whose sampled frames hold more pixels together are too_large rows", AT_LEAST_1)
    decoder: Literal["decord", "nvdec", "auto"] = key(
        "decord",
        "where sampled frames are decoded: decord (the decode workers), nvdec (the rank's GPU; pip install 'embedjob[nvdec]'), "
        "auto (both in a video job: the GPU takes the share of videos the workers cannot keep up with; decord where it cannot)",
    )
    nvdec_sessions: int = key(
        DEFAULT_NVDEC_SESSIONS, "with decoder nvdec or auto: videos the GPU's decoder reads at once, one decoder session each "
        "(an H100 or H200 has 7 decode engines: on an H100, 7 sessions read 162 s of video a second, 1 read 75)", AT_LEAST_1,
    )


@dataclass
class BatchingConfig:
    """Budgets and policy of the packer and graph manager."""

    token_budgets: Auto | list[int] = key("auto", "encoder tokens per batch, one graph each; auto: powers of two", AT_LEAST_1)
    max_items_per_batch: Auto | int = key("auto", "the most items in one batch", AT_LEAST_1)
    max_frames_per_batch: Auto | int = key(
        "auto", "the most video frames in one batch; a video with more runs alone, eagerly (0: every video)", AT_LEAST_0
    )
    cuda_graphs: bool = key(True, "replay captured graphs (false: every batch runs eagerly at its exact size)")
    policy: Literal["greedy", "min_padding"] = key("min_padding", "how items are packed into batches")
    refine_budgets: bool = key(
        True, "add a budget (and capture its graph) when a window's batches pay over 5% of their tokens in padding"
    )
    window: int = key(256, "decoded items packed together (the first windows are smaller)", AT_LEAST_1)
    compile: bool = key(False, "compile the encoder's blocks with torch.compile (CUDA only)")
    min_budget: int | None = key(None, "the smallest automatic budget; null: the model's", AT_LEAST_1)
    max_budget: int | None = key(None, "the largest automatic budget; null: the model's", AT_LEAST_1)


@dataclass
class OutputConfig:
    """Where and how embeddings are written."""

    path: str = key("", "the output directory or object-store URL (s3://...): parts, and bookkeeping under _embedjob/")
    pooling: Literal["mean", "none"] = key("mean", "mean: one vector per row; none: one vector per output token, with its grid")
    dtype: Literal["float16", "float32"] = key("float16", "the precision of the written vectors")
    rows_per_part: int = key(10_000, "rows per Parquet part (the unit of commit and resume)", AT_LEAST_1)
    normalize: bool = key(False, "write L2-normalised vectors (each token's with pooling: none)")
    columns: list[str] = key([], "input columns copied into the output, e.g. [url, caption]")
    storage_options: dict[str, Any] = key(
        {}, "fsspec options for an output.path URL (s3://, gs://, ...; docs/output.md); credentials also come from the store's usual places"
    )
    labels: list[str] = key([], "zero-shot label prompts: each row gets the best one (label) and its cosine (label_score)")


@dataclass
class RuntimeConfig:
    """Process-level settings."""

    device: Literal["auto", "cuda", "cpu"] = key("auto", "where the encoder runs; auto: cuda when visible")
    workers: Auto | int = key(
        "auto", "decode processes per GPU; auto: the cores shared among the GPUs; 0: inline", AT_LEAST_0
    )
    decode_timeout: float = key(60.0, "seconds one item may take to decode before it is a timeout row", ABOVE_0)
    gpus: Auto | int = key("auto", "GPUs (one process each) for a shard; auto: every visible GPU", AT_LEAST_1)
    cache_dir: str | None = key(None, "where builtin models, compiled kernels, webdataset tar indexes and (where Python writes none) bytecode are kept; null: $EMBEDJOB_CACHE or ~/.cache/embedjob")
    progress: bool = key(True, "show a progress bar (where stderr is no terminal: a log line every 30 s)")
    max_error_rate: float | None = key(
        0.5,
        "stop the shard (exit 1) once more than this fraction of its rows are errors; null: no limit",
        Range(0, 1, high_open=True),
    )
    error_rate_min_rows: int = key(
        100, "rows a shard writes before max_error_rate applies (a shard's last row: always)", AT_LEAST_1
    )


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

    def recorded(self) -> dict[str, Any]:
        """`to_dict` as an output records it (its statistics): storage options by name
        only, as their values may be credentials."""
        spec = self.to_dict()
        for section in ("input", "output"):
            spec[section]["storage_options"] = sorted(spec[section]["storage_options"])
        return spec


REQUIRED = ("input.path", "input.media_column", "model.path", "output.path")
REQUIRED_HINTS = {
    "model.path": (
        "name the checkpoint, a local directory or a hub id (e.g. openai/clip-vit-base-patch16) with its model.family; "
        "builtin:tiny-<family> is a tiny random-weight model for demos and tests"
    ),
}
OUTPUT_COLUMNS = ("id", "row", "modality", "tokens", "frames", "grid", "embedding", "error", "text_embedding", "score", "label", "label_score")
"""The columns embedjob writes itself; `output.columns` may not reuse their names."""


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where (line and column, 1-based), what it expected
    and what it was parsing (its own text spans lines and quotes the file)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    started = getattr(exc, "context_mark", None)
    where = f" (from line {started.line + 1}, column {started.column + 1})" if context and started is not None else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f", {context}{where}" if context else "")


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Job:
    """Read a YAML job file, apply `key.sub=value` overrides, validate and return it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobError(f"cannot read job file {path}: {exc.strerror or exc}{relative_note(str(path))}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobError(f"job file {path} is not valid YAML: {yaml_problem(exc)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"job file {path} must be a mapping of sections (input, model, ...), got {type(raw).__name__}")
    return job_from_dict(raw, overrides)


def job_from_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Job:
    """Validate a spec given as nested dicts (as parsed from YAML) plus overrides.

    Every problem is collected before anything is raised, so a user fixes a spec in one
    round: a key with a bad value is reported and then taken at its default, which keeps
    the cross-field checks from reporting it twice. One JobError lists them all.
    """
    errors: list[str] = []
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        _apply_override(raw, item, errors)
    _find_family(raw)
    job = _build(Job, raw, "", errors)
    for name in REQUIRED:
        section, field_name = name.split(".")
        if not getattr(getattr(job, section), field_name):
            hint = REQUIRED_HINTS.get(name, f"set it in the job file or with --set {name}=...")
            errors.append(f"{name} is required: {hint}")
    _check(job, errors)
    if errors:
        raise JobError(errors[0] if len(errors) == 1 else f"{len(errors)} problems in the job spec: " + "; ".join(
            f"({n}) {e}" for n, e in enumerate(errors, 1)
        ))
    return job


def _find_family(raw: dict[str, Any]) -> None:
    """A model section that leaves `family` out gets the one its checkpoint names
    (`registry.family_of`); where none can be told, the default stays, and a checkpoint
    of another family is the loader's error, naming the family to set."""
    model = raw.get("model")
    if isinstance(model, dict) and "family" not in model and isinstance(model.get("path"), str):
        family = family_of(model["path"])
        if family is not None:
            model["family"] = family


def relative_note(path: str) -> str:
    """For a message about a path that was not found: where a relative one was looked
    for (job paths resolve against the working directory, not the job file's)."""
    if os.path.isabs(os.path.expanduser(path)) or "://" in path:
        return ""
    return f" (relative paths resolve against the working directory, {os.getcwd()})"


def describe() -> str:
    """Every key with its allowed values (a numeric key's range included), default and
    description, one per line (for `embedjob inspect`)."""
    return "\n".join(f"{name}: {allowed} (default: {default!r}) - {doc}" for name, allowed, default, doc in keys())


REFERENCE_INTRO = """# Configuration

Every key of a job file, as `embedjob inspect` lists them: the values each allows, its
default and what it does. Generated from the job spec (`embedjob inspect --markdown >
docs/configuration.md`); a test fails when this page and the spec disagree. A key may be
set in the job's YAML or on the command line (`--set section.key=value`); a wrong key,
type or value stops the job before anything is read or written, with one line naming
every problem (exit 2).
"""


def reference_markdown() -> str:
    """docs/configuration.md: one table per section of the job spec, in spec order, each
    key with its allowed values (ranges included), default and description."""
    rows = keys()
    parts = [REFERENCE_INTRO]
    for section in dataclasses.fields(Job):
        doc = inspect.getdoc(section.default_factory) or ""  # type: ignore[misc]
        parts.append(f"\n## {section.name}\n\n{doc}\n\n| key | allowed | default | what it does |\n| --- | --- | --- | --- |\n")
        for name, allowed, default, about in rows:
            if name.startswith(f"{section.name}."):
                shown = "required" if name in REQUIRED else f"`{_as_yaml(default)}`"
                parts.append(f"| `{name}` | {_cell(allowed)} | {shown} | {_cell(about)} |\n")
    return "".join(parts)


def _as_yaml(value: Any) -> str:
    """A default as a job file writes it: null, true/false, numbers and quoted strings."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def _cell(text: str) -> str:
    """`text` inside a Markdown table cell, whose columns a bare `|` would split."""
    return text.replace("|", "\\|")


def keys() -> list[tuple[str, str, Any, str]]:
    """(section.key, allowed values, default, description) of every key, in spec order;
    a numeric key's allowed values name its range, as in `an integer >= 1`."""
    rows = []
    for section in dataclasses.fields(Job):
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            allowed = _allowed(hints[f.name], f.metadata["range"])
            rows.append((f"{section.name}.{f.name}", allowed, default, f.metadata["doc"]))
    return rows


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    if "=" not in item:
        errors.append(f"--set expects key.sub=value, got {item!r}")
        return
    name, _, text = item.partition("=")
    parts = name.strip().split(".")
    if len(parts) != 2 or not all(parts):
        errors.append(f"--set key must be section.key (e.g. output.path), got {name!r}")
        return
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        errors.append(f"section '{parts[0]}' must be a mapping of keys")
        return
    section[parts[1]] = value


def _build(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    """`cls` from `raw`, each bad key reported to `errors` and left at its default."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.append(f"'{prefix}' must be a mapping, got {type(raw).__name__}")
        raw = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"in section '{prefix}'" if prefix else "at the top level"
    for unknown in (k for k in raw if k not in fields):
        errors.append(f"unknown key '{_join(prefix, unknown)}' {where}; allowed: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        hint = hints[name]
        full = _join(prefix, name)
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], full, errors)
            continue
        within = f.metadata["range"]
        ok, value = _fits(raw[name], hint, within)
        if ok:
            values[name] = value
        else:
            errors.append(f"key '{full}' = {raw[name]!r} is not allowed; expected {_allowed(hint, within)}")
    return cls(**values)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _fits(value: Any, hint: Any, within: Range | None) -> tuple[bool, Any]:
    """(whether `value` is of type `hint`, its numbers in `within`; the value as the job
    keeps it). bool is an int to Python but never a number here: `window: true` is a
    mistake, not 1."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(hint):
            ok, result = _fits(value, arm, within)
            if ok:
                return True, result
        return False, None
    if origin is Literal:
        return (value in typing.get_args(hint)), value
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value), value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False, None
        out = []
        for v in value:
            ok, r = _fits(v, inner, within)
            if not ok:
                return False, None
            out.append(r)
        return True, out
    if hint is type(None):
        return value is None, None
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and _admits(within, value), value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False, None
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float: out of every range
            return False, None
        return _admits(within, number), number
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _admits(within: Range | None, number: float) -> bool:
    """Whether `number` is in the key's range; a numeric key declared without one is a
    bug in this module, not in the job."""
    if within is None:
        raise TypeError("a numeric job key without a range: declare one with key(..., within=Range(...))")
    return within.admits(number)


def _allowed(hint: Any, within: Range | None) -> str:
    """What `hint` allows in words, numbers with their range: `'auto' or an integer >= 0`."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_allowed(a, within) for a in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_allowed(typing.get_args(hint)[0], within)}"
    if origin is dict:
        return "a mapping of option names to values"
    if hint is type(None):
        return "null"
    if hint in (int, float):
        return f"{'an integer' if hint is int else 'a finite number'} {within}"
    return {str: "a string", bool: "true or false"}.get(hint, str(hint))


ORDERED = (
    ("preprocess.min_pixels", "preprocess.max_pixels"),
    ("video.min_pixels", "video.max_pixels"),
    ("batching.min_budget", "batching.max_budget"),
)
"""Pairs of keys whose first may not exceed the second where both are set (null: the
model's value, unknown until it loads)."""


def _check(job: Job, errors: list[str]) -> None:
    """Cross-field checks, which no one key's type and range express, each failure added
    to `errors`."""
    for low_name, high_name in ORDERED:
        low, high = _value(job, low_name), _value(job, high_name)
        if low is not None and high is not None and low > high:
            errors.append(
                f"{low_name} = {low} is larger than {high_name} = {high}; "
                f"lower {low_name.split('.')[1]} or raise {high_name.split('.')[1]}"
            )
    _check_batching(job, errors)
    _check_model(job, errors)
    _check_columns(job, errors)
    _check_text(job, errors)


def _value(job: Job, name: str) -> Any:
    section, key_name = name.split(".")
    return getattr(getattr(job, section), key_name)


def _check_batching(job: Job, errors: list[str]) -> None:
    """Budgets the packer would refuse only once the model is loaded, after the output
    exists: none at all, or more items per batch than the smallest budget (the largest,
    `max_budget`, for automatic ones) has tokens, as a captured batch of that many items
    must give each at least one."""
    b = job.batching
    if b.token_budgets == []:
        errors.append("key 'batching.token_budgets' = [] is not allowed; expected 'auto' or at least one budget")
    items = b.max_items_per_batch
    if items == "auto":
        return
    if b.token_budgets != "auto" and b.token_budgets and items > min(b.token_budgets):
        smallest = min(b.token_budgets)
        errors.append(
            f"batching.max_items_per_batch = {items} is larger than the smallest of batching.token_budgets, {smallest}; "
            f"lower max_items_per_batch to <= {smallest} or raise the smallest budget"
        )
    if b.token_budgets == "auto" and b.max_budget is not None and items > b.max_budget:
        errors.append(
            f"batching.max_items_per_batch = {items} is larger than batching.max_budget = {b.max_budget}; "
            f"lower max_items_per_batch to <= {b.max_budget} or raise max_budget"
        )


def _check_model(job: Job, errors: list[str]) -> None:
    pp = job.preprocess
    family = FAMILIES.get(job.model.family)
    if family is not None and family.package is not None and importlib.util.find_spec(family.package) is None:
        errors.append(
            f"model.family {job.model.family!r} needs the {family.package} package, which is not installed here: "
            f"pip install 'embedjob[{family.extra}]'"
        )
    if pp.tiling == "anyres" and job.model.family not in FIXED_RESOLUTION:
        errors.append(
            f"preprocess.tiling = 'anyres' needs a fixed-resolution encoder ({', '.join(FIXED_RESOLUTION)}); "
            f"model.family {job.model.family!r} already sees images at their native resolution: use tiling: none"
        )
    if pp.tiling == "anyres" and job.output.pooling == "none":
        errors.append(
            "output.pooling = 'none' gives one vector per patch token of one view, which tiles have no place in; "
            "use preprocess.tiling: none for per-token output, or output.pooling: mean for tiles"
        )
    if job.model.attention != "auto" and job.model.family in FIXED_RESOLUTION:
        errors.append(
            f"model.attention = {job.model.attention!r} applies to the Qwen-VL families only: model.family "
            f"{job.model.family!r} runs transformers' scaled-dot-product attention, which is faster on these towers "
            "than FlashAttention-4 (cuDNN's kernels on an H200, benchmarks/RESULTS.md); remove model.attention"
        )
    _check_pool(job, errors)
    if job.model.fp8_keep and job.model.precision != "fp8":
        errors.append("model.fp8_keep names layers kept out of FP8, but model.precision is not fp8; remove model.fp8_keep")
    if job.model.fp8_calibrate and job.model.precision != "fp8":
        errors.append("model.fp8_calibrate calibrates FP8 weights, but model.precision is not fp8; remove model.fp8_calibrate")
    if pp.decoder == "gpu" and pp.tiling == "anyres":
        errors.append("preprocess.decoder = 'gpu' cannot cut anyres tiles (they are cut on the CPU); use decoder: cpu or tiling: none")
    if pp.decoder == "gpu" and job.runtime.device == "cpu":
        errors.append("preprocess.decoder = 'gpu' decodes on the rank's GPU but runtime.device is 'cpu'; use decoder: cpu")
    if pp.decoder == "gpu" and job.input.modality == "video":
        errors.append("preprocess.decoder = 'gpu' decodes JPEG images and input.modality is 'video'; remove preprocess.decoder")
    if job.video.decoder == "nvdec" and job.runtime.device == "cpu":
        errors.append("video.decoder = 'nvdec' decodes on the rank's GPU but runtime.device is 'cpu'; use video.decoder: decord")
    if job.video.decoder == "nvdec" and job.input.modality == "image":
        errors.append("video.decoder = 'nvdec' decodes videos and input.modality is 'image'; remove video.decoder")


def _check_pool(job: Job, errors: list[str]) -> None:
    """`model.pool` only where the family has the choice; the deprecated `model.dinov2_pool`
    where it always ran (its 'cls' anywhere, as when it was every job's default), with a
    warning, and never against `model.pool`."""
    model = job.model
    families = " or ".join(repr(f) for f in POOLABLE)
    if model.pool is not None and model.family not in POOLABLE:
        errors.append(f"model.pool applies to model.family {families} only, not {model.family!r}; remove it")
    if model.dinov2_pool is None:
        return
    if model.family not in POOLABLE:
        if model.dinov2_pool != "cls":
            errors.append(f"model.dinov2_pool applies to model.family {families} only, not {model.family!r}; remove it")
        else:
            logger.warning("model.dinov2_pool is deprecated and does nothing for model.family %r: remove it", model.family)
    elif model.pool is not None and model.pool != model.dinov2_pool:
        errors.append(
            f"model.dinov2_pool = {model.dinov2_pool!r} and model.pool = {model.pool!r} disagree; "
            "model.dinov2_pool is deprecated: remove it and keep model.pool"
        )
    else:
        logger.warning("model.dinov2_pool is deprecated: write model.pool: %s instead", model.dinov2_pool)


def _check_columns(job: Job, errors: list[str]) -> None:
    """Copied input columns must name distinct output columns of their own; the id
    column must not be the media column, and webdataset input has none (its ids are keys)."""
    columns = job.output.columns
    taken = [c for c in columns if c in OUTPUT_COLUMNS]
    if taken:
        errors.append(
            f"output.columns {taken} would replace embedjob's own output columns ({', '.join(OUTPUT_COLUMNS)}); "
            "rename those input columns or leave them out"
        )
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        errors.append(f"output.columns names {repeated} more than once")
    ids = job.input.id_column
    if ids is not None and job.input.format == "webdataset":
        errors.append(f"input.id_column '{ids}' does not apply to input.format 'webdataset': each row's id is its key; remove it")
    elif ids is not None and ids == job.input.media_column:
        errors.append(
            f"input.id_column '{ids}' is input.media_column: each id would be a copy of the media; "
            "name a column of ids, or null to use the row index"
        )


def _check_text(job: Job, errors: list[str]) -> None:
    """Captions (`input.text_column`) and zero-shot labels (`output.labels`) need a
    family whose checkpoints carry a text tower (`registry.Family.text`) and one vector
    per row in the text's space (not per token, not [global ; tiles], twice its width)."""
    text, labels = job.input.text_column, job.output.labels
    if text is None and not labels:
        return
    asked = "input.text_column" if text is not None else "output.labels"
    family = job.model.family
    if family not in TEXT_FAMILIES:
        errors.append(
            f"{asked} needs a model with a text tower ({', '.join(TEXT_FAMILIES)}); model.family {family!r} has none: "
            f"remove {asked} or use one of those families"
        )
    if job.output.pooling == "none":
        errors.append(f"{asked} compares one vector per row with text; output.pooling = 'none' gives one per token: use pooling: mean")
    if job.preprocess.tiling == "anyres" and job.preprocess.tile_combine == "concat":
        errors.append(
            f"{asked} compares image and text vectors, and tile_combine = 'concat' makes image vectors twice the text's "
            "width; use preprocess.tile_combine: mean or tiling: none"
        )
    if text is not None and not text:
        errors.append("input.text_column = '' names no column; name the caption column, or null for none")
    if text is not None and text in (job.input.media_column, job.input.id_column):
        errors.append(f"input.text_column {text!r} is the media or id column; name the column of captions")
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        errors.append(f"output.labels names {repeated} more than once")
    if any(not label.strip() for label in labels):
        errors.append("output.labels has an empty prompt; give each label its text, e.g. 'a photo of a cat'")


def cache_root(configured: str | None) -> Path:
    """Where builtin models, compiled artefacts, webdataset tar indexes
    (`io.index_cache`) and the bytecode `embedjob run` keeps (`keep_bytecode`) are kept.

    The job key wins, then $EMBEDJOB_CACHE, then ~/.cache/embedjob, so cluster users can
    point every task at one shared directory.
    """
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("EMBEDJOB_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "embedjob"


def keep_bytecode(root: Path) -> None:
    """Where this environment writes no Python bytecode and torch was installed without
    it, keep the bytecode of what this process imports under `root`/pycache, for it and
    for the ranks and decode workers it starts (they read it through the environment).

    PYTHONDONTWRITEBYTECODE is common on clusters and in containers, and pip installs no
    bytecode under it; every rank then compiles torch's compiler, transformers' modeling
    code and its own modules from source again, 7-8 s of each run's setup on an H200
    machine (benchmarks/RESULTS.md, section 4). A mirror tree
    (`sys.pycache_prefix`) leaves the installed packages untouched. Changes nothing where
    bytecode is written anyway, where the user chose a prefix (PYTHONPYCACHEPREFIX), or
    where torch's compiler has its bytecode beside its source."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or _torch_has_bytecode():
        return
    prefix = str((root / "pycache").absolute())  # a Ray task leaves the directory it ran from
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    logger.debug("keeping Python's bytecode under %s (PYTHONDONTWRITEBYTECODE is set)", prefix)


DEVICE_QUEUES = "32"
"""Hardware work queues a process's CUDA streams spread over (CUDA's own default is 8,
its largest value 32); see `spread_device_queues`."""


def spread_device_queues() -> None:
    """Give the CUDA streams of this process, and of the ranks it starts, `DEVICE_QUEUES`
    hardware work queues, unless the user chose a number (CUDA_DEVICE_MAX_CONNECTIONS).

    Streams beyond the queues' number share one, and a queue starts its work in order. A
    rank has more streams than CUDA's default 8 queues (torch's pool alone makes dozens),
    so nvjpeg's stream in the GPU decoder shared a queue with the encoder's graphs, and
    each picture's kernel waited for the GEMMs queued ahead of it: beside a stream of
    back-to-back GEMMs a window of 256 JPEGs took 340 ms with 8 queues and 12 ms with 32
    (7 ms on an idle device), and the rank's main thread stopped waiting for the
    GPU-decode thread (benchmarks/RESULTS.md, "Hardware work queues"). The driver reads
    the variable when the process first uses CUDA, so this runs before that."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ:
        return
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = DEVICE_QUEUES
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        logger.info(
            "CUDA was in use in this process before the job started, so its own streams keep "
            "CUDA's 8 hardware work queues (the ranks it starts get %s); for the GPU decoders' "
            "full speed set CUDA_DEVICE_MAX_CONNECTIONS=%s before the process first uses CUDA",
            DEVICE_QUEUES,
            DEVICE_QUEUES,
        )


def prepare_process(cache_dir: str | None) -> None:
    """What a process that runs jobs sets up before it imports torch: Python's bytecode
    kept under the cache (`keep_bytecode`) and CUDA's hardware work queues spread
    (`spread_device_queues`), for it and for the ranks and decode workers it starts.

    The command, `embedjob.run` and a Ray task each call it first, as both settings are
    read only once: bytecode when a module is first imported, the queues when the process
    first uses CUDA."""
    keep_bytecode(cache_root(cache_dir))
    spread_device_queues()


def _torch_has_bytecode() -> bool:
    """Whether the installed torch.compile's largest module has bytecode beside its
    source (found without importing torch), as an install that wrote bytecode has."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # nothing to keep: the run stops at its first torch import anyway
    source = Path(spec.submodule_search_locations[0]) / "_inductor" / "compile_fx.py"
    return Path(importlib.util.cache_from_source(str(source))).exists()
