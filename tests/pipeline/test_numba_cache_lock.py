"""One compile per cache entry across processes (``stoker._numba_cache``: the entry's ``flock``).

A small function in a temporary module, cached in a private folder by
:class:`~stoker._numba_cache.PrivateFunctionCache` (as a generated pipeline function is). The interleavings are
forced, not timed: a child counts Numba's ``numba:compile`` events for the function and, once inside its compile,
waits for a file that the other child writes after its own first lookup missed; so both children have missed before
either saves, and only the entry lock can keep the second one from compiling too.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numba
import pytest

import stoker
from stoker import _numba_cache

SRC = str(Path(stoker.__file__).resolve().parents[1])  # the children import the same stoker as this process

MODULE = textwrap.dedent(
    """
    def f(x):
        return x * 3 + 1
    """
)

CHILD = textwrap.dedent(
    """
    import importlib.util, json, os, sys, time
    from pathlib import Path

    import numba
    from numba.core import event

    from stoker import _numba_cache

    _numba_cache.register()
    module_path, folder, me, other, mode = sys.argv[1:]
    marks = Path(folder).parent

    def touch(name):
        (marks / name).write_text("")

    def wait_for(name):  # (a bound against a broken run only: the order is forced by the files, not by time)
        for _ in range(12000):
            if (marks / name).exists():
                return
            time.sleep(0.01)
        raise RuntimeError(f"{me}: {name} never came")

    spec = importlib.util.spec_from_file_location("stoker_lock_probe", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    dispatcher = numba.njit(module.f)
    dispatcher._cache = _numba_cache.PrivateFunctionCache(dispatcher.py_func, Path(folder))

    lookup = _numba_cache.PrivateFunctionCache._load_overload

    def counted_lookup(self, sig, target_context):
        cres = lookup(self, sig, target_context)
        if cres is None and self is dispatcher._cache:
            touch(f"missed.{me}")
        return cres

    _numba_cache.PrivateFunctionCache._load_overload = counted_lookup
    compiles = []

    class Count(event.Listener):
        def on_start(self, ev):
            if ev.data["dispatcher"] is dispatcher:
                compiles.append(me)
                if mode == "pair":
                    wait_for(f"missed.{other}")
                elif mode == "hold":
                    touch("holding")
                    time.sleep(600)  # killed here, holding the entry's lock

        def on_end(self, ev):
            pass

    event.register("numba:compile", Count())
    result = int(dispatcher(21))
    print(json.dumps({"compiles": len(compiles), "result": result}))
    """
)


@pytest.fixture
def probe(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The module file, its private cache folder, and the child script."""
    module = tmp_path / "stoker_lock_probe.py"
    module.write_text(MODULE)
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return module, folder, script


def _start(probe: tuple[Path, Path, Path], me: str, other: str, mode: str) -> subprocess.Popen[str]:
    module, folder, script = probe
    env = {**os.environ, "PYTHONPATH": SRC, "STOKER_CACHE_DIR": str(folder.parent / "root")}
    env["STOKER_COMPILE_LOCK_TIMEOUT"] = "600"  # a lock never released would fail the test by its timeout, not pass
    return subprocess.Popen(
        [sys.executable, str(script), str(module), str(folder), me, other, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, int]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _free(lock: Path) -> bool:
    """Whether nobody holds the lock file ``lock`` (a new open file description of this process tries it)."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_two_processes_compiling_the_same_function_compile_it_once(probe: tuple[Path, Path, Path]) -> None:
    a = _start(probe, "a", "b", "pair")
    b = _start(probe, "b", "a", "pair")
    results = [_result(a), _result(b)]
    assert [r["result"] for r in results] == [64, 64]
    assert sum(r["compiles"] for r in results) == 1, results  # the other one waited, then loaded what was saved
    folder = probe[1]
    locks = list(folder.glob("*.lock"))
    assert len(locks) == 1 and all(_free(lock) for lock in locks)
    assert (os.stat(locks[0]).st_mode & 0o777) == 0o600


def test_a_process_killed_holding_the_lock_does_not_block_the_next(probe: tuple[Path, Path, Path]) -> None:
    folder = probe[1]
    holder = _start(probe, "h", "-", "hold")
    marks = folder.parent
    try:
        for _ in range(24000):  # (a bound against a broken run only)
            if (marks / "holding").exists() or holder.poll() is not None:
                break
            time.sleep(0.01)
        assert (marks / "holding").exists(), holder.communicate()[1][-3000:]
        (lock,) = folder.glob("*.lock")
        assert not _free(lock)  # held by the child, inside its compile
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    assert _free(lock)  # the kernel released it with the process
    result = _result(_start(probe, "n", "-", "count"))
    assert result == {"compiles": 1, "result": 64}  # compiled here (nothing was saved), without waiting on the dead


def test_a_failing_compile_releases_its_lock_and_its_callers(tmp_path: Path) -> None:
    _numba_cache.register()
    module_path = tmp_path / "stoker_lock_failing.py"
    module_path.write_text(
        textwrap.dedent(
            """
            def bad(x):
                return x.no_such_attribute

            def caller(x):
                return BAD(x) + 1
            """
        )
    )
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    namespace: dict[str, object] = {"__name__": "stoker_lock_failing", "__file__": str(module_path)}
    exec(compile(module_path.read_text(), str(module_path), "exec"), namespace)
    bad = numba.njit(namespace["bad"])
    bad._cache = _numba_cache.PrivateFunctionCache(bad.py_func, folder)
    namespace["BAD"] = bad
    caller = numba.njit(namespace["caller"])
    caller._cache = _numba_cache.PrivateFunctionCache(caller.py_func, folder)
    with pytest.raises(numba.core.errors.TypingError):
        caller(1)
    locks = sorted(folder.glob("*.lock"))
    assert {lock.name.split(".")[0] for lock in locks} == {"stoker_lock_failing"}
    assert len({lock.name.rsplit(".", 2)[0] for lock in locks}) == 2, locks  # the caller's and the callee's
    assert all(_free(lock) for lock in locks)
    assert not _numba_cache._HELD
    with pytest.raises(numba.core.errors.TypingError):  # and again: nothing left held blocks this process either
        bad(2)
    assert all(_free(lock) for lock in locks) and not _numba_cache._HELD


def test_a_peer_that_never_releases_is_waited_for_a_bounded_time_and_said(
    probe: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a stopped peer: the lock is held by this test for the whole compile; the bound is set to 1.5 s)
    _numba_cache.register()
    module_path, folder, _ = probe
    namespace: dict[str, object] = {"__name__": "stoker_lock_probe", "__file__": str(module_path)}
    exec(compile(module_path.read_text(), str(module_path), "exec"), namespace)

    def fresh() -> numba.core.registry.CPUDispatcher:
        dispatcher = numba.njit(namespace["f"])
        dispatcher._cache = _numba_cache.PrivateFunctionCache(dispatcher.py_func, folder)
        return dispatcher

    assert fresh()(21) == 64
    (lock,) = folder.glob("*.lock")
    for entry in folder.iterdir():
        if entry != lock:
            entry.unlink()  # the entry gone, its lock file left
    monkeypatch.setenv("STOKER_COMPILE_LOCK_TIMEOUT", "1.5")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with caplog.at_level("INFO", logger="stoker.compile"):
            assert fresh()(21) == 64  # compiled anyway, after the bound
    finally:
        os.close(fd)
    said = [r.getMessage() for r in caplog.records if r.name == "stoker.compile"]
    assert any("stoker_lock_probe.f" in line and "another process" in line for line in said), said
    assert any("STOKER_COMPILE_LOCK_TIMEOUT" in line for line in said), said
    assert _free(lock) and not _numba_cache._HELD
