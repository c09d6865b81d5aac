"""Machine facts behind the Otto benchmark's numbers: what a hand-off between two threads costs here."""

from __future__ import annotations

import os
import statistics
import time

from stoker._threads import start_thread


def thread_round_trip_us(cpus: tuple[int, int] | None = None, round_trips: int = 2000, repeats: int = 3) -> float:
    """Median time for two threads to pass an object there and back through two queues [microseconds].

    A machine fact behind every loader that hands batches between threads: each
    hand-off to a waiting thread costs about half of it. Waking a thread on
    another CPU costs far more than on the same one on virtual machines (the
    sleeping CPU must be woken), so ``cpus`` pins the two threads (this thread
    first; its affinity is restored after); ``None`` leaves them where the
    system puts them.
    """
    import queue

    def pin(cpu: int | None) -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread

    mine = os.sched_getaffinity(0) if cpus is not None else None
    if mine is not None and cpus is not None and not set(cpus) <= mine:
        raise ValueError(f"cpus {cpus} are not all among the CPUs this process may run on ({sorted(mine)})")
    times = []
    try:
        pin(None if cpus is None else cpus[0])
        for _ in range(repeats):
            there: queue.SimpleQueue[int] = queue.SimpleQueue()
            back: queue.SimpleQueue[int] = queue.SimpleQueue()

            def echo(there: queue.SimpleQueue[int] = there, back: queue.SimpleQueue[int] = back) -> None:
                pin(None if cpus is None else cpus[1])
                for _ in range(round_trips):
                    back.put(there.get())

            thread = start_thread(echo, name="stoker-bench-echo")
            there.put(-1)  # the echo thread is running (and pinned) before the clock starts
            back.get()
            start = time.perf_counter()
            for i in range(round_trips - 1):
                there.put(i)
                back.get()
            times.append((time.perf_counter() - start) / (round_trips - 1) * 1e6)
            thread.join()
    finally:
        if mine is not None:
            os.sched_setaffinity(0, mine)
    return statistics.median(times)


def thread_round_trips_us() -> dict[str, float | None]:
    """:func:`thread_round_trip_us` with both threads on one CPU and on two (``None`` with fewer than two CPUs)."""
    if not hasattr(os, "sched_getaffinity"):  # pragma: no cover - Linux has it
        return {"same_cpu": None, "two_cpus": None}
    cpus = sorted(os.sched_getaffinity(0))
    return {
        "same_cpu": thread_round_trip_us((cpus[0], cpus[0])),
        "two_cpus": thread_round_trip_us((cpus[0], cpus[1])) if len(cpus) > 1 else None,
    }
