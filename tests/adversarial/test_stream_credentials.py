"""A stream's id is its credential; what one client reports cannot break another's view.

Found by an attack audit (session 48), from a loopback TCP peer with no token:

* ``Stats`` listed every stream's id, and ``Batches(Start(stream_id=...))`` with another
  client's id took that client's stream over (it then failed with "already being served").
  Peers other than the daemon's user over its Unix socket, and the metrics endpoint, now see a
  public name instead (``daemon._stats.public_stream_id``).
* Two ``Release`` messages for a slot the client did not hold, each with
  ``wait_us = 2**64 - 1``, overflowed the stream's ``client_wait_us`` past uint64: ``Stats``
  failed for every caller (``INTERNAL: Value out of range``) while that stream lived.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from beton_client import Loader, ServeOptions
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def _open_request() -> pb.OpenStreamRequest:
    return pb.OpenStreamRequest(
        dataset="mixed_fields",
        batch_size=4,
        batches_ahead=2,
        pipelines=[
            pb.PipelineSpec(name="int", ops=[pb.OpSpec(name="IntDecoder", params_json="{}")]),
            *(pb.PipelineSpec(name=n, skip=True) for n in ("float", "array", "blob", "meta")),
        ],
        host=pb.HostIdentity(pid=os.getpid(), uid=os.getuid()),
    )


@pytest.fixture
def tcp_daemon(daemon_factory, fixtures_dir: Path) -> Iterator[tuple[object, str]]:  # noqa: F811
    port = free_port()
    d = daemon_factory(
        [fixtures_dir / "mixed_fields.beton"], args=["--listen", f"127.0.0.1:{port}"]
    )
    yield d, f"127.0.0.1:{port}"


def test_another_peer_sees_public_names_and_cannot_claim_a_stream(tcp_daemon) -> None:
    d, tcp = tcp_daemon
    served = ServeOptions(server=d.address, spawn=False, transport="shm")
    with Loader("mixed_fields", batch_size=4, serve=served) as victim:
        (owner_row,) = d.stats().streams
        (public_row,) = d.stats(tcp).streams
        assert public_row.stream_id != owner_row.stream_id
        assert public_row.stream_id.startswith("p") and len(public_row.stream_id) == 16
        assert public_row.batches_sent == owner_row.batches_sent  # the same stream, renamed
        assert d.stats(tcp).streams[0].stream_id == public_row.stream_id  # stable

        with grpc.insecure_channel(tcp) as ch:
            stub = pb_grpc.BetonServeStub(ch)

            def start() -> Iterator[pb.ClientMessage]:
                yield pb.ClientMessage(start=pb.Start(stream_id=public_row.stream_id, credits=1))

            with pytest.raises(grpc.RpcError) as info:
                next(stub.Batches(start(), timeout=10))
            assert "unknown stream" in (info.value.details() or "")
        # The victim reads its epoch as if nothing happened.
        assert sum(len(b[0]) for b in victim) == 48


def test_metrics_show_public_stream_names(daemon_factory, fixtures_dir: Path) -> None:  # noqa: F811
    import urllib.request

    port = free_port()
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"], args=["--metrics-port", str(port)])
    served = ServeOptions(server=d.address, spawn=False)
    with Loader("mixed_fields", batch_size=4, serve=served) as ld:
        next(iter(ld))
        (row,) = d.stats().streams
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    assert 'stream="p' in text
    assert row.stream_id not in text


def test_absurd_release_waits_do_not_break_stats(tcp_daemon) -> None:
    d, tcp = tcp_daemon
    with grpc.insecure_channel(tcp) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        sid = stub.OpenStream(_open_request(), timeout=30).stream_id

        def messages() -> Iterator[pb.ClientMessage]:
            yield pb.ClientMessage(start=pb.Start(stream_id=sid, credits=1))
            for slot in (4000, 4000, 0, 1):  # two it does not hold, then its own
                yield pb.ClientMessage(
                    release=pb.Release(slot=slot, batch_index=0, wait_us=2**64 - 1)
                )
            time.sleep(1.5)

        call = stub.Batches(messages(), timeout=20)
        assert next(call).WhichOneof("kind") is not None
        time.sleep(0.5)
        for address in (None, tcp):  # every caller's Stats still answers
            (row,) = d.stats(address).streams
            assert 0 <= row.client_wait_us <= 2 * 3600 * 10**6  # at most an hour per release
        call.cancel()
