"""Crop samplers shared by the crop decoders and ``RandomResizedCrop`` (compiled; import lazily).

``random_resized_crop`` follows FFCV (ffcv-format.md §3.5), which follows torchvision: up to 10
attempts of (area fraction ~ U(scale), log aspect ratio ~ U(log ratio)), a crop of
``round(sqrt(target * ar))`` by ``round(sqrt(target / ar))`` (half to even) kept if it fits, at a
uniform position; otherwise a central crop with the aspect ratio clamped to the ratio range.
The draws come from :mod:`beton_serve.pipeline.rng`: attempt ``a`` of sample ``sid`` reads
counters ``4a`` (area), ``4a + 1`` (ratio), ``4a + 2`` (row) and ``4a + 3`` (column), so a crop is
a pure function of ``(seed_key, sample_id, image size)``.
"""

from __future__ import annotations

import math

import numpy as np

from beton_serve.pipeline import rng
from beton_serve.pipeline.compiler import Compiler

__all__ = [
    "center_crop",
    "center_crop_batch",
    "random_resized_crop",
    "rrc_batch",
    "rrc_batch_fixed",
]

#: ``numba.njit(nogil=True, error_model="numpy")`` with the persistent compile cache.
_jit = Compiler.kernel


@_jit
def random_resized_crop(
    seed_key, sid, height, width, scale_lo, scale_hi, log_r_lo, log_r_hi, r_min, r_max
):  # pragma: no cover - compiled
    """``(top, left, h, w)`` of one sample's random resized crop (see the module docstring)."""
    area = height * width
    for a in range(10):
        target = area * rng.uniform_range(seed_key, sid, 4 * a, scale_lo, scale_hi)
        ar = math.exp(rng.uniform_range(seed_key, sid, 4 * a + 1, log_r_lo, log_r_hi))
        w = int(np.rint(math.sqrt(target * ar)))
        h = int(np.rint(math.sqrt(target / ar)))
        if 0 < w <= width and 0 < h <= height:
            i = int(rng.uniform_range(seed_key, sid, 4 * a + 2, 0.0, height - h + 1.0))
            j = int(rng.uniform_range(seed_key, sid, 4 * a + 3, 0.0, width - w + 1.0))
            return i, j, h, w
    in_ratio = width / height
    if in_ratio < r_min:
        w = width
        h = int(np.rint(w / r_min))
    elif in_ratio > r_max:
        h = height
        w = int(np.rint(h * r_max))
    else:
        w = width
        h = height
    h = max(1, min(h, height))
    w = max(1, min(w, width))
    return (height - h) // 2, (width - w) // 2, h, w


@_jit
def _rrc_rows(seed_key, batch_indices, heights, widths, scale, ratio):  # pragma: no cover
    """Crops ``(B, 4)`` int64: row ``b`` for sample ``batch_indices[b]`` of size
    ``heights[b] x widths[b]``."""
    n = batch_indices.shape[0]
    out = np.empty((n, 4), np.int64)
    lr0 = math.log(ratio[0])
    lr1 = math.log(ratio[1])
    rmin = min(ratio[0], ratio[1])
    rmax = max(ratio[0], ratio[1])
    for b in range(n):
        i, j, h, w = random_resized_crop(
            seed_key,
            np.uint64(batch_indices[b]),
            int(heights[b]),
            int(widths[b]),
            scale[0],
            scale[1],
            lr0,
            lr1,
            rmin,
            rmax,
        )
        out[b, 0] = i
        out[b, 1] = j
        out[b, 2] = h
        out[b, 3] = w
    return out


@_jit
def rrc_batch(seed_key, batch_indices, heights, widths, scale, ratio):  # pragma: no cover
    """Crops ``(B, 4)`` int64 of a batch; ``heights``/``widths`` are indexed by sample id."""
    return _rrc_rows(
        seed_key, batch_indices, heights[batch_indices], widths[batch_indices], scale, ratio
    )


@_jit
def rrc_batch_fixed(seed_key, batch_indices, height, width, scale, ratio):  # pragma: no cover
    """Crops ``(B, 4)`` of a batch whose images all are ``height x width``."""
    n = batch_indices.shape[0]
    return _rrc_rows(
        seed_key,
        batch_indices,
        np.full(n, height, np.int64),
        np.full(n, width, np.int64),
        scale,
        ratio,
    )


@_jit
def center_crop(height, width, ratio):  # pragma: no cover - compiled
    """FFCV's centre crop: a ``c x c`` square, ``c = int(ratio * min(h, w))``, centred."""
    c = int(ratio * min(height, width))
    c = max(1, min(c, min(height, width)))
    return (height - c) // 2, (width - c) // 2, c, c


@_jit
def center_crop_batch(batch_indices, heights, widths, ratio):  # pragma: no cover - compiled
    """Centre crops ``(B, 4)`` int64 of a batch."""
    n = batch_indices.shape[0]
    out = np.empty((n, 4), np.int64)
    for b in range(n):
        sid = batch_indices[b]
        i, j, h, w = center_crop(int(heights[sid]), int(widths[sid]), ratio)
        out[b, 0] = i
        out[b, 1] = j
        out[b, 2] = h
        out[b, 3] = w
    return out
