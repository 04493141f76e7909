"""Serving one ``Batches`` call: a stream's control channel, and its batches when it has no other.

The call's first message names the stream (:class:`StartEpoch`); the call then owns the stream
until it ends. A reader task routes the client's later messages: releases and credits to the
stream, epoch starts to the serving loop. Each epoch is served one of two ways:

* with ``notices`` (shm, notice channel attached): the :class:`NoticePump` publishes from the
  engine workers with a ``NoticePublisher``; the call only waits for the epoch's outcome;
* otherwise ``Stream.run_epoch`` publishes on the call itself (``CallPublisher``), and the call
  yields each :class:`BatchOut` and the :class:`EpochEnd`.

The stream ends with the call: the client closing it or its notice channel, an error, the
liveness monitor cancelling the task, or a drain (``Stream.abort``). Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from beton_wire.limits import MAX_EPOCH

from beton_serve.daemon._events import (
    ClientEvent,
    ClientHungUp,
    CreditEvent,
    ReleaseSlot,
    StartEpoch,
)
from beton_serve.daemon._publish import BatchOut, EpochEnd, NoticePublisher
from beton_serve.daemon._pump import NoticePump
from beton_serve.daemon._streams import StreamTable
from beton_serve.errors import BetonError, SpecError, without_traceback

__all__ = ["serve_call"]

log = logging.getLogger("beton_serve.daemon")


async def serve_call(
    streams: StreamTable, events: AsyncIterator[ClientEvent]
) -> AsyncIterator[BatchOut | EpochEnd]:
    """Serve one Batches call over ``streams`` (see the module docstring).

    Raises:
        SpecError: a protocol misuse (no Start first, an unknown stream, one already served).
        PipelineError, TransportError, ShuttingDown, ...: what ended the stream.
    """
    first = await anext(aiter(events), None)
    if not isinstance(first, StartEpoch):
        raise SpecError("a Batches call must start with a Start message naming the stream")
    stream = streams.claim(streams.find(first.stream_id, call="Batches"))
    starts = stream.starts
    starts.put_nowait(first)
    hung_up = asyncio.Event()

    async def read() -> None:
        try:
            async for ev in events:
                if isinstance(ev, ReleaseSlot):
                    stream.on_release(ev)
                elif isinstance(ev, CreditEvent):
                    stream.on_credit(ev)
                else:
                    stream.queue_start(ev)
        finally:
            hung_up.set()
            starts.put_nowait(None)
            stream.wake()
            if stream.pump is not None:  # the client hung up mid-epoch
                stream.pump.fail(ClientHungUp("the client closed its Batches call"))

    def notice_closed() -> None:
        hung_up.set()
        stream.abort(ClientHungUp("the client closed its notice channel"))

    loop = asyncio.get_running_loop()
    reader = loop.create_task(read())
    try:
        while True:
            start = await starts.get()
            if stream.abort_exc is not None:
                raise stream.abort_exc
            if start is None:
                return
            if start.stream_id and start.stream_id != stream.stream_id:
                raise SpecError("a Batches call serves one stream; open another call")
            if not 0 <= start.epoch <= MAX_EPOCH:  # a client checks it; this one did not
                raise SpecError(f"epoch {start.epoch} is outside 0..{MAX_EPOCH}")
            if start.notices:  # published from the workers, off this loop (daemon._pump)
                conn = await stream.attach_notices(notice_closed)
                await NoticePump(stream, start, loop, NoticePublisher(conn)).run()
                continue
            # Closed here, not by the garbage collector: its frame holds slot views.
            async with contextlib.aclosing(stream.run_epoch(start)) as items:
                async for item in items:
                    if hung_up.is_set():
                        return  # the client closed its side mid-epoch: nobody will read more
                    yield item
    except ClientHungUp:
        return
    except Exception:
        # The client reads what was published before the error, then the error: what it was
        # sent stays readable until it released it (or hung up).
        await stream.hold_until_released(hung_up)
        raise
    finally:
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        streams.remove(stream)
        if isinstance(stream.abort_exc, BetonError):
            # Raised above, its traceback keeps this frame, which keeps the stream, which
            # keeps the error: an expected error's message is all anyone gets of it.
            without_traceback(stream.abort_exc)
        log.info(
            "stream %s closed after %d batches", stream.stream_id, stream.counters.batches_sent
        )
