"""Area (``INTER_AREA``) downscaling of HWC uint8 images, matching OpenCV.

OpenCV's ``resize(..., INTER_AREA)`` on a non-integer downscale takes a generic, unvectorised
path (~390 us per ImageNet crop). It computes, for every output row, the horizontal weighted
sums of each source row it covers (so a source row on a cell boundary is summed twice), then a
vertical weighted sum, all in float32, then rounds half-to-even and saturates.

:func:`area_resize` computes the same weighted sums in float32 (the tests check ``max |diff|
<= 1`` against ``cv2.resize`` and that almost every pixel is exact; on this project's hosts all
are), per output row: the vertical sum of its source rows over the crop's width, then the
horizontal sums of that one row, skipping OpenCV's per-row table walks. The horizontal pass, the
costly part (a gather per output column), runs two columns per 8-lane vector with the taps
unrolled (:func:`_pair_pass`), 1.6-1.8x faster than one column a vector and the same bytes.
Weights follow OpenCV's ``computeResizeAreaTab``:
output cell ``d`` covers ``[d*s, (d+1)*s)`` of the source with ``s = 1 / (dsize / ssize)``;
partial boundary pixels get weight ``overlap / cell``, inner pixels ``1 / cell`` (boundary slivers
below 1e-3 of a pixel are ignored).

Integer scale factors take OpenCV's "fast area" path (a plain box average, rounded). Upscaling
in either direction is not an area operation: OpenCV interpolates linearly there, and
:func:`resize_crop` hands it to :func:`beton_serve._kernels.upscale.upscale_into`, the same
arithmetic compiled (``method="cv2"`` calls OpenCV for everything).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic
from numpy.typing import NDArray

from beton_serve._kernels.upscale import upscale_into
from beton_serve.pipeline.compiler import Compiler

__all__ = ["area_resize", "area_table", "resize_crop", "scratch_size"]

#: ``numba.njit(nogil=True, error_model="numpy")`` with the persistent compile cache.
_jit = Compiler.kernel


@_jit
def area_table(ssize: int, dsize: int):  # pragma: no cover - compiled
    """Per output index: first source index, tap count and float32 weights (OpenCV's table).

    Returns:
        ``(start int64[dsize], count int64[dsize], weights float32[dsize, max_taps])``.
    """
    scale = 1.0 / (dsize / ssize)
    max_taps = math.ceil(scale) + 2
    start = np.empty(dsize, np.int64)
    # zeroed by loops: np.zeros would compile one more Numba overload (about 0.2 s, cold)
    count = np.empty(dsize, np.int64)
    weights = np.empty((dsize, max_taps), np.float32)
    for d in range(dsize):
        count[d] = 0
        for k in range(max_taps):
            weights[d, k] = 0.0
    for d in range(dsize):
        fs1 = d * scale
        fs2 = fs1 + scale
        cell = min(scale, ssize - fs1)
        s1 = math.ceil(fs1)
        s2 = math.floor(fs2)
        s2 = min(s2, ssize - 1)
        s1 = min(s1, s2)
        k = 0
        if s1 - fs1 > 1e-3:
            start[d] = s1 - 1
            weights[d, k] = np.float32((s1 - fs1) / cell)
            k += 1
        else:
            start[d] = s1
        for _ in range(s1, s2):
            weights[d, k] = np.float32(1.0 / cell)
            k += 1
        if fs2 - s2 > 1e-3:
            weights[d, k] = np.float32(min(min(fs2 - s2, 1.0), cell) / cell)
            k += 1
        count[d] = k
    return start, count, weights


_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds half to even
_ZERO = np.float32(0.0)
_TOP = np.float32(255.0)


@_jit
def _round_sat(v: np.float32) -> np.uint8:  # pragma: no cover - compiled
    # saturate, then round half to even (cvRound) with the float32 magic-number trick: exact for
    # |v| < 2**22 under the default rounding mode, and far cheaper than a libm rint call.
    v = min(max(v, _ZERO), _TOP)
    return np.uint8((v + _MAGIC) - _MAGIC)


_V4 = ir.VectorType(ir.FloatType(), 4)
_V8 = ir.VectorType(ir.FloatType(), 8)

#: Largest tap count per output column that :func:`_area_generic` runs through the unrolled,
#: two-columns-a-vector pass (:func:`_pair_pass`); wider cells (a shrink by about 4x or more)
#: take the per-column :func:`_hpass`.
_PAIR_TAPS = 5
#: float32 elements after a source row that the unrolled pass may read (zeroed, weight 0).
_PAD = 3 * _PAIR_TAPS + 1
#: float32 elements of the pair weight table per two output columns (8 lanes per tap).
_PAIR_FLOATS = 8 * _PAIR_TAPS


def _splat(builder: ir.IRBuilder, w: ir.Value) -> ir.Value:
    v = builder.insert_element(ir.Constant(_V4, ir.Undefined), w, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), 4), [0, 0, 0, 0])
    return builder.shuffle_vector(v, ir.Constant(_V4, ir.Undefined), zeros)


@intrinsic
def _hpass(typingctx, out, acc, xs, xc, xw, first, dw):  # type: ignore[no-untyped-def]  # pragma: no cover
    """One row's horizontal pass: ``out[3d : 3d+3] = sum_k acc[3 * (xs[d] + k) : +3] * xw[d, k]``
    for ``d`` in ``range(first, dw)``, taps in order ``k = 0 .. xc[d] - 1``.

    Each tap is one 4-lane float32 multiply and add over an RGB pixel plus the next value (the
    lanes are IEEE float32 operations in the scalar order, so the sums are bit-identical to a
    scalar loop). The 4th lane of column ``d`` lands on ``out[3d + 3]``, which column ``d + 1``
    then overwrites: ``acc`` needs one readable element after ``3 * sw`` and ``out`` one after
    ``3 * dw``. LLVM does not vectorise this gather itself (each column's taps start at a
    different offset); this is ~2x faster than the scalar loop it replaces.
    """

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        three = ir.Constant(i64, 3)
        a_out, a_acc, a_xs, a_xc, a_xw = (
            context.make_array(t)(context, builder, v)
            for t, v in zip(sig.args[:5], args[:5], strict=True)
        )
        taps = cgutils.unpack_tuple(builder, a_xw.shape, 2)[1]
        vsum = cgutils.alloca_once(builder, _V4)
        one = ir.Constant(i64, 1)
        start = context.cast(builder, args[5], sig.args[5], types.int64)
        stop = context.cast(builder, args[6], sig.args[6], types.int64)
        with cgutils.for_range_slice(builder, start, stop, one, inc=True) as (d, _):
            first = builder.mul(builder.load(builder.gep(a_xs.data, [d])), three)
            count = builder.load(builder.gep(a_xc.data, [d]))
            wrow = builder.gep(a_xw.data, [builder.mul(d, taps)])
            p = builder.bitcast(builder.gep(a_acc.data, [first]), _V4.as_pointer())
            w = _splat(builder, builder.load(wrow))
            builder.store(builder.fmul(builder.load(p, align=4), w), vsum)
            with cgutils.for_range_slice(builder, one, count, one, inc=True) as (k, _):
                src = builder.add(first, builder.mul(k, three))
                p = builder.bitcast(builder.gep(a_acc.data, [src]), _V4.as_pointer())
                w = _splat(builder, builder.load(builder.gep(wrow, [k])))
                builder.store(
                    builder.fadd(builder.load(vsum), builder.fmul(builder.load(p, align=4), w)),
                    vsum,
                )
            q = builder.bitcast(builder.gep(a_out.data, [builder.mul(d, three)]), _V4.as_pointer())
            builder.store(builder.load(vsum), q, align=4)
        return context.get_dummy_value()

    return types.void(out, acc, xs, xc, xw, first, dw), codegen


def _pair_pass(taps: int) -> Any:
    """The horizontal pass of one row for columns that all have ``taps`` taps (the table padded
    with zero weights), two columns per 8-lane vector, the taps unrolled.

    ``out[3d : 3d+3] = sum_k acc[3 * (xs[d] + k) : +3] * w[d, k]`` for ``d < 2 * npairs``, with
    ``wv`` holding, per pair and tap, column ``2q``'s weight in lanes 0-3 and ``2q + 1``'s in
    lanes 4-7 (filled by :func:`_area_generic`). Each lane does what :func:`_hpass` does, in the same
    order: a product, then one add per further tap; a zero-weight tap adds ``+0.0``, which
    leaves every sum (finite, not negative) unchanged, so the result is bit-identical. Without
    the per-column tap loop, and with two columns per multiply, this pass is about 1.7x faster
    (its variable trip count cost a branch mispredict every few columns).

    Reads ``acc`` up to ``3 * (xs[d] + taps) + 1`` (the caller zeroes what lies past the row)
    and writes one float past column ``2 * npairs - 1``, which the next column overwrites.
    """

    @intrinsic
    def pass_(typingctx, out, acc, xs, wv, npairs):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            i64 = ir.IntType(64)
            three = ir.Constant(i64, 3)
            a_out, a_acc, a_xs, a_wv = (
                context.make_array(t)(context, builder, v)
                for t, v in zip(sig.args[:4], args[:4], strict=True)
            )
            both = ir.Constant(ir.VectorType(ir.IntType(32), 8), list(range(8)))
            low = ir.Constant(ir.VectorType(ir.IntType(32), 4), [0, 1, 2, 3])
            high = ir.Constant(ir.VectorType(ir.IntType(32), 4), [4, 5, 6, 7])
            n = context.cast(builder, args[4], sig.args[4], types.int64)
            with cgutils.for_range(builder, n) as loop:
                q = loop.index
                d0 = builder.mul(q, ir.Constant(i64, 2))
                f0 = builder.mul(builder.load(builder.gep(a_xs.data, [d0])), three)
                d1 = builder.add(d0, ir.Constant(i64, 1))
                f1 = builder.mul(builder.load(builder.gep(a_xs.data, [d1])), three)
                wbase = builder.mul(q, ir.Constant(i64, 8 * taps))
                total = None
                for k in range(taps):
                    step = ir.Constant(i64, 3 * k)
                    p0 = builder.gep(a_acc.data, [builder.add(f0, step)])
                    p1 = builder.gep(a_acc.data, [builder.add(f1, step)])
                    v = builder.shuffle_vector(
                        builder.load(builder.bitcast(p0, _V4.as_pointer()), align=4),
                        builder.load(builder.bitcast(p1, _V4.as_pointer()), align=4),
                        both,
                    )
                    pw = builder.gep(a_wv.data, [builder.add(wbase, ir.Constant(i64, 8 * k))])
                    m = builder.fmul(
                        v, builder.load(builder.bitcast(pw, _V8.as_pointer()), align=4)
                    )
                    total = m if total is None else builder.fadd(total, m)
                assert total is not None
                o0 = builder.gep(a_out.data, [builder.mul(d0, three)])
                builder.store(
                    builder.shuffle_vector(total, total, low),
                    builder.bitcast(o0, _V4.as_pointer()),
                    align=4,
                )
                o1 = builder.gep(a_out.data, [builder.mul(d1, three)])
                builder.store(
                    builder.shuffle_vector(total, total, high),
                    builder.bitcast(o1, _V4.as_pointer()),
                    align=4,
                )
            return context.get_dummy_value()

        return types.void(out, acc, xs, wv, npairs), codegen

    return pass_


_pair1, _pair2, _pair3, _pair4, _pair5 = (_pair_pass(t) for t in range(1, _PAIR_TAPS + 1))


@_jit
def _area_generic(flat, width, top, left, sh, sw, dh, dw, dflat, acc, out, wv):  # pragma: no cover
    xs, xc, xw = area_table(sw, dw)
    ys, yc, yw = area_table(sh, dh)
    n = sw * 3
    taps = 1
    for d in range(dw):
        taps = max(taps, xc[d])
    if taps > _PAIR_TAPS:  # (no column has more taps than the table is wide)
        taps = 0  # the per-column pass
    npairs = dw // 2 if taps else 0
    # per pair and tap: column 2q's weight in lanes 0-3, 2q + 1's in lanes 4-7 (what
    # _pair_pass loads), in the caller's scratch (an array made here cost ~0.15 s more of the
    # cold compile on the first batch's path, a jitted helper that made it ~0.3 s): at most
    # (dw // 2) * _PAIR_FLOATS floats
    for q in range(npairs):
        for k in range(taps):
            for lane in range(4):
                wv[(q * taps + k) * 8 + lane] = xw[2 * q, k]
                wv[(q * taps + k) * 8 + 4 + lane] = xw[2 * q + 1, k]
    # read, times a zero weight, by the 4th lane of the last column and by padded taps: zeros,
    # since the scratch may hold anything (a NaN times 0 is not 0)
    for j in range(n, n + _PAD):
        acc[j] = 0.0
    for dy in range(dh):
        # vertical pass first: contiguous source rows, vectorised
        # (slices, not flat[base + j]: an index that may be negative makes Numba emit
        # wraparound checks that stop LLVM from vectorising; with slices this pass is ~10x faster)
        sy = ys[dy]
        base = ((top + sy) * width + left) * 3
        w0 = yw[dy, 0]
        a = acc[:n]
        row = flat[base : base + n]
        for j in range(n):
            a[j] = w0 * np.float32(row[j])
        for k in range(1, yc[dy]):
            wk = yw[dy, k]
            b = base + k * width * 3
            row = flat[b : b + n]
            for j in range(n):
                a[j] = a[j] + wk * np.float32(row[j])
        # then the horizontal pass on one row: two columns a vector, or 4 lanes per column
        if taps == 1:
            _pair1(out, acc, xs, wv, npairs)  # type: ignore[call-arg]  # typingctx is numba's
        elif taps == 2:
            _pair2(out, acc, xs, wv, npairs)  # type: ignore[call-arg]
        elif taps == 3:
            _pair3(out, acc, xs, wv, npairs)  # type: ignore[call-arg]
        elif taps == 4:
            _pair4(out, acc, xs, wv, npairs)  # type: ignore[call-arg]
        elif taps == 5:
            _pair5(out, acc, xs, wv, npairs)  # type: ignore[call-arg]
        if npairs * 2 < dw:
            # the odd last column (or every column, taps == 0), 4 lanes at a time
            _hpass(out, acc, xs, xc, xw, 2 * npairs, dw)  # type: ignore[call-arg]
        drow = dflat[dy * dw * 3 : (dy + 1) * dw * 3]
        o = out[: dw * 3]
        for j in range(dw * 3):
            drow[j] = _round_sat(o[j])


@_jit
def _area_int(src, dst, fy, fx):  # pragma: no cover - compiled
    dh, dw = dst.shape[0], dst.shape[1]
    area = fy * fx
    if fx == 2 and fy == 2:
        for dy in range(dh):
            for dx in range(dw):
                for c in range(3):
                    s = (
                        np.int32(src[2 * dy, 2 * dx, c])
                        + np.int32(src[2 * dy, 2 * dx + 1, c])
                        + np.int32(src[2 * dy + 1, 2 * dx, c])
                        + np.int32(src[2 * dy + 1, 2 * dx + 1, c])
                    )
                    dst[dy, dx, c] = np.uint8((s + 2) >> 2)
        return
    scale = np.float32(1.0) / np.float32(area)
    for dy in range(dh):
        for dx in range(dw):
            for c in range(3):
                s = np.int32(0)
                for yy in range(fy):
                    for xx in range(fx):
                        s += np.int32(src[dy * fy + yy, dx * fx + xx, c])
                dst[dy, dx, c] = _round_sat(np.float32(s) * scale)


def scratch_size(crop_width: int, out_width: int) -> int:
    """float32 elements of scratch :func:`area_resize` needs for crops up to ``crop_width``."""
    return (max(crop_width, out_width) + out_width) * 3 + _PAD + 1 + (out_width // 2) * _PAIR_FLOATS


@_jit
def area_resize(src, flat, top, left, height, width, dst, dflat, scratch):  # pragma: no cover
    """Area-downscale the crop ``src[top:top+height, left:left+width]`` into ``dst``.

    Args:
        src: (H, W, 3) uint8, C-contiguous (the whole decoded image).
        flat: ``src.reshape(-1)``, made by the caller: a reshape inside compiled code pulls in
            Numba's error-message formatting, about 3 s of the first compile.
        top, left, height, width: the crop; ``dst.shape[0] <= height``, ``dst.shape[1] <=
            width`` (a downscale or same size in each direction).
        dst: (oh, ow, 3) uint8, C-contiguous; written.
        dflat: ``dst.reshape(-1)``.
        scratch: float32 array of at least ``scratch_size(width, ow)`` elements, reused.
    """
    dh, dw = dst.shape[0], dst.shape[1]
    if height == dh and width == dw:
        # element loop, not ``dst[:] = src[...]``: slice assignment compiles Numba's
        # shape-mismatch message formatting (about 3 s of a cold compile)
        for y in range(dh):
            for x in range(dw):
                for c in range(3):
                    dst[y, x, c] = src[top + y, left + x, c]
        return
    scale_x = 1.0 / (dw / width)
    scale_y = 1.0 / (dh / height)
    ix = round(scale_x)
    iy = round(scale_y)
    if abs(scale_x - ix) < 2.220446049250313e-16 and abs(scale_y - iy) < 2.220446049250313e-16:
        _area_int(src[top : top + height, left : left + width], dst, iy, ix)
        return
    n = max(width, dw) * 3 + _PAD
    _area_generic(
        flat,
        src.shape[1],
        top,
        left,
        height,
        width,
        dh,
        dw,
        dflat,
        scratch[:n],
        scratch[n : n + dw * 3 + 1],
        scratch[n + dw * 3 + 1 : n + dw * 3 + 1 + (dw // 2) * _PAIR_FLOATS],
    )


def resize_crop(
    src: NDArray[np.uint8],
    top: int,
    left: int,
    height: int,
    width: int,
    dst: NDArray[np.uint8],
    scratch: NDArray[np.float32],
    method: str = "area",
) -> None:
    """Resize ``src[top:top+height, left:left+width]`` into ``dst`` like OpenCV ``INTER_AREA``.

    With ``method="area"`` the pixels are within 1 grey level of ``cv2.resize(..., INTER_AREA)``
    and, on this project's x86-64 hosts, equal to them: downscales by :func:`area_resize`,
    upscales by :func:`~beton_serve._kernels.upscale.upscale_into`. Either way the work runs in
    compiled code without the GIL.

    Args:
        src: (H, W, 3) uint8 image, C-contiguous.
        top: first row of the crop.
        left: first column of the crop.
        height: crop height (>= 1).
        width: crop width (>= 1).
        dst: (oh, ow, 3) uint8 output, written in place.
        scratch: float32 scratch of at least ``scratch_size(width, ow)`` elements.
        method: ``"area"``: the compiled kernels; ``"cv2"``: ``cv2.resize(..., INTER_AREA)``.
    """
    oh, ow = dst.shape[0], dst.shape[1]
    if method == "area":
        if not src.flags.c_contiguous:
            src = np.ascontiguousarray(src[top : top + height, left : left + width])
            top = left = 0
        out = dst if dst.flags.c_contiguous else np.empty(dst.shape, np.uint8)
        if oh <= height and ow <= width:
            area_resize(
                src, src.reshape(-1), top, left, height, width, out, out.reshape(-1), scratch
            )
        else:
            # the float32 scratch, as int16, holds the upscale's two rows (rows_size(ow) <=
            # 2 * scratch_size(width, ow) for every width)
            rows = scratch.view(np.int16)
            upscale_into(
                src.reshape(-1),
                src.shape[1],
                top,
                left,
                height,
                width,
                out.reshape(-1),
                oh,
                ow,
                rows,
            )
        if out is not dst:
            dst[...] = out
        return
    import cv2

    crop = src[top : top + height, left : left + width]
    cv2.resize(crop, (ow, oh), dst=dst, interpolation=cv2.INTER_AREA)
