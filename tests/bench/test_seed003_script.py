"""benchmarks/seed003.py: its checks refuse a broken loop before any number, and it runs end to end on a small file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seed003.py"


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("seed003_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Fixed:
    """A loop that yields the same batches every epoch (not shuffled), as ``make`` builds them."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __iter__(self) -> Any:
        return iter(self.make())


def test_the_checks_refuse_broken_loops() -> None:
    seed003 = _script()
    n, bs = 1200, 300
    good = seed003.FastDataloader(torch.arange(n), bs)
    seed003.check_epochs("fast_dataloader", good, n, bs, (bs,), tensors=True)  # the seed's loop passes
    seed003.check_epochs("numpy_permutation", seed003.NumpyPermutation(np.arange(n), bs, 0), n, bs, (bs,), tensors=False)
    broken = {
        "not shuffled every epoch": _Fixed(lambda: list(torch.arange(n).reshape(-1, bs))),
        "a sample twice": _Fixed(lambda: [torch.zeros(bs, dtype=torch.int64)] * (n // bs)),
        "a batch short": _Fixed(lambda: list(torch.randperm(n).reshape(-1, bs))[1:]),
        "int32": _Fixed(lambda: list(torch.randperm(n).to(torch.int32).reshape(-1, bs))),
        "numpy, not tensors": _Fixed(lambda: list(np.random.default_rng().permutation(n).reshape(-1, bs))),
        "(300, 1), not (300,)": _Fixed(lambda: list(torch.randperm(n).reshape(-1, bs, 1))),
    }
    for why, loop in broken.items():
        with pytest.raises(SystemExit):
            seed003.check_epochs(why, loop, n, bs, (bs,), tensors=True)


@pytest.mark.long
def test_seed003_benchmark_runs_and_reports_every_system(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--samples", "3000", "--runs", "2", "--epochs", "4", "--block", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    systems = ["numpy_permutation", "fast_dataloader", "stoker_default_w1", "stoker_default_w2", "stoker_squeeze_w1", "stoker_squeeze_w2"]
    assert [line.split("|")[1].strip() for line in table[1:7]] == systems, out.stdout
    result = json.loads((tmp_path / "seed003.json").read_text())
    assert len(result["runs_detail"]) == 2
    for run in result["runs_detail"]:
        assert set(run["per_batch_us"]) == set(systems) and min(run["per_batch_us"].values()) > 0
        assert min(run["first_batch_us"].values()) > 0
        assert set(run["per_batch_after_switch_us"]) == set(systems) and min(run["per_batch_after_switch_us"].values()) > 0
    assert result["shapes"]["stoker_default_w1"] == [300, 1] and result["shapes"]["stoker_squeeze_w2"] == [300]
    assert all(len(r) == 2 and min(r) > 0 for r in result["ratio_stoker_over"].values())
    assert result["ratio_stoker_over_after_switch"].keys() == result["ratio_stoker_over"].keys()
