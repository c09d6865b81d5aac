"""One epoch of a :class:`~stoker.loader.Loader`: its producer threads and the consumer side.

The loader's producer threads (:class:`_Producers`) are kept from one epoch to
the next; each epoch gives every thread a job (:class:`_Job`, run by
:func:`_produce`): its share of the epoch's batches, written into batch slots
and handed to the consumer (:class:`_EpochIterator`) through one queue per
producer. At interpreter exit every running epoch is stopped and every thread
joined before anything they use goes away.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from stoker.errors import DatasetFormatError, LoaderError, StokerError
from stoker.format.sharded import ShardedReader
from stoker.pipeline.graph import FieldPipeline
from stoker.pipeline.random import sample_seeds

if TYPE_CHECKING:
    from stoker.loader.loader import Loader

_END = object()  # sentinel: the epoch is over
_WORKQUEUE_LOCK = threading.Lock()  # numba's workqueue layer cannot run two parallel regions at once

# Every running epoch, so that interpreter exit can stop and join its producer threads before
# anything they use (libjpeg-turbo handles, memory maps, the interpreter itself) goes away.
_LIVE_EPOCHS: weakref.WeakSet[Epoch] = weakref.WeakSet()
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
    for epoch in list(_LIVE_EPOCHS):
        with contextlib.suppress(Exception):
            epoch.close()
    for pool in list(_LIVE_POOLS):
        with contextlib.suppress(Exception):
            pool.shutdown()


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        # atexit runs its functions last-registered first: this one, registered when the first epoch
        # starts, runs before the finalizers of objects built earlier (the decoders' handles)
        atexit.register(_stop_all_epochs)
        _ATEXIT_REGISTERED = True


class _Stop(Exception):
    """Raised inside the producer when the iterator is closed."""


class Epoch:
    """The loop's side of one epoch: what every kind of epoch shares (iteration, one thread at a time, length).

    A subclass sets ``consumed``, ``finished``, ``_loader``, ``_busy`` (a
    lock) and ``_pid`` (the process it started in), and defines
    :meth:`_next_batch` and :meth:`close`.
    """

    consumed: int
    finished: bool
    _loader: Loader
    _busy: threading.Lock
    _pid: int
    _interrupted: str | None = None  # what interrupted a next() (KeyboardInterrupt): the epoch is over

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> tuple[Any, ...] | dict[str, Any]:
        if self._pid != os.getpid():  # its producers stayed in the parent: waiting for them would never end
            raise StokerError(
                "this Loader iterator was started before the process forked, and its producer threads are in the parent "
                "process; in this process, call loader.close() and iterate the loader again (a new epoch)"
            )
        if not self._busy.acquire(blocking=False):
            raise StokerError("next() was called on one Loader iterator from two threads at once: use one Loader per thread")
        try:
            if self._interrupted is not None:
                raise StokerError(
                    f"this Loader iterator was interrupted ({self._interrupted}) inside next(), which left its epoch half "
                    "handed over; iterate the loader again for the next epoch, or call loader.load_state_dict(loader.state_dict()) "
                    "first to go on after the last batch you got"
                )
            return self._next_batch()
        except (KeyboardInterrupt, SystemExit) as exc:  # anywhere in the hand-over: its bookkeeping cannot be trusted
            self._interrupted = type(exc).__name__
            self.close()
            raise
        finally:
            self._busy.release()

    def __len__(self) -> int:
        return len(self._loader) - self.consumed

    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _EpochIterator(Epoch):
    """One epoch: producer threads filling slots, and the consumer side.

    With ``P`` producers, producer ``t`` makes batches ``skip + t``, ``skip + t + P``, ...
    and puts them on its own queue; the consumer takes them round-robin, so
    batches arrive in order. Each producer also has a queue of tokens, one per
    batch it may prepare ahead; the consumer gives a token back as it takes a
    batch, which bounds the memory in flight. Batch ``b`` goes to slot
    ``(slot_base + b - skip) % num_slots``: slots continue from one epoch to the next.
    """

    def __init__(self, loader: Loader, epoch: int, skip: int, slot_base: int) -> None:
        self.epoch = epoch
        self.consumed = skip
        self.finished = False
        self._loader = loader  # keeps the loader (and its memory) alive while the epoch runs
        self._cuda = loader._cuda
        self._wait = loader.wait_seconds
        self._busy = threading.Lock()
        self._pid = os.getpid()
        # this rank's samples, and the position of the first in the epoch's global order (a sample's position is
        # its seeds' key, whatever the world size; producers compute each batch's positions from it)
        order, first_position = loader._epoch_share(epoch)
        self._order = order  # batch b holds order[b * batch_size:(b + 1) * batch_size] (return_indices, return_lengths)
        producers = loader._producers
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(producers)]
        self._tokens: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(producers)]
        for tokens in self._tokens:
            for _ in range(loader._tokens_per_producer):
                tokens.put(True)
        self._stop = threading.Event()
        self._last_slot: int | None = None
        self._next = 0  # which producer's queue holds the next batch
        cache = None if loader.os_cache else cast(ShardedReader, loader.reader)  # os_cache=False: a bounded ShardedReader (acquire/release)
        threads_each = max(1, loader.num_workers // producers)
        pool = self._pool = producer_pool(loader)
        jobs = []
        for t in range(producers):
            job = _Job(loader.pipelines, order, first_position, loader.batch_size, skip, skip + t, producers, slot_base, loader._num_slots,
                       loader.seed, epoch, threads_each, self._queues[t], self._tokens[t], self._stop, loader._cuda,
                       loader._producer_wait[t], cache, loader._producer_seconds[t], loader._held,
                       loader.reader.validate_samples)  # fmt: skip
            jobs.append(job)
        _LIVE_EPOCHS.add(self)
        for t, job in enumerate(jobs):
            pool.submit(t, job)

    def _next_batch(self) -> tuple[Any, ...] | dict[str, Any]:
        # first, before anything changes: a warning turned into an error (warnings.simplefilter("error")) loses no batch
        self._loader._note_held()
        if self.finished:
            raise StopIteration
        if self._cuda is not None and self._last_slot is not None:
            self._cuda.release(self._last_slot)
        t = self._next
        t0 = time.perf_counter()
        item = self._queues[t].get()
        self._wait["consumer_waiting_for_producer"] += time.perf_counter() - t0
        self._tokens[t].put(True)
        self._next = (t + 1) % len(self._queues)
        if item is _END:
            self.close()
            self._loader._position = (self.epoch + 1, 0)
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            self._loader.close()  # a failed epoch leaves no thread behind
            raise item
        slot, event, outputs = item
        if event is not None:
            self._cuda.hand_over(event, outputs)
        self._last_slot = slot
        loader = self._loader
        if loader._extras:  # fresh tensors, never slot memory: a kept batch keeps its own
            bs = loader.batch_size
            outputs = loader._extras.add(loader.pipelines, outputs, self._order[self.consumed * bs : (self.consumed + 1) * bs])
        self.consumed += 1
        loader._position = (self.epoch, self.consumed)
        if loader.named:
            return dict(zip(loader.output_names, outputs))
        return tuple(outputs)

    def close(self) -> None:
        """Stop and join the producer threads; drop queued batches."""
        self.finished = True
        if self._stop.is_set():
            return
        self._stop.set()
        for tokens in self._tokens:
            tokens.put(False)  # wakes a producer waiting for a token
        self._pool.wait_idle()
        for q in self._queues:
            while not q.empty():
                q.get_nowait()
        _LIVE_EPOCHS.discard(self)

    def __del__(self) -> None:
        self.close()


def producer_pool(loader: Loader) -> _Producers:
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
        self._inboxes: list[queue.SimpleQueue[_Job | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._idle = [threading.Event() for _ in range(count)]
        for idle in self._idle:
            idle.set()
        self._threads = [
            threading.Thread(target=_serve, args=(inbox, idle), name=f"stoker-loader-{t}", daemon=True)
            for t, (inbox, idle) in enumerate(zip(self._inboxes, self._idle, strict=True))
        ]
        for thread in self._threads:
            thread.start()
        _LIVE_POOLS.add(self)

    def __len__(self) -> int:
        return len(self._threads)

    def usable(self, count: int) -> bool:
        """Whether this pool can run an epoch of ``count`` producers in this process."""
        return self.pid == os.getpid() and len(self._threads) == count and all(t.is_alive() for t in self._threads)

    def submit(self, t: int, job: _Job) -> None:
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
        for inbox in self._inboxes:
            inbox.put(None)
        me = threading.current_thread()
        if self.pid == os.getpid():
            for thread in self._threads:
                if thread is not me:
                    thread.join()
        _LIVE_POOLS.discard(self)


def _serve(inbox: queue.SimpleQueue[_Job | None], idle: threading.Event) -> None:
    """A producer thread: run each job from ``inbox`` until ``None`` (a ``_Job``, or an object with ``run()``)."""
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            if isinstance(job, _Job):
                _produce(job)
            else:
                job.run()
        finally:
            job = None  # hold nothing of the epoch while idle
            idle.set()


class _Job(NamedTuple):
    """What one producer thread needs (no reference to the iterator, so dropping it stops the epoch)."""

    pipelines: list[FieldPipeline]
    order: np.ndarray
    first_position: int  # the position of order[0] in the epoch's global order (positions are its seeds' key)
    batch_size: int
    skip: int
    first: int
    step: int
    slot_base: int
    num_slots: int
    seed: int
    epoch: int
    num_threads: int
    out: queue.SimpleQueue[Any]
    tokens: queue.SimpleQueue[Any]
    stop: threading.Event
    cuda: Any
    wait: dict[str, float]
    cache: ShardedReader | None  # os_cache=False: the bounded reader that holds each batch's bytes while it runs
    seconds: dict[str, dict[str, float]]
    held: list[int]
    validate: Callable[[np.ndarray], None]  # checks the metadata of a batch's samples before compiled code reads it


def _produce(job: _Job) -> None:
    """A producer thread: batches ``first``, ``first + step``, ... of the epoch, every field, into their slots."""
    out, stop, cuda = job.out, job.stop, job.cuda
    seed, epoch = job.seed, job.epoch
    first_position = job.first_position  # a sample's position in the epoch's global order is its seeds' key

    def take_token() -> None:
        t0 = time.perf_counter()
        job.tokens.get()
        job.wait["producer_waiting_for_consumer"] += time.perf_counter() - t0
        if stop.is_set():
            raise _Stop

    def seeds_fn(salt: int, where: np.ndarray) -> np.ndarray:
        return sample_seeds(seed, epoch, where, salt)

    try:
        set_producer_threads(job.num_threads, job.batch_size)
        lock = _WORKQUEUE_LOCK if _layer_is_workqueue() else None
        n_batches = -(-len(job.order) // job.batch_size)
        for b in range(job.first, n_batches, job.step):
            take_token()
            lo, hi = b * job.batch_size, (b + 1) * job.batch_size
            indices = job.order[lo:hi]
            where = np.arange(first_position + lo, first_position + lo + len(indices), dtype=np.int64)  # per batch: no epoch-long array
            slot = (job.slot_base + b - job.skip) % job.num_slots
            if cuda is not None:  # before anything in the slot is written or freed: its copies and the user's use are done
                cuda.before_slot(slot)
            for p in job.pipelines:
                if p.slot_in_use(slot):  # the user kept a batch that lives there: never overwrite it
                    p.renew_slot(slot)
                    job.held[0] += 1
            ticket = None
            try:
                job.validate(indices)
                if job.cache is not None:  # os_cache=False: the batch's bytes, read into the bounded cache
                    ticket = job.cache.acquire(indices)
            except DatasetFormatError as exc:  # corrupt metadata: named sample, before any compiled code reads it
                out.put(exc)
                return
            try:
                outputs = []
                for p in job.pipelines:
                    try:
                        if lock is not None:
                            with lock:
                                result = _run(p, indices, where, slot, seeds_fn, cuda, job.seconds[p.name])
                        else:
                            result = _run(p, indices, where, slot, seeds_fn, cuda, job.seconds[p.name])
                    except Exception as exc:
                        err = p.locate_error(indices, where, slot, seeds_fn, exc)
                        err.__cause__ = exc
                        out.put(err)
                        return
                    outputs.append(result)
            finally:  # every output is in slot memory now: the cached bytes are no longer needed
                if ticket is not None:
                    job.cache.release(ticket)  # type: ignore[union-attr]
            event = cuda.after_batch(slot, outputs) if cuda is not None else None
            out.put((slot, event, outputs))
            outputs, result = [], None  # hold no reference to the batch handed over
        out.put(_END)
    except _Stop:
        return
    except BaseException as exc:  # an error of the loader itself: hand it to the consumer
        out.put(LoaderError("*", "loader", None, f"{type(exc).__name__}: {exc}"))


def _run(p: FieldPipeline, indices: np.ndarray, where: np.ndarray, slot: int, seeds_fn: Any, cuda: Any, seconds: dict[str, float]) -> Any:
    if cuda is None:
        return p.run(indices, where, slot, seeds_fn, seconds)
    with cuda.stream_context():
        return p.run(indices, where, slot, seeds_fn, seconds)


def _layer_is_workqueue() -> bool:
    import numba

    try:
        return bool(numba.threading_layer() == "workqueue")
    except ValueError:  # no parallel region has run yet: decide from the configuration
        return str(numba.config.THREADING_LAYER) == "workqueue"  # type: ignore[attr-defined]
