"""The ``.beton`` file format (FFCV version 2): layout, validated reader, zero-copy access.

``BetonReader(path, custom_fields=None)`` maps and validates a file; ``memory_read(ptr, state)``
returns a sample's bytes (plain Python that Numba can compile). See ``_layout`` for the bytes and
``_reader`` for the list of checks.
"""

from __future__ import annotations

from beton_serve.format._layout import (
    ALLOC_ENTRY_DTYPE,
    BYTES_META_DTYPE,
    FIELD_DESC_DTYPE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    RGB_META_DTYPE,
    align_up,
    record_dtype,
)
from beton_serve.format._memory import memory_read
from beton_serve.format._reader import BetonReader, Header

__all__ = [
    "ALLOC_ENTRY_DTYPE",
    "BYTES_META_DTYPE",
    "BetonReader",
    "FIELD_DESC_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "Header",
    "RGB_META_DTYPE",
    "align_up",
    "memory_read",
    "record_dtype",
]
