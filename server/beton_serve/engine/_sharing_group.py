"""The sharing group: :class:`SharedProducer` and its :class:`Consumer` (see ``sharing``).

The data structure, the lag and join rules and the threading contract are described in the
public module, :mod:`beton_serve.engine.sharing`, which re-exports everything here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from beton_serve.errors import BetonError, SpecError

# Logged under the public module's name: that is the one operators filter on.
log = logging.getLogger("beton_serve.engine.sharing")

__all__ = [
    "BatchTimeoutError",
    "Consumer",
    "SharedBatch",
    "SharedProducer",
    "SharingStats",
]

S = TypeVar("S")

# Handles to free once the lock is dropped, each with the free of the consumer that produced it.
FreeList = list[tuple[Callable[[Any], None], Any]]

_PENDING, _READY, _FAILED = 0, 1, 2


class BatchTimeoutError(BetonError, TimeoutError):
    """``Consumer.next`` waited longer than its timeout for another thread's ``produce`` call."""


@dataclass(frozen=True, slots=True)
class SharedBatch(Generic[S]):
    """One batch handed to a consumer. Give it back with :meth:`Consumer.release`.

    Attributes:
        epoch: the epoch.
        index: the batch index within the epoch.
        handle: what ``produce`` returned; shared read-only with the other consumers when
            ``shared`` is true.
        shared: true when the batch came from the group, false when the consumer produced it
            privately (after being detached, or when it never joined).
    """

    epoch: int
    index: int
    handle: S
    shared: bool


@dataclass(frozen=True, slots=True)
class SharingStats:
    """Counters of one producer (a snapshot).

    Attributes:
        consumers: consumers attached to the group now.
        produced: batches produced for the group (shared).
        produced_private: batches produced by private or detached consumers.
        freed: group batches freed.
        detached: consumers detached for lagging.
        joined_private: consumers that asked to attach but got a private stream.
        live: group batches produced and not yet freed (including retained ones).
        retained: batches no consumer needs, kept for late joiners (``retain``).
        peak_live: the largest ``live`` seen.
    """

    consumers: int
    produced: int
    produced_private: int
    freed: int
    detached: int
    joined_private: int
    live: int
    retained: int
    peak_live: int


class _Entry:
    __slots__ = ("error", "free", "handle", "holders", "pos", "state")

    def __init__(self, pos: int, holders: set[Consumer[Any]], free: Callable[[Any], None]) -> None:
        self.pos = pos
        self.holders = holders
        self.free = free  # the free of the consumer that produced it
        self.state = _PENDING
        self.handle: Any = None
        self.error: BaseException | None = None


