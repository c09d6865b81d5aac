"""Decoders of :class:`~stoker.fields.RGBImageField`: whole images, centre crops, random resized crops.

JPEG values are decoded by libjpeg-turbo from compiled code, one decoder handle
per thread, with the GIL released. When the crop is known before decoding,
only the rows and columns of the crop are decoded (TurboJPEG's cropping
region), at a reduced scale (1/2, 1/4, 1/8, in the DCT domain) when the crop is
at least that many times larger than the output. Raw values are copied or
resized straight from the file.

Resizing uses area averaging when shrinking and bilinear interpolation when
enlarging (per axis).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np

from stoker.errors import PipelineError
from stoker.fields import _image_kernels as kernels
from stoker.fields._decoder_base import _check_type, _Decoder
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.state import State

DEFAULT_CROP_RATIO = 224 / 256


def _size(output_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if output_size is None:
        return None
    if isinstance(output_size, (int, np.integer)):
        output_size = (int(output_size), int(output_size))
    h, w = (int(s) for s in output_size)
    if h < 1 or w < 1:
        raise ValueError(f"output_size must be positive; got {output_size}")
    return h, w


class _ImageDecoder(_Decoder):
    """Shared machinery: per-thread handles and scratch, status and the error policy."""

    #: one libjpeg-turbo handle and scratch buffer per thread: one batch at a time
    reentrant = False

    kind = kernels.KIND_SIMPLE

    def __init__(
        self,
        output_size: int | tuple[int, int] | None = None,
        *,
        on_error: str = "raise",
        fast_dct: bool = False,
        dct_scaling: bool = True,
        crop_decode: bool = True,
    ) -> None:
        if on_error not in ("raise", "replace"):
            raise ValueError(f"on_error must be 'raise' or 'replace'; got {on_error!r}")
        self.output_size = _size(output_size)
        self.on_error = on_error
        self.fast_dct = fast_dct
        self.dct_scaling = dct_scaling
        self.crop_decode = crop_decode
        self._resources: tuple[np.ndarray, ...] | None = None
        self._counts = np.zeros(1, dtype=np.int64)

    @property
    def num_replaced(self) -> int:
        """Images that failed to decode and were replaced by zeros (``on_error='replace'``)."""
        return int(self._counts[0])

    def _params(self) -> np.ndarray:
        flags = (float(self.dct_scaling), float(self.on_error == "replace"), float(self.crop_decode))
        return np.array([self.kind, 0.0, 0.0, 0.0, 0.0, 0.0, *flags], dtype=np.float64)

    def _output_shape(self, heights: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
        assert self.output_size is not None  # noqa: S101 - crop decoders always have one
        return self.output_size

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _check_type(self, "rgb_image")
        assert self.reader is not None  # noqa: S101
        meta, name = self.reader.metadata, self.field_name
        heights, widths, modes = meta[f"{name}/height"], meta[f"{name}/width"], meta[f"{name}/mode"]
        oh, ow = self._output_shape(heights, widths) if len(heights) else (self.output_size or (0, 0))
        shape = (oh, ow, 3)
        threads = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        jpeg = bool((modes != kernels.MODE_RAW).any()) if len(modes) else False
        max_h = int(heights.max()) if len(heights) else 1
        max_w = int(widths.max()) if len(widths) else 1
        max_bytes = int((heights.astype(np.int64) * widths.astype(np.int64)).max()) * 3 if jpeg else 1
        fps = np.zeros(5, dtype=np.int64)
        handles = np.zeros(threads, dtype=np.int64)
        if jpeg:
            from stoker.fields._turbojpeg import TurboJPEG

            tj = TurboJPEG.load()
            if tj is None:
                raise PipelineError(f"field '{name}' holds JPEG images and libjpeg-turbo is not available: pip install turbojpeg")
            import ctypes

            addr = [
                ctypes.cast(f, ctypes.c_void_p).value
                for f in (tj.decompress_header, tj.get, tj.set_scaling_factor, tj.set_cropping_region, tj.decompress8)
            ]
            fps[:] = [int(a or 0) for a in addr]
            handles[:] = tj.new_handles(threads, self.fast_dct, fast_upsample=False)
            weakref.finalize(self, _destroy, tj, handles.tolist())
        batch = int(getattr(self, "batch_size", 0) or len(heights) or 1)
        self._resources = (
            fps,
            handles,
            np.zeros((threads, max_bytes), dtype=np.uint8),
            np.zeros((threads, kernels.resize_scratch_size(max_h, max_w, oh, ow)), dtype=np.float32),
            np.zeros(batch, dtype=np.int32),
            self._params(),
            self._counts,
        )
        return replace(previous_state, jit_mode=True, shape=shape, dtype=np.dtype("u1")), AllocationQuery(shape, np.dtype("u1"))

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        ptr, size, height, width, mode = super().loader_arrays()
        if self._resources is None:
            raise PipelineError(f"{type(self).__name__}: declare_state_and_memory must run before loader_arrays")
        return (ptr, size, height, width, mode, *self._resources)

    def generate_code(self) -> Callable[..., Any]:
        return kernels.decode_images


def _destroy(tj: Any, handles: list[int]) -> None:
    for h in handles:
        if h:
            tj.destroy(h)


class SimpleRGBImageDecoder(_ImageDecoder):
    """Decodes images that all share one size to ``(batch, height, width, 3)`` uint8, raw or JPEG.

    Raises :class:`~stoker.errors.PipelineError` naming a sample whose size
    differs. A corrupt JPEG raises a :class:`~stoker.errors.LoaderError`
    naming the sample, or, with ``on_error='replace'``, becomes a black image
    counted in :attr:`num_replaced`.
    """

    kind = kernels.KIND_SIMPLE

    def __init__(self, *, on_error: str = "raise") -> None:
        super().__init__(None, on_error=on_error)

    def _output_shape(self, heights: np.ndarray, widths: np.ndarray) -> tuple[int, int]:
        h0, w0 = int(heights[0]), int(widths[0])
        odd = np.flatnonzero((heights != h0) | (widths != w0))
        if len(odd):
            i = int(odd[0])
            raise PipelineError(
                f"SimpleRGBImageDecoder needs images of one size; field '{self.field_name}': sample 0 is {h0}x{w0}, "
                f"sample {i} is {int(heights[i])}x{int(widths[i])} (use CenterCropRGBImageDecoder or RandomResizedCropRGBImageDecoder)"
            )
        return h0, w0


class CenterCropRGBImageDecoder(_ImageDecoder):
    """Centre crop then resize, as FFCV: the crop is a centred square of side ``ratio * min(h, w)``.

    Args:
        output_size: ``(height, width)`` of the output, or an int for a square.
        ratio: side of the crop relative to the image's shorter side.
        on_error: ``'raise'`` or ``'replace'`` (see :class:`SimpleRGBImageDecoder`).
        fast_dct: libjpeg-turbo's fast integer IDCT (faster, slightly less accurate).
        dct_scaling: decode at 1/2, 1/4, 1/8 scale when the crop is that many times the output.
        crop_decode: decode only the rows and columns of the crop (TurboJPEG's cropping region).
    """

    kind = kernels.KIND_CENTER

    def __init__(self, output_size: int | tuple[int, int], ratio: float = DEFAULT_CROP_RATIO, **kwargs: Any) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1]; got {ratio}")
        super().__init__(output_size, **kwargs)
        self.ratio = float(ratio)

    def _params(self) -> np.ndarray:
        params = super()._params()
        params[1] = self.ratio
        return params

    def __repr__(self) -> str:
        return f"CenterCropRGBImageDecoder({self.output_size}, ratio={self.ratio:.4g})"


class RandomResizedCropRGBImageDecoder(_ImageDecoder):
    """torchvision's RandomResizedCrop, fused with decoding; every draw comes from (seed, epoch, sample).

    Args:
        output_size: ``(height, width)`` of the output, or an int for a square.
        scale: range of the crop's area relative to the image.
        ratio: range of the crop's aspect ratio (width / height).
        on_error, fast_dct, dct_scaling, crop_decode: as in :class:`CenterCropRGBImageDecoder`.
    """

    kind = kernels.KIND_RANDOM
    uses_seeds = True

    def __init__(
        self,
        output_size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        **kwargs: Any,
    ) -> None:
        if not 0.0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi; got {scale}")
        if not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (lo, hi) with 0 < lo <= hi; got {ratio}")
        super().__init__(output_size, **kwargs)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def _params(self) -> np.ndarray:
        params = super()._params()
        params[2:6] = (self.scale[0], self.scale[1], math.log(self.ratio[0]), math.log(self.ratio[1]))
        return params

    def __repr__(self) -> str:
        return f"RandomResizedCropRGBImageDecoder({self.output_size}, scale={self.scale}, ratio={self.ratio})"
