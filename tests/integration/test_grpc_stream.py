"""Real gRPC servers on 127.0.0.1 (port 0) or a Unix socket streaming framed batches: every
compression, threaded and aio servers, errors, cancellation, bearer token, TLS, mutual TLS, and two
daemons with one dying mid-epoch. Every server is stopped by the test that started it."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from beton_client._security import secure_or_plain_channel
from beton_client._transport.grpc_codec import (
    CHANNEL_OPTIONS,
    BatchStream,
    BufferPool,
    iter_batches,
)
from beton_client._transport.multi import MultiDaemonReader, StreamLink
from beton_client.errors import (
    AuthError,
    BetonClientError,
    ServerUnavailable,
    SpecError,
    TransportError,
)
from beton_serve.errors import SpecError as ServerSpecError
from beton_serve.transport import security as sec
from beton_serve.transport.grpc_codec import (
    SERVER_OPTIONS,
    OutgoingBatch,
    add_batch_stream_handler,
)
from beton_wire.framing import Codec, Compression, OpenRequest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers import tls_certs

TOKEN = "test-token-0123456789"


def make_batch(epoch: int, b: int) -> dict[str, np.ndarray]:
    """A deterministic, partly compressible batch identifying its position."""
    img = np.zeros((6, 24, 24, 3), np.uint8)
    img[:, :12] = (b * 7 + epoch) % 256
    img[:, 12:] = np.random.default_rng([epoch, b]).integers(0, 256, size=(6, 12, 24, 3))
    return {"image": img, "label": np.full(6, b, np.int64), "epoch": np.array([epoch], np.int32)}


def check(batch: Any, epoch: int, b: int) -> None:
    want = make_batch(epoch, b)
    assert (batch.epoch, batch.batch_index) == (epoch, b)
    assert list(batch.arrays) == list(want)
    for k, v in want.items():
        np.testing.assert_array_equal(batch.arrays[k], v)


class Recorder:
    """A producer factory that counts opens, closes and releases."""

    def __init__(self, fn: Callable[[int, int], Any] = make_batch) -> None:
        self.fn = fn
        self.executor = cf.ThreadPoolExecutor(2, thread_name_prefix="beton-test-producer")
        self.opens: list[OpenRequest] = []
        self.closed = 0
        self.produced = 0
        self.released = 0
        self.lock = threading.Lock()

    def __call__(self, req: OpenRequest, ctx: Any) -> Any:
        self.opens.append(req)
        rec = self

        def produce(epoch: int, b: int) -> OutgoingBatch:
            arrays = rec.fn(epoch, b)
            with rec.lock:
                rec.produced += 1

            def release() -> None:
                with rec.lock:
                    rec.released += 1

            return OutgoingBatch(arrays, release)

        class Producer:
            def submit(self, epoch: int, b: int) -> cf.Future:
                return rec.executor.submit(produce, epoch, b)

            def close(self) -> None:
                rec.closed += 1

        return Producer()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def threaded_server(
    factory: Any,
    *,
    address: str = "127.0.0.1:0",
    creds: grpc.ServerCredentials | None = None,
    interceptors: tuple = (),
    allowed: frozenset[Codec] = frozenset(Codec),
    health_service: bool = False,
) -> Iterator[tuple[grpc.Server, str]]:
    pool = cf.ThreadPoolExecutor(8)
    server = grpc.server(pool, options=SERVER_OPTIONS, interceptors=interceptors)
    add_batch_stream_handler(server, factory, allowed_codecs=allowed)
    if health_service:
        hs = health.HealthServicer()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    server.start()
    target = address if address.startswith("unix:") else f"127.0.0.1:{port}"
    try:
        yield server, target
    finally:
        server.stop(None).wait(10)
        pool.shutdown(wait=True)


def read_all(
    channel: grpc.Channel, positions: list[tuple[int, int]], comp: str = "none", **kw: Any
):
    stream = BatchStream(
        channel,
        open_request=OpenRequest(Compression.parse(comp), chunk_bytes=4096),
        pool=BufferPool(4),
        **kw,
    )
    try:
        out: list[tuple[int, int]] = []
        for batch in iter_batches(stream, positions, prefetch=3, timeout=20):
            check(batch, *positions[len(out)])
            out.append((batch.epoch, batch.batch_index))
        return out
    finally:
        stream.close()


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("comp", ["none", "lz4", "zstd:1", "zstd:3"])
def test_threaded_server_streams_every_compression(comp: str) -> None:
    rec = Recorder()
    positions = [(2, b) for b in range(12)] + [(3, 0)]
    try:
        with threaded_server(rec) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                assert read_all(ch, positions, comp) == positions
            assert wait_for(lambda: rec.closed == 1)
        assert rec.opens[0].compression == Compression.parse(comp)
        assert rec.produced == rec.released == len(positions)
    finally:
        rec.shutdown()


def _fails_at_99(epoch: int, b: int) -> dict[str, np.ndarray]:
    if b == 99:
        raise ServerSpecError("batch 99 does not exist")
    return make_batch(epoch, b)


def test_aio_server_streams_and_checks_the_token() -> None:
    rec = Recorder(_fails_at_99)
    try:
        with aio_server(rec, interceptors=[sec.AioBearerTokenInterceptor(TOKEN)]) as target:
            with secure_or_plain_channel(target, token=TOKEN, options=CHANNEL_OPTIONS) as ch:
                positions = [(0, b) for b in range(6)]
                assert read_all(ch, positions, "none") == positions
                assert read_all(ch, positions, "lz4") == positions
                with pytest.raises(SpecError, match="does not exist") as info:
                    read_all(ch, [(0, 99)])
                assert info.value.server_error == "SpecError"
            with secure_or_plain_channel(
                target, token="wrong-token", options=CHANNEL_OPTIONS
            ) as ch:
                with pytest.raises(AuthError):
                    read_all(ch, positions)
    finally:
        rec.shutdown()
    assert rec.closed == 3 and rec.released == 12


def test_unix_socket(tmp_path: Path) -> None:
    rec = Recorder()
    try:
        address = f"unix:{tmp_path / 'beton.sock'}"
        with threaded_server(rec, address=address) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                assert read_all(ch, [(0, 0), (0, 1)]) == [(0, 0), (0, 1)]
    finally:
        rec.shutdown()


def test_compression_not_enabled_is_refused() -> None:
    rec = Recorder()
    try:
        with threaded_server(rec, allowed=frozenset({Codec.NONE})) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                with pytest.raises(SpecError, match="not enabled") as info:
                    read_all(ch, [(0, 0)], "zstd:1")
        assert info.value.code == "INVALID_ARGUMENT"
        assert rec.opens == []
    finally:
        rec.shutdown()


def test_producer_error_reaches_the_client_after_earlier_batches() -> None:
    def fn(epoch: int, b: int) -> dict[str, np.ndarray]:
        if b == 3:
            raise ServerSpecError("batch 3 is cursed; change the pipeline")
        return make_batch(epoch, b)

    rec = Recorder(fn)
    got: list[int] = []
    try:
        with threaded_server(rec) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                stream = BatchStream(ch, pool=BufferPool(4))
                with pytest.raises(SpecError, match="cursed") as info:
                    for batch in iter_batches(stream, [(0, b) for b in range(6)], timeout=20):
                        got.append(batch.batch_index)
                stream.close()
        assert info.value.code == "INVALID_ARGUMENT"
        assert info.value.server_error == "SpecError"
        assert got == [0, 1, 2]
    finally:
        rec.shutdown()


def test_client_cancel_closes_the_producer_and_releases_every_batch() -> None:
    rec = Recorder()
    try:
        with threaded_server(rec) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                stream = BatchStream(ch, pool=BufferPool(12))
                stream.want([(0, b) for b in range(10)])
                check(stream.receive(timeout=20), 0, 0)
                stream.close()
                assert wait_for(lambda: rec.closed == 1)
                assert wait_for(lambda: rec.released == rec.produced)
                with pytest.raises(BetonClientError, match="closed"):
                    stream.want([(0, 11)])
    finally:
        rec.shutdown()


def test_receive_timeout_cancels_a_silent_stream() -> None:
    gate = threading.Event()

    def fn(epoch: int, b: int) -> dict[str, np.ndarray]:
        gate.wait(10)
        return make_batch(epoch, b)

    rec = Recorder(fn)
    try:
        with threaded_server(rec) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                stream = BatchStream(ch)
                stream.want([(0, 0)])
                t0 = time.monotonic()
                with pytest.raises(ServerUnavailable, match="no batch within"):
                    stream.receive(timeout=0.3)
                assert time.monotonic() - t0 < 5
                stream.close()
                gate.set()
    finally:
        gate.set()
        rec.shutdown()


def test_ctrl_c_in_receive_leaves_the_channel_usable_and_no_thread_behind() -> None:
    """A KeyboardInterrupt while ``receive`` waits (Ctrl-C in the training loop) lands in the
    wait on the stream's queue, never inside grpcio's locks: the stream then closes at once, its
    reader thread ends, and a new stream on the same channel works. A later receive after a
    timeout raises again instead of waiting."""
    import signal

    gate = threading.Event()

    def fn(epoch: int, b: int) -> dict[str, np.ndarray]:
        if b == 0:
            gate.wait(10)
        return make_batch(epoch, b)

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "beton-grpc-recv"]

    rec = Recorder(fn)
    try:
        with threaded_server(rec) as (_, target):
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                stream = BatchStream(ch)
                assert len(readers()) == 1
                stream.want([(0, 0)])
                main = threading.main_thread().ident
                timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
                timer.start()
                t0 = time.monotonic()
                with pytest.raises(KeyboardInterrupt):
                    stream.receive(timeout=20)
                timer.join()
                assert time.monotonic() - t0 < 5
                stream.close()
                assert time.monotonic() - t0 < 5
                assert readers() == []
                gate.set()
                again = BatchStream(ch)
                again.want([(0, 1)])
                batch = again.receive(timeout=20)
                assert (batch.epoch, batch.batch_index) == (0, 1)
                want = make_batch(0, 1)
                assert all(np.array_equal(batch.arrays[k], v) for k, v in want.items())
                again.close()
                silent = BatchStream(ch)
                gate.clear()
                silent.want([(0, 0)])
                for _ in range(2):
                    with pytest.raises(ServerUnavailable):
                        silent.receive(timeout=0.2)
                silent.close()
                gate.set()
                assert readers() == []
    finally:
        gate.set()
        rec.shutdown()


def test_bearer_token_required_and_health_exempt() -> None:
    rec = Recorder()
    try:
        with threaded_server(
            rec, interceptors=(sec.BearerTokenInterceptor(TOKEN),), health_service=True
        ) as (_, target):
            for token in (None, "wrong-token"):
                with secure_or_plain_channel(target, token=token, options=CHANNEL_OPTIONS) as ch:
                    with pytest.raises(AuthError) as info:
                        read_all(ch, [(0, 0)])
                    assert info.value.code == "UNAUTHENTICATED"
            with secure_or_plain_channel(target, token=TOKEN, options=CHANNEL_OPTIONS) as ch:
                assert read_all(ch, [(0, 0), (0, 1)]) == [(0, 0), (0, 1)]
            with grpc.insecure_channel(target) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=10
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert len(rec.opens) == 1  # refused calls never reached the daemon
    finally:
        rec.shutdown()


needs_certs = pytest.mark.skipif(
    not tls_certs.available(), reason="needs the cryptography package or the openssl command"
)


@needs_certs
def test_tls_with_token(tmp_path: Path) -> None:
    files = tls_certs.make_tls_files(tmp_path)
    creds = sec.server_credentials(
        sec.TlsConfig(cert_file=files.server_cert, key_file=files.server_key)
    )
    rec = Recorder()
    try:
        with threaded_server(
            rec, creds=creds, interceptors=(sec.BearerTokenInterceptor(TOKEN),)
        ) as (_, target):
            kw: dict[str, Any] = {"options": CHANNEL_OPTIONS}
            with secure_or_plain_channel(target, ca_file=files.ca_cert, token=TOKEN, **kw) as ch:
                assert read_all(ch, [(1, 0), (1, 1)], "lz4") == [(1, 0), (1, 1)]
            with secure_or_plain_channel(target, ca_file=files.ca_cert, **kw) as ch:
                with pytest.raises(BetonClientError) as info:
                    read_all(ch, [(1, 0)])
                assert info.value.code == "UNAUTHENTICATED"
            # a client that does not trust the daemon's CA never completes the handshake
            with secure_or_plain_channel(target, ca_file=files.other_ca_cert, **kw) as ch:
                with pytest.raises(ServerUnavailable):
                    read_all(ch, [(1, 0)])
            # a plain-text client cannot talk to the TLS port
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                with pytest.raises(ServerUnavailable):
                    read_all(ch, [(1, 0)])
    finally:
        rec.shutdown()


@needs_certs
def test_mutual_tls(tmp_path: Path) -> None:
    files = tls_certs.make_tls_files(tmp_path)
    creds = sec.server_credentials(
        sec.TlsConfig(
            cert_file=files.server_cert, key_file=files.server_key, client_ca_file=files.ca_cert
        )
    )
    rec = Recorder()
    try:
        with threaded_server(rec, creds=creds) as (_, target):
            kw: dict[str, Any] = {"ca_file": files.ca_cert, "options": CHANNEL_OPTIONS}
            with secure_or_plain_channel(
                target, cert_file=files.client_cert, key_file=files.client_key, **kw
            ) as ch:
                assert read_all(ch, [(0, 5)]) == [(0, 5)]
            with secure_or_plain_channel(target, **kw) as ch:  # no client certificate
                with pytest.raises(ServerUnavailable):
                    read_all(ch, [(0, 5)])
        assert len(rec.opens) == 1
    finally:
        rec.shutdown()


def test_two_daemons_one_dies_mid_epoch() -> None:
    recs = [Recorder(), Recorder()]
    lost: list[int] = []
    n = 16
    try:
        with threaded_server(recs[0]) as (_, t0), threaded_server(recs[1]) as (s1, t1):
            chans = [grpc.insecure_channel(t, options=CHANNEL_OPTIONS) for t in (t0, t1)]
            streams = [BatchStream(ch, pool=BufferPool(4)) for ch in chans]
            try:
                reader = MultiDaemonReader(
                    [StreamLink(s, timeout=20) for s in streams],
                    credits_per_daemon=2,
                    on_daemon_lost=lambda i, e: lost.append(i),
                )
                got: list[int] = []
                for batch in reader.iter_epoch(4, n):
                    check(batch, 4, len(got))
                    got.append(batch.batch_index)
                    if batch.release is not None:
                        batch.release()
                    if len(got) == 5:
                        s1.stop(None)  # daemon 1 goes away mid-epoch
                assert got == list(range(n))
                assert lost == [1]
                assert reader.alive == (0,)
            finally:
                for s in streams:
                    s.close()
                for ch in chans:
                    ch.close()
        # daemon 1 served only what was asked before it died; daemon 0 made everything else
        assert recs[1].produced <= 5
        assert recs[0].produced >= n - recs[1].produced
    finally:
        for r in recs:
            r.shutdown()


@pytest.mark.parametrize(
    "messages",
    [[b"garbage"], [b"BTB1" + bytes(60)], "out-of-order"],
    ids=["garbage", "bad-header", "out-of-order"],
)
def test_malformed_stream_from_a_daemon_is_a_transport_error(messages: Any) -> None:
    from beton_wire.framing import BatchEncoder

    if messages == "out-of-order":
        messages = list(BatchEncoder().encode(0, 9, make_batch(0, 9)))

    def rogue(request_iterator: Iterator[bytes], ctx: Any) -> Iterator[bytes]:
        next(request_iterator)
        yield from messages

    pool = cf.ThreadPoolExecutor(2)
    server = grpc.server(pool, options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "beton.v1.BatchStream", {"Stream": grpc.stream_stream_rpc_method_handler(rogue)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            stream = BatchStream(ch)
            stream.want([(0, 0)])
            with pytest.raises(TransportError, match=r"malformed|expected"):
                stream.receive(timeout=10)
            stream.close()
    finally:
        server.stop(None).wait(10)
        pool.shutdown(wait=True)


@contextlib.contextmanager
def aio_server(factory: Any, interceptors: list | None = None) -> Iterator[str]:
    """A grpc.aio server with the batch method on 127.0.0.1, on its own loop thread; stopped
    and its thread joined on exit."""
    started = threading.Event()
    state: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
            add_batch_stream_handler(server, factory)
            state["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            state["stop"] = asyncio.Event()
            state["loop"] = asyncio.get_running_loop()
            started.set()
            await state["stop"].wait()
            await server.stop(None)

        asyncio.run(main())

    t = threading.Thread(target=run, name="beton-test-aio-server")
    t.start()
    try:
        assert started.wait(10)
        yield f"127.0.0.1:{state['port']}"
    finally:
        if "loop" in state:
            state["loop"].call_soon_threadsafe(state["stop"].set)
        t.join(10)
    assert not t.is_alive()


@contextlib.contextmanager
def either_server(kind: str, factory: Any) -> Iterator[str]:
    if kind == "aio":
        with aio_server(factory) as target:
            yield target
    else:
        with threaded_server(factory) as (_, target):
            yield target


def _raw_call(ch: grpc.Channel, wants: list[list[tuple[int, int]]], hold: threading.Event):
    """The batch method called with raw requests: OPEN, then ``wants``, then nothing more
    until ``hold`` is set (the call stays open, as a client that never reads)."""
    from beton_client._transport.grpc_codec import DEFAULT_METHOD_PATH
    from beton_wire.framing import WantRequest

    def requests() -> Iterator[bytes]:
        yield OpenRequest(Compression.parse("none"), chunk_bytes=4096).to_bytes()
        for items in wants:
            yield WantRequest(tuple(items)).to_bytes()
        hold.wait(30)

    call = ch.stream_stream(DEFAULT_METHOD_PATH, request_serializer=None)
    return call(requests())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["threaded", "aio"])
def test_a_client_that_wants_more_than_it_reads_ends_its_call_and_leaks_nothing(
    kind: str,
) -> None:
    from beton_wire.limits import MAX_WANTS_IN_FLIGHT

    rec = Recorder()
    hold = threading.Event()
    n = MAX_WANTS_IN_FLIGHT // 2 + 10
    try:
        with either_server(kind, rec) as target:
            with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                # Two WANTs that fit, then one over the limit; nothing is read until then.
                flood = [[(0, b) for b in range(n)], [(1, b) for b in range(n)]]
                responses = _raw_call(ch, flood, hold)
                received = 0
                with pytest.raises(grpc.RpcError) as info:
                    for _ in responses:
                        received += 1
                hold.set()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"more than {MAX_WANTS_IN_FLIGHT} batches wanted" in info.value.details()
                assert received < 2 * n  # ended before answering every WANT
                assert wait_for(lambda: rec.closed == 1)
                assert wait_for(lambda: rec.released == rec.produced)
                # The server serves the next call as before.
                positions = [(0, b) for b in range(5)]
                assert read_all(ch, positions) == positions
    finally:
        hold.set()
        rec.shutdown()


@pytest.mark.timeout(60)
def test_a_client_that_cancels_mid_write_is_logged_at_info_not_as_a_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO")
    # 1 MiB batches: the daemon is blocked in a write (HTTP/2's window full) when the client goes.
    rec = Recorder(lambda epoch, b: {"image": np.full(1 << 20, b % 256, np.uint8)})
    hold = threading.Event()
    try:
        with aio_server(rec) as target:
            for _ in range(3):
                with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
                    responses = _raw_call(ch, [[(0, b) for b in range(100)]], hold)
                    for _, _msg in zip(range(5), responses, strict=False):
                        pass
                    time.sleep(0.3)  # the daemon writes until the window is full
                    responses.cancel()
            assert wait_for(lambda: rec.closed == 3)
            assert wait_for(lambda: rec.released == rec.produced)
    finally:
        hold.set()
        rec.shutdown()
    faults = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert not faults, [r.getMessage()[:200] for r in faults]


def test_the_in_flight_bound_counts_what_was_sent_not_what_was_ever_wanted() -> None:
    from beton_serve.transport.grpc_codec import _InFlight
    from beton_wire.framing import FramingError
    from beton_wire.limits import MAX_WANTS_IN_FLIGHT

    flight = _InFlight()
    for _ in range(10):  # a long call: ten times the bound wanted, each sent before more
        flight.add(MAX_WANTS_IN_FLIGHT)
        for _ in range(MAX_WANTS_IN_FLIGHT):
            flight.sent()
    flight.add(MAX_WANTS_IN_FLIGHT)
    with pytest.raises(FramingError, match="batches wanted and not yet received"):
        flight.add(1)
    assert flight.error is not None
