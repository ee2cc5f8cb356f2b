"""Encoder adapters: the model side of embedjob (see ARCHITECTURE.md).

`registry` names the families, `loading` finds and loads their checkpoints, and one
module per kind of tower (`qwen`, `fixed`) holds its adapter. Importing this package
loads no torch: the job spec reads the registry before any model library is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EncoderAdapter": "embedjob.encoders.base",
    "EncoderInput": "embedjob.encoders.base",
    "StaticInputs": "embedjob.encoders.base",
    "load_adapter": "embedjob.encoders.loading",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
