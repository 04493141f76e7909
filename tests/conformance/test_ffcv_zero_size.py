"""Zero-size allocations as FFCV 1.0.2 writes them (found by a helper's audit, session 41).

FFCV's ``BytesField`` allocates ``size`` bytes for a value, 0 for ``b""``, and its allocator then
records whatever pointer it held: the data start minus a page when the worker had booked no page
yet (0 here), or the end of the data region after an exactly full last page. Our reader refused
such files ("ptr is outside [D, A)"). ``tests/data/ffcv/bytes_empty_values.beton`` was written by
FFCV 1.0.2 (``make_bytes_empty_values.py`` next to it); FFCV itself reads padding for the empty
values, and for ``b"hello"`` the size of the zero-size entry sharing its pointer, so the values
below are what was written, not what FFCV reads back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from beton_serve.cli import main
from beton_serve.fields import BytesField
from beton_serve.fields.decoders import BytesDecoder, IntDecoder
from beton_serve.format import BetonReader
from beton_serve.loader import Loader, OrderOption
from beton_serve.writer import DatasetWriter

DATA = Path(__file__).resolve().parents[1] / "data" / "ffcv" / "bytes_empty_values.beton"
WRITTEN = [b"", b"abc", b"", b"hello"]


def _read(path: Path, custom: dict | None = None, field: str = "b") -> list[bytes]:
    pipelines = {field: [BytesDecoder()]}
    out = []
    with Loader(
        str(path),
        batch_size=8,
        num_workers=1,
        order=OrderOption.SEQUENTIAL,
        drop_last=False,
        pipelines=pipelines,
        custom_fields=custom,
    ) as loader:
        for batch in loader:
            out += [bytes(np.asarray(r)).rstrip(b"\0") for r in batch[0]]
    return out


def test_ffcvs_empty_first_value_opens_and_reads_what_was_written(
    capsys: pytest.CaptureFixture,
) -> None:
    with BetonReader(DATA) as r:
        assert r.field_metadata("b")["size"].tolist() == [0, 3, 0, 5]
        assert r.sample_pages.tolist() == [-1, 1, -1, 1]  # an empty value has no page
    assert _read(DATA) == WRITTEN
    with Loader(
        str(DATA),
        batch_size=4,
        num_workers=1,
        order=OrderOption.SEQUENTIAL,
        pipelines={"label": [IntDecoder()], "b": None},
    ) as loader:
        assert np.asarray(next(iter(loader))[0]).ravel().tolist() == [0, 1, 2, 3]
    assert main(["inspect", str(DATA)]) == 0
    assert "validation: OK" in capsys.readouterr().out


class FfcvBytes(BytesField):
    """FFCV's ``BytesField.encode`` behaviour: a zero-size allocation for an empty value."""

    def prepare(self, value, rng=None):
        return value

    def encode(self, destination, field, malloc) -> None:
        ptr, buf = malloc(field.size)
        buf[:] = field
        destination["ptr"] = ptr
        destination["size"] = field.size

    @staticmethod
    def from_binary(binary) -> FfcvBytes:
        return FfcvBytes()


class SmallPages(DatasetWriter):
    _MIN_PAGE_SIZE = 1 << 12


@pytest.mark.parametrize(
    "values",
    [
        [b"x" * 4096, b""],  # a full page, then an empty value: its pointer is the data end
        [b"x" * 100, b"", b"yyyyy"],
        [b"x" * 4096, b"", b"yyyyy"],  # the empty value's pointer starts the next page
    ],
    ids=["full_page_then_empty_last", "empty_in_the_middle", "full_page_empty_more"],
)
def test_zero_size_entries_anywhere_ffcvs_allocator_puts_them(
    tmp_path: Path, values: list[bytes]
) -> None:
    out = tmp_path / "z.beton"
    SmallPages(out, {"b": FfcvBytes()}, page_size=1 << 12).from_indexed_dataset(
        [(np.frombuffer(v, np.uint8),) for v in values]
    )
    assert _read(out, {"b": FfcvBytes}) == values


def test_a_zero_size_entry_past_the_end_is_still_refused(tmp_path: Path) -> None:
    from beton_serve.errors import FormatError
    from beton_serve.format import ALLOC_ENTRY_DTYPE, HEADER_DTYPE

    data = bytearray(DATA.read_bytes())
    header = np.frombuffer(bytes(data[: HEADER_DTYPE.itemsize]), HEADER_DTYPE)[0]
    table = int(header["alloc_table_ptr"])
    entry = np.zeros(1, ALLOC_ENTRY_DTYPE)
    entry["sample_id"], entry["ptr"], entry["size"] = 0, table + 4096, 0
    data[table : table + 24] = entry.tobytes()
    bad = tmp_path / "bad.beton"
    bad.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="ptr is past the data region end"):
        BetonReader(bad)
