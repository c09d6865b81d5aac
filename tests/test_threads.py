"""``stoker._threads``: threads that leave SIGINT and SIGTERM to the main thread, and the CPUs this process may use."""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import stoker
from stoker import _threads
from stoker._threads import INTERRUPTS, available_cpus, block_interrupts, start_thread
from stoker.fields import IntField
from stoker.format import DatasetWriter

needs_sigmask = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="the platform has no pthread_sigmask")


def _mask_of_thread(start: object) -> set[int]:
    """The signals blocked in a thread that ``start(target, name=...)`` starts."""
    seen: list[set[int]] = []
    thread = start(lambda: seen.append(set(signal.pthread_sigmask(signal.SIG_BLOCK, []))), name="stoker-test-mask")  # type: ignore[operator]
    thread.join(timeout=60)
    return seen[0]


@needs_sigmask
def test_start_thread_blocks_interrupts_in_the_thread_only() -> None:
    before = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    assert _mask_of_thread(start_thread) >= INTERRUPTS
    assert set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) == before  # the caller's mask is its own


@needs_sigmask
def test_threads_started_by_such_a_thread_inherit_the_mask() -> None:
    inner: list[set[int]] = []

    def outer() -> None:  # a plain thread inside, as Numba's or a library's would be
        t = threading.Thread(target=lambda: inner.append(set(signal.pthread_sigmask(signal.SIG_BLOCK, []))))
        t.start()
        t.join()

    start_thread(outer, name="stoker-test-outer").join(timeout=60)
    assert inner[0] >= INTERRUPTS


def test_start_thread_passes_arguments_and_names_the_thread() -> None:
    got: list[object] = []
    thread = start_thread(lambda *a, **k: got.append((a, k, threading.current_thread().name)), 1, 2, name="stoker-test-args", key=3)
    thread.join(timeout=60)
    assert got == [((1, 2), {"key": 3}, "stoker-test-args")]
    assert thread.daemon and thread.name == "stoker-test-args"
    assert not start_thread(lambda: None, name="stoker-test-joined", daemon=False).daemon


@needs_sigmask
def test_block_interrupts_as_a_pool_initializer() -> None:
    with ThreadPoolExecutor(1, initializer=block_interrupts) as pool:
        mask = pool.submit(lambda: set(signal.pthread_sigmask(signal.SIG_BLOCK, []))).result(timeout=60)
    assert mask >= INTERRUPTS


def test_a_daemon_pool_runs_work_like_an_executor() -> None:
    """Results and exceptions come back through the futures, at most ``workers`` threads run (daemon, named, signals
    blocked), work not started is cancelled by ``shutdown(cancel_futures=True)``, and a shut pool takes no more."""
    pool = _threads.DaemonPool(2, "stoker-test-pool")
    gate = threading.Event()
    running = threading.Semaphore(0)

    def held(x: int) -> int:
        running.release()
        gate.wait(60)
        return x * x

    first = [pool.submit(held, i) for i in range(2)]
    assert running.acquire(timeout=60) and running.acquire(timeout=60)  # (both threads busy)
    waiting = [pool.submit(held, i) for i in range(2, 5)]
    threads = [t for t in threading.enumerate() if t.name.startswith("stoker-test-pool")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    failing = pool.submit(lambda: 1 / 0)
    gate.set()
    assert [f.result(timeout=60) for f in first + waiting] == [0, 1, 4, 9, 16]
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=60)
    if hasattr(signal, "pthread_sigmask"):
        assert pool.submit(lambda: set(signal.pthread_sigmask(signal.SIG_BLOCK, []))).result(timeout=60) >= INTERRUPTS
    gate.clear()
    running = threading.Semaphore(0)  # (the first one counted the waiting work too)
    busy = [pool.submit(held, 0) for _ in range(2)]
    assert running.acquire(timeout=60) and running.acquire(timeout=60)  # (both threads busy again)
    left = [pool.submit(held, i) for i in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)  # (while both threads are held: the work left is not started)
    gate.set()
    assert all(f.result(timeout=60) == 0 for f in busy) and all(f.cancelled() for f in left)
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(abs, -1)


# A process that leaves while a pool's work is in progress (a read of a slow store): it prints "left" at the end of the
# script; the work would take a minute.
LEAVING = r"""
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from stoker._threads import DaemonPool

started = threading.Event()
def slow():
    started.set()
    time.sleep(60)
pool = DaemonPool(1, "stoker-test-slow") if sys.argv[1] == "daemon" else ThreadPoolExecutor(1)
pool.submit(slow)
started.wait(60)
print("left", flush=True)
"""


