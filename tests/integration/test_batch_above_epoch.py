# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A batch size above the epoch's samples allocates only the samples, in both Loaders.

A small validation set read at a training batch size (or an absurd request) used to size every
buffer for the batch size: a raw request for batch size 65,536 on a 64-sample file made the
daemon allocate an 809 MB ring for one batch of 64. Plans, rings and client buffers are now
sized by ``beton_wire.loader_state.batch_rows`` (the epoch's largest batch), while batching
(``len``, ``drop_last``, QUASI_RANDOM's windows) still follows the batch size. These tests check
the contents against a Loader whose batch size is the epoch itself, and the daemon's ring bytes
against that Loader's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from beton_wire.loader_state import batch_rows
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HUGE = 65_536
#: (order, Loader arguments, environment, samples in the epoch): images_jpg has 64 samples.
CASES = {
    "random": ("RANDOM", {"seed": 5}, {}, 64),
    "quasi_subset": ("QUASI_RANDOM", {"seed": 3, "indices": list(range(0, 64, 3))}, {}, 22),
    "distributed": (
        "SEQUENTIAL",
        {"seed": 1, "distributed": True},
        {"RANK": "1", "WORLD_SIZE": "3"},
        22,
    ),
}


def _pipelines() -> dict[str, Any]:
    return {
        "image": [RandomResizedCropRGBImageDecoder((16, 16)), RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


def _take(loader: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def _same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert gx.shape == wx.shape and torch.equal(gx, wx) and torch.equal(gy, wy)


def test_batch_rows() -> None:
    assert batch_rows(256, 64) == 64
    assert batch_rows(16, 64) == 16
    assert batch_rows(256, 0) == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_batch_size_above_the_epoch_allocates_only_the_epoch(
    daemon_factory, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    order, kw, env, samples = CASES[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    beton = str(fixtures_dir / "images_jpg.beton")

    def local(batch_size: int) -> InProcessLoader:
        return InProcessLoader(
            beton,
            batch_size=batch_size,
            order=InProcessOrder[order],
            pipelines=_pipelines(),
            num_workers=1,
            drop_last=False,
            **kw,
        )

    def served(batch_size: int, **more: Any) -> Loader:
        args = {"drop_last": False, **kw, **more}
        return Loader(
            "images_jpg",
            batch_size=batch_size,
            order=OrderOption[order],
            pipelines=_pipelines(),
            server=d.address,
            spawn=False,
            **args,
        )

    d = daemon_factory([beton])
    with local(samples) as ref:
        want = _take(ref)  # the epoch as one batch
    assert len(want) == 1 and len(want[0][1]) == samples
    with local(HUGE) as ld:
        _same(_take(ld), want)
        assert ld._feed.batch_rows == samples  # its buffers hold the epoch, not 65,536 rows

    rings = []
    for batch_size in (samples, HUGE):
        with served(batch_size) as ld:
            it = iter(ld)
            first = next(it)
            rings.append(d.stats().ring_bytes)
            got = [(first[0].clone(), first[1].clone()), *_take(it)]
        _same(got, want)
    assert rings[0] == rings[1] > 0, f"ring bytes at batch sizes {samples} and {HUGE}: {rings}"

    # drop_last drops the one short batch: an empty epoch, in both Loaders
    with served(HUGE, drop_last=True) as ld:
        assert len(ld) == 0 and _take(ld) == []
    with InProcessLoader(
        beton, batch_size=HUGE, order=InProcessOrder[order], pipelines=_pipelines(), **kw
    ) as ld:
        assert len(ld) == 0 and _take(ld) == []
