"""Scalar fields stored inline in the metadata record (mirrors ``ffcv.fields.basics``).

``FloatField`` (type 0) stores a ``<f8`` and ``IntField`` (type 1) an ``<i8``; neither allocates
data, and both store an all-zero argument blob.

Values: FFCV assigns whatever it is given into the numpy record, so ``3.7`` written to an
IntField is stored as ``3``, ``"5"`` as ``5``, ``None`` in a FloatField as NaN, and a label past
the int64 range fails with an ``OverflowError`` that names no sample. Here a value is stored only
when the stored value is the value given (:func:`exact_int`, :func:`real_float`): an IntField
takes integers (Python, numpy or a one-element tensor/array of an integer dtype, or a float that
is a whole number, e.g. ``3.0``) within int64; a FloatField takes real numbers. Anything else is
a ``ValueError`` saying what was given, which the writer reports with the sample's index.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np
from beton_wire.limits import short_repr
from numpy.typing import NDArray

from beton_serve.fields.base import Field, Malloc, lazy_decoders, zero_args

__all__ = ["FloatField", "IntField"]


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _scalar(value: Any, field: str) -> Any:
    """The one number ``value`` holds (a size-1 array or tensor gives its element)."""
    if value is None or isinstance(value, (str, bytes, bytearray)):
        raise ValueError(f"{field} stores a number per sample, got {value!r}")
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return value
    arr = np.asarray(value)
    if arr.size != 1 or arr.dtype.kind not in "biufc":
        raise ValueError(
            f"{field} stores one number per sample, got {type(value).__name__} of shape "
            f"{arr.shape} and dtype {arr.dtype}"
        )
    return arr.reshape(()).item()


def exact_int(value: Any) -> int:
    """``value`` as an int64, only when that is exactly its value (see the module docstring).

    Raises:
        ValueError: not an integer, a float with a fraction (or NaN, inf), or outside int64.
    """
    x = _scalar(value, "IntField")
    try:
        v = operator.index(x)
    except TypeError:
        v = _whole(x, value)
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ValueError(f"IntField stores int64 values, got {v}, which is outside its range")
    return v


def _whole(x: Any, value: Any) -> int:
    """The int a float ``x`` (from ``value``) equals; ``ValueError`` if it has a fraction."""
    if not isinstance(x, (float, np.floating)):  # a complex number, or no number at all
        raise ValueError(f"IntField stores integers, got {value!r}")
    f = float(x)
    if not math.isfinite(f):
        raise ValueError(f"IntField stores integers, got {value!r}; use FloatField")
    if not f.is_integer():
        raise ValueError(
            f"IntField stores integers, got {value!r}, which FFCV would store as {int(f)}; "
            "round it first, or use FloatField"
        )
    return int(f)


def real_float(value: Any) -> float:
    """``value`` as a float64 (a real number; see the module docstring).

    Raises:
        ValueError: ``None``, a string, a complex number, or not one number.
    """
    x = _scalar(value, "FloatField")
    if isinstance(x, (complex, np.complexfloating)):
        raise ValueError(f"FloatField stores real numbers, got {value!r}")
    try:
        f = float(x)
    except OverflowError:  # an int beyond float64's range
        raise ValueError(
            f"FloatField stores float64 values; {short_repr(value)} overflows it"
        ) from None
    except (TypeError, ValueError):
        raise ValueError(f"FloatField stores real numbers, got {value!r}") from None
    if not math.isfinite(f) and bool(np.isfinite(x)):  # a finite longdouble beyond float64
        raise ValueError(
            f"FloatField stores float64 values; {short_repr(value)} overflows it to {f}"
        )
    return f


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
        destination[0] = real_float(field)

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
        destination[0] = exact_int(field)

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import IntDecoder

        return IntDecoder


# FFCV also exposes its decoders here (e.g. ``ffcv.fields.basics.<Decoder>``).
__getattr__ = lazy_decoders(__name__, ("IntDecoder", "FloatDecoder"))
