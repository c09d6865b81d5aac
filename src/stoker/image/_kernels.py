"""Compiled image kernels: JPEG decoding (libjpeg-turbo), crop geometry and resizing.

Everything a kernel needs arrives as arguments (function pointers and per-thread
scratch included), so the kernels are cached on disk and allocate nothing per
image. Resizing (:mod:`stoker.image._resize`) crops, then resizes: it is
separable, *area* averaging when shrinking an axis, *bilinear* (half-pixel
centres, the crop's edge repeated) when enlarging it, computed in float32 and
rounded to nearest. A failed TurboJPEG call is recorded per sample with
libjpeg-turbo's own message. Whole images whose SOF marker (:func:`jpeg_size`) gives the
metadata's size are decoded without ``tj3DecompressHeader``, so libjpeg parses their header once.

The large kernels are called by symbol (:mod:`stoker.pipeline.linking`), not linked in: ``decode_images`` and
``decode_sample`` call ``_decode_one``, which calls ``resize``; each compiles once, on its own, and is cached on
its own (a cold start compiled ``_decode_one`` and ``resize`` again inside each caller: most of its 80 s of LLVM).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from stoker import _numba_cache
from stoker.fields.rgb_image import MODE_RAW
from stoker.image._copy import copy
from stoker.image._resize import resize
from stoker.image._resize import resize_scratch_size as resize_scratch_size  # re-exported for the decoders, stoker.io
from stoker.image._resize import resize_taps_size as resize_taps_size
from stoker.image._turbojpeg import (
    ERROR_MESSAGE_BYTES,
    JPEG_ROWS_OFFSET,
    MCU_WIDTH,
    TJERR_WARNING,
    TJPARAM_JPEGHEIGHT,
    TJPARAM_JPEGWIDTH,
    TJPARAM_SUBSAMP,
    TJPF_RGB,
)
from stoker.pipeline.compiler import by_symbol
from stoker.pipeline.native import address_as_pointer
from stoker.pipeline.random import uniform

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

KIND_SIMPLE, KIND_CENTER, KIND_RANDOM = 0, 1, 2
# arrays (the decoder's loader_arrays): ptrs, sizes, heights, widths, modes (the field's metadata columns), fps,
# handles (one per thread), scratch (uint8, per thread: a decoded JPEG), rows (float32) and taps (int64), per thread:
# resizing, status, messages, last, params, counts (images replaced)
# params layout (float64): kind, ratio (center), scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, dct_scaling, replace_on_error, crop_decode
# fps layout (int64): the addresses of _turbojpeg.KERNEL_FUNCTIONS (tj3DecompressHeader, tj3Get, tj3SetScalingFactor,
# tj3SetCroppingRegion, tj3Decompress8, tj3GetErrorStr, tj3GetErrorCode)
# status layout (int32, one row per sample of the batch): stage that failed (OK or ERR_*), tj3GetErrorCode, the JPEG
# header's height and width (ERR_SIZE); messages (uint8, one row per sample): libjpeg-turbo's message, NUL-terminated;
# last (int64): failures in the last batch, position in the batch and sample index of the first one
OK, ERR_HEADER, ERR_SIZE, ERR_SCALE, ERR_CROP, ERR_DECODE, ERR_THREAD = 0, 1, 2, 3, 4, 5, 6
#: the TurboJPEG function behind each status
STAGES = {
    ERR_HEADER: "tj3DecompressHeader",
    ERR_SIZE: "tj3DecompressHeader",
    ERR_SCALE: "tj3SetScalingFactor",
    ERR_CROP: "tj3SetCroppingRegion",
    ERR_DECODE: "tj3Decompress8",
}
#: columns of the status array and bytes of a message row
STATUS_COLUMNS, MESSAGE_BYTES = 4, ERROR_MESSAGE_BYTES


def _ccall_codegen(restype: ir.Type, args: types.BaseTuple):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, llargs):  # type: ignore[no-untyped-def]
        fp, tup = llargs
        argtys = [context.get_value_type(t) for t in args.types]
        values = cgutils.unpack_tuple(builder, tup, len(args.types))
        fnty = ir.FunctionType(restype, argtys)
        return builder.call(builder.inttoptr(fp, fnty.as_pointer()), values)

    return codegen


@intrinsic
def _ccall(typingctx, fptr, args):  # type: ignore[no-untyped-def]
    """``int32 (*fptr)(args...)``: call a C function through a pointer held in an integer."""
    if not isinstance(fptr, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    return types.int32(fptr, args), _ccall_codegen(ir.IntType(32), args)


@intrinsic
def _ccall_p(typingctx, fptr, args):  # type: ignore[no-untyped-def]
    """``void *(*fptr)(args...)``: as :func:`_ccall`, for a function that returns a pointer (as an int64)."""
    if not isinstance(fptr, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    return types.int64(fptr, args), _ccall_codegen(ir.IntType(64), args)


@intrinsic
def _peek(typingctx, addr):  # type: ignore[no-untyped-def]
    """The byte at address ``addr``."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, llargs):  # type: ignore[no-untyped-def]
        return builder.load(builder.inttoptr(llargs[0], ir.IntType(8).as_pointer()))

    return types.uint8(addr), codegen


