# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A daemon with more workers than a stream has credits splits prefetched batches into slices
(``Engine.prefetch_slices``); what it serves stays equal, bit for bit, to the in-process Loader.

With ``--workers 16`` and 224-px batches of 32 (4.8 MB a slot, so a ring of 6 slots and 6
credits), each prefetched batch runs in ``ceil(16 / 6) = 3`` slices. The daemons of the other
served tests have 2 workers, where prefetched batches stay whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _pipelines() -> dict:
    return {
        "image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


def _epochs(ld: Any, n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for _ in range(n):
        for image, label in ld:
            out.append((image.numpy().copy(), label.numpy().copy(), ld.last_sample_ids.copy()))
    return out


def test_a_sixteen_worker_daemon_serves_split_prefetch_equal_to_in_process(
    daemon_factory, fixtures_dir: Path
) -> None:
    beton = fixtures_dir / "images_jpg.beton"
    kw: dict[str, Any] = dict(
        batch_size=32, order=OrderOption.RANDOM, seed=11, drop_last=False, batches_ahead=3
    )
    # beton_serve's own Loader: beton_client's, given a path, would spawn a daemon of its own
    with InProcessLoader(str(beton), pipelines=_pipelines(), num_workers=1, **kw) as ref_ld:
        want = _epochs(ref_ld, 3)
    d = daemon_factory([beton], args=["--workers", "16"])
    with Loader("images_jpg", pipelines=_pipelines(), server=d.address, copy=True, **kw) as ld:
        got = _epochs(ld, 3)
    assert len(got) == len(want) >= 6
    for (gi, gl, gs), (wi, wl, ws) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gs, ws)
        np.testing.assert_array_equal(gl, wl)
        np.testing.assert_array_equal(gi, wi)
