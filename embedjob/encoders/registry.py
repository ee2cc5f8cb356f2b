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


@dataclass(frozen=True)
class Family:
    """`adapter`: the module whose `build_adapter(family, path, dtype, device, options)`
    loads the family; `fixed_resolution`: the tower takes one image size (so it can tile);
    `model_types`: the `model_type`s of its checkpoints' config.json (full model, vision
    tower), as its adapter's spec checks them; `poolable`: its image vector is the job's
    choice (`model.pool`: the CLS token or the patch mean)."""

    adapter: str
    fixed_resolution: bool
    model_types: tuple[str, ...]
    poolable: bool = False


_QWEN = "embedjob.encoders.qwen"
_FIXED = "embedjob.encoders.fixed"
_SIGLIP2 = "embedjob.encoders.siglip2"

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(_QWEN, False, ("qwen2_vl", "qwen2_vl_vision")),
    "qwen2_5_vl": Family(_QWEN, False, ("qwen2_5_vl", "qwen2_5_vl_vision")),
    "qwen3_vl": Family(_QWEN, False, ("qwen3_vl", "qwen3_vl_vision")),
    "clip": Family(_FIXED, True, ("clip", "clip_vision_model")),
    "siglip": Family(_FIXED, True, ("siglip", "siglip_vision_model")),
    "dinov2": Family(_FIXED, True, ("dinov2",), poolable=True),
    "dinov3": Family(_FIXED, True, ("dinov3_vit",), poolable=True),
    "metaclip2": Family(_FIXED, True, ("metaclip_2", "metaclip_2_vision_model")),
    "siglip2": Family(_SIGLIP2, False, ("siglip2", "siglip2_vision_model")),
}


def family_of(path: str) -> str | None:
    """The family of the checkpoint `model.path` names, None where it cannot be told:
    a builtin model's from its name, a local directory's or a hub id's from the
    `model_type` of its config.json (a hub id's fetched, or read from the local cache
    offline). A checkpoint of no family here is left to the loader, which names it."""
    if path.startswith(BUILTIN):
        name = path.removeprefix(BUILTIN)
        return name if name in FAMILIES else None
    local = Path(path).expanduser()
    config = local / "config.json" if local.is_dir() else _hub_config(path)
    if config is None:
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return next((name for name, family in FAMILIES.items() if model_type in family.model_types), None)


def _hub_config(repo_id: str) -> Path | None:
    """A hub checkpoint's config.json, None when there is none to be had (not a hub id,
    no network and not cached)."""
    if local_looking(repo_id):
        return None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as exc:  # the hub client raises many kinds; the loader reports the real problem
        logger.debug("no config.json for %s: %s", repo_id, exc)
        return None


def local_looking(path: str) -> bool:
    """Whether `path` reads as a local path rather than a hub id (`org/name`)."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists() or path.count("/") != 1

FIXED_RESOLUTION = tuple(name for name, family in FAMILIES.items() if family.fixed_resolution)
POOLABLE = tuple(name for name, family in FAMILIES.items() if family.poolable)

ADAPTER_MODULES = tuple(dict.fromkeys(family.adapter for family in FAMILIES.values()))
"""Every adapter module, once each: decode workers import them before their first task."""
