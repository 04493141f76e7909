# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""One ``state_dict`` format: a checkpoint from the served Loader resumes the in-process one and
the other way round, exactly (issue 12 §2).

Random crops and flips make a batch depend on (seed, epoch, sample id): only an exact resume
gives the same pixels as an uninterrupted in-process epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption, SpecError
from beton_serve.errors import SpecError as ServerSpecError
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow

Batch = tuple[torch.Tensor, torch.Tensor]


def _pipelines() -> dict[str, Any]:
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((16, 16)),
            RandomHorizontalFlip(0.5),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
        "weight": None,
    }


#: (order name, Loader arguments): every sample with drop_last, and a subset without it.
CONFIGS = {
    "random_all": ("RANDOM", {"seed": 99, "drop_last": True}),
    "quasi_subset": (
        "QUASI_RANDOM",
        {"seed": 7, "drop_last": False, "indices": [5, 3, 11, 2, 8, 13, 1, 21, 34, 0, 17, 9, 4]},
    ),
}


def _served(address: str, order: str, kw: dict[str, Any]) -> Loader:
    return Loader(
        "images_jpg",
        batch_size=4,
        order=OrderOption[order],
        pipelines=_pipelines(),
        server=address,
        batches_ahead=2,
        copy=True,
        **kw,
    )


def _local(beton: str, order: str, kw: dict[str, Any]) -> InProcessLoader:
    return InProcessLoader(
        beton,
        batch_size=4,
        order=InProcessOrder[order],
        pipelines=_pipelines(),
        num_workers=1,
        batches_ahead=2,
        **kw,
    )


def _take(it: Any, n: int | None = None) -> list[Batch]:
    out = []
    for image, label in it:
        out.append((image.clone(), label.clone()))
        if n is not None and len(out) == n:
            break
    return out


def _assert_same(got: list[Batch], want: list[Batch], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} batches, expected {len(want)}"
    for i, ((gi, gl), (wi, wl)) in enumerate(zip(got, want, strict=True)):
        assert gi.dtype == wi.dtype and gi.shape == wi.shape, f"{what}: batch {i} image type"
        assert torch.equal(gi, wi), f"{what}: batch {i} pixels differ"
        assert torch.equal(gl, wl), f"{what}: batch {i} labels differ"


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_state_resumes_exactly_across_backends(
    daemon_factory, fixtures_dir: Path, config: str
) -> None:
    order, kw = CONFIGS[config]
    beton = str(fixtures_dir / "images_jpg.beton")
    d = daemon_factory([beton])
    with _local(beton, order, kw) as ref:
        reference = [_take(ref) for _ in range(2)]
        orders = [ref.sample_order(e) for e in range(2)]
    n = len(reference[0])
    assert n >= 3
    # the augmentations are random: epochs differ, so a wrong epoch or batch cannot pass
    assert not torch.equal(reference[0][0][0], reference[1][0][0])

    # served -> in-process: the whole of epoch 0, then part of epoch 1
    served = _served(d.address, order, kw)
    try:
        _assert_same(_take(served), reference[0], "served epoch 0")
        it = iter(served)
        head = _take(it, 2)
        np.testing.assert_array_equal(served.last_sample_ids, orders[1][4:8])
        del it  # abandoned mid-epoch: the state still says what was yielded
        state = served.state_dict()
    finally:
        served.close()
    assert (state["version"], state["epoch"], state["batch"]) == (2, 1, 2)
    _assert_same(head, reference[1][:2], "served epoch 1 before the checkpoint")
    with _local(beton, order, kw) as local:
        local.load_state_dict(state)
        rest = _take(local)
        assert local.state_dict() == {**state, "epoch": 2, "batch": 0}
    _assert_same(rest, reference[1][2:], "in-process resumed from a served state")

    # in-process -> served: part of epoch 0
    with _local(beton, order, kw) as local:
        it2 = iter(local)
        _take(it2, 1)
        it2.close()
        state2 = local.state_dict()
    assert (state2["epoch"], state2["batch"]) == (0, 1)
    assert {k: v for k, v in state2.items() if k not in ("epoch", "batch")} == {
        k: v for k, v in state.items() if k not in ("epoch", "batch")
    }  # the same identity from both backends
    served = _served(d.address, order, kw)
    try:
        served.load_state_dict(state2)
        rest2 = _take(served)
        again = _take(served)
    finally:
        served.close()
    _assert_same(rest2, reference[0][1:], "served resumed from an in-process state")
    _assert_same(again, reference[1], "served epoch after the resumed one")


def test_a_state_from_other_arguments_is_refused_by_both(
    daemon_factory, fixtures_dir: Path
) -> None:
    beton = str(fixtures_dir / "images_jpg.beton")
    d = daemon_factory([beton])
    with _local(beton, "RANDOM", {"seed": 99}) as local:
        state = local.state_dict()
    served = _served(d.address, "QUASI_RANDOM", {"seed": 99})
    try:
        with pytest.raises(SpecError, match=r"order='RANDOM'.*the order differs"):
            served.load_state_dict(state)
        state_q = served.state_dict()
    finally:
        served.close()
    with _local(beton, "QUASI_RANDOM", {"seed": 99, "drop_last": False}) as local:
        with pytest.raises(ServerSpecError, match=r"drop_last=True.*the drop_last differs"):
            local.load_state_dict(state_q)
