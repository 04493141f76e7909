"""Deterministic synthetic image datasets, numpy only, for benchmarks that must match the reference
figures quoted in the issues (measured on FFCV 1.0.2 with exactly these datasets).

    ImageNetLike(n=5000, lo=300, hi=500, seed=7001)  # write with RGBImageField(write_mode='jpg', jpeg_quality=90), IntField
    CifarLike(n=50000, hw=(32, 32), seed=7002)        # write with RGBImageField(write_mode='raw'), IntField

Both are indexed datasets returning (uint8 HWC RGB image, int label), as DatasetWriter.from_indexed_dataset
expects. The reference files were written with num_workers=2 and the default 8 MiB page size.
Note: these JPEGs average ~22 KB (0.14 B/px), sparser than real photos, so decode-bound figures
are optimistic in absolute terms; compare ratios.
"""

import numpy as np


def synth_image(seed, h, w, gray=False):
    """Smooth gradients + a sinusoidal texture + 1-4 flat shapes + N(0, 3) noise; ``seed`` is
    anything np.random.default_rng accepts."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    yn = yy / max(h - 1, 1)
    xn = xx / max(w - 1, 1)
    img = np.empty((h, w, 3), np.float64)
    for c in range(3):
        a, b = rng.uniform(-120, 120, size=2)
        base = rng.uniform(40, 215)
        img[..., c] = base + a * (xn - 0.5) + b * (yn - 0.5)
    fx, fy = rng.uniform(0.5, 4.0, size=2)
    phase = rng.uniform(0, 2 * np.pi)
    img += (20.0 * np.sin(2 * np.pi * (fx * xn + fy * yn) + phase))[..., None]
    for _ in range(int(rng.integers(1, 5))):
        col = rng.uniform(0, 255, size=3)
        if rng.random() < 0.5:
            y0, y1 = np.sort(rng.integers(0, h + 1, size=2))
            x0, x1 = np.sort(rng.integers(0, w + 1, size=2))
            img[y0:y1, x0:x1] = 0.3 * img[y0:y1, x0:x1] + 0.7 * col
        else:
            cy, cx = rng.uniform(0, h), rng.uniform(0, w)
            r = rng.uniform(0.05, 0.4) * min(h, w) + 1.0
            m = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            img[m] = col
    img += rng.normal(0.0, 3.0, size=img.shape)
    if gray:
        img[...] = img.mean(axis=2, keepdims=True)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


class ImageNetLike:
    def __init__(self, n=5000, lo=300, hi=500, seed=7001):
        self.n, self.seed = n, seed
        self.sizes = np.random.default_rng([seed, 0]).integers(lo, hi + 1, size=(n, 2))
        self.labels = np.random.default_rng([seed, 1]).integers(0, 1000, size=n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        h, w = (int(v) for v in self.sizes[i])
        return synth_image([self.seed, 2, i], h, w, gray=(i % 10 == 0)), int(self.labels[i])


class CifarLike:
    def __init__(self, n=50000, hw=(32, 32), seed=7002):
        self.n, self.hw, self.seed = n, hw, seed
        self.labels = np.random.default_rng([seed, 1]).integers(0, 10, size=n)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        h, w = self.hw
        return synth_image([self.seed, 2, i], h, w, gray=(i % 10 == 0)), int(self.labels[i])
