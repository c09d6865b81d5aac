"""Operations that turn a batch into torch tensors and reshape them (run in Python, once per batch; ToTorchImage's copy is compiled)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.compiler import Compiler
from stoker.pipeline.operation import Operation
from stoker.pipeline.state import State

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


def _is_torch(dtype: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


class ToTensor(Operation):
    """Turns the numpy batch into a torch tensor sharing its memory (no copy)."""

    reentrant = True
    view_only = True  # (torch.from_numpy: the tensor is the batch's memory)
    #: wraps the batch's memory as it is: the operation after it may do its work before it (``compiled_form``)
    tensor_view = True

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        import torch

        return replace(previous_state, jit_mode=False, device=torch.device("cpu"), dtype=_torch_dtype(previous_state.dtype)), None

    def generate_code(self) -> Callable[..., Any]:
        import torch

        def to_tensor(batch: Any, dst: Any) -> Any:
            return torch.from_numpy(batch) if isinstance(batch, np.ndarray) else batch

        return to_tensor


@numba.njit(nogil=True, parallel=True, cache=True)
def hwc_to_chw(src, dst):  # type: ignore[no-untyped-def]
    """Copy ``src`` (n, h, w, c), C-contiguous, into ``dst`` (n, c, h, w), C-contiguous; returns ``dst``.

    Each image is a de-interleave of its ``h * w`` pixels into ``c`` planes: one
    sequential read and ``c`` sequential writes. Unsigned indices and the literal
    stride of the RGB case let LLVM vectorise it (byte shuffles); images run in
    parallel.
    """
    n, h, w, c = src.shape
    hw = numba.uint64(h * w)
    cu = numba.uint64(c)
    size = hw * cu
    s = src.reshape(-1)  # flattened once per batch: a reshape per image costs a call into Numba's runtime
    d = dst.reshape(-1)
    for i in numba.prange(n):
        start = numba.uint64(i) * size
        if c == 3:
            p0 = start
            p1 = start + hw
            p2 = start + numba.uint64(2) * hw
            for p in range(hw):
                q = start + numba.uint64(3) * p
                d[p0 + p] = s[q]
                d[p1 + p] = s[q + numba.uint64(1)]
                d[p2 + p] = s[q + numba.uint64(2)]
        else:
            for p in range(hw):
                for k in range(cu):
                    d[start + k * hw + p] = s[start + p * cu + k]
    return dst


@numba.njit(nogil=True, cache=True)
def hwc_to_chw_one(image, out):  # type: ignore[no-untyped-def]
    """One image: ``out[k, p] = image[p, k]`` (HWC -> CHW, both C-contiguous); returns ``out``."""
    h, w, c = image.shape
    hw = numba.uint64(h * w)
    cu = numba.uint64(c)
    s = image.reshape(-1)
    d = out.reshape(-1)
    if c == 3:
        for p in range(hw):
            q = numba.uint64(3) * p
            d[p] = s[q]
            d[hw + p] = s[q + numba.uint64(1)]
            d[numba.uint64(2) * hw + p] = s[q + numba.uint64(2)]
    else:
        for p in range(hw):
            for k in range(cu):
                d[k * hw + p] = s[p * cu + k]
    return out


@numba.njit(nogil=True, parallel=True, cache=True)
def _hwc_to_chw_batch(src, dst):  # type: ignore[no-untyped-def]
    """:func:`hwc_to_chw_one` for each image of the batch."""
    for i in numba.prange(src.shape[0]):
        hwc_to_chw_one(src[i], dst[i])
    return dst


class ToCHW(Operation):
    """HWC -> CHW of a numpy image batch, compiled, in the producers: ``ToTorchImage(channels_last=False)``'s copy.

    Not for use in a pipeline directly: the loader puts it before a ``ToTensor()`` that a
    ``ToTorchImage(channels_last=False)`` follows (see :meth:`ToTorchImage.compiled_form`), so that
    the copy runs in the producers' pass over each sample (fused with the steps before it)
    instead of on the loop's thread after them; ``ToTorchImage`` then receives CHW samples
    and passes them through. The batches are the same.
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        h, w, c = previous_state.image_size(self)
        dtype = np.dtype(previous_state.dtype)
        return replace(previous_state, shape=(c, h, w), layout="CHW"), AllocationQuery((c, h, w), dtype)

    def generate_code(self) -> Callable[..., Any]:
        kernel = _hwc_to_chw_batch if Compiler.is_enabled() else _hwc_to_chw_batch.py_func

        def to_chw(batch: np.ndarray, dst: np.ndarray) -> np.ndarray:
            return kernel(batch, dst[: batch.shape[0]])  # type: ignore[no-any-return]

        return to_chw

    def generate_sample_code(self) -> Callable[..., Any]:
        def to_chw_one(image: np.ndarray, dst: np.ndarray, index: int, seed: np.uint64) -> np.ndarray:
            return hwc_to_chw_one(image, dst)  # type: ignore[no-any-return]

        return to_chw_one

    def __repr__(self) -> str:
        return "ToTorchImage(channels_last=False)'s copy (compiled)"


