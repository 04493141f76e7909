"""Corrupt files: every malformation raises FormatError (never a crash, a hang or another error)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from beton_serve.errors import FormatError
from beton_serve.fields import BytesField, IntField, JSONField, NDArrayField, RGBImageField
from beton_serve.format import ALLOC_ENTRY_DTYPE, BetonReader, memory_read
from beton_serve.writer import DatasetWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PAGE = 4096


class SmallPageWriter(DatasetWriter):
    """Writes 4 KiB pages so that corrupt-file tests work on ~30 KB files."""

    _MIN_PAGE_SIZE = PAGE


def _samples(n: int = 12) -> list[tuple]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        h, w = int(rng.integers(2, 20)), int(rng.integers(2, 20))
        img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        blob = rng.integers(0, 255, int(rng.integers(0, 40)), dtype=np.uint8)
        out.append((img, i - 3, blob, rng.random((2, 3)).astype(np.float32), {"i": i}))
    return out


def _fields() -> dict:
    return {
        "image": RGBImageField(write_mode="proportion", compress_probability=0.5),
        "label": IntField(),
        "blob": BytesField(),
        "arr": NDArrayField(np.float32, (2, 3)),
        "meta": JSONField(),
    }


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("corrupt") / "small.beton"
    SmallPageWriter(path, _fields(), page_size=PAGE, num_workers=1, seed=3).from_indexed_dataset(
        _samples()
    )
    data = path.read_bytes()
    with BetonReader(path) as r:  # sanity: it is valid, uses both modes and several pages
        modes = set(r.field_metadata("image")["mode"].tolist())
        assert modes == {0, 1}
        assert len(set(r.sample_pages.tolist())) > 1
    return data


def _open(tmp_path: Path, data: bytes | bytearray) -> BetonReader:
    p = tmp_path / "x.beton"
    p.write_bytes(bytes(data))
    return BetonReader(p)


def _layout(data: bytes) -> dict:
    hdr = np.frombuffer(
        data[:24], dtype=[("v", "<u2"), ("nf", "<u2"), ("ps", "<u4"), ("n", "<u8"), ("a", "<u8")]
    )[0]
    return {"nf": int(hdr["nf"]), "n": int(hdr["n"]), "a": int(hdr["a"]), "ps": int(hdr["ps"])}


def _read_everything(r: BetonReader) -> int:
    """Touch every byte a decoder could read and decode every JPEG; returns allocations read.

    A corrupt JPEG may raise ValueError from simplejpeg (the decoder layer turns that into an
    error naming the sample); it must never crash the process.
    """
    import simplejpeg

    total = 0
    for name in r.field_names:
        column = r.field_metadata(name)
        for chk in r.handlers[name].allocation_checks(column):
            for k, ptr in enumerate(chk.ptrs):
                data = memory_read(int(ptr), r.storage_state)
                total += int(data.sum() >= 0)
                if isinstance(r.handlers[name], RGBImageField) and column["mode"][k] == 0:
                    try:
                        simplejpeg.decode_jpeg(data.tobytes(), "RGB", fastdct=True)
                    except ValueError:
                        pass
    return total


def test_truncation_at_many_offsets(tmp_path: Path, small_file: bytes) -> None:
    lay = _layout(small_file)
    m = 24 + 1041 * lay["nf"]
    cuts = {0, 1, 2, 23, 24, 25, 100, m - 1, m, m + 7, lay["a"] - 1, lay["a"], lay["a"] + 1}
    cuts |= {len(small_file) - k for k in (1, 8, 23, 24, 25)}
    cuts |= set(range(m, len(small_file), 997))
    for cut in sorted(c for c in cuts if 0 <= c < len(small_file)):
        with pytest.raises(FormatError) as info:
            _open(tmp_path, small_file[:cut])
        assert info.value.path.endswith("x.beton")


def test_appended_bytes_rejected(tmp_path: Path, small_file: bytes) -> None:
    with pytest.raises(FormatError, match="multiple of 24"):
        _open(tmp_path, small_file + b"\0")
    # An entry of sample 0 at ptr 0 holding 1 byte: out of range. (A zero-size one there is
    # what FFCV 1.0.2 writes for an empty first value, and is read: test_ffcv_zero_size.py.)
    entry = np.zeros(1, ALLOC_ENTRY_DTYPE)
    entry["size"] = 1
    with pytest.raises(FormatError, match="ptr is outside"):
        _open(tmp_path, small_file + entry.tobytes())
    entry["ptr"], entry["size"] = 1, 0  # zero-size, but not where FFCV's allocator stands
    with pytest.raises(FormatError, match="before the data region start"):
        _open(tmp_path, small_file + entry.tobytes())


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (0, 3, "version is 3"),
        (2, 0, "num_fields is 0"),
        (4, 0x01, "power of two"),
        (16, 0, "alloc_table_ptr 0"),
    ],
)
def test_header_fields(
    tmp_path: Path, small_file: bytes, offset: int, value: int, match: str
) -> None:
    data = bytearray(small_file)
    width = {0: 2, 2: 2, 4: 4, 16: 8}[offset]
    data[offset : offset + width] = value.to_bytes(width, "little")
    with pytest.raises(FormatError, match=match) as info:
        _open(tmp_path, data)
    assert info.value.offset is not None


def test_every_single_header_bit_flip(tmp_path: Path, small_file: bytes) -> None:
    """Every bit of the header matters: no flip leaves a file that still opens."""
    for byte in range(24):
        for bit in range(8):
            data = bytearray(small_file)
            data[byte] ^= 1 << bit
            with pytest.raises(FormatError):
                _open(tmp_path, data)


def test_descriptor_corruptions(tmp_path: Path, small_file: bytes) -> None:
    cases = [
        (24, 0x80, "unknown type id"),  # image type 2 -> 130
        (24, 0xFD, "custom_fields"),  # 2 ^ 0xfd = 255
        (25, 0x80, "printable ASCII"),  # first name byte
        (24 + 1 + 10, 0x41, "non-zero bytes after its NUL"),
        (24 + 17 + 5, 0x01, "arguments of field 'image'"),
        (24 + 1041 * 3 + 17 + 300, 0x01, "arguments of field 'arr'"),  # NDArray blob tail
        (24 + 1041 * 3 + 17 + 256, 0x40, "arguments of field 'arr'"),  # type_length
    ]
    for offset, xor, match in cases:
        data = bytearray(small_file)
        data[offset] ^= xor
        with pytest.raises(FormatError, match=match):
            _open(tmp_path, data)


def _rename(data: bytearray, index: int, name: bytes) -> None:
    at = 24 + 1041 * index + 1
    data[at : at + 16] = name.ljust(16, b"\0")


def test_name_rules(tmp_path: Path, small_file: bytes) -> None:
    data = bytearray(small_file)
    _rename(data, 1, b"image")
    with pytest.raises(FormatError, match="16 characters collide"):
        _open(tmp_path, data)
    data = bytearray(small_file)
    _rename(data, 1, b"")
    with pytest.raises(FormatError, match="empty name"):
        _open(tmp_path, data)
    data = bytearray(small_file)
    _rename(data, 1, b"exactly_16_chars")  # no NUL terminator: valid
    with _open(tmp_path, data) as r:
        assert r.field_names[1] == "exactly_16_chars"


def _table(data: bytes | bytearray) -> tuple[int, np.ndarray]:
    a = _layout(bytes(data[:24]))["a"]
    return a, np.frombuffer(bytes(data[a:]), dtype=ALLOC_ENTRY_DTYPE).copy()


def _with_table(data: bytes, table: np.ndarray) -> bytearray:
    a = _layout(data)["a"]
    return bytearray(data[:a]) + bytearray(table.tobytes())


def test_allocation_table_corruptions(tmp_path: Path, small_file: bytes) -> None:
    a, t = _table(small_file)
    lay = _layout(small_file)
    cases = []
    x = t.copy()
    x["sample_id"][0] = lay["n"]
    cases.append((x, "sample_id is not below"))
    x = t.copy()
    x["ptr"][2] = 5
    cases.append((x, "outside"))
    x = t.copy()
    x["ptr"][2] = a + 10
    cases.append((x, "outside"))
    x = t.copy()
    x["size"][-1] = 1 << 40
    cases.append((x, "runs past|crosses a page"))
    x = t.copy()
    order = np.argsort(x["ptr"])
    i, j = order[0], order[1]
    x["size"][i] = x["ptr"][j] - x["ptr"][i] + 1  # overlaps the next allocation
    cases.append((x, "overlap"))
    x = t.copy()
    x["ptr"][order[0]] = (x["ptr"][order[0]] // PAGE + 1) * PAGE - 1  # straddles a page end
    x["size"][order[0]] = 2
    cases.append((x, "page boundary|overlap"))
    x = t.copy()
    x["sample_id"][order[0]], x["sample_id"][order[-1]] = (
        x["sample_id"][order[-1]],
        x["sample_id"][order[0]],
    )
    cases.append((x, "more than one page|belongs to sample"))
    x = t.copy()
    x["size"][order[3]] += 0  # unchanged control case is valid
    with _open(tmp_path, _with_table(small_file, x)) as r:
        assert r.num_allocations == t.size
    for table, match in cases:
        with pytest.raises(FormatError, match=match):
            _open(tmp_path, _with_table(small_file, table))
    # Dropping an entry: a pointer in metadata is no longer in the table.
    with pytest.raises(FormatError, match="not in the allocation table"):
        _open(tmp_path, _with_table(small_file, t[1:]))
    # An empty table while metadata references data.
    data = bytearray(small_file[:a])
    with pytest.raises(FormatError, match="table is empty"):
        _open(tmp_path, data)


def test_shuffled_table_is_valid(tmp_path: Path, small_file: bytes) -> None:
    """The table's order is unspecified (FFCV concatenates per-worker lists)."""
    _, t = _table(small_file)
    rng = np.random.default_rng(0)
    with _open(tmp_path, _with_table(small_file, t[rng.permutation(t.size)])) as r:
        assert np.all(np.diff(r.allocations[1].astype(np.int64)) > 0)


