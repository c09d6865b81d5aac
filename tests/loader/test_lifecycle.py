"""Threads never outlive their loader; errors reach the loop with the sample index."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stoker.decoders import IntDecoder, NDArrayDecoder
from stoker.errors import LoaderError, StokerError
from stoker.loader import Loader, OrderOption
from stoker.pipeline.operation import Operation
from stoker.transforms import ToTensor

from .conftest import loader_threads, other_loaders_threads


def _wait_no_threads(timeout: float = 5.0, ignore: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The producer threads still alive after ``timeout`` seconds (collecting garbage meanwhile), but those in ``ignore``."""
    deadline = time.monotonic() + timeout

    def alive() -> list[threading.Thread]:
        return [t for t in loader_threads() if t not in ignore]

    while alive() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return alive()


def test_early_break_30_times_leaks_no_thread(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=10, order=OrderOption.RANDOM, seed=0, num_workers=2)
    for _ in range(30):
        for i, _batch in enumerate(loader):
            if i == 3:
                break
    loader.close()
    assert _wait_no_threads() == []


def test_early_break_then_full_epoch_is_complete(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=0)
    for i, _batch in enumerate(loader):
        if i == 1:
            break
    seen = np.concatenate([y.numpy().ravel().copy() for _, y in loader])
    assert sorted(seen.tolist()) == list(range(1000))


def test_an_epoch_left_by_break_that_only_garbage_holds_does_not_refuse_the_next(table_path: Path) -> None:
    """The epoch whose first batch compiled the loop sits on that compile's stack, which Numba's typing keeps in a
    reference cycle (a failed overload's exception and its frames): after ``break`` it is garbage, not iterated, and
    iter() used to refuse ('already being iterated') until the collector ran (CI, a worker's first test)."""
    loader = Loader(table_path, batch_size=10, num_workers=2)
    gc.disable()
    try:
        for i, _batch in enumerate(loader):
            if i == 2:
                garbage: list[object] = [loader._active() if loader._active is not None else None]
                garbage.append(garbage)  # the running epoch, reachable from garbage once the loop lets go of it
                del garbage
                break
        assert loader._iterating(), "the epoch is still there, held by garbage (not collected: gc is off)"
        assert sum(1 for _ in loader) == len(loader) == 100
        it = iter(loader)
        next(it)
        with pytest.raises(StokerError, match="already being iterated"):  # an epoch truly alive is still refused
            iter(loader)
        del it
    finally:
        gc.enable()
    loader.close()


def test_deleting_the_loader_stops_its_thread(table_path: Path) -> None:
    loader = Loader(table_path, batch_size=10)
    it = iter(loader)
    next(it)
    assert loader_threads(), "the producer thread should be running mid-epoch"
    del it, loader
    assert _wait_no_threads() == []


def test_context_manager_and_close_twice(table_path: Path) -> None:
    with Loader(table_path, batch_size=10) as loader:
        it = iter(loader)
        next(it)
    loader.close()
    assert _wait_no_threads() == []


def test_memory_does_not_grow_over_epochs_with_breaks(table_path: Path) -> None:
    import tracemalloc

    loader = Loader(table_path, batch_size=10, order=OrderOption.RANDOM, seed=0)
    for i, _ in enumerate(loader):  # warm up: allocate slots, compile
        if i == 2:
            break
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(30):
        for i, _ in enumerate(loader):
            if i == 2:
                break
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 1_000_000, f"{after - before} bytes retained after 30 interrupted epochs"


def _fails_on(value: int):  # type: ignore[no-untyped-def]
    def check(batch):  # type: ignore[no-untyped-def]
        if (batch.reshape(-1) == value).any():
            raise ValueError(f"found {value}")
        return batch

    return check


@pytest.mark.parametrize("num_workers", [1, 2])
def test_error_in_python_operation_names_field_operation_and_sample(table_path: Path, num_workers: int) -> None:
    loader = Loader(table_path, batch_size=64, num_workers=num_workers, pipelines={"y": [IntDecoder(), ToTensor(), _fails_on(700)]})
    with pytest.raises(LoaderError) as info:
        for _ in loader:
            pass
    err = info.value
    assert err.index == 700 and err.field == "y"
    assert "found 700" in str(err) and "sample 700" in str(err)
    assert isinstance(err.__cause__, ValueError)
    assert _wait_no_threads() == []


def test_error_in_compiled_operation_names_the_sample(table_path: Path) -> None:
    from dataclasses import replace

    class FailOn(Operation):
        def declare_state_and_memory(self, previous_state):  # type: ignore[no-untyped-def]
            return replace(previous_state), None

        def generate_code(self):  # type: ignore[no-untyped-def]
            def fail_on(batch, dst, indices):  # type: ignore[no-untyped-def]
                for i in range(indices.shape[0]):
                    if indices[i] == 321:
                        raise ValueError("bad sample")
                return batch

            return fail_on

    loader = Loader(table_path, batch_size=100, order=OrderOption.RANDOM, seed=1, pipelines={"x": [NDArrayDecoder(), FailOn(), ToTensor()]})
    with pytest.raises(LoaderError) as info:
        for _ in loader:
            pass
    assert info.value.index == 321 and info.value.field == "x" and "FailOn" in info.value.operation


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_leaves_no_thread(table_path: Path) -> None:
    def slow(batch):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return batch

    loader = Loader(table_path, batch_size=10, pipelines={"y": [IntDecoder(), ToTensor(), slow]})
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(100):
            for _batch in loader:
                pass
    timer.join()
    del loader
    assert _wait_no_threads() == []


