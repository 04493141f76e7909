"""The future of one batch, with what its consumer needs to know declared as attributes.

A batch's future used to carry ad-hoc attributes set by whoever made it (``sample_ids``,
``tasks``, ``decoded_here``, ``shared_ref``), and the daemon probed for them with ``getattr``.
:class:`BatchFuture` declares them once, with their defaults, so every producer of batch futures
(the worker pool, ``BatchSource``, ``SharedSource``) returns the same type and every consumer
reads the attributes directly.

Why it does not use ``concurrent.futures.Future``'s machinery: a CIFAR-sized batch is a few
hundred microseconds of work, and each one made two or three futures, each with a new
``threading.Condition`` (an ``RLock``, a deque of waiter locks, a new waiter lock per
``result()`` that has to wait) on the consumer's core, which the two workers also need
(RESULTS.md, session 19). :class:`LightFuture` keeps the ``Future`` API and its states, and
pays for what it uses: one plain lock per future guards the state and the callbacks, and a
*gate* lock, made only when somebody has to wait, is held until the future completes. A waiter
acquires the gate and passes it on at once, so any number of threads may wait.

It stays a ``concurrent.futures.Future`` (``asyncio.wrap_future`` requires one, and the daemon
wraps batch futures) and keeps the attributes that ``concurrent.futures.wait`` and
``as_completed`` read (``_state``, ``_waiters`` and ``_condition``, a ``Condition`` on the same
lock, made when first asked for), so those work on it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from beton_serve.engine._pool import Task

__all__ = ["BatchFuture", "LightFuture", "Releasable", "SourceCaps", "ids_or"]

#: The logger ``concurrent.futures`` reports a failing done-callback on.
_cf_log = logging.getLogger("concurrent.futures")
_DONE = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)
_CANCELLED = (CANCELLED, CANCELLED_AND_NOTIFIED)


class Releasable(Protocol):
    """A shared batch's handle: where it lives, and how to give it back (idempotent)."""

    segment: str
    offset: int

    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SourceCaps:
    """What a batch source can do, declared by the source (the daemon never probes for it).

    Attributes:
        by_reference: ``submit(..., by_reference=True)`` may deliver a batch in a group buffer
            (``BatchFuture.shared_ref``) instead of copying it into the caller's slot.
        look_ahead: batches of the next epoch may be decoded before the client starts it.
    """

    by_reference: bool = False
    look_ahead: bool = True


