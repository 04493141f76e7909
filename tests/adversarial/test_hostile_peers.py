"""What another local user (a loopback TCP peer, no token) or a misbehaving client can do.

Found by an attack audit (session 48):

* ``Stats`` listed every stream's id, and ``Batches(Start(stream_id=...))`` with another
  client's id took that client's stream over (it then failed with "already being served").
  Peers other than the daemon's user over its Unix socket, and the metrics endpoint, now see a
  public name instead (``daemon._stats.public_stream_id``).
* Two ``Release`` messages for a slot the client did not hold, each with
  ``wait_us = 2**64 - 1``, overflowed the stream's ``client_wait_us`` past uint64: ``Stats``
  failed for every caller (``INTERNAL: Value out of range``) while that stream lived.
* ``Start`` messages sent in a flood (78,000 on one call) queued without bound, each kept until
  the stream closed and each to run as an epoch.
* A client of the daemon's own user truncated its ring's segment in ``/dev/shm`` (or a sharing
  group's arena): the daemon's next access raised SIGBUS and killed it, every stream with it.
  The segments are now guarded as the ``.beton`` mappings are; that stream (or group) fails.
* Raw TCP connections that never spoke HTTP/2 held a descriptor each for about a minute; with
  the soft fd limit, a few hundred left the daemon none for its own clients.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from beton_client import Loader, OrderOption, ServeOptions
from beton_wire.v1 import beton_pb2 as pb
from beton_wire.v1 import beton_pb2_grpc as pb_grpc
from helpers.daemon import daemon_factory, free_port, short_tmp  # noqa: F401
from helpers.requests import int_only_request

pytestmark = pytest.mark.timeout(120)


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
        sid = stub.OpenStream(int_only_request(), timeout=30).stream_id

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


def test_a_release_naming_another_batch_frees_nothing(tcp_daemon) -> None:
    """A ``Release`` names a slot and the batch the client held in it. A stale or replayed one
    (an earlier batch of that slot) freed whatever batch the slot held now, which the daemon
    could then overwrite while the client still read it. Now it frees nothing."""
    import contextlib
    import queue
    import threading

    _, tcp = tcp_daemon
    with grpc.insecure_channel(tcp) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        opened = stub.OpenStream(int_only_request(batch_size=1), timeout=30)
        credits = opened.max_credits
        assert opened.num_batches > credits + 1
        out: queue.Queue[pb.ClientMessage | None] = queue.Queue()
        out.put(pb.ClientMessage(start=pb.Start(stream_id=opened.stream_id, credits=credits)))
        call = stub.Batches(iter(out.get, None), timeout=60)
        got: queue.Queue[pb.BatchReady] = queue.Queue()

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # the cancel at the end
                for msg in call:
                    if msg.WhichOneof("kind") == "batch":
                        got.put(msg.batch)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            held = [got.get(timeout=30) for _ in range(credits)]  # every slot is leased now
            assert [b.batch_index for b in held] == list(range(credits))
            first, other = held[0], held[-1]
            assert first.slot != other.slot
            for wrong in (other.batch_index, first.batch_index + credits):
                out.put(
                    pb.ClientMessage(
                        release=pb.Release(slot=first.slot, batch_index=wrong, wait_us=0)
                    )
                )
            with pytest.raises(queue.Empty):  # nothing was freed: no slot for the next batch
                got.get(timeout=1.5)
            out.put(
                pb.ClientMessage(
                    release=pb.Release(slot=first.slot, batch_index=first.batch_index, wait_us=0)
                )
            )
            nxt = got.get(timeout=30)
            assert (nxt.batch_index, nxt.slot) == (credits, first.slot)
        finally:
            call.cancel()
            out.put(None)
            reader.join(10)


def test_a_flood_of_epoch_starts_ends_only_that_stream(tcp_daemon) -> None:
    d, tcp = tcp_daemon
    with grpc.insecure_channel(tcp) as ch:
        stub = pb_grpc.BetonServeStub(ch)
        sid = stub.OpenStream(int_only_request(), timeout=30).stream_id

        def flood() -> Iterator[pb.ClientMessage]:
            for _ in range(1000):
                yield pb.ClientMessage(start=pb.Start(stream_id=sid, credits=1))
            time.sleep(5)

        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.Batches(flood(), timeout=30):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "epoch starts queued" in (info.value.details() or "")
    served = ServeOptions(server=d.address, spawn=False)
    with Loader("mixed_fields", batch_size=4, serve=served) as ld:  # the daemon serves on
        assert sum(len(b[0]) for b in ld) == 48


def test_the_daemon_raises_its_soft_open_file_limit() -> None:
    import subprocess
    import sys

    code = (
        "import resource as r\n"
        "soft, hard = r.getrlimit(r.RLIMIT_NOFILE)\n"
        "r.setrlimit(r.RLIMIT_NOFILE, (256, hard))\n"
        "from beton_serve.cli._serve import FD_LIMIT_TARGET, _raise_fd_limit\n"
        "_raise_fd_limit()\n"
        "want = FD_LIMIT_TARGET if hard == r.RLIM_INFINITY else min(hard, FD_LIMIT_TARGET)\n"
        "print(r.getrlimit(r.RLIMIT_NOFILE)[0] == want, want > 256)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_raw_connections_that_never_handshake_are_closed(tcp_daemon) -> None:
    import socket

    d, tcp = tcp_daemon
    base = len(os.listdir(f"/proc/{d.pid}/fd"))
    host, port = tcp.rsplit(":", 1)
    raw = [socket.create_connection((host, int(port))) for _ in range(10)]
    try:
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{d.pid}/fd")) >= base + 8  # held, for now
        deadline = time.monotonic() + 20  # the handshake timeout is 5 s
        while len(os.listdir(f"/proc/{d.pid}/fd")) > base + 1:
            assert time.monotonic() < deadline, "raw connections are still held after 20 s"
            time.sleep(0.5)
    finally:
        for s in raw:
            s.close()


_TRUNCATE_OWN_RING = r"""
import glob, os, sys, time
from beton_client import Loader, OrderOption, ServeOptions
address, pid = sys.argv[1], sys.argv[2]
before = set(glob.glob(f"/dev/shm/beton-{pid}-*-ring-*"))
ld = Loader("mixed_fields", batch_size=2, serve=ServeOptions(server=address, spawn=False))
it = iter(ld)
next(it)
mine = sorted(set(glob.glob(f"/dev/shm/beton-{pid}-*-ring-*")) - before)
assert len(mine) == 1, mine
os.truncate(mine[0], 0)
time.sleep(3)  # the daemon goes on decoding into the truncated ring; never read it again
os._exit(0)
"""


def test_a_client_that_truncates_its_ring_fails_alone(daemon_factory, fixtures_dir) -> None:  # noqa: F811
    import subprocess
    import sys

    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    served = ServeOptions(server=d.address, spawn=False)
    with Loader("mixed_fields", batch_size=4, serve=served) as other:
        it = iter(other)
        first = next(it)[0].numpy().copy()  # a copy: a served batch lives until the next one
        out = subprocess.run(
            [sys.executable, "-c", _TRUNCATE_OWN_RING, d.address, str(d.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert d.proc.poll() is None, "the daemon died"
        labels = [first] + [b[0].numpy().copy() for b in it]
    from beton_serve.loader import Loader as InProcess

    with InProcess(str(fixtures_dir / "mixed_fields.beton"), batch_size=4) as ref:
        want = [b[0].numpy().copy() for b in ref]
    assert len(labels) == len(want) == 12
    assert all(np.array_equal(a, b) for a, b in zip(labels, want, strict=True))
    deadline = time.monotonic() + 10
    while d.stats().streams:  # the truncated stream ended too
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "was truncated under the daemon" in d.log() or "closed after" in d.log()


def test_a_truncated_sharing_arena_does_not_kill_the_daemon(daemon_factory, fixtures_dir) -> None:  # noqa: F811
    d = daemon_factory([fixtures_dir / "mixed_fields.beton"])
    served = ServeOptions(server=d.address, spawn=False)

    def make() -> Loader:
        return Loader("mixed_fields", batch_size=4, order=OrderOption.RANDOM, seed=3, serve=served)

    with make() as a, make() as b:
        ia, ib = iter(a), iter(b)
        next(ia), next(ib)
        shares = [p for p in d.shm_files() if "-share-" in p]
        assert shares, d.shm_files()
        for name in shares:
            os.truncate(f"/dev/shm/{name}", 0)
        for it in (ia, ib):  # each reads on, or fails with a clear error; never SIGBUS
            try:
                for _ in it:
                    pass
            except Exception as exc:
                assert type(exc).__name__ in ("TransportError", "PipelineError"), exc
        assert d.proc.poll() is None, "the daemon died"
    with make() as c:  # the daemon serves on
        assert sum(len(x[0]) for x in c) == 48
