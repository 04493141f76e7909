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
    # The clients start within milliseconds of each other, but the first one's stream may have
    # decoded and copied its first batches by then: --share-retain keeps them for the others, so
    # the count is exactly 1x however the starts are scheduled.
    d = daemon_factory([fixtures_dir / "images_smart.beton"], args=["--share-retain", "16"])
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


def test_a_stalled_client_is_detached_and_the_others_never_wait(daemon_factory, fixtures_dir):
    """One client stops reading after its first batch; the three others finish their epoch
    meanwhile. The stalled one then resumes on a private stream from its exact position."""
    d = daemon_factory([fixtures_dir / "images_smart.beton"])
    batch = 2  # 32 batches per epoch: more than the daemon's default max_lag (8)
    loaders = [
        Loader(
            "images_smart",
            batch_size=batch,
            order=OrderOption.RANDOM,
            seed=5,
            drop_last=False,
            pipelines={"image": [CenterCropRGBImageDecoder((24, 24), 0.8), ToTensor()]},
            server=d.address,
            spawn=False,
        )
        for _ in range(4)
    ]
    got: list[list[tuple[np.ndarray, torch.Tensor]]] = [[] for _ in loaders]
    fast_done = threading.Event()
    started = threading.Barrier(4, timeout=60)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            it = iter(loaders[i])
            started.wait()
            for n, b in enumerate(it):
                got[i].append((loaders[i].last_sample_ids.copy(), b[0].clone()))
                if i == 0 and n == 0 and not fast_done.wait(60):
                    raise AssertionError("the fast clients waited for the stalled one")
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(i,), name=f"beton-test-client-{i}") for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(120)
    fast_done.set()  # only now does the stalled client read on
    threads[0].join(120)
    for ld in loaders:
        ld.close()
    if errors:
        raise errors[0]
    per_epoch = N_SAMPLES // batch
    assert all(len(g) == per_epoch for g in got)
    for other in got[1:]:
        for (i1, x1), (i2, x2) in zip(got[0], other, strict=True):
            assert np.array_equal(i1, i2) and torch.equal(x1, x2)  # same batches, same order
    decoded = {x.name: x.samples_decoded for x in d.stats().datasets}["images_smart"]
    # The stalled one, detached, decoded on its own the batches it had not taken when it fell
    # behind; the others shared (at most 3 more epochs would mean no sharing at all).
    assert N_SAMPLES < decoded < 3 * N_SAMPLES
    assert "continues on its own" in d.log()  # the detach was logged
