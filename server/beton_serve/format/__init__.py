"""The ``.beton`` file format (FFCV version 2): layout, validated reader, zero-copy access.

``BetonReader(path, custom_fields=None)`` maps and validates a file; ``memory_read(ptr, state)``
returns a sample's bytes (plain Python that Numba can compile). See ``_layout`` for the bytes and
``_reader`` for the list of checks. ``_checksum`` holds the per-sample CRC32C sidecar
(``FILE.crc32c``): ``write_sidecar(reader)`` and ``ChecksumVerifier(readers).check(ids)``.
``_guard`` turns SIGBUS from a file truncated under its mapping into zeros that
``check_mapping()`` reports (``guard_mapping(mmap, address, length) -> MappedRegion``).
"""

from __future__ import annotations

from beton_serve.format._checksum import (
    SIDECAR_SUFFIX,
    ChecksumVerifier,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from beton_serve.format._guard import Region as MappedRegion
from beton_serve.format._guard import guard as guard_mapping
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
    "ChecksumVerifier",
    "FIELD_DESC_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "Header",
    "MappedRegion",
    "RGB_META_DTYPE",
    "SIDECAR_SUFFIX",
    "align_up",
    "guard_mapping",
    "memory_read",
    "read_sidecar",
    "record_dtype",
    "sidecar_path",
    "write_sidecar",
]
