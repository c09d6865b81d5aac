"""Settings read from the environment: one parse, one message naming the variable and what it takes."""

from __future__ import annotations

import os


def env_count(name: str, default: int, unit: str, zero: str) -> int:
    """``$name`` as a whole number >= 0 (``default`` when unset or blank).

    Args:
        name: the variable.
        default: its value when unset or blank.
        unit: what it counts, for the message ("processes", "bytes").
        zero: what 0 means, for the message ("none", "never copy").

    Raises:
        ValueError: the value is not a whole number >= 0; the message names the variable and the value.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"${name}={raw!r}: expected a whole number of {unit} >= 0 (0: {zero})")
    return value