def test_metadata_corruptions(tmp_path: Path, small_file: bytes) -> None:
    p = tmp_path / "ok.beton"
    p.write_bytes(small_file)
    with BetonReader(p) as r:
        m, rsize = r.metadata_offset, r.record_size
        offs = {n: r.record.fields[f"f{i}"][1] for i, n in enumerate(r.field_names)}
        meta = r.field_metadata("image")
        raw = int(np.flatnonzero(meta["mode"] == 1)[0])
        jpg = int(np.flatnonzero(meta["mode"] == 0)[0])
    cases = [
        (m + raw * rsize + offs["image"] + 0, 2, "mode 3"),  # mode byte 1 -> 3
        (m + raw * rsize + offs["image"] + 1, 1, "has size"),  # width -> raw size mismatch
        (m + jpg * rsize + offs["image"] + 1, 0xFF, None),  # jpg width: not checkable, opens
        (m + raw * rsize + offs["image"] + 5, 1, "not in the allocation table"),  # data_ptr
        (m + 0 * rsize + offs["arr"], 4, "not in the allocation table|has size"),
        (m + 1 * rsize + offs["blob"] + 8, 1, "has size"),  # bytes size
        (m + 2 * rsize + offs["meta"] + 12, 0x10, "has size"),
    ]
    for offset, xor, match in cases:
        data = bytearray(small_file)
        data[offset] ^= xor
        if match is None:
            with _open(tmp_path, data) as r:
                assert _read_everything(r) > 0
        else:
            with pytest.raises(FormatError, match=match):
                _open(tmp_path, data)


