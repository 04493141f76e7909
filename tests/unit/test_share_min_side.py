"""Issue 16: ``share_min_side``, decode groups that share a DCT-scaled decode.

A crop decoder with ``share_decode=True, share_min_side=S`` shares each image decoded at the
smallest of 1/8, 1/4, 1/2 whose shorter side is still >= S (full size when none is), a choice
made from the image's size alone. The pixels are checked against an independent reference:
TurboJPEG 3's own scaled decode (another libjpeg-turbo build than simplejpeg's) of each FFCV
fixture, the crop mapped onto it, and OpenCV's ``INTER_AREA`` resize.
"""

from __future__ import annotations

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.fields._shared_decode import scaled_box, scaled_plan, shared_scale
from beton_serve.fields.decode_cache import (
    DecodeBinding,
    DecodeCache,
    GroupKey,
    decode_key,
    decode_scope,
)
from beton_serve.fields.decoders import (
    CenterCropRGBImageDecoder,
    RandomResizedCropRGBImageDecoder,
)
from beton_serve.format import BetonReader
from beton_serve.pipeline.registry import op_from_spec

MIN_SIDE = 16  # on the FFCV fixture images (1..500 px a side): scales 1/8, 1/4, 1/2 and 8/8


@pytest.mark.parametrize(
    ("h", "w", "s", "m"),
    [
        (375, 500, 0, 8),  # 0: full size
        (375, 500, 16, 1),  # 1/8 already covers 16 (47 x 63)
        (375, 500, 47, 1),
        (375, 500, 48, 2),  # 1/8 gives 47: 1/4
        (375, 500, 94, 2),
        (375, 500, 95, 4),
        (375, 500, 188, 4),
        (375, 500, 189, 8),  # 1/2 gives 188 < 189: full size
        (500, 375, 189, 8),  # the shorter side decides, whichever it is
        (32, 32, 16, 4),
        (17, 33, 16, 8),
        (1, 100, 16, 8),
        (1, 1, 1, 1),  # ceil(1/8) = 1
    ],
)
def test_the_scale_is_the_cheapest_one_whose_shorter_side_covers(h, w, s, m) -> None:
    assert shared_scale(h, w, s) == m


def test_the_decode_key_names_the_mode() -> None:
    assert decode_key(0) == "full" and decode_key(160) == "min_side=160"
    assert GroupKey(dataset="d", field="f", order="o") != GroupKey(
        dataset="d", field="f", order="o", decode=decode_key(160)
    )


def test_a_crop_maps_onto_the_scaled_image_inside_it_and_close_to_its_place() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        h, w = (int(v) for v in rng.integers(1, 600, 2))
        m = int(rng.choice([1, 2, 4, 8]))
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        sh, sw = -((-h * m) // 8), -((-w * m) // 8)
        t, lf, c2h, c2w = scaled_box(top, left, ch, cw, m, sh, sw)
        assert 0 <= t and t + c2h <= sh and c2h >= 1
        assert 0 <= lf and lf + c2w <= sw and c2w >= 1
        if m == 8:
            assert (t, lf, c2h, c2w) == (top, left, ch, cw)
        else:  # each edge within half a scaled pixel, unless clamped into the image
            assert abs(t - top * m / 8) <= 0.5 or t == sh - 1
            bottom = t + c2h
            assert abs(bottom - (top + ch) * m / 8) <= 0.5 or bottom in (sh, t + 1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"share_min_side": 160}, "only with share_decode=True"),
        ({"share_decode": True, "share_min_side": -1}, "share_min_side must be an int"),
        ({"share_decode": True, "share_min_side": 70000}, "share_min_side must be an int"),
        ({"share_decode": True, "share_min_side": True}, "share_min_side must be an int"),
        ({"share_decode": True, "share_min_side": 1.5}, "share_min_side must be an int"),
        ({"share_decode": "yes"}, "share_decode must be True or False"),
    ],
)
def test_bad_share_arguments_are_spec_errors_in_process_and_from_the_wire(kw, match) -> None:
    for cls, args in (
        (RandomResizedCropRGBImageDecoder, ((32, 32),)),
        (CenterCropRGBImageDecoder, ((32, 32), 0.875)),
    ):
        with pytest.raises(SpecError, match=match):
            cls(*args, **kw)
    params = {"output_size": [32, 32], **kw}
    with pytest.raises(SpecError, match=match):
        op_from_spec("RandomResizedCropRGBImageDecoder", params)


