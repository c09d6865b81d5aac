"""Compiled image kernels: JPEG decoding (libjpeg-turbo), crop geometry and resizing.

Everything a kernel needs arrives as arguments (function pointers included),
so the kernels are cached on disk. Resizing is separable: *area* averaging
when shrinking an axis, *bilinear* (half-pixel centres) when enlarging it,
computed in float32 and rounded to nearest.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from stoker.fields._copy import copy
from stoker.pipeline.random import uniform

MODE_RAW = 0
KIND_SIMPLE, KIND_CENTER, KIND_RANDOM = 0, 1, 2
# params layout (float64): kind, ratio (center), scale_lo, scale_hi, log_ratio_lo, log_ratio_hi, dct_scaling, replace_on_error, crop_decode
# fps layout (int64): tj3DecompressHeader, tj3Get, tj3SetScalingFactor, tj3SetCroppingRegion, tj3Decompress8
OK, ERR_HEADER, ERR_SIZE, ERR_DECODE = 0, 1, 2, 3
_MCU = (8, 16, 16, 8, 8, 32, 8)


@intrinsic
def _ccall(typingctx, fptr, args):  # type: ignore[no-untyped-def]
    """``int32 (*fptr)(args...)``: call a C function through a pointer held in an integer."""
    if not isinstance(fptr, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    sig = types.int32(fptr, args)

    def codegen(context, builder, signature, llargs):  # type: ignore[no-untyped-def]
        fp, tup = llargs
        argtys = [context.get_value_type(t) for t in args.types]
        values = cgutils.unpack_tuple(builder, tup, len(args.types))
        fnty = ir.FunctionType(ir.IntType(32), argtys)
        return builder.call(builder.inttoptr(fp, fnty.as_pointer()), values)

    return sig, codegen


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
def _taps(s0, size, n_out, n_src):  # type: ignore[no-untyped-def]
    """Per output index: first source index, tap count and weights (area when shrinking, bilinear when enlarging)."""
    f = size / n_out
    width = int(math.ceil(f)) + 2 if f > 1.0 else 2
    first = np.empty(n_out, np.int64)
    count = np.empty(n_out, np.int64)
    weights = np.zeros((n_out, width), np.float32)
    for o in range(n_out):
        if f > 1.0:
            a = s0 + o * f
            b = a + f
            lo = int(math.floor(a))
            hi = int(math.ceil(b))
            first[o] = lo
            count[o] = hi - lo
            for x in range(lo, hi):
                weights[o, x - lo] = (min(b, x + 1.0) - max(a, float(x))) / f
        else:
            c = s0 + (o + 0.5) * f - 0.5
            lo = int(math.floor(c))
            t = c - lo
            first[o] = lo
            count[o] = 2
            weights[o, 0] = 1.0 - t
            weights[o, 1] = t
        # clamp: fold taps that fall outside the source onto its edge
        for k in range(count[o]):
            x = first[o] + k
            if x < 0 or x >= n_src:
                edge = 0 if x < 0 else n_src - 1
                w = weights[o, k]
                weights[o, k] = 0.0
                weights[o, edge - first[o]] += w if 0 <= edge - first[o] < width else 0.0
    return first, count, weights


@numba.njit(nogil=True, cache=True)
def resize(src, off, pitch, src_h, src_w, sy0, sx0, sh, sw, dst, scratch):  # type: ignore[no-untyped-def]
    """Resample the rectangle (sy0, sx0, sh, sw) of an HWC uint8 image into ``dst`` (oh, ow, 3).

    ``src`` is a flat uint8 array; pixel (y, x, c) is at ``off + y * pitch + 3 * x + c``.
    ``scratch`` is a flat float32 array of at least ``resize_scratch_size`` elements.
    Taps outside the image repeat its edge. The vertical pass (contiguous rows,
    vectorised) runs first when it shrinks the image, so that fewer rows go
    through the horizontal pass; otherwise the horizontal pass runs first.
    """
    oh, ow = dst.shape[0], dst.shape[1]
    xf, xn, xw = _taps(sx0, sw, ow, src_w)
    yf, yn, yw = _taps(sy0, sh, oh, src_h)
    r_lo = max(0, yf.min())
    r_hi = min(src_h, (yf + yn).max())
    c_lo = max(0, xf.min())
    c_hi = min(src_w, (xf + xn).max())
    out = dst.reshape((oh, ow * 3))
    p3 = numba.uint64(pitch)
    if r_hi - r_lo > oh:
        # vertical first: tmp[oy, 3 * (x - c_lo) + c] over the needed columns
        width = numba.uint64(3 * (c_hi - c_lo))
        for oy in range(oh):
            row = scratch[oy * width : (oy + 1) * width]
            row[:] = 0.0
            for k in range(yn[oy]):
                wgt = yw[oy, k]
                if wgt != 0.0:
                    base = numba.uint64(off) + numba.uint64(yf[oy] + k) * p3 + numba.uint64(3 * c_lo)
                    for c in range(width):
                        row[c] += wgt * np.float32(src[base + c])
        for oy in range(oh):
            row = scratch[oy * width : (oy + 1) * width]
            for ox in range(ow):
                a0 = a1 = a2 = np.float32(0.0)
                for k in range(xn[ox]):
                    wgt = xw[ox, k]
                    if wgt != 0.0:
                        q = numba.uint64(3 * (xf[ox] + k - c_lo))
                        a0 += wgt * row[q]
                        a1 += wgt * row[q + numba.uint64(1)]
                        a2 += wgt * row[q + numba.uint64(2)]
                out[oy, 3 * ox] = np.uint8(min(np.float32(255.0), max(np.float32(0.0), a0 + np.float32(0.5))))
                out[oy, 3 * ox + 1] = np.uint8(min(np.float32(255.0), max(np.float32(0.0), a1 + np.float32(0.5))))
                out[oy, 3 * ox + 2] = np.uint8(min(np.float32(255.0), max(np.float32(0.0), a2 + np.float32(0.5))))
        return
    # horizontal first: rows[r - r_lo, 3 * ox + c] for the rows the vertical pass reads
    n = numba.uint64(ow * 3)
    for r in range(r_lo, r_hi):
        base = numba.uint64(off) + numba.uint64(r) * p3
        dst_row = scratch[numba.uint64(r - r_lo) * n : numba.uint64(r - r_lo + 1) * n]
        for ox in range(ow):
            a0 = a1 = a2 = np.float32(0.0)
            for k in range(xn[ox]):
                wgt = xw[ox, k]
                if wgt != 0.0:
                    p = base + numba.uint64(3 * (xf[ox] + k))
                    a0 += wgt * np.float32(src[p])
                    a1 += wgt * np.float32(src[p + numba.uint64(1)])
                    a2 += wgt * np.float32(src[p + numba.uint64(2)])
            dst_row[3 * ox] = a0
            dst_row[3 * ox + 1] = a1
            dst_row[3 * ox + 2] = a2
    acc = np.empty(n, np.float32)
    for oy in range(oh):  # vertical pass: contiguous rows, vectorised
        acc[:] = 0.0
        for k in range(yn[oy]):
            wgt = yw[oy, k]
            if wgt != 0.0:
                row = scratch[numba.uint64(yf[oy] + k - r_lo) * n : numba.uint64(yf[oy] + k - r_lo + 1) * n]
                for c in range(n):
                    acc[c] += wgt * row[c]
        for c in range(n):
            out[oy, c] = np.uint8(min(np.float32(255.0), max(np.float32(0.0), acc[c] + np.float32(0.5))))


def resize_scratch_size(max_h: int, max_w: int, oh: int, ow: int) -> int:
    """Float32 elements of scratch that :func:`resize` needs for images up to ``max_h`` x ``max_w``."""
    return max((max_h + 2) * ow * 3, oh * (max_w + 2) * 3, 1)


@numba.njit(nogil=True, cache=True)
def _pack(lo: int, hi: int) -> np.int64:
    return np.int64(np.uint64(lo) | (np.uint64(hi) << np.uint64(32)))


@numba.njit(nogil=True, cache=True)
def _decode_one(i, j, dst, ptrs, sizes, heights, widths, modes, fps, handle, scratch, rows, seed, params, storage):  # type: ignore[no-untyped-def]
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
            resize(storage, ptrs[j], w * 3, h, w, float(y0), float(x0), float(ch), float(cw), dst[i], rows)
        return OK
    if _ccall(fps[0], (handle, base, np.int64(sizes[j]))) != 0:
        return ERR_HEADER
    if _ccall(fps[1], (handle, np.int32(5))) != w or _ccall(fps[1], (handle, np.int32(6))) != h:
        return ERR_SIZE
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
        return ERR_DECODE
    if kind == KIND_SIMPLE:
        _ccall(fps[3], (handle, np.int64(0), np.int64(0)))
        if _ccall(fps[4], (handle, base, np.int64(sizes[j]), dst[i].ctypes.data, np.int32(w * 3), np.int32(0))) != 0:
            return ERR_DECODE
        return OK
    scale = num / 8.0
    ws, hs = (w * num + 7) // 8, (h * num + 7) // 8
    fy0, fx0, fch, fcw = y0 * scale, x0 * scale, ch * scale, cw * scale
    subsamp = _ccall(fps[1], (handle, np.int32(4)))
    mcu_full = _MCU[subsamp] if 0 <= subsamp < 7 else 16
    mcu = max(1, (mcu_full * num + 7) // 8)  # the scaled iMCU width: crop regions start on multiples of it
    if params[8] != 0.0:  # decode only the rows and columns of the crop
        rx0 = (int(math.floor(fx0)) // mcu) * mcu
        rx1 = min(ws, int(math.ceil(fx0 + fcw)))
        ry0 = int(math.floor(fy0))
        ry1 = min(hs, int(math.ceil(fy0 + fch)))
    else:
        rx0, rx1, ry0, ry1 = 0, ws, 0, hs
    rw, rh = rx1 - rx0, ry1 - ry0
    if rx0 == 0 and ry0 == 0 and rw == ws and rh == hs:
        _ccall(fps[3], (handle, np.int64(0), np.int64(0)))
    elif _ccall(fps[3], (handle, _pack(rx0, ry0), _pack(rw, rh))) != 0:
        return ERR_DECODE
    if _ccall(fps[4], (handle, base, np.int64(sizes[j]), scratch.ctypes.data, np.int32(rw * 3), np.int32(0))) != 0:
        return ERR_DECODE
    resize(scratch, 0, rw * 3, rh, rw, fy0 - ry0, fx0 - rx0, fch, fcw, dst[i], rows)
    return OK


@numba.njit(nogil=True, parallel=True, cache=True)
def decode_images(indices, dst, arrays, storage, seeds):  # type: ignore[no-untyped-def]
    """Decoder kernel: (indices, dst (B, oh, ow, 3), arrays, storage, seeds)."""
    ptrs, sizes, heights, widths, modes, fps, handles, scratch, rows, status, params, counts = arrays
    n = indices.shape[0]
    for i in numba.prange(n):
        t = numba.get_thread_id()
        seed = seeds[i] if seeds.shape[0] > 0 else np.uint64(0)
        status[i] = _decode_one(
            i, indices[i], dst, ptrs, sizes, heights, widths, modes, fps, handles[t], scratch[t], rows[t], seed, params, storage
        )
    failed = 0
    for i in range(n):
        if status[i] != OK:
            failed += 1
            if params[7] != 0.0:
                dst[i] = 0
    if failed:
        if params[7] == 0.0:
            raise ValueError("image decoding failed: corrupt or truncated JPEG data, or a JPEG whose size differs from the metadata")
        counts[0] += failed
    return dst
