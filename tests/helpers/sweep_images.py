"""Smooth random RGB images as a JPEG ``.beton`` (image + label), for the decode-group tests.

Each image is 40..90 px a side (drawn from its index), a gradient with a little noise: JPEG
compresses it well, and crops of it differ visibly from one another.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from beton_serve.fields import IntField, RGBImageField
from beton_serve.writer import DatasetWriter


class SmoothImages:
    """``n`` images, ``(uint8 HWC image, its index)``; ``offset`` changes every image."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n = n
        self.offset = offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        g = np.random.default_rng(self.offset + i)
        h, w = (int(v) for v in g.integers(40, 91, 2))
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([(yy * (c + 1) + xx * (3 - c) + 40 * c) % 256 for c in range(3)], -1)
        img = img + g.normal(0, 4, img.shape)
        return np.clip(img, 0, 255).astype(np.uint8), i


def write_sweep_file(path: Path, n: int, offset: int = 0) -> Path:
    """Write :class:`SmoothImages` as JPEG (quality 90) with an int label to ``path``."""
    DatasetWriter(
        str(path),
        {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
        num_workers=1,
    ).from_indexed_dataset(SmoothImages(n, offset))
    return path
