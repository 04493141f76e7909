"""A stream: one client's view of one dataset with one pipeline, order and batch size.

Protocol (driven by ``beton_serve.rpc`` from the ``Batches`` call, all on the event-loop thread):

* the client starts an epoch (:class:`StartEpoch`) with a resume position and credits;
* the stream submits batches to the shared engine, in order, each into a slot it acquired from
  its ring, never holding more slots (filling or leased) than the client's credits;
* it publishes them in batch order (:class:`BatchOut`), then :class:`EpochEnd`;
* each :class:`ReleaseSlot` returns a slot (and so a credit); the stream then submits more.

One owner of credits and slots: every serving path (this module's :meth:`Stream.run_epoch` for
the ``Batches`` call, the notice pump, the grpc batch method) takes slots with
:meth:`Stream.acquire`, submits with :meth:`Stream.submit`, books and publishes each decoded
batch with :meth:`Stream.finish` through its ``daemon._publish.Publisher``, and gets slots back
through :meth:`Stream.release`. The paths differ only in who drives the epoch and where the
batch goes.

Fair scheduling: a batch is submitted with priority 0 (served first by the engine) when the client
has nothing left to read, i.e. it is waiting; prefetch batches get priority 1.

Notices (shm streams, :mod:`beton_wire.notice`): when the client starts an epoch with
``notices``, the serving task sends each published batch and the epoch's end over the stream's
notice connection instead of yielding them to the Batches call, and releases arrive there too.
Per batch that replaces two gRPC messages with two 32-byte socket records.

Ending: the Batches call ending, the client closing its notice channel, the client's process
dying (the daemon's liveness monitor cancels the serving task) or the daemon shutting down all
end the stream; :meth:`Stream.close` then reclaims every lease and frees the ring. A client that closes its notice channel before its
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
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from beton_wire.notice import lease_token
from beton_wire.slots import SlotLayout
from numpy.typing import NDArray

from beton_serve.daemon._backend import BatchSourceLike, DemandLike, EngineLike, OutputInfo
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._events import (
    ClientEvent,
    ClientHungUp,
    CreditEvent,
    ReleaseSlot,
    StartEpoch,
)
from beton_serve.daemon._publish import (
    BatchOut,
    CallPublisher,
    EpochEnd,
    Finished,
    Publisher,
    TensorOut,
)
from beton_serve.engine import BatchFuture, Releasable, ids_or
from beton_serve.errors import SpecError, TransportError
from beton_serve.transport.base import SlotTransport

if TYPE_CHECKING:
    from beton_serve.transport.notice import NoticeConn

__all__ = [
    "NOTICE_ATTACH_TIMEOUT_S",
    "BatchOut",
    "ClientEvent",
    "ClientHungUp",
    "CreditEvent",
    "EpochEnd",
    "EpochPump",
    "Lookahead",
    "Pending",
    "ReleaseSlot",
    "StartEpoch",
    "Stream",
    "TensorOut",
]

log = logging.getLogger("beton_serve.daemon")

#: Seconds a client that asked for notices has to connect its notice channel.
NOTICE_ATTACH_TIMEOUT_S = 10.0
#: First and longest delay of the starvation timer (seconds), doubling from one to the other:
#: while the daemon waits for a client's release with nothing in flight (the notice pump, and
#: :meth:`Stream.hold_until_released`), it looks at the release words this often too. It
#: only matters when a ``WAKE`` was missed.
TIMER_FIRST_S = 0.001
TIMER_MAX_S = 0.016
#: One release's reported wait is counted up to an hour, and a stream's total up to the
#: largest int64 (``StreamStats.client_wait_us``; the CLI reads it as an int64).
MAX_WAIT_US = 3600 * 10**6
MAX_WAIT_TOTAL_US = 2**63 - 1
#: Epoch starts a stream queues at most (:meth:`Stream.queue_start`).
MAX_QUEUED_STARTS = 4


#: Batches submitted and not yet published, oldest first: ``(batch index, slot, future)``.
Pending = deque[tuple[int, int, Future[list[np.ndarray]]]]


class Lookahead:
    """Batches ``0..next-1`` of ``epoch`` submitted ahead of the client's ``Start`` (the notice
    pump's look-ahead, ``daemon._pump``); adopted or discarded by the next epoch's start."""

    __slots__ = ("epoch", "next", "pending")

    def __init__(self, epoch: int, pending: Pending, next_batch: int) -> None:
        self.epoch = epoch
        self.pending = pending
        self.next = next_batch


class EpochPump(Protocol):
    """The driver of an epoch that publishes from the engine workers (``daemon._pump``), as
    the stream's client events reach it (event-loop thread)."""

    def fill(self) -> None:
        """Collect released slots and submit batches into them, up to the credits."""
        ...

    def fail(self, exc: BaseException) -> None:
        """End the epoch with ``exc``."""
        ...