class LightFuture(Future[Any]):
    """A ``concurrent.futures.Future`` without a ``Condition`` per instance (module docstring).

    Same contract as ``Future``: the producer calls :meth:`set_running_or_notify_cancel`, then
    :meth:`set_result` or :meth:`set_exception`; any thread may wait, cancel or add callbacks.
    Callbacks run in the thread that completes (or cancels) the future, or at once in the
    caller's when it is already done; one that raises is logged, as ``Future`` does.

    ``Future.__init__`` is deliberately not called: it would make the ``Condition`` this class
    exists to avoid. Every method of ``Future`` is overridden.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        #: Held from its creation until the future is done; made by the first waiter.
        self._gate: threading.Lock | None = None
        self._cond: threading.Condition | None = None
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[Any]], object]] = []
        self._waiters: list[Any] = []  # concurrent.futures.wait's

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """For ``concurrent.futures.wait`` / ``as_completed``, which lock the future with it."""
        cond = self._cond
        if cond is None:
            cond = threading.Condition(self._mutex)
            if self._cond is None:  # racing makers: both wrap the same lock, either will do
                self._cond = cond
        return cond

    def __repr__(self) -> str:
        state = self._state
        if state == FINISHED:
            if self._exception is not None:
                what = f"raised {type(self._exception).__name__}"
            else:
                what = f"returned {type(self._result).__name__}"
            return f"<{type(self).__name__} at {id(self):#x} state=finished {what}>"
        return f"<{type(self).__name__} at {id(self):#x} state={state.lower()}>"

    # -- completing --------------------------------------------------------------------
    def _complete_locked(self, state: str) -> tuple[threading.Lock | None, list[Any]]:
        """Enter ``state`` (a done state) with ``_mutex`` held; returns the gate to open and
        the callbacks to run once it is released."""
        self._state = state
        gate, self._gate = self._gate, None
        callbacks, self._callbacks = self._callbacks, []
        return gate, callbacks

    def _after_complete(self, gate: threading.Lock | None, callbacks: list[Any]) -> None:
        if gate is not None:
            gate.release()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                _cf_log.exception("exception calling callback for %r", self)

    def cancel(self) -> bool:
        """Cancel unless running or done; True if the future is (now) cancelled."""
        with self._mutex:
            state = self._state
            if state in (RUNNING, FINISHED):
                return False
            if state in _CANCELLED:
                return True
            gate, callbacks = self._complete_locked(CANCELLED)
        self._after_complete(gate, callbacks)
        return True

    def set_running_or_notify_cancel(self) -> bool:
        """Mark running (True), or, when cancelled, notify ``wait``'s waiters (False)."""
        with self._mutex:
            state = self._state
            if state == PENDING:
                self._state = RUNNING
                return True
            if state == CANCELLED:
                self._state = CANCELLED_AND_NOTIFIED
                for waiter in self._waiters:
                    waiter.add_cancelled(self)
                return False
        raise RuntimeError(f"Future in unexpected state: {state}")

    def set_result(self, result: Any) -> None:
        """Complete with ``result``; ``InvalidStateError`` if it is already done."""
        self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        """Complete with ``exception``; ``InvalidStateError`` if it is already done."""
        self._finish(None, exception)

    def _finish(self, result: Any, exception: BaseException | None) -> None:
        with self._mutex:
            if self._state in _DONE:
                raise InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception = result, exception
            for waiter in self._waiters:
                if exception is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
            gate, callbacks = self._complete_locked(FINISHED)
        self._after_complete(gate, callbacks)

    # -- observing ---------------------------------------------------------------------
    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == RUNNING

    def done(self) -> bool:
        return self._state in _DONE

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        """Call ``fn(self)`` when done: now, in this thread, if it already is."""
        if self._state not in _DONE:
            with self._mutex:
                if self._state not in _DONE:
                    self._callbacks.append(fn)
                    return
        try:
            fn(self)
        except Exception:
            _cf_log.exception("exception calling callback for %r", self)

    def _wait_finished(self, timeout: float | None) -> None:
        """Return once finished; ``CancelledError`` if cancelled, ``TimeoutError`` after
        ``timeout`` seconds (``None``: no bound)."""
        if self._state == FINISHED:
            return
        with self._mutex:
            gate = None
            if self._state not in _DONE:
                gate = self._gate
                if gate is None:
                    gate = self._gate = threading.Lock()
                    gate.acquire()
        if gate is not None:
            if timeout is None:
                gate.acquire()
            elif not gate.acquire(timeout=min(max(0.0, timeout), threading.TIMEOUT_MAX)):
                raise TimeoutError
            gate.release()  # pass it on to the next waiter
        if self._state in _CANCELLED:
            raise CancelledError

    def result(self, timeout: float | None = None) -> Any:
        """The result, waiting up to ``timeout`` seconds; raises the future's exception,
        ``CancelledError``, or ``TimeoutError``."""
        self._wait_finished(timeout)
        exc = self._exception
        if exc is not None:
            try:
                raise exc
            finally:  # no cycle through this frame (Future.__get_result does the same)
                exc = None
                self = None  # type: ignore[assignment]
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception (``None`` if it returned), waiting as :meth:`result` does."""
        self._wait_finished(timeout)
        return self._exception


class BatchFuture(LightFuture):
    """A ``concurrent.futures.Future`` of a batch's arrays, with its bookkeeping.

    Attributes:
        sample_ids: the ids the batch holds, when its source knows them (a skipped sample is
            replaced: ``engine._source``); ``None`` means "the order's ids".
        bad: the failing samples the batch skipped (``engine._source.FoundBad``), in batch
            order; not yet charged to any bad-sample budget: the in-order consumer charges
            them when it delivers the batch (``BatchSource.charge``). Empty for most batches.
        tasks: the pool tasks computing it, for ``promote`` and for cancelling what has not
            started (emptied when it completes, which breaks the task -> future -> task cycle).
        group_tasks: the tasks computing the sharing group's batch this one delivers, for
            ``promote`` only: one member must not cancel work that the other members still
            read (a cancelled group batch failed their streams with ``CancelledError``). A
            group batch that every member gave up on is still decoded (at most the members'
            read-ahead, once): "no holder" does not mean "nobody waits for it" (a member that
            re-attaches leaves batches its stream still waits for).
        decoded_here: ``False`` when another stream of a sharing group decoded it.
        shared_ref: the group buffer holding it when delivered by reference, else ``None``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sample_ids: NDArray[np.uint64] | None = None
        self.bad: Sequence[Any] = ()
        self.tasks: list[Task] = []
        self.group_tasks: list[Task] = []
        self.decoded_here = True
        self.shared_ref: Releasable | None = None


def ids_or(fut: Future[Any], order_ids: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The ids batch ``fut`` holds: its ``sample_ids`` if it is a :class:`BatchFuture` that has
    them, else ``order_ids`` (the order's ids, e.g. for a plain future from a test's fake)."""
    ids = fut.sample_ids if isinstance(fut, BatchFuture) else None
    return order_ids if ids is None else ids
