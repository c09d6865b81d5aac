"""A small table for the accounting tests, written once per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stoker.fields import IntField, NDArrayField
from stoker.writer import DatasetWriter

N = 320


@pytest.fixture(scope="session")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("observe") / "table.stoker"
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((N, 8)).astype(np.float32), "y": np.arange(N)}
    DatasetWriter(
        path, {"x": NDArrayField(shape=(8,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_arrays(arrays)
    return path
