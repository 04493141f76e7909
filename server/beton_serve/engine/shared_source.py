"""``SharedSource``: a ``BatchSource`` look-alike that shares decoding between identical streams.

The daemon's streams talk to a source through ``submit(epoch, b, out, priority) -> Future``
(``BatchSourceLike`` in ``beton_serve.daemon``), writing each batch into a slot of the stream's own
ring. Wrapping a stream's :class:`~beton_serve.engine.BatchSource` in a :class:`SharedSource`
keeps that interface and the per-stream rings, leases and credits unchanged, while batches are
*decoded* once per sharing group (:mod:`beton_serve.engine.sharing`):

- A stream that is the only open one with its key (the registry's member count) is *solo*: its
  ``submit`` is the wrapped source's, decoding straight into its slot, so sharing costs nothing
  when there is nobody to share with. It moves to the group at its next ``submit`` once an
  identical stream opens, and back to solo when it is alone again.
- ``submit(epoch, b, out)`` takes batch ``(epoch, b)`` from the group. If no member has produced
  it yet, this stream produces it, on its own ``BatchSource`` (so each source's in-flight credit
  still bounds only its own stream's work), into a group buffer taken from this stream's small
  buffer pool.
- Zero copy: when the daemon gives the source an arena factory (shm streams) and the stream
  asks for it (``submit(..., by_reference=True)``: its client reads the notice channel), group
  buffers are taken from this stream's :class:`~beton_serve.transport.arena.ShmArena`, and the
  returned future carries a :class:`SharedRef` (segment, offset, ``release``) instead of a copy:
  the stream publishes the reference, its client reads the group buffer in place, and the stream
  calls ``release`` when the client releases the slot. The group frees the buffer once every
  member's client is done with it. When the arena is full, the batch falls back to a copy.
- Otherwise, when the group batch is done, it is copied into ``out`` (the stream's slot), the
  group batch is released, and the returned future completes. The copy is a memcpy (about 6 ms for a
  256x224x224x3 batch here), far cheaper than decoding JPEGs, though about the cost of "decoding"
  raw pixels; it keeps every client's slot private, so a client that dies or stalls holds only
  its own slots, and leases, liveness and credits work as without sharing.
- A stream that falls more than ``max_lag`` batches behind the group's leader is detached by the
  group and continues on its own source from its exact position (see ``sharing``). Its
  read-ahead (the source's ``batches_ahead``) is not counted as lag.
- A submit at a position other than the consumer's next one (a new epoch start after an early
  stop, a resume) re-attaches at that position, under the late-joiner policy of ``sharing``. So
  does a detached stream at the start of each epoch: it rejoins the group if it is close enough.

Counting. ``future.decoded_here`` is true on a returned future when this stream's source decoded
the batch (for the group or privately) and false when the batch was a copy of another stream's
work: the daemon adds a batch to its ``samples_decoded`` counter only when it is true, so the
counter shows 1x the epoch for N identical streams.

Cancelling. A stream cancels what it submitted and will not publish (its client closed or was
killed, a resume elsewhere) through the tasks its futures expose. A group batch is other
members' too, so the futures ``submit`` returns expose its tasks for ``promote`` only
(``BatchFuture.group_tasks``): one member leaving used to cancel a batch the others waited for,
and their streams failed with ``CancelledError``. A group batch every member gave up on is then
decoded anyway (at most the members' read-ahead, once).

Threads. ``submit``, ``promote`` and ``close`` are called by the stream's owner (the daemon's
event-loop thread). The copy into ``out`` runs in the done-callback of the group batch: on the
engine worker that finished it, or in ``submit`` itself when the batch was already done.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from beton_serve._batchmem import batch_empty
from beton_serve.engine._future import BatchFuture, SourceCaps
from beton_serve.engine.sharing import Consumer, ShareKey, SharingRegistry
from beton_serve.errors import BetonError

__all__ = ["Produced", "SharedRef", "SharedSource"]

log = logging.getLogger("beton_serve.engine.sharing")


@dataclass(slots=True)
class Produced:
    """A group batch: the future of its arrays, the buffers it is written into, the
    :class:`SharedSource` whose stream decoded it, and, for arena buffers, the arena and index."""

    future: Future[list[np.ndarray]]
    buffers: list[np.ndarray] | None
    owner: SharedSource
    arena: Any = None
    index: int = -1


class SharedRef:
    """Where a shared batch lives (``segment`` under /dev/shm, byte ``offset``), and how to give it
    back: :meth:`release`, once the stream's client is done with it (idempotent)."""

    __slots__ = ("_release", "offset", "segment")

    def __init__(self, segment: str, offset: int, release: Any) -> None:
        self.segment = segment
        self.offset = offset
        self._release = release

    def release(self) -> None:
        """Let the group free the batch (once every member is done); later calls do nothing."""
        release, self._release = self._release, None
        if release is not None:
            with contextlib.suppress(BetonError):
                release()


