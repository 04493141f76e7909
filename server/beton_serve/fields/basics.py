"""Scalar fields stored inline in the metadata record (mirrors ``ffcv.fields.basics``).

``FloatField`` (type 0) stores a ``<f8`` and ``IntField`` (type 1) an ``<i8``; neither allocates
data, and both store an all-zero argument blob. Assignment follows numpy casting, as in FFCV: a
float written to an IntField is truncated toward zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.base import Field, Malloc, lazy_decoders, zero_args

__all__ = ["FloatField", "IntField"]


def _check_zero_args(binary: NDArray[np.uint8], cls: str) -> None:
    if np.any(np.asarray(binary)):
        raise ValueError(f"{cls} stores an all-zero argument blob; this one has non-zero bytes")


class FloatField(Field):
    """A float64 value per sample; decodes to shape ``(1,)`` float64 (``FloatDecoder``)."""

    @property
    def metadata_type(self) -> np.dtype:
        return np.dtype("<f8")

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> FloatField:
        _check_zero_args(binary, "FloatField")
        return FloatField()

    def to_binary(self) -> NDArray[np.uint8]:
        return zero_args()

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        destination[0] = field

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import FloatDecoder

        return FloatDecoder


class IntField(Field):
    """An int64 value per sample; decodes to shape ``(1,)`` int64 (``IntDecoder``)."""

    @property
    def metadata_type(self) -> np.dtype:
        return np.dtype("<i8")

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> IntField:
        _check_zero_args(binary, "IntField")
        return IntField()

    def to_binary(self) -> NDArray[np.uint8]:
        return zero_args()

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        destination[0] = field

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import IntDecoder

        return IntDecoder


# FFCV also exposes its decoders here (e.g. ``ffcv.fields.basics.<Decoder>``).
__getattr__ = lazy_decoders(__name__, ("IntDecoder", "FloatDecoder"))
