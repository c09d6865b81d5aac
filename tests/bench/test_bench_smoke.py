"""``stoker bench --quick`` runs end to end and reports every system, checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from stoker.loader import Loader  # noqa: F401

    LOADER_MISSING = ""
except ImportError as exc:  # the loader is written in parallel with this test
    LOADER_MISSING = f"stoker.loader cannot be imported yet: {exc}"

needs_loader = pytest.mark.skipif(bool(LOADER_MISSING), reason=LOADER_MISSING)

SYSTEMS = {"torch_getitem_w0", "torch_getitem_w2", "torch_getitems_w0", "torch_getitems_w2", "numpy_take", "stoker_w1", "stoker_w2"}


@pytest.mark.slow
@needs_loader
def test_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "stoker", "bench", "--quick", "--out", str(out), "--stoker-workers", "1,2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"stoker bench exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "otto.json").read_text())
    assert (out / "otto.md").read_text() in proc.stdout
    assert (out / "otto.png").stat().st_size > 1000

    loading = results["loading"]["systems"]
    assert set(loading) == SYSTEMS
    assert loading["numpy_take"]["ratio_to_limit"] == pytest.approx(1.0)
    for key, r in loading.items():
        assert math.isfinite(r["ratio_to_limit"]) and r["ratio_to_limit"] > 0, key
        assert r["samples_per_s"] > 0 and r["first_epoch_s"] > 0, key
        assert (r["batch"]["x"], r["batch"]["y"]) == ([[1024, 93], "float32"], [[1024], "int64"]), key
        assert r["samples_per_epoch"] == (results["dataset"]["num_samples"] // 1024) * 1024, key

    training = results["training"]
    assert set(training["systems"]) == {"STOKER", "TORCH"}
    for stats in training["systems"].values():
        assert 0 < stats["median_s"] <= stats["q95_s"]
    assert set(training["uplift_percent"]) == {"mean_s", "median_s", "q95_s"}
    assert all(math.isfinite(v) for v in training["final_loss"].values())

    startup = results["startup"]
    assert set(startup) == {"cold", "warm"}
    for run in startup.values():
        assert 0 < run["construct_to_first_batch_s"] < run["process_s"]


def test_bench_rejects_bad_options(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stoker", "bench", "--out", str(tmp_path), "--samples", "100"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "num_samples" in proc.stderr and "got 100" in proc.stderr
    assert not (tmp_path / "otto.json").exists()


def test_broken_loader_reports_no_number() -> None:
    import numpy as np

    from stoker.bench.data import fingerprints, make_otto_arrays
    from stoker.bench.loading import BenchCheckError, SystemSpec, run_system

    X, y = make_otto_arrays(4096, seed=1)
    reference = fingerprints(X, y)

    class Repeats:
        """Fast and wrong: the same batch over and over."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            for _ in range(4):
                yield X[:1024], y[:1024]

    class Sequential:
        """Right samples, but in file order though random order was asked for."""

        def __iter__(self):  # type: ignore[no-untyped-def]
            for b in range(4):
                yield X[b * 1024 : (b + 1) * 1024], y[b * 1024 : (b + 1) * 1024]

    class WrongDtype:
        def __iter__(self):  # type: ignore[no-untyped-def]
            for b in range(4):
                yield X[b * 1024 : (b + 1) * 1024].astype(np.float64), y[b * 1024 : (b + 1) * 1024]

    for cls, message in [(Repeats, "more than once"), (Sequential, "file order"), (WrongDtype, "float32")]:
        with pytest.raises(BenchCheckError, match=message):
            run_system(SystemSpec("broken", "broken", 1, cls, 1), reference, 1024, 93)
