# ruff: noqa: F811  (pytest fixtures imported from helpers.daemon are used as parameters)
"""The shm notice channel (beton_wire.notice) against a real daemon: used by default, equal to
the gRPC path, and robust to bad tokens, garbage, a client that closes it and one that never
connects it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from beton_client import Loader, OrderOption
from beton_serve.fields.decoders import IntDecoder, NDArrayDecoder
from beton_serve.transforms import ToTensor
from beton_wire import notice
from beton_wire.limits import MAX_EPOCH
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import SHM, daemon, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

PIPES = {
    "int": [IntDecoder(), ToTensor()],
    "float": None,
    "array": [NDArrayDecoder(), ToTensor()],
    "blob": None,
    "meta": None,
}


def _epochs(loader: Loader, n: int) -> list[tuple[np.ndarray, ...]]:
    out = []
    for _ in range(n):
        for batch in loader:
            out.append((*(t.numpy().copy() for t in batch), loader.last_sample_ids.copy()))
    return out


def _socket_of(d) -> Path:
    names = [n for n in d.shm_files() if "-notice-" in n]
    assert len(names) == 1, names
    return SHM / names[0]


def test_notice_channel_is_used_and_equals_the_grpc_path(daemon, monkeypatch) -> None:
    kw = dict(batch_size=7, pipelines=PIPES, order=OrderOption.RANDOM, seed=5, drop_last=False)
    with Loader("mixed_fields", server=daemon.address, **kw) as fast:
        assert fast._stream is not None and fast._stream.notice is not None
        got_fast = _epochs(fast, 2)
        # The client's waiting time reaches the daemon through the release words (data stall).
        mine = [x for x in daemon.stats().streams if x.stream_id == fast._stream.reply.stream_id]
        assert len(mine) == 1 and mine[0].client_wait_us > 0
    monkeypatch.setattr("beton_client._stream._connect_notices", lambda *a: None)
    with Loader("mixed_fields", server=daemon.address, **kw) as slow:
        assert slow._stream is not None and slow._stream.notice is None
        got_slow = _epochs(slow, 2)
        per_epoch = len(slow)
    assert len(got_fast) == len(got_slow) == 2 * per_epoch
    for a, b in zip(got_fast, got_slow, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    # The last partial batch (50 samples, batch 7) travelled with its true length and ids.
    assert len(got_fast[per_epoch - 1][0]) == 50 % 7


def test_bad_token_and_garbage_are_refused_and_the_daemon_keeps_serving(daemon) -> None:
    path = _socket_of(daemon)
    for record in (notice.hello(b"x" * notice.TOKEN_BYTES), b"\x00" * 5, notice.release(0, 0, 0)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        try:
            s.connect(str(path))
            s.send(record)
            assert s.recv(64) == b""  # the daemon closed it
        finally:
            s.close()
    with Loader("mixed_fields", batch_size=10, pipelines=PIPES, server=daemon.address) as ld:
        assert sum(len(b[0]) for b in ld) == 50


def test_a_client_that_closes_its_notice_channel_loses_its_stream(daemon) -> None:
    ld = Loader("mixed_fields", batch_size=5, pipelines=PIPES, server=daemon.address)
    try:
        it = iter(ld)
        next(it)
        stream_id = ld._stream.reply.stream_id
        assert any(s.stream_id == stream_id for s in daemon.stats().streams)
        ld._stream.notice.close()
        wait_for(lambda: not any(s.stream_id == stream_id for s in daemon.stats().streams), 3.0)
    finally:
        ld.close()
    with Loader("mixed_fields", batch_size=25, pipelines=PIPES, server=daemon.address) as ld2:
        assert sum(len(b[0]) for b in ld2) == 50


def _open_raw(stub, transport: str) -> pb.OpenStreamResponse:
    from beton_client._transport.identity import gather_facts

    ident = gather_facts("cpu", transport).to_dict()["identity"]
    return stub.OpenStream(
        pb.OpenStreamRequest(
            dataset="mixed_fields",
            batch_size=5,
            batches_ahead=3,  # required: 0 is refused (issue 11)
            pipelines=[
                pb.PipelineSpec(name="int", field="int", ops=[pb.OpSpec(name="IntDecoder")]),
                *(pb.PipelineSpec(name=n, field=n, skip=True) for n in PIPES if n != "int"),
            ],
            transport=transport,
            host=pb.HostIdentity(
                boot_id=ident["boot_id"],
                hostname=ident["hostname"],
                uid=ident["uid"],
                pid=ident["pid"],
                ipc_ns=ident["ipc_ns"] or 0,
                has_ipc_ns=ident["ipc_ns"] is not None,
            ),
            capabilities=pb.Capabilities(transports=["shm", "grpc"]),
        ),
        timeout=30,
    )


def test_notices_on_a_stream_without_a_channel_is_invalid_argument(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        reply = _open_raw(stub, "grpc")
        assert reply.transport.kind == "grpc" and not reply.transport.shm.notice_socket
        start = pb.ClientMessage(start=pb.Start(stream_id=reply.stream_id, notices=True))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Batches(iter([start]), timeout=20))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "notice channel" in err.value.details()


@pytest.mark.parametrize("epoch", [MAX_EPOCH + 1, 2**63, 2**64 - 1])
def test_a_start_past_max_epoch_is_invalid_argument(daemon, epoch: int) -> None:
    """A client that skips the checks sends an absurd epoch: the daemon names it
    (``INVALID_ARGUMENT``); from 2**63 on it answered "internal error: OverflowError" (arming
    the lease token). It serves on."""
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        reply = _open_raw(stub, "grpc")
        start = pb.ClientMessage(start=pb.Start(stream_id=reply.stream_id, epoch=epoch))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Batches(iter([start]), timeout=20))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"epoch {epoch} is outside 0..{MAX_EPOCH}" in err.value.details()
    with Loader("mixed_fields", batch_size=25, pipelines=PIPES, server=daemon.address) as ld:
        first = [int(x) for b in ld for x in b[0].reshape(-1)]
        ld.next_epoch = MAX_EPOCH  # the last epoch a Loader starts: SEQUENTIAL, the same values
        assert [int(x) for b in ld for x in b[0].reshape(-1)] == first and len(first) == 50


def test_notices_asked_for_but_never_connected_fail_the_stream(daemon) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        reply = _open_raw(stub, "shm")
        setup = reply.transport.shm
        assert setup.notice_socket and len(setup.notice_token) == notice.TOKEN_BYTES
        assert setup.ids_offset == setup.slot_count * setup.slot_bytes
        start = pb.ClientMessage(start=pb.Start(stream_id=reply.stream_id, notices=True))
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Batches(iter([start]), timeout=30))
        assert "did not connect its notice channel" in err.value.details()
        assert 5 < time.monotonic() - t0 < 25
    wait_for(lambda: not any(s.stream_id == reply.stream_id for s in daemon.stats().streams), 3.0)


def _slow_epoch(ld: Loader, pause: float) -> list[np.ndarray]:
    ids = []
    for _ in ld:
        ids.append(ld.last_sample_ids.copy())
        time.sleep(pause)  # slower than the daemon: its ring fills and it starves
    return ids


def test_a_slow_client_wakes_a_starved_daemon(daemon) -> None:
    kw = dict(batch_size=2, pipelines=PIPES, order=OrderOption.RANDOM, seed=9, drop_last=False)
    with Loader("mixed_fields", server=daemon.address, **kw) as ld:
        assert (
            ld._stream is not None and ld._stream.notice is not None
        )  # releases through the words
        t0 = time.monotonic()
        ids = _slow_epoch(ld, 0.01)
        took = time.monotonic() - t0
    assert sorted(np.concatenate(ids).tolist()) == list(range(50))
    assert took < 25 * 0.01 + 2.0  # no release waited for the back-off timer for long


def test_a_missed_wake_is_rescued_by_the_daemons_timer(daemon, monkeypatch) -> None:
    monkeypatch.setattr("beton_client._transport.shm.NoticeChannel.wake", lambda self: None)
    kw = dict(batch_size=2, pipelines=PIPES, order=OrderOption.RANDOM, seed=9, drop_last=False)
    with Loader("mixed_fields", server=daemon.address, **kw) as ld:
        ids = [_slow_epoch(ld, 0.005) for _ in range(2)]
    for epoch in ids:
        assert sorted(np.concatenate(epoch).tolist()) == list(range(50))