class SharedSource:
    """Wrap one stream's ``BatchSource`` so that identical streams decode each batch once.

    ``submit`` takes ``by_reference`` (zero-copy sharing; see the module docstring).

    Args:
        source: the stream's own ``BatchSource`` (``submit``, ``batch_ids``, ``len``, and
            optionally ``promote``, ``plan.outputs`` and ``plan.batch_size``, which size the pool).
        registry: the daemon's registry of sharing groups, one per :class:`ShareKey`.
        key: what makes this stream identical to others.
        pool_size: group buffers this stream keeps for reuse; more are allocated on demand and
            dropped when freed.
        timeout: how long ``submit`` may wait for another thread's in-progress ``produce`` of the
            same batch (it does not wait for the decode itself).
    """

    def __init__(
        self,
        source: Any,
        registry: SharingRegistry[Produced],
        key: ShareKey,
        *,
        pool_size: int = 4,
        timeout: float = 30.0,
        make_arena: Any = None,
    ) -> None:
        self.source = source
        self.supports_by_reference = make_arena is not None
        self._make_arena = make_arena
        self._arena: Any = None
        self.registry = registry
        self.key = key
        self._pool_size = int(pool_size)
        self._timeout = timeout
        self._consumer: Consumer[Produced] | None = None
        self._priority = 1
        self._slices: int | None = None
        self._lock = threading.Lock()
        self._pool: list[list[np.ndarray]] = []
        self._closed = False
        registry.add_member(key)
        plan = getattr(source, "plan", None)
        outputs = getattr(plan, "outputs", None)
        # The largest batch (the plan's rows, ``batch_rows``), not a batch_size above the epoch.
        bs = getattr(plan, "batch_size", None)
        if not isinstance(bs, int):
            bs = getattr(source, "batch_size", None)
        self._shapes: list[tuple[tuple[int, ...], np.dtype[Any]]] | None = None
        if outputs is not None and isinstance(bs, int):
            self._shapes = [((bs, *tuple(o.shape)), np.dtype(o.dtype)) for o in outputs]

    # ------------------------------------------------------------------ BatchSourceLike
    def __len__(self) -> int:
        return len(self.source)

    def batch_ids(self, epoch: int, b: int) -> np.ndarray:
        """The batch's sample ids (the wrapped source's)."""
        return np.asarray(self.source.batch_ids(epoch, b))

    def submit(
        self,
        epoch: int,
        b: int,
        out: list[np.ndarray] | None = None,
        priority: int = 1,
        *,
        slices: int | None = None,
        by_reference: bool = False,
    ) -> BatchFuture:
        """Deliver batch ``(epoch, b)`` into ``out`` (``None``: new arrays); ``slices`` is passed
        to the wrapped source when this stream decodes the batch.

        Returns:
            A future of ``[out[i][:n] ...]``, with ``decoded_here`` (see the module docstring),
            ``tasks`` (for :meth:`promote`) and ``shared_ref`` attributes. It is already running
            and cannot be cancelled: the copy into ``out`` always completes (as with
            ``BatchSource``). With ``by_reference``, a batch in an arena buffer is not copied:
            the arrays are the group buffer's and ``shared_ref`` (set before the future
            completes, else ``None``) is the :class:`SharedRef` the caller must release.

        Raises:
            BetonError: the source is closed.
            Exception: what the wrapped ``submit`` raised when this stream produced the batch.
        """
        if self._closed:
            raise BetonError("this shared source is closed")
        if self.registry.members(self.key) <= 1:
            if self._consumer is not None:  # alone again: leave the group
                self._consumer.close()
                self._consumer = None
            return self.source.submit(epoch, b, out, priority=priority, slices=slices)  # type: ignore[no-any-return]
        consumer = self._consumer_at(epoch, b)
        self._priority = priority
        self._slices = slices
        batch = consumer.next(timeout=self._timeout)
        if batch is None:  # cannot happen: consumers here have no stop
            raise BetonError(f"no batch ({epoch}, {b}) from the sharing group")
        produced = batch.handle
        decoded_here = produced.owner is self
        result = BatchFuture()
        result.set_running_or_notify_cancel()
        result.decoded_here = decoded_here
        group_future = produced.future
        if isinstance(group_future, BatchFuture):
            # Promoted, never cancelled, through this future (``BatchFuture.group_tasks``); the
            # list is the group batch's own, emptied when it completes.
            result.group_tasks = group_future.tasks
            # The ids the group batch holds (a skipped sample replaced), as the producer's
            # source patched them (engine._source.delivered_ids).
            result.sample_ids = group_future.sample_ids
            # What the group batch skipped, charged to this stream's own budget as this
            # stream delivers it (``BatchSource.charge``), whichever member decoded it.
            result.bad = group_future.bad

        # One shot: the group future keeps its callbacks, so deliver lets go of what it needs
        # (the stream's slot views, its future, the group batch) once it ran; otherwise they
        # would live in a cycle through ``produced`` until the garbage collector runs (issue 11).
        state: list[Any] = [out, result, produced, consumer, batch]

        def deliver(f: Future[list[np.ndarray]]) -> None:
            if not state:
                return
            out, result, produced, consumer, batch = state
            state.clear()
            views: list[np.ndarray] = []
            # An arena another process truncated holds zeros where the batch was written
            # (transport.shm, "Truncation"): neither referenced nor copied.
            error: BaseException | None = (
                None if produced.arena is None else produced.arena.damaged()
            )
            if (
                error is None
                and by_reference
                and produced.arena is not None
                and not f.cancelled()
                and f.exception() is None
            ):
                arena, index = produced.arena, produced.index
                # Pinned until the client releases it: the group may free the batch earlier (this
                # consumer re-attached or closed), and the buffer must not be reused under the
                # client meanwhile (issue 11 §4).
                arena.pin(index)

                def release() -> None:
                    try:
                        consumer.release(batch)
                    finally:
                        arena.unpin(index)

                result.shared_ref = SharedRef(arena.name, arena.offset(index), release)
                result.set_result(f.result())
                return
            try:
                # Not f.result(): raising here would put this frame, and the slot views in
                # its locals, into the traceback of the error the stream's future keeps.
                if error is None:
                    error = CancelledError() if f.cancelled() else f.exception()
                if error is None:
                    arrays = f.result()
                    dst = out if out is not None else [np.empty_like(a) for a in arrays]
                    for d, a in zip(dst, arrays, strict=True):
                        view = d[: len(a)]
                        np.copyto(view, a)
                        views.append(view)
            except BaseException as exc:  # the copy failed: keep the error, not this frame
                tb = exc.__traceback__
                error = exc.with_traceback(None if tb is None else tb.tb_next)
            finally:
                # Never let a bookkeeping error leave the stream's future pending.
                with contextlib.suppress(BetonError):
                    consumer.release(batch)
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(views)

        produced.future.add_done_callback(deliver)
        return result

    @property
    def caps(self) -> SourceCaps:
        """By reference when the daemon gave it an arena; looks ahead as its own source does."""
        return SourceCaps(
            by_reference=self.supports_by_reference, look_ahead=self.source.caps.look_ahead
        )

    def skipped(self) -> Sequence[Any]:
        """The samples the wrapped source skipped (``BatchSource.skipped``)."""
        return self.source.skipped()  # type: ignore[no-any-return]

    def charge(self, epoch: int, fut: Future[Any]) -> None:
        """Charge what batch ``fut`` skipped to this stream's budget (``BatchSource.charge``)."""
        self.source.charge(epoch, fut)

    def promote(self, fut: Future[Any]) -> None:
        """Move the decode behind ``fut`` ahead of prefetch work (its consumer is waiting)."""
        if isinstance(fut, BatchFuture):
            for task in (*fut.tasks, *fut.group_tasks):
                task.promote()

    def close(self) -> None:
        """Leave the sharing group and release what this stream holds. Idempotent."""
        if not self._closed:
            self.registry.remove_member(self.key)
        self._closed = True
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()
        if self._arena is not None:  # unlinked once the other members gave its buffers back
            self._arena.close()
        self.source.close()  # its own source leaves its decode groups now (issue 16)

    # ------------------------------------------------------------------ state
    @property
    def solo(self) -> bool:
        """Whether this stream is the only open one with its key (it then bypasses the group)."""
        return self.registry.members(self.key) <= 1

    @property
    def shared(self) -> bool:
        """Whether this stream currently reads the group's batches."""
        return self._consumer is not None and self._consumer.shared

    @property
    def detached(self) -> bool:
        """Whether the group detached this stream onto its own decoding for lagging."""
        return self._consumer is not None and self._consumer.detached

    # ------------------------------------------------------------------ internals
    def _consumer_at(self, epoch: int, b: int) -> Consumer[Produced]:
        c = self._consumer
        if c is not None and c.position == (epoch, b) and (c.shared or b != 0):
            return c
        # A new position, or a detached stream at an epoch start: (re)attach, which shares again
        # when the group's window allows it.
        if c is not None:
            c.close()
        c = self.registry.attach(
            self.key,
            produce=self._produce,
            free=self._free,
            batches_per_epoch=len(self.source),
            epoch=epoch,
            index=b,
            ahead=int(getattr(self.source, "batches_ahead", 0) or 0),
        )
        self._consumer = c
        return c

    def _take_buffers(self) -> list[np.ndarray] | None:
        if self._shapes is None:
            return None
        with self._lock:
            if self._pool:
                return self._pool.pop()
        return [batch_empty(shape, dtype) for shape, dtype in self._shapes]

    def _take_arena(self) -> tuple[Any, int, list[np.ndarray]] | None:
        if self._make_arena is None or self._closed:
            return None
        if self._arena is None:
            try:
                self._arena = self._make_arena()
            except BetonError as exc:  # e.g. /dev/shm is full: share by copying
                log.warning("no shared-memory arena for zero-copy sharing: %s", exc)
                self._make_arena = None
                return None
        got = self._arena.take()
        if got is None:
            return None
        return self._arena, got[0], got[1]

    def _produce(self, epoch: int, b: int) -> Produced:
        slot = self._take_arena()
        if slot is not None:
            arena, index, buffers = slot
            try:
                fut = self.source.submit(
                    epoch, b, buffers, priority=self._priority, slices=self._slices
                )
            except BaseException:
                arena.give(index)
                raise
            return Produced(fut, buffers, self, arena, index)
        pooled = self._take_buffers()
        fut = self.source.submit(epoch, b, pooled, priority=self._priority, slices=self._slices)
        return Produced(fut, pooled, self)

    def _free(self, produced: Produced) -> None:
        if produced.arena is not None:
            arena, index = produced.arena, produced.index
            # Only once the decode has finished writing into it.
            produced.future.add_done_callback(lambda _f: arena.give(index))
            return
        buffers = produced.buffers
        if buffers is None:
            return

        def recycle(_f: Future[Any], buffers: Sequence[np.ndarray] = buffers) -> None:
            # Only once the decode has finished writing into them.
            with self._lock:
                if len(self._pool) < self._pool_size and not self._closed:
                    self._pool.append(list(buffers))

        produced.future.add_done_callback(recycle)
