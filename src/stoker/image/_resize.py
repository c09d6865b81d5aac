"""The resize kernel: crop a box of an HWC uint8 image, then resample it, separably and without allocating.

Shrinking an axis averages areas; enlarging it interpolates bilinearly (half-pixel centres). Taps that
fall outside the box (rounded out to whole pixels) repeat its edge: the box is cropped, then resized,
whatever else of the image lies around it. Arithmetic is float32, rounded to nearest at the end.

Each axis gets ``K`` taps per output (the most any output needs), in a window of ``K`` consecutive
source pixels that lies inside the box; folded and zero weights fill it. The passes then run with no
branch per tap:

- vertical: ``K`` whole rows combined per output row, a contiguous loop that LLVM vectorises;
- horizontal: per output pixel, ``K`` loads of four floats (its RGB and the next pixel's R, unused),
  four pixels at a time, written as LLVM vector IR (:func:`_hrow`): Numba leaves LLVM's SLP vectoriser
  off and the loop vectoriser would need gathers, which LLVM avoids on many x86 CPUs.

When the vertical axis shrinks the vertical pass runs first, one output row at a time, and the
horizontal pass reads the row it made (in L1); otherwise the horizontal pass runs first, over the
source rows the vertical pass reads.
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

_numba_cache.register()  # before its cache=True kernels: their compiled code is kept in stoker's private folder only

_U = numba.uint64
_F = np.float32
#: pixels per step of the horizontal pass, and the float32 lanes each takes (RGB and one spare)
GROUP, LANES = 4, 4
_KEEP = [p * LANES + c for p in range(GROUP) for c in range(3)]  # the RGB lanes of a group


def _hrow_codegen(to_u8: bool):  # type: ignore[no-untyped-def]
    f32, i32 = ir.FloatType(), ir.IntType(32)
    pixel, vec = ir.VectorType(f32, LANES), ir.VectorType(f32, GROUP * LANES)
    width = GROUP * LANES

    def codegen(context, builder, signature, llargs):  # type: ignore[no-untyped-def]
        row, xq, wt, out, groups, kx = llargs
        i64 = ir.IntType(64)
        acc = cgutils.alloca_once(builder, vec)
        with cgutils.for_range(builder, groups) as g_loop:
            g = g_loop.index
            builder.store(ir.Constant(vec, [0.0] * width), acc)
            with cgutils.for_range(builder, kx) as k_loop:
                k = k_loop.index
                three_k = builder.mul(k, ir.Constant(i64, 3))
                parts = []
                for p in range(GROUP):
                    at = builder.add(
                        xq, builder.shl(builder.add(builder.mul(g, ir.Constant(i64, GROUP)), ir.Constant(i64, p)), ir.Constant(i64, 2))
                    )
                    q = builder.sext(builder.load(builder.inttoptr(at, i32.as_pointer()), align=4, typ=i32), i64)
                    src = builder.add(row, builder.shl(builder.add(q, three_k), ir.Constant(i64, 2)))
                    parts.append(builder.load(builder.inttoptr(src, pixel.as_pointer()), align=4, typ=pixel))
                while len(parts) > 1:  # concatenate: 4 + 4 -> 8, 8 + 8 -> 16 lanes
                    n = 2 * parts[0].type.count
                    mask = ir.Constant(ir.VectorType(i32, n), list(range(n)))
                    parts = [builder.shuffle_vector(parts[i], parts[i + 1], mask) for i in range(0, len(parts), 2)]
                w_at = builder.add(wt, builder.shl(builder.add(builder.mul(g, kx), k), ir.Constant(i64, 6)))
                w = builder.load(builder.inttoptr(w_at, vec.as_pointer()), align=4, typ=vec)
                builder.store(builder.fadd(builder.load(acc, typ=vec), builder.fmul(parts[0], w)), acc)
            res = builder.load(acc, typ=vec)
            keep = ir.Constant(ir.VectorType(i32, len(_KEEP)), _KEEP)
            if to_u8:
                res = builder.fadd(res, ir.Constant(vec, [0.5] * width))
                ints = builder.trunc(builder.fptosi(res, ir.VectorType(i32, width)), ir.VectorType(ir.IntType(8), width))
                rgb = builder.shuffle_vector(ints, ints, keep)
                dst = builder.add(out, builder.mul(g, ir.Constant(i64, 3 * GROUP)))
                builder.store(rgb, builder.inttoptr(dst, rgb.type.as_pointer()), align=1)
            else:
                rgb = builder.shuffle_vector(res, res, keep)
                dst = builder.add(out, builder.mul(g, ir.Constant(i64, 4 * 3 * GROUP)))
                builder.store(rgb, builder.inttoptr(dst, rgb.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _hrow_typer(to_u8: bool):  # type: ignore[no-untyped-def]
    def typer(typingctx, row, xq, wt, out, groups, kx):  # type: ignore[no-untyped-def]
        if not all(isinstance(a, types.Integer) for a in (row, xq, wt, out, groups, kx)):
            return None
        return types.none(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64), _hrow_codegen(to_u8)

    return typer


_hrow_u8 = intrinsic(_hrow_typer(True))
_hrow_u8.__doc__ = """The horizontal pass of :data:`GROUP` * ``groups`` pixels into uint8 (addresses as int64s); see :func:`_hrow`."""
_hrow_f32 = intrinsic(_hrow_typer(False))
_hrow_f32.__doc__ = """As :data:`_hrow_u8`, into float32, unrounded."""


@numba.njit(nogil=True, cache=True)
def _hrow(row, xq, wt, wx, kx, ow, out, to_u8):  # type: ignore[no-untyped-def]
    """One row of the horizontal pass: ``out[3 * ox + c] = sum_k wx[ox * kx + k] * row[xq[ox] + 3 * k + c]``.

    ``row`` (float32) is read one float past the last pixel a window reaches (the spare lane); ``wt``
    holds the weights of ``wx`` four times each, per group of pixels (see :func:`resize`). ``out`` is
    uint8 (rounded: ``to_u8``) or float32 (not). Whole groups run as vector code, the rest of the row here.
    """
    groups = ow // GROUP
    if groups > 0:
        # what the vector code reads and writes, read here so that a bounds-checked build checks it
        last = (groups * GROUP - 1) * kx + kx - 1
        _ = row[xq[groups * GROUP - 1] + 3 * (kx - 1) + 3] + wt[(groups * kx) * GROUP * LANES - 1] + wx[last]
        out[groups * GROUP * 3 - 1] = out[groups * GROUP * 3 - 1]
        if to_u8:
            _hrow_u8(row.ctypes.data, xq.ctypes.data, wt.ctypes.data, out.ctypes.data, groups, kx)
        else:
            _hrow_f32(row.ctypes.data, xq.ctypes.data, wt.ctypes.data, out.ctypes.data, groups, kx)
    half = _F(0.5) if to_u8 else _F(0.0)
    for ox in range(groups * GROUP, ow):
        q = _U(xq[ox])
        a0 = a1 = a2 = _F(0.0)
        for k in range(kx):
            wgt = wx[ox * kx + k]
            p = q + _U(3 * k)
            a0 += wgt * row[p]
            a1 += wgt * row[p + _U(1)]
            a2 += wgt * row[p + _U(2)]
        o = _U(3 * ox)
        out[o] = a0 + half
        out[o + _U(1)] = a1 + half
        out[o + _U(2)] = a2 + half


@numba.njit(nogil=True, cache=True)
def _vrow(src, base, stride, wy, k0, ky, n, out, acc, to_u8):  # type: ignore[no-untyped-def]
    """One row of the vertical pass: ``out[j] = sum_k wy[k0 + k] * src[base + k * stride + j]`` for ``j < n``.

    ``out`` is float32 (unrounded) or uint8 (rounded: ``to_u8``). Up to four taps run in one contiguous
    loop; more accumulate in ``acc`` (float32, ``n`` elements), pass by pass.
    """
    half = _F(0.5) if to_u8 else _F(0.0)
    nu, b, st = _U(n), _U(base), _U(stride)
    s0, w0 = src[b:], wy[k0]
    if ky == 1:
        for j in range(nu):
            out[j] = w0 * _F(s0[j]) + half
        return
    s1, w1 = src[b + st :], wy[k0 + 1]
    if ky == 2:
        for j in range(nu):
            out[j] = w0 * _F(s0[j]) + w1 * _F(s1[j]) + half
        return
    s2, w2 = src[b + _U(2) * st :], wy[k0 + 2]
    if ky == 3:
        for j in range(nu):
            out[j] = w0 * _F(s0[j]) + w1 * _F(s1[j]) + w2 * _F(s2[j]) + half
        return
    s3, w3 = src[b + _U(3) * st :], wy[k0 + 3]
    if ky == 4:
        for j in range(nu):
            out[j] = w0 * _F(s0[j]) + w1 * _F(s1[j]) + w2 * _F(s2[j]) + w3 * _F(s3[j]) + half
        return
    for j in range(nu):
        acc[j] = w0 * _F(s0[j]) + w1 * _F(s1[j]) + w2 * _F(s2[j]) + w3 * _F(s3[j])
    for k in range(4, ky):
        sk, wk = src[b + _U(k) * st :], wy[k0 + k]
        for j in range(nu):
            acc[j] += wk * _F(sk[j])
    for j in range(nu):
        out[j] = acc[j] + half


@numba.njit(nogil=True, cache=True)
def _axis(s0, size, n_out, n_src, first, weights):  # type: ignore[no-untyped-def]
    """The taps of one axis: returns ``K``; output ``o`` reads source pixels ``first[o] .. first[o] + K - 1``
    with weights ``weights[o * K .. o * K + K - 1]``.

    Area averaging when shrinking, bilinear when enlarging. The box ``[s0, s0 + size)``, rounded out to
    whole pixels and within ``[0, n_src)``, bounds every window: a tap outside it adds its weight to the
    box's edge pixel (crop, then resize). ``weights`` holds at least ``n_src + 3 * n_out`` elements.
    """
    lo_edge = max(0, int(math.floor(s0)))
    hi_edge = max(lo_edge + 1, min(n_src, int(math.ceil(s0 + size))))
    f = size / n_out
    k = 2
    if f > 1.0:
        k = 1
        for o in range(n_out):
            a = s0 + o * f
            k = max(k, int(math.ceil(a + f)) - int(math.floor(a)))
    k = min(k, hi_edge - lo_edge)
    for o in range(n_out):
        row = weights[o * k : (o + 1) * k]
        row[:] = 0.0
        if f > 1.0:
            a = s0 + o * f
            b = a + f
            lo = int(math.floor(a))
            hi = int(math.ceil(b))
        else:
            c = s0 + (o + 0.5) * f - 0.5
            lo = int(math.floor(c))
            hi = lo + 2
        start = min(max(lo, lo_edge), hi_edge - k)
        first[o] = start
        for x in range(lo, hi):
            if f > 1.0:
                wgt = (min(b, x + 1.0) - max(a, float(x))) / f
            else:
                t = c - lo
                wgt = 1.0 - t if x == lo else t
            row[min(max(x, lo_edge), hi_edge - 1) - start] += wgt
    return k


@numba.njit(nogil=True, cache=True)
def resize(src, off, pitch, src_h, src_w, sy0, sx0, sh, sw, dst, scratch, taps):  # type: ignore[no-untyped-def]
    """Resample the box (sy0, sx0, sh, sw) of an HWC uint8 image into ``dst`` (oh, ow, 3).

    ``src`` is a flat uint8 array; pixel (y, x, c) is at ``off + y * pitch + 3 * x + c``.
    ``scratch`` (float32) and ``taps`` (int64) are flat arrays of at least ``resize_scratch_size``
    and ``resize_taps_size`` elements: nothing is allocated.

    Stoker's compiled callers pass a writable C-contiguous ``src`` and ``off``, ``pitch``, ``src_h``,
    ``src_w`` as int64 (a read-only column as a writable view of its bytes): Numba compiles a kernel
    once per signature, and each difference (read-only or not, unsigned or literal sizes) compiled
    this one and its row passes again (``tests/images/test_one_signature.py``). ``stoker.io.resize``
    passes the user's image as it is (a read-only one compiles a second signature, once).
    """
    oh, ow = dst.shape[0], dst.shape[1]
    n3 = 3 * ow
    yf, xf = taps[:oh], taps[oh : oh + ow]
    used = 0
    wy = scratch[used : used + src_h + 3 * oh]
    used += src_h + 3 * oh
    wx = scratch[used : used + src_w + 3 * ow]
    used += src_w + 3 * ow
    ky = _axis(sy0, sh, oh, src_h, yf, wy)
    kx = _axis(sx0, sw, ow, src_w, xf, wx)
    c_lo = int(xf[0])
    c_hi = int(xf[ow - 1]) + kx
    r_lo = int(yf[0])
    r_hi = int(yf[oh - 1]) + ky
    groups = ow // GROUP
    wt = scratch[used : used + groups * kx * GROUP * LANES]
    used += groups * kx * GROUP * LANES
    xq = scratch[used : used + ow].view(np.int32)
    used += ow
    for ox in range(ow):
        xq[ox] = 3 * (xf[ox] - c_lo)
    for g in range(groups):
        for k in range(kx):
            for p in range(GROUP):
                wgt = wx[(g * GROUP + p) * kx + k]
                at = ((g * kx + k) * GROUP + p) * LANES
                for c in range(LANES):
                    wt[at + c] = wgt
    width = 3 * (c_hi - c_lo)
    row = scratch[used : used + width + LANES]
    used += width + LANES
    out = dst.reshape((oh, n3))
    p = _U(pitch)
    col = _U(off) + _U(3 * c_lo)
    if r_hi - r_lo > oh:  # vertical first, one output row at a time; the horizontal pass reads it from L1
        acc = scratch[used : used + width]
        for oy in range(oh):
            k0, k1 = oy * ky, oy * ky + ky  # the window's taps, less those of zero weight at either end
            while k1 - k0 > 1 and wy[k0] == 0.0:
                k0 += 1
            while k1 - k0 > 1 and wy[k1 - 1] == 0.0:
                k1 -= 1
            _vrow(src, col + _U(yf[oy] + k0 - oy * ky) * p, pitch, wy, k0, k1 - k0, width, row, acc, False)
            _hrow(row, xq, wt, wx, kx, ow, out[oy], True)
        return
    # horizontal first, over the source rows the vertical pass reads, unrounded
    nu = _U(n3)
    tmp = scratch[used : used + (r_hi - r_lo) * n3]
    for r in range(r_lo, r_hi):
        base = col + _U(r) * p
        for j in range(_U(width)):
            row[j] = _F(src[base + j])
        _hrow(row, xq, wt, wx, kx, ow, tmp[_U(r - r_lo) * nu : _U(r - r_lo + 1) * nu], False)
    acc = scratch[used + (r_hi - r_lo) * n3 : used + (r_hi - r_lo + 1) * n3]
    for oy in range(oh):
        _vrow(tmp, _U(yf[oy] - r_lo) * nu, n3, wy, oy * ky, ky, n3, out[oy], acc, True)


# seconds of LLVM work: compiled on its own and called by symbol from the JPEG decoder (stoker.image._kernels), and from
# code run once per sample (a fused pipeline's)
resize.stoker_large = True  # type: ignore[attr-defined]


def resize_scratch_size(h: Any, w: Any, oh: int, ow: int) -> Any:
    """Float32 elements of scratch that :func:`resize` needs for an ``h`` x ``w`` source (ints, or arrays of them).

    The weights of both axes, the horizontal weights spread over the vector lanes (``GROUP * LANES``
    per tap of a group of pixels) and the source offsets of the outputs, one float32 row of the source
    (with a spare lane), then an accumulator (more than four vertical taps) or, when the horizontal pass
    runs first (then it reads at most ``oh`` source rows), its output rows and an accumulator.
    """
    kx_bound = np.floor_divide(w, ow) + 3  # taps per output, at most (see _axis)
    axes = (h + 3 * oh) + (w + 3 * ow)
    spread = (ow // GROUP) * kx_bound * GROUP * LANES + ow
    # vertical first: an accumulator row of the source's width; horizontal first: at most oh rows and one more
    return axes + spread + (3 * w + LANES) + np.maximum(3 * w, 3 * (oh + 1) * ow)


def resize_taps_size(oh: int, ow: int) -> int:
    """Int64 elements of the ``taps`` array that :func:`resize` needs for an ``oh`` x ``ow`` output."""
    return oh + ow
