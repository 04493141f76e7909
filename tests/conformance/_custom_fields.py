"""A custom field class for the conformance suite, importable by module path
(``conformance._custom_fields``) so that a daemon given this tests directory on its path can
load it as a training script's own class."""

from __future__ import annotations

from typing import Any

import numpy as np
from beton_serve.fields import IntField, NDArrayField


class TaggedInt(IntField):
    """An ``IntField`` subclass: written as a custom field (type 255), read with ``IntDecoder``."""

    @staticmethod
    def from_binary(binary: Any) -> TaggedInt:
        return TaggedInt()


class Rows:
    """``(vec, label)`` samples with ``vec == label == base + i`` (as ``helpers.labelled``)."""

    def __init__(self, n: int, base: int) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(4, self.base + i, dtype=np.float32), self.base + i


def write_custom(path: Any, n: int, base: int) -> Any:
    """Write ``n`` rows with ``label`` as a :class:`TaggedInt` custom field."""
    from beton_serve.writer import DatasetWriter

    DatasetWriter(
        str(path),
        {"vec": NDArrayField(np.dtype("float32"), (4,)), "label": TaggedInt()},
        num_workers=1,
    ).from_indexed_dataset(Rows(n, base))
    return path
