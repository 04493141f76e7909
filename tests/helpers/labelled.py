"""Small ``.beton`` files whose every value names its sample: ``vec`` (4 x float32) and
``label`` (int) both equal ``base + sample id``, so a test can tell two files, and two samples,
apart by content alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from beton_serve.fields import IntField, NDArrayField
from beton_serve.writer import DatasetWriter


class LabelledRows:
    """An indexed dataset of ``(vector, label)``; ``base`` makes every value distinct per file."""

    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(4, self.base + i, dtype=np.float32), self.base + i


def write_labelled(path: Path, n: int, base: int) -> Path:
    """Write ``n`` samples of :class:`LabelledRows` to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    DatasetWriter(
        str(path), {"vec": NDArrayField(np.dtype("float32"), (4,)), "label": IntField()}
    ).from_indexed_dataset(LabelledRows(n, base))
    return path


class PixelRows:
    """``(pixels, label)`` rows: ``pixels`` is ``ROW`` bytes of ``(i + shift) % 251`` for the
    samples in ``changed`` (``shift`` 0 elsewhere), ``label`` is ``i``. Two files of it that
    differ only in ``shift`` have the same sizes, labels and order, and, when ``changed`` leaves
    out enough samples at both ends, the same first and last 64 KiB: raw pixels regenerated in
    place of a dataset."""

    ROW = 3072

    def __init__(self, n: int, shift: int = 0, changed: range = range(0)) -> None:
        self.n, self.shift, self.changed = n, shift, changed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        value = (i + (self.shift if i in self.changed else 0)) % 251
        return np.full(self.ROW, value, dtype=np.uint8), i


def write_pixels(path: Path, n: int, shift: int = 0, changed: range = range(0)) -> Path:
    """Write ``n`` samples of :class:`PixelRows` (fields ``pixels``, ``label``) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    DatasetWriter(
        str(path),
        {"pixels": NDArrayField(np.dtype("uint8"), (PixelRows.ROW,)), "label": IntField()},
    ).from_indexed_dataset(PixelRows(n, shift, changed))
    return path