def _numpy_compatible(dtype: Any) -> bool:
    """Whether CPU tensors of torch ``dtype`` have a numpy view (``bfloat16``, for one, has none)."""
    import torch

    try:
        torch.empty(0, dtype=dtype).numpy()
    except (TypeError, RuntimeError):
        return False
    return True


class ToTorchImage(Operation):
    """Turns an image batch into NCHW: a view of NHWC memory (channels-last, as FFCV), or a contiguous NCHW copy.

    Reads the layout of the state, never the shape: HWC samples (from the
    image decoders) become an NCHW view, ``batch.permute(0, 3, 1, 2)``, whose
    memory stays channels-last; CHW samples (after ``NormalizeImage``) pass
    through, so FFCV's ``[..., NormalizeImage(...), ToTensor(), ToTorchImage()]``
    gives the NCHW batch too. Place it after ``ToTensor``; the state's layout
    becomes CHW.

    With ``channels_last=False``, HWC samples on the CPU are copied into
    contiguous NCHW memory that the loader allocates once per batch slot (like
    every operation's output: the batch lives until the slot is reused, and a
    batch you keep is never overwritten), by a compiled kernel, in parallel over
    the images; on another device, torch makes the copy.

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
    #: an operation after it may do its work before it (``NormalizeImage``'s output is CHW, which this one passes through):
    #: a loader that looks past views may move that operation's compiled form before ``ToTensor``
    tensor_view = True

    def __init__(self, channels_last: bool = True, convert_back_int16: bool = True) -> None:
        self.channels_last = channels_last
        self._permute = True
        self._compiled_copy = False

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if previous_state.jit_mode:
            raise ValueError("ToTorchImage works on torch tensors: place it after ToTensor")
        h, w, c = previous_state.image_size(self)
        self._permute = previous_state.layout == "HWC"
        state = replace(previous_state, shape=(c, h, w), layout="CHW")
        device = previous_state.device
        on_cpu = device is None or getattr(device, "type", device) == "cpu"
        dtype = _torch_dtype(previous_state.dtype)
        self._compiled_copy = self._permute and not self.channels_last and on_cpu and _numpy_compatible(dtype)
        if not self._compiled_copy:
            return state, None
        return state, AllocationQuery((c, h, w), dtype)

    @property
    def view_only(self) -> bool:  # type: ignore[override]
        """A view (``permute``, or the CHW batch as it is) with ``channels_last=True``; a copy otherwise."""
        return self.channels_last

    def compiled_form(self, state: State) -> Operation | None:
        """The compiled operation that does this one's work before ``ToTensor``, given the state ``ToTensor`` receives.

        ``channels_last=False`` on HWC numpy images (in the compiled head): :class:`ToCHW`, the copy
        made by the producers in their pass over each sample; this operation then passes the CHW
        batch through. ``None`` otherwise (a view, CHW samples, or images Numba cannot compile).
        """
        device = state.device
        if self.channels_last or not state.jit_mode or state.layout != "HWC" or getattr(device, "type", "cpu") != "cpu":
            return None
        dtype = np.dtype(state.dtype) if not _is_torch(state.dtype) else None
        if dtype is None or dtype.kind not in "biuf" or (dtype.itemsize == 2 and dtype.kind == "f"):
            return None
        return ToCHW()

    def generate_code(self) -> Callable[..., Any]:
        channels_last = self.channels_last
        if not self._permute:

            def already_chw(batch: Any, dst: Any) -> Any:
                return batch if channels_last else batch.contiguous()

            return already_chw

        if not self._compiled_copy:

            def to_torch_image(batch: Any, dst: Any) -> Any:
                out = batch.permute(0, 3, 1, 2)
                return out if channels_last else out.contiguous()

            return to_torch_image

        kernel = hwc_to_chw if Compiler.is_enabled() else hwc_to_chw.py_func

        def to_contiguous_nchw(batch: Any, dst: Any) -> Any:
            n, h, w, c = batch.shape
            if dst.shape[0] != n:  # a last batch smaller than the others
                dst = dst[:n]
            if tuple(dst.shape[1:]) != (c, h, w) or dst.dtype != batch.dtype:  # an operation before changed more than it declared
                return batch.permute(0, 3, 1, 2).contiguous()
            if batch.device.type != "cpu" or not batch.is_contiguous():
                return dst.copy_(batch.permute(0, 3, 1, 2))
            kernel(batch.numpy(), dst.numpy())
            return dst

        return to_contiguous_nchw

    def __repr__(self) -> str:
        return f"ToTorchImage(channels_last={self.channels_last})"


class Squeeze(Operation):
    """``tensor.squeeze(*dims)``; without dims, squeezes every dimension of size 1 but the batch."""

    reentrant = True
    view_only = True

    def __init__(self, *dims: int) -> None:
        self.dims = dims

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        if previous_state.jit_mode:
            raise ValueError("Squeeze works on torch tensors: place it after ToTensor")
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
    view_only = True

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
