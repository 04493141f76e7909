"""One compiled call that crops and resizes many images into the rows of a batch.

A decode group's member (:mod:`beton_serve.fields._shared_decode`) gets most of its images from
the group's cache, each its own array. Resizing them one ``cv2.resize`` or kernel call at a
time took and released the GIL per sample, and with two worker threads and the daemon's other
threads those hand-offs left a tenth or more of the cores idle (issue 16). Here the whole list
goes to one ``nogil`` kernel.

The images travel as their data addresses (``int64``, the arrays' ``__array_interface__``
pointers) beside a table of their shapes and crops, since a list of differently shaped arrays
is not a cheap Numba argument. The caller keeps every array alive across the call and vouches
for the shapes (they are the arrays' own), the crops (inside each image) and the rows (inside
``dst``): nothing here can check a pointer.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.core.extending import intrinsic

from beton_serve._kernels.resize import area_resize
from beton_serve._kernels.upscale import upscale_into
from beton_serve.pipeline.compiler import Compiler

__all__ = ["CROP_COLUMNS", "example_args", "resize_crops"]

_jit = Compiler.kernel

#: Columns of ``meta`` (int64): batch row, image height and width, crop top, left, height, width.
CROP_COLUMNS = ("row", "height", "width", "top", "left", "crop_height", "crop_width")


@intrinsic
def _voidptr(typingctx, addr):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    """The address ``addr`` (int64) as a ``void*``, for ``numba.carray``."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


@_jit
def resize_crops(addrs, meta, dst, dflat, scratch, rows):  # pragma: no cover - compiled
    """For each ``i``: crop image ``i`` and resize it into ``dst[meta[i, 0]]``, as
    :func:`~beton_serve._kernels.resize.resize_crop` with ``method="area"`` does, except that
    crops which do not shrink in both directions are upscaled by
    :func:`~beton_serve._kernels.upscale.upscale_into` instead of ``cv2.resize``.

    Args:
        addrs: int64[n], the address of each image's first byte (RGB, C-contiguous).
        meta: int64[n, 7], the :data:`CROP_COLUMNS` of each image.
        dst: (B, oh, ow, 3) uint8, C-contiguous; rows named in ``meta`` are written.
        dflat: ``dst.reshape(-1)``.
        scratch: float32 scratch of at least ``scratch_size(max crop width, ow)`` elements.
        rows: int16 scratch of at least :func:`~beton_serve._kernels.upscale.rows_size`
            ``(ow)`` elements.
    """
    oh = dst.shape[1]
    ow = dst.shape[2]
    per = oh * ow * 3
    for i in range(addrs.shape[0]):
        b = meta[i, 0]
        h = meta[i, 1]
        w = meta[i, 2]
        top = meta[i, 3]
        left = meta[i, 4]
        ch = meta[i, 5]
        cw = meta[i, 6]
        ptr = _voidptr(addrs[i])  # type: ignore[call-arg,var-annotated]  # typingctx is numba's
        flat = numba.carray(ptr, (h * w * 3,), np.uint8)
        d = dflat[b * per : (b + 1) * per]
        if oh <= ch and ow <= cw:
            src = numba.carray(ptr, (h, w, 3), np.uint8)
            area_resize(src, flat, top, left, ch, cw, dst[b], d, scratch)
        else:
            upscale_into(flat, w, top, left, ch, cw, d, oh, ow, rows)


def example_args() -> tuple[np.ndarray, ...]:
    """Arguments of :func:`resize_crops` of the types every caller passes (an empty batch), to
    compile it ahead with the TurboJPEG batch kernel (``_tj3``) and in the prewarm helper."""
    dst = np.zeros((0, 1, 1, 3), np.uint8)
    scratch = np.zeros(2, np.float32)
    return (
        np.zeros(0, np.int64),
        np.zeros((0, len(CROP_COLUMNS)), np.int64),
        dst,
        dst.reshape(-1),
        scratch,
        scratch.view(np.int16),
    )
