"""Systems timed in alternating rounds, and what the rounds say: medians, their spread, a verdict.

A machine whose load changes while a benchmark runs turns a comparison of systems
timed one after the other upside down: the one that ran during a burst loses. Here
every round times each system once (one or more epochs), in alternating order
(``A B C``, then ``C B A``, ...), and a ratio is taken **within each round**, where
both systems saw about the same load. The result is the median of the per-round
ratios with their spread (quartiles and range), and a verdict that only says
"faster" or "slower" when at least three quarters of the rounds agree by more
than 5% (``EQUIVALENCE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def order(names: Sequence[T], round_: int) -> list[T]:
    """The order of the systems in round ``round_``: as given in even rounds, reversed in odd ones."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``median``, quartiles ``q25``/``q75``, ``min``/``max`` and ``n`` of per-round values (``nan`` when empty)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        nan = float("nan")
        return {"median": nan, "q25": nan, "q75": nan, "min": nan, "max": nan, "n": 0}
    q25, med, q75 = np.percentile(v, [25, 50, 75])
    return {"median": float(med), "q25": float(q25), "q75": float(q75), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


#: speed ratios within this factor of 1 are "on par": a difference of a few percent is within what two runs of the
#: same system differ by on a shared machine
EQUIVALENCE = 1.05


def verdict(ratio: dict[str, Any]) -> str:
    """``"faster"`` when the lower quartile of a speed ratio is above ``EQUIVALENCE``, ``"slower"`` when the upper one
    is below ``1 / EQUIVALENCE``, else ``"on par"`` (the rounds disagree, or the difference is within a few percent)."""
    if ratio["n"] == 0:
        return "unknown"
    if ratio["q25"] > EQUIVALENCE:
        return "faster"
    if ratio["q75"] < 1 / EQUIVALENCE:
        return "slower"
    return "on par"


def describe(ratio: dict[str, Any]) -> str:
    """``"1.06x (rounds: quartiles 0.98x-1.10x, range 0.91x-1.21x, 10 rounds)"``."""
    return (
        f"{ratio['median']:.2f}x (rounds: quartiles {ratio['q25']:.2f}x-{ratio['q75']:.2f}x, "
        f"range {ratio['min']:.2f}x-{ratio['max']:.2f}x, {ratio['n']} rounds)"
    )


def within(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two measurements of one ratio agree: each median inside the other's range."""
    return bool(b["min"] <= a["median"] <= b["max"] and a["min"] <= b["median"] <= a["max"])
