"""Decoders of :class:`~stoker.fields.RGBImageField`: whole images, centre crops, random resized crops.

JPEG values are decoded by libjpeg-turbo from compiled code, one decoder handle
per thread, with the GIL released. JPEG sizes are checked against libjpeg's
limit (65,535 pixels a side) and the per-thread scratch against
``max_scratch_bytes`` when the pipeline is built, and each JPEG's header
against its metadata before it is decoded. When the crop is known before decoding,
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

from stoker.decoders._base import _check_type, _Decoder
from stoker.errors import PipelineError
from stoker.fields.rgb_image import MODE_RAW
from stoker.image import _kernels as kernels
from stoker.image._turbojpeg import JPEG_ROWS_OFFSET, KERNEL_FUNCTIONS, TJERR_WARNING, TurboJPEG
from stoker.pipeline.allocation_query import AllocationQuery
from stoker.pipeline.operation import SampleDecoder
from stoker.pipeline.state import State

DEFAULT_CROP_RATIO = 224 / 256
#: the default of ``max_scratch_bytes``: what one thread may set aside to decode and resize one image [bytes]
#: (1 GiB: a JPEG of up to about 18,000 x 18,000 pixels)
DEFAULT_MAX_SCRATCH_BYTES = 1 << 30


def _size(output_size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if output_size is None:
        return None
    if isinstance(output_size, (int, np.integer)) and not isinstance(output_size, bool):
        output_size = (int(output_size), int(output_size))
    pair = tuple(output_size) if isinstance(output_size, (tuple, list, np.ndarray)) else ()
    if len(pair) != 2 or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in pair):
        raise ValueError(f"output_size must be (height, width) in pixels, or one int for a square; got {output_size!r}")
    h, w = (int(s) for s in pair)
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
        max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES,
    ) -> None:
        if on_error not in ("raise", "replace"):
            raise ValueError(f"on_error must be 'raise' or 'replace'; got {on_error!r}")
        if int(max_scratch_bytes) < 1:
            raise ValueError(f"max_scratch_bytes must be >= 1; got {max_scratch_bytes}")
        self.output_size = _size(output_size)
        self.on_error = on_error
        self.fast_dct = fast_dct
        self.dct_scaling = dct_scaling
        self.crop_decode = crop_decode
        self.max_scratch_bytes = int(max_scratch_bytes)
        self._resources: tuple[np.ndarray, ...] | None = None
        self._handles_finalizer: weakref.finalize[Any, Any] | None = None
        self._status = self._messages = self._last = np.zeros(0, dtype=np.int64)
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

    def _scratch_sizes(
        self, where: str, heights: np.ndarray, widths: np.ndarray, jpeg: np.ndarray, oh: int, ow: int, threads: int
    ) -> tuple[int, int, int]:
        """Per thread: bytes to decode a JPEG into, float32 and int64 elements for resizing.

        Each thread works on one image at a time: it needs what the most demanding image needs,
        at most ``max_scratch_bytes`` in all. Whole images (no crop) are decoded or copied straight
        into the output and need nothing.

        Raises:
            PipelineError: an image needs more, naming the largest such image.
        """
        if self.kind == kernels.KIND_SIMPLE or len(heights) == 0:
            return 0, 0, 0
        h, w = heights.astype(np.int64), widths.astype(np.int64)  # JPEG sides <= 65535, raw ones bounded by the file's size
        decode = np.where(jpeg, kernels.jpeg_scratch_size(h, w), 0)
        resize = kernels.resize_scratch_size(h, w, oh, ow)
        jpeg_bytes, rows, taps = int(decode.max()), int(resize.max()), kernels.resize_taps_size(oh, ow)
        need = jpeg_bytes + 4 * rows + 8 * taps
        if need > self.max_scratch_bytes:
            j = int(np.argmax(decode + 4 * resize))
            raise PipelineError(
                f"{where}: {type(self).__name__} needs {need / 2**20:.1f} MiB of scratch per thread ({threads} threads), "
                f"more than max_scratch_bytes={self.max_scratch_bytes}; the largest image is sample {j} "
                f"({int(h[j])}x{int(w[j])} pixels{', JPEG' if jpeg[j] else ''}): write the dataset with a smaller "
                f"max_resolution, or pass a larger max_scratch_bytes"
            )
        return jpeg_bytes, rows, taps

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, AllocationQuery | None]:
        _check_type(self, "rgb_image")
        assert self.reader is not None  # noqa: S101
        # raw sizes agree with their byte counts, JPEG sides lie in 1..65535 (checked once per reader)
        self.reader.validate_metadata()
        meta, name = self.reader.metadata, self.field_name
        heights, widths, modes = (np.asarray(meta[f"{name}/{c}"]) for c in ("height", "width", "mode"))
        jpeg = modes != MODE_RAW
        where = f"{self.reader.path}: field '{name}'"
        oh, ow = self._output_shape(heights, widths) if len(heights) else (self.output_size or (0, 0))
        shape = (oh, ow, 3)
        threads = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        jpeg_bytes, rows, taps = self._scratch_sizes(where, heights, widths, jpeg, oh, ow, threads)
        fps = np.zeros(len(KERNEL_FUNCTIONS), dtype=np.int64)
        handles = np.zeros(threads, dtype=np.int64)
        if jpeg.any():
            tj = TurboJPEG.load()
            if tj is None:
                raise PipelineError(f"{where} holds JPEG images and libjpeg-turbo is not available: pip install turbojpeg==0.0.2")
            fps[:] = tj.kernel_pointers()
            handles[:] = tj.new_handles(threads, self.fast_dct, fast_upsample=False)
            # Freed with the array the kernels read them from, so never while a batch uses them; never at
            # interpreter exit, where a thread may still be decoding (the process frees them anyway).
            self._handles_finalizer = weakref.finalize(handles, tj.destroy_handles, handles.tolist())
            self._handles_finalizer.atexit = False
        batch = int(getattr(self, "batch_size", 0) or len(heights) or 1)
        # what the kernel reports per sample, read back by describe_error
        self._status = np.zeros((batch, kernels.STATUS_COLUMNS), dtype=np.int32)
        self._messages = np.zeros((batch, kernels.MESSAGE_BYTES), dtype=np.uint8)
        self._last = np.zeros(3, dtype=np.int64)
        self._resources = (
            fps,
            handles,
            np.zeros((threads, jpeg_bytes), dtype=np.uint8),
            np.zeros((threads, rows), dtype=np.float32),
            np.zeros((threads, taps), dtype=np.int64),
            self._status,
            self._messages,
            self._last,
            self._params(),
            self._counts,
        )
        state = replace(previous_state, jit_mode=True, shape=shape, dtype=np.dtype("u1"), layout="HWC")
        # whole images are decoded straight into the batch: rows that start on a 32-byte boundary would be written
        # with non-temporal stores (libjpeg-turbo's x86 colour conversion), past the cache the next operation reads
        offset = JPEG_ROWS_OFFSET if self.kind == kernels.KIND_SIMPLE and jpeg.any() else 0
        return state, AllocationQuery(shape, np.dtype("u1"), offset=offset)

    def loader_arrays(self) -> tuple[np.ndarray, ...]:
        ptr, size, height, width, mode = super().loader_arrays()
        if self._resources is None:
            raise PipelineError(f"{type(self).__name__}: declare_state_and_memory must run before loader_arrays")
        return (ptr, size, height, width, mode, *self._resources)

    def generate_code(self) -> Callable[..., Any]:
        return kernels.decode_images

    def generate_sample_code(self) -> SampleDecoder:
        return SampleDecoder(kernels.decode_sample_code, kernels.decode_begin, kernels.decode_end)

    def describe_error(self) -> str | None:
        """What went wrong with the first image that failed in the last batch, in libjpeg-turbo's words.

        ``None`` when the last batch had no failure. The loader appends this to the
        :class:`~stoker.errors.LoaderError` of a batch that failed.
        """
        if self._resources is None or self._last[0] == 0:
            return None
        i, j = int(self._last[1]), int(self._last[2])
        stage, code, header_h, header_w = (int(v) for v in self._status[i])
        text = bytes(self._messages[i]).split(b"\0", 1)[0].decode("utf-8", "replace")
        if stage == kernels.ERR_THREAD:
            return f"numba ran more threads than NUMBA_NUM_THREADS={len(self._resources[1])}, the number of decoder handles"
        if stage == kernels.ERR_SIZE:
            assert self.reader is not None  # noqa: S101
            meta = self.reader.metadata[j]
            h, w = int(meta[f"{self.field_name}/height"]), int(meta[f"{self.field_name}/width"])
            said = f"; libjpeg-turbo warned: {text}" if text else ""
            return f"the JPEG's header says {header_h}x{header_w} pixels, the metadata {h}x{w} (height x width){said}"
        severity = "TJERR_WARNING" if code == TJERR_WARNING else "TJERR_FATAL"
        return f"libjpeg-turbo: {text or 'no message'} ({kernels.STAGES.get(stage, '?')} failed, {severity})"


class SimpleRGBImageDecoder(_ImageDecoder):
    """Decodes images that all share one size to ``(batch, height, width, 3)`` uint8, raw or JPEG.

    Raises :class:`~stoker.errors.PipelineError` naming a sample whose size
    differs. A corrupt JPEG raises a :class:`~stoker.errors.LoaderError`
    naming the sample and quoting libjpeg-turbo's message, or, with
    ``on_error='replace'``, becomes a black image counted in :attr:`num_replaced`.
    libjpeg-turbo's warnings (corrupt or truncated data, which it would decode
    to a partly grey image) count as failures: stoker writes its JPEGs itself,
    so a warning means the file was damaged.
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
        max_scratch_bytes: the most each thread may set aside to decode and resize one
            image [bytes]; a dataset whose largest image needs more is refused when the
            pipeline is built (:class:`~stoker.errors.PipelineError`, naming the image).
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
        on_error, fast_dct, dct_scaling, crop_decode, max_scratch_bytes: as in
            :class:`CenterCropRGBImageDecoder`.
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