def test_pointer_of_other_sample_rejected(tmp_path: Path, small_file: bytes) -> None:
    p = tmp_path / "ok.beton"
    p.write_bytes(small_file)
    with BetonReader(p) as r:
        m, rsize = r.metadata_offset, r.record_size
        off = r.record.fields[f"f{r.field_names.index('arr')}"][1]
    data = bytearray(small_file)
    # sample 0's arr pointer := sample 1's (same size, exists in the table, wrong owner)
    data[m + off : m + off + 8] = data[m + rsize + off : m + rsize + off + 8]
    with pytest.raises(FormatError, match="belongs to sample 1"):
        _open(tmp_path, data)


def test_json_zero_size_rejected(tmp_path: Path) -> None:
    out = tmp_path / "j.beton"
    SmallPageWriter(out, {"j": JSONField()}, page_size=PAGE, num_workers=1).from_indexed_dataset(
        [({"a": 1},), ([1, 2],)]
    )
    data = bytearray(out.read_bytes())
    m = 24 + 1041
    data[m + 8 : m + 16] = bytes(8)  # sample 0: size 0
    with pytest.raises(FormatError, match="size 0"):
        _open(tmp_path, data)


def test_zero_size_duplicate_pointer_prefers_real_entry(tmp_path: Path) -> None:
    """FFCV writes an empty BytesField value as a zero-size allocation sharing the next ptr."""
    out = tmp_path / "b.beton"
    SmallPageWriter(out, {"b": BytesField()}, page_size=PAGE, num_workers=1).from_indexed_dataset(
        [(np.zeros(0, np.uint8),), (np.arange(5, dtype=np.uint8),)]
    )
    data = bytearray(out.read_bytes())
    _, t = _table(data)
    # Rewrite as FFCV would: sample 0 has size 0 at the same ptr as sample 1.
    p0 = int(t["ptr"][0])
    t["size"][0] = 0
    t["ptr"][1] = p0
    m = 24 + 1041
    data[m + 16 : m + 24] = p0.to_bytes(8, "little")  # sample 1's ptr
    data[p0 : p0 + 5] = bytes(range(5))
    with _open(tmp_path, _with_table(bytes(data), t[::-1].copy())) as r:
        assert r.sample_bytes(1, "b").tolist() == [0, 1, 2, 3, 4]
        assert r.field_metadata("b")["size"].tolist() == [0, 5]


