"""Per-channel normalisation of image batches, fused with the uint8 -> float conversion and HWC -> CHW: :class:`NormalizeImage`."""

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


def _is_torch_dtype(dtype: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(dtype, torch.dtype)


_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only


@numba.njit(nogil=True, cache=True)
def normalize_f32_one(image, out, mean, inv_std):  # type: ignore[no-untyped-def]
    """One HWC image: ``out[k, p] = (image[p, k] - mean[k]) * inv_std[k]`` in float32; reads each pixel once, writes C planes.

    Unsigned indices keep Numba from inserting negative-index checks, so the loop vectorises.
    """
    h, w, c = image.shape
    hw = numba.uint64(h * w)
    cu = numba.uint64(c)
    src = image.reshape(-1)
    flat = out.reshape(-1)
    for k in range(cu):
        m = mean[k]
        s = inv_std[k]
        plane = k * hw
        for p in range(hw):
            flat[plane + p] = (np.float32(src[p * cu + k]) - m) * s
    return out


@numba.njit(nogil=True, cache=True)
def normalize_rgb_f32_one(image, out, mean, inv_std):  # type: ignore[no-untyped-def]
    """The three-channel case of :func:`normalize_f32_one`, one pass over the pixels."""
    h, w, _ = image.shape
    hw = numba.uint64(h * w)
    m0, m1, m2 = mean[0], mean[1], mean[2]
    s0, s1, s2 = inv_std[0], inv_std[1], inv_std[2]
    src = image.reshape(-1)
    flat = out.reshape(-1)
    for p in range(hw):
        # literal strides (not variables): LLVM then vectorises the de-interleaving loads
        q = numba.uint64(3) * p
        flat[p] = (np.float32(src[q]) - m0) * s0
        flat[hw + p] = (np.float32(src[q + numba.uint64(1)]) - m1) * s1
        flat[numba.uint64(2) * hw + p] = (np.float32(src[q + numba.uint64(2)]) - m2) * s2
    return out


@numba.njit(nogil=True, cache=True)
def normalize_chw_f32_one(image, out, mean, inv_std):  # type: ignore[no-untyped-def]
    """One CHW image: ``out[k, p] = (image[k, p] - mean[k]) * inv_std[k]`` in float32, plane by contiguous plane."""
    c, h, w = image.shape
    hw = numba.uint64(h * w)
    cu = numba.uint64(c)
    src = image.reshape(-1)
    flat = out.reshape(-1)
    for k in range(cu):
        m = mean[k]
        s = inv_std[k]
        plane = k * hw
        for p in range(hw):
            flat[plane + p] = (np.float32(src[plane + p]) - m) * s
    return out


@numba.njit(nogil=True, parallel=True, cache=True)
def _normalize_f32_kernel(images, dst, mean, inv_std):  # type: ignore[no-untyped-def]
    """:func:`normalize_f32_one` for each image of the batch."""
    for i in numba.prange(images.shape[0]):
        normalize_f32_one(images[i], dst[i], mean, inv_std)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _normalize_rgb_f32_kernel(images, dst, mean, inv_std):  # type: ignore[no-untyped-def]
    """:func:`normalize_rgb_f32_one` for each image of the batch."""
    for i in numba.prange(images.shape[0]):
        normalize_rgb_f32_one(images[i], dst[i], mean, inv_std)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _normalize_kernel(images, dst, table):  # type: ignore[no-untyped-def]
    """``dst[i, k, y, x] = table[images[i, y, x, k], k]``: a lookup per pixel, written channel-first."""
    n, h, w, c = images.shape
    for i in numba.prange(n):
        for k in range(c):
            for y in range(h):
                for x in range(w):
                    dst[i, k, y, x] = table[images[i, y, x, k], k]
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _normalize_chw_f32_kernel(images, dst, mean, inv_std):  # type: ignore[no-untyped-def]
    """:func:`normalize_chw_f32_one` for each image of the batch."""
    for i in numba.prange(images.shape[0]):
        normalize_chw_f32_one(images[i], dst[i], mean, inv_std)
    return dst


@numba.njit(nogil=True, parallel=True, cache=True)
def _normalize_chw_kernel(images, dst, table):  # type: ignore[no-untyped-def]
    """CHW input: ``dst[i, k, y, x] = table[images[i, k, y, x], k]``."""
    n, c, h, w = images.shape
    for i in numba.prange(n):
        for k in range(c):
            for y in range(h):
                for x in range(w):
                    dst[i, k, y, x] = table[images[i, k, y, x], k]
    return dst


class NormalizeImage(Operation):
    """``(image - mean) / std`` per channel, into a float ``(batch, channels, height, width)`` batch.

    The conversion from uint8, the normalisation and the change of layout
    to CHW are one pass, computed in float32 and then cast to ``type``. The
    input's layout, HWC (from the decoders) or CHW, is read from the state,
    never guessed from the shape; the output's is CHW. Where it runs depends
    on its place in the pipeline:

    * on a numpy uint8 batch (before ``ToTensor``): a compiled kernel computes
      ``(float32(x) - mean) * (1 / std)`` per value (for ``type=np.float16``,
      it looks each value up in a 256-entry table per channel). The output
      memory is ``(batch, channels, height, width)``, contiguous: ``ToTensor``
      alone gives the NCHW tensor, and a ``ToTorchImage`` after it changes
      nothing. Image operations placed after it (flip, translate, cutout)
      work on this CHW float batch. Numba cannot compile float16 arrays, so
      with ``type=np.float16`` the kernel is called from Python on ``uint16``
      views after the compiled part of the pipeline, and no compiled
      operation may follow.
    * on a torch tensor (after ``ToTensor``, and ``ToDevice`` for the GPU):
      into memory allocated on the tensor's device, from NHWC (straight from
      the decoder) or NCHW (after ``ToTorchImage``) tensors of any dtype. The
      output is a contiguous NCHW tensor. For ``type=np.float32`` it is
      ``(float32(x) - mean) * (1 / std)``, as on numpy batches (the same
      values, bit for bit); uint8 CPU tensors go through the same compiled
      kernels, one pass over the pixels. Other types: ``(x - mean) / std``
      with torch operations on the tensor's device.
    * FFCV's ``[..., ToTensor(), NormalizeImage(...)]`` on uint8 CPU images
      (and ``[..., ToTensor(), ToTorchImage(), NormalizeImage(...)]`` where
      the loader looks past views, see :meth:`compiled_form`) with
      ``type=np.float32``: the loader moves the normalisation before
      ``ToTensor``, into the producers' pass over each sample (fused with the
      decoder and the image operations before it); the operation after
      ``ToTensor`` then passes the normalised batch through. The batches
      are the same (``STOKER_FUSE=0`` keeps the pipeline as written).

    Args:
        mean: per-channel mean, in the units of the pixels (0..255), e.g.
            ``np.array([0.485, 0.456, 0.406]) * 255``.
        std: per-channel standard deviation, same units, all > 0.
        type: the output's numpy float dtype (``np.float32`` or ``np.float16``).

    Raises:
        ValueError: ``mean`` and ``std`` of different lengths, a ``std`` <= 0 or
            a ``type`` that is not a float; at build time, an input that is not
            an image of a known layout with ``len(mean)`` channels (or not
            uint8 before ``ToTensor``).
    """

    reentrant = True
    wraps_kernels = True  # its generated function only calls compiled kernels

    def __init__(self, mean: Any, std: Any, type: Any) -> None:
        self.mean = np.asarray(mean, dtype=np.float32).reshape(-1)
        self.std = np.asarray(std, dtype=np.float32).reshape(-1)
        if self.mean.shape != self.std.shape or self.mean.size == 0:
            raise ValueError(f"mean and std need one value per channel, as many of each; got mean {self.mean}, std {self.std}")
        if not (self.std > 0).all():
            raise ValueError(f"std must be > 0 for every channel; got {self.std}")
        self.dtype = np.dtype(type)
        if self.dtype.kind != "f":
            raise ValueError(f"type must be a numpy float dtype such as np.float32 or np.float16; got {self.dtype}")
        self._mode = "numpy"
        self._nhwc = True
        self._device: Any = None
        #: set by :meth:`compiled_form` (its twin before ``ToTensor`` does the work), read once by the next declaration
        self._moved_before = False

    def compiled_form(self, state: State) -> Operation | None:
        """The compiled operation that does this one's work before ``ToTensor``, given the state ``ToTensor`` receives.

        A float32 ``NormalizeImage`` after ``ToTensor`` (and views such as ``ToTorchImage()``) on uint8
        images of a known layout, in the compiled head on the CPU: a ``NormalizeImage`` of the same mean,
        std and type, placed before ``ToTensor``, where it runs in the producers' pass over each sample;
        this operation then passes the normalised (CHW float32) batch through. ``None`` otherwise (float16,
        another device, images Numba cannot compile, another channel count: this operation then does its work
        itself, or says what is wrong).
        """
        if self.dtype != np.float32 or not state.jit_mode or getattr(state.device, "type", "cpu") != "cpu":
            return None
        if _is_torch_dtype(state.dtype) or np.dtype(state.dtype) != np.uint8 or state.layout is None:
            return None
        if state.image_size(self)[2] != self.mean.size:
            return None
        self._moved_before = True
        return NormalizeImage(self.mean, self.std, self.dtype)

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        moved, self._moved_before = self._moved_before, False
        if moved and not previous_state.jit_mode and previous_state.layout == "CHW":
            from stoker.transforms.tensor import _torch_dtype

            if _torch_dtype(previous_state.dtype) == _torch_dtype(self.dtype) and previous_state.shape[0] == self.mean.size:
                self._mode = "moved"  # its twin before ToTensor normalised the batch (see compiled_form)
                return previous_state, None
        h, w, c = previous_state.image_size(self)
        if c != self.mean.size:
            raise ValueError(
                f"NormalizeImage has {self.mean.size} channel values; the images have {c} "
                f"(sample shape {previous_state.shape}, layout {previous_state.layout})"
            )
        self._nhwc = previous_state.layout == "HWC"
        out_shape = (c, h, w)
        if previous_state.jit_mode:
            if np.dtype(previous_state.dtype) != np.uint8:
                raise ValueError(
                    f"NormalizeImage before ToTensor needs uint8 images; got {previous_state.dtype} "
                    "(to normalise other values, place it after ToTensor)"
                )
            self._mode = "numpy"
            # numba has no float16: such batches are written through uint16 views, from Python (see the class docstring)
            jit = self.dtype != np.float16
            state = replace(previous_state, jit_mode=jit, shape=out_shape, dtype=self.dtype, layout="CHW")
            return state, AllocationQuery(out_shape, self.dtype)
        from stoker.transforms.tensor import _torch_dtype

        self._mode = "torch"
        self._device = previous_state.device
        out_dtype = _torch_dtype(self.dtype)
        state = replace(previous_state, shape=out_shape, dtype=out_dtype, layout="CHW")
        return state, AllocationQuery(out_shape, out_dtype, self._device)

    def lookup_table(self) -> np.ndarray:
        """``table[v, k] = (v - mean[k]) / std[k]`` for every uint8 value ``v``, computed in float32, as ``type``."""
        values = np.arange(256, dtype=np.float32)[:, None]
        return ((values - self.mean[None, :]) / self.std[None, :]).astype(self.dtype)

    def generate_code(self) -> Callable[..., Any]:
        if self._mode == "moved":

            def normalized_before(batch: Any, dst: Any) -> Any:
                return batch

            return normalized_before
        if self._mode == "torch":
            return self._torch_code()
        compiled = _normalize_kernel if self._nhwc else _normalize_chw_kernel
        kernel = compiled if Compiler.is_enabled() else compiled.py_func
        table = np.ascontiguousarray(self.lookup_table())
        if self.dtype == np.float16:
            bits = table.view(np.uint16)

            def normalize_image_f16(batch: np.ndarray, dst: np.ndarray) -> np.ndarray:
                kernel(batch, dst.view(np.uint16), bits)
                return dst

            return normalize_image_f16

        mean = np.ascontiguousarray(self.mean, dtype=np.float32)
        inv_std = (np.float32(1.0) / self.std).astype(np.float32)
        if not self._nhwc:
            kernel32 = _normalize_chw_f32_kernel
        else:
            kernel32 = _normalize_rgb_f32_kernel if mean.size == 3 else _normalize_f32_kernel
        fast: Callable[..., Any] = kernel32 if Compiler.is_enabled() else kernel32.py_func

        def normalize_image(batch: np.ndarray, dst: np.ndarray) -> np.ndarray:
            return fast(batch, dst, mean, inv_std)  # type: ignore[no-any-return]

        return normalize_image

    def generate_sample_code(self) -> Callable[..., Any] | None:
        if self._mode != "numpy" or self.dtype != np.float32:
            return None  # (float16 batches are written from Python: see the class docstring)
        mean = np.ascontiguousarray(self.mean, dtype=np.float32)
        inv_std = (np.float32(1.0) / self.std).astype(np.float32)
        if not self._nhwc:
            one = normalize_chw_f32_one
        else:
            one = normalize_rgb_f32_one if mean.size == 3 else normalize_f32_one

        def normalize_image_one(image: np.ndarray, dst: np.ndarray, index: int, seed: np.uint64) -> np.ndarray:
            return one(image, dst, mean, inv_std)  # type: ignore[no-any-return]

        return normalize_image_one

    def _torch_code(self) -> Callable[..., Any]:
        import torch

        c = self.mean.size
        mean32 = np.ascontiguousarray(self.mean, dtype=np.float32)
        inv_std32 = (np.float32(1.0) / self.std).astype(np.float32)
        mean = torch.from_numpy(self.mean.copy()).to(self._device).view(1, c, 1, 1)
        std = torch.from_numpy(self.std.copy()).to(self._device).view(1, c, 1, 1)
        inv_std = torch.from_numpy(inv_std32.copy()).to(self._device).view(1, c, 1, 1)
        nhwc = self._nhwc
        compiled = Compiler.is_enabled()
        kernel: Any
        hwc_kernel: Any
        if nhwc:  # the kernels of the numpy path: the same values, in one pass
            kernel = _normalize_rgb_f32_kernel if c == 3 else _normalize_f32_kernel
        else:
            kernel = _normalize_chw_f32_kernel
        hwc_kernel = _normalize_rgb_f32_kernel if c == 3 else _normalize_f32_kernel
        if not compiled:
            kernel, hwc_kernel = kernel.py_func, hwc_kernel.py_func

        def normalize_image_torch(batch: Any, dst: Any) -> Any:
            x = batch.permute(0, 3, 1, 2) if nhwc else batch
            out = dst[: x.shape[0]]
            if out.dtype == torch.float32:
                if batch.dtype == torch.uint8 and batch.device.type == "cpu" and out.is_contiguous():
                    if batch.is_contiguous():  # NHWC, or contiguous NCHW
                        kernel(batch.numpy(), out.numpy(), mean32, inv_std32)
                        return out
                    hwc = batch.permute(0, 2, 3, 1)  # NCHW view of NHWC memory (ToTorchImage()): read it as NHWC
                    if not nhwc and hwc.is_contiguous():
                        hwc_kernel(hwc.numpy(), out.numpy(), mean32, inv_std32)
                        return out
                out.copy_(x)  # the conversion to float32 and the change of layout, in one copy
                out.sub_(mean).mul_(inv_std)
            else:
                out.copy_(x.to(torch.float32).sub_(mean).div_(std))
            return out

        return normalize_image_torch

    def __repr__(self) -> str:
        return f"NormalizeImage(mean={self.mean.tolist()}, std={self.std.tolist()}, type={self.dtype.name})"
