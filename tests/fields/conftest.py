"""Under ``make test`` (hypothesis profile ``ci``) these tests' batches are made by Python producers (``tests/_profile.py``)."""

from __future__ import annotations

import pytest

from .._profile import python_producers_unless_long


@pytest.fixture(autouse=True)
def _python_producers_unless_long(monkeypatch: pytest.MonkeyPatch) -> None:
    python_producers_unless_long(monkeypatch)
