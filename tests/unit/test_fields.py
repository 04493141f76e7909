"""Field classes: argument blobs, input conversion, encode rules and decoder lookup."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from beton_serve.fields import (
    BytesField,
    FloatField,
    IntField,
    JSONField,
    NDArrayField,
    RGBImageField,
    TorchTensorField,
)
from beton_serve.fields import rgb_image as rgb_mod


class Recorder:
    """A malloc that hands out slices of one buffer and records the calls."""

    def __init__(self) -> None:
        self.buf = np.zeros(1 << 16, np.uint8)
        self.used = 0
        self.calls: list[int] = []

    def __call__(self, size: int):
        ptr = 1000 + self.used
        view = self.buf[self.used : self.used + size]
        self.used += size
        self.calls.append(size)
        return ptr, view


def _dest(field):
    return np.zeros(1, dtype=field.metadata_type)


@pytest.mark.parametrize(
    "field", [FloatField(), IntField(), RGBImageField(), BytesField(), JSONField()]
)
def test_zero_argument_blobs_round_trip(field) -> None:
    blob = field.to_binary()
    assert blob.size == 1024 and not blob.any()
    assert type(type(field).from_binary(blob)) is type(field)
    bad = blob.copy()
    bad[100] = 1
    with pytest.raises(ValueError):
        type(field).from_binary(bad)


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (3, 3),
        (3.0, 3),
        (np.int32(-7), -7),
        (np.uint64(2**63 - 1), 2**63 - 1),
        (-(2**63), -(2**63)),
        (True, 1),
        (np.array([4]), 4),
        (np.float32(2.0), 2),
    ],
)
def test_int_field_stores_integers_exactly(value, stored) -> None:
    d = _dest(IntField())
    IntField().encode(d, value, Recorder())
    assert int(d[0]) == stored


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3.9, "FFCV would store as 3"),  # FFCV truncates: a wrong label, silently
        (-0.5, "FFCV would store as 0"),
        (float("nan"), "use FloatField"),
        (float("inf"), "use FloatField"),
        ("5", "got '5'"),  # numpy would parse it
        (None, "got None"),
        (2**63, "outside its range"),
        (np.uint64(2**64 - 1), "outside its range"),
        (1 + 0j, "stores integers"),
        (np.array([1, 2]), "shape \\(2,\\)"),
        (np.array(["a"]), "dtype <U1"),
    ],
)
def test_int_field_refuses_values_it_would_change(value, message) -> None:
    d = _dest(IntField())
    d[0] = 11
    with pytest.raises(ValueError, match=message):
        IntField().encode(d, value, Recorder())
    assert d[0] == 11  # nothing stored


def test_int_field_takes_torch_scalars() -> None:
    torch = pytest.importorskip("torch")
    d = _dest(IntField())
    IntField().encode(d, torch.tensor(5), Recorder())
    assert d[0] == 5
    with pytest.raises(ValueError, match="FFCV would store as 2"):
        IntField().encode(d, torch.tensor(2.5), Recorder())


def test_float_field_stores_real_numbers() -> None:
    d = _dest(FloatField())
    FloatField().encode(d, -0.0, Recorder())
    assert np.signbit(d[0])
    for value, stored in [(2, 2.0), (np.float32(1.5), 1.5), (np.array([3.25]), 3.25), (True, 1.0)]:
        FloatField().encode(d, value, Recorder())
        assert d[0] == stored
    FloatField().encode(d, float("nan"), Recorder())  # a NaN given is a NaN stored
    assert np.isnan(d[0])
    for value in [None, "5", b"5", 1 + 2j, np.complex64(1), np.array([1.0, 2.0])]:
        d[0] = 7.0
        with pytest.raises(ValueError, match="FloatField"):
            FloatField().encode(d, value, Recorder())
        assert d[0] == 7.0


def test_decoder_classes_are_imported_lazily() -> None:
    decoders = pytest.importorskip("beton_serve.fields.decoders")
    assert IntField().get_decoder_class() is decoders.IntDecoder
    assert FloatField().get_decoder_class() is decoders.FloatDecoder
    assert BytesField().get_decoder_class() is decoders.BytesDecoder
    assert JSONField().get_decoder_class() is decoders.BytesDecoder
    assert NDArrayField(np.uint8, (1,)).get_decoder_class() is decoders.NDArrayDecoder
    assert RGBImageField().get_decoder_class() is decoders.SimpleRGBImageDecoder


def test_bytes_field_rules() -> None:
    f = BytesField()
    rec = Recorder()
    d = _dest(f)
    f.encode(d, b"abc", rec)
    assert d["size"][0] == 3 and rec.buf[:3].tobytes() == b"abc"
    d = _dest(f)
    f.encode(d, np.zeros(0, np.uint8), rec)
    assert d["size"][0] == 0 and rec.calls[-1] == 1  # never a zero-size allocation
    with pytest.raises(ValueError, match="uint8"):
        f.encode(_dest(f), np.arange(3), rec)


def test_json_field_bytes_and_unpack() -> None:
    f = JSONField()
    value = {"a": [1, 2], "é": None}
    data = JSONField.encode_value(value)
    assert data.tobytes() == (json.dumps(value) + "\0").encode()
    rec = Recorder()
    d = _dest(f)
    f.encode(d, value, rec)
    assert d["size"][0] == data.size
    rows = np.zeros((2, 40), np.uint8)
    rows[0, : data.size] = data
    rows[1, :3] = np.frombuffer(b"[]\0", np.uint8)
    assert JSONField.unpack(rows) == [value, []]
    assert JSONField.unpack(rows[0]) == value


def test_ndarray_field_validation_and_casting() -> None:
    for shape in [(), (3, 0), (0, 3), (-1,), (1,) * 33]:
        with pytest.raises(ValueError):
            NDArrayField(np.float32, shape)
    with pytest.raises(ValueError):
        NDArrayField(np.dtype([("a", "<f4"), ("b", "<f4")]), (2,))
    f = NDArrayField(np.float32, (2, 2))
    assert f.element_size == 16
    rec = Recorder()
    d = _dest(f)
    f.encode(d, np.arange(4, dtype=np.int16).reshape(2, 2), rec)  # safe cast
    assert np.array_equal(rec.buf[:16].view(np.float32), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="shape"):
        f.encode(_dest(f), np.zeros(4, np.float32), rec)
    with pytest.raises(ValueError, match="cannot store"):
        f.encode(_dest(f), np.zeros((2, 2), np.complex64), rec)
    # within the kind: rounding to a narrower float is kept, a changed value is refused
    f.encode(_dest(f), np.full((2, 2), 0.1), rec)
    assert np.array_equal(
        rec.buf[rec.used - 16 : rec.used].view(np.float32), np.full(4, np.float32(0.1))
    )
    with pytest.raises(ValueError, match=r"element \(1, 0\) is 1e\+300, .* stored as inf"):
        f.encode(_dest(f), np.array([[1.0, 2.0], [1e300, 3.0]]), rec)
    f.encode(_dest(f), np.array([[np.inf, np.nan], [-np.inf, 3.0]]), rec)  # given, not made
    with pytest.raises(ValueError, match=r"element \(0, 1\) is 16777217, .* 16777216"):
        f.encode(_dest(f), np.array([[1, 2**24 + 1], [0, 0]], np.int64), rec)


@pytest.mark.parametrize(
    ("dtype", "values", "bad"),
    [
        (np.int8, [1, 2, 300], "element \\(2,\\) is 300, which would be stored as 44"),
        (np.int64, np.array([1, 2**63], np.uint64), "is 9223372036854775808"),
        (np.uint32, np.array([1, 2**33], np.uint64), "is 8589934592, .* stored as 0"),
        (np.int16, [True, False], None),
        (np.uint8, np.array([0, 255], np.uint16), None),
        (np.int64, np.array([1, 2], np.uint64), None),
    ],
)
def test_ndarray_field_integers_are_stored_exactly_or_refused(dtype, values, bad) -> None:
    arr = np.asarray(values)
    f = NDArrayField(dtype, arr.shape)
    rec = Recorder()
    if bad is None:
        f.encode(_dest(f), arr, rec)
        assert np.array_equal(rec.buf[: arr.size * f.dtype.itemsize].view(dtype), arr)
    else:
        with pytest.raises(ValueError, match=bad):
            f.encode(_dest(f), arr, rec)
    bad = f.to_binary()
    bad[264:270] = np.frombuffer(b"garbag", np.uint8)
    with pytest.raises(ValueError):
        NDArrayField.from_binary(bad)


def test_torch_tensor_field_reads_back_as_ndarray() -> None:
    torch = pytest.importorskip("torch")
    f = TorchTensorField(torch.float64, (3,))
    assert f.dtype == np.float64
    back = TorchTensorField.from_binary(f.to_binary())
    assert type(back) is NDArrayField and back.shape == (3,)
    rec = Recorder()
    d = _dest(f)
    f.encode(d, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), rec)
    assert rec.buf[:24].view(np.float64).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        TorchTensorField(torch.bfloat16, (3,))
    with pytest.raises(ValueError, match="float16 as float32"):  # no decoder reads it back
        TorchTensorField(torch.float16, (3,))


def test_rgb_input_conversion_rule() -> None:
    g = np.arange(12, dtype=np.uint8).reshape(3, 4)
    out = rgb_mod.to_rgb_array(g)
    assert out.shape == (3, 4, 3) and all(np.array_equal(out[..., c], g) for c in range(3))
    assert np.array_equal(rgb_mod.to_rgb_array(g[..., None]), out)
    rgba = np.random.default_rng(0).integers(0, 255, (3, 4, 4), dtype=np.uint8)
    assert np.array_equal(rgb_mod.to_rgb_array(rgba), rgba[..., :3])
    with pytest.raises(ValueError, match="uint8"):
        rgb_mod.to_rgb_array(np.zeros((2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        rgb_mod.to_rgb_array(np.zeros((2, 2, 2), np.uint8))


def test_rgb_pil_input() -> None:
    Image = pytest.importorskip("PIL.Image")
    arr = np.random.default_rng(1).integers(0, 255, (5, 6, 4), dtype=np.uint8)
    img = Image.fromarray(arr, mode="RGBA")
    assert np.array_equal(rgb_mod.to_rgb_array(img), arr[..., :3])
    gray = Image.fromarray(arr[..., 0], mode="L")
    assert np.array_equal(rgb_mod.to_rgb_array(gray)[..., 2], arr[..., 0])


class _WidePilImage:
    """A PIL-like image of more than 8 bits per channel (PIL's ``convert("RGB")`` clips one
    to 0/255, or zeros a 0..1 float image)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def convert(self, mode: str) -> np.ndarray:
        return np.full((2, 2, 3), 255, np.uint8)  # what PIL returns: no error, wrong pixels


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I", "F"])
def test_wide_pil_images_are_refused_not_clipped(mode: str) -> None:
    """A 16-bit PNG opened with PIL was stored as pixels of 0 and 255 with no error; FFCV
    refuses it (its array is not uint8), and so does the same data given as an array."""
    with pytest.raises(ValueError, match=f"PIL image mode '{re.escape(mode)}' has more than 8"):
        rgb_mod.to_rgb_array(_WidePilImage(mode))
    with pytest.raises(ValueError, match="more than 8 bits"):
        RGBImageField().prepare(_WidePilImage(mode))


