"""How hard the suite's property tests try: the hypothesis profile ``ci`` (``make test``) or ``long`` (``make test-long``).

``tests/conftest.py`` registers both profiles and loads the one named by
``$HYPOTHESIS_PROFILE`` (``ci`` when unset). A test whose examples are costly
(each compiles a pipeline or runs a loader) asks for its own counts with
:func:`examples`: a few under ``ci``, the full run under ``long``; the same
check either way.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest


def long_run() -> bool:
    """Whether the ``long`` profile (``make test-long``, nightly) is the one loaded (``$HYPOTHESIS_PROFILE``)."""
    return (os.environ.get("HYPOTHESIS_PROFILE") or "ci") == "long"


def examples(ci: int, long: int) -> int:
    """``max_examples`` for a costly property test: ``ci`` examples under ``make test``, ``long`` under ``make test-long``."""
    return long if long_run() else ci


def python_producers_unless_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests of operations, decoders and fields: their batches made by Python producers under ``ci``.

    Python producers call the same compiled per-field functions (the decoders and operations,
    fused or not) as the compiled producer loop; the loop is the glue around those calls, and
    each new combination of operations compiles a loop of its own (seconds each: most of the
    compile time of these tests). Under ``ci`` these tests check the operations and leave the
    loop to its own tests (``tests/loader``, ``tests/pipeline``: the same batches either way);
    under ``long`` they run through the compiled loop, as users' loaders do.
    """
    if not long_run():
        monkeypatch.setenv("STOKER_COMPILED_EPOCH", "0")
