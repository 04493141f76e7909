"""Large batch buffers (``beton_serve._batchmem``, issue 14).

Large private buffers (the in-process Loader's slots, op workspaces, decode-group buffers) are
private mappings advised ``MADV_NOHUGEPAGE``, unless ``BETON_SERVE_HUGEPAGES=1`` (the module
docstring says why). They must behave as ``np.empty`` does, hold the same pixels, and be
unmapped with their last view.
"""

from __future__ import annotations

import gc
import mmap
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_serve import _batchmem
from beton_serve._batchmem import BATCH_MAP_MIN_BYTES, batch_empty
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader, OrderOption
from beton_serve.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

pytestmark = pytest.mark.timeout(120)

_ADVISABLE = hasattr(mmap, "MADV_NOHUGEPAGE") and Path("/proc/self/smaps").exists()


def _vm_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (None: no mapping)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def test_small_buffers_are_plain_numpy() -> None:
    a = batch_empty((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32
    assert a.flags.owndata and a.base is None


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int64])
def test_large_buffers_behave_like_np_empty(dtype: type) -> None:
    shape = (23, 256, 256, 3)
    a = batch_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.nbytes >= BATCH_MAP_MIN_BYTES
    assert a.flags.c_contiguous and a.flags.writeable and a.flags.aligned
    assert isinstance(a.base, mmap.mmap)
    ref = np.arange(a.size, dtype=np.int64).astype(dtype).reshape(shape)
    a[...] = ref
    np.testing.assert_array_equal(a, ref)
    b = a[3:9, ::2]  # a view keeps the mapping alive
    del a
    gc.collect()
    np.testing.assert_array_equal(b, ref[3:9, ::2])


@pytest.mark.skipif(not _ADVISABLE, reason="needs MADV_NOHUGEPAGE and /proc/self/smaps")
def test_large_buffers_are_advised_and_unmapped_with_their_last_view() -> None:
    a = batch_empty((64, 224, 224, 3), np.uint8)
    address = a.ctypes.data
    flags = _vm_flags(address)
    assert flags is not None and "nh" in flags, flags
    base = weakref.ref(a.base)
    del a
    gc.collect()
    assert base() is None
    flags = _vm_flags(address)
    assert flags is None or "nh" not in flags  # the range is gone (or reused by malloc)


def test_hugepages_env_gives_numpys_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BETON_SERVE_HUGEPAGES", "1")
    a = batch_empty((64, 224, 224, 3), np.uint8)
    assert a.flags.owndata and a.base is None


def _epochs(beton: Path, n: int) -> list[list[tuple[np.ndarray, np.ndarray, Any]]]:
    """``n`` epochs of (pixels, labels, VmFlags of the pixels' slot); the images end as
    torch tensors over the slot (``ToTensor``, ``ToTorchImage``), as a trainer gets them."""
    pipes = {
        "image": [
            RandomResizedCropRGBImageDecoder((224, 224)),
            RandomHorizontalFlip(),
            ToTensor(),
            ToTorchImage(),
        ],
        "label": [IntDecoder()],
    }
    ld = Loader(
        str(beton), batch_size=32, order=OrderOption.RANDOM, seed=3, num_workers=2,
        pipelines=pipes,
    )  # fmt: skip
    try:
        out = []
        for _ in range(n):
            batches = []
            for batch in ld:
                img, label = batch[0], batch[1]
                assert isinstance(img, torch.Tensor) and img.shape[1:] == (3, 224, 224)
                pixels = img.permute(0, 2, 3, 1).numpy().copy()
                if _ADVISABLE and pixels.nbytes >= BATCH_MAP_MIN_BYTES:
                    flags = _vm_flags(img.data_ptr())
                else:
                    flags = None
                batches.append((pixels, label.copy(), flags))
            out.append(batches)
        return out
    finally:
        ld.close()


def test_loader_pixels_are_the_same_in_mapped_slots(
    fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Loader's slots (32 x 224² RGB = 4.8 MB) are advised mappings, and its batches hold
    exactly the pixels and labels of the same Loader on plain ``np.empty`` buffers, over two
    epochs."""
    beton = fixtures_dir / "images_jpg.beton"
    mapped = _epochs(beton, 2)
    monkeypatch.setattr(_batchmem, "BATCH_MAP_MIN_BYTES", 1 << 62)
    plain = _epochs(beton, 2)
    assert [len(e) for e in mapped] == [len(e) for e in plain] == [2, 2]
    for e_mapped, e_plain in zip(mapped, plain, strict=True):
        for (img, label, flags), (img0, label0, flags0) in zip(e_mapped, e_plain, strict=True):
            np.testing.assert_array_equal(img, img0)
            np.testing.assert_array_equal(label, label0)
            if _ADVISABLE and img.nbytes >= BATCH_MAP_MIN_BYTES:
                assert flags is not None and "nh" in flags
                assert flags0 is None or "nh" not in flags0
    assert not np.array_equal(mapped[0][0][0], mapped[1][0][0])  # the epochs differ


def test_an_impossible_buffer_is_a_memory_error() -> None:
    """``np.empty`` raises ``MemoryError``; a failed mapping must too, not ``OSError``."""
    with pytest.raises(MemoryError, match="Unable to allocate"):
        batch_empty((1 << 40, 224, 224, 3), np.uint8)


def test_an_absurd_batch_size_is_a_spec_error(fixtures_dir: Path) -> None:
    """The Loader's advice for slots it cannot allocate survives the mapped slots."""
    from beton_serve.errors import SpecError

    # The file's 64 samples (buffers hold the epoch, not the 65,536 asked for) x 60000² RGB:
    # 691 GB per slot
    pipes = {"image": [RandomResizedCropRGBImageDecoder((60000, 60000))], "label": [IntDecoder()]}
    ld = Loader(
        str(fixtures_dir / "images_jpg.beton"), batch_size=65536, num_workers=1,
        order=OrderOption.SEQUENTIAL, drop_last=False, pipelines=pipes,
    )  # fmt: skip
    try:
        with pytest.raises(SpecError, match="cannot be allocated in this process"):
            next(iter(ld))
    finally:
        ld.close()


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not _ADVISABLE, reason="needs MADV_NOHUGEPAGE and /proc/self/maps")
def test_loaders_opened_and_closed_leave_no_mappings(fixtures_dir: Path) -> None:
    """200 Loaders, each with 5 mapped slots of 4.8 MB (its 2 batches written), opened, read and
    closed: the mappings are gone with each Loader, and the RSS does not grow with the count."""
    pipes = {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip()],
        "label": [IntDecoder()],
    }

    def cycle() -> None:
        ld = Loader(
            str(fixtures_dir / "images_jpg.beton"), batch_size=32, num_workers=2,
            order=OrderOption.RANDOM, seed=1, pipelines=pipes,
        )  # fmt: skip
        try:
            batch = next(iter(ld))
            assert batch[0].shape == (32, 224, 224, 3)
        finally:
            ld.close()

    for _ in range(20):  # warm up: compiled plans, caches, the allocator's arenas
        cycle()
    gc.collect()
    maps0, rss0 = _mappings(), _rss_kib()
    for _ in range(200):
        cycle()
    gc.collect()
    maps1, rss1 = _mappings(), _rss_kib()
    # One Loader's slots alone are 5 mappings and 24 MB: 200 leaked would be 1,000 and 4.8 GB.
    assert maps1 - maps0 < 20, (maps0, maps1)
    assert rss1 - rss0 < 64 * 1024, (rss0, rss1)
