# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""Issue 6 §1 end to end: identical streams on a real daemon decode each batch once.

Four clients open the same spec (dataset, pipeline, seed, order, batch size, drop_last). The
daemon's ``samples_decoded`` counter (Stats RPC) must show 1x the epochs, and every client must
still get every batch, in order, bit-identical to the others.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import CenterCropRGBImageDecoder, IntDecoder
from beton_serve.transforms import RandomHorizontalFlip, ToTensor
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401

pytestmark = pytest.mark.slow

N_SAMPLES = 64  # images_smart.beton
BATCH = 8
EPOCHS = 2


def _loader(address: str) -> Loader:
    return Loader(
        "images_smart",
        batch_size=BATCH,
        order=OrderOption.RANDOM,
        seed=11,
        drop_last=False,
        pipelines={
            "image": [CenterCropRGBImageDecoder((24, 24), 0.8), RandomHorizontalFlip(), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        },
        server=address,
        spawn=False,
    )


def _run_clients(address: str, lockstep: bool) -> list[list[tuple[int, np.ndarray, torch.Tensor]]]:
    """Four client threads, each reading EPOCHS epochs; with ``lockstep`` they wait for each
    other after every batch (so nobody can release a batch before everyone has attached)."""
    loaders = [_loader(address) for _ in range(4)]
    barrier = threading.Barrier(4, timeout=60)
    got: list[list[tuple[int, np.ndarray, torch.Tensor]]] = [[] for _ in loaders]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            for epoch in range(EPOCHS):
                for batch in loaders[i]:
                    got[i].append((epoch, loaders[i].last_sample_ids.copy(), batch[0].clone()))
                    if lockstep:
                        barrier.wait()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=run, args=(i,), name=f"beton-test-client-{i}") for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for ld in loaders:
        ld.close()
    if errors:
        raise errors[0]
    return got


def _check_identical_complete_epochs(got) -> None:
    ref = got[0]
    per_epoch = -(-N_SAMPLES // BATCH)
    assert len(ref) == EPOCHS * per_epoch
    for epoch in range(EPOCHS):
        ids = np.concatenate([i for e, i, _ in ref if e == epoch])
        assert sorted(ids.tolist()) == list(range(N_SAMPLES))  # every sample once per epoch
    for other in got[1:]:
        assert len(other) == len(ref)
        for (e1, i1, x1), (e2, i2, x2) in zip(ref, other, strict=True):
            assert e1 == e2
            assert np.array_equal(i1, i2)  # same batches, same order
            assert torch.equal(x1, x2)  # bit-identical, random flips included


def test_four_identical_clients_decode_each_epoch_once(daemon_factory, fixtures_dir) -> None:
    d = daemon_factory([fixtures_dir / "images_smart.beton"])
    got = _run_clients(d.address, lockstep=True)
    _check_identical_complete_epochs(got)
    decoded = {x.name: x.samples_decoded for x in d.stats().datasets}
    assert decoded["images_smart"] == EPOCHS * N_SAMPLES  # 1x, not 4x


def test_four_free_running_clients_share_and_stay_exact(daemon_factory, fixtures_dir) -> None:
    d = daemon_factory([fixtures_dir / "images_smart.beton"])
    got = _run_clients(d.address, lockstep=False)
    _check_identical_complete_epochs(got)
    decoded = {x.name: x.samples_decoded for x in d.stats().datasets}["images_smart"]
    # Scheduling decides how much a late starter or a laggard re-decodes; some work is shared.
    assert EPOCHS * N_SAMPLES <= decoded < 4 * EPOCHS * N_SAMPLES
