"""BetonReader against the FFCV-written fixtures: every value equals what FFCV decoded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from beton_serve.errors import FormatError
from beton_serve.fields import Field, IntField, NDArrayField, RGBImageField
from beton_serve.format import BetonReader, memory_read

FIXTURES = ["images_raw", "images_jpg", "images_smart", "mixed_fields", "image_pairs"]


@pytest.fixture(scope="module")
def manifest(fixtures_dir: Path) -> dict:
    return json.loads((fixtures_dir / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_opens_with_manifest_header(fixtures_dir: Path, manifest: dict, name: str) -> None:
    info = manifest[name]
    with BetonReader(fixtures_dir / info["file"]) as r:
        assert r.header._asdict() == info["header"]
        assert r.field_names == [f["name"] for f in info["fields"]]
        assert [type(h).__name__ for h in r.handlers.values()] == [
            f["type"] for f in info["fields"]
        ]
        assert r.file_size == info["size_bytes"]
        # One page of data in every fixture: all samples with data are on page D / page_size.
        assert set(np.unique(r.sample_pages).tolist()) == {r.data_start // r.page_size}


def test_mixed_fields_values_exact(fixtures_dir: Path) -> None:
    e = np.load(fixtures_dir / "mixed_fields.expected.npz")
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        assert np.array_equal(r.field_metadata("int"), e["int"][:, 0])
        assert np.array_equal(r.field_metadata("float"), e["float"][:, 0], equal_nan=True)
        assert np.array_equal(
            np.signbit(r.field_metadata("float")), np.signbit(e["float"][:, 0])
        )  # -0.0 preserved
        h = r.handlers["array"]
        assert isinstance(h, NDArrayField) and h.shape == (3, 4) and h.dtype == np.float32
        arrays = np.stack(
            [np.frombuffer(r.sample_bytes(i, "array"), h.dtype).reshape(h.shape) for i in range(50)]
        )
        assert np.array_equal(arrays, e["array"], equal_nan=True)
        for key in ("blob", "meta"):
            sizes = r.field_metadata(key)["size"]
            assert np.array_equal(sizes, e[f"{key}__size"])
            rows = np.zeros((50, int(sizes.max())), np.uint8)  # FFCV rows, zero-padded
            for i in range(50):
                data = r.sample_bytes(i, key)
                rows[i, : data.size] = data
            assert np.array_equal(rows, e[key])
        from beton_serve.fields import JSONField

        assert json.dumps(JSONField.unpack(e["meta"])) == str(e["meta__unpacked_json"])
        rows_meta = np.zeros_like(e["meta"])
        for i in range(50):
            d = r.sample_bytes(i, "meta")
            rows_meta[i, : d.size] = d
        assert JSONField.unpack(rows_meta) == json.loads(str(e["meta__unpacked_json"]))


@pytest.mark.parametrize("name", ["images_raw", "images_jpg", "images_smart"])
def test_images_decode_exactly_like_ffcv(fixtures_dir: Path, manifest: dict, name: str) -> None:
    import cv2
    import simplejpeg

    full = np.load(fixtures_dir / f"{name}.decoded_full.npz")
    expected = np.load(fixtures_dir / f"{name}.expected.npz")
    info = manifest[name]
    with BetonReader(fixtures_dir / info["file"]) as r:
        meta = r.field_metadata("image")
        modes = ["jpg" if m == 0 else "raw" for m in meta["mode"]]
        assert modes == info["per_sample"]["mode"]
        assert np.array_equal(r.field_metadata("label"), expected["label"][:, 0])
        if "weight" in r.field_names:
            assert np.array_equal(r.field_metadata("weight"), expected["weight"][:, 0])
        for i in range(r.num_samples):
            data = r.sample_bytes(i, "image")
            assert data.size == info["per_sample"]["stored_bytes"][i]
            h, w = int(meta["height"][i]), int(meta["width"][i])
            assert [h, w] == info["per_sample"]["stored_hw"][i]
            if meta["mode"][i] == 0:
                img = simplejpeg.decode_jpeg(
                    data.tobytes(), colorspace="RGB", fastdct=True, fastupsample=False
                )
            else:
                img = data.reshape(h, w, 3)
            assert np.array_equal(img, full[f"image_{i:04d}"]), f"sample {i}"
            # CenterCropRGBImageDecoder((64, 64), ratio=1.0), reproduced with cv2 INTER_AREA.
            c = int(1.0 * min(h, w))
            top, left = (h - c) // 2, (w - c) // 2
            crop = cv2.resize(
                np.ascontiguousarray(img[top : top + c, left : left + c]),
                (64, 64),
                interpolation=cv2.INTER_AREA,
            )
            assert np.array_equal(crop, expected["image"][i]), f"sample {i}"


def test_image_pairs_constant_size(fixtures_dir: Path) -> None:
    import simplejpeg

    e = np.load(fixtures_dir / "image_pairs.expected.npz")
    with BetonReader(fixtures_dir / "image_pairs.beton") as r:
        assert set(r.field_metadata("input")["mode"].tolist()) == {0}
        assert set(r.field_metadata("target")["mode"].tolist()) == {1}
        for i in range(16):
            inp = simplejpeg.decode_jpeg(
                r.sample_bytes(i, "input").tobytes(), "RGB", fastdct=True, fastupsample=False
            )
            assert np.array_equal(inp, e["input"][i])
            assert np.array_equal(r.sample_bytes(i, "target").reshape(48, 64, 3), e["target"][i])


def test_sample_bytes_is_zero_copy_and_read_only(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "images_raw.beton") as r:
        a = r.sample_bytes(3, "image")
        assert not a.flags.writeable
        assert a.base is not None  # a view, not a copy
        assert np.shares_memory(a, r.storage_state[0])
        with pytest.raises(ValueError, match="inline"):
            r.sample_bytes(0, "label")
        with pytest.raises(KeyError):
            r.sample_bytes(0, "nope")
        with pytest.raises(IndexError):
            r.sample_bytes(64, "image")
        del a


def test_memory_read_compiles_with_numba(fixtures_dir: Path) -> None:
    numba = pytest.importorskip("numba")
    read = numba.njit(memory_read)

    @numba.njit
    def total(meta, state):
        s = 0
        for i in range(meta.shape[0]):
            d = read(meta[i]["data_ptr"], state)
            s += d.shape[0] + np.int64(meta[i]["width"]) * 0
        return s

    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        meta = r.field_metadata("image")
        py = sum(memory_read(int(p), r.storage_state).size for p in meta["data_ptr"])
        assert total(meta, r.storage_state) == py
        assert py == int(r.allocations[2].sum())


def test_schema_key_is_stable_and_schema_specific(fixtures_dir: Path) -> None:
    with (
        BetonReader(fixtures_dir / "images_raw.beton") as a,
        BetonReader(fixtures_dir / "images_smart.beton") as b,
        BetonReader(fixtures_dir / "images_jpg.beton") as c,
    ):
        assert a.schema_key() == b.schema_key()  # same fields, different data
        assert a.schema_key() != c.schema_key()
        assert len(a.schema_key()) == 64


def test_custom_field_override_and_missing_custom(fixtures_dir: Path) -> None:
    class MyInt(IntField):
        @staticmethod
        def from_binary(binary):
            return MyInt()

    with BetonReader(fixtures_dir / "images_raw.beton", custom_fields={"label": MyInt}) as r:
        assert type(r.handlers["label"]) is MyInt


def test_close_is_idempotent_and_views_survive(fixtures_dir: Path) -> None:
    r = BetonReader(fixtures_dir / "images_raw.beton")
    view = r.sample_bytes(1, "image")
    expected = view.copy()
    r.close()
    r.close()
    assert np.array_equal(view, expected)  # mapping kept alive by the view


def test_missing_file_is_format_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="cannot open"):
        BetonReader(tmp_path / "nope.beton")


@pytest.mark.timeout(30)
def test_a_fifo_a_directory_or_a_device_is_a_format_error_not_a_hang(tmp_path: Path) -> None:
    """Opening a FIFO waited for a writer: ``BetonReader`` (the in-process Loader, and a daemon
    given one by a glob) hung for good. Now every non-regular file is refused by name."""
    fifo = tmp_path / "fifo.beton"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path, Path("/dev/zero")):
        with pytest.raises(FormatError, match="not a regular file"):
            BetonReader(path)


class Point(Field):
    """A custom field (type 255): two float32 coordinates stored inline."""

    @property
    def metadata_type(self) -> np.dtype:
        return np.dtype([("x", "<f4"), ("y", "<f4")])

    @staticmethod
    def from_binary(binary):
        return Point()

    def to_binary(self):
        return np.zeros(1024, np.uint8)

    def encode(self, destination, field, malloc):
        destination["x"], destination["y"] = field

    def get_decoder_class(self):
        raise NotImplementedError


def test_custom_type_255_round_trip(tmp_path: Path) -> None:
    from beton_serve.writer import DatasetWriter

    out = tmp_path / "custom.beton"
    data = [((float(i), -float(i)), i) for i in range(5)]
    DatasetWriter(out, {"pt": Point(), "label": IntField()}, num_workers=1).from_indexed_dataset(
        data
    )
    with pytest.raises(FormatError, match=r"custom_fields=\{'pt'"):
        BetonReader(out)
    with BetonReader(out, custom_fields={"pt": Point}) as r:
        assert r.type_ids == [255, 1]
        col = r.field_metadata("pt")
        assert col["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert col["y"].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0]


def test_rgb_subclass_is_written_as_custom(tmp_path: Path) -> None:
    from beton_serve.writer import DatasetWriter

    class MyImg(RGBImageField):
        pass

    out = tmp_path / "sub.beton"
    img = np.zeros((4, 4, 3), np.uint8)
    DatasetWriter(out, {"im": MyImg()}, num_workers=1).from_indexed_dataset([(img,)])
    with BetonReader(out, custom_fields={"im": MyImg}) as r:
        assert r.type_ids == [255]
        assert np.array_equal(r.sample_bytes(0, "im").reshape(4, 4, 3), img)
