"""Crop samplers (``_kernels/crop.py``) against a pure-Python reference of FFCV §3.5/§3.6."""

from __future__ import annotations

import math

import numpy as np
import pytest
from beton_serve._kernels.crop import center_crop_batch, rrc_batch, rrc_batch_fixed
from beton_serve.pipeline import rng as R


def ref_rrc(key: int, sid: int, h: int, w: int, scale, ratio) -> tuple[int, int, int, int]:
    def u(c: int, a: float, b: float) -> float:
        return a + (b - a) * R.py_uniform(key, sid, c)

    area = h * w
    lr = (math.log(ratio[0]), math.log(ratio[1]))
    for a in range(10):
        target = area * u(4 * a, *scale)
        ar = math.exp(u(4 * a + 1, *lr))
        cw = round(math.sqrt(target * ar))  # Python's round: half to even, like np.rint
        ch = round(math.sqrt(target / ar))
        if 0 < cw <= w and 0 < ch <= h:
            return int(u(4 * a + 2, 0, h - ch + 1)), int(u(4 * a + 3, 0, w - cw + 1)), ch, cw
    in_ratio = w / h
    if in_ratio < min(ratio):
        cw, ch = w, round(w / min(ratio))
    elif in_ratio > max(ratio):
        ch, cw = h, round(h * max(ratio))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


@pytest.mark.parametrize(
    ("scale", "ratio"),
    [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.2, 0.3)), ((0.35, 1), (1, 1))],
)
def test_rrc_matches_reference(scale, ratio) -> None:
    gen = np.random.default_rng(0)
    n = 300
    ids = gen.integers(0, 2**40, n).astype(np.uint64)
    sizes = gen.integers(1, 600, (n, 2))
    key = R.derive_seed_key(9, 1, 0)
    # rrc_batch indexes sizes by sample id: use dense ids for it, sparse ids for the fixed one
    dense = np.arange(n, dtype=np.uint64)
    got = rrc_batch(
        key, dense, sizes[:, 0].copy(), sizes[:, 1].copy(), np.array(scale), np.array(ratio)
    )
    for i in range(n):
        h, w = (int(v) for v in sizes[i])
        assert tuple(got[i]) == ref_rrc(int(key), i, h, w, scale, ratio)
        t, l_, ch, cw = got[i]
        assert 0 <= t and t + ch <= h and 0 <= l_ and l_ + cw <= w and ch >= 1 and cw >= 1
    fixed = rrc_batch_fixed(key, ids, 375, 500, np.array(scale), np.array(ratio))
    for i in range(n):
        assert tuple(fixed[i]) == ref_rrc(int(key), int(ids[i]), 375, 500, scale, ratio)


def test_rrc_statistics_follow_scale_and_ratio() -> None:
    key = R.derive_seed_key(1, 0, 0)
    ids = np.arange(4000, dtype=np.uint64)
    boxes = rrc_batch_fixed(key, ids, 400, 400, np.array([0.08, 1.0]), np.array([3 / 4, 4 / 3]))
    frac = boxes[:, 2] * boxes[:, 3] / 160000
    ar = boxes[:, 3] / boxes[:, 2]
    assert frac.min() >= 0.07 and frac.max() <= 1.0
    # U(0.08, 1) has mean 0.54; large non-square crops that do not fit are redrawn (torchvision's
    # rule), which lowers the accepted mean on a square image to about 0.48
    assert 0.44 < frac.mean() < 0.52
    assert ar.min() >= 0.74 and ar.max() <= 1.36
    # positions use the whole free range
    assert boxes[:, 0].min() == 0 and boxes[:, 1].min() == 0


def test_center_crop_matches_ffcv_rule() -> None:
    sizes = np.array([[375, 500], [32, 32], [1, 1], [100, 1], [7, 5]])
    for ratio in (1.0, 224 / 256, 0.5):
        got = center_crop_batch(
            np.arange(len(sizes), dtype=np.uint64), sizes[:, 0], sizes[:, 1], ratio
        )
        for (h, w), box in zip(sizes, got, strict=True):
            c = max(1, int(ratio * min(h, w)))
            assert tuple(box) == ((h - c) // 2, (w - c) // 2, c, c)
