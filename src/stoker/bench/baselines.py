"""What stoker is compared with: ``torch.utils.data.DataLoader`` two ways, and two one-thread limits.

Each factory returns an object that is iterated once per epoch and yields
``(x, y)`` batches. Each takes ``shuffle``: ``True`` for the timed runs
(random order), ``False`` for the check that batches hold the dataset's rows
in file order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.bench.data import BatchedOttoDataset, OttoDataset, collate_arrays

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


def dataloader_per_item(X: np.ndarray, y: np.ndarray, batch_size: int, num_workers: int, seed: int, shuffle: bool = True) -> Any:
    """The notebook's baseline: ``DataLoader`` over ``OttoDataset``, one ``__getitem__`` per sample.

    ``drop_last=True``, default collate; workers are persistent so that
    starting them is not counted in every epoch.
    """
    import torch
    from torch.utils.data import DataLoader

    dataset: Any = OttoDataset(X, y)  # the notebook's plain class, not a torch Dataset subclass
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


def dataloader_batched(X: np.ndarray, y: np.ndarray, batch_size: int, num_workers: int, seed: int, shuffle: bool = True) -> Any:
    """``DataLoader`` over a dataset with ``__getitems__``: one fancy-indexing gather per batch.

    The trick of "The fast train loops" (Nasy, 2024): the sampler still draws
    indices, but the dataset answers the whole batch at once and the
    ``collate_fn`` only wraps the arrays as tensors.
    """
    import torch
    from torch.utils.data import DataLoader

    dataset: Any = BatchedOttoDataset(X, y)
    collate: Any = collate_arrays  # receives what __getitems__ returned, not a list of samples
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(seed),
    )


@numba.njit(nogil=True, cache=True)
def gather_rows(X: np.ndarray, y: np.ndarray, idx: np.ndarray, out_x: np.ndarray, out_y: np.ndarray) -> None:
    """``out_x[i, :] = X[idx[i], :]`` and ``out_y[i] = y[idx[i]]``: a plain loop over rows and columns, one thread."""
    n, k = out_x.shape
    for i in range(n):
        r = idx[i]
        for j in range(k):
            out_x[i, j] = X[r, j]
        out_y[i] = y[r]


class NumpyTake:
    """The numpy limit: ``np.take`` of each batch into one reused buffer, one thread.

    Every epoch draws a fresh permutation and gathers rows and labels with
    ``np.take(..., out=buffer)``. Like the stoker loader's batches, a batch is
    valid until the next one is produced.

    Args:
        X: ``(n, k)`` features.
        y: ``(n,)`` labels.
        batch_size: rows per batch; the last partial batch is dropped.
        seed: seeds the permutations.
        shuffle: ``False`` gathers the rows in file order.
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.X = np.ascontiguousarray(X)
        self.y = np.ascontiguousarray(y)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.x_buf = np.empty((batch_size, *self.X.shape[1:]), dtype=self.X.dtype)
        self.y_buf = np.empty(batch_size, dtype=self.y.dtype)

    def __len__(self) -> int:
        return len(self.X) // self.batch_size

    def gather(self, idx: np.ndarray) -> None:
        """Fill the buffers with rows ``idx``."""
        np.take(self.X, idx, axis=0, out=self.x_buf)
        np.take(self.y, idx, axis=0, out=self.y_buf)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        perm = self.rng.permutation(len(self.X)) if self.shuffle else np.arange(len(self.X))
        bs = self.batch_size
        for b in range(len(self)):
            self.gather(perm[b * bs : (b + 1) * bs])
            yield self.x_buf, self.y_buf


class CompiledGather(NumpyTake):
    """The compiled limit: :func:`gather_rows` (Numba, ``nogil``) into one reused buffer, one thread.

    The same permutations and buffers as :class:`NumpyTake`; only the gather
    differs. It is the copy stoker's loader does, without a file, threads or
    queues around it.
    """

    def gather(self, idx: np.ndarray) -> None:
        gather_rows(self.X, self.y, idx, self.x_buf, self.y_buf)
