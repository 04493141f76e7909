"""Work sharing between identical streams (DESIGN.md §5.4).

Streams that would produce exactly the same batches (same dataset, pipeline spec, seed, order,
batch size, ``drop_last``, distributed split and index subset: a :class:`ShareKey`) attach to one
:class:`SharedProducer`. Each batch is produced once into a slot; every attached consumer reads
that slot; the slot is freed when the last consumer that needs it releases it.

Data structure. A stream's batches form one line of *positions*, ``pos = epoch * B + index``
with ``B`` batches per epoch (the same for every member, since the key fixes it). The producer
keeps a table of *live entries*, ``pos -> (slot handle, holders)``, where ``holders`` is the set
of attached consumers that still have to take or release that batch. Each consumer has a
position (the next batch it will take) and an optional exclusive ``stop``.

- ``Consumer.next()`` at position ``p``: if ``p`` is live, take it; otherwise this consumer
  produces it by calling ``produce(epoch, index)``, and the entry's holders are every attached
  consumer whose range covers ``p``. The consumer that first reaches a batch produces it: production
  is pulled by the fastest consumer's credits; nobody waits for anybody.
- ``Consumer.release(batch)`` drops the consumer from the entry's holders; when none are left
  ``free(handle)`` is called, exactly once per produced batch.
- **Detaching.** After every ``next()``, any attached consumer more than ``max_lag`` batches
  behind the leader is detached. Lag is measured on each consumer's *progress*: its position
  less its read-ahead (``ahead``, a stream's credits), but not before its start, so prefetching
  does not count as being ahead. A detached consumer leaves the holders of every batch it has
  not taken yet (freeing those nobody else needs) and continues on a *private* stream from its
  exact position, calling its own ``produce``/``free``. Batches it took before being detached
  stay valid until it releases them. So the group's live entries are bounded by ``max_lag + 1``
  plus the leader's read-ahead, plus what consumers have taken and not released, plus
  ``retain``; and the fast consumers never wait for the slow one.
- **Late joiners** share from their own position ``p`` when it is within ``max_lag`` of every
  attached consumer's progress (``leader - max_lag <= p <= slowest + max_lag``), i.e. when
  joining detaches nobody. Batches in ``[p, leader)`` that the group has already freed are
  produced again for the joiner (and for anyone else still needing them), which costs extra
  decodes but keeps every stream's order exact; ``retain`` keeps the last few unneeded batches
  so that streams starting a little later (N jobs launched together) still share them. A joiner
  outside that window gets a private stream from its own position: it neither stalls the group
  nor drags it forward.

Callables and threads. ``produce(epoch, index) -> handle`` and ``free(handle)`` are supplied by
the owner, per consumer (the consumer that produces a batch is the one whose ``produce`` runs,
and its ``free`` frees it). :class:`~beton_serve.engine.shared_source.SharedSource` is the
daemon's: produce submits the batch to that stream's own ``BatchSource`` into a group buffer,
free recycles the buffer. The handle must be readable by every consumer. Both are called
*without* the producer's lock held, from the thread calling ``next()``/``release()``/``close()``,
so they may block (e.g. waiting for a free slot) without deadlocking releases on other threads.
``produce`` should only *start* the work; readiness is the handle's business. A consumer asking
for a batch another thread is still inside ``produce`` for waits (bounded by ``timeout``) for that
call to return. Everything here is thread-safe; with a single-threaded asyncio caller nothing ever
waits.

Failures. If ``produce`` raises, the exception propagates from ``next()`` of every consumer that
reaches that batch while the failed entry is live; their positions do not advance, and once no
holder is left the entry is dropped, so a later ``next()`` retries.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from beton_serve.engine._sharing_group import (
    BatchTimeoutError,
    Consumer,
    SharedBatch,
    SharedProducer,
    SharingStats,
)
from beton_serve.errors import SpecError

__all__ = [
    "BatchTimeoutError",
    "Consumer",
    "ShareKey",
    "SharedBatch",
    "SharedProducer",
    "SharingRegistry",
    "SharingStats",
]

S = TypeVar("S")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareKey:
    """What makes two streams identical, so that they may share batches.

    Build it with :meth:`build`, which canonicalises the pipeline spec and digests the indices.

    Attributes:
        dataset: the dataset name.
        pipeline: the pipeline spec as canonical JSON (sorted keys, no spaces).
        seed: the resolved seed (a stream opened without a seed gets a fresh one from the daemon,
            so it never matches another).
        order: the order's name (``"RANDOM"``, ``"SEQUENTIAL"``, ``"QUASI_RANDOM"``).
        batch_size: samples per batch.
        drop_last: whether the last partial batch is dropped.
        distributed: whether the stream reads one rank's split.
        rank: the rank (0 when not distributed).
        world_size: the world size (1 when not distributed).
        indices: a SHA-256 hex digest of the index subset as int64, or ``""`` for all samples.
        bad_sample_budget: the streams' bad-sample budget. A group's batches are decoded under
            the budget of the member that produces each one, and budget 0 fails a batch with a
            bad sample in the worker, for every member: streams with different budgets (a
            daemon's budget reloaded between their opens) must not share.
    """

    dataset: str
    pipeline: str
    seed: int
    order: str
    batch_size: int
    drop_last: bool
    distributed: bool
    rank: int
    world_size: int
    indices: str = ""
    bad_sample_budget: int = 0

    @classmethod
    def build(
        cls,
        *,
        dataset: str,
        pipeline: Mapping[str, Any] | str,
        seed: int,
        order: str,
        batch_size: int,
        drop_last: bool,
        distributed: bool = False,
        rank: int = 0,
        world_size: int = 1,
        indices: Iterable[int] | np.ndarray | None = None,
        bad_sample_budget: int = 0,
    ) -> ShareKey:
        """Build a key; equal keys mean bit-identical batch streams.

        Args:
            pipeline: the JSON-safe spec (``{field: [{"op": name, "params": {...}}, ...]}``), or a
                string already in canonical form.
            indices: the stream's index subset, or ``None`` for every sample.

        Raises:
            SpecError: the pipeline is not JSON-serialisable.
        """
        if isinstance(pipeline, str):
            canon = pipeline
        else:
            try:
                canon = json.dumps(pipeline, sort_keys=True, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise SpecError(f"pipeline spec must be JSON-safe to share work: {exc}") from None
        digest = ""
        if indices is not None:
            arr = np.ascontiguousarray(np.asarray(indices, dtype=np.int64))
            digest = hashlib.sha256(arr.tobytes()).hexdigest()
        if not distributed:
            rank, world_size = 0, 1
        return cls(
            dataset=dataset,
            pipeline=canon,
            seed=int(seed),
            order=str(order),
            batch_size=int(batch_size),
            drop_last=bool(drop_last),
            distributed=bool(distributed),
            rank=int(rank),
            world_size=int(world_size),
            indices=digest,
            bad_sample_budget=int(bad_sample_budget),
        )


class SharingRegistry(Generic[S]):
    """The daemon's table of sharing groups, one :class:`SharedProducer` per :class:`ShareKey`.

    A group is created by the first :meth:`attach` for its key (its ``produce``/``free`` are the
    defaults of consumers that bring none) and dropped when its last consumer closes; a later
    attach for the key starts a fresh group.

    It also counts *members* per key (:meth:`add_member`/:meth:`remove_member`): the open streams
    that could share, whether attached yet or not. A stream alone with its key can skip the group
    entirely (``SharedSource`` then decodes straight into its own slots, at no cost).

    Args:
        max_lag: see :class:`SharedProducer`.
        retain: see :class:`SharedProducer`.
    """

    def __init__(self, *, max_lag: int, retain: int = 0) -> None:
        if max_lag < 0:
            raise SpecError(f"max_lag must be >= 0 batches, got {max_lag}")
        if retain < 0:
            raise SpecError(f"retain must be >= 0 batches, got {retain}")
        self.max_lag = int(max_lag)
        self.retain = int(retain)
        self._lock = threading.Lock()
        self._groups: dict[ShareKey, SharedProducer[S]] = {}
        self._members: dict[ShareKey, int] = {}

    def add_member(self, key: ShareKey) -> None:
        """Count one more open stream with ``key``."""
        with self._lock:
            self._members[key] = self._members.get(key, 0) + 1

    def remove_member(self, key: ShareKey) -> None:
        """Count one open stream with ``key`` fewer (call once per :meth:`add_member`)."""
        with self._lock:
            n = self._members.get(key, 0) - 1
            if n > 0:
                self._members[key] = n
            else:
                self._members.pop(key, None)

    def members(self, key: ShareKey) -> int:
        """Open streams with ``key``."""
        with self._lock:
            return self._members.get(key, 0)

    def attach(
        self,
        key: ShareKey,
        *,
        produce: Callable[[int, int], S],
        free: Callable[[S], None],
        batches_per_epoch: int,
        epoch: int = 0,
        index: int = 0,
        stop: tuple[int, int] | None = None,
        ahead: int = 0,
    ) -> Consumer[S]:
        """Attach a stream to its key's group (creating it if needed); ``ahead`` as in
        :meth:`SharedProducer.attach`.

        Raises:
            SpecError: bad positions, or ``batches_per_epoch`` differs from the group's (a key
                that does not capture everything that shapes the stream).
        """
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = SharedProducer(
                    produce,
                    free,
                    batches_per_epoch=batches_per_epoch,
                    max_lag=self.max_lag,
                    retain=self.retain,
                    on_empty=lambda g, k=key: self._drop(k, g),  # type: ignore[misc]
                )
                self._groups[key] = group
            elif group.batches_per_epoch != batches_per_epoch:
                raise SpecError(
                    f"stream has {batches_per_epoch} batches per epoch but its sharing group "
                    f"has {group.batches_per_epoch}; the share key misses a setting"
                )
            return group.attach(epoch, index, stop=stop, produce=produce, free=free, ahead=ahead)

    def _drop(self, key: ShareKey, group: SharedProducer[S]) -> None:
        with self._lock:
            if self._groups.get(key) is not group:
                return
            with group._cond:
                if group._consumers:
                    return  # someone attached after it emptied
                group._closed = True
            del self._groups[key]

    def groups(self) -> dict[ShareKey, SharingStats]:
        """Stats of every live group."""
        with self._lock:
            items = list(self._groups.items())
        return {k: g.stats() for k, g in items}
