# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""How the grpc and cuda_ipc transports are wired into the daemon and the Loader (issue 5).

On CPU: the cuda_ipc setup travels daemon ring -> OpenStream reply -> client receiver (fake CUDA
runtime); negotiation through a real daemon gives a CUDA-wanting client on a CPU machine shm with
the reason; the daemon never gathers CUDA facts for CPU clients; grpc's host ring and compression
allow-list.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
from beton_client import Loader
from beton_client._loader import RECEIVERS
from beton_client._transport.cuda_ipc_slots import CudaIpcSlotReceiver, make_cuda_ipc_receiver
from beton_client._transport.grpc_receiver import SAMPLE_IDS as CLIENT_SAMPLE_IDS
from beton_client._transport.grpc_receiver import GrpcSetupInfo
from beton_client._transport.identity import gather_facts
from beton_client._transport.shm import TensorInfo
from beton_client.errors import SpecError as ClientSpecError
from beton_client.errors import TransportError as ClientTransportError
from beton_serve.daemon import SAMPLE_IDS, StreamOpened
from beton_serve.errors import ConfigError, SpecError
from beton_serve.rpc._convert import opened_message
from beton_serve.transforms import ToDevice, ToTensor
from beton_serve.transport.base import SlotTransport
from beton_serve.transport.cuda_ipc import CudaIpcRing
from beton_serve.transport.grpc_ring import BATCH_METHOD, GrpcFactory, HostRing, parse_codecs
from beton_wire.framing import Codec
from beton_wire.slots import slot_layout
from helpers.daemon import daemon_factory, short_tmp  # noqa: F401
from helpers.fake_cuda import FakeDriver, FakeRuntime

LAYOUT = slot_layout([("image", (4, 5, 3), "uint8"), ("label", (), "int64")], batch_size=6)


def _opened(setup) -> StreamOpened:
    return StreamOpened(
        stream_id="s1",
        outputs=(),
        setup=setup,
        rejected=(),
        num_batches=3,
        batch_size=6,
        num_samples=18,
        plan_cached=False,
        max_credits=2,
    )


def test_every_transport_has_a_receiver_and_is_announced() -> None:
    assert {"shm", "grpc", "cuda_ipc"} <= set(RECEIVERS)


def test_cuda_ipc_setup_travels_through_the_reply_to_the_receiver() -> None:
    driver = FakeDriver()
    daemon_rt, client_rt = FakeRuntime(driver, "daemon"), FakeRuntime(driver, "client")
    ring = CudaIpcRing(LAYOUT, 2, device_index=1, runtime=daemon_rt)
    reply = opened_message(_opened(ring.setup()))
    c = reply.transport.cuda_ipc
    assert reply.transport.kind == "cuda_ipc"
    assert c.device_uuid == driver.uuids[1].hex() and c.owner_pid > 0
    assert len(c.free_event_handles) == len(c.event_handles) == len(c.slab_handles) == 2

    def wrap(mapping, view, device, stream):
        raw = client_rt.device_bytes(mapping.ptr, mapping.nbytes)
        count = int(np.prod(view.shape))
        return raw[view.offset :].view(np.dtype(view.dtype))[:count].reshape(view.shape)

    rx = make_cuda_ipc_receiver(
        reply.transport, runtime=client_rt, stream_of=lambda dev: 5, wrap=wrap
    )
    assert isinstance(rx, CudaIpcSlotReceiver) and rx.receiver.device == 1  # fallback: daemon's
    slot = ring.acquire()
    assert slot is not None
    image, label = ring.host_views(slot)
    image[:] = np.arange(image.size, dtype=np.uint8).reshape(image.shape)
    label[:] = np.arange(6) * 7
    ring.publish(slot, 6)
    infos = [
        TensorInfo(t.name, (6, *t.shape), t.dtype, t.offset, t.sample_bytes * 6)
        for t in LAYOUT.tensors
    ]
    got = rx.arrays(slot, infos)
    np.testing.assert_array_equal(got[0], image)
    np.testing.assert_array_equal(got[1], label)
    rx.release(slot)  # records the free event the daemon waits on
    free_ev = int.from_bytes(bytes(c.free_event_handles[slot])[:8], "little")
    assert driver.events[free_ev]["records"] == 1
    assert ring.release(slot)
    del got
    rx.close()
    ring.close()
    gc.collect()
    assert client_rt.opened == {}


def test_grpc_setup_names_the_method_chunks_and_compression() -> None:
    ring = GrpcFactory(chunk_bytes=1 << 20).create(LAYOUT, 3)
    assert isinstance(ring, SlotTransport)
    reply = opened_message(_opened(ring.setup()))
    info = GrpcSetupInfo.from_setup(reply.transport)
    assert (info.method, info.chunk_bytes, info.compression) == (BATCH_METHOD, 1 << 20, "")
    assert SAMPLE_IDS == CLIENT_SAMPLE_IDS
    with pytest.raises(ClientTransportError):
        info.arrays(0, [])


