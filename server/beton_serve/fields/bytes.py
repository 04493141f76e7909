"""Variable-length byte arrays (type 3; mirrors ``ffcv.fields.bytes.BytesField``).

Metadata is the packed ``{ptr <u8, size <u8}`` struct (16 bytes, alignment 1). The bytes are one
allocation of ``size`` bytes. ``BytesDecoder`` returns rows of the file-wide maximum size.

Differences from FFCV (documented, compatible): only 1-D ``uint8`` arrays, ``bytes`` and
``bytearray`` are accepted (FFCV silently truncates other dtypes), and an empty value is stored as
``size = 0`` with a 1-byte allocation holding 0. FFCV would make a zero-size allocation, whose
pointer can collide with the next allocation's in the table (ffcv-format.md §1.6).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from beton_serve.fields.base import AllocationCheck, Field, Malloc, lazy_decoders, zero_args
from beton_serve.format import BYTES_META_DTYPE

__all__ = ["BytesField"]


def as_byte_array(value: Any, what: str) -> NDArray[np.uint8]:
    """``value`` as a 1-D uint8 array (no copy for arrays); ``ValueError`` for anything else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, dtype=np.uint8)
    arr = np.asarray(value)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(
            f"{what} needs a 1-D uint8 array or bytes, got {arr.dtype} with shape {arr.shape}; "
            "convert it first (e.g. arr.view(np.uint8).ravel())"
        )
    return arr


class BytesField(Field):
    """A variable-length byte string per sample."""

    @property
    def metadata_type(self) -> np.dtype:
        return BYTES_META_DTYPE

    @staticmethod
    def from_binary(binary: NDArray[np.uint8]) -> BytesField:
        if np.any(np.asarray(binary)):
            raise ValueError("BytesField stores an all-zero argument blob; this one is not")
        return BytesField()

    def to_binary(self) -> NDArray[np.uint8]:
        return zero_args()

    def prepare(self, value: Any, rng: np.random.Generator | None = None) -> Any:
        return as_byte_array(value, type(self).__name__)

    def encode(self, destination: np.ndarray, field: Any, malloc: Malloc) -> None:
        data = as_byte_array(field, type(self).__name__)
        size = int(data.size)
        ptr, buf = malloc(max(size, 1))
        if size:
            buf[:] = data
        else:
            buf[:] = 0
        destination["ptr"] = ptr
        destination["size"] = size

    def get_decoder_class(self) -> type:
        from beton_serve.fields.decoders import BytesDecoder

        return BytesDecoder

    def allocation_checks(self, column: np.ndarray) -> list[AllocationCheck]:
        ptrs = np.ascontiguousarray(column["ptr"], dtype=np.uint64)
        sizes = np.ascontiguousarray(column["size"]).astype(np.uint64)
        # Sizes that do not fit an int64 cannot be real; map them to an impossible value.
        big = sizes > np.uint64(2**62)
        sizes_i = sizes.astype(np.int64)
        sizes_i[big] = -2
        return [AllocationCheck(f"{type(self).__name__} ptr", ptrs, sizes_i, empty_as_one=True)]


# FFCV also exposes its decoders here (e.g. ``ffcv.fields.bytes.<Decoder>``).
__getattr__ = lazy_decoders(__name__, ("BytesDecoder",))
