"""Loader-only comparison: every system checked before it counts, then timed in alternating rounds.

A system is built and its first epoch timed (stoker: compilation; DataLoader:
starting workers), with its first batch timed from ``iter()`` as a user waits
for it. Then, before any number is kept, its values are checked:

* one untimed epoch in random order, sample by sample: the multiset of
  (row, label) fingerprints must be drawn from the dataset without repetition,
  cover ``(n // batch_size) * batch_size`` samples and not come in file order;
* a second instance of the same system in file order: its first batches must
  equal the dataset's rows and labels bit for bit, in the same order, so all
  systems are compared with the same arrays.

Then :func:`compare_loading_rounds` times every system in alternating rounds
(a few epochs of each per round, ``A B C ...`` then ``... C B A``) and each
ratio is taken within a round (see :mod:`stoker.bench.rounds`). Every batch
of every epoch is checked for shape and dtype. A system that fails raises
:class:`BenchCheckError`, so a fast but broken loader never reports a number.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from stoker.bench.baselines import CompiledGather, NumpyTake, dataloader_batched, dataloader_per_item
from stoker.bench.checks import (  # noqa: F401  (re-exported: the checks were defined here)
    BenchCheckError,
    _dtype_name,
    check_batch,
    check_epoch_fingerprints,
    verify_epoch,
    verify_in_order,
)
from stoker.bench.machine import thread_round_trip_us, thread_round_trips_us  # noqa: F401  (re-exported)
from stoker.bench.rounds import order, spread


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
        first_batch_s: the first epoch's first batch, from ``iter()`` [seconds].
        epoch_first_batch_s: each timed epoch's first batch, from ``iter()`` [seconds].
        rounds_epoch_s: the median timed epoch of each round [seconds].
        ratio_to_limit_rounds, ratio_to_compiled_rounds: the spread of the per-round ratios
            (:func:`stoker.bench.rounds.spread`).
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
    first_batch_s: float = float("nan")
    epoch_first_batch_s: list[float] = field(default_factory=list)
    rounds_epoch_s: list[float] = field(default_factory=list)
    ratio_to_limit_rounds: dict[str, Any] = field(default_factory=dict)
    ratio_to_compiled_rounds: dict[str, Any] = field(default_factory=dict)

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
            "first_batch_s": self.first_batch_s,
            "epoch_first_batch_median_s": statistics.median(self.epoch_first_batch_s) if self.epoch_first_batch_s else float("nan"),
            "rounds_epoch_s": self.rounds_epoch_s,
            "ratio_to_limit_rounds": self.ratio_to_limit_rounds,
            "ratio_to_compiled_rounds": self.ratio_to_compiled_rounds,
        }


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


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


@dataclass
class Prepared:
    """A system built, its first epoch timed and its values checked: ready to be timed (see :func:`prepare_system`).

    Attributes:
        spec: the system.
        loader: the running system (closed by :func:`finish_system`).
        construct_s, first_epoch_s, first_batch_s: as in :class:`SystemResult` [seconds].
        expected: batches per epoch.
        before: :func:`stage_seconds` when the timing started.
        epoch_s: every timed epoch [seconds].
        epoch_first_batch_s: every timed epoch's first batch, from ``iter()`` [seconds].
        rounds_epoch_s: the median timed epoch of each round [seconds].
        last: the last batch seen (its shapes and dtypes are reported).
        compile_s: a stoker loader's wait for its compiled code after the checks (``Loader.compile()``) [seconds].
    """

    spec: SystemSpec
    loader: Any
    construct_s: float
    first_epoch_s: float
    first_batch_s: float
    expected: int
    before: dict[str, float] | None = None
    epoch_s: list[float] = field(default_factory=list)
    epoch_first_batch_s: list[float] = field(default_factory=list)
    rounds_epoch_s: list[float] = field(default_factory=list)
    last: tuple[Any, Any] | None = None
    compile_s: float = 0.0


def _epoch(p: Prepared, batch_size: int, num_features: int) -> tuple[float, float]:
    """Run one epoch, every batch checked; ``(epoch seconds, first batch seconds from iter())``."""
    n = 0
    first = float("nan")
    start = time.perf_counter()
    for batch in p.loader:  # (iter() first: a DataLoader's workers, stoker's producers start there)
        if n == 0:
            first = time.perf_counter() - start
        p.last = check_batch(batch, batch_size, num_features, p.spec.label)
        n += 1
    seconds = time.perf_counter() - start
    if n != p.expected:
        raise BenchCheckError(f"{p.spec.label}: an epoch must have {p.expected} batches; got {n}")
    return seconds, first


def prepare_system(
    spec: SystemSpec, reference: np.ndarray, batch_size: int, num_features: int, dataset: tuple[np.ndarray, np.ndarray] | None = None
) -> Prepared:
    """Build a system, time its first epoch, then check its values (an untimed epoch in random order, and a second
    instance in file order when ``spec.make_in_order`` and ``dataset`` are given).

    A stoker loader then waits for its compiled code (``Loader.compile()``): on a fresh install its producer loop
    compiles in the background while Python producers make the batches, and the rounds compare compiled epochs (a
    fresh clone's ``make bench`` timed its first four rounds at 8-12 ms an epoch against 3 ms after, and called
    stoker 0.83x the gather with quartiles 0.30x-0.96x). The time to the first batch of a fresh process is measured
    apart (:func:`~stoker.bench.startup.time_to_first_batch`).

    Raises:
        BenchCheckError: see :func:`check_batch`, :func:`verify_epoch` and
            :func:`verify_in_order`; also a wrong number of batches in an epoch.
    """
    start = time.perf_counter()
    loader = spec.make()
    p = Prepared(spec, loader, time.perf_counter() - start, 0.0, 0.0, len(reference) // batch_size)
    try:
        p.first_epoch_s, p.first_batch_s = _epoch(p, batch_size, num_features)
        verify_epoch(loader, reference, batch_size, num_features, spec.label)
        if spec.make_in_order is not None and dataset is not None:
            in_order = spec.make_in_order()
            try:
                verify_in_order(in_order, dataset[0], dataset[1], batch_size, spec.label)
            finally:
                _close(in_order)
                del in_order
                gc.collect()
        if spec.key.startswith("stoker"):
            p.compile_s = loader.compile()
        p.before = stage_seconds(loader)  # (the first epoch, the checks and the compile are not in where the time went)
    except BaseException:
        _close(loader)
        raise
    return p


def time_epochs(p: Prepared, epochs: int, batch_size: int, num_features: int) -> list[float]:
    """Time ``epochs`` epochs of a prepared system; returns their seconds (also kept in ``p``)."""
    times = []
    for _ in range(epochs):
        seconds, first = _epoch(p, batch_size, num_features)
        times.append(seconds)
        p.epoch_first_batch_s.append(first)
    p.epoch_s.extend(times)
    return times


def finish_system(p: Prepared, batch_size: int) -> SystemResult:
    """Close a timed system and make its result."""
    try:
        spent = per_batch_us(p.before, stage_seconds(p.loader), p.expected * len(p.epoch_s))
    finally:
        _close(p.loader)
        p.loader = None
        gc.collect()
    if p.last is None:
        raise BenchCheckError(f"{p.spec.label}: produced no batch")
    if not p.epoch_s:
        raise BenchCheckError(f"{p.spec.label}: no epoch was timed")
    x, y = p.last
    batch = {"x": [list(x.shape), _dtype_name(x.dtype)], "y": [[batch_size], _dtype_name(y.dtype)], "y_shape_as_yielded": list(y.shape)}
    spec = p.spec
    return SystemResult(
        spec.key,
        spec.label,
        spec.workers,
        p.construct_s,
        p.first_epoch_s,
        list(p.epoch_s),
        p.expected * batch_size,
        batch,
        per_batch_us=spent,
        first_batch_s=p.first_batch_s,
        epoch_first_batch_s=list(p.epoch_first_batch_s),
        rounds_epoch_s=list(p.rounds_epoch_s) or [statistics.median(p.epoch_s)],
    )


def run_system(
    spec: SystemSpec, reference: np.ndarray, batch_size: int, num_features: int, dataset: tuple[np.ndarray, np.ndarray] | None = None
) -> SystemResult:
    """One system alone: :func:`prepare_system`, ``spec.epochs`` timed epochs, :func:`finish_system`.

    Raises:
        BenchCheckError: see :func:`prepare_system`.
    """
    p = prepare_system(spec, reference, batch_size, num_features, dataset)
    try:
        time_epochs(p, spec.epochs, batch_size, num_features)
    except BaseException:
        _close(p.loader)
        raise
    return finish_system(p, batch_size)


def stoker_loader(path: Path, batch_size: int, num_workers: int, seed: int, shuffle: bool = True, as_written: bool = False) -> Any:
    """The stoker ``Loader`` on the Otto file: random order (or file order), ``drop_last=True``.

    ``as_written``: seed 000's pipelines exactly as its notebook writes them (``ToDevice("cpu")`` on both fields,
    ``Squeeze()`` on the labels, as FFCV users write them); else the default pipelines (decoder, ``ToTensor()``).
    """
    from stoker.loader import Loader, OrderOption

    order = OrderOption.RANDOM if shuffle else OrderOption.SEQUENTIAL
    pipelines = None
    if as_written:
        from stoker.decoders import IntDecoder, NDArrayDecoder
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
    """Run every system alone, one after the other (see :func:`run_system`; the main job uses
    :func:`compare_loading_rounds`).

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


