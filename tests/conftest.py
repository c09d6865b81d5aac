"""Session-wide test settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_fused_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fused pipelines compiled by the tests are cached in a temporary folder, not in ~/.cache."""
    old = os.environ.get("STOKER_CACHE_DIR")
    os.environ["STOKER_CACHE_DIR"] = str(tmp_path_factory.mktemp("stoker-cache"))
    yield
    if old is None:
        os.environ.pop("STOKER_CACHE_DIR", None)
    else:
        os.environ["STOKER_CACHE_DIR"] = old
