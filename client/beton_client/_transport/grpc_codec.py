"""The client side of the remote (gRPC) batch stream: send credits, receive framed batches.

The wire format is :mod:`beton_wire.framing`; the daemon side is
``beton_serve.transport.grpc_codec`` (never imported from here). One :class:`BatchStream` is one
bidirectional call on a *synchronous* ``grpc.Channel``::

    stream = BatchStream(channel, open_request=OpenRequest(Compression.parse("lz4")))
    stream.want([(epoch, 0), (epoch, 1)])     # one credit per batch, answered in this order
    batch = stream.receive(timeout=30)        # DecodedBatch; arrays are views into a pool buffer
    batch.release()                           # buffer back to the pool (the Loader does this when
                                              # the next batch is requested)
    stream.close()

    for batch in iter_batches(stream, positions, prefetch=2): ...   # keeps `prefetch` credits out

Memory is bounded by credits: at most ``outstanding`` batches are in flight, each decoded into a
buffer from a :class:`BufferPool` (created with room for prefetch + 1 buffers), plus HTTP/2's
flow-control window inside grpcio.

Errors (``beton_client.errors``): every ``grpc.RpcError`` goes through ``from_rpc_error``
(UNAUTHENTICATED -> ``AuthError``, INVALID_ARGUMENT -> ``SpecError``, ...). A lost daemon
(UNAVAILABLE, CANCELLED, a receive timeout, the stream ending early) is ``ServerUnavailable``, a
``ConnectionError``, which is what the multi-daemon logic (``_transport.multi``) treats as
"reassign this daemon's batches". A malformed or out-of-order message from the daemon raises
``TransportError`` (the framing error is its message).

API::

    CHANNEL_OPTIONS; DEFAULT_METHOD_PATH
    BufferPool(max_buffers) .acquire(nbytes) .give_back(buf)
    BatchStream(channel, *, open_request=OpenRequest(), method=DEFAULT_METHOD_PATH,
                max_batch_bytes=DEFAULT_MAX_BATCH_BYTES, metadata=(), pool=None)
        .want(items) .receive(timeout=None) -> DecodedBatch .outstanding .close()
    iter_batches(stream, positions, *, prefetch=2, timeout=None) -> Iterator[DecodedBatch]

Threading: a BatchStream is used by one thread. grpcio consumes the request iterator on its own
thread, and a ``beton-grpc-recv`` thread of the stream reads the call's messages into a queue;
:meth:`BatchStream.close` ends both (it cancels the call and joins the reader). The thread that
uses the stream therefore never waits inside grpcio: it waits on the queue. grpcio's Python layer
is not safe against asynchronous exceptions: a ``KeyboardInterrupt`` (Ctrl-C in the training
loop) that lands between one of its locks' acquire and the block that releases it leaves the
lock held, and every later call on the channel, the cancel included, hangs. A wait on the queue
can be interrupted anywhere (no message is lost inside the queue). A receive timeout is the
queue's own timeout, and cancels the call. ``receive`` raises at once when the stream is closed
or the interpreter is shutting down (issue 11: nothing can be waited for then).
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
from beton_wire.framing import (
    DEFAULT_MAX_BATCH_BYTES,
    MAX_CHUNK_BYTES,
    BatchDecoder,
    DecodedBatch,
    FramingError,
    OpenRequest,
    WantRequest,
)
from numpy.typing import NDArray

from beton_client.errors import BetonClientError, ServerUnavailable, TransportError, from_rpc_error

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_METHOD_PATH",
    "BatchStream",
    "BufferPool",
    "iter_batches",
]

DEFAULT_METHOD_PATH = "/beton.v1.BatchStream/Stream"
_MSG_LIMIT = MAX_CHUNK_BYTES + MAX_CHUNK_BYTES // 64 + 64 * 1024
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", _MSG_LIMIT),
    ("grpc.max_send_message_length", _MSG_LIMIT),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)
"""Options for a channel that carries batch streams: message limits above the largest chunk and
keepalive, so a vanished daemon surfaces as UNAVAILABLE instead of a hang."""

_SENTINEL = object()
#: The reader's mark: the call ended without an error (the daemon ended the stream).
_END = object()
#: The mark of a call that ``receive`` cancelled on its timeout.
_CANCELLED_BY_DEADLINE = object()
#: Seconds :meth:`BatchStream.close` waits for the daemon to end a call that never delivered
#: anything (see there).
CLOSE_WAIT_S = 1.0


class BufferPool:
    """Recycles destination buffers for decoded batches.

    :meth:`give_back` takes no lock: a batch's ``release`` also runs from finalizers (an epoch
    dropped without ``close``), and the garbage collector may run one on this thread while it is
    inside :meth:`acquire`'s locked section. A returned buffer waits in a deque (whose append is
    atomic) until the next :meth:`acquire` takes it in.

    Args:
        max_buffers: how many buffers may exist at once (the stream's credits + the one the
            consumer holds). Asking for more is a bug in the caller and raises ``RuntimeError``.
    """

    def __init__(self, max_buffers: int) -> None:
        if max_buffers < 1:
            raise ValueError("max_buffers must be >= 1")
        self.max_buffers = max_buffers
        self._free: list[NDArray[np.uint8]] = []
        self._returned: collections.deque[NDArray[np.uint8]] = collections.deque()
        self._count = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> NDArray[np.uint8]:
        """A 1-D uint8 buffer of at least ``nbytes``; reuses the smallest free one that fits."""
        with self._lock:
            while self._returned:
                back = self._returned.popleft()
                if not any(b is back for b in self._free):
                    self._free.append(back)
            fits = [b for b in self._free if b.size >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.size)
                self._free = [b for b in self._free if b is not buf]
                return buf
            if self._count >= self.max_buffers:
                if not self._free:
                    raise RuntimeError(
                        f"all {self.max_buffers} batch buffers are in use; release a batch first"
                    )
                self._free.pop(0)  # too small for this batch: replace it
                self._count -= 1
            self._count += 1
        return np.empty(nbytes, np.uint8)

    def give_back(self, buf: NDArray[np.uint8]) -> None:
        """Return ``buf`` for reuse (any thread, any time, including a finalizer; see above)."""
        self._returned.append(buf)


def _requests_of(requests: queue.SimpleQueue[Any]) -> Iterator[bytes]:
    """A call's request iterator: the queued messages, until ``_SENTINEL``."""
    while True:
        item = requests.get()
        if item is _SENTINEL:
            return
        yield item


