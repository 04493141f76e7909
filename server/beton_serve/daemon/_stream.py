"""A stream: one client's view of one dataset with one pipeline, order and batch size.

Protocol (driven by ``beton_serve.rpc`` from the ``Batches`` call, all on the event-loop thread):

* the client starts an epoch (:class:`StartEpoch`) with a resume position and credits;
* the stream submits batches to the shared engine, in order, each into a slot it acquired from
  its ring, never holding more slots (filling or leased) than the client's credits;
* it publishes them in batch order (:class:`BatchOut`), then :class:`EpochEnd`;
* each :class:`ReleaseSlot` returns a slot (and so a credit); the stream then submits more.

Fair scheduling: a batch is submitted with priority 0 (served first by the engine) when the client
has nothing left to read, i.e. it is waiting; prefetch batches get priority 1.

Notices (shm streams, :mod:`beton_wire.notice`): when the client starts an epoch with
``notices``, the serving task sends each published batch and the epoch's end over the stream's
notice connection instead of yielding them to the Batches call, and releases arrive there too.
Per batch that replaces two gRPC messages with two 32-byte socket records.

Ending: the Batches call ending, the client closing its notice channel, the client's process dying (the daemon's liveness monitor
cancels the serving task) or the daemon shutting down all end the stream; :meth:`Stream.close`
then reclaims every lease and frees the ring. A client that closes its notice channel before its
first Start closed the stream (:meth:`Stream.closed_before_start`; the liveness monitor ends it).

Memory: the ring is unmapped when it closes unless a view of it is still alive, and then with
that view (``transport.shm``), so nothing here keeps a batch's views past its publication: the
serving task closes :meth:`Stream.run_epoch` explicitly, and an error raised out of it leaves no
views in its frame (issue 11: closed streams' rings stayed mapped until a garbage collection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from beton_wire.notice import lease_token
from beton_wire.slots import SlotLayout

from beton_serve.daemon._backend import BatchSourceLike, OutputInfo
from beton_serve.daemon._datasets import Dataset
from beton_serve.engine import BatchFuture, Releasable, ids_or
from beton_serve.errors import SpecError, TransportError
from beton_serve.transport.base import Published, SlotTransport

__all__ = [
    "NOTICE_ATTACH_TIMEOUT_S",
    "BatchOut",
    "ClientHungUp",
    "ClientEvent",
    "CreditEvent",
    "EpochEnd",
    "ReleaseSlot",
    "StartEpoch",
    "Stream",
    "TensorOut",
]

log = logging.getLogger("beton_serve.daemon")

#: Seconds a client that asked for notices has to connect its notice channel.
NOTICE_ATTACH_TIMEOUT_S = 10.0


class ClientHungUp(TransportError):
    """The client closed its notice channel: the stream ends quietly."""


@dataclass(frozen=True, slots=True)
class StartEpoch:
    """Start (or resume) ``epoch`` at batch ``next_batch`` with ``credits`` (0: the ring size);
    ``notices``: publish on the stream's notice channel rather than the Batches call."""

    stream_id: str
    epoch: int
    next_batch: int = 0
    credits: int = 0
    notices: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseSlot:
    """The client is done with ``slot`` (it held batch ``batch_index``); it waited ``wait_us``."""

    slot: int
    batch_index: int = 0
    wait_us: int = 0


@dataclass(frozen=True, slots=True)
class CreditEvent:
    """The client grants ``count`` more credits (up to the ring size)."""

    count: int


ClientEvent = StartEpoch | ReleaseSlot | CreditEvent