def test_share_min_side_travels_in_the_spec_only_when_set() -> None:
    op = RandomResizedCropRGBImageDecoder((32, 32), share_decode=True, share_min_side=160)
    params = op.spec_params()
    assert params["share_decode"] is True and params["share_min_side"] == 160
    back = op_from_spec("RandomResizedCropRGBImageDecoder", params)
    assert (back.share_decode, back.share_min_side) == (True, 160)
    plain = RandomResizedCropRGBImageDecoder((32, 32), share_decode=True).spec_params()
    assert "share_min_side" not in plain
    cc = CenterCropRGBImageDecoder((32, 32), 0.875, share_decode=True, share_min_side=24)
    assert op_from_spec("CenterCropRGBImageDecoder", cc.spec_params()).share_min_side == 24


def _run(op, md, state, ids) -> np.ndarray:
    from beton_serve.format import memory_read
    from beton_serve.pipeline import State

    op.accept_globals(md, memory_read)
    st, _ = op.declare_state_and_memory(
        State(jit_mode=True, device="cpu", shape=None, dtype=np.uint8)
    )
    dst = np.empty((len(ids), *st.shape), np.uint8)
    return np.array(op.generate_code()(np.asarray(ids, np.uint64), dst, md, state))


def _reference(reader: BetonReader, size: int, ratio: float) -> tuple[np.ndarray, list[int]]:
    """Independent of the shared loop: TurboJPEG 3's scaled decode, FFCV's centre crop of the
    full-size image mapped with round-half-up edges, OpenCV ``INTER_AREA``."""
    import cv2
    from beton_serve import _tj3

    try:
        dec = _tj3.Decompressor(_tj3.load())
    except _tj3.TJ3Unavailable as exc:
        pytest.skip(f"no TurboJPEG 3 library for the reference decode: {exc}")
    md = reader.field_metadata("image")
    out, scales = [], []
    for i in range(reader.num_samples):
        h, w = int(md["height"][i]), int(md["width"][i])
        data = np.ascontiguousarray(reader.sample_bytes(i, "image"))
        c = max(1, int(ratio * min(h, w)))  # FFCV's centre crop (ffcv-format.md §3.6)
        top, left = (h - c) // 2, (w - c) // 2
        if int(md["mode"][i]) != 0:
            img, m = data[: h * w * 3].reshape(h, w, 3), 8
        else:
            m = next((k for k in (1, 2, 4) if -((-min(h, w) * k) // 8) >= MIN_SIDE), 8)
            dec.header(data)
            img = np.empty((_tj3.scaled(h, m), _tj3.scaled(w, m), 3), np.uint8)
            dec.decode(data, img, m)
        scales.append(m)
        y0 = min(int(np.floor(top * m / 8 + 0.5)), img.shape[0] - 1)
        x0 = min(int(np.floor(left * m / 8 + 0.5)), img.shape[1] - 1)
        y1 = max(min(int(np.floor((top + c) * m / 8 + 0.5)), img.shape[0]), y0 + 1)
        x1 = max(min(int(np.floor((left + c) * m / 8 + 0.5)), img.shape[1]), x0 + 1)
        crop = np.ascontiguousarray(img[y0:y1, x0:x1])
        out.append(cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA))
    return np.stack(out), scales


@pytest.mark.parametrize("method", ["cv2", "area"])
@pytest.mark.parametrize("name", ["images_jpg", "images_smart"])
def test_pixels_are_the_scaled_decode_cropped_and_resized_alone_and_in_a_group(
    fixtures_dir, name: str, method: str
) -> None:
    """``resize="cv2"``: OpenCV's pixels exactly. ``"area"`` (the default): the compiled area
    and upscale kernels in one call per batch, within 1 grey level of OpenCV's ``INTER_AREA``;
    and either way the same alone as in a group."""
    size, ratio = 24, 0.875

    def op() -> CenterCropRGBImageDecoder:
        return CenterCropRGBImageDecoder(
            (size, size), ratio, resize=method, share_decode=True, share_min_side=MIN_SIDE
        )

    with BetonReader(fixtures_dir / f"{name}.beton") as r:
        md, n = r.field_metadata("image"), r.num_samples
        expected, scales = _reference(r, size, ratio)
        jpeg = np.asarray(md["mode"]) == 0
        assert {1, 2, 4} & set(scales) and 8 in scales  # the fixture exercises several scales
        alone = _run(op(), md, r.storage_state, range(n))
        if method == "cv2":
            np.testing.assert_array_equal(alone, expected)
        else:
            assert np.abs(alone.astype(np.int16) - expected).max() <= 1
            expected = alone
        # In a group of two: the second member reads the first one's decodes.
        cache = DecodeCache()
        key = GroupKey(dataset="d", field="image", order="o", decode=decode_key(MIN_SIDE))
        members = [cache.join(key, n) for _ in range(2)]
        for mb in members:
            mb.active = True  # both streams are running (what decode_scope marks)
        addr = int(md.__array_interface__["data"][0])
        peak = 0
        for m in members:
            with decode_scope(DecodeBinding({(addr, decode_key(MIN_SIDE)): m}), 0):
                got = _run(op(), md, r.storage_state, range(n))
            peak = max(peak, cache.peak_bytes)
            np.testing.assert_array_equal(got, expected)
        (st,) = cache.stats()
        assert st.decode == "min_side=16"
        assert st.decoded == int(jpeg.sum()) and st.hits == int(jpeg.sum())
        assert cache.nbytes == 0  # every entry freed once both members took it
        # entries are the scaled images, not the full ones
        h = np.asarray(md["height"], np.int64)[jpeg]
        w = np.asarray(md["width"], np.int64)[jpeg]
        sc = np.asarray(scales)[jpeg]
        scaled_bytes = int((-((-h * sc) // 8) * -((-w * sc) // 8) * 3).max())
        assert peak <= max(scaled_bytes, 1) * n
        for mb in members:
            mb.close()


def test_a_member_that_decodes_otherwise_is_not_used(fixtures_dir) -> None:
    """A binding of the full-decode group is no member for a ``share_min_side`` decoder."""
    with BetonReader(fixtures_dir / "images_jpg.beton") as r:
        md, n = r.field_metadata("image"), r.num_samples
        cache = DecodeCache()
        full = cache.join(GroupKey(dataset="d", field="image", order="o"), n)
        addr = int(md.__array_interface__["data"][0])
        with decode_scope(DecodeBinding({addr: full}), 0):
            _run(
                CenterCropRGBImageDecoder((8, 8), 1.0, share_decode=True, share_min_side=8),
                md,
                r.storage_state,
                range(n),
            )
        assert cache.stats()[0].delivered == 0
        full.close()


@pytest.mark.parametrize("min_side", [0, 1, 64, 160, 224, 5000])
def test_the_batch_plan_is_the_per_sample_arithmetic(min_side: int) -> None:
    """``scaled_plan`` (numpy, per batch) gives exactly what ``shared_scale`` and
    ``scaled_box`` give per sample: the member loop relies on it for bit-identical crops."""
    rng = np.random.default_rng(min_side)
    n = 3000
    hs = rng.integers(1, 2000, n)
    ws = rng.integers(1, 2000, n)
    boxes = []
    for h, w in zip(hs.tolist(), ws.tolist(), strict=True):
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append((int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw))
    ms, nbytes, sboxes = scaled_plan(hs, ws, np.array(boxes, np.int64), min_side)
    for i, (h, w) in enumerate(zip(hs.tolist(), ws.tolist(), strict=True)):
        m = shared_scale(h, w, min_side) if min_side else 8
        sh, sw = -((-h * m) // 8), -((-w * m) // 8)
        assert ms[i] == m
        assert nbytes[i] == sh * sw * 3
        assert sboxes[i] == scaled_box(*boxes[i], m, sh, sw)
        assert all(type(v) is int for v in (ms[i], nbytes[i], *sboxes[i]))