def test_reentrant_heads_get_two_producers_others_one(table_path: Path) -> None:
    """Only the heads (compiled steps, made by producers) count: a Python callable in the tail runs on the loop's thread."""
    from .test_engine import _KeepsState

    reentrant = Loader(table_path, batch_size=10, num_workers=2)
    assert reentrant._producers == 2
    with_callable = Loader(table_path, batch_size=10, num_workers=2, pipelines={"y": [IntDecoder(), ToTensor(), lambda t: t]})
    assert with_callable._producers == 2
    keeps_state = Loader(table_path, batch_size=10, num_workers=2, pipelines={"y": [IntDecoder(), _KeepsState(), ToTensor()]})
    assert keeps_state._producers == 1
    single = Loader(table_path, batch_size=10, num_workers=1)
    assert single._producers == 1
    a = [y.clone() for _, y in reentrant]
    for other in (with_callable, keeps_state):
        b = [y.clone() for _, y in other]
        assert all(np.array_equal(u.numpy(), v.numpy()) for u, v in zip(a, b, strict=True))
    for i, _ in enumerate(reentrant):  # break: the producers make what they have tokens for, then wait, idle ...
        if i == 5:
            break
    pool = reentrant._pool
    assert pool is not None and len(pool) == 2
    it = iter(reentrant)  # ... until the next epoch (or close()) stops them first
    assert reentrant._pool is pool and len(list(it)) == len(reentrant) and not pool.busy()
    for loader in (reentrant, with_callable, keeps_state, single):
        loader.close()
    assert _wait_no_threads() == []


@pytest.mark.parametrize("num_workers", [1, 2])
def test_producer_threads_are_kept_across_epochs_and_stop_with_the_loader(table_path: Path, num_workers: int) -> None:
    others = other_loaders_threads()
    loader = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=0, num_workers=num_workers)
    epochs = []
    for _ in range(3):
        epochs.append(np.concatenate([y.numpy().ravel().copy() for _, y in loader]))
        assert not loader._pool.busy(), "between epochs no producer runs"  # type: ignore[union-attr]
        epochs.append(np.concatenate([y.numpy().ravel().copy() for i, (_, y) in zip(range(3), loader, strict=False)]))
    threads = [t for t in loader_threads() if t not in others]
    assert len(threads) == loader._producers
    for _ in loader:  # another epoch: the same threads
        pass
    assert [t for t in loader_threads() if t not in others] == threads
    for seen in epochs[0::2]:
        assert sorted(seen.tolist()) == list(range(1000))
    fresh = Loader(table_path, batch_size=64, order=OrderOption.RANDOM, seed=0, num_workers=num_workers)
    for k, seen in enumerate(epochs[0::2]):  # kept threads give the batches fresh threads would (epoch k = 2k of fresh's)
        fresh.set_epoch(2 * k)
        np.testing.assert_array_equal(seen, np.concatenate([y.numpy().ravel().copy() for _, y in fresh]))
    fresh.close()
    del loader
    assert _wait_no_threads(ignore=others) == []


def test_threads_of_another_process_are_not_reused(table_path: Path) -> None:
    """After fork the child holds the parent's pool object but none of its threads: it must start its own.

    Simulated in this process (the pool marked as another process's): a real forked child would also run
    Numba's TBB layer after fork, which Numba warns may be in an invalid state (docs: Threads).
    """
    loader = Loader(table_path, batch_size=100, num_workers=2)
    expected = np.concatenate([y.numpy().ravel().copy() for _, y in loader])
    old = loader._pool
    assert old is not None
    old_threads = list(old._threads)
    assert len(old_threads) == 2 and all(t.is_alive() for t in old_threads)
    old.pid = -1  # what a forked child sees: a pool started by another process
    loader.set_epoch(0)
    again = np.concatenate([y.numpy().ravel().copy() for _, y in loader])
    np.testing.assert_array_equal(again, expected)
    assert loader._pool is not old and loader._pool is not None and len(loader._pool) == 2
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in old_threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in old_threads), "the replaced pool's threads must stop"
    new_threads = list(loader._pool._threads)
    loader.close()
    assert not any(t.is_alive() for t in new_threads), "close() joins the threads"


_QUIET_EXIT = """
import multiprocessing, sys
from stoker.loader import Loader
import stoker.loader.loader as loader_module

if sys.argv[2] == "interrupted init":  # Ctrl-C while the Loader opens its file: a half-built object is collected
    real = loader_module.Loader._build

    def interrupted(self):
        raise KeyboardInterrupt

    loader_module.Loader._build = interrupted
    try:
        half = Loader(sys.argv[1], batch_size=10)
    except KeyboardInterrupt:
        pass
    loader_module.Loader._build = real
loader = Loader(sys.argv[1], batch_size=10, num_workers=2)  # module-level, alive until the interpreter tears down
for _ in loader:
    pass
it = iter(loader)
next(it)  # an epoch in flight at exit
print("done", flush=True)
"""


@pytest.mark.parametrize("case", ["module-level loader", "interrupted init"])
def test_nothing_is_printed_at_exit(table_path: Path, case: str) -> None:
    """A module-level Loader (multiprocessing imported) and a Loader whose __init__ was interrupted used to print
    'Exception ignored in: Loader.__del__' at exit ('NoneType' object is not callable, AttributeError)."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", _QUIET_EXIT, str(table_path), case], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
