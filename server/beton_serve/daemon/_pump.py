"""Serving one epoch of an shm stream over its notice channel, off the event loop's per-batch path.

Why: a CIFAR-sized batch is a few hundred microseconds of decoding. Waking the event loop when a
batch completes (a self-pipe write, a task step, the async generator) costs a sizeable share of
that on a machine whose cores the workers already fill. So the :class:`NoticePump` publishes from
the engine worker that finishes a batch: it marks the slot leased, writes the sample ids and sends
the ``BATCH`` record itself. The client releases a slot by storing its lease token in the slot's
release word (``beton_wire.notice``), and the same worker, right after publishing, collects the
released slots and submits the next batches into them (:meth:`NoticePump._fill_locked`). In
steady state the event loop does nothing per batch.

Starvation: when nothing is in flight (every slot is leased to the client), no completion will
come to collect releases. The pump then sets the ring's ``starved`` word, looks at the release
words once more, and waits for the client's ``WAKE`` record (a client that sees ``starved`` after
storing its word sends one), with a back-off timer (1 to 16 ms) for the rare case where each side
missed the other's store. Clients without release words send ``RELEASE`` records, which refill
the pipeline from the event loop.

State and threads: the stream's :attr:`~beton_serve.daemon._stream.Stream.lock` (an ``RLock``)
guards the ring, the pending deque and every counter the pump touches; ``fill`` runs on the
event-loop thread (the release callback, and once at the start), ``_on_done`` on whichever
thread completes a batch future (an engine worker, or the caller when it was already done).
Batches are published strictly in order: ``_on_done`` publishes the head of the deque and every
finished batch behind it. One thread publishes at a time, and a worker that completes a batch
meanwhile leaves a mark for it instead of waiting (the two workers used to queue on the stream's
lock for each other's socket send: 9 % of their time on CIFAR-sized batches). The epoch's
outcome is an ``asyncio`` future on the loop, settled with ``call_soon_threadsafe``: ``None`` after the ``END`` record, or the error that ends the stream (a
failed batch, a client gone, an abort from the daemon).

Look-ahead: between two epochs the client reads ``END``, ends its loop, builds the next
``iter()`` and sends ``Start`` on the Batches call; with nothing in flight meanwhile, the workers
would idle for that round trip, which is several CIFAR batches long. So once every batch of the
epoch is submitted, ``fill`` goes on submitting batches of the *next* epoch into free slots (as
prefetch work, within the same credits). They are not published: when the epoch ends they are
handed to the stream (:class:`Lookahead`), and the next pump adopts them if the client starts
that epoch at batch 0, which it almost always does; any other start (a resume, a re-opened
stream) discards them: cancelled, slots returned, references released. A bad-sample budget
does not stop the look-ahead: ``Stream.finish`` charges it as each batch is published, in batch
order, so a batch decoded ahead and discarded spends nothing.

Depth: a pump keeps at most :func:`pump_depth` batches submitted and not yet published (this
epoch's and the next's together): the engine's workers plus :data:`DEPTH_SLACK`, enough to keep
every worker busy. The ring's other slots hold published batches the client has not released
yet. Slots are taken lowest index first, so a stream whose client keeps up cycles through the
same few slots, which stay in the CPU's caches; filling every free slot (as before) cycled
through all 16 slots of a CIFAR-like stream's 24 MiB ring, and the ring's traffic then cost the
decode kernels 5-12 % more time (RESULTS.md, sessions 16 and 17). ``BETON_SERVE_PUMP_DEPTH`` sets the depth (``0``: every
free slot, within the credits).

The ``Batches`` call's own path (``Stream.run_epoch``) has no look-ahead. Every path takes slots
with ``Stream.acquire``, submits with ``Stream.submit`` and publishes through ``Stream.finish``;
this one with a ``NoticePublisher`` (``daemon._publish``).

Memory: when the pump stops it keeps no batch future, and the error that ends an epoch carries no
frame of the thread that published: a batch's error is taken with ``Future.exception()`` (not
re-raised here), and an expected error raised while publishing (a :class:`BetonError`, e.g. the
client gone) loses its traceback. That traceback's frames, through their callers (a frame keeps
its caller once it has returned), held batch futures and slot views, and the error and the pump
refer to each other, so a closed stream's ring stayed mapped until the garbage collector ran
(issue 11). Other exceptions are bugs and keep their traceback, which ``beton_serve.rpc`` logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any

from beton_serve.daemon._events import StartEpoch
from beton_serve.daemon._publish import Publisher
from beton_serve.daemon._stream import TIMER_FIRST_S, TIMER_MAX_S, Lookahead, Pending, Stream
from beton_serve.errors import BetonError, SpecError, without_traceback

__all__ = ["Lookahead", "NoticePump"]


#: Batches submitted and not yet published, beyond one per engine worker (see the module
#: docstring): one finishing while the workers start the others, and one to spare.
DEPTH_SLACK = 2
#: Overrides :func:`pump_depth` (``0``: no limit but the credits and the ring).
DEPTH_ENV = "BETON_SERVE_PUMP_DEPTH"

log = logging.getLogger("beton_serve.daemon")


def pump_depth(workers: int | None) -> int:
    """Batches a pump keeps submitted and unpublished: ``workers + DEPTH_SLACK``, or
    ``$BETON_SERVE_PUMP_DEPTH`` when set; ``0`` means no limit (also when ``workers`` is
    ``None``: no engine to size it by)."""
    raw = os.environ.get(DEPTH_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value >= 0:
            return value
        log.warning("ignoring %s=%r: not a count of batches (0 or more)", DEPTH_ENV, raw)
    return 0 if workers is None else max(1, workers) + DEPTH_SLACK


class NoticePump:
    """One epoch of ``stream`` from ``start``, published with ``publisher`` (the stream's
    ``NoticePublisher``) from the engine workers; an :class:`~beton_serve.daemon._stream.EpochPump`.

    Raises (from :meth:`run`):
        SpecError: the resume position is past the end of the epoch.
        PipelineError, TransportError, ...: what ended the stream.
    """

    def __init__(
        self,
        stream: Stream,
        start: StartEpoch,
        loop: asyncio.AbstractEventLoop,
        publisher: Publisher,
    ) -> None:
        n = stream.num_batches
        if not 0 <= start.next_batch <= n:
            raise SpecError(f"next_batch {start.next_batch} is outside the epoch's {n} batches")
        self.stream = stream
        self.loop = loop
        self.out = publisher
        self.epoch = start.epoch
        self.n = n
        self.b_next = start.next_batch
        self.delivered = start.next_batch
        self.by_ref = stream.by_reference()
        self.pending: Pending = deque()
        self.ahead: Pending = deque()  # batches of the next epoch (see the module docstring)
        # n: nothing to look ahead at (see ``Stream.may_look_ahead``).
        self.ahead_next = 0 if stream.may_look_ahead() else n
        engine = stream.engine
        self.depth = pump_depth(engine.num_workers if engine is not None else None)
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
        # The release words and starved flag (beton_wire.notice); None: not an shm ring.
        self.extras = stream.ring.notice_extras
        self.ctl = self.extras is not None
        self.timer_armed = False
        self.delay = TIMER_FIRST_S
        self.done: asyncio.Future[None] = loop.create_future()
        #: :meth:`_on_done`'s publisher (one at a time) and the marks of completions it must
        #: look at (a deque: its ``append`` and truth test are atomic).
        self._publishing = threading.Lock()
        self._kicked: deque[None] = deque()
        stream.begin(start.credits)

    async def run(self) -> None:
        """Serve the epoch; returns after its ``END`` record, raises what ended the stream."""
        s = self.stream
        with s.lock:
            s.pump = self
        try:
            if self.delivered == self.n:
                s.end_epoch(self.epoch, self.out)
                return
            for cfut in self.adopted:
                cfut.add_done_callback(self._on_done)
            self.fill()
            await self.done
        finally:
            self._stop()
            # The settled future keeps the error that ended the epoch, whose traceback keeps
            # this frame, and the frame keeps this pump: a fresh future breaks that cycle
            # (nothing settles or awaits it: ``_settle`` does nothing once stopped).
            self.done = self.loop.create_future()

    def fill(self) -> None:
        """Collect released slots and submit batches into them, up to the credits (event-loop
        thread: the start, a ``RELEASE`` or ``WAKE`` record, the starvation timer)."""
        with self.stream.lock:
            new = self._fill_locked()
        for cfut in new:
            cfut.add_done_callback(self._on_done)

    def _fill_locked(self) -> list[Future[Any]]:
        s = self.stream
        if self.stopped or self.failed:
            return []
        new: list[Future[Any]] = []
        try:
            while True:
                s.reap()
                self._submit_locked(new)
                if self.pending or new or not self.ctl:
                    break
                # Nothing in flight, so no completion will collect releases: ask the client
                # to wake us (WAKE), then look once more in case it released meanwhile.
                if not self._wants_slot():
                    break
                self.extras.starved = True  # type: ignore[union-attr] # ctl is set
                if not s.reap():
                    self._arm_timer()
                    return new
            if self.extras is not None and self.extras.starved:
                self.extras.starved = False
            self.delay = TIMER_FIRST_S
            if self.pending and s.client_idle and not self.pending[0][2].done():
                s.promote(self.pending[0][2])  # the client has read everything: it waits
        except BaseException as exc:
            self._fail_locked(_detached(exc))
        return new

    def _wants_slot(self) -> bool:
        """A batch is left to submit (this epoch's, or the next's to look ahead at) and fewer
        than :attr:`depth` are submitted and unpublished."""
        if self.b_next >= self.n and self.ahead_next >= self.n:
            return False
        return not self.depth or len(self.pending) + len(self.ahead) < self.depth

    def _submit_locked(self, new: list[Future[Any]]) -> None:
        s = self.stream
        while self._wants_slot():
            slot = s.acquire()  # within the credits; re-checks the files (a truncation: SIGBUS)
            if slot is None:
                return
            ahead = self.b_next >= self.n
            epoch, b = (self.epoch + 1, self.ahead_next) if ahead else (self.epoch, self.b_next)
            try:
                waiting = s.waiting_for(not ahead and not self.pending)
                cfut = s.submit(epoch, b, slot, waiting=waiting, by_ref=self.by_ref)
            except BaseException:
                s.abandon(slot)
                raise
            if ahead:  # not published by this pump: no callback (see the module docstring)
                self.ahead.append((b, slot, cfut))
                self.ahead_next += 1
            else:
                self.pending.append((b, slot, cfut))
                new.append(cfut)
                self.b_next += 1

    def _arm_timer(self) -> None:
        """While starved, look for releases on a back-off timer too (a missed WAKE)."""
        if self.timer_armed:
            return
        self.timer_armed = True

        def schedule() -> None:
            self.loop.call_later(self.delay, self._tick)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            self.loop.call_soon_threadsafe(schedule)

    def _tick(self) -> None:
        self.timer_armed = False
        if self.stopped or self.failed:
            return
        self.delay = min(TIMER_MAX_S, self.delay * 2)
        self.fill()

    def _on_done(self, _f: Future[Any]) -> None:
        """Publish every finished batch at the head of the deque, then refill (any thread).

        One thread publishes at a time, and a worker never waits for another to do so: it
        leaves a mark in :attr:`_kicked` and returns to the engine's queue when a publish is
        under way; the publishing thread sees the mark once it is done and publishes again.
        A future is done before its callbacks run, so a mark left before the publisher cleared
        them is covered by its scan, and one left after it by its second look.
        """
        self._kicked.append(None)
        while self._publishing.acquire(blocking=False):
            try:
                self._kicked.clear()
                new = self._publish_done()
            finally:
                self._publishing.release()
            for cfut in new:
                cfut.add_done_callback(self._on_done)
            if not self._kicked:
                return

    def _publish_done(self) -> list[Future[Any]]:
        s = self.stream
        with s.lock:
            while not (self.stopped or self.failed) and self.pending and self.pending[0][2].done():
                b, slot, cfut = self.pending.popleft()
                error = CancelledError() if cfut.cancelled() else cfut.exception()
                if error is not None:
                    s.abandon(slot)
                    self._fail_locked(error)
                    return []
                try:
                    s.finish(self.epoch, b, slot, cfut, cfut.result(), self.out)
                    self.delivered += 1
                    if self.delivered == self.n:
                        s.end_epoch(self.epoch, self.out)
                        self._settle(None)
                except BaseException as exc:
                    self._fail_locked(_detached(exc))
                    return []
            return self._fill_locked()

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
            if self.extras is not None:
                self.extras.starved = False
            s.discard(self.pending)
            if self.delivered == self.n and not self.failed and not s.closed and self.ahead:
                s.lookahead = Lookahead(self.epoch + 1, self.ahead, self.ahead_next)
            else:
                s.discard(self.ahead)
            self.ahead = deque()
            self.adopted = []


def _detached(exc: BaseException) -> BaseException:
    """``exc`` without its tracebacks if it is an expected error (see the module docstring)."""
    return without_traceback(exc) if isinstance(exc, BetonError) else exc
