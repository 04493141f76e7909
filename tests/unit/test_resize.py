"""Compiled area resize vs OpenCV INTER_AREA and a plain-NumPy reference.

Stated tolerance: max |diff| <= 1 grey level against ``cv2.resize(..., INTER_AREA)`` and against
the float64 NumPy reference, with more than 99.9% of pixels exactly equal to OpenCV's.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from beton_serve._kernels.resize import area_table, resize_crop, scratch_size


def area_matrix(ssize: int, dsize: int) -> np.ndarray:
    """Reference weights: output cell d averages source [d*s, (d+1)*s), s = ssize / dsize."""
    s = ssize / dsize
    m = np.zeros((dsize, ssize))
    for d in range(dsize):
        a, b = d * s, (d + 1) * s
        for x in range(int(np.floor(a)), min(ssize, int(np.ceil(b)))):
            m[d, x] = max(0.0, min(b, x + 1) - max(a, x)) / s
    return m


def numpy_area(img: np.ndarray, oh: int, ow: int) -> np.ndarray:
    wy, wx = area_matrix(img.shape[0], oh), area_matrix(img.shape[1], ow)
    out = np.einsum("yh,hwc,xw->yxc", wy, img.astype(np.float64), wx)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def test_area_table_rows_sum_to_one() -> None:
    for ssize, dsize in [(500, 224), (7, 3), (10, 10), (301, 64), (9, 4)]:
        start, count, w = area_table(ssize, dsize)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-5)
        dense = np.zeros((dsize, ssize))
        for d in range(dsize):
            dense[d, start[d] : start[d] + count[d]] = w[d, : count[d]]
        np.testing.assert_allclose(dense, area_matrix(ssize, dsize), atol=2e-3)


@pytest.mark.parametrize("seed", range(4))
def test_matches_cv2_and_numpy_on_random_crops(seed: int) -> None:
    gen = np.random.default_rng(seed)
    scratch = np.empty(scratch_size(400, 400), np.float32)
    diffs, total_exact, total = 0, 0, 0
    for t in range(40):
        h_img, w_img = gen.integers(2, 200, 2)
        img = gen.integers(0, 256, (h_img, w_img, 3), dtype=np.uint8)
        if t % 2:
            img = cv2.GaussianBlur(img, (5, 5), 2)
        top, left = gen.integers(0, h_img), gen.integers(0, w_img)
        h, w = gen.integers(1, h_img - top + 1), gen.integers(1, w_img - left + 1)
        oh, ow = int(gen.integers(1, h + 1)), int(gen.integers(1, w + 1))
        dst = np.empty((oh, ow, 3), np.uint8)
        resize_crop(img, int(top), int(left), int(h), int(w), dst, scratch)
        crop = img[top : top + h, left : left + w]
        ref = cv2.resize(crop, (ow, oh), interpolation=cv2.INTER_AREA)
        d = np.abs(dst.astype(int) - ref)
        diffs = max(diffs, int(d.max()))
        total_exact += int((d == 0).sum())
        total += d.size
        assert np.abs(dst.astype(int) - numpy_area(crop, oh, ow)).max() <= 1
    assert diffs <= 1
    assert total_exact / total > 0.999


def test_integer_factor_and_identity_are_exact() -> None:
    gen = np.random.default_rng(9)
    img = gen.integers(0, 256, (96, 120, 3), dtype=np.uint8)
    scratch = np.empty(scratch_size(120, 120), np.float32)
    for oh, ow in [(48, 60), (32, 40), (96, 120), (24, 30)]:
        dst = np.empty((oh, ow, 3), np.uint8)
        resize_crop(img, 0, 0, 96, 120, dst, scratch)
        np.testing.assert_array_equal(dst, cv2.resize(img, (ow, oh), interpolation=cv2.INTER_AREA))


def test_an_upscale_is_opencvs_with_cv2_and_within_one_of_it_with_area() -> None:
    """``"cv2"`` calls OpenCV; ``"area"`` runs the compiled upscale (``_kernels.upscale``), whose
    own tests compare it with OpenCV and a NumPy statement of its arithmetic. Also a source and
    a destination that are not C-contiguous."""
    gen = np.random.default_rng(1)
    img = gen.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    scratch = np.empty(scratch_size(64, 64), np.float32)
    ref = cv2.resize(img, (25, 40), interpolation=cv2.INTER_AREA)
    dst = np.empty((40, 25, 3), np.uint8)  # up in height, down in width
    resize_crop(img, 0, 0, 20, 30, dst, scratch, "cv2")
    np.testing.assert_array_equal(dst, ref)
    resize_crop(img, 0, 0, 20, 30, dst, scratch, "area")
    assert np.abs(dst.astype(np.int16) - ref).max() <= 1
    area = dst.copy()
    wide = np.zeros((40, 50, 3), np.uint8)
    resize_crop(np.asfortranarray(img), 0, 0, 20, 30, wide[:, ::2], scratch, "area")
    np.testing.assert_array_equal(wide[:, ::2], area)
    assert not wide[:, 1::2].any()


def test_exactly_sized_scratch_is_enough_and_nothing_past_it_is_touched() -> None:
    # the horizontal pass reads and writes 4 lanes per RGB pixel: one float past the row in
    # each half of the scratch, which scratch_size counts; a sentinel after it stays put
    gen = np.random.default_rng(3)
    img = gen.integers(0, 256, (61, 77, 3), dtype=np.uint8)
    for top, left, h, w, oh, ow in [
        (0, 0, 61, 77, 40, 50),
        (5, 30, 56, 47, 31, 29),
        (0, 76, 61, 1, 7, 1),
    ]:
        need = scratch_size(w, ow)
        buf = np.full(need + 16, np.nan, np.float32)
        dst = np.empty((oh, ow, 3), np.uint8)
        resize_crop(img, top, left, h, w, dst, buf[:need])
        assert np.isnan(buf[need:]).all()
        ref = cv2.resize(
            img[top : top + h, left : left + w], (ow, oh), interpolation=cv2.INTER_AREA
        )
        assert np.abs(dst.astype(int) - ref).max() <= 1


def float32_area(crop: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The kernel's arithmetic stated in NumPy float32: per output row the vertical weighted
    sum of its source rows (taps in order), then per column the horizontal weighted sum (taps
    in order), each a float32 product and add; saturate, round half to even."""
    ys, yc, yw = area_table(crop.shape[0], oh)
    xs, xc, xw = area_table(crop.shape[1], ow)
    src = crop.astype(np.float32)
    out = np.empty((oh, ow, 3), np.uint8)
    for dy in range(oh):
        acc = yw[dy, 0] * src[ys[dy]]
        for k in range(1, yc[dy]):
            acc = acc + yw[dy, k] * src[ys[dy] + k]
        for d in range(ow):
            v = xw[d, 0] * acc[xs[d]]
            for k in range(1, xc[d]):
                v = v + xw[d, k] * acc[xs[d] + k]
            out[dy, d] = np.rint(np.clip(v, np.float32(0), np.float32(255)))
    return out


