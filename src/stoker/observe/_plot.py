"""A PNG of each recorder's per-step wait against its step time (matplotlib, imported only here)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoker.observe._recorder import EPOCH, T_ENTER, T_EXIT, attribute

if TYPE_CHECKING:
    from stoker.observe._recorder import Recorder


def plot_steps(recorders: list[Recorder], path: str | os.PathLike[str]) -> Path | None:
    """Per step: the time the loop waited in ``next()`` and the time of its step, one panel per recorder.

    Returns:
        The path written, or ``None`` when matplotlib is not installed (``pip install matplotlib``)
        or no recorder has a step.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(r, *r.recent()) for r in recorders]
    panels = [(r, s, m) for r, s, m in panels if len(s)]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels)), squeeze=False)
    for ax, (rec, s, m) in zip(axes[:, 0], panels, strict=True):
        wait_ms = attribute(s, m)["stall"] * 1e-6
        step_ms = np.full(len(s), np.nan)
        same = np.concatenate(([False], s[1:, EPOCH] == s[:-1, EPOCH]))
        step_ms[same] = (s[1:, T_ENTER] - s[:-1, T_EXIT])[same[1:]] * 1e-6
        x = np.arange(len(s))
        ax.plot(x, step_ms, lw=0.8, label="step (the loop's own work) [ms]")
        ax.plot(x, wait_ms, lw=0.8, label="wait for data in next() [ms]")
        ax.set_title(rec.label, fontsize=9)
        ax.set_xlabel("step (the last batches recorded)")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
