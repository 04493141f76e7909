"""Byte layout of a ``.beton`` (FFCV format version 2): dtypes, offsets and small helpers.

A file is, in order (all integers little-endian; see ``ffcv-format.md`` §1)::

    0                     header            24 B   HEADER_DTYPE
    24                    field descriptors F x 1041 B   FIELD_DESC_DTYPE (packed)
    M = 24 + 1041*F       metadata          N x R B  record_dtype(...) (numpy aligned struct)
    (zeros)               up to D = align_up(M + N*R, page_size)
    D                     data pages        P x page_size B, every page written in full
    A = D + P*page_size   allocation table  K x 24 B  ALLOC_ENTRY_DTYPE, runs to end of file

If no field allocates data, P = 0 and A = M + N*R (no padding). The record dtype is the aligned
struct of the per-field metadata dtypes; the RGB and Bytes/JSON metadata structs are *packed*
(alignment 1), exactly as numpy builds them without ``align=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "ALLOC_ENTRY_DTYPE",
    "ARGS_SIZE",
    "BYTES_META_DTYPE",
    "DESC_OFFSET",
    "DESC_SIZE",
    "FIELD_DESC_DTYPE",
    "FORMAT_VERSION",
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "MAX_NAME_BYTES",
    "MIN_READ_PAGE_SIZE",
    "MIN_WRITE_PAGE_SIZE",
    "NDARRAY_ARGS_DTYPE",
    "RGB_META_DTYPE",
    "TYPE_CUSTOM",
    "align_up",
    "data_start",
    "metadata_offset",
    "record_dtype",
]

FORMAT_VERSION = 2
HEADER_SIZE = 24
DESC_OFFSET = 24
DESC_SIZE = 1041
ARGS_SIZE = 1024
MAX_NAME_BYTES = 16
TYPE_CUSTOM = 255
#: FFCV's writer refuses page sizes below 2 MiB; FFCV's reader accepts any. We write >= 2 MiB and
#: read any power of two from 4 KiB (smaller pages are never written by anyone in practice).
MIN_WRITE_PAGE_SIZE = 1 << 21
MIN_READ_PAGE_SIZE = 1 << 12

HEADER_DTYPE = np.dtype(
    [
        ("version", "<u2"),
        ("num_fields", "<u2"),
        ("page_size", "<u4"),
        ("num_samples", "<u8"),
        ("alloc_table_ptr", "<u8"),
    ],
    align=True,
)
FIELD_DESC_DTYPE = np.dtype(
    [("type_id", "<u1"), ("name", "<u1", (MAX_NAME_BYTES,)), ("arguments", "<u1", (ARGS_SIZE,))],
    align=True,
)
ALLOC_ENTRY_DTYPE = np.dtype([("sample_id", "<u8"), ("ptr", "<u8"), ("size", "<u8")])

#: Per-sample metadata of RGBImageField: packed, 13 bytes, alignment 1 (no ``align=True``).
RGB_META_DTYPE = np.dtype(
    [("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]
)
#: Per-sample metadata of BytesField and JSONField: packed, 16 bytes, alignment 1.
BYTES_META_DTYPE = np.dtype([("ptr", "<u8"), ("size", "<u8")])
#: Argument blob of NDArrayField/TorchTensorField: 32 dims, then the length of the dtype text.
NDARRAY_ARGS_DTYPE = np.dtype([("shape", "<u8", (32,)), ("type_length", "<u8")])

if HEADER_DTYPE.itemsize != HEADER_SIZE or FIELD_DESC_DTYPE.itemsize != DESC_SIZE:
    raise ImportError("numpy produced an unexpected .beton header layout")  # pragma: no cover


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a positive integer)."""
    return -(-value // alignment) * alignment


def metadata_offset(num_fields: int) -> int:
    """File offset M of the metadata table for ``num_fields`` fields."""
    return DESC_OFFSET + DESC_SIZE * num_fields


def record_dtype(field_dtypes: Sequence[np.dtype]) -> np.dtype:
    """The metadata record dtype: members ``f0, f1, ...`` laid out by numpy's aligned-struct rule.

    Args:
        field_dtypes: each field's ``metadata_type``, in file order.

    Returns:
        A structured dtype whose itemsize is the record size R.
    """
    return np.dtype([(f"f{i}", np.dtype(d)) for i, d in enumerate(field_dtypes)], align=True)


def data_start(num_fields: int, num_samples: int, record_size: int, page_size: int) -> int:
    """File offset D of the first data page (page-aligned end of the metadata)."""
    return align_up(metadata_offset(num_fields) + num_samples * record_size, page_size)
