"""The Loader on FFCV-written fixtures, with FFCV's own Loader calls (manifest.json), against FFCV's outputs."""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.loader import Loader, OrderOption

dec = pytest.importorskip("beton_serve.fields.decoders")


def _collect(loader: Loader) -> list[np.ndarray]:
    batches = [[np.array(x, copy=True) for x in b] for b in loader]
    return [np.concatenate(col) for col in zip(*batches, strict=True)]


def test_mixed_fields_match_ffcv(fixtures_dir):
    exp = np.load(fixtures_dir / "mixed_fields.expected.npz")
    pipes = {
        "int": [dec.IntDecoder()],
        "float": [dec.FloatDecoder()],
        "array": [dec.NDArrayDecoder()],
        "blob": [dec.BytesDecoder()],
        "meta": [dec.BytesDecoder()],
    }
    path = fixtures_dir / "mixed_fields.beton"
    with Loader(path, batch_size=10, num_workers=2, drop_last=False, pipelines=pipes, seed=0) as ld:
        assert len(ld) == 5
        got = dict(zip(["int", "float", "array", "blob", "meta"], _collect(ld), strict=True))
    np.testing.assert_array_equal(got["int"], exp["int"])
    np.testing.assert_array_equal(got["float"], exp["float"])  # nan == nan in assert_array_equal
    np.testing.assert_array_equal(got["array"], exp["array"])
    for name in ("blob", "meta"):
        sizes = exp[f"{name}__size"].astype(int)
        for i, n in enumerate(sizes):
            np.testing.assert_array_equal(got[name][i, :n], exp[name][i, :n])


def test_image_pairs_and_output_order(fixtures_dir):
    exp = np.load(fixtures_dir / "image_pairs.expected.npz")
    pipes = {"target": [dec.SimpleRGBImageDecoder()], "input": [dec.SimpleRGBImageDecoder()]}
    with Loader(
        fixtures_dir / "image_pairs.beton",
        batch_size=4,
        num_workers=2,
        drop_last=False,
        pipelines=pipes,
        seed=0,
    ) as ld:
        inp, tgt = _collect(ld)  # file order: input, then target
    np.testing.assert_array_equal(inp, exp["input"])
    np.testing.assert_array_equal(tgt, exp["target"])


@pytest.mark.parametrize("name", ["images_raw", "images_jpg"])
def test_center_crop_and_random_order(fixtures_dir, name):
    exp = np.load(fixtures_dir / f"{name}.expected.npz")
    extra = {"weight": None} if name == "images_jpg" else {}
    pipes = {
        "image": [dec.CenterCropRGBImageDecoder((64, 64), ratio=1.0)],
        "label": [dec.IntDecoder()],
        **extra,
    }
    path = fixtures_dir / f"{name}.beton"
    with Loader(path, batch_size=16, num_workers=2, drop_last=False, pipelines=pipes, seed=0) as ld:
        img, lab = _collect(ld)
    np.testing.assert_array_equal(lab, exp["label"])
    assert img.shape == exp["image"].shape and img.dtype == np.uint8
    if name == "images_raw":  # JPEG parity is the decoders' tests' business (test_decoders*)
        diff = np.abs(img.astype(int) - exp["image"])
        assert diff.max() <= 2 and diff.mean() < 0.1
    with Loader(
        path,
        batch_size=16,
        num_workers=2,
        order=OrderOption.RANDOM,
        seed=0,
        pipelines={"image": None, "label": [dec.IntDecoder()], **extra},
    ) as ld:
        for epoch in range(2):
            (lab,) = _collect(ld)
            np.testing.assert_array_equal(
                lab[:, 0], exp["label"][exp[f"random_order_seed0_epoch{epoch}"], 0]
            )
