"""What every epoch of a :class:`~stoker.loader.Loader` stands on: its producer threads and the iterator's contract.

The loader's producer threads (:class:`_Producers`) are kept from one epoch to
the next; each epoch gives every thread a job (see :mod:`stoker.loader._engine`).
At interpreter exit every running epoch is stopped and every thread joined
before anything they use goes away.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from stoker._threads import start_thread
from stoker.errors import StokerError

if TYPE_CHECKING:
    from stoker.loader._view import LoaderView

_WORKQUEUE_LOCK = threading.Lock()  # numba's workqueue layer cannot run two parallel regions at once

_ATEXIT_REGISTERED = False
#: parallel loops of a producer with several threads run in about this many chunks per thread, taken as threads free
#: up (Numba's default is one chunk per thread: a thread descheduled by another process stalls the whole batch; with
#: a busy process beside a loader of 32x32 JPEGs on 2 CPUs, 84,000-88,000 images/s against 95,000-105,000 in chunks)
CHUNKS_PER_THREAD = 4


def set_producer_threads(threads: int, batch_size: int) -> None:
    """Numba's threads and parallel chunk size for the calling producer thread (both are per thread)."""
    import numba

    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    numba.set_num_threads(threads)  # type: ignore[attr-defined]
    numba.set_parallel_chunksize(max(1, -(-batch_size // (CHUNKS_PER_THREAD * threads))) if threads > 1 else 0)  # type: ignore[attr-defined]


# Every loader's producer threads (kept from one epoch to the next), shut down at exit after the epochs.
_LIVE_POOLS: weakref.WeakSet[_Producers] = weakref.WeakSet()


def _stop_all_epochs() -> None:
    """At exit: stop every loader's running epoch and join its threads, before anything they use (libjpeg-turbo
    handles, memory maps, the interpreter itself) goes away."""
    for pool in list(_LIVE_POOLS):
        with contextlib.suppress(Exception):
            pool.shutdown()


#: thread id -> Numba compilations ended in that thread (counted once :func:`compiles_here` was first called)
_compiles: dict[int, int] = {}
_compiles_watched = False
_compiles_lock = threading.Lock()


def compiles_here() -> int:
    """How many Numba compilations have ended in this thread (a listener on Numba's events, registered on first use).

    A compilation leaves garbage in a reference cycle that holds the frames on the compiling thread's stack (Numba's
    typing keeps a failed overload's exception and its traceback; a frame kept past its return keeps its caller's), so
    whatever those frames referred to (the epoch whose ``next()`` compiled) lives until the collector runs. A ``next()``
    or an ``iter()`` that compiled says so (``Loader._compile_garbage``): the loader's ``state_dict()`` then collects
    once before it trusts that an epoch left by ``break`` is still running (a collection costs a fraction of a second:
    never per batch).
    """
    global _compiles_watched
    if not _compiles_watched:
        with _compiles_lock:
            if not _compiles_watched:
                from numba.core import event

                class Compiles(event.Listener):  # type: ignore[misc]
                    def on_start(self, ev: Any) -> None:
                        pass

                    def on_end(self, ev: Any) -> None:
                        tid = threading.get_ident()
                        _compiles[tid] = _compiles.get(tid, 0) + 1

                event.register("numba:compile", Compiles())
                _compiles_watched = True
    return _compiles.get(threading.get_ident(), 0)


#: bumped in a child process after each fork (see :func:`fork_generation`): ``[generation]``
_FORK_GEN = [0]
_FORK_WATCHED = False


def _forked() -> None:
    _FORK_GEN[0] += 1


def fork_generation() -> int:
    """A number that changes in a process forked from this one (an ``os.getpid()`` that makes no system call per
    batch); the watch is registered on the first call, not at import."""
    global _FORK_WATCHED
    if not _FORK_WATCHED:
        _FORK_WATCHED = True
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forked)
    return _FORK_GEN[0]


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        # atexit runs its functions last-registered first: this one, registered when the first epoch
        # starts, runs before the finalizers of objects built earlier (the decoders' handles)
        atexit.register(_stop_all_epochs)
        _ATEXIT_REGISTERED = True


#: why a ``next()`` is refused while another thread is inside ``next()`` of the same iterator
TWO_THREADS = "next() was called on one Loader iterator from two threads at once: use one Loader per thread"


def busy_token() -> list[bool]:
    """An iterator's token for one ``next()`` at a time: ``next()`` pops it (an ``IndexError``: another thread is inside
    ``next()``), and puts it back as it returns. ``list.pop`` and ``list.append`` are atomic (one call under the GIL, or
    the list's own lock without one), and cost a tenth of a ``threading.Lock``'s acquire and release: ``next()`` takes
    it once per batch (microseconds in all)."""
    return [True]


class Epoch:
    """The loop's side of one epoch: what every kind of epoch shares (iteration, one thread at a time, length).

    A subclass sets ``epoch``, ``consumed`` (the batches of the epoch handed
    out, those a resume skipped included), ``finished``, ``_loader``, ``_busy``
    (:func:`busy_token`) and ``_pid`` (:func:`fork_generation` when it started), and
    defines :meth:`_next_batch` and :meth:`close`.
    """

    epoch: int
    consumed: int
    finished: bool
    _loader: LoaderView
    _busy: list[bool]
    _pid: int
    _interrupted: str | None = None  # what interrupted a next() (KeyboardInterrupt): the epoch is over

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> tuple[Any, ...] | dict[str, Any]:
        if self._pid != _FORK_GEN[0]:  # forked since: its producers stayed in the parent, waiting would never end
            raise StokerError(
                "this Loader iterator was started before the process forked, and its producer threads are in the parent "
                "process; in this process, call loader.close() and iterate the loader again (a new epoch)"
            )
        try:
            self._busy.pop()  # (the token: see busy_token)
        except IndexError:
            raise StokerError(TWO_THREADS) from None
        try:
            if self._interrupted is not None:
                raise StokerError(
                    f"this Loader iterator was interrupted ({self._interrupted}) inside next(), which left its epoch half "
                    "handed over; iterate the loader again for the next epoch (where loader.state_dict() now starts), or "
                    "load a state saved inside your loop (loader.state_dict()) first to go on after that batch"
                )
            tid = threading.get_ident()  # (compiles_here() inline once watched: next() is microseconds)
            compiled = _compiles.get(tid, 0) if _compiles_watched else compiles_here()
            try:
                return self._next_batch()
            finally:  # a compile's garbage may hold this epoch after break (see compiles_here)
                if _compiles.get(tid, 0) != compiled:
                    self._loader._compile_garbage = True
        except StopIteration:
            active = self._loader._active
            if active is not None and active() is self:  # ran to its end (a consumer may have read the end ahead)
                self._loader._ran_to_end = True
            raise
        except Exception:
            raise
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: the user's, anywhere in the hand-over; the epoch ends
            self._interrupted = type(exc).__name__
            self.close()
            raise
        finally:
            self._busy.append(True)

    def __len__(self) -> int:
        """The batches this iterator has still to hand out (0 once the epoch is over)."""
        return 0 if self.finished else max(0, self._loader._batches_in(self.epoch) - self.consumed)

    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def producer_pool(loader: LoaderView) -> _Producers:
    """The loader's kept producer threads, started (again) when it has none usable in this process."""
    pool = loader._pool
    if pool is None or not pool.usable(loader._producers):
        if pool is not None:
            pool.shutdown()
        pool = loader._pool = _Producers(loader._producers)
    return pool


#: seconds ``_Producers.wait_idle`` still waits for the batches in progress after a Ctrl-C interrupted it
WAIT_IDLE_GRACE = 10.0


class _Producers:
    """A loader's producer threads, kept from one epoch to the next.

    Starting threads for every epoch, and the first parallel regions Numba runs
    in a new thread, cost about as much as a whole epoch of a small table (1-2 ms
    of a ~10 ms Otto epoch). A thread holds no reference to its loader: it waits
    for a job (one epoch's share of batches), runs it, and says when it is idle.
    The loader shuts its threads down when it is closed or collected, and at exit.
    """

    def __init__(self, count: int) -> None:
        self.pid = os.getpid()  # threads do not survive fork: a child process starts its own
        self._inboxes: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(count)]
        self.current: Any = None  # what the threads' jobs belong to (an epoch's ring: its close() ends them), set with the jobs
        self._idle = [threading.Event() for _ in range(count)]
        for idle in self._idle:
            idle.set()
        # SIGINT and SIGTERM blocked: the kernel delivers them to the main thread, whatever the producers do
        self._threads = [
            start_thread(_serve, inbox, idle, name=f"stoker-loader-{t}")
            for t, (inbox, idle) in enumerate(zip(self._inboxes, self._idle, strict=True))
        ]
        _LIVE_POOLS.add(self)

    def __len__(self) -> int:
        return len(self._threads)

    def usable(self, count: int) -> bool:
        """Whether this pool can run an epoch of ``count`` producers in this process."""
        return self.pid == os.getpid() and len(self._threads) == count and all(t.is_alive() for t in self._threads)

    def stop_epoch(self) -> None:
        """Stop the epoch the threads run (also one whose iterator was dropped: its producers wait for tokens) and wait.

        An epoch holds no Python finalizer (a Ctrl-C whose handler runs inside one would be lost): an epoch
        left without ``close()`` (``break``) has its producers make the batches they have tokens for, then
        wait, idle, until the next epoch, ``loader.close()`` or exit stop them here.
        """
        if self.current is not None:
            self.current.close()
        self.wait_idle()

    def submit(self, t: int, job: Any) -> None:
        self._idle[t].clear()
        self._inboxes[t].put(job)

    def busy(self) -> bool:
        """Whether any thread is running a job."""
        return not all(idle.is_set() for idle in self._idle)

    def wait_idle(self) -> None:
        """Wait until every thread has finished its job (not for the calling thread itself).

        In a forked child there is nothing to wait for: the threads (and the jobs
        the parent gave them) stayed in the parent.
        """
        if self.pid != os.getpid():
            return
        me = threading.current_thread()
        interrupted: BaseException | None = None
        deadline = 0.0
        # a producer writes its batch's slots through raw addresses: returning (or raising) while it still does would
        # let the loader's memory be freed under it, so a Ctrl-C waits for the batches in progress, up to
        # WAIT_IDLE_GRACE seconds (an operation that never returns stays interruptible), and is raised then
        for thread, idle in zip(self._threads, self._idle, strict=True):
            if thread is me:
                continue
            while True:
                try:
                    if interrupted is None:
                        idle.wait()
                        break
                    if idle.wait(max(0.0, deadline - time.monotonic())):
                        break
                except BaseException as exc:  # a Ctrl-C, or a second one
                    if interrupted is None:
                        interrupted, deadline = exc, time.monotonic() + WAIT_IDLE_GRACE
                    continue
                raise interrupted  # the grace is over and this producer is still busy
        if interrupted is not None:
            raise interrupted

    def shutdown(self) -> None:
        """Stop the threads (after their current job) and join them; safe to call any number of times."""
        if self.current is not None and self.pid == os.getpid():
            self.current.close()
        for inbox in self._inboxes:
            inbox.put(None)
        me = threading.current_thread()
        if self.pid == os.getpid():
            for thread in self._threads:
                if thread is not me:
                    thread.join()
        _LIVE_POOLS.discard(self)


def _serve(inbox: queue.SimpleQueue[Any], idle: threading.Event) -> None:
    """A producer thread: run each job from ``inbox`` (an object with ``run()``) until ``None``."""
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            job.run()
        finally:
            job = None  # hold nothing of the epoch while idle
            idle.set()


def _layer_is_workqueue() -> bool:
    import numba

    try:
        return bool(numba.threading_layer() == "workqueue")
    except ValueError:  # no parallel region has run yet: decide from the configuration
        return str(numba.config.THREADING_LAYER) == "workqueue"  # type: ignore[attr-defined]
