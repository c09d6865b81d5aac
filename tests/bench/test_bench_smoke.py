"""``stoker bench --quick`` runs end to end and reports every system, checked; broken systems report nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.bench.baselines import CompiledGather, NumpyTake
from stoker.bench.data import fingerprints, make_otto_arrays
from stoker.bench.loading import BenchCheckError, SystemSpec, run_system

SYSTEMS = {
    "torch_getitem_w0",
    "torch_getitem_w2",
    "torch_getitems_w0",
    "torch_getitems_w2",
    "numpy_take",
    "compiled_gather",
    "stoker_w1",
    "stoker_w2",
    "stoker_seed000_w1",
    "stoker_seed000_w2",
}


@pytest.mark.long
@pytest.mark.slow
def test_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "stoker", "bench", "--quick", "--out", str(out), "--stoker-workers", "1,2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stoker bench exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "otto.json").read_text())
    assert (out / "otto.md").read_text() in proc.stdout
    assert (out / "otto.png").stat().st_size > 1000

    loading = results["loading"]["systems"]
    assert set(loading) == SYSTEMS
    assert loading["numpy_take"]["ratio_to_limit"] == pytest.approx(1.0)
    assert loading["compiled_gather"]["ratio_to_compiled"] == pytest.approx(1.0)
    for key, r in loading.items():
        for ratio in ("ratio_to_limit", "ratio_to_compiled"):
            assert math.isfinite(r[ratio]) and r[ratio] > 0, (key, ratio)
        assert r["samples_per_s"] > 0 and r["first_epoch_s"] > 0, key
        assert (r["batch"]["x"], r["batch"]["y"]) == ([[1024, 93], "float32"], [[1024], "int64"]), key
        assert r["samples_per_epoch"] == (results["dataset"]["num_samples"] // 1024) * 1024, key

    training = results["training"]
    assert list(training["systems"]) == ["STOKER", "TORCH", "TORCH_BATCHED"]
    for stats in training["systems"].values():
        assert 0 < stats["median_s"] <= stats["q95_s"]
    assert set(training["uplift_percent"]) == set(training["speedup_median"]) == {"TORCH", "TORCH_BATCHED"}
    for up in training["uplift_percent"].values():
        assert set(up) == {"mean_s", "median_s", "q95_s"}
    assert all(math.isfinite(v) for v in training["final_loss"].values())
    assert "TORCH_BATCHED (`__getitems__` per batch" in proc.stdout

    for key, r in loading.items():  # where a batch's time went: stoker's loaders only, each kind of stage reported
        if key.startswith("stoker"):
            assert set(r["per_batch_us"]) == {"compiled", "python_stages", "loop_waiting", "producers_waiting"}, key
            assert r["per_batch_us"]["compiled"] > 0 and min(r["per_batch_us"].values()) >= 0, key
        else:
            assert r["per_batch_us"] is None, key
    round_trip = results["machine"]["thread_round_trip_us"]
    assert round_trip["same_cpu"] > 0 and round_trip["two_cpus"] > 0  # this machine has two CPUs
    assert "between two CPUs" in proc.stdout
    assert "| stoker Loader (2 workers) |" in proc.stdout.split("Where a stoker batch's time goes")[1]

    startup = results["startup"]
    assert set(startup) == {"cold", "warm", "warm, numpy batches"}
    assert [r["torch_imported"] for r in startup.values()] == [True, True, False]
    for run in startup.values():
        assert 0 < run["construct_to_first_batch_s"] < run["start_to_first_batch_s"] < run["process_s"]
        assert 0 < run["report_first_batch_s"] <= run["first_batch_s"]  # report() counts from iter() too
    assert "| report()'s first batch [s] |" in proc.stdout

    # the rounds: every system timed in each, ratios with their spread, a verdict per comparison, the load said
    rounds = results["config"]["rounds"]
    assert rounds == 2 and training["rounds"] == rounds
    for name, ratio in training["speedup_rounds"].items():
        assert ratio["n"] == rounds and ratio["min"] <= ratio["median"] <= ratio["max"], name
        assert training["verdict"][name] in {"faster", "slower", "on par"}
    for key, r in loading.items():
        assert len(r["rounds_epoch_s"]) == rounds and r["ratio_to_compiled_rounds"]["n"] == rounds, key
        assert 0 < r["first_batch_s"] <= r["first_epoch_s"], key
    for s in training["systems"].values():
        assert s["first_batch_s"] > 0 and s["epoch_first_batch_median_s"] > 0
    whats = [v["what"] for v in results["verdicts"]]
    assert len(whats) == 4 and all(v["verdict"] in {"faster", "slower", "on par"} for v in results["verdicts"])
    assert "## Verdicts" in proc.stdout and "training step, stoker vs the batched DataLoader" in proc.stdout
    load = results["machine"]["load"]
    assert load["samples"] > 0 and load["cores"] >= 1 and load["busy"] in (True, False)
    assert len(load["rounds"]["loading"]) == len(load["rounds"]["training"]) == rounds
    assert ("WARNING: the machine was busy" in proc.stdout) == load["busy"]


def test_bench_rejects_bad_options(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stoker", "bench", "--out", str(tmp_path), "--samples", "100"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "num_samples" in proc.stderr and "got 100" in proc.stderr
    assert not (tmp_path / "otto.json").exists()


def _fake_results() -> dict[str, Any]:
    """A results dict shaped like run_otto_bench's, with made-up numbers (for the report alone)."""
    stats = {"mean_s": 0.004, "median_s": 0.003, "q95_s": 0.005, "samples_per_s": 250_000.0}
    system = {
        "label": "x",
        "samples_per_s": 1e6,
        "ratio_to_limit": 1.0,
        "ratio_to_compiled": 0.5,
        "median_epoch_s": 0.01,
        "first_epoch_s": 0.02,
    }
    return {
        "machine": {
            "cpu_count": 2,
            "platform": "p",
            "python": "3",
            "torch": "t",
            "numpy": "n",
            "numba": "b",
            "cuda": "none",
            "date": "d",
            "loadavg_1min": {"start": 0.0, "end": 0.0},
            "load": {
                "others": 0.0,
                "own": 2.0,
                "cores": 2,
                "free": 0.0,
                "samples": 10,
                "busy": False,
                "loadavg_1min": {"start": 0.0, "max": 0.0, "end": 0.0},
            },
        },
        "config": {"batch_size": 1024, "train_epochs": 1, "num_workers": 1, "load_epochs": 2, "slow_epochs": 1},
        "dataset": {"num_samples": 16384, "num_features": 93, "file_bytes": 2**20},
        "training": {
            "device": "cpu",
            "skip_batches": 10,
            "systems": {"STOKER": stats, "TORCH": stats, "TORCH_BATCHED": stats},
            "uplift_percent": {
                "TORCH": {"mean_s": 0.0, "median_s": 0.0, "q95_s": 0.0},
                "TORCH_BATCHED": {"mean_s": 0.0, "median_s": 0.0, "q95_s": 0.0},
            },
            "speedup_median": {"TORCH": 1.0, "TORCH_BATCHED": 1.0},
        },
        "loading": {"systems": {"numpy_take": {**system, "key": "numpy_take"}, "stoker_w1": {**system, "key": "stoker_w1"}}},
        "startup": None,
    }


