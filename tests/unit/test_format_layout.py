"""Byte layout of the .beton format against ffcv-format.md §1.2-§1.6 and §2.6."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.fields import (
    BytesField,
    FloatField,
    IntField,
    JSONField,
    NDArrayField,
    RGBImageField,
)
from beton_serve.format import (
    ALLOC_ENTRY_DTYPE,
    FIELD_DESC_DTYPE,
    HEADER_DTYPE,
    align_up,
    record_dtype,
)


def test_header_descriptor_and_table_entry_sizes() -> None:
    assert HEADER_DTYPE.itemsize == 24
    assert [HEADER_DTYPE.fields[n][1] for n in HEADER_DTYPE.names] == [0, 2, 4, 8, 16]
    assert FIELD_DESC_DTYPE.itemsize == 1041
    assert FIELD_DESC_DTYPE.fields["name"][1] == 1
    assert FIELD_DESC_DTYPE.fields["arguments"][1] == 17
    assert ALLOC_ENTRY_DTYPE.itemsize == 24


@pytest.mark.parametrize(
    ("fields", "offsets", "size"),
    [
        ([RGBImageField(), IntField()], [0, 16], 24),
        ([IntField(), RGBImageField()], [0, 8], 24),
        ([FloatField(), IntField()], [0, 8], 16),
        ([RGBImageField(), RGBImageField(), NDArrayField(np.uint8, (2,))], [0, 13, 32], 40),
        ([BytesField(), RGBImageField(), FloatField()], [0, 16, 32], 40),
        ([RGBImageField(), BytesField()], [0, 13], 29),
        ([JSONField(), IntField()], [0, 16], 24),
    ],
)
def test_record_layout_matches_spec_table(fields, offsets, size) -> None:
    rec = record_dtype([f.metadata_type for f in fields])
    assert [rec.fields[f"f{i}"][1] for i in range(len(fields))] == offsets
    assert rec.itemsize == size


def test_packed_metadata_structs() -> None:
    rgb = RGBImageField().metadata_type
    assert rgb.itemsize == 13 and rgb.alignment == 1
    assert [rgb.fields[n][1] for n in ("mode", "width", "height", "data_ptr")] == [0, 1, 3, 5]
    b = BytesField().metadata_type
    assert b.itemsize == 16 and b.alignment == 1


def test_ndarray_argument_blob_matches_spec_example() -> None:
    blob = NDArrayField(np.dtype("<f4"), (3, 4)).to_binary()
    assert blob.size == 1024
    assert blob[:8].view("<u8")[0] == 3 and blob[8:16].view("<u8")[0] == 4
    assert not blob[16:256].any()
    assert blob[256:264].view("<u8")[0] == 13
    assert blob[264:277].tobytes() == b'[["", "<f4"]]'
    assert not blob[277:].any()
    back = NDArrayField.from_binary(blob)
    assert back.dtype == np.dtype("<f4") and back.shape == (3, 4)


@pytest.mark.parametrize(
    ("dtype", "text"),
    [("u1", b'[["", "|u1"]]'), (">f8", b'[["", ">f8"]]'), ("f2", b'[["", "<f2"]]')],
)
def test_ndarray_descr_strings(dtype: str, text: bytes) -> None:
    # >f8 and f2 are refused for writing (no decoder reads them); a file may still hold them.
    blob = NDArrayField(np.dtype(dtype), (5,), _from_file=True).to_binary()
    assert blob[264 : 264 + len(text)].tobytes() == text
    assert NDArrayField.from_binary(blob).dtype == np.dtype(dtype)


def test_align_up() -> None:
    assert align_up(0, 8) == 0
    assert align_up(2178, 1 << 23) == 1 << 23
    assert align_up(1 << 23, 1 << 23) == 1 << 23
