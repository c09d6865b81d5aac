"""Compiling before a batch is said, from whichever thread compiles; a compile under way never delays exit (issue 44).

* a compilation of stoker's code on a thread that is not the loop's (a producer, a
  helper) is said on the ``stoker`` logger from that thread once it has made the
  process wait :data:`stoker.pipeline.warm.ANNOUNCE_AFTER` seconds, and counted for
  ``report()``; nothing is said when nothing compiles (everything cached);
* a process that built a loader whose producer loop is in no cache, took one batch and
  returned exits at once (the loop compiles in a child process, which caches it on its
  own: the next process runs it from its first batch).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.fields import IntField, NDArrayField
from stoker.loader import Loader
from stoker.pipeline import warm
from stoker.transforms import ToTensor
from stoker.writer import DatasetWriter

SRC = str(Path(warm.__file__).parents[2])  # (the stoker this test imported: the child runs the same)


def _table(path: Path, name: str) -> Path:
    rng = np.random.default_rng(0)
    rows = [(rng.random(5, dtype=np.float32), i % 3) for i in range(40)]
    fields = {name: NDArrayField(shape=(5,), dtype=np.dtype("float32")), "y": IntField()}
    DatasetWriter(path, fields, num_workers=1, progress=False).from_indexed_dataset(rows)
    return path


def test_a_compile_on_another_thread_is_said_from_that_thread(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    from stoker.pipeline.random import mix64

    monkeypatch.setattr(warm, "ANNOUNCE_AFTER", 0.0)  # (any compilation: the test does not depend on how long it takes)
    caplog.set_level(logging.INFO, logger="stoker")
    warm._watch_compiles()
    fresh = numba.njit(mix64.py_func)  # stoker's kernel, a dispatcher of its own: compiled now, whatever is cached
    t0 = time.perf_counter_ns()
    helper = threading.Thread(target=lambda: fresh.compile((numba.types.uint64,)), name="stoker-test-helper")
    helper.start()
    helper.join(300)
    t1 = time.perf_counter_ns()
    said = [r for r in caplog.records if "compiling" in r.getMessage()]
    assert said, "a compilation on a helper thread should be said"
    assert all(r.threadName == "stoker-test-helper" for r in said), [(r.threadName, r.getMessage()) for r in said]
    message = said[0].getMessage()
    assert "random.mix64" in message and "cached afterwards" in message, message
    assert len(said) == 1, [r.getMessage() for r in said]
    from stoker.observe import _compiles

    assert _compiles.overlap(t0, t1) > 0, "the compilation's time should be counted (report()'s first batch)"


def test_nothing_is_said_when_nothing_compiles(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table(tmp_path / "t.stoker", "x")
    pipelines = {"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]}
    first = Loader(table, batch_size=8, num_workers=2, seed=1, pipelines=pipelines)
    list(first)  # (compiles what is not cached yet)
    first.close()
    monkeypatch.setattr(warm, "ANNOUNCE_AFTER", 0.0)
    caplog.set_level(logging.DEBUG, logger="stoker")
    again = Loader(
        table, batch_size=8, num_workers=2, seed=1, pipelines={"x": [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]}
    )
    batches = list(again)
    report = again.report()
    again.close()
    assert len(batches) == 5
    said = [r.getMessage() for r in caplog.records if "compil" in r.getMessage()]
    assert not said, said
    assert "compiling" not in report, report


CHILD = r"""
import atexit, json, sys, time
compiler = [None]  # the compile process's pid


def last():  # registered first, so run last: every exit handler (stoker's too) has run, every non-daemon thread is joined
    try:  # whether the compile process still runs (not ended, not reaped)
        with open(f"/proc/{compiler[0]}/stat") as f:
            running = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, TypeError):
        running = False
    print(json.dumps({"handlers_done": time.time(), "compiling": running}), flush=True)


atexit.register(last)
from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.loader import Loader
from stoker.transforms import ToTensor
path, name = sys.argv[1], sys.argv[2]
loader = Loader(path, batch_size=8, num_workers=2, seed=3, pipelines={name: [NDArrayDecoder(), ToTensor()], "y": [IntDecoder(), ToTensor()]})
it = iter(loader)
next(it)
bg = loader._plan.background
compiler[0] = getattr(bg, "pid", None)
print(json.dumps({"compiled": it._batches.compiled, "started": bg is not None and bg.started,
                  "done": None if bg is None else bg.done(), "pid": getattr(bg, "pid", None)}), flush=True)
print(json.dumps({"end": time.time()}), flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.long
@pytest.mark.compiled_loop  # (its child plans the compiled loop: STOKER_COMPILED_EPOCH=0 would plan none)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc")
def test_a_process_exits_while_its_loop_compiles_and_the_loop_is_cached(tmp_path: Path) -> None:
    name = f"x{uuid.uuid4().hex[:8]}"  # (the loop's source names its fields: a loop in no cache, its kernels cached or not)
    table = _table(tmp_path / "t.stoker", name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    env.pop("STOKER_COMPILE_IN_BACKGROUND", None)  # (the suite sets it to 0: the default, background, here)
    log = tmp_path / "child.err"
    with (
        open(log, "w") as err,
        subprocess.Popen([sys.executable, "-c", CHILD, str(table), name], env=env, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"the child printed nothing: {log.read_text()[-3000:]}"
            state = json.loads(line)
            end = json.loads(proc.stdout.readline())["end"]  # type: ignore[union-attr]
            code = proc.wait(300)
            exited = time.time()
            last = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0
    assert state["started"] and not state["compiled"], state
    assert state["done"] is False, f"the loop's compilation should be under way when the script returns: {state}"
    # timed to the end of the exit handlers: what follows them, the interpreter's collection of torch's and Numba's
    # modules, is not stoker's (0.6-1.7 s on a quiet 2-core machine, 5 s beside other work: test_loader_faults)
    seconds, whole = last["handlers_done"] - end, exited - end
    print(f"the exit handlers were done {seconds:.2f} s after the script's last line, the process ended {whole:.2f} s after")
    assert seconds < 5.0, (
        f"the exit handlers were done {seconds:.1f} s after the script's last line (1 s target, 5 s bound); the process ended {whole:.1f} s after"
    )
    # and nothing waited for the compilation (it takes seconds: its process still ran when the last handler did)
    assert last["compiling"], f"the compile process had ended when the exit handlers were done ({seconds:.2f} s after the last line)"
    pid = state["pid"]
    deadline = time.monotonic() + 300
    while not _gone(pid) and time.monotonic() < deadline:  # the child finishes on its own
        time.sleep(0.2)
    assert _gone(pid), f"the compile process {pid} is still running after 300 s"
    again = subprocess.run([sys.executable, "-c", CHILD, str(table), name], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout.strip().splitlines()[0])
    assert result["compiled"] and not result["started"], f"the next process should run the loop its predecessor's child cached: {result}"
