"""Area (``INTER_AREA``) downscaling of HWC uint8 images, matching OpenCV.

OpenCV's ``resize(..., INTER_AREA)`` on a non-integer downscale takes a generic, unvectorised
path (~390 us per ImageNet crop). It computes, for every output row, the horizontal weighted
sums of each source row it covers (so a source row on a cell boundary is summed twice), then a
vertical weighted sum, all in float32, then rounds half-to-even and saturates.

:func:`area_resize` performs the same float32 operations in the same order (so the result is
the same up to the last bit; the tests check ``max |diff| <= 1`` against ``cv2.resize`` and
that almost every pixel is exact), but sums each source row horizontally once, into a scratch
block, and skips OpenCV's per-row table walks. Weights follow OpenCV's ``computeResizeAreaTab``:
output cell ``d`` covers ``[d*s, (d+1)*s)`` of the source with ``s = 1 / (dsize / ssize)``;
partial boundary pixels get weight ``overlap / cell``, inner pixels ``1 / cell`` (boundary slivers
below 1e-3 of a pixel are ignored).

Integer scale factors take OpenCV's "fast area" path (a plain box average, rounded); upscaling
in either direction is not an area operation, and :func:`resize_crop` hands it to OpenCV.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

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


@_jit
def _area_generic(flat, width, top, left, sh, sw, dh, dw, dflat, acc, out):  # pragma: no cover
    xs, xc, xw = area_table(sw, dw)
    ys, yc, yw = area_table(sh, dh)
    # Taps 0..common-1 exist for every output column: those run as dense loops over independent
    # columns (they pipeline/vectorise). The few extra taps of wider cells are a flat list,
    # ordered by tap then column, so each column still sums its taps left to right.
    common = xc[0]
    for dx in range(dw):
        common = min(common, xc[dx])
    idx = np.empty((common, dw), np.int64)
    wt = np.empty((common, dw), np.float32)
    n_extra = 0
    for dx in range(dw):
        n_extra += xc[dx] - common
        for k in range(common):
            idx[k, dx] = (xs[dx] + k) * 3
            wt[k, dx] = xw[dx, k]
    e_dst = np.empty(n_extra, np.int64)
    e_src = np.empty(n_extra, np.int64)
    e_w = np.empty(n_extra, np.float32)
    e = 0
    for k in range(common, xw.shape[1]):
        for dx in range(dw):
            if k < xc[dx]:
                e_dst[e] = 3 * dx
                e_src[e] = (xs[dx] + k) * 3
                e_w[e] = xw[dx, k]
                e += 1
    n = sw * 3
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
        # then the horizontal pass on one row
        for dx in range(dw):
            i = idx[0, dx]
            w = wt[0, dx]
            out[3 * dx] = acc[i] * w
            out[3 * dx + 1] = acc[i + 1] * w
            out[3 * dx + 2] = acc[i + 2] * w
        for k in range(1, common):
            for dx in range(dw):
                i = idx[k, dx]
                w = wt[k, dx]
                out[3 * dx] = out[3 * dx] + acc[i] * w
                out[3 * dx + 1] = out[3 * dx + 1] + acc[i + 1] * w
                out[3 * dx + 2] = out[3 * dx + 2] + acc[i + 2] * w
        for q in range(n_extra):
            o = e_dst[q]
            i = e_src[q]
            w = e_w[q]
            out[o] = out[o] + acc[i] * w
            out[o + 1] = out[o + 1] + acc[i + 1] * w
            out[o + 2] = out[o + 2] + acc[i + 2] * w
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
    return (max(crop_width, out_width) + out_width) * 3


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
    n = max(width, dw) * 3
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
        scratch[n : n + dw * 3],
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

    Args:
        src: (H, W, 3) uint8 image, C-contiguous.
        top: first row of the crop.
        left: first column of the crop.
        height: crop height (>= 1).
        width: crop width (>= 1).
        dst: (oh, ow, 3) uint8 output, written in place.
        scratch: float32 scratch of at least ``scratch_size(width, ow)`` elements.
        method: ``"area"`` uses the compiled kernel for downscales (OpenCV for upscales);
            ``"cv2"`` always calls ``cv2.resize(..., INTER_AREA)``.
    """
    oh, ow = dst.shape[0], dst.shape[1]
    if (
        method == "area"
        and oh <= height
        and ow <= width
        and src.flags.c_contiguous
        and dst.flags.c_contiguous
    ):
        area_resize(src, src.reshape(-1), top, left, height, width, dst, dst.reshape(-1), scratch)
        return
    import cv2

    crop = src[top : top + height, left : left + width]
    cv2.resize(crop, (ow, oh), dst=dst, interpolation=cv2.INTER_AREA)