@pytest.mark.parametrize("kind", ["daemon", "executor"])
def test_the_end_of_the_process_does_not_wait_for_a_daemon_pools_work(kind: str) -> None:
    """The interpreter joins a ``ThreadPoolExecutor``'s threads before :mod:`atexit` runs (a minute here, a slow store's
    read in stoker's head pools before); a :class:`~stoker._threads.DaemonPool`'s it leaves: the process ends at
    once. (The executor's case shows what the test measures: its process is still running a second later.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(stoker.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", LEAVING, kind], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "left"
        if kind == "daemon":
            assert child.wait(timeout=30) == 0  # (the work would hold it 60 s)
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=1.0)
    finally:
        child.kill()
        child.communicate()


def test_every_thread_of_stoker_starts_through_start_thread() -> None:
    """One mechanism: a ``threading.Thread`` made anywhere else, or a thread pool without the initializer, would take
    the main thread's signals."""
    package = Path(stoker.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "_threads.py":
            continue
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"\bThread\(|\bThreadPoolExecutor\(|\bTimer\(", text):
            line = text[: match.start()].count("\n") + 1
            call = text[match.start() : text.find("\n", match.start())]
            if "ThreadPoolExecutor(" in call and "initializer=block_interrupts" in call:
                continue
            offenders.append(f"{path.relative_to(package)}:{line}: {call.strip()}")
    assert offenders == [], "start threads with stoker._threads.start_thread (pools: initializer=block_interrupts)"


# A process whose worker threads are busy while its main thread waits; it says "ready" once they all run.
BUSY_WORKERS = r"""
import os
import signal
import sys
import threading
import time

from stoker._threads import start_thread

wait, workers = sys.argv[1], int(sys.argv[2])
if sys.argv[3] == "SIGTERM":
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_sigterm)
running = threading.Barrier(workers + 1)


def busy():
    running.wait()
    x = 0
    while True:  # Python bytecode: the thread holds the GIL as often as it can
        x += 1


for i in range(workers):
    start_thread(busy, name=f"busy-{i}")
try:
    running.wait()
    print("ready", flush=True)
    if wait == "event":
        threading.Event().wait()  # sem_wait: only a signal delivered to this thread interrupts it
    else:
        time.sleep(600)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os._exit(0)  # (the subject is the signal: not an interpreter's exit beside eight busy daemon threads)
"""


def _main_thread_state(pid: int) -> str:
    """The state of process ``pid``'s main thread: ``R`` running, ``S`` asleep in a wait a signal interrupts, ..."""
    return Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


#: (futex, clock_nanosleep) system call numbers, by machine
_SYSCALLS = {"x86_64": (202, 230), "aarch64": (98, 115)}


def _main_thread_in_the_wait(pid: int, wait: str) -> bool:
    """Whether process ``pid``'s main thread sleeps in the wait itself, not for the GIL on its way there.

    Both are state ``S``; a signal its C handler takes while the thread waits for the GIL after its last check for
    signals would be lost to the wait that follows (it is not interrupted). So the system call must be the wait's: ``clock_nanosleep`` for ``time.sleep``, a ``futex`` wait with no timeout for
    ``sem_wait`` (the GIL's wait has one). Where the call cannot be read, the state alone.
    """
    if _main_thread_state(pid) != "S":
        return False
    numbers = _SYSCALLS.get(platform.machine())
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    except OSError:
        fields = []
    if numbers is None or len(fields) < 5 or not fields[0].isdigit():
        return True
    futex, nanosleep = numbers
    if wait == "sleep":
        return int(fields[0]) == nanosleep
    return int(fields[0]) == futex and int(fields[4], 16) == 0


