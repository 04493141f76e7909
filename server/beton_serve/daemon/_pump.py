"""Serving one epoch of an shm stream over its notice channel, off the event loop's per-batch path.

Why: a CIFAR-sized batch is a few hundred microseconds of decoding. Waking the event loop when a
batch completes (a self-pipe write, a task step, the async generator) costs a sizeable share of
that on a machine whose cores the workers already fill. So the :class:`NoticePump` publishes from
the engine worker that finishes a batch: it marks the slot leased, writes the sample ids and sends
the ``BATCH`` record itself. The event loop only reads the client's releases, and refills the
pipeline in the same callback (:meth:`NoticePump.fill`), without a task step.

State and threads: the stream's :attr:`~beton_serve.daemon._stream.Stream.lock` (an ``RLock``)
guards the ring, the pending deque and every counter the pump touches; ``fill`` runs on the
event-loop thread (the release callback, and once at the start), ``_on_done`` on whichever
thread completes a batch future (an engine worker, or the caller when it was already done).
Batches are published strictly in order: ``_on_done`` publishes the head of the deque and every
finished batch behind it. The epoch's outcome is an ``asyncio`` future on the loop, settled with
``call_soon_threadsafe``: ``None`` after the ``END`` record, or the error that ends the stream (a
failed batch, a client gone, an abort from the daemon).

Look-ahead: between two epochs the client reads ``END``, ends its loop, builds the next
``iter()`` and sends ``Start`` on the Batches call; with nothing in flight meanwhile, the workers
would idle for that round trip, which is several CIFAR batches long. So once every batch of the
epoch is submitted, ``fill`` goes on submitting batches of the *next* epoch into free slots (as
prefetch work, within the same credits). They are not published: when the epoch ends they are
handed to the stream (:class:`Lookahead`), and the next pump adopts them if the client starts
that epoch at batch 0, which it almost always does; any other start (a resume, a re-opened
stream) discards them: cancelled, slots returned, references released.

The gRPC path (``Stream.run_epoch``) has no look-ahead; both publish through ``Stream.submit``
and ``Stream.publish``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from concurrent.futures import Future
from typing import Any

from beton_serve.daemon._stream import EpochEnd, StartEpoch, Stream
from beton_serve.errors import SpecError

__all__ = ["Lookahead", "NoticePump"]

Pending = deque[tuple[int, int, Future[Any]]]


class Lookahead:
    """Batches ``0..next-1`` of ``epoch`` submitted ahead of the client's ``Start``."""

    __slots__ = ("epoch", "next", "pending")

    def __init__(self, epoch: int, pending: Pending, next_batch: int) -> None:
        self.epoch = epoch
        self.pending = pending
        self.next = next_batch


