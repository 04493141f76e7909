"""Spreading one epoch over several daemons: batch b comes from daemon b mod S, delivered in order.

A job that outgrows one decode machine lists several daemons (``server=["h1:port", "h2:port"]``).
There is no coordinator: every daemon can produce any batch (the order is a pure function of the
seed and epoch), so the client decides who makes what.

Assignment. With S daemons and the set ``dead`` of daemons that failed so far::

    owner(b) = b % S                                   if that daemon is alive
             = alive[(b // S) % len(alive)]            otherwise (alive sorted by index)

so a dead daemon's share is spread round-robin over the survivors, the same way on every run
with the same failures. A batch already requested from a daemon that then dies is requested again
from its new owner; a batch already *received* from it is kept. Each position in
``[start, num_batches)`` is therefore delivered exactly once, in order: none lost, none repeated.

Flow. Each daemon is a :class:`DaemonLink`: requests are pipelined and answered in request
order (a batch stream's WANT/receive). The reader keeps at most ``credits_per_daemon`` batches
requested-or-buffered per daemon, plus the batch the consumer is waiting for, so memory is bounded
by ``S * (credits_per_daemon + 1)`` batches; a stream's buffer pool needs ``credits_per_daemon + 2``
buffers (one more for the batch the consumer still holds). Batches that arrive ahead of their
turn wait in a small reorder buffer.

Failure. A ``ConnectionError`` (the grpc client raises ``beton_client.errors.ServerUnavailable``)
from ``request`` or ``receive`` marks the daemon dead; ``on_daemon_lost(index, exc)`` is called
(log it); its link is closed. When no daemon is left, :class:`AllDaemonsLostError` is raised.
Any other exception propagates unchanged.

Stopping early. An epoch iterator that is closed before its end (``break`` then ``close()``)
*drains*: it receives the answers still owed, so that the links stay in step for the next epoch.
An epoch stopped by Ctrl-C (``KeyboardInterrupt``) does not drain: the interrupt may have landed
between a receive and its bookkeeping, so what the links still owe is unknown, and the reader
says it is :attr:`~MultiDaemonReader.out_of_step` (its owner re-opens the stream). Once the
reader itself is closed (:meth:`MultiDaemonReader.close`, which the Loader's stream calls
when it is closed, abandoned or the interpreter exits) nothing is drained: an iterator finalised
later, even by the garbage collector at interpreter shutdown, never blocks and never receives
(issue 11: a drain that ran at shutdown started a timer thread and hung the process for good).

API::

    DaemonLink (protocol): request(epoch, batch_index); receive() -> batch; close()
    CallableLink(fetch, daemon_index)   # fetch(daemon_index, epoch, batch_index) -> batch
    StreamLink(stream, timeout=None)    # over a _transport.grpc_codec.BatchStream
    MultiDaemonReader(links, *, credits_per_daemon=2, on_daemon_lost=None, discard=None)
        .iter_epoch(epoch, num_batches, start=0) -> Iterator[batch]
        .alive -> tuple[int, ...];  owner(batch_index) -> int;  .close()

Threading: single consumer thread; no threads of its own. Pure logic: the tests drive it with
fake links, including one that dies mid-epoch.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "AllDaemonsLostError",
    "CallableLink",
    "DaemonLink",
    "MultiDaemonReader",
    "StreamLink",
]

#: Exceptions that may land between any two bytecodes (a signal handler raises them), so
#: between a link's receive and the reader's bookkeeping of it: see ``out_of_step``.
ASYNC_EXCEPTIONS = (KeyboardInterrupt, SystemExit)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class AllDaemonsLostError(ConnectionError):
    """Every daemon of a multi-daemon stream failed; the last failure is the ``__cause__``.

    Attributes:
        failures: each lost daemon's failure, by daemon index, in the order they were lost.
    """

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, BaseException] = dict(failures or {})


class DaemonLink(Protocol[T_co]):
    """A pipelined connection to one daemon.

    ``request`` must not block for long (it only grants a credit); ``receive`` blocks until the
    oldest requested batch has arrived and returns it. Both raise ``ConnectionError`` when the
    daemon is gone. ``close`` is idempotent and never raises.
    """

    def request(self, epoch: int, batch_index: int) -> None: ...

    def receive(self) -> T_co: ...

    def close(self) -> None: ...


class CallableLink(Generic[T]):
    """A link over a blocking ``fetch(daemon_index, epoch, batch_index) -> batch`` callable.

    Requests are queued and fetched one by one on ``receive``: no concurrency, which suits tests
    and request/response back ends.
    """

    def __init__(self, fetch: Callable[[int, int, int], T], daemon_index: int) -> None:
        self._fetch = fetch
        self._index = daemon_index
        self._queue: collections.deque[tuple[int, int]] = collections.deque()

    def request(self, epoch: int, batch_index: int) -> None:
        self._queue.append((epoch, batch_index))

    def receive(self) -> T:
        epoch, b = self._queue[0]
        out = self._fetch(self._index, epoch, b)
        self._queue.popleft()
        return out

    def close(self) -> None:
        self._queue.clear()


class StreamLink:
    """A link over a ``BatchStream`` (one bidirectional batch call to one daemon)."""

    def __init__(self, stream: Any, timeout: float | None = None) -> None:
        self._stream = stream
        self._timeout = timeout

    def request(self, epoch: int, batch_index: int) -> None:
        self._stream.want([(epoch, batch_index)])

    def receive(self) -> Any:
        return self._stream.receive(self._timeout)

    def close(self) -> None:
        self._stream.close()


def _keep(item: Any) -> None:
    """The default ``discard``: nothing to give back."""


class MultiDaemonReader(Generic[T]):
    """Reads epochs from S daemons, batch b from ``owner(b)``, in order (see the module docstring).

    Args:
        links: one link per daemon, index = daemon index. The reader closes links of daemons it
            declares dead; the caller closes the rest.
        credits_per_daemon: batches requested or buffered per daemon at once (>= 1).
        on_daemon_lost: called as ``on_daemon_lost(index, exc)`` when a daemon is declared dead.
        discard: called on batches received but never delivered (when the consumer stops early),
            e.g. to give their buffers back; default: nothing.
        names: each daemon's address, for messages (default: ``#index``).
    """

    def __init__(
        self,
        links: Sequence[DaemonLink[T]],
        *,
        credits_per_daemon: int = 2,
        on_daemon_lost: Callable[[int, BaseException], None] | None = None,
        discard: Callable[[T], None] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if not links:
            raise ValueError("at least one daemon link is needed")
        if credits_per_daemon < 1:
            raise ValueError("credits_per_daemon must be >= 1")
        self._links = list(links)
        self._names = list(names) if names is not None else [f"#{i}" for i in range(len(links))]
        self._credits = credits_per_daemon
        self._on_lost = on_daemon_lost
        self._discard: Callable[[T], None] = discard or _keep
        self._dead: set[int] = set()
        #: Why each lost daemon was lost (for the final error: a drain is not a crash).
        self._failures: dict[int, BaseException] = {}
        self._alive: list[int] = list(range(len(self._links)))
        self._closed = False
        #: An asynchronous exception (Ctrl-C) stopped an epoch: see :attr:`out_of_step`.
        self._out_of_step = False

    @property
    def alive(self) -> tuple[int, ...]:
        """Indices of the daemons not declared dead, ascending."""
        return tuple(self._alive)

    @property
    def out_of_step(self) -> bool:
        """Whether an epoch was stopped by an asynchronous exception (``KeyboardInterrupt``,
        ``SystemExit``). It may have landed between a link's send or receive and the reader's
        bookkeeping of it (a batch received and not yet counted), so the answers the links still
        owe are unknown: nothing is drained (a drain could wait for an answer that never comes),
        and the links must be closed, not used for another epoch. Also after :meth:`abandon`."""
        return self._out_of_step

    def abandon(self) -> None:
        """Give up the epoch being read without draining it: the consumer failed it itself
        (a batch's skipped samples exhausted the bad-sample budget), and what the links still
        owe may include answers that fail too. The reader is then :attr:`out_of_step`, so its
        owner re-opens the stream for the next epoch."""
        self._out_of_step = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Close every link (idempotent, never raises). Epoch iterators stopped or finalised
        afterwards drain nothing (see the module docstring)."""
        self._closed = True
        for link in self._links:
            with contextlib.suppress(Exception):
                link.close()

    def owner(self, batch_index: int) -> int:
        """The daemon that produces ``batch_index`` given the failures seen so far."""
        s = len(self._links)
        d = batch_index % s
        if d not in self._dead:
            return d
        if not self._alive:
            raise AllDaemonsLostError("no daemon is left", self._failures)
        return self._alive[(batch_index // s) % len(self._alive)]

    def _lose(self, d: int, exc: BaseException) -> None:
        self._failures[d] = exc
        self._dead.add(d)
        self._alive = [i for i in self._alive if i != d]
        try:
            self._links[d].close()
        except Exception:  # a dying link's close must not mask the failover
            pass
        if self._on_lost is not None:
            self._on_lost(d, exc)
        if not self._alive:
            name = self._names[d] if d < len(self._names) else f"#{d}"
            text = (
                f"the daemon {name} failed: {exc}"
                if len(self._links) == 1
                else f"all {len(self._links)} daemons failed; the last one, {name}, with: {exc}"
            )
            raise AllDaemonsLostError(text, self._failures) from exc

    def iter_epoch(self, epoch: int, num_batches: int, start: int = 0) -> Iterator[T]:
        """Yield batches ``start .. num_batches-1`` of ``epoch`` in order, each exactly once.

        Raises:
            AllDaemonsLostError: every daemon failed before the epoch was complete.
        """
        if not 0 <= start <= num_batches:
            raise ValueError(f"start {start} is outside [0, {num_batches}]")
        ep = _Epoch(self, epoch, start, num_batches)
        try:
            while ep.cursor < num_batches:
                ep.dispatch()
                got = ep.ready.pop(ep.cursor, None)
                if got is None:
                    ep.receive_from(ep.location[ep.cursor])
                    continue
                item, src = got
                ep.held[src] -= 1
                ep.cursor += 1
                yield item
        except ASYNC_EXCEPTIONS:
            self._out_of_step = True
            raise
        finally:
            ep.drain()


class _Epoch(Generic[T]):
    """Per-epoch bookkeeping of a :class:`MultiDaemonReader`."""

    def __init__(self, reader: MultiDaemonReader[T], epoch: int, start: int, end: int) -> None:
        self.r = reader
        self.epoch = epoch
        self.cursor = start
        self.end = end
        self.next_new = start
        self.orphans: set[int] = set()
        n = len(reader._links)
        self.outstanding: list[collections.deque[int]] = [collections.deque() for _ in range(n)]
        self.held = [0] * n  # requested or buffered, per daemon
        self.location: dict[int, int] = {}
        self.ready: dict[int, tuple[T, int]] = {}

    def _request(self, d: int, b: int) -> bool:
        try:
            self.r._links[d].request(self.epoch, b)
        except ConnectionError as exc:
            self.orphans.add(b)
            self.lose(d, exc)
            return False
        self.outstanding[d].append(b)
        self.location[b] = d
        self.held[d] += 1
        self.orphans.discard(b)
        return True

    def _room(self, d: int, b: int) -> bool:
        # the batch the consumer waits for is always let through, so a daemon whose credits are
        # taken by later batches cannot starve the cursor
        return self.held[d] < self.r._credits or b == self.cursor

    def dispatch(self) -> None:
        progress = True
        while progress:
            progress = False
            limit = min(self.end, self.cursor + self.r._credits * len(self.r._alive))
            for b in sorted(self.orphans):
                if b >= limit:
                    break
                d = self.r.owner(b)
                if self._room(d, b):
                    progress = True
                    if not self._request(d, b):
                        break  # the alive set changed: recompute owners
            else:
                while self.next_new < limit:
                    b = self.next_new
                    d = self.r.owner(b)
                    if not self._room(d, b):
                        break
                    self.next_new += 1
                    if not self._request(d, b):
                        progress = True
                        break

    def receive_from(self, d: int) -> None:
        try:
            item = self.r._links[d].receive()
        except ConnectionError as exc:
            self.lose(d, exc)
            return
        b = self.outstanding[d].popleft()
        del self.location[b]
        self.ready[b] = (item, d)

    def lose(self, d: int, exc: BaseException) -> None:
        for b in self.outstanding[d]:
            del self.location[b]
            self.orphans.add(b)
        self.outstanding[d].clear()
        self.held[d] = 0
        self.r._lose(d, exc)

    def drain(self) -> None:
        """Consume answers still owed (the consumer stopped early) so the links stay in sync;
        nothing is received once the reader is closed or the interpreter is shutting down."""
        for item, _ in self.ready.values():
            self.r._discard(item)
        self.ready.clear()
        if self.r._closed or self.r._out_of_step or sys.is_finalizing():
            for pending in self.outstanding:
                pending.clear()
            return
        for d, pending in enumerate(self.outstanding):
            while pending and d in self.r._alive:
                try:
                    item = self.r._links[d].receive()
                except ASYNC_EXCEPTIONS:
                    self.r._out_of_step = True
                    raise
                except ConnectionError as exc:
                    pending.clear()
                    self.r._dead.add(d)
                    self.r._alive = [i for i in self.r._alive if i != d]
                    self.r._links[d].close()
                    if self.r._on_lost is not None:
                        self.r._on_lost(d, exc)
                    break
                pending.popleft()
                self.r._discard(item)
