"""The encoder families embedjob runs, one entry each (see ARCHITECTURE.md).

Adding a family is one entry here plus its spec in the adapter module the entry names;
the job's `model.family` choices and its checks read this table. No torch: a job spec
is read and checked (its family found in its checkpoint's config.json where the job
leaves it out, `family_of`) before any model library is imported.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BUILTIN = "builtin:tiny-"
"""The prefix of a builtin model's `model.path`; the family's name follows it."""
OPEN_CLIP_CONFIG = "open_clip_config.json"
"""What an OpenCLIP checkpoint holds where a transformers one holds config.json."""
OPEN_CLIP_HUB = "hf-hub:"
"""OpenCLIP's prefix of a hub id (`hf-hub:org/name`)."""


@dataclass(frozen=True)
class Family:
    """`adapter`: the module whose `build_adapter(family, path, dtype, device, options)`
    loads the family; `fixed_resolution`: the tower takes one image size (so it can tile);
    `model_types`: the `model_type`s of its checkpoints' config.json (full model, vision
    tower), as its adapter's spec checks them; `package`: the module its adapter needs
    beyond embedjob's own dependencies, from the extra `pip install 'embedjob[<extra>]'`
    (a job naming the family without it stops before any work); `poolable`: its image
    vector is the job's choice (`model.pool`: the CLS token or the patch mean); `text`:
    its full checkpoints carry a text tower and tokenizer, which the adapter module's
    `build_adapter` loads beside the image tower when `AdapterOptions.text` asks
    (captions and zero-shot labels): CLIP, SigLIP, MetaCLIP 2 and SigLIP 2 through
    `fixed.build_text`, OpenCLIP through `open_clip.build_text`."""

    adapter: str
    fixed_resolution: bool
    model_types: tuple[str, ...]
    package: str | None = None
    extra: str | None = None
    poolable: bool = False
    text: bool = False


_QWEN = "embedjob.encoders.qwen"
_FIXED = "embedjob.encoders.fixed"
_SIGLIP2 = "embedjob.encoders.siglip2"

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(_QWEN, False, ("qwen2_vl", "qwen2_vl_vision")),
    "qwen2_5_vl": Family(_QWEN, False, ("qwen2_5_vl", "qwen2_5_vl_vision")),
    "qwen3_vl": Family(_QWEN, False, ("qwen3_vl", "qwen3_vl_vision")),
    "qwen3_5": Family(_QWEN, False, ("qwen3_5", "qwen3_5_vision", "qwen3_5_moe", "qwen3_5_moe_vision")),
    "clip": Family(_FIXED, True, ("clip", "clip_vision_model"), text=True),
    "siglip": Family(_FIXED, True, ("siglip", "siglip_vision_model"), text=True),
    "dinov2": Family(_FIXED, True, ("dinov2",), poolable=True),
    "dinov3": Family(_FIXED, True, ("dinov3_vit",), poolable=True),
    "metaclip2": Family(_FIXED, True, ("metaclip_2", "metaclip_2_vision_model"), text=True),
    "siglip2": Family(_SIGLIP2, False, ("siglip2", "siglip2_vision_model"), text=True),
    "open_clip": Family("embedjob.encoders.open_clip", True, (), package="open_clip", extra="open_clip", text=True),
}


def family_of(path: str) -> str | None:
    """The family of the checkpoint `model.path` names, None where it cannot be told:
    a builtin model's from its name, a local directory's or a hub id's from the
    `model_type` of its config.json (a hub id's fetched, or read from the local cache
    offline). An OpenCLIP checkpoint has an `open_clip_config.json` and no config.json,
    or is named `hf-hub:org/name`. A checkpoint of no family here is left to the loader,
    which names it."""
    if path.startswith(BUILTIN):
        name = path.removeprefix(BUILTIN)
        return name if name in FAMILIES else None
    if path.startswith(OPEN_CLIP_HUB):
        return "open_clip"
    local = Path(path).expanduser()
    if local.is_dir():
        config = local / "config.json"
        if not config.exists() and (local / OPEN_CLIP_CONFIG).is_file():
            return "open_clip"
    else:
        config = _hub_config(path)
        if config is None and _hub_config(path, OPEN_CLIP_CONFIG) is not None:
            return "open_clip"
    if config is None:
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return next((name for name, family in FAMILIES.items() if model_type in family.model_types), None)


def _hub_config(repo_id: str, name: str = "config.json") -> Path | None:
    """A hub checkpoint's config file `name`, None when there is none to be had (not a
    hub id, no network and not cached)."""
    if local_looking(repo_id):
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, name))
    except Exception as exc:  # the hub client raises many kinds; the loader reports the real problem
        logger.debug("no %s for %s: %s", name, repo_id, exc)
        return None


def local_looking(path: str) -> bool:
    """Whether `path` reads as a local path rather than a hub id (`org/name`)."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists() or path.count("/") != 1

FIXED_RESOLUTION = tuple(name for name, family in FAMILIES.items() if family.fixed_resolution)
POOLABLE = tuple(name for name, family in FAMILIES.items() if family.poolable)

TEXT_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.text)
"""The families that can embed captions and labels (`input.text_column`, `output.labels`)."""

ADAPTER_MODULES = tuple(dict.fromkeys(family.adapter for family in FAMILIES.values()))
"""Every adapter module, once each: decode workers import them before their first task."""