def test_report_without_matplotlib_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.bench.report import matplotlib_missing, to_markdown, write_outputs

    (tmp_path / "otto.png").write_bytes(b"a chart of an earlier run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    note = matplotlib_missing()
    assert note is not None and "pip install" in note and "\n" not in note
    results = _fake_results()
    paths = write_outputs(results, tmp_path)
    assert paths["chart"] is None and not (tmp_path / "otto.png").exists()
    assert (tmp_path / "otto.md").read_text() == to_markdown(results)
    assert json.loads((tmp_path / "otto.json").read_text())["training"]["speedup_median"] == {"TORCH": 1.0, "TORCH_BATCHED": 1.0}
    assert "| UPLIFT vs TORCH_BATCHED (%) |" in to_markdown(results)


def test_cli_without_matplotlib_prints_the_table_and_a_note(tmp_path: Path) -> None:
    """The whole command with matplotlib hidden: the table, no chart, one line saying how to get it."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import stoker.bench.otto as otto\n"
        "from stoker.cli.bench import main\n"
        f"otto.run_otto_bench = lambda config, log: {_fake_results()!r}\n"
        f"sys.exit(main(['--out', {str(tmp_path)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "# stoker bench: Otto" in proc.stdout and "| STOKER |" in proc.stdout
    notes = [line for line in proc.stderr.splitlines() if "matplotlib" in line]
    assert len(notes) == 1 and "pip install" in notes[0]
    assert (tmp_path / "otto.md").exists() and not (tmp_path / "otto.png").exists()


class _Staged(CompiledGather):
    """The compiled gather with a loader's ``stats()``: made-up stage times, a first epoch far slower than the others."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epochs = 0
        self.seconds = {"compiled[NDArrayDecoder()]": 0.0, "ToTensor()": 0.0}
        self.waits = {"consumer_waiting_for_producer": 0.0, "producer_waiting_for_consumer": 0.0, "kept_batches": 0.0}

    def __iter__(self):  # type: ignore[no-untyped-def]
        first = self.epochs == 0
        self.epochs += 1
        for batch in super().__iter__():
            self.seconds["compiled[NDArrayDecoder()]"] += 5.0 if first else 40e-6  # the first epoch compiles
            self.seconds["ToTensor()"] += 3e-6
            self.waits["consumer_waiting_for_producer"] += 7e-6
            self.waits["producer_waiting_for_consumer"] += 1e-6
            yield batch

    def stats(self) -> dict[str, dict[str, float]]:
        return {"x": dict(self.seconds), "y": {"compiled[IntDecoder()]": 2e-6 * self.epochs}, "loader": dict(self.waits)}


def test_where_a_batch_time_goes_counts_the_timed_epochs_only() -> None:
    """``per_batch_us`` divides what the timed epochs added to ``stats()`` by their batches; the first epoch is left out."""
    from stoker.bench.report import per_batch_table

    X, y = make_otto_arrays(4096, seed=3)
    result = run_system(SystemSpec("staged", "staged", 2, lambda: _Staged(X, y, 1024, seed=0), 3), fingerprints(X, y), 1024, 93)
    spent = result.per_batch_us
    assert spent is not None
    # 3 timed epochs of 4 batches: x's compiled 40 us a batch, y's 2 us an epoch (2/4 us a batch)
    assert spent["compiled"] == pytest.approx(40 + 2 / 4)
    assert spent["python_stages"] == pytest.approx(3)
    assert spent["loop_waiting"] == pytest.approx(7)
    assert spent["producers_waiting"] == pytest.approx(1)
    assert spent["compiled"] < 1000  # the first epoch's 5 s a batch would show here
    plain = run_system(SystemSpec("plain", "plain", 1, lambda: CompiledGather(X, y, 1024, seed=0), 1), fingerprints(X, y), 1024, 93)
    assert plain.per_batch_us is None
    loading = {"systems": {"compiled_gather": plain.to_dict(), "staged": result.to_dict()}}
    table = per_batch_table(loading)
    row = [line for line in table.splitlines() if line.startswith("| staged |")]
    wall = result.median_epoch_s / 4 * 1e6
    assert row == [f"| staged | {wall:.1f} | {plain.median_epoch_s / 4 * 1e6:.1f} | 40.5 | 3.0 | 7.0 | 1.0 |"]
    assert per_batch_table({"systems": {"compiled_gather": plain.to_dict()}}) == ""


def test_thread_round_trip_is_measured_and_the_affinity_restored() -> None:
    import os

    from stoker.bench.loading import thread_round_trip_us

    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    assert 0 < thread_round_trip_us((cpus[0], cpus[-1]), round_trips=200, repeats=1) < 1e5
    assert os.sched_getaffinity(0) == mine
    assert 0 < thread_round_trip_us(None, round_trips=200, repeats=1) < 1e5
    with pytest.raises(ValueError, match=r"cpus \(0, 4096\) are not all among"):
        thread_round_trip_us((0, 4096), round_trips=10, repeats=1)
    assert os.sched_getaffinity(0) == mine


@pytest.mark.parametrize("cls", [NumpyTake, CompiledGather])
@pytest.mark.parametrize("shuffle", [True, False])
def test_limits_gather_the_dataset_rows(cls: type, shuffle: bool) -> None:
    X, y = make_otto_arrays(3000, seed=2)
    limit = cls(X, y, 512, seed=0, shuffle=shuffle)
    rows = []
    for xb, yb in limit:
        pos = [int(np.flatnonzero((r == X).all(axis=1) & (y == label))[0]) for r, label in zip(xb, yb)]
        rows.extend(pos)
        np.testing.assert_array_equal(xb, X[pos])
    assert len(rows) == len(set(rows)) == (3000 // 512) * 512
    assert (rows == sorted(rows)) == (not shuffle)


def test_broken_loader_reports_no_number() -> None:
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


def test_wrong_values_in_file_order_report_no_number() -> None:
    """A system right in random order but whose rows in file order are not the dataset's (one value off)."""
    X, y = make_otto_arrays(4096, seed=1)
    reference = fingerprints(X, y)

    def off_by_one_value() -> Any:
        bad = X.copy()
        bad[1030, 5] += 1
        return NumpyTake(bad, y, 1024, seed=0, shuffle=False)

    good = SystemSpec("ok", "ok", 1, lambda: NumpyTake(X, y, 1024, seed=0), 1, lambda: NumpyTake(X, y, 1024, seed=0, shuffle=False))
    run_system(good, reference, 1024, 93, (X, y))
    broken = SystemSpec("broken", "broken", 1, lambda: NumpyTake(X, y, 1024, seed=0), 1, off_by_one_value)
    with pytest.raises(BenchCheckError, match=r"batch 1 must hold rows 1024\.\.2047 of the dataset; 1 rows of x and 0 labels differ"):
        run_system(broken, reference, 1024, 93, (X, y))