@needs_sigmask
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the main thread's state from /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("wait", ["event", "sleep"])
@pytest.mark.parametrize(
    "stopped",
    # (stopped: make test-long only. Its sleep-SIGTERM case hung for 120 s in two of five suite runs on 2026-11-28, one
    # quiet, one busy, with the main thread already in clock_nanosleep: the cause is not found yet, see TEST_SPLIT.md)
    [False, pytest.param(True, marks=pytest.mark.long)],
    ids=["running", "stopped"],
)
def test_the_main_thread_gets_the_signal_while_workers_are_busy(wait: str, sig: int, stopped: bool) -> None:
    """The main thread, blocked in a wait, raises ``KeyboardInterrupt`` when the process gets the signal.

    Linux gives a process-directed signal to the main thread when it can take the
    signal at once; otherwise (it has another signal pending and is not running, as
    on a busy machine) to any thread that does not block it. ``stopped`` makes the
    second case happen every time: the signal arrives while the process is stopped,
    and the first thread to run after ``SIGCONT`` takes it. Were it one of the busy
    workers (a plain ``threading.Thread``), Python would run the handler only when
    the main thread next runs bytecode: never, in this wait.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_WORKERS, wait, "8", signal.Signals(sig).name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(stoker.__file__).parents[1])},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        # Not until the main thread sleeps in the wait's system call: a signal handled between its last check for
        # signals and that call (waiting for the GIL on its way) would be lost to the wait (CPython's, whichever thread)
        deadline = time.monotonic() + 120
        while not _main_thread_in_the_wait(proc.pid, wait):
            assert time.monotonic() < deadline and proc.poll() is None, "the main thread never waited"
            time.sleep(0.001)
        if stopped:
            os.kill(proc.pid, signal.SIGSTOP)
            _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once every thread has stopped
            assert os.WIFSTOPPED(status)
        os.kill(proc.pid, sig)
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        try:
            stdout, stderr = proc.communicate(timeout=120)  # at once, in fact; the bound only keeps a failure from hanging
        except subprocess.TimeoutExpired:  # what the child said by then: whether the signal was taken at all
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the child did not end within 120 s of the signal; its output: {stdout!r}, {stderr.decode()!r}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert stdout == b"interrupted\n", stderr.decode()
    assert proc.returncode == 0, stderr.decode()


# ---- CPUs ---------------------------------------------------------------------------------------------


def _pretend(monkeypatch: pytest.MonkeyPatch, affinity: int, quota: float | None) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setattr(os, "process_cpu_count", lambda: affinity, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's: never the answer
    monkeypatch.setattr(_threads, "_cgroup_cpus", lambda: quota)
    monkeypatch.setattr(_threads, "_CPUS_CACHE", None, raising=False)  # (the answer is cached per process and affinity)


@pytest.mark.parametrize(
    ("affinity", "quota", "expected"),
    [
        (8, None, 8),  # no quota: the affinity set
        (8, 1.5, 2),  # a quota of 1.5 CPUs: two threads can use it
        (8, 2.0, 2),
        (8, 0.2, 1),  # at least one
        (2, 16.0, 2),  # the affinity set caps a large quota
    ],
)
def test_available_cpus(monkeypatch: pytest.MonkeyPatch, affinity: int, quota: float | None, expected: int) -> None:
    _pretend(monkeypatch, affinity, quota)
    assert available_cpus() == expected


def test_available_cpus_without_process_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, 6, 3.0)
    monkeypatch.delattr(os, "process_cpu_count", raising=False)  # Python < 3.13: the affinity set
    assert available_cpus() == 3


def test_available_cpus_cached_until_fork_or_affinity_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cgroup files are read once per process and affinity set, not on every call (each epoch start asks)."""
    _pretend(monkeypatch, 8, None)
    reads: list[int] = []
    quota = [3.0]
    monkeypatch.setattr(_threads, "_cgroup_cpus", lambda: reads.append(1) or quota[0])
    assert [available_cpus() for _ in range(5)] == [3] * 5
    assert len(reads) == 1
    quota[0] = 1.0  # (a quota changed at run time is seen after a fork or an affinity change, not before)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "process_cpu_count", lambda: 2, raising=False)
    assert available_cpus() == 1
    assert len(reads) == 2
    quota[0] = 8.0
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # a forked child
    assert available_cpus() == 2
    assert available_cpus() == 2
    assert len(reads) == 3


def test_writer_workers_follow_available_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend(monkeypatch, 8, 1.5)
    assert DatasetWriter(tmp_path / "d.stoker", {"y": IntField()}, num_workers=-1, progress=False).num_workers == 2
    assert DatasetWriter(tmp_path / "d.stoker", {"y": IntField()}, num_workers=3, progress=False).num_workers == 3


def test_image_check_workers_follow_available_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.convert import imagefolder

    _pretend(monkeypatch, 8, 2.0)
    pools: list[int] = []

    class Context:
        def Pool(self, processes: int, initializer: object) -> object:
            pools.append(processes)
            raise RuntimeError("no pool in this test")

    monkeypatch.setattr(imagefolder.mp, "get_context", lambda method: Context())
    with pytest.raises(RuntimeError, match="no pool"):
        imagefolder.find_bad_images([tmp_path / f"{i}.png" for i in range(5)], num_workers=-1, progress=False)
    assert pools == [2]


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n", "cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # v2 first
        ({"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.5),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "garbage\n"}, None),
        ({"cpu.max": "0 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "100000\n"}, None),  # no period
        ({}, None),  # no cgroup file system
    ],
)
def test_cgroup_cpus_reads_v2_then_v1(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    assert _threads._cgroup_cpus(_cgroup(tmp_path, files)) == expected
