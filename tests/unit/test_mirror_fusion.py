"""A raw ``SimpleRGBImageDecoder`` followed by an in-place ``RandomHorizontalFlip`` runs as one
pass (``Plan._mirror_fusions``): the decoder writes the images drawn for a flip mirrored. The
pixels must be those of the two ops run one after the other, bit for bit, in every shape the
planner fuses and in the cases it must not fuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from beton_serve.fields import IntField, RGBImageField
from beton_serve.fields.decoders import IntDecoder, SimpleRGBImageDecoder
from beton_serve.format import BetonReader
from beton_serve.pipeline import PipelineSpec, compile_pipelines
from beton_serve.pipeline import _plan as plan_module
from beton_serve.pipeline.rng import uniform
from beton_serve.transforms import RandomHorizontalFlip
from beton_serve.writer import DatasetWriter

pytestmark = pytest.mark.timeout(180)

H, W, N = 6, 5, 37  # an odd width: the middle column stays in place


class _Images:
    def __init__(self, n: int, h: int = H, w: int = W) -> None:
        rng = np.random.default_rng(7)
        self.images = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], i


@pytest.fixture(scope="module")
def raw_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, np.ndarray]]:
    path = tmp_path_factory.mktemp("fusion") / "raw.beton"
    data = _Images(N)
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()}
    ).from_indexed_dataset(data)
    yield path, data.images


def _plan(reader: BetonReader, pipes: dict, batch: int, *, fuse: bool, monkeypatch) -> object:
    monkeypatch.setenv(plan_module.FUSE_MIRROR_ENV, "1" if fuse else "0")
    return compile_pipelines(reader, pipes, batch_size=batch)


def _run(plan, ids, outs=None, epoch: int = 2) -> list[np.ndarray]:
    ws = plan.acquire_workspace()
    try:
        res = plan.run(ws, np.asarray(ids, np.uint64), plan.seed_keys(11, epoch), outs)
        return [np.array(r, copy=True) for r in res]
    finally:
        plan.release_workspace(ws)


def _expected(images: np.ndarray, ids, key: np.uint64, p: float) -> np.ndarray:
    out = images[np.asarray(ids)].copy()
    for k, sid in enumerate(ids):
        if uniform(key, np.uint64(sid), 0) < p:
            out[k] = out[k][:, ::-1]
    return out


def _flip_position(plan, flip) -> int:
    return next(nd.position for nd in plan.nodes if nd.op is flip)


@pytest.mark.parametrize("p", [0.5, 1.0, 0.0])
@pytest.mark.parametrize("direct", [True, False])
def test_the_fused_pass_writes_the_pixels_of_the_two_ops(
    raw_file, monkeypatch, p: float, direct: bool
) -> None:
    path, images = raw_file
    ids = [5, 0, 17, 3, 9, 30, 2, 36, 11, 12]
    with BetonReader(path) as reader:
        got = {}
        for fuse in (True, False):
            flip = RandomHorizontalFlip(p)
            pipes = {"image": [SimpleRGBImageDecoder(), flip], "label": [IntDecoder()]}
            plan = _plan(reader, pipes, 16, fuse=fuse, monkeypatch=monkeypatch)
            assert bool(plan._mirror_fusions()) is fuse
            outs = [np.full((16, *o.shape), 77, o.dtype) for o in plan.outputs] if direct else None
            img, label = _run(plan, ids, outs)
            key = plan.seed_keys(11, 2)[_flip_position(plan, flip)]
            np.testing.assert_array_equal(img, _expected(images, ids, key, p))
            np.testing.assert_array_equal(label.reshape(-1), ids)
            if outs is not None:
                np.testing.assert_array_equal(outs[0][: len(ids)], img)
                assert (outs[0][len(ids) :] == 77).all()  # nothing written past the batch
            got[fuse] = img
        np.testing.assert_array_equal(got[True], got[False])


def test_a_batch_run_in_slices_is_the_batch_run_whole(raw_file, monkeypatch) -> None:
    path, images = raw_file
    ids = list(range(N))[::-1]
    with BetonReader(path) as reader:
        flip = RandomHorizontalFlip()
        plan = _plan(
            reader,
            {"image": [SimpleRGBImageDecoder(), flip], "label": None},
            N,
            fuse=True,
            monkeypatch=monkeypatch,
        )
        whole = [np.zeros((N, H, W, 3), np.uint8)]
        _run(plan, ids, whole)
        parts = [np.zeros((N, H, W, 3), np.uint8)]
        for lo, hi in ((0, 10), (10, 11), (11, N)):
            _run(plan, ids[lo:hi], [parts[0][lo:hi]])
        np.testing.assert_array_equal(parts[0], whole[0])
        key = plan.seed_keys(11, 2)[_flip_position(plan, flip)]
        np.testing.assert_array_equal(whole[0], _expected(images, ids, key, 0.5))


def test_a_branch_reading_the_decoded_images_keeps_them_unflipped(raw_file, monkeypatch) -> None:
    path, images = raw_file
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    with BetonReader(path) as reader:
        dec, flip = SimpleRGBImageDecoder(), RandomHorizontalFlip()
        pipes = {"image": [dec, flip], "label": None, "plain": PipelineSpec(dec, transforms=[])}
        plan = _plan(reader, pipes, 8, fuse=True, monkeypatch=monkeypatch)
        assert not plan._mirror_fusions()
        flipped, plain = _run(plan, ids)
        key = plan.seed_keys(11, 2)[_flip_position(plan, flip)]
        np.testing.assert_array_equal(flipped, _expected(images, ids, key, 0.5))
        np.testing.assert_array_equal(plain, images[ids])


def test_a_flip_after_another_op_is_not_fused(raw_file, monkeypatch) -> None:
    from beton_serve.transforms import RandomBrightness

    path, _ = raw_file
    with BetonReader(path) as reader:
        pipes = {
            "image": [SimpleRGBImageDecoder(), RandomBrightness(0.0), RandomHorizontalFlip()],
            "label": None,
        }
        plan = _plan(reader, pipes, 8, fuse=True, monkeypatch=monkeypatch)
        assert not plan._mirror_fusions()


def test_a_file_with_a_short_allocation_keeps_the_looked_up_copy(raw_file, monkeypatch) -> None:
    """A raw allocation shorter than the image (a damaged or foreign file): the decoder leaves
    the rest of the image zero, so it keeps the copy that looks each allocation up, and the
    flip runs after it as its own op."""
    path, images = raw_file
    ids = list(range(12))
    with BetonReader(path) as reader:
        dec, flip = SimpleRGBImageDecoder(), RandomHorizontalFlip(1.0)
        plan = _plan(
            reader, {"image": [dec, flip], "label": None}, 12, fuse=True, monkeypatch=monkeypatch
        )
        assert dec._raw_whole is True and plan._mirror_fusions()
        mem, ptrs, sizes = reader.storage_state
        short = np.minimum(sizes, H * W * 3 - 7)  # every image loses its last 7 bytes
        monkeypatch.setattr(reader, "storage_state", (mem, ptrs, short))
        dec, flip = SimpleRGBImageDecoder(), RandomHorizontalFlip(1.0)
        plan = _plan(
            reader, {"image": [dec, flip], "label": None}, 12, fuse=True, monkeypatch=monkeypatch
        )
        assert dec._raw_whole is False and not plan._mirror_fusions()
        (img,) = _run(plan, ids)
        want = images[ids].copy().reshape(len(ids), -1)
        want[:, -7:] = 0
        np.testing.assert_array_equal(img, want.reshape(-1, H, W, 3)[:, :, ::-1])


@pytest.mark.parametrize(("h", "w"), [(32, 32), (4, 7), (3, 8), (1, 4), (5, 1), (2, 13), (7, 6)])
def test_every_image_size_is_mirrored_as_the_flip_does(tmp_path: Path, monkeypatch, h, w) -> None:
    """Every width and height (one row, one column, odd and even), a whole batch of images:
    the flip's pixels, and nothing written outside each image's bytes (the batch's last image
    included)."""
    path = tmp_path / "raw.beton"
    data = _Images(21, h, w)
    DatasetWriter(
        str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()}
    ).from_indexed_dataset(data)
    ids = [20, 3, 0, 19, 7, 11, 2, 5, 13, 17, 1]
    with BetonReader(path) as reader:
        got = {}
        for fuse in (True, False):
            flip = RandomHorizontalFlip(0.5)
            plan = _plan(
                reader,
                {"image": [SimpleRGBImageDecoder(), flip], "label": None},
                16,
                fuse=fuse,
                monkeypatch=monkeypatch,
            )
            assert bool(plan._mirror_fusions()) is fuse
            out = np.full((16, h, w, 3), 201, np.uint8)
            (img,) = _run(plan, ids, [out])
            assert (out[len(ids) :] == 201).all()
            key = plan.seed_keys(11, 2)[_flip_position(plan, flip)]
            np.testing.assert_array_equal(img, _expected(data.images, ids, key, 0.5))
            got[fuse] = img
        np.testing.assert_array_equal(got[True], got[False])
        # every image drawn for a flip, and a batch ending with one
        for fuse in (True, False):
            plan = _plan(
                reader,
                {"image": [SimpleRGBImageDecoder(), RandomHorizontalFlip(1.0)], "label": None},
                16,
                fuse=fuse,
                monkeypatch=monkeypatch,
            )
            out = np.full((16, h, w, 3), 201, np.uint8)
            (img,) = _run(plan, ids[:5], [out[:5]])
            assert (out[5:] == 201).all()
            np.testing.assert_array_equal(img, data.images[ids[:5]][:, :, ::-1])
