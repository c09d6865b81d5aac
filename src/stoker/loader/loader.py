"""The :class:`Loader`: compiled per-field pipelines, on threads, into preallocated batches."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from stoker.errors import LoaderError, StokerError
from stoker.format.reader import Reader
from stoker.loader.order import OrderOption, epoch_order
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.graph import FieldPipeline, build_pipeline
from stoker.pipeline.random import sample_seeds
from stoker.pipeline.threads import prefer_tbb

_END = object()  # sentinel: the epoch is over
_WORKQUEUE_LOCK = threading.Lock()  # numba's workqueue layer cannot run two parallel regions at once
_STATE_VERSION = 1


class _Stop(Exception):
    """Raised inside the producer when the iterator is closed."""


class Loader:
    """Iterate over a stoker file in batches of torch tensors.

    Each field runs its pipeline (a decoder, then transforms). The compiled part
    of every pipeline runs on ``num_workers`` threads without the GIL, writing
    into memory allocated once; a producer thread prepares ``batches_ahead``
    batches ahead of your loop.

    Args:
        fname: the stoker file.
        batch_size: samples per batch.
        num_workers: threads for the compiled parts; ``-1`` for all cores.
        os_cache: ``True``: memory-map and let the OS page cache keep the file
            (best when it fits in RAM). ``False``: release the pages read after
            each window of ``QUASI_RANDOM`` (or every few batches), so memory
            stays bounded for files larger than RAM.
        order: :class:`OrderOption`.
        distributed: not supported yet (raises).
        seed: the seed of orders and random augmentations; ``None`` draws one
            (see :attr:`seed`). The same seed gives the same batches whatever
            ``num_workers``.
        indices: the subset of samples to use (default: all).
        pipelines: field name -> list of operations; a field mapped to
            ``None`` is skipped; missing fields get their default decoder and
            ``ToTensor()``.
        custom_fields: field name -> Field class, for fields of types this
            stoker does not know.
        drop_last: drop the last incomplete batch (``False``, as the
            DataLoader; FFCV's default is ``True``).
        batches_ahead: batches prepared ahead of your loop.
        compile: compile pipelines with Numba (default: on; see
            :class:`~stoker.pipeline.compiler.Compiler`).
        chunk_size: samples per chunk for ``QUASI_RANDOM`` (default: 8 batches).
        window_chunks: chunks shuffled together in ``QUASI_RANDOM``.

    Batches are views into reused memory: the batch you hold and the one
    before it stay valid; older ones are overwritten. Call ``.clone()`` to
    keep a batch longer.

    Example:
        >>> loader = Loader("data.stoker", batch_size=1024, order=OrderOption.RANDOM, seed=0)  # doctest: +SKIP
        >>> for x, y in loader:  # doctest: +SKIP
        ...     loss = criterion(model(x), y.flatten())
    """

    def __init__(
        self,
        fname: str | os.PathLike[str],
        batch_size: int,
        num_workers: int = -1,
        os_cache: bool = True,
        order: OrderOption = OrderOption.SEQUENTIAL,
        distributed: bool = False,
        seed: int | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        pipelines: Mapping[str, Sequence[Any] | None] | None = None,
        custom_fields: Mapping[str, type] | None = None,
        drop_last: bool = False,
        batches_ahead: int = 3,
        recompile: bool = False,
        compile: bool | None = None,
        chunk_size: int | None = None,
        window_chunks: int = 8,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
        if not isinstance(order, OrderOption):
            raise ValueError(f"order must be an OrderOption (SEQUENTIAL, RANDOM, QUASI_RANDOM); got {order!r}")
        if batches_ahead < 1:
            raise ValueError(f"batches_ahead must be >= 1; got {batches_ahead}")
        if num_workers == 0 or num_workers < -1:
            raise ValueError(f"num_workers must be -1 (all cores) or >= 1; got {num_workers}")
        if distributed:
            raise NotImplementedError("distributed=True is not supported yet: shard with indices=... per rank for now")
        if window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1; got {window_chunks}")
        prefer_tbb()
        self.reader = Reader(fname, custom_fields=custom_fields)
        self.reader.validate_metadata()
        self.batch_size = int(batch_size)
        self.num_workers = (os.cpu_count() or 1) if num_workers == -1 else int(num_workers)
        self.os_cache = os_cache
        self.order = order
        self.drop_last = drop_last
        self.batches_ahead = int(batches_ahead)
        self.seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1) if seed is None else int(seed)
        self.chunk_size = int(chunk_size) if chunk_size else 8 * self.batch_size
        self.window_chunks = int(window_chunks)
        n = len(self.reader)
        if indices is None:
            self.indices = np.arange(n, dtype=np.int64)
        else:
            self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
            bad = (self.indices < 0) | (self.indices >= n)
            if bad.any():
                raise IndexError(f"indices must lie in [0, {n}) for {self.reader.path}; got {int(self.indices[bad][0])}")
        pipelines = dict(pipelines or {})
        unknown = set(pipelines) - set(self.reader.fields)
        if unknown:
            raise StokerError(
                f"pipelines name fields that {self.reader.path} does not have: {sorted(unknown)}; it has {list(self.reader.fields)}"
            )
        with Compiler.enabled(Compiler.is_enabled() if compile is None else compile):
            self.pipelines: list[FieldPipeline] = []
            for position, (name, field) in enumerate(self.reader.fields.items()):
                ops = pipelines.get(name, "default")
                if ops is None:
                    continue
                if ops == "default":
                    from stoker.transforms import ToTensor

                    ops = [field.default_decoder(), ToTensor()]
                self.pipelines.append(build_pipeline(name, field, list(ops), self.reader, position, self.batch_size))
        # Pipelines whose operations keep no per-thread state can prepare several batches at once:
        # one producer thread per worker, each running its batches' compiled code on one thread.
        # Otherwise one producer spreads each batch's samples over the workers.
        reentrant = all(getattr(s.op, "reentrant", False) for p in self.pipelines for s in p.steps)
        self._producers = max(1, min(self.num_workers, 2)) if reentrant else 1
        self._tokens_per_producer = max(1, -(-self.batches_ahead // self._producers))
        # batches in flight: the two the user may hold, the queued ones, and one per producer being made
        self._num_slots = self._producers * (self._tokens_per_producer + 1) + 2
        # stage times, one dict per producer position, kept across epochs (a new epoch starts after
        # the previous one's threads are joined, so each dict has one writer at a time)
        self._producer_seconds: list[dict[str, dict[str, float]]] = [{p.name: {} for p in self.pipelines} for _ in range(self._producers)]
        self._allocated = False
        self._next_epoch = 0
        self._skip_batches = 0
        self._position = (0, 0)  # (epoch, batches handed to the user in it)
        self._active: weakref.ref[_EpochIterator] | None = None
        self._cuda: Any = None
        self.wait_seconds = {"producer_waiting_for_consumer": 0.0, "consumer_waiting_for_producer": 0.0}

    # ---- sizes and state -------------------------------------------------------------------
    def __len__(self) -> int:
        n = len(self.indices)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def fields(self) -> list[str]:
        """Names of the fields the loader yields, in order."""
        return [p.name for p in self.pipelines]

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (after ``drop_last``)."""
        order = epoch_order(self.order, self.indices, self.seed, epoch, self.chunk_size, self.window_chunks)
        return order[: len(self) * self.batch_size] if self.drop_last else order

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: restore it with :meth:`load_state_dict` to continue exactly.

        The position is that of the last batch handed to you, not of the
        producer thread.
        """
        epoch, consumed = self._position
        return {"version": _STATE_VERSION, "seed": self.seed, "epoch": epoch, "batches_consumed": consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next iteration yields the batch after it."""
        if state.get("version") != _STATE_VERSION:
            raise StokerError(f"loader state of version {state.get('version')!r}; this stoker reads version {_STATE_VERSION}")
        self.close()
        self.seed = int(state["seed"])
        self._next_epoch = int(state["epoch"])
        self._skip_batches = int(state["batches_consumed"])
        self._position = (self._next_epoch, self._skip_batches)

    # ---- iteration -------------------------------------------------------------------------
    def _allocate(self) -> None:
        if self._allocated:
            return
        cuda_devices = {s.op.device for p in self.pipelines for s in p.steps if getattr(s.op, "is_cuda", False)}  # type: ignore[attr-defined]
        pinned = False
        if cuda_devices:
            import torch

            if not torch.cuda.is_available():
                raise StokerError(f"a pipeline has ToDevice({sorted(map(str, cuda_devices))}) but CUDA is not available")
            from stoker.loader.device import CudaSync

            self._cuda = CudaSync(next(iter(cuda_devices)), self._num_slots)
            pinned = True
        for p in self.pipelines:
            p.allocate(self._num_slots, self.batch_size, pinned and p.wants_pinned)
        self._allocated = True

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        self.close()
        self._allocate()
        epoch, skip = self._next_epoch, self._skip_batches
        self._next_epoch, self._skip_batches = epoch + 1, 0
        it = _EpochIterator(self, epoch, skip)
        self._active = weakref.ref(it)
        return it

    def close(self) -> None:
        """Stop the running epoch's thread, if any (safe to call any number of times)."""
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ---- where time goes ---------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, float]]:
        """Seconds spent so far, per field and stage, and waiting on either side.

        ``compiled[...]`` is the fused compiled part (reading the file and every
        compiled operation); other keys are Python stages run once per batch.
        """
        out: dict[str, dict[str, float]] = {p.name: {} for p in self.pipelines}
        for producer in self._producer_seconds:
            for field, stages in producer.items():
                for stage, seconds in stages.items():
                    out[field][stage] = out[field].get(stage, 0.0) + seconds
        out["loader"] = dict(self.wait_seconds)
        return out

    def __repr__(self) -> str:
        return f"Loader({str(self.reader.path)!r}, batch_size={self.batch_size}, order={self.order.name}, fields={self.fields}, batches={len(self)})"


