"""JPEG decode: FFCV pixel parity, DCT-scaled sizes, typed errors for corrupt data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from beton_serve import jpeg
from beton_serve.errors import PipelineError
from beton_serve.format import BetonReader, memory_read


@pytest.mark.parametrize("name", ["images_jpg", "images_smart"])
def test_full_decode_is_bit_exact_with_ffcv(fixtures_dir: Path, name: str) -> None:
    reader = BetonReader(fixtures_dir / f"{name}.beton")
    col = reader.field_metadata("image")
    full = np.load(fixtures_dir / f"{name}.decoded_full.npz")
    scratch = np.empty(int(col["height"].max()) * int(col["width"].max()) * 3, np.uint8)
    checked = 0
    for i in range(reader.num_samples):
        if col["mode"][i] != 0:
            continue
        data = memory_read(col["data_ptr"][i], reader.storage_state)
        assert jpeg.read_header(data) == (int(col["height"][i]), int(col["width"][i]))
        img = jpeg.decode_into(data, scratch)
        assert np.shares_memory(img, scratch)
        np.testing.assert_array_equal(img, full[f"image_{i:04d}"])
        checked += 1
    reader.close()
    assert checked > 50


def _smooth_jpeg(h: int, w: int, seed: int = 0) -> bytes:
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    img = np.stack(
        [(127 + 100 * np.sin(xx / (7 + c) + yy / 11 + rng.uniform())) for c in range(3)], -1
    ).astype(np.uint8)
    return simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=90, colorsubsampling="420")


@pytest.mark.parametrize(("h", "w"), [(375, 500), (301, 299), (64, 33)])
def test_scaled_size_matches_libjpeg_turbo(h: int, w: int) -> None:
    data = _smooth_jpeg(h, w)
    scratch = np.empty(h * w * 3, np.uint8)
    full = jpeg.decode_into(data, scratch).copy()
    for mh, mw in [(0, 0), (h // 2, w // 2), (h // 3, w // 5), (h // 8, 1), (h, w), (h - 1, 1)]:
        sh, sw = jpeg.scaled_size(h, w, mh, mw)
        assert sh >= mh and sw >= mw
        img = jpeg.decode_into(data, scratch, mh, mw)
        assert img.shape == (sh, sw, 3)
        if (sh, sw) == (h, w):
            np.testing.assert_array_equal(img, full)
        else:
            # a DCT-scaled decode is close to an area downscale of the full decode
            assert sh <= (h + 1) // 2
    # too-small minimum sizes never scale below 1/8
    assert jpeg.scaled_size(h, w, 1, 1) == (-(-h // 8), -(-w // 8))


def test_corrupt_data_raises_typed_error() -> None:
    data = _smooth_jpeg(64, 64)
    scratch = np.empty(64 * 64 * 3, np.uint8)
    with pytest.raises(jpeg.CorruptJPEGError):
        jpeg.decode_into(data[: len(data) // 2], scratch)
    with pytest.raises(jpeg.CorruptJPEGError):
        jpeg.decode_into(b"not a jpeg at all", scratch)
    with pytest.raises(jpeg.CorruptJPEGError):
        jpeg.read_header(np.zeros(100, np.uint8))
    assert issubclass(jpeg.CorruptJPEGError, PipelineError)


def test_scratch_too_small_raises() -> None:
    data = _smooth_jpeg(64, 64)
    with pytest.raises(jpeg.CorruptJPEGError):
        jpeg.decode_into(data, np.empty(10, np.uint8))


def test_fast_upsample_is_close_to_fancy() -> None:
    data = _smooth_jpeg(120, 90, seed=4)
    scratch = np.empty(120 * 90 * 3, np.uint8)
    fancy = jpeg.decode_into(data, scratch).astype(np.int16)
    fast = jpeg.decode_into(data, scratch, fast_upsample=True).astype(np.int16)
    assert fast.shape == fancy.shape
    diff = np.abs(fast - fancy)
    # strongly coloured test pattern: chroma edges move by a few levels on average
    assert diff.mean() < 4.0 and diff.any()