@dataclass(kw_only=True)
class StreamStatsCounters:
    """Counters of one stream (event-loop thread only)."""

    batches_sent: int = 0
    samples_sent: int = 0
    client_wait_us: int = 0


@dataclass(kw_only=True)
class Stream:
    """One open stream (see the module docstring).

    The stream owns its credits and slots for every serving path: a path's driver (the
    ``Batches`` call's :meth:`run_epoch`, the notice pump, the grpc batch method) takes a slot
    with :meth:`acquire`, starts the batch with :meth:`submit` and hands the decoded batch to
    :meth:`finish`, which books it and calls the path's :class:`Publisher`; the client's release
    comes back through :meth:`release` (or an shm release word, :meth:`reap`).

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
    _submitted: dict[int, Future[list[np.ndarray]]] = field(default_factory=dict)
    _bad_seen: int = 0  # bad samples of this stream's source already counted
    #: Set by :meth:`abort`: the error the serving task raises at its next step.
    abort_exc: BaseException | None = None
    #: Epoch starts from the client; ``None`` means stop (the client hung up, or an abort).
    starts: asyncio.Queue[StartEpoch | None] = field(default_factory=asyncio.Queue)
    #: The notice channel: the token the client must present, the future of its connection
    #: (``None``: the stream offers none), the bound connection, and how to forget the token.
    notice_token: bytes = b""
    notice_future: asyncio.Future[NoticeConn] | None = None
    notice: NoticeConn | None = None
    notice_unregister: Callable[[bytes], None] | None = None
    #: Shared batches published by reference, by slot: released with the slot (issue 6).
    _refs: dict[int, Releasable] = field(default_factory=dict)
    #: slot -> the batch index published in it (until released): a release naming another
    #: batch (stale, replayed) leaves the slot alone.
    _slot_batch: dict[int, int] = field(default_factory=dict)
    #: Guards the ring, the lease counts and the references while a notice pump publishes
    #: from engine workers (``daemon._pump``); the pump serving the epoch, if any.
    lock: threading.RLock = field(default_factory=threading.RLock)
    pump: EpochPump | None = None
    #: Batches of the next epoch a pump submitted ahead of the client's Start, adopted or
    #: discarded by the next epoch's start.
    lookahead: Lookahead | None = None
    #: Called by :meth:`abort` (event-loop thread): the grpc batch method's producer fails the
    #: batches its client is waiting for, so that its call ends with the abort's status.
    on_abort: Callable[[BaseException], None] | None = None
    #: The shared engine, told the stream's credits (:meth:`begin`) so that prefetch slices
    #: fill its workers; ``None`` (tests): prefetched batches stay whole.
    engine: EngineLike | None = None
    _demand: DemandLike | None = None

    async def attach_notices(self, on_hangup: Callable[[], None]) -> NoticeConn:
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
            self.notice = conn
        return self.notice

    def adopt_peer_pid(self, fut: asyncio.Future[NoticeConn]) -> None:
        """Take the client's pid from its notice connection as soon as it connects (a done
        callback of :attr:`notice_future`): the kernel's word (``SO_PEERCRED``), never the
        request's (``transport.peer``), so that the liveness monitor ends the stream when that
        process dies, started or not."""
        if fut.cancelled() or fut.exception() is not None:
            return
        pid = fut.result().peer_pid
        if pid and pid != self.client_pid:
            self.client_pid = pid
            log.debug("stream %s: client pid %d (its notice channel)", self.stream_id, pid)

    def pending_notice(self) -> NoticeConn | None:
        """The client's notice connection when it connected and no serving call took it up
        yet (before its first ``Start``); ``None`` otherwise."""
        fut = self.notice_future
        if self.notice is not None or fut is None or not fut.done() or fut.cancelled():
            return None
        if fut.exception() is not None:
            return None
        return fut.result()

    def closed_before_start(self) -> bool:
        """Whether the client connected the notice channel and closed it before its first
        ``Start``: it closed the stream, which the daemon then ends at once (the liveness
        monitor asks) rather than after ``UNATTACHED_TIMEOUT_S``."""
        conn = self.pending_notice()
        return conn is not None and conn.closed

    def client_connected(self) -> bool:
        """Whether the client holds the stream's notice channel open: it is alive (the
        channel's end-of-file and ``SO_PEERCRED`` pid tell when it is not) and will start the
        stream when it iterates, however long it takes to get there (a model to build, a
        ``torch.compile``). Such a stream is not reclaimed as unattached."""
        conn = self.notice if self.notice is not None else self.pending_notice()
        return conn is not None and not conn.closed

    def _notice_release(self, slot: int, index: int, wait_us: int) -> None:
        self.on_release(ReleaseSlot(slot, index, wait_us))

    def _notice_start(self, epoch: int, next_batch: int, credits: int) -> None:
        self.queue_start(StartEpoch(self.stream_id, epoch, next_batch, credits, True))

    def queue_start(self, start: StartEpoch) -> None:
        """Queue an epoch start from the client. A client starts an epoch once the previous
        one ended, so at most one waits in practice; past :data:`MAX_QUEUED_STARTS` the
        stream ends with ``SpecError`` (a client sent ~800,000 in 8 s: each took memory
        until the stream closed, and would have run as an epoch)."""
        if self.abort_exc is not None:
            return
        if self.starts.qsize() >= MAX_QUEUED_STARTS:
            self.abort(
                SpecError(
                    f"more than {MAX_QUEUED_STARTS} epoch starts queued: start an epoch once "
                    "the previous one has ended"
                )
            )
            return
        self.starts.put_nowait(start)

    def _notice_wake(self) -> None:
        self._wake.set()  # :meth:`hold_until_released` waits for it too
        if self.pump is not None:
            self.pump.fill()

    def abort(self, exc: BaseException) -> None:
        """Make the serving task end with ``exc`` (e.g. ``ShuttingDown``) at its next step."""
        self.abort_exc = exc
        self.starts.put_nowait(None)
        self._wake.set()
        if self.pump is not None:
            self.pump.fail(exc)
        if self.on_abort is not None:
            self.on_abort(exc)

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        return len(self.source)

    # -- credits and slots (every serving path) ------------------------------------------------
    def begin(self, credits: int) -> None:
        """Start serving with ``credits`` slots in flight at most (0: the whole ring)."""
        slots = self.ring.slot_count
        self._credits = slots if credits <= 0 else min(credits, slots)
        self._hold_demand()

    def _hold_demand(self) -> None:
        """Register the credits with the engine, which sizes prefetch slices by them."""
        if self.engine is None or self.closed:
            return
        if self._demand is None:
            self._demand = self.engine.hold_demand(self._credits)
        else:
            self._demand.update(self._credits)

    def has_credit(self) -> bool:
        """Whether another slot may be taken: fewer slots filling or leased than credits."""
        return self.ring.leased() < self._credits

    def acquire(self) -> int | None:
        """A free slot to decode the next batch into, within the credits (``None``: none now).

        Raises:
            FormatError: a file of the dataset shrank (a truncated file would SIGBUS the daemon).
        """
        if not self.has_credit():
            return None
        self.dataset.check_files()
        return self.ring.acquire()

    def abandon(self, slot: int) -> None:
        """Give back a slot acquired for a batch that will not be published (and that nothing
        writes into any more: see :meth:`abandon_when_done`)."""
        self.ring.abandon(slot)

    def abandon_when_done(self, slot: int, cfut: Future[Any] | None) -> None:
        """Cancel the batch submitted into ``slot`` and give the slot back once nothing writes
        into it (hold :attr:`lock`).

        At once when the batch never ran (cancelled) or has finished. A decode that is already
        running cannot be cancelled: the slot then goes back when it ends (on the worker that
        ends it). Given back at once, the slot could be handed to the next batch while the old
        decode still wrote into it, over the next batch's pixels: a client that resumed at
        another position than the one decoded ahead (``load_state_dict``, an epoch re-opened
        after Ctrl-C) received a batch with another batch's rows in it.
        """
        if cfut is not None:
            for task in getattr(cfut, "tasks", ()):  # the parts of a split batch not started
                task.future.cancel()
            cfut.cancel()
        if cfut is None or cfut.done():
            self.abandon(slot)
            return

        def give_back(_f: Future[Any]) -> None:
            with self.lock:
                if not self.closed:
                    self.abandon(slot)

        cfut.add_done_callback(give_back)

    @property
    def client_idle(self) -> bool:
        """Whether the client holds no published batch: it has read everything and waits."""
        return self._published == 0

    def waiting_for(self, first: bool) -> bool:
        """Whether the client waits for the batch submitted now: nothing is pending ahead of
        it (``first``) and the client holds at most one published batch."""
        return self._published <= 1 and first

    def submit(
        self,
        epoch: int,
        b: int,
        slot: int,
        *,
        waiting: bool,
        by_ref: bool = False,
        split_prefetch: bool = False,
    ) -> Future[list[np.ndarray]]:
        """Submit batch ``b`` into ``slot`` (from :meth:`acquire`).

        A batch the client waits for (``waiting``) goes in at priority 0 and is split over the
        workers, so it arrives sooner; prefetch work gets priority 1 and runs in as few parts
        as keep every worker busy (``Engine.prefetch_slices``: whole batches, which cost less
        per image, once the streams' credits cover the workers, as in the in-process Loader),
        unless ``split_prefetch`` (the grpc batch method: a remote client's WANTs are all
        waited for).
        """
        if waiting or split_prefetch:
            slices = None
        else:
            slices = self.engine.prefetch_slices() if self.engine is not None else 1
        return self.source.submit(
            epoch,
            b,
            self.ring.host_views(slot),
            priority=0 if waiting else 1,
            slices=slices,
            by_reference=by_ref,
        )

    def finish(
        self,
        epoch: int,
        b: int,
        slot: int,
        cfut: Future[list[np.ndarray]],
        arrays: Sequence[np.ndarray],
        publisher: Publisher,
    ) -> None:
        """Book the decoded batch ``b`` of ``slot`` and hand it to ``publisher``: the ids it
        holds, the counters, the slot's lease, an shm ring's id table and release word, a
        sharing group's reference (hold :attr:`lock` when engine workers may publish
        concurrently). Every serving path publishes through here, once per batch.

        Raises:
            PipelineError: the batch's bad samples exhaust the stream's bad-sample budget,
                charged here, in batch order (``BatchSource.charge``); the slot is given back.
            TransportError: the slot was not being filled (the ring was closed meanwhile), or
                the publisher's client is gone.
        """
        batch = cfut if isinstance(cfut, BatchFuture) else None
        ref = None if batch is None else batch.shared_ref
        try:
            self.source.charge(epoch, cfut)
        except BaseException:
            if ref is not None:
                ref.release()
            self.abandon(slot)
            raise
        if ref is not None:
            self._refs[slot] = ref
        ids, length = self._account(epoch, b, cfut, arrays)
        extras = self.ring.notice_extras
        if extras is not None:  # shm: the notice channel's clients read the ids there
            extras.write_ids(slot, ids)
        published = self.ring.publish(slot, length)
        if extras is not None:  # a client on the notice channel releases through its word
            extras.arm(slot, lease_token(epoch, b, self.num_batches))
        self._published += 1
        self._slot_batch[slot] = b
        at = None if ref is None else (ref.segment, ref.offset)
        skipped = () if batch is None or not batch.bad else tuple(batch.bad)
        publisher.publish(Finished(epoch, b, slot, length, ids, arrays, published, at, skipped))

    def end_epoch(self, epoch: int, publisher: Publisher) -> None:
        """Tell the client through ``publisher`` that ``epoch`` ended.

        Raises:
            TransportError: the client is gone or stopped reading.
        """
        publisher.end(epoch, self.num_batches)

    def release(self, slot: int) -> bool:
        """Return a published slot (the client is done with it); whether it was leased."""
        if not self.ring.release(slot):
            return False
        self._published -= 1
        self._slot_batch.pop(slot, None)
        ref = self._refs.pop(slot, None)
        if ref is not None:  # the group may free the shared buffer now
            ref.release()
        return True

    def reap(self) -> bool:
        """Release the slots whose release word the client set (hold :attr:`lock`); whether
        there were any."""
        extras = self.ring.notice_extras
        if extras is None:
            return False
        slots = extras.reap()
        for slot in slots:
            self.release(slot)
        if slots:
            # The client's own running total, from its ring word: bounded as a sum of
            # releases is (a client writes whatever it likes there).
            self.counters.client_wait_us = max(
                self.counters.client_wait_us, min(extras.client_wait_us(), MAX_WAIT_TOTAL_US)
            )
        return bool(slots)

    # -- events from the client (event-loop thread) -------------------------------------------
    def on_release(self, ev: ReleaseSlot) -> None:
        """Return a slot; unknown or double releases, and releases of another batch than the
        slot holds (stale or replayed records), are ignored (logged at debug level)."""
        with self.lock:
            if self._slot_batch.get(ev.slot) != ev.batch_index:
                log.debug(
                    "stream %s: ignored release of slot %d (batch %d): it holds batch %s",
                    self.stream_id,
                    ev.slot,
                    ev.batch_index,
                    self._slot_batch.get(ev.slot),
                )
            elif self.release(ev.slot):
                extras = self.ring.notice_extras
                if extras is not None:
                    extras.disarm(ev.slot)
                # Only a real release counts, each at most an hour, the sum within the int64
                # that Stats and the CLI read (a client sent 2**64 - 1 twice: Stats failed for
                # every caller while that stream lived).
                wait = min(max(0, ev.wait_us), MAX_WAIT_US)
                self.counters.client_wait_us = min(
                    self.counters.client_wait_us + wait, MAX_WAIT_TOTAL_US
                )
            else:
                log.debug("stream %s: ignored release of slot %d", self.stream_id, ev.slot)
        self._wake.set()
        if self.pump is not None:
            self.pump.fill()

    async def hold_until_released(self, hung_up: asyncio.Event) -> None:
        """After an error ended the stream (``daemon._call``), before it closes: wait until
        the client has released every batch published to it, or it hung up, or an abort (a
        drain, the client's notice channel closing) came.

        Why: the client reads the batches published before the error, then the error, in that
        order, as the in-process Loader delivers them, but a slow client may not have mapped
        them yet, and :meth:`close` frees what they live in. A batch sent by reference lives in
        its sharing group's buffer: released at once, the group unlinked the buffer's segment
        (the client then lost a batch the in-process Loader delivers before the same error: a
        CI flake) or could reuse the buffer for another batch (wrong pixels under the right
        sample ids). A cuda_ipc client opens each slot's slab the first time it reads that slot,
        which it cannot do once the ring is freed. (An shm client maps its whole ring when the
        stream opens, so its own slots would survive; it waits alike, which keeps one rule.)

        The wait is bounded as any held batch is: by the client's next ``next()`` (its
        release), its hang-up (the Batches call or the notice channel ending, the liveness
        monitor), or the daemon's drain. A release comes as a release word (the starved word
        makes the client send ``WAKE``; a back-off timer covers a missed one) or a ``RELEASE``
        record.
        """
        delay = TIMER_FIRST_S
        extras = self.ring.notice_extras
        try:
            while True:
                with self.lock:
                    if self.closed or self.abort_exc is not None or hung_up.is_set():
                        return
                    if extras is not None:
                        extras.starved = True  # set before looking: a release after it WAKEs
                    self._wake.clear()
                    self.reap()
                    if self.client_idle:
                        return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                delay = min(TIMER_MAX_S, delay * 2)
        finally:
            if extras is not None and not self.closed:
                with self.lock, contextlib.suppress(Exception):
                    extras.starved = False

    def on_credit(self, ev: CreditEvent) -> None:
        """Grant more credits, up to the ring size."""
        self._credits = min(self.ring.slot_count, self._credits + max(0, ev.count))
        self._hold_demand()
        self._wake.set()

    async def _wait_wake(self) -> None:
        """Sleep until a client event or a submitted batch completes (each sets ``_wake``)."""
        await self._wake.wait()
        self._wake.clear()

    def _on_done(self, _fut: asyncio.Future[Any]) -> None:
        self._wake.set()

    def wake(self) -> None:
        """Make :meth:`run_epoch` look at its state again (the Batches call ended)."""
        self._wake.set()

    # -- producing one epoch on the Batches call -----------------------------------------------
    async def run_epoch(self, start: StartEpoch) -> AsyncGenerator[BatchOut | EpochEnd, None]:
        """Produce ``start.epoch`` from ``start.next_batch``, in order (:class:`CallPublisher`).

        Raises:
            SpecError: the resume position is past the end of the epoch.
            PipelineError: a batch failed (the pending batches are cancelled first).
        """
        n = self.num_batches
        if not 0 <= start.next_batch <= n:
            raise SpecError(f"next_batch {start.next_batch} is outside the epoch's {n} batches")
        self.begin(start.credits)
        self.drop_lookahead()  # only the notice path looks ahead
        epoch = start.epoch
        b_next = start.next_batch
        by_ref = start.notices and self.by_reference()
        out = CallPublisher(self.layout)
        pending: deque[tuple[int, int, asyncio.Future[list[np.ndarray]]]] = deque()
        try:
            delivered = b_next
            while delivered < n:
                if self.abort_exc is not None:
                    raise self.abort_exc
                while b_next < n:
                    slot = self.acquire()
                    if slot is None:
                        break
                    try:
                        waiting = self.waiting_for(not pending)
                        cfut = self.submit(epoch, b_next, slot, waiting=waiting, by_ref=by_ref)
                    except BaseException:
                        self.abandon(slot)
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
                    if self.client_idle:  # the client has read everything: it is waiting
                        self.promote(self._submitted.get(b))
                    await self._wait_wake()
                    continue
                pending.popleft()
                cfut = self._submitted.pop(b)
                try:
                    arrays = fut.result()
                except BaseException:
                    self.abandon(slot)
                    raise
                try:
                    self.finish(epoch, b, slot, cfut, arrays, out)
                finally:
                    # An error raised out of here keeps this frame: not with the slot's views,
                    # which would keep the ring mapped after the stream closed (issue 11).
                    del arrays, fut, cfut
                yield out.items.popleft()
                delivered += 1
            self.end_epoch(epoch, out)
            yield out.items.popleft()
        finally:
            self._abandon(pending)

    def _abandon(self, pending: deque[tuple[int, int, asyncio.Future[list[np.ndarray]]]]) -> None:
        """Cancel the batches :meth:`run_epoch` submitted and did not publish, return their
        slots and references, and forget them (its frame keeps none of them: see there)."""
        for b, slot, fut in pending:
            fut.cancel()
            cfut = self._submitted.get(b)
            self.abandon_when_done(slot, cfut)
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

    def discard(self, pending: Pending) -> None:
        """Cancel submitted ``(batch, slot, future)`` entries that will not be published:
        return their slots (:meth:`abandon_when_done`) and shared references, and empty
        ``pending`` (hold :attr:`lock`)."""
        for _, slot, cfut in pending:
            self.abandon_when_done(slot, cfut)
            # Decoded (or still being decoded) by reference, never published: the reference is
            # set just before the future completes, so release it then (now, if done).
            cfut.add_done_callback(_release_shared_ref)
        pending.clear()

    def may_look_ahead(self) -> bool:
        """Whether batches of the next epoch may be decoded before the client starts it (the
        source says; a bad-sample budget is charged as batches are delivered, in
        :meth:`finish`, so a batch decoded ahead spends nothing until then)."""
        return self.source.caps.look_ahead

    def by_reference(self) -> bool:
        """Whether shared batches can be published by reference: zero-copy sharing needs a
        sharing source with an arena and the ring's id table (shm; with the notice channel,
        the only one that can name another segment)."""
        return self.source.caps.by_reference and self.ring.notice_extras is not None

    def _account(
        self, epoch: int, b: int, cfut: Future[list[np.ndarray]], arrays: Sequence[np.ndarray]
    ) -> tuple[NDArray[np.uint64], int]:
        """Count a finished batch (stream, dataset and bad samples) and return its ids and
        length (once per published batch, from :meth:`finish`)."""
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

    def promote(self, cfut: Future[Any] | None) -> None:
        """Move the decode behind ``cfut`` ahead of prefetch work (the client is waiting)."""
        if cfut is not None:
            self.source.promote(cfut)

    def close(self) -> None:
        """Free the ring and every lease (idempotent)."""
        with self.lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._demand is not None:
            self._demand.release()
        self.drop_lookahead()
        with contextlib.suppress(Exception):  # a shared source leaves its sharing group
            self.source.close()
        if self.notice_unregister is not None:
            self.notice_unregister(self.notice_token)
        if self.notice is not None:  # the client reads end-of-file, then the call's status
            self.notice.on_close = None
            self.notice.close()
        else:
            # Connected, never started: closed too, or a client that iterates later would wait
            # on it for ever (it read nothing, and nobody wrote to it any more).
            conn = self.pending_notice()
            if conn is not None:
                conn.close()
        refs, self._refs = self._refs, {}
        for ref in refs.values():
            ref.release()
        with contextlib.suppress(Exception):
            self.ring.close()
        self._wake.set()


def _release_shared_ref(fut: Future[Any]) -> None:
    """Done-callback: give back the shared reference of a batch that will not be published (a
    pinned group buffer would otherwise stay pinned; ``SharedRef.release`` is idempotent)."""
    if isinstance(fut, BatchFuture) and fut.shared_ref is not None:
        fut.shared_ref.release()
