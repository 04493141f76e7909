"""A new stream's source: its order parameters, and its sharing group.

:func:`source_params` turns an accepted request into the parameters of the engine's view of the
stream's batches (``BatchSource``, made by the backend): the order, the in-flight bound (the ring
size), how many slices a waited-for batch is split into, the bad-sample budget and the file
check the workers run before reading. With sharing on (``beton_serve.engine.sharing``),
:func:`shared` puts the source in the group of identical streams (same dataset, pipeline, seed,
order, batch size, ``drop_last`` and split), so that each batch is decoded once; an shm stream's
group decodes into a sharing arena (``transport.arena``), which makes the sharing zero-copy.

Arenas are made by the group when it needs one; :class:`ArenaBook` keeps every arena not yet
unlinked, so that the daemon's close unlinks those still held. Event-loop thread only (the
engine's sharing code calls ``make`` from ``SharedSource.submit``, on that thread too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from beton_wire.slots import SlotLayout

from beton_serve.daemon._backend import BatchSourceLike, SourceParams
from beton_serve.daemon._datasets import Dataset
from beton_serve.daemon._messages import StreamRequest
from beton_serve.transport.shm import ShmNamer

if TYPE_CHECKING:
    from beton_serve.engine.shared_source import Produced
    from beton_serve.engine.sharing import SharingRegistry
    from beton_serve.transport.arena import ShmArena

__all__ = ["ArenaBook", "shared", "sharing_registry", "source_params"]


def sharing_registry(max_lag: int, retain: int) -> SharingRegistry[Produced]:
    """The daemon's registry of sharing groups (``--share-max-lag``, ``--share-retain``)."""
    from beton_serve.engine.sharing import SharingRegistry

    return SharingRegistry(max_lag=max_lag, retain=retain)


class ArenaBook:
    """The sharing arenas a daemon made and has not unlinked yet (see the module docstring)."""

    def __init__(self) -> None:
        self._arenas: list[ShmArena] = []

    def maker(
        self,
        namer: ShmNamer,
        layout: SlotLayout,
        count: int,
        admit: Callable[[int], None] | None = None,
    ) -> Callable[[], ShmArena]:
        """``make() -> ShmArena`` of ``count`` buffers of ``layout``, named by ``namer``.

        ``admit(nbytes)`` runs first and may refuse the arena by raising a ``BetonError`` (the
        daemon's ``max_ring_bytes``); the group then shares by copying.
        """
        from beton_serve.transport.arena import ShmArena

        def make() -> ShmArena:
            if admit is not None:
                admit(layout.slot_bytes * count)
            arena = ShmArena(layout, count, namer.next("share"))
            self._arenas = [a for a in self._arenas if not a.unlinked]
            self._arenas.append(arena)
            return arena

        return make

    def nbytes(self) -> int:
        """Bytes of the arenas not yet unlinked (counted against ``max_ring_bytes``)."""
        return sum(a.size for a in list(self._arenas) if not a.unlinked)

    def close(self) -> None:
        """Unlink every arena (every stream is gone: nothing may still read them)."""
        for arena in self._arenas:
            arena.force_close()
        self._arenas = []


def source_params(
    req: StreamRequest, ds: Dataset, *, slots: int, workers: int, bad_sample_budget: int
) -> SourceParams:
    """The source's parameters for ``req`` over ``ds`` with a ring of ``slots``."""
    return SourceParams(
        order=req.order,
        batch_size=req.batch_size,
        seed=req.seed,
        indices=None if req.indices is None else np.asarray(req.indices, dtype=np.uint64),
        drop_last=req.drop_last,
        distributed=req.distributed,
        rank=req.rank,
        world_size=req.world_size,
        batches_ahead=slots,
        # A batch split over the workers arrives sooner; with many streams the pool is busy
        # anyway and the split costs little (BatchSource splits only sliceable plans).
        slices=workers,
        bad_sample_budget=bad_sample_budget,
        pre_run=ds.check_files,  # workers re-check the files right before reading
    )


def shared(
    source: BatchSourceLike,
    registry: SharingRegistry[Produced],
    spec_key: str,
    req: StreamRequest,
    dataset: str,
    make_arena: Callable[[], ShmArena] | None = None,
    *,
    bad_sample_budget: int = 0,
) -> BatchSourceLike:
    """Wrap a stream's source so that identical streams decode each batch once (issue 6);
    ``make_arena`` (shm streams) makes the sharing zero-copy. Streams share only with streams
    of the same ``bad_sample_budget`` (``ShareKey``)."""
    from beton_serve.engine.shared_source import SharedSource
    from beton_serve.engine.sharing import ShareKey

    key = ShareKey.build(
        dataset=dataset,
        pipeline=spec_key,
        seed=req.seed,
        order=req.order,
        batch_size=req.batch_size,
        drop_last=req.drop_last,
        distributed=req.distributed,
        rank=req.rank,
        world_size=req.world_size,
        indices=req.indices,
        bad_sample_budget=bad_sample_budget,
    )
    return SharedSource(source, registry, key, make_arena=make_arena)
