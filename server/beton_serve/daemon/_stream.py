"""A stream: one client's view of one dataset with one pipeline, order and batch size.

Protocol (driven by ``beton_serve.rpc`` from the ``Batches`` call, all on the event-loop thread):

* the client starts an epoch (:class:`StartEpoch`) with a resume position and credits;
* the stream submits batches to the shared engine, in order, each into a slot it acquired from
  its ring, never holding more slots (filling or leased) than the client's credits;
* it publishes them in batch order (:class:`BatchOut`), then :class:`EpochEnd`;
* each :class:`ReleaseSlot` returns a slot (and so a credit); the stream then submits more.

Fair scheduling: a batch is submitted with priority 0 (served first by the engine) when the client
has nothing left to read, i.e. it is waiting; prefetch batches get priority 1.

Ending: the Batches call ending, the client's process dying (the daemon's liveness monitor
cancels the serving task) or the daemon shutting down all end the stream; :meth:`Stream.close`
then reclaims every lease and frees the ring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from beton_wire.slots import SlotLayout

from beton_serve.daemon._backend import BatchSourceLike, OutputInfo
from beton_serve.daemon._datasets import Dataset
from beton_serve.errors import SpecError
from beton_serve.transport.base import Published, SlotTransport

__all__ = [
    "BatchOut",
    "ClientEvent",
    "CreditEvent",
    "EpochEnd",
    "ReleaseSlot",
    "StartEpoch",
    "Stream",
    "TensorOut",
]

log = logging.getLogger("beton_serve.daemon")


@dataclass(frozen=True, slots=True)
class StartEpoch:
    """Start (or resume) ``epoch`` at batch ``next_batch`` with ``credits`` (0: the ring size)."""

    stream_id: str
    epoch: int
    next_batch: int = 0
    credits: int = 0


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
        client_pid: the client's PID when it runs on this host (0: unknown or remote).
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

    def abort(self, exc: BaseException) -> None:
        """Make the serving task end with ``exc`` (e.g. ``ShuttingDown``) at its next step."""
        self.abort_exc = exc
        self.starts.put_nowait(None)
        self._wake.set()

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        return len(self.source)

    # -- events from the client (event-loop thread) -------------------------------------------
    def on_release(self, ev: ReleaseSlot) -> None:
        """Return a slot; unknown or double releases are ignored (logged at debug level)."""
        if self.ring.release(ev.slot):
            self._published -= 1
        else:
            log.debug("stream %s: ignored release of slot %d", self.stream_id, ev.slot)
        self.counters.client_wait_us += max(0, ev.wait_us)
        self._wake.set()

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
    async def run_epoch(self, start: StartEpoch) -> AsyncIterator[BatchOut | EpochEnd]:
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
        epoch = start.epoch
        b_next = start.next_batch
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
                    waiting = self._published <= 1 and not pending
                    cfut = self.source.submit(
                        epoch, b_next, self.ring.host_views(slot), priority=0 if waiting else 1
                    )
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
                # A shared source marks batches another identical stream decoded (issue 6).
                decoded = getattr(self._submitted.pop(b, None), "decoded_here", True)
                try:
                    arrays = fut.result()
                except BaseException:
                    self.ring.abandon(slot)
                    raise
                self._count_bad()
                ids = np.asarray(self.source.batch_ids(epoch, b), dtype=np.uint64)
                length = len(ids) if arrays is None or not len(arrays) else len(arrays[0])
                published = self.ring.publish(slot, length)
                self._published += 1
                self.counters.batches_sent += 1
                self.counters.samples_sent += length
                if decoded:
                    self.dataset.batches_decoded += 1
                    self.dataset.samples_decoded += length
                yield BatchOut(
                    epoch=epoch,
                    batch_index=b,
                    slot=slot,
                    length=length,
                    tensors=self._tensors(length),
                    sample_ids=ids,
                    published=published,
                )
                delivered += 1
            yield EpochEnd(epoch=epoch, batches=n)
        finally:
            for _, slot, fut in pending:
                fut.cancel()
                self.ring.abandon(slot)
            self._submitted.clear()

    def _count_bad(self) -> None:
        """Add the samples this stream's source skipped since the last batch to the dataset's."""
        inner = getattr(self.source, "source", self.source)  # a SharedSource wraps its own
        bad = getattr(inner, "bad_samples", None)
        if bad is not None and len(bad) > self._bad_seen:
            self.dataset.bad_samples += len(bad) - self._bad_seen
            self._bad_seen = len(bad)

    def _promote(self, b: int) -> None:
        cfut = self._submitted.get(b)
        promote = getattr(self.source, "promote", None)
        if cfut is not None and promote is not None:
            promote(cfut)

    def _tensors(self, length: int) -> tuple[TensorOut, ...]:
        return tuple(
            TensorOut(t.name, (length, *t.shape), t.dtype, t.offset, t.sample_bytes * length)
            for t in self.layout.tensors
        )

    def close(self) -> None:
        """Free the ring and every lease (idempotent)."""
        if self.closed:
            return
        self.closed = True
        close_source = getattr(self.source, "close", None)
        if callable(close_source):  # a shared source leaves its sharing group
            with contextlib.suppress(Exception):
                close_source()
        with contextlib.suppress(Exception):
            self.ring.close()
        self._wake.set()
