# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""A served batch stays what it was until the next one is requested, end to end.

The documented contract (README, docs/migrating-from-ffcv.md): a batch is valid until the next
``next()``. Over shm the tensors are views into a ring slot of the daemon's segment, and the
daemon keeps decoding ahead into every other slot while the trainer holds one; the slot the
trainer holds must not be handed to another batch before the trainer asks for the next one. The
unit tests cover the ring's leases and the in-process Loader (``test_prefetch_width.py``), the
sharing arenas (``test_zero_copy_sharing.py``); this test holds each batch of a solo stream
while the daemon has time to fill the whole ring, and checks its pixels and labels against the
copy taken on arrival and against the in-process Loader's batch, bit for bit.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from beton_serve.loader import Loader as InProcessLoader
from beton_serve.loader import OrderOption as InProcessOrder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

N_SAMPLES = 64  # images_smart.beton
BATCH = 4
EPOCHS = 2
#: Long enough for the daemon's two workers to decode far more than a ring's worth of these
#: small batches (~0.1 ms each) while the trainer holds one.
HOLD_S = 0.02


def _pipelines() -> dict:
    return {
        "image": [
            RandomResizedCropRGBImageDecoder((24, 24)),
            RandomHorizontalFlip(0.5),
            ToTensor(),
        ],
        "label": [IntDecoder(), ToTensor()],
    }


def _reference(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every batch of ``EPOCHS`` epochs from the in-process Loader, cloned."""
    out = []
    with InProcessLoader(
        str(path),
        batch_size=BATCH,
        order=InProcessOrder.RANDOM,
        seed=11,
        pipelines=_pipelines(),
        num_workers=1,
    ) as ld:
        for _ in range(EPOCHS):
            out.extend((img.clone(), lab.clone()) for img, lab in ld)
    return out


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_held_batch_keeps_its_contents_while_the_daemon_runs_ahead(
    daemon_factory, fixtures_dir: Path, transport: str
) -> None:
    path = fixtures_dir / "images_smart.beton"
    want = _reference(path)
    d = daemon_factory([path])
    with Loader(
        "images_smart",
        batch_size=BATCH,
        order=OrderOption.RANDOM,
        seed=11,
        pipelines=_pipelines(),
        server=d.address,
        spawn=False,
        transport=transport,
    ) as ld:
        assert ld.chosen_transport == transport
        got = 0
        ahead = 0  # the most batches the daemon had published past the one held
        for _ in range(EPOCHS):
            for img, lab in ld:
                w_img, w_lab = want[got]
                on_arrival = (img.clone(), lab.clone())
                assert torch.equal(img, w_img) and torch.equal(lab, w_lab), f"batch {got}"
                time.sleep(HOLD_S)  # the daemon decodes ahead into every slot it may take
                if transport == "shm" and got % 4 == 1:
                    (st,) = d.stats().streams
                    ahead = max(ahead, st.batches_sent - (got + 1))
                    assert st.client_pid == os.getpid()  # from the notice channel's SO_PEERCRED
                assert torch.equal(img, on_arrival[0]), f"batch {got}'s pixels changed"
                assert torch.equal(lab, on_arrival[1]), f"batch {got}'s labels changed"
                got += 1
        assert got == len(want) == EPOCHS * N_SAMPLES // BATCH
        if transport == "shm":  # the holds were tested: other slots filled meanwhile
            assert ahead >= 2, ahead
    # the served stream is closed with the Loader; nothing of it stays in the daemon
    deadline = time.monotonic() + 5
    while d.stats().streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not d.stats().streams
    # a Unix-socket call carries no pid: the open is logged without one (not as "pid=0")
    assert re.search(r"opened: dataset=images_smart client=\S+ pid=- ", d.log()), d.log()
