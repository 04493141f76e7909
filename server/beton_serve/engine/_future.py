"""The future of one batch, with what its consumer needs to know declared as attributes.

A batch's future used to carry ad-hoc attributes set by whoever made it (``sample_ids``,
``tasks``, ``decoded_here``, ``shared_ref``), and the daemon probed for them with ``getattr``.
:class:`BatchFuture` declares them once, with their defaults, so every producer of batch futures
(the worker pool, ``BatchSource``, ``SharedSource``) returns the same type and every consumer
reads the attributes directly.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from beton_serve.engine._pool import Task

__all__ = ["BatchFuture", "Releasable", "SourceCaps", "ids_or"]


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
        look_ahead: batches of the next epoch may be decoded before the client starts it (not
            under a bad-sample budget, which is spent in decode order).
    """

    by_reference: bool = False
    look_ahead: bool = True


class BatchFuture(Future[Any]):
    """A ``concurrent.futures.Future`` of a batch's arrays, with its bookkeeping.

    Attributes:
        sample_ids: the ids the batch holds, when its source knows them (a skipped sample is
            replaced: ``engine._source``); ``None`` means "the order's ids".
        tasks: the pool tasks computing it, for ``promote`` (emptied when it completes, which
            breaks the task -> future -> task cycle).
        decoded_here: ``False`` when another stream of a sharing group decoded it.
        shared_ref: the group buffer holding it when delivered by reference, else ``None``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sample_ids: NDArray[np.uint64] | None = None
        self.tasks: list[Task] = []
        self.decoded_here = True
        self.shared_ref: Releasable | None = None


def ids_or(fut: Future[Any], order_ids: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The ids batch ``fut`` holds: its ``sample_ids`` if it is a :class:`BatchFuture` that has
    them, else ``order_ids`` (the order's ids, e.g. for a plain future from a test's fake)."""
    ids = fut.sample_ids if isinstance(fut, BatchFuture) else None
    return order_ids if ids is None else ids