class Consumer(Generic[S]):
    """One stream's view of a :class:`SharedProducer`. Created by :meth:`SharedProducer.attach`.

    :meth:`next` is meant to be called by one thread at a time (the stream's); :meth:`release`
    and :meth:`close` may be called from any thread, concurrently with :meth:`next` (e.g. from a
    future's done-callback on a worker thread). Different consumers may run on different threads.
    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        group: SharedProducer[S],
        pos: int,
        stop: int | None,
        *,
        shared: bool,
        produce: Callable[[int, int], S],
        free: Callable[[S], None],
        ahead: int = 0,
    ) -> None:
        self._group = group
        self._produce = produce
        self._free = free
        self._start = pos
        self._ahead = ahead
        self._pos = pos
        self._stop = stop
        self._shared = shared
        self._was_shared = shared
        self._closed = False
        # pos -> group entry, for shared batches taken and not yet released.
        self._taken: dict[int, _Entry] = {}
        # private batches handed out and not yet released: pos -> handle
        self._private: dict[int, S] = {}

    # ---------------------------------------------------------------------- properties
    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, index)`` of the next batch :meth:`next` returns."""
        return divmod(self._pos, self._group.batches_per_epoch)

    @property
    def shared(self) -> bool:
        """Whether the consumer reads the group's batches now."""
        return self._shared

    @property
    def detached(self) -> bool:
        """Whether it was attached to the group and has been moved to a private stream."""
        return self._was_shared and not self._shared

    def _progress(self) -> int:
        # What the consumer's reader has (at least) consumed: its position less its read-ahead,
        # never before where it started. Lag is measured on this, so a stream that prefetches
        # `ahead` batches is not "ahead" of an identical one that has not filled its read-ahead.
        return max(self._start, self._pos - self._ahead)

    @property
    def finished(self) -> bool:
        """Whether it has reached its ``stop`` position."""
        return self._stop is not None and self._pos >= self._stop

    @property
    def held(self) -> int:
        """Batches handed out by :meth:`next` and not yet released."""
        return len(self._taken) + len(self._private)

    # ---------------------------------------------------------------------- operations
    def next(self, timeout: float | None = 30.0) -> SharedBatch[S] | None:
        """The next batch, in order, or ``None`` at ``stop``.

        Args:
            timeout: how long to wait, at most, for another thread's ``produce`` of this batch.

        Raises:
            BetonError: the consumer is closed.
            BatchTimeoutError: the wait exceeded ``timeout``; the position is unchanged.
            Exception: whatever ``produce`` raised for this batch; the position is unchanged.
        """
        if self._closed:
            raise BetonError("this sharing consumer is closed; attach a new one")
        if self.finished:
            return None
        if self._shared:
            batch = self._group._next_shared(self, timeout)
            if batch is not None:
                return batch
        return self._next_private()

    def _next_private(self) -> SharedBatch[S]:
        pos = self._pos
        epoch, index = divmod(pos, self._group.batches_per_epoch)
        handle = self._produce(epoch, index)
        with self._group._cond:
            self._group._produced_private += 1
            closed = self._closed
            if not closed:
                self._pos = pos + 1
                self._private[pos] = handle
        if closed:  # closed by another thread while we produced
            self._free(handle)
            raise BetonError("this sharing consumer was closed while producing a batch")
        return SharedBatch(epoch, index, handle, False)

    def release(self, batch: SharedBatch[S]) -> None:
        """Give back a batch from :meth:`next`; frees its slot if nobody else needs it.

        Releasing after :meth:`close` is a no-op (close released everything).

        Raises:
            BetonError: the batch was not handed to this consumer, or was released already.
        """
        pos = batch.epoch * self._group.batches_per_epoch + batch.index
        if batch.shared:
            self._group._release_shared(self, pos)
            return
        with self._group._cond:
            if self._closed:
                return
            if pos not in self._private:
                raise BetonError(
                    f"batch (epoch {batch.epoch}, index {batch.index}) is not held by this consumer"
                )
            handle = self._private.pop(pos)
        self._free(handle)

    def close(self) -> None:
        """Detach from the group and release every batch still held. Idempotent."""
        private = self._group._close_consumer(self)
        for handle in private:
            self._free(handle)

    def __enter__(self) -> Consumer[S]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedProducer(Generic[S]):
    """Produces each batch of one :class:`ShareKey` once for every attached :class:`Consumer`.

    Args:
        produce: ``produce(epoch, index) -> handle``: start producing that batch into a slot
            that every consumer can read, and return a handle to it. Called once per batch for
            the group (again only for late joiners needing freed batches), and once per batch for
            each private consumer. Called without the lock held.
        free: ``free(handle)``: the last holder released the batch; return its slot. Called
            exactly once per handle ``produce`` returned, without the lock held.
        batches_per_epoch: batches in one epoch (``len(BatchSource)``), > 0.
        max_lag: how many batches a consumer may fall behind the leader before it is detached
            onto a private stream, >= 0. Size it with the ring: the group holds at most
            ``max_lag + 1`` batches plus those its consumers have taken and not released, plus
            ``retain``.
        retain: how many of the most recent batches that no attached consumer needs any more
            are kept (not freed) for consumers that attach a little later, e.g. N identical
            jobs started within a few batches of each other; the oldest is freed first. 0 frees
            a batch as soon as its last holder releases it. Retained batches are freed when the
            last consumer leaves.
        on_empty: called (without the lock) when the last attached consumer leaves; used by
            :class:`SharingRegistry` to drop the group.

    Raises:
        SpecError: ``batches_per_epoch`` or ``max_lag`` out of range.
    """

    def __init__(
        self,
        produce: Callable[[int, int], S],
        free: Callable[[S], None],
        *,
        batches_per_epoch: int,
        max_lag: int,
        retain: int = 0,
        on_empty: Callable[[SharedProducer[S]], None] | None = None,
    ) -> None:
        if retain < 0:
            raise SpecError(f"retain must be >= 0 batches, got {retain}")
        if batches_per_epoch <= 0:
            raise SpecError(f"batches_per_epoch must be > 0, got {batches_per_epoch}")
        if max_lag < 0:
            raise SpecError(f"max_lag must be >= 0 batches, got {max_lag}")
        self._produce = produce
        self._free = free
        self.batches_per_epoch = int(batches_per_epoch)
        self.max_lag = int(max_lag)
        self.retain = int(retain)
        self._on_empty = on_empty
        # Produced batches no consumer holds any more, kept for late joiners: pos -> entry.
        self._retained: dict[int, _Entry] = {}
        self._cond = threading.Condition(threading.Lock())
        self._consumers: set[Consumer[S]] = set()
        self._entries: dict[int, _Entry] = {}
        self._closed = False  # set by the registry once the group is dropped
        self._produced = self._produced_private = self._freed = 0
        self._detached = self._joined_private = self._peak_live = 0

    # ---------------------------------------------------------------------- public
    def attach(
        self,
        epoch: int = 0,
        index: int = 0,
        *,
        stop: tuple[int, int] | None = None,
        produce: Callable[[int, int], S] | None = None,
        free: Callable[[S], None] | None = None,
        ahead: int = 0,
    ) -> Consumer[S]:
        """Attach a consumer that starts at ``(epoch, index)`` and stops before ``stop``.

        It shares with the group when joining detaches nobody (see the module docstring);
        otherwise it gets a private stream from the same position (``consumer.shared`` says
        which).

        Args:
            epoch: the first batch's epoch, >= 0.
            index: the first batch's index in that epoch, in ``[0, batches_per_epoch)``.
            stop: the exclusive end position ``(epoch, index)``, or ``None`` for no end; e.g.
                ``(epoch + 1, 0)`` for the rest of one epoch.
            produce: this consumer's own ``produce``, used when *it* produces a batch (for the
                group, or privately); the group's by default. Give each stream its own when the
                production bound (e.g. a source's in-flight credit) is per stream.
            free: the ``free`` matching ``produce``; a batch is freed by the ``free`` of the
                consumer that produced it.
            ahead: how many batches this consumer takes ahead of what its reader has consumed
                (a stream's credits). Lag, for detaching and for joining, is measured on
                ``max(start, position - ahead)``, so identical readers with different read-ahead
                depths, or one whose read-ahead is full and one just starting, are level.

        Raises:
            SpecError: a position out of range, or ``stop`` before the start.
        """
        pos = self._linear(epoch, index, "start")
        end = None if stop is None else self._linear(stop[0], stop[1], "stop", allow_end=True)
        if end is not None and end < pos:
            raise SpecError(f"stop {stop} is before the start ({epoch}, {index})")
        with self._cond:
            shared = not self._closed and self._may_join(pos, end)
            c: Consumer[S] = Consumer(
                self,
                pos,
                end,
                shared=shared,
                produce=produce if produce is not None else self._produce,
                free=free if free is not None else self._free,
                ahead=max(0, int(ahead)),
            )
            if shared:
                self._consumers.add(c)
                for k, e in self._entries.items():
                    if k >= pos and (end is None or k < end):
                        e.holders.add(c)
                        self._retained.pop(k, None)
            else:
                self._joined_private += 1
        return c

    def stats(self) -> SharingStats:
        """A snapshot of the producer's counters."""
        with self._cond:
            return SharingStats(
                consumers=len(self._consumers),
                produced=self._produced,
                produced_private=self._produced_private,
                freed=self._freed,
                detached=self._detached,
                joined_private=self._joined_private,
                live=len(self._entries),
                retained=len(self._retained),
                peak_live=self._peak_live,
            )

    # ---------------------------------------------------------------------- internals
    def _linear(self, epoch: int, index: int, what: str, *, allow_end: bool = False) -> int:
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            if not (allow_end and index == 0 and epoch >= 0):
                raise SpecError(
                    f"{what} position (epoch {epoch}, index {index}) is out of range: epochs "
                    f"start at 0 and indices lie in [0, {self.batches_per_epoch})"
                )
        return epoch * self.batches_per_epoch + index

    def _may_join(self, pos: int, end: int | None) -> bool:
        if end is not None and pos >= end:
            return False  # nothing to read: a private, finished consumer
        if not self._consumers:
            return True
        leader = max(c._progress() for c in self._consumers)
        active = [c._progress() for c in self._consumers if not c.finished]
        slowest = min(active) if active else leader
        return leader - self.max_lag <= pos <= slowest + self.max_lag

    def _next_shared(self, c: Consumer[S], timeout: float | None) -> SharedBatch[S] | None:
        """Take position ``c._pos`` from the group; ``None`` if ``c`` was detached meanwhile."""
        to_free: FreeList = []
        produce_it = False
        with self._cond:
            if not c._shared:
                return None
            pos = c._pos
            entry = self._entries.get(pos)
            if entry is None:
                holders = {
                    o
                    for o in self._consumers
                    if o._pos <= pos and (o._stop is None or pos < o._stop)
                }
                entry = _Entry(pos, holders, c._free)
                self._entries[pos] = entry
                self._peak_live = max(self._peak_live, len(self._entries))
                produce_it = True
            entry.holders.add(c)
            self._retained.pop(pos, None)
            c._taken[pos] = entry
            c._pos = pos + 1
            to_free = self._detach_laggards_locked()
        for free, h in to_free:
            free(h)
        epoch, index = divmod(pos, self.batches_per_epoch)
        if produce_it:
            try:
                handle = c._produce(epoch, index)
            except BaseException as exc:
                with self._cond:
                    entry.state, entry.error = _FAILED, exc
                    self._cond.notify_all()
                self._undo_take(c, entry)
                raise
            with self._cond:
                entry.handle, entry.state = handle, _READY
                self._produced += 1
                to_free = self._unheld_locked(entry) if not entry.holders else []
                self._cond.notify_all()
            for free, h in to_free:
                free(h)
            return SharedBatch(epoch, index, handle, True)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while entry.state == _PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            state, handle, error = entry.state, entry.handle, entry.error
        if state == _READY:
            return SharedBatch(epoch, index, handle, True)
        self._undo_take(c, entry)
        if error is not None:
            raise error
        raise BatchTimeoutError(
            f"waited {timeout} s for batch (epoch {epoch}, index {index}) being produced by "
            "another stream of the same sharing group"
        )

    def _undo_take(self, c: Consumer[S], entry: _Entry) -> None:
        """Give back a batch ``c`` took but could not use; its position goes back to it."""
        to_free: FreeList = []
        with self._cond:
            c._taken.pop(entry.pos, None)
            if c._pos == entry.pos + 1:
                c._pos = entry.pos
            entry.holders.discard(c)
            # A PENDING entry without holders is left to the thread producing it, which frees
            # it when produce returns; a READY one became ready just after a timeout.
            if not entry.holders:
                to_free = self._unheld_locked(entry)
        for free, h in to_free:
            free(h)

    def _detach_laggards_locked(self) -> FreeList:
        """Move consumers more than ``max_lag`` behind the leader to private streams.

        Returns the handles that lost their last holder, to be freed once the lock is dropped.
        """
        if len(self._consumers) < 2:
            return []
        leader = max(o._progress() for o in self._consumers)
        lagging = [
            o for o in self._consumers if not o.finished and leader - o._progress() > self.max_lag
        ]
        to_free: FreeList = []
        for o in lagging:
            self._detached += 1
            epoch, index = divmod(o._pos, self.batches_per_epoch)
            # Logged under the lock: rare, and the message is formatted lazily.
            log.info(
                "sharing: a stream %d batches behind the leader (max_lag %d) continues on its "
                "own from epoch %d batch %d",
                leader - o._progress(),
                self.max_lag,
                epoch,
                index,
            )
            to_free.extend(self._leave_locked(o, untaken_only=True))
        return to_free

    def _leave_locked(self, c: Consumer[S], *, untaken_only: bool) -> FreeList:
        """Remove ``c`` from the group; drop it from the holders of the batches it has not
        taken (and, unless ``untaken_only``, of those it has). Returns handles to free."""
        self._consumers.discard(c)
        c._shared = False
        to_free: FreeList = []
        for pos in sorted(self._entries):
            e = self._entries[pos]
            if c not in e.holders:
                continue
            if untaken_only and pos in c._taken:
                continue
            e.holders.discard(c)
            c._taken.pop(pos, None)
            if not e.holders:
                to_free.extend(self._unheld_locked(e))
        return to_free

    def _unheld_locked(self, e: _Entry) -> FreeList:
        """``e`` lost its last holder: retain it for late joiners, or free it.

        A PENDING entry is left to its producer (which calls this again when it is READY); a
        FAILED one is dropped. Returns what to free once the lock is dropped.
        """
        if e.state == _PENDING:
            return []
        if self._entries.get(e.pos) is not e:
            # Orphaned (replaced after a failure, or evicted): free it if it holds a batch.
            if e.state == _READY:
                self._freed += 1
                return [(e.free, e.handle)]
            return []
        if e.state == _FAILED:
            del self._entries[e.pos]
            return []
        if self.retain > 0 and self._consumers:
            self._retained[e.pos] = e
            return self._evict_locked(self.retain)
        del self._entries[e.pos]
        self._freed += 1
        return [(e.free, e.handle)]

    def _evict_locked(self, keep: int) -> FreeList:
        """Free retained entries, oldest positions first, until ``keep`` are left."""
        out: FreeList = []
        while len(self._retained) > keep:
            pos = min(self._retained)
            e = self._retained.pop(pos)
            del self._entries[pos]
            self._freed += 1
            out.append((e.free, e.handle))
        return out

    def _release_shared(self, c: Consumer[S], pos: int) -> None:
        with self._cond:
            if c._closed:
                return  # close released it already
            entry = c._taken.pop(pos, None)
            if entry is None:
                epoch, index = divmod(pos, self.batches_per_epoch)
                raise BetonError(
                    f"batch (epoch {epoch}, index {index}) is not held by this consumer"
                )
            entry.holders.discard(c)
            to_free = self._unheld_locked(entry) if not entry.holders else []
        for free, h in to_free:
            free(h)

    def _close_consumer(self, c: Consumer[S]) -> list[S]:
        """Remove ``c`` for good; free what only it held. Returns its private handles, which
        the caller frees with ``c``'s own ``free``."""
        with self._cond:
            if c._closed:
                return []
            c._closed = True
            was_member = c in self._consumers
            to_free = self._leave_locked(c, untaken_only=False)
            # Shared batches taken before a detach are still held by c: let them go too.
            for _, e in sorted(c._taken.items()):
                e.holders.discard(c)
                if not e.holders:
                    to_free.extend(self._unheld_locked(e))
            c._taken.clear()
            private = [c._private[k] for k in sorted(c._private)]
            c._private.clear()
            empty = was_member and not self._consumers
            if empty:  # nobody left to reuse retained batches
                to_free.extend(self._evict_locked(0))
        for free, h in to_free:
            free(h)
        if empty and self._on_empty is not None:
            self._on_empty(self)
        return private
