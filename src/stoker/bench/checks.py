"""The checks every system of the Otto benchmark must pass before any of its times counts.

Shape and dtype of every batch (:func:`check_batch`); one epoch's samples against
the dataset's fingerprints (:func:`check_epoch_fingerprints`, :func:`verify_epoch`);
the first batches in file order against the dataset's rows, bit for bit
(:func:`verify_in_order`). A failure raises :class:`BenchCheckError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.bench.data import fingerprints


class BenchCheckError(RuntimeError):
    """A system produced batches of the wrong shape, dtype or content."""


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
