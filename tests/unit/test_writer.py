"""DatasetWriter: FFCV's byte layout, round trips, determinism and failure handling."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from beton_serve.errors import WriterError
from beton_serve.fields import (
    BytesField,
    FloatField,
    IntField,
    JSONField,
    NDArrayField,
    RGBImageField,
)
from beton_serve.format import ALLOC_ENTRY_DTYPE, BetonReader
from beton_serve.writer import DatasetWriter

MiB = 1 << 20


class SmallPageWriter(DatasetWriter):
    _MIN_PAGE_SIZE = 4096


class ListDS:
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def _smooth(seed: int, h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = rng.uniform(60, 190, 3)
    img = base + 30 * np.sin(xx[..., None] / (w / 3 + 1) + yy[..., None] / (h / 2 + 1))
    return np.clip(img, 0, 255).astype(np.uint8)


def test_worked_example_byte_for_byte(tmp_path: Path) -> None:
    """ffcv-format.md §1.9: raw 32x32 images + int labels, 1 worker, 8 MiB pages."""
    out = tmp_path / "ex.beton"
    imgs = [np.full((32, 32, 3), 7 * i, np.uint8) for i in range(3)]
    DatasetWriter(
        out, {"image": RGBImageField(write_mode="raw"), "label": IntField()}, num_workers=1
    ).from_indexed_dataset([(imgs[i], 10 * i) for i in range(3)])
    b = out.read_bytes()
    assert len(b) == 16_777_288
    assert b[:24].hex() == "0200020000008000" + "0300000000000000" + "0000000100000000"
    assert b[24] == 2 and b[25:41] == b"image".ljust(16, b"\0") and not any(b[41:1065])
    assert b[1065] == 1 and b[1066:1082] == b"label".ljust(16, b"\0")
    rec = [b[2106 + 24 * j : 2130 + 24 * j] for j in range(3)]
    for j, r in enumerate(rec):
        ptr = 0x800000 + 3072 * j
        assert r[:13] == bytes([1, 32, 0, 32, 0]) + ptr.to_bytes(8, "little")
        assert r[13:16] == b"\0\0\0" and int.from_bytes(r[16:], "little", signed=True) == 10 * j
    assert not any(b[2178 : 1 << 23])
    for j in range(3):
        assert b[(1 << 23) + 3072 * j : (1 << 23) + 3072 * (j + 1)] == imgs[j].tobytes()
    assert not any(b[(1 << 23) + 9216 : 1 << 24])
    table = np.frombuffer(b[1 << 24 :], ALLOC_ENTRY_DTYPE)
    assert table.tolist() == [(0, 8388608, 3072), (1, 8391680, 3072), (2, 8394752, 3072)]


@pytest.mark.parametrize("workers", [1, 2])
def test_raw_fixture_reproduced_byte_for_byte(
    tmp_path: Path, fixtures_dir: Path, workers: int
) -> None:
    full = np.load(fixtures_dir / "images_raw.decoded_full.npz")
    labels = np.load(fixtures_dir / "images_raw.expected.npz")["label"][:, 0]
    out = tmp_path / "raw.beton"
    DatasetWriter(
        out,
        {"image": RGBImageField(write_mode="raw"), "label": IntField()},
        page_size=2 * MiB,
        num_workers=workers,
    ).from_indexed_dataset(
        ListDS([(full[f"image_{i:04d}"], int(labels[i])) for i in range(64)]), chunksize=5
    )
    assert out.read_bytes() == (fixtures_dir / "images_raw.beton").read_bytes()


def test_mixed_fixture_reproduced_byte_for_byte(tmp_path: Path, fixtures_dir: Path) -> None:
    e = np.load(fixtures_dir / "mixed_fields.expected.npz")
    objs = json.loads(str(e["meta__unpacked_json"]))
    items = [
        (
            int(e["int"][i, 0]),
            float(e["float"][i, 0]),
            e["array"][i],
            e["blob"][i, : int(e["blob__size"][i])],
            objs[i],
        )
        for i in range(50)
    ]
    fields = {
        "int": IntField(),
        "float": FloatField(),
        "array": NDArrayField(np.dtype("float32"), (3, 4)),
        "blob": BytesField(),
        "meta": JSONField(),
    }
    out = tmp_path / "mixed.beton"
    DatasetWriter(out, fields, page_size=2 * MiB, num_workers=2).from_indexed_dataset(items)
    assert out.read_bytes() == (fixtures_dir / "mixed_fields.beton").read_bytes()


def test_smart_fixture_raw_samples_match(tmp_path: Path, fixtures_dir: Path) -> None:
    """Our raw bytes of the fixture's raw-stored images equal the fixture's data region."""
    full = np.load(fixtures_dir / "images_smart.decoded_full.npz")
    with BetonReader(fixtures_dir / "images_smart.beton") as ref:
        raw_ids = np.flatnonzero(ref.field_metadata("image")["mode"] == 1).tolist()
        expected = {i: ref.sample_bytes(i, "image").tobytes() for i in raw_ids}
    out = tmp_path / "s.beton"
    DatasetWriter(
        out,
        {"image": RGBImageField("smart", smart_threshold=16384, max_resolution=256)},
        num_workers=1,
    ).from_indexed_dataset([(full[f"image_{i:04d}"],) for i in raw_ids])
    with BetonReader(out) as r:
        assert r.field_metadata("image")["mode"].tolist() == [1] * len(raw_ids)
        for k, i in enumerate(raw_ids):
            assert r.sample_bytes(k, "image").tobytes() == expected[i]


def _all_fields_items(n: int) -> list[tuple]:
    rng = np.random.default_rng(11)
    items = []
    for i in range(n):
        h, w = int(rng.integers(5, 60)), int(rng.integers(5, 60))
        items.append(
            (
                _smooth(i, h, w),
                int(rng.integers(-(2**63), 2**63 - 1)),
                float(rng.normal()),
                rng.integers(0, 256, int(rng.integers(0, 50)), dtype=np.uint8),
                rng.normal(size=(2, 5)).astype(np.float64),
                {"id": i, "tags": ["x"] * (i % 3)},
            )
        )
    return items


@pytest.mark.parametrize("mode", ["raw", "jpg", "smart", "proportion"])
def test_round_trip_every_field_type(tmp_path: Path, mode: str) -> None:
    import simplejpeg

    items = _all_fields_items(30)
    fields = {
        "img": RGBImageField(write_mode=mode, smart_threshold=3000, jpeg_quality=95),
        "i": IntField(),
        "f": FloatField(),
        "b": BytesField(),
        "a": NDArrayField(np.float64, (2, 5)),
        "j": JSONField(),
        "u": NDArrayField(np.uint8, (2, 3)),
    }
    items = [(*it, np.full((2, 3), k, np.uint8)) for k, it in enumerate(items)]
    out = tmp_path / f"{mode}.beton"
    DatasetWriter(out, fields, num_workers=2, seed=1).from_indexed_dataset(
        ListDS(items), chunksize=4
    )
    with BetonReader(out) as r:
        img = r.field_metadata("img")
        for k, (im, i, f, b, a, j, u) in enumerate(items):
            assert r.sample_bytes(k, "u").tobytes() == u.tobytes()
            assert r.field_metadata("i")[k] == i and r.field_metadata("f")[k] == f
            assert r.sample_bytes(k, "b").tobytes() == b.tobytes()
            assert r.field_metadata("b")["size"][k] == b.size
            assert np.array_equal(np.frombuffer(r.sample_bytes(k, "a"), np.float64), a.ravel())
            assert JSONField.unpack(r.sample_bytes(k, "j")) == j
            assert (img["height"][k], img["width"][k]) == im.shape[:2]
            data = r.sample_bytes(k, "img")
            if img["mode"][k] == 1:
                assert np.array_equal(data.reshape(im.shape), im)
            else:
                dec = simplejpeg.decode_jpeg(data.tobytes(), "RGB", fastdct=True)
                assert np.abs(dec.astype(int) - im).mean() < 3
        modes = set(img["mode"].tolist())
        want = {"raw": {1}, "jpg": {0}, "smart": {0, 1}, "proportion": {0, 1}}[mode]
        assert modes == want


@pytest.mark.parametrize("workers", [1, 3])
def test_unseeded_proportion_draws_like_ffcv_and_again_on_a_spill(
    tmp_path: Path, workers: int
) -> None:
    """FFCV's one worker draws ``np.random.rand()`` in write order when it encodes a sample, and
    encodes a sample that spills to a new page again, drawing again. Ours drew once, in the
    prepare threads: from the first spill on, every raw/JPEG choice was one draw out of step
    with FFCV's file (and with more workers, in no fixed order)."""
    n, p = 12, 0.5
    # Small images then an 800 kB blob: two samples per 2 MiB page, so the blob of every even
    # sample from 2 on spills (after its image was stored on the old page).
    items = [(_smooth(i, 10, 20), np.full(800_000, i, np.uint8)) for i in range(n)]
    fields = {"im": RGBImageField("proportion", compress_probability=p), "b": BytesField()}
    np.random.seed(7)
    want = []
    for i in range(n):
        jpeg = np.random.rand() < p
        if i >= 2 and i % 2 == 0:
            jpeg = np.random.rand() < p  # the second try's draw decides
        want.append(0 if jpeg else 1)
    np.random.seed(7)
    out = tmp_path / "p.beton"
    DatasetWriter(out, fields, page_size=2 * MiB, num_workers=workers).from_indexed_dataset(
        ListDS(items), chunksize=3
    )
    with BetonReader(out) as r:
        assert r.field_metadata("im")["mode"].tolist() == want
        ptrs = r.field_metadata("b")["ptr"] // (2 * MiB)
        assert (ptrs - ptrs[0]).tolist() == [i // 2 for i in range(n)]  # the model's spills
        for k, (im, b) in enumerate(items):
            assert r.sample_bytes(k, "b").tobytes() == b.tobytes()
            if want[k] == 1:
                assert np.array_equal(r.sample_bytes(k, "im").reshape(im.shape), im)


def test_seed_makes_output_independent_of_workers(tmp_path: Path) -> None:
    items = [(_smooth(i, 20 + i % 7, 30),) for i in range(40)]
    fields = {"im": RGBImageField("proportion", compress_probability=0.5)}
    blobs = []
    for w in (1, 3):
        out = tmp_path / f"w{w}.beton"
        DatasetWriter(out, fields, num_workers=w, seed=42).from_indexed_dataset(
            ListDS(items), chunksize=3, shuffle_indices=True
        )
        blobs.append(out.read_bytes())
    assert blobs[0] == blobs[1]
    out = tmp_path / "other.beton"
    DatasetWriter(out, fields, num_workers=2, seed=43).from_indexed_dataset(ListDS(items))
    assert out.read_bytes() != blobs[0]


def test_sample_level_retry_on_spill(tmp_path: Path) -> None:
    """A sample whose second allocation spills restarts on a new page (FFCV's retry rule)."""
    items = [
        (np.full(1000, 1, np.uint8), np.full(1000, 2, np.uint8)),
        (np.full(1500, 3, np.uint8), np.full(1500, 4, np.uint8)),
        (np.full(3000, 5, np.uint8), np.full(10, 6, np.uint8)),
    ]
    out = tmp_path / "spill.beton"
    SmallPageWriter(
        out, {"a": BytesField(), "b": BytesField()}, page_size=4096, num_workers=1
    ).from_indexed_dataset(items)
    with BetonReader(out) as r:
        d = r.data_start
        assert r.num_allocations == 6  # the abandoned allocation is not in the table
        assert r.sample_pages.tolist() == [d // 4096, d // 4096 + 1, d // 4096 + 2]
        a = r.field_metadata("a")["ptr"].tolist()
        b = r.field_metadata("b")["ptr"].tolist()
        assert a == [d, d + 4096, d + 8192] and b == [d + 1000, d + 4096 + 1500, d + 8192 + 3000]
        raw = np.frombuffer(out.read_bytes(), np.uint8)
        assert np.all(raw[d + 2000 : d + 3500] == 3)  # abandoned bytes stay in the old page
        assert not raw[d + 3500 : d + 4096].any()
        for k, (x, y) in enumerate(items):
            assert r.sample_bytes(k, "a").tobytes() == x.tobytes()
            assert r.sample_bytes(k, "b").tobytes() == y.tobytes()
        assert (r.file_size - r.header.alloc_table_ptr) == 6 * 24
        assert r.header.alloc_table_ptr == d + 3 * 4096  # every page written in full


def test_sample_larger_than_page(tmp_path: Path) -> None:
    fields = {"a": BytesField(), "b": BytesField()}
    w = SmallPageWriter(tmp_path / "x.beton", fields, page_size=4096, num_workers=1)
    with pytest.raises(WriterError, match="does not fit in one page") as info:
        w.from_indexed_dataset([(b"1", b"2"), (bytes(3000), bytes(3000))])
    assert info.value.index == 1
    with pytest.raises(WriterError, match="exceeds the page size") as info:
        w.from_indexed_dataset([(bytes(5000), b"x")])
    assert info.value.index == 0
    assert not list(tmp_path.iterdir())


class Failing:
    def __init__(self, bad: int, n: int = 50) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise RuntimeError("boom")
        return (i,)


@pytest.mark.parametrize(("workers", "bad"), [(1, 37), (2, 37), (2, 36), (1, 0)])
def test_failing_sample_names_its_index_and_cleans_up(
    tmp_path: Path, workers: int, bad: int
) -> None:
    out = tmp_path / "f.beton"
    out.write_bytes(b"previous")
    with pytest.raises(WriterError, match="boom") as info:
        DatasetWriter(out, {"x": IntField()}, num_workers=workers).from_indexed_dataset(
            Failing(bad), chunksize=4
        )
    assert info.value.index == bad
    assert f"dataset index {bad}, loading it" in str(info.value)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.beton"]


def test_index_is_write_position_not_source(tmp_path: Path) -> None:
    with pytest.raises(WriterError) as info:
        DatasetWriter(tmp_path / "f.beton", {"x": IntField()}, num_workers=1).from_indexed_dataset(
            Failing(7, 10), indices=[9, 8, 7, 6]
        )
    assert info.value.index == 2 and "dataset index 7" in str(info.value)


def test_bad_samples_rejected_clearly(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path / "f.beton", {"x": IntField(), "y": IntField()}, num_workers=1)
    with pytest.raises(WriterError, match="must return a tuple") as info:
        w.from_indexed_dataset([(1, 2), 3])
    assert info.value.index == 1
    with pytest.raises(WriterError, match="1 values for 2 fields"):
        w.from_indexed_dataset([(1,)])
    with pytest.raises(WriterError, match="empty"):
        w.from_indexed_dataset([])
    w.from_indexed_dataset([(1, 2, "extra ignored, as in FFCV")])
    with BetonReader(tmp_path / "f.beton") as r:
        assert r.field_metadata("y").tolist() == [2]
    with pytest.raises(WriterError, match="ValueError"):
        DatasetWriter(
            tmp_path / "g.beton", {"im": RGBImageField()}, num_workers=1
        ).from_indexed_dataset([(np.zeros((2, 2, 2), np.uint8),)])


def test_constructor_validation(tmp_path: Path) -> None:
    p = tmp_path / "f.beton"
    with pytest.raises(WriterError, match="at most 16"):
        DatasetWriter(p, {"a_name_longer_than_16": IntField()})
    DatasetWriter(p, {"exactly_16_chars": IntField()}, num_workers=1).from_indexed_dataset([(5,)])
    with BetonReader(p) as r:
        assert r.field_names == ["exactly_16_chars"]
    with pytest.raises(WriterError, match="ASCII"):
        DatasetWriter(p, {"naïve": IntField()})
    with pytest.raises(WriterError, match="non-empty"):
        DatasetWriter(p, {})
    for ps in (1 << 20, 3 << 20, 1 << 32):
        with pytest.raises(WriterError, match="page_size"):
            DatasetWriter(p, {"x": IntField()}, page_size=ps)
    with pytest.raises(WriterError, match="has no"):
        DatasetWriter(p, {"x": object()})


def test_inline_only_file_has_no_pages(tmp_path: Path) -> None:
    p = tmp_path / "inline.beton"
    DatasetWriter(p, {"i": IntField(), "f": FloatField()}, num_workers=2).from_indexed_dataset(
        [(i, i / 2) for i in range(100)]
    )
    assert p.stat().st_size == 24 + 2 * 1041 + 100 * 16
    with BetonReader(p) as r:
        assert r.num_allocations == 0 and (r.sample_pages == -1).all()
        assert r.field_metadata("f")[99] == 49.5


def test_progress_bar_only_on_request(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    DatasetWriter(tmp_path / "a.beton", {"x": IntField()}, num_workers=1).from_indexed_dataset(
        [(1,)] * 10
    )
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest
    DatasetWriter(
        tmp_path / "b.beton", {"x": IntField()}, num_workers=1, progress=True
    ).from_indexed_dataset([(1,)] * 10)
    assert "10/10" in capsys.readouterr().err


def test_num_workers_default_uses_cpus(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path / "a.beton", {"x": IntField()})
    assert w.num_workers == len(os.sched_getaffinity(0))


# --- FFCV's own read path (ffcv-format.md §1.7 and §3), restated independently of our reader ---
_FFCV_META = {
    0: np.dtype("<f8"),
    1: np.dtype("<i8"),
    2: np.dtype([("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]),
    3: np.dtype([("ptr", "<u8"), ("size", "<u8")]),
    4: np.dtype("<u8"),
    5: np.dtype([("ptr", "<u8"), ("size", "<u8")]),
    6: np.dtype("<u8"),
}


def _ffcv_read(path: Path) -> dict:
    """What FFCV 1.0.2's Reader and default decoders would produce, as python values."""
    raw = np.fromfile(path, dtype=np.uint8)
    hdr = raw[:24].view(
        np.dtype(
            [("v", "<u2"), ("nf", "<u2"), ("ps", "<u4"), ("n", "<u8"), ("a", "<u8")], align=True
        )
    )[0]
    assert hdr["v"] == 2
    nf, n, a = int(hdr["nf"]), int(hdr["n"]), int(hdr["a"])
    handlers = {}
    for i in range(nf):
        d = raw[24 + 1041 * i : 24 + 1041 * (i + 1)]
        name = d[1:17].tobytes().decode("ascii").split("\0")[0]
        handlers[name] = (int(d[0]), d[17:])
    rec = np.dtype(
        [(f"f{i}", _FFCV_META[t]) for i, (t, _) in enumerate(handlers.values())], align=True
    )
    m = 24 + 1041 * nf
    meta = raw[m : m + n * rec.itemsize].view(rec)
    table = raw[a:].view(np.dtype([("sid", "<u8"), ("ptr", "<u8"), ("size", "<u8")]))
    order = np.argsort(table["ptr"])
    ptrs, sizes = table["ptr"][order], table["size"][order]

    def read(ptr: int) -> np.ndarray:
        i = np.searchsorted(ptrs, ptr)
        return raw[ptr : ptr + int(sizes[i])]

    # QUASI_RANDOM's page map: every sample's entries are in one page.
    pages: dict[int, set[int]] = {}
    for sid, ptr in zip(table["sid"].tolist(), table["ptr"].tolist(), strict=True):
        pages.setdefault(sid, set()).add(ptr // int(hdr["ps"]))
    assert all(len(p) == 1 for p in pages.values())
    out: dict = {}
    for i, (name, (tid, args)) in enumerate(handlers.items()):
        col = meta[f"f{i}"]
        if tid in (0, 1):
            out[name] = col.tolist()
        elif tid == 2:
            vals = []
            for j in range(n):
                h, w, data = int(col["height"][j]), int(col["width"][j]), read(col["data_ptr"][j])
                if col["mode"][j] == 1:
                    assert data.size == h * w * 3  # memcpy into an (h, w, 3) buffer
                    vals.append(data.reshape(h, w, 3))
                else:
                    vals.append(("jpg", h, w, data.tobytes()))
            out[name] = vals
        elif tid in (3, 5):
            max_size = int(col["size"].max())
            rows = np.zeros((n, max_size), np.uint8)
            for j in range(n):
                data = read(col["ptr"][j])
                assert data.size <= max_size
                rows[j, : data.size] = data
            out[name] = (rows, col["size"].tolist())
        else:
            shape = [int(x) for x in args[:256].view("<u8") if x]
            descr = json.loads(args[264 : 264 + int(args[256:264].view("<u8")[0])].tobytes())
            dt = np.dtype([tuple(x) for x in descr])["f0"]
            size = int(np.prod(shape)) * dt.itemsize
            arrs = []
            for j in range(n):
                data = read(col[j])
                assert data.size == size
                arrs.append(data.view(dt).reshape(shape))
            out[name] = arrs
    return out


def test_ffcv_read_path_reads_everything_we_write(tmp_path: Path) -> None:
    import cv2

    items = _all_fields_items(25)
    items[3] = (*items[3][:3], np.zeros(0, np.uint8), *items[3][4:])  # an empty Bytes value
    fields = {
        "img": RGBImageField(write_mode="proportion", jpeg_quality=90),
        "i": IntField(),
        "f": FloatField(),
        "b": BytesField(),
        "a": NDArrayField(np.float64, (2, 5)),
        "j": JSONField(),
    }
    out = tmp_path / "ours.beton"
    DatasetWriter(out, fields, page_size=2 * MiB, num_workers=2, seed=7).from_indexed_dataset(
        ListDS(items), chunksize=3
    )
    got = _ffcv_read(out)
    assert got["i"] == [it[1] for it in items] and got["f"] == [it[2] for it in items]
    rows, sizes = got["b"]
    for k, it in enumerate(items):
        assert rows[k, : sizes[k]].tobytes() == it[3].tobytes()
        assert np.array_equal(got["a"][k], it[4])
        img = got["img"][k]
        if isinstance(img, tuple):
            _, h, w, data = img
            assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape == (h, w, 3)
        else:
            assert np.array_equal(img, it[0])
    jrows, _ = got["j"]
    assert JSONField.unpack(jrows) == [it[5] for it in items]


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True])
def test_a_bad_seed_is_refused_before_writing(tmp_path: Path, seed) -> None:
    """``seed=-1`` was taken, then every sample failed, blaming a field (numpy's generators take
    no negative seed)."""
    with pytest.raises(WriterError, match=r"seed must be None or an int >= 0"):
        DatasetWriter(tmp_path / "x.beton", {"x": IntField()}, seed=seed)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("workers", [100_000, 2.5, "8"])
def test_an_absurd_or_non_int_worker_count_is_refused_before_writing(tmp_path: Path, workers):
    with pytest.raises(WriterError, match=r"num_workers .* is out of range: use an int up to 1024"):
        DatasetWriter(tmp_path / "x.beton", {"x": IntField()}, num_workers=workers)
    assert not list(tmp_path.iterdir())


def test_numpy_integer_worker_counts_are_accepted(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path / "x.beton", {"x": IntField()}, num_workers=np.int64(2))
    assert w.num_workers == 2
    w.from_indexed_dataset([(i,) for i in range(5)])
    assert (tmp_path / "x.beton").stat().st_size > 0


@pytest.mark.parametrize(
    ("value", "words"),
    [(2**70, "ValueError: IntField stores int64 values"), ("a", "ValueError: .*got 'a'")],
)
def test_a_value_that_cannot_be_encoded_names_its_field_and_sample(tmp_path: Path, value, words):
    out = tmp_path / "x.beton"
    data = [(1, 2), (3, value)]
    with pytest.raises(WriterError, match=f"field 'label'\\) encoding failed: .*{words}") as info:
        DatasetWriter(
            out, {"id": IntField(), "label": IntField()}, num_workers=1
        ).from_indexed_dataset(data)
    assert info.value.index == 1
    assert not out.exists()


def test_a_label_the_field_would_change_names_its_sample(tmp_path: Path) -> None:
    """FFCV stores 3.7 in an IntField as 3, silently; here the sample is named and no file left."""
    out = tmp_path / "f.beton"
    rows = [(0, 0.5), (1, 1.5), (2.0, 2.5), (3.7, 3.5), (4, 4.5)]
    with pytest.raises(WriterError, match="FFCV would store as 3") as info:
        DatasetWriter(
            out, {"y": IntField(), "v": FloatField()}, num_workers=1
        ).from_indexed_dataset(rows)
    assert info.value.index == 3
    assert not out.exists()
    rows[3] = (3, None)
    with pytest.raises(
        WriterError, match="FloatField stores a number per sample, got None"
    ) as info:
        DatasetWriter(
            out, {"y": IntField(), "v": FloatField()}, num_workers=1
        ).from_indexed_dataset(rows)
    assert info.value.index == 3
    # A finite value beyond float64's range was stored as inf; an int beyond it raised
    # OverflowError from the writer's worker. Both name the sample now, as infinity itself
    # (a float64 value) is still stored.
    for big, shown in ((np.longdouble("1e4000"), "overflows it to inf"), (10**400, "overflows")):
        rows[3] = (3, big)
        with pytest.raises(
            WriterError, match=f"FloatField stores float64 values; .*{shown}"
        ) as info:
            DatasetWriter(
                out, {"y": IntField(), "v": FloatField()}, num_workers=1
            ).from_indexed_dataset(rows)
        assert info.value.index == 3
        assert not out.exists()
    rows[3] = (3, 3.5)
    DatasetWriter(out, {"y": IntField(), "v": FloatField()}, num_workers=1).from_indexed_dataset(
        rows
    )
    with BetonReader(out) as r:
        assert r.field_metadata("y").tolist() == [0, 1, 2, 3, 4]
        assert r.field_metadata("v").tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]


# -- the dataset as FFCV's workers see it: one copy per worker, each sample encoded before the next
class ReusedBuffers:
    """Fills and returns the same buffers on every call (valid under FFCV's writer)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.img = np.zeros((4, 5, 3), np.uint8)
        self.arr = np.zeros(3, np.float32)
        self.label = np.zeros((), np.int64)
        self.blob = bytearray(4)
        self.meta: dict = {"i": 0}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.img[:] = i
        self.arr[:] = i
        self.label[...] = i
        self.blob[:] = bytes([i, i, i, i])
        self.meta["i"] = i
        return (self.img, self.arr, self.label, self.blob, self.meta)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dataset_that_reuses_its_buffers_is_written_sample_by_sample(
    tmp_path: Path, workers: int
) -> None:
    out = tmp_path / "reused.beton"
    SmallPageWriter(
        out,
        {
            "image": RGBImageField(write_mode="raw"),
            "arr": NDArrayField(np.dtype(np.float32), (3,)),
            "label": IntField(),
            "blob": BytesField(),
            "meta": JSONField(),
        },
        page_size=4096,
        num_workers=workers,
    ).from_indexed_dataset(ReusedBuffers(37), chunksize=8)
    with BetonReader(out) as r:
        assert r.field_metadata("label").tolist() == list(range(37))
        for i in range(37):
            assert (np.asarray(r.sample_bytes(i, "image")) == i).all(), i
            assert np.asarray(r.sample_bytes(i, "arr")).view(np.float32).tolist() == [i] * 3
            assert bytes(r.sample_bytes(i, "blob")) == bytes([i] * 4)
            assert json.loads(bytes(r.sample_bytes(i, "meta")).rstrip(b"\0")) == {"i": i}


class ScratchState:
    """Keeps scratch state between the lines of ``__getitem__`` (one copy per FFCV worker)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.scratch = np.zeros(2, np.int64)
        self.calls_at_once = 0
        self.most_at_once = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls_at_once += 1
        self.most_at_once = max(self.most_at_once, self.calls_at_once)
        self.scratch[:] = i
        time.sleep(0.0005)  # a read from disk: another thread runs meanwhile
        value = int(self.scratch[0])
        self.calls_at_once -= 1
        return (value,)


def test_dataset_reads_are_one_at_a_time_unless_concurrent_reads(tmp_path: Path) -> None:
    ds = ScratchState(120)
    out = tmp_path / "scratch.beton"
    SmallPageWriter(out, {"label": IntField()}, page_size=4096, num_workers=4).from_indexed_dataset(
        ds, chunksize=5
    )
    with BetonReader(out) as r:
        assert r.field_metadata("label").tolist() == list(range(120))
    assert ds.most_at_once == 1

    # concurrent_reads=True is the promise that __getitem__ is thread-safe: the workers then
    # read at once (this dataset breaks that promise, so only the overlap is checked).
    fast = ScratchState(120)
    SmallPageWriter(
        tmp_path / "fast.beton",
        {"label": IntField()},
        page_size=4096,
        num_workers=4,
        concurrent_reads=True,
    ).from_indexed_dataset(fast, chunksize=5)
    assert fast.most_at_once > 1


def test_slow_serial_reads_log_the_concurrent_reads_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="beton_serve.writer")
    SmallPageWriter(
        tmp_path / "s.beton", {"label": IntField()}, page_size=4096, num_workers=2
    ).from_indexed_dataset(ScratchState(40), chunksize=5)
    assert "concurrent_reads=True" in caplog.text


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p / "missing" / "out.beton", "does not exist"),
        (lambda p: p / "adir", "is a directory"),
    ],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    tmp_path: Path, make, words: str
) -> None:
    (tmp_path / "adir").mkdir()
    calls = ScratchState(3)
    with pytest.raises(WriterError, match=words):
        DatasetWriter(make(tmp_path), {"label": IntField()}).from_indexed_dataset(calls)
    assert calls.most_at_once == 0  # nothing was read
    assert sorted(os.listdir(tmp_path)) == ["adir"]


