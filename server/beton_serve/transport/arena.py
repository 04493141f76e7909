"""Shared-memory buffers for batches that several streams read (issue 6, zero-copy sharing).

When identical streams share decoding (:mod:`beton_serve.engine.shared_source`), each batch is
decoded once into a *group buffer*. An :class:`ShmArena` puts those buffers in one POSIX
shared-memory segment, ``/dev/shm/beton-<pid>-<instance>-share-<n>`` (mode 0600), laid out like a ring's
slots (:func:`beton_wire.slots.slot_layout`). A stream on the notice channel then publishes a
*reference* to the group buffer (segment name and offset) instead of copying the batch into its
own slot, and its client maps the segment once and reads the batch in place: N clients of one
batch cost one decode and no copies.

Ownership: the arena belongs to the stream whose source produced into it. A buffer is taken by
that producer (:meth:`take`) and given back (:meth:`give`) when the sharing group frees the batch,
i.e. after every stream that read it was released by its client. A buffer published to a client
by reference is also *pinned* (:meth:`pin`) until that client releases it (:meth:`unpin`): a
:meth:`give` while it is pinned is deferred to the last unpin, so a buffer is never reused while
a client may still read it, whatever happens to the sharing group's bookkeeping meanwhile (a
consumer re-attached or closed, a laggard detached; issue 11 §4). Closing the arena (its stream
ended) only marks it; the segment is unlinked once every buffer is back, so a segment is never
unlinked while a client may still have to open it. :meth:`force_close` (the daemon shutting down)
unlinks at once. A daemon killed before either is swept at the next start (``shm.sweep_stale_segments``).

Threads: ``take``/``give``/``close`` may be called from engine workers and the event loop; a lock
guards the free list.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import numpy as np
from beton_wire.slots import SlotLayout

from beton_serve.errors import TransportError
from beton_serve.transport.base import slot_views
from beton_serve.transport.shm import (
    SHM_DIR,
    create_segment,
    guard_segment,
    release_mapping,
    truncation_error,
)

__all__ = ["ShmArena"]


class ShmArena:
    """``count`` batch buffers of ``layout`` in one shared-memory segment (see the module).

    Raises:
        TransportError: the segment cannot be created or allocated.
    """

    def __init__(self, layout: SlotLayout, count: int, name: str, shm_dir: Path = SHM_DIR) -> None:
        if count < 1:
            raise TransportError(f"an arena needs at least one buffer, not {count}")
        self.layout = layout
        self.count = count
        self.name = name
        self.path = shm_dir / name
        self.size = layout.slot_bytes * count
        self._mmap: mmap.mmap | None = create_segment(self.path, self.size)
        base = np.frombuffer(self._mmap, dtype=np.uint8)
        self._region = guard_segment(self._mmap, base)  # truncation: see transport.shm
        self._views = [slot_views(base, layout, i) for i in range(count)]
        self._free = list(range(count - 1, -1, -1))
        self._lock = threading.Lock()
        self._closing = False
        self._unlinked = False
        self._pins: dict[int, int] = {}  # index -> references published and not released
        self._deferred: set[int] = set()  # given back while pinned: freed at the last unpin

    def take(self) -> tuple[int, list[np.ndarray]] | None:
        """A free buffer as ``(index, views)``; ``None`` when all are in use or it is closing."""
        with self._lock:
            if self._closing or not self._free:
                return None
            i = self._free.pop()
            return i, self._views[i]

    def give(self, index: int) -> None:
        """Return buffer ``index``; the last one back after :meth:`close` unlinks the segment."""
        with self._lock:
            if self._unlinked or index in self._free:
                return
            if self._pins.get(index):
                self._deferred.add(index)
                return
            self._free.append(index)
            done = self._closing and len(self._free) == self.count
        if done:
            self._unlink()

    def pin(self, index: int) -> None:
        """A client was handed buffer ``index`` by reference: keep it until :meth:`unpin`."""
        with self._lock:
            self._pins[index] = self._pins.get(index, 0) + 1

    def unpin(self, index: int) -> None:
        """That client released it; a :meth:`give` deferred meanwhile happens now."""
        with self._lock:
            left = self._pins.get(index, 0) - 1
            if left > 0:
                self._pins[index] = left
                return
            self._pins.pop(index, None)
            deferred = index in self._deferred
            self._deferred.discard(index)
        if deferred:
            self.give(index)

    def offset(self, index: int) -> int:
        """Byte offset of buffer ``index`` in the segment (what a client is told)."""
        return self.layout.slot_offset(index)

    def in_use(self) -> int:
        """Buffers taken and not given back."""
        with self._lock:
            return self.count - len(self._free)

    def close(self) -> None:
        """No more :meth:`take`; unlink once every buffer is back (now, if none is out)."""
        with self._lock:
            self._closing = True
            done = len(self._free) == self.count
        if done:
            self._unlink()

    def force_close(self) -> None:
        """Unlink now, whatever is still out (the daemon is shutting down)."""
        with self._lock:
            self._closing = True
        self._unlink()

    @property
    def unlinked(self) -> bool:
        """Whether the segment is gone."""
        return self._unlinked

    def _unlink(self) -> None:
        with self._lock:
            if self._unlinked:
                return
            self._unlinked = True
        self.path.unlink(missing_ok=True)
        self._views = []
        m, self._mmap = self._mmap, None  # views still held go with their last reference
        if release_mapping(m, self.name) and self._region is not None:
            self._region.close()  # else with the mapping's last view (guard's finalizer)

    def damaged(self) -> TransportError | None:
        """Why the segment's contents cannot be trusted (another process truncated it), or
        ``None``."""
        return truncation_error(self._region, self.name)
