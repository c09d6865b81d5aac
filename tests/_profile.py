"""How hard the suite's property tests try: the hypothesis profile ``ci`` (``make test``) or ``long`` (``make test-long``).

``tests/conftest.py`` registers both profiles and loads the one named by
``$HYPOTHESIS_PROFILE`` (``ci`` when unset). A test whose examples are costly
(each compiles a pipeline or runs a loader) asks for its own counts with
:func:`examples`: a few under ``ci``, the full run under ``long``; the same
check either way.
"""

from __future__ import annotations

import os


def long_run() -> bool:
    """Whether the ``long`` profile (``make test-long``, nightly) is the one loaded (``$HYPOTHESIS_PROFILE``)."""
    return (os.environ.get("HYPOTHESIS_PROFILE") or "ci") == "long"


def examples(ci: int, long: int) -> int:
    """``max_examples`` for a costly property test: ``ci`` examples under ``make test``, ``long`` under ``make test-long``."""
    return long if long_run() else ci
