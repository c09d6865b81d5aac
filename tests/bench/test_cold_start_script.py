"""benchmarks/cold_start.py: its checks refuse wrong batches before any figure, its table, and (long) one measured
process on a small Otto-shaped table."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cold_start.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("cold_start_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(**changes: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "shapes": [[[1024, 93], "torch.float32"], [[1024], "torch.int64"]],
        "odd batches": [],
        "epoch samples": 61878,
        "samples": 61878,
        "first batch": 1.0,
        "first epoch": 2.0,
        "cpu": 1.5,
    }
    for col in _script().COLUMNS:
        r.setdefault(col, 0.5)
    r.update(changes)
    return r


def test_the_checks_refuse_wrong_batches() -> None:
    cold = _script()
    assert cold.check("otto", _result()) == ""
    assert "the first batch is" in cold.check("otto", _result(shapes=[[[1024, 93], "torch.float64"], [[1024], "torch.int64"]]))
    assert "unlike the first" in cold.check("otto", _result(**{"odd batches": [[[[92], "torch.float32"], [[], "torch.int64"]]]}))
    assert "samples of 61878" in cold.check("otto", _result(**{"epoch samples": 61000}))
    photo = _result(shapes=[[[64, 3, 224, 224], "torch.uint8"], [[64], "torch.int64"]])
    assert cold.check("photo", photo) == ""
    assert "the first batch is" in cold.check("photo", dict(photo, shapes=[[[64, 224, 224, 3], "torch.uint8"], [[64], "torch.int64"]]))


def test_the_table_gives_medians_and_spreads() -> None:
    cold = _script()
    text = cold.table({"otto": [_result(**{"first batch": t}) for t in (1.0, 3.0, 2.0)]})
    assert "| otto | 3 |" in text and "**2.00** (1.00-3.00)" in text
    assert cold.SCENARIOS["otto"][2] == {}, "the README's install uses the prebuilt kernels the repository ships"
    assert cold.SCENARIOS["otto-source"][2] == {"STOKER_PREBUILT": "0"}


@pytest.mark.long
def test_one_measured_process(tmp_path: Path) -> None:
    """The measured process on a small table of Otto's shape, with this session's caches: its batches check."""
    from stoker.fields import IntField, NDArrayField
    from stoker.writer import DatasetWriter

    cold = _script()
    rng = np.random.default_rng(0)
    rows = [(rng.random(93, dtype=np.float32), i % 9) for i in range(2500)]
    path = tmp_path / "otto.stoker"
    DatasetWriter(
        path, {"x": NDArrayField(shape=(93,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_indexed_dataset(rows)
    r = cold._run_child("otto", path, None, 600.0, {"STOKER_COMPILE_IN_BACKGROUND": os.environ.get("STOKER_COMPILE_IN_BACKGROUND", "1")})
    assert cold.check("otto", r) == "", r
    assert r["epoch batches"] == 3 and r["first batch"] <= r["first epoch"]
