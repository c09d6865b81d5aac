"""Recorders kept for ``stoker profile``: while collecting, every Loader and flow made registers its recorder.

Outside ``stoker profile`` nothing is kept (a recorder lives as long as its owner).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.observe._recorder import Recorder

_COLLECTING = False
_RECORDERS: list[Recorder] = []
_LOCK = threading.Lock()


def collect(on: bool = True) -> None:
    """Start (or stop) keeping every recorder made from now on."""
    global _COLLECTING
    _COLLECTING = on


def register(rec: Recorder) -> None:
    """Keep ``rec`` for the end-of-run report, when collecting."""
    if _COLLECTING:
        with _LOCK:
            _RECORDERS.append(rec)


def registered() -> list[Recorder]:
    """The recorders kept, in the order their owners were made."""
    with _LOCK:
        return list(_RECORDERS)


def enabled() -> bool:
    """Whether per-step accounting is on: unless the environment sets ``STOKER_ACCOUNTING=0`` (read when a Loader or flow is made)."""
    return os.environ.get("STOKER_ACCOUNTING", "1") != "0"
