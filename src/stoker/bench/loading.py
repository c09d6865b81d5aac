"""Loader-only comparison: epochs of each system side by side, each checked before it counts.

A system is timed over ``1 + epochs`` epochs; the first (stoker: compilation;
DataLoader: starting workers) is reported apart, the median of the others is
the system's number. Every batch of every epoch is checked for shape and
dtype, and one extra, untimed epoch is checked sample by sample: the multiset
of (row, label) fingerprints must be drawn from the dataset without
repetition, cover ``(n // batch_size) * batch_size`` samples and not come in
file order. A system that fails raises :class:`BenchCheckError`, so a fast but
broken loader never reports a number.
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

from stoker.bench.baselines import NumpyTake, dataloader_batched, dataloader_per_item
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
        make: builds the iterable (iterated once per epoch).
        epochs: timed epochs after the first.
    """

    key: str
    label: str
    workers: int
    make: Callable[[], Any]
    epochs: int


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
            "batch": self.batch,
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


def verify_epoch(loader: Any, reference: np.ndarray, batch_size: int, num_features: int, who: str) -> None:
    """Run one epoch and check its samples against the dataset's fingerprints.

    Args:
        loader: the system (one iteration = one epoch).
        reference: :func:`~stoker.bench.data.fingerprints` of the whole dataset.
        batch_size: rows per batch.
        num_features: columns of x.
        who: the system's name, for the message.

    Raises:
        BenchCheckError: a sample not in the dataset (or with the wrong label),
            a sample seen more often than the dataset holds it, the wrong
            number of samples, or batches in file order.
    """
    seen = []
    for batch in loader:
        x, y = check_batch(batch, batch_size, num_features, who)
        seen.append(fingerprints(_to_numpy(x), _to_numpy(y).reshape(-1)))
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


def run_system(spec: SystemSpec, reference: np.ndarray, batch_size: int, num_features: int) -> SystemResult:
    """Time ``1 + spec.epochs`` epochs of a system, then verify one more epoch.

    Raises:
        BenchCheckError: see :func:`check_batch` and :func:`verify_epoch`;
            also a wrong number of batches in an epoch.
    """
    expected = len(reference) // batch_size
    start = time.perf_counter()
    loader = spec.make()
    construct_s = time.perf_counter() - start
    times = []
    last: tuple[Any, Any] | None = None
    try:
        for _ in range(1 + spec.epochs):
            n = 0
            start = time.perf_counter()
            for batch in loader:
                last = check_batch(batch, batch_size, num_features, spec.label)
                n += 1
            times.append(time.perf_counter() - start)
            if n != expected:
                raise BenchCheckError(f"{spec.label}: an epoch must have {expected} batches; got {n}")
        verify_epoch(loader, reference, batch_size, num_features, spec.label)
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        del loader
        gc.collect()
    if last is None:
        raise BenchCheckError(f"{spec.label}: produced no batch")
    x, y = last
    batch = {"x": [list(x.shape), _dtype_name(x.dtype)], "y": [[batch_size], _dtype_name(y.dtype)], "y_shape_as_yielded": list(y.shape)}
    return SystemResult(spec.key, spec.label, spec.workers, construct_s, times[0], times[1:], expected * batch_size, batch)


def stoker_loader(path: Path, batch_size: int, num_workers: int, seed: int) -> Any:
    """The stoker ``Loader`` on the Otto file: random order, ``drop_last=True``, default pipelines."""
    from stoker.loader import Loader, OrderOption

    return Loader(str(path), batch_size=batch_size, num_workers=num_workers, order=OrderOption.RANDOM, seed=seed, drop_last=True)


def loading_specs(
    path: Path, X: np.ndarray, y: np.ndarray, batch_size: int, stoker_workers: list[int], epochs: int, slow_epochs: int, seed: int
) -> list[SystemSpec]:
    """The systems of the loader-only comparison: DataLoader, numpy limit, then stoker.

    The DataLoader systems fork worker processes, so run them before stoker
    has started threads in this process (``key.startswith("stoker")`` tells
    them apart).
    """
    specs = []
    for nw in (0, 2):
        s = "s" if nw != 1 else ""
        specs.append(
            SystemSpec(
                f"torch_getitem_w{nw}",
                f"DataLoader, __getitem__ per sample ({nw} worker{s})",
                nw,
                partial(dataloader_per_item, X, y, batch_size, nw, seed),
                slow_epochs,
            )
        )
    for nw in (0, 2):
        s = "s" if nw != 1 else ""
        specs.append(
            SystemSpec(
                f"torch_getitems_w{nw}",
                f"DataLoader, batched __getitems__ ({nw} worker{s})",
                nw,
                partial(dataloader_batched, X, y, batch_size, nw, seed),
                epochs,
            )
        )
    specs.append(
        SystemSpec("numpy_take", "numpy take into a reused buffer, 1 thread (limit)", 1, partial(NumpyTake, X, y, batch_size, seed), epochs)
    )
    for nw in stoker_workers:
        s = "s" if nw != 1 else ""
        specs.append(
            SystemSpec(f"stoker_w{nw}", f"stoker Loader ({nw} worker{s})", nw, partial(stoker_loader, path, batch_size, nw, seed), epochs)
        )
    return specs


def compare_loading(
    specs: list[SystemSpec], reference: np.ndarray, batch_size: int, num_features: int, log: Callable[[str], None]
) -> dict[str, SystemResult]:
    """Run every system in order.

    Returns:
        Results by key, in the order of ``specs``.

    Raises:
        BenchCheckError: a system failed its checks (nothing is returned).
    """
    results = {}
    for spec in specs:
        log(f"loading: {spec.label} ...")
        results[spec.key] = run_system(spec, reference, batch_size, num_features)
    return results


def add_ratios(results: dict[str, SystemResult], limit_key: str = "numpy_take") -> None:
    """Set each result's ``ratio_to_limit``: its median samples/s over that of ``limit_key``."""
    limit = results[limit_key].samples_per_s
    for r in results.values():
        r.ratio_to_limit = r.samples_per_s / limit
