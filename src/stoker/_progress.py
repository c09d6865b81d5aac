"""A progress bar for long work (writing a dataset, checking images): tqdm's, or none at all.

``progress=None`` shows one when stderr is a terminal, as tqdm's ``disable=None`` does;
``False`` never. Where none is shown, no tqdm object is made: tqdm (4.70) starts its
monitor thread even for a disabled bar, a thread that then stays for the rest of the process.
"""

from __future__ import annotations

import sys
from typing import Any


class _NoBar:
    """What a bar is asked for (``update``, a ``with`` block), doing nothing."""

    def update(self, n: int = 1) -> None:
        """Nothing: no bar is shown."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress_bar(total: int, unit: str, desc: str, progress: bool | None) -> Any:
    """A tqdm bar over ``total`` ``unit`` (``desc`` its label), or a bar that shows nothing.

    Args:
        total: the work's size.
        unit: what it counts (``"samples"``).
        desc: its label.
        progress: ``True``: shown; ``False``: not; ``None``: shown when stderr is a terminal.
    """
    if progress is False or (progress is None and not _is_terminal()):
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc=desc)


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # (a closed stream)
        return False
