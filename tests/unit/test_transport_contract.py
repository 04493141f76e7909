"""The SlotTransport contract, written once and run against every ring (shm, and cuda_ipc on a
fake CUDA runtime): slot states, views, lease counting, close."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from beton_serve.errors import TransportError
from beton_serve.transport.base import SlotTransport
from beton_serve.transport.cuda_ipc import CudaIpcRing
from beton_serve.transport.shm import ShmNamer, ShmRing
from beton_wire.slots import SlotLayout, slot_layout
from helpers.fake_cuda import FakeDriver, FakeRuntime

LAYOUT = slot_layout([("image", (4, 5, 3), "uint8"), ("label", (), "int64")], batch_size=8)


def _shm(layout: SlotLayout, n: int) -> ShmRing:
    return ShmRing(layout, n, ShmNamer().next("contract"))


def _cuda(layout: SlotLayout, n: int) -> CudaIpcRing:
    return CudaIpcRing(layout, n, device_index=0, runtime=FakeRuntime(FakeDriver(), "daemon"))


@pytest.fixture(params=[_shm, _cuda], ids=["shm", "cuda_ipc"])
def make(request) -> Iterator[Callable[[SlotLayout, int], SlotTransport]]:
    made: list[SlotTransport] = []

    def factory(layout: SlotLayout, n: int) -> SlotTransport:
        ring = request.param(layout, n)
        made.append(ring)
        return ring

    yield factory
    for ring in made:
        ring.close()


def test_is_a_slot_transport_and_describes_itself(make):
    ring = make(LAYOUT, 3)
    assert isinstance(ring, SlotTransport)
    setup = ring.setup()
    assert (setup.kind, setup.slot_count, setup.slot_bytes) == (ring.kind, 3, LAYOUT.slot_bytes)
    assert ring.nbytes() >= 3 * LAYOUT.slot_bytes


def test_slot_life_cycle(make):
    ring = make(LAYOUT, 3)
    assert [ring.acquire() for _ in range(4)] == [0, 1, 2, None]
    assert ring.leased() == 3
    assert ring.release(1) is False  # FILLING, not leased
    ring.publish(1, 8)
    with pytest.raises(TransportError):
        ring.publish(1, 8)  # LEASED, not FILLING
    assert ring.release(1) is True and ring.release(1) is False
    ring.abandon(0)
    assert ring.leased() == 1
    assert ring.acquire() in (0, 1)


def test_views_have_the_layout_and_are_per_slot(make):
    ring = make(LAYOUT, 2)
    a, b = ring.acquire(), ring.acquire()
    img_a, lab_a = ring.host_views(a)
    img_b, _ = ring.host_views(b)
    assert img_a.shape == (8, 4, 5, 3) and img_a.dtype == np.uint8
    assert lab_a.shape == (8,) and lab_a.dtype == np.int64
    img_a[:] = 1
    img_b[:] = 2
    assert int(ring.host_views(a)[0].max()) == 1  # slots do not alias
    lab_a[:] = np.arange(8)
    assert np.array_equal(ring.host_views(a)[1], np.arange(8))


def test_close_reclaims_leases_and_is_idempotent(make):
    ring = make(LAYOUT, 2)
    ring.publish(ring.acquire(), 3)
    ring.close()
    ring.close()
    assert ring.acquire() is None and ring.release(0) is False