def test_huge_counts_do_not_allocate(tmp_path: Path, small_file: bytes) -> None:
    data = bytearray(small_file)
    data[8:16] = (2**63).to_bytes(8, "little")
    with pytest.raises(FormatError, match="truncated"):
        _open(tmp_path, data)
    data = bytearray(small_file)
    data[2:4] = (65535).to_bytes(2, "little")
    with pytest.raises(FormatError, match="descriptors"):
        _open(tmp_path, data)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_mutations_open_or_format_error(tmp_path: Path, small_file: bytes, data) -> None:
    lay = _layout(small_file)
    m_end = 24 + 1041 * lay["nf"] + 64 * 12  # covers header, descriptors, metadata
    buf = bytearray(small_file)
    n_mut = data.draw(st.integers(1, 4))
    for _ in range(n_mut):
        region = data.draw(st.sampled_from(["head", "table", "any"]))
        if region == "head":
            pos = data.draw(st.integers(0, min(m_end, len(buf) - 1)))
        elif region == "table":
            pos = data.draw(st.integers(lay["a"], len(buf) - 1))
        else:
            pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    try:
        r = _open(tmp_path, buf)
    except FormatError:
        return
    with r:
        _read_everything(r)
        # A field's name is free text: a mutated name opens, under that name.
        if "image" in r.field_names:
            img = r.field_metadata("image")
            for i in np.flatnonzero(img["mode"] == 1):
                assert (
                    r.sample_bytes(int(i), "image").size
                    == int(img["width"][i]) * int(img["height"][i]) * 3
                )
        if "meta" in r.field_names:
            json_rows = [r.sample_bytes(i, "meta") for i in range(r.num_samples)]
            assert all(row[-1] == 0 for row in json_rows)
            del json_rows
    _ = json


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_ffcv_fixture(tmp_path: Path, fixtures_dir: Path, data) -> None:
    """Mutate the FFCV-written mixed_fields fixture (header, descriptors, metadata, table)."""
    original = (fixtures_dir / "mixed_fields.beton").read_bytes()
    lay = _layout(original)
    buf = bytearray(original)
    meta_end = 24 + 1041 * lay["nf"] + 56 * lay["n"]
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(
            st.one_of(st.integers(0, meta_end - 1), st.integers(lay["a"], len(buf) - 1))
        )
        buf[pos] ^= data.draw(st.integers(1, 255))
    try:
        r = _open(tmp_path, buf)
    except FormatError:
        return
    with r:
        assert _read_everything(r) >= 0
