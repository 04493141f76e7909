"""The field ABI (mirrors ``ffcv.fields.base.Field``) plus beton-serve's optional hooks.

A field describes one column of a ``.beton``: the per-sample metadata dtype stored in the record,
the 1024-byte argument blob stored in the field descriptor, how a value is encoded while writing,
and which decoder reads it back.

FFCV's ABI (enough for a custom field, type id 255):

* ``metadata_type``: numpy dtype of this field's slot in each metadata record;
* ``to_binary()``: the 1024-byte argument blob (bytes, a uint8 array or a 1024-byte ``np.void``);
* ``from_binary(blob)`` (static): rebuild the field from that blob (a read-only ``uint8[1024]``);
* ``encode(destination, value, malloc)``: write one sample. ``destination`` is a 1-element view of
  this field's metadata column; ``malloc(n)`` returns ``(absolute_ptr, writable uint8[n] view)``
  and may raise ``MemoryError`` (the writer then retries the whole sample on a fresh page, so
  ``encode`` must be re-runnable);
* ``get_decoder_class()``: the default decoder (an ``Operation`` subclass).

beton-serve hooks (all optional; custom fields without them work):

* ``prepare(value, rng)``: the expensive, pure part of encoding (resize, JPEG encode), run on the
  writer's worker threads. Its result is passed to ``encode_prepared`` on the writer's packing
  thread, which is what makes the output independent of the number of workers.
* ``allocation_checks(column)`` / ``metadata_problem(column)``: vectorised checks the reader runs
  on the metadata column before anything reads sample bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from beton_serve.format import ARGS_SIZE

__all__ = ["AllocationCheck", "Field", "Malloc", "zero_args"]

#: ``malloc(size) -> (absolute file offset, writable uint8 view of ``size`` bytes)``.
Malloc = Callable[[int], "tuple[int, NDArray[np.uint8]]"]


class AllocationCheck(NamedTuple):
    """Pointers a metadata column references, for the reader to check against the table.

    Attributes:
        what: a short label used in error messages, e.g. ``"image data_ptr"``.
        ptrs: ``uint64[N]`` absolute file offsets, one per sample.
        sizes: ``int64[N]`` expected allocation sizes; ``-1`` means "any size >= 1".
        empty_as_one: if true, an expected size of 0 may also be stored as a 1-byte allocation
            (beton-serve's writer avoids zero-size allocations that way).
    """

    what: str
    ptrs: NDArray[np.uint64]
    sizes: NDArray[np.int64]
    empty_as_one: bool = False


def zero_args() -> NDArray[np.uint8]:
    """A fresh all-zero argument blob (what every built-in field but NDArray stores)."""
    return np.zeros(ARGS_SIZE, dtype=np.uint8)


class Field(ABC):
    """Base class of every field; subclass it for a custom field (stored with type id 255)."""

    @property
    @abstractmethod
    def metadata_type(self) -> np.dtype:
        """Numpy dtype of this field's slot in the metadata record."""

    @staticmethod
    @abstractmethod
    def from_binary(binary: NDArray[np.uint8]) -> Field:
        """Rebuild the field from its 1024-byte argument blob; raise ``ValueError`` if invalid."""

    @abstractmethod
    def to_binary(self) -> Any:
        """The 1024-byte argument blob stored in the field descriptor."""

    @abstractmethod
    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        """Encode one value into ``destination`` (1-element metadata view) and ``malloc``'d bytes."""

    @abstractmethod
    def get_decoder_class(self) -> type:
        """The default decoder operation class for this field."""

    # -- beton-serve hooks ------------------------------------------------------------------
    def prepare(self, value: Any, rng: np.random.Generator | None = None) -> Any:
        """Do the expensive, side-effect-free part of encoding ``value`` (thread-safe).

        Args:
            value: the sample's value for this field.
            rng: a generator seeded from (writer seed, sample index, field index), or ``None``
                when the writer has no seed (then FFCV's global ``np.random`` is used).

        Returns:
            Anything ``encode_prepared`` accepts. The default returns ``value`` unchanged.
        """
        return value

    def encode_prepared(self, destination: np.ndarray, prepared: Any, malloc: Malloc) -> None:
        """Encode the result of :meth:`prepare`; must be cheap (runs on the packing thread)."""
        self.encode(destination, prepared, malloc)

    def allocation_checks(self, column: np.ndarray) -> list[AllocationCheck]:
        """Pointers in ``column`` (this field's metadata, all samples) that must be in the table."""
        return []

    def metadata_problem(self, column: np.ndarray) -> tuple[int, str] | None:
        """First invalid metadata value as ``(sample_id, reason)``, or ``None`` if all are valid."""
        return None

    def describe(self) -> dict[str, Any]:
        """Arguments recoverable from the file, for ``inspect`` (JSON-serialisable)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"{type(self).__name__}({args})"


def lazy_decoders(module: str, names: tuple[str, ...]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that also exposes ``names`` from
    :mod:`beton_serve.fields.decoders`, as FFCV does (e.g. ``ffcv.fields.basics.IntDecoder``).

    They are imported on first access, so importing the field module stays free of Numba.
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            from beton_serve.fields import decoders

            return getattr(decoders, name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
