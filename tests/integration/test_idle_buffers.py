# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The ops' buffers the daemon keeps between batches stay within ``max_idle_buffer_bytes``.

While a stream is open, the daemon keeps its layout's free buffer sets (one per worker that ran
it) for the next batches. Jobs of distinct layouts open at once (a sweep over output sizes, each
job its own) each keep theirs, so without a bound the daemon's buffer memory grows with the
number of layouts served at once. Past the bound, the kept sets of the layouts used longest ago
are freed, and allocated again when their layout runs next: the batches stay the same, bit for
bit, as the in-process Loader's. ``beton-serve stats`` (the Stats RPC) shows all of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import NormalizeImage, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: 64 images; 8 per batch: 8 batches per epoch.
BATCH = 8
SIZES = (48, 56, 64, 72, 80)  # one layout each
#: Below one layout's sets on 2 workers: the bound must free some while all five are open.
LIMIT = 400_000


def _pipelines(size: int) -> dict:
    mean, std = np.array([120.0, 110.0, 100.0]), np.array([60.0, 60.0, 60.0])
    return {
        # NormalizeImage after the decoder: the decoder's output is scratch memory
        "image": [
            RandomResizedCropRGBImageDecoder((size, size)),
            NormalizeImage(mean, std, np.float16),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
    }


def _arrays(batch) -> tuple[np.ndarray, ...]:
    return tuple(t.numpy().copy() for t in batch)


def test_idle_buffers_stay_within_the_bound_with_the_same_batches(
    daemon_factory, fixtures_dir: Path
) -> None:
    path = fixtures_dir / "images_jpg.beton"
    d = daemon_factory([path], args=["--workers", "2", "--max-idle-buffer-bytes", str(LIMIT)])
    s = d.stats()
    assert s.max_idle_buffer_bytes == LIMIT and s.idle_buffer_bytes == 0
    loaders = [
        Loader(
            "images_jpg",
            batch_size=BATCH,
            order=OrderOption.RANDOM,
            seed=5,
            pipelines=_pipelines(size),
            server=d.address,
            spawn=False,
        )
        for size in SIZES
    ]
    try:
        its = [iter(ld) for ld in loaders]
        got: list[list[tuple[np.ndarray, ...]]] = [[] for _ in SIZES]
        for _ in range(3):  # every layout runs, again and again, all five streams open
            for k, it in enumerate(its):
                got[k].append(_arrays(next(it)))
                s = d.stats()
                assert s.idle_buffer_bytes <= LIMIT, s
        assert s.idle_buffers_freed > 0  # the bound was met by freeing sets, not by luck
        for k, it in enumerate(its):
            got[k].extend(_arrays(b) for b in it)
    finally:
        for ld in loaders:
            ld.close()
    s = d.stats()
    assert s.idle_buffer_bytes == 0 and s.buffer_bytes == 0  # no stream: nothing kept
    for size, batches in zip(SIZES, got, strict=True):
        with InProcessLoader(
            str(path),
            batch_size=BATCH,
            order=InProcessOrder.RANDOM,
            seed=5,
            pipelines=_pipelines(size),
            num_workers=2,
        ) as ld:
            want = [_arrays(b) for b in ld]
        assert len(batches) == len(want) == 8
        for g, w in zip(batches, want, strict=True):
            assert (
                g[0].shape == (BATCH, size, size, 3) and g[0].dtype == np.int16
            )  # FFCV: float16 bits on CPU
            assert len(g) == len(w) and all(np.array_equal(x, y) for x, y in zip(g, w, strict=True))
