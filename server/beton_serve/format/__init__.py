"""The ``.beton`` file format (FFCV version 2): layout, validated reader, zero-copy access.

``BetonReader(path, custom_fields=None, *, field_types=None)`` maps and validates a file;
``memory_read(ptr, state)`` returns a sample's bytes (plain Python that Numba can compile). The
layout constants and dtypes below are the format's public spec (``_layout`` documents the bytes;
``fields`` and ``writer`` use them from here), and ``_reader`` lists the checks. This package
never imports ``beton_serve.fields`` (it sits below it): the reader is given the field class of
each type id (``field_types``), and without one it uses ``default_field_types()``, the built-in
table that the package root supplies (``beton_serve._field_types``).

``_checksum`` holds the per-sample CRC32C sidecar (``FILE.crc32c``): ``write_sidecar(reader)``
and ``ChecksumVerifier(readers).check(ids)``. ``_guard`` turns SIGBUS from a file truncated under
its mapping into zeros that ``check_mapping()`` reports (``guard_mapping(mmap, address, length)
-> MappedRegion``).
"""

from __future__ import annotations

from beton_serve.format._checksum import (
    SIDECAR_SUFFIX,
    ChecksumVerifier,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from beton_serve.format._files import NotRegularFile, open_regular
from beton_serve.format._guard import Region as MappedRegion
from beton_serve.format._guard import guard as guard_mapping
from beton_serve.format._layout import (
    ALLOC_ENTRY_DTYPE,
    ARGS_SIZE,
    BYTES_META_DTYPE,
    DESC_OFFSET,
    DESC_SIZE,
    FIELD_DESC_DTYPE,
    FORMAT_VERSION,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_NAME_BYTES,
    MIN_READ_PAGE_SIZE,
    MIN_WRITE_PAGE_SIZE,
    NDARRAY_ARGS_DTYPE,
    RGB_META_DTYPE,
    TYPE_CUSTOM,
    align_up,
    data_start,
    metadata_offset,
    record_dtype,
)
from beton_serve.format._memory import memory_read
from beton_serve.format._reader import BetonReader, Header, default_field_types, readers_digest

__all__ = [
    "NotRegularFile",
    "open_regular",
    "ALLOC_ENTRY_DTYPE",
    "ARGS_SIZE",
    "BYTES_META_DTYPE",
    "BetonReader",
    "ChecksumVerifier",
    "DESC_OFFSET",
    "DESC_SIZE",
    "FIELD_DESC_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "Header",
    "MAX_NAME_BYTES",
    "MIN_READ_PAGE_SIZE",
    "MIN_WRITE_PAGE_SIZE",
    "MappedRegion",
    "NDARRAY_ARGS_DTYPE",
    "RGB_META_DTYPE",
    "SIDECAR_SUFFIX",
    "TYPE_CUSTOM",
    "align_up",
    "data_start",
    "default_field_types",
    "guard_mapping",
    "memory_read",
    "metadata_offset",
    "read_sidecar",
    "readers_digest",
    "record_dtype",
    "sidecar_path",
    "write_sidecar",
]
