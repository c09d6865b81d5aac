"""The Otto-shaped table, the notebook's dataset class, the stoker file, and batch fingerprints.

The Otto Group product classification table has 61,878 rows of 93 small
integer counts (mostly zeros) and 9 unbalanced classes. :func:`make_otto_arrays`
draws a table of the same shape and sparsity from a seeded negative binomial,
so the benchmark needs no download.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoker._threads import available_cpus

#: rows and columns of the Otto training table
OTTO_SAMPLES = 61_878
OTTO_FEATURES = 93
OTTO_CLASSES = 9
#: class frequencies of the Otto training table (Class_1 .. Class_9)
_CLASS_FREQ = np.array([0.031, 0.261, 0.129, 0.044, 0.044, 0.228, 0.046, 0.137, 0.080])


def make_otto_arrays(num_samples: int = OTTO_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Draw an Otto-shaped table: ``(X, y)``.

    Args:
        num_samples: rows to draw (Otto has 61,878).
        seed: the random seed; the same seed gives the same table.

    Returns:
        ``X``: ``(num_samples, 93)`` float32 counts, about 79% zeros, each class
        with its own per-feature mean; ``y``: ``(num_samples,)`` int64 labels in
        ``0..8`` with Otto's class frequencies.

    Raises:
        ValueError: ``num_samples`` < 1.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples}")
    rng = np.random.default_rng(seed)
    y = rng.choice(OTTO_CLASSES, size=num_samples, p=_CLASS_FREQ / _CLASS_FREQ.sum()).astype(np.int64)
    means = rng.gamma(0.5, 1.2, size=(OTTO_CLASSES, OTTO_FEATURES))
    dispersion = 0.4
    X = rng.negative_binomial(dispersion, dispersion / (dispersion + means[y])).astype(np.float32)
    return X, y


class OttoDataset:
    """The notebook's ``OttoDataset``, over arrays instead of ``np.load``.

    ``__getitem__`` is the notebook's, line for line: one sample, a float32
    copy of the row and the label.

    Args:
        X: ``(n, 93)`` features.
        y: ``(n,)`` labels.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
        self.X = X
        self.y = y

    def __getitem__(self, idx: Any) -> tuple[np.ndarray, Any]:
        return (self.X[idx].astype("float32"), self.y[idx])

    def __len__(self) -> int:
        return len(self.X)


class BatchedOttoDataset(OttoDataset):
    """``OttoDataset`` plus ``__getitems__``: the whole batch in one fancy-indexing call.

    ``torch.utils.data.DataLoader`` calls ``__getitems__(indices)`` once per
    batch when the dataset has it, instead of ``__getitem__`` per sample; use
    it with :func:`collate_arrays`.
    """

    def __getitems__(self, idxs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self[np.asarray(idxs, dtype=np.int64)]


def collate_arrays(batch: tuple[np.ndarray, np.ndarray]) -> tuple[Any, Any]:
    """``collate_fn`` for :class:`BatchedOttoDataset`: wrap the two arrays as tensors (no copy)."""
    import torch

    x, y = batch
    return torch.from_numpy(x), torch.from_numpy(y)


@dataclass(frozen=True)
class OttoFile:
    """The Otto table as a stoker file.

    Attributes:
        path: the stoker file.
        X: the features, in memory.
        y: the labels, in memory.
        reused: the file was already there with the same content.
        write_s: time to write it [seconds] (0 when reused).
        file_bytes: its size [bytes].
    """

    path: Path
    X: np.ndarray
    y: np.ndarray
    reused: bool
    write_s: float
    file_bytes: int


def _matches(path: Path, X: np.ndarray, y: np.ndarray) -> bool:
    from stoker.errors import DatasetFormatError
    from stoker.fields import IntField, NDArrayField
    from stoker.format.reader import Reader

    try:
        with Reader(path) as reader:
            expected = {"x": NDArrayField(shape=(X.shape[1],), dtype=np.dtype("float32")), "y": IntField()}
            if reader.fields != expected or len(reader) != len(X):
                return False
            return bool(np.array_equal(reader.column("x"), X) and np.array_equal(reader.metadata["y/value"], y))
    except DatasetFormatError:
        return False


def write_otto(out: Path, num_samples: int = OTTO_SAMPLES, seed: int = 0) -> OttoFile:
    """Draw the table and write it with ``DatasetWriter`` as the notebook does, unless already there.

    The file ``otto-<num_samples>-<seed>.stoker`` in ``out`` is reused when it
    holds exactly this table.

    Args:
        out: the folder for the file (created if missing).
        num_samples: rows (see :func:`make_otto_arrays`).
        seed: the table's seed.

    Returns:
        The file and the arrays it holds.
    """
    from stoker.fields import IntField, NDArrayField
    from stoker.writer import DatasetWriter

    out.mkdir(parents=True, exist_ok=True)
    X, y = make_otto_arrays(num_samples, seed)
    path = out / f"otto-{num_samples}-{seed}.stoker"
    if path.exists() and _matches(path, X, y):
        return OttoFile(path, X, y, reused=True, write_s=0.0, file_bytes=path.stat().st_size)
    dataset = OttoDataset(X, y)
    start = time.perf_counter()
    writer = DatasetWriter(
        path,
        {"x": NDArrayField(shape=(OTTO_FEATURES,), dtype=np.dtype("float32")), "y": IntField()},
        num_workers=min(16, available_cpus()),
        progress=False,
    )
    writer.from_indexed_dataset(dataset)
    return OttoFile(path, X, y, reused=False, write_s=time.perf_counter() - start, file_bytes=path.stat().st_size)


def fingerprints(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """One 64-bit fingerprint per sample of its exact float32 bits and its label.

    Args:
        x: ``(m, k)`` float32 rows.
        y: ``(m,)`` integer labels.

    Returns:
        ``(m,)`` uint64; equal rows with equal labels give equal fingerprints,
        different ones differ except with negligible probability.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=x.shape[1] + 1, dtype=np.uint64) | np.uint64(1)
    bits = x.view(np.uint32).astype(np.uint64)
    h = (bits * mult[:-1]).sum(axis=1, dtype=np.uint64)
    h += np.asarray(y, dtype=np.int64).reshape(-1).astype(np.uint64) * mult[-1]
    h ^= h >> np.uint64(29)
    return h