def test_a_float_max_resolution_is_used_as_given_like_ffcv() -> None:
    """``max_resolution=100.5`` was truncated to 100 first: a 52x102 image came out 50x100,
    where FFCV's ``100.5 / 102`` ratio stores 51x100."""
    field = RGBImageField("raw", max_resolution=100.5)
    prepared = field.prepare(np.zeros((52, 102, 3), np.uint8))
    ratio = 100.5 / 102
    assert (prepared.height, prepared.width) == (int(ratio * 52), int(ratio * 102)) == (51, 100)
    assert RGBImageField(max_resolution=256.0).max_resolution == 256  # integral stays int
    for bad in (0, 0.5, -3, float("nan"), float("inf"), True, (256, 256), "256"):
        with pytest.raises(ValueError, match="max_resolution must be"):
            RGBImageField(max_resolution=bad)  # type: ignore[arg-type]


def test_max_resolution_rule_matches_ffcv() -> None:
    import cv2

    img = np.random.default_rng(2).integers(0, 255, (375, 500, 3), dtype=np.uint8)
    out = rgb_mod.resize_to_max(img, 256)
    ratio = 256 / 500
    assert out.shape == (int(ratio * 375), int(ratio * 500), 3)
    ref = cv2.resize(img, (int(ratio * 500), int(ratio * 375)), interpolation=cv2.INTER_AREA)
    assert np.array_equal(out, ref)
    assert rgb_mod.resize_to_max(img, 500) is img  # never upscale / no-op at the limit
    assert rgb_mod.resize_to_max(np.zeros((1, 1000, 3), np.uint8), 10).shape == (1, 10, 3)