@numba.njit(nogil=True, cache=True)
def center_crop(h: int, w: int, ratio: float) -> tuple[int, int, int, int]:
    """FFCV's centre crop: a centred square of side ``ratio * min(h, w)``; returns (y, x, ch, cw)."""
    c = max(1, int(ratio * min(h, w)))
    return (h - c) // 2, (w - c) // 2, c, c


@numba.njit(nogil=True, cache=True)
def random_resized_crop(
    h: int, w: int, seed: np.uint64, scale_lo: float, scale_hi: float, lr_lo: float, lr_hi: float
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop geometry, every draw from the sample's ``seed``; returns (y, x, ch, cw)."""
    area = h * w
    for attempt in range(10):
        target = area * (scale_lo + (scale_hi - scale_lo) * uniform(seed, 4 * attempt))
        aspect = math.exp(lr_lo + (lr_hi - lr_lo) * uniform(seed, 4 * attempt + 1))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            y = int(uniform(seed, 4 * attempt + 2) * (h - ch + 1))
            x = int(uniform(seed, 4 * attempt + 3) * (w - cw + 1))
            return y, x, ch, cw
    in_ratio = w / h
    if in_ratio < math.exp(lr_lo):
        cw = w
        ch = int(round(cw / math.exp(lr_lo)))
    elif in_ratio > math.exp(lr_hi):
        ch = h
        cw = int(round(ch * math.exp(lr_hi)))
    else:
        cw, ch = w, h
    ch, cw = max(1, min(ch, h)), max(1, min(cw, w))
    return (h - ch) // 2, (w - cw) // 2, ch, cw


@numba.njit(nogil=True, cache=True)
def _pack(lo: int, hi: int) -> np.int64:
    return np.int64(np.uint64(lo) | (np.uint64(hi) << np.uint64(32)))


@numba.njit(nogil=True, cache=True)
def _fail(fps, handle, stage, row, message, warnings_only):  # type: ignore[no-untyped-def]
    """Record a failed stage with libjpeg-turbo's error code and message; returns ``stage``.

    Runs on the thread whose call failed: libjpeg's messages live in a thread-local buffer, which
    ``tj3GetErrorStr`` returns when the handle holds no error of its own. With ``warnings_only``
    (the stage's call itself succeeded) the message is kept only if that call emitted a warning,
    since otherwise the buffer holds an older message.
    """
    row[0] = stage
    row[1] = _ccall(fps[6], (handle,))
    n = 0
    if not warnings_only or row[1] == TJERR_WARNING:
        p = _ccall_p(fps[5], (handle,))
        while p != 0 and n < message.shape[0] - 1:
            c = _peek(p + n)
            if c == 0:
                break
            message[n] = c
            n += 1
    message[n] = 0
    return stage


@numba.njit(nogil=True, cache=True)
def _reset(fps, handle, stage):  # type: ignore[no-untyped-def]
    """Leave ``handle`` ready for the next JPEG after a failed ``tj3DecompressHeader``; returns ``stage``.

    When libjpeg fails inside the header (an error, not a warning), ``tj3DecompressHeader``
    returns without aborting the decompressor, which stays half-way through that header:
    every later call on the handle would go on reading the next JPEG as the rest of it, and
    fail (libjpeg's "Bogus marker length"), good JPEGs included. ``tj3Decompress8`` with
    invalid arguments fails before reading anything and aborts the decompressor on its way
    out, which is all this call is for (its own error replaces the one already recorded).
    """
    zero = np.int64(0)
    _ccall(fps[4], (handle, zero, zero, zero, np.int32(0), np.int32(0)))
    return stage


@numba.njit(nogil=True, cache=True)
def jpeg_rows(address, width):  # type: ignore[no-untyped-def]
    """(start, pitch) of an RGB image ``width`` pixels wide decoded into scratch memory at ``address``.

    Every row starts ``JPEG_ROWS_OFFSET`` bytes past a 32-byte boundary (the pitch is a
    multiple of 32): libjpeg-turbo's x86 colour conversion writes a row that starts on a
    16- or 32-byte boundary with non-temporal stores, past the cache the resize reads from.
    The scratch must hold :func:`jpeg_scratch_size` bytes.
    """
    start = (JPEG_ROWS_OFFSET - address) % 32
    return start, (width * 3 + 31) // 32 * 32


def jpeg_scratch_size(h: Any, w: Any) -> Any:
    """Bytes of scratch :func:`jpeg_rows` needs to decode an ``h`` x ``w`` JPEG (ints, or arrays of them)."""
    return h * ((w * 3 + 31) // 32 * 32) + 32


@numba.njit(nogil=True, cache=True)
def jpeg_size(data, start, size):  # type: ignore[no-untyped-def]
    """The (height, width) of the JPEG in ``data[start:start + size]``, read from its first SOF marker as libjpeg does.

    Walks the markers from SOI to the first SOF, as libjpeg's ``read_markers`` does, and
    refuses (returns ``(-1, -1)``) every stream where libjpeg would do anything but read
    the same SOF: no SOI, bytes between markers (libjpeg skips them with a warning), a
    second SOI, SOS or EOI before any SOF, an unsupported or unknown marker, a segment
    length below 2, or a stream that ends first. So a size returned here is the size
    ``tj3Decompress8`` will decode, without a ``tj3DecompressHeader`` call (which parses
    the header only for ``tj3Decompress8`` to parse it again).
    """
    start, size = np.int64(start), np.int64(size)
    end = start + size
    if size < 4 or end > data.shape[0] or data[start] != 0xFF or data[start + 1] != 0xD8:
        return -1, -1
    pos = start + 2
    while pos < end:
        if data[pos] != 0xFF:  # libjpeg would skip these bytes, with a warning
            return -1, -1
        while pos < end and data[pos] == 0xFF:  # fill bytes
            pos += 1
        if pos >= end:
            return -1, -1
        marker = data[pos]
        pos += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no segment
            continue
        if pos + 2 > end:
            return -1, -1
        length = (np.int64(data[pos]) << 8) | np.int64(data[pos + 1])
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC9, 0xCA, 0xCB):  # the SOF markers libjpeg decodes
            if length < 8 or pos + 7 > end:
                return -1, -1
            height = (np.int64(data[pos + 3]) << 8) | np.int64(data[pos + 4])
            width = (np.int64(data[pos + 5]) << 8) | np.int64(data[pos + 6])
            return height, width
        if not (marker in (0xC4, 0xCC, 0xDB, 0xDC, 0xDD, 0xFE) or 0xE0 <= marker <= 0xEF) or length < 2:
            return -1, -1  # SOI, SOS, EOI, an unsupported SOF or an unknown marker: libjpeg stops or fails
        pos += length
    return -1, -1


def _large_by_symbol(fn: Any) -> Any:
    """``fn`` calling the kernels it reads that are marked large (``stoker_large``) by symbol, each compiled on its own.

    Linked in, each such callee's LLVM code would be optimised again inside every caller (the resize kernel inside
    the JPEG decoder, the decoder inside :func:`decode_sample` and :func:`decode_images`' parallel and serial builds):
    most of a cold start's compile. A call through a symbol costs nothing next to a JPEG decode. In debug mode (bounds
    checks) everything stays linked. Only a function object is made here: nothing compiles at import.
    """
    return by_symbol(fn, large_only=True)


@numba.njit(nogil=True, cache=True)
@_large_by_symbol
def _decode_one(i, j, t, seed, dst, arrays, storage):  # type: ignore[no-untyped-def]
    """Decode sample ``j`` into ``dst[i]`` on thread ``t``; returns OK or the ERR_* status recorded in ``status[i]``."""
    ptrs, sizes, heights, widths, modes, fps, handles, scratches, rowses, tapses, status, messages, _, params, _ = arrays
    handle, scratch, rows, taps, row, message = handles[t], scratches[t], rowses[t], tapses[t], status[i], messages[i]
    h, w = int(heights[j]), int(widths[j])
    kind = int(params[0])
    oh, ow = dst.shape[1], dst.shape[2]
    if kind == KIND_SIMPLE:
        y0, x0, ch, cw = 0, 0, h, w
    elif kind == KIND_CENTER:
        y0, x0, ch, cw = center_crop(h, w, params[1])
    else:
        y0, x0, ch, cw = random_resized_crop(h, w, seed, params[2], params[3], params[4], params[5])
    base = storage.ctypes.data + ptrs[j]
    if modes[j] == MODE_RAW:
        if kind == KIND_SIMPLE:
            copy(dst[i].reshape(-1), 0, storage, ptrs[j], h * w * 3)
        else:
            # (the sample's bytes as a writable array and every size as int64: resize's one signature, see resize)
            src = numba.carray(address_as_pointer(base), h * w * 3, np.uint8)
            resize(
                src, np.int64(0), np.int64(w * 3), np.int64(h), np.int64(w), float(y0), float(x0), float(ch), float(cw), dst[i], rows, taps
            )
        return OK
    size = np.int64(sizes[j])
    pf = np.int32(TJPF_RGB)
    if kind == KIND_SIMPLE:
        # the header parsed once, by tj3Decompress8, when the SOF says the metadata's size (so the decode fits dst[i]);
        # anything else, a failure included, takes the checked path below, which records what went wrong
        sh, sw = jpeg_size(storage, ptrs[j], size)
        if sh == h and sw == w:
            _ccall(fps[2], (handle, _pack(1, 1)))
            _ccall(fps[3], (handle, np.int64(0), np.int64(0)))
            decoded = _ccall(fps[4], (handle, base, size, dst[i].ctypes.data, np.int32(w * 3), pf)) == 0
            # what libjpeg read, checked anyway: a disagreement with jpeg_size would be a bug in it
            if (
                decoded
                and _ccall(fps[1], (handle, np.int32(TJPARAM_JPEGHEIGHT))) == h
                and _ccall(fps[1], (handle, np.int32(TJPARAM_JPEGWIDTH))) == w
            ):
                return OK
    if _ccall(fps[0], (handle, base, size)) != 0:
        _fail(fps, handle, ERR_HEADER, row, message, False)
        return _reset(fps, handle, ERR_HEADER)
    hh = _ccall(fps[1], (handle, np.int32(TJPARAM_JPEGHEIGHT)))
    hw = _ccall(fps[1], (handle, np.int32(TJPARAM_JPEGWIDTH)))
    if hw != w or hh != h:  # the scratch buffers are sized from the metadata: never decode past them
        row[2], row[3] = hh, hw
        return _fail(fps, handle, ERR_SIZE, row, message, True)
    # DCT-domain scaling by 1/2, 1/4 or 1/8 (SIMD IDCTs; libjpeg-turbo's other M/8 IDCTs are plain C and
    # measured slower than a full decode plus resize): the smallest that keeps the crop at least the output's size
    num = 8
    if kind != KIND_SIMPLE and params[6] != 0.0:
        for m in (1, 2, 4):
            if ch * m >= 8 * oh and cw * m >= 8 * ow:
                num = m
                break
    g = 8 if num == 8 else (4 if num % 4 == 0 else (2 if num % 2 == 0 else 1))  # TurboJPEG lists factors in lowest terms
    if _ccall(fps[2], (handle, _pack(num // g, 8 // g))) != 0:
        return _fail(fps, handle, ERR_SCALE, row, message, False)
    if kind == KIND_SIMPLE:
        _ccall(fps[3], (handle, np.int64(0), np.int64(0)))
        if _ccall(fps[4], (handle, base, size, dst[i].ctypes.data, np.int32(w * 3), pf)) != 0:
            return _fail(fps, handle, ERR_DECODE, row, message, False)
        return OK
    scale = num / 8.0
    ws, hs = (w * num + 7) // 8, (h * num + 7) // 8
    fy0, fx0, fch, fcw = y0 * scale, x0 * scale, ch * scale, cw * scale
    subsamp = _ccall(fps[1], (handle, np.int32(TJPARAM_SUBSAMP)))
    mcu_full = MCU_WIDTH[subsamp] if 0 <= subsamp < len(MCU_WIDTH) else 16
    mcu = max(1, (mcu_full * num + 7) // 8)  # the scaled iMCU width: crop regions start on multiples of it
    if params[8] != 0.0:
        # decode only the rows and columns of the crop, and one more column on each side (within the image):
        # libjpeg upsamples chroma from the neighbouring samples and treats the side of a cropping region as
        # the image's, so without it the crop's edge columns would differ from a full decode's. Rows need no
        # margin: libjpeg decodes the rows around a cropping region for their chroma (context rows).
        rx0 = (max(0, int(math.floor(fx0)) - 1) // mcu) * mcu
        rx1 = min(ws, int(math.ceil(fx0 + fcw)) + 1)
        ry0 = int(math.floor(fy0))
        ry1 = min(hs, int(math.ceil(fy0 + fch)))
    else:
        rx0, rx1, ry0, ry1 = 0, ws, 0, hs
    rw, rh = rx1 - rx0, ry1 - ry0
    if rx0 == 0 and ry0 == 0 and rw == ws and rh == hs:
        _ccall(fps[3], (handle, np.int64(0), np.int64(0)))
    elif _ccall(fps[3], (handle, _pack(rx0, ry0), _pack(rw, rh))) != 0:
        return _fail(fps, handle, ERR_CROP, row, message, False)
    start, pitch = jpeg_rows(scratch.ctypes.data, rw)
    if _ccall(fps[4], (handle, base, size, scratch.ctypes.data + start, np.int32(pitch), pf)) != 0:
        return _fail(fps, handle, ERR_DECODE, row, message, False)
    resize(scratch, np.int64(start), np.int64(pitch), np.int64(rh), np.int64(rw), fy0 - ry0, fx0 - rx0, fch, fcw, dst[i], rows, taps)
    return OK


@numba.njit(nogil=True, cache=True)
def decode_begin(indices, dst, arrays):  # type: ignore[no-untyped-def]
    """Before a batch's samples are decoded: the batch fits the memory, no failure recorded yet."""
    status, last = arrays[10], arrays[12]
    n = indices.shape[0]
    if n > status.shape[0] or n > dst.shape[0]:
        raise ValueError("image decoder: a batch larger than the batch size it was built for")
    last[0] = 0


# seconds of LLVM work: compiled on its own and called by symbol, even from code run once per sample (a fused pipeline's)
_decode_one.stoker_large = True  # type: ignore[attr-defined]


def decode_sample_code(i, j, seed, dst, arrays, storage):  # type: ignore[no-untyped-def]
    """Decode sample ``j`` into ``dst[i]`` on this thread; a failure is recorded in ``status[i]``, and its image is
    zeros at once when failures are replaced (``replace``), before any operation after the decoder sees it.

    Python, compiled twice: as :func:`decode_sample` (which :func:`decode_images` calls) and into a fused
    pipeline's loop over samples, where it is inlined (a raw image is one copy); both call
    :func:`_decode_one` by symbol (compiled and cached on its own, as :func:`_decode_one` calls the resize kernel).
    """
    ptrs, heights, widths, modes, handles, status, params = arrays[0], arrays[2], arrays[3], arrays[4], arrays[6], arrays[10], arrays[13]
    status[i, 0] = OK
    if modes[j] == MODE_RAW and params[0] == KIND_SIMPLE:  # a copy: none of the decoder's per-thread state (the common small-image case)
        copy(dst.reshape(-1), i * dst.shape[1] * dst.shape[2] * 3, storage, ptrs[j], np.int64(heights[j]) * np.int64(widths[j]) * 3)
        return
    t = numba.get_thread_id()
    if t >= handles.shape[0]:  # more threads than handles: a pool larger than NUMBA_NUM_THREADS
        status[i, 0] = ERR_THREAD
    else:
        # (a prange index is unsigned, a range's signed: one signature of the decoder's seconds of LLVM work for both)
        _decode_one(np.int64(i), np.int64(j), t, seed, dst, arrays, storage)
    if status[i, 0] != OK and params[7] != 0.0:
        dst[i] = 0


decode_sample = numba.njit(nogil=True, cache=True)(_large_by_symbol(decode_sample_code))


@numba.njit(nogil=True, cache=True)
def decode_end(indices, dst, arrays):  # type: ignore[no-untyped-def]
    """After a batch's samples: the first failure in ``last``; then the batch raises, or (``replace``) they are counted."""
    status, last, params, counts = arrays[10], arrays[12], arrays[13], arrays[14]
    n = indices.shape[0]
    failed = 0
    for i in range(n):
        if status[i, 0] != OK:
            if failed == 0:
                last[1], last[2] = i, indices[i]
            failed += 1
    last[0] = failed
    if failed:
        if params[7] == 0.0:
            raise ValueError("image decoding failed: corrupt or truncated JPEG data, or a JPEG whose size differs from the metadata")
        counts[0] += failed


@numba.njit(nogil=True, parallel=True, cache=True)
def decode_images(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    """Decoder kernel: (indices, dst (B, oh, ow, 3), arrays, storage, seeds).

    Every failure is recorded per sample in ``status`` and ``messages`` and the first one in
    ``last``, for the decoder's ``describe_error``; then the batch raises, or (``replace``)
    the failed images become zeros and are counted.
    """
    decode_begin(indices, dst, arrays)
    for i in numba.prange(indices.shape[0]):
        decode_sample(i, indices[i], seeds[i] if seeds.shape[0] > 0 else np.uint64(0), dst, arrays, storage)
    decode_end(indices, dst, arrays)
    return dst
