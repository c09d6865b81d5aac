"""Operations that turn a batch into torch tensors and reshape them (run in Python, once per batch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


class ToTensor(Operation):
    """Turns the numpy batch into a torch tensor sharing its memory (no copy)."""

    reentrant = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        import torch

        return replace(previous_state, jit_mode=False, device=torch.device("cpu"), dtype=_torch_dtype(previous_state.dtype)), None

    def generate_code(self) -> Callable[..., Any]:
        import torch

        def to_tensor(batch: Any, dst: Any) -> Any:
            return torch.from_numpy(batch) if isinstance(batch, np.ndarray) else batch

        return to_tensor


class ToTorchImage(Operation):
    """Turns an image batch into NCHW: a view of NHWC memory (channels-last, as FFCV), or the batch itself.

    Reads the layout of the state, never the shape: HWC samples (from the
    image decoders) become an NCHW view, ``batch.permute(0, 3, 1, 2)``, whose
    memory stays channels-last; CHW samples (after ``NormalizeImage``) pass
    through, so FFCV's ``[..., NormalizeImage(...), ToTensor(), ToTorchImage()]``
    gives the NCHW batch too. Place it after ``ToTensor``; the state's layout
    becomes CHW.

    Args:
        channels_last: keep the memory as it is (for HWC samples: a free,
            channels-last view); ``False`` makes the batch contiguous NCHW
            (a copy for HWC samples).
        convert_back_int16: accepted for FFCV compatibility (no effect).

    Raises:
        ValueError: at build time, a numpy batch (before ``ToTensor``), or
            samples that are not images of a known layout.
    """

    reentrant = True

    def __init__(self, channels_last: bool = True, convert_back_int16: bool = True) -> None:
        self.channels_last = channels_last
        self._permute = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if previous_state.jit_mode:
            raise ValueError("ToTorchImage works on torch tensors: place it after ToTensor")
        h, w, c = previous_state.image_size(self)
        self._permute = previous_state.layout == "HWC"
        return replace(previous_state, shape=(c, h, w), layout="CHW"), None

    def generate_code(self) -> Callable[..., Any]:
        channels_last = self.channels_last
        if not self._permute:

            def already_chw(batch: Any, dst: Any) -> Any:
                return batch if channels_last else batch.contiguous()

            return already_chw

        def to_torch_image(batch: Any, dst: Any) -> Any:
            out = batch.permute(0, 3, 1, 2)
            return out if channels_last else out.contiguous()

        return to_torch_image

    def __repr__(self) -> str:
        return f"ToTorchImage(channels_last={self.channels_last})"


class Squeeze(Operation):
    """``tensor.squeeze(*dims)``; without dims, squeezes every dimension of size 1 but the batch."""

    reentrant = True

    def __init__(self, *dims: int) -> None:
        self.dims = dims

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        shape = previous_state.shape
        if self.dims:
            drop = {d - 1 if d > 0 else len(shape) + d for d in self.dims}
            new = tuple(s for i, s in enumerate(shape) if not (i in drop and s == 1))
        else:
            new = tuple(s for s in shape if s != 1)
        return replace(previous_state, shape=new), None

    def generate_code(self) -> Callable[..., Any]:
        dims = self.dims

        def squeeze(batch: Any, dst: Any) -> Any:
            if dims:
                return batch.squeeze(dims)
            keep = [batch.shape[0]] + [s for s in batch.shape[1:] if s != 1]
            return batch.reshape(keep)

        return squeeze


class View(Operation):
    """``tensor.view(dtype)``: reinterpret the bytes as another dtype of the same size."""

    reentrant = True

    def __init__(self, target_dtype: Any) -> None:
        self.target_dtype = target_dtype

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return replace(previous_state, dtype=self.target_dtype), None

    def generate_code(self) -> Callable[..., Any]:
        target = self.target_dtype

        def view(batch: Any, dst: Any) -> Any:
            if isinstance(batch, np.ndarray):
                return batch.view(target)
            return batch.view(_torch_dtype(target))

        return view


class Convert(Operation):
    """``tensor.to(dtype)`` (or ``array.astype``): convert the batch to another dtype."""

    reentrant = True

    def __init__(self, target_dtype: Any) -> None:
        self.target_dtype = target_dtype

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        return replace(previous_state, dtype=self.target_dtype), None

    def generate_code(self) -> Callable[..., Any]:
        target = self.target_dtype

        def convert(batch: Any, dst: Any) -> Any:
            if isinstance(batch, np.ndarray):
                return batch.astype(target)
            return batch.to(_torch_dtype(target))

        return convert
