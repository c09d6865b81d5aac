"""Session-wide test settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _loops_compiled_before_the_first_batch() -> Iterator[None]:
    """Loaders compile their producer loop before the first batch, as the engine's tests expect of epoch 0.

    (By default a loader whose loop is not cached makes its first epoch with Python
    producers while the loop compiles in the background: tests/loader/test_cold_start.py.)
    """
    old = os.environ.get("STOKER_COMPILE_IN_BACKGROUND")
    os.environ["STOKER_COMPILE_IN_BACKGROUND"] = "0"
    yield
    if old is None:
        os.environ.pop("STOKER_COMPILE_IN_BACKGROUND", None)
    else:
        os.environ["STOKER_COMPILE_IN_BACKGROUND"] = old


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
