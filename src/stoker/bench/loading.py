"""Loader-only comparison: epochs of each system side by side, each checked before it counts.

A system is timed over ``1 + epochs`` epochs; the first (stoker: compilation;
DataLoader: starting workers) is reported apart, the median of the others is
the system's number. Every batch of every epoch is checked for shape and
dtype. Then, before any number is returned, the values are checked:

* one extra, untimed epoch in random order, sample by sample: the multiset of
  (row, label) fingerprints must be drawn from the dataset without repetition,
  cover ``(n // batch_size) * batch_size`` samples and not come in file order;
* a second instance of the same system in file order: its first batches must
  equal the dataset's rows and labels bit for bit, in the same order, so all
  systems are compared with the same arrays.

A system that fails raises :class:`BenchCheckError`, so a fast but broken
loader never reports a number.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from stoker._threads import start_thread
from stoker.bench.baselines import CompiledGather, NumpyTake, dataloader_batched, dataloader_per_item
from stoker.bench.data import fingerprints


class BenchCheckError(RuntimeError):
    """A system produced batches of the wrong shape, dtype or content."""


@dataclass(frozen=True)
class SystemSpec:
    """One system to time.

    Attributes:
        key: short identifier used in the JSON output.
        label: human-readable name.
        workers: worker threads or processes it uses.
        make: builds the iterable (iterated once per epoch), in random order.
        epochs: timed epochs after the first.
        make_in_order: builds the same system in file order (no shuffling), for
            the bit-for-bit check against the dataset; ``None`` skips that check.
    """

    key: str
    label: str
    workers: int
    make: Callable[[], Any]
    epochs: int
    make_in_order: Callable[[], Any] | None = None


@dataclass
class SystemResult:
    """Timings of one system.

    Attributes:
        key, label, workers: as in :class:`SystemSpec`.
        construct_s: time to build the loader [seconds].
        first_epoch_s: the first epoch [seconds] (compilation, worker start).
        epoch_s: the later epochs [seconds].
        samples_per_epoch: samples seen per epoch.
        batch: the normalized batch description ``{"x": [shape, dtype], "y": [shape, dtype]}``,
            plus ``y_shape_as_yielded`` (``[B]`` or ``[B, 1]``).
        ratio_to_limit: median samples/s over that of the numpy limit.
        ratio_to_compiled: median samples/s over that of the compiled gather.
        per_batch_us: for a loader with ``stats()`` (stoker), where a batch's time
            went over the timed epochs, in microseconds per batch:
            ``compiled`` (compiled stages, summed over the threads that made batches),
            ``python_stages`` (Python stages such as ``ToTensor``),
            ``loop_waiting`` (the loop waiting for a batch) and
            ``producers_waiting`` (producers waiting for the loop to take one);
            ``None`` for other systems.
    """

    key: str
    label: str
    workers: int
    construct_s: float
    first_epoch_s: float
    epoch_s: list[float]
    samples_per_epoch: int
    batch: dict[str, Any] = field(default_factory=dict)
    ratio_to_limit: float = float("nan")
    ratio_to_compiled: float = float("nan")
    per_batch_us: dict[str, float] | None = None

    @property
    def median_epoch_s(self) -> float:
        """The median of the later epochs [seconds]."""
        return statistics.median(self.epoch_s)

    @property
    def samples_per_s(self) -> float:
        """Samples per second of the median later epoch."""
        return self.samples_per_epoch / self.median_epoch_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, derived numbers included."""
        return {
            "key": self.key,
            "label": self.label,
            "workers": self.workers,
            "construct_s": self.construct_s,
            "first_epoch_s": self.first_epoch_s,
            "epoch_s": self.epoch_s,
            "median_epoch_s": self.median_epoch_s,
            "samples_per_epoch": self.samples_per_epoch,
            "samples_per_s": self.samples_per_s,
            "ratio_to_limit": self.ratio_to_limit,
            "ratio_to_compiled": self.ratio_to_compiled,
            "batch": self.batch,
            "per_batch_us": self.per_batch_us,
        }


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def check_batch(batch: Any, batch_size: int, num_features: int, who: str) -> tuple[Any, Any]:
    """Check one ``(x, y)`` batch: x ``(B, F)`` float32, y int64 of shape ``(B,)`` or ``(B, 1)``.

    Args:
        batch: what the system yielded.
        batch_size: ``B``.
        num_features: ``F``.
        who: the system's name, for the message.

    Returns:
        ``(x, y)`` as yielded.

    Raises:
        BenchCheckError: anything else.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise BenchCheckError(
            f"{who}: a batch must be a pair (x, y); got {type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'}"
        )
    x, y = batch
    xs, xd = tuple(x.shape), _dtype_name(x.dtype)
    ys, yd = tuple(y.shape), _dtype_name(y.dtype)
    if xs != (batch_size, num_features) or xd != "float32":
        raise BenchCheckError(f"{who}: x must be ({batch_size}, {num_features}) float32; got {xs} {xd}")
    if ys not in ((batch_size,), (batch_size, 1)) or yd != "int64":
        raise BenchCheckError(f"{who}: y must be int64 of shape ({batch_size},) or ({batch_size}, 1); got {ys} {yd}")
    return x, y


def _to_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return a.detach().cpu().numpy()


def check_epoch_fingerprints(seen: list[np.ndarray], reference: np.ndarray, batch_size: int, who: str) -> None:
    """Check the fingerprints of one epoch's batches against those of the dataset.

    Args:
        seen: one array of :func:`~stoker.bench.data.fingerprints` per batch, in order.
        reference: the fingerprints of the whole dataset.
        batch_size: rows per batch.
        who: the system's name, for the message.

    Raises:
        BenchCheckError: a sample not in the dataset (or with the wrong label),
            a sample seen more often than the dataset holds it, the wrong
            number of samples, or batches in file order.
    """
    kept = (len(reference) // batch_size) * batch_size
    got = np.concatenate(seen) if seen else np.empty(0, dtype=np.uint64)
    if got.size != kept:
        raise BenchCheckError(f"{who}: an epoch with drop_last must hold {kept} samples; got {got.size} in {len(seen)} batches")
    ref_vals, ref_counts = np.unique(reference, return_counts=True)
    vals, counts = np.unique(got, return_counts=True)
    pos = np.minimum(np.searchsorted(ref_vals, vals), len(ref_vals) - 1)
    unknown = ref_vals[pos] != vals
    if unknown.any():
        raise BenchCheckError(f"{who}: {int(counts[unknown].sum())} samples of an epoch are not (row, label) pairs of the dataset")
    repeated = counts > ref_counts[pos]
    if repeated.any():
        raise BenchCheckError(f"{who}: {int((counts - ref_counts[pos])[repeated].sum())} samples came more than once in an epoch")
    if np.array_equal(seen[0], reference[:batch_size]):
        raise BenchCheckError(f"{who}: the first batch holds samples 0..{batch_size - 1} in file order; random order was asked for")


def verify_epoch(loader: Any, reference: np.ndarray, batch_size: int, num_features: int, who: str) -> None:
    """Run one epoch and check its samples against the dataset's fingerprints.

    Args:
        loader: the system (one iteration = one epoch).
        reference: :func:`~stoker.bench.data.fingerprints` of the whole dataset.
        batch_size: rows per batch.
        num_features: columns of x.
        who: the system's name, for the message.

    Raises:
        BenchCheckError: see :func:`check_epoch_fingerprints`.
    """
    seen = []
    for batch in loader:
        x, y = check_batch(batch, batch_size, num_features, who)
        seen.append(fingerprints(_to_numpy(x), _to_numpy(y).reshape(-1)))
    check_epoch_fingerprints(seen, reference, batch_size, who)


def verify_in_order(loader: Any, X: np.ndarray, y: np.ndarray, batch_size: int, who: str, batches: int = 3) -> None:
    """Check that the first ``batches`` batches of a system in file order equal the dataset's rows, bit for bit.

    Args:
        loader: the system, built without shuffling.
        X: ``(n, k)`` float32 features of the dataset.
        y: ``(n,)`` labels.
        batch_size: rows per batch.
        who: the system's name, for the message.
        batches: how many batches to compare.

    Raises:
        BenchCheckError: a batch of the wrong shape or dtype, rows or labels
            that differ from the dataset's, or fewer batches than asked.
    """
    n = 0
    for b, batch in enumerate(loader):
        if b == batches:
            break
        x, yb = check_batch(batch, batch_size, X.shape[1], who)
        xs, ys = np.ascontiguousarray(_to_numpy(x)), _to_numpy(yb).reshape(-1)
        rows = slice(b * batch_size, (b + 1) * batch_size)
        bad_x = ~(xs.view(np.uint32) == np.ascontiguousarray(X[rows]).view(np.uint32)).all(axis=1)
        bad_y = ys != y[rows]
        if bad_x.any() or bad_y.any():
            raise BenchCheckError(
                f"{who}: in file order, batch {b} must hold rows {rows.start}..{rows.stop - 1} of the dataset; "
                f"{int(bad_x.sum())} rows of x and {int(bad_y.sum())} labels differ"
            )
        n += 1
    want = min(batches, len(X) // batch_size)
    if n != want:
        raise BenchCheckError(f"{who}: in file order, {want} batches were expected; got {n}")


def stage_seconds(loader: Any) -> dict[str, float] | None:
    """Seconds a loader with ``stats()`` has spent so far, by kind of stage; ``None`` for one without.

    Keys: ``compiled`` (every ``compiled[...]`` stage of every field, summed over
    the threads that made batches: producers, and the loop's own), ``python_stages`` (every other stage), ``loop_waiting``
    and ``producers_waiting`` (``stats()["loader"]``).
    """
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        return None
    from stoker.loader.loader import STATS_SECTIONS

    found = stats()
    totals = {"compiled": 0.0, "python_stages": 0.0}
    for name, stages in found.items():
        if name in STATS_SECTIONS:  # not fields: the loader's waits, the step accounting, the cache
            continue
        for stage, seconds in stages.items():
            totals["compiled" if stage.startswith("compiled[") else "python_stages"] += seconds
    totals["loop_waiting"] = found["loader"]["consumer_waiting_for_producer"]
    totals["producers_waiting"] = found["loader"]["producer_waiting_for_consumer"]
    return totals


def per_batch_us(before: dict[str, float] | None, after: dict[str, float] | None, batches: int) -> dict[str, float] | None:
    """``(after - before) / batches`` in microseconds, key by key (see :func:`stage_seconds`)."""
    if before is None or after is None or batches <= 0:
        return None
    return {key: (after[key] - before[key]) / batches * 1e6 for key in after}


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


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


def run_system(
    spec: SystemSpec, reference: np.ndarray, batch_size: int, num_features: int, dataset: tuple[np.ndarray, np.ndarray] | None = None
) -> SystemResult:
    """Time ``1 + spec.epochs`` epochs of a system, then verify its values before returning a number.

    Args:
        spec: the system.
        reference: :func:`~stoker.bench.data.fingerprints` of the whole dataset.
        batch_size: rows per batch.
        num_features: columns of x.
        dataset: ``(X, y)``, for the bit-for-bit check in file order
            (with ``spec.make_in_order``).

    Raises:
        BenchCheckError: see :func:`check_batch`, :func:`verify_epoch` and
            :func:`verify_in_order`; also a wrong number of batches in an epoch.
    """
    expected = len(reference) // batch_size
    start = time.perf_counter()
    loader = spec.make()
    construct_s = time.perf_counter() - start
    times = []
    last: tuple[Any, Any] | None = None
    before: dict[str, float] | None = None
    try:
        for epoch in range(1 + spec.epochs):
            if epoch == 1:  # the first epoch (compilation) is not in the timed numbers, nor in where time went
                before = stage_seconds(loader)
            n = 0
            start = time.perf_counter()
            for batch in loader:
                last = check_batch(batch, batch_size, num_features, spec.label)
                n += 1
            times.append(time.perf_counter() - start)
            if n != expected:
                raise BenchCheckError(f"{spec.label}: an epoch must have {expected} batches; got {n}")
        spent = per_batch_us(before, stage_seconds(loader), expected * spec.epochs)
        verify_epoch(loader, reference, batch_size, num_features, spec.label)
    finally:
        _close(loader)
        del loader
        gc.collect()
    if spec.make_in_order is not None and dataset is not None:
        in_order = spec.make_in_order()
        try:
            verify_in_order(in_order, dataset[0], dataset[1], batch_size, spec.label)
        finally:
            _close(in_order)
            del in_order
            gc.collect()
    if last is None:
        raise BenchCheckError(f"{spec.label}: produced no batch")
    x, y = last
    batch = {"x": [list(x.shape), _dtype_name(x.dtype)], "y": [[batch_size], _dtype_name(y.dtype)], "y_shape_as_yielded": list(y.shape)}
    return SystemResult(
        spec.key, spec.label, spec.workers, construct_s, times[0], times[1:], expected * batch_size, batch, per_batch_us=spent
    )


def stoker_loader(path: Path, batch_size: int, num_workers: int, seed: int, shuffle: bool = True, as_written: bool = False) -> Any:
    """The stoker ``Loader`` on the Otto file: random order (or file order), ``drop_last=True``.

    ``as_written``: seed 000's pipelines exactly as its notebook writes them (``ToDevice("cpu")`` on both fields,
    ``Squeeze()`` on the labels, as FFCV users write them); else the default pipelines (decoder, ``ToTensor()``).
    """
    from stoker.loader import Loader, OrderOption

    order = OrderOption.RANDOM if shuffle else OrderOption.SEQUENTIAL
    pipelines = None
    if as_written:
        from stoker.fields.decoders import IntDecoder, NDArrayDecoder
        from stoker.transforms import Squeeze, ToDevice, ToTensor

        pipelines = {
            "x": [NDArrayDecoder(), ToTensor(), ToDevice("cpu")],
            "y": [IntDecoder(), ToTensor(), ToDevice("cpu"), Squeeze()],
        }
    return Loader(str(path), batch_size=batch_size, num_workers=num_workers, order=order, seed=seed, drop_last=True, pipelines=pipelines)


def loading_specs(
    path: Path, X: np.ndarray, y: np.ndarray, batch_size: int, stoker_workers: list[int], epochs: int, slow_epochs: int, seed: int
) -> list[SystemSpec]:
    """The systems of the loader-only comparison: DataLoader, the two limits, then stoker.

    The DataLoader systems fork worker processes, so run them before stoker
    has started threads in this process (``key.startswith("stoker")`` tells
    them apart).
    """

    def spec(key: str, label: str, workers: int, make: Callable[..., Any], n_epochs: int) -> SystemSpec:
        return SystemSpec(key, label, workers, partial(make, shuffle=True), n_epochs, partial(make, shuffle=False))

    def plural(nw: int) -> str:
        return f"{nw} worker{'s' if nw != 1 else ''}"

    specs = []
    for nw in (0, 2):
        make = partial(dataloader_per_item, X, y, batch_size, nw, seed)
        specs.append(spec(f"torch_getitem_w{nw}", f"DataLoader, __getitem__ per sample ({plural(nw)})", nw, make, slow_epochs))
    for nw in (0, 2):
        make = partial(dataloader_batched, X, y, batch_size, nw, seed)
        specs.append(spec(f"torch_getitems_w{nw}", f"DataLoader, batched __getitems__ ({plural(nw)})", nw, make, epochs))
    specs.append(
        spec("numpy_take", "numpy take into a reused buffer, 1 thread (limit)", 1, partial(NumpyTake, X, y, batch_size, seed), epochs)
    )
    specs.append(
        spec(
            "compiled_gather",
            "compiled gather (Numba) into a reused buffer, 1 thread (limit)",
            1,
            partial(CompiledGather, X, y, batch_size, seed),
            epochs,
        )
    )
    for nw in stoker_workers:
        specs.append(spec(f"stoker_w{nw}", f"stoker Loader ({plural(nw)})", nw, partial(stoker_loader, path, batch_size, nw, seed), epochs))
    for nw in stoker_workers:  # the pipeline users write (seed 000's notebook, FFCV's label pipeline)
        make = partial(stoker_loader, path, batch_size, nw, seed, as_written=True)
        specs.append(
            spec(f"stoker_seed000_w{nw}", f"stoker Loader, seed 000's pipelines: ToDevice, Squeeze ({plural(nw)})", nw, make, epochs)
        )
    return specs


def compare_loading(
    specs: list[SystemSpec],
    reference: np.ndarray,
    batch_size: int,
    num_features: int,
    log: Callable[[str], None],
    dataset: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, SystemResult]:
    """Run every system in order (see :func:`run_system`).

    Returns:
        Results by key, in the order of ``specs``.

    Raises:
        BenchCheckError: a system failed its checks (nothing is returned).
    """
    results = {}
    for s in specs:
        log(f"loading: {s.label} ...")
        results[s.key] = run_system(s, reference, batch_size, num_features, dataset)
    return results


def add_ratios(results: dict[str, SystemResult], limit_key: str = "numpy_take", compiled_key: str = "compiled_gather") -> None:
    """Set each result's ``ratio_to_limit`` and ``ratio_to_compiled``: its median samples/s over those of the two limits."""
    limit = results[limit_key].samples_per_s
    compiled = results[compiled_key].samples_per_s if compiled_key in results else float("nan")
    for r in results.values():
        r.ratio_to_limit = r.samples_per_s / limit
        r.ratio_to_compiled = r.samples_per_s / compiled
