"""Linear upscaling of HWC uint8 crops with OpenCV ``INTER_AREA``'s weights, compiled.

OpenCV's ``resize(..., INTER_AREA)`` averages areas only when the crop shrinks in both
directions (:mod:`beton_serve._kernels.resize`). Otherwise it interpolates linearly between two
source pixels per axis, with "area" weights: output index ``d`` of an ``s -> n`` axis
(``scale = 1 / (n / s)``) reads source ``x = floor(d * scale)`` and ``x + 1`` with weights
``1 - f`` and ``f``, where ``f = (d + 1) - (x + 1) * n / s`` in float32, taken as 0 when it is
not positive and reduced modulo 1 otherwise (so a source pixel is copied, except where an output
cell straddles a source pixel's edge). Weights are fixed point, ``round(w * 2048)``; at the far
edge (``x + 1`` outside the crop) the pixel is copied with weight 2048.

Passes, as OpenCV's fixed-point path for 8-bit images:

1. horizontal, once per source row: ``h = w0 * S[x] + w1 * S[x + 1]`` (int32, exact), kept as
   ``h >> 4`` (int16) since that is all the next pass reads;
2. vertical, per output row: ``((h0 * b0) >> 16) + ((h1 * b1) >> 16)``, then ``(v + 2) >> 2``
   saturated to uint8. This is the arithmetic of OpenCV's SIMD vertical pass
   (``VResizeLinearVec_32s8u``), which OpenCV runs on every full vector of a row; its scalar
   remainder (``(b0 * S0 + b1 * S1 + 2**21) >> 22``) can differ by 1 on the bytes past the last
   full vector, whose number depends on the CPU's vector width. On this project's x86-64 hosts
   the pixels equal ``cv2.resize``'s (``tests/unit/test_upscale.py`` allows 1 and counts).

Both passes are explicit vectors (LLVM does not vectorise the horizontal gather, and picks
32-bit lanes for the vertical one): an RGB pixel's two taps are two 4-byte loads, the 4th lane
landing on the next pixel's first value, which that pixel then overwrites (the row scratch has
one element more than ``3 * dw``); the vertical pass runs 16 values at a time, its products as
high-half 16-bit multiplies (``pmulhw`` on x86, as in OpenCV). A 150 x 150 ->
224 x 224 upscale takes about 47 us here against 80-100 us in ``cv2.resize``.

It is the upscale of ``resize="area"`` everywhere (:func:`~beton_serve._kernels.resize.resize_crop`):
faster than the OpenCV call it replaced, and callable from compiled code, so that a batch's
crops resize in one ``nogil`` call (:mod:`beton_serve._kernels.crops`; the decode groups' member
loop, where a ``cv2.resize`` per sample queued the worker threads on the GIL, issue 16).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic

from beton_serve.pipeline.compiler import Compiler

__all__ = ["linear_table", "rows_size", "upscale_into"]

_jit = Compiler.kernel

#: OpenCV's ``INTER_RESIZE_COEF_SCALE``: weights are fractions of 2048.
_ONE = 2048
#: Values per vector of the vertical pass.
_LANES = 16


def rows_size(out_width: int) -> int:
    """int16 elements of the row scratch :func:`upscale_into` needs for ``out_width``."""
    return 2 * (out_width * 3 + 1)


@_jit
def linear_table(ssize: int, dsize: int):  # pragma: no cover - compiled
    """Per output index: OpenCV's source index and int32 weights (fractions of 2048) for an
    ``INTER_AREA`` axis that does not shrink, far edge clamped (module docstring).

    Returns:
        ``(start int64[dsize], w0 int32[dsize], w1 int32[dsize])``.
    """
    inv = dsize / ssize
    scale = 1.0 / inv  # as OpenCV: scale_x = 1. / inv_scale_x
    start = np.empty(dsize, np.int64)
    w0 = np.empty(dsize, np.int32)
    w1 = np.empty(dsize, np.int32)
    for d in range(dsize):
        sx = math.floor(d * scale)
        f = np.float32((d + 1) - (sx + 1) * inv)
        if f <= 0:
            f = np.float32(0.0)
        else:
            f = np.float32(f - math.floor(f))
        if sx + 1 >= ssize:  # past OpenCV's xmax: one tap of weight ONE
            start[d] = ssize - 1
            w0[d] = _ONE
            w1[d] = 0
        else:
            start[d] = sx
            # saturate_cast<short>(float): round half to even
            w0[d] = np.int32(np.rint((np.float32(1.0) - f) * np.float32(_ONE)))
            w1[d] = np.int32(np.rint(f * np.float32(_ONE)))
    return start, w0, w1


def _splat(builder: ir.IRBuilder, vty: ir.VectorType, value: ir.Value) -> ir.Value:
    lanes = vty.count
    v = builder.insert_element(
        ir.Constant(vty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0)
    )
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), zeros)


def _i32(context, builder, value, ty):  # type: ignore[no-untyped-def]
    return context.cast(builder, value, ty, types.int32)


@intrinsic
def _hrow_vec(typingctx, out, flat, base, xs, xw0, xw1, count):  # type: ignore[no-untyped-def]
    """``out[3d : 3d+3] = (xw0[d] * P[xs[d]] + xw1[d] * P[xs[d] + 1]) >> 4`` for the pixels
    ``P`` of the source row at ``flat[base:]`` and ``d < count``; reads one byte past the second
    pixel and writes one int16 past ``out[3d + 2]`` (the caller keeps both inside)."""
    i8x4 = ir.VectorType(ir.IntType(8), 4)
    i32x4 = ir.VectorType(ir.IntType(32), 4)
    i16x4 = ir.VectorType(ir.IntType(16), 4)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        three = ir.Constant(i64, 3)
        a_out = context.make_array(sig.args[0])(context, builder, args[0])
        a_flat = context.make_array(sig.args[1])(context, builder, args[1])
        base = context.cast(builder, args[2], sig.args[2], types.int64)
        a_xs = context.make_array(sig.args[3])(context, builder, args[3])
        a_w0 = context.make_array(sig.args[4])(context, builder, args[4])
        a_w1 = context.make_array(sig.args[5])(context, builder, args[5])
        n = context.cast(builder, args[6], sig.args[6], types.int64)
        four = ir.Constant(i32x4, [4, 4, 4, 4])
        with cgutils.for_range(builder, n) as loop:
            d = loop.index
            x = builder.load(builder.gep(a_xs.data, [d]))
            p = builder.add(base, builder.mul(x, three))
            q0 = builder.bitcast(builder.gep(a_flat.data, [p]), i8x4.as_pointer())
            q1 = builder.bitcast(
                builder.gep(a_flat.data, [builder.add(p, three)]), i8x4.as_pointer()
            )
            v0 = builder.zext(builder.load(q0, align=1), i32x4)
            v1 = builder.zext(builder.load(q1, align=1), i32x4)
            w0 = _splat(builder, i32x4, builder.load(builder.gep(a_w0.data, [d])))
            w1 = _splat(builder, i32x4, builder.load(builder.gep(a_w1.data, [d])))
            s = builder.add(builder.mul(v0, w0), builder.mul(v1, w1))
            s = builder.trunc(builder.lshr(s, four), i16x4)
            o = builder.gep(a_out.data, [builder.mul(d, three)])
            builder.store(s, builder.bitcast(o, i16x4.as_pointer()), align=2)
        return context.get_dummy_value()

    return types.void(out, flat, base, xs, xw0, xw1, count), codegen


@intrinsic
def _vrow_vec(typingctx, dflat, off, h0, h1, b0, b1, blocks):  # type: ignore[no-untyped-def]
    """``dflat[off + j] = sat_u8((((h0[j] * b0) >> 16) + ((h1[j] * b1) >> 16) + 2) >> 2)`` for
    ``j < 16 * blocks``, 16 values a vector."""
    lanes = _LANES
    i16v = ir.VectorType(ir.IntType(16), lanes)
    i32v = ir.VectorType(ir.IntType(32), lanes)
    i8v = ir.VectorType(ir.IntType(8), lanes)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        a_d = context.make_array(sig.args[0])(context, builder, args[0])
        off = context.cast(builder, args[1], sig.args[1], types.int64)
        a_h0 = context.make_array(sig.args[2])(context, builder, args[2])
        a_h1 = context.make_array(sig.args[3])(context, builder, args[3])
        # the weights (<= 2048) as sign-extended int16: with both factors known to be int16,
        # LLVM emits ``(a * b) >> 16`` as one high-half multiply (x86 ``pmulhw``), OpenCV's
        # own instruction here, instead of widening to 32-bit lanes (1.8x faster pass)
        i16 = ir.IntType(16)
        w0 = builder.sext(
            _splat(builder, i16v, builder.trunc(_i32(context, builder, args[4], sig.args[4]), i16)),
            i32v,
        )
        w1 = builder.sext(
            _splat(builder, i16v, builder.trunc(_i32(context, builder, args[5], sig.args[5]), i16)),
            i32v,
        )
        n = context.cast(builder, args[6], sig.args[6], types.int64)
        c16 = ir.Constant(i32v, [16] * lanes)
        c2 = ir.Constant(i16v, [2] * lanes)
        c0 = ir.Constant(i16v, [0] * lanes)
        c255 = ir.Constant(i16v, [255] * lanes)
        step = ir.Constant(i64, lanes)
        with cgutils.for_range(builder, n) as loop:
            j = builder.mul(loop.index, step)
            p0 = builder.bitcast(builder.gep(a_h0.data, [j]), i16v.as_pointer())
            p1 = builder.bitcast(builder.gep(a_h1.data, [j]), i16v.as_pointer())
            m0 = builder.mul(builder.sext(builder.load(p0, align=2), i32v), w0)
            m1 = builder.mul(builder.sext(builder.load(p1, align=2), i32v), w1)
            m0 = builder.trunc(builder.ashr(m0, c16), i16v)
            m1 = builder.trunc(builder.ashr(m1, c16), i16v)
            v = builder.ashr(builder.add(builder.add(m0, m1), c2), c2)
            v = builder.select(builder.icmp_signed("<", v, c0), c0, v)
            v = builder.select(builder.icmp_signed(">", v, c255), c255, v)
            q = builder.gep(a_d.data, [builder.add(off, j)])
            builder.store(builder.trunc(v, i8v), builder.bitcast(q, i8v.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(dflat, off, h0, h1, b0, b1, blocks), codegen


@_jit
def _hrow(flat, base, xs, xw0, xw1, dw, out):  # pragma: no cover - compiled
    """The horizontal pass of one source row (``flat[base:]``) into ``out`` (int16, at least
    ``3 * dw + 1``): vectors while the 4-byte loads stay inside ``flat``, then scalar."""
    dv = dw
    limit = flat.shape[0]
    while dv > 0 and base + xs[dv - 1] * 3 + 7 > limit:
        dv -= 1
    _hrow_vec(out, flat, base, xs, xw0, xw1, dv)  # type: ignore[call-arg]  # typingctx is numba's
    for d in range(dv, dw):
        p = base + xs[d] * 3
        a = xw0[d]
        b = xw1[d]
        for c in range(3):
            v = np.int32(flat[p + c]) * a
            if b != 0:
                v += np.int32(flat[p + 3 + c]) * b
            out[d * 3 + c] = np.int16(v >> 4)


@_jit
def upscale_into(flat, width, top, left, sh, sw, dflat, dh, dw, rows):  # pragma: no cover
    """Resize the crop ``(top, left, sh, sw)`` of an RGB image into ``dflat`` as OpenCV's
    ``INTER_AREA`` does when the crop does not shrink in both directions (module docstring).

    Args:
        flat: the image's ``H * W * 3`` bytes (C order).
        width: ``W``.
        top, left, sh, sw: the crop, inside the image.
        dflat: the ``dh * dw * 3`` output bytes (C order); written.
        dh, dw: the output size.
        rows: int16 scratch of at least :func:`rows_size` ``(dw)`` elements.
    """
    xs, xw0, xw1 = linear_table(sw, dw)
    ys, yw0, yw1 = linear_table(sh, dh)
    n = dw * 3
    half = n + 1
    r0 = rows[:half]
    r1 = rows[half : 2 * half]
    have0 = -1  # the crop row whose pass r0 / r1 holds (-1: none)
    have1 = -1
    rowlen = width * 3
    blocks = n // _LANES
    for dy in range(dh):
        sy = ys[dy]
        sy1 = min(sy + 1, sh - 1)
        # each source row goes through the horizontal pass once: an upscale reads it for
        # about ``dh / sh`` consecutive output rows
        if have0 != sy:
            if have1 == sy:
                r0, r1 = r1, r0
                have0, have1 = have1, have0
            else:
                _hrow(flat, (top + sy) * rowlen + left * 3, xs, xw0, xw1, dw, r0)
                have0 = sy
        if have1 != sy1:
            _hrow(flat, (top + sy1) * rowlen + left * 3, xs, xw0, xw1, dw, r1)
            have1 = sy1
        b0 = yw0[dy]
        b1 = yw1[dy]
        off = dy * n
        _vrow_vec(dflat, off, r0, r1, b0, b1, blocks)  # type: ignore[call-arg]  # numba's typingctx
        for j in range(blocks * _LANES, n):
            v = ((np.int32(r0[j]) * b0) >> 16) + ((np.int32(r1[j]) * b1) >> 16)
            v = (v + 2) >> 2
            dflat[off + j] = np.uint8(min(max(v, 0), 255))
