"""``beton_wire.skipped``: the samples a grpc batch skipped, as sent to a multi-daemon client."""

from __future__ import annotations

import numpy as np
import pytest
from beton_wire.skipped import MAX_CAUSE_CHARS, Skipped, decode, encode, max_bytes


class CorruptJpeg(Exception):
    pass


def test_records_round_trip_with_the_in_process_words() -> None:
    found = [
        (5, "RandomResizedCropRGBImageDecoder", CorruptJpeg("bad Huffman table")),
        (9, "x", ValueError("")),
    ]
    got = decode(encode(found))
    assert got == [
        Skipped(5, "RandomResizedCropRGBImageDecoder", "CorruptJpeg", "bad Huffman table"),
        Skipped(9, "x", "ValueError", ""),
    ]
    assert got[0].describe() == f"{type(found[0][2]).__name__}: {found[0][2]}"


def test_the_worst_record_fits_the_bound_the_client_checks() -> None:
    """Causes are cut, and JSON escapes every character at most 6 bytes, so a batch of n
    skipped samples is at most ``max_bytes(n)`` (the client refuses a larger header)."""
    nasty = '\u2603\x00"\\' * 5000
    found = [(2**63, nasty, type("☃" * 500, (Exception,), {})(nasty)) for _ in range(8)]
    array = encode(found)
    assert array.dtype == np.uint8 and array.size <= max_bytes(8)
    rec = decode(array)[0]
    assert rec.sample_id == 2**63 and len(rec.cause) == MAX_CAUSE_CHARS
    assert rec.cause == nasty[:MAX_CAUSE_CHARS]


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe",
        b"not json",
        b'{"a": 1}',
        b"[[1, 2, 3]]",
        b'[[-1, "op", "T", "c"]]',
        b'[[1.5, "op", "T", "c"]]',
        b'[[true, "op", "T", "c"]]',
        b'[[1, 2, "T", "c"]]',
    ],
)
def test_a_malformed_array_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="skipped"):
        decode(np.frombuffer(raw, np.uint8))