def test_host_ring_slot_states() -> None:
    ring = HostRing(LAYOUT, 2)
    a, b = ring.acquire(), ring.acquire()
    assert (a, b, ring.acquire()) == (0, 1, None)
    assert a is not None and b is not None
    ring.host_views(a)[0][:] = 9
    ring.publish(a, 3)
    assert ring.leased() == 2 and not ring.release(b)  # b is filling, not leased
    ring.abandon(b)
    assert ring.release(a) and ring.leased() == 0
    assert ring.nbytes() == 2 * LAYOUT.slot_bytes
    ring.close()
    assert ring.acquire() is None and ring.nbytes() == 0


def test_compression_allow_list() -> None:
    f = GrpcFactory(allowed_codecs=parse_codecs(["lz4"]))
    assert f.check_compression("") == "" and f.check_compression("none") == ""
    assert f.check_compression("LZ4") == "lz4"
    with pytest.raises(SpecError, match="not enabled"):
        f.check_compression("zstd:3")
    with pytest.raises(SpecError):
        f.check_compression("brotli")
    assert parse_codecs([]) == frozenset({Codec.NONE})
    with pytest.raises(ConfigError):
        parse_codecs(["gzip"])


@pytest.mark.slow
def test_cuda_wanting_cpu_client_falls_back_to_shm_with_the_reason(
    daemon_factory, fixtures_dir: Path
) -> None:
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    pipes: dict = {"int": None, "float": None, "array": None, "blob": None, "meta": None}
    with Loader("mixed_fields", 8, server=d.address) as cpu:
        assert cpu.chosen_transport == "shm" and cpu.transport_rejections == []
    assert "cuda facts" not in d.log()  # a CPU client never makes the daemon touch CUDA
    from beton_serve.fields.decoders import IntDecoder

    pipes["int"] = [IntDecoder(), ToTensor(), ToDevice("cuda:0")]
    if not gather_facts("cuda:0").cuda_devices:
        # A client without that GPU is refused before it asks the daemon (issue 11): its first
        # batch could never reach the device.
        for transport in ("auto", "cuda_ipc"):
            with pytest.raises(ClientSpecError, match="sees no CUDA device; install a CUDA"):
                Loader("mixed_fields", 8, server=d.address, pipelines=pipes, transport=transport)
        assert "cuda facts" not in d.log()
        return
    with Loader("mixed_fields", 8, server=d.address, pipelines=pipes) as gpu:
        assert gpu.chosen_transport == "shm"
        codes = [(t, c) for t, c, _ in gpu.transport_rejections]
        assert codes and codes[0][0] == "cuda_ipc"
        assert codes[0][1] in ("client_no_cuda", "client_no_cupy", "daemon_no_cupy")
    log = d.log()
    assert "cuda facts gathered" in log and "fallback" in log and "cuda_ipc rejected" in log
    with pytest.raises(ClientTransportError):
        Loader("mixed_fields", 8, server=d.address, pipelines=pipes, transport="cuda_ipc")


def test_loader_refuses_several_daemons_over_shm() -> None:
    from beton_client.errors import SpecError as ClientSpecError

    with pytest.raises(ClientSpecError, match="grpc"):
        Loader("x", 4, server=["127.0.0.1:1", "127.0.0.1:2"], transport="shm", spawn=False)


class _FakeStub:
    """OpenStream answers cuda_ipc first, then shm; Batches is an empty call."""

    def __init__(self) -> None:
        self.transports: list[str] = []

    def OpenStream(self, req, timeout=None):
        from beton_wire.v1 import beton_pb2 as pb

        self.transports.append(req.transport)
        reply = pb.OpenStreamResponse(stream_id=f"s{len(self.transports)}", num_batches=2)
        reply.transport.kind = "cuda_ipc" if len(self.transports) == 1 else "shm"
        return reply

    def Batches(self, requests):
        class Call:
            def __iter__(self):
                return self

            def __next__(self):
                raise StopIteration

            def cancel(self) -> None:
                pass

        return Call()


class _NullReceiver:
    kind = "shm"
    closed = False

    def arrays(self, slot, tensors):
        return []

    def release(self, slot) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_cuda_ipc_unusable_in_the_client_reopens_over_shm(monkeypatch, caplog) -> None:
    from beton_client import _loader
    from beton_client._transport.cuda_ipc import TransportUnavailable

    stub = _FakeStub()

    def no_cupy(setup):
        raise TransportUnavailable("client_no_cupy", "CuPy is not installed in the trainer")

    monkeypatch.setattr(_loader.pb_grpc, "BetonServeStub", lambda channel: stub)
    # No daemon: the fake stub answers, so the absent socket is not refused before it.
    monkeypatch.setattr("beton_client._security.check_unix_target", lambda target, owner: None)
    monkeypatch.setitem(_loader.RECEIVERS, "cuda_ipc", no_cupy)
    monkeypatch.setitem(_loader.RECEIVERS, "shm", lambda setup: _NullReceiver())
    with caplog.at_level("WARNING", logger="beton_client"):
        ld = Loader("ds", 4, server="unix:///nonexistent/beton.sock", spawn=False)
    try:
        assert stub.transports == ["auto", "shm"]
        assert ld.chosen_transport == "shm"
        assert [(t, c) for t, c, _ in ld.transport_rejections] == [("cuda_ipc", "client_no_cupy")]
        assert "falling back to shm" in caplog.text and "CuPy is not installed" in caplog.text
        iter(ld)  # the same request next epoch: no re-open, no second fallback
        assert stub.transports == ["auto", "shm"]
    finally:
        ld.close()