def _read_call(call: Any, inbox: queue.SimpleQueue[Any], received: threading.Event) -> None:
    """The ``beton-grpc-recv`` thread: move the call's messages into ``inbox``, then ``_END``
    or the call's ``RpcError`` (a cancel, a lost daemon, the daemon's error status).

    The ``RpcError`` a call raises is the call object itself, and its traceback's frames (gRPC's
    ``__next__``, this function) hold the call: a reference cycle that kept the stream, and its
    batch buffers, until a full garbage collection. The traceback is dropped (it shows only
    gRPC's iteration; the error's code and details say what happened). A bug's traceback is
    kept, and this frame lets go of the inbox that holds it.
    """
    try:
        for msg in call:
            received.set()
            inbox.put(msg)
        inbox.put(_END)
    except BaseException as err:  # an RpcError, or a bug: the receiving thread raises it
        if isinstance(err, grpc.RpcError):
            err.with_traceback(None)
        inbox.put(err)
        del inbox, call  # the traceback keeps this frame, and so whatever it still refers to


class _Allocator:
    """A stream decoder's ``allocate``: buffers from the pool, the last one remembered.

    Not a bound method of the stream: the decoder would then hold the stream that holds it, a
    reference cycle that kept the stream's buffers until a full garbage collection.
    """

    __slots__ = ("last", "pool")

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.last: NDArray[np.uint8] | None = None

    def __call__(self, nbytes: int) -> NDArray[np.uint8]:
        buf = self.last = self.pool.acquire(nbytes)
        return buf


