"""The grpc transport inside the daemon: a host-memory ring and the producer of the batch method.

A stream negotiated as ``grpc`` (a client on another host, or ``transport="grpc"``) gets a
:class:`HostRing`: the same slot ring as shm, in private process memory instead of a shared
segment. Its batches do not travel in the ``Batches`` call: the client opens the pass-through batch
method (``beton_serve.transport.grpc_codec``, hosted on the daemon's grpc.aio server by
``beton_serve.rpc.create_server``) with the stream id as the OPEN payload, then asks for
``(epoch, batch_index)`` pairs with WANT messages. Each WANT is one credit:

* :class:`StreamProducer` takes a free slot, submits the batch to the stream's source (the shared
  engine) into that slot, and when it is decoded publishes it and hands the slot's views to the
  encoder (plus the sample ids as one more array, :data:`SAMPLE_IDS`);
* the encoder copies the slot out in chunks, then releases it (:meth:`OutgoingBatch.release`),
  which frees the slot and lets the next waiting WANT start.

WANTs beyond the ring wait in order for a slot, so daemon memory is bounded by the ring and client
memory by its credits (plus HTTP/2's window). Any ``(epoch, batch)`` may be asked for, in any
order: this is what lets several daemons share an epoch (``beton_client._transport.multi``).

The call owns the stream: when it ends (client hang-up, cancel, the liveness monitor, drain) the
stream is removed from the daemon and its ring freed. Everything runs on the event-loop thread;
only the source's futures complete on engine threads and hop back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from beton_wire.framing import ALL_CODECS, OpenRequest

from beton_serve.errors import SpecError, TransportError
from beton_serve.transport.base import TransportFactory
from beton_serve.transport.grpc_codec import OutgoingBatch
from beton_serve.transport.grpc_ring import (
    GrpcFactory,
)

if TYPE_CHECKING:
    from beton_serve.daemon._stream import Stream

__all__ = ["SAMPLE_IDS", "StreamProducer", "StreamTable", "producer_factory"]

log = logging.getLogger("beton_serve.daemon")

#: Name of the extra array that carries a batch's sample ids (uint64), last in every batch.
SAMPLE_IDS = "__sample_ids__"


class StreamTable(Protocol):
    """What the batch method needs from the daemon (``beton_serve.daemon.Daemon`` is one).

    Declared here, below the daemon, so that this module never imports ``_daemon`` (which imports
    it through ``_transports``). Read and written on the event-loop thread only.
    """

    #: Open streams by id; :meth:`StreamProducer.close` removes its own.
    streams: dict[str, Stream]
    #: Transport factories by kind; ``grpc`` names the codecs it allows (``allowed_codecs``).
    factories: dict[str, TransportFactory]


class StreamProducer:
    """Produces one grpc stream's batches for the batch method (see the module docstring)."""

    def __init__(
        self, daemon: StreamTable, stream: Stream, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.daemon = daemon
        self.stream = stream
        self.loop = loop
        self._waiting: collections.deque[
            tuple[int, int, concurrent.futures.Future[OutgoingBatch]]
        ] = collections.deque()
        self._inflight = 0
        self._closed = False

    # -- BatchProducer -----------------------------------------------------------------------
    def submit(self, epoch: int, batch_index: int) -> concurrent.futures.Future[OutgoingBatch]:
        out: concurrent.futures.Future[OutgoingBatch] = concurrent.futures.Future()
        n = self.stream.num_batches
        if not 0 <= batch_index < n:
            out.set_exception(SpecError(f"batch {batch_index} is outside the epoch's {n} batches"))
            return out
        self._waiting.append((int(epoch), int(batch_index), out))
        self._pump()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._waiting:
            self._waiting.popleft()[2].cancel()
        self.daemon.streams.pop(self.stream.stream_id, None)
        self.stream.close()
        log.info(
            "stream %s closed after %d batches (grpc)",
            self.stream.stream_id,
            self.stream.counters.batches_sent,
        )

    # -- internals (event-loop thread) -------------------------------------------------------
    def _pump(self) -> None:
        ring = self.stream.ring
        while self._waiting and not self._closed:
            if self.stream.abort_exc is not None:
                self._waiting.popleft()[2].set_exception(self.stream.abort_exc)
                continue
            slot = ring.acquire()
            if slot is None:
                return
            epoch, b, out = self._waiting.popleft()
            try:
                src = self.stream.source.submit(
                    epoch, b, ring.host_views(slot), priority=0 if self._inflight == 0 else 1
                )
            except Exception as exc:
                ring.abandon(slot)
                out.set_exception(exc)
                continue
            self._inflight += 1

            def done(f: Any, slot: int = slot, epoch: int = epoch, b: int = b, out: Any = out):
                self.loop.call_soon_threadsafe(self._done, f, slot, epoch, b, out)

            src.add_done_callback(done)

    def _done(
        self,
        f: concurrent.futures.Future[list[np.ndarray]],
        slot: int,
        epoch: int,
        b: int,
        out: concurrent.futures.Future[OutgoingBatch],
    ) -> None:
        self._inflight -= 1
        ring = self.stream.ring
        if self._closed:
            ring.abandon(slot)
            return
        exc = self.stream.abort_exc or (f.exception() if not f.cancelled() else None)
        if exc is None and f.cancelled():
            exc = TransportError("the engine stopped before the batch was made")
        if exc is not None:
            ring.abandon(slot)
            out.set_exception(exc)
            self._pump()
            return
        arrays = f.result()
        s = self.stream
        ids, length = s.account(epoch, b, f, arrays)  # the counters every publisher keeps
        ring.publish(slot, length)
        named = [(o.name, a[:length]) for o, a in zip(s.outputs, arrays, strict=True)]
        named.append((SAMPLE_IDS, ids))
        out.set_result(OutgoingBatch(named, release=lambda: self._release(slot)))

    def _release(self, slot: int) -> None:
        if not self._closed:
            self.stream.ring.release(slot)
            self._pump()


def producer_factory(daemon: StreamTable) -> Any:
    """The ``producer_factory`` of the batch method for ``daemon`` (runs on the event loop).

    The OPEN payload is the stream id from OpenStream; the stream must use the grpc transport
    and not be attached to another call.
    """

    def make(req: OpenRequest, context: Any) -> StreamProducer:
        sid = req.payload.decode("utf-8", "replace")
        stream = daemon.streams.get(sid)
        if stream is None:
            raise SpecError(
                f"unknown stream {sid!r}: open it with OpenStream first (streams are closed "
                "when their batch call ends)"
            )
        if stream.ring.kind != "grpc":
            raise SpecError(
                f"stream {sid!r} uses the {stream.ring.kind} transport; read it with Batches"
            )
        if stream.task is not None:
            raise SpecError(f"stream {sid!r} is already being served")
        factory = daemon.factories.get("grpc")
        allowed = factory.allowed_codecs if isinstance(factory, GrpcFactory) else ALL_CODECS
        if req.compression.codec not in allowed:
            raise SpecError(f"compression {req.compression} is not enabled on this daemon")
        stream.task = asyncio.current_task()
        return StreamProducer(daemon, stream, asyncio.get_running_loop())

    return make
