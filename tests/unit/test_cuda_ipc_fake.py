"""The cuda_ipc ring and receiver on CPU, against a fake CUDA runtime (tests/helpers/fake_cuda).

What the fake can check without a GPU: the slot state machine, that bytes written by the engine
reach the client's view of the slab, the order of GPU operations (the daemon's copy waits on the
client's ``free`` event; the client's stream waits on ``ready``), that each handle is opened once,
and that every slab, pinned buffer, event and stream is released.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
from beton_client._transport.cuda_ipc import CudaIpcReceiver, TensorView, TransportUnavailable
from beton_serve.errors import TransportError
from beton_serve.transport.base import SlotTransport
from beton_serve.transport.cuda_ipc import (
    EVENT_DISABLE_TIMING,
    EVENT_INTERPROCESS,
    CachedProbe,
    CudaIpcFactory,
    CudaIpcRing,
    cuda_facts,
    probe_cuda_ipc,
)
from beton_wire.slots import slot_layout
from helpers.fake_cuda import FakeDriver, FakeRuntime

LAYOUT = slot_layout([("image", (4, 5, 3), "uint8"), ("label", (), "int64")], batch_size=6)
DEVICE = 1  # not the current device: every call must switch to it and back


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def daemon_rt(driver) -> FakeRuntime:
    return FakeRuntime(driver, "daemon")


@pytest.fixture
def client_rt(driver) -> FakeRuntime:
    return FakeRuntime(driver, "client")


def _assert_all_freed(rt: FakeRuntime, driver: FakeDriver) -> None:
    assert rt.dev_ptrs == {} and rt.host == {} and rt.streams == set()
    assert [e for e in driver.events.values() if e["owner"] == rt.name] == []
    assert rt.device == 0  # the current device was restored


def _views(length: int) -> list[TensorView]:
    return [
        TensorView(shape=(length, *t.shape), dtype=t.dtype, offset=t.offset) for t in LAYOUT.tensors
    ]


def _client_wrap(client_rt: FakeRuntime):
    """A CPU stand-in for the DLPack wrap: a numpy view of the client's mapping."""

    def wrap(mapping, view: TensorView, device: int, stream: int):
        raw = client_rt.device_bytes(mapping.ptr, mapping.nbytes)
        count = int(np.prod(view.shape))
        arr = raw[view.offset :].view(np.dtype(view.dtype))[:count].reshape(view.shape)
        return (arr, mapping)  # holding the mapping, as a real tensor view does

    return wrap


