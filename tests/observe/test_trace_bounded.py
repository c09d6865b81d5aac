"""A trace of a long run: memory that does not grow with it, spans made off the loop's thread, a file that stays valid
JSON however the process ends (Ctrl-C, an exception, ``stoker profile`` interrupted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader
from stoker.observe import _events, _trace
from stoker.writer import DatasetWriter

ROWS = 4000
BATCHES = 40_000  # ten epochs of batch_size 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4,000 rows of two small fields: 4,000 batches of one row per epoch, about 20 µs each."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.stoker"
    DatasetWriter(
        path, {"x": NDArrayField(shape=(2,), dtype=np.dtype("float32")), "y": IntField()}, num_workers=1, progress=False
    ).from_arrays({"x": np.zeros((ROWS, 2), np.float32), "y": np.arange(ROWS)})
    return path


def _child(code: str, cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _events_of(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["traceEvents"]


def _batches(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if e["name"].startswith("batch "))


PEAK_RSS = """
import json, re, sys
from stoker.loader import Loader

def kib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

with Loader(sys.argv[1], batch_size=1, num_workers=1) as loader:
    for _ in loader:  # compiled, threads started, pages in: before the measure
        pass
    before = kib("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    with loader.trace(sys.argv[2]):
        for _ in range(int(sys.argv[3])):
            for _ in loader:
                pass
    print(json.dumps({"growth_mib": (kib("VmHWM") - before) / 1024}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux's /proc/self/clear_refs")
def test_a_40000_batch_trace_stays_within_40_mb(tiny: Path, tmp_path: Path) -> None:
    """The issue's run: 40,000 batches traced held 130 MB (3.4 KB a batch, kept until the end); the bound is 40 MB of
    peak RSS over the traced run, measured in a process of its own."""
    out = tmp_path / "long.json"
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(tiny), str(out), str(BATCHES // ROWS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"]
    events = _events_of(out)
    assert _batches(events) == BATCHES  # every batch is in the trace
    assert growth < 40, f"the trace of {BATCHES} batches grew the process by {growth:.0f} MiB"


def test_the_queue_is_bounded_and_loses_nothing(tmp_path: Path) -> None:
    """Spans added faster than the writer takes them wait for room: the queue never holds more than MAX_QUEUED, and
    every span reaches the file."""
    n = 3 * _trace.MAX_QUEUED
    out = tmp_path / "spans.json"
    session = _trace.start([], out, spans_too=True)
    try:

        def add() -> None:
            for i in range(n // 2):
                _trace.record_span(f"span {i}", time.perf_counter_ns(), time.perf_counter_ns(), "test")

        threads = [threading.Thread(target=add, name=f"adder-{k}") for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _trace.stop(session)
    assert session.peak_queued <= _trace.MAX_QUEUED
    events = _events_of(out)
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == n and session.written == n and session.dropped == 0
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {"adder-0", "adder-1"}


def test_spans_are_made_on_the_writer_thread(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the loop runs, its rows are turned into JSON by the trace's writer thread, never by the loop's."""
    made_on: list[str] = []
    rows = _events.rows

    def spy(*args: Any, **kw: Any) -> list[str]:
        made_on.append(threading.current_thread().name)
        return rows(*args, **kw)

    monkeypatch.setattr(_events, "rows", spy)
    out = tmp_path / "run.json"
    with Loader(tiny, batch_size=1, num_workers=1) as loader:
        for _ in loader:
            pass
        with loader.trace(out):
            deadline = time.monotonic() + 120
            while not made_on:  # (until the writer has formatted some rows: then the check below means something)
                for _ in loader:
                    pass
                assert time.monotonic() < deadline, "the writer never formatted a row"
            during = list(made_on)
    assert set(during) == {"stoker-trace-writer"}
    assert threading.main_thread().name not in during
    assert _batches(_events_of(out)) >= ROWS


ENDLESS = """
import sys
from stoker.loader import Loader

with Loader(sys.argv[1], batch_size=1, num_workers=1) as loader, loader.trace(sys.argv[2]):
    epoch = 0
    while True:
        for _ in loader:
            pass
        epoch += 1
        if epoch == 1:
            print("running", flush=True)
        if sys.argv[3] == "raise" and epoch == 3:
            raise RuntimeError("boom in the training loop")
"""


def _wait_valid(path: Path, proc: subprocess.Popen[str], timeout: float = 120.0) -> list[dict[str, Any]]:
    """The trace file's events once it parses and holds batches (it is written while the run goes on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            events = _events_of(path)
        except (OSError, ValueError):  # (not created yet, or read in the middle of a write)
            events = []
        if _batches(events) > 0:
            return events
        time.sleep(0.05)
    raise AssertionError(f"{path} never held a batch while the process ran")


def test_valid_json_while_running_and_after_ctrl_c(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = _child(ENDLESS, tmp_path, str(tiny), str(out), "sigint")
    try:
        during = _wait_valid(out, proc)  # streamed: on disk, and valid, before the end
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode in (-signal.SIGINT, 130, 1), err[-3000:]
    assert "KeyboardInterrupt" in err
    after = _events_of(out)
    assert _batches(after) >= _batches(during)


def test_valid_json_after_an_exception(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = _child(ENDLESS, tmp_path, str(tiny), str(out), "raise")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "boom in the training loop" in err, err[-3000:]
    assert _batches(_events_of(out)) == 3 * ROWS - 1  # every batch of the three epochs (the loader's first is reported apart)


PROFILED = """
from stoker.loader import Loader
import sys

loader = Loader(sys.argv[1], batch_size=1, num_workers=1)
epoch = 0
while True:
    for _ in loader:
        pass
    epoch += 1
    if epoch == 1:
        print("running", flush=True)
"""


def test_stoker_profile_interrupted_leaves_a_valid_trace(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PROFILED)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker", "profile", "--out", "prof", "--", "python", "train.py", str(tiny)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    trace = tmp_path / "prof" / "trace.json"
    try:
        during = _wait_valid(trace, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "KeyboardInterrupt" in err and "verdict:" in err  # the report still comes
    assert _batches(_events_of(trace)) >= _batches(during)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # (3.12+: a fork beside the writer thread, on purpose)
def test_a_forked_child_leaves_the_parents_trace_alone(tmp_path: Path) -> None:
    """A child forked while a trace records (a DataLoader worker, say) inherits the session: what it records and its
    exit (atexit closes open sessions) must not write into the parent's file."""
    out = tmp_path / "parent.json"
    session = _trace.start([], out, spans_too=True)
    try:
        _trace.record_span("parent before", 1, 2, "test")
        pid = os.fork()
        if pid == 0:  # the child: record, then exit through atexit (which would close the session)
            code = 0
            try:
                for i in range(3 * _trace.MAX_QUEUED):
                    _trace.record_span(f"child {i}", 1, 2, "test")
                _trace._close_all()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _trace.record_span("parent after", 1, 2, "test")
    finally:
        _trace.stop(session)
    names = [e["name"] for e in _events_of(out) if e["ph"] == "X"]
    assert names == ["parent before", "parent after"]
