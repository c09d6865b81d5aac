"""Relabelling of chosen samples: :class:`ReplaceLabel` (FFCV's ``ffcv.transforms.replace_label``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


def sorted_indices(op: Operation, indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """``indices`` as a sorted int64 array, for :func:`numpy.searchsorted` in a kernel.

    Raises:
        ValueError: ``indices`` is not a 1-d sequence of non-negative integers.
    """
    array = np.asarray(indices)
    name = type(op).__name__
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{name}: indices must be a 1-d sequence of sample indices (integers); got {array.dtype} of shape {array.shape}")
    if array.size and array.min() < 0:
        raise ValueError(f"{name}: indices must be >= 0 (indices of samples in the dataset); got {int(array.min())}")
    return np.sort(array.astype(np.int64))


@numba.njit(nogil=True, cache=True)
def contains(sorted_values, value):  # type: ignore[no-untyped-def]
    """Whether ``value`` is in the sorted array ``sorted_values``."""
    position = np.searchsorted(sorted_values, value)
    return position < sorted_values.shape[0] and sorted_values[position] == value


@numba.njit(nogil=True, parallel=True, cache=True)
def _replace_label_kernel(labels, indices, to_change, new_label):  # type: ignore[no-untyped-def]
    flat = labels.reshape(-1)  # a view of the C-contiguous batch
    per_sample = flat.shape[0] // max(labels.shape[0], 1)
    for i in numba.prange(labels.shape[0]):
        if contains(to_change, indices[i]):
            for j in range(i * per_sample, (i + 1) * per_sample):
                flat[j] = new_label
    return labels


class ReplaceLabel(Operation):
    """Sets the label of the samples whose dataset index is in ``indices`` to ``new_label`` (compiled, in place).

    Place it after ``IntDecoder`` (before ``ToTensor``): every value of a
    chosen sample becomes ``new_label``; the other samples are unchanged.

    Args:
        indices: the indices, in the dataset file, of the samples to relabel.
        new_label: the label they get.

    Raises:
        ValueError: ``indices`` not a 1-d sequence of non-negative integers;
            at build time, a batch that is not a numpy batch.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, indices: Sequence[int] | np.ndarray, new_label: int) -> None:
        self.indices = sorted_indices(self, indices)
        self.new_label = int(new_label)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if not previous_state.jit_mode:
            raise ValueError(
                f"ReplaceLabel is a compiled operation on numpy batches: place it before ToTensor; got a batch of {previous_state.dtype}"
            )
        return previous_state, None

    def generate_code(self) -> Callable[..., Any]:
        kernel = _replace_label_kernel if Compiler.is_enabled() else _replace_label_kernel.py_func
        to_change, new_label = self.indices, self.new_label

        def replace_label(batch: np.ndarray, dst: Any, indices: np.ndarray) -> np.ndarray:
            return kernel(batch, indices, to_change, new_label)  # type: ignore[no-any-return]

        return replace_label

    def __repr__(self) -> str:
        return f"ReplaceLabel(indices=<{self.indices.size} indices>, new_label={self.new_label})"
