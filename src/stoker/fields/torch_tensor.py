"""Fixed-shape torch tensors: :class:`TorchTensorField` (FFCV's ``ffcv.fields.ndarray.TorchTensorField``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.fields.ndarray import NDArrayField


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a torch dtype (``torch.float32`` -> ``float32``); numpy dtypes pass through.

    Raises:
        TypeError: a torch dtype that numpy has no equivalent for (``torch.bfloat16``).
    """
    if type(dtype).__module__ != "torch":
        return np.dtype(dtype)
    import torch

    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError as error:
        raise TypeError(f"TorchTensorField: {dtype} has no numpy equivalent; convert the tensors to a numpy-compatible dtype") from error


class TorchTensorField(NDArrayField):
    """A torch tensor of one fixed shape and dtype per sample, stored as an :class:`NDArrayField`.

    ``TorchTensorField(torch.float32, (3, 4))`` as in FFCV: the torch dtype
    becomes its numpy twin, and tensors are written as arrays (moved to the
    CPU). The file holds an ``NDArrayField``: reading gives numpy arrays
    (``NDArrayDecoder``), and ``ToTensor`` turns the batch into a tensor.

    Args:
        dtype: a torch dtype (or a numpy one).
        shape: the shape of every tensor.

    Raises:
        TypeError: a torch dtype without a numpy equivalent.
        ValueError: as :class:`NDArrayField`.
    """

    def __init__(self, dtype: Any, shape: tuple[int, ...] | int) -> None:
        super().__init__(shape, numpy_dtype(dtype))