@pytest.mark.parametrize("shrink", [1.0, 1.3, 1.9, 2.6, 3.4, 4.7, 6.2])
def test_every_tap_count_equals_the_float32_statement_bit_for_bit(shrink: float) -> None:
    """Columns with up to 5 taps run two to a vector with the taps unrolled and the table
    padded by zero weights; wider ones one per vector. Either way the bytes are those of the
    scalar float32 order, for odd and even output widths, with a scratch full of NaNs."""
    gen = np.random.default_rng(int(shrink * 10))
    for t in range(12):
        ow = int(gen.integers(1, 40)) * 2 + t % 2
        w = max(ow, round(ow * shrink) + int(gen.integers(0, 3)))
        oh = int(gen.integers(1, 30))
        h = int(gen.integers(oh, 3 * oh + 2))
        img = cv2.GaussianBlur(gen.integers(0, 256, (h + 3, w + 5, 3), dtype=np.uint8), (3, 3), 1)
        need = scratch_size(w, ow)
        scratch = np.full(need + 8, np.nan, np.float32)
        dst = np.empty((oh, ow, 3), np.uint8)
        if (oh, ow) == (h, w) or (h % oh == 0 and w % ow == 0):
            continue  # the copy and the integer-factor paths, tested above
        resize_crop(img, 2, 4, h, w, dst, scratch[:need])
        np.testing.assert_array_equal(dst, float32_area(img[2 : 2 + h, 4 : 4 + w], oh, ow))
        assert np.isnan(scratch[need:]).all()