def compare_loading_rounds(
    prepared: dict[str, Prepared],
    rounds: int,
    batch_size: int,
    num_features: int,
    log: Callable[[str], None] = lambda s: None,
    after_round: Callable[[int], Any] | None = None,
) -> tuple[dict[str, SystemResult], list[Any]]:
    """Time prepared systems in alternating rounds, then close them.

    Each round runs ``max(1, spec.epochs // rounds)`` epochs of each system, in the order of ``prepared`` in even
    rounds and the reverse in odd ones. ``after_round(r)`` is called at the end of each round (the load monitor's
    window); its results are returned with the systems' results.

    Raises:
        BenchCheckError: a batch of the wrong shape or dtype (every system is closed).
    """
    keys = list(prepared)
    marks = []
    try:
        for r in range(rounds):
            for key in order(keys, r):
                p = prepared[key]
                p.rounds_epoch_s.append(statistics.median(time_epochs(p, max(1, p.spec.epochs // rounds), batch_size, num_features)))
            if after_round is not None:
                marks.append(after_round(r))
            log(f"loading: round {r + 1}/{rounds} done")
        return {key: finish_system(prepared[key], batch_size) for key in keys}, marks
    finally:
        for p in prepared.values():
            if p.loader is not None:
                _close(p.loader)
                p.loader = None


def speed_ratio_rounds(a: SystemResult, b: SystemResult) -> dict[str, Any]:
    """The spread of ``a``'s speed over ``b``'s, round by round (``b``'s median epoch over ``a``'s, same samples)."""
    return spread([tb / ta for ta, tb in zip(a.rounds_epoch_s, b.rounds_epoch_s, strict=True)])


def add_ratios(results: dict[str, SystemResult], limit_key: str = "numpy_take", compiled_key: str = "compiled_gather") -> None:
    """Set each result's ratios to the two limits: the median of the per-round ratios of its speed over the limit's
    (``ratio_to_limit``, ``ratio_to_compiled``) and their spread (``*_rounds``)."""
    limit = results[limit_key]
    compiled = results.get(compiled_key)
    for r in results.values():
        r.ratio_to_limit_rounds = speed_ratio_rounds(r, limit)
        r.ratio_to_limit = r.ratio_to_limit_rounds["median"]
        if compiled is not None:
            r.ratio_to_compiled_rounds = speed_ratio_rounds(r, compiled)
            r.ratio_to_compiled = r.ratio_to_compiled_rounds["median"]
