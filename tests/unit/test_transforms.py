"""Transforms vs plain-NumPy references on seeded random inputs.

Tolerances: every compiled op here is compared for exact equality (same float64/float32
operations in the same order), except ``RandomResizedCrop`` (area resize: max |diff| <= 1 vs
OpenCV, see test_resize.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from beton_serve.errors import SpecError
from beton_serve.pipeline import Compiler, State
from beton_serve.pipeline import rng as R
from beton_serve.transforms import (
    Cutout,
    ImageMixup,
    LabelMixup,
    NormalizeImage,
    Poison,
    RandomBrightness,
    RandomContrast,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomSaturation,
    RandomTranslate,
    ReplaceLabel,
)

KEY = R.derive_seed_key(1234, 2, 5)


def img_state(shape: tuple[int, ...], dtype: Any = np.uint8) -> State:
    return State(jit_mode=True, device="cpu", shape=shape, dtype=np.dtype(dtype))


def run(op: Any, batch: np.ndarray, ids: np.ndarray, key: Any = KEY) -> tuple[np.ndarray, State]:
    """Plan one op on a batch as the planner does and run it once."""
    state, query = op.declare_state_and_memory(img_state(batch.shape[1:], batch.dtype))
    fn = op.generate_code()
    if state.jit_mode and not getattr(fn, "python", False):
        fn = Compiler.compile(fn)
    dst = None
    if query is not None:
        dst = np.zeros((len(batch), *query.shape), np.dtype(query.dtype))
    args: list[Any] = [batch, dst]
    if getattr(fn, "with_indices", False):
        args.append(ids)
    if getattr(fn, "with_seed", False):
        args.append(key)
    return np.array(fn(*args)), state


def images(n: int = 12, h: int = 20, w: int = 17, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


IDS = np.array([5, 900, 3, 77, 12, 13, 14, 2**40, 8, 9, 10, 11], np.uint64)


def ru(sid: int, c: int) -> float:
    return R.py_uniform(int(KEY), int(sid), c)


def rint_(sid: int, c: int, lo: int, hi: int) -> int:
    return lo + int(np.floor(ru(sid, c) * (hi - lo)))


@pytest.mark.parametrize(
    ("h", "w", "c"),
    [(20, 17, 3), (96, 80, 3), (96, 80, 1), (96, 80, 4), (20, 17, 6)],
)  # the compiled row loop (small or RGB or grey), cv2.flip (large RGBA), the loop's any-c branch
def test_flip_matches_reference_and_is_slice_independent(h: int, w: int, c: int) -> None:
    x = np.random.default_rng(c).integers(0, 256, (len(IDS), h, w, c), dtype=np.uint8)
    got, state = run(RandomHorizontalFlip(0.5), x.copy(), IDS)
    ref = np.stack([x[i][:, ::-1] if ru(s, 0) < 0.5 else x[i] for i, s in enumerate(IDS)])
    np.testing.assert_array_equal(got, ref)
    assert 0 < sum(ru(s, 0) < 0.5 for s in IDS) < len(IDS)
    # a non-contiguous input takes the generic compiled path: same result
    wide = np.zeros((len(IDS), h, w + 3, c), np.uint8)
    wide[:, :, :w] = x
    strided, _ = run(RandomHorizontalFlip(0.5), wide[:, :, :w], IDS)
    np.testing.assert_array_equal(strided, ref)
    halves = np.concatenate(
        [run(RandomHorizontalFlip(0.5), x[a:b].copy(), IDS[a:b])[0] for a, b in [(0, 5), (5, 12)]]
    )
    np.testing.assert_array_equal(got, halves)
    assert state.shape == x.shape[1:]


@pytest.mark.parametrize("c", [1, 2, 3, 4])  # grey and RGB have their own branch of the loop
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_flip_of_small_images_matches_reference_for_each_channel_count(c: int, dtype) -> None:
    x = np.random.default_rng(c).integers(0, 256, (len(IDS), 6, 7, c)).astype(dtype)
    got, _ = run(RandomHorizontalFlip(0.5), x.copy(), IDS)
    ref = np.stack([x[i][:, ::-1] if ru(s, 0) < 0.5 else x[i] for i, s in enumerate(IDS)])
    np.testing.assert_array_equal(got, ref)


def test_translate_matches_reference() -> None:
    x = images()
    pad, fill = 3, (10, 20, 30)
    got, _ = run(RandomTranslate(pad, fill), x.copy(), IDS)
    h, w = x.shape[1:3]
    for i, s in enumerate(IDS):
        canvas = np.empty((h + 2 * pad, w + 2 * pad, 3), np.uint8)
        canvas[:] = fill
        canvas[pad : pad + h, pad : pad + w] = x[i]
        y, xx = rint_(s, 0, 0, 2 * pad + 1), rint_(s, 1, 0, 2 * pad + 1)
        np.testing.assert_array_equal(got[i], canvas[y : y + h, xx : xx + w])


def test_cutout_matches_reference() -> None:
    x = images()
    got, _ = run(Cutout(5, (1, 2, 3)), x.copy(), IDS)
    h, w = x.shape[1:3]
    for i, s in enumerate(IDS):
        ref = x[i].copy()
        y, xx = rint_(s, 0, 0, h - 5 + 1), rint_(s, 1, 0, w - 5 + 1)
        ref[y : y + 5, xx : xx + 5] = (1, 2, 3)
        np.testing.assert_array_equal(got[i], ref)


def _gray(img: np.ndarray) -> np.ndarray:
    f = img.astype(np.float64)
    return (0.2989 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]).astype(np.uint8)


@pytest.mark.parametrize("cls", [RandomBrightness, RandomContrast, RandomSaturation])
def test_color_jitter_matches_reference(cls: Any) -> None:
    x = images(seed=3)
    mag, p = 0.4, 0.6
    got, _ = run(cls(mag, p), x.copy(), IDS)
    for i, s in enumerate(IDS):
        ref = x[i]
        if ru(s, 0) < p:
            f = max(0.0, 1 - mag) + (1 + mag - max(0.0, 1 - mag)) * ru(s, 1)
            if cls is RandomBrightness:
                other: Any = 0.0
            elif cls is RandomContrast:
                g = _gray(x[i])
                other = int(g.astype(np.int64).sum()) / g.size
            else:
                other = _gray(x[i]).astype(np.float64)[..., None]
            ref = np.clip(f * x[i] + (1.0 - f) * other, 0, 255).astype(np.uint8)
        np.testing.assert_array_equal(got[i], ref)


def test_random_resized_crop_transform() -> None:
    import cv2
    from beton_serve._kernels.crop import rrc_batch_fixed

    x = images(h=40, w=50)
    op = RandomResizedCrop((0.3, 1.0), (0.75, 4 / 3), 16)
    got, state = run(op, x, IDS)
    assert state.shape == (16, 16, 3)
    boxes = rrc_batch_fixed(KEY, IDS, 40, 50, np.array([0.3, 1.0]), np.array([0.75, 4 / 3]))
    for i in range(len(IDS)):
        t, l_, h, w = boxes[i]
        ref = cv2.resize(x[i, t : t + h, l_ : l_ + w], (16, 16), interpolation=cv2.INTER_AREA)
        assert np.abs(got[i].astype(int) - ref).max() <= 1


@pytest.mark.parametrize("same", [True, False])
def test_mixup_image_and_label_share_lambdas(same: bool) -> None:
    from beton_serve.transforms.mixup import mixup_key

    key = mixup_key()
    x = images(n=6)
    labels = np.arange(6, dtype=np.int64)[:, None] * 10
    ids = IDS[:6]
    got, _ = run(ImageMixup(0.5, same), x, ids, key)
    lab, lstate = run(LabelMixup(0.5, same), labels, ids, key)
    assert lstate.shape == (3,) and lab.dtype == np.float32
    lam = np.array([R.beta(key, np.uint64(ids[-1]), 0 if same else i, 0.5, 0.5) for i in range(6)])
    if same:
        assert np.all(lam == lam[0])
    for i in range(6):
        j = i - 1 if i else 5
        ref = (x[i] * lam[i] + x[j] * (1.0 - lam[i])).astype(np.uint8)
        np.testing.assert_array_equal(got[i], ref)
        np.testing.assert_array_equal(
            lab[i], np.array([labels[i, 0], labels[j, 0], lam[i]], np.float32)
        )


def test_mixup_to_one_hot() -> None:
    torch = pytest.importorskip("torch")
    from beton_serve.transforms import MixupToOneHot

    op = MixupToOneHot(5)
    st, _ = op.declare_state_and_memory(
        State(jit_mode=False, device="cpu", shape=(3,), dtype=torch.float32)
    )
    assert st.shape == (5,)
    mixed = torch.tensor([[1, 3, 0.25], [2, 2, 0.6]], dtype=torch.float32)
    before = mixed.clone()
    out = op.generate_code()(mixed, torch.empty(4, 5))
    expected = torch.tensor([[0, 0.25, 0, 0.75, 0], [0, 0, 1.0, 0, 0]])
    assert torch.allclose(out, expected)
    assert torch.equal(mixed, before)


def test_poison_matches_reference() -> None:
    x = images(h=8, w=9, seed=5)
    gen = np.random.default_rng(1)
    mask = gen.integers(0, 256, (8, 9, 3)).astype(np.float32)
    alpha = gen.uniform(0, 1, (8, 9)).astype(np.float32)
    chosen = [900, 13, 10]
    got, _ = run(Poison(mask, alpha, chosen, (5, 250)), x.copy(), IDS)
    for i, s in enumerate(IDS):
        ref = x[i]
        if int(s) in chosen:
            a = alpha[..., None]
            v = x[i].astype(np.float32) * (np.float32(1) - a) + mask * a
            ref = np.clip(v, np.float32(5), np.float32(250)).astype(np.uint8)
        np.testing.assert_array_equal(got[i], ref)


def test_replace_label() -> None:
    labels = np.arange(12, dtype=np.int64)[:, None]
    got, _ = run(ReplaceLabel([3, 77, 2**40], 99), labels.copy(), IDS)
    ref = labels.copy()
    for i, s in enumerate(IDS):
        if int(s) in (3, 77, 2**40):
            ref[i] = 99
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_normalize_cpu_lut(dtype: Any) -> None:
    x = images()
    mean, std = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255
    got, state = run(NormalizeImage(mean, std, dtype), x, IDS)
    ref = ((x.astype(np.float64) - mean) / std).astype(dtype)
    if dtype == np.float16:
        assert state.dtype == np.int16 and got.dtype == np.int16
        got = got.view(np.float16)
    np.testing.assert_array_equal(got, ref)


def test_normalize_torch_path() -> None:
    torch = pytest.importorskip("torch")
    x = images(n=3)
    mean, std = np.array([120.0, 110, 100]), np.array([60.0, 50, 40])
    op = NormalizeImage(mean, std, np.float16)
    st, q = op.declare_state_and_memory(
        State(jit_mode=False, device="cpu", shape=(3, 20, 17), dtype=torch.uint8)
    )
    assert st.dtype == torch.float16
    inp = torch.from_numpy(x).permute(0, 3, 1, 2)
    out = op.generate_code()(inp, torch.empty(3, *q.shape, dtype=q.dtype))
    ref = ((x.astype(np.float64) - mean) / std).astype(np.float16).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_jit_ops_refuse_torch_state_and_vice_versa() -> None:
    torch = pytest.importorskip("torch")
    from beton_serve.transforms import Convert, Squeeze, ToTorchImage

    tstate = State(jit_mode=False, device="cpu", shape=(4, 4, 3), dtype=torch.uint8)
    for op in (RandomHorizontalFlip(), Cutout(2), RandomBrightness(0.1)):
        with pytest.raises(SpecError, match="before ToTensor"):
            op.declare_state_and_memory(tstate)
    for op in (Convert(torch.float16), Squeeze(), ToTorchImage()):
        with pytest.raises(SpecError, match="after ToTensor"):
            op.declare_state_and_memory(img_state((4, 4, 3)))
    with pytest.raises(SpecError):
        Cutout(10).declare_state_and_memory(img_state((4, 4, 3)))