@dataclass(frozen=True, slots=True)
class TensorOut:
    """Where one output of a published batch is: shape includes the batch dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BatchOut:
    """A published batch."""

    epoch: int
    batch_index: int
    slot: int
    length: int
    tensors: tuple[TensorOut, ...]
    sample_ids: np.ndarray
    published: Published
    #: ``(segment, offset)`` when the data is not in ``slot`` but in a sharing group's buffer
    #: (zero-copy sharing, notice channel only); ``None`` otherwise.
    at: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """Every batch of ``epoch`` was published."""

    epoch: int
    batches: int


@dataclass(kw_only=True)
class StreamStatsCounters:
    """Counters of one stream (event-loop thread only)."""

    batches_sent: int = 0
    samples_sent: int = 0
    client_wait_us: int = 0


@dataclass(kw_only=True)
class Stream:
    """One open stream (see the module docstring).

    Attributes:
        stream_id: the id handed to the client.
        dataset: the dataset it reads.
        source: the engine's view of its batches.
        ring: its slots.
        layout: the slot layout.
        outputs: the daemon-side outputs, in order.
        client_pid: the client's PID, from the kernel: ``SO_PEERCRED`` of its notice
            connection, set when it attaches (0: unknown, remote, or no notice channel). The
            liveness monitor ends the stream when that process is gone.
        client_name: for logs and stats.
    """

    stream_id: str
    dataset: Dataset
    source: BatchSourceLike
    ring: SlotTransport
    layout: SlotLayout
    outputs: Sequence[OutputInfo]
    client_pid: int = 0
    client_name: str = ""
    created: float = field(default_factory=time.monotonic)
    counters: StreamStatsCounters = field(default_factory=StreamStatsCounters)
    task: asyncio.Task[Any] | None = None
    closed: bool = False
    _credits: int = 0
    _published: int = 0  # published and not yet released
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _submitted: dict[int, Any] = field(default_factory=dict)
    _bad_seen: int = 0  # bad samples of this stream's source already counted
    #: Set by :meth:`abort`: the error the serving task raises at its next step.
    abort_exc: BaseException | None = None
    #: Epoch starts from the client; ``None`` means stop (the client hung up, or an abort).
    starts: asyncio.Queue[StartEpoch | None] = field(default_factory=asyncio.Queue)
    #: The notice channel: the token the client must present, the future of its connection
    #: (``None``: the stream offers none), the bound connection, and how to forget the token.
    notice_token: bytes = b""
    notice_future: asyncio.Future[Any] | None = None
    notice: Any = None
    notice_unregister: Any = None
    #: Shared batches published by reference, by slot: released with the slot (issue 6).
    _refs: dict[int, Any] = field(default_factory=dict)
    #: Guards the ring, the lease counts and the references while a :class:`NoticePump`
    #: publishes from engine workers (``daemon._pump``); the pump serving the epoch, if any.
    lock: threading.RLock = field(default_factory=threading.RLock)
    pump: Any = None
    #: Batches of the next epoch a pump submitted ahead of the client's Start
    #: (``daemon._pump.Lookahead``), adopted or discarded by the next epoch's start.
    lookahead: Any = None

    async def attach_notices(self, on_hangup: Any) -> Any:
        """Wait for the client's notice connection and route its releases to this stream.

        ``on_hangup`` is called when the client closes it.

        Raises:
            SpecError: the stream has no notice channel (it is not shm, or the daemon runs none).
            TransportError: the client did not connect in time.
            ClientHungUp: it connected and already closed the connection.
        """
        if self.notice is None:
            if self.notice_future is None:
                raise SpecError(
                    "Start.notices was set but this stream offers no notice channel (it is not "
                    "an shm stream); start the epoch without notices"
                )
            try:
                conn = await asyncio.wait_for(
                    asyncio.shield(self.notice_future), NOTICE_ATTACH_TIMEOUT_S
                )
            except TimeoutError:
                raise TransportError(
                    f"the client asked for notices but did not connect its notice channel within "
                    f"{NOTICE_ATTACH_TIMEOUT_S:.0f} s"
                ) from None
            if conn.closed:
                raise ClientHungUp("the client closed its notice channel")
            conn.on_release = self._notice_release
            conn.on_wake = self._notice_wake
            conn.on_start = self._notice_start
            conn.on_close = on_hangup
            if conn.peer_pid:  # the kernel's word, never the request's (transport.peer)
                self.client_pid = conn.peer_pid
            self.notice = conn
        return self.notice

    def closed_before_start(self) -> bool:
        """Whether the client connected the notice channel and closed it before its first
        ``Start``: it closed the stream, which the daemon then ends at once (the liveness
        monitor asks) rather than after ``UNATTACHED_TIMEOUT_S``."""
        fut = self.notice_future
        if self.notice is not None or fut is None or not fut.done() or fut.cancelled():
            return False
        return bool(fut.result().closed)

    def _notice_release(self, slot: int, index: int, wait_us: int) -> None:
        self.on_release(ReleaseSlot(slot, index, wait_us))

    def _notice_start(self, epoch: int, next_batch: int, credits: int) -> None:
        self.starts.put_nowait(StartEpoch(self.stream_id, epoch, next_batch, credits, True))

    def _notice_wake(self) -> None:
        if self.pump is not None:
            self.pump.fill()

    def reap(self) -> bool:
        """Release the slots whose release word the client set (hold :attr:`lock`); whether
        there were any."""
        extras = self.ring.notice_extras
        if extras is None:
            return False
        slots = extras.reap()
        for slot in slots:
            self._release_slot(slot)
        if slots:
            self.counters.client_wait_us = max(
                self.counters.client_wait_us, extras.client_wait_us()
            )
        return bool(slots)

    def _release_slot(self, slot: int) -> bool:
        if not self.ring.release(slot):
            return False
        self._published -= 1
        ref = self._refs.pop(slot, None)
        if ref is not None:  # the group may free the shared buffer now
            ref.release()
        return True

    def send_end(self, epoch: int) -> None:
        """Tell the client on the notice channel that ``epoch`` ended (see :meth:`publish_notice`
        for the batches).

        Raises:
            TransportError: the client is gone or stopped reading.
        """
        self.notice.send_end(epoch, self.num_batches)

    def abort(self, exc: BaseException) -> None:
        """Make the serving task end with ``exc`` (e.g. ``ShuttingDown``) at its next step."""
        self.abort_exc = exc
        self.starts.put_nowait(None)
        self._wake.set()
        if self.pump is not None:
            self.pump.fail(exc)

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        return len(self.source)

    # -- events from the client (event-loop thread) -------------------------------------------
    def on_release(self, ev: ReleaseSlot) -> None:
        """Return a slot; unknown or double releases are ignored (logged at debug level)."""
        with self.lock:
            if self._release_slot(ev.slot):
                extras = self.ring.notice_extras
                if extras is not None:
                    extras.disarm(ev.slot)
            else:
                log.debug("stream %s: ignored release of slot %d", self.stream_id, ev.slot)
            self.counters.client_wait_us += max(0, ev.wait_us)
        self._wake.set()
        if self.pump is not None:
            self.pump.fill()

    def on_credit(self, ev: CreditEvent) -> None:
        """Grant more credits, up to the ring size."""
        self._credits = min(self.ring.slot_count, self._credits + max(0, ev.count))
        self._wake.set()

    async def _wait_wake(self) -> None:
        """Sleep until a client event or a submitted batch completes (each sets ``_wake``)."""
        await self._wake.wait()
        self._wake.clear()

    def _on_done(self, _fut: asyncio.Future[Any]) -> None:
        self._wake.set()

    # -- producing one epoch -----------------------------------------------------------------
    async def run_epoch(self, start: StartEpoch) -> AsyncGenerator[BatchOut | EpochEnd, None]:
        """Produce ``start.epoch`` from ``start.next_batch``, in order.

        Raises:
            SpecError: the resume position is past the end of the epoch.
            PipelineError: a batch failed (the pending batches are cancelled first).
        """
        n = self.num_batches
        if not 0 <= start.next_batch <= n:
            raise SpecError(f"next_batch {start.next_batch} is outside the epoch's {n} batches")
        slots = self.ring.slot_count
        self._credits = slots if start.credits <= 0 else min(start.credits, slots)
        self.drop_lookahead()  # only the notice path looks ahead
        epoch = start.epoch
        b_next = start.next_batch
        by_ref = start.notices and self.by_reference()
        pending: deque[tuple[int, int, asyncio.Future[list[np.ndarray]]]] = deque()
        try:
            delivered = b_next
            while delivered < n:
                if self.abort_exc is not None:
                    raise self.abort_exc
                while b_next < n and self.ring.leased() < self._credits:
                    self.dataset.check_files()  # a truncated file would SIGBUS the daemon
                    slot = self.ring.acquire()
                    if slot is None:
                        break
                    try:
                        cfut = self.submit(epoch, b_next, slot, not pending, by_ref)
                    except BaseException:
                        self.ring.abandon(slot)
                        raise
                    afut = asyncio.wrap_future(cfut)
                    afut.add_done_callback(self._on_done)
                    pending.append((b_next, slot, afut))
                    self._submitted[b_next] = cfut
                    b_next += 1
                if not pending:
                    await self._wait_wake()
                    continue
                b, slot, fut = pending[0]
                if not fut.done():
                    if self._published == 0:  # the client has read everything: it is waiting
                        self._promote(b)
                    await self._wait_wake()
                    continue
                pending.popleft()
                cfut = self._submitted.pop(b, None)
                try:
                    arrays = fut.result()
                except BaseException:
                    self.ring.abandon(slot)
                    raise
                try:
                    item = self.publish(epoch, b, slot, cfut, arrays)
                finally:
                    # An error raised out of here keeps this frame: not with the slot's views,
                    # which would keep the ring mapped after the stream closed (issue 11).
                    del arrays, fut, cfut
                yield item
                delivered += 1
            yield EpochEnd(epoch=epoch, batches=n)
        finally:
            self._abandon(pending)

    def _abandon(self, pending: deque[tuple[int, int, asyncio.Future[list[np.ndarray]]]]) -> None:
        """Cancel the batches :meth:`run_epoch` submitted and did not publish, return their
        slots and references, and forget them (its frame keeps none of them: see there)."""
        for b, slot, fut in pending:
            fut.cancel()
            self.ring.abandon(slot)
            cfut = self._submitted.get(b)
            if cfut is not None:  # decoded (or being decoded) by reference, never published
                cfut.add_done_callback(_release_shared_ref)
        self._submitted.clear()
        pending.clear()

    def drop_lookahead(self) -> None:
        """Discard batches submitted ahead for the next epoch (they will not be published)."""
        with self.lock:
            la, self.lookahead = self.lookahead, None
            if la is not None:
                self.discard(la.pending)

    def discard(self, pending: Any) -> None:
        """Cancel submitted ``(batch, slot, future)`` entries that will not be published:
        return their slots and shared references, and empty ``pending`` (hold :attr:`lock`)."""
        for _, slot, cfut in pending:
            cfut.cancel()
            self.ring.abandon(slot)
            # Decoded (or still being decoded) by reference, never published: the reference is
            # set just before the future completes, so release it then (now, if done).
            cfut.add_done_callback(_release_shared_ref)
        pending.clear()

    def may_look_ahead(self) -> bool:
        """Whether batches of the next epoch may be decoded before the client starts it: not
        under a bad-sample budget, which is spent in decode order (a bad sample of the next
        epoch decoded ahead could use up the budget before one of the current epoch)."""
        return self.source.caps.look_ahead

    def by_reference(self) -> bool:
        """Whether shared batches can be published by reference: zero-copy sharing needs a
        sharing source with an arena and the ring's id table (shm; with the notice channel,
        the only one that can name another segment)."""
        return self.source.caps.by_reference and self.ring.notice_extras is not None

    def submit(self, epoch: int, b: int, slot: int, first: bool, by_ref: bool) -> Any:
        """Submit batch ``b`` into ``slot`` (acquired); ``first``: nothing else is pending.

        A batch the client waits for (nothing published for it to read, nothing ahead of it) is
        split over the workers, so it arrives sooner; prefetch work stays whole, which costs
        less per image (as in the in-process Loader).
        """
        waiting = self._published <= 1 and first
        return self.source.submit(
            epoch,
            b,
            self.ring.host_views(slot),
            priority=0 if waiting else 1,
            slices=None if waiting else 1,
            by_reference=by_ref,
        )

    def publish(self, epoch: int, b: int, slot: int, cfut: Future[Any], arrays: Any) -> BatchOut:
        """Publish the finished batch ``b`` of ``slot``: ids, lease, counters (the caller holds
        :attr:`lock` when engine workers may publish concurrently).

        Raises:
            TransportError: the slot was not being filled (the ring was closed meanwhile).
        """
        length, ids, ref, published = self._book(epoch, b, slot, cfut, arrays)
        return BatchOut(
            epoch=epoch,
            batch_index=b,
            slot=slot,
            length=length,
            tensors=self._tensors(length),
            sample_ids=ids,
            published=published,
            at=None if ref is None else (ref.segment, ref.offset),
        )

    def publish_notice(self, epoch: int, b: int, slot: int, cfut: Future[Any], arrays: Any) -> None:
        """:meth:`publish` straight to the notice channel (``BATCH`` or ``BATCH_AT``), without
        building the message the Batches call would need (hold :attr:`lock`).

        Raises:
            TransportError: the slot was not being filled, or the client is gone.
        """
        length, _, ref, _ = self._book(epoch, b, slot, cfut, arrays)
        if ref is None:
            self.notice.send_batch(slot, epoch, b, length)
        else:
            self.notice.send_batch_at(slot, epoch, b, length, ref.segment, ref.offset)

    def _book(
        self, epoch: int, b: int, slot: int, cfut: Future[Any], arrays: Any
    ) -> tuple[int, np.ndarray, Releasable | None, Published]:
        batch = cfut if isinstance(cfut, BatchFuture) else None
        ref = None if batch is None else batch.shared_ref
        if ref is not None:
            self._refs[slot] = ref
        ids, length = self.account(epoch, b, cfut, arrays)
        extras = self.ring.notice_extras
        if extras is not None:  # shm: the notice channel's clients read the ids there
            extras.write_ids(slot, ids)
        published = self.ring.publish(slot, length)
        if extras is not None:  # a client on the notice channel releases through its word
            extras.arm(slot, lease_token(epoch, b, self.num_batches))
        self._published += 1
        return length, ids, ref, published

    def account(self, epoch: int, b: int, cfut: Future[Any], arrays: Any) -> tuple[np.ndarray, int]:
        """Count a finished batch (stream, dataset and bad samples) and return its ids and
        length: every publisher (notices, the Batches call, the grpc batch method) calls this
        once per batch it publishes.
        """
        self._count_bad()
        # The ids the batch holds (a skipped sample is replaced: engine._source.delivered_ids);
        # the order's only when the future does not carry them (looked up only then: this runs
        # once per batch, on the worker that publishes).
        batch = cfut if isinstance(cfut, BatchFuture) else None
        held = None if batch is None else batch.sample_ids
        ids = ids_or(cfut, self.source.batch_ids(epoch, b)) if held is None else held
        if type(ids) is not np.ndarray or ids.dtype != np.uint64:
            ids = np.asarray(ids, dtype=np.uint64)
        length = len(ids) if arrays is None or not len(arrays) else len(arrays[0])
        counters = self.counters
        counters.batches_sent += 1
        counters.samples_sent += length
        # A shared source marks batches another identical stream decoded (issue 6).
        if batch is None or batch.decoded_here:
            self.dataset.count(batches=1, samples=length)
        return ids, length

    def _count_bad(self) -> None:
        """Add the samples this stream's source skipped since the last batch to the dataset's."""
        bad = self.source.skipped()
        if len(bad) > self._bad_seen:
            self.dataset.note_bad(int(x.sample_id) for x in bad[self._bad_seen :])
            self._bad_seen = len(bad)

    def _promote(self, b: int) -> None:
        self.promote(self._submitted.get(b))

    def promote(self, cfut: Any) -> None:
        """Move the decode behind ``cfut`` ahead of prefetch work (the client is waiting)."""
        if cfut is not None:
            self.source.promote(cfut)

    def _tensors(self, length: int) -> tuple[TensorOut, ...]:
        return tuple(
            TensorOut(t.name, (length, *t.shape), t.dtype, t.offset, t.sample_bytes * length)
            for t in self.layout.tensors
        )

    def close(self) -> None:
        """Free the ring and every lease (idempotent)."""
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.drop_lookahead()
        with contextlib.suppress(Exception):  # a shared source leaves its sharing group
            self.source.close()
        if self.notice_unregister is not None:
            self.notice_unregister(self.notice_token)
        if self.notice is not None:  # the client reads end-of-file, then the call's status
            self.notice.on_close = None
            self.notice.close()
        refs, self._refs = self._refs, {}
        for ref in refs.values():
            ref.release()
        with contextlib.suppress(Exception):
            self.ring.close()
        self._wake.set()


def _release_shared_ref(fut: Any) -> None:
    """Done-callback: give back the shared reference of a batch that will not be published (a
    pinned group buffer would otherwise stay pinned; ``SharedRef.release`` is idempotent)."""
    if isinstance(fut, BatchFuture) and fut.shared_ref is not None:
        fut.shared_ref.release()