def _fill(ring: CudaIpcRing, slot: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    image, label = ring.host_views(slot)
    rng = np.random.default_rng(seed)
    image[:] = rng.integers(0, 256, image.shape, dtype=np.uint8)
    label[:] = rng.integers(0, 1000, label.shape)
    return image.copy(), label.copy()


def test_ring_allocates_dedicated_slabs_and_exports_every_handle(daemon_rt, driver):
    with CudaIpcRing(LAYOUT, 3, device_index=DEVICE, runtime=daemon_rt) as ring:
        assert isinstance(ring, SlotTransport)
        setup = ring.setup()
        assert (setup.kind, setup.slot_count, setup.slot_bytes) == (
            "cuda_ipc",
            3,
            LAYOUT.slot_bytes,
        )
        extra = setup.extra
        assert extra["device"] == DEVICE and extra["device_uuid"] == driver.uuids[DEVICE].hex()
        assert len({bytes(h) for h in extra["slab_handles"]}) == 3  # one allocation per slot
        assert all(
            len(h) == 64
            for k in ("slab_handles", "event_handles", "free_event_handles")
            for h in extra[k]
        )
        assert daemon_rt.calls["malloc"] == 3
        assert all(a[1] == DEVICE for a in daemon_rt.dev_ptrs.values())
        flags = {e["flags"] for e in driver.events.values()}
        assert flags == {EVENT_INTERPROCESS | EVENT_DISABLE_TIMING}
        assert ring.nbytes() == 3 * LAYOUT.slot_bytes
        assert daemon_rt.device == 0
    _assert_all_freed(daemon_rt, driver)
    assert ring.closed


def test_batch_reaches_the_client_in_order_with_free_and_ready_events(daemon_rt, client_rt, driver):
    ring = CudaIpcRing(LAYOUT, 2, device_index=DEVICE, runtime=daemon_rt)
    extra = ring.setup().extra
    ready_ev = [int.from_bytes(h[:8], "little") for h in extra["event_handles"]]
    free_ev = [int.from_bytes(h[:8], "little") for h in extra["free_event_handles"]]
    rx = CudaIpcReceiver(
        extra,
        slot_bytes=LAYOUT.slot_bytes,
        device=DEVICE,
        runtime=client_rt,
        stream_of=lambda dev: 777,
        wrap=_client_wrap(client_rt),
    )
    seen = []
    for batch in range(5):
        slot = ring.acquire()
        assert slot is not None
        image, label = _fill(ring, slot, seed=batch)
        ring.publish(slot, LAYOUT.batch_size)
        out = rx.tensors(slot, _views(LAYOUT.batch_size))
        got_image, got_label = out[0][0], out[1][0]
        np.testing.assert_array_equal(got_image, image)
        np.testing.assert_array_equal(got_label, label)
        seen.append(slot)
        rx.release(slot)
        assert ring.release(slot)
    del out  # the last views: their mapping may now close
    assert rx.open_slots() == 1 and client_rt.calls["ipcOpenMemHandle"] == 1  # opened once
    assert seen == [0] * 5

    log = [e for e in driver.log if e[1] != "sync"]
    # daemon: wait(free) -> copy -> record(ready); client: wait(ready) on its stream; record(free)
    first = log[:5]
    assert first[0] == ("daemon", "wait", free_ev[0], first[0][3])
    assert first[1][:2] == ("daemon", "copy") and first[1][3] == LAYOUT.slot_bytes
    assert first[2] == ("daemon", "record", ready_ev[0], first[0][3])
    assert first[3] == ("client", "wait", ready_ev[0], 777)
    assert first[4] == ("client", "record", free_ev[0], 777)
    assert driver.events[free_ev[0]]["records"] == 5
    rx.close()
    ring.close()
    gc.collect()
    assert client_rt.opened == {}
    _assert_all_freed(daemon_rt, driver)


def test_acquire_waits_for_the_previous_copy_out_of_the_staging_buffer(daemon_rt, driver):
    with CudaIpcRing(LAYOUT, 1, device_index=DEVICE, runtime=daemon_rt) as ring:
        slot = ring.acquire()
        ring.publish(slot, 2)
        ring.release(slot)
        ready = int.from_bytes(ring.setup().extra["event_handles"][0][:8], "little")
        driver.log.clear()
        assert ring.acquire() == 0
        assert driver.log == [("daemon", "sync", ready)]


def test_slot_state_machine(daemon_rt):
    with CudaIpcRing(LAYOUT, 2, device_index=DEVICE, runtime=daemon_rt) as ring:
        a, b = ring.acquire(), ring.acquire()
        assert (a, b, ring.acquire(), ring.leased()) == (0, 1, None, 2)
        ring.publish(a, 1)
        with pytest.raises(TransportError, match="without being filled"):
            ring.publish(a, 1)  # already LEASED
        assert ring.release(a) is True and ring.release(a) is False
        ring.abandon(b)
        assert ring.leased() == 0 and ring.release(99) is False
        with pytest.raises(TransportError, match="length"):
            ring.publish(ring.acquire(), LAYOUT.batch_size + 1)


def test_partial_batch_copies_only_the_used_rows(daemon_rt, driver):
    with CudaIpcRing(LAYOUT, 1, device_index=DEVICE, runtime=daemon_rt) as ring:
        ring.publish(ring.acquire(), 2)
        (copy,) = [e for e in driver.log if e[1] == "copy"]
        label = LAYOUT.tensors[-1]
        assert copy[3] == label.offset + 2 * label.sample_bytes < LAYOUT.slot_bytes


def test_close_reclaims_leased_slots_and_is_idempotent(daemon_rt, driver):
    ring = CudaIpcFactory(daemon_rt).create(LAYOUT, 2, device_index=DEVICE)
    ring.publish(ring.acquire(), 1)  # leased to a client that never releases (it died)
    ring.close()
    ring.close()
    _assert_all_freed(daemon_rt, driver)
    assert ring.release(0) is False and ring.acquire() is None
    with pytest.raises(TransportError, match="closed"):
        ring.host_views(0)


def test_finalizer_frees_an_unclosed_ring(daemon_rt, driver):
    ring = CudaIpcRing(LAYOUT, 2, device_index=DEVICE, runtime=daemon_rt)
    assert daemon_rt.dev_ptrs
    del ring
    gc.collect()
    _assert_all_freed(daemon_rt, driver)


@pytest.mark.parametrize("call", ["malloc", "hostAlloc", "eventCreateWithFlags", "ipcGetMemHandle"])
def test_failed_allocation_frees_what_was_allocated(daemon_rt, driver, call):
    driver.fail[call] = 2
    with pytest.raises(TransportError, match="transport='shm'"):
        CudaIpcRing(LAYOUT, 3, device_index=DEVICE, runtime=daemon_rt)
    _assert_all_freed(daemon_rt, driver)


def test_stuck_stream_is_left_to_the_driver_instead_of_hanging(daemon_rt, driver, caplog):
    ring = CudaIpcRing(LAYOUT, 1, device_index=DEVICE, runtime=daemon_rt, drain_timeout=0.05)
    driver.stuck_streams.update(daemon_rt.streams)
    with caplog.at_level(logging.ERROR, "beton_serve.transport.cuda_ipc"):
        ring.close()
    assert "did not drain" in caplog.text
    assert len(daemon_rt.dev_ptrs) == 1  # not freed: cudaFree would block on the stuck stream


def test_ring_rejects_bad_arguments(daemon_rt):
    with pytest.raises(TransportError, match="at least one slot"):
        CudaIpcRing(LAYOUT, 0, device_index=0, runtime=daemon_rt)
    with pytest.raises(TransportError, match="GPU index"):
        CudaIpcFactory(daemon_rt).create(LAYOUT, 1)


def test_ring_without_cupy_says_what_to_install():
    with pytest.raises(TransportError, match=r"beton-serve\[cuda12\]"):
        CudaIpcRing(LAYOUT, 1, device_index=0)


def test_probe_reports_the_failing_call(daemon_rt, driver):
    assert probe_cuda_ipc(0, runtime=daemon_rt, cross_process=False) == (True, "")
    assert daemon_rt.dev_ptrs == {} and daemon_rt.local_events == {}
    ok, why = probe_cuda_ipc(5, runtime=daemon_rt, cross_process=False)
    assert not ok and "not visible" in why
    driver.fail["ipcGetMemHandle"] = daemon_rt.calls.get("ipcGetMemHandle", 0) + 1
    ok, why = probe_cuda_ipc(0, runtime=daemon_rt, cross_process=False)
    assert not ok and why.startswith("cudaIpcGetMemHandle failed") and "injected" in why
    assert daemon_rt.dev_ptrs == {}  # the probe frees its allocation on failure too
    ok, why = probe_cuda_ipc(0)  # no CuPy on this machine
    assert not ok and "CuPy" in why


def test_receiver_mappings_close_when_the_last_view_dies(daemon_rt, client_rt, driver):
    with CudaIpcRing(LAYOUT, 2, device_index=DEVICE, runtime=daemon_rt) as ring:
        rx = CudaIpcReceiver(
            ring.setup().extra,
            slot_bytes=LAYOUT.slot_bytes,
            device=DEVICE,
            runtime=client_rt,
            stream_of=lambda dev: 5,
            wrap=_client_wrap(client_rt),
        )
        for _ in range(2):
            ring.publish(ring.acquire(), LAYOUT.batch_size)
        kept = rx.tensors(1, _views(3))
        rx.tensors(0, _views(3))
        assert rx.open_slots() == 2 and len(client_rt.opened) == 2
        rx.close()
        gc.collect()
        assert len(client_rt.opened) == 1  # slot 1 is still viewed by `kept`
        assert client_rt.local_events == {}  # events destroyed at close
        del kept
        gc.collect()
        assert client_rt.opened == {} and client_rt.device == 0
        rx.release(0)  # after close: ignored, no error
        with pytest.raises(ValueError, match="closed"):
            rx.tensors(0, _views(1))


def test_receiver_validates_setup_and_views(client_rt):
    with pytest.raises(ValueError, match="malformed"):
        CudaIpcReceiver({"slab_handles": [b"x" * 64]}, slot_bytes=64, device=0, runtime=client_rt)
    extra = {k: [b"\0" * 64] for k in ("slab_handles", "event_handles", "free_event_handles")}
    rx = CudaIpcReceiver(extra, slot_bytes=64, device=0, runtime=client_rt, stream_of=lambda d: 0)
    with pytest.raises(ValueError, match="does not fit"):
        rx.tensors(0, [TensorView(shape=(65,), dtype="uint8", offset=0)])
    with pytest.raises(ValueError, match="outside"):
        rx.tensors(1, [])
    with pytest.raises(TransportUnavailable, match=r"\[ipc_open_failed\].*transport='shm'"):
        rx.tensors(0, [TensorView(shape=(8,), dtype="uint8", offset=0)])
    rx.close()


def test_receiver_without_cupy_is_transport_unavailable():
    extra = {k: [b"\0" * 64] for k in ("slab_handles", "event_handles", "free_event_handles")}
    with pytest.raises(TransportUnavailable) as info:
        CudaIpcReceiver(extra, slot_bytes=64, device=0)
    assert info.value.code == "client_no_cupy"


def test_cuda_facts_and_cached_probe(daemon_rt, driver):
    has_cupy, devices = cuda_facts(daemon_rt)
    assert has_cupy and [(d.index, d.uuid) for d in devices] == [
        (i, u.hex()) for i, u in enumerate(driver.uuids)
    ]
    assert cuda_facts() == (False, ())  # no CuPy here
    calls = []
    probe = CachedProbe(lambda i: calls.append(i) or (i == 0, "" if i == 0 else "refused"))
    assert [probe(0), probe(1), probe(0), probe(1)] == [(True, ""), (False, "refused")] * 2
    assert calls == [0, 1]