class BatchStream:
    """One bidirectional batch call (see the module docstring).

    Args:
        channel: a synchronous channel created with :data:`CHANNEL_OPTIONS` (and credentials).
        open_request: compression, chunk size and the daemon's opaque stream payload.
        method: the full method path registered by the daemon.
        max_batch_bytes: the largest batch this client accepts (from the open-stream reply); a
            header above it is rejected before allocating.
        metadata: call metadata, e.g. ``(("authorization", "Bearer ..."),)``.
        pool: destination buffers; default: a pool of 8.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        open_request: OpenRequest | None = None,
        method: str = DEFAULT_METHOD_PATH,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        metadata: Sequence[tuple[str, str]] = (),
        pool: BufferPool | None = None,
    ) -> None:
        self.open_request = open_request or OpenRequest()
        self._pool = pool or BufferPool(8)
        self._allocator = _Allocator(self._pool)
        self._decoder = BatchDecoder(
            max_batch_bytes=max_batch_bytes,
            allowed_codecs={self.open_request.compression.codec},
            allocate=self._allocator,
        )
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests.put(self.open_request.to_bytes())
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._closed = False
        #: Set by the reader when a message arrived: the daemon's handler runs (see close).
        self._received = threading.Event()
        #: What the reader took from the call: messages, then _END or the call's RpcError.
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: The call's end (_END or its RpcError), once the reader reported it: later receives
        #: raise the same.
        self._end: Any = None
        stub = channel.stream_stream(method)  # no serializers: bytes in, bytes out
        # The request iterator and the reader thread's target are module functions, not
        # methods: the call holds its iterator until it ends, and a running thread must not
        # keep the stream alive either.
        self._call = stub(_requests_of(self._requests), metadata=tuple(metadata))
        self._reader = threading.Thread(
            target=_read_call,
            args=(self._call, self._inbox, self._received),
            name="beton-grpc-recv",
            daemon=True,
        )
        try:
            self._reader.start()
        except BaseException:
            self._call.cancel()
            raise

    @property
    def outstanding(self) -> int:
        """Batches wanted and not yet received."""
        return len(self._pending)

    def want(self, items: Iterable[tuple[int, int]]) -> None:
        """Grant one credit per ``(epoch, batch_index)``; the daemon answers in this order."""
        if self._closed:
            raise BetonClientError("the batch stream is closed", code="CANCELLED")
        batch = tuple((int(e), int(b)) for e, b in items)
        if batch:
            self._requests.put(WantRequest(batch).to_bytes())
            self._pending.extend(batch)

    def receive(self, timeout: float | None = None) -> DecodedBatch:
        """Block until the next wanted batch is complete and return it.

        Args:
            timeout: seconds to wait for the whole batch; on expiry the call is cancelled and
                ``ServerUnavailable`` raised (the stream is then unusable).

        Raises:
            ServerUnavailable: the daemon went away, ended the stream early, or the timeout hit;
                or the interpreter is shutting down (nothing can be waited for then).
            BetonClientError: the stream is closed (``CANCELLED``), or any other failure the
                daemon reported (``from_rpc_error``).
            TransportError: the daemon sent a malformed or unexpected batch.
        """
        if self._closed:
            raise BetonClientError("the batch stream is closed", code="CANCELLED")
        if sys.is_finalizing():
            self.close()
            raise ServerUnavailable(
                "the interpreter is shutting down; the batch stream was cancelled",
                code="CANCELLED",
            )
        if not self._pending:
            raise BetonClientError(
                "receive() without an outstanding want()", code="FAILED_PRECONDITION"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            item = self._end
            if item is None:
                try:
                    item = self._inbox.get(
                        timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
                    )
                except queue.Empty:
                    self._call.cancel()
                    self._end = _CANCELLED_BY_DEADLINE
                    raise ServerUnavailable(
                        f"no batch within {timeout} s; the stream was cancelled",
                        code="DEADLINE_EXCEEDED",
                    ) from None
            if item is _END or item is _CANCELLED_BY_DEADLINE:
                self._end = item
                why = (
                    "the daemon ended the stream"
                    if item is _END
                    else "the stream was cancelled after a receive timeout"
                )
                raise ServerUnavailable(
                    f"{why} with {len(self._pending)} batches owed", code="UNAVAILABLE"
                )
            if isinstance(item, grpc.RpcError):
                self._end = item
                raise from_rpc_error(item) from None
            if isinstance(item, BaseException):  # a bug in the reader: hand it over as it is
                self._end = item
                raise item
            try:
                batch = self._decoder.feed(item)
            except FramingError as exc:
                self.close()
                raise TransportError(f"malformed batch stream: {exc}") from None
            if batch is not None:
                break
        expected = self._pending.popleft()
        buf = self._allocator.last
        if buf is not None:
            pool = self._pool
            batch.release = lambda: pool.give_back(buf)
        if (batch.epoch, batch.batch_index) != expected:
            self.close()
            raise TransportError(
                f"daemon sent batch {(batch.epoch, batch.batch_index)}, expected {expected}"
            )
        return batch

    def close(self) -> None:
        """End the call (idempotent): half-close the requests and cancel what is in flight.

        A call that never delivered a message is first given up to :data:`CLOSE_WAIT_S` seconds
        to end by itself: the daemon ends it when it reads the half-close, and frees its stream.
        gRPC drops a call cancelled before the daemon took it up, and the daemon would then keep
        the stream until its unattached timeout (issue 11). A call that delivered something is
        being served, so it is cancelled at once.
        """
        if self._closed:
            return
        self._closed = True
        self._requests.put(_SENTINEL)
        finalizing = sys.is_finalizing()
        if not self._received.is_set() and not finalizing:
            ended = threading.Event()
            self._call.add_done_callback(lambda _call: ended.set())
            ended.wait(CLOSE_WAIT_S)
        self._call.cancel()
        if not finalizing and self._reader is not threading.current_thread():
            self._reader.join(CLOSE_WAIT_S)  # the cancel ends its iteration at once

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_batches(
    stream: BatchStream,
    positions: Iterable[tuple[int, int]],
    *,
    prefetch: int = 2,
    timeout: float | None = None,
) -> Iterator[DecodedBatch]:
    """Yield the batches at ``positions`` in order, keeping ``prefetch`` credits outstanding.

    The previous batch is released (its buffer returns to the pool) when the next one is
    requested, so the stream's pool needs ``prefetch + 1`` buffers.
    """
    if prefetch < 1:
        raise ValueError("prefetch must be >= 1")
    it = iter(positions)
    stream.want(p for _, p in zip(range(prefetch), it, strict=False))
    while stream.outstanding:
        batch = stream.receive(timeout)
        nxt = next(it, None)
        if nxt is not None:
            stream.want([nxt])
        try:
            yield batch
        finally:
            if batch.release is not None:
                batch.release()