class NoticePump:
    """One epoch of ``stream`` from ``start``, published on its notice channel.

    Raises (from :meth:`run`):
        SpecError: the resume position is past the end of the epoch.
        PipelineError, TransportError, ...: what ended the stream.
    """

    def __init__(self, stream: Stream, start: StartEpoch, loop: asyncio.AbstractEventLoop) -> None:
        n = stream.num_batches
        if not 0 <= start.next_batch <= n:
            raise SpecError(f"next_batch {start.next_batch} is outside the epoch's {n} batches")
        self.stream = stream
        self.loop = loop
        self.epoch = start.epoch
        self.n = n
        self.b_next = start.next_batch
        self.delivered = start.next_batch
        self.by_ref = stream.by_reference()
        self.pending: Pending = deque()
        self.ahead: Pending = deque()  # batches of the next epoch (see the module docstring)
        self.ahead_next = 0
        self.adopted: list[Future[Any]] = []
        with stream.lock:
            la, stream.lookahead = stream.lookahead, None
            if la is not None and la.epoch == start.epoch and start.next_batch == 0:
                self.pending, self.b_next = la.pending, la.next
                self.adopted = [cfut for _, _, cfut in self.pending]
            elif la is not None:
                stream.discard(la.pending)
        self.failed = False
        self.stopped = False
        self.done: asyncio.Future[None] = loop.create_future()
        slots = stream.ring.slot_count
        stream._credits = slots if start.credits <= 0 else min(start.credits, slots)

    async def run(self) -> None:
        """Serve the epoch; returns after its ``END`` record, raises what ended the stream."""
        s = self.stream
        with s.lock:
            s.pump = self
        try:
            if self.delivered == self.n:
                s.send_notice(EpochEnd(epoch=self.epoch, batches=self.n))
                return
            for cfut in self.adopted:
                cfut.add_done_callback(self._on_done)
            self.fill()
            await self.done
        finally:
            self._stop()

    def fill(self) -> None:
        """Submit batches into free slots up to the credits (event-loop thread)."""
        s = self.stream
        new: list[Future[Any]] = []
        with s.lock:
            if self.stopped or self.failed:
                return
            try:
                while self.b_next < self.n and s.ring.leased() < s._credits:
                    s.dataset.check_files()  # a truncated file would SIGBUS the daemon
                    slot = s.ring.acquire()
                    if slot is None:
                        break
                    try:
                        cfut = s.submit(
                            self.epoch, self.b_next, slot, not self.pending, self.by_ref
                        )
                    except BaseException:
                        s.ring.abandon(slot)
                        raise
                    self.pending.append((self.b_next, slot, cfut))
                    new.append(cfut)
                    self.b_next += 1
                while self.b_next >= self.n and self.ahead_next < self.n:
                    if s.ring.leased() >= s._credits:
                        break
                    slot = s.ring.acquire()
                    if slot is None:
                        break
                    try:
                        cfut = s.submit(self.epoch + 1, self.ahead_next, slot, False, self.by_ref)
                    except BaseException:
                        s.ring.abandon(slot)
                        raise
                    self.ahead.append((self.ahead_next, slot, cfut))
                    self.ahead_next += 1
                if self.pending and s._published == 0 and not self.pending[0][2].done():
                    s.promote(self.pending[0][2])  # the client has read everything: it waits
            except BaseException as exc:
                self._fail_locked(exc)
        for cfut in new:
            cfut.add_done_callback(self._on_done)

    def _on_done(self, _f: Future[Any]) -> None:
        """Publish every finished batch at the head of the deque (any thread)."""
        s = self.stream
        with s.lock:
            while not (self.stopped or self.failed) and self.pending and self.pending[0][2].done():
                b, slot, cfut = self.pending.popleft()
                try:
                    arrays = cfut.result()
                except BaseException as exc:
                    s.ring.abandon(slot)
                    self._fail_locked(exc)
                    return
                try:
                    s.send_notice(s.publish(self.epoch, b, slot, cfut, arrays))
                    self.delivered += 1
                    if self.delivered == self.n:
                        s.send_notice(EpochEnd(epoch=self.epoch, batches=self.n))
                        self._settle(None)
                except BaseException as exc:
                    self._fail_locked(exc)
                    return

    def fail(self, exc: BaseException) -> None:
        """End the epoch with ``exc`` (the daemon's abort, the client hanging up)."""
        with self.stream.lock:
            self._fail_locked(exc)

    def _fail_locked(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self._settle(exc)

    def _settle(self, exc: BaseException | None) -> None:
        def settle() -> None:
            if not self.stopped and not self.done.done():
                if exc is None:
                    self.done.set_result(None)
                else:
                    self.done.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
            self.loop.call_soon_threadsafe(settle)

    def _stop(self) -> None:
        """Cancel what is pending and return its slots (event-loop thread, at the end)."""
        s = self.stream
        with s.lock:
            self.stopped = True
            if s.pump is self:
                s.pump = None
            s.discard(self.pending)
            if self.delivered == self.n and not self.failed and not s.closed and self.ahead:
                s.lookahead = Lookahead(self.epoch + 1, self.ahead, self.ahead_next)
            else:
                s.discard(self.ahead)
            self.ahead = deque()
