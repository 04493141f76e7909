"""The daemon's stream table: the open streams by id, how each ends, and the liveness monitor.

A stream is added when OpenStream accepts it and leaves the table exactly once, by one of:

* its serving call ending (the ``Batches`` call or the grpc batch method): :meth:`remove`;
* the liveness monitor (:meth:`watch`): the client's process is gone, the client closed its
  notice channel before its first ``Start``, or no call came within
  :attr:`StreamTable.unattached_timeout_s` (:data:`UNATTACHED_TIMEOUT_S` by default) while no
  client held the notice channel open (a client that holds it is alive, and starts when it
  iterates, minutes later if it builds a model first: the timeout used to end such a stream,
  and the client then waited on its channel for ever): :meth:`end`, which also cancels a
  running serving task;
* the daemon draining or closing: :meth:`drain`, :meth:`close`.

Either way :meth:`Stream.close <beton_serve.daemon._stream.Stream.close>` runs, which reclaims
every lease and frees the ring. A serving call finds its stream with :meth:`find` and claims it
with :meth:`claim`, so that one stream is never served by two calls.

Ring sizing (:func:`ring_size`) lives here too: how many slots a new stream's ring gets.

Threads: everything runs on the daemon's event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from beton_serve.daemon._stream import Stream
from beton_serve.errors import SpecError
from beton_serve.transport.shm import pid_alive

__all__ = [
    "ARENA_EXTRA",
    "MAX_RING_SLOTS",
    "SMALL_RING_BYTES",
    "UNATTACHED_TIMEOUT_S",
    "StreamTable",
    "ring_size",
]

log = logging.getLogger("beton_serve.daemon")

#: Seconds a stream may stay open with no serving call and no client connected to its notice
#: channel (a client that died or hung after OpenStream) before it is reclaimed: the default of
#: the daemon's ``unattached_timeout`` (TOML key, ``--unattached-timeout``).
UNATTACHED_TIMEOUT_S = 30.0
#: Rings of small slots may grow to this many bytes (deeper prefetch hides per-batch latency).
SMALL_RING_BYTES = 32 << 20
#: ... but to at most this many slots.
MAX_RING_SLOTS = 16
#: Group buffers of a shm stream's sharing arena beyond its ring size (zero-copy sharing).
ARENA_EXTRA = 2


def ring_size(batches_ahead: int, slot_bytes: int, room: int | None = None) -> int:
    """Slots of a stream's ring: the batch the client holds plus ``batches_ahead`` in flight, and,
    when slots are small (CIFAR-sized batches), more, up to :data:`SMALL_RING_BYTES` in all.

    The slots past ``batches_ahead + 1`` are a speed-up, never a requirement: ``room`` (bytes;
    ``None``: no bound) is what they may take, and a ring gets only the whole extra slots that
    fit in it. The daemon passes what keeps its rings within half its stream memory budget
    (``Daemon._ring_slots``), so that one stream's optional depth never takes the room another
    stream's required slots need.

    Measured here (2 cores): with 38 MB ImageNet slots, 5 slots in flight cost ~15 % throughput
    against 4 (more live buffers); with 1.5 MB CIFAR slots the per-batch round trip dominates and
    a deeper ring hides it.
    """
    base = batches_ahead + 1
    slot = max(1, slot_bytes)
    deep = max(base, min(MAX_RING_SLOTS, SMALL_RING_BYTES // slot))
    if room is not None:
        deep = min(deep, base + max(0, room) // slot)
    return deep


class StreamTable:
    """The open streams of one daemon (see the module docstring); event-loop thread only.

    Iterating yields the streams in opening order; ``len`` counts them.
    """

    def __init__(self, unattached_timeout_s: float = UNATTACHED_TIMEOUT_S) -> None:
        self._streams: dict[str, Stream] = {}
        #: Seconds a stream no call took up is kept while no client holds its notice channel.
        self.unattached_timeout_s = unattached_timeout_s
        #: Streams accepted over the daemon's life (the Stats RPC's ``streams_opened``).
        self.opened = 0

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))

    def get(self, stream_id: str) -> Stream | None:
        """The open stream ``stream_id``, or ``None``."""
        return self._streams.get(stream_id)

    def add(self, stream: Stream) -> None:
        """Admit a stream OpenStream accepted."""
        self._streams[stream.stream_id] = stream
        self.opened += 1

    def find(self, stream_id: str, *, call: str, kind: str | None = None) -> Stream:
        """The stream a serving call names, if that call may serve it (:meth:`claim` it next).

        Args:
            stream_id: from the call's first message.
            call: the call's name, for the error message (``Batches``, ``batch``).
            kind: the transport the call serves (``None``: any).

        Raises:
            SpecError: unknown stream, another transport, or already served by another call.
        """
        stream = self._streams.get(stream_id)
        if stream is None:
            raise SpecError(
                f"unknown stream {stream_id!r}: open it with OpenStream first (streams are closed "
                f"when their {call} call ends)"
            )
        if kind is not None and stream.ring.kind != kind:
            raise SpecError(
                f"stream {stream_id!r} uses the {stream.ring.kind} transport; read it with Batches"
            )
        if stream.task is not None:
            raise SpecError(f"stream {stream_id!r} is already being served")
        return stream

    @staticmethod
    def claim(stream: Stream) -> Stream:
        """Mark ``stream`` as served by the current task (the liveness monitor cancels that task
        when the client goes); returns it."""
        stream.task = asyncio.current_task()
        return stream

    def remove(self, stream: Stream) -> None:
        """Forget ``stream`` and free it: its serving call ended (idempotent)."""
        self._streams.pop(stream.stream_id, None)
        stream.close()

    def end(self, stream: Stream) -> None:
        """Cancel ``stream``'s serving task, if one runs, forget it and free it."""
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        self.remove(stream)

    def sweep(self, now: float) -> None:
        """End the streams whose client is gone or never came (see the module docstring)."""
        for s in self:
            if s.client_pid and not pid_alive(s.client_pid):
                # A client process that exits without closing its Loader is a normal end
                # of a stream (INFO), not a fault: real failures are logged where they occur.
                log.info(
                    "stream %s: client pid %d exited; reclaiming its %d slot(s)",
                    s.stream_id,
                    s.client_pid,
                    s.ring.leased(),
                )
                self.end(s)
            elif s.task is None and s.closed_before_start():
                # Its Batches call may never reach the daemon (a call cancelled early is
                # dropped by gRPC), but the notice channel's end-of-file always does.
                log.info("stream %s: closed by the client before it started", s.stream_id)
                self.end(s)
            elif (
                s.task is None
                and not s.client_connected()
                and now - s.created > self.unattached_timeout_s
            ):
                log.info("stream %s: never started; closing it", s.stream_id)
                self.end(s)

    async def watch(self, interval: float, after: Callable[[float], None]) -> None:
        """Every ``interval`` seconds, :meth:`sweep`, then call ``after(now)`` (runs until
        cancelled)."""
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.sweep(now)
            after(now)

    async def drain(self, error: Callable[[], BaseException], timeout: float) -> None:
        """End every stream: those being served with a new ``error()`` as their final status
        (tasks not done after ``timeout`` seconds are cancelled), the others at once."""
        tasks = []
        for s in self:
            if s.task is not None and not s.task.done():
                tasks.append(s.task)
                s.abort(error())
            else:
                self.end(s)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            for t in late:
                t.cancel()
        self.close()

    def close(self) -> None:
        """End every stream (idempotent)."""
        for s in self:
            self.end(s)
