"""The encoder families embedjob runs, one entry each (see ARCHITECTURE.md).

Adding a family is one entry here plus its spec in the adapter module the entry names;
the job's `model.family` choices and its checks read this table. Pure data, no torch:
a job spec is read and checked before any model library is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """`adapter`: the module whose `build_adapter(family, path, dtype, device, options)`
    loads the family; `fixed_resolution`: the tower takes one image size (so it can tile)."""

    adapter: str
    fixed_resolution: bool


_QWEN = "embedjob.encoders.qwen"
_FIXED = "embedjob.encoders.fixed"

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(_QWEN, fixed_resolution=False),
    "qwen2_5_vl": Family(_QWEN, fixed_resolution=False),
    "qwen3_vl": Family(_QWEN, fixed_resolution=False),
    "clip": Family(_FIXED, fixed_resolution=True),
    "siglip": Family(_FIXED, fixed_resolution=True),
    "dinov2": Family(_FIXED, fixed_resolution=True),
}

FIXED_RESOLUTION = tuple(name for name, family in FAMILIES.items() if family.fixed_resolution)

ADAPTER_MODULES = tuple(dict.fromkeys(family.adapter for family in FAMILIES.values()))
"""Every adapter module, once each: decode workers import them before their first task."""
