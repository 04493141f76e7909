"""Decoders against the FFCV-written fixtures, called directly (no planner).

Each test builds the batch buffer itself, feeds ``accept_field``/``accept_globals``, declares,
generates, compiles the function when it is jit-mode and not ``python``, and runs it batch by
batch in sequential order, as FFCV's Loader did when the fixtures were written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.fields.decoders import (
    BytesDecoder,
    CenterCropRGBImageDecoder,
    FloatDecoder,
    IntDecoder,
    NDArrayDecoder,
    RandomResizedCropRGBImageDecoder,
    SimpleRGBImageDecoder,
)
from beton_serve.format import BetonReader, memory_read
from beton_serve.jpeg import CorruptJPEGError
from beton_serve.pipeline import Compiler, State
from beton_serve.pipeline.rng import derive_seed_key

INITIAL = State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8)


def prepare(op: Any, reader: BetonReader, field: str) -> tuple[Any, State]:
    op.accept_field(reader.handlers[field])
    op.accept_globals(reader.field_metadata(field), memory_read)
    state, query = op.declare_state_and_memory(INITIAL)
    assert query.shape == state.shape and np.dtype(query.dtype) == state.dtype
    fn = op.generate_code()
    if state.jit_mode and not getattr(fn, "python", False):
        fn = Compiler.compile(fn)
    return fn, state


def run_all(
    op: Any, reader: BetonReader, field: str, batch: int, seed_key: Any = None, fill: int = 0
) -> np.ndarray:
    fn, state = prepare(op, reader, field)
    n = reader.num_samples
    buf = np.full((batch, *state.shape), fill, dtype=state.dtype)
    outs = []
    for start in range(0, n, batch):
        ids = np.arange(start, min(n, start + batch), dtype=np.uint64)
        args = [ids, buf[: len(ids)], reader.field_metadata(field), reader.storage_state]
        if getattr(fn, "with_seed", False):
            args.append(seed_key)
        outs.append(np.array(fn(*args)))
    return np.concatenate(outs)


@pytest.mark.parametrize("name", ["images_raw", "images_jpg", "images_smart"])
def test_center_crop_cv2_is_exact(fixtures_dir: Path, name: str) -> None:
    expected = np.load(fixtures_dir / f"{name}.expected.npz")
    with BetonReader(fixtures_dir / f"{name}.beton") as r:
        got = run_all(
            CenterCropRGBImageDecoder((64, 64), 1.0, resize="cv2", dct_scale=False), r, "image", 16
        )
        labels = run_all(IntDecoder(), r, "label", 16)
    np.testing.assert_array_equal(got, expected["image"])
    np.testing.assert_array_equal(labels, expected["label"])


@pytest.mark.parametrize("name", ["images_raw", "images_jpg", "images_smart"])
def test_center_crop_fast_path_tolerance(fixtures_dir: Path, name: str) -> None:
    """``resize="area"``: max |diff| <= 1 and > 99% of pixels exact; with DCT scaling the
    JPEG samples whose crop is >= 2x the output differ more (stated: mean |diff| < 3)."""
    expected = np.load(fixtures_dir / f"{name}.expected.npz")["image"].astype(np.int16)
    with BetonReader(fixtures_dir / f"{name}.beton") as r:
        fast = run_all(CenterCropRGBImageDecoder((64, 64), 1.0, dct_scale=False), r, "image", 16)
        scaled = run_all(CenterCropRGBImageDecoder((64, 64), 1.0), r, "image", 16)
    diff = np.abs(fast.astype(np.int16) - expected)
    assert diff.max() <= 1
    assert (diff == 0).mean() > 0.99
    dsc = np.abs(scaled.astype(np.int16) - expected)
    assert dsc.mean(axis=(1, 2, 3)).max() < 3.0


def test_mixed_fields(fixtures_dir: Path) -> None:
    expected = np.load(fixtures_dir / "mixed_fields.expected.npz")
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        np.testing.assert_array_equal(run_all(IntDecoder(), r, "int", 10), expected["int"])
        got_f = run_all(FloatDecoder(), r, "float", 10)
        assert got_f.dtype == np.float64
        np.testing.assert_array_equal(got_f, expected["float"])
        arr = run_all(NDArrayDecoder(), r, "array", 10)
        assert arr.dtype == np.float32 and arr.shape == (50, 3, 4)
        np.testing.assert_array_equal(arr, expected["array"])
        for field in ("blob", "meta"):
            # buffers start full of 0xAB: the decoder must zero the tail of every row
            rows = run_all(BytesDecoder(), r, field, 10, fill=0xAB)
            np.testing.assert_array_equal(rows, expected[field])


def test_bytes_rows_have_no_stale_tail(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        fn, state = prepare(BytesDecoder(), r, "blob")
        sizes = r.field_metadata("blob")["size"].astype(int)
        big, small = int(np.argmax(sizes)), int(np.argmin(sizes))
        buf = np.zeros((1, *state.shape), np.uint8)
        md = r.field_metadata("blob")
        fn(np.array([big], np.uint64), buf, md, r.storage_state)
        fn(np.array([small], np.uint64), buf, md, r.storage_state)
        assert not buf[0, sizes[small] :].any()


def test_simple_rgb_image_pairs(fixtures_dir: Path) -> None:
    expected = np.load(fixtures_dir / "image_pairs.expected.npz")
    with BetonReader(fixtures_dir / "image_pairs.beton") as r:
        for field in ("input", "target"):
            np.testing.assert_array_equal(
                run_all(SimpleRGBImageDecoder(), r, field, 4), expected[field]
            )


def test_simple_rgb_refuses_variable_size(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        op = SimpleRGBImageDecoder()
        op.accept_globals(r.field_metadata("image"), memory_read)
        with pytest.raises(SpecError, match="CenterCropRGBImageDecoder"):
            op.declare_state_and_memory(INITIAL)


def test_decoder_field_mismatch_is_spec_error(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "mixed_fields.beton") as r:
        op = BytesDecoder()
        op.accept_globals(r.field_metadata("int"), memory_read)
        with pytest.raises(SpecError):
            op.declare_state_and_memory(INITIAL)
        op2 = IntDecoder()
        op2.accept_globals(r.field_metadata("blob"), memory_read)
        with pytest.raises(SpecError):
            op2.declare_state_and_memory(INITIAL)


def test_rrc_is_reproducible_and_epoch_dependent(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        op = RandomResizedCropRGBImageDecoder((32, 32))
        k0 = derive_seed_key(0, 0, 0)
        a = run_all(op, r, "image", 16, seed_key=k0)
        # other batch slicing (worker-count independent): same pixels
        b = run_all(op, r, "image", 5, seed_key=k0)
        np.testing.assert_array_equal(a, b)
        c = run_all(op, r, "image", 16, seed_key=derive_seed_key(0, 1, 0))
        assert (a != c).any()
        assert op.spec_params()["output_size"] == [32, 32]


def test_rrc_matches_reference_crop_then_cv2(fixtures_dir: Path) -> None:
    """RRC with resize='cv2', no DCT scaling == full decode + sampled crop + cv2 INTER_AREA."""
    import cv2
    from beton_serve._kernels.crop import rrc_batch

    full = np.load(fixtures_dir / "images_jpg.decoded_full.npz")
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        op = RandomResizedCropRGBImageDecoder((24, 20), resize="cv2", dct_scale=False)
        key = derive_seed_key(3, 0, 1)
        got = run_all(op, r, "image", 8, seed_key=key)
        md = r.field_metadata("image")
        ids = np.arange(r.num_samples, dtype=np.uint64)
        boxes = rrc_batch(
            key,
            ids,
            md["height"].astype(np.int64),
            md["width"].astype(np.int64),
            np.array([0.08, 1.0]),
            np.array([3 / 4, 4 / 3]),
        )
    for s in range(r.num_samples):
        i, j, h, w = boxes[s]
        img = full[f"image_{s:04d}"]
        assert 0 <= i and i + h <= img.shape[0] and 0 <= j and j + w <= img.shape[1]
        ref = cv2.resize(img[i : i + h, j : j + w], (20, 24), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(got[s], ref)


def test_output_size_changes_between_epochs(fixtures_dir: Path) -> None:
    with BetonReader(fixtures_dir / "images_raw.beton") as r:
        op = RandomResizedCropRGBImageDecoder((16, 16))
        a = run_all(op, r, "image", 16, seed_key=derive_seed_key(0, 0, 0))
        op.output_size = (24, 12)
        b = run_all(op, r, "image", 16, seed_key=derive_seed_key(0, 1, 0))
    assert a.shape[1:] == (16, 16, 3) and b.shape[1:] == (24, 12, 3)


def test_corrupt_jpeg_raises_with_sample_id() -> None:
    import simplejpeg

    good = simplejpeg.encode_jpeg(np.full((16, 16, 3), 100, np.uint8), quality=90)
    bad = good[: len(good) // 2]
    blobs = [good, bad]
    data = np.frombuffer(b"".join(blobs), np.uint8)
    ptrs = np.array([0, len(good)], np.uint64)
    sizes = np.array([len(good), len(bad)], np.uint64)
    md = np.zeros(
        2,
        dtype=np.dtype([("mode", "u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")]),
    )
    md["width"] = 16
    md["height"] = 16
    md["data_ptr"] = ptrs
    state = (data, ptrs, sizes)
    for op in (CenterCropRGBImageDecoder((8, 8), 1.0), SimpleRGBImageDecoder()):
        op.accept_globals(md, memory_read)
        st, _ = op.declare_state_and_memory(INITIAL)
        fn = op.generate_code()
        assert fn.python
        dst = np.empty((2, *st.shape), np.uint8)
        fn(np.array([0], np.uint64), dst[:1], md, state)
        with pytest.raises(CorruptJPEGError) as info:
            fn(np.array([0, 1], np.uint64), dst, md, state)
        assert info.value.sample_index == 1
        assert info.value.op == type(op).__name__


def test_decoder_reused_on_another_file_uses_new_metadata(fixtures_dir: Path) -> None:
    op = CenterCropRGBImageDecoder((16, 16), 1.0)
    with BetonReader(fixtures_dir / "images_raw.beton") as r:
        a = run_all(op, r, "image", 16)
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        b = run_all(op, r, "image", 16)
        fresh = run_all(CenterCropRGBImageDecoder((16, 16), 1.0), r, "image", 16)
    np.testing.assert_array_equal(b, fresh)
    assert (a != b).any()


@pytest.mark.parametrize(
    ("name", "field", "make"),
    [
        ("image_pairs", "input", SimpleRGBImageDecoder),
        ("images_jpg", "image", lambda: RandomResizedCropRGBImageDecoder((16, 16))),
    ],
)
def test_image_columns_are_built_once_per_file_not_per_epoch(
    fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, name: str, field: str, make: Any
) -> None:
    """The plan hands a decoder its metadata again before every epoch; the columns (and
    SimpleRGBImageDecoder's common size) are derived from it once, and epochs stay the same."""
    import beton_serve.fields.decoders as dec
    from beton_serve.loader import Loader, OrderOption

    built: list[int] = []
    real = dec._ImageColumns

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, md: np.ndarray) -> None:
            built.append(len(md))
            super().__init__(md)

    monkeypatch.setattr(dec, "_ImageColumns", Counting)
    pipes = {field: [make()]}
    with Loader(
        str(fixtures_dir / f"{name}.beton"),
        batch_size=4,
        order=OrderOption.SEQUENTIAL,
        pipelines=pipes,
        num_workers=1,
    ) as ld:
        first = [x[0].copy() for x in ld]
        after_one = len(built)
        for _ in range(3):
            again = [x[0].copy() for x in ld]
    assert after_one >= 1 and len(built) == after_one, built
    if name == "image_pairs":  # no random draws: every epoch equal
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)
