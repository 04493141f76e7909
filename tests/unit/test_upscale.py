"""The compiled linear upscale (``_kernels.upscale``) and the batch crop kernel (``_kernels.crops``).

Checked against a plain NumPy statement of the same fixed-point arithmetic (exact), against
OpenCV's ``INTER_AREA`` (within 1 grey level; on this project's x86-64 hosts every pixel is
equal, which the test reports), at the edges of the source buffer (a guard page after the image),
and as a batch against the per-sample kernels it replaces.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from beton_serve._kernels.crops import resize_crops
from beton_serve._kernels.resize import resize_crop, scratch_size
from beton_serve._kernels.upscale import linear_table, rows_size, upscale_into


def _np_table(s: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's INTER_AREA weights for an axis that does not shrink, in NumPy (the reference)."""
    inv = n / s
    scale = 1.0 / inv
    start = np.empty(n, np.int64)
    w0 = np.empty(n, np.int64)
    w1 = np.empty(n, np.int64)
    for d in range(n):
        sx = int(np.floor(d * scale))
        f = np.float32((d + 1) - (sx + 1) * inv)
        f = np.float32(0.0) if f <= 0 else np.float32(f - np.floor(f))
        if sx + 1 >= s:
            start[d], w0[d], w1[d] = s - 1, 2048, 0
        else:
            start[d] = sx
            w0[d] = int(np.rint((np.float32(1.0) - f) * np.float32(2048)))
            w1[d] = int(np.rint(f * np.float32(2048)))
    return start, w0, w1


def _np_upscale(crop: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The module docstring's arithmetic, vectorised in NumPy, on a (h, w, 3) uint8 crop."""
    h, w = crop.shape[:2]
    xs, xw0, xw1 = _np_table(w, ow)
    ys, yw0, yw1 = _np_table(h, oh)
    c = crop.astype(np.int64)
    nxt = np.minimum(xs + 1, w - 1)
    hp = (c[:, xs, :] * xw0[None, :, None] + c[:, nxt, :] * xw1[None, :, None]) >> 4  # (h, ow, 3)
    r0 = hp[ys]
    r1 = hp[np.minimum(ys + 1, h - 1)]
    v = ((r0 * yw0[:, None, None]) >> 16) + ((r1 * yw1[:, None, None]) >> 16)
    return np.clip((v + 2) >> 2, 0, 255).astype(np.uint8)


def _run(img: np.ndarray, top: int, left: int, ch: int, cw: int, oh: int, ow: int) -> np.ndarray:
    out = np.full((oh, ow, 3), 7, np.uint8)
    rows = np.empty(rows_size(ow), np.int16)
    upscale_into(img.reshape(-1), img.shape[1], top, left, ch, cw, out.reshape(-1), oh, ow, rows)
    return out


def _cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    while n:
        hh, ww = (int(x) for x in rng.integers(1, 120, 2))
        ch, cw = int(rng.integers(1, hh + 1)), int(rng.integers(1, ww + 1))
        top, left = int(rng.integers(0, hh - ch + 1)), int(rng.integers(0, ww - cw + 1))
        oh, ow = (int(x) for x in rng.integers(1, 160, 2))
        if oh <= ch and ow <= cw:
            continue  # a downscale in both directions is the area kernel's
        n -= 1
        img = rng.integers(0, 256, (hh, ww, 3), np.uint8)
        yield img, top, left, ch, cw, oh, ow


def test_the_table_is_opencvs() -> None:
    for s, n in [(1, 5), (2, 3), (3, 7), (7, 7), (10, 3), (150, 224), (223, 224), (5, 160)]:
        got = linear_table(s, n)
        want = _np_table(s, n)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.int64), w)


def test_pixels_equal_the_numpy_statement_of_the_arithmetic() -> None:
    for img, top, left, ch, cw, oh, ow in _cases(200, 0):
        crop = img[top : top + ch, left : left + cw]
        np.testing.assert_array_equal(
            _run(img, top, left, ch, cw, oh, ow), _np_upscale(crop, oh, ow)
        )