class _EpochIterator:
    """One epoch: producer threads filling slots, and the consumer side.

    With ``P`` producers, producer ``t`` makes batches ``skip + t``, ``skip + t + P``, ...
    and puts them on its own queue; the consumer takes them round-robin, so
    batches arrive in order. Each producer also has a queue of tokens, one per
    batch it may prepare ahead; the consumer gives a token back as it takes a
    batch, which bounds the memory in flight.
    """

    def __init__(self, loader: Loader, epoch: int, skip: int) -> None:
        self.epoch = epoch
        self.consumed = skip
        self.finished = False
        self._loader = loader  # keeps the loader (and its memory) alive while the epoch runs
        self._cuda = loader._cuda
        self._wait = loader.wait_seconds
        order = loader.epoch_indices(epoch)
        producers = loader._producers
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(producers)]
        self._tokens: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(producers)]
        for tokens in self._tokens:
            for _ in range(loader._tokens_per_producer):
                tokens.put(True)
        self._stop = threading.Event()
        self._last_slot: int | None = None
        self._next = 0  # which producer's queue holds the next batch
        release = _release_fn(loader)
        threads_each = max(1, loader.num_workers // producers)
        self._threads = []
        for t in range(producers):
            seconds = loader._producer_seconds[t]
            job = _Job(loader.pipelines, order, loader.batch_size, skip + t, producers, loader._num_slots, loader.seed, epoch,
                       threads_each, self._queues[t], self._tokens[t], self._stop, loader._cuda, loader.wait_seconds,
                       release if t == 0 else None, loader.batches_ahead, seconds)  # fmt: skip
            thread = threading.Thread(target=_produce, args=(job,), name=f"stoker-loader-epoch{epoch}-{t}", daemon=True)
            self._threads.append(thread)
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> tuple[Any, ...]:
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
            raise item
        slot, event, outputs = item
        if event is not None:
            self._cuda.hand_over(event)
        self._last_slot = slot
        self.consumed += 1
        self._loader._position = (self.epoch, self.consumed)
        return tuple(outputs)

    def __len__(self) -> int:
        return len(self._loader) - self.consumed

    def close(self) -> None:
        """Stop and join the producer threads; drop queued batches."""
        self.finished = True
        if self._stop.is_set():
            return
        self._stop.set()
        for tokens in self._tokens:
            tokens.put(False)  # wakes a producer waiting for a token
        for thread in self._threads:
            thread.join()
        for q in self._queues:
            while not q.empty():
                q.get_nowait()

    def __del__(self) -> None:
        self.close()


def _release_fn(loader: Loader) -> Any:
    """Per-batch page-cache release for ``os_cache=False`` (None when caching)."""
    if loader.os_cache:
        return None
    storage = loader.reader.storage
    path = loader.reader.path

    def release() -> None:
        import mmap

        mm = getattr(storage, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    return release


class _Job(NamedTuple):
    """What one producer thread needs (no reference to the iterator, so dropping it stops the epoch)."""

    pipelines: list[FieldPipeline]
    order: np.ndarray
    batch_size: int
    first: int
    step: int
    num_slots: int
    seed: int
    epoch: int
    num_threads: int
    out: queue.SimpleQueue[Any]
    tokens: queue.SimpleQueue[Any]
    stop: threading.Event
    cuda: Any
    wait: dict[str, float]
    release: Any
    batches_ahead: int
    seconds: dict[str, dict[str, float]]


def _produce(job: _Job) -> None:
    """A producer thread: batches ``first``, ``first + step``, ... of the epoch, every field, into their slots."""
    out, stop, cuda = job.out, job.stop, job.cuda
    seed, epoch = job.seed, job.epoch

    def take_token() -> None:
        t0 = time.perf_counter()
        job.tokens.get()
        job.wait["producer_waiting_for_consumer"] += time.perf_counter() - t0
        if stop.is_set():
            raise _Stop

    def seeds_fn(salt: int, idx: np.ndarray) -> np.ndarray:
        return sample_seeds(seed, epoch, idx, salt)

    try:
        import numba

        numba.set_num_threads(max(1, min(job.num_threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        lock = _WORKQUEUE_LOCK if _layer_is_workqueue() else None
        n_batches = -(-len(job.order) // job.batch_size)
        release_every = max(1, job.batches_ahead + 3)
        for b in range(job.first, n_batches, job.step):
            take_token()
            indices = job.order[b * job.batch_size : (b + 1) * job.batch_size]
            slot = b % job.num_slots
            event = None
            if cuda is not None:
                cuda.before_slot(slot)
            outputs = []
            for p in job.pipelines:
                try:
                    if lock is not None:
                        with lock:
                            result = _run(p, indices, slot, seeds_fn, cuda, job.seconds[p.name])
                    else:
                        result = _run(p, indices, slot, seeds_fn, cuda, job.seconds[p.name])
                except Exception as exc:
                    err = p.locate_error(indices, slot, seeds_fn, exc)
                    err.__cause__ = exc
                    out.put(err)
                    return
                outputs.append(result)
            if cuda is not None:
                event = cuda.after_batch(slot)
            out.put((slot, event, outputs))
            if job.release is not None and (b + 1) % release_every == 0:
                job.release()
        out.put(_END)
    except _Stop:
        return
    except BaseException as exc:  # an error of the loader itself: hand it to the consumer
        out.put(LoaderError("*", "loader", None, f"{type(exc).__name__}: {exc}"))


def _run(p: FieldPipeline, indices: np.ndarray, slot: int, seeds_fn: Any, cuda: Any, seconds: dict[str, float]) -> Any:
    if cuda is None:
        return p.run(indices, slot, seeds_fn, seconds)
    with cuda.stream_context():
        return p.run(indices, slot, seeds_fn, seconds)


def _layer_is_workqueue() -> bool:
    import numba

    try:
        return bool(numba.threading_layer() == "workqueue")
    except ValueError:  # no parallel region has run yet: decide from the configuration
        return str(numba.config.THREADING_LAYER) == "workqueue"  # type: ignore[attr-defined]