def test_jpeg_encode_matches_opencv_bgr() -> None:
    import cv2

    img = np.random.default_rng(3).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    ok, ref = cv2.imencode(".jpg", img[..., ::-1].copy(), [cv2.IMWRITE_JPEG_QUALITY, 77])
    assert ok
    assert np.array_equal(rgb_mod.encode_jpeg(img, 77), ref.reshape(-1))


def test_write_modes_and_smart_does_not_encode_raw(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    real = rgb_mod.encode_jpeg

    def counting(image, quality):
        calls.append(image.shape)
        return real(image, quality)

    monkeypatch.setattr(rgb_mod, "encode_jpeg", counting)
    small = np.zeros((8, 8, 3), np.uint8)  # 192 bytes
    big = np.zeros((32, 32, 3), np.uint8)  # 3072 bytes
    smart = RGBImageField(write_mode="smart", smart_threshold=1000)
    assert smart.prepare(small).mode == 1 and calls == []
    assert smart.prepare(big).mode == 0 and calls == [(32, 32, 3)]
    assert RGBImageField(write_mode="smart").prepare(big).mode == 1  # no threshold: raw
    assert len(calls) == 1
    assert RGBImageField(write_mode="raw").prepare(big).mode == 1
    assert RGBImageField(write_mode="jpg").prepare(small).mode == 0
    prop = RGBImageField(write_mode="proportion", compress_probability=0.5)
    modes = [prop.prepare(small, np.random.default_rng([9, i])).mode for i in range(200)]
    assert 60 < sum(m == 0 for m in modes) < 140
    again = [prop.prepare(small, np.random.default_rng([9, i])).mode for i in range(200)]
    assert modes == again
    always = RGBImageField("proportion", compress_probability=1.0)
    assert always.prepare(small, np.random.default_rng(0)).mode == 0
    assert always.prepare(small).mode == -1  # unseeded: drawn when stored, in write order


def test_rgb_limits() -> None:
    with pytest.raises(ValueError, match="write_mode"):
        RGBImageField(write_mode="png")
    with pytest.raises(ValueError, match="jpeg_quality"):
        RGBImageField(jpeg_quality=101)
    f = RGBImageField()
    with pytest.raises(ValueError, match="65535"):
        f.prepare(np.zeros((1, 65536), np.uint8))
    with pytest.raises(ValueError, match="empty"):
        f.prepare(np.zeros((0, 5, 3), np.uint8))
    assert RGBImageField(max_resolution=100).prepare(np.zeros((1, 65536), np.uint8)).width == 100


def test_rgb_encode_metadata() -> None:
    f = RGBImageField(write_mode="raw")
    img = np.random.default_rng(4).integers(0, 255, (5, 7, 3), dtype=np.uint8)
    rec = Recorder()
    d = _dest(f)
    f.encode(d, img, rec)
    assert (d["mode"][0], d["width"][0], d["height"][0], d["data_ptr"][0]) == (1, 7, 5, 1000)
    assert np.array_equal(rec.buf[:105].reshape(5, 7, 3), img)


def test_ffcv_module_paths_expose_decoders() -> None:
    decoders = pytest.importorskip("beton_serve.fields.decoders")
    from beton_serve.fields import basics, ndarray, rgb_image
    from beton_serve.fields import bytes as bytes_mod

    assert basics.IntDecoder is decoders.IntDecoder
    assert rgb_image.CenterCropRGBImageDecoder is decoders.CenterCropRGBImageDecoder
    assert bytes_mod.BytesDecoder is decoders.BytesDecoder
    assert ndarray.NDArrayDecoder is decoders.NDArrayDecoder
    with pytest.raises(AttributeError):
        _ = basics.NoSuchDecoder


@pytest.mark.parametrize("dtype", ["float16", ">i4", ">f8", "S4", "U2", "V4", "M8[s]"])
def test_ndarray_field_refuses_dtypes_no_decoder_reads_back(dtype: str) -> None:
    # They used to be written, and then every batch failed to decode (float16, big-endian) or
    # the Loader raised an untyped TypeError (strings, bytes, void).
    with pytest.raises(ValueError, match="NDArrayField of dtype"):
        NDArrayField(np.dtype(dtype), (2,))


@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint16", "int64", "uint64", "float32", "float64", "complex64"]
)
def test_every_decodable_dtype_round_trips_bit_for_bit(tmp_path, dtype: str) -> None:
    from beton_serve.fields.decoders import NDArrayDecoder
    from beton_serve.loader import Loader, OrderOption
    from beton_serve.writer import DatasetWriter

    rng = np.random.default_rng(3)
    values = [rng.integers(0, 100, (2, 3)).astype(dtype) for _ in range(6)]
    out = tmp_path / "d.beton"
    DatasetWriter(out, {"a": NDArrayField(np.dtype(dtype), (2, 3))}).from_indexed_dataset(
        [(v,) for v in values]
    )
    with Loader(
        str(out),
        batch_size=3,
        num_workers=1,
        order=OrderOption.SEQUENTIAL,
        pipelines={"a": [NDArrayDecoder()]},
    ) as loader:
        got = np.concatenate([np.array(b[0], copy=True) for b in loader])
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(got, np.stack(values))


