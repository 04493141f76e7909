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
- When the group batch is done, it is copied into ``out`` (the stream's slot), the group batch
  is released, and the returned future completes. The copy is a memcpy (about 6 ms for a
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

Threads. ``submit``, ``promote`` and ``close`` are called by the stream's owner (the daemon's
event-loop thread). The copy into ``out`` runs in the done-callback of the group batch: on the
engine worker that finished it, or in ``submit`` itself when the batch was already done.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from beton_serve.engine.sharing import Consumer, ShareKey, SharingRegistry
from beton_serve.errors import BetonError

__all__ = ["Produced", "SharedSource"]


@dataclass(slots=True)
class Produced:
    """A group batch: the future of its arrays, the pooled buffers it is written into, and the
    :class:`SharedSource` whose stream decoded it."""

    future: Future[list[np.ndarray]]
    buffers: list[np.ndarray] | None
    owner: SharedSource


class SharedSource:
    """Wrap one stream's ``BatchSource`` so that identical streams decode each batch once.

    Args:
        source: the stream's own ``BatchSource`` (``submit``, ``batch_ids``, ``len``, and
            optionally ``promote``, ``plan.outputs`` and ``batch_size``, which size the pool).
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
    ) -> None:
        self.source = source
        self.registry = registry
        self.key = key
        self._pool_size = int(pool_size)
        self._timeout = timeout
        self._consumer: Consumer[Produced] | None = None
        self._priority = 1
        self._lock = threading.Lock()
        self._pool: list[list[np.ndarray]] = []
        self._closed = False
        registry.add_member(key)
        plan = getattr(source, "plan", None)
        outputs = getattr(plan, "outputs", None)
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
        self, epoch: int, b: int, out: list[np.ndarray] | None = None, priority: int = 1
    ) -> Future[list[np.ndarray]]:
        """Deliver batch ``(epoch, b)`` into ``out`` (``None``: new arrays).

        Returns:
            A future of ``[out[i][:n] ...]``, with ``decoded_here`` (see the module docstring)
            and ``tasks`` (for :meth:`promote`) attributes. It is already running and cannot
            be cancelled: the copy into ``out`` always completes (as with ``BatchSource``).

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
            return self.source.submit(epoch, b, out, priority=priority)  # type: ignore[no-any-return]
        consumer = self._consumer_at(epoch, b)
        self._priority = priority
        batch = consumer.next(timeout=self._timeout)
        if batch is None:  # cannot happen: consumers here have no stop
            raise BetonError(f"no batch ({epoch}, {b}) from the sharing group")
        produced = batch.handle
        decoded_here = produced.owner is self
        result: Future[list[np.ndarray]] = Future()
        result.set_running_or_notify_cancel()
        result.decoded_here = decoded_here  # type: ignore[attr-defined]
        result.tasks = getattr(produced.future, "tasks", ())  # type: ignore[attr-defined]

        def deliver(f: Future[list[np.ndarray]]) -> None:
            views: list[np.ndarray] = []
            error: BaseException | None = None
            try:
                arrays = f.result()
                dst = out if out is not None else [np.empty_like(a) for a in arrays]
                for d, a in zip(dst, arrays, strict=True):
                    view = d[: len(a)]
                    np.copyto(view, a)
                    views.append(view)
            except BaseException as exc:
                error = exc
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

    def promote(self, fut: Future[Any]) -> None:
        """Move the decode behind ``fut`` ahead of prefetch work (its consumer is waiting)."""
        promote = getattr(self.source, "promote", None)
        if promote is not None:
            promote(fut)

    def close(self) -> None:
        """Leave the sharing group and release what this stream holds. Idempotent."""
        if not self._closed:
            self.registry.remove_member(self.key)
        self._closed = True
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

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
        return [np.empty(shape, dtype) for shape, dtype in self._shapes]

    def _produce(self, epoch: int, b: int) -> Produced:
        buffers = self._take_buffers()
        fut = self.source.submit(epoch, b, buffers, priority=self._priority)
        return Produced(fut, buffers, self)

    def _free(self, produced: Produced) -> None:
        buffers = produced.buffers
        if buffers is None:
            return

        def recycle(_f: Future[Any], buffers: Sequence[np.ndarray] = buffers) -> None:
            # Only once the decode has finished writing into them.
            with self._lock:
                if len(self._pool) < self._pool_size and not self._closed:
                    self._pool.append(list(buffers))

        produced.future.add_done_callback(recycle)
