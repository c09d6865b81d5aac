"""The main job on a busy machine: alternating rounds, ratios taken within a round, their spread, the verdict, and
other work's load told apart from the benchmark's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.bench import loading
from stoker.bench.baselines import NumpyTake
from stoker.bench.data import fingerprints, make_otto_arrays
from stoker.bench.load import LoadMonitor, LoadWindow, busy_note
from stoker.bench.loading import SystemSpec, add_ratios, compare_loading_rounds, prepare_system
from stoker.bench.rounds import order, spread, verdict, within
from stoker.bench.training import train_rounds

# ---- the statistics ----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 100, allow_nan=False), min_size=1, max_size=40))
def test_spread_matches_numpy(values: list[float]) -> None:
    s = spread(values)
    assert s["n"] == len(values)
    assert s["min"] == min(values) and s["max"] == max(values)
    assert s["min"] <= s["q25"] <= s["median"] <= s["q75"] <= s["max"]
    assert s["median"] == pytest.approx(float(np.median(values)))


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ([1.2, 1.3, 1.1, 1.25], "faster"),
        ([0.8, 0.9, 0.85, 0.7], "slower"),
        ([0.9, 1.1, 1.0, 1.05], "on par"),
        ([1.01, 1.03, 1.02, 1.04], "on par"),  # every round faster, by less than 5%: within what runs differ by
        ([], "unknown"),
    ],
)
def test_verdict_needs_three_quarters_of_the_rounds_by_5_percent(values: list[float], word: str) -> None:
    assert verdict(spread(values)) == word


def test_within_each_others_range() -> None:
    quiet, busy, other = spread([1.0, 1.1, 1.2]), spread([0.95, 1.05, 1.3]), spread([0.2, 0.3, 0.4])
    assert within(quiet, busy) and not within(quiet, other)


def test_rounds_alternate() -> None:
    assert [order("ABC", r) for r in range(3)] == [list("ABC"), list("CBA"), list("ABC")]


# ---- rounds against a load that changes -------------------------------------------------------


class _Clock:
    """A fake ``time`` module: the time moves only when a system works, by its cost times the machine's load, which
    doubles every epoch anyone runs (a machine getting busier as the benchmark goes)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.epochs = 0

    def perf_counter(self) -> float:
        return self.now

    def load(self) -> float:
        return 2.0 ** (self.epochs // 2)


class _Costly(NumpyTake):
    """The numpy limit, whose every batch costs ``cost`` seconds of the fake clock (times its load)."""

    def __init__(self, clock: _Clock, cost: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.cost = clock, cost

    def __iter__(self):  # type: ignore[no-untyped-def]
        load = self.clock.load()
        for batch in super().__iter__():
            self.clock.now += self.cost * load
            yield batch
        self.clock.epochs += 1


def test_ratios_are_taken_within_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two systems, one twice as fast, on a machine whose load grows all along: timed one after the other, the slow
    one would run in the busier half and look 8x slower; alternated, every round's ratio is exactly 2."""
    clock = _Clock()
    monkeypatch.setattr(loading, "time", clock)
    X, y = make_otto_arrays(4096, seed=5)
    ref = fingerprints(X, y)
    specs = {
        "fast": SystemSpec("fast", "fast", 1, lambda: _Costly(clock, 1.0, X, y, 1024, seed=0), 4),
        "slow": SystemSpec("slow", "slow", 1, lambda: _Costly(clock, 2.0, X, y, 1024, seed=1), 4),
    }
    prepared = {k: prepare_system(s, ref, 1024, 93) for k, s in specs.items()}
    seen: list[int] = []
    results, marks = compare_loading_rounds(prepared, 4, 1024, 93, after_round=lambda r: seen.append(r) or r)
    assert marks == seen == [0, 1, 2, 3]
    fast, slow = results["fast"], results["slow"]
    assert len(fast.rounds_epoch_s) == len(slow.rounds_epoch_s) == 4 and len(fast.epoch_s) == 4  # one epoch a round
    ratio = loading.speed_ratio_rounds(fast, slow)
    assert ratio["min"] == ratio["max"] == pytest.approx(2.0)
    add_ratios(results, limit_key="slow", compiled_key="fast")
    assert fast.ratio_to_limit == pytest.approx(2.0) and slow.ratio_to_compiled == pytest.approx(0.5)
    assert fast.ratio_to_limit_rounds["n"] == 4


def test_a_stoker_system_is_compiled_before_its_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first epoch and checks, a stoker system waits for its compiled code (``Loader.compile()``: a fresh
    install's producer loop compiles in the background meanwhile, and the rounds compare compiled epochs), before
    the stage times the rounds count from; a system that is not stoker's is left as it is."""
    from stoker.bench.data import write_otto
    from stoker.loader import Loader

    calls: list[tuple[int, float]] = []
    original = Loader.compile

    def compile_spy(self: Loader) -> float:
        seconds = original(self)
        calls.append((id(self), seconds))
        return seconds

    monkeypatch.setattr(Loader, "compile", compile_spy)
    before = loading.stage_seconds
    taken: list[int] = []
    monkeypatch.setattr(loading, "stage_seconds", lambda loader: (taken.append(len(calls)), before(loader))[1])
    otto = write_otto(tmp_path, 2048, 3)
    ref = fingerprints(otto.X, otto.y)
    stoker = SystemSpec("stoker_w1", "stoker", 1, lambda: loading.stoker_loader(otto.path, 512, 1, 0), 1)
    other = SystemSpec("numpy_take", "numpy", 1, lambda: NumpyTake(otto.X, otto.y, 512, 0), 1)
    p = prepare_system(stoker, ref, 512, 93)
    try:
        assert [c[0] for c in calls] == [id(p.loader)] and p.compile_s == calls[0][1] >= 0
        assert taken == [1], taken  # (the stages' times were taken once compiled)
    finally:
        loading._close(p.loader)
    q = prepare_system(other, ref, 512, 93)
    assert len(calls) == 1 and q.compile_s == 0.0


class _Trainer:
    def __init__(self, name: str, calls: list[str], step: float) -> None:
        self.name, self.calls, self.step = name, calls, step
        self.rounds: list[float] = []

    def epoch(self, timed: bool) -> list[float]:
        assert timed
        self.calls.append(self.name)
        return [self.step * (len(self.calls))] * 3


def test_training_rounds_alternate_and_keep_each_rounds_median() -> None:
    calls: list[str] = []
    trainers: dict[str, Any] = {n: _Trainer(n, calls, s) for n, s in (("STOKER", 1.0), ("TORCH", 2.0))}
    marks = train_rounds(trainers, 3, 2, after_round=lambda r: r * 10)
    assert calls == ["STOKER"] * 2 + ["TORCH"] * 2 + ["TORCH"] * 2 + ["STOKER"] * 2 + ["STOKER"] * 2 + ["TORCH"] * 2
    assert marks == [0, 10, 20]
    assert trainers["STOKER"].rounds == [1.5, 7.5, 9.5]  # the median of the round's two epochs' steps


# ---- other work's load ------------------------------------------------------------------------


def _fake_proc(root: Path, running: int, own: dict[int, list[str]], children: dict[int, list[int]]) -> Path:
    """A ``/proc`` with ``running`` runnable threads in all; ``own``: pid -> its threads' states."""
    (root / "loadavg").write_text(f"3.00 2.00 1.00 {running}/300 999\n")
    for pid, states in own.items():
        for k, state in enumerate(states):
            task = root / str(pid) / "task" / str(pid * 100 + k)
            task.mkdir(parents=True)
            (task / "stat").write_text(f"{pid} (py thon) {state} 1 2 3\n")
            (task / "children").write_text(" ".join(map(str, children.get(pid, []))) if k == 0 else "")
    return root


def test_others_are_told_apart_from_the_benchmarks_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid = os.getpid()
    proc = _fake_proc(tmp_path, 5, {pid: ["R", "S", "R"], 4242: ["R", "R", "S"]}, {pid: [4242]})
    monitor = LoadMonitor(proc=proc)
    monitor.cores = 4
    monitor.sample()
    w = monitor.window()
    assert (w.own, w.others, w.samples) == (4, 1, 1)  # 2 runnable here, 2 in the child; 5 - 4 on the machine
    assert w.free == 0 and w.busy is True  # all 4 cores taken by the benchmark: 1 runnable thread of others is too many
    (proc / "loadavg").write_text("0.5 0.5 0.5 4/300 999\n")
    monitor.sample()
    assert monitor.window().busy is False and monitor.total().samples == 2
    assert LoadWindow(0.0, 0.0, 2, 0).busy is None


def test_children_found_without_the_children_files(tmp_path: Path) -> None:
    pid = os.getpid()
    proc = _fake_proc(tmp_path, 9, {pid: ["R"], 4242: ["R", "R"]}, {})
    for f in proc.rglob("children"):
        f.unlink()
    (proc / "4242" / "stat").write_text(f"4242 (worker) R {pid} 1 1\n")
    (proc / str(pid) / "stat").write_text(f"{pid} (main) S 1 1 1\n")
    monitor = LoadMonitor(proc=proc)
    monitor.sample()
    assert monitor.total().own == 3


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="needs Linux's /proc")
def test_a_busy_process_is_others_and_a_busy_child_is_ours() -> None:
    """A busy loop is always runnable: one that is not ours counts in every sample as others' load, one that is our
    child as our own (no timing involved: a spinning process's state is R whenever it is sampled)."""
    code = "while True: pass"
    child = subprocess.Popen([sys.executable, "-c", code])
    orphan = int(
        subprocess.run(  # started by a shell that exits at once: no descendant of ours
            ["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    try:
        deadline = time.monotonic() + 60
        while Path(f"/proc/{orphan}/stat").read_text().split(") ")[1][0] != "R" or not _started(child.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monitor = LoadMonitor()
        for _ in range(5):
            monitor.sample()
        w = monitor.total()
        assert w.samples == 5 and w.own >= 1 and w.others >= 1
    finally:
        child.kill()
        child.wait()
        os.kill(orphan, signal.SIGKILL)


def _started(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "R"


def test_a_busy_machine_is_said_and_the_verdict_marked() -> None:
    from stoker.bench.report import verdict_lines

    load = {**LoadWindow(1.2, 2.0, 2, 100).to_dict(), "loadavg_1min": {"start": 1.1, "max": 3.2, "end": 3.0}}
    note = busy_note(load)
    assert note is not None and "busy" in note and "1.2" in note and "may be unreliable" in note
    ratio = spread([0.9, 1.0, 1.1])
    results: dict[str, Any] = {"machine": {"load": load}, "verdicts": [{"what": "x vs y", "verdict": "on par", "summary": "1.00x"}]}
    lines = verdict_lines(results)
    assert lines[0] == note and "**on par (may be unreliable: busy machine)**" in lines[-1]
    quiet = {**LoadWindow(0.1, 2.0, 2, 100).to_dict(), "loadavg_1min": {"start": 0.1, "max": 2.0, "end": 2.0}}
    assert busy_note(quiet) is None
    lines = verdict_lines({"machine": {"load": quiet}, "verdicts": results["verdicts"]})
    assert "WARNING" not in "\n".join(lines) and "**on par**" in lines[0] and "quiet" in lines[-1]
    assert ratio["n"] == 3


def test_rounds_option(tmp_path: Path) -> None:
    import argparse

    from stoker.cli.bench import _config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _config(parser.parse_args(["--out", str(tmp_path), "--rounds", "4"])).rounds == 4
    assert _config(parser.parse_args(["--out", str(tmp_path)])).rounds == 10
    assert _config(parser.parse_args(["--out", str(tmp_path), "--quick"])).rounds == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])
