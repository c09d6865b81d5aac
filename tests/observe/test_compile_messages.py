"""What a wait for the compiler says: which kernel, "n of m" of those not in a cache, on a terminal a progress line;
and the compile child's fork without Numba's TBB warning (issue 44).

The kernels here are dispatchers of stoker's functions made by the test (``numba.njit(kernel.py_func)``): cached
nowhere, so they compile whatever the caches hold. ``ANNOUNCE_AFTER`` is 0: the test does not depend on how long a
compilation takes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numba
import numpy as np
import pytest

from stoker.pipeline import _fork, warm
from stoker.pipeline.random import mix64, uniform
from stoker.transforms import RandomHorizontalFlip


def _pipelines(*codes: Any) -> list[Any]:
    """What :func:`warm.watch` reads of a loader's field pipelines: the steps of their first batch."""
    return [SimpleNamespace(steps=[SimpleNamespace(python=None, code=c) for c in codes], head=len(codes))]


@pytest.fixture
def new_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "ANNOUNCE_AFTER", 0.0)
    monkeypatch.setattr(warm, "_burst", dict(warm._burst, running={}, done=[], last=-1e9, expected=[]))


def test_the_message_says_which_kernel_n_of_m_not_in_the_cache(
    new_burst: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    monkeypatch.setattr(warm, "_on_terminal", lambda: True)
    first, second = numba.njit(mix64.py_func), numba.njit(uniform.py_func)
    warm.watch(_pipelines(first, second))  # (as a loader does when it is planned)
    helper = threading.Thread(target=lambda: first.compile((numba.types.uint64,)), name="stoker-test-compile")
    helper.start()  # (said from whichever thread compiles)
    helper.join(300)
    said = [r.getMessage() for r in caplog.records if "waiting for the compiler" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "compiling random.mix64 (kernel 1 of 2 not in the cache)" in said[0], said
    assert "cached afterwards" in said[0]
    progress = capsys.readouterr().err
    assert "stoker: compiling random.mix64 (kernel 1 of 2" in progress, progress
    assert progress.endswith("\r\x1b[K"), "the progress line is cleared once compiling stops"


def test_the_first_batchs_block_says_n_of_m_too(new_burst: None, caplog: pytest.LogCaptureFixture) -> None:
    """The loop's first batch is one announced block (``warm.announced``): its message counts the kernels as well."""
    caplog.set_level(logging.INFO, logger="stoker")
    first, second = numba.njit(mix64.py_func), numba.njit(uniform.py_func)
    warm.watch(_pipelines(first, second))
    with warm.announced("the pipelines of the test"):
        first.compile((numba.types.uint64,))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stoker: compiling the pipelines of the test")]
    assert len(said) == 1 and "now random.mix64, kernel 1 of 2 not in the cache" in said[0], said


def test_kernels_in_a_cache_are_not_counted(new_burst: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = numba.njit(mix64.py_func)
    compiled = numba.njit(uniform.py_func)
    compiled.compile((numba.types.uint64, numba.types.int64))
    warm.watch(_pipelines(fresh, compiled))
    assert warm._burst["expected"] == [fresh]


def test_the_kernels_an_operation_calls_are_found() -> None:
    """A transform's generated function (Python calling compiled kernels) is followed to the kernels it calls."""
    from stoker.transforms.flip import _flip_kernel

    found = warm._kernels_called([RandomHorizontalFlip().generate_code()])
    assert _flip_kernel in found, found


TBB_LINE = "Attempted to fork from a non-main thread"


def _fork_once(quiet: bool, fd: int, own: bytes) -> None:
    """One fork (the child leaves at once), ``own`` written on ``fd`` just before it; inside the filter if ``quiet``."""
    with _fork.tbb_fork_quiet() if quiet else _nothing():
        os.write(fd, own)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0)
    os.waitpid(pid, 0)


def _fork_from_a_thread(quiet: bool) -> None:
    def fork() -> None:
        _fork_once(quiet, 2, b"a line of the program's own\n")

    t = threading.Thread(target=fork)
    t.start()
    t.join(60)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")
def test_the_compile_childs_fork_says_nothing_of_tbb(capfd: pytest.CaptureFixture[str]) -> None:
    """Forked from a thread other than the main one with TBB running, the fork prints TBB's warning; around the compile
    child's fork, exactly that line is held back and the process's other output is kept."""
    from numba.np.ufunc.parallel import _launch_threads

    _launch_threads()
    if numba.threading_layer() != "tbb":
        pytest.skip("Numba's threading layer is not TBB here")
    numba.njit(parallel=True)(lambda a: a.sum())(np.ones(100))  # (TBB's scheduler started)
    _fork_from_a_thread(quiet=False)
    plain = capfd.readouterr().err
    if TBB_LINE not in plain:
        pytest.skip("this TBB prints nothing on such a fork")
    _fork_from_a_thread(quiet=True)
    quiet = capfd.readouterr().err
    assert TBB_LINE not in quiet, quiet
    assert "a line of the program's own" in quiet


BUSY_LINE = "Unable to join threads to shut down before fork()"


@numba.njit(parallel=True, nogil=True)
def _parallel_work(a: np.ndarray, rounds: int) -> float:  # pragma: no cover - compiled
    s = 0.0
    for r in range(rounds):
        for i in numba.prange(a.shape[0]):
            s += np.sqrt(a[i] + r)
    return s


def _fork_beside_a_parallel_region(quiet: bool, forks: int = 3) -> None:
    """Fork from this thread while another one runs TBB's workers in a parallel region (a Loader's first batch on
    Python producers, its compile child forked meanwhile)."""
    stop = threading.Event()
    started = threading.Event()

    def busy() -> None:
        a = np.ones(100_000)
        while not stop.is_set():
            started.set()
            _parallel_work(a, 20)

    t = threading.Thread(target=busy)
    t.start()
    try:
        started.wait(60)
        for _ in range(forks):
            _fork_once(quiet, 1, b"the program's own output\n")
    finally:
        stop.set()
        t.join(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork")
def test_a_fork_beside_a_parallel_region_says_nothing_of_tbb(capfd: pytest.CaptureFixture[str]) -> None:
    """Forked while TBB's workers run another thread's parallel region, the fork prints TBB's "Unable to join
    threads" on stdout (``make bench`` showed it seven times); around the compile child's fork it is held back from
    stdout and stderr alike, and the process's other output is kept."""
    from stoker.pipeline.threads import prefer_tbb

    prefer_tbb()
    if numba.threading_layer() != "tbb":
        pytest.skip("Numba's threading layer is not TBB here")
    _parallel_work(np.ones(10), 1)  # (compiled, TBB's scheduler started)
    _fork_beside_a_parallel_region(quiet=False)
    plain = capfd.readouterr()
    if BUSY_LINE not in plain.out + plain.err:
        pytest.skip("this TBB printed nothing on these forks")
    _fork_beside_a_parallel_region(quiet=True)
    quiet = capfd.readouterr()
    assert BUSY_LINE not in quiet.out + quiet.err, quiet
    assert quiet.out.count("the program's own output") == 3, quiet.out
