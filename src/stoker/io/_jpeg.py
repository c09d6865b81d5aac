"""JPEG decoding for flow stages: libjpeg-turbo through compiled code, one handle per thread, no GIL.

The kernels call the TurboJPEG functions and the resize of the Loader's decoders
(``stoker.image._kernels``) and run with the GIL released, so that N threads
decode N images at once. Each thread gets its own decompression handle and scratch
buffers the first time it decodes; the handle is destroyed when the thread ends
(nothing else can use it then), and left to the process at interpreter exit, when a
thread may still be decoding with it.

The kernels are compiled on first use, not cached on disk: they inline the
resize of another module, which a disk cache would not see change.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import numba
import numpy as np

from stoker import _numba_cache
from stoker.image import _kernels as kernels
from stoker.image._turbojpeg import (
    KERNEL_FUNCTIONS,
    TJCS_CMYK,
    TJCS_YCCK,
    TJERR_WARNING,
    TJPARAM_COLORSPACE,
    TJPARAM_JPEGHEIGHT,
    TJPARAM_JPEGWIDTH,
    TJPF_RGB,
    TurboJPEG,
)

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

# numba intrinsics and dispatchers: typed by numba, not by mypy
_ccall: Any = kernels._ccall
_jpeg_rows: Any = kernels.jpeg_rows
_pack: Any = kernels._pack
_resize: Any = kernels.resize

# indices into the function-pointer array (the order of KERNEL_FUNCTIONS)
_F_HEADER = KERNEL_FUNCTIONS.index("tj3DecompressHeader")
_F_GET = KERNEL_FUNCTIONS.index("tj3Get")
_F_SCALE = KERNEL_FUNCTIONS.index("tj3SetScalingFactor")
_F_CROP = KERNEL_FUNCTIONS.index("tj3SetCroppingRegion")
_F_DECODE = KERNEL_FUNCTIONS.index("tj3Decompress8")
#: the TurboJPEG call behind each failure stage a kernel returns
_STAGES = ("tj3DecompressHeader", "tj3SetScalingFactor", "tj3SetCroppingRegion", "tj3Decompress8")
#: colour spaces libjpeg-turbo cannot convert to RGB (TJCS values): such JPEGs are for Pillow
NOT_RGB_COLORSPACES = (TJCS_CMYK, TJCS_YCCK)


@numba.njit(nogil=True, cache=True)
def _headers(fps, handle, ptrs, sizes, info, status):  # type: ignore[no-untyped-def]
    """``info[i] = (height, width, colorspace)`` of each JPEG; on failure ``status = (i, 0)`` and stop."""
    for i in range(ptrs.shape[0]):
        if _ccall(fps[_F_HEADER], (handle, ptrs[i], sizes[i])) != 0:
            status[0], status[1] = i, 0
            return
        info[i, 0] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGHEIGHT)))
        info[i, 1] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGWIDTH)))
        info[i, 2] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_COLORSPACE)))
        if info[i, 0] < 1 or info[i, 1] < 1:  # a "success" without a frame header (see _fresh_handle)
            info[i, 0], info[i, 1], info[i, 2] = -1, -1, -1
            status[0], status[1] = i, 0
            return


@numba.njit(nogil=True, cache=True)
def _header_one(fps, handle, data, info):  # type: ignore[no-untyped-def]
    """``info = (height, width, colorspace)`` of the JPEG in ``data``; returns False if libjpeg-turbo cannot read it."""
    if _ccall(fps[_F_HEADER], (handle, data.ctypes.data, np.int64(data.shape[0]))) != 0:
        return False
    info[0] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGHEIGHT)))
    info[1] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGWIDTH)))
    info[2] = _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_COLORSPACE)))
    return info[0] >= 1 and info[1] >= 1  # (see _fresh_handle: a "success" may come without a frame header)


@numba.njit(nogil=True, cache=True)
def _decode_into(fps, handle, ptr, size, h, w, y0, x0, ch, cw, dst, scratch, rows, taps):  # type: ignore[no-untyped-def]
    """Decode one JPEG (``size`` bytes at ``ptr``, ``h`` x ``w``) and resample its crop ``(y0, x0, ch, cw)`` into ``dst``.

    The JPEG is decoded at the smallest of 1/8, 1/4, 1/2 scale (in the DCT domain) that keeps the
    crop at least 8/8 of the output's size in both axes, else at full size; an uncropped image
    of the output's size is decoded straight into ``dst``. Returns -1, or the failing stage.
    """
    oh, ow = dst.shape[0], dst.shape[1]
    pf = np.int32(TJPF_RGB)
    if _ccall(fps[_F_HEADER], (handle, ptr, size)) != 0:
        return 0
    # the buffers are sized for h x w: decode nothing else (see _fresh_handle)
    if _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGHEIGHT))) != h or _ccall(fps[_F_GET], (handle, np.int32(TJPARAM_JPEGWIDTH))) != w:
        return 0
    _ccall(fps[_F_CROP], (handle, np.int64(0), np.int64(0)))
    direct = y0 == 0 and x0 == 0 and ch == h and cw == w and oh == h and ow == w
    num = 8
    if not direct:
        for m in (1, 2, 4):
            if ch * m >= 8 * oh and cw * m >= 8 * ow:
                num = m
                break
    g = 8 if num == 8 else (4 if num % 4 == 0 else (2 if num % 2 == 0 else 1))
    if _ccall(fps[_F_SCALE], (handle, _pack(num // g, 8 // g))) != 0:
        return 1
    if direct:
        if _ccall(fps[_F_DECODE], (handle, ptr, size, dst.ctypes.data, np.int32(w * 3), pf)) != 0:
            return 3
        return -1
    ws, hs = (w * num + 7) // 8, (h * num + 7) // 8
    start, pitch = _jpeg_rows(scratch.ctypes.data, ws)
    if _ccall(fps[_F_DECODE], (handle, ptr, size, scratch.ctypes.data + start, np.int32(pitch), pf)) != 0:
        return 3
    s = num / 8.0
    i64 = np.int64  # (resize's one signature: every size int64, see stoker.image._resize.resize)
    _resize(scratch, i64(start), i64(pitch), i64(hs), i64(ws), y0 * s, x0 * s, ch * s, cw * s, dst, rows, taps)
    return -1


@numba.njit(nogil=True, cache=True)
def _decode(fps, handle, ptrs, sizes, dims, crops, dst, scratch, rows, taps, status):  # type: ignore[no-untyped-def]
    """Decode JPEG ``i`` and resample its crop ``crops[i] = (y, x, h, w)`` into ``dst[i]``, for every ``i``
    (see :func:`_decode_into`). On failure ``status = (i, stage)``."""
    for i in range(ptrs.shape[0]):
        stage = _decode_into(
            fps, handle, ptrs[i], sizes[i], dims[i, 0], dims[i, 1], crops[i, 0], crops[i, 1], crops[i, 2], crops[i, 3],
            dst[i], scratch, rows, taps,
        )  # fmt: skip
        if stage >= 0:
            status[0], status[1] = i, stage
            return


@numba.njit(nogil=True, cache=True)
def _decode_one(fps, handle, data, h, w, y0, x0, ch, cw, dst, scratch, rows, taps):  # type: ignore[no-untyped-def]
    """:func:`_decode_into` for the JPEG bytes ``data``."""
    return _decode_into(fps, handle, data.ctypes.data, np.int64(data.shape[0]), h, w, y0, x0, ch, cw, dst, scratch, rows, taps)


class _Handle:
    """One thread's decompression handle; destroyed with the thread's locals, never at interpreter exit."""

    def __init__(self, tj: TurboJPEG) -> None:
        self.value = tj.new_handles(1, fast_dct=False, fast_upsample=False)[0]
        finalizer = weakref.finalize(self, tj.destroy_handles, [self.value])
        finalizer.atexit = False


class _Local(threading.local):
    handle: _Handle | None = None
    scratch: np.ndarray | None = None
    rows: np.ndarray | None = None
    taps: np.ndarray | None = None
    info: np.ndarray | None = None


_local = _Local()
_fps_cache: list[np.ndarray] = []
_fps_lock = threading.Lock()


def _turbojpeg() -> TurboJPEG:
    tj = TurboJPEG.load()
    if tj is None:
        raise ImportError("stoker.io decodes JPEG with libjpeg-turbo, which is not installed: pip install turbojpeg==0.0.2")
    return tj


def _fps() -> np.ndarray:
    if _fps_cache:  # (set once, never changed)
        return _fps_cache[0]
    with _fps_lock:
        if not _fps_cache:
            _fps_cache.append(np.array(_turbojpeg().kernel_pointers(), dtype=np.int64))
        return _fps_cache[0]


def _thread_handle() -> int:
    handle = _local.handle
    if handle is None:
        handle = _local.handle = _Handle(_turbojpeg())
    return int(handle.value)


def _fresh_handle() -> int:
    """A new handle for this thread, after a failure: the old one is destroyed.

    After a failed call on a truncated stream, libjpeg-turbo's next ``tj3DecompressHeader``
    on that handle "succeeds" without reading the stream (its dimensions are the last
    image's, or -1): a decode sized from them overran the scratch buffer.
    """
    _local.handle = None
    return _thread_handle()


def _buffer(name: str, size: int, dtype: Any) -> np.ndarray:
    buf = getattr(_local, name)
    if buf is None or buf.shape[0] < size:
        buf = np.empty(max(size, 1), dtype=dtype)
        setattr(_local, name, buf)
    return buf


def _message(handle: int) -> str:
    funcs = _turbojpeg().functions
    address = funcs["tj3GetErrorStr"](handle)
    text = ctypes.string_at(address) if address else b""
    severity = "warning: corrupt or truncated data" if funcs["tj3GetErrorCode"](handle) == TJERR_WARNING else "fatal"
    return f"{text.decode('utf-8', 'replace') or 'no message'} ({severity})"


def jpeg_headers(arrays: list[np.ndarray]) -> tuple[np.ndarray, dict[int, str]]:
    """The headers of JPEG byte arrays, and those libjpeg-turbo cannot read.

    Returns:
        ``(n, 3)`` int64 ``(height, width, colorspace)`` (a ``TJCS`` value; ``-1`` in each
        column of a header that cannot be read), and ``{i: message}`` of those headers.
    """
    n = len(arrays)
    ptrs = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
    sizes = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    info = np.full((n, 3), -1, dtype=np.int64)
    status = np.full(2, -1, dtype=np.int64)
    handle = _thread_handle()
    fps = _fps()
    failed: dict[int, str] = {}
    start = 0
    while start < n:
        status[:] = -1
        _headers(fps, np.int64(handle), ptrs[start:], sizes[start:], info[start:], status)
        if status[0] < 0:
            break
        i = start + int(status[0])
        failed[i] = f"libjpeg-turbo: {_message(handle)} (tj3DecompressHeader)"
        handle = _fresh_handle()
        start = i + 1
    return info, failed


def decode_jpegs(arrays: list[np.ndarray], dims: np.ndarray, crops: np.ndarray, dst: np.ndarray) -> dict[int, str]:
    """Decode ``arrays[i]`` (JPEG bytes of size ``dims[i]``), crop ``crops[i]`` (y, x, h, w) and resize into ``dst[i]``.

    Returns:
        ``{i: message}`` of the JPEGs libjpeg-turbo fails to decode (their ``dst[i]`` is left
        as it was): the TurboJPEG call and its message.
    """
    n = len(arrays)
    if n == 0:
        return {}
    oh, ow = int(dst.shape[1]), int(dst.shape[2])
    h, w = dims[:, 0], dims[:, 1]
    scratch = _buffer("scratch", int(np.max(kernels.jpeg_scratch_size(h, w))), np.uint8)
    rows = _buffer("rows", int(np.max(kernels.resize_scratch_size(h, w, oh, ow))), np.float32)
    taps = _buffer("taps", int(kernels.resize_taps_size(oh, ow)), np.int64)
    ptrs = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
    sizes = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    status = np.full(2, -1, dtype=np.int64)
    handle = _thread_handle()
    fps = _fps()
    failed: dict[int, str] = {}
    start = 0
    while start < n:
        status[:] = -1
        _decode(fps, np.int64(handle), ptrs[start:], sizes[start:], dims[start:], crops[start:], dst[start:], scratch, rows, taps, status)
        if status[0] < 0:
            break
        i = start + int(status[0])
        failed[i] = f"libjpeg-turbo: {_message(handle)} ({_STAGES[int(status[1])]})"
        handle = _fresh_handle()
        start = i + 1
    return failed


#: (source height, width, output height, width) -> the scratch sizes decode_one needs (a plain dict: threads share it)
_SIZES: dict[tuple[int, int, int, int], tuple[int, int, int]] = {}


def decode_one(data: np.ndarray, size: tuple[int, int] | None, crop: Any, out: np.ndarray | None) -> np.ndarray | None:
    """One JPEG (1-D uint8 ``data``) decoded, cropped and resized into ``out`` (or a new array), with two compiled calls.

    The per-image path of :func:`stoker.io.decode_image`: no per-call arrays besides the output,
    this thread's buffers reused. Returns ``None`` where the general path must decide (not a
    header libjpeg-turbo reads, a CMYK or YCCK JPEG, a crop or ``out`` that does not fit, a
    decoding failure or warning): it then decodes again and says why, or reads it with Pillow.
    """
    handle = np.int64(_thread_handle())
    fps = _fps()
    info = _local.info
    if info is None:
        info = _local.info = np.zeros(3, dtype=np.int64)
    if not _header_one(fps, handle, data, info):
        _fresh_handle()
        return None
    h, w, cs = int(info[0]), int(info[1]), int(info[2])
    if cs in NOT_RGB_COLORSPACES:
        return None
    if crop is None:
        y0, x0, ch, cw = 0, 0, h, w
    else:
        try:
            y0, x0, ch, cw = check_crop(crop, h, w)
        except ValueError:
            return None
    oh, ow = size if size is not None else (ch, cw)
    if out is None:
        out = np.empty((oh, ow, 3), dtype=np.uint8)
    elif out.shape != (oh, ow, 3) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        return None
    key = (h, w, oh, ow)
    sizes = _SIZES.get(key)
    if sizes is None:
        if len(_SIZES) >= 1024:
            _SIZES.clear()
        sizes = _SIZES[key] = (
            int(kernels.jpeg_scratch_size(h, w)),
            int(kernels.resize_scratch_size(h, w, oh, ow)),
            int(kernels.resize_taps_size(oh, ow)),
        )
    scratch = _buffer("scratch", sizes[0], np.uint8)
    rows = _buffer("rows", sizes[1], np.float32)
    taps = _buffer("taps", sizes[2], np.int64)
    f64 = float
    stage = _decode_one(fps, handle, data, h, w, f64(y0), f64(x0), f64(ch), f64(cw), out, scratch, rows, taps)
    if stage >= 0:
        _fresh_handle()
        return None
    return out


def resize_into(image: np.ndarray, crop: tuple[float, float, float, float], dst: np.ndarray) -> None:
    """Resample the ``crop`` (y, x, h, w) of an HWC uint8 ``image`` into ``dst`` (oh, ow, 3), without the GIL."""
    src = np.ascontiguousarray(image)
    # (the kernel reads the crop's pixels without bounds checks: an empty image or a crop outside it read other memory)
    if src.ndim != 3 or src.shape[2] != 3 or dst.ndim != 3 or dst.shape[2] != 3 or 0 in src.shape or 0 in dst.shape:
        raise ValueError(f"resize needs a non-empty (h, w, 3) image and output; got {src.shape} -> {dst.shape}")
    h, w = int(src.shape[0]), int(src.shape[1])
    oh, ow = int(dst.shape[0]), int(dst.shape[1])
    y0, x0, ch, cw = (float(v) for v in crop)
    if not (y0 >= 0 and x0 >= 0 and ch > 0 and cw > 0 and y0 + ch <= h and x0 + cw <= w):
        raise ValueError(f"crop {crop!r} (y, x, height, width) must lie inside the {h}x{w} image")
    rows = _buffer("rows", int(kernels.resize_scratch_size(h, w, oh, ow)), np.float32)
    taps = _buffer("taps", int(kernels.resize_taps_size(oh, ow)), np.int64)
    _resize(src.reshape(-1), np.int64(0), np.int64(w * 3), np.int64(h), np.int64(w), y0, x0, ch, cw, dst, rows, taps)


def check_crop(crop: Any, h: int, w: int) -> tuple[int, int, int, int]:
    """``crop`` as ints (y, x, height, width) inside an ``h`` x ``w`` image.

    Raises:
        ValueError: it is not four ints or does not fit.
    """
    try:
        y, x, ch, cw = (int(v) for v in crop)
    except (TypeError, ValueError):
        raise ValueError(f"crop must be (y, x, height, width); got {crop!r}") from None
    if y < 0 or x < 0 or ch < 1 or cw < 1 or y + ch > h or x + cw > w:
        raise ValueError(f"crop {crop!r} (y, x, height, width) must lie inside the {h}x{w} image")
    return y, x, ch, cw