def test_a_file_holding_a_float16_field_is_a_spec_error_when_decoded(tmp_path) -> None:
    """FFCV's writer takes float16; the file opens, and decoding that field is refused by
    name when the Loader is built (it used to fail every batch)."""
    from beton_serve.errors import SpecError
    from beton_serve.fields.decoders import NDArrayDecoder
    from beton_serve.loader import Loader
    from beton_serve.writer import DatasetWriter

    class Half(NDArrayField):  # what FFCV writes: the file's own field, as read back
        def __init__(self) -> None:
            super().__init__(np.float16, (2,), _from_file=True)

    out = tmp_path / "half.beton"
    DatasetWriter(out, {"a": Half(), "label": IntField()}).from_indexed_dataset(
        [(np.ones(2, np.float16), i) for i in range(4)]
    )
    custom = {"a": NDArrayField}  # the writer stored Half's type id; read it as FFCV's field
    with pytest.raises(SpecError, match="NDArrayDecoder cannot decode this field's dtype float16"):
        Loader(
            str(out),
            batch_size=2,
            num_workers=1,
            pipelines={"a": [NDArrayDecoder()]},
            custom_fields=custom,
        )
    with Loader(
        str(out), batch_size=2, num_workers=1, pipelines={"a": None}, custom_fields=custom
    ) as loader:
        assert sum(len(b[0]) for b in loader) == 4  # the other fields read as before