def test_a_directory_without_write_permission_is_a_writer_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # os.access answers for the real user (root may write anywhere, so it is simulated here).
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(WriterError, match="no permission"):
        DatasetWriter(tmp_path / "x.beton", {"label": IntField()}).from_indexed_dataset(
            ListDS([(1,)])
        )


def test_a_disk_error_while_writing_is_a_writer_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriterError, match="No space left on device"):
        DatasetWriter(tmp_path / "x.beton", {"label": IntField()}).from_indexed_dataset(
            ListDS([(1,), (2,)])
        )
    assert os.listdir(tmp_path) == []


def test_a_long_legal_name_is_written(tmp_path: Path) -> None:
    out = tmp_path / ("x" * 244 + ".beton")  # 250 bytes: the temporary name must still fit
    DatasetWriter(out, {"label": IntField()}).from_indexed_dataset(ListDS([(7,)]))
    with BetonReader(out) as r:
        assert r.field_metadata("label").tolist() == [7]


def test_a_symbolic_link_is_written_through(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    real = tmp_path / "data" / "real.beton"
    link = tmp_path / "link.beton"
    link.symlink_to(real)
    DatasetWriter(link, {"label": IntField()}).from_indexed_dataset(ListDS([(3,), (4,)]))
    assert link.is_symlink()
    with BetonReader(real) as r:
        assert r.field_metadata("label").tolist() == [3, 4]


def test_a_uint64_index_past_int64_is_refused_not_wrapped(tmp_path: Path) -> None:
    # 2**64 - 1 cast to int64 is -1: it wrote dataset[-1] silently.
    idx = np.array([0, 2**64 - 1], np.uint64)
    with pytest.raises(WriterError, match="index 18446744073709551615 is out of range"):
        DatasetWriter(tmp_path / "x.beton", {"label": IntField()}).from_indexed_dataset(
            ListDS([(1,), (2,)]), indices=idx
        )
    assert os.listdir(tmp_path) == []
