"""The grpc transport inside the daemon: the producer (and publisher) of the batch method.

A stream negotiated as ``grpc`` (a client on another host, or ``transport="grpc"``) gets a
``transport.grpc_ring.HostRing``: the same slot ring as shm, in private process memory instead of
a shared segment. Its batches do not travel in the ``Batches`` call: the client opens the
pass-through batch method (``beton_serve.transport.grpc_codec``, hosted on the daemon's grpc.aio
server by ``beton_serve.rpc.create_server``) with the stream id as the OPEN payload, then asks
for ``(epoch, batch_index)`` pairs with WANT messages. Each WANT is one credit:

* :class:`StreamProducer` takes a free slot from the stream (``Stream.acquire``), submits the
  batch into it (``Stream.submit``), and when it is decoded the stream books it
  (``Stream.finish``) and calls the producer as its ``daemon._publish.Publisher``, which hands the
  slot's views to the encoder (plus the sample ids as one more array, :data:`SAMPLE_IDS`, and,
  when the batch skipped bad samples, those samples as ``beton_wire.skipped.SKIPPED``, which a
  client reading from several daemons charges to its one budget);
* the encoder copies the slot out in chunks, then releases it (:meth:`OutgoingBatch.release`),
  which returns the slot to the stream (``Stream.release``) and lets the next waiting WANT start.

Decoded batches are booked in the order of their WANTs, not in the order the workers finish
them: ``Stream.finish`` charges the stream's bad-sample budget (``BatchSource.charge``), and a
batch that finished early must not spend it before the batches asked for ahead of it. The call's
handler sends the batches in WANT order anyway, so holding a finished batch until those ahead of
it are booked delays nothing that the client would read sooner.

WANTs beyond the ring wait in order for a slot, so the decoded batches the daemon holds are bounded
by the ring, and client memory by its credits (plus HTTP/2's window). The batch method ends a call
that has more than ``beton_wire.limits.MAX_WANTS_IN_FLIGHT`` batches wanted and not yet sent
(``INVALID_ARGUMENT``): a waiting WANT costs the daemon a future, and a client that asked for
millions without reading grew the daemon's memory by ~2 KB each. Any ``(epoch, batch)`` may be asked for, in any
order: this is what lets several daemons share an epoch (``beton_client._transport.multi``).

The call owns the stream: when it ends (client hang-up, cancel, the liveness monitor, drain) the
stream is removed from the daemon and its ring freed. Everything runs on the event-loop thread;
only the source's futures complete on engine threads and hop back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from beton_wire.framing import Codec, OpenRequest
from beton_wire.limits import MAX_EPOCH
from beton_wire.skipped import SKIPPED
from beton_wire.skipped import encode as encode_skipped

from beton_serve.daemon._publish import Finished
from beton_serve.daemon._stream import Stream
from beton_serve.daemon._streams import StreamTable
from beton_serve.errors import SpecError, TransportError
from beton_serve.transport.grpc_codec import OutgoingBatch

__all__ = ["SAMPLE_IDS", "StreamProducer", "producer_factory"]

log = logging.getLogger("beton_serve.daemon")

#: Name of the extra array that carries a batch's sample ids (uint64), last in every batch.
SAMPLE_IDS = "__sample_ids__"

Want = tuple[int, int, concurrent.futures.Future[OutgoingBatch]]


@dataclasses.dataclass(slots=True)
class _Submitted:
    """A WANT whose batch was submitted into ``slot``; ``decoded`` is its engine future once
    it completed (``None`` until then)."""

    epoch: int
    b: int
    slot: int
    out: concurrent.futures.Future[OutgoingBatch]
    decoded: concurrent.futures.Future[list[np.ndarray]] | None = None


class StreamProducer:
    """Produces one grpc stream's batches for the batch method (see the module docstring).

    A ``transport.grpc_codec.BatchProducer`` for the call, and the stream's
    ``daemon._publish.Publisher``: one WANT is one credit, and the ring bounds them.
    """

    def __init__(self, table: StreamTable, stream: Stream, loop: asyncio.AbstractEventLoop) -> None:
        self.table = table
        self.stream = stream
        self.loop = loop
        self._waiting: collections.deque[Want] = collections.deque()
        #: The submitted WANTs in order: booked from the head as their batches are decoded
        #: (empty: nothing is being decoded for this call).
        self._booking: collections.deque[_Submitted] = collections.deque()
        #: The WANT of each slot being published (set in ``_done``, taken by :meth:`publish`).
        self._outs: dict[int, concurrent.futures.Future[OutgoingBatch]] = {}
        self._closed = False
        self._abort_listeners: list[Callable[[BaseException], None]] = []
        stream.begin(0)  # credits: the whole ring (WANTs beyond it wait in order)
        # A drain (SIGTERM) aborts the stream: the WANTs waiting for a slot fail with its error
        # now, so the call ends with ShuttingDown as its status instead of being cancelled when
        # the server stops (the client tells a drain from a crash by that status).
        stream.on_abort = self._on_abort

    # -- BatchProducer -----------------------------------------------------------------------
    def submit(self, epoch: int, batch_index: int) -> concurrent.futures.Future[OutgoingBatch]:
        out: concurrent.futures.Future[OutgoingBatch] = concurrent.futures.Future()
        n = self.stream.num_batches
        if not 0 <= batch_index < n:
            out.set_exception(SpecError(f"batch {batch_index} is outside the epoch's {n} batches"))
            return out
        if not 0 <= epoch <= MAX_EPOCH:
            out.set_exception(SpecError(f"epoch {epoch} is outside 0..{MAX_EPOCH}"))
            return out
        self._waiting.append((int(epoch), int(batch_index), out))
        self._pump()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.on_abort = None  # nothing left to end; and no stream -> producer cycle
        self._abort_listeners.clear()
        while self._waiting:
            self._waiting.popleft()[2].cancel()
        self._booking.clear()  # their slots go back as they finish (``_done`` when closed)
        self.table.remove(self.stream)
        log.info(
            "stream %s closed after %d batches (grpc)",
            self.stream.stream_id,
            self.stream.counters.batches_sent,
        )

    def add_abort_listener(self, callback: Callable[[BaseException], None]) -> None:
        """``callback(exc)`` when the stream is aborted (the batch method's handler ends its
        call with ``exc``'s status: ``transport.grpc_codec.BatchProducer``)."""
        self._abort_listeners.append(callback)

    def _on_abort(self, exc: BaseException) -> None:
        """The stream was aborted (event-loop thread): fail what waits for a slot, and end the
        call even when its client is not waiting for a batch."""
        self._pump()
        for callback in self._abort_listeners:
            callback(exc)

    # -- Publisher (called by Stream.finish, event-loop thread) -------------------------------
    def publish(self, batch: Finished) -> None:
        """Hand the slot's views and the ids to the encoder; it releases the slot when sent."""
        out = self._outs.pop(batch.slot)
        n = batch.length
        named = [(o.name, a[:n]) for o, a in zip(self.stream.outputs, batch.arrays, strict=True)]
        named.append((SAMPLE_IDS, batch.sample_ids))
        if batch.skipped:  # for a client that charges the budget itself (beton_wire.skipped)
            named.append((SKIPPED, encode_skipped(batch.skipped)))
        slot = batch.slot
        out.set_result(OutgoingBatch(named, release=lambda: self._release(slot)))

    def end(self, epoch: int, batches: int) -> None:
        """Nothing to send: the batch method has no epochs (the client asks for each batch)."""

    # -- internals (event-loop thread) -------------------------------------------------------
    def _pump(self) -> None:
        s = self.stream
        while self._waiting and not self._closed:
            if s.abort_exc is not None:
                self._waiting.popleft()[2].set_exception(s.abort_exc)
                continue
            try:
                slot = s.acquire()
            except Exception as exc:  # a file shrank: this WANT fails, as every next one will
                self._waiting.popleft()[2].set_exception(exc)
                continue
            if slot is None:
                return
            epoch, b, out = self._waiting.popleft()
            try:
                # A remote client waits for every batch it asked for: all are split over the
                # workers, the first one ahead of prefetch work.
                waiting = not self._booking  # nothing decoding: the client waits for this one
                src = s.submit(epoch, b, slot, waiting=waiting, split_prefetch=True)
            except Exception as exc:
                s.abandon(slot)
                out.set_exception(exc)
                continue
            sub = _Submitted(epoch, b, slot, out)
            self._booking.append(sub)
            src.add_done_callback(self._on_engine_done(sub))

    def _on_engine_done(
        self, sub: _Submitted
    ) -> Callable[[concurrent.futures.Future[list[np.ndarray]]], None]:
        def done(f: concurrent.futures.Future[list[np.ndarray]]) -> None:  # an engine thread
            self.loop.call_soon_threadsafe(self._done, f, sub)

        return done

    def _done(self, f: concurrent.futures.Future[list[np.ndarray]], sub: _Submitted) -> None:
        """``sub``'s batch is decoded: book every decoded batch at the head, in WANT order."""
        sub.decoded = f
        if self._closed:  # nothing is booked any more: the slot goes back
            self.stream.abandon(sub.slot)
            return
        freed = False
        while self._booking and self._booking[0].decoded is not None:
            freed = self._book(self._booking.popleft()) or freed
        if freed:
            self._pump()

    def _book(self, sub: _Submitted) -> bool:
        """Publish ``sub``'s decoded batch or fail its WANT; whether the slot was given back
        instead of published."""
        s = self.stream
        f, slot, out = sub.decoded, sub.slot, sub.out
        assert f is not None  # booked only once decoded
        exc = s.abort_exc or (f.exception() if not f.cancelled() else None)
        if exc is None and f.cancelled():
            exc = TransportError("the engine stopped before the batch was made")
        if exc is not None:
            s.abandon(slot)
            out.set_exception(exc)
            return True
        self._outs[slot] = out
        try:
            s.finish(sub.epoch, sub.b, slot, f, f.result(), self)
        except Exception as exc:  # the budget ran out (slot given back), or the ring closed
            if self._outs.pop(slot, None) is not None:
                out.set_exception(exc)
            return True
        return False

    def _release(self, slot: int) -> None:
        if not self._closed:
            self.stream.release(slot)
            self._pump()


def producer_factory(
    table: StreamTable, allowed_codecs: frozenset[Codec]
) -> Callable[[OpenRequest, Any], StreamProducer]:
    """The ``producer_factory`` of the batch method over ``table`` (runs on the event loop).

    The OPEN payload is the stream id from OpenStream; the stream must use the grpc transport
    and not be attached to another call, and the compression must be in ``allowed_codecs``.
    ``context`` (the grpc call's) is not used.
    """

    def make(req: OpenRequest, context: Any) -> StreamProducer:
        sid = req.payload.decode("utf-8", "replace")
        stream = table.find(sid, call="batch", kind="grpc")
        if req.compression.codec not in allowed_codecs:
            raise SpecError(f"compression {req.compression} is not enabled on this daemon")
        return StreamProducer(table, table.claim(stream), asyncio.get_running_loop())

    return make
