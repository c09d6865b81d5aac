"""stoker: keeps the accelerator fed.

A memory-mappable dataset format with a parallel writer, and a loader that runs
compiled per-field pipelines on threads into preallocated batch memory.

Nothing heavy runs at import: ``import stoker`` loads no numba, no torch; the
names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DatasetWriter": "stoker.format.writer",
    "Loader": "stoker.loader",
    "OrderOption": "stoker.loader",
    "Reader": "stoker.format.reader",
    "Stream": "stoker.loader",
    "prefetch": "stoker.device",
    "to_device": "stoker.device",
}

__all__ = ["DatasetWriter", "Loader", "OrderOption", "Reader", "Stream", "__version__", "prefetch", "to_device"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stoker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