def test_pixels_are_within_one_of_opencv_inter_area() -> None:
    cv2 = pytest.importorskip("cv2")
    total = exact = 0
    for img, top, left, ch, cw, oh, ow in _cases(200, 1):
        crop = np.ascontiguousarray(img[top : top + ch, left : left + cw])
        ref = cv2.resize(crop, (ow, oh), interpolation=cv2.INTER_AREA)
        d = np.abs(ref.astype(np.int16) - _run(img, top, left, ch, cw, oh, ow))
        assert d.max() <= 1, (img.shape, top, left, ch, cw, oh, ow)
        total += d.size
        exact += int((d == 0).sum())
    # OpenCV's own SIMD vertical pass is this arithmetic; only its scalar row tails may differ
    assert exact / total >= 0.99


def test_the_last_pixel_of_a_buffer_followed_by_a_guard_page_is_read_safely() -> None:
    """The horizontal pass loads 4 bytes per tap; at the end of the image it must fall back to
    scalar loads. The image's last byte is put just before a PROT_NONE page, in a child process
    (a read past it would kill the child with SIGSEGV, not the test run)."""
    code = textwrap.dedent(
        """
        import ctypes, mmap
        import numpy as np
        from beton_serve._kernels.upscale import rows_size, upscale_into
        page = mmap.PAGESIZE
        buf = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(base + page, page, 0) == 0
        h, w = 9, 13
        n = h * w * 3
        img = np.frombuffer(buf, np.uint8, count=n, offset=page - n)
        img[:] = np.arange(n) % 251
        out = np.empty(64 * 64 * 3, np.uint8)
        rows = np.empty(rows_size(64), np.int16)
        for top, left, ch, cw in [(0, 0, 9, 13), (8, 12, 1, 1), (5, 7, 4, 6), (8, 0, 1, 13)]:
            upscale_into(img, w, top, left, ch, cw, out, 64, 64, rows)
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_a_batch_equals_the_per_sample_kernels_and_writes_only_its_rows() -> None:
    rng = np.random.default_rng(2)
    batch, oh, ow = 12, 40, 56
    dst = np.full((batch, oh, ow, 3), 7, np.uint8)
    want = dst.copy()
    imgs, meta = [], []
    for b in range(0, batch, 2):  # odd rows stay untouched
        hh, ww = (int(x) for x in rng.integers(60, 140, 2))
        img = rng.integers(0, 256, (hh, ww, 3), np.uint8)
        img.flags.writeable = False  # the decode cache's arrays are read-only
        if b % 4 == 0:  # a downscale in both directions, then a crop smaller than the output
            ch, cw = int(rng.integers(oh, hh + 1)), int(rng.integers(ow, ww + 1))
        else:
            ch, cw = int(rng.integers(1, oh)), int(rng.integers(1, ww + 1))
        top, left = int(rng.integers(0, hh - ch + 1)), int(rng.integers(0, ww - cw + 1))
        imgs.append(img)
        meta.append((b, hh, ww, top, left, ch, cw))
        if oh <= ch and ow <= cw:
            scratch = np.empty(scratch_size(ww, ow), np.float32)
            resize_crop(img, top, left, ch, cw, want[b], scratch, "area")
        else:
            want[b] = _run(img, top, left, ch, cw, oh, ow)
    assert any(oh <= m[5] and ow <= m[6] for m in meta) and any(
        not (oh <= m[5] and ow <= m[6]) for m in meta
    )  # both kinds are in the batch
    addrs = np.array([im.__array_interface__["data"][0] for im in imgs], np.int64)
    scratch = np.empty(scratch_size(140, ow), np.float32)
    rows = np.empty(rows_size(ow), np.int16)
    resize_crops(addrs, np.array(meta, np.int64), dst, dst.reshape(-1), scratch, rows)
    np.testing.assert_array_equal(dst, want)
